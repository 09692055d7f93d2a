//! RabbitMQ scenarios, on the harness's broker (`containers::rabbitmq()`,
//! `IDEMPOTENCY_TEST_RABBITMQ_*` overrides). Each consumer runs `run` on a
//! connection of its own; the ledger learns each delivery's answer from the
//! `on_answer` hook (the consumer has no `poll_once`: no poll times).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_conformance::containers::{self, RabbitMqServer};
use idempotency_consumers::rabbitmq::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idempotency_consumers::rabbitmq::lapin::types::{FieldTable, ShortString};
use idempotency_consumers::rabbitmq::lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use idempotency_consumers::rabbitmq::{RabbitConsumer, RabbitError};
use idempotency_consumers::{Backoff, Disposition};
use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::ledger::{allow_unrecorded, handler_times, keys, until, Ledger, Row, Setting};

/// How long a scenario may take before what is left counts as unacked.
const LIMIT: Duration = Duration::from_secs(25);
/// The same for the broker restart (a graceful stop and a start of RabbitMQ
/// take 5–15 s of it).
const RESTART_LIMIT: Duration = Duration::from_secs(60);

type Times = Arc<std::collections::BTreeMap<String, Duration>>;

struct Queue {
    url: String,
    name: String,
    /// The test's own channel (declare, publish, count), opened again after
    /// a broker restart.
    admin: tokio::sync::Mutex<Option<(Connection, Channel)>>,
    store: Arc<MemoryRepository>,
    config: Config,
    /// The broker's `consumer_timeout`, when the scenario set one.
    consumer_timeout: Option<Duration>,
    /// Deliveries answered `Ack` (by every consumer).
    acked: Arc<AtomicU64>,
}

async fn connect(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("a RabbitMQ connection")
}

fn config(lease: Duration, extension: Option<Duration>) -> Config {
    Config {
        processing_timeout: lease,
        store_timeout: Duration::from_millis(500),
        lease_extension_interval: extension,
        ..Config::default()
    }
}

impl Queue {
    /// A transient queue on the harness's shared broker.
    async fn new(lease: Duration) -> Queue {
        let server = containers::rabbitmq().await.expect("a RabbitMQ broker");
        let name = server.unique_queue_name("brokers");
        Queue::declare(server.url(), name, config(lease, None), false).await
    }

    /// A queue on `url` (durable, its messages persistent, when `durable`).
    async fn declare(url: &str, name: String, config: Config, durable: bool) -> Queue {
        let queue = Queue {
            url: url.to_owned(),
            name,
            admin: tokio::sync::Mutex::new(None),
            store: Arc::new(MemoryRepository::new()),
            config,
            consumer_timeout: None,
            acked: Arc::default(),
        };
        let options = QueueDeclareOptions {
            durable,
            ..QueueDeclareOptions::default()
        };
        queue
            .channel()
            .await
            .expect("a channel")
            .queue_declare(queue.name.as_str().into(), options, FieldTable::default())
            .await
            .expect("queue.declare");
        queue
    }

    /// The admin channel, opened (again) when it is not open.
    async fn channel(&self) -> Option<Channel> {
        let mut admin = self.admin.lock().await;
        if let Some((_, channel)) = admin.as_ref().filter(|(c, _)| c.status().connected()) {
            if channel.status().connected() {
                return Some(channel.clone());
            }
        }
        let open = async {
            let connection = Connection::connect(&self.url, ConnectionProperties::default())
                .await
                .ok()?;
            let channel = connection.create_channel().await.ok()?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .ok()?;
            Some((connection, channel))
        };
        let (connection, channel) = tokio::time::timeout(Duration::from_secs(5), open)
            .await
            .ok()
            .flatten()?;
        *admin = Some((connection, channel.clone()));
        Some(channel)
    }

    /// Publishes one persistent message per entry of `order` (its key the
    /// `message_id`), each confirmed by the broker.
    async fn publish(&self, order: &[String]) {
        let channel = self.channel().await.expect("a channel");
        for key in order {
            let properties = BasicProperties::default()
                .with_message_id(ShortString::from(key.as_str()))
                .with_delivery_mode(2);
            let confirm = channel
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
            assert!(confirm.is_ack(), "the broker confirmed {key}");
        }
    }

