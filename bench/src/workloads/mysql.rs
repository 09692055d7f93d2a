//! MySQL/MariaDB: the library against sqlx issuing the same statements on the
//! same pool — the fresh key's `INSERT` and the owner-checked `UPDATE` that
//! completes; for a duplicate, the `INSERT` its duplicate-key error answers,
//! then the `SELECT` of the stored record.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use idempotency_conformance::containers::WireCounter;
use idempotency_core::{Clock, IdempotencyManager, SystemClock};
use idempotency_mysql::sqlx::{self, MySqlPool};
use idempotency_mysql::MySqlRepository;

use super::{config, execute, key_id, populate, receipt_bytes, Lane, Workload};
use crate::{BoxError, Scenario, Variant};

/// The library and the raw client over one pool.
struct Side {
    manager: IdempotencyManager,
    repo: MySqlRepository,
}

impl Side {
    async fn connect(url: &str, table: &str, pool: u32) -> Result<Self, BoxError> {
        let separator = if url.contains('?') { '&' } else { '?' };
        let repo = MySqlRepository::connect(&format!(
            "{url}{separator}table={table}&max_connections={pool}"
        ))
        .await?;
        let manager = IdempotencyManager::new(Arc::new(repo.clone()), config())?;
        Ok(Side { manager, repo })
    }

    fn pool(&self) -> &MySqlPool {
        self.repo.pool()
    }
}

/// MySQL workload on a table of its own (dropped by [`Workload::cleanup`]).
pub struct MySqlWorkload {
    timed: Side,
    counted: Side,
    counter: WireCounter,
    version: String,
    pool_size: u32,
    ttl_ms: i64,
}

impl std::fmt::Debug for MySqlWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlWorkload")
            .field("table", &self.timed.repo.table())
            .finish_non_exhaustive()
    }
}

impl MySqlWorkload {
    /// Connects both sides to `url` with pools of `pool_size` connections and
    /// creates a table of their own.
    ///
    /// # Errors
    /// When the server cannot be reached or the migration fails.
    pub async fn connect(url: &str, pool_size: u32) -> Result<Self, BoxError> {
        let table = format!("bench_{:012x}", rand::random::<u64>() >> 16);
        let timed = Side::connect(url, &table, pool_size).await?;
        let counter = WireCounter::mysql(url).await?;
        // One connection: no connection is opened (and its statements
        // prepared) mid-count.
        let counted = Side::connect(counter.url(), &table, 1).await?;
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(timed.pool())
            .await?;
        Ok(MySqlWorkload {
            timed,
            counted,
            counter,
            version,
            pool_size,
            ttl_ms: i64::try_from(config().ttl.as_millis()).unwrap_or(i64::MAX),
        })
    }

    /// The raw operation: the same statements with the same binds.
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
        let inserted = sqlx::query(sql.insert())
            .bind(b"bench".as_slice())
            .bind(id.as_bytes())
            .bind("processing")
            .bind(owner.clone())
            .bind(1_u32)
            .bind(Some(vec![0xab_u8; 32]))
            .bind(None::<Vec<u8>>)
            .bind(None::<Vec<u8>>)
            .bind(false)
            .bind(now + 300_000)
            .bind(expires)
            .bind(now)
            .bind(now)
            .execute(side.pool())
            .await;
        match (scenario, inserted) {
            (Scenario::Fresh, Ok(_)) => {
                let done = sqlx::query(sql.finish())
                    .bind("completed")
                    .bind(receipt_bytes(i))
                    .bind(None::<Vec<u8>>)
                    .bind(false)
                    .bind(expires)
                    .bind(now)
                    .bind(b"bench".as_slice())
                    .bind(id.as_bytes())
                    .bind(owner)
                    .bind(now)
                    .execute(side.pool())
                    .await?;
                if done.rows_affected() == 1 {
                    Ok(())
                } else {
                    Err(format!("raw complete of {id} updated no row").into())
                }
            }
            (Scenario::Duplicate, Err(sqlx::Error::Database(e)))
                if e.kind() == sqlx::error::ErrorKind::UniqueViolation =>
            {
                let found = sqlx::query(sql.select())
                    .bind(b"bench".as_slice())
                    .bind(id.as_bytes())
                    .fetch_optional(side.pool())
                    .await?;
                match found {
                    Some(_) => Ok(()),
                    None => Err(format!("raw duplicate of {id} found no record").into()),
                }
            }
            (scenario, inserted) => Err(format!(
                "raw {scenario} insert of {id} answered {:?}",
                inserted.map(|_| "inserted")
            )
            .into()),
        }
    }
}

#[async_trait]
impl Workload for MySqlWorkload {
    fn backend(&self) -> &'static str {
        "mysql"
    }

    fn manager(&self, lane: Lane) -> &IdempotencyManager {
        match lane {
            Lane::Timed => &self.timed.manager,
            Lane::Counted => &self.counted.manager,
        }
    }

    fn describe(&self) -> String {
        format!(
            "MySQL protocol, server {} — one sqlx pool of {} connections shared by library and \
             raw (statements prepared once per connection)",
            self.version, self.pool_size
        )
    }

    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        populate(&self.timed.manager, ns, ops, self.pool_size as usize).await
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
        // Commands the server answers; pings (none expected) apart.
        Ok(Some(self.counter.round_trips_since(&BTreeMap::new())))
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        let table = self.timed.repo.table();
        sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`"))
            .execute(self.timed.pool())
            .await?;
        sqlx::query("DELETE FROM idempotency_schema_migrations WHERE table_name = ?")
            .bind(table)
            .execute(self.timed.pool())
            .await?;
        Ok(())
    }
}
