//! The repository's statements, how rows decode into records, and the
//! reservation.

use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    Capabilities, Error, OwnedWrite, OwnerToken, Record, RecordKey, Reservation, ReserveRequest,
    StoredColumns, Timestamp,
};
use sqlx::mysql::MySqlRow;
use sqlx::{MySqlExecutor, MySqlPool, Row};

use crate::error::{code, deadlocked, map_sqlx, number, BACKEND};

/// The longest id stored verbatim (the column is `VARBINARY(1024)`); longer
/// ids are digested by the manager.
pub(crate) const MAX_ID_BYTES: usize = 1024;

/// The largest result or stored error accepted when the server allows it
/// (64 MiB; a `LONGBLOB` holds 4 GiB, but every duplicate reads the result
/// back in full). The server's `max_allowed_packet` lowers it: see
/// [`capabilities`].
pub(crate) const MAX_RESULT_BYTES: usize = 64 * 1024 * 1024;

/// Room left in a packet for the statement around a value (key, owner,
/// timestamps: under 2 KiB; the rest is margin).
pub(crate) const PACKET_HEADROOM: usize = 64 * 1024;

/// How often a reservation starts over when the record it found vanished
/// before it could lock it (an operator's delete or a purge between two
/// statements) or InnoDB chose it as a deadlock's victim; more means a
/// pathological churn, reported as a retryable [`Error::Unavailable`].
const RESERVE_ROUNDS: usize = 4;

pub(crate) const COLUMNS: &str = "status, owner, attempt, fingerprint, result, error, retryable, \
                       lease_until, expires_at, created_at, updated_at";

/// The condition every owner-checked write shares: the live `processing`
/// record `owner` holds (binds namespace, id, owner, now).
const OWNED: &str =
    "namespace = ? AND id = ? AND owner = ? AND status = 'processing' AND expires_at > ?";

/// The condition of a takeover's compare-and-set: the row is still the one
/// the decision was made on — the columns the decision reads, and the owner,
/// attempt and last write (binds status, owner, attempt, fingerprint,
/// lease_until, expires_at, updated_at; `<=>` is NULL-safe). `retryable`
/// only changes with `status` and `updated_at`.
const UNCHANGED: &str = "status = ? AND owner = ? AND attempt = ? AND fingerprint <=> ? \
                         AND lease_until = ? AND expires_at = ? AND updated_at = ?";

/// A timestamp as the BIGINT the table stores (milliseconds; instants past
/// `i64::MAX` clamp, which keeps their order).
pub(crate) fn ts(t: Timestamp) -> i64 {
    i64::try_from(t.as_millis()).unwrap_or(i64::MAX)
}

/// What this store holds, given the server's `max_allowed_packet`: a value
/// must fit in one statement's packet, with room for the rest of it.
pub(crate) fn capabilities(max_allowed_packet: Option<u64>) -> Capabilities {
    let packet_cap = max_allowed_packet
        .map(|p| usize::try_from(p).unwrap_or(usize::MAX))
        .map(|p| p.saturating_sub(PACKET_HEADROOM));
    let max = packet_cap.map_or(MAX_RESULT_BYTES, |p| p.min(MAX_RESULT_BYTES));
    Capabilities::new(BACKEND)
        .with_max_result_bytes(Some(max))
        .with_max_id_bytes(MAX_ID_BYTES)
}

/// The statements of one table, built once per repository. Binds are `?`,
/// in the order they appear.
#[derive(Debug)]
pub struct Statements {
    table: String,
    select: String,
    insert: String,
    replace_if_unchanged: String,
    finish: String,
    extend: String,
    release: String,
    delete: String,
    purge_select: String,
}

