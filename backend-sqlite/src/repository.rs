//! [`SqliteRepository`]: the [`Repository`] over a SQLite file.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    Capabilities, Error, OwnedWrite, OwnerToken, Record, RecordKey, Repository, Reservation,
    ReserveRequest, Timestamp,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::SqlitePool;

use crate::error::{map_open, map_sqlx};
use crate::ops::{self, check_key, check_size};
use crate::options::{Durability, UrlOptions};

/// How long a statement waits for another connection's lock (and a call for
/// a connection of the pool) before it fails with a retryable
/// [`Error::Timeout`], by default.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections per pool by default: one. SQLite lets one connection write at
/// a time, and every operation of this store writes (a reservation takes the
/// write lock to decide); more connections in one process only wait on each
/// other's locks, through SQLite's busy handler, which sleeps. Processes
/// sharing the file are serialised by SQLite's locks either way.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1;

/// The idempotency store in a SQLite database file: durable across restarts,
/// no server to run, safe for several processes sharing the file (WAL mode;
/// every reservation decides and writes in one `BEGIN IMMEDIATE` transaction,
/// so two processes can never both acquire a key).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// use std::sync::Arc;
/// use idempotency_core::{Config, IdempotencyManager};
/// use idempotency_sqlite::SqliteRepository;
///
/// let dir = std::env::temp_dir().join(format!("idem-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let url = format!("sqlite://{}", dir.join("idempotency.db").display());
/// let repo = SqliteRepository::connect(&url).await?;
/// let manager = IdempotencyManager::new(Arc::new(repo), Config::default())?;
/// let charged = manager
///     .execute("payment-1", &(), || async { Ok::<_, idempotency_core::HandlerError<String>>(42) })
///     .await?;
/// assert_eq!(charged.into_value(), Some(42));
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteRepository {
    pool: SqlitePool,
}

impl SqliteRepository {
    /// Opens (creating it if missing) the database at a `sqlite://` URL and
    /// applies the embedded migrations, unless the URL says `migrate=false`.
    ///
    /// URL options: `max_connections` (default
    /// [`DEFAULT_MAX_CONNECTIONS`]), `busy_timeout` (default
    /// [`DEFAULT_BUSY_TIMEOUT`]; also the pool's acquire timeout),
    /// `synchronous` (`full`, the default, `normal` or `extra`: see
    /// [`Durability`]), `migrate`; and sqlx's `mode`, `cache`, `immutable`,
    /// `vfs`.
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed URL or option, a URL whose
    /// connections would not share one database (no path; an in-memory
    /// database with `cache=private`), a file that cannot be opened (a missing
    /// directory, no permission), a read-only file or a schema newer than this
    /// library; [`Error::Unavailable`] for an I/O failure of the disk.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let options = UrlOptions::parse(url)?;
        let busy = options.busy_timeout.unwrap_or(DEFAULT_BUSY_TIMEOUT);
        let connect = SqliteConnectOptions::from_str(&options.sqlx_url)
            .map_err(|e| map_sqlx(e, "connect", None))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match options.durability.unwrap_or_default() {
                Durability::Full => SqliteSynchronous::Full,
                Durability::Normal => SqliteSynchronous::Normal,
                Durability::Extra => SqliteSynchronous::Extra,
            })
            .busy_timeout(busy);
        let pool = SqlitePoolOptions::new()
            .max_connections(options.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS))
            // Kept open: closing the last connection of an in-memory
            // database (`sqlite::memory:`) would drop it.
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(busy)
            // A SQLite connection is a file handle, not a socket: nothing to
            // ping before handing it out.
            .test_before_acquire(false)
            .connect_with(connect)
            .await
            .map_err(|e| map_open(e, url))?;
        let repo = SqliteRepository { pool };
        if options.migrate.unwrap_or(true) {
            repo.migrate().await?;
        }
        Ok(repo)
    }

    /// A repository over a pool the application configured. Run
    /// [`migrate`](Self::migrate) once before use; use WAL mode and a busy
    /// timeout (as [`connect`](Self::connect) does) when several connections
    /// or processes share the file.
    pub fn from_pool(pool: SqlitePool) -> Self {
        SqliteRepository { pool }
    }

    /// Creates or upgrades the table this store needs; idempotent, and safe
    /// for processes starting together.
    ///
    /// # Errors
    /// The store's errors; [`Error::Config`] for a schema newer than this
    /// library.
    pub async fn migrate(&self) -> Result<(), Error> {
        crate::migrate::run(&self.pool).await
    }

    /// The schema version the database is at (0: never migrated), and the
    /// newest this library knows.
    ///
    /// # Errors
    /// The store's errors.
    pub async fn schema_version(&self) -> Result<(i64, i64), Error> {
        Ok((
            crate::migrate::version(&self.pool).await?,
            crate::migrate::latest_version(),
        ))
    }

    /// The connection pool (for raw access: tests, operator tools).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn write_owned(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        write: OwnedWrite<'_>,
    ) -> Result<(), Error> {
        check_key(key)?;
        ops::write_owned(&self.pool, key, owner, now, write).await
    }
}

