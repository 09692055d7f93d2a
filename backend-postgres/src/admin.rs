//! The operator operations ([`Admin`]) of the PostgreSQL store: indexed
//! listing, exact counts, migrations with a dry run, and a check of the
//! server's settings the library relies on.

use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::admin::{
    prefix_upper_bound, Admin, Check, DoctorOptions, ListFilter, Listing, Stats,
};
use idempotency_core::decision::skew_cutoff;
use idempotency_core::{Clock, Error, Status, SystemClock, Timestamp};
use sqlx::Row;

use crate::error::map_sqlx;
use crate::names::RECORD_COLUMNS;
use crate::ops::{decode_record, ts};
use crate::PgRepository;

/// The columns a completion, a failure or an extension writes (besides
/// `purge_after`, which they keep as a rule): an index on any of them makes
/// those updates write new index entries (not HOT).
const UPDATED_COLUMNS: [&str; 7] = [
    "status",
    "result",
    "error",
    "retryable",
    "lease_until",
    "expires_at",
    "updated_at",
];

/// The verdict on whether the table's updates can be HOT: `indexed` are the
/// columns of [`UPDATED_COLUMNS`] some index depends on (key, expression or
/// predicate), `fillfactor` the table's; `updates` and `hot` are the server's
/// counts since its statistics were reset, reported but not judged (they
/// include everything from before migration 4).
fn hot_verdict(indexed: &[String], fillfactor: Option<i32>, updates: i64, hot: i64) -> Check {
    const NAME: &str = "HOT updates";
    let counted = match updates {
        0 => "no updates counted yet".to_owned(),
        _ => format!(
            "{}% of {updates} updates HOT since the statistics were reset",
            i128::from(hot) * 100 / i128::from(updates)
        ),
    };
    if !indexed.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "completions change the indexed {}: each writes new index entries \
                 ({counted})",
                indexed.join(", ")
            ),
            "run `idempotency migrate` (migration 4 moves the purge index to purge_after, \
             which completions keep); move or drop indexes of your own on these columns",
        );
    }
    let fillfactor = fillfactor.unwrap_or(100);
    if fillfactor >= 100 {
        return Check::warn(
            NAME,
            format!("fillfactor 100: full pages keep no room for completed versions ({counted})"),
            "run `idempotency migrate` (migration 4 sets fillfactor 85; it applies to pages \
             written from then on)",
        );
    }
    Check::pass(
        NAME,
        format!("no index on a column completions change; fillfactor {fillfactor} ({counted})"),
    )
}

