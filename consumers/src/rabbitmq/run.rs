//! The run loop: consume, gather a poll, run it, settle each delivery.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use idempotency_core::{Codec, ExecutionContext, HandlerError};
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Acker, Channel, Connection, Consumer, ExchangeKind};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;
use tracing::Instrument;

use super::held::{sleep_until, Held};
use super::message::{attempt_of, Body, Message};
use super::{bounded, settled, RabbitConsumer, RabbitError, BROKER};
use crate::batch::{run_poll, Delivery};
use crate::disposition::Disposition;
use crate::metrics::observe;

/// One delivery of a poll: the message, how to settle it, and its key's
/// problem if it has none.
struct Received {
    message: Arc<Message>,
    acker: Acker,
    no_key: Option<String>,
}

impl<C: Codec + Clone> RabbitConsumer<C> {
    /// Consumes the queue on a channel of its own on `connection` until
    /// `shutdown` completes, running `handler` once per key.
    ///
    /// The handler gets the [`Message`] and the manager's
    /// [`ExecutionContext`]; what it returns is recorded and replayed to
    /// duplicates. Once `shutdown` completes, the poll under way finishes and
    /// its deliveries are settled, then the consumer is cancelled and its
    /// channel closed, which hands every delivery still held (retries waiting
    /// for their time, deliveries received but not polled) back to the queue.
    ///
    /// # Errors
    /// - [`RabbitError::Setup`] (not retryable): the queue or the expected
    ///   dead-letter exchange does not exist, or the user may not use them;
    /// - [`RabbitError::Broker`], [`RabbitError::ChannelClosed`],
    ///   [`RabbitError::Timeout`], [`RabbitError::Cancelled`] (retryable): the
    ///   connection or channel died, an operation went unanswered for the
    ///   `operation_timeout`, or the broker cancelled the consumer. Every delivery not
    ///   acknowledged yet goes back to the queue (the broker requeues what an
    ///   unacknowledging channel held); those whose outcome was recorded are
    ///   answered as duplicates when they come back. Run again on a new
    ///   connection. A connection that dies silently (a partition) is only
    ///   noticed through AMQP heartbeats: keep them on (`?heartbeat=10` in
    ///   the URI sets the interval).
    ///
    /// # Panics
    /// A handler's panic propagates, as from
    /// [`execute_batch`](idempotency_core::IdempotencyManager::execute_batch),
    /// once the poll's other handlers have finished; the poll's deliveries are
    /// left unacknowledged and return to the queue when the channel or
    /// connection closes.
    pub async fn run<T, E, F, Fut, S>(
        &self,
        connection: &Connection,
        handler: F,
        shutdown: S,
    ) -> Result<(), RabbitError>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(Arc<Message>, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
        S: Future<Output = ()>,
    {
        self.check_dead_letter_exchange(connection).await?;
        let limit = self.operation_timeout;
        let channel = bounded(limit, "channel.open", connection.create_channel()).await?;
        let qos = BasicQosOptions { global: false };
        bounded(limit, "basic.qos", channel.basic_qos(self.prefetch, qos)).await?;
        let consume = channel.basic_consume(
            self.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let mut consumer = bounded(limit, "basic.consume", consume)
            .await
            .map_err(|e| e.in_setup(format!("consuming queue {}", self.queue)))?;
        tracing::info!(queue = %self.queue, prefetch = self.prefetch, "rabbitmq consumer started");
        let mut held = Held::default();
        let shutdown = std::pin::pin!(shutdown);
        let result = self
            .consume(&mut consumer, &mut held, &handler, shutdown)
            .await;
        match result {
            Ok(()) => {
                // Stop deliveries, then close: the broker requeues what the
                // channel still holds (held retries, received but not polled).
                let cancel = channel.basic_cancel(consumer.tag(), BasicCancelOptions::default());
                let _ = bounded(limit, "basic.cancel", cancel).await;
                let close = channel.close(200, "consumer shut down".into());
                let _ = bounded(limit, "channel.close", close).await;
                tracing::info!(queue = %self.queue, requeued_retries = held.len(), "rabbitmq consumer stopped");
                Ok(())
            }
            Err(error) => {
                // A consumer stream that ended with its channel is a dead
                // channel or connection, not a cancellation.
                let error = match error {
                    RabbitError::Cancelled { .. } if !channel.status().connected() => {
                        RabbitError::ChannelClosed {
                            operation: "basic.consume",
                        }
                    }
                    other => other,
                };
                tracing::warn!(queue = %self.queue, %error, "rabbitmq consumer failed");
                if channel.status().connected() {
                    let close = channel.close(200, "consumer failed".into());
                    let _ = bounded(limit, "channel.close", close).await;
                }
                Err(error)
            }
        }
    }

    /// Polls until shutdown or a broker failure.
    async fn consume<T, E, F, Fut>(
        &self,
        consumer: &mut Consumer,
        held: &mut Held,
        handler: &F,
        mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<(), RabbitError>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(Arc<Message>, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        loop {
            let first = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = sleep_until(held.next_due()) => {
                    held.release_due(self.operation_timeout).await?;
                    continue;
                }
                next = consumer.next() => next,
            };
            let first = self.delivered(first)?;
            let (poll, ended) = self.gather(first, consumer).await;
            self.process(poll, held, handler).await?;
            if let Some(ended) = ended {
                return Err(ended);
            }
        }
    }

    /// A delivery of the stream, or the stream's failure or end.
    fn delivered(
        &self,
        next: Option<lapin::Result<AmqpDelivery>>,
    ) -> Result<AmqpDelivery, RabbitError> {
        match next {
            Some(Ok(delivery)) => Ok(delivery),
            Some(Err(source)) => Err(RabbitError::Broker {
                operation: "basic.consume",
                source,
            }),
            None => Err(RabbitError::Cancelled {
                queue: self.queue.clone(),
            }),
        }
    }

    /// The first delivery and what else arrives within the linger, up to the
    /// prefetch count; a stream failure met on the way ends the poll and is
    /// returned after it.
    async fn gather(
        &self,
        first: AmqpDelivery,
        consumer: &mut Consumer,
    ) -> (Vec<AmqpDelivery>, Option<RabbitError>) {
        let deadline = Instant::now() + self.linger;
        let mut poll = vec![first];
        while poll.len() < usize::from(self.prefetch) {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(next) => match self.delivered(next) {
                    Ok(delivery) => poll.push(delivery),
                    Err(ended) => return (poll, Some(ended)),
                },
                Err(_) => break,
            }
        }
        (poll, None)
    }

    /// Runs one poll and settles each delivery; held retries that come due
    /// meanwhile are requeued on time.
    async fn process<T, E, F, Fut>(
        &self,
        poll: Vec<AmqpDelivery>,
        held: &mut Held,
        handler: &F,
    ) -> Result<(), RabbitError>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(Arc<Message>, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let span = tracing::info_span!("rabbitmq.poll", queue = %self.queue, messages = poll.len());
        let received: Vec<Received> = poll.into_iter().map(|d| self.receive(d)).collect();
        let keyed: Vec<&Received> = received.iter().filter(|r| r.no_key.is_none()).collect();
        let deliveries: Vec<Delivery<Body<'_>>> = keyed
            .iter()
            .map(|r| Delivery {
                key: r.message.key.clone(),
                payload: Body(&r.message.body),
                attempt: r.message.attempt,
                redelivered: r.message.redelivered,
            })
            .collect();
        let run = run_poll(
            BROKER,
            &self.manager,
            &deliveries,
            self.concurrency,
            &self.backoff,
            |index, ctx| {
                let message = keyed[index].message.clone();
                let span = tracing::info_span!(
                    "rabbitmq.message",
                    key = %message.key,
                    delivery_tag = message.delivery_tag,
                    attempt = message.attempt,
                    redelivered = message.redelivered,
                );
                handler(message, ctx).instrument(span)
            },
        );
        let mut run = std::pin::pin!(run.instrument(span.clone()));
        // A failed requeue means the channel is gone: the poll still runs to
        // the end (its outcomes get recorded), then the failure is returned.
        let mut failed: Option<RabbitError> = None;
        let answers = loop {
            let due = if failed.is_none() {
                held.next_due()
            } else {
                None
            };
            tokio::select! {
                answers = &mut run => break answers,
                () = sleep_until(due) => {
                    if let Err(e) = held.release_due(self.operation_timeout).await {
                        failed = Some(e);
                    }
                }
            }
        };
        let dispositions =
            self.dispositions(&received, answers.into_iter().map(|a| a.disposition), &span);
        let settled = self.settle(dispositions, held).instrument(span).await;
        match failed {
            Some(e) => Err(e),
            None => settled,
        }
    }

    /// Each received delivery with its disposition, in order: the keyed ones
    /// as `run_poll` answered them, the keyless ones rejected (counted here,
    /// as `run_poll` never saw them). The answer hook sees each.
    fn dispositions<'r>(
        &self,
        received: &'r [Received],
        mut answered: impl Iterator<Item = Disposition>,
        span: &tracing::Span,
    ) -> Vec<(&'r Received, Disposition)> {
        let mut out = Vec::with_capacity(received.len());
        for r in received {
            let disposition = match &r.no_key {
                Some(reason) => {
                    tracing::warn!(parent: span, delivery_tag = r.message.delivery_tag, %reason, "message without an idempotency key rejected");
                    let disposition = Disposition::Reject {
                        reason: "invalid_key",
                    };
                    observe(BROKER, &disposition, r.message.redelivered);
                    disposition
                }
                // run_poll answers every delivery; should one be missing, keep it.
                None => answered.next().unwrap_or(Disposition::Retry {
                    after: self.min_retry_delay,
                    reason: "unanswered",
                }),
            };
            if let Some(hook) = &self.on_answer {
                hook(&r.message, &disposition);
            }
            out.push((r, disposition));
        }
        out
    }

