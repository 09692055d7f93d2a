//! Broker scenarios: consumers of `idempotency-consumers` on real brokers
//! (SQS: the harness's moto server; Kafka: librdkafka's mock cluster), three
//! at a time over one store, through faults: a consumer killed mid-batch and
//! restarted, handlers slower than the broker's redelivery timer, every
//! message published twice. The ledger checks each key's effect exactly once
//! (a killed consumer's unrecorded effect allowed once more, as the
//! contract states), every message acknowledged (the queue empty, the
//! partitions committed to their ends), none lost, no poll past its bound.
//! A failure prints the seed (`IDEMPOTENCY_RELIABILITY_SEED` replays it) and
//! the failing key's history. Broker restarts: RabbitMQ's for real (a
//! dedicated broker, stopped and started), Kafka's mock and SQS's moto
//! differently (see RELIABILITY.md, Brokers).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "brokers/kafka.rs"]
mod kafka;
#[path = "brokers/ledger.rs"]
mod ledger;
#[cfg(feature = "rabbitmq")]
#[path = "brokers/rabbitmq.rs"]
mod rabbitmq;
#[path = "brokers/sqs.rs"]
mod sqs;

use std::future::Future;
use std::pin::Pin;

use ledger::Row;

type Scenario = fn(u64) -> Pin<Box<dyn Future<Output = Row>>>;

fn seed() -> u64 {
    std::env::var("IDEMPOTENCY_RELIABILITY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>)
}

/// Runs the scenarios at once (each on its own queue or cluster), prints
/// their rows, then fails with every broken verdict.
async fn run(scenarios: &[Scenario]) {
    let seed = seed();
    let rows = futures::future::join_all(scenarios.iter().map(|s| s(seed))).await;
    let mut failures = Vec::new();
    let mut out = format!("seed {seed}\n{}\n", Row::header());
    for row in &rows {
        out.push_str(&row.row());
        out.push('\n');
        if !row.setting.note.is_empty() {
            out.push_str(&format!("  ({})\n", row.setting.note));
        }
        if let Some(error) = &row.first_poll_error {
            out.push_str(&format!("  (first poll error: {error})\n"));
        }
        if let Err(e) = row.verdict() {
            failures.push(e);
        }
    }
    println!("{out}");
    assert!(
        failures.is_empty(),
        "replay with IDEMPOTENCY_RELIABILITY_SEED={seed}:\n{}",
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqs() {
    run(&[
        |s| Box::pin(sqs::killed_and_restarted(s)),
        |s| Box::pin(sqs::slower_than_visibility(s)),
        |s| Box::pin(sqs::sent_twice(s)),
        |s| Box::pin(sqs::server_paused(s)),
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka() {
    run(&[
        |s| Box::pin(kafka::killed_and_restarted(s)),
        |s| Box::pin(kafka::slower_than_poll_interval(s)),
        |s| Box::pin(kafka::sent_twice(s)),
        |s| Box::pin(kafka::broker_down_and_up(s)),
    ])
    .await;
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq() {
    run(&[
        |s| Box::pin(rabbitmq::killed_and_restarted(s)),
        |s| Box::pin(rabbitmq::slower_than_consumer_timeout(s)),
        |s| Box::pin(rabbitmq::sent_twice(s)),
        |s| Box::pin(rabbitmq::broker_restarted(s)),
    ])
    .await;
}
