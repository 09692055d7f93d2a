//! The custom repository passes the same suite as the bundled backends.

use std::sync::Arc;

use custom_backend_example::CasRepository;
use idempotency_core::SharedRepository;

async fn repository() -> SharedRepository {
    Arc::new(CasRepository::default())
}

idempotency_conformance::conformance_tests!(repository);
