//! The whole conformance suite against a DynamoDB-compatible server.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;

use idempotency_core::SharedRepository;

/// The suite checks what the store answers, not how fast: the emulator is one
/// Python process that, on a machine busy with the other test binaries, can
/// take longer than the default 5 s operation timeout to answer the suite's
/// concurrent checks. The timeout itself is checked by `store_faults` below.
const SUITE_TIMEOUT: &str = "30s";

async fn repository() -> SharedRepository {
    let url = format!("{}&timeout={SUITE_TIMEOUT}", common::url(common::TABLE).await);
    let repo = idempotency_dynamodb::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test DynamoDB server: {e}"));
    Arc::new(repo)
}

idempotency_conformance::conformance_tests!(repository);

/// The errors clause, through a proxy the test can cut: items the repository
/// cannot decode, and a server that stops answering.
mod store_faults {
    use super::*;
    use aws_sdk_dynamodb::types::AttributeValue;
    use idempotency_conformance::containers::{FaultProxy, ProxyFaults};
    use idempotency_conformance::SharedFaults;
    use idempotency_core::RecordKey;
    use idempotency_dynamodb::DynamoDbRepository;

    /// An item with a status no version of the record format has.
    async fn corrupt(direct: DynamoDbRepository, key: RecordKey) -> Result<(), String> {
        direct
            .client()
            .put_item()
            .table_name(direct.table_name())
            .item("pk", AttributeValue::S(key.encode()))
            .item("status", AttributeValue::S("exploded".into()))
            .item("expires_at", AttributeValue::N(u64::MAX.to_string()))
            .send()
            .await
            .map(drop)
            .map_err(|e| format!("{e:?}"))
    }

    async fn repository_and_faults() -> (SharedRepository, SharedFaults) {
        let direct = common::repository().await;
        let server = common::server().await;
        let proxy = FaultProxy::start(server.endpoint())
            .await
            .expect("a fault proxy");
        let repo = idempotency_dynamodb::connect(&format!(
            "dynamodb://{}?region={}&endpoint={}&credentials=dummy&timeout=2s",
            common::TABLE,
            server.region(),
            proxy.url().trim_end_matches('/')
        ))
        .await
        .expect("connect through the fault proxy");
        let faults = ProxyFaults::new(proxy, move |key| corrupt(direct.clone(), key));
        (Arc::new(repo), Arc::new(faults))
    }

    idempotency_conformance::store_fault_tests!(repository_and_faults);
}
