//! Transactional mode: the idempotency record commits or rolls back with the
//! caller's own writes.

use std::fmt;
use std::sync::Arc;

use idempotency_core::decision::decide_duplicate;
use idempotency_core::stages::{
    answer_duplicate, cacheable_result, failure_record, reserve_request, FailureRecord, Front,
};
use idempotency_core::{
    BoxFuture, Clock, Codec, Config, Error, ExecuteError, Fingerprint, HandlerError, JsonCodec,
    Outcome, OwnerToken, Record, RecordKey, Repository, Reservation, ReserveRequest, Status,
    SystemClock, Timestamp,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::PgConnection;
use tracing::Instrument;

use crate::error::map_sqlx;
use crate::names::On;
use crate::ops::{self, MAX_RESULT_BYTES};
use crate::repository::PgRepository;

/// The repository's operations on a caller's connection or transaction, from
/// [`PgRepository::in_transaction`].
///
/// Each method is the same single statement as the pooled [`Repository`]
/// method, executed on the borrowed connection: inside a transaction the
/// record's changes commit or roll back with everything else the transaction
/// does, and the row lock a [`reserve`](Self::reserve) takes is held until then —
/// concurrent reservations of the same key wait for the outcome.
///
/// ```no_run
/// # async fn demo(repo: idempotency_postgres::PgRepository) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idempotency_core::{OwnerToken, RecordKey, Repository, Reservation, ReserveRequest, SystemClock, Clock};
///
/// let key = RecordKey::new("payments", "order-42", repo.capabilities().max_id_bytes)?;
/// let mut tx = repo.pool().begin().await?;
/// let now = SystemClock.now();
/// let owner = OwnerToken::random();
/// let reservation = repo
///     .in_transaction(&mut tx)
///     .reserve(ReserveRequest {
///         key: &key,
///         owner,
///         fingerprint: None,
///         now,
///         lease_until: now + Duration::from_secs(30),
///         expires_at: now + Duration::from_secs(3600),
///         retry_failed: false,
///         clock_skew: Duration::ZERO,
///     })
///     .await?;
/// if let Reservation::Acquired { .. } = reservation {
///     sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 7")
///         .execute(&mut *tx)
///         .await?;
///     repo.in_transaction(&mut tx)
///         .complete(&key, owner, Some(b"charged"), now + Duration::from_secs(3600), now)
///         .await?;
/// }
/// tx.commit().await?; // the debit and the record, together
/// # Ok(())
/// # }
/// ```
pub struct PgTransactionRepository<'a> {
    repo: &'a PgRepository,
    conn: &'a mut PgConnection,
}

impl fmt::Debug for PgTransactionRepository<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionRepository")
            .field("repo", self.repo)
            .finish_non_exhaustive()
    }
}

impl<'a> PgTransactionRepository<'a> {
    pub(crate) fn new(repo: &'a PgRepository, conn: &'a mut PgConnection) -> Self {
        PgTransactionRepository { repo, conn }
    }

    /// [`Repository::reserve`] on the caller's connection.
    ///
    /// It waits for another transaction's row lock on the key at most the
    /// repository's [`lock_timeout`](crate::PgRepositoryBuilder::lock_timeout),
    /// set for this statement alone: your own `lock_timeout` is as it was
    /// once it answers.
    ///
    /// # Errors
    /// As [`Repository::reserve`]; a key another transaction still holds
    /// after that wait is [`Error::InProgress`] (retryable; nothing applied,
    /// and the statement's error aborts your transaction: roll it back, or
    /// to a savepoint taken before). An explicitly set operation timeout
    /// bounds the whole call on the client ([`Error::Timeout`]).
    pub async fn reserve(&mut self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let fut = self.repo.reserve_in_transaction(&mut *self.conn, &request);
        self.repo.timed_in_transaction("reserve", fut).await
    }

