//! The operator operations ([`Admin`]) of the MySQL store: indexed listing,
//! exact counts, migrations with a dry run, and a check of the server's
//! settings the library relies on.

use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::admin::{
    prefix_upper_bound, Admin, Check, DoctorOptions, ListFilter, Listing, Stats,
};
use idempotency_core::decision::skew_cutoff;
use idempotency_core::{Clock, Error, Status, SystemClock, Timestamp};
use sqlx::Row;

use crate::error::map_sqlx;
use crate::ops::{decode, ts, COLUMNS};
use crate::MySqlRepository;

impl MySqlRepository {
    fn map(&self) -> impl Fn(sqlx::Error) -> Error + '_ {
        |e| map_sqlx(e, "admin", None, self.table())
    }

    async fn expired(&self, now: Timestamp) -> Result<u64, Error> {
        sqlx::query_scalar(&format!(
            "SELECT CAST(COUNT(*) AS UNSIGNED) FROM `{}` WHERE expires_at <= ?",
            self.table()
        ))
        .bind(ts(now))
        .fetch_one(self.pool())
        .await
        .map_err(self.map())
    }

    async fn variable(&self, name: &str) -> Result<Option<String>, Error> {
        let row = sqlx::query(&format!("SHOW VARIABLES LIKE '{name}'"))
            .fetch_optional(self.pool())
            .await
            .map_err(self.map())?;
        // SHOW VARIABLES answers in the connection's character set; read bytes.
        Ok(row
            .map(|r| r.try_get::<Vec<u8>, _>(1))
            .transpose()
            .map_err(self.map())?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    async fn durability_check(&self) -> Result<Check, Error> {
        let flush = self
            .variable("innodb_flush_log_at_trx_commit")
            .await?
            .unwrap_or_default();
        Ok(if flush == "1" {
            Check::pass(
                "innodb_flush_log_at_trx_commit",
                "1: a reservation is on disk before the server answers",
            )
        } else {
            Check::warn(
                "innodb_flush_log_at_trx_commit",
                format!(
                    "{flush}: a crash of the server (not a clean restart) loses up to a second \
                     of commits, and a key whose record is lost runs its handler again"
                ),
                "SET GLOBAL innodb_flush_log_at_trx_commit = 1 (and in the server's \
                 configuration), unless that window is acceptable",
            )
        })
    }

    async fn read_only_check(&self) -> Result<Check, Error> {
        let read_only = self.variable("read_only").await?.unwrap_or_default();
        Ok(
            if read_only.eq_ignore_ascii_case("ON") || read_only == "1" {
                Check::fail(
                    "read_only",
                    "the server refuses writes (a replica, or a primary demoted in a failover): \
                 every reservation fails",
                    "point the URL at the primary",
                )
            } else {
                Check::pass("read_only", "the server accepts writes")
            },
        )
    }

    async fn clock_check(&self, options: &DoctorOptions) -> Result<Check, Error> {
        let before = SystemClock.now();
        let server: i64 =
            sqlx::query_scalar("SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)")
                .fetch_one(self.pool())
                .await
                .map_err(self.map())?;
        let after = SystemClock.now();
        let server = Timestamp::from_millis(u64::try_from(server).unwrap_or(0));
        Ok(Check::clock_offset(
            server,
            before,
            after,
            options.clock_skew,
        ))
    }
}

#[async_trait]
impl Admin for MySqlRepository {
    /// In key order, through the primary key (a range of namespaces).
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        let prefix = filter.namespace_prefix.as_deref().unwrap_or("").as_bytes();
        let sql = format!(
            "SELECT {COLUMNS}, namespace, id FROM `{}` \
             WHERE expires_at > ? AND namespace >= ? AND (? IS NULL OR namespace < ?) \
             AND (? IS NULL OR status = ?) \
             AND (? = 0 OR (status = 'processing' AND lease_until <= ?)) \
             ORDER BY namespace, id LIMIT ?",
            self.table()
        );
        let upper = prefix_upper_bound(prefix);
        let status = filter.status.map(Status::as_str);
        let rows = sqlx::query(&sql)
            .bind(ts(now))
            .bind(prefix)
            .bind(upper.clone())
            .bind(upper)
            .bind(status)
            .bind(status)
            .bind(filter.stuck)
            .bind(ts(filter.stuck_cutoff(now)))
            .bind(u64::try_from(filter.limit.saturating_add(1)).unwrap_or(u64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(self.map())?;
        let key_of = |row: &_| -> Result<(Vec<u8>, Vec<u8>), Error> {
            Ok((
                sqlx::Row::try_get(row, 11).map_err(self.map())?,
                sqlx::Row::try_get(row, 12).map_err(self.map())?,
            ))
        };
        Listing::from_rows(&rows, filter.limit, key_of, decode)
    }

    /// Exact counts, by one `GROUP BY` scan of the table.
    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        let rows = sqlx::query(&format!(
            "SELECT namespace, CAST(status AS BINARY), \
             CAST(status = 'processing' AND lease_until <= ? AS SIGNED), \
             CAST(COUNT(*) AS UNSIGNED) FROM `{}` WHERE expires_at > ? GROUP BY 1, 2, 3",
            self.table()
        ))
        .bind(ts(skew_cutoff(now, clock_skew)))
        .bind(ts(now))
        .fetch_all(self.pool())
        .await
        .map_err(self.map())?;
        let mut stats = Stats::default();
        for row in &rows {
            let namespace: Vec<u8> = row.try_get(0).map_err(self.map())?;
            let status: Vec<u8> = row.try_get(1).map_err(self.map())?;
            let stuck: i64 = row.try_get(2).map_err(self.map())?;
            let n: u64 = row.try_get(3).map_err(self.map())?;
            let status = std::str::from_utf8(&status).ok().and_then(Status::parse);
            if let Some(status) = status {
                stats.add(&String::from_utf8_lossy(&namespace), status, stuck != 0, n);
            }
        }
        stats.expired = self.expired(now).await?;
        Ok(stats)
    }

    async fn migrate(&self, dry_run: bool) -> Result<Vec<String>, Error> {
        let pending = crate::migrate::pending(self.pool(), self.table()).await?;
        if !dry_run && !pending.is_empty() {
            MySqlRepository::migrate(self).await?;
        }
        Ok(pending)
    }

    async fn doctor(&self, options: &DoctorOptions) -> Result<Vec<Check>, Error> {
        let (at, latest) = self.schema_version().await?;
        let mut checks = vec![
            Check::schema_version(u64::from(at), u64::from(latest)),
            self.read_only_check().await?,
            self.durability_check().await?,
            self.clock_check(options).await?,
        ];
        if at > 0 {
            checks.push(Check::purge_backlog(self.expired(SystemClock.now()).await?));
        }
        Ok(checks)
    }
}
