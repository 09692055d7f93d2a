//! Embedded migrations, serialised across processes by a named server lock.
//!
//! Not sqlx's migrator: sqlx 0.8 keeps its versions in `_sqlx_migrations`,
//! the table an application's own sqlx migrations use. In a database the
//! application shares with this store, our version 1 would collide with the
//! application's (a checksum mismatch), and each migrator would refuse the
//! other's versions as unknown. This crate keeps its versions in
//! `idempotency_schema_migrations`, per records table (one database may hold
//! several, under different `table` names).

use idempotency_core::{Clock, Error, SystemClock};
use sqlx::{Connection, Executor, MySqlConnection, MySqlPool, Row};

use crate::error::map_sqlx;

/// One embedded migration; `{table}` in its SQL is the quoted table name.
struct Migration {
    version: u32,
    description: &'static str,
    sql: &'static str,
}

/// Every migration, in order. Never edit an applied one: append a new version.
const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "records table and its expires_at index",
    sql: include_str!("sql/0001_records.sql"),
}];

/// How long `migrate()` waits for another process's migration to finish.
const LOCK_WAIT_SECONDS: u32 = 60;

const VERSIONS: &str = "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
    table_name  VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    version     INT UNSIGNED NOT NULL,
    description VARCHAR(255) NOT NULL,
    applied_at  BIGINT NOT NULL,
    PRIMARY KEY (table_name, version)
) ENGINE = InnoDB";

/// The newest migration version this crate knows.
pub(crate) fn latest_version() -> u32 {
    MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0)
}

/// Applies the pending migrations of `table`. MySQL commits every DDL
/// statement on its own, so the migrations are serialised by `GET_LOCK`
/// instead of a transaction: two processes starting together apply each
/// version once (the second waits, then finds nothing to do). Every statement
/// is also idempotent on its own.
///
/// The lock is a session's: it is taken on a connection detached from the
/// pool and closed at the end, so a cancelled or failed migration never hands
/// a connection holding it back to the pool (the server releases it when the
/// connection closes). DDL waits for other sessions' metadata locks at most
/// [`LOCK_WAIT_SECONDS`].
pub(crate) async fn run(pool: &MySqlPool, table: &str) -> Result<(), Error> {
    let map = |e| map_sqlx(e, "migrate", None, table);
    let mut conn = pool.acquire().await.map_err(map)?.detach();
    let applied = locked(&mut conn, table).await;
    // Closing ends the session and with it the lock; a failure to close
    // politely changes nothing.
    let _ = conn.close().await;
    applied
}

async fn locked(conn: &mut MySqlConnection, table: &str) -> Result<(), Error> {
    let map = |e| map_sqlx(e, "migrate", None, table);
    conn.execute(format!("SET SESSION lock_wait_timeout = {LOCK_WAIT_SECONDS}").as_str())
        .await
        .map_err(map)?;
    // A digest keeps the name within MySQL's 64 characters for any table.
    let got: Option<i64> =
        sqlx::query("SELECT GET_LOCK(CONCAT('idempotency-migrate:', SHA1(?)), ?)")
            .bind(table)
            .bind(LOCK_WAIT_SECONDS)
            .fetch_one(&mut *conn)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(map)?;
    if got != Some(1) {
        return Err(Error::Timeout {
            backend: crate::error::BACKEND,
            operation: "migrate",
        });
    }
    apply(conn, table).await?;
    check_key_columns(conn, table).await
}

async fn apply(conn: &mut MySqlConnection, table: &str) -> Result<(), Error> {
    let map = |e| map_sqlx(e, "migrate", None, table);
    conn.execute(VERSIONS).await.map_err(map)?;
    let applied = applied_version(&mut *conn, table).await?;
    if applied > latest_version() {
        return Err(Error::config(format!(
            "the MySQL table {table} is at schema version {applied}, newer than this library's \
             {}; upgrade the library",
            latest_version()
        )));
    }
    for m in MIGRATIONS.iter().filter(|m| m.version > applied) {
        let sql = m.sql.replace("{table}", &format!("`{table}`"));
        conn.execute(sql.as_str()).await.map_err(map)?;
        sqlx::query(
            "INSERT INTO idempotency_schema_migrations (table_name, version, description, \
             applied_at) VALUES (?, ?, ?, ?)",
        )
        .bind(table)
        .bind(m.version)
        .bind(m.description)
        .bind(crate::ops::ts(SystemClock.now()))
        .execute(&mut *conn)
        .await
        .map_err(map)?;
        tracing::info!(
            table,
            version = m.version,
            description = m.description,
            "MySQL migration applied"
        );
    }
    Ok(())
}

/// `CREATE TABLE IF NOT EXISTS` keeps a table someone made before, whatever
/// its columns: refuse one whose keys are not binary strings (a `VARCHAR`
/// under a case-insensitive or PAD SPACE collation merges distinct keys, and
/// a `BINARY` pads them).
async fn check_key_columns(conn: &mut MySqlConnection, table: &str) -> Result<(), Error> {
    let types: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT CAST(column_name AS CHAR), CAST(data_type AS BINARY) FROM information_schema.columns \
         WHERE table_schema = DATABASE() AND table_name = ? AND column_name IN ('namespace', 'id')",
    )
    .bind(table)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| map_sqlx(e, "migrate", None, table))?;
    let wrong: Vec<String> = types
        .iter()
        .filter(|(_, ty)| !ty.eq_ignore_ascii_case(b"varbinary"))
        .map(|(column, ty)| format!("{column} is {}", String::from_utf8_lossy(ty)))
        .collect();
    if types.len() == 2 && wrong.is_empty() {
        return Ok(());
    }
    Err(Error::config(format!(
        "the MySQL table {table} exists with key columns this store cannot use ({}): namespace \
         and id must be VARBINARY, compared byte for byte; use another table name, or drop the \
         table",
        if wrong.is_empty() {
            "namespace or id missing".to_owned()
        } else {
            wrong.join(", ")
        }
    )))
}

async fn applied_version<'e>(
    exec: impl sqlx::MySqlExecutor<'e>,
    table: &str,
) -> Result<u32, Error> {
    let version: Option<u32> =
        sqlx::query("SELECT MAX(version) FROM idempotency_schema_migrations WHERE table_name = ?")
            .bind(table)
            .fetch_one(exec)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(|e| map_sqlx(e, "migrate", None, table))?;
    Ok(version.unwrap_or(0))
}

/// The schema version `table` is at (0: never migrated).
pub(crate) async fn version(pool: &MySqlPool, table: &str) -> Result<u32, Error> {
    let exists: i64 = sqlx::query(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() \
         AND table_name = 'idempotency_schema_migrations'",
    )
    .fetch_one(pool)
    .await
    .and_then(|row| row.try_get(0))
    .map_err(|e| map_sqlx(e, "migrate", None, table))?;
    if exists == 0 {
        return Ok(0);
    }
    applied_version(pool, table).await
}

/// The migrations `table` has not had yet, described (`version N: …`).
pub(crate) async fn pending(pool: &MySqlPool, table: &str) -> Result<Vec<String>, Error> {
    let at = version(pool, table).await?;
    Ok(MIGRATIONS
        .iter()
        .filter(|m| m.version > at)
        .map(|m| format!("version {}: {}", m.version, m.description))
        .collect())
}