impl Statements {
    /// The statements for `table` (a name [`valid_table`] accepted).
    pub(crate) fn new(table: &str) -> Statements {
        let t = format!("`{table}`");
        let key = "namespace = ? AND id = ?";
        Statements {
            select: format!("SELECT {COLUMNS} FROM {t} WHERE {key}"),
            insert: format!(
                "INSERT INTO {t} (namespace, id, {COLUMNS}) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            ),
            replace_if_unchanged: format!(
                "UPDATE {t} SET status = ?, owner = ?, attempt = ?, fingerprint = ?, result = ?, \
                 error = ?, retryable = ?, lease_until = ?, expires_at = ?, created_at = ?, \
                 updated_at = ? WHERE {key} AND {UNCHANGED}"
            ),
            finish: format!(
                "UPDATE {t} SET status = ?, result = ?, error = ?, retryable = ?, \
                 expires_at = ?, updated_at = ? WHERE {OWNED}"
            ),
            extend: format!(
                "UPDATE {t} SET lease_until = GREATEST(lease_until, ?), \
                 expires_at = GREATEST(expires_at, ?), \
                 updated_at = ? WHERE {OWNED}"
            ),
            release: format!("DELETE FROM {t} WHERE {OWNED}"),
            delete: format!("DELETE FROM {t} WHERE {key}"),
            purge_select: format!(
                "SELECT namespace, id FROM {t} WHERE expires_at <= ? ORDER BY expires_at LIMIT ?"
            ),
            table: table.to_owned(),
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Reads a record: binds namespace, id; columns status, owner, attempt,
    /// fingerprint, result, error, retryable, lease_until, expires_at,
    /// created_at, updated_at.
    pub fn select(&self) -> &str {
        &self.select
    }

    /// Creates a record (a fresh key's reservation): binds namespace, id, then
    /// the columns of [`select`](Self::select).
    pub fn insert(&self) -> &str {
        &self.insert
    }

    /// Completes or fails the live record an owner holds: binds status,
    /// result, error, retryable, expires_at, now, then namespace, id, owner,
    /// now.
    pub fn finish(&self) -> &str {
        &self.finish
    }
}

/// Whether `table` is a name this crate puts in its statements: an unquoted
/// MySQL identifier of at most 64 ASCII letters, digits and underscores, not
/// starting with a digit.
pub(crate) fn valid_table(table: &str) -> Result<(), Error> {
    let ok = !table.is_empty()
        && table.len() <= 64
        && table
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !table.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "invalid MySQL table name {table:?}: use at most 64 ASCII letters, digits and \
             underscores, not starting with a digit"
        )))
    }
}

/// Decodes a row of [`COLUMNS`]; anything out of shape is `Corrupt` naming
/// the key, never a panic and never a record made up. (An `ascii_bin`
/// status column reaches sqlx as binary: it is read as bytes.)
pub(crate) fn decode(row: &MySqlRow, key: &RecordKey) -> Result<Record, Error> {
    let corrupt = |e: sqlx::Error| Error::corrupt(key, e.to_string());
    let attempt: u32 = row.try_get(2).map_err(corrupt)?;
    let retryable: i8 = row.try_get(6).map_err(corrupt)?;
    StoredColumns {
        status: row.try_get(0).map_err(corrupt)?,
        owner: row.try_get(1).map_err(corrupt)?,
        attempt: i64::from(attempt),
        fingerprint: row.try_get(3).map_err(corrupt)?,
        result: row.try_get(4).map_err(corrupt)?,
        error: row.try_get(5).map_err(corrupt)?,
        retryable: retryable != 0,
        lease_until: row.try_get(7).map_err(corrupt)?,
        expires_at: row.try_get(8).map_err(corrupt)?,
        created_at: row.try_get(9).map_err(corrupt)?,
        updated_at: row.try_get(10).map_err(corrupt)?,
    }
    .into_record(key)
}

/// The stored record under `key`, expired or not.
pub(crate) async fn select<'e>(
    sql: &Statements,
    exec: impl MySqlExecutor<'e>,
    key: &RecordKey,
    operation: &'static str,
) -> Result<Option<Record>, Error> {
    let row = sqlx::query(&sql.select)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .fetch_optional(exec)
        .await
        .map_err(|e| map_sqlx(e, operation, Some(key), &sql.table))?;
    row.map(|row| decode(&row, key)).transpose()
}

type Query<'q> = sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>;

/// Binds every column of `r`, in the order of [`COLUMNS`].
fn bind_record<'q>(query: Query<'q>, r: &'q Record) -> Query<'q> {
    query
        .bind(r.status.as_str())
        .bind(r.owner.to_bytes().to_vec())
        .bind(r.attempt)
        .bind(r.fingerprint.map(|f| f.as_bytes().to_vec()))
        .bind(r.result.as_deref())
        .bind(r.error.as_deref())
        .bind(r.retryable)
        .bind(ts(r.lease_until))
        .bind(ts(r.expires_at))
        .bind(ts(r.created_at))
        .bind(ts(r.updated_at))
}

