//! The in-memory store passes the whole suite: through the per-check macro,
//! through `run_all`, and behind `Box<dyn Repository>` / `Arc<Arc<…>>` wrappers.

use std::sync::Arc;

use idempotency_core::{MemoryRepository, Repository, SharedRepository};

async fn repository() -> SharedRepository {
    Arc::new(MemoryRepository::new())
}

idempotency_conformance::conformance_tests!(repository);

mod small_limit {
    use super::*;

    /// A store with a declared result limit exercises the `TooLarge` paths.
    async fn repository() -> SharedRepository {
        Arc::new(MemoryRepository::new().with_max_result_bytes(4096))
    }

    idempotency_conformance::conformance_tests!(repository);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_all_through_dyn_wrappers() {
    let boxed: Box<dyn Repository> = Box::new(MemoryRepository::with_shards(1));
    let shared: SharedRepository = Arc::new(boxed);
    let report = idempotency_conformance::run_all(shared).await;
    assert!(report.passed() >= 40, "{report}");
    report.assert_all_passed();

    let double: SharedRepository = Arc::new(Arc::new(MemoryRepository::new()));
    idempotency_conformance::run_all(double)
        .await
        .assert_all_passed();
}

#[test]
fn suite_has_at_least_forty_uniquely_named_checks() {
    let names: std::collections::HashSet<_> = idempotency_conformance::ALL_CHECKS
        .iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(names.len(), idempotency_conformance::ALL_CHECKS.len());
    assert!(names.len() >= 40, "{} checks", names.len());
}
