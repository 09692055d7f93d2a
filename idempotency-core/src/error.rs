//! The one error type of the core surface.

use std::fmt;
use std::time::Duration;

use crate::key::RecordKey;

/// A boxed error from a backend's own client.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in the idempotency layer, for repositories and the
/// manager alike.
///
/// Store failures are split by what a caller should do: [`Error::Unavailable`] and
/// [`Error::Timeout`] are retryable ([`Error::is_retryable`]);
/// [`Error::Corrupt`], [`Error::Config`] and [`Error::TooLarge`] are not.
/// Outcomes of the state machine that are not the handler's (a duplicate in
/// flight, a reused key) are variants too, so one `match` covers them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The idempotency key is unusable (empty, or a namespace that is too long).
    #[error("invalid idempotency key: {reason}")]
    InvalidKey {
        /// What is wrong with it.
        reason: String,
    },

    /// Another attempt holds the key and its lease is live. Brokers should
    /// redeliver later; HTTP answers 409.
    #[error("{key} is being processed by another attempt; retry after {retry_after:?}")]
    InProgress {
        /// The key.
        key: RecordKey,
        /// When to try again: from the manager, about one typical execution
        /// (a running average of how long its executions held a key, from
        /// reserve to recorded outcome, at least 1 ms), never later than the
        /// holder's lease ends; before any execution has finished, and from a
        /// bare repository, when the lease ends (plus the skew allowance). A
        /// repository's `reserve` that waited for another transaction's lock
        /// on the key (PostgreSQL) answers this error itself, the holder's
        /// lease unknown to it: how long it waited.
        retry_after: Duration,
    },

    /// The key was used before with a different payload. HTTP answers 422.
    #[error("{key} was used before with a different payload")]
    PayloadMismatch {
        /// The key.
        key: RecordKey,
    },

    /// The key's earlier attempt failed and its failure was stored.
    #[error("{key} failed before: {}", String::from_utf8_lossy(error))]
    PreviouslyFailed {
        /// The key.
        key: RecordKey,
        /// The stored error (the manager stores the handler error's `Display`).
        error: Vec<u8>,
    },

    /// The owner token no longer holds the record: it was taken over, completed,
    /// released, deleted or expired. The record was left untouched.
    #[error("the lease on {key} was lost: another owner holds it, or it is gone")]
    LeaseLost {
        /// The key.
        key: RecordKey,
    },

    /// The store cannot be reached or refused service (retryable).
    #[error("{backend} is unavailable: {message}")]
    Unavailable {
        /// The backend's name.
        backend: &'static str,
        /// What happened.
        message: String,
        /// The client's error.
        #[source]
        source: Option<BoxError>,
    },

    /// An operation did not finish in time (retryable; its effect is unknown).
    #[error("{backend} timed out during {operation}")]
    Timeout {
        /// The backend's name.
        backend: &'static str,
        /// The operation that timed out.
        operation: &'static str,
    },

    /// A stored record (or a value in it) could not be read back.
    #[error("corrupt record {}: {reason}", key.as_ref().map_or_else(|| "<value>".to_owned(), |k| k.to_string()))]
    Corrupt {
        /// The key, where known.
        key: Option<RecordKey>,
        /// What could not be parsed.
        reason: String,
    },

    /// The layer or a backend is misconfigured.
    #[error("configuration error: {message}")]
    Config {
        /// What is wrong.
        message: String,
    },

    /// A value is larger than the store can hold.
    #[error("{what} of {size} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// What was too large (`result`, `error`).
        what: &'static str,
        /// Its size.
        size: usize,
        /// The limit.
        max: usize,
    },

    /// The backend does not support an operation.
    #[error("{backend} does not support {operation}")]
    Unsupported {
        /// The operation.
        operation: &'static str,
        /// The backend's name.
        backend: &'static str,
    },

    /// A result could not be encoded or decoded by the codec.
    #[error("codec error: {source}")]
    Codec {
        /// The codec's error.
        #[source]
        source: BoxError,
    },

    /// Any other failure of the store, not known to be retryable.
    #[error("{backend} error: {message}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// What happened.
        message: String,
        /// The client's error.
        #[source]
        source: Option<BoxError>,
    },
}