    /// Messages ready in the queue (unacknowledged ones do not count);
    /// `u32::MAX` while the broker does not answer.
    async fn ready(&self) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let Some(channel) = self.channel().await else {
            return u32::MAX;
        };
        channel
            .queue_declare(self.name.as_str().into(), passive, FieldTable::default())
            .await
            .map_or(u32::MAX, |q| q.message_count())
    }

    async fn delete(&self) {
        if let Some(channel) = self.channel().await {
            let _ = channel
                .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }

    fn consumer(&self, c: usize, ledger: &Ledger) -> (IdempotencyManager, RabbitConsumer) {
        let manager =
            IdempotencyManager::new(self.store.clone(), self.config.clone()).expect("a manager");
        let (ledger, acked) = (ledger.clone(), self.acked.clone());
        let mut builder = RabbitConsumer::builder(manager.clone(), self.name.as_str())
            .prefetch(10)
            .min_retry_delay(Duration::from_millis(100))
            .operation_timeout(Duration::from_secs(3))
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_millis(500),
            });
        if let Some(timeout) = self.consumer_timeout {
            builder = builder
                .consumer_timeout(timeout)
                .max_retry_hold(Duration::from_secs(1));
        }
        let consumer = builder
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

/// A running consumer: its connection (closed to kill it; none for a
/// supervised one, which opens its own) and its task.
struct Running {
    connection: Option<Arc<Connection>>,
    task: JoinHandle<Result<(), RabbitError>>,
}

type Handler = Arc<
    dyn Fn(
            Arc<idempotency_consumers::rabbitmq::Message>,
            idempotency_core::ExecutionContext,
        ) -> Pin<
            Box<dyn Future<Output = Result<u32, idempotency_core::HandlerError<String>>> + Send>,
        > + Send
        + Sync,
>;

/// The scenarios' handler: notes its call, sleeps the key's time, applies
/// the effect.
fn handler(c: usize, ledger: &Ledger, times: &Times) -> Handler {
    let (ledger, times) = (ledger.clone(), times.clone());
    Arc::new(move |message, _ctx| {
        let key = message.key.clone();
        let time = times.get(&key).copied().unwrap_or_default();
        let ledger = ledger.clone();
        Box::pin(async move {
            ledger.call(&key, c);
            tokio::time::sleep(time).await;
            ledger.apply(&key, c);
            Ok(1u32)
        })
    })
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A consumer that runs once on a connection of its own (killed by closing it).
async fn spawn(
    queue: &Queue,
    c: usize,
    consumer: RabbitConsumer,
    ledger: &Ledger,
    times: &Times,
    stop: watch::Receiver<bool>,
) -> Running {
    let connection = Arc::new(connect(&queue.url).await);
    let (handler, conn) = (handler(c, ledger, times), connection.clone());
    let task = tokio::spawn(async move {
        consumer
            .run(&conn, move |m, ctx| handler(m, ctx), stopped(stop))
            .await
    });
    Running {
        connection: Some(connection),
        task,
    }
}

/// A consumer as a service runs one: `run` again after each retryable
/// failure (a closed channel, a broker gone), on a new connection when the
/// old one died, 200 ms apart (the reconnect backoff: real time, as the
/// broker's own restart is), until `stop`.
fn supervise(
    queue: &Queue,
    c: usize,
    consumer: RabbitConsumer,
    ledger: &Ledger,
    times: &Times,
    stop: watch::Receiver<bool>,
) -> Running {
    let (url, handler, ledger) = (queue.url.clone(), handler(c, ledger, times), ledger.clone());
    let task = tokio::spawn(async move {
        let mut connection: Option<Connection> = None;
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            if !connection.as_ref().is_some_and(|c| c.status().connected()) {
                let connect = Connection::connect(&url, ConnectionProperties::default());
                connection = tokio::time::timeout(Duration::from_secs(3), connect)
                    .await
                    .ok()
                    .and_then(Result::ok);
            }
            if let Some(conn) = &connection {
                let handler = handler.clone();
                match consumer
                    .run(conn, move |m, ctx| handler(m, ctx), stopped(stop.clone()))
                    .await
                {
                    Ok(()) => return Ok(()),
                    Err(error) if error.is_retryable() => ledger.poll_error(c, error.to_string()),
                    Err(error) => return Err(error),
                }
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
                () = stopped(stop.clone()) => return Ok(()),
            }
        }
    });
    Running {
        connection: None,
        task,
    }
}

/// When a scenario is done, and by when at the latest.
struct Goal {
    keys: usize,
    messages: u64,
    started: Instant,
    limit: Duration,
}

/// Consumers running, and their stop signal.
struct Crew {
    running: Vec<Running>,
    stop: watch::Sender<bool>,
}

impl Crew {
    /// Stops every consumer (their channels close: what they held goes back
    /// to the queue); a consumer's failure is a poll error.
    async fn stop(self, ledger: &Ledger) {
        let _ = self.stop.send(true);
        for r in self.running {
            match tokio::time::timeout(Duration::from_secs(10), r.task).await {
                Ok(Ok(Err(error))) => ledger.poll_error(99, error.to_string()),
                Ok(Ok(Ok(()))) => {}
                _ => ledger.poll_error(99, "a consumer did not stop".to_owned()),
            }
        }
    }
}

