//! The whole conformance suite against a DynamoDB-compatible server.

mod common;

use std::sync::Arc;

use idempotency_core::SharedRepository;

async fn repository() -> SharedRepository {
    Arc::new(common::repository().await)
}

idempotency_conformance::conformance_tests!(repository);
