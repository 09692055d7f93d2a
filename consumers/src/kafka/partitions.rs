//! What the consumer knows of each partition it owns (its assignment epoch,
//! the offset committed and the one waiting to be, its hold, its messages'
//! attempts), shared with the rebalance callbacks.
//!
//! librdkafka runs the rebalance callbacks while the consumer is polled, and
//! the consumer is polled only while a batch is collected, never while one is
//! answered or committed: a revocation never lands in the middle of
//! [`run_poll`](crate::run_poll).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::offsets::{settle, Hold, Step};

/// A topic and partition.
pub(crate) type Tp = (String, i32);

/// The most attempts remembered per partition; past it the lowest offsets
/// are forgotten (their next delivery counts as a first one again).
const MAX_ATTEMPTS_PER_PARTITION: usize = 10_000;

/// How long a hold waits at least, so a short `retry_after` (a key held
/// elsewhere, hinted at by this manager's own fast executions) never re-reads
/// the partition in a tight loop. The same floor as the shared policy's
/// [`MIN_RETRY_AFTER`](crate::disposition) for `InProgress`.
pub(crate) const MIN_HOLD: Duration = Duration::from_millis(250);

/// One owned partition.
#[derive(Debug, Default)]
struct Owned {
    /// Which assignment this is (messages of an earlier one are stale).
    epoch: u64,
    /// The offset last committed by this consumer.
    committed: Option<i64>,
    /// An answered offset not committed yet.
    pending: Option<i64>,
    /// The first unanswered message and when to read it again.
    hold: Option<(i64, Instant)>,
    /// One past the highest offset delivered.
    position: Option<i64>,
    /// Deliveries of each message not committed yet.
    attempts: BTreeMap<i64, u32>,
    /// Rejected messages not committed yet that were routed already.
    routed: BTreeSet<i64>,
    /// Messages answered (acknowledged or routed) past a hold, not committed
    /// yet: read again with the held one, they are not run again (their
    /// outcome may not be in the store: `Unrecorded`, `Unprotected`).
    answered: BTreeSet<i64>,
    /// The lowest offset admitted since the last settled batch: set while a
    /// batch is collected and run, cleared once it is settled. Left over, the
    /// batch was abandoned (its `poll_once` dropped, or a handler panicked):
    /// the partition is read again from here.
    in_flight: Option<i64>,
}

/// Every owned partition, and where revoked ones had got to.
#[derive(Debug, Default)]
pub(crate) struct Partitions {
    epoch: u64,
    owned: HashMap<Tp, Owned>,
    /// One past the highest offset delivered when the partition was last
    /// revoked from this consumer: a message below it was delivered before.
    revoked_at: HashMap<Tp, i64>,
}

/// How a received message is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admitted {
    pub(crate) epoch: u64,
    pub(crate) attempt: u32,
    pub(crate) redelivered: bool,
    /// Answered already (past a hold that brought it back): not run again.
    pub(crate) answered: bool,
}

impl Partitions {
    /// Takes a message in: `None` when its partition is not owned (revoked
    /// meanwhile) or held (it is read again once the hold ends).
    pub(crate) fn admit(&mut self, tp: &Tp, offset: i64) -> Option<Admitted> {
        let owned = self.owned.get_mut(tp)?;
        if owned.hold.is_some() {
            return None;
        }
        owned.position = Some(owned.position.map_or(offset + 1, |p| p.max(offset + 1)));
        owned.in_flight = Some(owned.in_flight.map_or(offset, |f| f.min(offset)));
        if owned.answered.contains(&offset) {
            return Some(Admitted {
                epoch: owned.epoch,
                attempt: owned.attempts.get(&offset).copied().unwrap_or(1),
                redelivered: true,
                answered: true,
            });
        }
        let attempts = owned.attempts.entry(offset).or_insert(0);
        *attempts = attempts.saturating_add(1);
        let attempt = *attempts;
        while owned.attempts.len() > MAX_ATTEMPTS_PER_PARTITION {
            owned.attempts.pop_first();
        }
        let before = self.revoked_at.get(tp).is_some_and(|&at| offset < at);
        Some(Admitted {
            epoch: owned.epoch,
            attempt,
            redelivered: attempt > 1 || before,
            answered: false,
        })
    }

