//! Broker consumers for idempotency-rs: the glue between a broker and
//! [`IdempotencyManager::execute_batch`](idempotency_core::IdempotencyManager::execute_batch)
//! that decides when a message is acknowledged, redelivered or dead-lettered.
//!
//! Brokers deliver at least once; the manager runs a handler once per key.
//! Between the two sits the decision this crate makes the same way for every
//! broker ([`disposition`]): a message is acknowledged only once its outcome
//! is recorded (or was, by an earlier delivery); a message whose key another
//! consumer holds, or whose store is unreachable, is delivered again after a
//! delay, never dropped and never spun on; a message no redelivery can answer
//! is dead-lettered.
//!
//! | Broker | Feature | Module |
//! |---|---|---|
//! | Kafka | `kafka` | `kafka` |
//! | Amazon SQS (and Lambda's partial batch responses) | `sqs` | `sqs` |
//! | RabbitMQ (AMQP 0-9-1) | `rabbitmq` | `rabbitmq` |
//!
//! Every module shares [`run_poll`]: one poll, reserved in one round trip per
//! group, each message's [`Disposition`] counted in [`metrics::MESSAGES`].
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod batch;
pub mod disposition;
pub mod metrics;
pub mod retention;

pub use batch::{run_poll, Answered, Delivery};
pub use disposition::{
    classify, failure_redelivers, Answer, Backoff, Disposition, MIN_RETRY_AFTER,
};

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;

#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub mod sqs;

#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
