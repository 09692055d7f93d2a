//! The whole conformance suite against SQLite files, and its errors clause:
//! rows the repository cannot decode, and a database another process keeps
//! locked.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;

use idempotency_core::SharedRepository;

async fn repository() -> SharedRepository {
    let path = common::fresh_path("conformance");
    Arc::new(common::repository_at(&path, "").await)
}

idempotency_conformance::conformance_tests!(repository);

/// A store that "goes away" is, for SQLite, a database whose connection is
/// taken and whose file is locked (another task holding the process's only
/// connection in a write transaction): every call waits for the pool's
/// acquire timeout, then fails. The busy timeout against another process's
/// lock is in `tests/sqlite.rs`.
mod store_faults {
    use super::*;
    use async_trait::async_trait;
    use idempotency_conformance::{SharedFaults, StoreFaults};
    use idempotency_core::RecordKey;
    use idempotency_sqlite::SqliteRepository;
    use sqlx::pool::PoolConnection;
    use sqlx::{Connection, Executor, Sqlite, SqliteConnection};
    use tokio::sync::Mutex;

    struct Faults {
        url: String,
        repo: SqliteRepository,
        /// The repository's connection, taken while the store is "unreachable".
        taken: Mutex<Option<PoolConnection<Sqlite>>>,
    }

    #[async_trait]
    impl StoreFaults for Faults {
        async fn corrupt(&self, key: &RecordKey) -> Result<(), String> {
            let mut c = SqliteConnection::connect(&self.url)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::query(
                "INSERT OR REPLACE INTO idempotency_records (namespace, id, status, owner, \
                 attempt, lease_until, expires_at, created_at, updated_at) \
                 VALUES (?1, ?2, 'processing', x'0102', 1, 0, 9223372036854775807, 0, 0)",
            )
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .execute(&mut c)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
        }

        async fn unreach(&self) -> Result<(), String> {
            let mut c = self
                .repo
                .pool()
                .acquire()
                .await
                .map_err(|e| e.to_string())?;
            c.execute("BEGIN IMMEDIATE")
                .await
                .map_err(|e| e.to_string())?;
            *self.taken.lock().await = Some(c);
            Ok(())
        }

        async fn reach(&self) -> Result<(), String> {
            if let Some(mut c) = self.taken.lock().await.take() {
                c.execute("ROLLBACK").await.map_err(|e| e.to_string())?;
            }
            Ok(())
        }
    }

    async fn repository_and_faults() -> (SharedRepository, SharedFaults) {
        let path = common::fresh_path("faults");
        let repo = common::repository_at(&path, "?busy_timeout=1s").await;
        let faults = Faults {
            url: common::url(&path, ""),
            repo: repo.clone(),
            taken: Mutex::new(None),
        };
        (Arc::new(repo), Arc::new(faults))
    }

    idempotency_conformance::store_fault_tests!(repository_and_faults);
}
