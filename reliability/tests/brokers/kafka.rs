//! Kafka scenarios, on librdkafka's in-process mock cluster (one per
//! scenario): consumer groups, rebalances and offset commits over the Kafka
//! protocol.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency_consumers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idempotency_consumers::kafka::rdkafka::message::OwnedMessage;
use idempotency_consumers::kafka::rdkafka::mocking::MockCluster;
use idempotency_consumers::kafka::rdkafka::producer::{
    DefaultProducerContext, FutureProducer, FutureRecord,
};
use idempotency_consumers::kafka::rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use idempotency_consumers::kafka::KafkaConsumer;
use idempotency_consumers::Backoff;
use idempotency_core::{
    Config, ExecutionContext, HandlerError, IdempotencyManager, JsonCodec, MemoryRepository,
};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ledger::{allow_unrecorded, handler_times, keys, until, Ledger, Row, Setting};

const PARTITIONS: i32 = 3;
const LINGER: Duration = Duration::from_millis(200);
const COMMIT: Duration = Duration::from_secs(5);
/// How long a scenario may take before what is left counts as unacked.
const LIMIT: Duration = Duration::from_secs(30);

type Times = Arc<BTreeMap<String, Duration>>;
type Committed = Arc<Mutex<BTreeMap<i32, i64>>>;

/// One scenario's cluster, topic, group and store.
struct Topic {
    mock: MockCluster<'static, DefaultProducerContext>,
    producer: FutureProducer,
    name: String,
    group: String,
    store: Arc<MemoryRepository>,
    config: Config,
    /// Client properties of the scenario (session, poll interval).
    client: Vec<(&'static str, &'static str)>,
    /// Per partition: its end offset once produced.
    ends: BTreeMap<i32, i64>,
}

impl Topic {
    fn new(seed: u64, config: Config, client: Vec<(&'static str, &'static str)>) -> Topic {
        let mock = MockCluster::new(1).expect("a mock cluster");
        let name = format!("brokers-{seed:016x}-{:08x}", rand::random::<u32>());
        mock.create_topic(&name, PARTITIONS, 1).expect("a topic");
        let producer = ClientConfig::new()
            .set("bootstrap.servers", mock.bootstrap_servers())
            .set("message.timeout.ms", "10000")
            .create()
            .expect("a producer");
        Topic {
            producer,
            group: format!("{name}-group"),
            name,
            mock,
            store: Arc::new(MemoryRepository::new()),
            config,
            client,
            ends: BTreeMap::new(),
        }
    }

    fn client(&self, group: &str) -> ClientConfig {
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", self.mock.bootstrap_servers())
            .set("group.id", group)
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "300")
            .set("fetch.wait.max.ms", "50")
            .set("max.poll.interval.ms", "60000");
        for (k, v) in &self.client {
            client.set(*k, *v);
        }
        client
    }

    /// Produces `key` to `partition` (awaiting its delivery report).
    async fn produce(&mut self, key: &str, partition: i32) {
        let payload = format!("charge {key}");
        let record: FutureRecord<'_, str, str> = FutureRecord::to(&self.name)
            .partition(partition)
            .key(key)
            .payload(&payload);
        let delivered = self
            .producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
        let end = self.ends.entry(delivered.partition).or_default();
        *end = (*end).max(delivered.offset + 1);
    }

    fn consumer(&self) -> (IdempotencyManager, KafkaConsumer<JsonCodec>) {
        let manager =
            IdempotencyManager::new(self.store.clone(), self.config.clone()).expect("a manager");
        let consumer = KafkaConsumer::builder(manager.clone(), self.client(&self.group))
            .topics([self.name.as_str()])
            .linger(LINGER)
            .batch_size(20)
            // One group per batch: the scenario's `max.poll.interval.ms`
            // covers one lease between two polls.
            .concurrency(20)
            .commit_timeout(COMMIT)
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_millis(500),
            })
            .on_reject(|_| async { Ok(()) })
            .build()
            .expect("a consumer");
        (manager, consumer)
    }

    /// Messages between the group's committed offsets and the partitions'
    /// ends, read from the broker.
    async fn unacked(&self) -> u64 {
        let client = self.client(&self.group);
        let (topic, ends) = (self.name.clone(), self.ends.clone());
        tokio::task::spawn_blocking(move || {
            let probe: BaseConsumer = client.create().expect("a probe");
            let mut list = TopicPartitionList::new();
            for partition in 0..PARTITIONS {
                list.add_partition(&topic, partition);
            }
            let committed = probe
                .committed_offsets(list, Duration::from_secs(10))
                .expect("committed offsets");
            ends.iter()
                .map(|(p, end)| {
                    let at = match committed.find_partition(&topic, *p).map(|e| e.offset()) {
                        Some(Offset::Offset(o)) => o,
                        _ => 0,
                    };
                    u64::try_from(end - at).unwrap_or(0)
                })
                .sum()
        })
        .await
        .expect("the probe task")
    }
}

