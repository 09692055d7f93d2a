//! A Kafka consumer that charges each order once, while the producer sends
//! some orders twice.
//!
//! ```bash
//! # Against librdkafka's mock cluster (in-process, speaking the Kafka protocol):
//! cargo run -p idempotency-consumers --features kafka --example kafka
//! # Against your own cluster:
//! KAFKA_BROKERS=localhost:9092 cargo run -p idempotency-consumers --features kafka --example kafka
//! ```
//!
//! It creates a topic of three partitions (on your cluster: `orders-<pid>`,
//! auto-created, or create it first), produces 20 orders keyed by their id (5
//! of them twice, as a producer retrying after a lost acknowledgement does),
//! consumes until every message is answered and committed, and exits non-zero
//! unless every order was charged exactly once.
#![allow(clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_consumers::kafka::rdkafka::mocking::MockCluster;
use idempotency_consumers::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotency_consumers::kafka::rdkafka::{ClientConfig, Message};
use idempotency_consumers::kafka::{KafkaConsumer, KeySource};
use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};

const ORDERS: usize = 20;
const SENT_TWICE: usize = 5;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let topic = format!("orders-{}", std::process::id());
    // The mock cluster lives as long as `_mock`.
    let (brokers, _mock) = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) => (brokers, None),
        Err(_) => {
            let mock = MockCluster::new(1)?;
            mock.create_topic(&topic, 3, 1)?;
            (mock.bootstrap_servers(), Some(mock))
        }
    };
    publish(&brokers, &topic).await?;

    // The store: in memory here; any store of the `idempotency` crate in production.
    let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("billing-{}", std::process::id()))
        .set("auto.offset.reset", "earliest");
    let consumer = KafkaConsumer::builder(manager, client)
        .topics([topic.as_str()])
        .key(KeySource::MessageKey)
        .linger(Duration::from_millis(200))
        .on_reject(|rejected| async move {
            eprintln!(
                "rejected offset {} ({}: {})",
                rejected.message.offset(),
                rejected.reason,
                rejected.detail
            );
            Ok(())
        })
        .build()?;

    let charges: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let mut answered = 0;
    // Until every message is answered (bounded: at most 100 polls).
    for _ in 0..100 {
        let report = consumer
            .poll_once(|message, _ctx| {
                let charges = charges.clone();
                async move {
                    let order =
                        String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
                    *charges
                        .lock()
                        .expect("the ledger")
                        .entry(order)
                        .or_default() += 1;
                    Ok::<_, HandlerError<String>>(message.payload().map_or(0, <[u8]>::len))
                }
            })
            .await?;
        answered += report.acked + report.rejected;
        if answered >= ORDERS + SENT_TWICE && report.held == 0 {
            break;
        }
    }

    let charges = charges.lock().expect("the ledger").clone();
    println!("answered {answered} messages for {} orders", charges.len());
    for (order, times) in &charges {
        println!("  {order}: charged {times}×");
    }
    if charges.len() == ORDERS && charges.values().all(|&n| n == 1) {
        println!("every order charged exactly once ✔");
        Ok(())
    } else {
        Err(format!("expected {ORDERS} orders charged once").into())
    }
}

/// Produces the orders, the first `SENT_TWICE` of them twice.
async fn publish(brokers: &str, topic: &str) -> Result<(), Box<dyn std::error::Error>> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("message.timeout.ms", "10000")
        .create()?;
    for i in (0..ORDERS).chain(0..SENT_TWICE) {
        let key = format!("order-{i}");
        let payload = format!("{{\"order\":{i},\"amount\":{}}}", 10 + i);
        producer
            .send(
                FutureRecord::to(topic).key(&key).payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    Ok(())
}
