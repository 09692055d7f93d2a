//! A real tonic client and server, the server behind the layer's gRPC
//! dialect, over an in-memory HTTP/2 connection (so the test can run on
//! Tokio's paused clock): a client whose tower retry policy follows gRPC's
//! retry specification (A6) — retryable statuses `ABORTED` and `UNAVAILABLE`,
//! at most 5 attempts, exponential backoff unless the server sends
//! `grpc-retry-pushback-ms`, which then decides alone — retries a call whose
//! first attempt is still running (1.5 s) until it gets the replayed answer.
//! The method runs once, and the client never gives up: each pushback is
//! the time the running call has left as well as the layer can tell, never
//! the manager's average of earlier (fast) calls.
//!
//! Paused time: the handler's 1.5 s and the client's waits take no real time;
//! the manager's clock follows Tokio's, so the records' times agree with it.

#![cfg(feature = "tonic")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt;
use http::uri::PathAndQuery;
use hyper_util::rt::TokioIo;
use idempotency_core::{Config, IdempotencyManager, MemoryRepository, Timestamp};
use idempotency_http::IdempotencyLayer;
use tonic::codec::ProstCodec;
use tonic::server::NamedService;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tower::retry::{Policy, RetryLayer};
use tower::{Layer, Service, ServiceExt};

const METHOD: &str = "/shop.Orders/Create";
/// How long the first call of the slow order runs.
const SLOW: Duration = Duration::from_millis(1500);

#[derive(Clone, PartialEq, prost::Message)]
struct CreateOrder {
    #[prost(string, tag = "1")]
    item: String,
    #[prost(uint64, tag = "2")]
    delay_ms: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Order {
    #[prost(uint64, tag = "1")]
    number: u64,
    #[prost(string, tag = "2")]
    item: String,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The `shop.Orders` service, hand-written as the generated code would be:
/// `Create` numbers orders and takes `delay_ms` to answer.
#[derive(Clone, Default)]
struct Orders {
    runs: Arc<AtomicUsize>,
    started: Arc<tokio::sync::Notify>,
}

impl NamedService for Orders {
    const NAME: &'static str = "shop.Orders";
}

impl Service<http::Request<tonic::body::Body>> for Orders {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let create = Create(self.clone());
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Order, CreateOrder>::default());
            Ok(grpc.unary(create, request).await)
        })
    }
}

/// The `Create` method.
struct Create(Orders);

impl tonic::server::UnaryService<CreateOrder> for Create {
    type Response = Order;
    type Future = BoxFuture<Result<tonic::Response<Order>, Status>>;

    fn call(&mut self, request: tonic::Request<CreateOrder>) -> Self::Future {
        let orders = self.0.clone();
        Box::pin(async move {
            let order = request.into_inner();
            let number = orders.runs.fetch_add(1, Ordering::SeqCst) as u64 + 1;
            orders.started.notify_waiters();
            tokio::time::sleep(Duration::from_millis(order.delay_ms)).await;
            Ok(tonic::Response::new(Order {
                number,
                item: order.item,
            }))
        })
    }
}

/// The manager's clock, following the test's (paused) Tokio time.
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

/// Starts the server behind the layer on one end of an in-memory
/// connection; the channel is the other end.
async fn start(orders: Orders) -> tonic::transport::Channel {
    let clock = Arc::new(TokioClock {
        start: tokio::time::Instant::now(),
        at_start: Timestamp::from_system_time(std::time::SystemTime::now()),
    });
    let config = Config {
        processing_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config)
        .unwrap()
        .with_clock(clock);
    let layer = IdempotencyLayer::grpc(manager).unary(METHOD).tonic();
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let incoming = futures::stream::once(async move { Ok::<_, std::io::Error>(server_io) })
        .chain(futures::stream::pending());
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(orders)
            .serve_with_incoming(incoming),
    );
    let mut client_io = Some(client_io);
    Endpoint::from_static("http://in-memory")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let io = client_io.take();
            async move {
                io.map(TokioIo::new)
                    .ok_or_else(|| std::io::Error::other("one connection only"))
            }
        }))
        .await
        .unwrap()
}

