//! SQS scenarios, on the harness's SQS server (moto; `containers::sqs()`,
//! `IDEMPOTENCY_TEST_SQS_*` overrides).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use aws_sdk_sqs::Client;
use idempotency_conformance::containers;
use idempotency_consumers::sqs::{SqsConsumer, SqsMessage};
use idempotency_consumers::{Backoff, Disposition};
use idempotency_core::{
    Config, ExecutionContext, HandlerError, IdempotencyManager, MemoryRepository,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ledger::{allow_unrecorded, handler_times, keys, until, Ledger, Row, Setting};

const KEY: &str = "idempotency-key";
/// Long polling of the consumers.
const WAIT: Duration = Duration::from_secs(1);
/// Each SQS call's bound.
const CALL: Duration = Duration::from_secs(3);
/// How long a scenario may take before what is left counts as unacked.
const LIMIT: Duration = Duration::from_secs(25);

async fn client() -> Client {
    let server = containers::sqs().await.expect("an SQS server");
    client_of(
        server.endpoint(),
        server.region(),
        (server.access_key_id(), server.secret_access_key()),
    )
}

fn client_of(endpoint: &str, region: &str, (key, secret): (&str, &str)) -> Client {
    let credentials = Credentials::new(key, secret, None, None, "brokers");
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region.to_owned()))
        .endpoint_url(endpoint)
        .credentials_provider(credentials)
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Client::from_conf(config)
}

/// A fresh queue with this visibility timeout (seconds).
async fn queue(client: &Client, visibility: u32) -> String {
    let server = containers::sqs().await.expect("an SQS server");
    client
        .create_queue()
        .queue_name(server.unique_queue_name("brokers"))
        .attributes(
            QueueAttributeName::VisibilityTimeout,
            visibility.to_string(),
        )
        .send()
        .await
        .expect("CreateQueue")
        .queue_url()
        .expect("a queue URL")
        .to_owned()
}

/// Sends one message per key in `order` (a key twice: two messages, two
/// message ids).
async fn send(client: &Client, url: &str, order: &[String]) {
    for chunk in order.chunks(10) {
        let mut batch = client.send_message_batch().queue_url(url);
        for (i, key) in chunk.iter().enumerate() {
            let attribute = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(key)
                .build()
                .expect("an attribute");
            batch = batch.entries(
                aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(format!("charge {key}"))
                    .message_attributes(KEY, attribute)
                    .build()
                    .expect("an entry"),
            );
        }
        let sent = batch.send().await.expect("SendMessageBatch");
        assert!(sent.failed().is_empty(), "{:?}", sent.failed());
    }
}

/// Messages in the queue, visible and in flight.
async fn left(client: &Client, url: &str) -> u64 {
    let output = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .expect("GetQueueAttributes");
    output
        .attributes()
        .into_iter()
        .flatten()
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum()
}

fn config(processing: Duration, extension: Option<Duration>) -> Config {
    Config {
        processing_timeout: processing,
        store_timeout: Duration::from_millis(500),
        lease_extension_interval: extension,
        ..Config::default()
    }
}

struct Queue {
    client: Client,
    url: String,
    store: Arc<MemoryRepository>,
    config: Config,
}

impl Queue {
    async fn consumer(&self) -> (IdempotencyManager, SqsConsumer) {
        let manager =
            IdempotencyManager::new(self.store.clone(), self.config.clone()).expect("a manager");
        let consumer = SqsConsumer::builder(self.client.clone(), manager.clone(), &self.url)
            .wait_time(WAIT)
            .call_timeout(CALL)
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_millis(500),
            })
            .build()
            .await
            .expect("a consumer");
        (manager, consumer)
    }
}

type Times = Arc<BTreeMap<String, Duration>>;

/// The future of one handler call.
type Answer = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<String, HandlerError<String>>> + Send>,
>;