impl PgRepository {
    fn map(&self) -> impl Fn(sqlx::Error) -> Error + '_ {
        |e| map_sqlx(e, "admin", None, &self.statements().qualified)
    }

    /// How many records have expired by `now`, found through the purge index
    /// of a table at version `at`.
    async fn expired(&self, now: Timestamp, at: i32) -> Result<u64, Error> {
        let column = crate::migrate::purge_column(at);
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE {column} <= $1 AND expires_at <= $1",
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

    /// Whether purges find expired rows by index: on `purge_after` since
    /// migration 4, on `expires_at` before (`at` is the table's version).
    async fn index_check(&self, at: i32) -> Result<Check, Error> {
        let names = self.statements();
        let column = crate::migrate::purge_column(at);
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 \
             AND indexdef LIKE '%(' || $3 || ')%'",
        )
        .bind(&names.schema)
        .bind(&names.table)
        .bind(column)
        .fetch_one(self.pool())
        .await
        .map_err(self.map())?;
        Ok(if n > 0 {
            Check::pass(
                "purge index",
                format!("present: purges find expired rows by index (on {column})"),
            )
        } else {
            Check::warn(
                "purge index",
                format!("missing (on {column}): every purge scans the whole table"),
                "run `idempotency migrate` (it creates the index)",
            )
        })
    }

    /// Whether the table's updates (completions, failures, extensions) can be
    /// HOT: no index on a column they change, room left on each page.
    async fn hot_check(&self) -> Result<Check, Error> {
        let table = &self.statements().qualified;
        // Key columns from `pg_index`; columns of expressions and predicates
        // from the index's dependencies.
        let indexed: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT a.attname::text FROM pg_index i \
             JOIN pg_attribute a ON a.attrelid = i.indrelid \
             WHERE i.indrelid = to_regclass($1) AND a.attname = ANY($2) \
             AND (a.attnum = ANY(i.indkey) OR EXISTS (SELECT 1 FROM pg_depend d \
                  WHERE d.classid = 'pg_class'::regclass AND d.objid = i.indexrelid \
                  AND d.refclassid = 'pg_class'::regclass AND d.refobjid = i.indrelid \
                  AND d.refobjsubid = a.attnum)) \
             ORDER BY 1",
        )
        .bind(table)
        .bind(&UPDATED_COLUMNS[..])
        .fetch_all(self.pool())
        .await
        .map_err(self.map())?;
        let (fillfactor, updates, hot): (Option<i32>, i64, i64) = sqlx::query_as(
            "SELECT (SELECT split_part(o, '=', 2)::int FROM unnest(c.reloptions) o \
                     WHERE o LIKE 'fillfactor=%'), \
                    COALESCE(s.n_tup_upd, 0), COALESCE(s.n_tup_hot_upd, 0) \
             FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
             WHERE c.oid = to_regclass($1)",
        )
        .bind(table)
        .fetch_one(self.pool())
        .await
        .map_err(self.map())?;
        Ok(hot_verdict(&indexed, fillfactor, updates, hot))
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
             AND (NOT $5 OR (status = 'processing' AND lease_until <= $7)) \
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
            .bind(ts(filter.stuck_cutoff(now)))
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
    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        let rows = sqlx::query(&format!(
            "SELECT namespace, status, status = 'processing' AND lease_until <= $2, count(*) \
             FROM {} WHERE expires_at > $1 GROUP BY 1, 2, 3",
            self.statements().qualified
        ))
        .bind(ts(now))
        .bind(ts(skew_cutoff(now, clock_skew)))
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
        let at = crate::migrate::version(self.pool(), self.statements()).await?;
        stats.expired = self.expired(now, at).await?;
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
        checks.push(self.index_check(at).await?);
        checks.push(self.hot_check().await?);
        checks.push(self.lock_timeout_check().await?);
        checks.push(self.clock_check(options).await?);
        checks.push(Check::purge_backlog(
            self.expired(SystemClock.now(), at).await?,
        ));
        Ok(checks)
    }
}

#[cfg(test)]
mod tests {
    use idempotency_core::admin::Verdict;

    use super::hot_verdict;

    #[test]
    fn hot_verdicts() {
        let ok = hot_verdict(&[], Some(85), 10_000, 9_990);
        assert_eq!(ok.verdict, Verdict::Pass);
        assert!(
            ok.detail.contains("fillfactor 85 (99% of 10000"),
            "{}",
            ok.detail
        );
        assert!(hot_verdict(&[], Some(85), 0, 0)
            .detail
            .contains("no updates"));
        assert_eq!(
            hot_verdict(&[], Some(90), i64::MAX, i64::MAX).verdict,
            Verdict::Pass
        );
        let indexed = hot_verdict(&["expires_at".to_owned()], Some(85), 10, 0);
        assert_eq!(indexed.verdict, Verdict::Warn);
        assert!(
            indexed.detail.contains("indexed expires_at"),
            "{}",
            indexed.detail
        );
        assert!(indexed.fix.as_deref().unwrap_or("").contains("migrate"));
        for full in [None, Some(100)] {
            let full = hot_verdict(&[], full, 10, 10);
            assert_eq!(full.verdict, Verdict::Warn);
            assert!(full.detail.starts_with("fillfactor 100"), "{}", full.detail);
        }
    }
}
