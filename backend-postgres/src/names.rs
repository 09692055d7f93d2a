//! Validated identifiers and the SQL rendered from them.

use std::time::Duration;

use idempotency_core::Error;

/// The default schema.
pub(crate) const DEFAULT_SCHEMA: &str = "public";
/// The default table.
pub(crate) const DEFAULT_TABLE: &str = "idempotency_records";

/// How long a statement of a repository waits for a row lock by default
/// (when neither [`lock_timeout`](crate::PgRepositoryBuilder::lock_timeout)
/// is set nor half the operation timeout is shorter).
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_millis(250);

/// How long a batch statement waits for a row lock at most (less when the
/// repository's `lock_timeout` is shorter): then each of its keys is sent on
/// its own.
const BATCH_LOCK_TIMEOUT: Duration = Duration::from_millis(100);

/// The longest schema name accepted (Postgres truncates identifiers at 63 bytes).
const MAX_SCHEMA_BYTES: usize = 63;
/// The longest table name accepted: derived names (`{table}_expires_at_idx`, the
/// longest suffix, 15 bytes) must fit in Postgres's 63 bytes too.
pub(crate) const MAX_TABLE_BYTES: usize = 48;

/// Checks that `name` is a plain identifier: ASCII letters, digits and `_`, not
/// starting with a digit, 1..=`max` bytes. Anything else — quotes, dots, spaces,
/// semicolons, non-ASCII — is a configuration error, never SQL.
fn validate(kind: &str, name: &str, max: usize) -> Result<(), Error> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !first_ok || !rest_ok || name.len() > max {
        return Err(Error::config(format!(
            "invalid PostgreSQL {kind} name {name:?}: use 1 to {max} ASCII letters, digits or \
             underscores, not starting with a digit"
        )));
    }
    if kind == "schema" && name.to_ascii_lowercase().starts_with("pg_") {
        return Err(Error::config(format!(
            "invalid PostgreSQL schema name {name:?}: names starting with `pg_` are reserved"
        )));
    }
    Ok(())
}

/// `"name"`, with any `"` doubled (validated names contain none; this is a second
/// line of defence).
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The SQL a [`PgRepository`](crate::PgRepository) runs, rendered once for its
/// schema, table and [`lock_timeout`](crate::PgRepositoryBuilder::lock_timeout):
/// review it, `EXPLAIN` it, or allow-list it in a proxy. Each operation is this
/// one statement, prepared once per connection; a reservation may start with
/// [`reserve_insert`](Self::reserve_insert) or [`reserve_read`](Self::reserve_read)
/// instead, and a batch's or coalesced reservations with their forms over
/// arrays (see [`ReservePlan`](crate::ReservePlan)).
///
/// **Row locks.** Every statement here that may wait for a row lock (a key
/// another transaction holds: its reservation not yet committed, or the row
/// locked) sets `lock_timeout` for itself alone (`set_config(…, true)` in an
/// argument evaluated before any row is touched; local to the statement's
/// transaction): a reservation waits at most the repository's `lock_timeout`
/// and is then answered [`Error::InProgress`](idempotency_core::Error::InProgress),
/// a completion, failure, release, extension or delete is then
/// [`Error::Timeout`](idempotency_core::Error::Timeout) (nothing applied), a
/// batch statement waits at most 100 ms. So no statement of this crate keeps
/// its connection waiting on the server for a lock after its caller gave up.
/// On your own connection ([`PgRepository::in_transaction`](crate::PgRepository::in_transaction)),
/// the reservation sets the bound for its own call and restores your
/// `lock_timeout` in the same statement; the other operations there run
/// without it (the row is your transaction's own).
///
/// Keeping the exact strings stable lets sqlx reuse its per-connection
/// prepared statements.
#[derive(Debug)]
pub struct Statements {
    pub(crate) schema: String,
    pub(crate) table: String,
    /// `"schema"."table"`.
    pub(crate) qualified: String,
    /// The row-lock bound of the single statements (`lock_timeout`).
    pub(crate) lock_timeout: Duration,
    pub(crate) reserve_insert: String,
    pub(crate) reserve_read: String,
    pub(crate) reserve_many: String,
    pub(crate) reserve_insert_many: String,
    pub(crate) reserve_read_many: String,
    pub(crate) complete_many: String,
    pub(crate) get: String,
    pub(crate) purge: String,
    /// The single-record writes on the repository's own connections, each
    /// bounding its own lock wait.
    pub(crate) own: Writes,
    /// The same on a caller's connection ([`On::Caller`]).
    pub(crate) caller: Writes,
    /// `"schema"."table_migrations"`.
    pub(crate) migrations: String,
}