    /// A received delivery, its key and attempt read.
    fn receive(&self, delivery: AmqpDelivery) -> Received {
        let (key, no_key) = match self.keys.key_of(&delivery.data, &delivery.properties) {
            Ok(key) => (key, None),
            Err(reason) => (String::new(), Some(reason)),
        };
        let message = Message {
            key,
            attempt: attempt_of(&delivery.properties, delivery.redelivered),
            redelivered: delivery.redelivered,
            delivery_tag: delivery.delivery_tag,
            exchange: delivery.exchange.as_str().to_owned(),
            routing_key: delivery.routing_key.as_str().to_owned(),
            properties: delivery.properties,
            body: delivery.data,
        };
        Received {
            message: Arc::new(message),
            acker: delivery.acker,
            no_key,
        }
    }

    /// Acks what is answered and rejects what never will be, all at once;
    /// holds retries until their time. Every delivery is settled before the
    /// first failure is returned.
    async fn settle(
        &self,
        settle: Vec<(&Received, Disposition)>,
        held: &mut Held,
    ) -> Result<(), RabbitError> {
        let mut pending = Vec::new();
        for (r, disposition) in settle {
            match disposition {
                Disposition::Ack(_) => {
                    pending.push(settle_one(&r.acker, true, self.operation_timeout))
                }
                Disposition::Reject { .. } => {
                    pending.push(settle_one(&r.acker, false, self.operation_timeout))
                }
                Disposition::Retry { after, .. } => {
                    let hold = after.clamp(self.min_retry_delay, self.max_retry_hold);
                    held.push(
                        Instant::now() + hold,
                        r.message.delivery_tag,
                        r.acker.clone(),
                    );
                }
            }
        }
        futures::future::join_all(pending)
            .await
            .into_iter()
            .collect::<Result<Vec<()>, _>>()
            .map(drop)
    }

