//! The scenarios every store runs through: an in-process axum app behind the
//! layer, with handlers that count their runs and can be held in flight.
//!
//! Each scenario builds its own app over a fresh namespace of the given
//! repository, so they run in parallel on one shared server. Nothing sleeps
//! to wait for state: handlers are held by a `watch` gate, "the handler
//! started" and "a duplicate saw the key in flight" are signalled through
//! channels and `Notify`.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing;
use axum::Router;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idempotency_conformance::containers::unique_namespace;
use idempotency_core::{
    async_trait, Capabilities, Config, Error, FailurePolicy, IdempotencyManager, InProgressPolicy,
    OwnerToken, Record, RecordKey, Repository, Reservation, ReserveRequest, SharedRepository,
    Status, Timestamp,
};
use idempotency_http::{
    caller_from_header, record_id, IdempotencyLayer, Protection, RequestFingerprint,
};
use tokio::sync::{mpsc, watch, Notify};
use tower::ServiceExt;

/// The cache cap of the test apps.
pub const CAP: usize = 64 * 1024;
/// The request body cap of the test apps.
pub const MAX_REQUEST: usize = 32 * 1024;
/// How long a test waits for an event before failing (never reached when the
/// code is right).
const PATIENCE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// A repository wrapper that reports duplicates seeing a key in flight.

#[derive(Debug)]
pub struct Observed {
    inner: SharedRepository,
    in_flight_seen: AtomicUsize,
    notify: Notify,
}

impl Observed {
    fn new(inner: SharedRepository) -> Self {
        Observed {
            inner,
            in_flight_seen: AtomicUsize::new(0),
            notify: Notify::new(),
        }
    }

    /// Waits until `n` reservations found the key `Processing` under another
    /// owner.
    pub async fn wait_in_flight_seen(&self, n: usize) {
        tokio::time::timeout(PATIENCE, async {
            loop {
                let notified = self.notify.notified();
                if self.in_flight_seen.load(Ordering::SeqCst) >= n {
                    return;
                }
                notified.await;
            }
        })
        .await
        .expect("a duplicate reached the store while the first request was in flight");
    }
}

#[async_trait]
impl Repository for Observed {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let r = self.inner.reserve(request).await;
        if let Ok(Reservation::Existing(record)) = &r {
            if record.status == Status::Processing {
                self.in_flight_seen.fetch_add(1, Ordering::SeqCst);
                self.notify.notify_waiters();
            }
        }
        r
    }
    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner
            .complete(key, owner, result, expires_at, now)
            .await
    }
    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner
            .fail(key, owner, error, retryable, expires_at, now)
            .await
    }
    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner.release(key, owner, now).await
    }
    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner
            .extend(key, owner, lease_until, expires_at, now)
            .await
    }
    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        self.inner.get(key, now).await
    }
    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        self.inner.delete(key).await
    }
    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        self.inner.purge_expired(now, limit).await
    }
}

// ---------------------------------------------------------------------------
// The app.

struct Shared {
    runs: Mutex<HashMap<&'static str, usize>>,
    started: mpsc::UnboundedSender<()>,
    gate: watch::Receiver<bool>,
}

impl Shared {
    fn bump(&self, name: &'static str) -> usize {
        let mut runs = self.runs.lock().unwrap();
        let n = runs.entry(name).or_default();
        *n += 1;
        *n
    }
}

/// What a test app is built with.
pub struct Options {
    pub config: Config,
    pub fingerprint: RequestFingerprint,
    /// Read the route template with an explicit extractor (true) or rely on
    /// the crate's default (the `axum` feature, else the path).
    pub explicit_route_extractor: bool,
    /// The manager's clock (the system's when none).
    pub clock: Option<Arc<dyn idempotency_core::Clock>>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            config: Config::default(),
            fingerprint: RequestFingerprint::default(),
            explicit_route_extractor: true,
            clock: None,
        }
    }
}

pub struct TestApp {
    pub router: Router,
    pub manager: IdempotencyManager,
    pub repo: Arc<Observed>,
    shared: Arc<Shared>,
    started: tokio::sync::Mutex<mpsc::UnboundedReceiver<()>>,
    gate: watch::Sender<bool>,
}

impl TestApp {
    pub fn new(repo: SharedRepository) -> Self {
        Self::with(repo, Options::default())
    }

