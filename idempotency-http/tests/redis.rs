//! The layer in an in-process axum app over a real Redis server from the test
//! harness (`idempotency_conformance::containers::redis`): every shared
//! scenario, each in its own random key prefix.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use idempotency_conformance::containers;
use idempotency_core::SharedRepository;
use idempotency_redis::RedisRepository;

async fn repository() -> SharedRepository {
    let server = containers::redis()
        .await
        .expect("a Redis server from the harness (see docs/testing.md)");
    let repo = RedisRepository::connect(server.url())
        .await
        .expect("connect to the harness's Redis server");
    Arc::new(repo)
}

common::http_scenarios!(repository);
