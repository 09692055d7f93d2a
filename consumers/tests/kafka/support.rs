//! The broker the Kafka tests run against, and their helpers.
//!
//! By default each test starts its own librdkafka mock cluster
//! (`rdkafka::mocking::MockCluster`): in-process brokers speaking the Kafka
//! protocol (produce, fetch, consumer groups with join/sync/heartbeat and
//! rebalances, offset commits and fetches). There is no Kafka broker on the
//! machines this project builds on (no Debian package, no registry for
//! images), and the mock is the one librdkafka's own test suite uses. With
//! `IDEMPOTENCY_TEST_KAFKA_BROKERS=host:port[,…]` the tests run against that
//! cluster instead (topics created through the admin API); the test that
//! injects commit errors needs the mock's error injection and skips that
//! part there.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency_consumers::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idempotency_consumers::kafka::rdkafka::client::DefaultClientContext;
use idempotency_consumers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idempotency_consumers::kafka::rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use idempotency_consumers::kafka::rdkafka::mocking::MockCluster;
use idempotency_consumers::kafka::rdkafka::producer::{
    DefaultProducerContext, FutureProducer, FutureRecord,
};
use idempotency_consumers::kafka::rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use idempotency_consumers::kafka::{KafkaConsumer, PollReport};
use idempotency_consumers::Backoff;
use idempotency_core::{
    Config, ExecutionContext, HandlerError, IdempotencyManager, MemoryRepository,
};
use parking_lot::Mutex;

/// The env var naming a real cluster's bootstrap servers.
pub(crate) const BROKERS_ENV: &str = "IDEMPOTENCY_TEST_KAFKA_BROKERS";

/// The cluster of one test.
pub(crate) struct Broker {
    pub(crate) bootstrap: String,
    mock: Option<MockCluster<'static, DefaultProducerContext>>,
    producer: FutureProducer,
}

impl Broker {
    /// The cluster named by [`BROKERS_ENV`], or a new mock cluster.
    pub(crate) fn start() -> Broker {
        let (bootstrap, mock) = match std::env::var(BROKERS_ENV) {
            Ok(brokers) if !brokers.trim().is_empty() => (brokers, None),
            _ => {
                let mock = MockCluster::new(1).expect("mock cluster");
                (mock.bootstrap_servers(), Some(mock))
            }
        };
        let producer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("message.timeout.ms", "10000")
            .create()
            .expect("producer");
        Broker {
            bootstrap,
            mock,
            producer,
        }
    }

    /// The mock cluster, when the tests run on one.
    pub(crate) fn mock(&self) -> Option<&MockCluster<'static, DefaultProducerContext>> {
        self.mock.as_ref()
    }

    /// A new topic with a unique name.
    pub(crate) async fn topic(&self, partitions: i32) -> String {
        let name = unique("topic");
        match &self.mock {
            Some(mock) => mock.create_topic(&name, partitions, 1).expect("topic"),
            None => {
                let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", &self.bootstrap)
                    .create()
                    .expect("admin client");
                let topic = NewTopic::new(&name, partitions, TopicReplication::Fixed(1));
                let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
                for result in admin.create_topics([&topic], &opts).await.expect("create") {
                    result.expect("topic created");
                }
            }
        }
        name
    }

    /// A consumer group member's client configuration.
    pub(crate) fn client(&self, group: &str) -> ClientConfig {
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", &self.bootstrap)
            .set("group.id", group)
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "300")
            .set("fetch.wait.max.ms", "50")
            .set("max.poll.interval.ms", "120000");
        client
    }

    /// Produces one message and awaits its delivery report.
    pub(crate) async fn produce(
        &self,
        topic: &str,
        partition: i32,
        key: Option<&str>,
        payload: &str,
        header: Option<(&str, &str)>,
    ) {
        let mut record: FutureRecord<'_, str, str> = FutureRecord::to(topic)
            .partition(partition)
            .payload(payload);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some((name, value)) = header {
            record = record.headers(OwnedHeaders::new().insert(Header {
                key: name,
                value: Some(value),
            }));
        }
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }

    /// The group's committed offsets of `topic`'s partitions (`None`: none).
    pub(crate) async fn committed(
        &self,
        group: &str,
        topic: &str,
        partitions: i32,
    ) -> Vec<Option<i64>> {
        let client = self.client(group);
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let probe: BaseConsumer = client.create().expect("probe consumer");
            let mut list = TopicPartitionList::new();
            for partition in 0..partitions {
                list.add_partition(&topic, partition);
            }
            let committed = probe
                .committed_offsets(list, Duration::from_secs(10))
                .expect("committed offsets");
            (0..partitions)
                .map(
                    |p| match committed.find_partition(&topic, p).map(|e| e.offset()) {
                        Some(Offset::Offset(offset)) => Some(offset),
                        _ => None,
                    },
                )
                .collect()
        })
        .await
        .expect("probe task")
    }

    /// How many messages `topic`'s partition 0 holds (its high watermark).
    pub(crate) async fn high_watermark(&self, topic: &str) -> i64 {
        let client = self.client(&unique("watermarks"));
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let probe: BaseConsumer = client.create().expect("probe consumer");
            let (_, high) = probe
                .fetch_watermarks(&topic, 0, Duration::from_secs(10))
                .expect("watermarks");
            high
        })
        .await
        .expect("probe task")
    }

    /// Every message of `topic`'s partition 0 up to `count`, read with a
    /// plain consumer (no group commits).
    pub(crate) async fn read(&self, topic: &str, count: usize) -> Vec<OwnedMessage> {
        let client = self.client(&unique("reader"));
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = client.create().expect("reader");
            let mut list = TopicPartitionList::new();
            list.add_partition_offset(&topic, 0, Offset::Beginning)
                .expect("offset");
            reader.assign(&list).expect("assign");
            let mut messages = Vec::new();
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while messages.len() < count && std::time::Instant::now() < deadline {
                if let Some(Ok(message)) = reader.poll(Duration::from_millis(100)) {
                    messages.push(message.detach());
                }
            }
            messages
        })
        .await
        .expect("reader task")
    }
}