    pub fn with(repo: SharedRepository, options: Options) -> Self {
        let repo = Arc::new(Observed::new(repo));
        let config = Config {
            key_prefix: unique_namespace("http"),
            ..options.config
        };
        let mut manager = IdempotencyManager::new(repo.clone(), config).unwrap();
        if let Some(clock) = options.clock {
            manager = manager.with_clock(clock);
        }
        let (started_tx, started_rx) = mpsc::unbounded_channel();
        let (gate_tx, gate_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            runs: Mutex::new(HashMap::new()),
            started: started_tx,
            gate: gate_rx,
        });
        let mut layer = IdempotencyLayer::new(manager.clone())
            .caller_identity(caller_from_header("x-api-key".parse().unwrap()))
            .route("/webhooks", Protection::Skip)
            .route("/search", Protection::Optional)
            .fingerprint(options.fingerprint)
            .max_cached_body(CAP)
            .max_request_body(MAX_REQUEST);
        if options.explicit_route_extractor {
            layer = layer.route_extractor(|parts| {
                parts
                    .extensions
                    .get::<MatchedPath>()
                    .map(|m| m.as_str().to_owned())
            });
        }
        let router = Router::new()
            .route(
                "/orders",
                routing::post(orders).patch(orders).get(read_orders),
            )
            .route("/orders/{id}/items", routing::post(items))
            .route("/slow", routing::post(slow))
            .route("/slow-body", routing::post(slow_body))
            .route("/flaky", routing::post(flaky))
            .route("/status/{code}", routing::post(status))
            .route("/big", routing::post(big))
            .route("/trailers", routing::post(trailers))
            .route("/panic-once", routing::post(panic_once))
            .route("/broken-once", routing::post(broken_once))
            .route("/panicking-body", routing::post(panicking_body))
            .route("/stream-echo", routing::post(stream_echo))
            .route("/early-refusal", routing::post(early_refusal))
            .route("/events", routing::post(events))
            .route("/webhooks", routing::post(webhooks))
            .route("/search", routing::post(search))
            .layer(layer)
            .with_state(shared.clone());
        TestApp {
            router,
            manager,
            repo,
            shared,
            started: tokio::sync::Mutex::new(started_rx),
            gate: gate_tx,
        }
    }

    /// How often the handler `name` ran.
    pub fn runs(&self, name: &'static str) -> usize {
        self.shared
            .runs
            .lock()
            .unwrap()
            .get(name)
            .copied()
            .unwrap_or(0)
    }

    /// Waits until a `/slow` handler has started (and is held at the gate).
    pub async fn handler_started(&self) {
        tokio::time::timeout(PATIENCE, self.started.lock().await.recv())
            .await
            .expect("the /slow handler started")
            .expect("the app is alive");
    }

    /// Lets every held and future `/slow` handler finish.
    pub fn open_gate(&self) {
        self.gate.send_replace(true);
    }

    pub async fn send(&self, request: Request<Body>) -> Reply {
        send(&self.router, request).await
    }

    /// The record key a request gets (no caller identity).
    pub fn record_key(&self, method: &Method, route: &str, key: &str) -> RecordKey {
        self.manager
            .record_key(&record_id(None, method, route, key))
            .unwrap()
    }
}

async fn orders(State(s): State<Arc<Shared>>, method: Method, body: String) -> Response {
    let n = s.bump("orders");
    (
        StatusCode::CREATED,
        [
            ("x-order", n.to_string()),
            ("set-cookie", format!("session={n}")),
            ("content-type", "application/json".to_owned()),
        ],
        serde_json::json!({"order": n, "method": method.as_str(), "body": body}).to_string(),
    )
        .into_response()
}

async fn read_orders(State(s): State<Arc<Shared>>) -> Response {
    let n = s.bump("reads");
    (StatusCode::OK, format!("read {n}")).into_response()
}

async fn items(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let n = s.bump("items");
    (StatusCode::CREATED, format!("item {n} for order {id}")).into_response()
}

async fn slow(State(s): State<Arc<Shared>>) -> Response {
    let _ = s.started.send(());
    let mut gate = s.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    let n = s.bump("slow");
    (StatusCode::CREATED, format!("slow {n}")).into_response()
}

/// A body whose second chunk comes `secs` (query) after the first.
async fn slow_body(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, u64>>,
) -> Response {
    let n = s.bump("slow-body");
    let pause = Duration::from_secs(q.get("secs").copied().unwrap_or(0));
    let chunks = futures::stream::unfold(0u8, move |step| async move {
        let chunk = match step {
            0 => format!("run {n}: first;"),
            1 => {
                // Only the paused-clock test asks for a pause: no real time.
                tokio::time::sleep(pause).await;
                " last".to_owned()
            }
            _ => return None,
        };
        Some((Ok::<_, Infallible>(Bytes::from(chunk)), step + 1))
    });
    (StatusCode::CREATED, Body::from_stream(chunks)).into_response()
}

async fn flaky(State(s): State<Arc<Shared>>) -> Response {
    let n = s.bump("flaky");
    if n == 1 {
        (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response()
    } else {
        (StatusCode::CREATED, format!("flaky {n}")).into_response()
    }
}

async fn status(State(s): State<Arc<Shared>>, Path(code): Path<u16>) -> Response {
    let n = s.bump("status");
    let status = StatusCode::from_u16(code).unwrap();
    (status, format!("status {code} run {n}")).into_response()
}

/// The bytes `/big?size=N` answers.
pub fn big_body(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i % 251) as u8).collect()
}

async fn big(State(s): State<Arc<Shared>>, Query(q): Query<HashMap<String, usize>>) -> Response {
    s.bump("big");
    let size = q.get("size").copied().unwrap_or(3 * CAP);
    let chunks: Vec<Result<Bytes, Infallible>> = big_body(size)
        .chunks(16 * 1024)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    // A stream: no Content-Length, the layer only learns the size by reading.
    Response::new(Body::from_stream(futures::stream::iter(chunks)))
}

async fn trailers(State(s): State<Arc<Shared>>) -> Response {
    let n = s.bump("trailers");
    let mut t = HeaderMap::new();
    t.insert("x-checksum", HeaderValue::from(n));
    let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
        Ok(Frame::data(Bytes::from(format!("payload {n}")))),
        Ok(Frame::trailers(t)),
    ];
    Response::new(Body::new(StreamBody::new(futures::stream::iter(frames))))
}

async fn panic_once(State(s): State<Arc<Shared>>) -> Response {
    let n = s.bump("panic");
    if n == 1 {
        panic!("the handler panicked on purpose");
    }
    (StatusCode::CREATED, format!("survived {n}")).into_response()
}

/// The first run's body fails after one chunk; later runs succeed.
async fn broken_once(State(s): State<Arc<Shared>>) -> Response {
    let n = s.bump("broken");
    let items: Vec<Result<Bytes, std::io::Error>> = if n == 1 {
        vec![
            Ok(Bytes::from_static(b"partial")),
            Err(std::io::Error::other("the database cursor broke")),
        ]
    } else {
        vec![Ok(Bytes::from(format!("whole {n}")))]
    };
    Response::new(Body::from_stream(futures::stream::iter(items)))
}

/// A body that panics after one chunk (an encoder's bug): the handler ran.
async fn panicking_body(State(s): State<Arc<Shared>>) -> Response {
    s.bump("panicking");
    let chunks = futures::StreamExt::map(futures::stream::iter(0..2), |i| {
        assert!(i == 0, "the body's encoder panicked");
        Ok::<_, std::io::Error>(Bytes::from_static(b"partial"))
    });
    Response::new(Body::from_stream(chunks))
}

