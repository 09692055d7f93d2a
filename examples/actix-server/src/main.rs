//! Runs the example order service on actix-web.
//!
//! Environment:
//! - `IDEMPOTENCY_STORE_URL`: where idempotency records live (default `memory:`;
//!   `redis://…`, `postgres://…`, `dynamodb://TABLE?…` work too);
//! - `BIND`: the listening address (default `127.0.0.1:3001`);
//! - `RUST_LOG`: log filter (default `info`).

use actix_web::{web, HttpServer};
use idempotency::{Config, IdempotencyManager, StoreKind};
use idempotency_actix_server_example::{app, idempotency, Shop};
use tracing_subscriber::EnvFilter;

#[actix_web::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let url = idempotency::store_url_from_env();
    let addr = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3001".to_owned());

    // Only the kind of store is logged: the URL may carry a password.
    let kind = StoreKind::from_url(&url)?;
    let store = idempotency::connect(&url).await?;
    let manager = IdempotencyManager::new(store, Config::default())?.scoped("actix-example")?;
    let (layer, shop) = (idempotency(manager), web::Data::new(Shop::default()));

    tracing::info!(store = ?kind, "listening on http://{addr}");
    HttpServer::new(move || app(layer.clone(), shop.clone()))
        .bind(addr)?
        .run()
        .await?;
    Ok(())
}
