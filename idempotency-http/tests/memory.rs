//! The layer in an in-process axum app over the in-memory store: every shared
//! scenario, plus what only a fake or a tuned store can show (outages, store
//! limits, caching off).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use common::{post, Options, TestApp};
use idempotency_core::{
    async_trait, Capabilities, Config, Error, MemoryRepository, OutagePolicy, OwnerToken, Record,
    RecordKey, Repository, Reservation, ReserveRequest, SharedRepository, Timestamp,
};

async fn repository() -> SharedRepository {
    Arc::new(MemoryRepository::new())
}

common::http_scenarios!(repository);

/// A store that is always down.
#[derive(Debug)]
struct Down;

fn down() -> Error {
    Error::Unavailable {
        backend: "down",
        message: "connection refused".into(),
        source: None,
    }
}

#[async_trait]
impl Repository for Down {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("down")
    }
    async fn reserve(&self, _: ReserveRequest<'_>) -> Result<Reservation, Error> {
        Err(down())
    }
    async fn complete(
        &self,
        _: &RecordKey,
        _: OwnerToken,
        _: Option<&[u8]>,
        _: Timestamp,
        _: Timestamp,
    ) -> Result<(), Error> {
        Err(down())
    }
    async fn fail(
        &self,
        _: &RecordKey,
        _: OwnerToken,
        _: Option<&[u8]>,
        _: bool,
        _: Timestamp,
        _: Timestamp,
    ) -> Result<(), Error> {
        Err(down())
    }
    async fn release(&self, _: &RecordKey, _: OwnerToken, _: Timestamp) -> Result<(), Error> {
        Err(down())
    }
    async fn extend(
        &self,
        _: &RecordKey,
        _: OwnerToken,
        _: Timestamp,
        _: Timestamp,
        _: Timestamp,
    ) -> Result<(), Error> {
        Err(down())
    }
    async fn get(&self, _: &RecordKey, _: Timestamp) -> Result<Option<Record>, Error> {
        Err(down())
    }
    async fn delete(&self, _: &RecordKey) -> Result<bool, Error> {
        Err(down())
    }
    async fn purge_expired(&self, _: Timestamp, _: usize) -> Result<usize, Error> {
        Err(down())
    }
}

/// Fail-closed (the default): `503` with `Retry-After`, the handler does not
/// run; unprotected routes are unaffected.
#[tokio::test]
async fn store_outage_fails_closed_with_503() {
    let app = TestApp::new(Arc::new(Down));
    let reply = app.send(post("/orders", Some("k"), "a")).await;
    reply.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(app.runs("orders"), 0);
    let webhook = app.send(post("/webhooks", Some("k"), "")).await;
    assert_eq!(webhook.status, StatusCode::OK);
}

/// Fail-open: the handler runs unprotected, every time.
#[tokio::test]
async fn store_outage_fails_open_when_configured() {
    let app = TestApp::with(
        Arc::new(Down),
        Options {
            config: Config {
                on_store_outage: OutagePolicy::FailOpen,
                ..Config::default()
            },
            ..Options::default()
        },
    );
    for n in 1..=2 {
        let reply = app.send(post("/orders", Some("k"), "a")).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        assert_eq!(reply.headers["x-order"], n.to_string());
    }
    assert_eq!(app.runs("orders"), 2);
}

/// The store's own limit caps the cached body below the layer's cap: the
/// response passes through and is not retained, the handler runs once.
#[tokio::test]
async fn store_limit_caps_the_cached_body() {
    let repo = Arc::new(MemoryRepository::new().with_max_result_bytes(4 * 1024));
    let app = TestApp::new(repo);
    let uri = "/big?size=8192";
    let first = app.send(post(uri, Some("k"), "")).await;
    assert_eq!(first.body.len(), 8192);
    app.send(post(uri, Some("k"), ""))
        .await
        .assert_problem(StatusCode::GONE, "response-not-retained");
    // Small responses still fit.
    let small = "/big?size=1000";
    assert!(!app.send(post(small, Some("s"), "")).await.replayed());
    assert!(app.send(post(small, Some("s"), "")).await.replayed());
    assert_eq!(app.runs("big"), 2);
}

