//! [`KafkaConsumerBuilder`]: the consumer's settings, checked before any
//! client is created.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use idempotency_core::{Codec, IdempotencyManager};
use parking_lot::Mutex;
use rdkafka::config::{ClientConfig, FromClientConfigAndContext};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;

use super::keys::KeySource;
use super::partitions::{PartitionContext, Partitions};
use super::reject::{DeadLetter, RejectRoute, Rejected};
use super::KafkaConsumer;
use crate::disposition::Backoff;

/// Why the consumer could not be built or could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaConsumerError {
    /// The configuration is inconsistent (not retryable).
    #[error("kafka consumer configuration: {0}")]
    Config(String),
    /// The client failed.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// An offset commit did not finish in time (it may still land).
    #[error("the offset commit did not finish within {0:?}")]
    CommitTimeout(Duration),
    /// The blocking commit task did not finish (the runtime is shutting down).
    #[error("the offset commit was interrupted: {0}")]
    Interrupted(String),
}

impl KafkaConsumerError {
    /// Whether trying again may succeed (a configuration error never does).
    pub fn is_retryable(&self) -> bool {
        match self {
            KafkaConsumerError::Config(_) => false,
            KafkaConsumerError::Kafka(error) => !matches!(
                error,
                KafkaError::ClientConfig(..)
                    | KafkaError::ClientCreation(_)
                    | KafkaError::Subscription(_)
            ),
            KafkaConsumerError::CommitTimeout(_) | KafkaConsumerError::Interrupted(_) => true,
        }
    }
}

/// The settings of a [`KafkaConsumer`] (see the builder's methods).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) batch_size: usize,
    pub(crate) linger: Duration,
    pub(crate) concurrency: usize,
    pub(crate) backoff: Backoff,
    pub(crate) commit_timeout: Duration,
    pub(crate) seek_timeout: Duration,
}

/// Builds a [`KafkaConsumer`]: [`KafkaConsumer::builder`].
pub struct KafkaConsumerBuilder<C: Codec + Clone> {
    manager: IdempotencyManager<C>,
    client: ClientConfig,
    topics: Vec<String>,
    keys: KeySource,
    settings: Settings,
    dead_letter: Option<(String, Option<ClientConfig>)>,
    reject: RejectRoute,
}

impl<C: Codec + Clone> std::fmt::Debug for KafkaConsumerBuilder<C> {
    // The client configuration may hold credentials: only its keys are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let client: Vec<&str> = self.client.config_map().into_keys().collect();
        f.debug_struct("KafkaConsumerBuilder")
            .field("client_keys", &client)
            .field("topics", &self.topics)
            .field("keys", &self.keys)
            .field("settings", &self.settings)
            .field("dead_letter", &self.dead_letter.as_ref().map(|d| &d.0))
            .field("reject", &self.reject)
            .finish_non_exhaustive()
    }
}

/// Consumer properties this crate owns: offsets are committed by the
/// consumer, never automatically.
const OWNED: [(&str, &str); 2] = [
    ("enable.auto.commit", "false"),
    ("enable.auto.offset.store", "false"),
];

/// The properties a dead-letter producer takes over from the consumer's.
const SHARED_PREFIXES: [&str; 6] = [
    "bootstrap.servers",
    "security.protocol",
    "sasl.",
    "ssl.",
    "client.id",
    "broker.address.family",
];

impl<C: Codec + Clone> KafkaConsumerBuilder<C> {
    pub(crate) fn new(manager: IdempotencyManager<C>, client: ClientConfig) -> Self {
        KafkaConsumerBuilder {
            manager,
            client,
            topics: Vec::new(),
            keys: KeySource::default(),
            settings: Settings {
                batch_size: 100,
                linger: Duration::from_millis(100),
                concurrency: 16,
                backoff: Backoff::default(),
                commit_timeout: Duration::from_secs(30),
                seek_timeout: Duration::from_secs(5),
            },
            dead_letter: None,
            reject: RejectRoute {
                hook_timeout: Duration::from_secs(30),
                ..RejectRoute::default()
            },
        }
    }

    /// The topics to subscribe to (at least one).
    pub fn topics<I, S>(mut self, topics: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.topics = topics.into_iter().map(Into::into).collect();
        self
    }

    /// Where each message's key comes from (default: the Kafka message key).
    pub fn key(mut self, keys: KeySource) -> Self {
        self.keys = keys;
        self
    }

