//! The layer's own answers in an API's own error format (a problem
//! responder, here Stripe's `{"error": {…}}`), the statuses and retry hints
//! they keep, and the replay marker under another name (Stripe's
//! `Idempotent-Replayed`): an in-process axum app over the in-memory store.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use idempotency_core::{
    async_trait, Capabilities, Config, Error, IdempotencyManager, MemoryRepository, OwnerToken,
    Record, RecordKey, Repository, Reservation, ReserveRequest, SharedRepository, Timestamp,
};
use idempotency_http::{IdempotencyLayer, Problem, ProblemKind};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

const CAP: usize = 1024;

/// Stripe's error object: `type`, and the layer's kind as `code`.
fn stripe_error(problem: &Problem) -> Response<Bytes> {
    let kind = match problem.kind() {
        ProblemKind::InProgress | ProblemKind::KeyReused | ProblemKind::ResponseNotRetained => {
            "idempotency_error"
        }
        ProblemKind::StoreUnavailable | ProblemKind::StoreError => "api_error",
        _ => "invalid_request_error",
    };
    let mut error = serde_json::json!({
        "type": kind,
        "code": problem.kind().slug(),
        "message": problem.detail(),
    });
    if let Some(status) = problem.original_status() {
        error["original_status"] = status.as_u16().into();
    }
    let body = serde_json::json!({ "error": error }).to_string();
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = problem.status();
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

struct App {
    router: Router,
    runs: Arc<AtomicUsize>,
    started: Arc<Notify>,
    gate: watch::Sender<bool>,
}

/// `/orders` answers `201 order N`; `/slow` the same once the gate opens;
/// `/big` a body over the cache cap.
fn app(
    repo: SharedRepository,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> App {
    let manager = IdempotencyManager::new(repo, Config::default()).unwrap();
    let layer = configure(IdempotencyLayer::new(manager).max_cached_body(CAP));
    let runs = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Notify::new());
    let (gate, opened) = watch::channel(false);
    let order = {
        let runs = runs.clone();
        move || {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("order {n}"))
        }
    };
    let slow = {
        let (order, started) = (order.clone(), started.clone());
        move || async move {
            started.notify_waiters();
            opened.clone().wait_for(|open| *open).await.unwrap();
            order()
        }
    };
    let big = {
        let order = order.clone();
        move || async move {
            order();
            (StatusCode::CREATED, vec![b'x'; 4 * CAP])
        }
    };
    let router = Router::new()
        .route("/orders", post(move || async move { order() }))
        .route("/slow", post(slow))
        .route("/big", post(big))
        .layer(layer);
    App {
        router,
        runs,
        started,
        gate,
    }
}