/// Answers `200` at once and streams the request body back as it arrives (a
/// proxy, an upload handler): a request body that fails fails the response's.
async fn stream_echo(State(s): State<Arc<Shared>>, request: Request<Body>) -> Response {
    s.bump("echo");
    Response::new(Body::from_stream(request.into_body().into_data_stream()))
}

/// A `400` sent before the upload is read, its body ending once the upload
/// has (whole or cut): a validating proxy that answers early.
async fn early_refusal(State(s): State<Arc<Shared>>, request: Request<Body>) -> Response {
    s.bump("early");
    let mut upload = request.into_body().into_data_stream();
    let verdict = futures::stream::once(async move {
        while let Some(Ok(_)) = futures::StreamExt::next(&mut upload).await {}
        Ok::<_, Infallible>(Bytes::from_static(b"invalid upload"))
    });
    (StatusCode::BAD_REQUEST, Body::from_stream(verdict)).into_response()
}

/// A server-sent event stream that sends one event, then keeps the
/// connection open (a heartbeat that never ends, for the test's purpose).
async fn events(State(s): State<Arc<Shared>>) -> Response {
    s.bump("events");
    let first =
        futures::stream::once(async { Ok::<_, Infallible>(Bytes::from_static(b"data: 1\n\n")) });
    let stream = futures::StreamExt::chain(first, futures::stream::pending());
    (
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            "text/event-stream; charset=utf-8",
        )],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn webhooks(State(s): State<Arc<Shared>>) -> Response {
    let n = s.bump("webhooks");
    (StatusCode::OK, format!("webhook {n}")).into_response()
}

async fn search(State(s): State<Arc<Shared>>) -> Response {
    let n = s.bump("search");
    (StatusCode::OK, format!("search {n}")).into_response()
}

// ---------------------------------------------------------------------------
// Requests and replies.

/// An upload whose first bytes are `first`, then cut short by the transport
/// (`why`: a connection reset).
pub fn cut_upload(first: &'static [u8], why: &str) -> Body {
    let error = std::io::Error::new(std::io::ErrorKind::ConnectionReset, why.to_owned());
    Body::from_stream(futures::stream::iter([
        Ok(Bytes::from_static(first)),
        Err(error),
    ]))
}

pub fn request(
    method: Method,
    uri: &str,
    key: Option<&str>,
    body: impl Into<Body>,
) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(uri);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(body.into()).unwrap()
}

pub fn post(uri: &str, key: Option<&str>, body: &str) -> Request<Body> {
    request(Method::POST, uri, key, body.to_owned())
}

pub fn post_as(caller: &str, uri: &str, key: &str, body: &str) -> Request<Body> {
    let mut r = post(uri, Some(key), body);
    r.headers_mut()
        .insert("x-api-key", HeaderValue::from_str(caller).unwrap());
    r
}

#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Reply {
    pub fn replayed(&self) -> bool {
        match self.headers.get("idempotency-replayed") {
            None => false,
            Some(v) => {
                assert_eq!(v, "true");
                true
            }
        }
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.body.to_vec()).unwrap()
    }

    /// The problem+json body, checked for the RFC 9457 members.
    pub fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{self:?}"
        );
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        assert!(
            json["title"].as_str().is_some_and(|t| !t.is_empty()),
            "{json}"
        );
        assert!(
            json["detail"].as_str().is_some_and(|t| !t.is_empty()),
            "{json}"
        );
        assert!(json["type"].as_str().is_some(), "{json}");
        json
    }

    /// Asserts a problem of this status and slug.
    pub fn assert_problem(&self, status: StatusCode, slug: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "{self:?}");
        let json = self.problem();
        let ty = json["type"].as_str().unwrap();
        assert!(ty.ends_with(&format!("#{slug}")), "type {ty} is not {slug}");
        json
    }
}

pub async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

// ---------------------------------------------------------------------------
// The scenarios.

/// The first request runs the handler; a retry replays status, selected
/// headers and body, marked `Idempotency-Replayed: true`, without running it.
pub async fn first_request_runs_then_retry_replays(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let first = app.send(post("/orders", Some("k-1"), "two books")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.headers["x-order"], "1");
    assert_eq!(first.headers["set-cookie"], "session=1");
    let body: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"order": 1, "method": "POST", "body": "two books"})
    );

    for _ in 0..3 {
        let retry = app.send(post("/orders", Some("k-1"), "two books")).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.headers["x-order"], "1");
        assert_eq!(retry.headers["content-type"], "application/json");
        assert!(
            retry.headers.get("set-cookie").is_none(),
            "Set-Cookie is not replayed by default"
        );
    }
    assert_eq!(app.runs("orders"), 1);

    // Another key is another request.
    let other = app.send(post("/orders", Some("k-2"), "two books")).await;
    assert!(!other.replayed());
    assert_eq!(other.headers["x-order"], "2");
    assert_eq!(app.runs("orders"), 2);
}

/// Duplicates arriving while the first request is held in its handler get
/// `409` with `Retry-After`; once it finishes, the key replays.
pub async fn duplicates_in_flight_get_409(repo: SharedRepository) {
    let app = Arc::new(TestApp::new(repo));
    const N: usize = 16;
    let (tx, mut rx) = mpsc::unbounded_channel();
    for _ in 0..N {
        let app = app.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let reply = app.send(post("/slow", Some("held"), "")).await;
            let _ = tx.send(reply);
        });
    }
    app.handler_started().await;
    // Every request but the one in the handler is answered while it is held.
    for _ in 0..N - 1 {
        let reply = tokio::time::timeout(PATIENCE, rx.recv())
            .await
            .unwrap()
            .unwrap();
        reply.assert_problem(StatusCode::CONFLICT, "in-progress");
        // The smaller of the layer's hint (1 s) and the holder's lease (300 s).
        assert_eq!(reply.headers["retry-after"], "1");
    }
    assert_eq!(app.runs("slow"), 0, "the held handler has not finished");
    app.open_gate();
    let winner = tokio::time::timeout(PATIENCE, rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(winner.status, StatusCode::CREATED);
    assert!(!winner.replayed());
    assert_eq!(winner.text(), "slow 1");
    assert_eq!(app.runs("slow"), 1);

    let after = app.send(post("/slow", Some("held"), "")).await;
    assert!(after.replayed());
    assert_eq!(after.text(), "slow 1");
    assert_eq!(app.runs("slow"), 1);
}

