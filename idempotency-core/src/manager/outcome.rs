//! What an execution returns: the outcome, the handler's classified error, and
//! the execution's error.

use std::fmt;

use crate::decision::FailureKind;
use crate::error::Error;

/// What a call to [`IdempotencyManager::execute`](crate::IdempotencyManager::execute) did.
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
    /// The handler ran and succeeded, but recording the completion kept failing
    /// until shortly before the lease ended (a store outage longer than the
    /// lease): the record stays `Processing` until its lease ends, after which a
    /// redelivery would run the handler again. Acknowledge the message rather
    /// than retrying it.
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
/// [`FailurePolicy`](crate::FailurePolicy) decides); mark an error [`HandlerError::transient`] to release
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

/// Why [`IdempotencyManager::execute`](crate::IdempotencyManager::execute) did not
/// return an [`Outcome`].
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
