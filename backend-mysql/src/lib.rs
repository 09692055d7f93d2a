//! MySQL and MariaDB backend of idempotency-rs: [`MySqlRepository`], an
//! idempotency [`Repository`](idempotency_core::Repository) in one InnoDB
//! table, on a sqlx [`MySqlPool`](sqlx::MySqlPool).
//!
//! ```no_run
//! use std::sync::Arc;
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, Outcome};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // Connects, and creates the table on first use (`migrate=false` to skip).
//! let repo = idempotency_mysql::connect("mysql://app:secret@localhost/shop").await?;
//! let manager = IdempotencyManager::new(Arc::new(repo), Config::default())?;
//!
//! // The broker delivers the same message twice: the handler runs once.
//! for delivery in 1..=2 {
//!     let outcome = manager
//!         .execute("ProcessPayment:evt-42", &10, || async {
//!             Ok::<_, HandlerError<String>>("receipt-1".to_owned())
//!         })
//!         .await?;
//!     assert!(matches!((delivery, outcome), (1, Outcome::Executed(_)) | (2, Outcome::Cached(_))));
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # How a reservation is decided
//!
//! Never a read-then-write race, never an interactive transaction (a call
//! cancelled between `BEGIN` and its reply would leave an open transaction
//! on a pooled connection), and one round trip in the common cases:
//!
//! | case | statements |
//! |---|---|
//! | fresh key | one `INSERT` (the primary key decides between racing consumers: one gets a duplicate-key error) |
//! | duplicate, in progress, our own live reservation | the failed `INSERT`, then one plain `SELECT`, answered with the core's rule |
//! | takeover (expired, lease ended, retryable failure) | the failed `INSERT`, a `SELECT`, then one `UPDATE … WHERE` *the row is still the one read* (a compare-and-set); if another consumer changed it first, the round starts over and sees its reservation |
//! | complete, fail, extend, release | one owner-checked `UPDATE` or `DELETE` (`WHERE owner = ? AND status = 'processing' AND expires_at > now`) |
//! | get / delete / purge | one `SELECT` / `DELETE` / `DELETE … ORDER BY expires_at LIMIT n` |
//!
//! The decision is the core's (`reserve_transition`), the rule every store
//! applies; the compare-and-set makes two consumers taking over one key take
//! turns, and the second sees the first's reservation.
//!
//! # Support table
//!
//! | | |
//! |---|---|
//! | keys | `VARBINARY(512)` namespace and `VARBINARY(1024)` id: byte for byte, no collation, no `PAD SPACE` (`a`, `A`, `a ` and `a\0` are four keys); longer ids are digested by the manager |
//! | results, stored errors | `LONGBLOB`, up to 64 MiB and below the server's `max_allowed_packet` (read at connect; MariaDB's default 16 MiB allows just under 16 MiB); larger values are refused with [`Error::TooLarge`](idempotency_core::Error::TooLarge) before any statement. Should the server's setting be lowered later, a write it refuses, or whose connection it cuts while the value is sent, reads the size again and is answered `TooLarge` too (the manager then records the outcome without the value), and later values are checked against the lower size |
//! | timestamps | milliseconds (`BIGINT`), from the caller's clock; the server's clock is never used |
//! | expiry | an expired row is absent to every operation; no native expiry: schedule [`purge_expired`](idempotency_core::Repository::purge_expired) |
//! | timeouts | every operation under `operation_timeout` (default 5 s) → retryable [`Error::Timeout`](idempotency_core::Error::Timeout); pools made by [`connect`] also set the session's `innodb_lock_wait_timeout` to it (rounded up to whole seconds), so a statement abandoned behind a row lock frees its connection soon after (with your own pool, set it yourself) |
//! | outages | connection errors, a server shutting down, too many connections, deadlocks, a read-only server (a failover), a server out of a resource for now (disk, a full tablespace, memory, lock table, `max_prepared_stmt_count`), a statement to prepare again (1615), a Group Replication rollback (3101) → retryable [`Error::Unavailable`](idempotency_core::Error::Unavailable) |
//! | corrupt rows | [`Error::Corrupt`](idempotency_core::Error::Corrupt) naming the key, never a panic |
//! | servers | MariaDB 10.5+ (tested: 10.11 from Debian), MySQL 5.7 and 8.x (InnoDB, `ROW_FORMAT=DYNAMIC`) |
//!
//! # URL
//!
//! | URL | meaning |
//! |---|---|
//! | `mysql://user:password@host:3306/database` | the database (it must exist); `mariadb://` is the same |
//! | `…?table=payment_keys` | another table (ASCII letters, digits, `_`; at most 64) |
//! | `…?max_connections=20&acquire_timeout=2s&operation_timeout=2s` | pool size and timeouts |
//! | `…?migrate=false` | do not create or upgrade the table |
//! | `…?ssl-mode=required` | TLS (the `tls` feature); a server without TLS under such a mode, or a certificate the client does not trust (`verify_ca`, `verify_identity`), is an `Error::Config` (no retry fixes it) |
//!
//! Migrations are embedded and applied by [`MySqlRepository::connect`] (unless
//! `migrate=false`) or [`MySqlRepository::migrate`], under a `GET_LOCK` named
//! after the table, with their versions in `idempotency_schema_migrations`
//! (why not sqlx's migrator: see the `migrate` module's source).

mod admin;
mod error;
mod migrate;
mod ops;
mod options;
mod repository;

pub use sqlx;

pub use ops::Statements;
pub use repository::{
    MySqlRepository, DEFAULT_ACQUIRE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_TABLE,
};

/// [`MySqlRepository::connect`].
///
/// # Errors
/// See [`MySqlRepository::connect`].
pub async fn connect(url: &str) -> Result<MySqlRepository, idempotency_core::Error> {
    MySqlRepository::connect(url).await
}
