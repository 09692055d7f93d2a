//! RabbitMQ scenarios, on the harness's broker (`containers::rabbitmq()`,
//! `IDEMPOTENCY_TEST_RABBITMQ_*` overrides). Each consumer runs `run` on a
//! connection of its own; the ledger learns each delivery's answer from the
//! `on_answer` hook (the consumer has no `poll_once`: no poll times).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_conformance::containers;
use idempotency_consumers::rabbitmq::lapin::options::{
    BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotency_consumers::rabbitmq::lapin::types::{FieldTable, ShortString};
use idempotency_consumers::rabbitmq::lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use idempotency_consumers::rabbitmq::{RabbitConsumer, RabbitError};
use idempotency_consumers::{Backoff, Disposition};
use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::ledger::{allow_unrecorded, handler_times, keys, until, Ledger, Row, Setting};

/// How long a scenario may take before what is left counts as unacked.
const LIMIT: Duration = Duration::from_secs(25);

type Times = Arc<std::collections::BTreeMap<String, Duration>>;

struct Queue {
    url: String,
    name: String,
    _connection: Connection,
    channel: Channel,
    store: Arc<MemoryRepository>,
    config: Config,
    /// Deliveries answered `Ack` (by every consumer).
    acked: Arc<AtomicU64>,
}

async fn connect(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("a RabbitMQ connection")
}

impl Queue {
    async fn new(lease: Duration) -> Queue {
        let server = containers::rabbitmq().await.expect("a RabbitMQ broker");
        let url = server.url().to_owned();
        let connection = connect(&url).await;
        let channel = connection.create_channel().await.expect("a channel");
        let name = server.unique_queue_name("brokers");
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("queue.declare");
        Queue {
            url,
            name,
            _connection: connection,
            channel,
            store: Arc::new(MemoryRepository::new()),
            config: Config {
                processing_timeout: lease,
                store_timeout: Duration::from_millis(500),
                ..Config::default()
            },
            acked: Arc::default(),
        }
    }

    /// Publishes one message per entry of `order` (its key the `message_id`).
    async fn publish(&self, order: &[String]) {
        for key in order {
            let properties =
                BasicProperties::default().with_message_id(ShortString::from(key.as_str()));
            self.channel
                .basic_publish(
                    "".into(),
                    self.name.as_str().into(),
                    BasicPublishOptions::default(),
                    format!("charge {key}").as_bytes(),
                    properties,
                )
                .await
                .expect("basic.publish")
                .await
                .expect("published");
        }
    }

    /// Messages ready in the queue (unacknowledged ones do not count).
    async fn ready(&self) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(self.name.as_str().into(), passive, FieldTable::default())
            .await
            .map_or(u32::MAX, |q| q.message_count())
    }

    fn consumer(&self, c: usize, ledger: &Ledger) -> (IdempotencyManager, RabbitConsumer) {
        let manager =
            IdempotencyManager::new(self.store.clone(), self.config.clone()).expect("a manager");
        let (ledger, acked) = (ledger.clone(), self.acked.clone());
        let consumer = RabbitConsumer::builder(manager.clone(), self.name.as_str())
            .prefetch(10)
            .min_retry_delay(Duration::from_millis(100))
            .operation_timeout(Duration::from_secs(3))
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_millis(500),
            })
            .on_answer(move |message, disposition| {
                if disposition.is_ack() {
                    acked.fetch_add(1, Ordering::SeqCst);
                }
                if disposition.is_retry() {
                    ledger.retried(1);
                }
                let what = match disposition {
                    Disposition::Ack(answer) => format!("ack {answer:?}"),
                    other => format!("{other:?}"),
                };
                ledger.delivered(&message.key, c, &what);
            })
            .build()
            .expect("a consumer");
        (manager, consumer)
    }
}

/// A running consumer: its connection (closed to kill it) and its task.
struct Running {
    connection: Arc<Connection>,
    task: JoinHandle<Result<(), RabbitError>>,
}

async fn spawn(
    queue: &Queue,
    c: usize,
    consumer: RabbitConsumer,
    ledger: &Ledger,
    times: &Times,
    mut stop: watch::Receiver<bool>,
) -> Running {
    let connection = Arc::new(connect(&queue.url).await);
    let (ledger, times, conn) = (ledger.clone(), times.clone(), connection.clone());
    let task = tokio::spawn(async move {
        let handler = move |message: Arc<idempotency_consumers::rabbitmq::Message>, _ctx| {
            let key = message.key.clone();
            let time = times.get(&key).copied().unwrap_or_default();
            let ledger = ledger.clone();
            async move {
                ledger.call(&key, c);
                tokio::time::sleep(time).await;
                ledger.apply(&key, c);
                Ok::<_, idempotency_core::HandlerError<String>>(1u32)
            }
        };
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        consumer.run(&conn, handler, shutdown).await
    });
    Running { connection, task }
}