    /// Whether `tp` is still owned under `epoch`.
    pub(crate) fn current(&self, tp: &Tp, epoch: u64) -> bool {
        self.owned.get(tp).is_some_and(|o| o.epoch == epoch)
    }

    /// Settles a partition's batch (see [`settle`]): records the offset to
    /// commit, the hold and the messages answered past it (not run again when
    /// read again), ends the batch's in-flight mark; returns the hold, if any.
    pub(crate) fn settle(
        &mut self,
        tp: &Tp,
        epoch: u64,
        batch: &[(i64, Step)],
        now: Instant,
    ) -> Option<Hold> {
        let owned = self.owned.get_mut(tp).filter(|o| o.epoch == epoch)?;
        let known = owned.pending.max(owned.committed);
        let settled = settle(known, batch);
        owned.in_flight = None;
        if let Some(commit) = settled.commit {
            owned.pending = Some(commit);
        }
        if let Some(hold) = settled.hold {
            owned.hold = Some((hold.offset, now + hold.after.max(MIN_HOLD)));
            let past = batch
                .iter()
                .filter(|&&(offset, step)| step == Step::Answered && offset > hold.offset);
            owned.answered.extend(past.map(|&(offset, _)| offset));
            while owned.answered.len() > MAX_ATTEMPTS_PER_PARTITION {
                // Forgotten from the highest down: read again, they run again
                // unless the store answers them (a redelivery, as after a
                // rebalance).
                owned.answered.pop_last();
            }
        }
        settled.hold
    }

    /// Turns each abandoned batch's in-flight mark into a hold due now: the
    /// partition is sought back to it (by the caller, as any hold's end) and
    /// its unanswered messages are read again. Returns how many partitions.
    pub(crate) fn recover_in_flight(&mut self, now: Instant) -> usize {
        let mut recovered = 0;
        for owned in self.owned.values_mut() {
            let Some(offset) = owned.in_flight.take() else {
                continue;
            };
            let offset = owned.hold.map_or(offset, |(held, _)| held.min(offset));
            owned.hold = Some((offset, now));
            recovered += 1;
        }
        recovered
    }

    /// The offsets waiting to be committed.
    pub(crate) fn pending(&self) -> Vec<(Tp, i64)> {
        let mut pending: Vec<_> = self
            .owned
            .iter()
            .filter_map(|(tp, o)| o.pending.map(|p| (tp.clone(), p)))
            .collect();
        pending.sort();
        pending
    }

    /// Records offsets the broker confirmed; forgets the attempts below them.
    pub(crate) fn committed(&mut self, offsets: &[(Tp, i64)]) {
        for (tp, offset) in offsets {
            let Some(owned) = self.owned.get_mut(tp) else {
                continue;
            };
            if owned.pending == Some(*offset) {
                owned.pending = None;
            }
            owned.committed = Some(owned.committed.map_or(*offset, |c| c.max(*offset)));
            owned.attempts = owned.attempts.split_off(offset);
            owned.routed = owned.routed.split_off(offset);
            owned.answered = owned.answered.split_off(offset);
        }
    }

    /// Whether the rejected message at `offset` was routed already (it is
    /// read again because an earlier message of its partition held it back).
    pub(crate) fn was_routed(&self, tp: &Tp, offset: i64) -> bool {
        self.owned
            .get(tp)
            .is_some_and(|o| o.routed.contains(&offset))
    }

    /// Records that the rejected message at `offset` was routed.
    pub(crate) fn routed(&mut self, tp: &Tp, offset: i64) {
        if let Some(owned) = self.owned.get_mut(tp) {
            owned.routed.insert(offset);
            while owned.routed.len() > MAX_ATTEMPTS_PER_PARTITION {
                owned.routed.pop_first();
            }
        }
    }

    /// The holds that are over (each partition's offset to read again from);
    /// they stay until [`released`](Self::released).
    pub(crate) fn due(&self, now: Instant) -> Vec<(Tp, i64)> {
        self.owned
            .iter()
            .filter_map(|(tp, o)| match o.hold {
                Some((offset, until)) if until <= now => Some((tp.clone(), offset)),
                _ => None,
            })
            .collect()
    }

