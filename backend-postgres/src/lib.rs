//! PostgreSQL backend of **idempotency-rs**: [`PgRepository`], an idempotency
//! [`Repository`](idempotency_core::Repository) in one table, on a sqlx
//! [`PgPool`](sqlx::PgPool).
//!
//! ```no_run
//! use std::sync::Arc;
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, Outcome};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // Connects, and creates the table on first use (`migrate=false` to skip).
//! let repo = idempotency_postgres::connect("postgres://app:secret@localhost/shop").await?;
//! let manager = IdempotencyManager::new(Arc::new(repo), Config::default())?;
//!
//! // The broker delivers the same message twice: the handler runs once.
//! for delivery in 1..=2 {
//!     let outcome = manager
//!         .execute("ProcessPayment:evt-42", &serde_json::json!({"amount": 10}), || async {
//!             Ok::<_, HandlerError<String>>("receipt-1".to_owned())
//!         })
//!         .await?;
//!     assert!(matches!((delivery, outcome), (1, Outcome::Executed(_)) | (2, Outcome::Cached(_))));
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Building a repository
//!
//! | how | migrates? |
//! |---|---|
//! | [`connect`]`("postgres://…")` (also `postgresql://`) | yes, unless `migrate=false` |
//! | [`PgRepository::from_url`], [`PgRepository::from_env`] (`IDEMPOTENCY_POSTGRES_URL`, else `DATABASE_URL`) | only with `migrate=true` |
//! | [`PgRepository::from_pool`] (your pool, default names), [`PgRepositoryBuilder::build_with_pool`] | no |
//! | [`PgRepository::builder`]`()….connect(url)` / `.connect_lazy(url)` | only with `migrate=true` |
//!
//! URL query options taken by this crate: `schema` (default `public`), `table`
//! (default `idempotency_records`), `migrate`, `max_connections` (default 10),
//! `acquire_timeout` (default `5s`), `operation_timeout` (default `5s`; both
//! must be positive), `held_connections` (connections kept between
//! operations; default: the whole pool, see
//! [`PgRepositoryBuilder::held_connections`]), `reserve_plan` (`adaptive`,
//! the default, `function`, `insert-first` or `read-first`; see
//! [`ReservePlan`]), `coalesce_above` (default 2, `0` off; see
//! [Coalescing](#coalescing)). sqlx's connection options (`sslmode`, `sslrootcert`,
//! `sslcert`, `sslkey`, `host`, `hostaddr`, `port`, `dbname`, `user`, `password`,
//! `application_name`, `options`, `options[NAME]`, `statement-cache-capacity`)
//! pass through; any other option is an
//! [`Error::Config`](idempotency_core::Error::Config) naming it (a typo such as
//! `tabel=` or `sslmod=` never silently falls back to a default). Schema and table names must be plain
//! identifiers — ASCII letters, digits, `_`, not starting with a digit; at most 63
//! and 48 bytes — and are always quoted (case-sensitive); anything else is an
//! [`Error::Config`](idempotency_core::Error::Config), never SQL. TLS
//! (`sslmode=require`, `verify-full`) needs this crate's `tls` feature; a
//! server without TLS under such a mode, or a certificate the client does not
//! trust, is an [`Error::Config`](idempotency_core::Error::Config) (no retry
//! fixes it), a connection cut mid-handshake an outage.
//!
//! [`PgRepository::migrate`] applies the embedded migrations: idempotent, in one
//! transaction under an advisory lock, so processes starting together are safe.
//! Before its first reservation, a repository checks (in the catalogs) that
//! the table has every column its statements write, and refuses to reserve (an
//! [`Error::Config`](idempotency_core::Error::Config) naming the columns;
//! nothing is written) on a table an older version of this crate migrated, or
//! one made by hand from an older release's SQL: there a reservation could
//! succeed and the completion after the handler fail on the missing column,
//! and the handler would run again when the lease ended. Run the migrations
//! first. A table migrated by a newer version is used as it is (each migration
//! keeps the previous version's statements working, for rolling upgrades).
//!
//! # Support table
//!
//! | | |
//! |---|---|
//! | atomicity | every write is one statement under READ COMMITTED (a reservation the plan's plain statement does not answer is decided by a second, the function); `reserve` decides under the row lock |
//! | concurrency | exactly one `Acquired` among concurrent reservers of a key (the conformance races, and 48 tasks over three pools through ten takeover rounds in `tests/postgres.rs`) |
//! | expiry | from the caller's `now` only; an expired row is absent to every operation before it is purged |
//! | native expiry | no: schedule [`purge_expired`](idempotency_core::Repository::purge_expired) |
//! | key | `namespace` and `id` as `bytea` (their UTF-8 bytes): injective for every string, NUL included |
//! | `max_id_bytes` | 1024 (longer ids are digested by the manager); namespaces ≤ 512 bytes (core limit) |
//! | `max_result_bytes` | 16 MiB per result or stored error (`bytea`; larger → `TooLarge`, the manager completes without caching) |
//! | timeouts | [`operation_timeout`](PgRepositoryBuilder::operation_timeout) (default 5 s) is a client-side timer around each of this crate's statements (never a connection `statement_timeout`, so a transactional handler's own statements may take longer): a paused server fails a call after it, not after the outage; on your own connection (transactional mode) only when set explicitly; the manager's `store_timeout` bounds every call too |
//! | row locks | [`lock_timeout`](PgRepositoryBuilder::lock_timeout) (default 250 ms, at most half the operation timeout): every statement that may wait for a row lock sets it on the server for itself alone (a batch statement 100 ms), so none keeps a connection waiting behind another transaction after its caller gave up; a reservation past it is `InProgress` (the key is held by a transaction not yet committed: a duplicate of a key the transactional manager holds is answered in progress, never an outage, never run under fail-open), a completion, failure, release, extension or delete `Timeout` |
//! | outage | I/O, pool timeouts, SQLSTATE 08xxx, 53xxx, 57Pxx (the server ended the session, `idle_session_timeout` included), 25P03 (`idle_in_transaction_session_timeout`), 40001, 40P01 → `Unavailable` (a pooled connection idle over a second is pinged before use, so one the server ended while idle is replaced, not failed); `57014`, `55P03` (outside a reservation), the operation timeout → `Timeout` |
//! | corrupt rows | wrong-length owner or fingerprint, unknown status, negative instants → `Corrupt` naming the key |
//!
//! Round trips — each operation is a single statement, a prepared statement
//! cached per connection (its first use on a connection adds one `Parse` round
//! trip), sent as one pipelined `Bind`/`Execute`/`Close`/`Sync`; only a
//! reservation whose plan guessed wrong sends a second (see
//! [`ReservePlan`]).
//! `tests/statements.rs` proves it twice: a proxy counts the protocol messages
//! the server receives for each operation (exactly one `Execute` and one `Sync`,
//! no `Parse`, no simple `Query`), and, server side, `pg_stat_database.xact_commit`
//! of a database created for the test grows by exactly one transaction per extra
//! operation. On pools this crate creates, sqlx's ping before handing out a
//! connection is off (`test_before_acquire(false)`), and sqlx's ping of every
//! connection it gets back (its release check, which no option turns off) is
//! skipped: the repository keeps the connection an operation ended cleanly on
//! for its next operation, and gives a connection back to the pool only when
//! it was left unused for a second, after 30 s of use, or when its operation
//! was cancelled or failed without the server's answer — then sqlx's ping
//! drains it in the background, off every operation's path (see
//! [`PgRepositoryBuilder::held_connections`]). `tests/statements.rs` checks
//! that pooled operations send nothing but their statement.
//!
//! | operation | round trips | statement |
//! |---|---|---|
//! | `reserve`, fresh key | 1 | `SELECT … FROM {table}_reserve(…)`: a plain read finds no row, then its `INSERT … ON CONFLICT DO NOTHING RETURNING` inserts and answers; while fresh keys dominate (the adaptive plan), that `INSERT` alone, without the function |
//! | `reserve`, duplicate (live record not open to a takeover) or re-sent by its owner | 1 | same call: answered by one plain read that also decides (no row lock, no transaction id, nothing written — since migration 2; one query since migration 4); while duplicates dominate, that `SELECT` alone |
//! | `reserve`, takeover / expired row / key inserted concurrently | 1 | same call: the insert conflicts, `SELECT … FOR UPDATE` locks the newest row version, the function decides; a takeover adds one `UPDATE` of the locked row |
//! | `reserve`, a case the plan's first statement does not answer (after the insert: a duplicate, a re-sent reserve, an expired row, a takeover, a key inserted concurrently; after the read: a fresh key, an expired row, a takeover) | 2 | the plain statement, which answers nothing and writes nothing (an `INSERT … ON CONFLICT DO NOTHING` that meets the key takes no transaction id), then the function |
//! | `reserve_many`, `complete_many` (batches), and `reserve`, `complete` waiting to be coalesced (see [Coalescing](#coalescing)) | 1 (2 when the plan's first statement leaves some keys) | the plan's first statement over arrays (the plain `INSERT … SELECT FROM unnest`, the plain `SELECT` joined to `unnest`, or the function over arrays), then the function over arrays for the keys it left; the completing `UPDATE` over arrays |
//! | `complete`, `fail`, `extend` | 1 | `UPDATE … WHERE key AND owner AND status = 'processing' AND expires_at > now` (`complete` and `fail` set `purge_after = LEAST(purge_after, $expiry)`, unchanged as a rule, so the update is HOT; `extend` sets `expires_at = GREATEST(expires_at, $new)`) |
//! | `release` | 1 | `DELETE …` with the same condition |
//! | `get` | 1 | `SELECT … WHERE key AND expires_at > now` |
//! | `delete` | 1 | `DELETE … WHERE key` |
//! | `purge_expired(now, limit)` | 1 | `WITH doomed AS (SELECT … WHERE purge_after <= now AND expires_at <= now ORDER BY purge_after LIMIT n FOR UPDATE SKIP LOCKED) DELETE …` |
//!
//! # Why a function for `reserve`
//!
//! The obvious single statement, `INSERT … ON CONFLICT DO UPDATE … WHERE
//! <takeover rule> RETURNING *`, returns nothing when the rule says "keep the
//! existing record" — exactly the duplicate case, which must return that record.
//! A fallback `SELECT` in the same CTE reads the statement's snapshot, which
//! misses a row committed by a concurrent reserver a moment earlier; making the
//! `DO UPDATE` unconditional (a `CASE` per column) returns the row but writes a
//! new row version for every duplicate. The PL/pgSQL function created by the
//! migration has none of these problems, in one round trip:
//!
//! 0. One plain query of the key (no lock) that reads and decides: a live
//!    record that the call may not take over (a duplicate), or that the
//!    caller's owner token already holds (a re-sent reserve), is answered as
//!    read — nothing is locked or written.
//! 1. `INSERT … ON CONFLICT (namespace, id) DO NOTHING RETURNING …` — a fresh
//!    key is reserved and answered here. If another transaction is inserting
//!    the same key, this waits for it to commit or roll back, up to the
//!    repository's [`lock_timeout`](PgRepositoryBuilder::lock_timeout), which
//!    the call sets for itself in its first argument (then: `InProgress`).
//! 2. Otherwise `SELECT … FOR UPDATE` locks the newest committed version of the
//!    row (each PL/pgSQL statement takes a fresh snapshot under READ COMMITTED,
//!    and a locked row is re-read after the lock holder finishes); if it vanished
//!    meanwhile (released, deleted, purged) the loop starts over.
//! 3. Under the lock, the rule of `idempotency_core::decision::reserve_transition`
//!    is applied to the caller's `now`, `lease_cutoff()`, `retry_failed` and
//!    fingerprint, all parameters: an expired row is overwritten as a new record
//!    (attempt 1); a live `Processing` row held by the caller's owner token (a
//!    re-sent reserve) answers `Acquired` with its attempt, unchanged; a stale
//!    `Processing` or retryable `Failed` row is taken over (attempt + 1,
//!    `created_at` kept, the stored fingerprint kept when the request has none)
//!    unless the fingerprints conflict; otherwise the row is returned unchanged.
//!
//! Two plain-SQL alternatives that skip the function on the common paths within
//! the one statement were measured with pgbench on PostgreSQL 15, 16 clients, and dropped: CTEs
//! reading the row and inserting conditionally, the function behind a
//! one-time filter, ran fresh keys at the same rate and duplicates about 10 %
//! slower (the CTEs' materialization costs more than PL/pgSQL's cached plans);
//! without the CTEs (a `SELECT` answering the duplicate, the function behind
//! `WHERE NOT EXISTS`), duplicates ran level with migration 4's function and
//! fresh keys 5–12 % slower (two more index probes).
//!
//! Run on their own, the function's first query and its insert cost the
//! server a quarter to a third less than the call (pgbench, PostgreSQL 15,
//! 16 clients, fsync off: 70–74k plain reads per second against 52k calls
//! for duplicates, 22k against 18k inserts and completions for fresh keys;
//! BENCHMARKS.md, "PostgreSQL: the plain statement first"). Sending one of them
//! first, as a separate statement, and the function only when it does not
//! answer, keeps the function's answers — each statement answers only the case
//! it decides alone, under the same rule, and a miss costs a second round trip,
//! nothing else. [`ReservePlan`] says which goes first; the default adapts to
//! the recent mix of fresh keys and duplicates. Reservations on your own
//! connection ([`PgRepository::in_transaction`], the transactional manager)
//! always call the function: in a transaction at `REPEATABLE READ` the
//! plain insert would fail (40001) on a row version newer than the snapshot,
//! where the function answers the record as the snapshot shows it.
//!
//! Every decision is made by the one transaction holding the row lock, on the
//! row's newest version, so exactly one concurrent reserver acquires a given
//! version. Duplicates of live records write nothing; only a duplicate that
//! meets the locked path (a row changed after the plain read) takes a row
//! lock, and still writes no row version.
//!
//! # Coalescing
//!
//! Under load, most of what a one-row statement costs — on the client and on
//! the server — is the statement itself: its round trip, two wake-ups, the
//! executor's start, a commit. So a repository keeps at most
//! [`coalesce_above`](PgRepositoryBuilder::coalesce_above) single
//! reservations and completions in flight (default 2), each sent by a task
//! of the repository's own. A call that finds fewer starts such a task, which
//! sends it alone at once: a light load sees each call's own statement, as
//! before, plus one task hop (15–20 µs of latency on the benchmark machine).
//! A call that finds that many waits; when one of those statements ends, its
//! task sends the calls then waiting together — each kind in one statement
//! over arrays, up to 128 calls, a key at most once — and keeps doing so
//! while calls wait. Under load a call usually waits for one statement
//! before its own goes; longer behind waiting completions (they go first),
//! behind more than 128 waiting calls, or behind other calls for the same
//! key (one per statement) — always within the operation timeout. The slots
//! belong to
//! those tasks, never to a caller's future: one that is dropped, or leaked
//! and never polled again, holds nothing up.
//!
//! - **The same answers.** Each call keeps its own instants, lease, expiry,
//!   fingerprint and owner token, and is answered by the rule its single
//!   statement applies: the reserve plan's first statement over arrays
//!   answers what it decides alone, the reservation function over arrays the
//!   rest (a takeover, an expired row, a key inserted concurrently); the
//!   completion is the owner-checked update, row by row. The conformance
//!   suite runs three more times with every single call sent through these
//!   statements (`tests/conformance.rs`), and `tests/coalesce.rs` checks,
//!   statement by statement, how waiting calls are grouped.
//! - **Failure.** An error of the shared statement is each of its calls': an
//!   outage or a timeout is "maybe applied", as for a single statement, and
//!   the manager retries it with the same owner token. A key locked by
//!   another transaction (e.g. the transactional mode's) past the statement's
//!   `lock_timeout` of 100 ms refuses the whole statement with nothing
//!   applied; its calls are then sent again one by one, so the others are not
//!   held behind that lock (the locked one is answered `InProgress` once its
//!   own statement's bound passes). A batch's `reserve_many` does the same. A call whose caller gives up while it waits in
//!   the queue is never sent, and a reservation whose caller gives up while
//!   its statement waits for a connection is left out of it once the
//!   connection is there; one that gives up after is in the position of a
//!   single statement abandoned on the wire. The task that sends waiting
//!   calls is not the caller's, so no caller's cancellation strands the
//!   others.
//! - **Where it does not apply.** Operations on your own connection
//!   ([`PgRepository::in_transaction`], the transactional manager), the batch
//!   operations, which are sent over arrays already, and `fail`, `release`,
//!   `extend`, `get` (one statement each, rare next to reservations and
//!   completions).
//!
//! Lower it where the server's CPU is the limit, raise it (or set `0`, off)
//! where round trips are long and the server has cores to spare, or where
//! many deliveries of one key arrive at once (they go a statement each). On
//! one PostgreSQL 15 sharing two cores with the client, coalescing with 4
//! slots ran executions 1.0–1.5 times as fast as no coalescing at 16 tasks
//! and 2.7–3.6 times at 64, fresh keys and duplicates, fsync on and off
//! (BENCHMARKS.md, "PostgreSQL: coalescing"); 2 slots, the default since,
//! ran duplicates a further 14 % and fresh keys 7 % faster at 16 tasks, and
//! 1.3–1.5 times as fast as no coalescing (BENCHMARKS.md, "PostgreSQL
//! against its own limit, both sides settled").
//!
//! # Schema
//!
//! ```sql
//! CREATE TABLE "public"."idempotency_records" (
//!     namespace   bytea  NOT NULL,       -- UTF-8 bytes of the namespace
//!     id          bytea  NOT NULL,       -- UTF-8 bytes of the id (or its digest)
//!     status      text   NOT NULL,       -- 'processing' | 'completed' | 'failed'
//!     owner       bytea  NOT NULL,       -- 16-byte fencing token
//!     attempt     bigint NOT NULL,
//!     fingerprint bytea,                 -- 32-byte SHA-256 of the payload
//!     result      bytea,                 -- cached outcome (NULL ≠ empty)
//!     error       bytea,                 -- stored failure
//!     retryable   boolean NOT NULL,      -- whether a Failed row may be retried (migration 3)
//!     lease_until bigint NOT NULL,       -- milliseconds since the Unix epoch, caller's clock
//!     expires_at  bigint NOT NULL,
//!     created_at  bigint NOT NULL,
//!     updated_at  bigint NOT NULL,
//!     purge_after bigint NOT NULL DEFAULT 0, -- where purges look, ≤ expires_at (migration 4)
//!     PRIMARY KEY (namespace, id),
//!     CHECK (status IN ('processing', 'completed', 'failed'))
//! ) WITH (fillfactor = 85);
//! CREATE INDEX "idempotency_records_purge_idx" ON "public"."idempotency_records" (purge_after);
//! -- plus the function "public"."idempotency_records_reserve"(…) and the
//! -- bookkeeping table "public"."idempotency_records_migrations".
//! ```
//!
//! Read a key by hand with `convert_from(id, 'UTF8')`, or find one with
//! `WHERE namespace = convert_to('idempotency', 'UTF8') AND id = convert_to('order-1', 'UTF8')`.
//!
//! # Purging and vacuum
//!
//! Expired rows are invisible at once but stay on disk until
//! [`purge_expired`](idempotency_core::Repository::purge_expired) deletes them:
//! batches of `limit` rows, oldest first through the `purge_after` index, with
//! `FOR UPDATE SKIP LOCKED` so several processes can purge at once without
//! waiting on each other or on reservations.
//! [`RepositoryExt::purge_all_expired`](idempotency_core::RepositoryExt::purge_all_expired)
//! loops until a batch comes back short, keeping the consumers' `clock_skew`
//! as a margin (it removes records expired by `now - clock_skew`). Schedule
//! it, for example:
//!
//! ```no_run
//! use std::time::Duration;
//! use idempotency_core::{Clock, RepositoryExt, SystemClock};
//!
//! # async fn demo(repo: idempotency_postgres::PgRepository) {
//! let clock_skew = Duration::from_secs(2); // the consumers' Config::clock_skew
//! let mut every = tokio::time::interval(Duration::from_secs(60));
//! loop {
//!     every.tick().await;
//!     match repo.purge_all_expired(SystemClock.now(), clock_skew, 1_000).await {
//!         Ok(n) => tracing::debug!(purged = n, "idempotency purge"),
//!         Err(e) => tracing::warn!(error = %e, "idempotency purge failed; retrying next tick"),
//!     }
//! }
//! # }
//! ```
//!
//! or from the database itself with `pg_cron` (same statement, server clock,
//! here with a margin of 2000 ms: the consumers' `clock_skew`):
//!
//! ```sql
//! SELECT cron.schedule('idempotency-purge', '* * * * *', $$
//!   DELETE FROM "public"."idempotency_records" WHERE (namespace, id) IN (
//!     SELECT namespace, id FROM "public"."idempotency_records"
//!     WHERE purge_after <= (extract(epoch FROM clock_timestamp()) * 1000)::bigint - 2000
//!       AND expires_at <= (extract(epoch FROM clock_timestamp()) * 1000)::bigint - 2000
//!     ORDER BY purge_after LIMIT 10000 FOR UPDATE SKIP LOCKED)
//! $$);
//! ```
//!
//! Purge with a trustworthy clock: a purger whose clock runs ahead of the
//! consumers' by more than the margin deletes records they still consider
//! live.
//!
//! The table churns (an insert, an update or two and a delete per key), so let
//! autovacuum keep up: on busy tables lower its thresholds, e.g.
//! `ALTER TABLE "public"."idempotency_records" SET (autovacuum_vacuum_scale_factor = 0.02,
//! autovacuum_vacuum_insert_scale_factor = 0.05)`, purge often in small batches
//! rather than rarely in huge ones, and watch `n_dead_tup` in
//! `pg_stat_user_tables`.
//!
//! Completions, failures and lease extensions are HOT updates as a rule (since
//! migration 4): the only indexed instant is `purge_after`, the expiry a record
//! was reserved with, which they leave as it is (a completion's expiry is
//! later; `LEAST` lowers it only for a shorter one), and the table's
//! `fillfactor` of 85 keeps room on each page for the new versions of its
//! rows. PostgreSQL then writes the new version beside the old one with no new
//! index entry, and prunes the old one from the page without a vacuum. A
//! version that does not fit in the page's free space (a result stored inline
//! larger than about a kilobyte, on a page whose old versions are not yet
//! prunable) is written elsewhere, as before; results past about 2 kB are
//! stored out of line (TOAST) and do not count. Takeovers and overwrites of
//! expired rows change `purge_after` and are not HOT. `idempotency doctor`
//! checks the indexes and the fillfactor and reports `n_tup_hot_upd` against
//! `n_tup_upd`. `expires_at` is the record's expiry for every statement;
//! `purge_after` is not later than it (only a completion by a process of the
//! previous version, during a rolling upgrade, can leave it later: that record
//! is purged later, never earlier), so the purge's index finds every expired
//! row, and its `expires_at` filter skips the few records completed after
//! their reservation's expiry would have passed.
//!
//! # Transactional mode
//!
//! For work that happens inside the same database, the record can commit or
//! roll back with the business writes — exactly-once *effects*, not just
//! at-most-once handler runs. [`PgTransactionalManager::execute`] begins a
//! transaction, reserves the key in it, runs the handler with the transaction's
//! connection, completes the record in it and commits; a handler error rolls
//! everything back. Duplicates arriving meanwhile — transactional or not —
//! wait on the row lock up to the repository's
//! [`lock_timeout`](PgRepositoryBuilder::lock_timeout) (250 ms by default) and
//! then see the committed outcome, or, while the transaction is still open,
//! get [`Error::InProgress`](idempotency_core::Error::InProgress) as for any
//! live holder: never a store outage, so never a fail-open run beside the
//! transaction, and never a pooled connection left waiting behind it. For
//! manual control,
//! [`PgRepository::in_transaction`] runs each operation on your own
//! transaction ([`PgTransactionRepository`]).
//!
//! In transactions at `REPEATABLE READ` or `SERIALIZABLE`, a reservation that
//! meets a row changed after the transaction's snapshot fails with a
//! serialization error (SQLSTATE 40001), reported as the retryable
//! [`Error::Unavailable`](idempotency_core::Error::Unavailable): retry the whole
//! transaction.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod coalesce;
mod error;
mod held;
mod migrate;
mod names;
mod ops;
mod options;
mod plan;
mod repository;
mod transaction;

