//! RabbitMQ (AMQP 0-9-1, through [lapin]): a consumer of one queue that
//! acknowledges a message only once its outcome is recorded, delivers again
//! what is not answered yet no sooner than asked, and dead-letters what no
//! redelivery can answer.
//!
//! # What it does
//!
//! - It opens a channel of its own, sets `basic.qos(prefetch)` and consumes
//!   with manual acknowledgements. The broker never leaves more than
//!   `prefetch` deliveries unacknowledged with it, so the prefetch count bounds
//!   both a poll's size and the handlers running at once (`concurrency`, by
//!   default the prefetch count, bounds them further).
//! - A poll is the first delivery plus whatever arrives within the `linger`
//!   (default 5 ms), up to the prefetch count. It runs through
//!   [`run_poll`](crate::run_poll): one reservation round trip per group, each
//!   message's [`Disposition`](crate::Disposition) decided by the crate's one
//!   policy ([`classify`](crate::classify)) and counted in
//!   [`metrics`](crate::metrics) (with `redelivered`).
//! - [`Ack`](crate::Disposition::Ack): `basic.ack` of that delivery tag
//!   (one per delivery, sent together after the poll).
//! - [`Reject`](crate::Disposition::Reject): `basic.reject(requeue=false)`,
//!   which routes the message to the queue's dead-letter exchange. **Without a
//!   dead-letter exchange the broker drops it.** AMQP cannot read a queue's
//!   arguments or policies, so the consumer cannot tell: it logs a warning at
//!   start unless told the exchange with
//!   [`dead_letter_exchange`](RabbitConsumerBuilder::dead_letter_exchange), in
//!   which case it refuses to start when that exchange does not exist.
//! - [`Retry { after }`](crate::Disposition::Retry): the delivery is held,
//!   unacknowledged, and `basic.nack(requeue=true)` is sent once `after` has
//!   passed (at least `min_retry_delay`, at most `max_retry_hold`); see below.
//! - Keys come from the `message_id` property (default), a header, a function
//!   of the body and properties, or the body read as an
//!   [`Event`](idempotency_core::Event) with a
//!   [`KeyStrategy`](idempotency_core::KeyStrategy) ([`KeySource`]). A message
//!   without a key is rejected (reason `invalid_key`) without reaching the
//!   handler.
//! - The attempt (for the [`Backoff`](crate::Backoff)) is `x-delivery-count +
//!   1` on quorum queues; classic queues only have the `redelivered` flag, so
//!   their attempt is 1 or 2.
//! - A connection or channel that dies ends [`run`](RabbitConsumer::run) with
//!   a retryable [`RabbitError`], never a panic nor a hang: every AMQP
//!   operation is bounded by the `operation_timeout` (default 30 s), as lapin
//!   never answers one sent while its connection shuts down. The broker
//!   requeues every delivery the channel had not acknowledged (AMQP 0-9-1
//!   does not confirm acks, so an ack written just before the connection
//!   died may be lost too); a redelivered message whose outcome was recorded
//!   is answered as a duplicate, without running the handler again. A
//!   shutdown signal lets the poll under way finish and settle before `run`
//!   returns.
//!
//! # Why retries are held, not republished
//!
//! Two designs deliver a message again after a delay: hold the delivery and
//! `nack` it with `requeue=true` when the delay ends, or republish it to a delay
//! queue whose per-message TTL dead-letters it back, and ack the original. This
//! consumer holds, because:
//!
//! - **A crash never loses the message.** A held delivery is still the broker's:
//!   if the consumer dies, its channel closes and the broker requeues it.
//!   Republishing needs a publisher confirm before the ack to be as safe, and
//!   a crash between the two leaves a copy in both queues.
//! - **No topology to own.** Delay queues must be declared (and permitted),
//!   and per-message TTLs only expire at the head of a queue, so a 5-minute
//!   retry would block a 100 ms one behind it unless every delay gets a queue
//!   of its own.
//! - **Order is kept as far as RabbitMQ keeps it**: a requeued message goes
//!   back to its original position where possible.
//!
//! What holding costs, and the bounds that keep it safe:
//!
//! - A held delivery occupies a prefetch slot until its delay ends: with every
//!   slot held the consumer receives nothing new (it still requeues on time,
//!   so it never stalls for longer than the longest hold). Delays are short in
//!   practice: `InProgress` asks for about one run of the handler, failures
//!   follow the [`Backoff`](crate::Backoff). Size the prefetch for them.
//! - RabbitMQ closes a channel whose delivery stays unacknowledged beyond its
//!   `consumer_timeout` (30 minutes by default). Holds are capped by
//!   `max_retry_hold` (default 5 minutes), and
//!   [`build`](RabbitConsumerBuilder::build) refuses a hold or a lease
//!   (`processing_timeout`) not below the `consumer_timeout` it is told.
//! - Never a hot loop: every retry waits at least `min_retry_delay` (default
//!   250 ms), also when the store estimates the holder's run as shorter.
//! - On quorum queues every requeue counts as a delivery: a `delivery-limit`
//!   (20 by default since RabbitMQ 4.0) dead-letters a message after that many
//!   retries, e.g. while another consumer holds its key for long. Raise it for
//!   such queues.
//! - At shutdown the held deliveries return to the queue at once (the channel
//!   closes), so another consumer may see them before their delay ends; it
//!   answers them by the same policy (a key still in progress is held again).
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use idempotency_consumers::rabbitmq::{KeySource, RabbitConsumer};
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};
//! use lapin::{Connection, ConnectionProperties};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
//! let consumer = RabbitConsumer::builder(manager, "orders")
//!     .prefetch(16)
//!     .keys(KeySource::header("x-idempotency-key"))
//!     .dead_letter_exchange("orders.dead")
//!     .build()?;
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let connection =
//!     Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", ConnectionProperties::default())
//!         .await?;
//! consumer
//!     .run(
//!         &connection,
//!         |message, _ctx| async move {
//!             // ... apply the order in message.body ...
//!             Ok::<_, HandlerError<String>>(message.body.len())
//!         },
//!         async {
//!             let _ = stopped.await; // e.g. a Ctrl-C or SIGTERM handler sends on `stop`
//!         },
//!     )
//!     .await?;
//! # drop(stop);
//! # Ok(())
//! # }
//! ```
//!
//! [lapin]: https://docs.rs/lapin

