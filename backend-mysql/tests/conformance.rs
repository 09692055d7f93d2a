//! The whole conformance suite against MariaDB, and its errors clause.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;

use idempotency_core::SharedRepository;

/// One table for the suite: checks keep apart by namespace.
const TABLE: &str = "idem_conformance";

async fn repository() -> SharedRepository {
    Arc::new(common::repository(TABLE, "").await)
}

idempotency_conformance::conformance_tests!(repository);

/// The errors clause, through a proxy the test can cut: rows the repository
/// cannot decode, and a server that stops answering.
mod store_faults {
    use super::*;
    use idempotency_conformance::containers::{FaultProxy, ProxyFaults};
    use idempotency_conformance::SharedFaults;
    use idempotency_core::{Clock, OwnerToken, RecordKey, Repository, ReserveRequest, SystemClock};
    use idempotency_mysql::{sqlx, MySqlRepository};
    use std::time::Duration;

    /// A live record whose owner token is 2 bytes instead of 16.
    async fn corrupt(direct: MySqlRepository, key: RecordKey) -> Result<(), String> {
        let now = SystemClock.now();
        direct
            .reserve(ReserveRequest::new(
                &key,
                OwnerToken::random(),
                now,
                Duration::from_secs(3600),
                Duration::from_secs(7200),
            ))
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query(&format!(
            "UPDATE {TABLE} SET owner = x'0102' WHERE namespace = ? AND id = ?"
        ))
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .execute(direct.pool())
        .await
        .map(drop)
        .map_err(|e| e.to_string())
    }

    async fn repository_and_faults() -> (SharedRepository, SharedFaults) {
        let direct = common::repository(TABLE, "").await;
        let proxy = FaultProxy::start(&common::server_url().await)
            .await
            .expect("a fault proxy");
        let separator = if proxy.url().contains('?') { '&' } else { '?' };
        let repo = idempotency_mysql::connect(&format!(
            "{}{separator}table={TABLE}&operation_timeout=1s&acquire_timeout=1s",
            proxy.url()
        ))
        .await
        .expect("connect through the fault proxy");
        let faults = ProxyFaults::new(proxy, move |key| corrupt(direct.clone(), key));
        (Arc::new(repo), Arc::new(faults))
    }

    idempotency_conformance::store_fault_tests!(repository_and_faults);
}
