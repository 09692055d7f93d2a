//! A small gRPC order service on tonic whose unary `shop.Orders/Create` is
//! made idempotent by [`idempotency_http::IdempotencyLayer::grpc`]: clients
//! send an `idempotency-key` metadata entry and may retry as often as they
//! like; each order is created once. `shop.Orders/Watch` streams and is left
//! alone (see [`idempotency_http::grpc`] for why).
//!
//! Callers are told apart by the `authorization` metadata entry (digested), so
//! two clients using the same key never see each other's orders.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::IdempotencyManager;
use idempotency_http::grpc::TonicLayer;
use idempotency_http::IdempotencyLayer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// The generated messages, server and client of `proto/shop.proto`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::unwrap_used)]
pub mod proto {
    tonic::include_proto!("shop");
}

use proto::orders_server::{Orders, OrdersServer};
use proto::{CreateOrder, Order, WatchOrders};

/// The longest simulated work a call may ask for.
const MAX_DELAY: Duration = Duration::from_secs(60);

/// The shop's state: orders in memory (the point is the idempotency store, not
/// the order store), and how often `Create` ran.
#[derive(Debug, Default)]
pub struct Shop {
    last_id: AtomicU64,
    calls: AtomicU64,
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

    /// How many times `Create` ran, failed calls included.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

/// The `shop.Orders` service over a [`Shop`].
#[derive(Debug, Clone)]
pub struct OrderService(pub Arc<Shop>);

#[tonic::async_trait]
impl Orders for OrderService {
    async fn create(&self, request: Request<CreateOrder>) -> Result<Response<Order>, Status> {
        self.0.calls.fetch_add(1, Ordering::SeqCst);
        let order = request.into_inner();
        if order.quantity == 0 {
            return Err(Status::invalid_argument("quantity must be at least 1"));
        }
        if order.item == "out-of-stock" {
            // Transient: the layer does not store it, a retry runs again.
            return Err(Status::unavailable("the warehouse is not answering"));
        }
        let delay = Duration::from_millis(order.delay_ms);
        if delay > MAX_DELAY {
            return Err(Status::invalid_argument("delay_ms is at most 60000"));
        }
        tokio::time::sleep(delay).await;
        let created = Order {
            id: self.0.last_id.fetch_add(1, Ordering::SeqCst) + 1,
            item: order.item,
            quantity: order.quantity,
        };
        self.0
            .orders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(created.clone());
        Ok(Response::new(created))
    }

    type WatchStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<Order, Status>> + Send>>;

    async fn watch(
        &self,
        _request: Request<WatchOrders>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let orders = self
            .0
            .orders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Ok(Response::new(Box::pin(tokio_stream::iter(
            orders.into_iter().map(Ok),
        ))))
    }
}

/// The idempotency layer of the service over `manager`: `Create` protected,
/// everything else untouched.
pub fn idempotency(manager: IdempotencyManager) -> TonicLayer {
    IdempotencyLayer::grpc(manager)
        .unary("/shop.Orders/Create")
        .tonic()
}

/// Serves `shop` behind the layer on `listener` until `shutdown` resolves.
///
/// # Errors
/// A transport error of the server.
pub async fn serve(
    listener: TcpListener,
    manager: IdempotencyManager,
    shop: Arc<Shop>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .layer(idempotency(manager))
        .add_service(OrdersServer::new(OrderService(shop)))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
}
