//! The manager: the contract's state machine (§4) around a handler.
//!
//! The manager only strings the engine's stages together (see
//! [`crate::engine`]): reserve and decide, run under the lease, record the
//! outcome; a guard decides what a dropped execution leaves behind.

mod batch;
mod execution;
pub(crate) mod front;
mod outcome;

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::codec::{Codec, JsonCodec};
use crate::config::{Config, OutagePolicy};
use crate::decision::{DuplicateDecision, FailureKind};
use crate::engine::answers::AnswerCacheStats;
use crate::engine::completions::Participant;
use crate::engine::finish::{Finished, Pending};
use crate::engine::guard::{ExecutionGuard, Phase};
use crate::engine::lease::{ExecutionContext, Lease};
use crate::engine::reserve::Reserved;
use crate::engine::Engine;
use crate::error::Error;
use crate::key::{compose_parts, Fingerprint, OwnerToken, RecordKey};
use crate::metrics::Counter;
use crate::repository::SharedRepository;
use crate::stages::{answer_duplicate, failure_record, FailureRecord};
use crate::time::{Clock, SystemClock, Timestamp};
use front::{record_outcome, Front};

pub use outcome::{ExecuteError, HandlerError, HandlerResult, Outcome};

/// A panic caught from a handler, resumed once the record is taken care of.
type Panic = Box<dyn Any + Send>;

/// Wraps handlers so that each key's first delivery runs them and every duplicate
/// gets the recorded outcome (contract §4). Cheap to clone; clones share the
/// repository, configuration and clock.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?
///     .scoped("payments")?;
/// let charges = AtomicU32::new(0);
/// let payload = serde_json::json!({"account": "A-1", "amount": 25});
/// for _delivery in 0..3 {
///     let outcome = manager
///         .execute("payment-7", &payload, || async {
///             charges.fetch_add(1, Ordering::SeqCst);
///             Ok::<_, HandlerError<String>>(format!("charged {}", payload["amount"]))
///         })
///         .await?;
///     assert_eq!(outcome.value().map(String::as_str), Some("charged 25"));
/// }
/// assert_eq!(charges.load(Ordering::SeqCst), 1);
///
/// // The same key with another payload is refused.
/// let other = serde_json::json!({"account": "A-1", "amount": 99});
/// let err = manager
///     .execute("payment-7", &other, || async { Ok::<_, HandlerError<String>>(String::new()) })
///     .await
///     .unwrap_err();
/// assert!(matches!(err.as_idempotency(), Some(idempotency_core::Error::PayloadMismatch { .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct IdempotencyManager<C: Codec = JsonCodec> {
    engine: Arc<Engine>,
    front: Front,
    codec: C,
}

impl<C: Codec + Clone> Clone for IdempotencyManager<C> {
    fn clone(&self) -> Self {
        IdempotencyManager {
            engine: self.engine.clone(),
            front: self.front.clone(),
            codec: self.codec.clone(),
        }
    }
}

impl<C: Codec> fmt::Debug for IdempotencyManager<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyManager")
            .field("namespace", &self.front.namespace())
            .field("engine", &self.engine)
            .field("codec", &self.codec)
            .finish()
    }
}

/// Refuses a `store_timeout` the store's lock wait could outlast (see
/// [`Capabilities::max_lock_wait`]): a reservation waiting on a live holder
/// must be answered `InProgress` by the store before the manager's own timer
/// calls it a timeout, an outage.
fn check_lock_wait(config: &Config, caps: &crate::Capabilities) -> Result<(), Error> {
    match caps.max_lock_wait {
        Some(wait) if config.store_timeout < wait.saturating_mul(2) => Err(Error::config(format!(
            "store_timeout ({:?}) must be at least twice the {} store's lock wait ({wait:?}): \
             a reservation waiting on a key another transaction holds would time out as an \
             outage first; raise store_timeout or lower the store's lock_timeout",
            config.store_timeout, caps.backend
        ))),
        _ => Ok(()),
    }
}