/// Consumer `c`'s handler: its call noted, its time spent, then its effect.
fn handler(
    c: usize,
    ledger: &Ledger,
    times: &Times,
) -> impl Fn(SqsMessage, ExecutionContext) -> Answer + Send + Sync + 'static {
    let (ledger, times) = (ledger.clone(), times.clone());
    move |message, _ctx| {
        let key = message.attributes.get(KEY).cloned().unwrap_or_default();
        let time = times.get(&key).copied().unwrap_or_default();
        let ledger = ledger.clone();
        Box::pin(async move {
            ledger.call(&key, c);
            tokio::time::sleep(time).await;
            ledger.apply(&key, c);
            Ok(key)
        })
    }
}

/// Consumer `c` polls until told to stop, each poll that returns noted.
async fn consume(
    c: usize,
    consumer: SqsConsumer,
    ledger: Ledger,
    times: Times,
    mut stop: watch::Receiver<bool>,
) {
    let handler = handler(c, &ledger, &times);
    while !*stop.borrow_and_update() {
        let begun = Instant::now();
        match consumer.poll_once(&handler).await {
            Ok(report) => {
                ledger.poll(begun.elapsed());
                for m in report.messages {
                    if m.disposition.is_retry() {
                        ledger.retried(1);
                    }
                    let what = match m.disposition {
                        Disposition::Ack(answer) => format!("ack {answer:?}"),
                        other => format!("{other:?}"),
                    };
                    ledger.delivered(m.key.as_deref().unwrap_or("?"), c, &what);
                }
            }
            Err(error) => {
                ledger.poll_error(c, error.to_string());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Runs the consumers until every key has its effect and the queue is empty
/// (or [`LIMIT`]); the messages left.
async fn finish(
    queue: &Queue,
    ledger: &Ledger,
    keys: usize,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: watch::Sender<bool>,
    started: Instant,
) -> u64 {
    until(started + LIMIT, || async {
        ledger.effected() == keys && left(&queue.client, &queue.url).await == 0
    })
    .await;
    let _ = stop.send(true);
    for task in tasks {
        task.await.expect("a consumer task");
    }
    left(&queue.client, &queue.url).await
}

fn poll_bound(config: &Config, handler: Duration) -> Duration {
    WAIT + CALL * 2 + handler + config.store_timeout * 3 + Duration::from_secs(2)
}

/// When and how the victim of scenario 1 is killed.
struct Kill {
    /// Its handler calls before the kill.
    calls: u32,
    /// And then this long.
    extra: Duration,
    /// Leak the poll (a crash) rather than drop it.
    crash: bool,
    /// No kill after this (the others took every message).
    deadline: Instant,
}

impl Kill {
    /// Polls with the victim (consumer 0) until the kill; whether it came.
    async fn run(&self, victim: &SqsConsumer, ledger: &Ledger, times: &Times) -> bool {
        let handler = handler(0, ledger, times);
        loop {
            let kill = async {
                until(self.deadline, || async { ledger.calls_by(0) >= self.calls }).await;
                tokio::time::sleep(self.extra).await;
            };
            let mut poll = Box::pin(victim.poll_once(&handler));
            tokio::select! {
                report = &mut poll => {
                    if let Err(error) = report { ledger.poll_error(0, error.to_string()); }
                    if Instant::now() >= self.deadline { return false; }
                }
                () = kill => {
                    if self.crash {
                        std::mem::forget(poll);
                    } else {
                        drop(poll);
                    }
                    return true;
                }
            }
        }
    }
}

/// 1. A consumer killed mid-batch (its poll future dropped or leaked at a
///    random point while handlers run, then the consumer dropped), and a
///    fresh one started: the
///    killed consumer's messages come back after the queue's visibility
///    timeout, its keys after the lease.
pub(crate) async fn killed_and_restarted(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let client = client().await;
    let queue = Queue {
        url: queue(&client, 2).await,
        client,
        store: Arc::new(MemoryRepository::new()),
        config: config(Duration::from_secs(2), None),
    };
    let keys = keys(60);
    let times = handler_times(&keys, seed, 20..200);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    send(&queue.client, &queue.url, &order).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    for c in 1..3 {
        let (_, consumer) = queue.consumer().await;
        tasks.push(tokio::spawn(consume(
            c,
            consumer,
            ledger.clone(),
            times.clone(),
            stopped.clone(),
        )));
    }
    // The victim: killed once its handlers were called `calls` times, plus a
    // random moment.
    let (victim_manager, victim) = queue.consumer().await;
    let calls = rng.random_range(1..=8);
    let extra = Duration::from_millis(rng.random_range(0..150));
    // Half the runs drop the poll (a cancellation: the manager records the
    // outcomes of handlers that returned, releases the keys not started);
    // half leak it (`mem::forget`: a crash, nothing of it runs again, no
    // visibility extended, no key released).
    let crash = rng.random_bool(0.5);
    let kill = Kill {
        calls,
        extra,
        crash,
        deadline: started + Duration::from_secs(10),
    };
    let killed = kill.run(&victim, &ledger, &times).await;
    drop(victim);
    allow_unrecorded(&ledger, &victim_manager, 0).await;
    let (_, fresh) = queue.consumer().await;
    tasks.push(tokio::spawn(consume(
        3,
        fresh,
        ledger.clone(),
        times.clone(),
        stopped.clone(),
    )));
    let unacked = finish(&queue, &ledger, keys.len(), tasks, stop, started).await;
    let setting = Setting {
        broker: "SQS",
        scenario: "consumer killed mid-batch, restarted",
        seed,
        messages: order.len(),
        consumers: (3, 4),
        unacked,
        poll_bound: poll_bound(&queue.config, Duration::from_millis(200)),
        deliveries_bound: None,
        calls_bound: None,
        took: started.elapsed(),
        note: format!(
            "killed: {killed} ({}), after {calls} handler calls + {extra:?}",
            if crash { "poll leaked" } else { "poll dropped" }
        ),
        keys,
    };
    Row::collect(setting, &ledger)
}

/// 2. Handlers slower than the queue's visibility timeout (1 s; handlers
///    1.5–2.5 s), with lease extension on: the consumers extend the messages'
///    visibility with the lease, so no other consumer receives one meanwhile
///    (one delivery, one handler call per key).
pub(crate) async fn slower_than_visibility(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let client = client().await;
    let queue = Queue {
        url: queue(&client, 1).await,
        client,
        store: Arc::new(MemoryRepository::new()),
        config: config(Duration::from_secs(3), Some(Duration::from_millis(500))),
    };
    let keys = keys(30);
    let times = handler_times(&keys, seed, 1500..2500);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    send(&queue.client, &queue.url, &order).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    for c in 0..3 {
        let (_, consumer) = queue.consumer().await;
        tasks.push(tokio::spawn(consume(
            c,
            consumer,
            ledger.clone(),
            times.clone(),
            stopped.clone(),
        )));
    }
    let unacked = finish(&queue, &ledger, keys.len(), tasks, stop, started).await;
    let setting = Setting {
        broker: "SQS",
        scenario: "handler (1.5–2.5 s) slower than the visibility timeout (1 s), lease extension",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: poll_bound(&queue.config, Duration::from_millis(2500)),
        deliveries_bound: Some(1),
        calls_bound: Some(1),
        took: started.elapsed(),
        note: String::new(),
        keys,
    };
    Row::collect(setting, &ledger)
}

/// 3. The producer sends every message twice (same key, two message ids), in
///    a random order: one effect per key, every message deleted.
pub(crate) async fn sent_twice(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let client = client().await;
    let queue = Queue {
        url: queue(&client, 5).await,
        client,
        store: Arc::new(MemoryRepository::new()),
        config: config(Duration::from_secs(5), None),
    };
    let keys = keys(60);
    let times = handler_times(&keys, seed, 5..60);
    let mut order: Vec<String> = keys.iter().chain(keys.iter()).cloned().collect();
    order.shuffle(&mut rng);
    send(&queue.client, &queue.url, &order).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    for c in 0..3 {
        let (_, consumer) = queue.consumer().await;
        tasks.push(tokio::spawn(consume(
            c,
            consumer,
            ledger.clone(),
            times.clone(),
            stopped.clone(),
        )));
    }
    let unacked = finish(&queue, &ledger, keys.len(), tasks, stop, started).await;
    let setting = Setting {
        broker: "SQS",
        scenario: "every message published twice",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: poll_bound(&queue.config, Duration::from_millis(60)),
        deliveries_bound: None,
        calls_bound: Some(1),
        took: started.elapsed(),
        note: String::new(),
        keys,
    };
    Row::collect(setting, &ledger)
}

const PAUSED: &str = "server paused 4.5–5.5 s (docker pause), resumed";

/// Scenario 4's row when it cannot run.
fn skipped(seed: u64, why: &str) -> Row {
    let setting = Setting {
        broker: "SQS",
        scenario: PAUSED,
        seed,
        messages: 0,
        consumers: (0, 0),
        unacked: 0,
        poll_bound: Duration::ZERO,
        deliveries_bound: None,
        calls_bound: None,
        took: Duration::ZERO,
        note: format!("skipped: {why}"),
        keys: Vec::new(),
    };
    Row::collect(setting, &Ledger::default())
}

/// A moto server of its own (the DynamoDB harness's dedicated container) and
/// a queue on it (visibility 3 s, lease 3 s); why not, when it serves no SQS.
async fn paused_queue() -> Result<(containers::Dedicated<containers::DynamoDbServer>, Queue), String>
{
    let server = containers::DynamoDbServer::dedicated()
        .await
        .map_err(|e| format!("no dedicated moto server: {e}"))?;
    let s = server.server();
    let client = client_of(
        s.endpoint(),
        s.region(),
        (s.access_key_id(), s.secret_access_key()),
    );
    let created = client
        .create_queue()
        .queue_name(format!("brokers-paused-{:08x}", rand::random::<u32>()))
        .attributes(QueueAttributeName::VisibilityTimeout, "3")
        .send()
        .await;
    let url = created
        .ok()
        .and_then(|o| o.queue_url().map(str::to_owned))
        .ok_or("the dedicated server does not serve SQS")?;
    let queue = Queue {
        url,
        client,
        store: Arc::new(MemoryRepository::new()),
        config: config(Duration::from_secs(3), None),
    };
    Ok((server, queue))
}

/// 4. The nearest to a broker restart that applies: the SQS server frozen
///    (`docker pause`: every call unanswered, its queues kept) for 4.5–5.5 s
///    (past the receive's bound, wait + call timeout = 4 s) once
///    a third of the keys are applied, then resumed. Receives and deletes in
///    flight time out (the call timeout); deletes that failed come back after
///    the visibility timeout and are answered from the store. A restart of
///    the moto container does not apply: moto keeps queues in memory, so a
///    restart deletes the queue and its messages, which SQS (durable,
///    replicated, never restarted from a client's view) never does. It runs
///    on a moto server of its own (the DynamoDB harness's dedicated container:
///    moto serves SQS too), as the shared one must not stop; skipped when
///    that server does not serve SQS (another DynamoDB emulator configured).
pub(crate) async fn server_paused(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let keys = keys(60);
    let (server, queue) = match paused_queue().await {
        Ok(found) => found,
        Err(why) => return skipped(seed, &why),
    };
    let times = handler_times(&keys, seed, 5..60);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    send(&queue.client, &queue.url, &order).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    for c in 0..3 {
        let (_, consumer) = queue.consumer().await;
        tasks.push(tokio::spawn(consume(
            c,
            consumer,
            ledger.clone(),
            times.clone(),
            stopped.clone(),
        )));
    }
    let outage = Duration::from_millis(rng.random_range(4500..5500));
    let reached = until(started + Duration::from_secs(15), || async {
        ledger.effected() >= keys.len() / 3
    })
    .await;
    server.pause().await.expect("docker pause");
    // The outage's length (the fault schedule, not a wait for an event).
    tokio::time::sleep(outage).await;
    server.unpause().await.expect("docker unpause");
    let unacked = finish(&queue, &ledger, keys.len(), tasks, stop, started).await;
    let setting = Setting {
        broker: "SQS",
        scenario: PAUSED,
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: poll_bound(&queue.config, Duration::from_millis(60)),
        deliveries_bound: None,
        calls_bound: Some(1),
        took: started.elapsed(),
        note: format!(
            "paused for {outage:?} after {} effects (a third reached: {reached})",
            keys.len() / 3
        ),
        keys,
    };
    let _ = server.remove().await;
    Row::collect(setting, &ledger)
}
