//! A Kafka consumer (rdkafka, a consumer group) whose offsets move only past
//! answered messages.
//!
//! Each [`poll_once`](KafkaConsumer::poll_once) collects a batch (up to
//! [`batch_size`](KafkaConsumerBuilder::batch_size) messages, for at most the
//! [`linger`](KafkaConsumerBuilder::linger)), runs it through
//! [`run_poll`] (one reservation round trip per group of keys,
//! each message's [`Disposition`] decided by the shared
//! policy), then settles each partition:
//!
//! - **Commit up to the first unanswered message.** A message answered
//!   `Retry` (its key held by another consumer, a store outage, a transient
//!   handler failure) holds its partition: the committed offset stops right
//!   before it, the partition is paused for the `retry_after` (or the
//!   [`Backoff`](crate::Backoff) of its attempt; at least 250 ms, so a key
//!   held elsewhere is not re-read in a tight loop), then sought back to it
//!   and read again from it. It is never skipped. The messages after
//!   it in the same batch that were answered (acknowledged or routed) are
//!   read again too, but this consumer remembers them (per partition, until
//!   committed past, at most 10 000) and counts them answered without running
//!   them again (nor counting them again in the metrics): their outcome may not be in the store (`Unrecorded`,
//!   `Unprotected`, a permanent failure whose record could not be written).
//!   After a rebalance their new owner has no such memory: it answers them
//!   from the store, and runs again those the store holds no completed
//!   record of, as the contract says of any redelivery. (With
//!   [`concurrency`](KafkaConsumerBuilder::concurrency) above one, handlers
//!   of one partition do not run in offset order anyway.)
//! - **Rejects are routed, then answered.** A message no redelivery can
//!   answer (no key: `invalid_key`; a permanent handler failure; a payload
//!   mismatch; …) is produced to the
//!   [dead-letter topic](KafkaConsumerBuilder::dead_letter_topic) (its delivery
//!   report awaited) and/or handed to the
//!   [`on_reject`](KafkaConsumerBuilder::on_reject) hook; only then is its
//!   offset committed past. A failed route (or a hook that does not answer
//!   within the [`reject_timeout`](KafkaConsumerBuilder::reject_timeout))
//!   holds the partition like a retry.
//!   A reject read again before its partition's commit passed it (an earlier
//!   message held the partition) is not routed again by this consumer; after
//!   a rebalance its new owner may route it again: the dead-letter topic is
//!   at least once (its `idempotency-source` header names the original).
//! - **Commits follow the recorded outcomes.** Offsets are committed after
//!   `run_poll` returned (every outcome is recorded in the store by then),
//!   synchronously: the broker's answer is awaited (on a blocking thread,
//!   bounded by [`commit_timeout`](KafkaConsumerBuilder::commit_timeout)), so
//!   a poll that returns has either committed its progress or reports why
//!   not, and a failed commit is tried again with the next one. Automatic
//!   commits are off (the builder refuses them).
//! - **Rebalances.** librdkafka runs rebalance callbacks while the consumer
//!   is polled, which happens only while a batch is collected: on revocation
//!   the revoked partitions stop taking work (their messages collected so far
//!   are dropped, unrun) and their answered, uncommitted offsets are committed
//!   before the partitions are given up. A batch is never interrupted by a
//!   revocation; if answering it outlasts `max.poll.interval.ms` the consumer
//!   leaves the group and its commits fail, but its outcomes are recorded in
//!   the store, so the partitions' new owner answers those messages as
//!   duplicates.
//! - **Attempts.** Each message's deliveries to this consumer are counted
//!   (per partition, until committed past; at most 10 000 per partition),
//!   for the backoff; a message is `redelivered` when delivered before here,
//!   or when its offset is below where this consumer had read its partition
//!   to when the partition was last revoked from it.
//! - [`run`](KafkaConsumer::run) polls until a shutdown signal, finishing the
//!   batch in hand and its commits before it returns.
//! - **Abandoned batches: cancel and panic safety.** As a batch is
//!   collected, each of its partitions is marked in flight from the batch's
//!   first message; the mark is cleared once the batch is settled. A
//!   [`poll_once`](KafkaConsumer::poll_once) dropped before that (a caller's
//!   timeout, a `select!`) or a handler panic (which continues out of
//!   `poll_once`/`run` once the batch's other outcomes are recorded, as in
//!   [`execute_batch`](idempotency_core::IdempotencyManager::execute_batch))
//!   leaves the mark: nothing of the batch is committed, and the next
//!   `poll_once` (or `run`) on this consumer first seeks those partitions
//!   back to it, so the batch is read again (the store answers the messages
//!   that completed; the others run). A consumer dropped instead leaves the
//!   batch to the partitions' next owner, from the last commit.
//! - **Blocking calls.** Pauses and resumes are local librdkafka calls; a
//!   seek waits for librdkafka's fetcher (up to 5 s) and runs on a blocking
//!   thread, as does the commit after a batch. The revocation commit runs
//!   inside librdkafka's rebalance callback, on the task that polls, and
//!   blocks it for one round trip. Run the consumer on a multi-threaded
//!   runtime when other tasks must not wait for it.
//!
//! librdkafka is built from source without SSL, SASL, zstd and curl (the
//! fastest offline build): gzip (system zlib or a bundled copy), snappy and
//! lz4 batches are read. For zstd-compressed topics or TLS, enable rdkafka's
//! `zstd`/`ssl` features in your own `Cargo.toml` (Cargo unifies them).
//!
//! Keys come from a header, the message key or a closure/[`KeyStrategy`](idempotency_core::KeyStrategy)
//! over the payload ([`KeySource`]); the fingerprint is computed over the
//! payload's bytes. Keys live in the manager's namespace: give each topic
//! whose keys may collide its own manager (namespace).
//!
//! Tests: `consumers/tests/kafka.rs` runs against librdkafka's mock cluster
//! (in-process, speaking the Kafka protocol: consumer groups, rebalances,
//! offset commits), as this machine has no Kafka broker; with
//! `IDEMPOTENCY_TEST_KAFKA_BROKERS` set they run against that cluster.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idempotency_consumers::kafka::{rdkafka, KafkaConsumer, KeySource};
//! use idempotency_consumers::kafka::rdkafka::Message;
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
//! let mut client = rdkafka::ClientConfig::new();
//! client.set("bootstrap.servers", "localhost:9092").set("group.id", "payments");
//! let consumer = KafkaConsumer::builder(manager, client)
//!     .topics(["payments"])
//!     .key(KeySource::header("idempotency-key"))
//!     .linger(Duration::from_millis(200))
//!     .dead_letter_topic("payments.dead-letter", None)
//!     .build()?;
//! // Send on `stop_tx` (a signal handler, say) to stop after the batch in hand.
//! let (stop_tx, stop) = tokio::sync::oneshot::channel::<()>();
//! # drop(stop_tx);
//! consumer
//!     .run(
//!         |message, _ctx| async move {
//!             let amount = message.payload().map_or(0, <[u8]>::len);
//!             Ok::<_, HandlerError<String>>(amount)
//!         },
//!         async { stop.await.ok(); },
//!     )
//!     .await?;
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use idempotency_core::{Codec, ExecutionContext, HandlerError, IdempotencyManager};
use parking_lot::Mutex;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Message, OwnedMessage};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;
use tracing::Instrument;