impl IdempotencyManager<JsonCodec> {
    /// A manager over `repo` with the system clock and JSON results.
    ///
    /// # Errors
    /// [`Error::Config`] when `config` does not validate.
    pub fn new(repo: SharedRepository, config: Config) -> Result<Self, Error> {
        Self::with_parts(repo, config, Arc::new(SystemClock), JsonCodec)
    }
}

impl<C: Codec + Clone> IdempotencyManager<C> {
    /// A manager with an explicit clock and codec.
    ///
    /// # Errors
    /// [`Error::Config`] when `config` does not validate, or its
    /// `store_timeout` is not at least twice the store's
    /// [`max_lock_wait`](crate::Capabilities::max_lock_wait).
    pub fn with_parts(
        repo: SharedRepository,
        config: Config,
        clock: Arc<dyn Clock>,
        codec: C,
    ) -> Result<Self, Error> {
        config.validate()?;
        check_lock_wait(&config, &repo.capabilities())?;
        let engine = Arc::new(Engine::new(repo, config, clock));
        let front = Front::with_metrics(&engine.config, &engine.caps, engine.metrics.clone());
        Ok(IdempotencyManager {
            engine,
            front,
            codec,
        })
    }

    /// The same manager with another clock (tests use a
    /// [`ManualClock`](crate::ManualClock)).
    pub fn with_clock(self, clock: Arc<dyn Clock>) -> Self {
        let engine = Arc::new(Engine::new(
            self.engine.repo.clone(),
            self.engine.config.clone(),
            clock,
        ));
        IdempotencyManager {
            engine,
            // The same namespace; its metric keys are the same backend's.
            front: self.front,
            codec: self.codec,
        }
    }

    /// The same manager with another result codec.
    pub fn with_codec<C2: Codec + Clone>(self, codec: C2) -> IdempotencyManager<C2> {
        IdempotencyManager {
            engine: self.engine,
            front: self.front,
            codec,
        }
    }

    /// A manager whose keys live in the sub-namespace `scope` (e.g. a handler or
    /// operation name): the same id under two scopes is two records. Scopes
    /// compose injectively (`%` and `:` in a scope are escaped):
    /// `scoped("a").scoped("b")` and `scoped("a:b")` are two namespaces.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency_core::{Config, Error, IdempotencyManager, MemoryRepository};
    /// let m = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// assert_eq!(m.scoped("payments")?.namespace(), "idempotency:payments");
    /// assert_ne!(m.scoped("a")?.scoped("b")?.namespace(), m.scoped("a:b")?.namespace());
    /// // A scope that leaves no room for keys is refused here, not at every call.
    /// assert!(matches!(m.scoped(&"s".repeat(600)), Err(Error::InvalidKey { .. })));
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when the namespace with the scope would be longer
    /// than [`MAX_NAMESPACE_BYTES`](crate::MAX_NAMESPACE_BYTES).
    pub fn scoped(&self, scope: &str) -> Result<Self, Error> {
        Ok(IdempotencyManager {
            engine: self.engine.clone(),
            front: self.front.scoped(scope)?,
            codec: self.codec.clone(),
        })
    }

    /// The namespace of this manager's keys.
    pub fn namespace(&self) -> &str {
        self.front.namespace()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.engine.config
    }

