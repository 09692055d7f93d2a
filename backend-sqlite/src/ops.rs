//! The repository's statements and how rows decode into records.

use std::sync::LazyLock;

use idempotency_core::{
    Capabilities, Error, OwnedWrite, OwnerToken, Record, RecordKey, StoredColumns, Timestamp,
};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, Sqlite, SqliteExecutor, SqlitePool, Transaction};

use crate::error::{map_sqlx, BACKEND};

/// The longest id stored verbatim; longer ids are digested by the manager.
pub(crate) const MAX_ID_BYTES: usize = 1024;

/// The largest result or stored error accepted (16 MiB). SQLite holds up to
/// 1 GB in a BLOB, but every duplicate reads the result back in full.
pub(crate) const MAX_RESULT_BYTES: usize = 16 * 1024 * 1024;

pub(crate) const COLUMNS: &str = "status, owner, attempt, fingerprint, result, error, retryable, \
                       lease_until, expires_at, created_at, updated_at";

/// The condition every owner-checked write shares: the live `processing`
/// record `owner` holds (parameters 1 to 4: namespace, id, owner, now).
const OWNED: &str = "namespace = ?1 AND id = ?2 AND owner = ?3 AND status = 'processing' \
                     AND expires_at > ?4";

/// A timestamp as the INTEGER the table stores (milliseconds; instants past
/// `i64::MAX` clamp, which keeps their order).
pub(crate) fn ts(t: Timestamp) -> i64 {
    i64::try_from(t.as_millis()).unwrap_or(i64::MAX)
}

/// What this store holds: its name and limits (checked before every write).
pub(crate) fn capabilities() -> Capabilities {
    Capabilities::new(BACKEND)
        .with_max_result_bytes(Some(MAX_RESULT_BYTES))
        .with_max_id_bytes(MAX_ID_BYTES)
}

pub(crate) fn check_key(key: &RecordKey) -> Result<(), Error> {
    capabilities().check_id(key)
}

pub(crate) fn check_size(what: &'static str, value: Option<&[u8]>) -> Result<(), Error> {
    capabilities().check_value(what, value)
}

/// Decodes a row of [`COLUMNS`]; anything out of shape is `Corrupt` naming
/// the key, never a panic and never a record made up.
pub(crate) fn decode(row: &SqliteRow, key: &RecordKey) -> Result<Record, Error> {
    let corrupt = |e: sqlx::Error| Error::corrupt(key, e.to_string());
    let status: String = row.try_get(0).map_err(corrupt)?;
    StoredColumns {
        status: status.into_bytes(),
        owner: row.try_get(1).map_err(corrupt)?,
        attempt: row.try_get(2).map_err(corrupt)?,
        fingerprint: row.try_get(3).map_err(corrupt)?,
        result: row.try_get(4).map_err(corrupt)?,
        error: row.try_get(5).map_err(corrupt)?,
        retryable: row.try_get(6).map_err(corrupt)?,
        lease_until: row.try_get(7).map_err(corrupt)?,
        expires_at: row.try_get(8).map_err(corrupt)?,
        created_at: row.try_get(9).map_err(corrupt)?,
        updated_at: row.try_get(10).map_err(corrupt)?,
    }
    .into_record(key)
}

/// `BEGIN IMMEDIATE` on a connection of `pool`, on a task of its own.
///
/// sqlx makes the transaction's guard (which rolls it back when dropped) only
/// after a second exchange with the connection's worker, so a caller dropped
/// in between — the manager's store timer, a future given up — would send the
/// connection back to the pool inside the open transaction: every later
/// reservation on it refused, every later write on it never committed. On
/// its own task the begin always finishes, and should its caller be gone by
/// then, the guard is dropped there and rolls the transaction back.
pub(crate) async fn begin_immediate(
    pool: &SqlitePool,
) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
    let pool = pool.clone();
    tokio::spawn(async move { pool.begin_with("BEGIN IMMEDIATE").await })
        .await
        .unwrap_or(Err(sqlx::Error::WorkerCrashed))
}

/// The stored record under `key`, expired or not.
pub(crate) async fn select<'e>(
    exec: impl SqliteExecutor<'e>,
    key: &RecordKey,
    operation: &'static str,
) -> Result<Option<Record>, Error> {
    let row = sqlx::query(&STATEMENTS.select)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .fetch_optional(exec)
        .await
        .map_err(|e| map_sqlx(e, operation, Some(key)))?;
    row.map(|row| decode(&row, key)).transpose()
}

