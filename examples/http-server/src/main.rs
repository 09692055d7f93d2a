//! Runs the example order service.
//!
//! Environment:
//! - `IDEMPOTENCY_STORE_URL`: where idempotency records live (default `memory:`;
//!   `redis://…`, `postgres://…`, `dynamodb://TABLE?…` work too);
//! - `BIND`: the listening address (default `127.0.0.1:3000`);
//! - `RUST_LOG`: log filter (default `info`).

use std::net::SocketAddr;

use idempotency::{Config, IdempotencyManager, StoreKind};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let url = idempotency::store_url_from_env();
    let addr: SocketAddr = std::env::var("BIND")
        .unwrap_or_else(|_| "127.0.0.1:3000".to_owned())
        .parse()?;

    // Only the kind of store is logged: the URL may carry a password.
    let kind = StoreKind::from_url(&url)?;
    let store = idempotency::connect(&url).await?;
    let manager = IdempotencyManager::new(store, Config::default())?.scoped("http-example")?;
    let app = idempotency_http_server_example::app(manager);

    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(store = ?kind, "listening on http://{addr}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
