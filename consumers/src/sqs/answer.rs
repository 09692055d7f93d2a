//! Messages through the shared front ([`run_poll`]): keys, attempts, spans.

use std::fmt;
use std::future::Future;

use idempotency_core::{
    Codec, Error, ExecuteError, ExecutionContext, HandlerError, IdempotencyManager, Outcome,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use super::message::{KeySource, SqsMessage};
use crate::batch::{run_poll, Delivery};
use crate::disposition::{Backoff, Disposition};

/// The broker's name in metrics.
pub(crate) const BROKER: &str = "sqs";

/// One message's answer: the manager's, and what SQS is told.
#[derive(Debug)]
pub struct Handled<T, E> {
    /// SQS's id of the message.
    pub message_id: String,
    /// Its idempotency key (`None` when it had none: then `answer` is an
    /// [`Error::InvalidKey`] saying why).
    pub key: Option<String>,
    /// How many times SQS delivered it, this time included.
    pub receive_count: u32,
    /// The manager's answer.
    pub answer: Result<Outcome<T>, ExecuteError<E>>,
    /// What was decided for the message.
    pub disposition: Disposition,
}

/// The policy of one answering: keys, concurrency, backoff.
#[derive(Debug, Clone)]
pub(crate) struct Answering {
    pub(crate) key: KeySource,
    pub(crate) concurrency: usize,
    pub(crate) backoff: Backoff,
}

impl Answering {
    /// Runs `messages` through [`run_poll`]; a message with no key is passed
    /// with an empty one, which the manager rejects (`invalid_key`) without
    /// running the handler, and its answer then carries the reason.
    pub(crate) async fn answer<C, T, E, F, Fut>(
        &self,
        manager: &IdempotencyManager<C>,
        messages: &[SqsMessage],
        handler: &F,
    ) -> Vec<Handled<T, E>>
    where
        C: Codec + Clone,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(SqsMessage, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let keys: Vec<Result<String, Error>> =
            messages.iter().map(|m| self.key.key_of(m)).collect();
        let deliveries: Vec<Delivery<&str>> = messages
            .iter()
            .zip(&keys)
            .map(|(message, key)| Delivery {
                key: key.as_ref().ok().cloned().unwrap_or_default(),
                payload: message.body.as_str(),
                attempt: message.receive_count,
                redelivered: message.redelivered(),
            })
            .collect();
        let answered = run_poll(
            BROKER,
            manager,
            &deliveries,
            self.concurrency,
            &self.backoff,
            |index, ctx| {
                let message = &messages[index];
                let span = tracing::info_span!(
                    "sqs_message",
                    message_id = %message.message_id,
                    receive_count = message.receive_count,
                );
                handler(message.clone(), ctx).instrument(span)
            },
        )
        .await;
        answered
            .into_iter()
            .zip(messages.iter().zip(keys))
            .map(|(answered, (message, key))| {
                let (key, answer) = match key {
                    Ok(key) => (Some(key), answered.answer),
                    Err(error) => {
                        tracing::warn!(message_id = %message.message_id, %error, "message without an idempotency key");
                        (None, Err(ExecuteError::Idempotency(error)))
                    }
                };
                Handled {
                    message_id: message.message_id.clone(),
                    key,
                    receive_count: message.receive_count,
                    answer,
                    disposition: answered.disposition,
                }
            })
            .collect()
    }
}
