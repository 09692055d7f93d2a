//! The operator operations ([`Admin`]) of the PostgreSQL store: indexed
//! listing, exact counts, migrations with a dry run, and a check of the
//! server's settings the library relies on.

use async_trait::async_trait;
use idempotency_core::admin::{
    prefix_upper_bound, Admin, Check, DoctorOptions, ListFilter, Listing, Stats,
};
use idempotency_core::{Clock, Error, Status, SystemClock, Timestamp};
use sqlx::Row;

use crate::error::map_sqlx;
use crate::names::RECORD_COLUMNS;
use crate::ops::{decode_record, ts};
use crate::PgRepository;

impl PgRepository {
    fn map(&self) -> impl Fn(sqlx::Error) -> Error + '_ {
        |e| map_sqlx(e, "admin", None, &self.statements().qualified)
    }

    async fn expired(&self, now: Timestamp) -> Result<u64, Error> {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE expires_at <= $1",
            self.statements().qualified
        ))
        .bind(ts(now))
        .fetch_one(self.pool())
        .await
        .map_err(self.map())?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn setting(&self, name: &str) -> Result<String, Error> {
        sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(self.pool())
            .await
            .map_err(self.map())
    }

    async fn index_check(&self) -> Result<Check, Error> {
        let names = self.statements();
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 \
             AND indexdef LIKE '%(expires_at)%'",
        )
        .bind(&names.schema)
        .bind(&names.table)
        .fetch_one(self.pool())
        .await
        .map_err(self.map())?;
        Ok(if n > 0 {
            Check::pass(
                "expires_at index",
                "present: purges find expired rows by index",
            )
        } else {
            Check::warn(
                "expires_at index",
                "missing: every purge scans the whole table",
                "run `idempotency migrate` (it creates the index)",
            )
        })
    }

    async fn lock_timeout_check(&self) -> Result<Check, Error> {
        let lock = self.setting("lock_timeout").await?;
        let statement = self.setting("statement_timeout").await?;
        let detail = format!("lock_timeout {lock}, statement_timeout {statement}");
        Ok(if lock == "0" && statement == "0" {
            Check::warn(
                "lock_timeout",
                format!(
                    "{detail}: a statement the client's operation_timeout abandoned behind a \
                     row lock keeps its connection until the lock is free"
                ),
                "ALTER ROLE … SET lock_timeout = '5s' (not statement_timeout, which would also \
                 cut a transactional handler's own statements)",
            )
        } else {
            Check::pass(
                "lock_timeout",
                format!("{detail}: a server-side timeout is a retryable Timeout"),
            )
        })
    }

    async fn clock_check(&self, options: &DoctorOptions) -> Result<Check, Error> {
        let before = SystemClock.now();
        let server: i64 =
            sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
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
impl Admin for PgRepository {
    /// In key order, through the primary key (a range of namespaces).
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        let prefix = filter.namespace_prefix.as_deref().unwrap_or("").as_bytes();
        let sql = format!(
            "SELECT {RECORD_COLUMNS}, namespace, id FROM {} \
             WHERE expires_at > $1 AND namespace >= $2 AND ($3::bytea IS NULL OR namespace < $3) \
             AND ($4::text IS NULL OR status = $4) \
             AND (NOT $5 OR (status = 'processing' AND lease_until <= $1)) \
             ORDER BY namespace, id LIMIT $6",
            self.statements().qualified
        );
        let rows = sqlx::query(&sql)
            .bind(ts(now))
            .bind(prefix)
            .bind(prefix_upper_bound(prefix))
            .bind(filter.status.map(Status::as_str))
            .bind(filter.stuck)
            .bind(i64::try_from(filter.limit.saturating_add(1)).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(self.map())?;
        let key_of = |row: &_| -> Result<(Vec<u8>, Vec<u8>), Error> {
            Ok((
                sqlx::Row::try_get(row, 11).map_err(self.map())?,
                sqlx::Row::try_get(row, 12).map_err(self.map())?,
            ))
        };
        Listing::from_rows(&rows, filter.limit, key_of, |row, key| {
            decode_record(row, 0, key)
        })
    }

    /// Exact counts, by one `GROUP BY` scan of the table.
    async fn stats(&self, now: Timestamp) -> Result<Stats, Error> {
        let rows = sqlx::query(&format!(
            "SELECT namespace, status, status = 'processing' AND lease_until <= $1, count(*) \
             FROM {} WHERE expires_at > $1 GROUP BY 1, 2, 3",
            self.statements().qualified
        ))
        .bind(ts(now))
        .fetch_all(self.pool())
        .await
        .map_err(self.map())?;
        let mut stats = Stats::default();
        for row in &rows {
            let namespace: Vec<u8> = row.try_get(0).map_err(self.map())?;
            let status: String = row.try_get(1).map_err(self.map())?;
            let stuck: bool = row.try_get(2).map_err(self.map())?;
            let n: i64 = row.try_get(3).map_err(self.map())?;
            if let Some(status) = Status::parse(&status) {
                let namespace = String::from_utf8_lossy(&namespace);
                stats.add(&namespace, status, stuck, u64::try_from(n).unwrap_or(0));
            }
        }
        stats.expired = self.expired(now).await?;
        Ok(stats)
    }

    async fn migrate(&self, dry_run: bool) -> Result<Vec<String>, Error> {
        let pending = crate::migrate::pending(self.pool(), self.statements()).await?;
        if !dry_run && !pending.is_empty() {
            PgRepository::migrate(self).await?;
        }
        Ok(pending)
    }

    async fn doctor(&self, options: &DoctorOptions) -> Result<Vec<Check>, Error> {
        let at = crate::migrate::version(self.pool(), self.statements()).await?;
        let latest = crate::migrate::latest_version();
        let version = |v: i32| u64::try_from(v).unwrap_or(0);
        let mut checks = vec![Check::schema_version(version(at), version(latest))];
        if at == 0 {
            // Nothing else can be read from a table that does not exist.
            checks.push(self.clock_check(options).await?);
            return Ok(checks);
        }
        checks.push(self.index_check().await?);
        checks.push(self.lock_timeout_check().await?);
        checks.push(self.clock_check(options).await?);
        checks.push(Check::purge_backlog(self.expired(SystemClock.now()).await?));
        Ok(checks)
    }
}
