//! The RabbitMQ consumer against a real broker (`containers::rabbitmq()`):
//! duplicates, keys held elsewhere, transient and permanent failures,
//! dead-lettering, prefetch, a connection dying mid-poll, shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_conformance::containers::{self, FaultProxy};
use idempotency_consumers::rabbitmq::{
    KeySource, RabbitConsumer, RabbitConsumerBuilder, RabbitError,
};
use idempotency_consumers::{Answer, Backoff, Disposition};
use idempotency_core::{
    Config, HandlerError, IdempotencyManager, MemoryRepository, SharedRepository,
};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long any awaited event may take.
const PATIENCE: Duration = Duration::from_secs(20);

/// One message's answer as the consumer's hook saw it.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    key: String,
    disposition: Disposition,
    redelivered: bool,
    attempt: u32,
}

type Log = Arc<Mutex<Vec<Seen>>>;

struct Broker {
    url: String,
    /// Kept open for `channel`.
    _connection: Connection,
    channel: Channel,
}

impl Broker {
    async fn start() -> Broker {
        let server = containers::rabbitmq()
            .await
            .expect("a RabbitMQ broker for the tests");
        let url = server.url().to_owned();
        let connection = connect(&url).await;
        let channel = connection.create_channel().await.unwrap();
        Broker {
            url,
            _connection: connection,
            channel,
        }
    }

