//! Telling SQS what was decided: one `DeleteMessageBatch` for what is
//! answered, one `ChangeMessageVisibilityBatch` for what is delivered again
//! later, `SendMessageBatch` to the dead-letter queue for what is rejected.

use std::future::Future;
use std::time::Duration;

use aws_sdk_sqs::error::{DisplayErrorContext, SdkError};
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, ChangeMessageVisibilityBatchRequestEntry,
    DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;
use idempotency_core::Error;

use super::message::SqsMessage;
use crate::disposition::{Backoff, Disposition};

/// Failures to settle messages with SQS, by `operation` (`delete`,
/// `change_visibility`, `dead_letter`, `heartbeat`): each is a message left
/// to reappear when its visibility timeout ends (none is retried at once).
pub const SETTLE_FAILURES: &str = "idempotency_consumer_sqs_settle_failures_total";

/// SQS's longest visibility timeout (12 hours).
pub const MAX_VISIBILITY: Duration = Duration::from_secs(43_200);

/// A batch call's most entries.
const BATCH: usize = 10;

/// What settling one poll did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Messages deleted (answered, or dead-lettered).
    pub deleted: usize,
    /// Messages whose visibility was changed (to be delivered again later).
    pub delayed: usize,
    /// Messages sent to the dead-letter queue.
    pub dead_lettered: usize,
    /// Messages SQS did not settle as decided (each logged and counted in
    /// [`SETTLE_FAILURES`]); they reappear when their visibility ends.
    pub failures: usize,
}

/// Where settling sends what it rejects, and how it backs off.
pub(crate) struct Settler<'a> {
    pub(crate) client: &'a Client,
    pub(crate) queue_url: &'a str,
    pub(crate) dead_letter_queue_url: Option<&'a str>,
    pub(crate) backoff: &'a Backoff,
    /// The longest one batch call may take.
    pub(crate) timeout: Duration,
}

/// `after` in whole seconds, rounded up, within SQS's limits.
pub(crate) fn visibility_seconds(after: Duration) -> i32 {
    let after = after.min(MAX_VISIBILITY);
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    i32::try_from(seconds).unwrap_or(i32::MAX)
}

impl Settler<'_> {
    /// Settles every message of a poll as decided.
    pub(crate) async fn settle(
        &self,
        messages: &[SqsMessage],
        dispositions: &[Disposition],
    ) -> Settled {
        let mut settled = Settled::default();
        let mut delete = Vec::new();
        let mut delay = Vec::new();
        let mut reject = Vec::new();
        for (message, disposition) in messages.iter().zip(dispositions) {
            match disposition {
                Disposition::Ack(_) => delete.push(message),
                Disposition::Retry { after, .. } => delay.push((message, *after)),
                Disposition::Reject { .. } => reject.push(message),
            }
        }
        if !reject.is_empty() {
            match self.dead_letter_queue_url {
                Some(dlq) => {
                    let (sent, unsent) = self.dead_letter(dlq, &reject, &mut settled).await;
                    settled.dead_lettered = sent.len();
                    delete.extend(sent);
                    delay.extend(unsent.into_iter().map(|m| (m, self.reject_delay(m))));
                }
                // The queue's redrive policy moves it after maxReceiveCount.
                None => delay.extend(reject.iter().map(|m| (*m, self.reject_delay(m)))),
            }
        }
        for chunk in delete.chunks(BATCH) {
            let failed = self.delete(chunk).await;
            settled.deleted += chunk.len().saturating_sub(failed);
            settled.failures += failed;
        }
        for chunk in delay.chunks(BATCH) {
            let failed = self.change_visibility(chunk, "change_visibility").await;
            settled.delayed += chunk.len().saturating_sub(failed);
            settled.failures += failed;
        }
        settled
    }

    /// A rejected message left to the redrive policy comes back after the
    /// backoff, not at once.
    fn reject_delay(&self, message: &SqsMessage) -> Duration {
        self.backoff.delay(message.receive_count)
    }

    /// Deletes `messages`; returns how many failed.
    async fn delete(&self, messages: &[&SqsMessage]) -> usize {
        let entries: Vec<DeleteMessageBatchRequestEntry> = messages
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(m.receipt_handle.clone()?)
                    .build()
                    .ok()
            })
            .collect();
        let unbuilt = messages.len() - entries.len();
        if entries.is_empty() {
            return unbuilt;
        }
        let request = self
            .client
            .delete_message_batch()
            .queue_url(self.queue_url)
            .set_entries(Some(entries))
            .send();
        let result = bounded("DeleteMessageBatch", self.timeout, request).await;
        let failed = match result {
            Ok(output) => entry_failures("delete", messages, output.failed()),
            Err(error) => call_failed("delete", messages, &error),
        };
        (unbuilt + failed).min(messages.len())
    }

    /// Sets the visibility of each message to its delay; returns how many
    /// failed.
    pub(crate) async fn change_visibility(
        &self,
        messages: &[(&SqsMessage, Duration)],
        operation: &'static str,
    ) -> usize {
        let entries: Vec<ChangeMessageVisibilityBatchRequestEntry> = messages
            .iter()
            .enumerate()
            .filter_map(|(i, (m, after))| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(m.receipt_handle.clone()?)
                    .visibility_timeout(visibility_seconds(*after))
                    .build()
                    .ok()
            })
            .collect();
        let unbuilt = messages.len() - entries.len();
        if entries.is_empty() {
            return unbuilt;
        }
        let request = self
            .client
            .change_message_visibility_batch()
            .queue_url(self.queue_url)
            .set_entries(Some(entries))
            .send();
        let result = bounded("ChangeMessageVisibilityBatch", self.timeout, request).await;
        let only: Vec<&SqsMessage> = messages.iter().map(|(m, _)| *m).collect();
        let failed = match result {
            Ok(output) => entry_failures(operation, &only, output.failed()),
            Err(error) => call_failed(operation, &only, &error),
        };
        (unbuilt + failed).min(messages.len())
    }

    /// Sends `messages` to the dead-letter queue (body and attributes kept);
    /// returns those sent and those not.
    async fn dead_letter<'m>(
        &self,
        dlq: &str,
        messages: &[&'m SqsMessage],
        settled: &mut Settled,
    ) -> (Vec<&'m SqsMessage>, Vec<&'m SqsMessage>) {
        let fifo = dlq.ends_with(".fifo");
        let mut sent = Vec::new();
        let mut unsent = Vec::new();
        for chunk in messages.chunks(BATCH) {
            let entries: Vec<SendMessageBatchRequestEntry> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, m)| dead_letter_entry(i, m, fifo))
                .collect();
            let built: Vec<String> = entries.iter().map(|e| e.id().to_owned()).collect();
            let request = self
                .client
                .send_message_batch()
                .queue_url(dlq)
                .set_entries(Some(entries))
                .send();
            let result = bounded("SendMessageBatch", self.timeout, request).await;
            let failed: Vec<String> = match &result {
                Ok(output) => {
                    entry_failures("dead_letter", chunk, output.failed());
                    output.failed().iter().map(|f| f.id().to_owned()).collect()
                }
                Err(error) => {
                    call_failed("dead_letter", chunk, error);
                    built.clone()
                }
            };
            for (i, message) in chunk.iter().enumerate() {
                let id = i.to_string();
                if failed.contains(&id) || !built.contains(&id) {
                    settled.failures += 1;
                    unsent.push(*message);
                } else {
                    sent.push(*message);
                }
            }
        }
        (sent, unsent)
    }
}

