//! The manager: the state machine of `SPEC.md` §4 around a handler.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::codec::{Codec, JsonCodec};
use crate::config::{Config, FailurePolicy, InProgressPolicy, OutagePolicy};
use crate::decision::{
    decide_duplicate, failure_action, should_cache_result, DuplicateDecision, FailureAction,
    FailureKind,
};
use crate::error::Error;
use crate::key::{Fingerprint, OwnerToken, RecordKey};
use crate::metrics::{Counter, Metrics, Op};
use crate::record::Status;
use crate::repository::{Capabilities, Reservation, ReserveRequest, SharedRepository};
use crate::time::{Clock, SystemClock, Timestamp};

/// What a call to [`IdempotencyManager::execute`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome<T> {
    /// First delivery: the handler ran and its outcome is recorded.
    Executed(T),
    /// Duplicate: the handler did not run; this is the first delivery's cached
    /// result.
    Cached(T),
    /// Duplicate of a completed key with no cached result (caching off, or the
    /// result exceeded the size limit): the handler did not run.
    Duplicate,
    /// The handler ran and succeeded, but meanwhile another attempt took the key
    /// over (this attempt's lease ran out): the work was done, but the record
    /// belongs to the other owner. Consider the effect possibly applied twice if
    /// the handler is not itself idempotent, and alert on it.
    LeaseLost(T),
    /// The handler ran and succeeded, but recording the completion failed even
    /// after retries (store outage): the record stays `Processing` until its lease
    /// ends, after which a redelivery would run the handler again.
    Unrecorded {
        /// The handler's value.
        value: T,
        /// The store's last error.
        error: Error,
    },
    /// The store was unreachable and the outage policy is fail-open: the handler
    /// ran without protection.
    Unprotected(T),
}

impl<T> Outcome<T> {
    /// Whether the handler ran in this call.
    pub fn handler_ran(&self) -> bool {
        !matches!(self, Outcome::Cached(_) | Outcome::Duplicate)
    }

    /// Whether this delivery was a duplicate (answered without running).
    pub fn is_duplicate(&self) -> bool {
        !self.handler_ran()
    }

    /// The value, if the handler ran or a cached result was replayed.
    pub fn value(&self) -> Option<&T> {
        match self {
            Outcome::Executed(v)
            | Outcome::Cached(v)
            | Outcome::LeaseLost(v)
            | Outcome::Unprotected(v)
            | Outcome::Unrecorded { value: v, .. } => Some(v),
            Outcome::Duplicate => None,
        }
    }

    /// Consumes the outcome into its value, if any.
    pub fn into_value(self) -> Option<T> {
        match self {
            Outcome::Executed(v)
            | Outcome::Cached(v)
            | Outcome::LeaseLost(v)
            | Outcome::Unprotected(v)
            | Outcome::Unrecorded { value: v, .. } => Some(v),
            Outcome::Duplicate => None,
        }
    }

    /// Maps the value.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Executed(v) => Outcome::Executed(f(v)),
            Outcome::Cached(v) => Outcome::Cached(f(v)),
            Outcome::Duplicate => Outcome::Duplicate,
            Outcome::LeaseLost(v) => Outcome::LeaseLost(f(v)),
            Outcome::Unprotected(v) => Outcome::Unprotected(f(v)),
            Outcome::Unrecorded { value, error } => Outcome::Unrecorded {
                value: f(value),
                error,
            },
        }
    }
}

/// A handler's error with its classification for this call.
///
/// `?` converts any `E` into it with [`FailureKind::Default`] (the configured
/// [`FailurePolicy`] decides); mark an error [`HandlerError::transient`] to release
/// the key for a redelivery, or [`HandlerError::permanent`] to store it so
/// duplicates get [`Error::PreviouslyFailed`].
///
/// ```
/// use idempotency_core::{FailureKind, HandlerError};
/// fn charge(amount: i64) -> Result<i64, HandlerError<String>> {
///     if amount < 0 {
///         return Err(HandlerError::permanent("negative amount".to_owned()));
///     }
///     let balance: i64 = "100".parse::<i64>().map_err(|e| e.to_string())?; // Default
///     Ok(balance - amount)
/// }
/// assert_eq!(charge(-1).unwrap_err().kind(), FailureKind::Permanent);
/// ```
#[derive(Debug)]
pub struct HandlerError<E> {
    error: E,
    kind: FailureKind,
}

