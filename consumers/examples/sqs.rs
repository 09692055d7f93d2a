//! An SQS consumer that charges each order once, while the producer sends
//! some orders twice and SQS redelivers what it likes.
//!
//! ```bash
//! # Against the test harness's SQS (a moto container, as the tests use):
//! cargo run -p idempotency-consumers --features sqs --example sqs
//! # Against your own SQS-compatible endpoint (credentials from the AWS_* variables):
//! SQS_ENDPOINT=http://127.0.0.1:4566 AWS_REGION=us-east-1 \
//!     cargo run -p idempotency-consumers --features sqs --example sqs
//! ```
//!
//! It creates a queue, publishes 20 orders (5 of them twice, as a producer
//! retrying after a lost acknowledgement does), consumes until the queue is
//! empty, and exits non-zero unless every order was charged exactly once.
#![allow(clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use aws_sdk_sqs::Client;
use idempotency_consumers::sqs::{KeySource, SqsConsumer};
use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};

const ORDERS: usize = 20;
const SENT_TWICE: usize = 5;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = client().await?;
    let queue = client
        .create_queue()
        .queue_name(format!("orders-{}", std::process::id()))
        .attributes(QueueAttributeName::VisibilityTimeout, "30")
        .send()
        .await?
        .queue_url()
        .ok_or("CreateQueue returned no URL")?
        .to_owned();
    publish(&client, &queue).await?;

    // The store: in memory here; any store of the `idempotency` crate in production.
    // Handlers may take up to a minute: the consumer keeps their messages
    // invisible (the queue says 30 s) as the lease is extended.
    let config = Config {
        processing_timeout: Duration::from_secs(60),
        lease_extension_interval: Some(Duration::from_secs(20)),
        ..Config::default()
    };
    let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config)?;
    let consumer = SqsConsumer::builder(client.clone(), manager, &queue)
        .key(KeySource::attribute("order-id"))
        .wait_time(Duration::from_secs(1))
        .build()
        .await?;

    let charges: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let (mut received, mut empty_polls) = (0, 0);
    // Until two receives in a row come back empty (bounded: at most 50 polls).
    for _ in 0..50 {
        let report = consumer
            .poll_once(|message, _ctx| {
                let charges = charges.clone();
                async move {
                    let order = message
                        .attributes
                        .get("order-id")
                        .cloned()
                        .unwrap_or_default();
                    *charges
                        .lock()
                        .expect("the ledger")
                        .entry(order)
                        .or_default() += 1;
                    Ok::<_, HandlerError<String>>(format!("charged {}", message.body))
                }
            })
            .await?;
        received += report.messages.len();
        empty_polls = if report.messages.is_empty() {
            empty_polls + 1
        } else {
            0
        };
        if empty_polls == 2 {
            break;
        }
    }

    let charges = charges.lock().expect("the ledger").clone();
    println!("received {received} messages for {} orders", charges.len());
    for (order, times) in &charges {
        println!("  {order}: charged {times}×");
    }
    let once = charges.len() == ORDERS && charges.values().all(|&n| n == 1);
    client.delete_queue().queue_url(&queue).send().await?;
    if once && received == ORDERS + SENT_TWICE {
        println!("every order charged exactly once ✔");
        Ok(())
    } else {
        Err(format!(
            "expected {ORDERS} orders charged once from {} messages",
            ORDERS + SENT_TWICE
        )
        .into())
    }
}

/// Publishes the orders, the first `SENT_TWICE` of them twice.
async fn publish(client: &Client, queue: &str) -> Result<(), Box<dyn std::error::Error>> {
    for i in (0..ORDERS).chain(0..SENT_TWICE) {
        let order = MessageAttributeValue::builder()
            .data_type("String")
            .string_value(format!("order-{i}"))
            .build()?;
        client
            .send_message()
            .queue_url(queue)
            .message_body(format!("{{\"order\":{i},\"amount\":{}}}", 10 + i))
            .message_attributes("order-id", order)
            .send()
            .await?;
    }
    Ok(())
}

/// A client for `SQS_ENDPOINT`, or for the test harness's SQS server.
async fn client() -> Result<Client, Box<dyn std::error::Error>> {
    let (endpoint, region, credentials) = match std::env::var("SQS_ENDPOINT") {
        Ok(endpoint) => {
            let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into());
            let key = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "test".into());
            let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "test".into());
            (
                endpoint,
                region,
                Credentials::new(key, secret, None, None, "env"),
            )
        }
        Err(_) => {
            let server = idempotency_conformance::containers::sqs().await?;
            let credentials = Credentials::new(
                server.access_key_id(),
                server.secret_access_key(),
                None,
                None,
                "harness",
            );
            (
                server.endpoint().to_owned(),
                server.region().to_owned(),
                credentials,
            )
        }
    };
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region))
        .endpoint_url(endpoint)
        .credentials_provider(credentials)
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Ok(Client::from_conf(config))
}
