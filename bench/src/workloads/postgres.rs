//! PostgreSQL: the library against sqlx issuing the same statements on the same
//! pool — the reservation function (a duplicate ends there) and the
//! owner-checked `UPDATE` that completes.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use idempotency_conformance::containers::WireCounter;
use idempotency_core::{Clock, IdempotencyManager, SystemClock};
use idempotency_postgres::sqlx::{self, PgPool, Row};
use idempotency_postgres::PgRepository;

use super::{config, execute, key_id, populate, receipt_bytes, Lane, Workload};
use crate::{BoxError, Scenario, Variant};

/// The library and the raw client over one pool.
struct Side {
    manager: IdempotencyManager,
    repo: PgRepository,
}

impl Side {
    async fn connect(url: &str, table: &str, pool: u32) -> Result<Self, BoxError> {
        let repo = PgRepository::builder()
            .table(table)
            .max_connections(pool)
            .connect(url)
            .await?;
        repo.migrate().await?;
        let manager = IdempotencyManager::new(Arc::new(repo.clone()), config())?;
        Ok(Side { manager, repo })
    }

    fn pool(&self) -> &PgPool {
        self.repo.pool()
    }
}

/// PostgreSQL workload on a table of its own (dropped by [`Workload::cleanup`]).
pub struct PostgresWorkload {
    timed: Side,
    counted: Side,
    counter: WireCounter,
    table: String,
    version: String,
    pool_size: u32,
    ttl_ms: i64,
}

impl std::fmt::Debug for PostgresWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresWorkload")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PostgresWorkload {
    /// Connects both sides to `url` with pools of `pool_size` connections and
    /// creates a table of their own.
    ///
    /// # Errors
    /// When the server cannot be reached or the migration fails.
    pub async fn connect(url: &str, pool_size: u32) -> Result<Self, BoxError> {
        let table = format!("bench_{:012x}", rand::random::<u64>() >> 16);
        let timed = Side::connect(url, &table, pool_size).await?;
        let counter = WireCounter::postgres(url).await?;
        // One connection: each counted operation waits for the previous one's
        // release check, and no connection is opened (and prepared) mid-count.
        let counted = Side::connect(counter.url(), &table, 1).await?;
        let version: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(timed.pool())
            .await?;
        Ok(PostgresWorkload {
            timed,
            counted,
            counter,
            table,
            version,
            pool_size,
            ttl_ms: i64::try_from(config().ttl.as_millis()).unwrap_or(i64::MAX),
        })
    }

    /// The raw operation: the same two statements with the same binds.
    async fn raw(
        &self,
        side: &Side,
        scenario: Scenario,
        ns: &str,
        i: usize,
    ) -> Result<(), BoxError> {
        let sql = side.repo.statements();
        let id = key_id(ns, i);
        let now = i64::try_from(SystemClock.now().as_millis())?;
        let expires = now + self.ttl_ms;
        let owner = rand::random::<u128>().to_be_bytes().to_vec();
        let row = sqlx::query(sql.reserve())
            .bind(b"bench".as_slice())
            .bind(id.as_bytes())
            .bind(owner.clone())
            .bind(Some(vec![0xab_u8; 32]))
            .bind(now)
            .bind(now)
            .bind(now + 300_000)
            .bind(expires)
            .bind(false)
            .fetch_one(side.pool())
            .await?;
        let acquired: bool = row.try_get(0)?;
        match (scenario, acquired) {
            (Scenario::Duplicate, false) => Ok(()),
            (Scenario::Fresh, true) => {
                let done = sqlx::query(sql.complete())
                    .bind(b"bench".as_slice())
                    .bind(id.as_bytes())
                    .bind(owner)
                    .bind(receipt_bytes(i))
                    .bind(expires)
                    .bind(now)
                    .execute(side.pool())
                    .await?;
                if done.rows_affected() == 1 {
                    Ok(())
                } else {
                    Err(format!("raw complete of {id} updated no row").into())
                }
            }
            (scenario, acquired) => {
                Err(format!("raw {scenario} reserve of {id} answered acquired={acquired}").into())
            }
        }
    }
}

#[async_trait]
impl Workload for PostgresWorkload {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn manager(&self, lane: Lane) -> &IdempotencyManager {
        match lane {
            Lane::Timed => &self.timed.manager,
            Lane::Counted => &self.counted.manager,
        }
    }

    fn describe(&self) -> String {
        format!(
            "PostgreSQL {} — one sqlx pool of {} connections shared by library and raw \
             (statements prepared once per connection)",
            self.version, self.pool_size
        )
    }

    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        populate(&self.timed.manager, ns, ops, self.pool_size as usize).await
    }

    /// `VACUUM ANALYZE` of the table: otherwise autovacuum and autoanalyze
    /// of the rows just populated (and of a fresh scenario's before them) run
    /// during the measured rounds, while pgbench in `bench/pg-limit.sh` reads
    /// a settled table; duplicates measured 10–20 % slower that way.
    async fn settle(&self) -> Result<(), BoxError> {
        let sql = self.timed.repo.statements();
        sqlx::query(&format!("VACUUM ANALYZE {}", sql.qualified_table()))
            .execute(self.timed.pool())
            .await?;
        Ok(())
    }

    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        lane: Lane,
    ) -> Result<(), BoxError> {
        let side = match lane {
            Lane::Timed => &self.timed,
            Lane::Counted => &self.counted,
        };
        match variant {
            Variant::Library => execute(&side.manager, scenario, ns, i).await,
            Variant::Raw => self.raw(side, scenario, ns, i).await,
        }
    }

    async fn round_trips(&self) -> Result<Option<u64>, BoxError> {
        // Statements only: the `Sync` sqlx sends as a connection returns to the
        // pool (after the caller has its answer) is a ping, not counted.
        Ok(Some(self.counter.round_trips_since(&BTreeMap::new())))
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        let sql = self.timed.repo.statements();
        let function = format!(
            "\"{}\".\"{}_reserve\"",
            self.timed.repo.schema(),
            self.table
        );
        let migrations = format!(
            "\"{}\".\"{}_migrations\"",
            self.timed.repo.schema(),
            self.table
        );
        for statement in [
            format!("DROP TABLE IF EXISTS {}", sql.qualified_table()),
            format!("DROP TABLE IF EXISTS {migrations}"),
            format!("DROP FUNCTION IF EXISTS {function}"),
        ] {
            sqlx::query(&statement).execute(self.timed.pool()).await?;
        }
        Ok(())
    }
}
