//! SQS: `SqsConsumer::poll_once` (over a store) against the same receive,
//! handler and `DeleteMessageBatch` through the same SDK client, without the
//! layer.
//!
//! **A batch of 100.** A receive takes at most 10 messages, so each variant
//! runs [`SQS_POLLERS`](super::SQS_POLLERS) poll loops at once (`--sqs-pollers`), each receiving up
//! to 10: 100 messages in flight, as a consumer process with ten polling
//! tasks has. A "poll" in the figures is one receive of up to 10, its
//! handlers and its delete. Receives are short polls (wait time 0), so the
//! end of a round waits on no long poll; a poll loop that finds the queue
//! empty while others still hold the round's last messages tries again
//! after 5 ms.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageAttributeValue, MessageSystemAttributeName,
    QueueAttributeName, SendMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;
use futures::stream::{self, StreamExt, TryStreamExt};
use idempotency_consumers::sqs::{SqsConsumer, SqsMessage, DEFAULT_KEY_ATTRIBUTE};
use idempotency_consumers::{Backoff, Disposition};
use idempotency_core::{ExecutionContext, HandlerError, IdempotencyManager, SharedRepository};
use parking_lot::Mutex;

use super::{complete_keys, handle, manager, nanos_since, payload, BrokerWorkload, Round, STALL};
use crate::workloads::key_id;
use crate::{BoxError, Scenario, Variant};

/// SQS's most messages per receive (and per batch call).
const RECEIVE: usize = 10;
/// The queues' visibility timeout: the manager's default lease (300 s), so
/// the consumer needs no visibility heartbeat.
const VISIBILITY: u32 = 300;

/// The messages a round consumed, and how many deliveries were of a message
/// consumed before.
#[derive(Debug, Default)]
struct Seen {
    ids: HashSet<String>,
    redelivered: usize,
}

/// Where the SQS server is.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `http://host:port`.
    pub url: String,
    /// The region to sign for.
    pub region: String,
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
}

/// The library's consumer and the raw loop, each on its own queue.
#[derive(Debug)]
pub struct SqsWorkload {
    store: String,
    setup: String,
    client: Client,
    manager: IdempotencyManager,
    library: SqsConsumer,
    library_queue: String,
    raw_queue: String,
    pollers: usize,
    handled: Arc<AtomicUsize>,
}

/// An SDK client for `endpoint` (plain HTTP, as the harness's server speaks).
pub fn client(endpoint: &Endpoint) -> Client {
    let credentials = Credentials::new(
        &endpoint.access_key_id,
        &endpoint.secret_access_key,
        None,
        None,
        "bench",
    );
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(endpoint.region.clone()))
        .endpoint_url(&endpoint.url)
        .credentials_provider(credentials)
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Client::from_conf(config)
}

async fn create_queue(client: &Client, prefix: &str) -> Result<String, BoxError> {
    let name = format!("bench-{prefix}-{:016x}", rand::random::<u64>());
    let output = client
        .create_queue()
        .queue_name(name)
        .attributes(
            QueueAttributeName::VisibilityTimeout,
            VISIBILITY.to_string(),
        )
        .send()
        .await?;
    Ok(output
        .queue_url()
        .ok_or("CreateQueue gave no URL")?
        .to_owned())
}

