//! RabbitMQ: `RabbitConsumer::run` (prefetch 100: polls of up to 100, over a
//! store) against a lapin consumer doing the same: `basic.qos(100)`, the
//! first delivery plus what arrives within the same 5 ms linger, the same
//! handler, one `basic.ack` per delivery sent together after the poll.
//!
//! The consumer has no single-poll entry point, so a round is one `run`: it
//! starts (channel, qos, consume), stops once the round's messages are all
//! answered (counted by its `on_answer` hook) and returns after the last
//! poll is acknowledged. The raw loop opens, consumes and closes its channel
//! the same way each round. Per-poll latencies are not observable from
//! outside `run`: the library's line has none (the raw loop's are given).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use idempotency_consumers::rabbitmq::lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    QueueDeclareOptions,
};
use idempotency_consumers::rabbitmq::lapin::types::{FieldTable, ShortString};
use idempotency_consumers::rabbitmq::lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use idempotency_consumers::rabbitmq::{Message, RabbitConsumer};
use idempotency_consumers::Disposition;
use idempotency_core::{ExecutionContext, HandlerError, IdempotencyManager, SharedRepository};
use tokio::sync::Notify;

use super::{complete_keys, handle, manager, nanos_since, payload, BrokerWorkload, Round, STALL};
use crate::workloads::key_id;
use crate::{BoxError, Scenario, Variant};

/// Prefetch count, both variants: a poll takes up to this many.
pub const PREFETCH: u16 = 100;
/// The consumer's default linger, both variants.
const LINGER: Duration = Duration::from_millis(5);

/// The library's consumer and the raw loop, each on its own queue.
pub struct RabbitWorkload {
    store: String,
    setup: String,
    connection: Connection,
    channel: Channel,
    manager: IdempotencyManager,
    library: RabbitConsumer,
    library_queue: String,
    raw_queue: String,
    handled: Arc<AtomicUsize>,
    acked: Arc<AtomicUsize>,
    answered: Arc<Notify>,
}

impl std::fmt::Debug for RabbitWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitWorkload")
            .field("store", &self.store)
            .field("setup", &self.setup)
            .finish_non_exhaustive()
    }
}

async fn declare(channel: &Channel, prefix: &str) -> Result<String, BoxError> {
    let name = format!("bench-{prefix}-{:016x}", rand::random::<u64>());
    // Not auto-delete: each round's consumer cancels, which would delete it.
    // The queues are empty after a run (on your own broker: delete them).
    channel
        .queue_declare(
            name.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(name)
}

impl RabbitWorkload {
    /// Queues and consumers on the broker at `url`; the library's manager
    /// over `repo`.
    ///
    /// # Errors
    /// The broker's refusal, or a consumer the builder refuses.
    pub async fn connect(
        url: &str,
        store: &str,
        repo: SharedRepository,
        store_setup: &str,
    ) -> Result<Self, BoxError> {
        let connection = Connection::connect(url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        let library_queue = declare(&channel, "library").await?;
        let raw_queue = declare(&channel, "raw").await?;
        let manager = manager(repo)?;
        let acked = Arc::new(AtomicUsize::new(0));
        let answered = Arc::new(Notify::new());
        let (count, notify) = (acked.clone(), answered.clone());
        let library = RabbitConsumer::builder(manager.clone(), library_queue.as_str())
            .prefetch(PREFETCH)
            .linger(LINGER)
            .on_answer(move |_message, disposition| {
                if matches!(disposition, Disposition::Ack(_)) {
                    count.fetch_add(1, Ordering::Relaxed);
                    notify.notify_one();
                }
            })
            .build()?;
        let setup = format!(
            "RabbitMQ at {} (classic queues), prefetch {PREFETCH}, linger {} ms, one group of \
             {PREFETCH} keys a poll; library over {store_setup}; raw: a lapin consumer with the \
             same qos, linger, handler and per-delivery acks",
            redact(url),
            LINGER.as_millis()
        );
        Ok(RabbitWorkload {
            store: store.to_owned(),
            setup,
            connection,
            channel,
            manager,
            library,
            library_queue,
            raw_queue,
            handled: Arc::new(AtomicUsize::new(0)),
            acked,
            answered,
        })
    }

    fn run_handler(&self, body: &[u8]) -> usize {
        self.handled.fetch_add(1, Ordering::Relaxed);
        handle(body)
    }

    async fn consume_library(&self, messages: usize) -> Result<Round, BoxError> {
        self.acked.store(0, Ordering::Relaxed);
        let handler = |message: Arc<Message>, _ctx: ExecutionContext| {
            std::future::ready(Ok::<_, HandlerError<String>>(
                self.run_handler(&message.body),
            ))
        };
        // Stops once every message is answered (or nothing came for STALL).
        let shutdown = async {
            while self.acked.load(Ordering::Relaxed) < messages {
                if tokio::time::timeout(STALL, self.answered.notified())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        };
        let started = Instant::now();
        self.library
            .run(&self.connection, handler, shutdown)
            .await?;
        let consumed = self.acked.load(Ordering::Relaxed);
        if consumed < messages {
            return Err(
                format!("no message for {STALL:?}: {consumed} of {messages} consumed").into(),
            );
        }
        Ok(Round {
            messages: consumed,
            redelivered: 0,
            elapsed: started.elapsed(),
            polls: Vec::new(),
        })
    }

    async fn consume_raw(&self, messages: usize) -> Result<Round, BoxError> {
        let started = Instant::now();
        let channel = self.connection.create_channel().await?;
        channel
            .basic_qos(PREFETCH, BasicQosOptions { global: false })
            .await?;
        let mut consumer = channel
            .basic_consume(
                self.raw_queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut round = Round::default();
        while round.messages < messages {
            let t = Instant::now();
            let first = tokio::time::timeout(STALL, consumer.next())
                .await
                .map_err(|_| format!("no message for {STALL:?}"))?
                .ok_or("the raw consumer's stream ended")??;
            let deadline = tokio::time::Instant::now() + LINGER;
            let mut poll = vec![first];
            while poll.len() < usize::from(PREFETCH) {
                match tokio::time::timeout_at(deadline, consumer.next()).await {
                    Ok(Some(delivery)) => poll.push(delivery?),
                    Ok(None) | Err(_) => break,
                }
            }
            for delivery in &poll {
                std::hint::black_box(self.run_handler(&delivery.data));
            }
            let acks = poll
                .iter()
                .map(|d| d.acker.ack(BasicAckOptions { multiple: false }));
            for result in futures::future::join_all(acks).await {
                result?;
            }
            round.polls.push(nanos_since(t));
            round.messages += poll.len();
        }
        channel
            .basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await?;
        channel.close(200, "round done".into()).await?;
        round.elapsed = started.elapsed();
        Ok(round)
    }
}

/// The URL without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://…@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[async_trait]
impl BrokerWorkload for RabbitWorkload {
    fn broker(&self) -> &'static str {
        "rabbitmq"
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
        let queue = match variant {
            Variant::Library => &self.library_queue,
            Variant::Raw => &self.raw_queue,
        };
        let mut confirms = Vec::with_capacity(messages);
        for i in 0..messages {
            let properties =
                BasicProperties::default().with_message_id(ShortString::from(key_id(ns, i)));
            let confirm = self
                .channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    payload(i).as_bytes(),
                    properties,
                )
                .await?;
            confirms.push(confirm);
        }
        for confirm in confirms {
            confirm.await?;
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
