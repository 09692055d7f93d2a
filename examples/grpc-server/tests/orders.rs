//! The example's tonic server on a real socket, over a real Redis server from
//! the test harness, driven by the generated tonic client: each test its own
//! server and its own random key prefix.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use idempotency::{Config, IdempotencyManager};
use idempotency_conformance::containers::{self, unique_namespace};
use idempotency_grpc_server_example::proto::orders_client::OrdersClient;
use idempotency_grpc_server_example::proto::{CreateOrder, Order, WatchOrders};
use idempotency_grpc_server_example::{serve, Shop};
use idempotency_redis::RedisRepository;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

struct Server {
    client: OrdersClient<Channel>,
    shop: Arc<Shop>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Server {
    async fn start() -> Server {
        let redis = containers::redis()
            .await
            .expect("a Redis server from the harness (see docs/testing.md)");
        let repo = RedisRepository::connect(redis.url())
            .await
            .expect("connect to the harness's Redis server");
        let config = Config {
            key_prefix: unique_namespace("grpc"),
            ..Config::default()
        };
        let manager = IdempotencyManager::new(Arc::new(repo), config).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shop = Arc::new(Shop::default());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, manager, shop.clone(), async {
            let _ = stopped.await;
        }));
        let client = OrdersClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        Server {
            client,
            shop,
            _stop: stop,
        }
    }

    async fn create(
        &self,
        key: Option<&str>,
        caller: &str,
        order: CreateOrder,
    ) -> Result<tonic::Response<Order>, Status> {
        let mut request = Request::new(order);
        if let Some(key) = key {
            request
                .metadata_mut()
                .insert("idempotency-key", key.parse().unwrap());
        }
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {caller}").parse().unwrap());
        self.client.clone().create(request).await
    }
}

fn order(item: &str, quantity: u32) -> CreateOrder {
    CreateOrder {
        item: item.to_owned(),
        quantity,
        delay_ms: 0,
    }
}

fn replayed<T>(response: &tonic::Response<T>) -> bool {
    response
        .metadata()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true")
}

fn problem(status: &Status) -> &str {
    status
        .metadata()
        .get("idempotency-problem")
        .map_or("", |v| v.to_str().unwrap())
}

#[tokio::test]
async fn a_unary_call_runs_once_and_its_retry_is_replayed() {
    let server = Server::start().await;
    let first = server
        .create(Some("k-1"), "a", order("book", 2))
        .await
        .unwrap();
    assert!(!replayed(&first));
    let again = server
        .create(Some("k-1"), "a", order("book", 2))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(server.shop.calls(), 1);

    let reused = server
        .create(Some("k-1"), "a", order("book", 3))
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert_eq!(problem(&reused), "key-reused");

    let missing = server
        .create(None, "a", order("book", 2))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert_eq!(problem(&missing), "missing-key");
    assert_eq!(server.shop.created(), 1);
}

#[tokio::test]
async fn streaming_methods_are_left_alone() {
    let server = Server::start().await;
    server
        .create(Some("k"), "a", order("book", 1))
        .await
        .unwrap();
    // No key needed, nothing stored: two calls, two live streams.
    for _ in 0..2 {
        let mut stream = server
            .client
            .clone()
            .watch(WatchOrders {})
            .await
            .unwrap()
            .into_inner();
        let first = stream.message().await.unwrap().unwrap();
        assert_eq!(first.item, "book");
        assert!(stream.message().await.unwrap().is_none());
    }
}

#[tokio::test]
async fn deterministic_errors_are_replayed_transient_ones_run_again() {
    let server = Server::start().await;
    let invalid = server
        .create(Some("zero"), "a", order("book", 0))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);
    let again = server
        .create(Some("zero"), "a", order("book", 0))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::InvalidArgument);
    assert_eq!(again.message(), invalid.message());
    assert!(
        again.metadata().get("idempotency-replayed").is_some(),
        "{again:?} calls={}",
        server.shop.calls()
    );
    assert_eq!(server.shop.calls(), 1);

    for _ in 0..2 {
        let down = server
            .create(Some("later"), "a", order("out-of-stock", 1))
            .await
            .unwrap_err();
        assert_eq!(down.code(), Code::Unavailable);
        assert!(down.metadata().get("idempotency-replayed").is_none());
    }
    assert_eq!(server.shop.calls(), 3, "UNAVAILABLE leaves the key free");
}

#[tokio::test]
async fn a_duplicate_while_the_first_runs_is_aborted_with_a_pushback() {
    let server = Server::start().await;
    let slow = CreateOrder {
        delay_ms: 1500,
        ..order("piano", 1)
    };
    let (a, b) = tokio::join!(
        server.create(Some("slow"), "a", slow.clone()),
        server.create(Some("slow"), "a", slow),
    );
    let busy = match (a, b) {
        (Ok(_), Err(busy)) | (Err(busy), Ok(_)) => busy,
        other => panic!("one call runs, the other is told to wait: {other:?}"),
    };
    assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
    assert_eq!(problem(&busy), "in-progress");
    assert!(busy.metadata().get("grpc-retry-pushback-ms").is_some());
    assert_eq!(server.shop.created(), 1);
}

#[tokio::test]
async fn callers_with_other_credentials_never_share_a_key() {
    let server = Server::start().await;
    let alice = server
        .create(Some("same"), "alice", order("book", 1))
        .await
        .unwrap();
    let bob = server
        .create(Some("same"), "bob", order("book", 1))
        .await
        .unwrap();
    assert!(!replayed(&bob));
    assert_ne!(alice.get_ref().id, bob.get_ref().id);
    assert_eq!(server.shop.created(), 2);
}