    /// The earliest end of a hold.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.owned
            .values()
            .filter_map(|o| o.hold.map(|h| h.1))
            .min()
    }

    /// Ends the hold of `tp` (its partition was sought back and resumed).
    pub(crate) fn released(&mut self, tp: &Tp) {
        if let Some(owned) = self.owned.get_mut(tp) {
            owned.hold = None;
        }
    }

    /// Moves the end of `tp`'s hold to `until` (its seek back failed: it is
    /// tried again then, not in a loop).
    pub(crate) fn postpone(&mut self, tp: &Tp, until: Instant) {
        if let Some(hold) = self.owned.get_mut(tp).and_then(|o| o.hold.as_mut()) {
            hold.1 = until;
        }
    }

    /// The partitions held now.
    pub(crate) fn held(&self) -> usize {
        self.owned.values().filter(|o| o.hold.is_some()).count()
    }

    fn assign(&mut self, tps: impl IntoIterator<Item = Tp>) {
        self.epoch += 1;
        for tp in tps {
            let owned = Owned {
                epoch: self.epoch,
                ..Owned::default()
            };
            self.owned.insert(tp, owned);
        }
    }

    /// Forgets revoked partitions; returns their offsets still to commit.
    fn revoke(&mut self, tps: impl IntoIterator<Item = Tp>) -> Vec<(Tp, i64)> {
        let mut pending = Vec::new();
        for tp in tps {
            if let Some(owned) = self.owned.remove(&tp) {
                if let Some(position) = owned.position {
                    self.revoked_at.insert(tp.clone(), position);
                }
                if let Some(offset) = owned.pending {
                    pending.push((tp, offset));
                }
            }
        }
        pending
    }
}

/// The offsets as a list to commit.
pub(crate) fn offsets_list(offsets: &[(Tp, i64)]) -> TopicPartitionList {
    let mut list = TopicPartitionList::with_capacity(offsets.len());
    for ((topic, partition), offset) in offsets {
        // Only fails for an invalid offset; ours are non-negative.
        if let Err(error) = list.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
            tracing::warn!(topic, partition, offset, %error, "offset not representable");
        }
    }
    list
}