fn config(processing: Duration, extension: Option<Duration>) -> Config {
    Config {
        processing_timeout: processing,
        store_timeout: Duration::from_millis(500),
        lease_extension_interval: extension,
        ..Config::default()
    }
}

type Handler = Box<
    dyn Fn(
            Arc<OwnedMessage>,
            ExecutionContext,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<u32, HandlerError<String>>> + Send>,
        > + Send
        + Sync,
>;

/// Consumer `c`'s handler: its call noted, its time spent, then its effect.
fn handler(c: usize, ledger: &Ledger, times: &Times) -> Handler {
    let (ledger, times) = (ledger.clone(), times.clone());
    Box::new(move |message, _ctx| {
        let key = message
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .unwrap_or_default();
        let time = times.get(&key).copied().unwrap_or_default();
        let ledger = ledger.clone();
        Box::pin(async move {
            ledger.call(&key, c);
            tokio::time::sleep(time).await;
            ledger.apply(&key, c);
            Ok(1)
        })
    })
}

/// Consumer `c` polls until told to stop; each poll's commits merged into
/// `committed`.
async fn consume(
    c: usize,
    consumer: KafkaConsumer<JsonCodec>,
    ledger: Ledger,
    times: Times,
    committed: Committed,
    mut stop: watch::Receiver<bool>,
) {
    let handler = handler(c, &ledger, &times);
    while !*stop.borrow_and_update() {
        let begun = Instant::now();
        match consumer.poll_once(&handler).await {
            Ok(report) => {
                ledger.poll(begun.elapsed());
                ledger.retried(report.retried as u64);
                let mut merged = committed.lock().unwrap_or_else(PoisonError::into_inner);
                for ((_, partition), offset) in report.committed {
                    let at = merged.entry(partition).or_default();
                    *at = (*at).max(offset);
                }
            }
            Err(error) => {
                ledger.poll_error(c, error.to_string());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // Closing the client (leaving the group) blocks: off the runtime's workers.
    let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
}

/// The scenario's consumers, the stop signal and the commits they saw.
struct Group {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: watch::Sender<bool>,
    stopped: watch::Receiver<bool>,
    committed: Committed,
    ledger: Ledger,
    times: Times,
}

impl Group {
    fn new(ledger: &Ledger, times: &Times) -> Group {
        let (stop, stopped) = watch::channel(false);
        Group {
            tasks: Vec::new(),
            stop,
            stopped,
            committed: Committed::default(),
            ledger: ledger.clone(),
            times: times.clone(),
        }
    }

    fn spawn(&mut self, c: usize, consumer: KafkaConsumer<JsonCodec>) {
        self.tasks.push(tokio::spawn(consume(
            c,
            consumer,
            self.ledger.clone(),
            self.times.clone(),
            self.committed.clone(),
            self.stopped.clone(),
        )));
    }

    /// Until every key has its effect and every partition is committed to
    /// its end (or [`LIMIT`]); then the consumers stop; the unacked left.
    async fn finish(self, topic: &Topic, keys: usize, started: Instant) -> u64 {
        let committed = self.committed.clone();
        until(started + LIMIT, || {
            let done = self.ledger.effected() == keys && {
                let c = committed.lock().unwrap_or_else(PoisonError::into_inner);
                topic.ends.iter().all(|(p, end)| c.get(p) == Some(end))
            };
            async move { done }
        })
        .await;
        let _ = self.stop.send(true);
        for task in self.tasks {
            task.await.expect("a consumer task");
        }
        topic.unacked().await
    }
}

fn poll_bound(config: &Config, handler: Duration) -> Duration {
    LINGER + handler + COMMIT + config.store_timeout * 3 + Duration::from_secs(2)
}

/// Produces one message per entry of `order` to a random partition.
async fn produce_all(topic: &mut Topic, order: &[String], rng: &mut rand::rngs::StdRng) {
    for key in order {
        let partition = rng.random_range(0..PARTITIONS);
        topic.produce(key, partition).await;
    }
}

/// 1. A member killed mid-batch (its poll dropped at a random point while
///    handlers run, then its client closed: the group rebalances its
///    partitions to the other members), and a fresh member joining.
pub(crate) async fn killed_and_restarted(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut topic = Topic::new(seed, config(Duration::from_secs(2), None), Vec::new());
    let keys = keys(60);
    let times = handler_times(&keys, seed, 20..200);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    produce_all(&mut topic, &order, &mut rng).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let mut group = Group::new(&ledger, &times);
    for c in 1..3 {
        group.spawn(c, topic.consumer().1);
    }
    let (victim_manager, victim) = topic.consumer();
    let calls = rng.random_range(1..=8);
    let extra = Duration::from_millis(rng.random_range(0..150));
    let victim_handler = handler(0, &ledger, &times);
    let kill_deadline = started + Duration::from_secs(15);
    let killed = loop {
        let kill = async {
            until(kill_deadline, || async { ledger.calls_by(0) >= calls }).await;
            tokio::time::sleep(extra).await;
        };
        tokio::select! {
            report = victim.poll_once(&victim_handler) => {
                if let Err(error) = report { ledger.poll_error(0, error.to_string()); }
                if Instant::now() >= kill_deadline { break false; }
            }
            () = kill => break true,
        }
    };
    tokio::task::spawn_blocking(move || drop(victim))
        .await
        .expect("closing the killed member");
    allow_unrecorded(&ledger, &victim_manager, 0).await;
    group.spawn(3, topic.consumer().1);
    let unacked = group.finish(&topic, keys.len(), started).await;
    let setting = Setting {
        broker: "Kafka",
        scenario: "member killed mid-batch (client closed), fresh member joins",
        seed,
        messages: order.len(),
        consumers: (3, 4),
        unacked,
        poll_bound: poll_bound(&topic.config, Duration::from_millis(200)),
        deliveries_bound: None,
        calls_bound: None,
        took: started.elapsed(),
        note: format!("killed: {killed}, after {calls} handler calls + {extra:?}"),
        keys,
    };
    Row::collect(setting, &ledger)
}

/// 2. The Kafka analogue of a handler slower than a redelivery timer: Kafka
///    has no per-message timer, but a member that does not poll for
///    `max.poll.interval.ms` (3 s) leaves the group (librdkafka leaves it
///    itself) and its partitions go to the other members, which read the
///    uncommitted messages again while their handlers still run. Six keys,
///    all on partition 0, take 6–6.5 s. The lease (2 s, extended every
///    500 ms; the builder refuses a poll interval shorter than the lease)
///    keeps their keys: the other members hold the partition (`retried`)
///    until the outcome is recorded, then answer them as duplicates. One
///    handler call and one effect per key. (The session timeout is not the
///    analogue: librdkafka heartbeats from its own thread while handlers run;
///    the mock's group coordinator did not form a group with a session
///    timeout of 1 s, hence 3 s.)
pub(crate) async fn slower_than_poll_interval(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let client = vec![
        ("session.timeout.ms", "3000"),
        ("max.poll.interval.ms", "3000"),
    ];
    let mut topic = Topic::new(
        seed,
        config(Duration::from_secs(2), Some(Duration::from_millis(500))),
        client,
    );
    let keys = keys(30);
    let mut times: BTreeMap<String, Duration> = (*handler_times(&keys, seed, 5..50)).clone();
    let slow: Vec<String> = keys.choose_multiple(&mut rng, 6).cloned().collect();
    for key in &slow {
        times.insert(
            key.clone(),
            Duration::from_millis(rng.random_range(6000..6500)),
        );
    }
    let times = Arc::new(times);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    // The slow keys all on partition 0: one member is slow, the others take
    // its partition over.
    for key in &order {
        let partition = if slow.contains(key) {
            0
        } else {
            rng.random_range(0..PARTITIONS)
        };
        topic.produce(key, partition).await;
    }
    let ledger = Ledger::default();
    let started = Instant::now();
    let mut group = Group::new(&ledger, &times);
    for c in 0..3 {
        group.spawn(c, topic.consumer().1);
    }
    let unacked = group.finish(&topic, keys.len(), started).await;
    let setting = Setting {
        broker: "Kafka",
        scenario: "handlers (6 of 6–6.5 s, one partition) longer than max.poll.interval.ms (3 s), lease extension",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: poll_bound(&topic.config, Duration::from_millis(6500)),
        deliveries_bound: None,
        calls_bound: Some(1),
        took: started.elapsed(),
        note: format!("slow keys: {slow:?}"),
        keys,
    };
    Row::collect(setting, &ledger)
}

/// 3. The producer publishes every message twice (same key, two offsets,
///    each copy to a random partition): one effect per key, every partition
///    committed to its end.
pub(crate) async fn sent_twice(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut topic = Topic::new(seed, config(Duration::from_secs(5), None), Vec::new());
    let keys = keys(60);
    let times = handler_times(&keys, seed, 5..60);
    let mut order: Vec<String> = keys.iter().chain(keys.iter()).cloned().collect();
    order.shuffle(&mut rng);
    produce_all(&mut topic, &order, &mut rng).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let mut group = Group::new(&ledger, &times);
    for c in 0..3 {
        group.spawn(c, topic.consumer().1);
    }
    let unacked = group.finish(&topic, keys.len(), started).await;
    let setting = Setting {
        broker: "Kafka",
        scenario: "every message published twice",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: poll_bound(&topic.config, Duration::from_millis(60)),
        deliveries_bound: None,
        calls_bound: Some(1),
        took: started.elapsed(),
        note: String::new(),
        keys,
    };
    Row::collect(setting, &ledger)
}

/// 4. The nearest the mock cluster comes to a broker restart: its only
///    broker set down (connections closed and refused; its log, groups and
///    committed offsets kept) for 1–2 s once a third of the keys are applied,
///    then up again. (The mock cannot restart: it lives in this process and
///    keeps everything in memory; dropping it ends the cluster.)
pub(crate) async fn broker_down_and_up(seed: u64) -> Row {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut topic = Topic::new(seed, config(Duration::from_secs(2), None), Vec::new());
    let keys = keys(60);
    let times = handler_times(&keys, seed, 5..60);
    let mut order = keys.clone();
    order.shuffle(&mut rng);
    produce_all(&mut topic, &order, &mut rng).await;
    let ledger = Ledger::default();
    let started = Instant::now();
    let mut group = Group::new(&ledger, &times);
    for c in 0..3 {
        group.spawn(c, topic.consumer().1);
    }
    let outage = Duration::from_millis(rng.random_range(1000..2000));
    let reached = until(started + Duration::from_secs(15), || async {
        ledger.effected() >= keys.len() / 3
    })
    .await;
    topic.mock.broker_down(1).expect("broker down");
    // The outage's length (the fault schedule, not a wait for an event).
    tokio::time::sleep(outage).await;
    topic.mock.broker_up(1).expect("broker up");
    let unacked = group.finish(&topic, keys.len(), started).await;
    let setting = Setting {
        broker: "Kafka",
        scenario: "broker down 1–2 s (mock: connections refused, log kept), then up",
        seed,
        messages: order.len(),
        consumers: (3, 3),
        unacked,
        poll_bound: poll_bound(&topic.config, Duration::from_millis(60)),
        deliveries_bound: None,
        calls_bound: Some(1),
        took: started.elapsed(),
        note: format!(
            "down for {outage:?} after {} effects (a third reached: {reached})",
            keys.len() / 3
        ),
        keys,
    };
    Row::collect(setting, &ledger)
}
