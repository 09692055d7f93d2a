//! The whole conformance suite against PostgreSQL.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;

use idempotency_core::SharedRepository;

async fn repository() -> SharedRepository {
    Arc::new(common::repository("idem_conformance").await)
}

idempotency_conformance::conformance_tests!(repository);

/// The suite again with each plain statement sent first on every reservation
/// (the default, adaptive plan picks one of them by the recent mix of fresh
/// keys and duplicates): each must answer only what the reservation function
/// would, and leave the rest to it.
mod insert_first {
    use super::*;

    async fn repository() -> SharedRepository {
        let plan = idempotency_postgres::ReservePlan::InsertFirst;
        Arc::new(common::repository_with("idem_conformance", plan).await)
    }

    idempotency_conformance::conformance_tests!(repository);
}

/// See [`insert_first`].
mod read_first {
    use super::*;

    async fn repository() -> SharedRepository {
        let plan = idempotency_postgres::ReservePlan::ReadFirst;
        Arc::new(common::repository_with("idem_conformance", plan).await)
    }

    idempotency_conformance::conformance_tests!(repository);
}

/// The suite again with every single reservation and completion sent through
/// the statements over arrays that coalesced calls share (see
/// `coalesce_above`), whose answers must be each call's own: once with the
/// reservation function over arrays, once with each plain statement over
/// arrays first. `tests/coalesce.rs` checks how waiting calls are grouped.
mod coalesced {
    use super::*;
    use idempotency_postgres::ReservePlan;

    async fn coalescing(plan: ReservePlan) -> SharedRepository {
        Arc::new(common::repository_over_arrays("idem_conformance", plan).await)
    }

    mod function {
        async fn repository() -> super::SharedRepository {
            super::coalescing(super::ReservePlan::Function).await
        }
        idempotency_conformance::conformance_tests!(repository);
    }

    mod insert_first {
        async fn repository() -> super::SharedRepository {
            super::coalescing(super::ReservePlan::InsertFirst).await
        }
        idempotency_conformance::conformance_tests!(repository);
    }

    mod read_first {
        async fn repository() -> super::SharedRepository {
            super::coalescing(super::ReservePlan::ReadFirst).await
        }
        idempotency_conformance::conformance_tests!(repository);
    }
}

/// The errors clause, through a proxy the test can cut: rows the repository
/// cannot decode, and a server that stops answering.
mod store_faults {
    use super::*;
    use idempotency_conformance::containers::{FaultProxy, ProxyFaults};
    use idempotency_conformance::SharedFaults;
    use idempotency_core::{Clock, OwnerToken, RecordKey, Repository, ReserveRequest, SystemClock};
    use idempotency_postgres::PgRepository;
    use std::time::Duration;

    const TABLE: &str = "idem_conformance";

    /// A live record whose owner token is 2 bytes instead of 16.
    async fn corrupt(direct: PgRepository, key: RecordKey) -> Result<(), String> {
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
            "UPDATE {TABLE} SET owner = '\\x0102'::bytea WHERE namespace = $1 AND id = $2"
        ))
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .execute(direct.pool())
        .await
        .map(drop)
        .map_err(|e| e.to_string())
    }

    async fn repository_and_faults() -> (SharedRepository, SharedFaults) {
        let direct = common::repository(TABLE).await;
        let proxy = FaultProxy::start(&common::server_url().await)
            .await
            .expect("a fault proxy");
        let separator = if proxy.url().contains('?') { '&' } else { '?' };
        let repo = idempotency_postgres::connect(&format!(
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