    /// Refuses to start without the expected dead-letter exchange; warns
    /// when none is expected.
    async fn check_dead_letter_exchange(&self, connection: &Connection) -> Result<(), RabbitError> {
        let Some(exchange) = &self.dead_letter_exchange else {
            tracing::warn!(
                queue = %self.queue,
                "no dead-letter exchange configured: rejected messages (permanent failures, \
                 invalid keys, payload mismatches) are dropped by the broker unless queue {} \
                 has one (x-dead-letter-exchange argument or policy)",
                self.queue
            );
            return Ok(());
        };
        // A failed passive declare closes its channel: use one of its own.
        let limit = self.operation_timeout;
        let channel: Channel = bounded(limit, "channel.open", connection.create_channel()).await?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let declare = channel.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        );
        bounded(limit, "exchange.declare (passive)", declare)
            .await
            .map_err(|e| e.in_setup(format!("the dead-letter exchange {exchange}")))?;
        let _ = bounded(limit, "channel.close", channel.close(200, "checked".into())).await;
        Ok(())
    }
}

/// Acks (`true`) or rejects without requeueing (`false`) one delivery,
/// failing after `limit`.
async fn settle_one(acker: &Acker, ack: bool, limit: Duration) -> Result<(), RabbitError> {
    if ack {
        let options = BasicAckOptions { multiple: false };
        settled(limit, "basic.ack", acker.ack(options)).await
    } else {
        let options = BasicRejectOptions { requeue: false };
        settled(limit, "basic.reject", acker.reject(options)).await
    }
}
