//! The front every consumer shares: one poll through
//! [`IdempotencyManager::execute_batch`], each answer with its
//! [`Disposition`], counted and traced the same way for every broker.

use std::fmt;
use std::future::Future;

use idempotency_core::{
    Codec, ExecuteError, ExecutionContext, FailureKind, HandlerError, IdempotencyManager, Outcome,
};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::disposition::{classify, failure_redelivers, Backoff, Disposition};
use crate::metrics::observe;

/// One message of a poll, as the shared front sees it.
#[derive(Debug, Clone)]
pub struct Delivery<P> {
    /// The idempotency key.
    pub key: String,
    /// What the fingerprint is computed over (the payload).
    pub payload: P,
    /// How many times the broker delivered it, this time included (1 for the
    /// first delivery), for the [`Backoff`].
    pub attempt: u32,
    /// Whether the broker marked it as delivered before.
    pub redelivered: bool,
}

/// One message's answer and what to do with it.
#[derive(Debug)]
pub struct Answered<T, E> {
    /// The manager's answer.
    pub answer: Result<Outcome<T>, ExecuteError<E>>,
    /// What the broker does with the message.
    pub disposition: Disposition,
}

/// Runs one poll through the manager and decides each message's disposition.
///
/// `broker` names the broker in metrics (`kafka`, `sqs`, `rabbitmq`, …).
/// The handler's failures are classified as they come back (a transient one
/// is redelivered, a permanent one rejected; the default kind follows the
/// manager's [`FailurePolicy`](idempotency_core::FailurePolicy)).
pub async fn run_poll<C, P, T, E, F, Fut>(
    broker: &'static str,
    manager: &IdempotencyManager<C>,
    deliveries: &[Delivery<P>],
    concurrency: usize,
    backoff: &Backoff,
    handler: F,
) -> Vec<Answered<T, E>>
where
    C: Codec + Clone,
    P: Serialize,
    T: Serialize + DeserializeOwned,
    E: fmt::Display,
    F: Fn(usize, ExecutionContext) -> Fut,
    Fut: Future<Output = Result<T, HandlerError<E>>>,
{
    let kinds: Vec<Mutex<Option<FailureKind>>> =
        deliveries.iter().map(|_| Mutex::new(None)).collect();
    let items: Vec<(&str, &P)> = deliveries
        .iter()
        .map(|d| (d.key.as_str(), &d.payload))
        .collect();
    let answers = manager
        .execute_batch(&items, concurrency, |index, ctx| {
            let run = handler(index, ctx);
            let kinds = &kinds;
            async move {
                let result = run.await;
                if let Err(error) = &result {
                    *kinds[index].lock() = Some(error.kind());
                }
                result
            }
        })
        .await;
    let policy = manager.config().failure_policy;
    answers
        .into_iter()
        .zip(deliveries)
        .zip(kinds)
        .map(|((answer, delivery), kind)| {
            let redelivers = kind
                .into_inner()
                .is_some_and(|kind| failure_redelivers(kind, policy));
            let disposition = classify(&answer, redelivers, delivery.attempt, backoff);
            observe(broker, &disposition, delivery.redelivered);
            Answered {
                answer,
                disposition,
            }
        })
        .collect()
}