fn partitions_of(list: &TopicPartitionList) -> Vec<Tp> {
    list.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

/// The consumer's [`ConsumerContext`]: on revocation, the revoked partitions
/// stop taking work (their messages still being collected are dropped, their
/// holds and attempts forgotten) and what is answered of them is committed,
/// synchronously, before librdkafka gives them up.
#[derive(Debug, Clone)]
pub(crate) struct PartitionContext {
    pub(crate) state: Arc<Mutex<Partitions>>,
}

impl ClientContext for PartitionContext {}

impl ConsumerContext for PartitionContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(list) = rebalance else {
            return;
        };
        let pending = self.state.lock().revoke(partitions_of(list));
        let _span =
            tracing::info_span!("idempotency.kafka.revoke", partitions = list.count()).entered();
        if pending.is_empty() {
            return;
        }
        match consumer.commit(&offsets_list(&pending), CommitMode::Sync) {
            Ok(()) => {
                tracing::info!(offsets = ?pending, "committed the answered offsets of revoked partitions")
            }
            Err(error) => tracing::warn!(
                offsets = ?pending, %error,
                "could not commit the answered offsets of revoked partitions: their next owner answers them from the store"
            ),
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Assign(list) = rebalance else {
            return;
        };
        self.state.lock().assign(partitions_of(list));
        // A partition held under an earlier assignment starts unpaused.
        if let Err(error) = consumer.resume(list) {
            tracing::debug!(%error, "resuming newly assigned partitions");
        }
        tracing::info!(partitions = list.count(), "partitions assigned");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn tp() -> Tp {
        ("t".into(), 0)
    }

    #[test]
    fn attempts_count_per_offset_and_mark_redeliveries() {
        let mut p = Partitions::default();
        assert!(p.admit(&tp(), 0).is_none(), "not owned");
        p.assign([tp()]);
        let first = p.admit(&tp(), 5).unwrap();
        assert_eq!((first.attempt, first.redelivered), (1, false));
        let again = p.admit(&tp(), 5).unwrap();
        assert_eq!((again.attempt, again.redelivered), (2, true));
        p.committed(&[(tp(), 6)]);
        assert_eq!(
            p.admit(&tp(), 5).unwrap().attempt,
            1,
            "forgotten below the commit"
        );
    }

    #[test]
    fn a_revoked_partition_hands_back_its_pending_offset_and_marks_what_it_saw() {
        let mut p = Partitions::default();
        p.assign([tp()]);
        let epoch = p.admit(&tp(), 3).unwrap().epoch;
        p.admit(&tp(), 4).unwrap();
        p.settle(
            &tp(),
            epoch,
            &[(3, Step::Answered), (4, Step::Answered)],
            Instant::now(),
        );
        assert_eq!(p.revoke([tp()]), vec![(tp(), 5)]);
        assert!(!p.current(&tp(), epoch));
        p.assign([tp()]);
        let back = p.admit(&tp(), 4).unwrap();
        assert!(back.redelivered && back.attempt == 1 && back.epoch != epoch);
        assert!(!p.admit(&tp(), 5).unwrap().redelivered);
    }

    #[test]
    fn a_held_partition_takes_nothing_until_released() {
        let mut p = Partitions::default();
        p.assign([tp()]);
        let now = Instant::now();
        let epoch = p.admit(&tp(), 0).unwrap().epoch;
        let later = Step::Unanswered {
            after: Duration::from_millis(500),
        };
        let hold = p.settle(&tp(), epoch, &[(0, later)], now).unwrap();
        assert_eq!(hold.offset, 0);
        assert!(p.admit(&tp(), 1).is_none());
        assert!(p.due(now).is_empty());
        assert_eq!(p.due(now + Duration::from_millis(500)), vec![(tp(), 0)]);
        p.released(&tp());
        assert_eq!(p.admit(&tp(), 0).unwrap().attempt, 2);
    }

    #[test]
    fn messages_answered_past_a_hold_are_admitted_as_answered_until_committed() {
        let mut p = Partitions::default();
        p.assign([tp()]);
        let now = Instant::now();
        let epoch = p.admit(&tp(), 0).unwrap().epoch;
        p.admit(&tp(), 1).unwrap();
        p.admit(&tp(), 2).unwrap();
        let later = Step::Unanswered {
            after: Duration::ZERO,
        };
        let batch = [(0, Step::Answered), (1, later), (2, Step::Answered)];
        let hold = p.settle(&tp(), epoch, &batch, now).unwrap();
        assert_eq!(hold.offset, 1);
        assert!(
            p.due(now + MIN_HOLD - Duration::from_millis(1)).is_empty(),
            "a hold lasts at least MIN_HOLD"
        );
        p.released(&tp());
        assert!(!p.admit(&tp(), 1).unwrap().answered, "the held one runs");
        assert!(p.admit(&tp(), 2).unwrap().answered, "2 does not run again");
        p.committed(&[(tp(), 3)]);
        assert!(
            !p.admit(&tp(), 2).unwrap().answered,
            "forgotten once committed"
        );
    }

    #[test]
    fn a_revocation_forgets_what_was_answered_past_a_hold() {
        let mut p = Partitions::default();
        p.assign([tp()]);
        let epoch = p.admit(&tp(), 0).unwrap().epoch;
        p.admit(&tp(), 1).unwrap();
        let later = Step::Unanswered {
            after: Duration::ZERO,
        };
        p.settle(
            &tp(),
            epoch,
            &[(0, later), (1, Step::Answered)],
            Instant::now(),
        );
        p.revoke([tp()]);
        p.assign([tp()]);
        assert!(!p.admit(&tp(), 1).unwrap().answered, "left to the store");
    }

    #[test]
    fn an_abandoned_batch_becomes_a_hold_due_at_once_from_its_first_message() {
        let mut p = Partitions::default();
        p.assign([tp()]);
        let now = Instant::now();
        let epoch = p.admit(&tp(), 4).unwrap().epoch;
        p.admit(&tp(), 5).unwrap();
        // Settled: nothing left in flight.
        p.settle(
            &tp(),
            epoch,
            &[(4, Step::Answered), (5, Step::Answered)],
            now,
        );
        assert_eq!(p.recover_in_flight(now), 0);
        // Admitted, never settled (dropped, or a handler panicked).
        p.admit(&tp(), 7).unwrap();
        p.admit(&tp(), 6).unwrap();
        assert_eq!(p.recover_in_flight(now), 1);
        assert_eq!(p.due(now), vec![(tp(), 6)]);
        assert!(p.admit(&tp(), 8).is_none(), "held until sought back");
        p.released(&tp());
        assert_eq!(p.recover_in_flight(now), 0, "recovered once");
        assert_eq!(p.admit(&tp(), 6).unwrap().attempt, 2);
    }
}