/// Until every key has its effect, every delivery is acknowledged and the
/// queue is empty (or [`LIMIT`]); then the consumers stop (their channels
/// close: anything unacknowledged goes back to the queue), and the messages
/// left are counted.
async fn finish(
    queue: &Queue,
    ledger: &Ledger,
    keys: usize,
    messages: u64,
    running: Vec<Running>,
    stop: watch::Sender<bool>,
    started: Instant,
) -> u64 {
    until(started + LIMIT, || async {
        ledger.effected() == keys
            && queue.acked.load(Ordering::SeqCst) >= messages
            && queue.ready().await == 0
    })
    .await;
    let _ = stop.send(true);
    for r in running {
        match tokio::time::timeout(Duration::from_secs(10), r.task).await {
            Ok(Ok(Err(error))) => ledger.poll_error(99, error.to_string()),
            Ok(Ok(Ok(()))) => {}
            _ => ledger.poll_error(99, "a consumer did not stop".to_owned()),
        }
    }
    let left = u64::from(queue.ready().await);
    let _ = queue
        .channel
        .queue_delete(queue.name.as_str().into(), QueueDeleteOptions::default())
        .await;
    left
}

/// 1. A consumer killed mid-poll (its task aborted and its connection closed,
///    as when its process dies) once its handlers were called 1–8 times,
///    and a fresh one started: the broker requeues what it had not
///    acknowledged; keys it held come back after the lease (2 s).
pub(crate) async fn killed_and_restarted(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let queue = Queue::new(Duration::from_secs(2)).await;
    let keys = keys(60);
    let times = handler_times(&keys, seed, 20..200);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    queue.publish(&order).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let mut running = Vec::new();
    for c in 1..3 {
        let (_, consumer) = queue.consumer(c, &ledger);
        running.push(spawn(&queue, c, consumer, &ledger, &times, stopped.clone()).await);
    }
    let (victim_manager, victim) = queue.consumer(0, &ledger);
    let victim = spawn(&queue, 0, victim, &ledger, &times, stopped.clone()).await;
    let calls = rng.random_range(1..=8);
    let extra = Duration::from_millis(rng.random_range(0..150));
    let killed = until(started + Duration::from_secs(10), || async {
        ledger.calls_by(0) >= calls
    })
    .await;
    tokio::time::sleep(extra).await;
    victim.task.abort();
    let _ = victim.task.await;
    let _ = victim.connection.close(320, "killed".into()).await;
    allow_unrecorded(&ledger, &victim_manager, 0).await;
    let (_, fresh) = queue.consumer(3, &ledger);
    running.push(spawn(&queue, 3, fresh, &ledger, &times, stopped.clone()).await);
    let messages = order.len() as u64;
    let unacked = finish(
        &queue,
        &ledger,
        keys.len(),
        messages,
        running,
        stop,
        started,
    )
    .await;
    let setting = Setting {
        broker: "RabbitMQ",
        scenario: "consumer killed mid-poll (connection closed), restarted",
        seed,
        messages: order.len(),
        consumers: (3, 4),
        unacked,
        poll_bound: Duration::MAX,
        deliveries_bound: None,
        calls_bound: None,
        took: started.elapsed(),
        note: format!("killed: {killed}, after {calls} handler calls + {extra:?}"),
        keys,
    };
    Row::collect(setting, &ledger)
}

/// 3. The producer publishes every message twice (same `message_id`, two
///    deliveries), shuffled: one effect per key, every delivery acknowledged.
pub(crate) async fn sent_twice(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let queue = Queue::new(Duration::from_secs(5)).await;
    let keys = keys(60);
    let times = handler_times(&keys, seed, 5..60);
    let mut order: Vec<String> = keys.iter().chain(keys.iter()).cloned().collect();
    order.shuffle(&mut rng);
    queue.publish(&order).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let mut running = Vec::new();
    for c in 0..3 {
        let (_, consumer) = queue.consumer(c, &ledger);
        running.push(spawn(&queue, c, consumer, &ledger, &times, stopped.clone()).await);
    }
    let messages = order.len() as u64;
    let unacked = finish(
        &queue,
        &ledger,
        keys.len(),
        messages,
        running,
        stop,
        started,
    )
    .await;
    let setting = Setting {
        broker: "RabbitMQ",
        scenario: "every message published twice",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: Duration::MAX,
        deliveries_bound: None,
        calls_bound: Some(1),
        took: started.elapsed(),
        note: String::new(),
        keys,
    };
    Row::collect(setting, &ledger)
}