/// Many identical requests released together: the handler runs exactly once;
/// every other request gets `409` or the replay of that one response.
pub async fn racing_duplicates_run_the_handler_once(repo: SharedRepository) {
    let app = Arc::new(TestApp::new(repo));
    const N: usize = 24;
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let app = app.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            app.send(post("/orders", Some("race"), "same")).await
        }));
    }
    let mut fresh = Vec::new();
    let mut replays = 0;
    let mut conflicts = 0;
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            StatusCode::CREATED if reply.replayed() => {
                replays += 1;
                assert_eq!(reply.headers["x-order"], "1");
            }
            StatusCode::CREATED => fresh.push(reply),
            StatusCode::CONFLICT => {
                reply.assert_problem(StatusCode::CONFLICT, "in-progress");
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    assert_eq!(fresh.len(), 1, "exactly one request ran the handler");
    assert_eq!(fresh[0].headers["x-order"], "1");
    assert_eq!(replays + conflicts, N - 1);
    assert_eq!(app.runs("orders"), 1);
}

/// A key reused with another body, or on another resource of the same route,
/// is `422`; the handler does not run.
pub async fn reused_key_with_another_request_is_422(repo: SharedRepository) {
    let app = TestApp::new(repo);
    assert_eq!(
        app.send(post("/orders", Some("k"), "a")).await.status,
        StatusCode::CREATED
    );
    let reused = app.send(post("/orders", Some("k"), "b")).await;
    let problem = reused.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(problem["status"], 422);
    assert!(!reused.replayed());
    assert_eq!(app.runs("orders"), 1);

    // Same route template, other path: the path is part of the fingerprint.
    assert_eq!(
        app.send(post("/orders/1/items", Some("k"), ""))
            .await
            .status,
        StatusCode::CREATED
    );
    app.send(post("/orders/2/items", Some("k"), ""))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(app.runs("items"), 1);

    // The original request still replays.
    let again = app.send(post("/orders", Some("k"), "a")).await;
    assert!(again.replayed());
}

/// No key on a route that requires one: `400`, handler not run.
pub async fn missing_key_is_400(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let reply = app.send(post("/orders", None, "a")).await;
    let problem = reply.assert_problem(StatusCode::BAD_REQUEST, "missing-key");
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("idempotency-key"));
    let patch = app.send(request(Method::PATCH, "/orders", None, "a")).await;
    patch.assert_problem(StatusCode::BAD_REQUEST, "missing-key");
    assert_eq!(app.runs("orders"), 0);
}

/// Empty, too long, non-ASCII, control characters, repeated headers and bad
/// quoting: `400`, handler not run, never a panic. The quoted (Structured
/// Field) and bare forms name the same key.
pub async fn invalid_keys_are_400(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let bad: Vec<HeaderValue> = vec![
        HeaderValue::from_static(""),
        HeaderValue::from_static("\"\""),
        HeaderValue::from_str(&"k".repeat(256)).unwrap(),
        HeaderValue::from_str(&"k".repeat(64 * 1024)).unwrap(),
        HeaderValue::from_static("has space"),
        HeaderValue::from_static("a,b"),
        HeaderValue::from_static("tab\there"),
        HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        HeaderValue::from_bytes(b"\xff\xfe\x80").unwrap(),
        HeaderValue::from_static("\"unterminated"),
        HeaderValue::from_static("\"bad\\escape\""),
        HeaderValue::from_static("\"key\";param=1"),
    ];
    for value in bad {
        let mut r = post("/orders", None, "a");
        r.headers_mut().insert("idempotency-key", value.clone());
        app.send(r)
            .await
            .assert_problem(StatusCode::BAD_REQUEST, "invalid-key");
    }
    let mut repeated = post("/orders", Some("one"), "a");
    repeated
        .headers_mut()
        .append("idempotency-key", HeaderValue::from_static("two"));
    app.send(repeated)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "invalid-key");
    assert_eq!(app.runs("orders"), 0);

    // The longest key allowed works; quoted and bare forms are one key.
    let longest = "k".repeat(255);
    assert_eq!(
        app.send(post("/orders", Some(&longest), "a")).await.status,
        StatusCode::CREATED
    );
    let quoted = app.send(post("/orders", Some("\"q-1\""), "a")).await;
    assert!(!quoted.replayed());
    let bare = app.send(post("/orders", Some("q-1"), "a")).await;
    assert!(bare.replayed());
    assert_eq!(bare.body, quoted.body);
    assert_eq!(app.runs("orders"), 2);
}

/// A streamed response over the cap reaches the first client whole, is not
/// cached, and retries get `410 response-not-retained` (with the original
/// status) instead of a second run. A body exactly at the cap is cached.
pub async fn oversized_response_passes_through_uncached(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let size = 3 * CAP + 123;
    let uri = format!("/big?size={size}");
    let first = app.send(post(&uri, Some("big"), "")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.replayed());
    assert_eq!(first.body.len(), size);
    assert_eq!(first.body.as_ref(), big_body(size).as_slice());

    let retry = app.send(post(&uri, Some("big"), "")).await;
    let problem = retry.assert_problem(StatusCode::GONE, "response-not-retained");
    assert_eq!(problem["original_status"], 200);
    assert!(retry.headers.get("retry-after").is_none());
    assert_eq!(app.runs("big"), 1, "the handler ran once anyway");

    // At the cap: stored and replayed byte for byte.
    let uri = format!("/big?size={CAP}");
    let first = app.send(post(&uri, Some("at-cap"), "")).await;
    assert_eq!(first.body.len(), CAP);
    let retry = app.send(post(&uri, Some("at-cap"), "")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.runs("big"), 2);
}