    /// [`Repository::complete`] on the caller's connection.
    ///
    /// # Errors
    /// As [`Repository::complete`].
    pub async fn complete(
        &mut self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let sql = self.repo.statements();
        let fut = ops::finish(
            sql,
            On::Caller,
            &mut *self.conn,
            key,
            owner,
            Status::Completed,
            result,
            false,
            expires_at,
            now,
        );
        self.repo.timed_in_transaction("complete", fut).await
    }

    /// [`Repository::fail`] on the caller's connection.
    ///
    /// # Errors
    /// As [`Repository::fail`].
    pub async fn fail(
        &mut self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let sql = self.repo.statements();
        let fut = ops::finish(
            sql,
            On::Caller,
            &mut *self.conn,
            key,
            owner,
            Status::Failed,
            error,
            retryable,
            expires_at,
            now,
        );
        self.repo.timed_in_transaction("fail", fut).await
    }

    /// [`Repository::release`] on the caller's connection.
    ///
    /// # Errors
    /// As [`Repository::release`].
    pub async fn release(
        &mut self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        let sql = self.repo.statements();
        let fut = ops::release(sql, On::Caller, &mut *self.conn, key, owner, now);
        self.repo.timed_in_transaction("release", fut).await
    }

    /// [`Repository::extend`] on the caller's connection.
    ///
    /// # Errors
    /// As [`Repository::extend`].
    pub async fn extend(
        &mut self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let sql = self.repo.statements();
        let fut = ops::extend(
            sql,
            On::Caller,
            &mut *self.conn,
            key,
            owner,
            lease_until,
            expires_at,
            now,
        );
        self.repo.timed_in_transaction("extend", fut).await
    }

    /// [`Repository::get`] on the caller's connection (sees the transaction's
    /// own uncommitted changes).
    ///
    /// # Errors
    /// As [`Repository::get`].
    pub async fn get(&mut self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        let sql = self.repo.statements();
        let fut = ops::get(sql, &mut *self.conn, key, now);
        self.repo.timed_in_transaction("get", fut).await
    }

    /// [`Repository::purge_expired`] on the caller's connection.
    ///
    /// # Errors
    /// As [`Repository::purge_expired`].
    pub async fn purge_expired(&mut self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        let sql = self.repo.statements();
        let fut = ops::purge(sql, &mut *self.conn, now, limit);
        self.repo.timed_in_transaction("purge_expired", fut).await
    }

    /// [`Repository::delete`] on the caller's connection.
    ///
    /// # Errors
    /// As [`Repository::delete`].
    pub async fn delete(&mut self, key: &RecordKey) -> Result<bool, Error> {
        let sql = self.repo.statements();
        let fut = ops::delete(sql, On::Caller, &mut *self.conn, key);
        self.repo.timed_in_transaction("delete", fut).await
    }
}