mod builder;
mod held;
mod message;
mod run;

pub use builder::{AnswerHook, RabbitConsumer, RabbitConsumerBuilder, DEFAULT_CONSUMER_TIMEOUT};
/// The lapin this module is built on (connect with it, so the versions match).
pub use lapin;
pub use message::{CustomKeyFn, KeySource, Message};

/// The broker's name in metrics.
const BROKER: &str = "rabbitmq";

/// Why [`RabbitConsumer`] stopped or could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// The configuration is inconsistent (from
    /// [`build`](RabbitConsumerBuilder::build)).
    #[error("invalid RabbitMQ consumer configuration: {0}")]
    Config(String),
    /// The queue or the dead-letter exchange is missing, or the user may not
    /// use it: nothing was consumed.
    #[error("{what}: {source}")]
    Setup {
        /// What was being set up.
        what: String,
        /// The broker's answer.
        source: lapin::Error,
    },
    /// The connection or channel failed; every unacknowledged delivery goes
    /// back to the queue.
    #[error("RabbitMQ {operation} failed: {source}; unacknowledged messages return to the queue")]
    Broker {
        /// The AMQP operation.
        operation: &'static str,
        /// lapin's error.
        source: lapin::Error,
    },
    /// The channel was closed under a delivery being settled; every
    /// unacknowledged delivery goes back to the queue.
    #[error(
        "RabbitMQ {operation}: the channel is closed; unacknowledged messages return to the queue"
    )]
    ChannelClosed {
        /// The AMQP operation.
        operation: &'static str,
    },
    /// An AMQP operation got no answer within the consumer's
    /// `operation_timeout` (lapin never answers an operation sent while its
    /// connection shuts down); every unacknowledged delivery goes back to the
    /// queue once the connection is gone.
    #[error(
        "RabbitMQ {operation} got no answer within {after:?}; unacknowledged messages return \
         to the queue once the connection closes"
    )]
    Timeout {
        /// The AMQP operation.
        operation: &'static str,
        /// The `operation_timeout`.
        after: std::time::Duration,
    },
    /// The broker cancelled the consumer (the queue was deleted, or a quorum
    /// queue's leader moved).
    #[error("the broker cancelled the consumer of queue {queue}")]
    Cancelled {
        /// The queue.
        queue: String,
    },
}

impl RabbitError {
    /// Whether running the consumer again (on a new connection) may work:
    /// true for broker failures and cancellations, false for configuration
    /// and set-up errors.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            RabbitError::Broker { .. }
                | RabbitError::ChannelClosed { .. }
                | RabbitError::Timeout { .. }
                | RabbitError::Cancelled { .. }
        )
    }

    /// A broker's refusal while setting up (a missing queue or exchange, no
    /// permission) is a [`Setup`](RabbitError::Setup) error; a connection
    /// that died meanwhile stays a broker failure.
    fn in_setup(self, what: String) -> Self {
        match self {
            RabbitError::Broker { source, .. }
                if !source.is_io_error() && !source.is_amqp_hard_error() =>
            {
                RabbitError::Setup { what, source }
            }
            other => other,
        }
    }
}

/// Runs one AMQP operation, failing it after `limit`: lapin never answers an
/// operation sent while its connection shuts down.
async fn bounded<T>(
    limit: std::time::Duration,
    operation: &'static str,
    run: impl std::future::Future<Output = lapin::Result<T>>,
) -> Result<T, RabbitError> {
    match tokio::time::timeout(limit, run).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(RabbitError::Broker { operation, source }),
        Err(_) => Err(RabbitError::Timeout {
            operation,
            after: limit,
        }),
    }
}

/// Settles one delivery through `settle` (an ack, nack or reject of its
/// acker), bounded by `limit`; an acker lapin refuses (its channel closed)
/// is [`RabbitError::ChannelClosed`].
async fn settled(
    limit: std::time::Duration,
    operation: &'static str,
    settle: impl std::future::Future<Output = lapin::Result<bool>>,
) -> Result<(), RabbitError> {
    if bounded(limit, operation, settle).await? {
        Ok(())
    } else {
        Err(RabbitError::ChannelClosed { operation })
    }
}
