//! The consumer's configuration, checked once by [`RabbitConsumerBuilder::build`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Codec, IdempotencyManager, JsonCodec};

use super::message::{KeySource, Message};
use super::RabbitError;
use crate::disposition::{Backoff, Disposition};

/// Called with each message and what is done with it, before the broker is
/// told (logging, alerting, tests).
pub type AnswerHook = Arc<dyn Fn(&Message, &Disposition) + Send + Sync>;

/// RabbitMQ's default `consumer_timeout`: a delivery left unacknowledged
/// longer makes the broker close the channel.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A RabbitMQ consumer of one queue, running each poll through
/// [`run_poll`](crate::run_poll); see the [module docs](super) for the
/// behaviour. Built by [`RabbitConsumer::builder`]; run with
/// [`run`](RabbitConsumer::run).
pub struct RabbitConsumer<C: Codec = JsonCodec> {
    pub(crate) manager: IdempotencyManager<C>,
    pub(crate) queue: String,
    pub(crate) prefetch: u16,
    pub(crate) concurrency: usize,
    pub(crate) linger: Duration,
    pub(crate) keys: KeySource,
    pub(crate) backoff: Backoff,
    pub(crate) min_retry_delay: Duration,
    pub(crate) max_retry_hold: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) dead_letter_exchange: Option<String>,
    pub(crate) on_answer: Option<AnswerHook>,
}

impl<C: Codec + Clone> RabbitConsumer<C> {
    /// A builder for a consumer of `queue` over `manager`.
    pub fn builder(
        manager: IdempotencyManager<C>,
        queue: impl Into<String>,
    ) -> RabbitConsumerBuilder<C> {
        RabbitConsumerBuilder {
            manager,
            queue: queue.into(),
            prefetch: 32,
            concurrency: None,
            linger: Duration::from_millis(5),
            keys: KeySource::default(),
            backoff: Backoff::default(),
            min_retry_delay: Duration::from_millis(250),
            max_retry_hold: Duration::from_secs(300),
            operation_timeout: Duration::from_secs(30),
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            dead_letter_exchange: None,
            on_answer: None,
        }
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The prefetch count (`basic.qos`): the most unacknowledged deliveries,
    /// held retries included, and the most messages of one poll.
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }
}

impl<C: Codec> fmt::Debug for RabbitConsumer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("linger", &self.linger)
            .field("keys", &self.keys)
            .field("backoff", &self.backoff)
            .field("min_retry_delay", &self.min_retry_delay)
            .field("max_retry_hold", &self.max_retry_hold)
            .field("operation_timeout", &self.operation_timeout)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .finish_non_exhaustive()
    }
}

/// Configures a [`RabbitConsumer`]; [`build`](Self::build) checks it.
pub struct RabbitConsumerBuilder<C: Codec = JsonCodec> {
    manager: IdempotencyManager<C>,
    queue: String,
    prefetch: u16,
    concurrency: Option<usize>,
    linger: Duration,
    keys: KeySource,
    backoff: Backoff,
    min_retry_delay: Duration,
    max_retry_hold: Duration,
    operation_timeout: Duration,
    consumer_timeout: Duration,
    dead_letter_exchange: Option<String>,
    on_answer: Option<AnswerHook>,
}

