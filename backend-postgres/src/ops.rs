//! The repository operations as single statements over any Postgres executor (the
//! pool, or a caller's connection or transaction).

use idempotency_core::{
    Capabilities, Completion, Error, OwnerToken, Record, RecordKey, Reservation, ReserveRequest,
    Status, StoredColumns, Timestamp,
};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgExecutor, Row};

use crate::error::map_sqlx;
use crate::names::{On, Statements};
use crate::plan::First;

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

/// `reserve`, starting with the statement `first` names: the reservation
/// function (every case, one round trip), or one of its own two plain
/// statements, which answers only the case it decides alone (the insert a
/// fresh key, the read a duplicate or a re-sent reserve); without an answer
/// from it, the function decides, on the same connection. On a caller's
/// connection (`on`), always the function.
pub(crate) async fn reserve(
    sql: &Statements,
    conn: &mut PgConnection,
    req: &ReserveRequest<'_>,
    first: First,
    on: On,
) -> Result<Reservation, Error> {
    check_key(req.key)?;
    let speculative = match (first, on) {
        (First::Function, _) | (_, On::Caller) => None,
        (First::Insert, On::Own) => Some(&sql.reserve_insert),
        (First::Read, On::Own) => Some(&sql.reserve_read),
    };
    if let Some(statement) = speculative {
        let row = reserve_query(statement, req)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| reserve_error(e, req.key, sql))?;
        if let Some(row) = row {
            return reservation_of(&row, req);
        }
    }
    let row = reserve_query(&sql.writes(on).reserve, req)
        .fetch_one(conn)
        .await
        .map_err(|e| reserve_error(e, req.key, sql))?;
    reservation_of(&row, req)
}

/// The error of a single reservation. Its statement waited for a row lock
/// past its `lock_timeout` (`55P03`): another transaction holds the key (its
/// reservation not yet committed, as the transactional mode's until it
/// ends, or the row locked), and nothing of the statement was applied. The
/// store answered, and the key is held: [`Error::InProgress`], never an
/// outage, with the wait as the hint when to try again.
fn reserve_error(e: sqlx::Error, key: &RecordKey, sql: &Statements) -> Error {
    if sqlstate(&e).as_deref() == Some("55P03") {
        tracing::debug!(key = %key, error = %e, "reserve: the key is locked by another transaction; answering in progress");
        return Error::InProgress {
            key: key.clone(),
            retry_after: sql.lock_timeout,
        };
    }
    map_sqlx(e, "reserve", Some(key), &sql.qualified)
}

/// The SQLSTATE of a server error.
fn sqlstate(e: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    e.as_database_error().and_then(|d| d.code())
}

/// A reservation statement with the request's parameters, in the order of
/// the reservation function's.
fn reserve_query<'q>(
    statement: &'q str,
    req: &ReserveRequest<'q>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(statement)
        .bind(req.key.namespace().as_bytes())
        .bind(req.key.id().as_bytes())
        .bind(req.owner.to_bytes().to_vec())
        .bind(req.fingerprint.map(|f| f.as_bytes().to_vec()))
        .bind(ts(req.now))
        .bind(ts(req.lease_cutoff()))
        .bind(ts(req.lease_until))
        .bind(ts(req.expires_at))
        .bind(req.retry_failed)
}

/// `reserve` for many keys in one statement: the reservation function over
/// arrays (`unnest … CROSS JOIN LATERAL`), one row per request. The requests
/// are sent in key order, so that two batches lock shared keys in the same
/// order; the answers come back in the caller's order. A request whose key the
/// table cannot hold is answered on its own; an error of the statement is
/// every request's.
pub(crate) async fn reserve_many<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    requests: &[ReserveRequest<'_>],
) -> Vec<Result<Reservation, Error>> {
    let (mut answers, sent) = checked_in_key_order(requests);
    if sent.is_empty() {
        return answered(answers, "reserve");
    }
    match reserve_arrays(&sql.reserve_many, requests, &sent)
        .fetch_all(exec)
        .await
    {
        Ok(rows) if rows.len() == sent.len() => {
            for (position, (row, &i)) in rows.iter().zip(&sent).enumerate() {
                answers[i] = Some(batch_row(row, &requests[i], position));
            }
        }
        Ok(rows) => {
            let e = Error::Unavailable {
                backend: crate::error::BACKEND,
                message: format!("reserve: {} rows for {} requests", rows.len(), sent.len()),
                source: None,
            };
            for &i in &sent {
                answers[i] = Some(Err(e.for_another()));
            }
        }
        Err(e) => {
            let e = batch_error(e, "reserve", sql);
            for &i in &sent {
                answers[i] = Some(Err(e.for_another()));
            }
        }
    }
    answered(answers, "reserve")
}