/// One call: the key and the message, cloned for every attempt.
#[derive(Clone)]
struct Call {
    key: &'static str,
    order: CreateOrder,
}

/// The tonic client as a tower service of [`Call`]s.
fn client(
    channel: tonic::transport::Channel,
) -> impl Service<Call, Response = tonic::Response<Order>, Error = Status, Future: Send> + Clone {
    tower::service_fn(move |call: Call| {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        async move {
            grpc.ready()
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            let mut request = tonic::Request::new(call.order);
            request
                .metadata_mut()
                .insert("idempotency-key", call.key.parse().unwrap());
            grpc.unary(
                request,
                PathAndQuery::from_static(METHOD),
                ProstCodec::<CreateOrder, Order>::default(),
            )
            .await
        }
    })
}

/// What the policy saw: one entry per failed attempt, with the pushback it
/// followed (`None`: its own backoff).
type Log = Arc<Mutex<Vec<(Code, Option<Duration>)>>>;

/// gRPC's retry policy (A6): retryable codes, at most `max_attempts`
/// attempts, exponential backoff (100 ms × 2ⁿ up to 1 s, without jitter to
/// keep the test exact), overridden by the server's pushback; a pushback
/// that is not a non-negative integer stops retrying.
#[derive(Clone)]
struct GrpcRetryPolicy {
    attempts: u32,
    max_attempts: u32,
    log: Log,
}

impl GrpcRetryPolicy {
    fn new(log: Log) -> Self {
        GrpcRetryPolicy {
            attempts: 1,
            max_attempts: 5,
            log,
        }
    }
}

impl<Res> Policy<Call, Res, Status> for GrpcRetryPolicy {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _call: &mut Call,
        result: &mut Result<Res, Status>,
    ) -> Option<Self::Future> {
        let status = result.as_ref().err()?;
        if !matches!(status.code(), Code::Aborted | Code::Unavailable) {
            return None;
        }
        let pushback = match status.metadata().get("grpc-retry-pushback-ms") {
            Some(value) => Some(Duration::from_millis(value.to_str().ok()?.parse().ok()?)),
            None => None,
        };
        self.log.lock().unwrap().push((status.code(), pushback));
        if self.attempts >= self.max_attempts {
            return None;
        }
        let backoff =
            Duration::from_millis(100 * 2u64.pow(self.attempts - 1)).min(Duration::from_secs(1));
        self.attempts += 1;
        Some(tokio::time::sleep(pushback.unwrap_or(backoff)))
    }

    fn clone_request(&mut self, call: &Call) -> Option<Call> {
        Some(call.clone())
    }
}

