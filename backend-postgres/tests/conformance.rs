//! The whole conformance suite against PostgreSQL.

mod common;

use std::sync::Arc;

use idempotency_core::SharedRepository;

async fn repository() -> SharedRepository {
    Arc::new(common::repository("idem_conformance").await)
}

idempotency_conformance::conformance_tests!(repository);