/// `5xx` (and `429`) are not stored: the retry runs the handler again. `4xx`
/// are stored and replayed.
pub async fn server_errors_are_released_client_errors_stored(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let first = app.send(post("/flaky", Some("f"), "")).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!first.replayed());
    let retry = app.send(post("/flaky", Some("f"), "")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(app.runs("flaky"), 2, "the 503 was released: the retry ran");
    let third = app.send(post("/flaky", Some("f"), "")).await;
    assert!(third.replayed());
    assert_eq!(third.text(), "flaky 2");
    assert_eq!(app.runs("flaky"), 2);

    for _ in 0..2 {
        let limited = app.send(post("/status/429", Some("rate"), "")).await;
        assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(!limited.replayed());
    }
    assert_eq!(app.runs("status"), 2);

    let invalid = app.send(post("/status/400", Some("bad"), "")).await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    let again = app.send(post("/status/400", Some("bad"), "")).await;
    assert_eq!(again.status, StatusCode::BAD_REQUEST);
    assert!(again.replayed());
    assert_eq!(again.body, invalid.body);
    assert_eq!(app.runs("status"), 3);

    // What a fixed request or a changed resource answers differently is not
    // stored: the retry runs.
    for (code, key) in [
        (401, "auth"),
        (403, "forbidden"),
        (404, "missing"),
        (409, "clash"),
    ] {
        for _ in 0..2 {
            let r = app
                .send(post(&format!("/status/{code}"), Some(key), ""))
                .await;
            assert_eq!(r.status.as_u16(), code);
            assert!(!r.replayed(), "{code} was replayed");
        }
    }
    assert_eq!(app.runs("status"), 11);
    let unprocessable = app.send(post("/status/422", Some("invalid"), "")).await;
    assert!(!unprocessable.replayed());
    assert!(app
        .send(post("/status/422", Some("invalid"), ""))
        .await
        .replayed());
    assert_eq!(app.runs("status"), 12);
}

