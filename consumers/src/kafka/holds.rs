//! Holding and releasing partitions: a settled batch's first unanswered
//! message pauses its partition; when the hold is over the partition is
//! sought back to it and resumed. An abandoned batch (its `poll_once` dropped,
//! or a handler panicked) leaves an in-flight mark that becomes a hold due at
//! once, so its unanswered messages are read again.

use std::collections::BTreeMap;

use idempotency_core::Codec;
use rdkafka::consumer::Consumer;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;

use super::offsets::Step;
use super::partitions::Tp;
use super::{KafkaConsumer, Received};

impl<C: Codec + Clone> KafkaConsumer<C> {
    /// Turns what an abandoned batch left in flight into holds due now (see
    /// [`release_due_holds`](Self::release_due_holds)): its partitions are
    /// read again from the batch's first message.
    pub(super) fn recover_in_flight(&self) {
        let recovered = self
            .state
            .lock()
            .recover_in_flight(Instant::now().into_std());
        if recovered > 0 {
            tracing::warn!(
                partitions = recovered,
                "an earlier batch was abandoned (its poll dropped, or a handler panicked): \
                 its partitions are read again from its first message"
            );
        }
    }

    /// Seeks each partition whose hold is over back to its first unanswered
    /// message, then resumes it. A partition whose seek or resume failed stays
    /// held (and paused) for the backoff's first delay more: it is never
    /// resumed past the message.
    ///
    /// The seek waits for librdkafka's fetcher (up to the seek timeout): it
    /// runs on a blocking thread, never on the async task. Dropped while it
    /// waits, the hold stays and is released by the next poll.
    pub(super) async fn release_due_holds(&self) {
        let due = self.state.lock().due(Instant::now().into_std());
        for (tp, offset) in due {
            let consumer = self.consumer.clone();
            let timeout = self.settings.seek_timeout;
            let (topic, partition) = (tp.0.clone(), tp.1);
            let seek = tokio::task::spawn_blocking(move || {
                consumer.seek(&topic, partition, Offset::Offset(offset), timeout)
            })
            .await;
            let (topic, partition) = (&tp.0, tp.1);
            let error = match seek {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(error.to_string()),
                Err(join) => Some(join.to_string()),
            };
            if let Some(error) = error {
                tracing::warn!(topic, partition, offset, %error, "seek back failed; the partition stays held");
                self.postpone(&tp);
                continue;
            }
            let mut list = TopicPartitionList::new();
            list.add_partition(topic, partition);
            match self.consumer.resume(&list) {
                Ok(()) => self.state.lock().released(&tp),
                Err(error) => {
                    tracing::warn!(topic, partition, %error, "resume failed; the partition stays held");
                    self.postpone(&tp);
                }
            }
        }
    }

    fn postpone(&self, tp: &Tp) {
        let later = Instant::now() + self.settings.backoff.initial;
        self.state.lock().postpone(tp, later.into_std());
    }

    /// Settles each partition of the batch; pauses the held ones (they are
    /// sought back when their hold ends: the messages fetched meanwhile are
    /// not taken).
    pub(super) fn settle(&self, batch: &[Received], steps: &[Step]) {
        let mut partitions: BTreeMap<(Tp, u64), Vec<(i64, Step)>> = BTreeMap::new();
        for (received, step) in batch.iter().zip(steps) {
            partitions
                .entry((received.tp(), received.epoch))
                .or_default()
                .push((received.message.offset(), *step));
        }
        let now = Instant::now().into_std();
        for ((tp, epoch), steps) in partitions {
            let hold = self.state.lock().settle(&tp, epoch, &steps, now);
            let Some(hold) = hold else { continue };
            let (topic, partition) = (&tp.0, tp.1);
            tracing::debug!(topic, partition, offset = hold.offset, after = ?hold.after, "partition held");
            let mut list = TopicPartitionList::new();
            list.add_partition(topic, partition);
            if let Err(error) = self.consumer.pause(&list) {
                tracing::warn!(topic, partition, %error, "pause failed; its messages are dropped until the hold ends");
            }
        }
    }
}