/// With the manager's result caching off nothing can be replayed: duplicates
/// are refused (`410 response-not-retained`), never run twice.
#[tokio::test]
async fn caching_off_refuses_duplicates_without_running_them() {
    let app = TestApp::with(
        Arc::new(MemoryRepository::new()),
        Options {
            config: Config {
                cache_results: false,
                ..Config::default()
            },
            ..Options::default()
        },
    );
    assert_eq!(
        app.send(post("/orders", Some("k"), "a")).await.status,
        StatusCode::CREATED
    );
    let retry = app.send(post("/orders", Some("k"), "a")).await;
    let problem = retry.assert_problem(StatusCode::GONE, "response-not-retained");
    // Nothing at all is stored, not even the status.
    assert!(problem.get("original_status").is_none(), "{problem}");
    assert_eq!(app.runs("orders"), 1);
}

/// Without a route extractor the default decides the scope: axum's
/// `MatchedPath` with the `axum` feature, the path without it.
#[tokio::test]
async fn default_route_extractor() {
    let app = TestApp::with(
        Arc::new(MemoryRepository::new()),
        Options {
            explicit_route_extractor: false,
            ..Options::default()
        },
    );
    assert_eq!(
        app.send(post("/orders/1/items", Some("k"), ""))
            .await
            .status,
        StatusCode::CREATED
    );
    let other = app.send(post("/orders/2/items", Some("k"), "")).await;
    if cfg!(feature = "axum") {
        // One scope (`/orders/{id}/items`), another path: a reused key.
        other.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
        assert_eq!(app.runs("items"), 1);
    } else {
        // Two scopes (`/orders/1/items`, `/orders/2/items`).
        assert_eq!(other.status, StatusCode::CREATED);
        assert_eq!(app.runs("items"), 2);
    }
}

/// An app with the layer's defaults: no caller identity configured.
fn default_app(
    layer: idempotency_http::IdempotencyLayer,
) -> (axum::Router, Arc<std::sync::atomic::AtomicUsize>) {
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = runs.clone();
    let router = axum::Router::new()
        .route(
            "/orders",
            axum::routing::post(move || {
                let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                async move { (StatusCode::CREATED, format!("order {n}")) }
            }),
        )
        .layer(layer);
    (router, runs)
}

fn order(authorization: Option<&str>) -> axum::http::Request<axum::body::Body> {
    let mut request = post("/orders", Some("same-key"), "same body");
    if let Some(credentials) = authorization {
        request.headers_mut().insert(
            axum::http::header::AUTHORIZATION,
            credentials.parse().unwrap(),
        );
    }
    request
}

fn layer() -> idempotency_http::IdempotencyLayer {
    let manager = idempotency_core::IdempotencyManager::new(
        Arc::new(MemoryRepository::new()),
        Config::default(),
    )
    .unwrap();
    idempotency_http::IdempotencyLayer::new(manager)
}