impl<E> HandlerError<E> {
    /// An error classified by the configured policy.
    pub fn new(error: E) -> Self {
        HandlerError {
            error,
            kind: FailureKind::Default,
        }
    }

    /// An error worth retrying: the record is released.
    pub fn transient(error: E) -> Self {
        HandlerError {
            error,
            kind: FailureKind::Transient,
        }
    }

    /// An error not worth retrying: the failure is stored.
    pub fn permanent(error: E) -> Self {
        HandlerError {
            error,
            kind: FailureKind::Permanent,
        }
    }

    /// The classification.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// The error.
    pub fn get_ref(&self) -> &E {
        &self.error
    }

    /// Consumes into the error.
    pub fn into_inner(self) -> E {
        self.error
    }
}

impl<E> From<E> for HandlerError<E> {
    fn from(error: E) -> Self {
        HandlerError::new(error)
    }
}

impl<E: fmt::Display> fmt::Display for HandlerError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

/// A handler's result with a classified error.
pub type HandlerResult<T, E> = Result<T, HandlerError<E>>;

/// Why [`IdempotencyManager::execute`] did not return an [`Outcome`].
#[derive(Debug, thiserror::Error)]
pub enum ExecuteError<E> {
    /// The handler ran and failed; the record was released or the failure stored
    /// as classified.
    #[error("handler failed: {0}")]
    Handler(E),
    /// The layer decided not to run the handler (in progress, payload mismatch,
    /// previously failed, invalid key) or the store failed.
    #[error(transparent)]
    Idempotency(#[from] Error),
}

impl<E> ExecuteError<E> {
    /// The layer's error, if this is not the handler's.
    pub fn as_idempotency(&self) -> Option<&Error> {
        match self {
            ExecuteError::Idempotency(e) => Some(e),
            ExecuteError::Handler(_) => None,
        }
    }

    /// The handler's error, if the handler failed.
    pub fn as_handler(&self) -> Option<&E> {
        match self {
            ExecuteError::Handler(e) => Some(e),
            ExecuteError::Idempotency(_) => None,
        }
    }
}

/// Retries of `complete`/`fail` after a store error, with these pauses.
const FINISH_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_millis(20),
    Duration::from_millis(100),
    Duration::from_millis(400),
];

struct Inner {
    repo: SharedRepository,
    config: Config,
    clock: Arc<dyn Clock>,
    caps: Capabilities,
    metrics: Metrics,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyManager")
            .field("repo", &self.repo)
            .field("config", &self.config)
            .field("clock", &self.clock)
            .finish()
    }
}

/// Wraps handlers so that each key's first delivery runs them and every duplicate
/// gets the recorded outcome (`SPEC.md` §4). Cheap to clone; clones share the
/// repository, configuration and clock.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?
///     .scoped("payments");
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
    inner: Arc<Inner>,
    namespace: Arc<str>,
    codec: C,
}

impl<C: Codec + Clone> Clone for IdempotencyManager<C> {
    fn clone(&self) -> Self {
        IdempotencyManager {
            inner: self.inner.clone(),
            namespace: self.namespace.clone(),
            codec: self.codec.clone(),
        }
    }
}

