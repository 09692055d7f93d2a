//! The example's actix-web server on a real socket, over a real Redis server
//! from the test harness, driven by a real HTTP client (reqwest): each test
//! its own server and its own random key prefix.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::{web, HttpServer};
use idempotency::{Config, IdempotencyManager};
use idempotency_actix_server_example::{app, idempotency, Shop};
use idempotency_conformance::containers::{self, unique_namespace};
use idempotency_redis::RedisRepository;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// How long a test waits for a slow order's stored response at most.
const PATIENCE: Duration = Duration::from_secs(30);

struct Server {
    base: String,
    shop: web::Data<Shop>,
    client: reqwest::Client,
}

impl Server {
    /// The example app with two workers on 127.0.0.1, records in Redis.
    async fn start() -> Server {
        let redis = containers::redis()
            .await
            .expect("a Redis server from the harness (see docs/testing.md)");
        let repo = RedisRepository::connect(redis.url())
            .await
            .expect("connect to the harness's Redis server");
        let config = Config {
            key_prefix: unique_namespace("actix"),
            ..Config::default()
        };
        let manager = IdempotencyManager::new(Arc::new(repo), config).unwrap();
        let (layer, shop) = (idempotency(manager), web::Data::new(Shop::default()));
        let app_shop = shop.clone();
        let server = HttpServer::new(move || app(layer.clone(), app_shop.clone()))
            .workers(2)
            .bind(("127.0.0.1", 0))
            .unwrap();
        let addr = server.addrs()[0];
        actix_web::rt::spawn(server.run());
        Server {
            base: format!("http://{addr}"),
            shop,
            client: reqwest::Client::new(),
        }
    }

    fn order(&self, key: Option<&str>, api_key: &str, body: Value) -> reqwest::RequestBuilder {
        let request = self
            .client
            .post(format!("{}/orders", self.base))
            .header("x-api-key", api_key)
            .json(&body);
        match key {
            Some(key) => request.header("idempotency-key", key),
            None => request,
        }
    }
}

async fn answer(
    request: reqwest::RequestBuilder,
) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let response = request.send().await.unwrap();
    let (status, headers) = (response.status(), response.headers().clone());
    (status, headers, response.json().await.unwrap())
}

#[actix_web::test]
async fn first_request_runs_retries_replay_and_reuse_is_refused() {
    let server = Server::start().await;
    let book = json!({"item": "book", "quantity": 2});

    let (status, headers, first) = answer(server.order(Some("k-1"), "a", book.clone())).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotency-replayed").is_none());
    assert_eq!(headers["location"], "/orders/1");

    let (status, headers, again) = answer(server.order(Some("k-1"), "a", book.clone())).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotency-replayed"], "true");
    assert_eq!(headers["location"], "/orders/1");
    assert_eq!(again, first);

    let other = json!({"item": "book", "quantity": 3});
    let (status, headers, problem) = answer(server.order(Some("k-1"), "a", other)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(
        problem["type"].as_str().unwrap().ends_with("key-reused"),
        "{problem}"
    );

    let (status, _, _) = answer(server.order(None, "a", book.clone())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // Not protected: GET, and the POST the app opted out.
    let list = server
        .client
        .get(format!("{}/orders", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(list.status(), StatusCode::OK);
    let search = server
        .client
        .post(format!("{}/search", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(search.status(), StatusCode::OK);
    assert_eq!(server.shop.created(), 1);
}

#[actix_web::test]
async fn callers_with_other_credentials_never_share_a_key() {
    let server = Server::start().await;
    let book = json!({"item": "book", "quantity": 1});
    let (_, _, a) = answer(server.order(Some("same"), "alice", book.clone())).await;
    let (status, headers, b) = answer(server.order(Some("same"), "bob", book)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotency-replayed").is_none());
    assert_ne!(a["id"], b["id"]);
    assert_eq!(server.shop.created(), 2);
}

#[actix_web::test]
async fn client_errors_a_retry_should_not_see_again_are_not_stored() {
    let server = Server::start().await;
    // 422 is stored (deterministic); a malformed body is refused by actix's
    // JSON extractor with 400, also stored.
    let zero = json!({"item": "book", "quantity": 0});
    let (status, _, _) = answer(server.order(Some("z"), "a", zero.clone())).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, headers, _) = answer(server.order(Some("z"), "a", zero)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(headers["idempotency-replayed"], "true");
    assert_eq!(server.shop.created(), 0);
}

#[actix_web::test]
async fn a_duplicate_while_the_first_runs_is_told_to_retry_later() {
    let server = Server::start().await;
    let slow = json!({"item": "piano", "quantity": 1, "delay_ms": 1500});
    let (a, b) = tokio::join!(
        answer(server.order(Some("slow"), "a", slow.clone())),
        answer(server.order(Some("slow"), "a", slow)),
    );
    let (mut statuses, in_progress) = (
        vec![a.0, b.0],
        if a.0 == StatusCode::CONFLICT { a } else { b },
    );
    statuses.sort();
    assert_eq!(statuses, [StatusCode::CREATED, StatusCode::CONFLICT]);
    assert!(
        in_progress.1.contains_key("retry-after"),
        "{}",
        in_progress.2
    );
    assert_eq!(server.shop.created(), 1);
}

#[actix_web::test]
async fn a_client_that_gives_up_does_not_undo_the_protection() {
    let server = Server::start().await;
    let slow = json!({"item": "piano", "quantity": 1, "delay_ms": 1000});
    let impatient = server
        .order(Some("gone"), "a", slow.clone())
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(impatient.unwrap_err().is_timeout());

    // The handler goes on without its client; its retry, once the order is
    // made, gets the stored response instead of a second order. (actix-web's
    // HTTP/1 dispatcher finishes a handler whose client left; the middleware
    // detaches it anyway, for wherever actix drops a request's future.)
    let started = Instant::now();
    let (status, headers, order) = loop {
        let answered = answer(server.order(Some("gone"), "a", slow.clone())).await;
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
    assert_eq!(order["id"], 1);
    assert_eq!(server.shop.created(), 1);
}