    /// How the local answer cache ([`Config::answer_cache`]) has done so
    /// far: hits, misses, hit ratio, size; `None` without one. Shared by every
    /// clone and scope of this manager.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency_core::{AnswerCacheConfig, Config, HandlerError, IdempotencyManager, MemoryRepository};
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let config = Config { answer_cache: Some(AnswerCacheConfig::default()), ..Config::default() };
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config)?;
    /// for _ in 0..4 {
    ///     manager.execute("k", &(), || async { Ok::<_, HandlerError<String>>(1) }).await?;
    /// }
    /// let stats = manager.answer_cache_stats().expect("configured");
    /// // The first delivery went to the store; the three duplicates did not.
    /// assert_eq!((stats.hits, stats.misses), (3, 1));
    /// assert_eq!(stats.hit_ratio(), 0.75);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn answer_cache_stats(&self) -> Option<AnswerCacheStats> {
        self.engine.answer_cache_stats()
    }

    /// The repository.
    pub fn repository(&self) -> &SharedRepository {
        &self.engine.repo
    }

    /// The record key of `id` in this manager's namespace (validated; long ids
    /// digested).
    ///
    /// # Errors
    /// [`Error::InvalidKey`].
    pub fn record_key(&self, id: &str) -> Result<RecordKey, Error> {
        self.front.record_key(id)
    }

    /// Runs `handler` once per key (contract §4).
    ///
    /// `payload` is fingerprinted (canonical JSON, SHA-256) when payload
    /// validation is on, to refuse the same key with another payload; pass `&()`
    /// when there is none. The handler's value is stored through the codec and
    /// replayed to duplicates as [`Outcome::Cached`]. To see the attempt number
    /// (a fencing token) and a lease-lost signal, use
    /// [`execute_with_context`](Self::execute_with_context).
    ///
    /// A handler panic is treated as a failure of the configured policy's
    /// default kind (released by default), then the panic continues.
    ///
    /// # Cancel safety
    /// Dropping the returned future never makes the key re-runnable while the
    /// handler's effect may still be happening:
    /// - before the handler started, the record (if any) is released in the
    ///   background;
    /// - while the handler runs, [`Config::on_cancel`] decides: the record keeps
    ///   its lease until it ends (default), or is released (opt-in);
    /// - after the handler returned, its outcome is recorded in the background.
    ///
    /// Background work needs a Tokio runtime; without one the record keeps its
    /// lease. To let the handler run to completion although the caller left, use
    /// [`execute_detached`](Self::execute_detached).
    ///
    /// # Errors
    /// [`ExecuteError::Handler`] with the handler's error, or
    /// [`ExecuteError::Idempotency`]: [`Error::InProgress`],
    /// [`Error::PayloadMismatch`], [`Error::PreviouslyFailed`],
    /// [`Error::InvalidKey`], a codec error replaying a cached result, or a store
    /// error (fail-closed).
    pub async fn execute<P, T, E, F, Fut>(
        &self,
        key: &str,
        payload: &P,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        self.execute_with_context(key, payload, |_: ExecutionContext| handler())
            .await
    }

    /// [`execute`](Self::execute) with a handler that receives its
    /// [`ExecutionContext`]: the attempt number (a fencing token for downstream
    /// writes), the owner token, and a signal that fires when the lease can no
    /// longer be confirmed.
    ///
    /// # Errors
    /// As [`execute`](Self::execute).
    pub async fn execute_with_context<P, T, E, F, Fut>(
        &self,
        key: &str,
        payload: &P,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce(ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let (key, fingerprint) = self.prepare(key, payload)?;
        self.run_instrumented(key, fingerprint, handler).await
    }

    /// [`execute_with_context`](Self::execute_with_context) on a task of its own:
    /// if the caller drops the returned future (an HTTP client disconnects, an
    /// outer timeout fires), the handler still runs to completion and its
    /// outcome is recorded, so the caller's retry gets the stored outcome
    /// instead of running the handler again. Needs a Tokio runtime.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build()?.block_on(async {
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// // The client gives up after 1 s; the handler takes 2 s.
    /// let first = tokio::time::timeout(
    ///     Duration::from_secs(1),
    ///     manager.execute_detached("order-1", &(), |_ctx| async {
    ///         tokio::time::sleep(Duration::from_secs(2)).await;
    ///         Ok::<_, HandlerError<String>>("charged".to_owned())
    ///     }),
    /// )
    /// .await;
    /// assert!(first.is_err(), "the caller gave up");
    /// tokio::time::sleep(Duration::from_secs(2)).await;
    /// // The retry gets the first execution's result; the handler ran once.
    /// let retry = manager
    ///     .execute("order-1", &(), || async { Ok::<_, HandlerError<String>>("twice".to_owned()) })
    ///     .await?;
    /// assert!(matches!(retry, Outcome::Cached(ref r) if r == "charged"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`execute`](Self::execute); [`Error::Backend`] if the runtime shut
    /// down before the execution ended. A handler panic continues in the caller.
    pub async fn execute_detached<P, T, E, F, Fut>(
        &self,
        key: &str,
        payload: &P,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
        F: FnOnce(ExecutionContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, HandlerError<E>>> + Send + 'static,
    {
        let (key, fingerprint) = self.prepare(key, payload)?;
        let this = self.clone();
        let task =
            tokio::spawn(async move { this.run_instrumented(key, fingerprint, handler).await });
        self.join_detached(task).await
    }

    /// [`execute_detached`](Self::execute_detached) for a handler that is not
    /// `Send` (actix-web's services, anything holding an `Rc`): the execution
    /// runs on a task of the current thread's [`tokio::task::LocalSet`]
    /// (actix-web runs every worker in one).
    ///
    /// ```
    /// use std::rc::Rc;
    /// use std::sync::Arc;
    /// use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
    ///
    /// # let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// let local = tokio::task::LocalSet::new();
    /// let outcome = local.block_on(&runtime, async {
    ///     let state = Rc::new(7); // not Send
    ///     manager
    ///         .execute_detached_local("order-1", &(), move |_ctx| async move {
    ///             Ok::<_, HandlerError<String>>(*state)
    ///         })
    ///         .await
    /// })?;
    /// assert!(matches!(outcome, Outcome::Executed(7)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Panics
    /// Outside a `LocalSet` (Tokio's `spawn_local` panics there).
    ///
    /// # Errors
    /// As [`execute_detached`](Self::execute_detached).
    pub async fn execute_detached_local<P, T, E, F, Fut>(
        &self,
        key: &str,
        payload: &P,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned + 'static,
        E: fmt::Display + 'static,
        F: FnOnce(ExecutionContext) -> Fut + 'static,
        Fut: Future<Output = Result<T, HandlerError<E>>> + 'static,
    {
        let (key, fingerprint) = self.prepare(key, payload)?;
        let this = self.clone();
        let task = tokio::task::spawn_local(async move {
            this.run_instrumented(key, fingerprint, handler).await
        });
        self.join_detached(task).await
    }

    /// The result of a detached execution's task; its panic continues here.
    async fn join_detached<T, E>(
        &self,
        task: tokio::task::JoinHandle<Result<Outcome<T>, ExecuteError<E>>>,
    ) -> Result<Outcome<T>, ExecuteError<E>> {
        match task.await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_cancelled) => Err(Error::Backend {
                backend: self.engine.caps.backend,
                message: "the runtime shut down before the detached execution ended".into(),
                source: None,
            }
            .into()),
        }
    }

    /// Runs one step of a multi-step handler under a sub-key of (`event_id`,
    /// `step`), composed injectively (`("a:b", "c")` and `("a", "b:c")` are two
    /// keys): each step runs once even if a redelivery repeats the steps before
    /// it.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// for _delivery in 0..2 {
    ///     let reserved = manager.step("evt-1", "reserve-stock", &(), || async { Ok::<_, HandlerError<String>>(3) }).await?;
    ///     let charged = manager.step("evt-1", "charge", &(), || async { Ok::<_, HandlerError<String>>(true) }).await?;
    ///     assert_eq!((reserved.into_value(), charged.into_value()), (Some(3), Some(true)));
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`IdempotencyManager::execute`].
    pub async fn step<P, T, E, F, Fut>(
        &self,
        event_id: &str,
        step: &str,
        payload: &P,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        self.execute(&compose_parts(event_id, step), payload, handler)
            .await
    }

    /// The current instant of the manager's clock.
    pub fn now(&self) -> Timestamp {
        self.engine.now()
    }

    /// The record key and the payload's fingerprint (when validation is on).
    fn prepare<P: Serialize + ?Sized>(
        &self,
        key: &str,
        payload: &P,
    ) -> Result<(RecordKey, Option<Fingerprint>), Error> {
        self.front.prepare(key, payload)
    }

    async fn run_instrumented<T, E, F, Fut>(
        &self,
        key: RecordKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce(ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let span = self.front.span(&key);
        if span.is_disabled() {
            // No subscriber wants the span: skip entering and leaving it on every
            // poll (with `tracing`'s `log` feature on, each of those is a call).
            self.run(key, fingerprint, handler).await
        } else {
            self.run(key, fingerprint, handler).instrument(span).await
        }
    }
}