impl<C: Codec> fmt::Debug for IdempotencyManager<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyManager")
            .field("namespace", &self.namespace)
            .field("inner", &self.inner)
            .field("codec", &self.codec)
            .finish()
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
    /// [`Error::Config`] when `config` does not validate.
    pub fn with_parts(
        repo: SharedRepository,
        config: Config,
        clock: Arc<dyn Clock>,
        codec: C,
    ) -> Result<Self, Error> {
        config.validate()?;
        let caps = repo.capabilities();
        let namespace: Arc<str> = config.key_prefix.as_str().into();
        Ok(IdempotencyManager {
            inner: Arc::new(Inner {
                repo,
                config,
                clock,
                metrics: Metrics::new(caps.backend),
                caps,
            }),
            namespace,
            codec,
        })
    }

    /// The same manager with another clock (tests use a
    /// [`ManualClock`](crate::ManualClock)).
    pub fn with_clock(self, clock: Arc<dyn Clock>) -> Self {
        let inner = Inner {
            repo: self.inner.repo.clone(),
            config: self.inner.config.clone(),
            clock,
            caps: self.inner.caps.clone(),
            metrics: Metrics::new(self.inner.caps.backend),
        };
        IdempotencyManager {
            inner: Arc::new(inner),
            namespace: self.namespace,
            codec: self.codec,
        }
    }

    /// The same manager with another result codec.
    pub fn with_codec<C2: Codec + Clone>(self, codec: C2) -> IdempotencyManager<C2> {
        IdempotencyManager {
            inner: self.inner,
            namespace: self.namespace,
            codec,
        }
    }

    /// A manager whose keys live in the sub-namespace `scope` (e.g. a handler or
    /// operation name): the same id under two scopes is two records.
    pub fn scoped(&self, scope: &str) -> Self {
        IdempotencyManager {
            inner: self.inner.clone(),
            namespace: format!("{}:{scope}", self.namespace).into(),
            codec: self.codec.clone(),
        }
    }

    /// The namespace of this manager's keys.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The repository.
    pub fn repository(&self) -> &SharedRepository {
        &self.inner.repo
    }

    /// The record key of `id` in this manager's namespace (validated; long ids
    /// digested).
    ///
    /// # Errors
    /// [`Error::InvalidKey`].
    pub fn record_key(&self, id: &str) -> Result<RecordKey, Error> {
        RecordKey::in_namespace(&self.namespace, id, self.inner.caps.max_id_bytes)
    }

    /// Runs `handler` once per key (`SPEC.md` §4).
    ///
    /// `payload` is fingerprinted (canonical JSON, SHA-256) when payload
    /// validation is on, to refuse the same key with another payload; pass `&()`
    /// when there is none. The handler's value is stored through the codec and
    /// replayed to duplicates as [`Outcome::Cached`].
    ///
    /// If the handler panics, the record is released (a redelivery runs it again)
    /// and the panic continues. If the returned future is dropped while the
    /// handler runs, the record is released in the background when a Tokio runtime
    /// is available, and otherwise stays `Processing` until its lease ends.
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
        let record_key = self.record_key(key)?;
        let fingerprint = if self.inner.config.validate_payload {
            Some(Fingerprint::of_json(payload)?)
        } else {
            None
        };
        let span = tracing::debug_span!(
            EXECUTE_SPAN,
            key = %record_key,
            backend = self.inner.caps.backend,
            outcome = tracing::field::Empty,
        );
        if span.is_disabled() {
            // No subscriber wants the span: skip entering and leaving it on every
            // poll (with `tracing`'s `log` feature on, each of those is a call).
            self.execute_inner(record_key, fingerprint, handler).await
        } else {
            self.execute_inner(record_key, fingerprint, handler)
                .instrument(span)
                .await
        }
    }

    async fn execute_inner<T, E, F, Fut>(
        &self,
        key: RecordKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let config = &self.inner.config;
        let wait_deadline = match config.in_progress {
            InProgressPolicy::Wait { timeout, .. } => Some(tokio::time::Instant::now() + timeout),
            InProgressPolicy::FailFast => None,
        };
        let (owner, attempt) = loop {
            let now = self.inner.clock.now();
            let owner = OwnerToken::random();
            let request = ReserveRequest {
                key: &key,
                owner,
                fingerprint,
                now,
                lease_until: now + config.processing_timeout,
                expires_at: now + config.ttl,
                retry_failed: config.failure_policy == FailurePolicy::StoreAndRetry,
                clock_skew: config.clock_skew,
            };
            let started = Instant::now();
            let reserved = self.inner.repo.reserve(request).await;
            self.inner
                .metrics
                .operation(Op::Reserve, started.elapsed(), reserved.is_ok());
            let existing = match reserved {
                Ok(Reservation::Acquired { attempt }) => break (owner, attempt),
                Ok(Reservation::Existing(record)) => record,
                Err(e)
                    if e.is_store_outage() && config.on_store_outage == OutagePolicy::FailOpen =>
                {
                    tracing::warn!(error = %e, "store unavailable; running the handler unprotected (fail-open)");
                    self.inner.metrics.count(Counter::FailOpen);
                    record_outcome("unprotected");
                    return match handler().await {
                        Ok(v) => Ok(Outcome::Unprotected(v)),
                        Err(e) => Err(ExecuteError::Handler(e.into_inner())),
                    };
                }
                Err(e) => return Err(e.into()),
            };
            let decision = decide_duplicate(existing, fingerprint.as_ref(), now, config.clock_skew);
            if let DuplicateDecision::InProgress { retry_after } = decision {
                if let (Some(deadline), InProgressPolicy::Wait { poll_interval, .. }) =
                    (wait_deadline, config.in_progress)
                {
                    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if !remaining.is_zero() {
                        tokio::time::sleep(poll_interval.min(remaining)).await;
                        continue;
                    }
                }
                self.inner.metrics.count(Counter::DuplicatesBlocked);
                record_outcome("in_progress");
                return Err(Error::InProgress { key, retry_after }.into());
            }
            self.inner.metrics.count(Counter::DuplicatesBlocked);
            return self.answer_duplicate(key, decision);
        };

        self.inner.metrics.count(Counter::CacheMisses);
        let _active = self.inner.metrics.active();
        tracing::debug!(attempt, "acquired");
        let mut guard = ReleaseGuard {
            repo: Some(self.inner.repo.clone()),
            clock: self.inner.clock.clone(),
            key: key.clone(),
            owner,
        };
        let result = self.run_handler(&key, owner, handler).await;
        guard.disarm();
        match result {
            Err(panic) => {
                let now = self.inner.clock.now();
                if let Err(e) = self.inner.repo.release(&key, owner, now).await {
                    tracing::error!(error = %e, "could not release the record after a handler panic; it stays Processing until its lease ends");
                }
                std::panic::resume_unwind(panic)
            }
            Ok(Ok(value)) => Ok(self.record_success(&key, owner, value).await),
            Ok(Err(err)) => {
                self.record_failure(&key, owner, &err).await;
                Err(ExecuteError::Handler(err.into_inner()))
            }
        }
    }

    fn answer_duplicate<T, E>(
        &self,
        key: RecordKey,
        decision: DuplicateDecision,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: DeserializeOwned,
    {
        match decision {
            DuplicateDecision::Replay(bytes) => {
                self.inner.metrics.count(Counter::CacheHits);
                record_outcome("cached");
                Ok(Outcome::Cached(self.codec.decode(&bytes)?))
            }
            DuplicateDecision::Duplicate => {
                record_outcome("duplicate");
                Ok(Outcome::Duplicate)
            }
            DuplicateDecision::PayloadMismatch => {
                record_outcome("payload_mismatch");
                Err(Error::PayloadMismatch { key }.into())
            }
            DuplicateDecision::PreviouslyFailed(error) => {
                record_outcome("previously_failed");
                Err(Error::PreviouslyFailed { key, error }.into())
            }
            DuplicateDecision::InProgress { retry_after } => {
                record_outcome("in_progress");
                Err(Error::InProgress { key, retry_after }.into())
            }
        }
    }

    /// Runs the handler, catching panics, extending the lease meanwhile if
    /// configured.
    async fn run_handler<T, E, F, Fut>(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        handler: F,
    ) -> Result<Result<T, HandlerError<E>>, Box<dyn std::any::Any + Send>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let fut = match std::panic::catch_unwind(AssertUnwindSafe(handler)) {
            Ok(fut) => AssertUnwindSafe(fut).catch_unwind(),
            Err(panic) => return Err(panic),
        };
        let Some(interval) = self.inner.config.lease_extension_interval else {
            return fut.await;
        };
        let mut fut = std::pin::pin!(fut);
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        let mut extending = true;
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return out,
                _ = ticker.tick(), if extending => {
                    let now = self.inner.clock.now();
                    let until = now + self.inner.config.processing_timeout;
                    let started = Instant::now();
                    let r = self.inner.repo.extend(key, owner, until, now).await;
                    self.inner.metrics.operation(Op::Extend, started.elapsed(), r.is_ok());
                    match r {
                        Ok(()) => tracing::trace!(lease_until = %until, "lease extended"),
                        Err(Error::LeaseLost { .. }) => {
                            tracing::warn!("lease lost while the handler runs; another attempt took over");
                            extending = false;
                        }
                        Err(e) => tracing::warn!(error = %e, "could not extend the lease; will retry"),
                    }
                }
            }
        }
    }

    async fn record_success<T: Serialize>(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        value: T,
    ) -> Outcome<T> {
        let config = &self.inner.config;
        let backend = self.inner.caps.backend;
        let bytes = if config.cache_results {
            match self.codec.encode(&value) {
                Ok(b)
                    if should_cache_result(
                        b.len(),
                        true,
                        config.max_result_size_bytes,
                        self.inner.caps.max_result_bytes,
                    ) =>
                {
                    Some(b)
                }
                Ok(b) => {
                    tracing::debug!(
                        size = b.len(),
                        "result too large to cache; completing without it"
                    );
                    None
                }
                Err(e) => {
                    tracing::warn!(error = %e, "result could not be encoded; completing without it");
                    None
                }
            }
        } else {
            None
        };
        let mut result = bytes.as_deref();
        let mut last_error = None;
        for pause in std::iter::once(Duration::ZERO).chain(FINISH_RETRY_PAUSES) {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let now = self.inner.clock.now();
            let started = Instant::now();
            let r = self
                .inner
                .repo
                .complete(key, owner, result, now + config.ttl, now)
                .await;
            self.inner
                .metrics
                .operation(Op::Complete, started.elapsed(), r.is_ok());
            match r {
                Ok(()) => {
                    record_outcome("executed");
                    return Outcome::Executed(value);
                }
                Err(Error::LeaseLost { .. })
                    if last_error.is_some()
                        && self.finished_by_us(key, owner, Status::Completed).await =>
                {
                    // An earlier attempt was applied; only its reply was lost.
                    record_outcome("executed");
                    return Outcome::Executed(value);
                }
                Err(Error::LeaseLost { .. }) => {
                    self.inner.metrics.count(Counter::LeaseLost);
                    record_outcome("lease_lost");
                    tracing::warn!("handler finished after its lease was taken over");
                    return Outcome::LeaseLost(value);
                }
                Err(Error::TooLarge { .. }) if result.is_some() => {
                    // The store's real limit is below the declared one: keep the
                    // protection, drop the cache.
                    result = None;
                    last_error = None;
                }
                Err(e) if e.is_retryable() => last_error = Some(e),
                Err(e) => {
                    last_error = Some(e);
                    break;
                }
            }
        }
        let error = last_error.unwrap_or_else(|| Error::Backend {
            backend,
            message: "completion was not recorded".into(),
            source: None,
        });
        tracing::error!(error = %error, "handler succeeded but its completion was not recorded");
        record_outcome("unrecorded");
        Outcome::Unrecorded { value, error }
    }

    /// Whether the record is `status` under `owner`: after a `complete` or
    /// `fail` whose reply was lost (a timeout, a dropped connection), the retry
    /// finds the record no longer `Processing`; if it carries this attempt's
    /// owner token, the lost attempt was applied. Only asked on that path.
    async fn finished_by_us(&self, key: &RecordKey, owner: OwnerToken, status: Status) -> bool {
        let now = self.inner.clock.now();
        matches!(
            self.inner.repo.get(key, now).await,
            Ok(Some(r)) if r.owner == owner && r.status == status
        )
    }

    async fn record_failure<E: fmt::Display>(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        err: &HandlerError<E>,
    ) {
        let config = &self.inner.config;
        let action = failure_action(err.kind(), config.failure_policy);
        let mut retrying = false;
        for pause in std::iter::once(Duration::ZERO).chain(FINISH_RETRY_PAUSES) {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let now = self.inner.clock.now();
            let started = Instant::now();
            let (op, r) = match action {
                FailureAction::Release => {
                    (Op::Release, self.inner.repo.release(key, owner, now).await)
                }
                FailureAction::StoreFailed => {
                    let limit = self
                        .inner
                        .caps
                        .max_result_bytes
                        .map_or(config.max_result_size_bytes, |s| {
                            s.min(config.max_result_size_bytes)
                        });
                    let message = truncate_utf8(err.to_string(), limit);
                    let r = self
                        .inner
                        .repo
                        .fail(key, owner, Some(message.as_bytes()), now + config.ttl, now)
                        .await;
                    (Op::Fail, r)
                }
            };
            self.inner
                .metrics
                .operation(op, started.elapsed(), r.is_ok());
            match r {
                Ok(()) => return,
                // An earlier attempt stored the failure; only its reply was lost.
                Err(Error::LeaseLost { .. })
                    if retrying
                        && action == FailureAction::StoreFailed
                        && self.finished_by_us(key, owner, Status::Failed).await =>
                {
                    return;
                }
                Err(Error::LeaseLost { .. }) => {
                    self.inner.metrics.count(Counter::LeaseLost);
                    return;
                }
                Err(e) if e.is_retryable() => {
                    retrying = true;
                    tracing::warn!(error = %e, operation = op.as_str(), "could not record the handler failure; retrying");
                }
                Err(e) => {
                    tracing::error!(error = %e, operation = op.as_str(), "could not record the handler failure; the record stays Processing until its lease ends");
                    return;
                }
            }
        }
        tracing::error!(
            "could not record the handler failure; the record stays Processing until its lease ends"
        );
    }

    /// Runs one step of a multi-step handler under the sub-key
    /// `{event_id}:{step}`: each step runs once even if a redelivery repeats the
    /// steps before it.
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
        self.execute(&format!("{event_id}:{step}"), payload, handler)
            .await
    }

    /// The current instant of the manager's clock.
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }
}

