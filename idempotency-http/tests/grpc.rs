//! The gRPC dialect of the layer around a hand-written gRPC-shaped service
//! (HTTP 200, `application/grpc`, the final status in trailers or, for a
//! trailers-only answer, in the head), over the in-memory store: what is
//! stored is decided by the final `grpc-status`, also for answers larger than
//! the cache cap, and the decision can be widened. The generated tonic
//! client and server are in `examples/grpc-server`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::{stream, StreamExt};
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
use idempotency_http::grpc::{code, is_grpc_stored_by_default};
use idempotency_http::IdempotencyLayer;
use tower::{Layer, ServiceExt};

const METHOD: &str = "/shop.Orders/Create";
const CAP: usize = 1024;

type Frames = Vec<Result<http_body::Frame<Bytes>, Infallible>>;
type GrpcBody =
    StreamBody<stream::Iter<std::vec::IntoIter<Result<http_body::Frame<Bytes>, Infallible>>>>;

/// How the service answers: a message of `len` bytes then `status` in the
/// trailers, or (`len == None`) a trailers-only answer with `status`.
#[derive(Clone, Copy)]
struct Answer {
    len: Option<usize>,
    status: i32,
}

fn grpc_response(answer: Answer) -> Response<GrpcBody> {
    let mut frames: Frames = Vec::new();
    let mut response = Response::builder()
        .status(200)
        .header("content-type", "application/grpc");
    match answer.len {
        Some(len) => {
            // Several data frames, as tonic's encoder sends a large message.
            for chunk in vec![b'm'; len].chunks(300) {
                frames.push(Ok(http_body::Frame::data(Bytes::copy_from_slice(chunk))));
            }
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from(answer.status));
            frames.push(Ok(http_body::Frame::trailers(trailers)));
        }
        None => response = response.header("grpc-status", answer.status),
    }
    response
        .body(StreamBody::new(stream::iter(frames)))
        .expect("a valid response")
}

/// A unary call of `METHOD` under `key`.
fn unary_request(key: &str) -> Request<Full<Bytes>> {
    Request::post(METHOD)
        .header("content-type", "application/grpc")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\x02hi")))
        .unwrap()
}

/// A gRPC answer's head over `body` (its status to come in the trailers).
fn grpc_head<B>(body: B) -> Response<B> {
    Response::builder()
        .header("content-type", "application/grpc")
        .body(body)
        .unwrap()
}

struct Harness {
    layer: IdempotencyLayer,
    runs: Arc<AtomicUsize>,
    answer: Answer,
}

/// What a client sees: the HTTP head, the message bytes and the trailers.
struct Seen {
    headers: HeaderMap,
    message: Bytes,
    trailers: Option<HeaderMap>,
}

impl Seen {
    /// The final status, from the trailers or a trailers-only head.
    fn status(&self) -> i32 {
        let map = self.trailers.as_ref().unwrap_or(&self.headers);
        map["grpc-status"].to_str().unwrap().parse().unwrap()
    }
}

