//! Runs the example gRPC order service.
//!
//! Environment:
//! - `IDEMPOTENCY_STORE_URL`: where idempotency records live (default `memory:`;
//!   `redis://…`, `postgres://…`, `dynamodb://TABLE?…` work too);
//! - `BIND`: the listening address (default `127.0.0.1:50051`);
//! - `RUST_LOG`: log filter (default `info`).

use std::sync::Arc;

use idempotency::{Config, IdempotencyManager, StoreKind};
use idempotency_grpc_server_example::{serve, Shop};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let url = idempotency::store_url_from_env();
    let addr = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:50051".to_owned());

    // Only the kind of store is logged: the URL may carry a password.
    let kind = StoreKind::from_url(&url)?;
    let store = idempotency::connect(&url).await?;
    let manager = IdempotencyManager::new(store, Config::default())?.scoped("grpc-example")?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(store = ?kind, "gRPC on http://{addr}");
    serve(listener, manager, Arc::new(Shop::default()), async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