/// Writes `record` under `key`, replacing whatever was there.
pub(crate) async fn put<'e>(
    exec: impl SqliteExecutor<'e>,
    key: &RecordKey,
    record: &Record,
) -> Result<(), Error> {
    sqlx::query(&STATEMENTS.put)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(record.status.as_str())
        .bind(record.owner.to_bytes().to_vec())
        .bind(i64::from(record.attempt))
        .bind(record.fingerprint.map(|f| f.as_bytes().to_vec()))
        .bind(record.result.as_deref())
        .bind(record.error.as_deref())
        .bind(record.retryable)
        .bind(ts(record.lease_until))
        .bind(ts(record.expires_at))
        .bind(ts(record.created_at))
        .bind(ts(record.updated_at))
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, "reserve", Some(key)))?;
    Ok(())
}

/// Applies `write` to the live `Processing` record `owner` holds under `key`,
/// in one statement; `LeaseLost` when there is none.
pub(crate) async fn write_owned<'e>(
    exec: impl SqliteExecutor<'e>,
    key: &RecordKey,
    owner: OwnerToken,
    now: Timestamp,
    write: OwnedWrite<'_>,
) -> Result<(), Error> {
    let operation = write.operation();
    let statements: &'static Statements = &STATEMENTS;
    let base = |sql: &'static str| {
        sqlx::query(sql)
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .bind(owner.to_bytes().to_vec())
            .bind(ts(now))
    };
    let query = match write {
        OwnedWrite::Finish {
            status,
            retryable,
            expires_at,
            ..
        } => {
            let (result, error) = write.columns();
            base(&statements.finish)
                .bind(status.as_str())
                .bind(result)
                .bind(error)
                .bind(retryable)
                .bind(ts(expires_at))
        }
        OwnedWrite::Extend {
            lease_until,
            expires_at,
        } => base(&statements.extend)
            .bind(ts(lease_until))
            .bind(ts(expires_at)),
        OwnedWrite::Release => base(&statements.release),
    };
    let done = query
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, operation, Some(key)))?;
    if done.rows_affected() == 0 {
        return Err(Error::LeaseLost { key: key.clone() });
    }
    Ok(())
}

/// The statements the repository runs, as text: for benchmarks against raw
/// sqlx and for operator tools. Built once; the owner-checked ones share one
/// condition.
#[derive(Debug)]
pub struct Statements {
    select: String,
    put: String,
    finish: String,
    extend: String,
    release: String,
}

impl Statements {
    /// The statements (the same for every repository: the table is fixed).
    pub fn get() -> &'static Statements {
        &STATEMENTS
    }

    /// Reads a record: binds namespace, id; columns status, owner, attempt,
    /// fingerprint, result, error, retryable, lease_until, expires_at,
    /// created_at, updated_at.
    pub fn select(&self) -> &str {
        &self.select
    }

    /// Writes a whole record (inside a reservation's transaction): binds
    /// namespace, id, then the columns of [`select`](Self::select).
    pub fn put(&self) -> &str {
        &self.put
    }

    /// Completes or fails the live record an owner holds: binds namespace,
    /// id, owner, now, status, result, error, retryable, expires_at.
    pub fn finish(&self) -> &str {
        &self.finish
    }
}

static STATEMENTS: LazyLock<Statements> = LazyLock::new(|| Statements {
    select: format!("SELECT {COLUMNS} FROM idempotency_records WHERE namespace = ?1 AND id = ?2"),
    put: format!(
        "INSERT OR REPLACE INTO idempotency_records (namespace, id, {COLUMNS}) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
    ),
    finish: format!(
        "UPDATE idempotency_records SET status = ?5, result = ?6, error = ?7, retryable = ?8, \
         expires_at = ?9, updated_at = ?4 WHERE {OWNED}"
    ),
    extend: format!(
        "UPDATE idempotency_records SET lease_until = MAX(lease_until, ?5), \
         expires_at = MAX(expires_at, ?6), \
         updated_at = ?4 WHERE {OWNED}"
    ),
    release: format!("DELETE FROM idempotency_records WHERE {OWNED}"),
});