/// Two callers using the same key each get their own run and their own
/// replay; neither can see the other's response.
pub async fn callers_are_isolated(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let alice = app
        .send(post_as("sk_alice", "/orders", "shared-key", "same body"))
        .await;
    let bob = app
        .send(post_as("sk_bob", "/orders", "shared-key", "same body"))
        .await;
    assert!(!alice.replayed());
    assert!(!bob.replayed(), "bob's request is not a replay of alice's");
    assert_eq!(alice.headers["x-order"], "1");
    assert_eq!(bob.headers["x-order"], "2");
    // A third caller with another body: no 422, its own scope.
    let carol = app
        .send(post_as("sk_carol", "/orders", "shared-key", "other body"))
        .await;
    assert_eq!(carol.status, StatusCode::CREATED);
    assert!(!carol.replayed());
    // Anonymous callers form their own scope too.
    let anonymous = app
        .send(post("/orders", Some("shared-key"), "same body"))
        .await;
    assert!(!anonymous.replayed());
    assert_eq!(app.runs("orders"), 4);

    let alice_again = app
        .send(post_as("sk_alice", "/orders", "shared-key", "same body"))
        .await;
    let bob_again = app
        .send(post_as("sk_bob", "/orders", "shared-key", "same body"))
        .await;
    assert!(alice_again.replayed() && bob_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(bob_again.body, bob.body);
    assert_eq!(app.runs("orders"), 4);
}

/// Method and route template are part of the scope: the same key on POST and
/// PATCH, or on two routes, names different requests.
pub async fn scope_includes_method_and_route(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let post_reply = app.send(post("/orders", Some("k"), "x")).await;
    let patch_reply = app
        .send(request(Method::PATCH, "/orders", Some("k"), "x"))
        .await;
    let items_reply = app.send(post("/orders/7/items", Some("k"), "")).await;
    assert!(!post_reply.replayed() && !patch_reply.replayed() && !items_reply.replayed());
    assert_eq!(app.runs("orders"), 2);
    assert_eq!(app.runs("items"), 1);
    let patch_again = app
        .send(request(Method::PATCH, "/orders", Some("k"), "x"))
        .await;
    assert!(patch_again.replayed());
    let body: serde_json::Value = serde_json::from_slice(&patch_again.body).unwrap();
    assert_eq!(body["method"], "PATCH");
}

/// `Protection::Skip` routes pass through untouched; `Protection::Optional`
/// routes protect requests with a key and pass the others through.
pub async fn opt_out_and_optional_routes(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let no_key = app.send(post("/webhooks", None, "")).await;
    assert_eq!(no_key.status, StatusCode::OK);
    for _ in 0..2 {
        let with_key = app.send(post("/webhooks", Some("w"), "")).await;
        assert_eq!(with_key.status, StatusCode::OK);
        assert!(!with_key.replayed());
    }
    assert_eq!(app.runs("webhooks"), 3);

    for _ in 0..2 {
        let unkeyed = app.send(post("/search", None, "")).await;
        assert_eq!(unkeyed.status, StatusCode::OK);
        assert!(!unkeyed.replayed());
    }
    assert_eq!(app.runs("search"), 2);
    let keyed = app.send(post("/search", Some("s"), "")).await;
    let keyed_again = app.send(post("/search", Some("s"), "")).await;
    assert!(!keyed.replayed());
    assert!(keyed_again.replayed());
    assert_eq!(keyed_again.body, keyed.body);
    assert_eq!(app.runs("search"), 3);
}

/// GET is not a protected method: with or without a key, every request runs.
pub async fn get_passes_through_untouched(repo: SharedRepository) {
    let app = TestApp::new(repo);
    for key in [None, Some("g"), Some("g"), Some("bad key with spaces")] {
        let reply = app
            .send(request(Method::GET, "/orders", key, Body::empty()))
            .await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(!reply.replayed());
    }
    assert_eq!(app.runs("reads"), 4);
}

/// A client that disconnects while the handler runs (the response future is
/// dropped) does not undo the protection: the handler runs to completion, its
/// response is stored, and the client's retry gets it — the handler ran once.
pub async fn dropped_request_still_completes_and_replays(repo: SharedRepository) {
    let app = Arc::new(TestApp::new(repo));
    let held = {
        let app = app.clone();
        tokio::spawn(async move { app.send(post("/slow", Some("gone"), "")).await })
    };
    app.handler_started().await;
    held.abort();
    assert!(held.await.unwrap_err().is_cancelled());
    // While the detached handler still runs, a retry is told it is in flight.
    let early = app.send(post("/slow", Some("gone"), "")).await;
    assert_eq!(early.status, StatusCode::CONFLICT);
    app.open_gate();
    // The detached handler finishes in the background: retry until answered.
    let reply = tokio::time::timeout(PATIENCE, async {
        loop {
            let reply = app.send(post("/slow", Some("gone"), "")).await;
            if reply.status != StatusCode::CONFLICT {
                return reply;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the dropped request's handler finished");
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(reply.replayed(), "the retry gets the stored response");
    assert_eq!(app.runs("slow"), 1, "the handler ran once");
}

/// A handler that panics releases the key, like a `500`, whatever the
/// manager's failure policy (one that stores failures would otherwise answer
/// every retry with the panic's record); the retry runs it again.
pub async fn panicking_handler_releases_the_key(repo: SharedRepository) {
    for failure_policy in [
        FailurePolicy::Release,
        FailurePolicy::Store,
        FailurePolicy::StoreAndRetry,
    ] {
        let options = Options {
            config: Config {
                failure_policy,
                ..Config::default()
            },
            ..Options::default()
        };
        let app = Arc::new(TestApp::with(repo.clone(), options));
        let first = {
            let app = app.clone();
            tokio::spawn(async move { app.send(post("/panic-once", Some("p"), "")).await })
        };
        assert!(first.await.unwrap_err().is_panic(), "{failure_policy:?}");
        let retry = app.send(post("/panic-once", Some("p"), "")).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{failure_policy:?}");
        assert_eq!(retry.text(), "survived 2");
        assert_eq!(app.runs("panic"), 2);
        assert!(app
            .send(post("/panic-once", Some("p"), ""))
            .await
            .replayed());
    }
}

/// An upload cut short while the fingerprint reads it: `400 unreadable-body`
/// without running the handler or holding the key, and without the
/// transport's own words; the client's full retry runs.
pub async fn cut_upload_read_for_the_fingerprint_is_400(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let cut = cut_upload(b"{\"amount\":", "peer 10.1.2.3 went away");
    let first = app
        .send(request(Method::POST, "/orders", Some("cut-read"), cut))
        .await;
    let problem = first.assert_problem(StatusCode::BAD_REQUEST, "unreadable-body");
    assert!(
        !problem["detail"].as_str().unwrap().contains("10.1.2.3"),
        "{problem}"
    );
    assert_eq!(app.runs("orders"), 0);
    let retry = app
        .send(post("/orders", Some("cut-read"), "{\"amount\":1}"))
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(app.runs("orders"), 1);
}

/// An upload cut short, with a fingerprint that does not read the body (as
/// for large uploads): the inner service answers the failed body with a `400`
/// (axum: "failed to buffer the request body"), which answers the broken
/// transport, not the request. It is not stored: the client's full retry runs.
pub async fn cut_upload_is_not_stored(repo: SharedRepository) {
    let options = Options {
        fingerprint: RequestFingerprint::MethodPath,
        ..Options::default()
    };
    let app = TestApp::with(repo, options);
    let cut = cut_upload(b"{\"amount\":", "client went away");
    let first = app
        .send(request(Method::POST, "/orders", Some("cut"), cut))
        .await;
    assert_eq!(first.status, StatusCode::BAD_REQUEST);
    assert_eq!(app.runs("orders"), 0, "the handler never got a body");
    let retry = app
        .send(post("/orders", Some("cut"), "{\"amount\":1}"))
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed(), "the full retry ran");
    assert_eq!(app.runs("orders"), 1);
    let again = app
        .send(post("/orders", Some("cut"), "{\"amount\":1}"))
        .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(app.runs("orders"), 1);
    // A 400 to a whole body is the request's answer, and is stored.
    let invalid = app.send(post("/status/400", Some("whole"), "")).await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    let again = app.send(post("/status/400", Some("whole"), "")).await;
    assert!(again.replayed());
    assert_eq!(app.runs("status"), 1);
}

/// A response body that fails while the layer reads it, after a head that
/// says the handler ran: the client sees the failure after the bytes that
/// came, and the key is kept as not retained, so its retry is refused with
/// the original status instead of running the handler a second time.
pub async fn failing_response_body_is_kept_not_retained(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let response = app
        .router
        .clone()
        .oneshot(post("/broken-once", Some("b"), ""))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().get("idempotency-replayed").is_none());
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "partial");
    let error = body.frame().await.unwrap().unwrap_err();
    assert!(error.to_string().contains("cursor broke"), "{error}");

    refused_as_not_retained(&app, "/broken-once", "b", "broken").await;
}

/// Retries of `path` under `key` are refused as `response-not-retained` with
/// the original `200`, and the handler (counted as `runs`) ran once.
async fn refused_as_not_retained(app: &TestApp, path: &str, key: &str, runs: &'static str) {
    for _ in 0..2 {
        let retry = app.send(post(path, Some(key), "")).await;
        let problem = retry.assert_problem(StatusCode::GONE, "response-not-retained");
        assert_eq!(problem["original_status"], 200);
        assert_eq!(app.runs(runs), 1, "the handler is not run again");
    }
}

/// A response body that panics while the layer reads it is handled as one
/// that fails: the handler ran, so the key is kept as not retained and the
/// retry is refused, never run again (a released key would charge twice).
pub async fn panicking_response_body_is_kept_not_retained(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let response = app
        .router
        .clone()
        .oneshot(post("/panicking-body", Some("p"), ""))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let error = response.into_body().collect().await.unwrap_err();
    assert!(error.to_string().contains("panicked"), "{error}");
    refused_as_not_retained(&app, "/panicking-body", "p", "panicking").await;
}

/// A response body that fails because the request body it streams from was
/// cut short (an upload the handler proxies): the request never arrived
/// whole, so the key is released and the client's full retry runs.
pub async fn response_failing_with_a_cut_upload_is_released(repo: SharedRepository) {
    let options = Options {
        fingerprint: RequestFingerprint::MethodPath,
        ..Options::default()
    };
    let app = TestApp::with(repo, options);
    let cut = cut_upload(b"first half", "client went away");
    let response = app
        .router
        .clone()
        .oneshot(request(Method::POST, "/stream-echo", Some("up"), cut))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let collected = response.into_body().collect().await;
    assert!(collected.is_err(), "the client sees the echo fail");
    assert_eq!(app.runs("echo"), 1);

    let retry = app.send(post("/stream-echo", Some("up"), "whole")).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(!retry.replayed(), "the full retry ran");
    assert_eq!(retry.text(), "whole");
    assert_eq!(app.runs("echo"), 2);
    let again = app.send(post("/stream-echo", Some("up"), "whole")).await;
    assert!(again.replayed());
    assert_eq!(again.text(), "whole");
    assert_eq!(app.runs("echo"), 2);
}

/// A `400` whose head came before the upload was cut, its body after: it
/// answers the broken transport, not the request, so it is not stored and
/// the client's full retry runs.
pub async fn early_refusal_of_a_cut_upload_is_not_stored(repo: SharedRepository) {
    let options = Options {
        fingerprint: RequestFingerprint::MethodPath,
        ..Options::default()
    };
    let app = TestApp::with(repo, options);
    let cut = cut_upload(b"first half", "client went away");
    let first = app
        .send(request(Method::POST, "/early-refusal", Some("early"), cut))
        .await;
    assert_eq!(first.status, StatusCode::BAD_REQUEST);
    assert_eq!(app.runs("early"), 1);
    let retry = app
        .send(post("/early-refusal", Some("early"), "whole"))
        .await;
    assert_eq!(retry.status, StatusCode::BAD_REQUEST);
    assert!(!retry.replayed(), "the full retry ran");
    assert_eq!(app.runs("early"), 2);
    let again = app
        .send(post("/early-refusal", Some("early"), "whole"))
        .await;
    assert!(again.replayed(), "a 400 to a whole upload is stored");
    assert_eq!(app.runs("early"), 2);
}

/// A server-sent event stream reaches its client as it comes, not held back
/// to be stored (it may never end): the key completes without it, and a retry
/// is refused as not retained, never run again.
pub async fn event_streams_flow_through_and_are_not_retained(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let sent = app.router.clone().oneshot(post("/events", Some("ev"), ""));
    let response = tokio::time::timeout(PATIENCE, sent)
        .await
        .expect("the head comes without waiting for the stream's end")
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = tokio::time::timeout(PATIENCE, body.frame())
        .await
        .expect("the first event comes as it is sent")
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "data: 1\n\n");
    drop(body);
    for _ in 0..2 {
        let retry = app.send(post("/events", Some("ev"), "")).await;
        let problem = retry.assert_problem(StatusCode::GONE, "response-not-retained");
        assert_eq!(problem["original_status"], 200);
    }
    assert_eq!(app.runs("events"), 1, "the handler ran once");
}

/// With the manager's wait policy, a duplicate that finds the key in flight
/// waits for the first request and gets its replay instead of a `409`.
pub async fn wait_policy_replays_after_the_first_finishes(repo: SharedRepository) {
    let app = Arc::new(TestApp::with(
        repo,
        Options {
            config: Config {
                in_progress: InProgressPolicy::Wait {
                    timeout: PATIENCE,
                    poll_interval: Duration::from_millis(10),
                },
                ..Config::default()
            },
            ..Options::default()
        },
    ));
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.send(post("/slow", Some("w"), "")).await })
    };
    app.handler_started().await;
    let second = {
        let app = app.clone();
        tokio::spawn(async move { app.send(post("/slow", Some("w"), "")).await })
    };
    // The duplicate has seen the key in flight (and is now waiting).
    app.repo.wait_in_flight_seen(1).await;
    app.open_gate();
    let first = first.await.unwrap();
    let second = second.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(second.replayed(), "the waiting duplicate got the replay");
    assert_eq!(second.body, first.body);
    assert_eq!(app.runs("slow"), 1);
}

