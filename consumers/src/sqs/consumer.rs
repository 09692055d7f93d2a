//! The consumer: receive, answer, keep invisible, settle; once or until
//! shutdown.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use aws_sdk_sqs::Client;
use idempotency_core::{
    Codec, Error, ExecutionContext, HandlerError, IdempotencyManager, JsonCodec,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use super::answer::{Answering, Handled};
use super::heartbeat::{keep_invisible, Heartbeat};
use super::message::{KeySource, SqsMessage};
use super::settle::{bounded, sdk_error, Settled, Settler, MAX_VISIBILITY};
use crate::disposition::Backoff;

/// SQS's longest long-polling wait.
const MAX_WAIT: Duration = Duration::from_secs(20);
/// The longest one SQS call takes by default.
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds an [`SqsConsumer`]; see [`SqsConsumer::builder`].
#[derive(Debug)]
pub struct SqsConsumerBuilder<C: Codec + Clone = JsonCodec> {
    client: Client,
    manager: IdempotencyManager<C>,
    queue_url: String,
    dead_letter_queue_url: Option<String>,
    answering: Answering,
    wait_time: Duration,
    max_messages: u8,
    call_timeout: Duration,
}

/// An SQS consumer that runs each message's handler once per idempotency key
/// (see the [module docs](super)).
#[derive(Debug)]
pub struct SqsConsumer<C: Codec + Clone = JsonCodec> {
    client: Client,
    manager: IdempotencyManager<C>,
    queue_url: String,
    dead_letter_queue_url: Option<String>,
    answering: Answering,
    wait_time: Duration,
    max_messages: u8,
    call_timeout: Duration,
    queue_visibility: Duration,
    heartbeat: Option<Heartbeat>,
}

/// What one poll did.
#[derive(Debug)]
pub struct PollReport<T, E> {
    /// Each message received, in the order SQS gave them.
    pub messages: Vec<Handled<T, E>>,
    /// What SQS was told.
    pub settled: Settled,
}

/// What [`SqsConsumer::run`] did until it was stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Receives answered by SQS (empty ones included).
    pub polls: u64,
    /// Messages received.
    pub messages: u64,
    /// Messages deleted.
    pub deleted: u64,
    /// Messages made visible again later (retried, or rejected without a
    /// dead-letter queue).
    pub delayed: u64,
    /// Messages sent to the dead-letter queue.
    pub dead_lettered: u64,
    /// Messages SQS did not settle as decided.
    pub settle_failures: u64,
    /// Receives that failed (each followed by a backoff).
    pub receive_errors: u64,
}

impl<C: Codec + Clone> SqsConsumer<C> {
    /// A builder for a consumer of `queue_url` with `client` (configured by
    /// the caller: region, credentials, endpoint, HTTP client) and `manager`.
    ///
    /// Defaults: keys from the message attribute `idempotency-key`
    /// ([`KeySource::default`]), no dead-letter queue (rejected messages are
    /// left to the queue's redrive policy), 20 s long polling, 10 messages a
    /// receive, 10 handlers at once, [`Backoff::default`], 10 s per SQS call.
    pub fn builder(
        client: Client,
        manager: IdempotencyManager<C>,
        queue_url: impl Into<String>,
    ) -> SqsConsumerBuilder<C> {
        SqsConsumerBuilder {
            client,
            manager,
            queue_url: queue_url.into(),
            dead_letter_queue_url: None,
            answering: Answering {
                key: KeySource::default(),
                concurrency: 10,
                backoff: Backoff::default(),
            },
            wait_time: MAX_WAIT,
            max_messages: 10,
            call_timeout: DEFAULT_CALL_TIMEOUT,
        }
    }
}

impl<C: Codec + Clone> SqsConsumerBuilder<C> {
    /// Where each message's idempotency key comes from.
    pub fn key(mut self, key: KeySource) -> Self {
        self.answering.key = key;
        self
    }

    /// Sends rejected messages (body and message attributes kept) to this
    /// queue, then deletes them from the source queue.
    pub fn dead_letter_queue(mut self, url: impl Into<String>) -> Self {
        self.dead_letter_queue_url = Some(url.into());
        self
    }

