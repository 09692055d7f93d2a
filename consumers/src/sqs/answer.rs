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
use crate::disposition::{classify, Backoff, Disposition};
use crate::metrics::observe;

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
    /// Runs the messages that have a key through [`run_poll`]; a message
    /// whose key could not be read is answered with that error and
    /// classified by the same policy (`invalid_key` is rejected; a key
    /// function's retryable error, say a store it reads, is retried).
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
        // The messages with a key, by their index in `messages`.
        let keyed: Vec<usize> = (0..messages.len()).filter(|&i| keys[i].is_ok()).collect();
        let deliveries: Vec<Delivery<&str>> = keyed
            .iter()
            .map(|&i| Delivery {
                key: keys[i].as_ref().map(Clone::clone).unwrap_or_default(),
                payload: messages[i].body.as_str(),
                attempt: messages[i].receive_count,
                redelivered: messages[i].redelivered(),
            })
            .collect();
        let answered = run_poll(
            BROKER,
            manager,
            &deliveries,
            self.concurrency,
            &self.backoff,
            |index, ctx| {
                let message = &messages[keyed[index]];
                let span = tracing::info_span!(
                    "sqs_message",
                    message_id = %message.message_id,
                    receive_count = message.receive_count,
                );
                handler(message.clone(), ctx).instrument(span)
            },
        )
        .await;
        let mut answered = answered.into_iter();
        messages
            .iter()
            .zip(keys)
            .map(|(message, key)| {
                let (key, answer, disposition) = match key {
                    Ok(key) => match answered.next() {
                        Some(a) => (Some(key), a.answer, a.disposition),
                        None => unanswered(self, message),
                    },
                    Err(error) => {
                        tracing::warn!(message_id = %message.message_id, %error, "no idempotency key for the message");
                        let answer = Err(ExecuteError::Idempotency(error));
                        let disposition = classify(&answer, false, message.receive_count, &self.backoff);
                        observe(BROKER, &disposition, message.redelivered());
                        (None, answer, disposition)
                    }
                };
                Handled {
                    message_id: message.message_id.clone(),
                    key,
                    receive_count: message.receive_count,
                    answer,
                    disposition,
                }
            })
            .collect()
    }
}

/// A keyed message `run_poll` gave no answer for (never expected: it answers
/// every delivery): kept, and delivered again after the backoff.
fn unanswered<T, E>(
    answering: &Answering,
    message: &SqsMessage,
) -> (
    Option<String>,
    Result<Outcome<T>, ExecuteError<E>>,
    Disposition,
) {
    let error = Error::Backend {
        backend: BROKER,
        message: format!("message {} was left unanswered", message.message_id),
        source: None,
    };
    let answer = Err(ExecuteError::Idempotency(error));
    let disposition = classify(&answer, false, message.receive_count, &answering.backoff);
    (None, answer, disposition)
}
