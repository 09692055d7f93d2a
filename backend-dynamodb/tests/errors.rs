//! DynamoDB's error table: each misconfiguration or failure, against the
//! harness's DynamoDB-compatible server, comes back as the error variant (and
//! so the retry class) the guide's table says, with a message naming what to
//! fix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
};
use idempotency_conformance::containers::{self, FaultProxy};
use idempotency_conformance::error_table::{
    assert_error_table, foreign_service, reserve_once, ErrorRow, Expected,
};
use idempotency_dynamodb::DynamoDbRepository;

/// A URL on the shared server's endpoint (or `endpoint`), without creating
/// the table unless `query` says so.
async fn url(table: &str, endpoint: Option<&str>, query: &str) -> String {
    let server = common::server().await;
    let endpoint = endpoint.unwrap_or(server.endpoint()).trim_end_matches('/');
    format!(
        "dynamodb://{table}?region={}&endpoint={endpoint}{query}",
        server.region()
    )
}

async fn url_rows() -> Vec<ErrorRow> {
    let table = common::TABLE;
    let mut rows = vec![
        ErrorRow::new(
            "unknown URL option (`?tabel=x`)",
            idempotency_dynamodb::connect(&url(table, None, "&tabel=x").await).await,
            Expected::Config,
            &["unknown option `tabel`"],
        ),
        ErrorRow::new(
            "zero timeout (`?timeout=0s`)",
            idempotency_dynamodb::connect(&url(table, None, "&timeout=0s").await).await,
            Expected::Config,
            &["timeout=0s"],
        ),
    ];
    if !cfg!(feature = "tls") {
        rows.push(ErrorRow::new(
            "AWS (HTTPS) without the `tls` feature",
            idempotency_dynamodb::connect("dynamodb://idempotency?region=eu-west-1").await,
            Expected::Config,
            &["`tls`"],
        ));
    }
    rows
}

/// Operations on a table that does not exist, and on one whose key schema is
/// not this backend's.
async fn table_rows() -> Vec<ErrorRow> {
    let missing = common::unique_table("errors-missing").await;
    let repo = idempotency_dynamodb::connect(&url(&missing, None, "&credentials=dummy").await)
        .await
        .unwrap();
    let missing_row = ErrorRow::new(
        "table that does not exist",
        reserve_once(&repo, "x").await,
        Expected::Config,
        &[&missing, "create_table"],
    );
    let other = common::unique_table("errors-schema").await;
    repo.client()
        .create_table()
        .table_name(&other)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("id")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("id")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await
        .unwrap();
    let wrong = DynamoDbRepository::from_client(repo.client().clone(), other.clone());
    let schema_row = ErrorRow::new(
        "table with another partition key",
        reserve_once(&wrong, "x").await,
        Expected::Config,
        &[&other, "partition key `pk`"],
    );
    vec![missing_row, schema_row]
}

/// The SDK's default credential chain finding nothing (no variables, no
/// profile, no instance metadata).
async fn no_credentials_row() -> ErrorRow {
    let repo =
        idempotency_dynamodb::connect(&url(common::TABLE, None, "&credentials=default").await)
            .await
            .unwrap();
    ErrorRow::new(
        "no AWS credentials anywhere (`credentials=default`)",
        reserve_once(&repo, "x").await,
        Expected::Config,
        &["no AWS credentials"],
    )
}

/// No endpoint listening: refused at once (within the default timeout).
async fn refused_row() -> ErrorRow {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let repo = idempotency_dynamodb::connect(&url("t_refused", Some(&endpoint), "").await)
        .await
        .unwrap();
    ErrorRow::new(
        "nothing listening at the endpoint",
        reserve_once(&repo, "x").await,
        Expected::Outage,
        &["dynamodb"],
    )
}

/// Another service (HTTP, but not DynamoDB) at the endpoint.
async fn foreign_row() -> ErrorRow {
    let endpoint = format!("http://127.0.0.1:{}", foreign_service().await.unwrap());
    let repo = idempotency_dynamodb::connect(&url("t_foreign", Some(&endpoint), "").await)
        .await
        .unwrap();
    ErrorRow::new(
        "another service at the endpoint",
        reserve_once(&repo, "x").await,
        Expected::Config,
        &["t_foreign", "is it a DynamoDB endpoint"],
    )
}

/// A real Redis server at the endpoint: it closes an HTTP request's
/// connection without a reply. Refused when connecting, not retried as an
/// outage for ever.
async fn not_http_row() -> ErrorRow {
    let redis = containers::redis().await.expect("a Redis server");
    let endpoint = format!("http://{}:{}", redis.host(), redis.port());
    ErrorRow::new(
        "a service that is not HTTP (Redis) at the endpoint",
        idempotency_dynamodb::connect(&url("t_not_http", Some(&endpoint), "").await).await,
        Expected::Config,
        &["not an HTTP server", "without answering"],
    )
}

/// A server that stops answering: the call fails after the default
/// operation timeout, however long the outage lasts.
async fn black_hole_row() -> ErrorRow {
    let server = common::server().await;
    let proxy = FaultProxy::start(server.endpoint())
        .await
        .expect("a fault proxy");
    let repo = idempotency_dynamodb::connect(
        &url(
            common::TABLE,
            Some(proxy.url()),
            "&credentials=dummy&create_table=true",
        )
        .await,
    )
    .await
    .unwrap();
    reserve_once(&repo, "warm").await.unwrap();
    proxy.cut();
    let started = Instant::now();
    let got = reserve_once(&repo, "cut").await;
    let waited = started.elapsed();
    proxy.heal();
    let bound = idempotency_dynamodb::DEFAULT_OPERATION_TIMEOUT + Duration::from_secs(5);
    let cause = if waited <= bound {
        "server stops answering (default operation timeout)".to_owned()
    } else {
        format!("server stops answering: the call waited {waited:?}, over {bound:?}")
    };
    ErrorRow::new(cause, got, Expected::Timeout, &["dynamodb"])
}

#[tokio::test]
async fn every_cause_has_its_error_and_message() {
    let mut rows = url_rows().await;
    rows.extend(table_rows().await);
    let configured = [
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some());
    if !configured {
        rows.push(no_credentials_row().await);
    }
    rows.push(refused_row().await);
    rows.push(foreign_row().await);
    rows.push(not_http_row().await);
    rows.push(black_hole_row().await);
    assert_error_table("dynamodb", &rows);
}