    /// How long a receive waits for messages (long polling; whole seconds,
    /// at most 20 s; 0 for short polling).
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.wait_time = wait;
        self
    }

    /// The most messages a receive takes (1 to 10).
    pub fn max_messages(mut self, max: u8) -> Self {
        self.max_messages = max;
        self
    }

    /// How many handlers of a poll run at once (at least 1).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.answering.concurrency = concurrency;
        self
    }

    /// The longest one SQS call may take (default 10 s; a receive may take
    /// its wait time longer). A call past it is abandoned: a settling call's
    /// messages reappear when their visibility ends, a receive is retried.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The delays before a failed message is delivered again.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.answering.backoff = backoff;
        self
    }

    /// Checks the settings and the queue, and builds the consumer.
    ///
    /// Reads the queue's `VisibilityTimeout` and `MessageRetentionPeriod`
    /// (`GetQueueAttributes`), and warns when the records' `ttl` is shorter
    /// than the retention (a message delivered after its record expired
    /// would run again: keep records longer than the queue keeps messages).
    /// With
    /// [`Config::lease_extension_interval`](idempotency_core::Config) set, the
    /// consumer extends the visibility of a poll's messages while their
    /// handlers run; without it, the queue's visibility timeout must be at
    /// least the manager's `processing_timeout`, or a message would be
    /// delivered to another consumer while its handler still runs.
    ///
    /// # Errors
    /// [`Error::Config`] for a setting out of range, a queue that does not
    /// exist, or a visibility timeout too short for the lease; the error of
    /// `GetQueueAttributes` when SQS cannot be asked.
    pub async fn build(self) -> Result<SqsConsumer<C>, Error> {
        self.check_settings()?;
        let timeout = self.call_timeout;
        let queue = queue_timers(&self.client, &self.queue_url, timeout).await?;
        if let Some(dlq) = &self.dead_letter_queue_url {
            queue_timers(&self.client, dlq, timeout).await?;
        }
        check_retention(self.manager.config(), &self.queue_url, queue.retention);
        let queue_visibility = queue.visibility;
        let heartbeat = heartbeat_for(self.manager.config(), &self.queue_url, queue_visibility)?;
        Ok(SqsConsumer {
            client: self.client,
            manager: self.manager,
            queue_url: self.queue_url,
            dead_letter_queue_url: self.dead_letter_queue_url,
            answering: self.answering,
            wait_time: self.wait_time,
            max_messages: self.max_messages,
            call_timeout: self.call_timeout,
            queue_visibility,
            heartbeat,
        })
    }

    fn check_settings(&self) -> Result<(), Error> {
        if self.queue_url.trim().is_empty() {
            return Err(Error::config("the SQS queue URL is empty"));
        }
        if self.wait_time > MAX_WAIT {
            return Err(Error::config(format!(
                "the SQS wait time ({:?}) is longer than SQS allows (20 s)",
                self.wait_time
            )));
        }
        if !(1..=10).contains(&self.max_messages) {
            return Err(Error::config(format!(
                "an SQS receive takes 1 to 10 messages, not {}",
                self.max_messages
            )));
        }
        if self.call_timeout.is_zero() {
            return Err(Error::config("the SQS call timeout must be positive"));
        }
        let backoff = &self.answering.backoff;
        if backoff.initial.is_zero() || backoff.max < backoff.initial {
            return Err(Error::config(format!(
                "the SQS consumer's backoff must start above zero and not exceed its maximum \
                 (initial {:?}, max {:?}): a zero delay makes a failed message visible again at \
                 once, a hot loop",
                backoff.initial, backoff.max
            )));
        }
        if self.answering.concurrency == 0 {
            return Err(Error::config(
                "the SQS consumer's concurrency must be at least 1",
            ));
        }
        match &self.dead_letter_queue_url {
            Some(dlq) if dlq.trim().is_empty() || *dlq == self.queue_url => Err(Error::config(
                "the dead-letter queue must be another queue than the one consumed",
            )),
            _ => Ok(()),
        }
    }
}

/// A queue's timers, as `GetQueueAttributes` gives them.
struct QueueTimers {
    /// `VisibilityTimeout`.
    visibility: Duration,
    /// `MessageRetentionPeriod`, when SQS gave it.
    retention: Option<Duration>,
}

/// Warns when a message may be delivered after its record expired
/// ([`retention::judge`](crate::retention::judge)).
fn check_retention(
    config: &idempotency_core::Config,
    queue_url: &str,
    retention: Option<Duration>,
) {
    let Some(retention) = retention else { return };
    let check = crate::retention::judge(
        &format!("SQS queue {queue_url}"),
        config.ttl,
        Some(retention),
    );
    if check.verdict != idempotency_core::admin::Verdict::Pass {
        tracing::warn!(queue = queue_url, ttl = ?config.ttl, retention = ?retention, "{}", check.detail);
    }
}