/// A request body over the fingerprint cap is `413`; at the cap it runs.
pub async fn request_body_over_the_cap_is_413(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let too_big = "x".repeat(MAX_REQUEST + 1);
    app.send(post("/orders", Some("big-req"), &too_big))
        .await
        .assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    // Streamed without a length: still refused.
    let chunks: Vec<Result<Bytes, Infallible>> = (0..=MAX_REQUEST / 1024)
        .map(|_| Ok(Bytes::from(vec![b'y'; 1024])))
        .collect();
    let streamed = request(
        Method::POST,
        "/orders",
        Some("big-stream"),
        Body::from_stream(futures::stream::iter(chunks)),
    );
    app.send(streamed)
        .await
        .assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert_eq!(app.runs("orders"), 0);
    let at_cap = "x".repeat(MAX_REQUEST);
    let reply = app.send(post("/orders", Some("big-req"), &at_cap)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(
        body["body"].as_str().unwrap().len(),
        MAX_REQUEST,
        "the handler got the whole body"
    );
}

/// Trailers (gRPC status, checksums) are stored and replayed with the body.
pub async fn trailers_are_replayed(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let first = app.send(post("/trailers", Some("t"), "")).await;
    assert_eq!(first.text(), "payload 1");
    assert_eq!(first.trailers.as_ref().unwrap()["x-checksum"], "1");
    let retry = app.send(post("/trailers", Some("t"), "")).await;
    assert!(retry.replayed());
    assert_eq!(retry.text(), "payload 1");
    assert_eq!(retry.trailers.as_ref().unwrap()["x-checksum"], "1");
    assert_eq!(app.runs("trailers"), 1);
}

/// A stored result that is not a response (corrupt, or written by something
/// else) is a `500` problem, never a panic, and the handler does not run.
pub async fn corrupt_stored_response_is_500(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let now = app.manager.now();
    for garbage in [&b"IDH1\x00"[..], b"{\"json\":true}", b"\xff\x00\xfe", b""] {
        let key = app.record_key(
            &Method::POST,
            "/orders",
            &format!("corrupt-{}", garbage.len()),
        );
        let owner = OwnerToken::random();
        let reserved = app
            .repo
            .reserve(ReserveRequest::new(
                &key,
                owner,
                now,
                Duration::from_secs(60),
                Duration::from_secs(3600),
            ))
            .await
            .unwrap();
        assert_eq!(reserved, Reservation::Acquired { attempt: 1 });
        app.repo
            .complete(
                &key,
                owner,
                Some(garbage),
                now + Duration::from_secs(3600),
                now,
            )
            .await
            .unwrap();
        let reply = app
            .send(post(
                "/orders",
                Some(&format!("corrupt-{}", garbage.len())),
                "a",
            ))
            .await;
        reply.assert_problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "stored-response-unreadable",
        );
    }
    assert_eq!(app.runs("orders"), 0);
}