    /// The most messages in one batch (default 100).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.settings.batch_size = batch_size;
        self
    }

    /// How long a batch is collected at most (default 100 ms).
    pub fn linger(mut self, linger: Duration) -> Self {
        self.settings.linger = linger;
        self
    }

    /// How many keys of a batch are reserved and run at once (default 16);
    /// the groups of a batch run one after another (see
    /// [`build`](Self::build) on `max.poll.interval.ms`).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency;
        self
    }

    /// The delays before a failed message is read again.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.settings.backoff = backoff;
        self
    }

    /// How long an offset commit is awaited (default 30 s).
    pub fn commit_timeout(mut self, timeout: Duration) -> Self {
        self.settings.commit_timeout = timeout;
        self
    }

    /// How long the [`on_reject`](Self::on_reject) hook is awaited for one
    /// message (default 30 s); past it the hook's future is dropped and the
    /// message stays unanswered, like a failed route.
    pub fn reject_timeout(mut self, timeout: Duration) -> Self {
        self.reject.hook_timeout = timeout;
        self
    }

    /// Rejected messages are produced to `topic` (with the consumer's
    /// connection properties, or `producer` when given); a message counts as
    /// answered once its delivery report came back, within the
    /// [`commit_timeout`](Self::commit_timeout) (the producer's
    /// `message.timeout.ms` when the consumer's properties are used).
    pub fn dead_letter_topic(
        mut self,
        topic: impl Into<String>,
        producer: Option<ClientConfig>,
    ) -> Self {
        self.dead_letter = Some((topic.into(), producer));
        self
    }

    /// Rejected messages are handed to `hook` (after the dead-letter topic,
    /// if any); `Err`, or no answer within the
    /// [`reject_timeout`](Self::reject_timeout), keeps the message unanswered
    /// (its partition holds it; the hook is called again when it is read
    /// again, so make it idempotent).
    pub fn on_reject<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn(Rejected) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        self.reject.hook = Some(Arc::new(move |rejected| hook(rejected).boxed()));
        self
    }

    /// Checks the settings, creates the client and subscribes.
    ///
    /// # Errors
    /// [`KafkaConsumerError::Config`] for an inconsistent configuration (no
    /// topic, no `group.id` or `bootstrap.servers`, automatic commits asked
    /// for, no reject route, a zero batch size, linger, concurrency or
    /// timeout, a `max.poll.interval.ms` below the manager's lease times
    /// `ceil(batch_size / concurrency)`).
    ///
    /// What the `max.poll.interval.ms` check guarantees: `execute_batch`
    /// reserves and runs a batch's keys in groups of `concurrency`, one group
    /// after another, so with distinct keys a batch's handlers take about
    /// `ceil(batch_size / concurrency)` leases at most (a handler that stays
    /// within its lease). Not covered, and to be left room for: a key repeated
    /// within a batch (its later occurrences wait for the first), handlers
    /// that outlive their lease, the reject routes (up to the
    /// [`commit_timeout`](Self::commit_timeout) for the dead-letter topic, the
    /// [`reject_timeout`](Self::reject_timeout) for the hook) and the commit
    /// (up to the `commit_timeout`). A batch that outlasts
    /// `max.poll.interval.ms` makes the consumer leave its group (see the
    /// [module docs](super)).
    /// [`KafkaConsumerError::Kafka`] when librdkafka refuses the client.
    pub fn build(mut self) -> Result<KafkaConsumer<C>, KafkaConsumerError> {
        self.check()?;
        for (key, value) in OWNED {
            self.client.set(key, value);
        }
        if let Some((topic, producer)) = self.dead_letter.take() {
            let timeout = self.settings.commit_timeout;
            let producer = producer.unwrap_or_else(|| self.producer_config(timeout));
            self.reject.dead_letter = Some(DeadLetter {
                topic,
                producer: producer.create::<FutureProducer>()?,
                timeout,
            });
        }
        let state = Arc::new(Mutex::new(Partitions::default()));
        let context = PartitionContext {
            state: state.clone(),
        };
        let consumer: StreamConsumer<PartitionContext> =
            StreamConsumer::from_config_and_context(&self.client, context)?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        Ok(KafkaConsumer {
            consumer: Arc::new(consumer),
            manager: self.manager,
            keys: self.keys,
            settings: self.settings,
            reject: self.reject,
            state,
        })
    }

    fn check(&self) -> Result<(), KafkaConsumerError> {
        let fail = |reason: String| Err(KafkaConsumerError::Config(reason));
        if self.topics.is_empty() || self.topics.iter().any(String::is_empty) {
            return fail("no topic (or an empty topic name) to subscribe to".into());
        }
        for key in ["bootstrap.servers", "group.id"] {
            if self.client.get(key).is_none_or(str::is_empty) {
                return fail(format!("the client configuration has no `{key}`"));
            }
        }
        for (key, value) in OWNED {
            if self.client.get(key).is_some_and(|v| v != value) {
                return fail(format!(
                    "`{key}` must be `{value}`: offsets are committed once messages are answered"
                ));
            }
        }
        if self.dead_letter.is_none() && self.reject.is_empty() {
            return fail("rejected messages need a dead-letter topic or an on_reject hook".into());
        }
        let s = &self.settings;
        if s.batch_size == 0 || s.concurrency == 0 || s.linger.is_zero() {
            return fail("batch_size, concurrency and linger must be above zero".into());
        }
        if s.commit_timeout.is_zero()
            || s.backoff.initial.is_zero()
            || self.reject.hook_timeout.is_zero()
        {
            return fail(
                "commit_timeout, reject_timeout and the backoff must be above zero".into(),
            );
        }
        let lease = self.manager.config().processing_timeout;
        let max_poll = match self.client.get("max.poll.interval.ms") {
            None => Duration::from_secs(300),
            Some(ms) => match ms.parse::<u64>() {
                Ok(ms) => Duration::from_millis(ms),
                Err(_) => return fail(format!("`max.poll.interval.ms` is not a number: {ms}")),
            },
        };
        let groups = s.batch_size.div_ceil(s.concurrency);
        let needed = u32::try_from(groups)
            .ok()
            .and_then(|groups| lease.checked_mul(groups));
        if needed.is_none_or(|needed| max_poll < needed) {
            return fail(format!(
                "`max.poll.interval.ms` ({max_poll:?}) must be at least the manager's lease ({lease:?}) \
                 times ceil(batch_size / concurrency) ({groups}): a batch's keys run in groups of \
                 `concurrency`, one group after another, each for about a lease, and the \
                 consumer is not polled meanwhile"
            ));
        }
        Ok(())
    }

    fn producer_config(&self, timeout: Duration) -> ClientConfig {
        let mut producer = ClientConfig::new();
        for (key, value) in self.client.config_map() {
            if SHARED_PREFIXES.iter().any(|p| key.starts_with(p)) {
                producer.set(key, value);
            }
        }
        producer.set("message.timeout.ms", timeout.as_millis().to_string());
        producer
    }
}