/// Exactly-once effects for work inside PostgreSQL: the reservation, the
/// handler's writes and the completion run in **one transaction**.
///
/// [`execute`](Self::execute) begins a transaction, reserves the key in it (the
/// row stays locked until the end), runs the handler with the transaction's
/// connection, stores the completion in it and commits — so the business writes
/// and the idempotency record commit together, or, when the handler fails,
/// vanish together.
///
/// **Duplicates while the transaction is open** — from another
/// `PgTransactionalManager`, or an [`IdempotencyManager`](idempotency_core::IdempotencyManager)
/// over the same table — cannot see the uncommitted record; their
/// reservation waits on its row lock (the `INSERT` for the uncommitted row,
/// or `SELECT … FOR UPDATE` for the lock) for at most the repository's
/// [`lock_timeout`](crate::PgRepositoryBuilder::lock_timeout) (250 ms by
/// default), which the reservation sets on the server for itself alone. When
/// the first transaction commits within it they get its outcome
/// ([`Outcome::Cached`]); when it rolls back, they acquire the key and run;
/// while it is still open, they get [`Error::InProgress`] (`retry_after` the
/// wait), as for any live holder: the manager's wait policy polls again, and a
/// fail-open outage policy never runs the handler beside the transaction (the
/// store answered; the key is held). The waiting statement ends on the
/// server, so no duplicate keeps a pooled connection blocked behind the
/// transaction. Keep handlers short: the transaction holds a pooled
/// connection and the row lock while it runs.
///
/// It shares the [`Config`] of the [`IdempotencyManager`](idempotency_core::IdempotencyManager)
/// (namespace from `key_prefix`, `ttl`, `processing_timeout`, `validate_payload`,
/// `cache_results`, `max_result_size_bytes`, `failure_policy`, `clock_skew`) and
/// stores records the manager reads, so both can guard the same keys.
/// `in_progress`, `on_store_outage` and `lease_extension_interval` do not apply:
/// nobody waits on a `Processing` record, the handler cannot run without its
/// transaction, and the lease does not matter while the row is locked.
///
/// Handler errors roll the transaction back. Under [`FailurePolicy::Store`](idempotency_core::FailurePolicy::Store) /
/// [`FailurePolicy::StoreAndRetry`](idempotency_core::FailurePolicy::StoreAndRetry) (or a [`HandlerError::permanent`] error) the
/// failure is then recorded in a second, short transaction so duplicates get
/// [`Error::PreviouslyFailed`]; under the default [`FailurePolicy::Release`](idempotency_core::FailurePolicy::Release)
/// nothing remains and a redelivery runs again. A panicking or cancelled handler
/// drops the transaction, which rolls back.
///
/// ```no_run
/// use idempotency_core::{Config, HandlerError, Outcome};
/// use idempotency_postgres::{PgRepository, PgTransactionalManager};
/// use sqlx::PgConnection;
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let repo = idempotency_postgres::connect("postgres://app@localhost/shop").await?;
/// let payments = PgTransactionalManager::new(repo, Config::default())?;
/// let outcome = payments
///     .execute("charge:order-42", &serde_json::json!({"amount": 10}), |conn: &mut PgConnection| {
///         Box::pin(async move {
///             sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 7")
///                 .execute(&mut *conn)
///                 .await
///                 .map_err(|e| HandlerError::transient(e.to_string()))?;
///             Ok::<_, HandlerError<String>>("receipt-42".to_owned())
///         })
///     })
///     .await?;
/// assert!(matches!(outcome, Outcome::Executed(_) | Outcome::Cached(_)));
/// # Ok(())
/// # }
/// ```
pub struct PgTransactionalManager<C: Codec = JsonCodec> {
    repo: PgRepository,
    config: Arc<Config>,
    front: Front,
    clock: Arc<dyn Clock>,
    codec: C,
}

impl<C: Codec + Clone> Clone for PgTransactionalManager<C> {
    fn clone(&self) -> Self {
        PgTransactionalManager {
            repo: self.repo.clone(),
            config: self.config.clone(),
            front: self.front.clone(),
            clock: self.clock.clone(),
            codec: self.codec.clone(),
        }
    }
}

impl<C: Codec> fmt::Debug for PgTransactionalManager<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionalManager")
            .field("repo", &self.repo)
            .field("namespace", &self.front.namespace())
            .field("config", &self.config)
            .field("codec", &self.codec)
            .finish_non_exhaustive()
    }
}

impl PgTransactionalManager<JsonCodec> {
    /// A manager over `repo` with the wall clock and the JSON codec.
    ///
    /// # Errors
    /// [`Error::Config`] when `config` is inconsistent ([`Config::validate`]).
    pub fn new(repo: PgRepository, config: Config) -> Result<Self, Error> {
        config.validate()?;
        Ok(PgTransactionalManager {
            front: Front::new(&config, &repo.capabilities()),
            repo,
            config: Arc::new(config),
            clock: Arc::new(SystemClock),
            codec: JsonCodec,
        })
    }
}

