//! SQLite: the library against sqlx issuing the same statements on the same
//! pool and file — the reservation's immediate transaction (`SELECT`, then
//! `INSERT OR REPLACE` for a fresh key) and the owner-checked `UPDATE` that
//! completes.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use idempotency_core::{Clock, IdempotencyManager, SystemClock};
use idempotency_sqlite::sqlx::{self, SqlitePool};
use idempotency_sqlite::{SqliteRepository, Statements};

use super::{config, execute, key_id, populate, receipt_bytes, Lane, Workload};
use crate::{BoxError, Scenario, Variant};

/// SQLite workload on a file of its own (removed by [`Workload::cleanup`]).
#[derive(Debug)]
pub struct SqliteWorkload {
    manager: IdempotencyManager,
    repo: SqliteRepository,
    path: PathBuf,
    synchronous: String,
    version: String,
    ttl_ms: i64,
}

impl SqliteWorkload {
    /// A new file under `dir` with `synchronous` (`full` or `normal`), the
    /// library's defaults otherwise (one connection, WAL).
    ///
    /// # Errors
    /// When the file cannot be created.
    pub async fn connect(dir: &std::path::Path, synchronous: &str) -> Result<Self, BoxError> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("bench-{:012x}.db", rand::random::<u64>() >> 16));
        let url = format!("sqlite://{}?synchronous={synchronous}", path.display());
        let repo = SqliteRepository::connect(&url).await?;
        let manager = IdempotencyManager::new(Arc::new(repo.clone()), config())?;
        let version: String = sqlx::query_scalar("SELECT sqlite_version()")
            .fetch_one(repo.pool())
            .await?;
        Ok(SqliteWorkload {
            manager,
            repo,
            path,
            synchronous: synchronous.to_owned(),
            version,
            ttl_ms: i64::try_from(config().ttl.as_millis()).unwrap_or(i64::MAX),
        })
    }

    fn pool(&self) -> &SqlitePool {
        self.repo.pool()
    }

    /// The raw operation: the same statements with the same binds.
    async fn raw(&self, scenario: Scenario, ns: &str, i: usize) -> Result<(), BoxError> {
        let sql = Statements::get();
        let id = key_id(ns, i);
        let now = i64::try_from(SystemClock.now().as_millis())?;
        let expires = now + self.ttl_ms;
        let owner = rand::random::<u128>().to_be_bytes().to_vec();
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        let found = sqlx::query(sql.select())
            .bind(b"bench".as_slice())
            .bind(id.as_bytes())
            .fetch_optional(&mut *tx)
            .await?;
        match (scenario, found) {
            (Scenario::Duplicate, Some(_)) => Ok(tx.commit().await?),
            (Scenario::Fresh, None) => {
                sqlx::query(sql.put())
                    .bind(b"bench".as_slice())
                    .bind(id.as_bytes())
                    .bind("processing")
                    .bind(owner.clone())
                    .bind(1_i64)
                    .bind(Some(vec![0xab_u8; 32]))
                    .bind(None::<Vec<u8>>)
                    .bind(None::<Vec<u8>>)
                    .bind(false)
                    .bind(now + 300_000)
                    .bind(expires)
                    .bind(now)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                let done = sqlx::query(sql.finish())
                    .bind(b"bench".as_slice())
                    .bind(id.as_bytes())
                    .bind(owner)
                    .bind(now)
                    .bind("completed")
                    .bind(receipt_bytes(i))
                    .bind(None::<Vec<u8>>)
                    .bind(false)
                    .bind(expires)
                    .execute(self.pool())
                    .await?;
                if done.rows_affected() == 1 {
                    Ok(())
                } else {
                    Err(format!("raw complete of {id} updated no row").into())
                }
            }
            (scenario, found) => Err(format!(
                "raw {scenario} reserve of {id} found a record: {}",
                found.is_some()
            )
            .into()),
        }
    }
}

#[async_trait]
impl Workload for SqliteWorkload {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn manager(&self, _lane: Lane) -> &IdempotencyManager {
        &self.manager
    }

    fn describe(&self) -> String {
        format!(
            "SQLite {} — one file ({}), WAL, synchronous={}, one connection shared by library \
             and raw",
            self.version,
            self.path.display(),
            self.synchronous
        )
    }

    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        populate(&self.manager, ns, ops, 1).await
    }

    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        _lane: Lane,
    ) -> Result<(), BoxError> {
        match variant {
            Variant::Library => execute(&self.manager, scenario, ns, i).await,
            Variant::Raw => self.raw(scenario, ns, i).await,
        }
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        self.pool().close().await;
        for suffix in ["", "-wal", "-shm"] {
            let mut file = self.path.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
        Ok(())
    }
}