impl Error {
    /// Whether retrying the same call later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Unavailable { .. } | Error::Timeout { .. } | Error::InProgress { .. }
        )
    }

    /// The same error again, of the same variant and class, for another
    /// request a shared failure hit (each request of a batch whose one round
    /// trip failed gets its own answer). Variant fields are kept; a client's
    /// `source` is kept as text in the message.
    ///
    /// ```
    /// use idempotency_core::Error;
    /// let e = Error::unavailable("redis", std::io::Error::other("connection reset"));
    /// let again = e.for_another();
    /// assert!(again.is_store_outage());
    /// assert_eq!(again.to_string(), e.to_string());
    /// ```
    pub fn for_another(&self) -> Error {
        match self {
            Error::InvalidKey { reason } => Error::InvalidKey {
                reason: reason.clone(),
            },
            Error::InProgress { key, retry_after } => Error::InProgress {
                key: key.clone(),
                retry_after: *retry_after,
            },
            Error::PayloadMismatch { key } => Error::PayloadMismatch { key: key.clone() },
            Error::PreviouslyFailed { key, error } => Error::PreviouslyFailed {
                key: key.clone(),
                error: error.clone(),
            },
            Error::LeaseLost { key } => Error::LeaseLost { key: key.clone() },
            Error::Unavailable {
                backend, message, ..
            } => Error::Unavailable {
                backend,
                message: message.clone(),
                source: None,
            },
            Error::Timeout { backend, operation } => Error::Timeout { backend, operation },
            Error::Corrupt { key, reason } => Error::Corrupt {
                key: key.clone(),
                reason: reason.clone(),
            },
            Error::Config { message } => Error::Config {
                message: message.clone(),
            },
            Error::TooLarge { what, size, max } => Error::TooLarge {
                what,
                size: *size,
                max: *max,
            },
            Error::Unsupported { operation, backend } => Error::Unsupported { operation, backend },
            Error::Codec { source } => Error::Codec {
                source: source.to_string().into(),
            },
            Error::Backend {
                backend, message, ..
            } => Error::Backend {
                backend,
                message: message.clone(),
                source: None,
            },
        }
    }

    /// Whether the store itself failed (unavailable or timed out), as opposed to a
    /// decision of the state machine: the condition for failing open.
    pub fn is_store_outage(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::Timeout { .. })
    }

    /// [`Error::Unavailable`] with a client error.
    pub fn unavailable(backend: &'static str, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Error::Unavailable {
            backend,
            message: source.to_string(),
            source: Some(source),
        }
    }

    /// [`Error::Backend`] with a client error.
    pub fn backend(backend: &'static str, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Error::Backend {
            backend,
            message: source.to_string(),
            source: Some(source),
        }
    }

    /// [`Error::Corrupt`] for the record at `key`.
    pub fn corrupt(key: &RecordKey, reason: impl Into<String>) -> Self {
        Error::Corrupt {
            key: Some(key.clone()),
            reason: reason.into(),
        }
    }

    /// [`Error::Corrupt`] for a value not yet tied to a key (a parser's error;
    /// attach the key with [`Error::with_key`]).
    pub fn corrupt_value(what: &str, problem: &str) -> Self {
        Error::Corrupt {
            key: None,
            reason: format!("{what}: {problem}"),
        }
    }

    /// [`Error::Config`].
    pub fn config(message: impl Into<String>) -> Self {
        Error::Config {
            message: message.into(),
        }
    }

    /// This error, naming `key` in its message if it does not already: a
    /// [`Error::Codec`] becomes "cannot decode the stored result of KEY: …"
    /// (the source stays reachable through [`std::error::Error::source`]); a
    /// [`Error::Corrupt`] without a key gets it. Other errors name their key
    /// already and are returned as they are.
    pub fn naming(self, key: &RecordKey) -> Self {
        match self {
            Error::Codec { source } if !source.is::<KeyedCodecError>() => Error::Codec {
                source: Box::new(KeyedCodecError {
                    key: key.clone(),
                    source,
                }),
            },
            other => other.with_key(key),
        }
    }

    /// Attaches `key` to a [`Error::Corrupt`] that has none; other errors are
    /// returned unchanged.
    pub fn with_key(self, key: &RecordKey) -> Self {
        match self {
            Error::Corrupt { key: None, reason } => Error::Corrupt {
                key: Some(key.clone()),
                reason,
            },
            other => other,
        }
    }
}

/// A codec error with the key whose stored result it concerns.
#[derive(Debug)]
struct KeyedCodecError {
    key: RecordKey,
    source: BoxError,
}

impl fmt::Display for KeyedCodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot decode the stored result of {} (did the result type change between \
             deployments?): {}",
            self.key, self.source
        )
    }
}

impl std::error::Error for KeyedCodecError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}