/// Until every key has its effect, as many deliveries were answered `Ack` as
/// messages were published, and none is ready (or the goal's limit); then
/// the consumers stop. A delivery answered `Ack` whose ack failed with its
/// channel (the broker's `consumer_timeout`, a restart) counts as acked but
/// comes back, so what is in the queue after the stop is handed to a fresh
/// consumer until the queue is empty (*drains*). Returns the messages left
/// at the limit (never acknowledged) and the drains it took.
async fn finish(
    queue: &Queue,
    ledger: &Ledger,
    times: &Times,
    goal: Goal,
    crew: Crew,
) -> (u64, u32) {
    let deadline = goal.started + goal.limit;
    until(deadline, || async {
        ledger.effected() == goal.keys
            && queue.acked.load(Ordering::SeqCst) >= goal.messages
            && queue.ready().await == 0
    })
    .await;
    crew.stop(ledger).await;
    let mut left = u64::from(queue.ready().await);
    let mut drains = 0;
    while left > 0 && Instant::now() < deadline {
        drains += 1;
        let c = 90 + drains as usize;
        let acked = queue.acked.load(Ordering::SeqCst);
        let (stop, stopped) = watch::channel(false);
        let (_, consumer) = queue.consumer(c, ledger);
        let running = vec![supervise(queue, c, consumer, ledger, times, stopped)];
        until(deadline, || async {
            queue.acked.load(Ordering::SeqCst) >= acked + left && queue.ready().await == 0
        })
        .await;
        Crew { running, stop }.stop(ledger).await;
        left = u64::from(queue.ready().await);
    }
    queue.delete().await;
    (left, drains)
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
    if let Some(connection) = &victim.connection {
        let _ = connection.close(320, "killed".into()).await;
    }
    allow_unrecorded(&ledger, &victim_manager, 0).await;
    let (_, fresh) = queue.consumer(3, &ledger);
    running.push(spawn(&queue, 3, fresh, &ledger, &times, stopped.clone()).await);
    let goal = Goal {
        keys: keys.len(),
        messages: order.len() as u64,
        started,
        limit: LIMIT,
    };
    let (unacked, drains) = finish(&queue, &ledger, &times, goal, Crew { running, stop }).await;
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
        note: format!(
            "killed: {killed}, after {calls} handler calls + {extra:?}; drains: {drains}"
        ),
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
    let goal = Goal {
        keys: keys.len(),
        messages: order.len() as u64,
        started,
        limit: LIMIT,
    };
    let (unacked, drains) = finish(&queue, &ledger, &times, goal, Crew { running, stop }).await;
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
        note: format!("drains: {drains}"),
        keys,
    };
    let mut row = Row::collect(setting, &ledger);
    explain_drains(&mut row, drains, &ledger);
    row
}

/// Drains are expected only where an ack may have been lost: a consumer's
/// `run` failed (its channel closed under answered deliveries) or a consumer
/// was killed. Elsewhere a message back in the queue after every delivery
/// was answered `Ack` means an ack was never sent: the row fails.
fn explain_drains(row: &mut Row, drains: u32, ledger: &Ledger) {
    if drains > 0 && ledger.poll_errors_with("c") == 0 {
        row.missing.push(format!(
            "{drains} drain(s) though no ack could have failed: a delivery answered Ack \
             was never acknowledged"
        ));
    }
}

/// Three supervised consumers over `queue` until done (or `limit`): the
/// scenario's ledger and what it measured.
async fn run_supervised(
    queue: &Queue,
    order: &[String],
    keys: usize,
    times: &Times,
    limit: Duration,
    during: impl Future<Output = String>,
) -> (Ledger, u64, Duration, String, u32) {
    let ledger = Ledger::default();
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let running: Vec<Running> = (0..3)
        .map(|c| {
            let (_, consumer) = queue.consumer(c, &ledger);
            supervise(queue, c, consumer, &ledger, times, stopped.clone())
        })
        .collect();
    let note = during.await;
    let goal = Goal {
        keys,
        messages: order.len() as u64,
        started,
        limit,
    };
    let (unacked, drains) = finish(queue, &ledger, times, goal, Crew { running, stop }).await;
    let took = started.elapsed();
    (
        ledger,
        unacked,
        took,
        format!("{note}drains: {drains}"),
        drains,
    )
}

