//! [`PgRepositoryBuilder`]: from a URL (connecting a new pool) or from an
//! existing pool.

use std::str::FromStr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::Error;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};

use super::{PgRepository, DEFAULT_OPERATION_TIMEOUT};
use crate::coalesce::{Coalescer, DEFAULT_COALESCE_ABOVE};
use crate::error::{map_sqlx, BACKEND};
use crate::held::Held;
use crate::names::{Statements, DEFAULT_LOCK_TIMEOUT, DEFAULT_SCHEMA, DEFAULT_TABLE};
use crate::options::UrlOptions;
use crate::plan::{Planner, ReservePlan};

const DEFAULT_MAX_CONNECTIONS: u32 = 10;
const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a pooled connection may have been idle before it is pinged on
/// its way out of the pool (see `pool_options`).
const PING_IDLE_OVER: Duration = Duration::from_secs(1);

/// The pool's size.
fn pool_size(pool: &PgPool) -> usize {
    usize::try_from(pool.options().get_max_connections()).unwrap_or(usize::MAX)
}

/// The connections kept by default from a pool the caller passed in: half of
/// it (at least one), the rest left to the caller's own queries.
fn shared_pool_share(pool: &PgPool) -> usize {
    pool_size(pool).div_ceil(2)
}

/// Builds a [`PgRepository`]: from a URL (connecting a new pool) or from an
/// existing pool.
///
/// ```
/// use std::time::Duration;
/// use idempotency_postgres::PgRepository;
///
/// let builder = PgRepository::builder()
///     .schema("idempotency")
///     .table("payment_keys")
///     .max_connections(20)
///     .acquire_timeout(Duration::from_secs(2))
///     .operation_timeout(Duration::from_secs(10));
/// // builder.connect("postgres://…").await? or builder.build_with_pool(pool)?
/// # let _ = builder;
/// ```
#[derive(Debug, Clone)]
pub struct PgRepositoryBuilder {
    schema: String,
    table: String,
    max_connections: u32,
    acquire_timeout: Duration,
    operation_timeout: Duration,
    /// Whether `operation_timeout` was set (builder or URL), which also bounds
    /// operations in a caller's transaction.
    explicit_timeout: bool,
    /// How long a statement waits for a row lock; by default derived from
    /// the operation timeout.
    lock_timeout: Option<Duration>,
    /// How many connections the repository keeps between its operations; by
    /// default the whole pool it creates, half of a pool it is given.
    held_connections: Option<usize>,
    reserve_plan: ReservePlan,
    coalesce_above: usize,
    single_calls_over_arrays: bool,
    detach_after: Duration,
}

impl Default for PgRepositoryBuilder {
    fn default() -> Self {
        PgRepositoryBuilder {
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            explicit_timeout: false,
            lock_timeout: None,
            held_connections: None,
            reserve_plan: ReservePlan::default(),
            coalesce_above: DEFAULT_COALESCE_ABOVE,
            single_calls_over_arrays: false,
            detach_after: crate::coalesce::DETACH_AFTER,
        }
    }
}