/// The single-record writes, in the form for one kind of connection.
#[derive(Debug)]
pub(crate) struct Writes {
    pub(crate) reserve: String,
    pub(crate) complete: String,
    pub(crate) fail: String,
    pub(crate) release: String,
    pub(crate) extend: String,
    pub(crate) delete: String,
}

/// Which connection a statement runs on, and so which form of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum On {
    /// One of the repository's own (autocommit): a `lock_timeout` set by the
    /// statement ends with it.
    Own,
    /// A caller's connection, perhaps in an open transaction: a setting made
    /// there would outlive the statement, so the reservation restores the
    /// caller's `lock_timeout`, and the other writes set none.
    Caller,
}

/// `set_config('lock_timeout', '<ms>ms', true)`: the statement's own bound on
/// lock waits (at least 1 ms; `0` would mean none). Local to the statement's
/// transaction: on the repository's autocommit connections, the statement.
fn lock_bound(timeout: Duration) -> String {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128);
    format!("set_config('lock_timeout', '{ms}ms', true)")
}

/// Opens the first array argument of a batch statement's `unnest` with its
/// lock bound (`lock_bound`, [`BATCH_LOCK_TIMEOUT`] or the repository's
/// shorter `lock_timeout`; function arguments are evaluated before the scan,
/// so it holds before the first row is touched). A statement is one
/// transaction: waiting on one key's row lock (another transaction's
/// uncommitted reservation, e.g. the transactional mode's) would keep every
/// other key of the batch uncommitted, invisible to duplicates, and apt to
/// commit after the caller gave up. Past the bound the statement fails
/// (`55P03`, nothing applied; answered as a definite error, not a timeout)
/// and each key goes through the single path. Both batch statements,
/// `reserve_many` and `complete_many`, set it.
fn batch_bound_first(lock_timeout: Duration) -> String {
    let bound = lock_bound(lock_timeout.min(BATCH_LOCK_TIMEOUT));
    format!("CASE WHEN {bound} IS NOT NULL THEN ")
}

/// The reservation parameters as arrays after the first, and the names of a
/// row `u` per request (its position in `u.ord`), in the order of the
/// reservation function's: `unnest(<first>, ` + this.
const ARRAYS_AFTER_FIRST: &str = "$2::bytea[], $3::bytea[], $4::bytea[], $5::int8[], $6::int8[], \
     $7::int8[], $8::int8[], $9::bool[]) WITH ORDINALITY AS u(namespace, id, owner, fingerprint, \
     now, lease_cutoff, lease_until, expires_at, retry_failed, ord)";

// The statements that join arrays to the table (`complete_many`,
// `reserve_read_many`) read the arrays through `LIMIT $n`, n their length:
// for a prepared statement's generic plan PostgreSQL estimates such a limit
// at a tenth of its input, one row, so it probes the table by its primary key
// row by row, as the single statements do. Without it, a plan made while the
// table was new (its size guessed at ten pages) scans the whole table on
// every batch, and sqlx keeps that plan on its connection until the table is
// next analyzed: 1.4 ms instead of 0.1 ms for 7 rows of a table being filled.

/// The columns of a record, in the order `decode_record` reads them.
pub(crate) const RECORD_COLUMNS: &str =
    "status, owner, attempt, fingerprint, result, error, retryable, lease_until, expires_at, created_at, updated_at";

