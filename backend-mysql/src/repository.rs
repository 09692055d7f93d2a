//! [`MySqlRepository`]: the [`Repository`] over a MySQL or MariaDB table.

use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    Capabilities, Error, OwnedWrite, OwnerToken, Record, RecordKey, Repository, Reservation,
    ReserveRequest, Status, Timestamp,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{Connection, MySqlConnection, MySqlPool, Row};

use crate::error::{map_sqlx, BACKEND};
use crate::ops::{self, Statements};
use crate::options::UrlOptions;

/// The table used unless the URL's `table` option names another.
pub const DEFAULT_TABLE: &str = "idempotency_records";
/// Connections per pool unless the URL's `max_connections` says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10;
/// How long [`connect`](MySqlRepository::connect) waits for the server by
/// default. An operation waits for a pooled connection within its own
/// operation timeout, unless the URL's `acquire_timeout` sets a shorter wait.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one operation may take, round trips included, before it fails
/// with a retryable [`Error::Timeout`], by default (as the manager's
/// `store_timeout`).
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a pooled connection may have been idle before it is pinged on
/// its way out of the pool.
const PING_IDLE_OVER: Duration = Duration::from_secs(1);

/// The idempotency store in a MySQL (5.7, 8.x) or MariaDB (10.5+) table.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use idempotency_core::{Config, HandlerError, IdempotencyManager};
/// use idempotency_mysql::MySqlRepository;
///
/// // Connects, and creates the table on first use (`migrate=false` to skip).
/// let repo = MySqlRepository::connect("mysql://app:secret@localhost/shop").await?;
/// let manager = IdempotencyManager::new(Arc::new(repo), Config::default())?;
/// let receipt = manager
///     .execute("ProcessPayment:evt-42", &10, || async {
///         Ok::<_, HandlerError<String>>("receipt-1".to_owned())
///     })
///     .await?;
/// # let _ = receipt;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlRepository {
    pool: MySqlPool,
    sql: Arc<Statements>,
    /// The server's `max_allowed_packet` as last read (at connect, and again
    /// when a value's write failed: see `MySqlRepository::over_packet`):
    /// values are capped below it. Shared by clones.
    max_allowed_packet: Arc<AtomicU64>,
    operation_timeout: Duration,
}

