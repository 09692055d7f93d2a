//! Helpers shared by the manager's integration tests: a memory store behind the
//! fault-injecting wrapper, a manager over it on a Tokio-time clock.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use idempotency_core::testing::{FaultyRepository, TokioClock};
use idempotency_core::{Config, IdempotencyManager, JsonCodec, MemoryRepository, SharedRepository};

pub(crate) type Store = Arc<FaultyRepository<MemoryRepository>>;

pub(crate) fn store() -> Store {
    Arc::new(FaultyRepository::new(MemoryRepository::new()))
}

pub(crate) fn manager(repo: &Store, config: Config, clock: &TokioClock) -> IdempotencyManager {
    IdempotencyManager::with_parts(
        repo.clone() as SharedRepository,
        config,
        Arc::new(clock.clone()),
        JsonCodec,
    )
    .unwrap()
}

/// Waits (bounded, by yielding) until `done` holds.
pub(crate) async fn eventually(mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..10_000 {
        if done().await {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("condition not reached");
}