/// An instance that crashed while holding a key (lease ran out) is taken over
/// by the retry; the crashed owner's late completion is fenced off.
pub async fn crashed_holder_is_taken_over_and_fenced(repo: SharedRepository) {
    let app = TestApp::new(repo);
    let key = app.record_key(&Method::POST, "/orders", "crashed");
    let now = app.manager.now();
    let ghost = OwnerToken::random();
    app.repo
        .reserve(ReserveRequest {
            key: &key,
            owner: ghost,
            fingerprint: None,
            now: now - Duration::from_secs(400),
            lease_until: now - Duration::from_secs(100),
            expires_at: now + Duration::from_secs(3600),
            retry_failed: false,
            clock_skew: Duration::ZERO,
        })
        .await
        .unwrap();
    let reply = app.send(post("/orders", Some("crashed"), "a")).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(!reply.replayed());
    let record = app
        .repo
        .get(&key, app.manager.now())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, Status::Completed);
    assert_eq!(record.attempt, 2, "taken over");
    let late = app
        .repo
        .complete(
            &key,
            ghost,
            Some(b"late"),
            now + Duration::from_secs(3600),
            app.manager.now(),
        )
        .await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    let retry = app.send(post("/orders", Some("crashed"), "a")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, reply.body);
    assert_eq!(app.runs("orders"), 1);
}

/// `RequestFingerprint::Disabled`: a reused key replays whatever the body;
/// `RequestFingerprint::Body`: the body counts, and the request target (as in
/// every mode), so another resource of the route is no replay.
pub async fn fingerprint_modes(repo: SharedRepository) {
    let app = TestApp::with(
        repo.clone(),
        Options {
            fingerprint: RequestFingerprint::Disabled,
            ..Options::default()
        },
    );
    let first = app.send(post("/orders", Some("k"), "a")).await;
    let other_body = app.send(post("/orders", Some("k"), "b")).await;
    assert!(other_body.replayed());
    assert_eq!(other_body.body, first.body);

    let app = TestApp::with(
        repo,
        Options {
            fingerprint: RequestFingerprint::Body,
            ..Options::default()
        },
    );
    let first = app.send(post("/orders/1/items", Some("k"), "same")).await;
    app.send(post("/orders/2/items", Some("k"), "same"))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    app.send(post("/orders/1/items", Some("k"), "changed"))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    let retry = app.send(post("/orders/1/items", Some("k"), "same")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.runs("items"), 1);
}

/// One `#[tokio::test]` per scenario over `$repo().await`.
macro_rules! http_scenarios {
    ($repo:ident) => {
        $crate::common::http_scenarios!(@each $repo;
            first_request_runs_then_retry_replays,
            duplicates_in_flight_get_409,
            racing_duplicates_run_the_handler_once,
            reused_key_with_another_request_is_422,
            missing_key_is_400,
            invalid_keys_are_400,
            oversized_response_passes_through_uncached,
            server_errors_are_released_client_errors_stored,
            callers_are_isolated,
            scope_includes_method_and_route,
            opt_out_and_optional_routes,
            get_passes_through_untouched,
            dropped_request_still_completes_and_replays,
            panicking_handler_releases_the_key,
            failing_response_body_is_kept_not_retained,
            panicking_response_body_is_kept_not_retained,
            response_failing_with_a_cut_upload_is_released,
            early_refusal_of_a_cut_upload_is_not_stored,
            event_streams_flow_through_and_are_not_retained,
            cut_upload_is_not_stored,
            cut_upload_read_for_the_fingerprint_is_400,
            wait_policy_replays_after_the_first_finishes,
            request_body_over_the_cap_is_413,
            trailers_are_replayed,
            corrupt_stored_response_is_500,
            crashed_holder_is_taken_over_and_fenced,
            fingerprint_modes,
        );
    };
    (@each $repo:ident; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::common::$name($repo().await).await;
            }
        )*
    };
}
pub(crate) use http_scenarios;