/// By default, callers with other credentials never share a key space: the
/// second client's order runs, and it never sees the first's response.
#[tokio::test]
async fn callers_are_told_apart_by_their_credentials_by_default() {
    let (router, runs) = default_app(layer());
    let alice = common::send(&router, order(Some("Bearer alice"))).await;
    let bob = common::send(&router, order(Some("Bearer bob"))).await;
    assert!(!bob.replayed(), "bob got alice's stored response");
    assert_eq!(
        (alice.text(), bob.text()),
        ("order 1".into(), "order 2".into())
    );
    assert!(common::send(&router, order(Some("Bearer alice")))
        .await
        .replayed());
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// Without a caller identity (an explicit choice), every client shares one
/// key space.
#[tokio::test]
async fn without_caller_identity_clients_share_keys() {
    let (router, runs) = default_app(layer().without_caller_identity());
    common::send(&router, order(Some("Bearer alice"))).await;
    let bob = common::send(&router, order(Some("Bearer bob"))).await;
    assert!(bob.replayed());
    assert_eq!(bob.text(), "order 1");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// The manager's clock following Tokio's (paused in the test below), so that
/// leases end as Tokio's time passes.
#[derive(Debug)]
struct TokioClock {
    start: tokio::time::Instant,
    at_start: Timestamp,
}

impl idempotency_core::Clock for TokioClock {
    fn now(&self) -> Timestamp {
        self.at_start + self.start.elapsed()
    }
}

/// A response body still coming as the lease ends: waiting on would let a
/// retry take the key over and run the handler again. The layer stops reading
/// a tenth of the processing timeout before the lease ends: the body streams
/// through to its client, the key is kept as not retained, and a retry while
/// the body still comes (or after) gets `410`, never a second run. With lease
/// extension on, the lease moves and the layer reads on: the retry meanwhile
/// is told the key is in progress, and the whole body is stored and replayed.
#[tokio::test(start_paused = true)]
async fn a_response_body_slower_than_the_lease_never_runs_twice() {
    for extension in [None, Some(std::time::Duration::from_secs(5))] {
        let clock = Arc::new(TokioClock {
            start: tokio::time::Instant::now(),
            at_start: Timestamp::from_system_time(std::time::SystemTime::now()),
        });
        let options = Options {
            config: Config {
                processing_timeout: std::time::Duration::from_secs(30),
                lease_extension_interval: extension,
                ..Config::default()
            },
            clock: Some(clock),
            ..Options::default()
        };
        let app = Arc::new(TestApp::with(repository().await, options));
        // The second chunk comes two minutes after the first: four leases.
        let first = {
            let app = app.clone();
            tokio::spawn(async move { app.send(post("/slow-body?secs=120", Some("k"), "")).await })
        };
        // A retry two leases later, while the body still comes. The test's
        // Tokio clock is paused: this sleep takes no real time, the runtime
        // jumps to it once every task is idle.
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        let retry = app.send(post("/slow-body?secs=120", Some("k"), "")).await;
        match extension {
            None => retry.assert_problem(StatusCode::GONE, "response-not-retained"),
            Some(_) => retry.assert_problem(StatusCode::CONFLICT, "in-progress"),
        };
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{extension:?}");
        assert_eq!(first.text(), "run 1: first; last", "the client gets it all");
        let after = app.send(post("/slow-body?secs=120", Some("k"), "")).await;
        match extension {
            None => {
                after.assert_problem(StatusCode::GONE, "response-not-retained");
            }
            Some(_) => {
                assert!(after.replayed(), "kept while the lease was extended");
                assert_eq!(after.text(), "run 1: first; last");
            }
        }
        assert_eq!(
            app.runs("slow-body"),
            1,
            "{extension:?}: never a second run"
        );
    }
}

/// Over a real HTTP/1.1 connection, a response body that fails after the
/// head is not announced with the length of the bytes that came: hyper then
/// cuts the connection at the failure, so the client sees a broken message,
/// not a complete shorter body (a `Content-Length` of the buffered bytes made
/// it look whole, and its retry is refused as not retained, so the client
/// would never have learned).
#[tokio::test]
async fn a_failing_response_body_reaches_the_client_as_truncated() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let app = TestApp::new(repository().await);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let router = app.router.clone();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
    client
        .write_all(
            b"POST /broken-once HTTP/1.1\r\nhost: test\r\nidempotency-key: wire\r\n\
              content-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        client.read_to_end(&mut got),
    )
    .await;
    server.abort();
    let got = String::from_utf8_lossy(&got).to_ascii_lowercase();
    // Cut: the connection closes at the failure (hyper may not have flushed
    // the head yet), and what came is never a complete message.
    assert!(read.is_ok(), "the connection stays open after {got:?}");
    assert!(got.is_empty() || got.starts_with("http/1.1 200"), "{got:?}");
    assert!(
        !got.contains("content-length"),
        "announced as whole: {got:?}"
    );
    assert!(!got.ends_with("0\r\n\r\n"), "chunked to its end: {got:?}");
    assert_eq!(app.runs("broken"), 1);
}