    /// A fresh queue, dead-lettering to a fresh exchange bound to a fresh
    /// queue when `dead_letters` (returns the exchange and that queue).
    async fn queue(&self, dead_letters: bool) -> (String, Option<(String, String)>) {
        let queue = containers::unique_namespace("orders");
        let mut arguments = FieldTable::default();
        let mut dlx = None;
        if dead_letters {
            let exchange = format!("{queue}.dlx");
            let dead = format!("{queue}.dead");
            self.channel
                .exchange_declare(
                    exchange.as_str().into(),
                    ExchangeKind::Fanout,
                    ExchangeDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            self.declare(&dead, FieldTable::default()).await;
            self.channel
                .queue_bind(
                    dead.as_str().into(),
                    exchange.as_str().into(),
                    "".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(LongString::from(exchange.as_str())),
            );
            dlx = Some((exchange, dead));
        }
        self.declare(&queue, arguments).await;
        (queue, dlx)
    }

    async fn declare(&self, queue: &str, arguments: FieldTable) {
        self.channel
            .queue_declare(queue.into(), QueueDeclareOptions::default(), arguments)
            .await
            .unwrap();
    }

    async fn publish(&self, queue: &str, message_id: Option<&str>, body: &str) {
        let mut properties = BasicProperties::default();
        if let Some(id) = message_id {
            properties = properties.with_message_id(ShortString::from(id));
        }
        self.channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Messages ready in `queue` (unacknowledged ones do not count).
    async fn ready(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }

    async fn delete(&self, queue: &str) {
        let _ = self
            .channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
    }
}

async fn connect(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap()
}

fn manager_on(repo: SharedRepository, lease: Duration) -> IdempotencyManager {
    let config = Config {
        processing_timeout: lease,
        store_timeout: Duration::from_millis(500),
        ttl: Duration::from_secs(120),
        ..Config::default()
    };
    IdempotencyManager::new(repo, config).unwrap()
}

fn manager() -> IdempotencyManager {
    manager_on(Arc::new(MemoryRepository::new()), Duration::from_secs(10))
}

/// A consumer builder with short delays and an answer log.
fn consumer(manager: IdempotencyManager, queue: &str, log: &Log) -> RabbitConsumerBuilder {
    let log = log.clone();
    RabbitConsumer::builder(manager, queue)
        .prefetch(8)
        .min_retry_delay(Duration::from_millis(50))
        .operation_timeout(Duration::from_secs(3))
        .backoff(Backoff {
            initial: Duration::from_millis(300),
            max: Duration::from_secs(1),
        })
        .on_answer(move |message, disposition| {
            log.lock().push(Seen {
                at: Instant::now(),
                key: message.key.clone(),
                disposition: *disposition,
                redelivered: message.redelivered,
                attempt: message.attempt,
            })
        })
}

/// A running consumer: stop it with `stop`, or wait for its end.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), RabbitError>>,
}

impl Running {
    async fn stop(mut self) -> Result<(), RabbitError> {
        drop(self.stop.take());
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the consumer stops")
            .unwrap()
    }
}

/// Spawns `consumer.run` on its own connection to `url`; the handler counts
/// its runs in `runs` and answers the body's length.
async fn spawn(consumer: RabbitConsumer, url: &str, runs: Arc<AtomicUsize>) -> Running {
    spawn_with(consumer, url, move |_| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .await
}

async fn spawn_with<F>(consumer: RabbitConsumer, url: &str, step: F) -> Running
where
    F: Fn(&[u8]) -> Result<(), HandlerError<String>> + Send + Sync + 'static,
{
    let connection = connect(url).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let step = Arc::new(step);
    let task = tokio::spawn(async move {
        consumer
            .run(
                &connection,
                move |message, _ctx| {
                    let step = step.clone();
                    async move {
                        step(&message.body)?;
                        Ok::<_, HandlerError<String>>(message.body.len())
                    }
                },
                async {
                    let _ = stopped.await;
                },
            )
            .await
    });
    Running {
        stop: Some(stop),
        task,
    }
}

/// Waits (bounded) for the first answer matching `matches`.
async fn wait_for(log: &Log, matches: impl Fn(&Seen) -> bool) -> Seen {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(seen) = log.lock().iter().find(|s| matches(s)) {
            return seen.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no such answer in {:?}",
            log.lock()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (bounded) until the log holds `n` answers.
async fn answers(log: &Log, n: usize) -> Vec<Seen> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let seen = log.lock().clone();
        if seen.len() >= n {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "{n} answers expected, got {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_runs_the_handler_once_and_both_are_acked() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-1"), "charge 10").await;
    broker.publish(&queue, Some("order-1"), "charge 10").await;
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let running = spawn(
        consumer(manager(), &queue, &log).build().unwrap(),
        &broker.url,
        runs.clone(),
    )
    .await;

    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    let answers: Vec<Disposition> = seen.iter().map(|s| s.disposition).collect();
    assert_eq!(
        answers,
        [
            Disposition::Ack(Answer::Executed),
            Disposition::Ack(Answer::Duplicate)
        ]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        broker.ready(&queue).await,
        0,
        "both acked, none requeued at shutdown"
    );
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_elsewhere_comes_back_no_sooner_than_retry_after() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let repo: SharedRepository = Arc::new(MemoryRepository::new());
    // Another consumer holds the key, its lease kept alive, until released.
    let mut holder_config = Config {
        processing_timeout: Duration::from_millis(1500),
        store_timeout: Duration::from_millis(300),
        ttl: Duration::from_secs(120),
        ..Config::default()
    };
    holder_config.lease_extension_interval = Some(Duration::from_millis(300));
    let holder = IdempotencyManager::new(repo.clone(), holder_config).unwrap();
    let release = Arc::new(Notify::new());
    let started = Arc::new(Notify::new());
    let holding = {
        let (release, started) = (release.clone(), started.clone());
        tokio::spawn(async move {
            holder
                .execute("order-7", "charge 70", || async move {
                    started.notify_one();
                    release.notified().await;
                    Ok::<_, HandlerError<String>>(9usize)
                })
                .await
        })
    };
    started.notified().await;
    broker.publish(&queue, Some("order-7"), "charge 70").await;

    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager_on(repo, Duration::from_secs(10)), &queue, &log);
    let running = spawn(consumer.build().unwrap(), &broker.url, runs.clone()).await;
    let first = answers(&log, 1).await.remove(0);
    let Disposition::Retry { after, reason } = first.disposition else {
        panic!("a held key is retried, not {first:?}");
    };
    assert_eq!(reason, "in_progress");
    assert!(
        after > Duration::ZERO && after <= Duration::from_millis(1500),
        "{after:?}"
    );
    // The held delivery does not stop the consumer: another message is
    // answered meanwhile.
    broker.publish(&queue, Some("order-7b"), "charge 71").await;
    let other = wait_for(&log, |s| s.key == "order-7b").await;
    assert_eq!(other.disposition, Disposition::Ack(Answer::Executed));
    assert!(
        other.at.duration_since(first.at) < after,
        "answered {:?} after the hold began, not within its {after:?}",
        other.at.duration_since(first.at)
    );
    release.notify_one();
    assert!(holding.await.unwrap().unwrap().handler_ran());

    wait_for(&log, |s| s.key == "order-7" && s.disposition.is_ack()).await;
    running.stop().await.unwrap();
    let seen: Vec<Seen> = log
        .lock()
        .iter()
        .filter(|s| s.key == "order-7")
        .cloned()
        .collect();
    let second = seen.last().unwrap();
    assert!(second.redelivered, "{second:?}");
    assert!(
        second.at.duration_since(first.at) >= after,
        "redelivered after {:?}, sooner than {after:?}",
        second.at.duration_since(first.at)
    );
    // A still-live holder may have been seen more than once; the last answer
    // is the recorded one.
    assert!(
        seen[..seen.len() - 1]
            .iter()
            .all(|s| s.disposition.is_retry()),
        "{seen:?}"
    );
    assert_eq!(second.disposition, Disposition::Ack(Answer::Duplicate));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "order-7 ran in the holder only"
    );
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_retried_after_the_backoff_then_acked() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-2"), "charge 20").await;
    let log = Log::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let running = spawn_with(
        consumer(manager(), &queue, &log).build().unwrap(),
        &broker.url,
        move |_| {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(HandlerError::transient(
                    "payment gateway timed out".to_owned(),
                ));
            }
            Ok(())
        },
    )
    .await;

    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    assert_eq!(
        seen[0].disposition,
        Disposition::Retry {
            after: Duration::from_millis(300),
            reason: "handler_retry"
        }
    );
    assert_eq!(seen[1].disposition, Disposition::Ack(Answer::Executed));
    assert!(seen[1].redelivered);
    assert!(seen[1].at.duration_since(seen[0].at) >= Duration::from_millis(300));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_count_attempts_and_the_backoff_grows() {
    let broker = Broker::start().await;
    let queue = containers::unique_namespace("quorum");
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    broker
        .channel
        .queue_declare(queue.as_str().into(), durable, arguments)
        .await
        .unwrap();
    broker.publish(&queue, Some("order-9"), "charge 90").await;
    let log = Log::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let running = spawn_with(consumer, &broker.url, move |_| {
        if counted.fetch_add(1, Ordering::SeqCst) < 2 {
            return Err(HandlerError::transient("not yet".to_owned()));
        }
        Ok(())
    })
    .await;

    let seen = answers(&log, 3).await;
    running.stop().await.unwrap();
    let attempts: Vec<u32> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [1, 2, 3], "x-delivery-count + 1: {seen:?}");
    let retry = |ms| Disposition::Retry {
        after: Duration::from_millis(ms),
        reason: "handler_retry",
    };
    assert_eq!(seen[0].disposition, retry(300));
    assert_eq!(seen[1].disposition, retry(600));
    assert_eq!(seen[2].disposition, Disposition::Ack(Answer::Executed));
    assert!(seen[2].at.duration_since(seen[1].at) >= Duration::from_millis(600));
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

