//! The execution engine's decisions, for managers other than
//! [`IdempotencyManager`](crate::IdempotencyManager) — the PostgreSQL
//! transactional manager, an integration with its own control flow — so that
//! each policy lives in one place.
//!
//! Each function is what the manager itself calls at that stage:
//! [`reserve_request`] (stage 1: what to reserve), [`answer_duplicate`] (stage
//! 1: what a duplicate gets), [`cacheable_result`] and [`failure_record`]
//! (stage 3: what to store).
//!
//! ```
//! use idempotency_core::stages::{cacheable_result, failure_record, FailureRecord};
//! use idempotency_core::{Config, FailureKind, FailurePolicy, JsonCodec};
//!
//! let config = Config { max_result_size_bytes: 8, ..Config::default() };
//! assert_eq!(cacheable_result(&JsonCodec, &config, None, &"ok"), Some(b"\"ok\"".to_vec()));
//! assert_eq!(cacheable_result(&JsonCodec, &config, None, &"far too long"), None);
//!
//! let store = Config { failure_policy: FailurePolicy::StoreAndRetry, ..Config::default() };
//! assert_eq!(
//!     failure_record(&store, None, FailureKind::Default, "timeout".into()),
//!     FailureRecord::Store { error: b"timeout".to_vec(), retryable: true },
//! );
//! assert_eq!(
//!     failure_record(&Config::default(), None, FailureKind::Default, "x".into()),
//!     FailureRecord::Release,
//! );
//! ```

use crate::codec::Codec;
use crate::config::Config;
use crate::decision::{
    failure_action, should_cache_result, DuplicateDecision, FailureAction, FailureKind,
};
use crate::error::Error;
use crate::key::RecordKey;
use crate::manager::{ExecuteError, Outcome};

pub use crate::engine::reserve::RESERVE_RETRIES;
pub use crate::engine::reserve_request;
pub use crate::manager::front::Front;

/// What a duplicate delivery gets for `decision` (contract §4, stage 1): the
/// cached result decoded with `codec`, `Duplicate`, or the matching error. A
/// cached result that does not decode is [`Error::Codec`] whose message names
/// the key.
///
/// # Errors
/// [`Error::PayloadMismatch`], [`Error::PreviouslyFailed`],
/// [`Error::InProgress`], or [`Error::Codec`].
pub fn answer_duplicate<T, E, C>(
    codec: &C,
    key: &RecordKey,
    decision: DuplicateDecision,
) -> Result<Outcome<T>, ExecuteError<E>>
where
    T: serde::de::DeserializeOwned,
    C: Codec,
{
    let key = key.clone();
    match decision {
        DuplicateDecision::Replay(bytes) => codec
            .decode(&bytes)
            .map(Outcome::Cached)
            .map_err(|e| e.naming(&key).into()),
        DuplicateDecision::Duplicate => Ok(Outcome::Duplicate),
        DuplicateDecision::PayloadMismatch => Err(Error::PayloadMismatch { key }.into()),
        DuplicateDecision::PreviouslyFailed(error) => {
            Err(Error::PreviouslyFailed { key, error }.into())
        }
        DuplicateDecision::InProgress { retry_after } => {
            Err(Error::InProgress { key, retry_after }.into())
        }
    }
}

/// The bytes to cache for a handler's `value`, if result caching is on and they
/// fit `min(max_result_size_bytes, store_limit)`; `None` completes the record
/// without a cached result (the key stays protected).
pub fn cacheable_result<T, C>(
    codec: &C,
    config: &Config,
    store_limit: Option<usize>,
    value: &T,
) -> Option<Vec<u8>>
where
    T: serde::Serialize + ?Sized,
    C: Codec,
{
    if !config.cache_results {
        return None;
    }
    match codec.encode(value) {
        Ok(bytes)
            if should_cache_result(
                bytes.len(),
                true,
                config.max_result_size_bytes,
                store_limit,
            ) =>
        {
            Some(bytes)
        }
        Ok(bytes) => {
            tracing::debug!(
                size = bytes.len(),
                "result too large to cache; completing without it"
            );
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "result could not be encoded; completing without it");
            None
        }
    }
}

/// What to do with the record after a handler error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureRecord {
    /// Delete it: the next delivery runs the handler again.
    Release,
    /// Store `Failed` with this error.
    Store {
        /// The handler error's `Display`, cut to the store's limit on a
        /// character boundary.
        error: Vec<u8>,
        /// Whether a later delivery may take the failure over.
        retryable: bool,
    },
}

/// What a handler error of `kind` with `message` does to the record under the
/// configured failure policy (contract §4, stage 3).
pub fn failure_record(
    config: &Config,
    store_limit: Option<usize>,
    kind: FailureKind,
    message: String,
) -> FailureRecord {
    match failure_action(kind, config.failure_policy) {
        FailureAction::Release => FailureRecord::Release,
        FailureAction::StoreFailed { retryable } => {
            let limit = store_limit.map_or(config.max_result_size_bytes, |s| {
                s.min(config.max_result_size_bytes)
            });
            FailureRecord::Store {
                error: truncate_utf8(message, limit).into_bytes(),
                retryable,
            }
        }
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