/// Inserts `record` for a key that has none; `false` when one exists.
async fn insert(
    sql: &Statements,
    pool: &MySqlPool,
    key: &RecordKey,
    r: &Record,
) -> Result<bool, Error> {
    let query = sqlx::query(&sql.insert)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes());
    let done = bind_record(query, r).execute(pool).await;
    match done {
        Ok(_) => Ok(true),
        Err(e) if number(&e) == Some(code::DUP_ENTRY) => Ok(false),
        Err(e) => Err(map_sqlx(e, "reserve", Some(key), &sql.table)),
    }
}

/// Replaces the record under `key` with `new` if it is still `old` (a
/// compare-and-set in one statement); whether it was.
async fn replace_if_unchanged(
    sql: &Statements,
    pool: &MySqlPool,
    key: &RecordKey,
    old: &Record,
    new: &Record,
) -> Result<bool, Error> {
    let done = bind_record(sqlx::query(&sql.replace_if_unchanged), new)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(old.status.as_str())
        .bind(old.owner.to_bytes().to_vec())
        .bind(old.attempt)
        .bind(old.fingerprint.map(|f| f.as_bytes().to_vec()))
        .bind(ts(old.lease_until))
        .bind(ts(old.expires_at))
        .bind(ts(old.updated_at))
        .execute(pool)
        .await
        .map_err(|e| map_sqlx(e, "reserve", Some(key), &sql.table))?;
    // CLIENT_FOUND_ROWS: rows matched.
    Ok(done.rows_affected() == 1)
}

/// The reservation, never a read-then-write race, and never an interactive
/// transaction (a call cancelled between `BEGIN` and its reply would leave
/// an open transaction, holding locks and uncommitted rows, on a pooled
/// connection). Each step is one autocommitted statement:
///
/// 1. a fresh key is one `INSERT` (the primary key makes it atomic: of two
///    racing inserts one fails with a duplicate-key error);
/// 2. an existing key is read with a plain `SELECT`, and the core decides
///    (`reserve_transition`, the rule every store applies): a duplicate, an
///    in-progress answer or our own live reservation is answered from that
///    read, a consistent snapshot of the row;
/// 3. when the read says the key may be taken over (expired, lease ended,
///    failed and retryable), one `UPDATE` replaces the row *if it is still
///    the row read* (a compare-and-set on every column the decision read):
///    of two consumers taking over from the same row, one matches it; the
///    other finds it changed and starts over, and then sees the first's
///    reservation.
///
/// A round starts over when the row vanished or changed between its
/// statements, and after a deadlock (InnoDB rolled the statement back whole,
/// so nothing of it applied).
pub(crate) async fn reserve(
    sql: &Statements,
    pool: &MySqlPool,
    req: &ReserveRequest<'_>,
) -> Result<Reservation, Error> {
    let key = req.key;
    for round in 1..=RESERVE_ROUNDS {
        match reserve_round(sql, pool, req).await {
            Ok(Some(answer)) => return Ok(answer),
            Ok(None) => {}
            Err(e) if deadlocked(&e) && round < RESERVE_ROUNDS => {}
            Err(e) => return Err(e),
        }
    }
    Err(Error::Unavailable {
        backend: BACKEND,
        message: format!(
            "reserve: {RESERVE_ROUNDS} rounds on {key} each found its record changed, removed or \
             deadlocked; retry"
        ),
        source: None,
    })
}

/// One round of [`reserve`]; `None` when the record changed under it.
async fn reserve_round(
    sql: &Statements,
    pool: &MySqlPool,
    req: &ReserveRequest<'_>,
) -> Result<Option<Reservation>, Error> {
    let key = req.key;
    if insert(sql, pool, key, &reserved_record(None, req, 1)).await? {
        return Ok(Some(Reservation::Acquired { attempt: 1 }));
    }
    let Some(existing) = select(sql, pool, key, "reserve").await? else {
        return Ok(None);
    };
    let (new, attempt) = match reserve_transition(Some(&existing), req) {
        ReserveTransition::Existing => return Ok(Some(Reservation::Existing(existing))),
        ReserveTransition::AlreadyHeld { attempt } => {
            return Ok(Some(Reservation::Acquired { attempt }))
        }
        ReserveTransition::Create => (reserved_record(None, req, 1), 1),
        ReserveTransition::Takeover { attempt } => {
            (reserved_record(Some(&existing), req, attempt), attempt)
        }
    };
    let taken = replace_if_unchanged(sql, pool, key, &existing, &new).await?;
    Ok(taken.then_some(Reservation::Acquired { attempt }))
}