impl PgRepositoryBuilder {
    /// The schema (default `public`): 1 to 63 ASCII letters, digits or `_`, not
    /// starting with a digit or `pg_`. Used quoted, so case matters.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The table (default `idempotency_records`): 1 to 48 ASCII letters, digits
    /// or `_`, not starting with a digit (derived names such as
    /// `{table}_expires_at_idx` must fit Postgres's 63 bytes). Used quoted.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The size of a pool this builder creates (default 10).
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// How long an operation waits for a pooled connection before failing with
    /// [`Error::Unavailable`] (default 5 s; also bounds connecting while the
    /// server is down). Zero is refused when the repository is built.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// An upper bound on each of this crate's operations, after which it fails
    /// with [`Error::Timeout`] (default 5 s, as the manager's `store_timeout`;
    /// zero is refused when the repository is built). A paused or black-holed
    /// server fails each call after this long, never after the outage.
    ///
    /// Operations on your own connection ([`PgRepository::in_transaction`], the
    /// [`PgTransactionalManager`](crate::PgTransactionalManager)) are bounded
    /// only when you set this explicitly, because a timer that gives up on a
    /// statement still running on the server leaves your connection busy
    /// (a reservation's wait for a row lock is bounded there anyway, by
    /// [`lock_timeout`](Self::lock_timeout)).
    ///
    /// It is a client-side timer around this crate's statements only — never a
    /// connection's `statement_timeout`, which would also cut the business
    /// statements a transactional handler runs on the same connection. A
    /// statement abandoned by the timer may still complete on the server: the
    /// timeout is ambiguous ("maybe applied"), and the manager retries it with
    /// the same owner token, which the contract makes safe.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self.explicit_timeout = true;
        self
    }

    /// How long one of this crate's statements waits for a row lock that
    /// another transaction holds (default [`DEFAULT_LOCK_TIMEOUT`], 250 ms,
    /// or half the [`operation_timeout`](Self::operation_timeout) when that
    /// is shorter; it must be shorter than the operation timeout). Also the
    /// URL option `lock_timeout=…`.
    ///
    /// Each statement sets PostgreSQL's `lock_timeout` for itself alone, so
    /// the bound is the server's: the statement ends there, with nothing
    /// applied, and never keeps its connection waiting after the client gave
    /// up on it. A **reservation** that meets it is answered
    /// [`Error::InProgress`] (`retry_after` this bound): the key is held by
    /// a transaction not yet committed — a [`PgTransactionalManager`](crate::PgTransactionalManager)'s
    /// handler, your own [`in_transaction`](PgRepository::in_transaction)
    /// work — and the manager answers the duplicate as for any live holder,
    /// or polls under its wait policy; never an outage, so never a
    /// fail-open run beside the holder. A holder that commits within the
    /// bound answers the duplicate with its outcome instead. A completion,
    /// failure, release, extension or delete that meets it is a retryable
    /// [`Error::Timeout`] (nothing applied); a batch statement waits at most
    /// 100 ms (less when this is shorter), then its keys go one by one.
    ///
    /// Keep it well below the manager's `store_timeout`: a reservation cut by
    /// the manager's timer first is an outage. Raise it where transactional
    /// handlers are short and duplicates should rather wait for their
    /// outcome than be answered in progress; every waiting duplicate holds a
    /// connection meanwhile. A lock on the whole table (a migration,
    /// `LOCK TABLE`) is waited for before a plain statement can set the
    /// bound (only the operation timeout, or a `lock_timeout` of your role,
    /// ends that wait), or inside the reservation function after it did:
    /// then the reservation is answered `InProgress` too — nothing runs, and
    /// the delivery is tried again later.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_postgres::PgRepository;
    ///
    /// // Duplicates wait up to a second for a transactional holder's outcome.
    /// let builder = PgRepository::builder().lock_timeout(Duration::from_secs(1));
    /// # let _ = builder;
    /// ```
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = Some(timeout);
        self
    }

    /// How many of the pool's connections the repository keeps checked out
    /// between its own operations, and so how many of its operations run at
    /// once (the others wait their turn, up to the pool's acquire timeout).
    ///
    /// sqlx's pool pings every connection it gets back, which would double the
    /// round trips of each one-statement operation. A kept connection skips
    /// that: an operation that got its answer leaves its connection to the
    /// next operation; one that was cancelled or hit an outage or a timeout
    /// gives it back to the pool, whose ping drains it in the background. A
    /// connection unused for a second goes back to the pool, and every
    /// connection does 30 s after it was taken, however busy.
    ///
    /// Default: the whole pool when the builder creates it
    /// ([`connect`](Self::connect), [`connect_lazy`](Self::connect_lazy)), half
    /// of a pool you pass in ([`build_with_pool`](Self::build_with_pool),
    /// [`PgRepository::from_pool`]), so that your own queries on it keep their
    /// share under load. Capped at the pool's size; `0` takes every
    /// connection from the pool and gives it back after each operation (the
    /// behaviour before this option, one ping per operation). Also the URL
    /// option `held_connections=N`.
    ///
    /// The [`PgTransactionalManager`](crate::PgTransactionalManager) takes its
    /// transactions' connections the same way, so the two modes share the
    /// turns fairly. Queries of your own on [`PgRepository::pool`] do not: under
    /// a steady load that keeps every connection busy, they wait in the pool's
    /// queue for a connection that returns (at the latest 30 s after it was
    /// taken); set this below `max_connections` to leave them a share. A kept
    /// connection skips the pool's own checks on acquire (`test_before_acquire`,
    /// `before_acquire`, `after_release` hooks of a pool you pass in); the
    /// pool's release check runs each time it goes back.
    pub fn held_connections(mut self, connections: usize) -> Self {
        self.held_connections = Some(connections);
        self
    }

    /// Which statement a single reservation sends first (default
    /// [`ReservePlan::Adaptive`]); every plan answers alike, see
    /// [`ReservePlan`]. Also the URL option `reserve_plan=…`.
    pub fn reserve_plan(mut self, plan: ReservePlan) -> Self {
        self.reserve_plan = plan;
        self
    }

    /// How many single reservations and completions may have a statement in
    /// flight at once before the next ones are coalesced (default
    /// [`DEFAULT_COALESCE_ABOVE`], 2; `0` turns coalescing off). Also the URL
    /// option `coalesce_above=N`.
    ///
    /// Statements are sent by tasks of the repository's own, one per slot. A
    /// call that finds fewer in flight starts one, which sends it alone at
    /// once (one task hop more than without this option). A call that finds
    /// this many waits; when one of those statements ends, every call waiting
    /// then goes in one statement over arrays (reservations as the reserve
    /// plan says, then through the reservation function, per key; completions
    /// through the owner-checked update), up to 128 calls and each key once.
    /// A caller that gives up, or whose future is leaked and never polled
    /// again, strands nobody and holds no slot. Each call keeps its own instants and gets
    /// its own answer, the one its single statement would have given; an
    /// error of the shared statement is each of its calls' (an outage or a
    /// timeout is "maybe applied", as for a single statement, and retried with
    /// the same owner token). A call usually waits for one statement to end
    /// before its own is sent (longer behind waiting completions, which go
    /// first, behind more than 128 waiting calls, or behind other calls for
    /// its key, which go one per statement), always within the operation
    /// timeout. A statement of
    /// one call that waits on a row lock (a key another transaction holds)
    /// gives up its slot after 100 ms and ends on a task of its own, so the
    /// calls behind it do not wait for that lock.
    ///
    /// Under a load above the limit, a statement's round trip, wake-ups and
    /// commit are shared by the calls it carries, which is most of what a
    /// one-row statement costs the client and the server: see BENCHMARKS.md.
    /// Lower it for a server whose CPU is the limit, raise it (or turn it
    /// off) where round trips are long and the server has cores to spare, or
    /// where many deliveries of one key arrive at once.
    /// Reservations and completions on your own connection
    /// ([`PgRepository::in_transaction`], the
    /// [`PgTransactionalManager`](crate::PgTransactionalManager)) and the
    /// batch operations are never coalesced.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// use idempotency_postgres::PgRepository;
    ///
    /// // A remote server with cores to spare: more statements in flight.
    /// let repo = PgRepository::builder()
    ///     .coalesce_above(16)
    ///     .connect_lazy("postgres://app@db.internal/app")?;
    /// // The same from the URL; 0 turns coalescing off.
    /// let off = PgRepository::builder().connect_lazy("postgres://app@db.internal/app?coalesce_above=0")?;
    /// # let _ = (repo, off);
    /// # Ok::<(), idempotency_core::Error>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn coalesce_above(mut self, statements: usize) -> Self {
        self.coalesce_above = statements;
        self
    }

    /// For this crate's tests: every single reservation and completion,
    /// also one that finds a slot free, goes through the statements over
    /// arrays that coalesced calls use, so that the whole conformance suite
    /// checks their answers call by call. Slower; never for production.
    #[doc(hidden)]
    pub fn single_calls_over_arrays(mut self) -> Self {
        self.single_calls_over_arrays = true;
        self
    }

    /// For this crate's tests: how long a coalescing slot waits for calls it
    /// sent on statements of their own before leaving them to tasks of their
    /// own (100 ms otherwise), so that a test can hold the slot with a call
    /// blocked on a row lock.
    #[doc(hidden)]
    pub fn coalesced_calls_detach_after(mut self, after: Duration) -> Self {
        self.detach_after = after;
        self
    }

    fn apply_url_options(&mut self, options: &UrlOptions) {
        if let Some(schema) = &options.schema {
            self.schema.clone_from(schema);
        }
        if let Some(table) = &options.table {
            self.table.clone_from(table);
        }
        if let Some(max) = options.max_connections {
            self.max_connections = max;
        }
        if let Some(timeout) = options.acquire_timeout {
            self.acquire_timeout = timeout;
        }
        if let Some(timeout) = options.operation_timeout {
            self.operation_timeout = timeout;
            self.explicit_timeout = true;
        }
        if let Some(timeout) = options.lock_timeout {
            self.lock_timeout = Some(timeout);
        }
        if let Some(held) = options.held_connections {
            self.held_connections = Some(held);
        }
        if let Some(plan) = options.reserve_plan {
            self.reserve_plan = plan;
        }
        if let Some(above) = options.coalesce_above {
            self.coalesce_above = above;
        }
    }

    /// The repository on `pool`: `own` when this builder created it.
    pub(super) fn assemble(&self, pool: PgPool, sql: Statements, own: bool) -> PgRepository {
        let limit = match self.held_connections {
            Some(limit) => limit.min(pool_size(&pool)),
            None if own => pool_size(&pool),
            None => shared_pool_share(&pool),
        };
        PgRepository {
            held: Arc::new(Held::new(pool.clone(), limit)),
            pool,
            sql: Arc::new(sql),
            operation_timeout: self.operation_timeout,
            transaction_timeout: self.transaction_timeout(),
            schema_current: Arc::new(AtomicBool::new(false)),
            planner: Arc::new(Planner::new(self.reserve_plan)),
            coalescer: Arc::new(
                Coalescer::new(self.coalesce_above, self.single_calls_over_arrays)
                    .detaching_after(self.detach_after),
            ),
        }
    }

    fn transaction_timeout(&self) -> Option<Duration> {
        self.explicit_timeout.then_some(self.operation_timeout)
    }

    /// The row-lock bound: as set, else [`DEFAULT_LOCK_TIMEOUT`] or half the
    /// operation timeout, whichever is shorter.
    pub(super) fn effective_lock_timeout(&self) -> Duration {
        self.lock_timeout
            .unwrap_or_else(|| DEFAULT_LOCK_TIMEOUT.min(self.operation_timeout / 2))
    }

    /// Refuses settings no repository can work with.
    fn validate(&self) -> Result<Statements, Error> {
        if self.operation_timeout.is_zero() || self.acquire_timeout.is_zero() {
            return Err(Error::config(
                "PostgreSQL operation_timeout and acquire_timeout must be positive",
            ));
        }
        let lock_timeout = self.effective_lock_timeout();
        if lock_timeout < Duration::from_millis(1) || lock_timeout >= self.operation_timeout {
            return Err(Error::config(format!(
                "PostgreSQL lock_timeout ({lock_timeout:?}) must be at least 1 ms and shorter \
                 than operation_timeout ({:?}), so that a reservation waiting for a key another \
                 transaction holds is answered in progress before the client gives up on it",
                self.operation_timeout
            )));
        }
        Statements::bounded(&self.schema, &self.table, lock_timeout)
    }

    /// Connects a new pool to `url` (`postgres://` or `postgresql://`) and checks
    /// that one connection opens.
    ///
    /// The URL's query may carry this crate's options — `schema`, `table`,
    /// `max_connections`, `acquire_timeout`, `operation_timeout`, `lock_timeout`
    /// (durations such as `5s` or `500ms`), `held_connections`, `reserve_plan`,
    /// `coalesce_above`
    /// and `migrate=true` (run [`PgRepository::migrate`]) —
    /// which override the builder's; every other option (`sslmode`,
    /// `application_name`, …) is sqlx's.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL, an unknown option, a bad name, a zero
    /// timeout, `sslmode=require` without the `tls` feature, credentials or a
    /// database the server refuses; [`Error::Unavailable`] when the server
    /// refuses the connection (at once) or none opens within the acquire timeout.
    pub async fn connect(self, url: &str) -> Result<PgRepository, Error> {
        let (repo, migrate) = self.connect_inner(url).await?;
        if migrate == Some(true) {
            repo.migrate().await?;
        }
        Ok(repo)
    }

    pub(crate) async fn connect_inner(
        mut self,
        url: &str,
    ) -> Result<(PgRepository, Option<bool>), Error> {
        let options = UrlOptions::parse(url)?;
        self.apply_url_options(&options);
        let sql = self.validate()?;
        let connect = self.connect_options(&options)?;
        self.probe(&connect, &sql.qualified).await?;
        let pool = self
            .pool_options()
            .connect_with(connect)
            .await
            .map_err(|e| map_sqlx(e, "connect", None, &sql.qualified))?;
        Ok((self.assemble(pool, sql, true), options.migrate))
    }

    /// Opens and closes one connection, so that a refused connection, bad
    /// credentials or a missing database are reported at once and as what
    /// they are (the pool would retry a refused connection until its acquire
    /// timeout and report only that).
    async fn probe(&self, connect: &PgConnectOptions, table: &str) -> Result<(), Error> {
        use sqlx::Connection as _;
        let conn = tokio::time::timeout(self.acquire_timeout, PgConnection::connect_with(connect))
            .await
            .map_err(|_| Error::Unavailable {
                backend: BACKEND,
                message: format!(
                    "connect: no connection within the acquire timeout ({:?})",
                    self.acquire_timeout
                ),
                source: None,
            })?
            .map_err(|e| map_sqlx(e, "connect", None, table))?;
        // Closing politely is a courtesy: a failure here changes nothing.
        let _ = conn.close().await;
        Ok(())
    }

    /// Like [`PgRepositoryBuilder::connect`], without opening a connection yet:
    /// the first operation does (so the server need not be up now).
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL or name.
    pub fn connect_lazy(mut self, url: &str) -> Result<PgRepository, Error> {
        let options = UrlOptions::parse(url)?;
        self.apply_url_options(&options);
        let sql = self.validate()?;
        let connect = self.connect_options(&options)?;
        let pool = self.pool_options().connect_lazy_with(connect);
        Ok(self.assemble(pool, sql, true))
    }

    /// Uses the caller's pool (its size and timeouts are the pool's own; this
    /// builder's `max_connections` and `acquire_timeout` do not apply).
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid schema or table name or a zero timeout.
    pub fn build_with_pool(self, pool: PgPool) -> Result<PgRepository, Error> {
        let sql = self.validate()?;
        Ok(self.assemble(pool, sql, false))
    }

    /// The connection options. No `statement_timeout` is set on the
    /// connections: it would also bound the business statements a
    /// transactional handler runs on them (see [`PgTransactionalManager`](crate::PgTransactionalManager)).
    fn connect_options(&self, options: &UrlOptions) -> Result<PgConnectOptions, Error> {
        PgConnectOptions::from_str(&options.sqlx_url)
            .map_err(|e| Error::config(format!("invalid PostgreSQL URL: {e}")))
    }

    /// Pools created here skip sqlx's ping before handing out a connection
    /// that was in use within the last [`PING_IDLE_OVER`], so an operation
    /// under load is one round trip (sqlx still checks each connection when
    /// it returns to the pool, off the operation's path). A connection idle
    /// for longer is pinged first, and replaced if the server or a middlebox
    /// ended it meanwhile (`idle_session_timeout`, a NAT's idle timer), so an
    /// operation after a quiet spell does not fail on it. After a server
    /// restart, a connection used within that second that died fails one
    /// operation with [`Error::Unavailable`] and is replaced.
    fn pool_options(&self) -> PgPoolOptions {
        PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > PING_IDLE_OVER {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
    }
}