impl<C: Codec + Clone> PgTransactionalManager<C> {
    /// Uses `clock` for every instant (tests use a
    /// [`ManualClock`](idempotency_core::ManualClock)).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Stores results with `codec` (use the same as any
    /// [`IdempotencyManager`](idempotency_core::IdempotencyManager) sharing the keys).
    pub fn with_codec<C2: Codec + Clone>(self, codec: C2) -> PgTransactionalManager<C2> {
        PgTransactionalManager {
            repo: self.repo,
            config: self.config,
            front: self.front,
            clock: self.clock,
            codec,
        }
    }

    /// A manager whose keys live in the sub-namespace `scope`, by the same
    /// rules as
    /// [`IdempotencyManager::scoped`](idempotency_core::IdempotencyManager::scoped)
    /// (both use [`Front`]): the same scope names the same records in both.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when the namespace with the scope would be longer
    /// than [`MAX_NAMESPACE_BYTES`](idempotency_core::MAX_NAMESPACE_BYTES).
    pub fn scoped(&self, scope: &str) -> Result<Self, Error> {
        Ok(PgTransactionalManager {
            front: self.front.scoped(scope)?,
            ..self.clone()
        })
    }

    /// The namespace of this manager's keys.
    pub fn namespace(&self) -> &str {
        self.front.namespace()
    }

    /// The repository.
    pub fn repository(&self) -> &PgRepository {
        &self.repo
    }

    /// The record key of `id` in this manager's namespace.
    ///
    /// # Errors
    /// [`Error::InvalidKey`].
    pub fn record_key(&self, id: &str) -> Result<RecordKey, Error> {
        self.front.record_key(id)
    }

    /// Runs `handler` once per key, in one transaction with the record (see the
    /// type's documentation).
    ///
    /// The handler gets the transaction's connection for its business writes;
    /// write it as a closure returning a boxed future (the connection is
    /// borrowed for the future's lifetime):
    /// `|conn: &mut PgConnection| Box::pin(async move { …; Ok(value) })`. It must
    /// not commit or roll back itself (nested `begin()` calls are savepoints).
    ///
    /// # Errors
    /// [`ExecuteError::Handler`] with the handler's error (the transaction was
    /// rolled back), or [`ExecuteError::Idempotency`]:
    /// [`Error::PayloadMismatch`], [`Error::PreviouslyFailed`],
    /// [`Error::InProgress`] (a non-transactional attempt holds a live lease,
    /// or another transaction still holds the key after the lock wait),
    /// [`Error::InvalidKey`], a codec error, or a store error — when `COMMIT`
    /// itself fails the outcome is unknown to the client: a redelivery finds
    /// either the committed record or none.
    pub async fn execute<P, T, E, F>(
        &self,
        key: &str,
        payload: &P,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, HandlerError<E>>>,
    {
        let (key, fingerprint) = self.front.prepare(key, payload)?;
        let span = self.front.span(&key);
        async {
            let answer = self.run(key, fingerprint, handler).await;
            self.front.observe(&answer);
            answer
        }
        .instrument(span)
        .await
    }

    /// The transaction: reserve, run, complete, commit (or answer the
    /// duplicate, or roll back and record the failure).
    async fn run<T, E, F>(
        &self,
        key: RecordKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, HandlerError<E>>>,
    {
        let sql = self.repo.statements();
        let map = |e| map_sqlx(e, "transaction", Some(&key), &sql.qualified);

        // A connection lent by the repository, kept for its next operation
        // only when the transaction ended with the server's answer.
        let mut conn = self.repo.connection("transaction").await?;
        let mut tx = sqlx::Connection::begin(conn.connection()?)
            .await
            .map_err(map)?;
        let now = self.clock.now();
        let owner = OwnerToken::random();
        let request = reserve_request(&self.config, &key, owner, fingerprint, now);
        let duplicate = match self.repo.in_transaction(&mut tx).reserve(request).await {
            Ok(Reservation::Acquired { .. }) => None,
            Ok(Reservation::Existing(record)) => Some(Ok(record)),
            // Another transaction holds the key past the lock bound: the
            // server refused the statement, the connection is sound.
            Err(e @ Error::InProgress { .. }) => Some(Err(e)),
            Err(e) => return Err(e.into()),
        };
        if let Some(duplicate) = duplicate {
            // Only a lock was taken, or none; end the transaction before
            // answering. A failed rollback means a broken connection, which
            // the server ends (releasing the lock) anyway.
            match tx.rollback().await {
                Ok(()) => conn.settle(true),
                Err(e) => {
                    tracing::debug!(key = %key, error = %e, "rollback after a duplicate failed")
                }
            }
            let record = duplicate?;
            return self.answer_duplicate(&key, record, fingerprint.as_ref(), now);
        }

        match handler(&mut tx).await {
            Ok(value) => {
                let bytes =
                    cacheable_result(&self.codec, &self.config, Some(MAX_RESULT_BYTES), &value);
                let now = self.clock.now();
                let expires_at = now + self.config.ttl;
                let mut ops = self.repo.in_transaction(&mut tx);
                match ops
                    .complete(&key, owner, bytes.as_deref(), expires_at, now)
                    .await
                {
                    Ok(()) => {}
                    Err(Error::TooLarge { .. }) => {
                        ops.complete(&key, owner, None, expires_at, now).await?;
                    }
                    Err(e) => return Err(e.into()),
                }
                tx.commit().await.map_err(map)?;
                conn.settle(true);
                Ok(Outcome::Executed(value))
            }
            Err(err) => {
                match tx.rollback().await {
                    Ok(()) => conn.settle(true),
                    // The connection is closed on error, which rolls back too.
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "rollback after a handler error failed")
                    }
                }
                drop(conn);
                let record = failure_record(
                    &self.config,
                    Some(MAX_RESULT_BYTES),
                    err.kind(),
                    err.to_string(),
                );
                if let FailureRecord::Store { error, retryable } = record {
                    self.store_failure(&key, fingerprint, &error, retryable)
                        .await;
                }
                Err(ExecuteError::Handler(err.into_inner()))
            }
        }
    }