use crate::batch::{run_poll, Answered, Delivery};
use crate::disposition::Disposition;

mod builder;
mod holds;
mod keys;
pub mod offsets;
mod partitions;
mod reject;
mod retention;

pub use builder::{KafkaConsumerBuilder, KafkaConsumerError};
pub use keys::{KeyFn, KeySource};
pub use rdkafka;
pub use reject::{headers, RejectHook, Rejected};
pub use retention::topic_retention;

use builder::Settings;
use keys::PayloadBytes;
use offsets::Step;
use partitions::{offsets_list, PartitionContext, Partitions, Tp};
use reject::RejectRoute;

/// The broker label in metrics.
const BROKER: &str = "kafka";

/// A Kafka consumer group member that runs each message through an
/// [`IdempotencyManager`] and commits only what is answered (see the
/// [module docs](self)).
pub struct KafkaConsumer<C: Codec + Clone> {
    consumer: Arc<StreamConsumer<PartitionContext>>,
    manager: IdempotencyManager<C>,
    keys: KeySource,
    settings: Settings,
    reject: RejectRoute,
    state: Arc<Mutex<Partitions>>,
}

impl<C: Codec + Clone> fmt::Debug for KafkaConsumer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("keys", &self.keys)
            .field("settings", &self.settings)
            .field("reject", &self.reject)
            .finish_non_exhaustive()
    }
}