/// Reservations of distinct keys (a batch's, or coalesced calls'): starting
/// with the statement `first` names over arrays (the plain insert or the
/// plain read of [`reserve`], each answering only what it decides alone),
/// then the reservation function over arrays for the requests it left, on
/// the same connection.
pub(crate) async fn reserve_planned_many(
    sql: &Statements,
    conn: &mut PgConnection,
    requests: &[ReserveRequest<'_>],
    first: First,
) -> Vec<Result<Reservation, Error>> {
    let statement = match first {
        First::Function => return reserve_many(sql, conn, requests).await,
        First::Insert => &sql.reserve_insert_many,
        First::Read => &sql.reserve_read_many,
    };
    let (mut answers, sent) = checked_in_key_order(requests);
    if sent.is_empty() {
        return answered(answers, "reserve");
    }
    let mut query = reserve_arrays(statement, requests, &sent);
    if first == First::Read {
        query = query.bind(length(&sent));
    }
    match query.fetch_all(&mut *conn).await {
        Ok(rows) => {
            // A row naming no request (never expected) answers nothing: its
            // request goes to the function, which answers a re-sent reserve
            // of the same owner as acquired.
            for row in &rows {
                if let Some(i) = answered_request(row, first, requests, &sent) {
                    answers[i] = Some(reservation_of(row, &requests[i]));
                }
            }
        }
        Err(e) => {
            let e = batch_error(e, "reserve", sql);
            for &i in &sent {
                answers[i] = Some(Err(e.for_another()));
            }
        }
    }
    let rest: Vec<usize> = sent.into_iter().filter(|&i| answers[i].is_none()).collect();
    if !rest.is_empty() {
        let left: Vec<ReserveRequest<'_>> = rest.iter().map(|&i| requests[i].clone()).collect();
        let decided = reserve_many(sql, conn, &left).await;
        for (i, answer) in rest.into_iter().zip(decided) {
            answers[i] = Some(answer);
        }
    }
    answered(answers, "reserve")
}

/// Which request a row of a plain statement over arrays answers: the read
/// ends with the request's position in `sent` (from 1), the insert with the
/// key it inserted, found by binary search in `sent`, which is in key order
/// (a key sent twice, never expected: the first, the one the insert took).
fn answered_request(
    row: &PgRow,
    first: First,
    requests: &[ReserveRequest<'_>],
    sent: &[usize],
) -> Option<usize> {
    let last = row.len().checked_sub(1)?;
    if first == First::Read {
        let ord: i64 = row.try_get(last).ok()?;
        return sent
            .get(usize::try_from(ord).ok()?.checked_sub(1)?)
            .copied();
    }
    let namespace: &[u8] = row.try_get(last.checked_sub(1)?).ok()?;
    let id: &[u8] = row.try_get(last).ok()?;
    let bytes = |i: usize| {
        let key = requests[i].key;
        (key.namespace().as_bytes(), key.id().as_bytes())
    };
    let at = sent.partition_point(|&i| bytes(i) < (namespace, id));
    sent.get(at)
        .copied()
        .filter(|&i| bytes(i) == (namespace, id))
}

/// The `LIMIT` of a statement joining arrays of `sent`'s length to the table
/// (see `names.rs`).
fn length(sent: &[usize]) -> i64 {
    i64::try_from(sent.len()).unwrap_or(i64::MAX)
}

/// The answers so far (a key the table cannot hold is answered at once) and
/// the positions of the requests to send, in key order, so that two batches
/// lock shared keys in the same order.
fn checked_in_key_order(
    requests: &[ReserveRequest<'_>],
) -> (Vec<Option<Result<Reservation, Error>>>, Vec<usize>) {
    let mut answers = Vec::with_capacity(requests.len());
    let mut sent = Vec::with_capacity(requests.len());
    for (i, req) in requests.iter().enumerate() {
        match check_key(req.key) {
            Ok(()) => {
                answers.push(None);
                sent.push(i);
            }
            Err(e) => answers.push(Some(Err(e))),
        }
    }
    sent.sort_by(|&a, &b| requests[a].key.cmp(requests[b].key));
    (answers, sent)
}

/// A reservation statement over arrays (the reservation function's
/// parameters, one element per request of `sent`, in that order).
fn reserve_arrays<'q>(
    statement: &'q str,
    requests: &[ReserveRequest<'_>],
    sent: &[usize],
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let column = |f: &dyn Fn(&ReserveRequest<'_>) -> Vec<u8>| -> Vec<Vec<u8>> {
        sent.iter().map(|&i| f(&requests[i])).collect()
    };
    let times = |f: &dyn Fn(&ReserveRequest<'_>) -> Timestamp| -> Vec<i64> {
        sent.iter().map(|&i| ts(f(&requests[i]))).collect()
    };
    sqlx::query(statement)
        .bind(column(&|r| r.key.namespace().as_bytes().to_vec()))
        .bind(column(&|r| r.key.id().as_bytes().to_vec()))
        .bind(column(&|r| r.owner.to_bytes().to_vec()))
        .bind(
            sent.iter()
                .map(|&i| requests[i].fingerprint.map(|f| f.as_bytes().to_vec()))
                .collect::<Vec<Option<Vec<u8>>>>(),
        )
        .bind(times(&|r| r.now))
        .bind(times(&|r| r.lease_cutoff()))
        .bind(times(&|r| r.lease_until))
        .bind(times(&|r| r.expires_at))
        .bind(
            sent.iter()
                .map(|&i| requests[i].retry_failed)
                .collect::<Vec<bool>>(),
        )
}

/// Every answer, a request left unanswered being an error (a bug, never
/// expected).
fn answered<T>(answers: Vec<Option<Result<T, Error>>>, operation: &str) -> Vec<Result<T, Error>> {
    answers
        .into_iter()
        .map(|a| a.unwrap_or_else(|| Err(unanswered(operation))))
        .collect()
}

/// The row of [`reserve_many`] at `position` (of the key order sent).
fn batch_row(row: &PgRow, req: &ReserveRequest<'_>, position: usize) -> Result<Reservation, Error> {
    let ord: i64 = row
        .try_get(row.len() - 1)
        .map_err(|e| corrupt(e, req.key))?;
    if usize::try_from(ord).ok() != Some(position + 1) {
        return Err(Error::corrupt(
            req.key,
            "reserve: the rows came back out of order",
        ));
    }
    reservation_of(row, req)
}

/// The reservation a row of the reservation function says.
fn reservation_of(row: &PgRow, req: &ReserveRequest<'_>) -> Result<Reservation, Error> {
    let key = req.key;
    let acquired: bool = row.try_get(0).map_err(|e| corrupt(e, key))?;
    let record = decode_record(row, 1, key)?;
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

/// `complete` for many records in one owner-checked `UPDATE … FROM unnest(…)`:
/// the rows it returns were applied, the others are `LeaseLost` (each write
/// has exactly `complete`'s conditions). Sent in key order, like
/// [`reserve_many`]; a write the table cannot hold is answered on its own.
/// `now(i)` is write `i`'s instant (a batch of the trait shares one; writes
/// coalesced from separate calls keep each their own).
pub(crate) async fn complete_many<'e>(
    sql: &Statements,
    exec: impl PgExecutor<'e>,
    writes: &[Completion<'_>],
    now: impl Fn(usize) -> Timestamp,
) -> Vec<Result<(), Error>> {
    let mut answers: Vec<Option<Result<(), Error>>> = Vec::with_capacity(writes.len());
    let mut sent: Vec<usize> = Vec::with_capacity(writes.len());
    for (i, w) in writes.iter().enumerate() {
        match check_key(w.key).and_then(|()| check_size("result", w.result)) {
            Ok(()) => {
                answers.push(None);
                sent.push(i);
            }
            Err(e) => answers.push(Some(Err(e))),
        }
    }
    sent.sort_by(|&a, &b| writes[a].key.cmp(writes[b].key));
    if sent.is_empty() {
        return answered(answers, "complete");
    }
    let bytes = |f: &dyn Fn(&Completion<'_>) -> Vec<u8>| -> Vec<Vec<u8>> {
        sent.iter().map(|&i| f(&writes[i])).collect()
    };
    let query = sqlx::query(&sql.complete_many)
        .bind(bytes(&|w| w.key.namespace().as_bytes().to_vec()))
        .bind(bytes(&|w| w.key.id().as_bytes().to_vec()))
        .bind(bytes(&|w| w.owner.to_bytes().to_vec()))
        .bind(
            sent.iter()
                .map(|&i| writes[i].result.map(<[u8]>::to_vec))
                .collect::<Vec<Option<Vec<u8>>>>(),
        )
        .bind(
            sent.iter()
                .map(|&i| ts(writes[i].expires_at))
                .collect::<Vec<i64>>(),
        )
        .bind(sent.iter().map(|&i| ts(now(i))).collect::<Vec<i64>>())
        .bind(length(&sent));
    match query.fetch_all(exec).await {
        Ok(rows) => {
            let ords: Result<Vec<i64>, _> = rows.iter().map(|r| r.try_get::<i64, _>(0)).collect();
            let Ok(ords) = ords else {
                // Applied, but which rows is unknown: as ambiguous as a lost
                // reply, so that each write is retried and recognised.
                for &i in &sent {
                    answers[i] = Some(Err(Error::Unavailable {
                        backend: crate::error::BACKEND,
                        message: "complete: the applied rows could not be read".into(),
                        source: None,
                    }));
                }
                return answered(answers, "complete");
            };
            let mut applied = vec![false; sent.len()];
            for ord in ords {
                if let Some(slot) = usize::try_from(ord - 1)
                    .ok()
                    .and_then(|p| applied.get_mut(p))
                {
                    *slot = true;
                }
            }
            for (position, &i) in sent.iter().enumerate() {
                answers[i] = Some(if applied[position] {
                    Ok(())
                } else {
                    Err(Error::LeaseLost {
                        key: writes[i].key.clone(),
                    })
                });
            }
        }
        Err(e) => {
            let e = batch_error(e, "complete", sql);
            for &i in &sent {
                answers[i] = Some(Err(e.for_another()));
            }
        }
    }
    answered(answers, "complete")
}

/// The error of a batch statement. A key locked past the batch's
/// `lock_timeout` (`55P03`) refused the whole statement, nothing of it
/// applied: a definite `Backend` error rather than an ambiguous `Timeout`, so
/// that the manager sends each of its keys on its own at once, none counted
/// as a lost write. (Keys an earlier statement of the same call answered,
/// such as the plan's plain insert, keep their answers.)
fn batch_error(e: sqlx::Error, operation: &'static str, sql: &Statements) -> Error {
    if sqlstate(&e).as_deref() == Some("55P03") {
        return Error::Backend {
            backend: crate::error::BACKEND,
            message: format!(
                "{operation}: a key of the batch statement was locked by another transaction \
                 past the statement's lock_timeout; nothing of that statement was applied"
            ),
            source: Some(Box::new(e)),
        };
    }
    map_sqlx(e, operation, None, &sql.qualified)
}

/// The error of a request a batch left unanswered (a bug, never expected).
fn unanswered(operation: &str) -> Error {
    Error::Backend {
        backend: crate::error::BACKEND,
        message: format!("{operation}: a request was left unanswered"),
        source: None,
    }
}

/// `complete` / `fail`: one owner-checked `UPDATE`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn finish<'e>(
    sql: &Statements,
    on: On,
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
        Status::Completed => (&sql.writes(on).complete, "complete", "result"),
        _ => (&sql.writes(on).fail, "fail", "error"),
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
    on: On,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
    owner: OwnerToken,
    now: Timestamp,
) -> Result<(), Error> {
    check_key(key)?;
    let done = sqlx::query(&sql.writes(on).release)
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
#[allow(clippy::too_many_arguments)]
pub(crate) async fn extend<'e>(
    sql: &Statements,
    on: On,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
    owner: OwnerToken,
    lease_until: Timestamp,
    expires_at: Timestamp,
    now: Timestamp,
) -> Result<(), Error> {
    check_key(key)?;
    let done = sqlx::query(&sql.writes(on).extend)
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
    on: On,
    exec: impl PgExecutor<'e>,
    key: &RecordKey,
) -> Result<bool, Error> {
    check_key(key)?;
    let done = sqlx::query(&sql.writes(on).delete)
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .execute(exec)
        .await
        .map_err(|e| map_sqlx(e, "delete", Some(key), &sql.qualified))?;
    Ok(done.rows_affected() > 0)
}

/// `purge_expired`: one batched `DELETE` of up to `limit` expired rows, oldest
/// first through the `purge_after` index, skipping rows another purger (or a
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