fn truncate_utf8(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// Releases the record in the background if the `execute` future is dropped
/// while the handler runs (cancellation).
struct ReleaseGuard {
    repo: Option<SharedRepository>,
    clock: Arc<dyn Clock>,
    key: RecordKey,
    owner: OwnerToken,
}

impl ReleaseGuard {
    fn disarm(&mut self) {
        self.repo = None;
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        let Some(repo) = self.repo.take() else { return };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %self.key, "execute cancelled outside a Tokio runtime; the record stays Processing until its lease ends");
            return;
        };
        let (key, owner, now) = (self.key.clone(), self.owner, self.clock.now());
        handle.spawn(async move {
            if let Err(e) = repo.release(&key, owner, now).await {
                tracing::warn!(key = %key, error = %e, "could not release the record of a cancelled execution");
            }
        });
    }
}

/// The name of the span around each execution.
const EXECUTE_SPAN: &str = "idempotency.execute";

/// Records the execution's outcome on its span. Only on its own span: when a
/// filter disables it, the current span is the caller's, not ours to write to
/// (and with no subscriber at all this is one check).
fn record_outcome(outcome: &'static str) {
    let span = tracing::Span::current();
    if span.metadata().is_some_and(|m| m.name() == EXECUTE_SPAN) {
        span.record("outcome", outcome);
    }
}