impl MySqlRepository {
    /// Connects a new pool to the server at a `mysql://` (or `mariadb://`)
    /// URL and applies the embedded migrations, unless the URL says
    /// `migrate=false`.
    ///
    /// URL options: `table` (default [`DEFAULT_TABLE`]), `migrate`,
    /// `max_connections` (default [`DEFAULT_MAX_CONNECTIONS`]),
    /// `acquire_timeout` (default [`DEFAULT_ACQUIRE_TIMEOUT`]),
    /// `operation_timeout` (default [`DEFAULT_OPERATION_TIMEOUT`]); sqlx's
    /// `ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`, `socket`, `charset`,
    /// `collation`, `statement-cache-capacity`, `timezone`,
    /// `enable-cleartext-plugin` pass through. Any other option is an
    /// [`Error::Config`] naming it.
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed URL or option, refused credentials,
    /// an unknown database, a schema newer than this library;
    /// [`Error::Unavailable`] when the server cannot be reached within the
    /// acquire timeout.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let options = UrlOptions::parse(url)?;
        let table = options.table.as_deref().unwrap_or(DEFAULT_TABLE);
        ops::valid_table(table)?;
        let acquire = options.acquire_timeout.unwrap_or(DEFAULT_ACQUIRE_TIMEOUT);
        let connect = MySqlConnectOptions::from_str(&options.sqlx_url)
            .map_err(|e| Error::config(format!("invalid MySQL URL: {e}")))?;
        let max_allowed_packet = probe(&connect, acquire, table).await?;
        let operation_timeout = options
            .operation_timeout
            .unwrap_or(DEFAULT_OPERATION_TIMEOUT);
        // Unless asked otherwise, waiting for a pooled connection is part of
        // the operation and bounded by its timeout alone: a server that
        // stops answering is a `Timeout` of the operation, not a pool error
        // that happens to fire first.
        let pool_wait = options
            .acquire_timeout
            .unwrap_or(operation_timeout + Duration::from_secs(1));
        let lock_wait = lock_wait_seconds(operation_timeout);
        let pool = MySqlPoolOptions::new()
            .max_connections(options.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS))
            .acquire_timeout(pool_wait)
            // One round trip per statement: no ping before each use of a
            // connection used within the last second. One idle for longer
            // is pinged first and replaced if the server (`wait_timeout`) or
            // a middlebox ended it meanwhile, so an operation after a quiet
            // spell does not fail on it. After a server restart, a connection
            // used within that second fails one operation with
            // Error::Unavailable and is replaced.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > PING_IDLE_OVER {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            // A statement the operation timeout abandoned behind a row lock
            // keeps its connection until the server gives up the wait: make
            // that soon after the timeout, not InnoDB's default 50 s.
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "SET SESSION innodb_lock_wait_timeout = {lock_wait}"
                    ))
                    .execute(conn)
                    .await
                    .map(drop)
                })
            })
            .connect_with(connect)
            .await
            .map_err(|e| map_sqlx(e, "connect", None, table))?;
        let repo = MySqlRepository {
            pool,
            sql: Arc::new(Statements::new(table)),
            max_allowed_packet: Arc::new(AtomicU64::new(max_allowed_packet)),
            operation_timeout,
        };
        if options.migrate.unwrap_or(true) {
            repo.migrate().await?;
        }
        Ok(repo)
    }

    /// A repository on `table` over a pool the application configured (its
    /// size, TLS and timeouts are the pool's own). Reads the server's
    /// `max_allowed_packet` (and again should a value's write fail); run
    /// [`migrate`](Self::migrate) once before use.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid table name; the store's errors when
    /// the server cannot be asked.
    pub async fn from_pool(pool: MySqlPool, table: &str) -> Result<Self, Error> {
        ops::valid_table(table)?;
        let max_allowed_packet = max_allowed_packet(&pool, table).await?;
        Ok(MySqlRepository {
            pool,
            sql: Arc::new(Statements::new(table)),
            max_allowed_packet: Arc::new(AtomicU64::new(max_allowed_packet)),
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
        })
    }

    /// The same repository with another operation timeout (see
    /// [`DEFAULT_OPERATION_TIMEOUT`]). A timed-out operation may still have
    /// applied; the manager retries it with the same owner token, which every
    /// operation accepts idempotently.
    ///
    /// # Panics
    /// Never; a zero timeout is raised to one millisecond.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Creates or upgrades the table this store needs; idempotent, and safe
    /// for processes starting together.
    ///
    /// # Errors
    /// The store's errors; [`Error::Config`] for a schema newer than this
    /// library or a user without the `CREATE` privilege.
    pub async fn migrate(&self) -> Result<(), Error> {
        crate::migrate::run(&self.pool, self.sql.table()).await
    }

    /// The schema version the table is at (0: never migrated), and the
    /// newest this library knows.
    ///
    /// # Errors
    /// The store's errors.
    pub async fn schema_version(&self) -> Result<(u32, u32), Error> {
        Ok((
            crate::migrate::version(&self.pool, self.sql.table()).await?,
            crate::migrate::latest_version(),
        ))
    }

    /// The connection pool (for raw access: tests, operator tools).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        self.sql.table()
    }

    /// The statements this repository runs (for benchmarks against raw sqlx
    /// and for operator tools).
    pub fn statements(&self) -> &Statements {
        &self.sql
    }

    /// Runs `fut` under the operation timeout.
    async fn timed<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        tokio::time::timeout(self.operation_timeout, fut)
            .await
            .unwrap_or(Err(Error::Timeout {
                backend: BACKEND,
                operation,
            }))
    }

    fn check_key(&self, key: &RecordKey) -> Result<(), Error> {
        self.capabilities().check_id(key)
    }

    /// One owner-checked write. One carrying a value (a result or an error) is
    /// refused with [`Error::TooLarge`] before any statement when over the
    /// packet size last read, and also when the write fails because the
    /// server's `max_allowed_packet` was lowered since (the server refuses the
    /// statement, or cuts the connection while it is sent): the manager then
    /// records the outcome without the value, rather than retrying a write
    /// that cannot succeed until the lease ends.
    async fn write_owned(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        write: OwnedWrite<'_>,
    ) -> Result<(), Error> {
        let (what, value) = carried(&write);
        self.capabilities().check_value(what, value)?;
        self.check_key(key)?;
        let operation = write.operation();
        self.timed(operation, async {
            let written = ops::write_owned(&self.sql, &self.pool, key, owner, now, write).await;
            match (written, value) {
                (Err(e), Some(value)) if may_be_over_packet(&e, value) => {
                    Err(self.over_packet(what, value).await.unwrap_or(e))
                }
                (written, _) => written,
            }
        })
        .await
    }

    /// After a value's write failed: reads the server's `max_allowed_packet`
    /// again, keeps the lower of it and the one known, and answers
    /// [`Error::TooLarge`] when `value` no longer fits. A statement over its
    /// connection's packet size is refused before it runs; after a cut
    /// connection that still had a larger size the write may have been
    /// applied, and the manager's retry without the value then finds the
    /// execution recorded by its own token, as after any lost reply. `None`
    /// when it fits, or the server cannot say.
    async fn over_packet(&self, what: &'static str, value: &[u8]) -> Option<Error> {
        let global: u64 =
            sqlx::query_scalar("SELECT CAST(@@GLOBAL.max_allowed_packet AS UNSIGNED)")
                .fetch_one(&self.pool)
                .await
                .ok()?;
        self.max_allowed_packet.fetch_min(global, Ordering::Relaxed);
        self.capabilities().check_value(what, Some(value)).err()
    }
}

