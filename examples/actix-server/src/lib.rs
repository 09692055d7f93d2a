//! A small order service on actix-web whose `POST /orders` is made idempotent
//! by [`idempotency_http::IdempotencyLayer`] used as actix middleware: clients
//! send an `Idempotency-Key` and may retry as often as they like; each order
//! is created once.
//!
//! | route | idempotency |
//! |---|---|
//! | `POST /orders` | key required; JSON body `{"item": "…", "quantity": N, "delay_ms": N}` (`delay_ms` simulates slow work) |
//! | `GET /orders` | not a protected method: untouched |
//! | `POST /search` | opted out ([`Protection::Skip`]): a read-only POST |
//!
//! Callers are told apart by the `X-Api-Key` header (digested), so two API
//! clients using the same key never see each other's orders.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use actix_web::{web, App, HttpResponse};
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
    /// request is still running (or a client give up).
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

/// The shop's state, shared by every worker: orders in memory (the point is
/// the idempotency store, not the order store).
#[derive(Debug, Default)]
pub struct Shop {
    last_id: AtomicU64,
    orders: Mutex<Vec<Order>>,
}

impl Shop {
    /// How many orders were created.
    pub fn created(&self) -> usize {
        self.orders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// The idempotency middleware of the app over `manager`.
pub fn idempotency(manager: IdempotencyManager) -> IdempotencyLayer {
    IdempotencyLayer::new(manager)
        .caller_identity(caller_from_header(
            idempotency_http::http::HeaderName::from_static("x-api-key"),
        ))
        .route("/search", Protection::Skip)
}

/// The app's routes and state; wrap the app in [`idempotency()`]:
///
/// ```no_run
/// # async fn serve(manager: idempotency::IdempotencyManager) -> std::io::Result<()> {
/// use actix_web::{web, App, HttpServer};
/// use idempotency_actix_server_example::{configure, idempotency, Shop};
///
/// let (layer, shop) = (idempotency(manager), web::Data::new(Shop::default()));
/// HttpServer::new(move || App::new().wrap(layer.clone()).configure(configure(shop.clone())))
///     .bind(("127.0.0.1", 8080))?
///     .run()
///     .await
/// # }
/// ```
pub fn configure(shop: web::Data<Shop>) -> impl FnOnce(&mut web::ServiceConfig) {
    move |config| {
        config
            .app_data(shop)
            .route("/orders", web::post().to(create_order))
            .route("/orders", web::get().to(list_orders))
            .route("/search", web::post().to(search));
    }
}

/// Convenience for tests and `main`: the whole app over `manager`.
pub fn app(
    layer: IdempotencyLayer,
    shop: web::Data<Shop>,
) -> App<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    App::new().wrap(layer).configure(configure(shop))
}

async fn create_order(shop: web::Data<Shop>, order: web::Json<NewOrder>) -> HttpResponse {
    let order = order.into_inner();
    if order.quantity == 0 {
        return HttpResponse::UnprocessableEntity()
            .json(serde_json::json!({ "error": "quantity must be at least 1" }));
    }
    let delay = Duration::from_millis(order.delay_ms);
    if delay > MAX_DELAY {
        return HttpResponse::BadRequest()
            .json(serde_json::json!({ "error": "delay_ms is at most 60000" }));
    }
    actix_web::rt::time::sleep(delay).await;
    let created = Order {
        id: shop.last_id.fetch_add(1, Ordering::SeqCst) + 1,
        item: order.item,
        quantity: order.quantity,
    };
    shop.orders
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(created.clone());
    HttpResponse::Created()
        .insert_header(("location", format!("/orders/{}", created.id)))
        .json(created)
}

async fn list_orders(shop: web::Data<Shop>) -> HttpResponse {
    let orders = shop
        .orders
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    HttpResponse::Ok().json(orders)
}

async fn search() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "results": [] }))
}