/// A unique name (topics and groups of parallel tests never meet).
pub(crate) fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{prefix}-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A manager over `store`, with a short lease.
pub(crate) fn manager(store: &Arc<MemoryRepository>, lease: Duration) -> IdempotencyManager {
    let config = Config {
        processing_timeout: lease,
        store_timeout: lease / 4,
        ..Config::default()
    };
    IdempotencyManager::new(store.clone(), config).expect("manager")
}

/// The short delays the tests run with.
pub(crate) fn backoff() -> Backoff {
    Backoff {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(1),
    }
}

/// How many times each key's effect (and each handler call) happened.
#[derive(Clone, Default)]
pub(crate) struct Effects {
    applied: Arc<Mutex<HashMap<String, u32>>>,
    calls: Arc<Mutex<HashMap<String, u32>>>,
}

impl Effects {
    pub(crate) fn call(&self, key: &str) -> u32 {
        let mut calls = self.calls.lock();
        let n = calls.entry(key.to_owned()).or_insert(0);
        *n += 1;
        *n
    }

    pub(crate) fn apply(&self, key: &str) {
        *self.applied.lock().entry(key.to_owned()).or_insert(0) += 1;
    }

    pub(crate) fn applied(&self) -> BTreeMap<String, u32> {
        self.applied
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    pub(crate) fn calls(&self, key: &str) -> u32 {
        self.calls.lock().get(key).copied().unwrap_or(0)
    }
}

/// The message's key as text.
pub(crate) fn key_of(message: &OwnedMessage) -> String {
    message
        .key()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .unwrap_or_default()
}

/// A handler that applies each key's effect once per call.
pub(crate) fn counting(
    effects: &Effects,
) -> impl Fn(Arc<OwnedMessage>, ExecutionContext) -> std::future::Ready<Result<u32, HandlerError<String>>>
{
    let effects = effects.clone();
    move |message, _ctx| {
        let key = key_of(&message);
        effects.call(&key);
        effects.apply(&key);
        std::future::ready(Ok(1))
    }
}

/// Polls until `done` holds for the offsets committed so far (merged over
/// the reports), or panics after `limit`.
pub(crate) async fn drive<H, Fut>(
    consumer: &KafkaConsumer<idempotency_core::JsonCodec>,
    handler: H,
    limit: Duration,
    mut done: impl FnMut(&BTreeMap<(String, i32), i64>, &PollReport) -> bool,
) -> BTreeMap<(String, i32), i64>
where
    H: Fn(Arc<OwnedMessage>, ExecutionContext) -> Fut,
    Fut: Future<Output = Result<u32, HandlerError<String>>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    let mut committed = BTreeMap::new();
    loop {
        let report = consumer.poll_once(&handler).await.expect("poll");
        committed.extend(report.committed.clone());
        if done(&committed, &report) {
            return committed;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done within {limit:?}: committed {committed:?}, last report {report:?}"
        );
    }
}