/// Waits (bounded) for a message in `queue` and takes it.
async fn take_one(broker: &Broker, queue: &str) -> lapin::message::BasicGetMessage {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let got = broker
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        if let Some(message) = got {
            return message;
        }
        assert!(Instant::now() < deadline, "nothing reached {queue}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_failure_is_dead_lettered() {
    let broker = Broker::start().await;
    let (queue, dlx) = broker.queue(true).await;
    let (exchange, dead) = dlx.unwrap();
    broker.publish(&queue, Some("order-3"), "charge -1").await;
    let log = Log::default();
    let consumer = consumer(manager(), &queue, &log).dead_letter_exchange(&exchange);
    let running = spawn_with(consumer.build().unwrap(), &broker.url, |_| {
        Err(HandlerError::permanent("negative amount".to_owned()))
    })
    .await;

    let dead_letter = take_one(&broker, &dead).await;
    running.stop().await.unwrap();
    assert_eq!(dead_letter.delivery.data, b"charge -1");
    let death = dead_letter.delivery.properties.headers().as_ref().unwrap();
    assert!(death.contains_key("x-death"), "{death:?}");
    let seen = log.lock().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].disposition,
        Disposition::Reject {
            reason: "handler_failed"
        }
    );
    assert_eq!(broker.ready(&queue).await, 0);
    for q in [&queue, &dead] {
        broker.delete(q).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_a_key_is_rejected_without_running() {
    let broker = Broker::start().await;
    let (queue, dlx) = broker.queue(true).await;
    let (exchange, dead) = dlx.unwrap();
    broker.publish(&queue, None, "no id").await;
    broker.publish(&queue, Some("order-4"), "with id").await;
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager(), &queue, &log).dead_letter_exchange(&exchange);
    let running = spawn(consumer.build().unwrap(), &broker.url, runs.clone()).await;

    let dead_letter = take_one(&broker, &dead).await;
    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    assert_eq!(dead_letter.delivery.data, b"no id");
    let keyless = seen.iter().find(|s| s.key.is_empty()).unwrap();
    assert_eq!(
        keyless.disposition,
        Disposition::Reject {
            reason: "invalid_key"
        }
    );
    let keyed = seen.iter().find(|s| s.key == "order-4").unwrap();
    assert_eq!(keyed.disposition, Disposition::Ack(Answer::Executed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the keyed message ran");
    for q in [&queue, &dead] {
        broker.delete(q).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispositions_and_redeliveries_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, None, "no id").await;
    broker.publish(&queue, Some("order-10"), "charge 100").await;
    let log = Log::default();
    let calls = AtomicUsize::new(0);
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let connection = connect(&broker.url).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(
        &connection,
        |message, _ctx| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    return Err(HandlerError::transient("once".to_owned()));
                }
                Ok(message.body.len())
            }
        },
        async {
            let _ = stopped.await;
        },
    );
    // The recorder is installed around the consumer's polls only.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut run = std::pin::pin!(run);
    let counted = std::future::poll_fn(|cx| {
        metrics::with_local_recorder(&recorder, || run.as_mut().poll(cx))
    });
    let (ended, ()) = tokio::join!(counted, async {
        answers(&log, 3).await;
        drop(stop);
    });
    ended.unwrap();

    let counters: Vec<(String, Vec<String>, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => Some((
                key.key().name().to_owned(),
                key.key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect(),
                n,
            )),
            _ => None,
        })
        .collect();
    let count = |name: &str, labels: &[&str]| {
        counters
            .iter()
            .filter(|(n, l, _)| n == name && labels.iter().all(|x| l.iter().any(|y| y == x)))
            .map(|(_, _, v)| v)
            .sum::<u64>()
    };
    let messages = idempotency_consumers::metrics::MESSAGES;
    let rabbit = "broker=rabbitmq";
    assert_eq!(
        count(messages, &[rabbit, "reason=invalid_key"]),
        1,
        "{counters:?}"
    );
    assert_eq!(count(messages, &[rabbit, "reason=handler_retry"]), 1);
    assert_eq!(
        count(messages, &[rabbit, "disposition=ack", "reason=executed"]),
        1
    );
    let redelivered = idempotency_consumers::metrics::REDELIVERED;
    assert_eq!(count(redelivered, &[rabbit]), 1, "{counters:?}");
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_come_from_a_header_when_configured() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let mut headers = FieldTable::default();
    headers.insert(
        "x-idempotency-key".into(),
        AMQPValue::LongString("h-1".into()),
    );
    for _ in 0..2 {
        let properties = BasicProperties::default().with_headers(headers.clone());
        broker
            .channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                b"x",
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager(), &queue, &log).keys(KeySource::header("x-idempotency-key"));
    let running = spawn(consumer.build().unwrap(), &broker.url, runs.clone()).await;
    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    assert!(
        seen.iter()
            .all(|s| s.key == "h-1" && s.disposition.is_ack()),
        "{seen:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefetch_count_bounds_concurrent_handlers() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    for i in 0..12 {
        broker
            .publish(&queue, Some(&format!("order-{i}")), "work")
            .await;
    }
    let log = Log::default();
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let consumer = consumer(manager(), &queue, &log)
        .prefetch(3)
        .build()
        .unwrap();
    let connection = connect(&broker.url).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = {
        let (now, most) = (now.clone(), most.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    &connection,
                    move |_message, _ctx| {
                        let (now, most) = (now.clone(), most.clone());
                        async move {
                            let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(running, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(60)).await;
                            now.fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, HandlerError<String>>(())
                        }
                    },
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
        })
    };
    let seen = answers(&log, 12).await;
    drop(stop);
    tokio::time::timeout(PATIENCE, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(seen
        .iter()
        .all(|s| s.disposition == Disposition::Ack(Answer::Executed)));
    let most = most.load(Ordering::SeqCst);
    assert!(
        (2..=3).contains(&most),
        "at most the prefetch count at once: {most}"
    );
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_before_the_ack_redelivers_to_another_consumer_as_a_duplicate() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-5"), "charge 50").await;
    let repo: SharedRepository = Arc::new(MemoryRepository::new());
    let effects = Arc::new(AtomicUsize::new(0));
    let proxy = FaultProxy::start(&broker.url)
        .await
        .expect("a proxy to the broker");

    // Consumer A: its handler applies the effect, then waits while the
    // connection is cut, so its ack can never reach the broker.
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let log_a = Log::default();
    let consumer_a = consumer(
        manager_on(repo.clone(), Duration::from_secs(10)),
        &queue,
        &log_a,
    );
    let connection_a = connect(proxy.url()).await;
    let task_a = {
        let (started, release, effects) = (started.clone(), release.clone(), effects.clone());
        let consumer_a = consumer_a.build().unwrap();
        tokio::spawn(async move {
            consumer_a
                .run(
                    &connection_a,
                    move |message, _ctx| {
                        let (started, release, effects) =
                            (started.clone(), release.clone(), effects.clone());
                        async move {
                            effects.fetch_add(1, Ordering::SeqCst);
                            started.notify_one();
                            release.notified().await;
                            // The same result type as B's handler (it is replayed to B).
                            Ok::<_, HandlerError<String>>(message.body.len())
                        }
                    },
                    std::future::pending::<()>(),
                )
                .await
        })
    };
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .unwrap();
    proxy.reset();
    release.notify_one();
    let ended = tokio::time::timeout(PATIENCE, task_a)
        .await
        .unwrap()
        .unwrap();
    let error = ended.expect_err("a consumer whose connection died stops with an error");
    eprintln!("consumer A stopped: {error}");
    assert!(error.is_retryable(), "{error}");
    assert_eq!(log_a.lock().len(), 1, "A answered before it failed to ack");

    // Consumer B on a sound connection gets the message back.
    let log_b = Log::default();
    let runs_b = Arc::new(AtomicUsize::new(0));
    let consumer_b = consumer(manager_on(repo, Duration::from_secs(10)), &queue, &log_b);
    let running_b = spawn(consumer_b.build().unwrap(), &broker.url, runs_b.clone()).await;
    let seen = answers(&log_b, 1).await;
    running_b.stop().await.unwrap();
    assert!(seen[0].redelivered, "{seen:?}");
    assert_eq!(seen[0].disposition, Disposition::Ack(Answer::Duplicate));
    assert_eq!(runs_b.load(Ordering::SeqCst), 0);
    assert_eq!(effects.load(Ordering::SeqCst), 1, "one effect overall");
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_consumer_whose_connection_dies_stops_with_a_retryable_error() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let proxy = FaultProxy::start(&broker.url)
        .await
        .expect("a proxy to the broker");
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let running = spawn(consumer, proxy.url(), runs).await;
    // Consuming: a message goes through.
    broker.publish(&queue, Some("order-8"), "charge 80").await;
    answers(&log, 1).await;

    proxy.reset();
    let ended = tokio::time::timeout(PATIENCE, running.task)
        .await
        .expect("a dead connection ends the run")
        .unwrap();
    let error = ended.expect_err("a consumer whose connection died stops with an error");
    assert!(error.is_retryable(), "{error}");
    assert!(!matches!(error, RabbitError::Cancelled { .. }), "{error}");
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_poll_under_way_finish_and_ack() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-6"), "charge 60").await;
    let log = Log::default();
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let connection = connect(&broker.url).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = {
        let (started, release) = (started.clone(), release.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    &connection,
                    move |_message, _ctx| {
                        let (started, release) = (started.clone(), release.clone());
                        async move {
                            started.notify_one();
                            release.notified().await;
                            Ok::<_, HandlerError<String>>(())
                        }
                    },
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
        })
    };
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .unwrap();
    drop(stop);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!task.is_finished(), "shutdown waits for the poll");
    release.notify_one();
    tokio::time::timeout(PATIENCE, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        log.lock()[0].disposition,
        Disposition::Ack(Answer::Executed)
    );
    assert_eq!(
        broker.ready(&queue).await,
        0,
        "acked before returning, not requeued"
    );
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_exchange_or_queue_refuses_to_start() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let log = Log::default();
    let connection = connect(&broker.url).await;
    let handler = |_message, _ctx| async { Ok::<_, HandlerError<String>>(()) };

    let no_dlx = consumer(manager(), &queue, &log)
        .dead_letter_exchange(containers::unique_namespace("missing"))
        .build()
        .unwrap();
    let error = no_dlx
        .run(&connection, handler, std::future::pending::<()>())
        .await
        .unwrap_err();
    assert!(matches!(error, RabbitError::Setup { .. }), "{error}");
    assert!(!error.is_retryable());

    let no_queue = consumer(manager(), &containers::unique_namespace("missing"), &log)
        .build()
        .unwrap();
    let error = no_queue
        .run(&connection, handler, std::future::pending::<()>())
        .await
        .unwrap_err();
    assert!(matches!(error, RabbitError::Setup { .. }), "{error}");
    broker.delete(&queue).await;
}