/// The value `write` carries, named as the size check names it.
fn carried<'a>(write: &OwnedWrite<'a>) -> (&'static str, Option<&'a [u8]>) {
    match write {
        OwnedWrite::Finish {
            status: Status::Completed,
            value,
            ..
        } => ("result", *value),
        OwnedWrite::Finish { value, .. } => ("error", *value),
        OwnedWrite::Extend { .. } | OwnedWrite::Release => ("value", None),
    }
}

/// Whether a write's error may come from a statement carrying `value` over
/// the server's `max_allowed_packet`: the server's refusal ([`Error::Config`]),
/// or, for a value larger than any server's packet is set to in practice, the
/// connection it cut while the statement was still being sent (an outage; a
/// small value's outage is left as it is, without asking a server that may
/// be gone).
fn may_be_over_packet(err: &Error, value: &[u8]) -> bool {
    matches!(err, Error::Config { .. })
        || (err.is_store_outage() && value.len() > ops::PACKET_HEADROOM)
}

/// The session's `innodb_lock_wait_timeout` for an operation timeout: whole
/// seconds, rounded up, at least 1.
fn lock_wait_seconds(operation_timeout: Duration) -> u64 {
    operation_timeout.as_millis().div_ceil(1000).max(1) as u64
}

/// Opens and closes one connection, so that a refused connection, bad
/// credentials or an unknown database are reported at once and as what they
/// are (a pool would retry until its acquire timeout and report only that);
/// returns the server's `max_allowed_packet`.
async fn probe(connect: &MySqlConnectOptions, within: Duration, table: &str) -> Result<u64, Error> {
    let mut conn = tokio::time::timeout(within, MySqlConnection::connect_with(connect))
        .await
        .map_err(|_| Error::Unavailable {
            backend: BACKEND,
            message: format!("connect: no connection within the acquire timeout ({within:?})"),
            source: None,
        })?
        .map_err(|e| map_sqlx(e, "connect", None, table))?;
    let packet = max_allowed_packet(&mut conn, table).await;
    // Closing politely is a courtesy: a failure here changes nothing.
    let _ = conn.close().await;
    packet
}

async fn max_allowed_packet<'e>(
    exec: impl sqlx::MySqlExecutor<'e>,
    table: &str,
) -> Result<u64, Error> {
    sqlx::query("SELECT CAST(@@max_allowed_packet AS UNSIGNED)")
        .fetch_one(exec)
        .await
        .and_then(|row| row.try_get::<u64, _>(0))
        .map_err(|e| map_sqlx(e, "connect", None, table))
}

#[async_trait]
impl Repository for MySqlRepository {
    fn capabilities(&self) -> Capabilities {
        ops::capabilities(Some(self.max_allowed_packet.load(Ordering::Relaxed)))
    }

    fn admin(&self) -> Option<&dyn idempotency_core::admin::Admin> {
        Some(self)
    }

    /// One `INSERT` for a fresh key; a plain read for a duplicate; a row lock
    /// only to take a key over (see the crate docs).
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        self.check_key(req.key)?;
        self.timed("reserve", ops::reserve(&self.sql, &self.pool, &req))
            .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
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
        self.check_key(key)?;
        let read = ops::select(&self.sql, &self.pool, key, "get");
        let record = self.timed("get", read).await?;
        Ok(record.filter(|r| !r.is_expired(now)))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        self.check_key(key)?;
        self.timed("delete", ops::delete(&self.sql, &self.pool, key))
            .await
    }

    /// In chunks of 100, each under the operation timeout.
    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        ops::purge(&self.sql, &self.pool, now, limit, self.operation_timeout).await
    }
}