pub use coalesce::DEFAULT_COALESCE_ABOVE;
pub use names::{Statements, DEFAULT_LOCK_TIMEOUT};
pub use plan::ReservePlan;
pub use repository::{PgRepository, PgRepositoryBuilder, DEFAULT_OPERATION_TIMEOUT, ENV_URL_VARS};
pub use transaction::{PgTransactionRepository, PgTransactionalManager};

/// Re-exported so users name the same sqlx version as this crate.
pub use sqlx;

/// Connects to `url` (`postgres://…` or `postgresql://…`) and applies the
/// migrations, unless the URL says `migrate=false`; the facade's
/// `idempotency::connect` calls it for those schemes.
///
/// Query options: `schema`, `table`, `migrate`, `max_connections`,
/// `acquire_timeout`, `operation_timeout`, `held_connections`, `reserve_plan` (see the
/// [crate docs](crate)); the
/// others go to sqlx.
///
/// # Errors
/// [`Error::Config`](idempotency_core::Error::Config) for a bad URL, scheme or
/// name; [`Error::Unavailable`](idempotency_core::Error::Unavailable) when the
/// server cannot be reached within the acquire timeout; a migration error.
pub async fn connect(url: &str) -> Result<PgRepository, idempotency_core::Error> {
    let (repo, migrate) = PgRepository::builder().connect_inner(url).await?;
    if migrate != Some(false) {
        repo.migrate().await?;
    }
    Ok(repo)
}