impl<C: Codec + Clone> RabbitConsumerBuilder<C> {
    /// The prefetch count set with `basic.qos` (default 32, at least 1): the
    /// most deliveries the broker leaves unacknowledged with this consumer
    /// (held retries count), so also the most messages of a poll.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// How many handlers of a poll run at once (default: the prefetch count;
    /// at most the prefetch count).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = Some(concurrency);
        self
    }

    /// How long a poll waits for more deliveries after the first one
    /// (default 5 ms; zero takes only those already received).
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Where keys come from (default: the `message_id` property).
    pub fn keys(mut self, keys: KeySource) -> Self {
        self.keys = keys;
        self
    }

    /// The delay before a failed message is delivered again (default 1 s
    /// doubling up to 300 s). Without `x-delivery-count` (classic queues) the
    /// attempt is 1 or 2, so the delay grows no further than its second step.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The shortest time a retried message is held before it is requeued
    /// (default 250 ms, must be positive): an `InProgress` answer may ask for
    /// less (the store's estimate of the holder's run), which would redeliver
    /// almost at once while the holder works.
    pub fn min_retry_delay(mut self, delay: Duration) -> Self {
        self.min_retry_delay = delay;
        self
    }

    /// The longest time a retried message is held (default 300 s): longer
    /// delays are cut to it. Must be below the broker's `consumer_timeout`.
    pub fn max_retry_hold(mut self, hold: Duration) -> Self {
        self.max_retry_hold = hold;
        self
    }

    /// How long an AMQP operation (ack, nack, reject, channel set-up) may go
    /// unanswered before [`run`](RabbitConsumer::run) fails with
    /// [`RabbitError::Timeout`] (default 30 s, must be positive): lapin never
    /// answers an operation sent while its connection shuts down.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// The broker's `consumer_timeout` (default 30 min, RabbitMQ's): the
    /// retry hold and the manager's lease must stay below it, or the broker
    /// closes the channel under a held or running delivery.
    pub fn consumer_timeout(mut self, timeout: Duration) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// The dead-letter exchange rejected messages are expected to reach (the
    /// queue's `x-dead-letter-exchange` argument or policy). [`run`] refuses
    /// to start when no such exchange exists. Without it, `run` warns once that
    /// rejected messages are dropped unless the queue has a dead-letter
    /// exchange (AMQP cannot read a queue's arguments or policies).
    ///
    /// [`run`]: RabbitConsumer::run
    pub fn dead_letter_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.dead_letter_exchange = Some(exchange.into());
        self
    }

    /// Called with each message and its [`Disposition`] before the broker is
    /// told (for logs, alerts or tests).
    pub fn on_answer<F>(mut self, hook: F) -> Self
    where
        F: Fn(&Message, &Disposition) + Send + Sync + 'static,
    {
        self.on_answer = Some(Arc::new(hook));
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`RabbitError::Config`] for an empty or too long queue name, a prefetch
    /// of 0, a concurrency of 0 or above the prefetch, a zero
    /// `min_retry_delay`, a `max_retry_hold` below it, a zero
    /// `operation_timeout`, an empty header name, or a hold, or a wait for
    /// an ack (the lease for each group of `concurrency` prefetched
    /// deliveries, plus one for the poll before), not below the
    /// `consumer_timeout`.
    pub fn build(self) -> Result<RabbitConsumer<C>, RabbitError> {
        let invalid = |message: String| Err(RabbitError::Config(message));
        if self.queue.is_empty() || self.queue.len() > 255 {
            return invalid(format!(
                "the queue name must be 1 to 255 bytes long (it is {})",
                self.queue.len()
            ));
        }
        if self.prefetch == 0 {
            return invalid("prefetch must be at least 1 (0 would mean unlimited)".into());
        }
        let concurrency = self.concurrency.unwrap_or(usize::from(self.prefetch));
        if concurrency == 0 || concurrency > usize::from(self.prefetch) {
            return invalid(format!(
                "concurrency must be 1 to the prefetch count ({}), not {concurrency}",
                self.prefetch
            ));
        }
        if self.min_retry_delay.is_zero() || self.max_retry_hold < self.min_retry_delay {
            return invalid(format!(
                "min_retry_delay ({:?}) must be positive and at most max_retry_hold ({:?})",
                self.min_retry_delay, self.max_retry_hold
            ));
        }
        if self.operation_timeout.is_zero() {
            return invalid("operation_timeout must be positive".into());
        }
        if matches!(&self.keys, KeySource::Header(name) if name.is_empty()) {
            return invalid("the key header's name is empty".into());
        }
        let lease = self.manager.config().processing_timeout;
        let unacked = longest_unacknowledged(lease, self.prefetch, concurrency);
        if self.max_retry_hold >= self.consumer_timeout || unacked >= self.consumer_timeout {
            return invalid(format!(
                "max_retry_hold ({:?}) and the longest a delivery waits for its ack ({unacked:?}: \
                 the manager's processing_timeout {lease:?} for each group of {concurrency} of the \
                 {} prefetched deliveries, one poll waiting for the one before) must be below the \
                 broker's consumer_timeout ({:?}), or the broker closes the channel under a held \
                 or running delivery",
                self.max_retry_hold, self.prefetch, self.consumer_timeout
            ));
        }
        Ok(RabbitConsumer {
            manager: self.manager,
            queue: self.queue,
            prefetch: self.prefetch,
            concurrency,
            linger: self.linger,
            keys: self.keys,
            backoff: self.backoff,
            min_retry_delay: self.min_retry_delay,
            max_retry_hold: self.max_retry_hold,
            operation_timeout: self.operation_timeout,
            dead_letter_exchange: self.dead_letter_exchange,
            on_answer: self.on_answer,
        })
    }
}

impl<C: Codec> fmt::Debug for RabbitConsumerBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumerBuilder")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

/// The longest a delivery may wait for its ack: a poll runs its deliveries
/// `concurrency` at a time, one group after another, each up to a lease; a
/// delivery that arrived while the previous poll ran waits for that poll too.
fn longest_unacknowledged(lease: Duration, prefetch: u16, concurrency: usize) -> Duration {
    let groups = usize::from(prefetch).div_ceil(concurrency.max(1));
    let polls = u32::try_from(groups.saturating_add(1)).unwrap_or(u32::MAX);
    lease.saturating_mul(polls)
}
