//! Kafka: `KafkaConsumer::poll_once` (batches of 100, over a store) against
//! a `StreamConsumer` collecting the same batches, running the same handler
//! and committing the same way, without the layer.
//!
//! Both consume their own topic of the same cluster: librdkafka's in-process
//! mock cluster (one broker, as the consumer's tests use), or a real cluster
//! given by `--kafka-brokers`. The mock runs inside the bench's process, so
//! on a small machine the broker's work competes with the consumer's for the
//! same cores, in both variants alike.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idempotency_consumers::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idempotency_consumers::kafka::rdkafka::client::DefaultClientContext;
use idempotency_consumers::kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use idempotency_consumers::kafka::rdkafka::error::KafkaError;
use idempotency_consumers::kafka::rdkafka::message::OwnedMessage;
use idempotency_consumers::kafka::rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use idempotency_consumers::kafka::rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use idempotency_consumers::kafka::KafkaConsumer;
use idempotency_core::{ExecutionContext, HandlerError, IdempotencyManager, SharedRepository};

use super::{
    complete_keys, handle, manager, nanos_since, payload, BrokerWorkload, Round, BATCH, STALL,
};
use crate::workloads::key_id;
use crate::{BoxError, Scenario, Variant};

/// Partitions of each topic.
pub const PARTITIONS: i32 = 4;
/// How long a batch is collected at most, both variants.
pub const LINGER: Duration = Duration::from_millis(100);
/// Keys of a batch reserved and run at once by default (the consumer's
/// default; `--kafka-concurrency`).
pub const CONCURRENCY: usize = 16;
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);

/// The library's consumer and the raw one, each on its own topic.
pub struct KafkaWorkload {
    store: String,
    setup: String,
    /// Owns the mock cluster, when there is one.
    producer: FutureProducer,
    manager: IdempotencyManager,
    library: KafkaConsumer<idempotency_core::JsonCodec>,
    library_topic: String,
    raw: Arc<StreamConsumer>,
    raw_topic: String,
    handled: Arc<AtomicUsize>,
}

impl std::fmt::Debug for KafkaWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaWorkload")
            .field("store", &self.store)
            .field("setup", &self.setup)
            .finish_non_exhaustive()
    }
}

fn unique(prefix: &str) -> String {
    format!("bench-{prefix}-{:016x}", rand::random::<u64>())
}

/// A consumer group member's configuration, the same for both variants.
fn client(bootstrap: &str, group: &str) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("fetch.wait.max.ms", "10")
        .set("session.timeout.ms", "10000")
        .set("heartbeat.interval.ms", "500");
    client
}

