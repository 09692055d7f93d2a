//! The DynamoDB-compatible server the tests run against, from the workspace's
//! harness: `IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT` if set, else a container
//! (`IDEMPOTENCY_TEST_DYNAMODB_IMAGE`, default `amazon/dynamodb-local`; the
//! baked moto image offline). Without either the tests fail, saying so.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use idempotency_conformance::containers::{self, DynamoDbServer};
use idempotency_dynamodb::DynamoDbRepository;

/// The table the tests share (each check uses its own random namespace).
pub(crate) const TABLE: &str = "idempotency_tests";

/// The shared server of this test binary.
pub(crate) async fn server() -> DynamoDbServer {
    containers::dynamodb()
        .await
        .unwrap_or_else(|e| panic!("a DynamoDB-compatible server for the tests: {e}"))
}

/// The endpoint of the shared server.
pub(crate) async fn endpoint() -> String {
    server().await.endpoint().to_owned()
}

/// The URL of `table` on `server`, with table creation.
pub(crate) fn url_on(server: &DynamoDbServer, table: &str) -> String {
    format!(
        "dynamodb://{table}?region={}&endpoint={}&credentials=dummy&create_table=true",
        server.region(),
        server.endpoint()
    )
}

/// The URL of `table` on the shared server, with table creation.
pub(crate) async fn url(table: &str) -> String {
    url_on(&server().await, table)
}

/// A fresh table name on the shared server.
pub(crate) async fn unique_table(prefix: &str) -> String {
    server().await.unique_table_name(prefix)
}

/// A repository on the shared test table (created on first use).
pub(crate) async fn repository() -> DynamoDbRepository {
    idempotency_dynamodb::connect(&url(TABLE).await)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test DynamoDB server: {e}"))
}

/// Strips the stored item from every refusal of a condition, as a store that
/// does not support `ReturnValuesOnConditionCheckFailure` answers (older
/// emulators).
#[derive(Debug, Default, Clone)]
pub(crate) struct StripRefusedItem {
    pub(crate) stripped: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl aws_sdk_dynamodb::config::Intercept for StripRefusedItem {
    fn name(&self) -> &'static str {
        "StripRefusedItem"
    }

    fn modify_before_deserialization(
        &self,
        context: &mut aws_sdk_dynamodb::config::interceptors::BeforeDeserializationInterceptorContextMut<'_>,
        _runtime_components: &aws_sdk_dynamodb::config::RuntimeComponents,
        _cfg: &mut aws_sdk_dynamodb::config::ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let response = context.response_mut();
        let refused = response
            .headers()
            .get("x-amzn-errortype")
            .is_some_and(|t| t.starts_with("ConditionalCheckFailedException"));
        if refused {
            self.stripped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            response.headers_mut().remove("x-amz-crc32");
            response.headers_mut().remove("content-length");
            *response.body_mut() = aws_smithy_types::body::SdkBody::from(
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#ConditionalCheckFailedException","message":"The conditional request failed"}"#,
            );
        }
        Ok(())
    }
}

/// `repository()` through a client with `interceptor` (which sees, and may
/// change, every request and reply).
pub(crate) async fn repository_through(
    interceptor: impl aws_sdk_dynamodb::config::Intercept + 'static,
) -> DynamoDbRepository {
    let repo = repository().await;
    let client = aws_sdk_dynamodb::Client::from_conf(
        repo.client()
            .config()
            .to_builder()
            .interceptor(interceptor)
            .build(),
    );
    DynamoDbRepository::from_client(client, repo.table_name())
}