/// The duplicate of a 1.5 s call, sent while it runs, retries on the
/// server's pushback and ends with the replayed order; the method ran once.
/// Earlier calls were fast, so the manager's own hint (their average, about
/// 1 ms) would have spent the five attempts in a few milliseconds.
#[tokio::test(start_paused = true)]
async fn a_retrying_duplicate_gets_the_replay_of_a_slow_call() {
    let orders = Orders::default();
    let channel = start(orders.clone()).await;
    let plain = client(channel.clone());
    let log: Log = Arc::default();
    let retrying = RetryLayer::new(GrpcRetryPolicy::new(log.clone())).layer(client(channel));

    // Fast calls first: the manager's average execution is now tiny.
    for key in ["warm-1", "warm-2"] {
        let order = CreateOrder {
            item: key.to_owned(),
            delay_ms: 0,
        };
        plain.clone().oneshot(Call { key, order }).await.unwrap();
    }
    assert_eq!(orders.runs.load(Ordering::SeqCst), 2);

    let slow = Call {
        key: "slow",
        order: CreateOrder {
            item: "piano".to_owned(),
            delay_ms: SLOW.as_millis() as u64,
        },
    };
    let started = orders.started.notified();
    let first = tokio::spawn(plain.clone().oneshot(slow.clone()));
    started.await;
    let began = tokio::time::Instant::now();

    let replayed = retrying
        .oneshot(slow)
        .await
        .expect("the retries reach the replay");
    assert_eq!(
        replayed.metadata().get("idempotency-replayed").unwrap(),
        "true"
    );
    let first = first.await.unwrap().unwrap();
    assert_eq!(
        replayed.get_ref(),
        first.get_ref(),
        "the first call's order"
    );
    assert_eq!(first.get_ref().number, 3);
    assert_eq!(
        orders.runs.load(Ordering::SeqCst),
        3,
        "the slow call ran once"
    );

    let log = log.lock().unwrap().clone();
    assert!(log.len() < 5, "attempts to spare: {log:?}");
    for (code, pushback) in &log {
        assert_eq!(*code, Code::Aborted, "{log:?}");
        let pushback = pushback.expect("every in-progress answer carries a pushback");
        assert!(
            pushback >= Duration::from_millis(100) && pushback <= Duration::from_secs(1),
            "{log:?}"
        );
    }
    // Paused time: the client came back once the call was done, not long after.
    assert!(
        began.elapsed() <= SLOW + Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
}

/// In-progress answers carry `retry-after` in whole seconds, rounded up from
/// the same hint as `grpc-retry-pushback-ms`; the message speaks gRPC.
#[tokio::test(start_paused = true)]
async fn in_progress_and_missing_key_answers_speak_grpc() {
    let orders = Orders::default();
    let channel = start(orders.clone()).await;
    let plain = client(channel.clone());
    let slow = Call {
        key: "k",
        order: CreateOrder {
            item: "desk".to_owned(),
            delay_ms: SLOW.as_millis() as u64,
        },
    };
    let started = orders.started.notified();
    let first = tokio::spawn(plain.clone().oneshot(slow.clone()));
    started.await;
    let busy = plain.clone().oneshot(slow).await.unwrap_err();
    assert_eq!(busy.code(), Code::Aborted);
    let pushback: u64 = busy
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let retry_after: u64 = busy
        .metadata()
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(retry_after, pushback.div_ceil(1000));
    assert_eq!(
        busy.metadata().get("idempotency-problem").unwrap(),
        "in-progress"
    );
    assert!(busy.message().contains("call"), "{}", busy.message());
    assert!(
        busy.message().contains("grpc-retry-pushback-ms"),
        "{}",
        busy.message()
    );
    first.await.unwrap().unwrap();

    // A call without a key: the message names the metadata, not a header.
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let missing = grpc
        .unary(
            tonic::Request::new(CreateOrder::default()),
            PathAndQuery::from_static(METHOD),
            ProstCodec::<CreateOrder, Order>::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(
        missing.message(),
        "/shop.Orders/Create requires `idempotency-key` metadata with a unique key per call"
    );
}

/// With calls that typically take 800 ms, a duplicate 300 ms into a running
/// one is pushed back by the 500 ms it has left (read from its record's
/// start), not by a whole typical execution; its retry then gets the replay.
#[tokio::test(start_paused = true)]
async fn the_pushback_is_what_the_running_call_has_left() {
    let orders = Orders::default();
    let channel = start(orders.clone()).await;
    let plain = client(channel);
    let call = |key: &'static str| Call {
        key,
        order: CreateOrder {
            item: "lamp".to_owned(),
            delay_ms: 800,
        },
    };
    for key in ["typical-1", "typical-2"] {
        plain.clone().oneshot(call(key)).await.unwrap();
    }

    let started = orders.started.notified();
    let first = tokio::spawn(plain.clone().oneshot(call("k")));
    started.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = plain.clone().oneshot(call("k")).await.unwrap_err();
    assert_eq!(busy.code(), Code::Aborted);
    let pushback: u64 = busy
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((490..=510).contains(&pushback), "{pushback} ms");
    assert_eq!(busy.metadata().get("retry-after").unwrap(), "1");

    tokio::time::sleep(Duration::from_millis(pushback)).await;
    let replayed = plain.oneshot(call("k")).await.unwrap();
    assert_eq!(
        replayed.metadata().get("idempotency-replayed").unwrap(),
        "true"
    );
    assert_eq!(replayed.get_ref(), first.await.unwrap().unwrap().get_ref());
    assert_eq!(orders.runs.load(Ordering::SeqCst), 3);
}
