//! The core of **idempotency-rs**: make at-least-once consumers behave exactly once.
//!
//! Brokers and HTTP clients redeliver. This crate wraps a handler so that the
//! first delivery of a key runs it and every duplicate gets the stored outcome —
//! or a clear "in progress" — without running it again, also when consumers race
//! on one key or crash half way (leases, takeover, fencing tokens).
//!
//! - [`Repository`]: the atomic store operations every backend implements
//!   (`reserve`, `complete`, `fail`, `release`, `extend`, `get`, `delete`,
//!   `purge_expired`), object-safe and usable as [`SharedRepository`].
//! - [`IdempotencyManager`]: the state machine around a handler.
//! - [`decision`]: the state machine's decisions as pure functions.
//! - [`MemoryRepository`]: the embedded default store.
//! - [`contract`]: the behaviour contract all of this is held to.
//! - [`testing`]: a fault-injecting repository wrapper and a Tokio-time clock,
//!   for testing handlers and backends under failure.
//! - [`KeyStrategy`], [`Fingerprint`], [`Dispatcher`], [`IdempotentHandler`]:
//!   deriving keys from events and wrapping event handlers.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
//!
//! // The broker delivers the same message twice.
//! for delivery in 1..=2 {
//!     let outcome = manager
//!         .execute("ProcessPayment:evt-42", &serde_json::json!({"amount": 10}), || async {
//!             // ... charge the card ...
//!             Ok::<_, HandlerError<String>>("receipt-1".to_string())
//!         })
//!         .await?;
//!     match (delivery, outcome) {
//!         (1, Outcome::Executed(receipt)) => assert_eq!(receipt, "receipt-1"),
//!         (2, Outcome::Cached(receipt)) => assert_eq!(receipt, "receipt-1"),
//!         (_, other) => panic!("unexpected {other:?}"),
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc = include_str!("../docs/contract.md")]
pub mod contract {}

pub mod admin;
mod canonical;
mod codec;
mod config;
pub mod decision;
mod engine;
mod error;
mod key;
mod manager;
mod memory;
pub mod metrics;

mod middleware;
pub mod probe;
mod record;
mod repository;
mod share;
pub mod stages;
mod strategy;
pub mod testing;
mod time;
pub mod tls;

pub use canonical::canonical_json_text;
pub use codec::{Codec, JsonCodec};
pub use config::{
    parse_bool, parse_duration, redact_url, AnswerCacheConfig, CancelPolicy, Config, FailurePolicy,
    InProgressPolicy, OutagePolicy, MAX_DURATION,
};
pub use decision::FailureKind;
pub use engine::answers::AnswerCacheStats;
pub use engine::lease::ExecutionContext;
pub use error::{BoxError, Error};
pub use key::{
    compose_parts, escape_namespace, escape_namespace_into, escape_part, Fingerprint, OwnerToken,
    RecordKey, DIGEST_PREFIX, MAX_NAMESPACE_BYTES,
};
pub use manager::{ExecuteError, HandlerError, HandlerResult, IdempotencyManager, Outcome};
pub use memory::MemoryRepository;
pub use middleware::{BoxFuture, DispatchResult, Dispatcher, EventHandler, IdempotentHandler};
pub use record::{Record, Status, StoredColumns};
pub use repository::{
    Capabilities, Completion, OwnedReserveRequest, OwnedWrite, Repository, RepositoryExt,
    Reservation, ReserveRequest, SharedRepository,
};
pub use share::FreshShare;
pub use strategy::{canonical_json, CustomKeyFn, Event, KeyStrategy};
pub use time::{Clock, ManualClock, SystemClock, Timestamp};

/// Re-exported so backends implement [`Repository`] with the same macro version.
pub use async_trait::async_trait;
