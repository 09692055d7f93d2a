//! A small order service whose `POST /orders` is made idempotent by
//! [`idempotency_http::IdempotencyLayer`]: clients send an `Idempotency-Key`
//! and may retry as often as they like; each order is created once.
//!
//! | route | idempotency |
//! |---|---|
//! | `POST /orders` | key required; JSON body `{"item": "…", "quantity": N, "delay_ms": N}` (`delay_ms` simulates slow work) |
//! | `GET /orders`, `GET /orders/{id}` | not a protected method: untouched |
//! | `POST /search` | opted out ([`Protection::Skip`]): a read-only POST |
//! | `GET /health` | untouched |
//!
//! Callers are told apart by the `X-Api-Key` header (digested), so two API
//! clients using the same key never see each other's orders.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency::IdempotencyManager;
use idempotency_http::{caller_from_header, IdempotencyLayer, Protection};
use serde::{Deserialize, Serialize};

/// The longest simulated work a request may ask for.
const MAX_DELAY: Duration = Duration::from_secs(60);

/// A new order, as posted.
#[derive(Debug, Deserialize)]
struct NewOrder {
    item: String,
    quantity: u32,
    /// Simulated processing time, to watch a retry arrive while the first
    /// request is still running.
    #[serde(default)]
    delay_ms: u64,
}

/// A created order.
#[derive(Debug, Clone, Serialize)]
struct Order {
    id: u64,
    item: String,
    quantity: u32,
}

/// The shop's state: orders in memory (the point is the idempotency store,
/// not the order store).
#[derive(Debug, Default)]
struct Shop {
    last_id: AtomicU64,
    orders: Mutex<BTreeMap<u64, Order>>,
}

/// The application: routes, the idempotency layer over `manager`, state.
pub fn app(manager: IdempotencyManager) -> Router {
    let idempotency = IdempotencyLayer::new(manager)
        .caller_identity(caller_from_header(HeaderName::from_static("x-api-key")))
        .route("/search", Protection::Skip);
    Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .route("/orders/{id}", get(get_order))
        .route("/search", post(search))
        // `Router::layer` runs the layer after routing, so it scopes records by
        // the matched route template (`MatchedPath`, feature `axum`).
        .layer(idempotency)
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(Shop::default()))
}

fn problem(status: StatusCode, detail: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        serde_json::json!({
            "type": "about:blank",
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": detail,
        })
        .to_string(),
    )
        .into_response()
}

async fn create_order(State(shop): State<Arc<Shop>>, body: Bytes) -> Response {
    let new: NewOrder = match serde_json::from_slice(&body) {
        Ok(new) => new,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &format!("invalid order: {e}")),
    };
    if new.quantity == 0 {
        return problem(StatusCode::BAD_REQUEST, "quantity must be at least 1");
    }
    if new.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(new.delay_ms).min(MAX_DELAY)).await;
    }
    let id = shop.last_id.fetch_add(1, Ordering::SeqCst) + 1;
    let order = Order {
        id,
        item: new.item,
        quantity: new.quantity,
    };
    shop.orders
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(id, order.clone());
    tracing::info!(id, item = %order.item, quantity = order.quantity, "order created");
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        Json(order),
    )
        .into_response()
}

async fn list_orders(State(shop): State<Arc<Shop>>) -> Json<Vec<Order>> {
    let orders = shop.orders.lock().unwrap_or_else(PoisonError::into_inner);
    Json(orders.values().cloned().collect())
}

async fn get_order(State(shop): State<Arc<Shop>>, Path(id): Path<u64>) -> Response {
    let orders = shop.orders.lock().unwrap_or_else(PoisonError::into_inner);
    match orders.get(&id) {
        Some(order) => Json(order.clone()).into_response(),
        None => problem(StatusCode::NOT_FOUND, &format!("no order {id}")),
    }
}

#[derive(Debug, Deserialize)]
struct Search {
    item: String,
}

async fn search(State(shop): State<Arc<Shop>>, body: Bytes) -> Response {
    let query: Search = match serde_json::from_slice(&body) {
        Ok(q) => q,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &format!("invalid search: {e}")),
    };
    let orders = shop.orders.lock().unwrap_or_else(PoisonError::into_inner);
    let found: Vec<Order> = orders
        .values()
        .filter(|o| o.item == query.item)
        .cloned()
        .collect();
    Json(found).into_response()
}
