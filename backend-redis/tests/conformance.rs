//! The whole conformance suite against the harness's Redis server, once per
//! reserve strategy. (The same suite against a Redis Cluster runs in
//! `tests/redis.rs`.)

#![allow(clippy::expect_used)]

use std::sync::Arc;

use idempotency_conformance::containers;
use idempotency_core::SharedRepository;
use idempotency_redis::{RedisRepository, ReserveStrategy};

async fn connect(strategy: ReserveStrategy) -> SharedRepository {
    let server = containers::redis()
        .await
        .expect("a Redis server from the harness (see docs/testing.md)");
    let repo = RedisRepository::connect(server.url())
        .await
        .expect("connect to the harness's Redis server")
        .with_reserve_strategy(strategy);
    Arc::new(repo)
}

/// The default: `SET … NX PX … GET`, the reserve script only for takeovers.
async fn repository() -> SharedRepository {
    connect(ReserveStrategy::SetNxGet).await
}

idempotency_conformance::conformance_tests!(repository);

/// Every reservation through the reserve script.
mod script_strategy {
    use super::*;

    async fn repository() -> SharedRepository {
        connect(ReserveStrategy::Script).await
    }

    idempotency_conformance::conformance_tests!(repository);
}