#[async_trait]
impl Repository for SqliteRepository {
    fn capabilities(&self) -> Capabilities {
        ops::capabilities()
    }

    fn admin(&self) -> Option<&dyn idempotency_core::admin::Admin> {
        Some(self)
    }

    /// Decides and writes in one `BEGIN IMMEDIATE` transaction: the write lock
    /// is taken before the record is read, so no other connection or process
    /// can change it between the decision and the write. The decision is the
    /// core's (`reserve_transition`), the same the memory store makes.
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let key = req.key;
        check_key(key)?;
        let map = |e| map_sqlx(e, "reserve", Some(key));
        let mut tx = ops::begin_immediate(&self.pool).await.map_err(map)?;
        let existing = ops::select(&mut *tx, key, "reserve").await?;
        let (write, answer) = match reserve_transition(existing.as_ref(), &req) {
            ReserveTransition::Create => (
                Some(reserved_record(None, &req, 1)),
                Reservation::Acquired { attempt: 1 },
            ),
            ReserveTransition::Takeover { attempt } => (
                Some(reserved_record(existing.as_ref(), &req, attempt)),
                Reservation::Acquired { attempt },
            ),
            ReserveTransition::AlreadyHeld { attempt } => (None, Reservation::Acquired { attempt }),
            ReserveTransition::Existing => match existing {
                Some(record) => (None, Reservation::Existing(record)),
                None => return Err(Error::corrupt(key, "reserve found no record to return")),
            },
        };
        if let Some(record) = &write {
            ops::put(&mut *tx, key, record).await?;
        }
        tx.commit().await.map_err(map)?;
        Ok(answer)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        check_size("result", result)?;
        self.write_owned(key, owner, now, OwnedWrite::complete(result, expires_at))
            .await
    }

    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        check_size("error", error)?;
        let write = OwnedWrite::fail(error, retryable, expires_at);
        self.write_owned(key, owner, now, write).await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.write_owned(key, owner, now, OwnedWrite::Release).await
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let write = OwnedWrite::Extend {
            lease_until,
            expires_at,
        };
        self.write_owned(key, owner, now, write).await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        check_key(key)?;
        let record = ops::select(&self.pool, key, "get").await?;
        Ok(record.filter(|r| !r.is_expired(now)))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        check_key(key)?;
        let done = sqlx::query("DELETE FROM idempotency_records WHERE namespace = ?1 AND id = ?2")
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .execute(&self.pool)
            .await
            .map_err(|e| map_sqlx(e, "delete", Some(key)))?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let done = sqlx::query(
            "DELETE FROM idempotency_records WHERE (namespace, id) IN \
             (SELECT namespace, id FROM idempotency_records WHERE expires_at <= ?1 LIMIT ?2)",
        )
        .bind(ops::ts(now))
        .bind(limit)
        .execute(&self.pool)
        .await
        .map_err(|e| map_sqlx(e, "purge_expired", None))?;
        Ok(usize::try_from(done.rows_affected()).unwrap_or(usize::MAX))
    }
}