impl Harness {
    fn new(answer: Answer, configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> Self {
        let manager =
            IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap();
        let layer = configure(
            IdempotencyLayer::grpc(manager)
                .unary(METHOD)
                .max_cached_body(CAP),
        );
        Harness {
            layer,
            runs: Arc::new(AtomicUsize::new(0)),
            answer,
        }
    }

    async fn call(&self, key: &str) -> Seen {
        let (runs, answer) = (self.runs.clone(), self.answer);
        let service = self
            .layer
            .layer(tower::service_fn(move |_request: Request<_>| {
                runs.fetch_add(1, Ordering::SeqCst);
                async move { Ok::<_, Infallible>(grpc_response(answer)) }
            }));
        let response = service.oneshot(unary_request(key)).await.unwrap();
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        Seen {
            headers: parts.headers,
            message: collected.to_bytes(),
            trailers,
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

#[tokio::test]
async fn a_small_ok_answer_is_replayed_with_its_trailers() {
    let h = Harness::new(
        Answer {
            len: Some(10),
            status: code::OK,
        },
        |l| l,
    );
    let first = h.call("k").await;
    assert_eq!((first.status(), first.message.len()), (code::OK, 10));
    let retry = h.call("k").await;
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!((retry.status(), retry.message), (code::OK, first.message));
    assert_eq!(h.runs(), 1);
}

/// Over the cap, the final status is still judged at the end: `OK` keeps the
/// key (the retry learns the answer is gone, with its status) ...
#[tokio::test]
async fn a_large_ok_answer_is_passed_whole_and_keeps_the_key() {
    let h = Harness::new(
        Answer {
            len: Some(5 * CAP),
            status: code::OK,
        },
        |l| l,
    );
    let first = h.call("k").await;
    assert_eq!(
        first.message.len(),
        5 * CAP,
        "the client gets the whole message"
    );
    assert_eq!(first.status(), code::OK, "and the trailers");

    let retry = h.call("k").await;
    assert_eq!(retry.status(), code::FAILED_PRECONDITION);
    assert_eq!(
        retry.headers["idempotency-problem"],
        "response-not-retained"
    );
    let message = retry.headers["grpc-message"].to_str().unwrap();
    assert!(message.contains("grpc-status 0"), "{message}");
    assert_eq!(h.runs(), 1, "the method ran once");
}

/// ... and a status that is not stored releases it, as it would for a small
/// answer: the retry runs the method again.
#[tokio::test]
async fn a_large_answer_with_a_transient_status_releases_the_key() {
    let h = Harness::new(
        Answer {
            len: Some(5 * CAP),
            status: code::UNAVAILABLE,
        },
        |l| l,
    );
    let first = h.call("k").await;
    assert_eq!(
        (first.status(), first.message.len()),
        (code::UNAVAILABLE, 5 * CAP)
    );
    let retry = h.call("k").await;
    assert_eq!(
        (retry.status(), retry.message.len()),
        (code::UNAVAILABLE, 5 * CAP)
    );
    assert!(retry.headers.get("idempotency-replayed").is_none());
    assert_eq!(h.runs(), 2, "the retry ran the method again");
}

#[tokio::test]
async fn trailers_only_errors_are_released_unless_the_filter_keeps_them() {
    const NOT_FOUND: i32 = 5;
    let answer = Answer {
        len: None,
        status: NOT_FOUND,
    };
    let by_default = Harness::new(answer, |l| l);
    assert_eq!(by_default.call("k").await.status(), NOT_FOUND);
    assert_eq!(by_default.call("k").await.status(), NOT_FOUND);
    assert_eq!(by_default.runs(), 2, "NOT_FOUND is not stored by default");

    let widened = Harness::new(answer, |l| {
        l.store_grpc_status_if(|s| s == NOT_FOUND || is_grpc_stored_by_default(s))
    });
    assert_eq!(widened.call("k").await.status(), NOT_FOUND);
    let retry = widened.call("k").await;
    assert_eq!(retry.status(), NOT_FOUND);
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!(widened.runs(), 1);
}

#[tokio::test]
async fn a_narrowed_filter_releases_what_the_default_keeps() {
    let answer = Answer {
        len: Some(10),
        status: code::INVALID_ARGUMENT,
    };
    let h = Harness::new(answer, |l| l.store_grpc_status_if(|s| s == code::OK));
    h.call("k").await;
    let retry = h.call("k").await;
    assert_eq!(retry.status(), code::INVALID_ARGUMENT);
    assert!(retry.headers.get("idempotency-replayed").is_none());
    assert_eq!(h.runs(), 2);
}

/// An answer over the cap whose end never comes: read until shortly before
/// the lease ends (paused time gets there at once), then kept as not
/// retained with its status unknown, the rest streamed through: the method
/// is never run again, and the call does not wait past the lease.
#[tokio::test(start_paused = true)]
async fn an_answer_that_never_ends_keeps_the_key_before_the_lease_ends() {
    let h = Harness::new(
        Answer {
            len: None,
            status: code::OK,
        },
        |l| l,
    );
    let runs = h.runs.clone();
    let service = h
        .layer
        .layer(tower::service_fn(move |_request: Request<_>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                let first: Vec<Result<http_body::Frame<Bytes>, Infallible>> =
                    vec![Ok(http_body::Frame::data(Bytes::from(vec![b'm'; 3 * CAP])))];
                let body = StreamBody::new(stream::iter(first).chain(stream::pending()));
                Ok::<_, Infallible>(grpc_head(body))
            }
        }));
    let request = || unary_request("k");
    let response = service.clone().oneshot(request()).await.unwrap();
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(
        first.data_ref().map(Bytes::len),
        Some(3 * CAP),
        "what was read is passed on"
    );

    let retry = service.oneshot(request()).await.unwrap();
    assert_eq!(
        retry.headers()["grpc-status"],
        code::FAILED_PRECONDITION.to_string().as_str()
    );
    assert_eq!(
        retry.headers()["idempotency-problem"],
        "response-not-retained"
    );
    let message = retry.headers()["grpc-message"].to_str().unwrap();
    assert!(message.contains("grpc-status unknown"), "{message}");
    assert_eq!(h.runs(), 1);
}

/// The manager's clock, following the test's (paused) Tokio time.
#[derive(Debug)]
struct TokioClock {
    start: tokio::time::Instant,
    at_start: idempotency_core::Timestamp,
}

impl idempotency_core::Clock for TokioClock {
    fn now(&self) -> idempotency_core::Timestamp {
        self.at_start + self.start.elapsed()
    }
}

/// An answer over the cap whose status comes two minutes later (four leases of
/// 30 s), with lease extension on: each extension confirmed moves the read's
/// deadline, so the layer reads on to the status. A retry meanwhile is told
/// the call is in progress (without extension it would be refused as not
/// retained, its status unknown), and after the end it gets the status that
/// was recorded. The method runs once.
#[tokio::test(start_paused = true)]
async fn an_extended_lease_moves_the_read_to_the_status() {
    let clock = Arc::new(TokioClock {
        start: tokio::time::Instant::now(),
        at_start: idempotency_core::Timestamp::from_system_time(std::time::SystemTime::now()),
    });
    let config = Config {
        processing_timeout: std::time::Duration::from_secs(30),
        lease_extension_interval: Some(std::time::Duration::from_secs(5)),
        ..Config::default()
    };
    let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config)
        .unwrap()
        .with_clock(clock);
    let layer = IdempotencyLayer::grpc(manager)
        .unary(METHOD)
        .max_cached_body(CAP);
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let service = layer.layer(tower::service_fn(move |_request: Request<_>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            let first: Frames = vec![Ok(http_body::Frame::data(Bytes::from(vec![b'm'; 3 * CAP])))];
            let status = stream::once(async {
                // Paused Tokio time: no real time passes.
                tokio::time::sleep(std::time::Duration::from_secs(120)).await;
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from(code::OK));
                Ok::<_, Infallible>(http_body::Frame::trailers(trailers))
            });
            let body = StreamBody::new(stream::iter(first).chain(status));
            Ok::<_, Infallible>(grpc_head(body))
        }
    }));
    let request = || unary_request("k");
    let first = tokio::spawn(service.clone().oneshot(request()));
    // Two leases later, while the answer is still read. Paused time, as above.
    tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    let retry = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(retry.headers()["idempotency-problem"], "in-progress");
    assert_eq!(
        retry.headers()["grpc-status"],
        code::ABORTED.to_string().as_str()
    );

    let first = first.await.unwrap().unwrap();
    let collected = first.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(
        collected.to_bytes().len(),
        3 * CAP,
        "the client gets it all"
    );

    let after = service.oneshot(request()).await.unwrap();
    assert_eq!(
        after.headers()["idempotency-problem"],
        "response-not-retained"
    );
    let message = after.headers()["grpc-message"].to_str().unwrap();
    assert!(message.contains("grpc-status 0"), "{message}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "never a second run");
}