fn dead_letter_entry(
    index: usize,
    message: &SqsMessage,
    fifo: bool,
) -> Option<SendMessageBatchRequestEntry> {
    let mut entry = SendMessageBatchRequestEntry::builder()
        .id(index.to_string())
        .message_body(message.body.clone());
    if !message.raw_attributes.is_empty() {
        entry = entry.set_message_attributes(Some(message.raw_attributes.clone()));
    }
    if fifo {
        let group = message
            .group_id
            .clone()
            .unwrap_or_else(|| "dead-letter".to_owned());
        entry = entry
            .message_group_id(group)
            .message_deduplication_id(message.message_id.clone());
    }
    entry.build().ok()
}

/// Logs and counts the entries SQS refused; returns how many.
fn entry_failures(
    operation: &'static str,
    messages: &[&SqsMessage],
    failed: &[BatchResultErrorEntry],
) -> usize {
    for entry in failed {
        let message_id = entry
            .id()
            .parse::<usize>()
            .ok()
            .and_then(|i| messages.get(i))
            .map_or("?", |m| m.message_id.as_str());
        tracing::warn!(
            operation,
            message_id,
            code = entry.code(),
            reason = entry.message().unwrap_or_default(),
            "SQS refused to settle a message; it reappears when its visibility ends"
        );
    }
    count(operation, failed.len());
    failed.len()
}

/// Logs and counts a batch call that failed as a whole; returns how many
/// messages it held.
fn call_failed(operation: &'static str, messages: &[&SqsMessage], error: &Error) -> usize {
    tracing::warn!(
        operation,
        messages = messages.len(),
        %error,
        "an SQS batch call failed; its messages reappear when their visibility ends"
    );
    count(operation, messages.len());
    messages.len()
}

fn count(operation: &'static str, failures: usize) {
    if failures > 0 {
        metrics::counter!(SETTLE_FAILURES, "operation" => operation).increment(failures as u64);
    }
}

/// One SQS call, bounded by `timeout`: a call past it is abandoned (its
/// effect unknown) and answered [`Error::Timeout`].
pub(crate) async fn bounded<T, E, R>(
    operation: &'static str,
    timeout: Duration,
    call: impl Future<Output = Result<T, SdkError<E, R>>>,
) -> Result<T, Error>
where
    E: std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(|e| sdk_error(operation, e)),
        Err(_) => Err(Error::Timeout {
            backend: "sqs",
            operation,
        }),
    }
}

/// An SDK error as the core's error: a service's answer is a backend error,
/// anything else (no answer, a timeout, a broken connection) unavailability.
pub(crate) fn sdk_error<E, R>(operation: &str, error: SdkError<E, R>) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let message = format!("{operation}: {}", DisplayErrorContext(&error));
    match error {
        SdkError::ServiceError(_) => Error::Backend {
            backend: "sqs",
            message,
            source: Some(Box::new(error)),
        },
        _ => Error::Unavailable {
            backend: "sqs",
            message,
            source: Some(Box::new(error)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_rounds_up_within_limits() {
        assert_eq!(visibility_seconds(Duration::ZERO), 0);
        assert_eq!(visibility_seconds(Duration::from_millis(1)), 1);
        assert_eq!(visibility_seconds(Duration::from_millis(1000)), 1);
        assert_eq!(visibility_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(visibility_seconds(Duration::from_secs(86_400)), 43_200);
    }
}