/// What one [`poll_once`](KafkaConsumer::poll_once) did.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct PollReport {
    /// Messages run through the manager.
    pub messages: usize,
    /// Messages acknowledged (executed, or duplicates).
    pub acked: usize,
    /// Messages rejected and routed (dead-letter topic, hook).
    pub rejected: usize,
    /// Messages not answered yet: their partitions are held.
    pub retried: usize,
    /// Offsets committed by this poll: `(topic, partition) → next offset`.
    pub committed: BTreeMap<(String, i32), i64>,
    /// Partitions held after this poll.
    pub held: usize,
    /// Why answered offsets could not be committed (they are tried again with
    /// the next commit, or on revocation).
    pub commit_error: Option<KafkaConsumerError>,
}

/// One collected message.
struct Received {
    message: Arc<OwnedMessage>,
    epoch: u64,
    attempt: u32,
    redelivered: bool,
    /// Answered already, past a hold that brought it back: not run again.
    answered: bool,
}

impl Received {
    fn tp(&self) -> Tp {
        (self.message.topic().to_owned(), self.message.partition())
    }
}

impl<C: Codec + Clone> KafkaConsumer<C> {
    /// A builder over `manager` and the client configuration (at least
    /// `bootstrap.servers` and `group.id`).
    pub fn builder(
        manager: IdempotencyManager<C>,
        client: rdkafka::ClientConfig,
    ) -> KafkaConsumerBuilder<C> {
        KafkaConsumerBuilder::new(manager, client)
    }

    /// The underlying rdkafka consumer (assignment, positions, metadata).
    /// Committing, seeking or pausing through it bypasses this consumer's
    /// bookkeeping.
    pub fn inner(&self) -> &StreamConsumer<impl rdkafka::consumer::ConsumerContext> {
        &*self.consumer
    }

