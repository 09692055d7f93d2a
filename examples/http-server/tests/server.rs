//! The example's axum server on a real socket, over a real Redis server from
//! the test harness, driven by a real HTTP client (reqwest): each test its own
//! server and its own random key prefix.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::{Config, IdempotencyManager};
use idempotency_conformance::containers::{self, unique_namespace};
use idempotency_redis::RedisRepository;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// How long a test waits for a slow order's stored response at most.
const PATIENCE: Duration = Duration::from_secs(30);

struct Server {
    base: String,
    client: reqwest::Client,
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
            key_prefix: unique_namespace("axum"),
            ..Config::default()
        };
        let manager = IdempotencyManager::new(Arc::new(repo), config).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = idempotency_http_server_example::app(manager);
        tokio::spawn(async move { axum::serve(listener, app).await });
        Server {
            base: format!("http://{addr}"),
            client: reqwest::Client::new(),
        }
    }

    fn order(&self, key: &str, body: &Value) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}/orders", self.base))
            .header("x-api-key", "a")
            .header("idempotency-key", key)
            .json(body)
    }

    async fn orders(&self) -> usize {
        let list: Vec<Value> = self
            .client
            .get(format!("{}/orders", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list.len()
    }
}

async fn answer(
    request: reqwest::RequestBuilder,
) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let response = request.send().await.unwrap();
    let (status, headers) = (response.status(), response.headers().clone());
    (status, headers, response.json().await.unwrap())
}

#[tokio::test]
async fn a_retry_over_the_wire_is_replayed() {
    let server = Server::start().await;
    let book = json!({"item": "book", "quantity": 2});
    let (status, _, first) = answer(server.order("k-1", &book)).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, again) = answer(server.order("k-1", &book)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotency-replayed"], "true");
    assert_eq!(again, first);
    let other = json!({"item": "book", "quantity": 3});
    let (status, _, _) = answer(server.order("k-1", &other)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(server.orders().await, 1);
}

/// hyper drops the request's future when its client disconnects: the layer's
/// detached execution is what lets the handler finish and store its answer.
#[tokio::test]
async fn a_client_that_gives_up_does_not_undo_the_protection() {
    let server = Server::start().await;
    let slow = json!({"item": "piano", "quantity": 1, "delay_ms": 1000});
    let impatient = server
        .order("gone", &slow)
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(impatient.unwrap_err().is_timeout());

    let started = Instant::now();
    let (status, headers, order) = loop {
        let answered = answer(server.order("gone", &slow)).await;
        if answered.0 != StatusCode::CONFLICT {
            break answered;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "the first execution never ended"
        );
        // Polling a real server over a socket (its handler runs in real time,
        // which paused Tokio time cannot drive); bounded by PATIENCE above.
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status, StatusCode::CREATED, "{order}");
    assert_eq!(headers["idempotency-replayed"], "true");
    assert_eq!(server.orders().await, 1);
}
