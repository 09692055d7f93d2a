//! The custom repository passes the same suite as the bundled backends.

use std::sync::Arc;

use custom_backend_example::CasRepository;
use idempotency_core::SharedRepository;

async fn repository() -> SharedRepository {
    Arc::new(CasRepository::default())
}

idempotency_conformance::conformance_tests!(repository);

/// The operator operations list and count what the repository holds.
#[tokio::test]
async fn admin_lists_and_counts_records() {
    use idempotency_core::admin::ListFilter;
    use idempotency_core::{Clock, OwnerToken, RecordKey, Repository, ReserveRequest, SystemClock};
    use std::time::Duration;

    let repo = CasRepository::default();
    let now = SystemClock.now();
    for id in ["a", "b"] {
        let key = RecordKey::new("ns", id, 256).unwrap();
        repo.reserve(ReserveRequest::new(
            &key,
            OwnerToken::random(),
            now,
            Duration::from_secs(30),
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    }
    let admin = repo.admin().expect("the example offers admin operations");
    let listing = admin.list(&ListFilter::default(), now).await.unwrap();
    assert_eq!(listing.records.len(), 2);
    let stats = admin.stats(now, Duration::ZERO).await.unwrap();
    assert_eq!(stats.namespaces[0].processing, 2);
}
