//! Redis's error table: each misconfiguration or failure, against the
//! harness's server, comes back as the error variant (and so the retry class)
//! the guide's table says, with a message naming what to fix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idempotency_conformance::containers::{self, FaultProxy, RedisServer};
use idempotency_conformance::error_table::{
    assert_error_table, closed_port, foreign_service, reserve_once, ErrorRow, Expected,
};
use idempotency_redis::RedisRepository;

async fn server() -> RedisServer {
    containers::redis()
        .await
        .expect("a Redis server from the harness (see docs/testing.md)")
}

async fn url_rows(server: &RedisServer) -> Vec<ErrorRow> {
    let url = server.url();
    let mut rows = vec![
        ErrorRow::new(
            "unknown URL option (`?tabel=x`)",
            RedisRepository::connect(&format!("{url}?tabel=x")).await,
            Expected::Config,
            &["unknown Redis URL option `tabel`"],
        ),
        ErrorRow::new(
            "zero timeout (`?response_timeout=0s`)",
            RedisRepository::connect(&format!("{url}?response_timeout=0s")).await,
            Expected::Config,
            &["response_timeout=0s"],
        ),
        ErrorRow::new(
            "zero timeout (`?connect_timeout=0ms`)",
            RedisRepository::connect(&format!("{url}?connect_timeout=0ms")).await,
            Expected::Config,
            &["connect_timeout=0ms"],
        ),
    ];
    let mut zero = idempotency_redis::RedisOptions::default();
    zero.response_timeout = Duration::ZERO;
    rows.push(ErrorRow::new(
        "zero timeout in `RedisOptions`",
        RedisRepository::connect_with(url, zero).await,
        Expected::Config,
        &["response_timeout"],
    ));
    if !cfg!(feature = "cluster") {
        rows.push(ErrorRow::new(
            "`redis+cluster://` without the `cluster` feature",
            RedisRepository::connect("redis+cluster://127.0.0.1:1").await,
            Expected::Config,
            &["`cluster`"],
        ));
    }
    if !cfg!(feature = "tls") {
        rows.push(ErrorRow::new(
            "`rediss://` without the `tls` feature",
            RedisRepository::connect("rediss://127.0.0.1:1").await,
            Expected::Config,
            &["`tls`"],
        ));
    }
    rows
}

/// A user whose password the URL gets wrong.
async fn wrong_password_row(server: &RedisServer) -> ErrorRow {
    let user = containers::unique_namespace("errors-user").replace(':', "_");
    server
        .command(&[
            "ACL",
            "SETUSER",
            &user,
            "on",
            ">right-password",
            "~*",
            "+@all",
        ])
        .await
        .unwrap();
    let got = RedisRepository::connect(&format!(
        "redis://{user}:wrong-password@{}:{}",
        server.host(),
        server.port()
    ))
    .await;
    server.command(&["ACL", "DELUSER", &user]).await.unwrap();
    ErrorRow::new("wrong password", got, Expected::Config, &["credentials"])
}

/// Where nothing, or something that is not Redis, listens.
async fn wrong_port_rows() -> Vec<ErrorRow> {
    let started = Instant::now();
    let refused = RedisRepository::connect(&format!(
        "redis://127.0.0.1:{}?connect_timeout=500ms&reconnect_retries=1",
        closed_port()
    ))
    .await;
    let cause = match started.elapsed() {
        waited if waited < Duration::from_secs(20) => "closed port".to_owned(),
        waited => format!("closed port (waited {waited:?})"),
    };
    let http = RedisRepository::connect(&format!(
        "redis://127.0.0.1:{}?connect_timeout=2s",
        foreign_service().await.unwrap()
    ))
    .await;
    // A real PostgreSQL server: it closes the connection without a reply
    // when the first bytes are not a startup packet.
    let postgres = containers::postgres().await.expect("a PostgreSQL server");
    let silent = RedisRepository::connect(&format!(
        "redis://{}:{}?connect_timeout=2s",
        postgres.host(),
        postgres.port()
    ))
    .await;
    vec![
        ErrorRow::new(cause, refused, Expected::Unavailable, &["redis"]),
        ErrorRow::new(
            "a port where another service (HTTP) listens",
            http,
            Expected::Config,
            &["not as a Redis server"],
        ),
        ErrorRow::new(
            "a port where a service that closes silently (PostgreSQL) listens",
            silent,
            Expected::Config,
            &["not a Redis server", "without answering"],
        ),
    ]
}

/// A server that stops answering: the call fails after the default response
/// timeout, however long the outage lasts.
async fn black_hole_row(server: &RedisServer) -> ErrorRow {
    let proxy = FaultProxy::start(server.url())
        .await
        .expect("a fault proxy");
    let repo = RedisRepository::connect(proxy.url()).await.unwrap();
    reserve_once(&repo, "warm").await.unwrap();
    proxy.cut();
    let started = Instant::now();
    let got = reserve_once(&repo, "cut").await;
    let waited = started.elapsed();
    proxy.heal();
    let bound = idempotency_redis::DEFAULT_RESPONSE_TIMEOUT + Duration::from_secs(5);
    let cause = if waited <= bound {
        "server stops answering (default response timeout)".to_owned()
    } else {
        format!("server stops answering: the call waited {waited:?}, over {bound:?}")
    };
    ErrorRow::new(cause, got, Expected::Timeout, &["redis"])
}

#[tokio::test]
async fn every_cause_has_its_error_and_message() {
    let server = server().await;
    let mut rows = url_rows(&server).await;
    rows.push(wrong_password_row(&server).await);
    rows.extend(wrong_port_rows().await);
    rows.push(black_hole_row(&server).await);
    assert_error_table("redis", &rows);
}