/// 2. Handlers slower than the broker's own redelivery timer: RabbitMQ's is
///    the `consumer_timeout`, past which it closes the channel under the
///    unacknowledged delivery and requeues everything the channel held. A
///    broker of its own with a `consumer_timeout` of 3 s, checked every
///    250 ms (`channel_tick_interval`; 60 s by default); two keys of 30 take
///    4–4.5 s (two, so that a consumer is free to receive what the broker
///    requeues while they run: a consumer takes no delivery while its poll
///    runs); lease 1 s extended every 300 ms (the consumer told the
///    timeout: its lease and holds stay below it). The requeued delivery
///    meets its key held by the running handler (*retried*) until the
///    outcome is recorded, then is answered as a duplicate and acked; the
///    closed channel's `run` fails and is run again. One handler call per
///    key; the row fails if no channel was closed (nothing tested).
pub(crate) async fn slower_than_consumer_timeout(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let settings = [
        ("consumer_timeout", "3000"),
        ("channel_tick_interval", "250"),
    ];
    let server = RabbitMqServer::dedicated_with_settings(&settings)
        .await
        .expect("a dedicated RabbitMQ broker");
    let lease = config(Duration::from_secs(1), Some(Duration::from_millis(300)));
    let name = server.unique_queue_name("slow");
    let mut queue = Queue::declare(server.url(), name, lease, false).await;
    queue.consumer_timeout = Some(Duration::from_secs(3));
    let keys = keys(30);
    let mut times = (*handler_times(&keys, seed, 20..200)).clone();
    let slow: Vec<String> = keys.choose_multiple(&mut rng, 2).cloned().collect();
    for key in &slow {
        times.insert(
            key.clone(),
            Duration::from_millis(rng.random_range(4000..4500)),
        );
    }
    let times = Arc::new(times);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    queue.publish(&order).await;
    let (ledger, unacked, took, note, drains) =
        run_supervised(&queue, &order, keys.len(), &times, LIMIT, async {
            String::new()
        })
        .await;
    let closed = ledger.poll_errors_with("channel is closed");
    let setting = Setting {
        broker: "RabbitMQ",
        scenario: "handlers (2 of 4–4.5 s) slower than consumer_timeout (3 s), lease extension",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: Duration::MAX,
        deliveries_bound: None,
        calls_bound: Some(1),
        took,
        note: format!(
            "channels closed by the broker's consumer_timeout: {closed}; slow keys: {slow:?}; {note}"
        ),
        keys,
    };
    let mut row = Row::collect(setting, &ledger);
    explain_drains(&mut row, drains, &ledger);
    if closed == 0 {
        row.missing
            .push("the broker closed no channel for its consumer_timeout".to_owned());
    }
    row
}

/// 4. The broker restarted under load: a broker of its own, a durable queue
///    of persistent messages (confirmed when published); once a third of the
///    keys are applied it is stopped (`docker stop`: RabbitMQ shuts down
///    cleanly) and started again (same node, same data: the queue and its
///    unacknowledged messages come back). Every consumer's `run` fails and is
///    run again on a new connection once the broker answers; acks written
///    before the stop and lost with it bring their messages back, answered
///    from the store. Lease 2 s.
pub(crate) async fn broker_restarted(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let server = RabbitMqServer::dedicated()
        .await
        .expect("a dedicated RabbitMQ broker");
    let name = server.unique_queue_name("restart");
    let lease = config(Duration::from_secs(2), None);
    let queue = Queue::declare(server.url(), name, lease, true).await;
    let keys = keys(60);
    let times = handler_times(&keys, seed, 20..200);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    queue.publish(&order).await;
    let third = keys.len() / 3;
    let (ledger, unacked, took, note, drains) = {
        let (server, queue_ref) = (&server, &queue);
        run_supervised(
            &queue,
            &order,
            keys.len(),
            &times,
            RESTART_LIMIT,
            async move {
                let begun = Instant::now();
                let reached = until(begun + Duration::from_secs(15), || async {
                    queue_ref.acked.load(Ordering::SeqCst) >= third as u64
                })
                .await;
                let down = Instant::now();
                server.restart().await.expect("the broker restarted");
                format!(
                    "restarted in {:.1}s after {third} acks (reached: {reached}); ",
                    down.elapsed().as_secs_f64()
                )
            },
        )
        .await
    };
    let restarts = ledger.poll_errors_with("c");
    let setting = Setting {
        broker: "RabbitMQ",
        scenario: "broker restarted (docker stop, start), durable queue",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: Duration::MAX,
        deliveries_bound: None,
        calls_bound: None,
        took,
        note,
        keys,
    };
    let mut row = Row::collect(setting, &ledger);
    explain_drains(&mut row, drains, &ledger);
    if restarts == 0 {
        row.missing
            .push("no consumer saw the broker go away".to_owned());
    }
    row
}
