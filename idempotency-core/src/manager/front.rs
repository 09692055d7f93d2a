//! The front every manager shares: the namespace and its rules, the record key
//! and fingerprint of a call, the execution's span, and the outcome it counts.
//! [`IdempotencyManager`](crate::IdempotencyManager) and the managers built on
//! the engine's stages (the PostgreSQL transactional manager) both use it, so
//! a rule about keys or telemetry lives here once.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use super::{ExecuteError, Outcome};
use crate::config::Config;
use crate::error::Error;
use crate::key::{escape_part, Fingerprint, RecordKey};
use crate::metrics::{Counter, Metrics};
use crate::repository::Capabilities;

/// The name of every execution's span.
pub(crate) const EXECUTE_SPAN: &str = "idempotency.execute";

/// A manager's front: its namespace, how it turns a call's key and payload
/// into a [`RecordKey`] and a [`Fingerprint`], and the span and metrics of an
/// execution.
///
/// ```
/// use idempotency_core::stages::Front;
/// use idempotency_core::{Capabilities, Config, Error};
///
/// let front = Front::new(&Config::default(), &Capabilities::new("memory"));
/// let orders = front.scoped("orders")?;
/// assert_eq!(orders.namespace(), "idempotency:orders");
/// let (key, fingerprint) = orders.prepare("o-1", &serde_json::json!({"amount": 5}))?;
/// assert_eq!(key.namespace(), "idempotency:orders");
/// assert!(fingerprint.is_some());
/// // A scope that leaves no room for keys is refused when it is made.
/// assert!(matches!(front.scoped(&"s".repeat(600)), Err(Error::InvalidKey { .. })));
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone)]
pub struct Front {
    namespace: Arc<str>,
    max_id_bytes: usize,
    validate_payload: bool,
    backend: &'static str,
    metrics: Arc<Metrics>,
}

impl fmt::Debug for Front {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Front")
            .field("namespace", &self.namespace)
            .field("max_id_bytes", &self.max_id_bytes)
            .field("validate_payload", &self.validate_payload)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl Front {
    /// The front of a manager with `config` over a store with `caps`: the
    /// namespace is `config.key_prefix`.
    pub fn new(config: &Config, caps: &Capabilities) -> Front {
        Front::with_metrics(config, caps, Arc::new(Metrics::new(caps.backend)))
    }

    pub(crate) fn with_metrics(
        config: &Config,
        caps: &Capabilities,
        metrics: Arc<Metrics>,
    ) -> Front {
        Front {
            namespace: escape_part(&config.key_prefix).into(),
            max_id_bytes: caps.max_id_bytes,
            validate_payload: config.validate_payload,
            backend: caps.backend,
            metrics,
        }
    }

    /// The front of the sub-namespace `scope`. Scopes compose injectively
    /// (`%` and `:` in a scope are escaped).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when the namespace with the scope would be longer
    /// than [`MAX_NAMESPACE_BYTES`](crate::MAX_NAMESPACE_BYTES).
    pub fn scoped(&self, scope: &str) -> Result<Front, Error> {
        let namespace: Arc<str> = format!("{}:{}", self.namespace, escape_part(scope)).into();
        if namespace.len() > crate::MAX_NAMESPACE_BYTES {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the scope `{}` makes the namespace {} bytes long; at most {} are allowed \
                     (shorten the scope or the key prefix)",
                    scope.escape_debug(),
                    namespace.len(),
                    crate::MAX_NAMESPACE_BYTES
                ),
            });
        }
        Ok(Front {
            namespace,
            ..self.clone()
        })
    }

    /// The namespace of this front's keys.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The store's name (the `backend` label of spans and metrics).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The record key of `id` in this namespace.
    ///
    /// # Errors
    /// [`Error::InvalidKey`].
    pub fn record_key(&self, id: &str) -> Result<RecordKey, Error> {
        RecordKey::in_namespace(&self.namespace, id, self.max_id_bytes)
    }

    /// A call's record key and, when payload validation is on, its payload's
    /// fingerprint.
    ///
    /// # Errors
    /// [`Error::InvalidKey`], or [`Error::Codec`] for a payload that does not
    /// serialise.
    pub fn prepare<P: Serialize + ?Sized>(
        &self,
        key: &str,
        payload: &P,
    ) -> Result<(RecordKey, Option<Fingerprint>), Error> {
        let record_key = self.record_key(key)?;
        let fingerprint = if self.validate_payload {
            Some(Fingerprint::of_json(payload)?)
        } else {
            None
        };
        Ok((record_key, fingerprint))
    }

    /// The span of one execution of `key` (`idempotency.execute`, with the
    /// key, the backend and an `outcome` field [`observe`](Self::observe)
    /// fills in).
    pub fn span(&self, key: &RecordKey) -> tracing::Span {
        tracing::debug_span!(
            EXECUTE_SPAN,
            key = %key,
            backend = self.backend,
            outcome = tracing::field::Empty,
        )
    }

    /// Counts a finished execution and records its outcome on the current
    /// execution span, for managers that drive the stages themselves (the
    /// [`IdempotencyManager`](crate::IdempotencyManager) counts as it goes).
    pub fn observe<T, E>(&self, answer: &Result<Outcome<T>, ExecuteError<E>>) {
        use Counter::{CacheHits, CacheMisses, DuplicatesBlocked, FailOpen, LeaseLost};
        let (outcome, counters): (&'static str, &[Counter]) = match answer {
            Ok(Outcome::Executed(_)) => ("executed", &[CacheMisses]),
            Ok(Outcome::Cached(_)) => ("cached", &[CacheHits, DuplicatesBlocked]),
            Ok(Outcome::Duplicate) => ("duplicate", &[DuplicatesBlocked]),
            Ok(Outcome::LeaseLost(_)) => ("lease_lost", &[CacheMisses, LeaseLost]),
            Ok(Outcome::Unprotected(_)) => ("unprotected", &[FailOpen]),
            Ok(Outcome::Unrecorded { .. }) => ("unrecorded", &[CacheMisses]),
            Err(ExecuteError::Handler(_)) => ("handler_error", &[CacheMisses]),
            Err(ExecuteError::Idempotency(e)) => match e {
                Error::InProgress { .. } => ("in_progress", &[DuplicatesBlocked]),
                Error::PayloadMismatch { .. } => ("payload_mismatch", &[DuplicatesBlocked]),
                Error::PreviouslyFailed { .. } => ("previously_failed", &[DuplicatesBlocked]),
                Error::InvalidKey { .. } => ("invalid_key", &[]),
                _ => ("store_error", &[]),
            },
        };
        for counter in counters {
            self.metrics.count(*counter);
        }
        record_outcome(outcome);
    }
}

/// Records the execution's outcome on its span. Only on its own span: when a
/// filter disables it, the current span is the caller's, not ours to write to
/// (and with no subscriber at all this is one check).
pub(crate) fn record_outcome(outcome: &'static str) {
    let span = tracing::Span::current();
    if span.metadata().is_some_and(|m| m.name() == EXECUTE_SPAN) {
        span.record("outcome", outcome);
    }
}
