//! The RabbitMQ consumer against a real broker (`containers::rabbitmq()`):
//! duplicates, keys held elsewhere, transient and permanent failures,
//! dead-lettering, prefetch, a connection dying mid-poll, shutdown. The
//! helpers are here; the tests are in `rabbitmq/answers.rs` (what each
//! message gets) and `rabbitmq/failures.rs` (prefetch, broken connections,
//! shutdown, set-up and configuration errors).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "rabbitmq/answers.rs"]
mod answers;
#[path = "rabbitmq/failures.rs"]
mod failures;

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