/// How long the SQS queue at `queue_url` keeps messages
/// (`MessageRetentionPeriod`), for `idempotency doctor` and start-up checks:
/// records must outlive it ([`retention::judge`](crate::retention::judge)).
///
/// # Errors
/// [`Error::Config`] when the queue does not exist or SQS does not say;
/// [`Error::Timeout`] past `timeout`; the call's error otherwise.
pub async fn message_retention(
    client: &Client,
    queue_url: &str,
    timeout: Duration,
) -> Result<Duration, Error> {
    queue_timers(client, queue_url, timeout)
        .await?
        .retention
        .ok_or_else(|| {
            Error::config(format!(
                "SQS did not give the MessageRetentionPeriod of the queue {queue_url}"
            ))
        })
}

/// The queue's timers; a missing queue is a configuration error.
async fn queue_timers(
    client: &Client,
    queue_url: &str,
    timeout: Duration,
) -> Result<QueueTimers, Error> {
    let request = client
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::VisibilityTimeout)
        .attribute_names(QueueAttributeName::MessageRetentionPeriod)
        .send();
    let output = tokio::time::timeout(timeout, request)
        .await
        .map_err(|_| Error::Timeout {
            backend: "sqs",
            operation: "GetQueueAttributes",
        })?
        .map_err(|error| {
            if error
                .as_service_error()
                .is_some_and(|e| e.is_queue_does_not_exist())
            {
                Error::config(format!("the SQS queue {queue_url} does not exist"))
            } else {
                sdk_error("GetQueueAttributes", error)
            }
        })?;
    let seconds = |name: &QueueAttributeName| {
        output
            .attributes()
            .and_then(|a| a.get(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs)
    };
    let visibility = seconds(&QueueAttributeName::VisibilityTimeout).ok_or_else(|| {
        Error::config(format!(
            "SQS did not give the VisibilityTimeout of the queue {queue_url}"
        ))
    })?;
    Ok(QueueTimers {
        visibility,
        retention: seconds(&QueueAttributeName::MessageRetentionPeriod),
    })
}

/// The heartbeat the lease needs, or why the queue cannot hold a message
/// for as long as the lease.
fn heartbeat_for(
    config: &idempotency_core::Config,
    queue_url: &str,
    visibility: Duration,
) -> Result<Option<Heartbeat>, Error> {
    if visibility.is_zero() {
        return Err(Error::config(format!(
            "the SQS queue {queue_url} has a VisibilityTimeout of 0: every message would be \
             delivered again while its handler runs"
        )));
    }
    let lease = config.processing_timeout;
    match config.lease_extension_interval {
        Some(interval) => {
            // In step with the lease keeper, and at least twice within the
            // queue's own timeout, so the first extension comes in time.
            let every = interval.min(visibility / 2).max(Duration::from_millis(100));
            let extend_to = lease.max(every * 2).min(MAX_VISIBILITY);
            Ok(Some(Heartbeat { every, extend_to }))
        }
        None if visibility < lease => Err(Error::config(format!(
            "the SQS queue {queue_url} has a VisibilityTimeout of {}s, shorter than the \
             manager's processing_timeout ({lease:?}), and lease extension is off: a message \
             would be delivered again while its handler still holds the key. Raise the queue's \
             VisibilityTimeout to at least the processing timeout, or set \
             Config::lease_extension_interval so the consumer extends the visibility",
            visibility.as_secs()
        ))),
        None => Ok(None),
    }
}

impl<C: Codec + Clone> SqsConsumer<C> {
    /// The queue consumed.
    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// The queue's `VisibilityTimeout`, as read by [`SqsConsumerBuilder::build`].
    pub fn queue_visibility_timeout(&self) -> Duration {
        self.queue_visibility
    }

    /// How often the visibility of in-flight messages is extended (`None`
    /// without lease extension).
    pub fn heartbeat_interval(&self) -> Option<Duration> {
        self.heartbeat.map(|h| h.every)
    }

    /// Receives once (waiting up to the wait time), answers every message
    /// received and settles each with SQS before returning.
    ///
    /// # Errors
    /// The receive's error ([`Error::Unavailable`] when SQS could not be
    /// reached, [`Error::Timeout`] past the wait time plus the call timeout,
    /// [`Error::Backend`] for SQS's refusal); failures to settle are in the
    /// report, never errors.
    pub async fn poll_once<T, E, F, Fut>(&self, handler: F) -> Result<PollReport<T, E>, Error>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(SqsMessage, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let messages = self.receive().await?;
        Ok(self.handle(messages, &handler).await)
    }

