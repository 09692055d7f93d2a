//! The repository operations as single statements over any Postgres executor (the
//! pool, or a caller's connection or transaction).

use idempotency_core::{
    Capabilities, Error, OwnerToken, Record, RecordKey, Reservation, ReserveRequest, Status,
    StoredColumns, Timestamp,
};
use sqlx::postgres::PgRow;
use sqlx::{PgExecutor, Row};

use crate::error::map_sqlx;
use crate::names::Statements;

/// The longest id stored verbatim; longer ids are digested by the manager. With a
/// namespace of at most 512 bytes the primary-key entry stays far below the
/// B-tree limit of about 2.7 KB.
pub(crate) const MAX_ID_BYTES: usize = 1024;

/// The largest result or stored error accepted (16 MiB). `bytea` holds up to
/// 1 GB, but a result that large belongs in object storage, and every duplicate
/// reads it back in full.
pub(crate) const MAX_RESULT_BYTES: usize = 16 * 1024 * 1024;

/// A timestamp as the `bigint` the table stores (milliseconds; instants past
/// `i64::MAX` — year 292 million — clamp, which keeps their order).
pub(crate) fn ts(t: Timestamp) -> i64 {
    i64::try_from(t.as_millis()).unwrap_or(i64::MAX)
}

/// What this store holds: its name and limits (checked before every write).
pub(crate) fn capabilities() -> Capabilities {
    Capabilities::new(crate::error::BACKEND)
        .with_max_result_bytes(Some(MAX_RESULT_BYTES))
        .with_max_id_bytes(MAX_ID_BYTES)
        .with_native_expiry(false)
}

fn check_key(key: &RecordKey) -> Result<(), Error> {
    capabilities().check_id(key)
}

fn check_size(what: &'static str, value: Option<&[u8]>) -> Result<(), Error> {
    capabilities().check_value(what, value)
}

fn corrupt(e: sqlx::Error, key: &RecordKey) -> Error {
    Error::corrupt(key, e.to_string())
}

/// Decodes the record columns starting at `at` (see `RECORD_COLUMNS`).
pub(crate) fn decode_record(row: &PgRow, at: usize, key: &RecordKey) -> Result<Record, Error> {
    let corrupt = |e: sqlx::Error| corrupt(e, key);
    let status: String = row.try_get(at).map_err(corrupt)?;
    StoredColumns {
        status: status.into_bytes(),
        owner: row.try_get(at + 1).map_err(corrupt)?,
        attempt: row.try_get(at + 2).map_err(corrupt)?,
        fingerprint: row.try_get(at + 3).map_err(corrupt)?,
        result: row.try_get(at + 4).map_err(corrupt)?,
        error: row.try_get(at + 5).map_err(corrupt)?,
        retryable: row.try_get(at + 6).map_err(corrupt)?,
        lease_until: row.try_get(at + 7).map_err(corrupt)?,
        expires_at: row.try_get(at + 8).map_err(corrupt)?,
        created_at: row.try_get(at + 9).map_err(corrupt)?,
        updated_at: row.try_get(at + 10).map_err(corrupt)?,
    }
    .into_record(key)
}

/// `reserve`: one call of the reservation function created by the migration.
pub(crate) async fn reserve<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    req: &ReserveRequest<'_>,
) -> Result<Reservation, Error> {
    let key = req.key;
    check_key(key)?;
    let fingerprint = req.fingerprint.map(|f| f.as_bytes().to_vec());
    let row = sqlx::query(&sql.reserve)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(req.owner.to_bytes().to_vec())
        .bind(fingerprint)
        .bind(ts(req.now))
        .bind(ts(req.lease_cutoff()))
        .bind(ts(req.lease_until))
        .bind(ts(req.expires_at))
        .bind(req.retry_failed)
        .fetch_one(exec)
        .await
        .map_err(|e| map_sqlx(e, "reserve", Some(key), &sql.qualified))?;
    let acquired: bool = row.try_get(0).map_err(|e| corrupt(e, key))?;
    let record = decode_record(&row, 1, key)?;
    if acquired {
        if record.owner != req.owner {
            return Err(Error::corrupt(
                key,
                "reserve acquired the record for another owner",
            ));
        }
        Ok(Reservation::Acquired {
            attempt: record.attempt,
        })
    } else {
        Ok(Reservation::Existing(record))
    }
}

/// `complete` / `fail`: one owner-checked `UPDATE`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn finish<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
    owner: OwnerToken,
    status: Status,
    value: Option<&[u8]>,
    retryable: bool,
    expires_at: Timestamp,
    now: Timestamp,
) -> Result<(), Error> {
    check_key(key)?;
    let (statement, operation, what) = match status {
        Status::Completed => (&sql.complete, "complete", "result"),
        _ => (&sql.fail, "fail", "error"),
    };
    check_size(what, value)?;
    let mut query = sqlx::query(statement)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(owner.to_bytes().to_vec())
        .bind(value)
        .bind(ts(expires_at))
        .bind(ts(now));
    if status == Status::Failed {
        query = query.bind(retryable);
    }
    let done = query
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, operation, Some(key), &sql.qualified))?;
    owned(done.rows_affected(), key)
}

/// `release`: one owner-checked `DELETE`.
pub(crate) async fn release<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
    owner: OwnerToken,
    now: Timestamp,
) -> Result<(), Error> {
    check_key(key)?;
    let done = sqlx::query(&sql.release)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(owner.to_bytes().to_vec())
        .bind(ts(now))
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, "release", Some(key), &sql.qualified))?;
    owned(done.rows_affected(), key)
}

/// `extend`: one owner-checked `UPDATE`.
pub(crate) async fn extend<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
    owner: OwnerToken,
    lease_until: Timestamp,
    expires_at: Timestamp,
    now: Timestamp,
) -> Result<(), Error> {
    check_key(key)?;
    let done = sqlx::query(&sql.extend)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(owner.to_bytes().to_vec())
        .bind(ts(lease_until))
        .bind(ts(now))
        .bind(ts(expires_at))
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, "extend", Some(key), &sql.qualified))?;
    owned(done.rows_affected(), key)
}

fn owned(rows: u64, key: &RecordKey) -> Result<(), Error> {
    if rows == 0 {
        Err(Error::LeaseLost { key: key.clone() })
    } else {
        Ok(())
    }
}

/// `get`: one `SELECT` of the live record.
pub(crate) async fn get<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
    now: Timestamp,
) -> Result<Option<Record>, Error> {
    check_key(key)?;
    let row = sqlx::query(&sql.get)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(ts(now))
        .fetch_optional(exec)
        .await
        .map_err(|e| map_sqlx(e, "get", Some(key), &sql.qualified))?;
    row.map(|row| decode_record(&row, 0, key)).transpose()
}

/// `delete`: one `DELETE` whatever the state.
pub(crate) async fn delete<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
) -> Result<bool, Error> {
    check_key(key)?;
    let done = sqlx::query(&sql.delete)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, "delete", Some(key), &sql.qualified))?;
    Ok(done.rows_affected() > 0)
}

/// `purge_expired`: one batched `DELETE` of up to `limit` expired rows, oldest
/// first through the `expires_at` index, skipping rows another purger (or a
/// reservation) has locked.
pub(crate) async fn purge<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    now: Timestamp,
    limit: usize,
) -> Result<usize, Error> {
    if limit == 0 {
        return Ok(0);
    }
    let done = sqlx::query(&sql.purge)
        .bind(ts(now))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, "purge_expired", None, &sql.qualified))?;
    Ok(usize::try_from(done.rows_affected()).unwrap_or(usize::MAX))
}
