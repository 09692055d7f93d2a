//! A RabbitMQ consumer that charges each order once, while the producer
//! publishes some orders twice.
//!
//! ```bash
//! # Against the test harness's broker (a RabbitMQ container, as the tests use):
//! cargo run -p idempotency-consumers --features rabbitmq --example rabbitmq
//! # Against your own broker:
//! RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run -p idempotency-consumers --features rabbitmq --example rabbitmq
//! ```
//!
//! It declares a queue, publishes 20 orders with their id as `message_id` (5
//! of them twice, as a producer retrying after a lost confirm does), consumes
//! until the queue is empty, and exits non-zero unless every order was
//! charged exactly once.
#![allow(clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_consumers::rabbitmq::lapin::options::{
    BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotency_consumers::rabbitmq::lapin::types::{FieldTable, ShortString};
use idempotency_consumers::rabbitmq::lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use idempotency_consumers::rabbitmq::{KeySource, RabbitConsumer};
use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};

const ORDERS: usize = 20;
const SENT_TWICE: usize = 5;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = match std::env::var("RABBITMQ_URL") {
        Ok(url) => url,
        Err(_) => idempotency_conformance::containers::rabbitmq()
            .await?
            .url()
            .to_owned(),
    };
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let queue = format!("orders-{}", std::process::id());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    publish(&channel, &queue).await?;

    // The store: in memory here; any store of the `idempotency` crate in production.
    let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    let consumer = RabbitConsumer::builder(manager, queue.as_str())
        .prefetch(8)
        .keys(KeySource::MessageId)
        .build()?;

    let charges: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let handler = |message: Arc<idempotency_consumers::rabbitmq::Message>, _ctx| {
        let charges = charges.clone();
        async move {
            let order = message.key.clone();
            *charges
                .lock()
                .expect("the ledger")
                .entry(order)
                .or_default() += 1;
            Ok::<_, HandlerError<String>>(message.body.len())
        }
    };
    // Stop once the queue has nothing ready (bounded: 30 s); the poll under
    // way is finished and acknowledged first.
    let drained = async {
        for _ in 0..300 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if ready(&channel, &queue).await.is_ok_and(|n| n == 0) {
                return;
            }
        }
    };
    consumer.run(&connection, handler, drained).await?;

    let left = ready(&channel, &queue).await?;
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    let charges = charges.lock().expect("the ledger").clone();
    println!(
        "{} orders charged, {left} messages left in the queue",
        charges.len()
    );
    for (order, times) in &charges {
        println!("  {order}: charged {times}×");
    }
    if left == 0 && charges.len() == ORDERS && charges.values().all(|&n| n == 1) {
        println!("every order charged exactly once ✔");
        Ok(())
    } else {
        Err(format!("expected {ORDERS} orders charged once and an empty queue").into())
    }
}

/// Publishes the orders, the first `SENT_TWICE` of them twice, each confirmed.
async fn publish(channel: &Channel, queue: &str) -> Result<(), Box<dyn std::error::Error>> {
    for i in (0..ORDERS).chain(0..SENT_TWICE) {
        let properties =
            BasicProperties::default().with_message_id(ShortString::from(format!("order-{i}")));
        let body = format!("{{\"order\":{i},\"amount\":{}}}", 10 + i);
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                properties,
            )
            .await?
            .await?;
    }
    Ok(())
}

/// Messages ready in `queue` (not those delivered and not yet acknowledged).
async fn ready(channel: &Channel, queue: &str) -> Result<u32, Box<dyn std::error::Error>> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    Ok(channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?
        .message_count())
}
