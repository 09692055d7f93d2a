//! SQLite backend of idempotency-rs: the durable store for a single-node
//! service, in one file, with no server to run.
//!
//! - **Atomic reservation**: every reservation reads and writes the record in
//!   one `BEGIN IMMEDIATE` transaction, which takes SQLite's write lock before
//!   the read: no other connection or process can change the record between
//!   the decision and the write. The decision itself is the core's, the one
//!   every store makes. A reservation abandoned at any point (the manager's
//!   store timer, a dropped future) rolls its transaction back; the begin runs
//!   on a task of its own so that no connection goes back to the pool inside
//!   an open transaction (needs a Tokio runtime, as sqlx does).
//! - **Several processes on one file**: WAL mode, and a busy timeout
//!   ([`DEFAULT_BUSY_TIMEOUT`], URL option `busy_timeout`): a statement that
//!   finds the file locked waits for it, then fails with a retryable
//!   [`Error::Timeout`](idempotency_core::Error::Timeout) (which the manager
//!   retries with the same owner token), never a panic or a silent failure.
//!   A race in the WAL's locking protocol (`SQLITE_PROTOCOL`) is the same
//!   retryable `Timeout`; I/O errors, a full disk and memory exhausted
//!   (`SQLITE_NOMEM`, e.g. past a `hard_heap_limit`) are a retryable
//!   [`Error::Unavailable`](idempotency_core::Error::Unavailable); a damaged
//!   file is a [`Error::Backend`](idempotency_core::Error::Backend).
//! - **Durability**: `synchronous=FULL` by default: a recorded outcome
//!   survives a crash of the process and a power loss. `synchronous=normal`
//!   trades the last commits before a power loss for speed ([`Durability`]).
//! - **Byte-exact keys**: namespaces and ids are `BLOB`s, compared byte for
//!   byte.
//! - **Expiry**: expired records are ignored at once and removed by
//!   [`purge_expired`](idempotency_core::Repository::purge_expired) (run it
//!   periodically, like for PostgreSQL).
//! - **Migrations**: embedded, applied by [`SqliteRepository::connect`]
//!   (unless `migrate=false`) or [`SqliteRepository::migrate`], in this
//!   crate's own version table (`idempotency_schema_migrations`; why not
//!   sqlx's migrator: see the `migrate` module's source).
//!
//! | URL | meaning |
//! |---|---|
//! | `sqlite://data/idempotency.db` | the file (created if missing), relative to the working directory |
//! | `sqlite:///var/lib/app/idempotency.db` | an absolute path |
//! | `…?synchronous=normal` | faster commits; the last ones may be lost on power loss |
//! | `…?busy_timeout=2s&max_connections=1` | how long to wait for a lock; connections per process |
//! | `…?migrate=false` | do not create or upgrade the table |
//!
//! Limits: ids up to 1024 bytes (longer ones are digested by the manager),
//! results and stored errors up to 16 MiB.

mod admin;
mod error;
mod migrate;
mod ops;
mod options;
mod repository;

pub use sqlx;

pub use ops::Statements;
pub use options::Durability;
pub use repository::{SqliteRepository, DEFAULT_BUSY_TIMEOUT, DEFAULT_MAX_CONNECTIONS};

/// [`SqliteRepository::connect`].
///
/// # Errors
/// See [`SqliteRepository::connect`].
pub async fn connect(url: &str) -> Result<SqliteRepository, idempotency_core::Error> {
    SqliteRepository::connect(url).await
}