    /// Polls until `shutdown` resolves, then returns what it did.
    ///
    /// `shutdown` is any future: `token.cancelled()` of a
    /// `tokio_util::sync::CancellationToken`, `async move {
    /// rx.wait_for(|stop| *stop).await.ok(); }` over a `tokio::sync::watch`,
    /// `async { tokio::signal::ctrl_c().await.ok(); }`. It is looked at
    /// between polls and while a receive waits: a poll whose messages were
    /// received is always finished (handlers, deletes, visibility changes)
    /// before `run` returns. A receive abandoned by the shutdown may have
    /// taken messages: they reappear when the queue's visibility timeout ends.
    ///
    /// A failed receive is logged and retried after the [`Backoff`] (by the
    /// number of failures in a row); with short polling (a wait time under a
    /// second), an empty receive is followed by the backoff's initial delay.
    pub async fn run<T, E, F, Fut, S>(&self, shutdown: S, handler: F) -> RunStats
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(SqsMessage, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
        S: Future<Output = ()>,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stats = RunStats::default();
        let mut failures = 0u32;
        loop {
            let received = tokio::select! {
                biased;
                () = &mut shutdown => break,
                received = self.receive() => received,
            };
            match received {
                Ok(messages) => {
                    failures = 0;
                    stats.polls += 1;
                    stats.messages += messages.len() as u64;
                    if !messages.is_empty() {
                        let report = self.handle(messages, &handler).await;
                        stats.add(&report.settled);
                    } else if self.wait_time < Duration::from_secs(1) {
                        // Short polling an empty queue: not in a hot loop.
                        tokio::select! {
                            biased;
                            () = &mut shutdown => break,
                            () = tokio::time::sleep(self.answering.backoff.initial) => {}
                        }
                    }
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    stats.receive_errors += 1;
                    let delay = self.answering.backoff.delay(failures);
                    tracing::warn!(queue = %self.queue_url, %error, ?delay, "SQS receive failed");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        stats
    }

    async fn receive(&self) -> Result<Vec<SqsMessage>, Error> {
        let wait = i32::try_from(self.wait_time.as_secs()).unwrap_or(20);
        let request = self
            .client
            .receive_message()
            .queue_url(&self.queue_url)
            .max_number_of_messages(i32::from(self.max_messages))
            .wait_time_seconds(wait)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::MessageDeduplicationId)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .message_attribute_names("All")
            .send();
        let timeout = self.wait_time + self.call_timeout;
        let output = bounded("ReceiveMessage", timeout, request).await?;
        Ok(output.messages().iter().map(SqsMessage::from_sdk).collect())
    }

    /// Answers one poll's messages while keeping them invisible, then
    /// settles them.
    async fn handle<T, E, F, Fut>(&self, messages: Vec<SqsMessage>, handler: &F) -> PollReport<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(SqsMessage, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let span =
            tracing::info_span!("sqs_poll", queue = %self.queue_url, messages = messages.len());
        let settler = Settler {
            client: &self.client,
            queue_url: &self.queue_url,
            dead_letter_queue_url: self.dead_letter_queue_url.as_deref(),
            backoff: &self.answering.backoff,
            timeout: self.call_timeout,
        };
        async {
            let answering = self.answering.answer(&self.manager, &messages, handler);
            let handled = keep_invisible(&settler, &messages, self.heartbeat, answering).await;
            let dispositions: Vec<_> = handled.iter().map(|h| h.disposition).collect();
            let settled = settler.settle(&messages, &dispositions).await;
            tracing::debug!(?settled, "poll settled");
            PollReport {
                messages: handled,
                settled,
            }
        }
        .instrument(span)
        .await
    }
}

impl RunStats {
    fn add(&mut self, settled: &Settled) {
        self.deleted += settled.deleted as u64;
        self.delayed += settled.delayed as u64;
        self.dead_lettered += settled.dead_lettered as u64;
        self.settle_failures += settled.failures as u64;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use idempotency_core::Config;

    #[test]
    fn the_lease_decides_the_heartbeat_or_refuses_the_queue() {
        let off = Config {
            processing_timeout: Duration::from_secs(30),
            ..Config::default()
        };
        assert!(matches!(
            heartbeat_for(&off, "q", Duration::from_secs(10)),
            Err(Error::Config { .. })
        ));
        assert!(heartbeat_for(&off, "q", Duration::from_secs(30))
            .unwrap()
            .is_none());
        let on = Config {
            lease_extension_interval: Some(Duration::from_secs(5)),
            ..off
        };
        let beat = heartbeat_for(&on, "q", Duration::from_secs(2))
            .unwrap()
            .unwrap();
        assert_eq!(beat.every, Duration::from_secs(1));
        assert_eq!(beat.extend_to, Duration::from_secs(30));
        assert!(matches!(
            heartbeat_for(&on, "q", Duration::ZERO),
            Err(Error::Config { .. })
        ));
    }
}
