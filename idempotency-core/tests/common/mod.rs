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

/// A memory store that declares no result limit but refuses results over 8
/// bytes when completing (as DynamoDB does for an item over its limit).
#[derive(Debug)]
pub(crate) struct SmallerThanDeclared(pub(crate) idempotency_core::MemoryRepository);

#[idempotency_core::async_trait]
impl idempotency_core::Repository for SmallerThanDeclared {
    fn capabilities(&self) -> idempotency_core::Capabilities {
        self.0.capabilities().with_max_result_bytes(None)
    }
    async fn reserve(
        &self,
        request: idempotency_core::ReserveRequest<'_>,
    ) -> Result<idempotency_core::Reservation, idempotency_core::Error> {
        self.0.reserve(request).await
    }
    async fn complete(
        &self,
        key: &idempotency_core::RecordKey,
        owner: idempotency_core::OwnerToken,
        result: Option<&[u8]>,
        expires_at: idempotency_core::Timestamp,
        now: idempotency_core::Timestamp,
    ) -> Result<(), idempotency_core::Error> {
        if let Some(r) = result.filter(|r| r.len() > 8) {
            return Err(idempotency_core::Error::TooLarge {
                what: "result",
                size: r.len(),
                max: 8,
            });
        }
        self.0.complete(key, owner, result, expires_at, now).await
    }
    async fn fail(
        &self,
        key: &idempotency_core::RecordKey,
        owner: idempotency_core::OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: idempotency_core::Timestamp,
        now: idempotency_core::Timestamp,
    ) -> Result<(), idempotency_core::Error> {
        self.0
            .fail(key, owner, error, retryable, expires_at, now)
            .await
    }
    async fn release(
        &self,
        key: &idempotency_core::RecordKey,
        owner: idempotency_core::OwnerToken,
        now: idempotency_core::Timestamp,
    ) -> Result<(), idempotency_core::Error> {
        self.0.release(key, owner, now).await
    }
    async fn extend(
        &self,
        key: &idempotency_core::RecordKey,
        owner: idempotency_core::OwnerToken,
        lease_until: idempotency_core::Timestamp,
        expires_at: idempotency_core::Timestamp,
        now: idempotency_core::Timestamp,
    ) -> Result<(), idempotency_core::Error> {
        self.0
            .extend(key, owner, lease_until, expires_at, now)
            .await
    }
    async fn get(
        &self,
        key: &idempotency_core::RecordKey,
        now: idempotency_core::Timestamp,
    ) -> Result<Option<idempotency_core::Record>, idempotency_core::Error> {
        self.0.get(key, now).await
    }
    async fn delete(
        &self,
        key: &idempotency_core::RecordKey,
    ) -> Result<bool, idempotency_core::Error> {
        self.0.delete(key).await
    }
    async fn purge_expired(
        &self,
        now: idempotency_core::Timestamp,
        limit: usize,
    ) -> Result<usize, idempotency_core::Error> {
        self.0.purge_expired(now, limit).await
    }
}
