//! The flows the README shows with curl, in process over the in-memory store,
//! so the README stays true.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use idempotency::{Config, IdempotencyManager, MemoryRepository};
use tower::ServiceExt;

fn app() -> Router {
    let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())
        .unwrap()
        .scoped("http-example")
        .unwrap();
    idempotency_http_server_example::app(manager)
}

async fn send(
    app: &Router,
    key: Option<&str>,
    body: &'static str,
) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
    let mut request = Request::post("/orders").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        serde_json::from_slice(&bytes).unwrap(),
    )
}

#[tokio::test]
async fn first_call_replay_mismatch_and_missing_key() {
    let app = app();
    let order = r#"{"item":"book","quantity":2}"#;
    let (status, headers, body) = send(&app, Some("order-7f3c"), order).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["location"], "/orders/1");
    assert!(headers.get("idempotency-replayed").is_none());
    assert_eq!(
        body,
        serde_json::json!({"id": 1, "item": "book", "quantity": 2})
    );

    let (status, headers, replay) = send(&app, Some("order-7f3c"), order).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotency-replayed"], "true");
    assert_eq!(headers["location"], "/orders/1");
    assert_eq!(replay, body);

    let (status, _, problem) =
        send(&app, Some("order-7f3c"), r#"{"item":"book","quantity":3}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(problem["type"].as_str().unwrap().ends_with("#key-reused"));

    let (status, _, problem) = send(&app, None, order).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(problem["type"].as_str().unwrap().ends_with("#missing-key"));

    let (status, _, problem) = send(&app, Some("has spaces"), order).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(problem["type"].as_str().unwrap().ends_with("#invalid-key"));

    // Validation errors are answers too: stored and replayed.
    let (status, _, _) = send(&app, Some("bad-qty"), r#"{"item":"book","quantity":0}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, headers, _) = send(&app, Some("bad-qty"), r#"{"item":"book","quantity":0}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(headers["idempotency-replayed"], "true");
}

#[tokio::test]
async fn retry_in_flight_is_409_then_replays() {
    let app = app();
    let slow = r#"{"item":"lamp","quantity":1,"delay_ms":60000}"#;
    // Virtual time: the handler's 60 s of "work" pass only when we advance.
    tokio::time::pause();
    let first = send(&app, Some("slow-1"), slow);
    let mut first = std::pin::pin!(first);
    // Drive the first request into its handler (the in-memory store answers
    // at once, so it parks on the handler's sleep).
    for _ in 0..10 {
        assert!(futures::poll!(first.as_mut()).is_pending());
    }
    let (status, headers, problem) = send(&app, Some("slow-1"), slow).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(headers["retry-after"], "1");
    assert!(problem["type"].as_str().unwrap().ends_with("#in-progress"));

    tokio::time::advance(std::time::Duration::from_secs(61)).await;
    let (status, _, order) = first.await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, replay) = send(&app, Some("slow-1"), slow).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotency-replayed"], "true");
    assert_eq!(replay, order);
}

#[tokio::test]
async fn search_is_opted_out_and_callers_are_isolated() {
    let app = app();
    let order = r#"{"item":"pen","quantity":1}"#;
    let as_caller = |caller: &'static str| {
        Request::post("/orders")
            .header("idempotency-key", "same-key")
            .header("x-api-key", caller)
            .body(Body::from(order))
            .unwrap()
    };
    let alice = app.clone().oneshot(as_caller("alice")).await.unwrap();
    let bob = app.clone().oneshot(as_caller("bob")).await.unwrap();
    assert_eq!(alice.headers()["location"], "/orders/1");
    assert_eq!(bob.headers()["location"], "/orders/2");
    assert!(bob.headers().get("idempotency-replayed").is_none());

    let search = Request::post("/search")
        .body(Body::from(r#"{"item":"pen"}"#))
        .unwrap();
    let found = app.clone().oneshot(search).await.unwrap();
    assert_eq!(found.status(), StatusCode::OK);
    let found: serde_json::Value =
        serde_json::from_slice(&found.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(found.as_array().unwrap().len(), 2);
}
