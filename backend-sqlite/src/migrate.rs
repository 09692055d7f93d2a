//! Embedded migrations, applied in one immediate transaction.
//!
//! Not sqlx's migrator: sqlx 0.8 keeps its versions in `_sqlx_migrations`,
//! the table an application's own sqlx migrations use. In a database file the
//! application shares with this store, our version 1 would collide with the
//! application's (a checksum mismatch), and each migrator would refuse the
//! other's versions as unknown. This crate keeps its own versions in
//! `idempotency_schema_migrations`.

use idempotency_core::{Clock, Error, SystemClock};
use sqlx::{Executor, Row, SqlitePool};

use crate::error::map_sqlx;

/// One embedded migration.
struct Migration {
    version: i64,
    description: &'static str,
    sql: &'static str,
}

/// Every migration, in order. Never edit an applied one: append a new version.
const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "records table and its expires_at index",
    sql: include_str!("sql/0001_records.sql"),
}];

/// The newest migration version this crate knows.
pub(crate) fn latest_version() -> i64 {
    MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0)
}

/// Applies the pending migrations in one `BEGIN IMMEDIATE` transaction: two
/// processes starting together on one file apply them once (the second waits
/// for the first's lock, then finds nothing to do).
pub(crate) async fn run(pool: &SqlitePool) -> Result<(), Error> {
    let map = |e| map_sqlx(e, "migrate", None);
    let mut tx = crate::ops::begin_immediate(pool).await.map_err(map)?;
    tx.execute(
        "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
             version     INTEGER PRIMARY KEY,
             description TEXT    NOT NULL,
             applied_at  INTEGER NOT NULL
         )",
    )
    .await
    .map_err(map)?;
    let applied: i64 =
        sqlx::query("SELECT COALESCE(MAX(version), 0) FROM idempotency_schema_migrations")
            .fetch_one(&mut *tx)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(map)?;
    if applied > latest_version() {
        return Err(Error::config(format!(
            "the SQLite database is at schema version {applied}, newer than this library's {}; \
             upgrade the library",
            latest_version()
        )));
    }
    for m in MIGRATIONS.iter().filter(|m| m.version > applied) {
        tx.execute(m.sql).await.map_err(map)?;
        sqlx::query(
            "INSERT INTO idempotency_schema_migrations (version, description, applied_at) \
             VALUES (?1, ?2, ?3)",
        )
        .bind(m.version)
        .bind(m.description)
        .bind(crate::ops::ts(SystemClock.now()))
        .execute(&mut *tx)
        .await
        .map_err(map)?;
        tracing::info!(
            version = m.version,
            description = m.description,
            "SQLite migration applied"
        );
    }
    tx.commit().await.map_err(map)
}

/// The schema version the database is at (0: never migrated).
pub(crate) async fn version(pool: &SqlitePool) -> Result<i64, Error> {
    let map = |e| map_sqlx(e, "migrate", None);
    let exists: bool = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' \
         AND name = 'idempotency_schema_migrations')",
    )
    .fetch_one(pool)
    .await
    .and_then(|row| row.try_get(0))
    .map_err(map)?;
    if !exists {
        return Ok(0);
    }
    sqlx::query("SELECT COALESCE(MAX(version), 0) FROM idempotency_schema_migrations")
        .fetch_one(pool)
        .await
        .and_then(|row| row.try_get(0))
        .map_err(map)
}

/// The migrations not yet applied, described (`version N: …`).
pub(crate) async fn pending(pool: &SqlitePool) -> Result<Vec<String>, Error> {
    let at = version(pool).await?;
    Ok(MIGRATIONS
        .iter()
        .filter(|m| m.version > at)
        .map(|m| format!("version {}: {}", m.version, m.description))
        .collect())
}