#[test]
fn inconsistent_configurations_fail_to_build() {
    let log = Log::default();
    let cases: Vec<(&str, RabbitConsumerBuilder)> = vec![
        ("prefetch", consumer(manager(), "q", &log).prefetch(0)),
        (
            "concurrency",
            consumer(manager(), "q", &log).prefetch(2).concurrency(3),
        ),
        ("concurrency", consumer(manager(), "q", &log).concurrency(0)),
        ("queue name", consumer(manager(), "", &log)),
        (
            "min_retry_delay",
            consumer(manager(), "q", &log).min_retry_delay(Duration::ZERO),
        ),
        (
            "operation_timeout",
            consumer(manager(), "q", &log).operation_timeout(Duration::ZERO),
        ),
        (
            "min_retry_delay",
            consumer(manager(), "q", &log)
                .min_retry_delay(Duration::from_secs(2))
                .max_retry_hold(Duration::from_secs(1)),
        ),
        (
            "header",
            consumer(manager(), "q", &log).keys(KeySource::header("")),
        ),
        (
            "consumer_timeout",
            consumer(manager(), "q", &log).consumer_timeout(Duration::from_secs(5)),
        ),
    ];
    for (needle, builder) in cases {
        let error = builder.build().unwrap_err();
        assert!(matches!(error, RabbitError::Config(_)));
        assert!(!error.is_retryable());
        assert!(
            error.to_string().contains(needle),
            "{needle:?} not in {error}"
        );
    }
    assert!(consumer(manager(), "q", &log).build().is_ok());
}