struct Reply {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    /// A Stripe-style error of `code`, with the status the layer decided.
    fn assert_stripe(&self, status: StatusCode, code: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "{:?}", self.body);
        assert_eq!(self.headers[CONTENT_TYPE], "application/json");
        assert_eq!(self.headers["cache-control"], "no-store");
        let json = self.json();
        assert_eq!(json["error"]["code"], code, "{json}");
        assert!(json["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
        json
    }
}

async fn send(router: &Router, path: &str, key: Option<&str>, body: &'static str) -> Reply {
    let mut request = Request::post(path);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

#[tokio::test]
async fn a_responder_answers_every_problem_in_the_apis_format() {
    let app = app(Arc::new(MemoryRepository::new()), |l| {
        l.problem_responder(stripe_error)
    });
    let r = &app.router;

    send(r, "/orders", None, "a")
        .await
        .assert_stripe(StatusCode::BAD_REQUEST, "missing-key");
    send(r, "/orders", Some("has space"), "a")
        .await
        .assert_stripe(StatusCode::BAD_REQUEST, "invalid-key");

    assert_eq!(
        send(r, "/orders", Some("k"), "a").await.status,
        StatusCode::CREATED
    );
    send(r, "/orders", Some("k"), "another body")
        .await
        .assert_stripe(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");

    // In progress: 409, and the layer's Retry-After although the responder
    // set none.
    let started = app.started.notified();
    let first = tokio::spawn({
        let r = r.clone();
        async move { send(&r, "/slow", Some("s"), "").await }
    });
    started.await;
    let busy = send(r, "/slow", Some("s"), "").await;
    busy.assert_stripe(StatusCode::CONFLICT, "in-progress");
    assert_eq!(busy.headers[RETRY_AFTER], "1");
    app.gate.send(true).unwrap();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);

    // Not retained: 410, no Retry-After, the first status available.
    assert_eq!(send(r, "/big", Some("b"), "").await.body.len(), 4 * CAP);
    let gone = send(r, "/big", Some("b"), "").await;
    let json = gone.assert_stripe(StatusCode::GONE, "response-not-retained");
    assert_eq!(json["error"]["original_status"], 201);
    assert!(gone.headers.get(RETRY_AFTER).is_none());
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        3,
        "orders, slow and big ran once"
    );

    // Replays are the handler's own responses, untouched by the responder.
    let replay = send(r, "/orders", Some("k"), "a").await;
    assert_eq!(
        (replay.status, replay.body.as_ref()),
        (StatusCode::CREATED, &b"order 1"[..])
    );
    assert_eq!(replay.headers["idempotency-replayed"], "true");
}

#[tokio::test]
async fn store_unavailable_keeps_its_retry_after_in_a_custom_answer() {
    let app = app(Arc::new(Down), |l| l.problem_responder(stripe_error));
    let down = send(&app.router, "/orders", Some("k"), "a").await;
    down.assert_stripe(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert_eq!(down.headers[RETRY_AFTER], "1");
    assert_eq!(app.runs.load(Ordering::SeqCst), 0, "fail-closed");
}

#[tokio::test]
async fn a_responder_can_keep_problem_json_for_some_kinds_and_set_its_own_retry_after() {
    let app = app(Arc::new(MemoryRepository::new()), |l| {
        l.problem_responder(|problem| match problem.kind() {
            ProblemKind::MissingKey => stripe_error(problem),
            _ => {
                let mut response = problem.to_problem_json();
                if problem.retry_after().is_some() {
                    let value = HeaderValue::from_static("5");
                    response.headers_mut().insert(RETRY_AFTER, value);
                }
                response
            }
        })
    });
    send(&app.router, "/orders", None, "")
        .await
        .assert_stripe(StatusCode::BAD_REQUEST, "missing-key");
    let invalid = send(&app.router, "/orders", Some(""), "").await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    assert_eq!(invalid.headers[CONTENT_TYPE], "application/problem+json");
    assert!(invalid.json()["type"]
        .as_str()
        .unwrap()
        .ends_with("#invalid-key"));

    let started = app.started.notified();
    let first = tokio::spawn({
        let r = app.router.clone();
        async move { send(&r, "/slow", Some("s"), "").await }
    });
    started.await;
    let busy = send(&app.router, "/slow", Some("s"), "").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(
        busy.headers[RETRY_AFTER], "5",
        "the responder's own is kept"
    );
    app.gate.send(true).unwrap();
    first.await.unwrap();
}

/// Stripe marks replays with `Idempotent-Replayed: true`.
#[tokio::test]
async fn the_replay_marker_can_be_named() {
    let stripe = HeaderName::from_static("idempotent-replayed");
    let app = app(Arc::new(MemoryRepository::new()), |l| {
        l.replayed_header(stripe.clone())
    });
    let first = send(&app.router, "/orders", Some("k"), "a").await;
    assert!(first.headers.get(&stripe).is_none());
    let retry = send(&app.router, "/orders", Some("k"), "a").await;
    assert_eq!(retry.headers[&stripe], "true");
    assert!(retry.headers.get("idempotency-replayed").is_none());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);

    // The default name is unchanged.
    let app = self::app(Arc::new(MemoryRepository::new()), |l| l);
    send(&app.router, "/orders", Some("k"), "a").await;
    let retry = send(&app.router, "/orders", Some("k"), "a").await;
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert!(retry.headers.get(&stripe).is_none());
}

/// A store that is down: every call is an outage.
#[derive(Debug)]
struct Down;

fn outage() -> Error {
    Error::unavailable("down", "connection refused")
}

#[async_trait]
impl Repository for Down {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("down")
    }
    async fn reserve(&self, _request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        Err(outage())
    }
    async fn complete(
        &self,
        _key: &RecordKey,
        _owner: OwnerToken,
        _result: Option<&[u8]>,
        _expires_at: Timestamp,
        _now: Timestamp,
    ) -> Result<(), Error> {
        Err(outage())
    }
    async fn fail(
        &self,
        _key: &RecordKey,
        _owner: OwnerToken,
        _error: Option<&[u8]>,
        _retryable: bool,
        _expires_at: Timestamp,
        _now: Timestamp,
    ) -> Result<(), Error> {
        Err(outage())
    }
    async fn release(
        &self,
        _key: &RecordKey,
        _owner: OwnerToken,
        _now: Timestamp,
    ) -> Result<(), Error> {
        Err(outage())
    }
    async fn extend(
        &self,
        _key: &RecordKey,
        _owner: OwnerToken,
        _lease_until: Timestamp,
        _expires_at: Timestamp,
        _now: Timestamp,
    ) -> Result<(), Error> {
        Err(outage())
    }
    async fn get(&self, _key: &RecordKey, _now: Timestamp) -> Result<Option<Record>, Error> {
        Err(outage())
    }
    async fn delete(&self, _key: &RecordKey) -> Result<bool, Error> {
        Err(outage())
    }
    async fn purge_expired(&self, _now: Timestamp, _limit: usize) -> Result<usize, Error> {
        Err(outage())
    }
}
