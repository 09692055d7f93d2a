//! AWS Lambda's SQS events and partial batch responses.
//!
//! Lambda receives and deletes the messages itself; a function answers which
//! ones it did not process (`batchItemFailures`, with `ReportBatchItemFailures`
//! enabled on the event source mapping) and Lambda leaves those on the queue,
//! to be delivered again when their visibility timeout ends (a partial batch
//! response cannot choose the delay) and moved by the queue's redrive policy
//! after `maxReceiveCount` deliveries. [`handle_event`] reports every message
//! not acknowledged: retried ones (another consumer holds the key, the store
//! is down, a transient failure) and rejected ones (a permanent failure, no
//! key), so nothing rejected is silently dropped.
//!
//! FIFO queues: Lambda expects a function to stop at a message group's first
//! failure; [`handle_event`] answers every record (later records of a group
//! may run before an earlier one is redelivered).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;

use idempotency_core::{Codec, ExecutionContext, HandlerError, IdempotencyManager};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::Instrument;

use super::answer::Answering;
use super::message::{parse_count, KeySource, SqsMessage};
use crate::disposition::Backoff;

/// An SQS event as Lambda delivers it (only the fields used here).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SqsEvent {
    /// The messages.
    #[serde(rename = "Records", default)]
    pub records: Vec<SqsEventRecord>,
}

/// One message of an [`SqsEvent`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SqsEventRecord {
    /// SQS's id of the message (what a failure reports).
    pub message_id: String,
    /// The body.
    #[serde(default)]
    pub body: String,
    /// The message attributes, by name.
    #[serde(default)]
    pub message_attributes: HashMap<String, SqsEventAttribute>,
    /// The system attributes.
    #[serde(default)]
    pub attributes: SqsEventSystemAttributes,
}

/// A message attribute of an [`SqsEventRecord`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SqsEventAttribute {
    /// The value of a `String` or `Number` attribute.
    #[serde(default)]
    pub string_value: Option<String>,
    /// `String`, `Number`, `Binary` (with an optional custom subtype).
    #[serde(default)]
    pub data_type: Option<String>,
}

/// The system attributes of an [`SqsEventRecord`] used here.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SqsEventSystemAttributes {
    /// How many times SQS delivered the message, as a decimal string.
    #[serde(rename = "ApproximateReceiveCount", default)]
    pub approximate_receive_count: Option<String>,
    /// The deduplication id (FIFO queues).
    #[serde(
        rename = "MessageDeduplicationId",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub message_deduplication_id: Option<String>,
    /// The message group (FIFO queues).
    #[serde(
        rename = "MessageGroupId",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub message_group_id: Option<String>,
}

/// A partial batch response: the messages Lambda is to leave on the queue.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchResponse {
    /// One entry per message not processed.
    #[serde(rename = "batchItemFailures")]
    pub batch_item_failures: Vec<BatchItemFailure>,
}

/// One message of a [`BatchResponse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchItemFailure {
    /// The message's `messageId`.
    #[serde(rename = "itemIdentifier")]
    pub item_identifier: String,
}

/// How [`handle_event`] answers an event's messages.
#[derive(Debug, Clone)]
pub struct LambdaOptions {
    /// Where each message's idempotency key comes from.
    pub key: KeySource,
    /// How many handlers run at once (at least 1 is used).
    pub concurrency: usize,
    /// Only for the dispositions' delays in metrics and logs: Lambda
    /// redelivers after the queue's visibility timeout.
    pub backoff: Backoff,
}

impl Default for LambdaOptions {
    fn default() -> Self {
        LambdaOptions {
            key: KeySource::default(),
            concurrency: 10,
            backoff: Backoff::default(),
        }
    }
}

impl SqsEventRecord {
    fn to_message(&self) -> SqsMessage {
        SqsMessage {
            message_id: self.message_id.clone(),
            body: self.body.clone(),
            attributes: self
                .message_attributes
                .iter()
                .filter_map(|(name, a)| Some((name.clone(), a.string_value.clone()?)))
                .collect(),
            receive_count: parse_count(self.attributes.approximate_receive_count.as_deref()),
            deduplication_id: self.attributes.message_deduplication_id.clone(),
            group_id: self.attributes.message_group_id.clone(),
            receipt_handle: None,
            raw_attributes: HashMap::new(),
        }
    }
}

/// Runs an SQS event's messages through `manager` (one handler run per key)
/// and answers which Lambda is to leave on the queue: every message not
/// acknowledged (see the [module docs](self)).
///
/// ```
/// use std::sync::Arc;
/// use idempotency_consumers::sqs::lambda::{handle_event, LambdaOptions, SqsEvent};
/// use idempotency_consumers::sqs::KeySource;
/// use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
/// let event: SqsEvent = serde_json::from_str(r#"{"Records": [
///   {"messageId": "m-1", "body": "10", "attributes": {"ApproximateReceiveCount": "1"},
///    "messageAttributes": {"order": {"stringValue": "o-1", "dataType": "String"}}},
///   {"messageId": "m-2", "body": "-5", "attributes": {"ApproximateReceiveCount": "1"},
///    "messageAttributes": {"order": {"stringValue": "o-2", "dataType": "String"}}},
///   {"messageId": "m-3", "body": "7", "attributes": {"ApproximateReceiveCount": "1"}}
/// ]}"#)?;
/// let options = LambdaOptions { key: KeySource::attribute("order"), ..LambdaOptions::default() };
/// let response = handle_event(&manager, &options, &event, |message, _ctx| async move {
///     let amount: i64 = message.body.parse().map_err(|_| HandlerError::permanent("not a number".to_owned()))?;
///     if amount < 0 {
///         return Err(HandlerError::permanent("negative amount".to_owned()));
///     }
///     Ok(amount)
/// })
/// .await;
/// // m-2 failed for good, m-3 has no key: both stay on the queue.
/// assert_eq!(
///     serde_json::to_string(&response)?,
///     r#"{"batchItemFailures":[{"itemIdentifier":"m-2"},{"itemIdentifier":"m-3"}]}"#
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub async fn handle_event<C, T, E, F, Fut>(
    manager: &IdempotencyManager<C>,
    options: &LambdaOptions,
    event: &SqsEvent,
    handler: F,
) -> BatchResponse
where
    C: Codec + Clone,
    T: Serialize + DeserializeOwned,
    E: fmt::Display,
    F: Fn(SqsMessage, ExecutionContext) -> Fut,
    Fut: Future<Output = Result<T, HandlerError<E>>>,
{
    let messages: Vec<SqsMessage> = event
        .records
        .iter()
        .map(SqsEventRecord::to_message)
        .collect();
    let answering = Answering {
        key: options.key.clone(),
        concurrency: options.concurrency.max(1),
        backoff: options.backoff,
    };
    let span = tracing::info_span!("sqs_lambda_event", messages = messages.len());
    let handled = answering
        .answer(manager, &messages, &handler)
        .instrument(span)
        .await;
    BatchResponse {
        batch_item_failures: handled
            .into_iter()
            .filter(|h| !h.disposition.is_ack())
            .map(|h| BatchItemFailure {
                item_identifier: h.message_id,
            })
            .collect(),
    }
}
