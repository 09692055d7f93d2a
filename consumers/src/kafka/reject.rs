//! Where a rejected message goes: a dead-letter topic (produced, its delivery
//! report awaited) and/or the `on_reject` hook. Only once it got there is it
//! answered, and its offset committed past.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// A message no redelivery can answer, on its way to the reject route.
#[derive(Debug, Clone)]
pub struct Rejected {
    /// The message as it was consumed.
    pub message: Arc<OwnedMessage>,
    /// Why, as a metrics label (`invalid_key`, `handler_failed`,
    /// `payload_mismatch`, `previously_failed`, …).
    pub reason: &'static str,
    /// The error's text.
    pub detail: String,
}

/// The `on_reject` hook: `Err`, or no answer within the
/// [`reject_timeout`](super::KafkaConsumerBuilder::reject_timeout), keeps the
/// message unanswered (its partition holds it and tries again after the
/// backoff).
pub type RejectHook = Arc<dyn Fn(Rejected) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Headers a dead-lettered message carries besides its own.
pub mod headers {
    /// Why it was rejected (the reason label).
    pub const REASON: &str = "idempotency-reject-reason";
    /// The error's text.
    pub const DETAIL: &str = "idempotency-reject-detail";
    /// Where it was consumed from: `topic/partition/offset`.
    pub const SOURCE: &str = "idempotency-source";
}

#[derive(Clone)]
pub(crate) struct DeadLetter {
    pub(crate) topic: String,
    pub(crate) producer: FutureProducer,
    pub(crate) timeout: Duration,
}

#[derive(Clone, Default)]
pub(crate) struct RejectRoute {
    pub(crate) dead_letter: Option<DeadLetter>,
    pub(crate) hook: Option<RejectHook>,
    /// How long the hook is awaited.
    pub(crate) hook_timeout: Duration,
}

impl fmt::Debug for RejectRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RejectRoute")
            .field("dead_letter", &self.dead_letter.as_ref().map(|d| &d.topic))
            .field("hook", &self.hook.is_some())
            .field("hook_timeout", &self.hook_timeout)
            .finish()
    }
}

impl RejectRoute {
    pub(crate) fn is_empty(&self) -> bool {
        self.dead_letter.is_none() && self.hook.is_none()
    }

    /// Hands `rejected` to the dead-letter topic, then to the hook; `Err`
    /// when either failed or the hook did not answer within its timeout (the
    /// message stays unanswered; a hook cut short may have done its work,
    /// and is called again when the message is read again).
    pub(crate) async fn route(&self, rejected: Rejected) -> Result<(), String> {
        if let Some(dead_letter) = &self.dead_letter {
            dead_letter.produce(&rejected).await?;
        }
        if let Some(hook) = &self.hook {
            let timeout = self.hook_timeout;
            tokio::time::timeout(timeout, hook(rejected))
                .await
                .map_err(|_| format!("the on_reject hook did not finish within {timeout:?}"))??;
        }
        Ok(())
    }
}

impl DeadLetter {
    async fn produce(&self, rejected: &Rejected) -> Result<(), String> {
        let message = &rejected.message;
        let source = format!(
            "{}/{}/{}",
            message.topic(),
            message.partition(),
            message.offset()
        );
        let mut headers = OwnedHeaders::new();
        if let Some(own) = message.headers() {
            for header in own.iter() {
                headers = headers.insert(Header {
                    key: header.key,
                    value: header.value,
                });
            }
        }
        let extra = [
            (headers::REASON, rejected.reason),
            (headers::DETAIL, rejected.detail.as_str()),
            (headers::SOURCE, source.as_str()),
        ];
        for (key, value) in extra {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).headers(headers);
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        if let Some(payload) = message.payload() {
            record = record.payload(payload);
        }
        match self.producer.send(record, self.timeout).await {
            Ok(delivery) => {
                tracing::info!(
                    topic = %self.topic, partition = delivery.partition, offset = delivery.offset,
                    source, reason = rejected.reason, "message dead-lettered"
                );
                Ok(())
            }
            Err((error, _)) => Err(format!(
                "producing to the dead-letter topic {} failed: {error}",
                self.topic
            )),
        }
    }
}