/// [`RECORD_COLUMNS`], each qualified by `alias`.
fn record_columns_of(alias: &str) -> String {
    RECORD_COLUMNS
        .split(", ")
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Statements {
    /// `reserve`: a call of the reservation function, binding namespace, id,
    /// owner, fingerprint, now, lease cutoff, lease end, expiry and retry-failed;
    /// it answers `acquired` and the record's columns. Its first argument
    /// sets the statement's lock bound (see the type's documentation).
    pub fn reserve(&self) -> &str {
        &self.own.reserve
    }

    /// [`reserve`](Self::reserve) as sent on your own connection
    /// ([`PgRepository::in_transaction`](crate::PgRepository::in_transaction),
    /// the transactional manager): the same call, under the same lock bound,
    /// answering your `lock_timeout` restored as a last column.
    pub fn reserve_in_transaction(&self) -> &str {
        &self.caller.reserve
    }

    /// The row-lock bound every single statement on the repository's own
    /// connections sets for itself, and the reservation on yours.
    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    /// The first statement of [`ReservePlan::InsertFirst`](crate::ReservePlan):
    /// the reservation function's own `INSERT … ON CONFLICT DO NOTHING
    /// RETURNING`, with [`reserve`](Self::reserve)'s parameters (lease cutoff
    /// and retry-failed unused). A row answers a fresh key; no row leaves the
    /// reservation to the function.
    pub fn reserve_insert(&self) -> &str {
        &self.reserve_insert
    }

    /// The first statement of [`ReservePlan::ReadFirst`](crate::ReservePlan):
    /// the reservation function's own first query, a plain `SELECT` that reads
    /// and decides, with [`reserve`](Self::reserve)'s parameters (lease end and
    /// expiry unused). A row answers a duplicate or a re-sent reserve; no row
    /// leaves the reservation to the function.
    pub fn reserve_read(&self) -> &str {
        &self.reserve_read
    }

    /// [`reserve_insert`](Self::reserve_insert) over arrays, for a batch's
    /// reservations and coalesced ones (see
    /// [`coalesce_above`](crate::PgRepositoryBuilder::coalesce_above)): the
    /// parameters of `reserve` as arrays, keys distinct and in key order; a row
    /// (ending with its key's namespace and id) answers each key inserted.
    pub fn reserve_insert_many(&self) -> &str {
        &self.reserve_insert_many
    }

    /// [`reserve_read`](Self::reserve_read) over arrays, for a batch's
    /// reservations and coalesced ones: a row (ending with the request's position, from 1)
    /// answers each key the read decides alone.
    pub fn reserve_read_many(&self) -> &str {
        &self.reserve_read_many
    }

    /// `complete`: the owner-checked `UPDATE` binding namespace, id, owner,
    /// result, expiry and now.
    pub fn complete(&self) -> &str {
        &self.own.complete
    }

    /// `fail`: as [`complete`](Self::complete), storing the error, then
    /// whether it is retryable.
    pub fn fail(&self) -> &str {
        &self.own.fail
    }

    /// `release`: the owner-checked `DELETE` binding namespace, id, owner and now.
    pub fn release(&self) -> &str {
        &self.own.release
    }

    /// `extend`: the owner-checked `UPDATE` binding namespace, id, owner, the
    /// lease end to raise to, now and the expiry to raise to (neither lowered).
    pub fn extend(&self) -> &str {
        &self.own.extend
    }

    /// `get`: the `SELECT` of a live record binding namespace, id and now.
    pub fn get(&self) -> &str {
        &self.get
    }

    /// `delete`: the `DELETE` binding namespace and id.
    pub fn delete(&self) -> &str {
        &self.own.delete
    }

    /// `purge_expired`: the batched `DELETE` binding now and the limit.
    pub fn purge_expired(&self) -> &str {
        &self.purge
    }

    /// The single-record writes for a connection of kind `on`.
    pub(crate) fn writes(&self, on: On) -> &Writes {
        match on {
            On::Own => &self.own,
            On::Caller => &self.caller,
        }
    }

    /// The quoted, schema-qualified table name.
    pub fn qualified_table(&self) -> &str {
        &self.qualified
    }

    /// Validates the names and renders the statements, with the default
    /// lock bound.
    #[cfg(test)]
    pub(crate) fn new(schema: &str, table: &str) -> Result<Self, Error> {
        Statements::bounded(schema, table, DEFAULT_LOCK_TIMEOUT)
    }

    /// Validates the names and renders the statements, each waiting at most
    /// `lock_timeout` for a row lock.
    pub(crate) fn bounded(
        schema: &str,
        table: &str,
        lock_timeout: Duration,
    ) -> Result<Self, Error> {
        validate("schema", schema, MAX_SCHEMA_BYTES)?;
        validate("table", table, MAX_TABLE_BYTES)?;
        Ok(Statements::render(schema, table, lock_timeout))
    }

    /// The statements of the default schema and table (valid names, unit-tested).
    pub(crate) fn defaults(lock_timeout: Duration) -> Self {
        Statements::render(DEFAULT_SCHEMA, DEFAULT_TABLE, lock_timeout)
    }

    fn render(schema: &str, table: &str, lock_timeout: Duration) -> Self {
        let qualified = format!("{}.{}", quote(schema), quote(table));
        let reserve_fn = format!("{}.{}", quote(schema), quote(&format!("{table}_reserve")));
        let arrays = format!("unnest($1::bytea[], {ARRAYS_AFTER_FIRST}");
        let batch_bound = batch_bound_first(lock_timeout);
        let arrays_locked = format!("unnest({batch_bound}$1::bytea[] END, {ARRAYS_AFTER_FIRST}");
        let bound = lock_bound(lock_timeout);
        Statements {
            schema: schema.to_owned(),
            table: table.to_owned(),
            lock_timeout,
            // These two are the reservation function's own first query and
            // insert (migration 4), over the same parameters: a migration that
            // changes the reservation rule changes them too (and, during a
            // rolling upgrade, the previous version's processes decide the
            // cases these answer by the previous rule). `tests/conformance.rs`
            // runs the whole suite with each first, `tests/statements.rs`
            // checks which cases each answers alone.
            reserve_insert: format!(
                "INSERT INTO {qualified} AS t (namespace, id, status, owner, attempt, fingerprint, \
                 result, error, retryable, lease_until, expires_at, created_at, updated_at, purge_after) \
                 VALUES (CASE WHEN {bound} IS NOT NULL THEN $1::bytea END, $2, 'processing', $3, 1, $4, NULL, NULL, false, $7, $8, $5, $5, $8) \
                 ON CONFLICT (namespace, id) DO NOTHING RETURNING true, {}",
                record_columns_of("t")
            ),
            reserve_read: format!(
                "SELECT t.status = 'processing' AND t.owner = $3, {} FROM {qualified} AS t \
                 WHERE t.namespace = $1 AND t.id = $2 AND t.expires_at > $5 \
                 AND ((t.status = 'processing' AND t.owner = $3) \
                 OR (t.fingerprint IS NOT NULL AND $4::bytea IS NOT NULL AND t.fingerprint <> $4) \
                 OR NOT ((t.status = 'processing' AND t.lease_until <= $6) \
                 OR (t.status = 'failed' AND $9 AND t.retryable)))",
                record_columns_of("t")
            ),
            reserve_many: format!(
                "SELECT r.acquired, {}, u.ord FROM {arrays_locked} CROSS JOIN LATERAL {reserve_fn}(u.namespace, u.id, u.owner, u.fingerprint, \
                 u.now, u.lease_cutoff, u.lease_until, u.expires_at, u.retry_failed) AS r \
                 ORDER BY u.ord",
                record_columns_of("r")
            ),
            // The two above over arrays, each row with its own parameters;
            // the same rule, so the same answers (the coalesced conformance
            // suites run each).
            reserve_insert_many: format!(
                "INSERT INTO {qualified} AS t (namespace, id, status, owner, attempt, fingerprint, \
                 result, error, retryable, lease_until, expires_at, created_at, updated_at, purge_after) \
                 SELECT u.namespace, u.id, 'processing', u.owner, 1, u.fingerprint, NULL, NULL, false, \
                 u.lease_until, u.expires_at, u.now, u.now, u.expires_at \
                 FROM {arrays_locked} ORDER BY u.ord \
                 ON CONFLICT (namespace, id) DO NOTHING RETURNING true, {}, t.namespace, t.id",
                record_columns_of("t")
            ),
            reserve_read_many: format!(
                "SELECT t.status = 'processing' AND t.owner = u.owner, {}, u.ord \
                 FROM (SELECT * FROM {arrays} LIMIT $10) AS u \
                 JOIN {qualified} AS t ON t.namespace = u.namespace AND t.id = u.id \
                 WHERE t.expires_at > u.now \
                 AND ((t.status = 'processing' AND t.owner = u.owner) \
                 OR (t.fingerprint IS NOT NULL AND u.fingerprint IS NOT NULL AND t.fingerprint <> u.fingerprint) \
                 OR NOT ((t.status = 'processing' AND t.lease_until <= u.lease_cutoff) \
                 OR (t.status = 'failed' AND u.retry_failed AND t.retryable)))",
                record_columns_of("t")
            ),
            complete_many: format!(
                "UPDATE {qualified} AS t SET status = 'completed', result = u.result, \
                 expires_at = u.expires_at, purge_after = LEAST(t.purge_after, u.expires_at), \
                 updated_at = u.now \
                 FROM (SELECT * FROM unnest({batch_bound}$1::bytea[] END, $2::bytea[], \
                 $3::bytea[], $4::bytea[], $5::int8[], $6::int8[]) \
                 WITH ORDINALITY AS u(namespace, id, owner, result, expires_at, now, ord) LIMIT $7) AS u \
                 WHERE t.namespace = u.namespace AND t.id = u.id AND t.owner = u.owner \
                 AND t.status = 'processing' AND t.expires_at > u.now RETURNING u.ord"
            ),
            get: format!(
                "SELECT {RECORD_COLUMNS} FROM {qualified} \
                 WHERE namespace = $1 AND id = $2 AND expires_at > $3"
            ),
            purge: format!(
                "WITH doomed AS (SELECT namespace, id FROM {qualified} \
                 WHERE purge_after <= $1 AND expires_at <= $1 \
                 ORDER BY purge_after LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 DELETE FROM {qualified} AS t USING doomed \
                 WHERE t.namespace = doomed.namespace AND t.id = doomed.id AND t.expires_at <= $1"
            ),
            own: Writes::own(&qualified, &reserve_fn, &bound),
            caller: Writes::caller(&qualified, &reserve_fn, &bound),
            migrations: format!("{}.{}", quote(schema), quote(&format!("{table}_migrations"))),
            qualified,
        }
    }

    /// The placeholders of the migration scripts and their quoted values.
    pub(crate) fn placeholders(&self) -> [(&'static str, String); 7] {
        let (schema, table) = (&self.schema, &self.table);
        [
            ("{schema}", quote(schema)),
            ("{table}", self.qualified.clone()),
            ("{pkey}", quote(&format!("{table}_pkey"))),
            ("{status_check}", quote(&format!("{table}_status_check"))),
            ("{expires_index}", quote(&format!("{table}_expires_at_idx"))),
            ("{purge_index}", quote(&format!("{table}_purge_idx"))),
            (
                "{reserve_fn}",
                format!("{}.{}", quote(schema), quote(&format!("{table}_reserve"))),
            ),
        ]
    }

    /// The quoted schema name.
    pub(crate) fn quoted_schema(&self) -> String {
        quote(&self.schema)
    }
}

impl Writes {
    /// The writes on the repository's own connections: each sets its lock
    /// bound (`bound`, from [`lock_bound`]) in an argument or a one-row
    /// subquery evaluated before its row is locked, which the statement's
    /// transaction then ends.
    fn own(qualified: &str, reserve_fn: &str, bound: &str) -> Self {
        // Not pulled into the query (volatile, `OFFSET 0`), and joined to
        // the row: the row is written only after it was evaluated.
        let with_bound = format!("(SELECT {bound} AS lock_bound OFFSET 0) AS b");
        let [complete, fail, release, extend, delete] = single_writes(qualified);
        Writes {
            reserve: format!(
                "SELECT acquired, {RECORD_COLUMNS} FROM {reserve_fn}(CASE WHEN {bound} IS NOT NULL \
                 THEN $1::bytea END, $2, $3, $4, $5, $6, $7, $8, $9)"
            ),
            complete: format!("{} FROM {with_bound} {}", complete.0, complete.1),
            fail: format!("{} FROM {with_bound} {}", fail.0, fail.1),
            release: format!("{} USING {with_bound} {}", release.0, release.1),
            extend: format!("{} FROM {with_bound} {}", extend.0, extend.1),
            delete: format!("{} USING {with_bound} {}", delete.0, delete.1),
        }
    }

    /// The writes on a caller's connection: the reservation reads the
    /// caller's `lock_timeout` first (a subquery the function's argument
    /// refers to, so it is evaluated before), sets its own bound, and sets
    /// the caller's back once the function has answered (a set-returning
    /// PL/pgSQL function runs to its end before its first row is read). A
    /// reservation that fails leaves the setting to the caller's rollback,
    /// which undoes it. The other writes set nothing.
    fn caller(qualified: &str, reserve_fn: &str, bound: &str) -> Self {
        let [complete, fail, release, extend, delete] = single_writes(qualified);
        let joined = |(head, tail): (String, String)| format!("{head} {tail}");
        Writes {
            reserve: format!(
                "SELECT r.acquired, {}, set_config('lock_timeout', s.previous, true) \
                 FROM (SELECT current_setting('lock_timeout') AS previous OFFSET 0) AS s \
                 CROSS JOIN LATERAL {reserve_fn}(CASE WHEN s.previous IS NOT NULL AND {bound} IS NOT NULL \
                 THEN $1::bytea END, $2, $3, $4, $5, $6, $7, $8, $9) AS r",
                record_columns_of("r")
            ),
            complete: joined(complete),
            fail: joined(fail),
            release: joined(release),
            extend: joined(extend),
            delete: joined(delete),
        }
    }
}

/// `complete`, `fail`, `release`, `extend` and `delete`, each split where a
/// `FROM` or `USING` item may go: (the statement's head, its `WHERE`).
fn single_writes(qualified: &str) -> [(String, String); 5] {
    let live_owned = "namespace = $1 AND id = $2 AND owner = $3 AND status = 'processing'";
    [
        (
            format!(
                "UPDATE {qualified} SET status = 'completed', result = $4, expires_at = $5, \
                 purge_after = LEAST(purge_after, $5), updated_at = $6"
            ),
            format!("WHERE {live_owned} AND expires_at > $6"),
        ),
        (
            format!(
                "UPDATE {qualified} SET status = 'failed', error = $4, expires_at = $5, \
                 purge_after = LEAST(purge_after, $5), updated_at = $6, retryable = $7"
            ),
            format!("WHERE {live_owned} AND expires_at > $6"),
        ),
        (
            format!("DELETE FROM {qualified}"),
            format!("WHERE {live_owned} AND expires_at > $4"),
        ),
        (
            format!(
                "UPDATE {qualified} SET lease_until = GREATEST(lease_until, $4), updated_at = $5, \
                 expires_at = GREATEST(expires_at, $6)"
            ),
            format!("WHERE {live_owned} AND expires_at > $5"),
        ),
        (
            format!("DELETE FROM {qualified}"),
            "WHERE namespace = $1 AND id = $2".to_owned(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        for name in [
            "idempotency_records",
            "_x",
            "A1",
            &"t".repeat(MAX_TABLE_BYTES),
        ] {
            assert!(Statements::new("public", name).is_ok(), "{name}");
        }
        assert!(Statements::new(&"s".repeat(63), "t").is_ok());
    }

    #[test]
    fn rejects_hostile_identifiers() {
        let hostile = [
            "",
            "1abc",
            "a b",
            "a;b",
            "records\"; DROP TABLE users; --",
            "x\"",
            "a.b",
            "a-b",
            "é",
            "a\0b",
            "tab\tle",
            &"t".repeat(MAX_TABLE_BYTES + 1),
        ];
        for name in hostile {
            let err = Statements::new("public", name).err();
            assert!(
                matches!(&err, Some(Error::Config { message }) if message.contains("table")),
                "{name:?}: {err:?}"
            );
            if name.len() > MAX_TABLE_BYTES {
                continue; // a valid schema length
            }
            let err = Statements::new(name, "t").err();
            assert!(
                matches!(&err, Some(Error::Config { message }) if message.contains("schema")),
                "{name:?}: {err:?}"
            );
        }
        assert!(Statements::new("pg_temp", "t").is_err());
        assert!(Statements::new(&"s".repeat(64), "t").is_err());
    }

    #[test]
    fn quotes_every_identifier() {
        let s = Statements::new("My_Schema", "Records").unwrap();
        assert_eq!(s.qualified, "\"My_Schema\".\"Records\"");
        assert!(s.own.reserve.contains("\"My_Schema\".\"Records_reserve\"("));
        assert_eq!(quote("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn every_write_that_may_wait_for_a_row_lock_bounds_it() {
        let s = Statements::bounded("public", "t", Duration::from_millis(1500)).unwrap();
        let bound = "set_config('lock_timeout', '1500ms', true)";
        let own = &s.own;
        for sql in [
            &own.reserve,
            &own.complete,
            &own.fail,
            &own.release,
            &own.extend,
            &own.delete,
            &s.reserve_insert,
            &s.caller.reserve,
        ] {
            assert!(sql.contains(bound), "{sql}");
        }
        // A batch waits 100 ms at most, less when the repository's bound is.
        assert!(s.reserve_many.contains("'100ms'"));
        assert!(s.complete_many.contains("'100ms'"));
        let short = Statements::bounded("public", "t", Duration::from_micros(10)).unwrap();
        assert!(short.own.reserve.contains("'1ms'"), "never 0 (no bound)");
        assert!(short.reserve_insert_many.contains("'1ms'"));
        // On a caller's connection the reservation restores the caller's
        // setting; the other writes set nothing that would outlive them.
        assert!(s
            .caller
            .reserve
            .contains("set_config('lock_timeout', s.previous, true)"));
        for sql in [
            &s.caller.complete,
            &s.caller.fail,
            &s.caller.release,
            &s.caller.extend,
            &s.caller.delete,
        ] {
            assert!(!sql.contains("set_config"), "{sql}");
        }
    }
}
