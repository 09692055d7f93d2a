//! The operator operations ([`Admin`]) of the SQLite store: indexed listing,
//! exact counts, migrations with a dry run, and a check of the connection's
//! settings.

use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::admin::{
    prefix_upper_bound, Admin, Check, DoctorOptions, ListFilter, Listing, Stats,
};
use idempotency_core::decision::skew_cutoff;
use idempotency_core::{Error, Status, Timestamp};
use sqlx::Row;

use crate::error::map_sqlx;
use crate::ops::{decode, ts, COLUMNS};
use crate::SqliteRepository;

fn map(e: sqlx::Error) -> Error {
    map_sqlx(e, "admin", None)
}

#[async_trait]
impl Admin for SqliteRepository {
    /// In key order, through the primary key (a range of namespaces).
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        let prefix = filter.namespace_prefix.as_deref().unwrap_or("").as_bytes();
        let sql = format!(
            "SELECT {COLUMNS}, namespace, id FROM idempotency_records \
             WHERE expires_at > ?1 AND namespace >= ?2 AND (?3 IS NULL OR namespace < ?3) \
             AND (?4 IS NULL OR status = ?4) \
             AND (?5 = 0 OR (status = 'processing' AND lease_until <= ?7)) \
             ORDER BY namespace, id LIMIT ?6"
        );
        let rows = sqlx::query(&sql)
            .bind(ts(now))
            .bind(prefix)
            .bind(prefix_upper_bound(prefix))
            .bind(filter.status.map(Status::as_str))
            .bind(filter.stuck)
            .bind(i64::try_from(filter.limit.saturating_add(1)).unwrap_or(i64::MAX))
            .bind(ts(filter.stuck_cutoff(now)))
            .fetch_all(self.pool())
            .await
            .map_err(map)?;
        let key_of = |row: &_| -> Result<(Vec<u8>, Vec<u8>), Error> {
            Ok((
                sqlx::Row::try_get(row, 11).map_err(map)?,
                sqlx::Row::try_get(row, 12).map_err(map)?,
            ))
        };
        Listing::from_rows(&rows, filter.limit, key_of, decode)
    }

    /// Exact counts (SQLite is local: a scan loads no server).
    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        let rows = sqlx::query(
            "SELECT namespace, status, status = 'processing' AND lease_until <= ?2, COUNT(*) \
             FROM idempotency_records WHERE expires_at > ?1 GROUP BY 1, 2, 3",
        )
        .bind(ts(now))
        .bind(ts(skew_cutoff(now, clock_skew)))
        .fetch_all(self.pool())
        .await
        .map_err(map)?;
        let mut stats = Stats::default();
        for row in &rows {
            let namespace: Vec<u8> = row.try_get(0).map_err(map)?;
            let status: String = row.try_get(1).map_err(map)?;
            let stuck: bool = row.try_get(2).map_err(map)?;
            let n: i64 = row.try_get(3).map_err(map)?;
            if let Some(status) = Status::parse(&status) {
                let namespace = String::from_utf8_lossy(&namespace);
                stats.add(&namespace, status, stuck, u64::try_from(n).unwrap_or(0));
            }
        }
        stats.expired = expired(self, now).await?;
        Ok(stats)
    }

    async fn migrate(&self, dry_run: bool) -> Result<Vec<String>, Error> {
        let pending = crate::migrate::pending(self.pool()).await?;
        if !dry_run && !pending.is_empty() {
            SqliteRepository::migrate(self).await?;
        }
        Ok(pending)
    }

    async fn doctor(&self, _options: &DoctorOptions) -> Result<Vec<Check>, Error> {
        let (at, latest) = self.schema_version().await?;
        let version = |v: i64| u64::try_from(v).unwrap_or(0);
        let mut checks = vec![Check::schema_version(version(at), version(latest))];
        let journal: String = pragma(self, "journal_mode").await?;
        checks.push(if journal.eq_ignore_ascii_case("wal") {
            Check::pass(
                "journal mode",
                "WAL: readers and the writer do not block each other",
            )
        } else {
            Check::warn(
                "journal mode",
                format!("{journal}: every reservation waits for readers of other processes"),
                "connect through SqliteRepository::connect (it sets WAL), or run PRAGMA \
                 journal_mode=WAL once",
            )
        });
        let synchronous: i64 = pragma(self, "synchronous").await?;
        checks.push(match synchronous {
            2 | 3 => Check::pass(
                "synchronous",
                "FULL: a recorded outcome survives a power loss",
            ),
            1 => Check::warn(
                "synchronous",
                "NORMAL: the last commits before a power loss or an OS crash may be lost, and \
                 a key whose record is lost runs its handler again",
                "synchronous=full in the URL, unless that window is acceptable",
            ),
            _ => Check::fail(
                "synchronous",
                "OFF: a crash of the machine can lose or corrupt records",
                "synchronous=full in the URL",
            ),
        });
        if at > 0 {
            let now = idempotency_core::Clock::now(&idempotency_core::SystemClock);
            checks.push(Check::purge_backlog(expired(self, now).await?));
        }
        Ok(checks)
    }
}

async fn expired(repo: &SqliteRepository, now: Timestamp) -> Result<u64, Error> {
    let n: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records WHERE expires_at <= ?1")
            .bind(ts(now))
            .fetch_one(repo.pool())
            .await
            .map_err(map)?;
    Ok(u64::try_from(n).unwrap_or(0))
}

async fn pragma<T>(repo: &SqliteRepository, name: &str) -> Result<T, Error>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite> + Send + Unpin,
{
    sqlx::query_scalar(&format!("PRAGMA {name}"))
        .fetch_one(repo.pool())
        .await
        .map_err(map)
}