/// Applies `write` to the live `Processing` record `owner` holds under `key`,
/// in one statement; `LeaseLost` when there is none.
pub(crate) async fn write_owned(
    sql: &Statements,
    pool: &MySqlPool,
    key: &RecordKey,
    owner: OwnerToken,
    now: Timestamp,
    write: OwnedWrite<'_>,
) -> Result<(), Error> {
    let operation = write.operation();
    let query = match write {
        OwnedWrite::Finish {
            status,
            retryable,
            expires_at,
            ..
        } => {
            let (result, error) = write.columns();
            sqlx::query(&sql.finish)
                .bind(status.as_str())
                .bind(result)
                .bind(error)
                .bind(retryable)
                .bind(ts(expires_at))
                .bind(ts(now))
        }
        OwnedWrite::Extend {
            lease_until,
            expires_at,
        } => sqlx::query(&sql.extend)
            .bind(ts(lease_until))
            .bind(ts(expires_at))
            .bind(ts(now)),
        OwnedWrite::Release => sqlx::query(&sql.release),
    };
    let done = query
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .bind(owner.to_bytes().to_vec())
        .bind(ts(now))
        .execute(pool)
        .await
        .map_err(|e| map_sqlx(e, operation, Some(key), &sql.table))?;
    // sqlx connects with CLIENT_FOUND_ROWS: rows matched, not rows changed,
    // so a write that leaves every column as it was still counts.
    if done.rows_affected() == 0 {
        return Err(Error::LeaseLost { key: key.clone() });
    }
    Ok(())
}

/// Removes the record under `key`; whether there was one.
pub(crate) async fn delete(
    sql: &Statements,
    pool: &MySqlPool,
    key: &RecordKey,
) -> Result<bool, Error> {
    let done = sqlx::query(&sql.delete)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .execute(pool)
        .await
        .map_err(|e| map_sqlx(e, "delete", Some(key), &sql.table))?;
    Ok(done.rows_affected() > 0)
}

/// Records a purge removes per statement.
const PURGE_CHUNK: usize = 100;

/// Removes up to `limit` expired records, oldest expiry first, in chunks: a
/// non-locking read of the next chunk's keys (through the `expires_at`
/// index), then one `DELETE` of those keys through the primary key (forced:
/// a range of the `expires_at` index would lock its gaps and block the
/// reservations inserting into them) that checks the expiry again (a key
/// reserved anew in between is kept). Each chunk has `chunk_timeout`; a
/// timeout after some progress returns the progress.
pub(crate) async fn purge(
    sql: &Statements,
    pool: &MySqlPool,
    now: Timestamp,
    limit: usize,
    chunk_timeout: std::time::Duration,
) -> Result<usize, Error> {
    let mut purged = 0;
    while purged < limit {
        let chunk = PURGE_CHUNK.min(limit - purged);
        let removed = tokio::time::timeout(chunk_timeout, purge_chunk(sql, pool, now, chunk)).await;
        let (selected, removed) = match removed {
            Ok(done) => done?,
            Err(_) if purged > 0 => break,
            Err(_) => {
                return Err(Error::Timeout {
                    backend: BACKEND,
                    operation: "purge_expired",
                })
            }
        };
        purged += removed;
        if selected < chunk || removed == 0 {
            break;
        }
    }
    Ok(purged)
}

/// One chunk of [`purge`]: how many keys it selected and how many it removed.
async fn purge_chunk(
    sql: &Statements,
    pool: &MySqlPool,
    now: Timestamp,
    chunk: usize,
) -> Result<(usize, usize), Error> {
    let map = |e| map_sqlx(e, "purge_expired", None, &sql.table);
    let keys: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(&sql.purge_select)
        .bind(ts(now))
        .bind(u64::try_from(chunk).unwrap_or(u64::MAX))
        .fetch_all(pool)
        .await
        .map_err(map)?;
    if keys.is_empty() {
        return Ok((0, 0));
    }
    let matches = vec!["(namespace = ? AND id = ?)"; keys.len()].join(" OR ");
    let text = format!(
        "DELETE t FROM `{}` AS t FORCE INDEX (PRIMARY) WHERE expires_at <= ? AND ({matches})",
        sql.table
    );
    let mut delete = sqlx::query(&text).bind(ts(now));
    for (namespace, id) in &keys {
        delete = delete.bind(namespace.as_slice()).bind(id.as_slice());
    }
    let done = delete.execute(pool).await.map_err(map)?;
    let removed = usize::try_from(done.rows_affected()).unwrap_or(usize::MAX);
    Ok((keys.len(), removed))
}