/// Creates `topics` on the cluster (the mock's own call, or the admin API).
async fn create_topics(
    producer: &FutureProducer,
    bootstrap: &str,
    topics: &[&str],
) -> Result<(), BoxError> {
    if let Some(mock) = producer.client().mock_cluster() {
        for topic in topics {
            mock.create_topic(topic, PARTITIONS, 1)?;
        }
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, PARTITIONS, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.create_topics(&new, &options).await? {
        result.map_err(|(topic, code)| format!("creating topic {topic}: {code}"))?;
    }
    Ok(())
}

impl KafkaWorkload {
    /// Topics and consumers on `brokers` (bootstrap servers), or on a new
    /// mock cluster; the library's manager over `repo`, `concurrency` keys
    /// of a batch at once.
    ///
    /// # Errors
    /// The client's or the cluster's refusal.
    pub async fn connect(
        brokers: Option<&str>,
        store: &str,
        repo: SharedRepository,
        store_setup: &str,
        concurrency: usize,
    ) -> Result<Self, BoxError> {
        let mut config = ClientConfig::new();
        config
            .set("queue.buffering.max.messages", "1000000")
            .set("message.timeout.ms", "30000");
        match brokers {
            Some(brokers) => config.set("bootstrap.servers", brokers),
            None => config.set("test.mock.num.brokers", "1"),
        };
        let producer: FutureProducer = config.create()?;
        let (bootstrap, cluster) = match producer.client().mock_cluster() {
            Some(mock) => (
                mock.bootstrap_servers(),
                "librdkafka's mock cluster (in process, 1 broker)".to_owned(),
            ),
            None => {
                let brokers = brokers.unwrap_or_default().to_owned();
                let cluster = format!("Kafka at {brokers}");
                (brokers, cluster)
            }
        };
        let (library_topic, raw_topic) = (unique("library"), unique("raw"));
        create_topics(&producer, &bootstrap, &[&library_topic, &raw_topic]).await?;
        let manager = manager(repo)?;
        // A batch's keys run in groups of `concurrency`, one after another:
        // librdkafka must allow a lease per group between two polls.
        let groups = u32::try_from(BATCH.div_ceil(concurrency.max(1))).unwrap_or(u32::MAX);
        let max_poll = (manager.config().processing_timeout * groups)
            .max(Duration::from_secs(300))
            .as_millis()
            .min(86_400_000);
        let mut library_client = client(&bootstrap, &unique("library-group"));
        library_client.set("max.poll.interval.ms", max_poll.to_string());
        let library = KafkaConsumer::builder(manager.clone(), library_client)
            .topics([library_topic.as_str()])
            .batch_size(BATCH)
            .linger(LINGER)
            .concurrency(concurrency)
            .commit_timeout(COMMIT_TIMEOUT)
            .on_reject(|_| async { Err("the bench rejects nothing".to_owned()) })
            .build()?;
        let raw: StreamConsumer = client(&bootstrap, &unique("raw-group")).create()?;
        raw.subscribe(&[raw_topic.as_str()])?;
        let setup = format!(
            "{cluster}, topics of {PARTITIONS} partitions; batches of {BATCH}, linger {} ms, \
             {concurrency} keys at once; library over {store_setup}; raw: a StreamConsumer \
             collecting the same batches, the same handler, the same synchronous commit",
            LINGER.as_millis()
        );
        Ok(KafkaWorkload {
            store: store.to_owned(),
            setup,
            producer,
            manager,
            library,
            library_topic,
            raw: Arc::new(raw),
            raw_topic,
            handled: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn topic(&self, variant: Variant) -> &str {
        match variant {
            Variant::Library => &self.library_topic,
            Variant::Raw => &self.raw_topic,
        }
    }

    /// The handler both variants run: counts, then the payload's length.
    fn handler(
        &self,
    ) -> impl Fn(
        Arc<OwnedMessage>,
        ExecutionContext,
    ) -> std::future::Ready<Result<usize, HandlerError<String>>>
           + '_ {
        move |message, _ctx| std::future::ready(Ok(self.run_handler(&message)))
    }

    fn run_handler(&self, message: &OwnedMessage) -> usize {
        self.handled.fetch_add(1, Ordering::Relaxed);
        handle(message.payload().unwrap_or_default())
    }

    async fn consume_library(&self, messages: usize) -> Result<Round, BoxError> {
        let handler = self.handler();
        let started = Instant::now();
        let mut last = started;
        let mut round = Round::default();
        while round.messages < messages {
            let t = Instant::now();
            let report = self.library.poll_once(&handler).await?;
            if report.retried > 0 || report.rejected > 0 || report.commit_error.is_some() {
                return Err(
                    format!("the library's poll did not settle cleanly: {report:?}").into(),
                );
            }
            if report.messages == 0 {
                stalled(last, round.messages, messages)?;
                continue;
            }
            round.polls.push(nanos_since(t));
            round.messages += report.acked;
            last = Instant::now();
        }
        round.elapsed = started.elapsed();
        Ok(round)
    }

    async fn consume_raw(&self, messages: usize) -> Result<Round, BoxError> {
        let started = Instant::now();
        let mut last = started;
        let mut round = Round::default();
        while round.messages < messages {
            let t = Instant::now();
            let batch = collect(&self.raw).await?;
            if batch.is_empty() {
                stalled(last, round.messages, messages)?;
                continue;
            }
            for message in &batch {
                std::hint::black_box(self.run_handler(message));
            }
            commit(&self.raw, &batch).await?;
            round.polls.push(nanos_since(t));
            round.messages += batch.len();
            last = Instant::now();
        }
        round.elapsed = started.elapsed();
        Ok(round)
    }
}

/// Fails once a round went [`STALL`] without a message.
fn stalled(last: Instant, got: usize, want: usize) -> Result<(), BoxError> {
    if last.elapsed() > STALL {
        return Err(format!("no message for {STALL:?}: {got} of {want} consumed").into());
    }
    Ok(())
}

/// Up to [`BATCH`] messages within [`LINGER`], as the library collects them.
async fn collect(consumer: &StreamConsumer) -> Result<Vec<Arc<OwnedMessage>>, BoxError> {
    let deadline = tokio::time::Instant::now() + LINGER;
    let mut batch = Vec::new();
    while batch.len() < BATCH {
        match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Err(_elapsed) => break,
            Ok(Ok(message)) => batch.push(Arc::new(message.detach())),
            Ok(Err(KafkaError::PartitionEOF(_))) => {}
            Ok(Err(error)) if batch.is_empty() => return Err(error.into()),
            Ok(Err(_)) => break,
        }
    }
    Ok(batch)
}

/// Commits past `batch` synchronously on a blocking thread, as the library
/// does.
async fn commit(
    consumer: &Arc<StreamConsumer>,
    batch: &[Arc<OwnedMessage>],
) -> Result<(), BoxError> {
    let mut next: BTreeMap<(&str, i32), i64> = BTreeMap::new();
    for m in batch {
        let entry = next.entry((m.topic(), m.partition())).or_insert(0);
        *entry = (*entry).max(m.offset() + 1);
    }
    let mut list = TopicPartitionList::new();
    for ((topic, partition), offset) in next {
        list.add_partition_offset(topic, partition, Offset::Offset(offset))?;
    }
    let consumer = consumer.clone();
    let commit = tokio::task::spawn_blocking(move || consumer.commit(&list, CommitMode::Sync));
    tokio::time::timeout(COMMIT_TIMEOUT, commit)
        .await
        .map_err(|_| "the raw consumer's commit timed out")???;
    Ok(())
}

#[async_trait]
impl BrokerWorkload for KafkaWorkload {
    fn broker(&self) -> &'static str {
        "kafka"
    }

    fn store(&self) -> &str {
        &self.store
    }

    fn describe(&self) -> String {
        self.setup.clone()
    }

    async fn prepare(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        messages: usize,
    ) -> Result<(), BoxError> {
        if variant == Variant::Library && scenario.is_duplicate() {
            complete_keys(&self.manager, ns, messages).await?;
        }
        let records: Vec<(String, String)> =
            (0..messages).map(|i| (key_id(ns, i), payload(i))).collect();
        let topic = self.topic(variant);
        let mut deliveries = Vec::with_capacity(records.len());
        for (key, payload) in &records {
            let record = FutureRecord::to(topic).key(key).payload(payload);
            let delivery = self
                .producer
                .send_result(record)
                .map_err(|(error, _)| error)?;
            deliveries.push(delivery);
        }
        for delivery in deliveries {
            delivery
                .await
                .map_err(|_| "the producer was dropped")?
                .map_err(|(error, _)| error)?;
        }
        Ok(())
    }

    async fn consume(
        &self,
        variant: Variant,
        scenario: Scenario,
        messages: usize,
    ) -> Result<Round, BoxError> {
        self.handled.store(0, Ordering::Relaxed);
        let round = match variant {
            Variant::Library => self.consume_library(messages).await?,
            Variant::Raw => self.consume_raw(messages).await?,
        };
        round.check(
            variant,
            scenario,
            messages,
            self.handled.load(Ordering::Relaxed),
        )?;
        Ok(round)
    }
}