impl SqsWorkload {
    /// Queues and consumers on `endpoint`; the library's manager over `repo`;
    /// `pollers` poll loops per variant.
    ///
    /// # Errors
    /// SQS's refusal, or a consumer the builder refuses.
    pub async fn connect(
        endpoint: &Endpoint,
        store: &str,
        repo: SharedRepository,
        store_setup: &str,
        pollers: usize,
    ) -> Result<Self, BoxError> {
        let client = client(endpoint);
        let library_queue = create_queue(&client, "library").await?;
        let raw_queue = create_queue(&client, "raw").await?;
        let manager = manager(repo)?;
        let library = SqsConsumer::builder(client.clone(), manager.clone(), &library_queue)
            .wait_time(Duration::ZERO)
            .max_messages(RECEIVE as u8)
            .concurrency(RECEIVE)
            // A message received twice at once is answered `Retry` by one
            // poll (its key in flight): it comes back within a second.
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(1),
            })
            .build()
            .await?;
        let setup = format!(
            "SQS at {} ({pollers} poll loops per variant, receives of up to {RECEIVE}, short \
             polling); library over {store_setup}; raw: the same ReceiveMessage, handler and \
             DeleteMessageBatch through the same client",
            endpoint.url
        );
        Ok(SqsWorkload {
            store: store.to_owned(),
            setup,
            client,
            manager,
            library,
            library_queue,
            raw_queue,
            pollers: pollers.max(1),
            handled: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn run_handler(&self, body: &str) -> usize {
        self.handled.fetch_add(1, Ordering::Relaxed);
        handle(body.as_bytes())
    }

    /// One library poll: the ids of the messages deleted. A message
    /// received twice at once (SQS is at least once) may be answered
    /// `Retry` by one of the polls (its key in flight): not deleted, it
    /// comes back.
    async fn poll_library(&self) -> Result<Vec<String>, BoxError> {
        let handler = |message: SqsMessage, _ctx: ExecutionContext| {
            std::future::ready(Ok::<_, HandlerError<String>>(
                self.run_handler(&message.body),
            ))
        };
        let report = self.library.poll_once(handler).await?;
        let settled = report.settled;
        let acked: Vec<String> = report
            .messages
            .into_iter()
            .filter(|h| matches!(h.disposition, Disposition::Ack(_)))
            .map(|h| h.message_id)
            .collect();
        if settled.failures > 0 || settled.dead_lettered > 0 || settled.deleted != acked.len() {
            return Err(format!("the library's poll did not settle cleanly: {settled:?}").into());
        }
        Ok(acked)
    }

    /// One raw poll: receive, handle, delete; the ids of the messages
    /// deleted.
    async fn poll_raw(&self) -> Result<Vec<String>, BoxError> {
        let output = self
            .client
            .receive_message()
            .queue_url(&self.raw_queue)
            .max_number_of_messages(RECEIVE as i32)
            .wait_time_seconds(0)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::MessageDeduplicationId)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .message_attribute_names("All")
            .send()
            .await?;
        let messages = output.messages();
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let mut entries = Vec::with_capacity(messages.len());
        for (i, message) in messages.iter().enumerate() {
            std::hint::black_box(self.run_handler(message.body().unwrap_or_default()));
            entries.push(
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(message.receipt_handle().unwrap_or_default())
                    .build()?,
            );
        }
        let deleted = self
            .client
            .delete_message_batch()
            .queue_url(&self.raw_queue)
            .set_entries(Some(entries))
            .send()
            .await?;
        if !deleted.failed().is_empty() {
            return Err(format!("raw delete failed: {:?}", deleted.failed()).into());
        }
        Ok(messages
            .iter()
            .map(|m| m.message_id().unwrap_or_default().to_owned())
            .collect())
    }

    /// One poll loop: polls until the round's `messages` are consumed (by all
    /// loops together); the duration of each poll that had messages.
    async fn poll_loop(
        &self,
        variant: Variant,
        seen: &Mutex<Seen>,
        messages: usize,
    ) -> Result<Vec<u64>, BoxError> {
        let mut polls = Vec::new();
        let mut last = Instant::now();
        while seen.lock().ids.len() < messages {
            let t = Instant::now();
            let deleted = match variant {
                Variant::Library => self.poll_library().await?,
                Variant::Raw => self.poll_raw().await?,
            };
            if deleted.is_empty() {
                if last.elapsed() > STALL {
                    let got = seen.lock().ids.len();
                    return Err(
                        format!("no message for {STALL:?}: {got} of {messages} consumed").into(),
                    );
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            polls.push(nanos_since(t));
            let mut seen = seen.lock();
            for id in deleted {
                if !seen.ids.insert(id) {
                    seen.redelivered += 1;
                }
            }
            last = Instant::now();
        }
        Ok(polls)
    }
}

#[async_trait]
impl BrokerWorkload for SqsWorkload {
    fn broker(&self) -> &'static str {
        "sqs"
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
        let chunks: Vec<Vec<usize>> = (0..messages)
            .collect::<Vec<_>>()
            .chunks(RECEIVE)
            .map(<[usize]>::to_vec)
            .collect();
        stream::iter(chunks)
            .map(|chunk| self.send(queue, ns, chunk))
            .buffer_unordered(8)
            .try_collect::<()>()
            .await
    }

    async fn consume(
        &self,
        variant: Variant,
        scenario: Scenario,
        messages: usize,
    ) -> Result<Round, BoxError> {
        self.handled.store(0, Ordering::Relaxed);
        let seen = Mutex::new(Seen::default());
        let started = Instant::now();
        let loops = (0..self.pollers).map(|_| self.poll_loop(variant, &seen, messages));
        let mut polls = Vec::new();
        for result in futures::future::join_all(loops).await {
            polls.extend(result?);
        }
        let elapsed = started.elapsed();
        let seen = seen.into_inner();
        let round = Round {
            messages: seen.ids.len(),
            redelivered: seen.redelivered,
            elapsed,
            polls,
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

impl SqsWorkload {
    /// Sends messages `chunk` of round `ns` to `queue` in one
    /// `SendMessageBatch`, each with its key in the consumer's attribute.
    async fn send(&self, queue: &str, ns: &str, chunk: Vec<usize>) -> Result<(), BoxError> {
        let mut entries = Vec::with_capacity(chunk.len());
        for i in chunk {
            let key = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(key_id(ns, i))
                .build()?;
            entries.push(
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(payload(i))
                    .message_attributes(DEFAULT_KEY_ATTRIBUTE, key)
                    .build()?,
            );
        }
        let output = self
            .client
            .send_message_batch()
            .queue_url(queue)
            .set_entries(Some(entries))
            .send()
            .await?;
        if !output.failed().is_empty() {
            return Err(format!("SendMessageBatch failed: {:?}", output.failed()).into());
        }
        Ok(())
    }
}