    /// Polls until `shutdown` completes, then finishes the batch in hand and
    /// its commits, commits what is still pending, and returns.
    ///
    /// A failed poll (the client's error with no message) is logged and
    /// followed by the backoff's first delay.
    ///
    /// Dropped (or left by a handler's panic) before `shutdown`, it loses
    /// nothing: as with [`poll_once`](Self::poll_once), the next `run` or
    /// `poll_once` on this consumer reads the abandoned batch again.
    ///
    /// # Errors
    /// The last commit's error, when the answered offsets could not be
    /// committed on the way out (the next owner answers those messages from
    /// the store).
    pub async fn run<T, E, H, Fut>(
        &self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), KafkaConsumerError>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        H: Fn(Arc<OwnedMessage>, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        tokio::pin!(shutdown);
        loop {
            self.recover_in_flight();
            self.release_due_holds().await;
            let batch = tokio::select! {
                biased;
                () = &mut shutdown => break,
                batch = self.collect() => batch,
            };
            match batch {
                Ok(batch) => {
                    let report = self.process(batch, &handler).await;
                    if let Some(error) = report.commit_error {
                        tracing::warn!(%error, "offsets not committed; tried again with the next commit");
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "kafka poll failed");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(self.settings.backoff.initial) => {}
                    }
                }
            }
        }
        let (_, error) = self.commit_pending().await;
        error.map_or(Ok(()), Err)
    }

    /// One step: reads again what an abandoned batch left, ends the holds
    /// that are over, collects a batch, answers it and commits what is
    /// answered.
    ///
    /// # Cancel safety
    /// Cancel-safe and panic-safe in the sense that no message is lost: a
    /// `poll_once` dropped at any await point (or left by a handler's panic)
    /// commits nothing of its batch, and the next `poll_once` or
    /// [`run`](Self::run) on this consumer reads the batch's partitions again
    /// from the batch's first message. Handlers cut short by the drop did not
    /// finish (the re-read runs them once the manager lets their keys go),
    /// and those that finished are answered from the store. A reject routed before the drop may be routed again.
    ///
    /// # Errors
    /// The client's error when the poll failed before any message came.
    pub async fn poll_once<T, E, H, Fut>(
        &self,
        handler: H,
    ) -> Result<PollReport, KafkaConsumerError>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        H: Fn(Arc<OwnedMessage>, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        self.recover_in_flight();
        self.release_due_holds().await;
        let batch = self.collect().await?;
        Ok(self.process(batch, &handler).await)
    }

    /// Collects up to `batch_size` messages for at most the linger (less when
    /// a hold ends sooner).
    async fn collect(&self) -> Result<Vec<Received>, KafkaConsumerError> {
        let mut deadline = Instant::now() + self.settings.linger;
        if let Some(due) = self.state.lock().next_due() {
            deadline = deadline.min(Instant::from_std(due));
        }
        let mut batch = Vec::new();
        while batch.len() < self.settings.batch_size {
            let message = match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                Err(_elapsed) => break,
                Ok(Ok(message)) => message,
                // Only with `enable.partition.eof`: nothing to answer.
                Ok(Err(KafkaError::PartitionEOF(_))) => continue,
                Ok(Err(error)) if batch.is_empty() => return Err(error.into()),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "kafka poll failed; answering the batch so far");
                    break;
                }
            };
            let tp = (message.topic().to_owned(), message.partition());
            let Some(admitted) = self.state.lock().admit(&tp, message.offset()) else {
                continue;
            };
            batch.push(Received {
                message: Arc::new(message.detach()),
                epoch: admitted.epoch,
                attempt: admitted.attempt,
                redelivered: admitted.redelivered,
                answered: admitted.answered,
            });
        }
        // Partitions revoked while collecting: their messages are not run.
        let state = self.state.lock();
        batch.retain(|r| state.current(&r.tp(), r.epoch));
        Ok(batch)
    }

    /// Answers a batch, routes its rejects, settles and commits.
    async fn process<T, E, H, Fut>(&self, batch: Vec<Received>, handler: &H) -> PollReport
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        H: Fn(Arc<OwnedMessage>, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let span = tracing::info_span!("idempotency.kafka.poll", messages = batch.len());
        async {
            let mut report = PollReport {
                messages: batch.len(),
                ..PollReport::default()
            };
            if !batch.is_empty() {
                let (batch, steps) = self.answer(batch, handler, &mut report).await;
                self.settle(&batch, &steps);
            }
            let (committed, error) = self.commit_pending().await;
            report.committed = committed;
            report.commit_error = error;
            report.held = self.state.lock().held();
            report
        }
        .instrument(span)
        .await
    }

    /// Runs the batch's messages not answered yet through `run_poll` and
    /// routes its rejects; the messages answered already (past a hold that
    /// brought them back) are counted answered without running again.
    /// Returns the batch, reordered, with each message's step.
    async fn answer<T, E, H, Fut>(
        &self,
        batch: Vec<Received>,
        handler: &H,
        report: &mut PollReport,
    ) -> (Vec<Received>, Vec<Step>)
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        H: Fn(Arc<OwnedMessage>, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let (known, mut batch): (Vec<Received>, Vec<Received>) =
            batch.into_iter().partition(|r| r.answered);
        let mut steps = Vec::with_capacity(batch.len() + known.len());
        if !batch.is_empty() {
            let (deliveries, missing) = self.deliveries(&batch);
            let answers = run_poll(
                BROKER,
                &self.manager,
                &deliveries,
                self.settings.concurrency,
                &self.settings.backoff,
                |index, ctx| {
                    let message = &batch[index].message;
                    let span = tracing::info_span!(
                        "idempotency.kafka.message",
                        topic = message.topic(),
                        partition = message.partition(),
                        offset = message.offset(),
                    );
                    handler(message.clone(), ctx).instrument(span)
                },
            )
            .await;
            steps = self.steps(&batch, answers, missing, report).await;
        }
        for received in known {
            let (tp, offset) = (received.tp(), received.message.offset());
            if self.state.lock().was_routed(&tp, offset) {
                report.rejected += 1;
            } else {
                report.acked += 1;
            }
            tracing::debug!(
                topic = tp.0,
                partition = tp.1,
                offset,
                "answered before its partition was held: not run again"
            );
            batch.push(received);
            steps.push(Step::Answered);
        }
        (batch, steps)
    }

    /// The deliveries for `run_poll`, and why the key-less ones have none
    /// (they go with an empty key, which the manager answers `InvalidKey`:
    /// rejected as `invalid_key`, counted like every other answer).
    fn deliveries(&self, batch: &[Received]) -> (Vec<Delivery<PayloadBytes>>, Vec<Option<String>>) {
        batch
            .iter()
            .map(|r| {
                let (key, missing) = match self.keys.key_of(&r.message) {
                    Ok(key) => (key, None),
                    Err(why) => (String::new(), Some(why)),
                };
                let delivery = Delivery {
                    key,
                    payload: PayloadBytes(r.message.clone()),
                    attempt: r.attempt,
                    redelivered: r.redelivered,
                };
                (delivery, missing)
            })
            .unzip()
    }

    /// Each message's step; rejects are routed first (concurrently).
    async fn steps<T, E: fmt::Display>(
        &self,
        batch: &[Received],
        answers: Vec<Answered<T, E>>,
        missing: Vec<Option<String>>,
        report: &mut PollReport,
    ) -> Vec<Step> {
        let mut steps = Vec::with_capacity(batch.len());
        let mut routes = Vec::new();
        for (index, (answered, missing)) in answers.into_iter().zip(missing).enumerate() {
            steps.push(match answered.disposition {
                Disposition::Ack(_) => {
                    report.acked += 1;
                    Step::Answered
                }
                Disposition::Retry { after, .. } => {
                    report.retried += 1;
                    Step::Unanswered { after }
                }
                Disposition::Reject { reason } => {
                    let detail = missing.unwrap_or_else(|| match &answered.answer {
                        Err(error) => error.to_string(),
                        Ok(_) => reason.to_owned(),
                    });
                    let received = &batch[index];
                    let tp = received.tp();
                    let offset = received.message.offset();
                    if self.state.lock().was_routed(&tp, offset) {
                        report.rejected += 1;
                        tracing::debug!(
                            topic = tp.0,
                            partition = tp.1,
                            offset,
                            reason,
                            "rejected message routed already"
                        );
                    } else {
                        let rejected = Rejected {
                            message: received.message.clone(),
                            reason,
                            detail,
                        };
                        routes.push(async move { (index, tp, self.reject.route(rejected).await) });
                    }
                    Step::Answered
                }
            });
        }
        for (index, tp, routed) in futures::future::join_all(routes).await {
            match routed {
                Ok(()) => {
                    report.rejected += 1;
                    let offset = batch[index].message.offset();
                    self.state.lock().routed(&tp, offset);
                }
                Err(error) => {
                    let after = self.settings.backoff.delay(batch[index].attempt);
                    let message = &batch[index].message;
                    tracing::warn!(
                        topic = message.topic(), partition = message.partition(),
                        offset = message.offset(), %error, ?after,
                        "the rejected message could not be routed; its partition holds it"
                    );
                    report.retried += 1;
                    steps[index] = Step::Unanswered { after };
                }
            }
        }
        steps
    }

    /// Commits the answered offsets waiting (synchronously, on a blocking
    /// thread); returns those the broker confirmed, or the error.
    async fn commit_pending(&self) -> (BTreeMap<(String, i32), i64>, Option<KafkaConsumerError>) {
        let pending = self.state.lock().pending();
        if pending.is_empty() {
            return (BTreeMap::new(), None);
        }
        let consumer = self.consumer.clone();
        let list = offsets_list(&pending);
        let commit = tokio::task::spawn_blocking(move || consumer.commit(&list, CommitMode::Sync));
        let timeout = self.settings.commit_timeout;
        let error = match tokio::time::timeout(timeout, commit).await {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(error))) => Some(error.into()),
            Ok(Err(join)) => Some(KafkaConsumerError::Interrupted(join.to_string())),
            Err(_elapsed) => Some(KafkaConsumerError::CommitTimeout(timeout)),
        };
        if error.is_some() {
            return (BTreeMap::new(), error);
        }
        self.state.lock().committed(&pending);
        tracing::debug!(offsets = ?pending, "offsets committed");
        (pending.into_iter().collect(), None)
    }
}
