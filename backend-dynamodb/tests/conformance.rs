//! The whole conformance suite against a DynamoDB-compatible server.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;

use idempotency_core::SharedRepository;

async fn repository() -> SharedRepository {
    Arc::new(common::repository().await)
}

idempotency_conformance::conformance_tests!(repository);

/// The errors clause, through a proxy the test can cut: items the repository
/// cannot decode, and a server that stops answering.
mod store_faults {
    use super::*;
    use aws_sdk_dynamodb::types::AttributeValue;
    use idempotency_conformance::containers::FaultProxy;
    use idempotency_conformance::{SharedFaults, StoreFaults};
    use idempotency_core::RecordKey;
    use idempotency_dynamodb::DynamoDbRepository;

    struct Faults {
        direct: DynamoDbRepository,
        proxy: FaultProxy,
    }

    #[async_trait::async_trait]
    impl StoreFaults for Faults {
        /// An item with a status no version of the record format has.
        async fn corrupt(&self, key: &RecordKey) -> Result<(), String> {
            self.direct
                .client()
                .put_item()
                .table_name(self.direct.table_name())
                .item("pk", AttributeValue::S(key.encode()))
                .item("status", AttributeValue::S("exploded".into()))
                .item("expires_at", AttributeValue::N(u64::MAX.to_string()))
                .send()
                .await
                .map(drop)
                .map_err(|e| format!("{e:?}"))
        }

        async fn unreach(&self) -> Result<(), String> {
            self.proxy.cut();
            Ok(())
        }

        async fn reach(&self) -> Result<(), String> {
            self.proxy.heal();
            Ok(())
        }
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
        (Arc::new(repo), Arc::new(Faults { direct, proxy }))
    }

    idempotency_conformance::store_fault_tests!(repository_and_faults);
}
