//! Amazon SQS: a consumer that runs each message's handler once per
//! idempotency key, and Lambda's partial batch responses ([`lambda`]).
//!
//! Each poll receives up to 10 messages (long polling, 20 s by default),
//! runs them through [`run_poll`](crate::run_poll) (one reservation round
//! trip per group, duplicates answered from the store) and tells SQS what
//! was decided ([`Disposition`](crate::Disposition)):
//!
//! | Disposition | What SQS is told |
//! |---|---|
//! | `Ack` (executed, or a duplicate answered from the record) | deleted, all of the poll's in one `DeleteMessageBatch` |
//! | `Retry { after }` (another consumer holds the key, the store is down, a transient failure) | `ChangeMessageVisibilityBatch` to `after` rounded up to whole seconds (at most 12 h): it reappears then, not at once |
//! | `Reject` (a permanent failure, no key, a reused key) | with a dead-letter queue: sent there (body and message attributes kept), then deleted; without one: made visible again after the [`Backoff`](crate::Backoff), and the queue's redrive policy moves it after `maxReceiveCount` deliveries |
//!
//! - **Failures to settle.** An entry SQS refuses, or a batch call that
//!   fails, is logged and counted ([`SETTLE_FAILURES`], [`Settled::failures`])
//!   and never retried in a loop: the message reappears when its visibility
//!   timeout ends. A message whose delete failed is then answered as a
//!   duplicate by the store (its outcome is recorded) and deleted; a
//!   dead-lettered message whose delete failed may reach the dead-letter
//!   queue twice.
//! - **Visibility and the lease.** While a poll's handlers run, the consumer
//!   extends the visibility of its messages (`ChangeMessageVisibilityBatch`)
//!   in step with the manager's lease keeper: every
//!   [`Config::lease_extension_interval`](idempotency_core::Config) (at most
//!   half the queue's visibility timeout), to `processing_timeout`. The
//!   extensions stop when the poll is answered. Without lease extension,
//!   [`SqsConsumerBuilder::build`] refuses a queue whose `VisibilityTimeout`
//!   is shorter than `processing_timeout` ([`Error::Config`](idempotency_core::Error)):
//!   SQS would hand the message to another consumer while the handler runs.
//! - **Keys** come from a message attribute, the FIFO
//!   `MessageDeduplicationId`, the body parsed as an
//!   [`Event`](idempotency_core::Event), or a function ([`KeySource`]). A
//!   message without one is rejected with reason `invalid_key` (its answer
//!   is an [`Error::InvalidKey`](idempotency_core::Error) saying why).
//! - **Attempts**: `ApproximateReceiveCount` (requested with every receive)
//!   is the attempt for the backoff; a count above 1 is a redelivery. Every
//!   receive counts towards a redrive policy's `maxReceiveCount`, those
//!   answered `InProgress` included (one about every second while another
//!   consumer holds the key, at least [`MIN_RETRY_AFTER`](crate::MIN_RETRY_AFTER)
//!   apart, rounded up to whole seconds): give `maxReceiveCount` room for
//!   the longest handler, or a message whose key is held goes to the
//!   dead-letter queue early.
//! - **Shutdown**: [`SqsConsumer::run`] stops when a future resolves (a
//!   cancellation token's `cancelled()`, a `watch` receiver's `wait_for`),
//!   after finishing the poll under way. [`SqsConsumer::poll_once`] handles
//!   exactly one receive.
//!
//! The consumer takes an `aws_sdk_sqs::Client` configured by the caller
//! (region, credentials, endpoint and HTTP client: with this crate's
//! `default-features = false` SDK build, enable the SDK's
//! `default-https-client` feature or give the client an HTTP client).
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idempotency_consumers::sqs::{KeySource, SqsConsumer};
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let sdk = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
//! let client = aws_sdk_sqs::Client::new(&sdk);
//! let config = Config {
//!     processing_timeout: Duration::from_secs(60),
//!     lease_extension_interval: Some(Duration::from_secs(20)),
//!     ..Config::default()
//! };
//! let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config)?;
//! let consumer = SqsConsumer::builder(client, manager, "https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
//!     .key(KeySource::attribute("order-id"))
//!     .dead_letter_queue("https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq")
//!     .build()
//!     .await?;
//!
//! let (stop, mut stopped) = tokio::sync::watch::channel(false);
//! let shutdown = async move {
//!     let _ = stopped.wait_for(|stop| *stop).await;
//! };
//! # drop(stop);
//! let stats = consumer
//!     .run(shutdown, |message, _ctx| async move {
//!         // Apply the order once; a redelivery gets this result back.
//!         Ok::<_, HandlerError<String>>(format!("charged {}", message.body))
//!     })
//!     .await;
//! println!("{stats:?}");
//! # Ok(())
//! # }
//! ```

mod answer;
mod consumer;
mod heartbeat;
pub mod lambda;
mod message;
mod settle;

pub use answer::Handled;
pub use consumer::{message_retention, PollReport, RunStats, SqsConsumer, SqsConsumerBuilder};
pub use message::{KeyFn, KeySource, SqsMessage, DEFAULT_KEY_ATTRIBUTE};
pub use settle::{Settled, MAX_VISIBILITY, SETTLE_FAILURES};