    fn answer_duplicate<T: DeserializeOwned, E>(
        &self,
        key: &RecordKey,
        record: Record,
        fingerprint: Option<&Fingerprint>,
        now: Timestamp,
    ) -> Result<Outcome<T>, ExecuteError<E>> {
        let decision = decide_duplicate(record, fingerprint, now, self.config.clock_skew);
        answer_duplicate(&self.codec, key, decision)
    }

    /// Records `Failed` after the rollback, in its own short transaction
    /// (reserve + fail), so duplicates get the stored error. Best effort: a
    /// failure to record it is logged, and the next delivery runs again.
    async fn store_failure(
        &self,
        key: &RecordKey,
        fingerprint: Option<Fingerprint>,
        error: &[u8],
        retryable: bool,
    ) {
        let result: Result<(), Error> = async {
            let sql = self.repo.statements();
            let map = |e| map_sqlx(e, "fail", Some(key), &sql.qualified);
            let mut conn = self.repo.connection("fail").await?;
            let mut tx = sqlx::Connection::begin(conn.connection()?)
                .await
                .map_err(map)?;
            let now = self.clock.now();
            let owner = OwnerToken::random();
            let request = reserve_request(&self.config, key, owner, fingerprint, now);
            let mut ops = self.repo.in_transaction(&mut tx);
            if let Reservation::Acquired { .. } = ops.reserve(request).await? {
                let expires_at = now + self.config.ttl;
                ops.fail(key, owner, Some(error), retryable, expires_at, now)
                    .await?;
                tx.commit().await.map_err(map)?;
                conn.settle(true);
            }
            // Existing: another attempt got there first; leave its record alone.
            Ok(())
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(key = %key, error = %e, "could not record the handler failure; a redelivery runs again");
        }
    }
}
