//! The offset arithmetic of one partition, kept pure: given what became of
//! each message of a batch, the offset to commit and the message to go back to.
//!
//! A Kafka commit is a position: committing `n` says every message below `n`
//! is done. So a partition is committed only up to its first message not yet
//! answered, and read again from there; the messages after it that were
//! answered already are read again too. The consumer remembers them and does
//! not run them again (the store may hold no record of them:
//! `Unrecorded`, `Unprotected`); after a rebalance, their new owner answers
//! them from the store.
//!
//! ```
//! use std::time::Duration;
//! use idempotency_consumers::kafka::offsets::{settle, Hold, Settle, Step};
//!
//! let later = Step::Unanswered { after: Duration::from_millis(100) };
//! // 10 and 11 answered, 12 waits for its key's holder, 13 answered.
//! let batch = [(10, Step::Answered), (11, Step::Answered), (12, later), (13, Step::Answered)];
//! assert_eq!(
//!     settle(Some(10), &batch),
//!     Settle { commit: Some(12), hold: Some(Hold { offset: 12, after: Duration::from_millis(100) }) },
//! );
//! // Read again from 12: 12 is answered now; 13 was answered before (the
//! // consumer does not run it again).
//! assert_eq!(
//!     settle(Some(12), &[(12, Step::Answered), (13, Step::Answered)]),
//!     Settle { commit: Some(14), hold: None },
//! );
//! ```

use std::time::Duration;

/// What became of one message of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Answered: acknowledged, or rejected and handed to the reject route.
    Answered,
    /// Not answered yet: to be delivered again, no sooner than `after`.
    Unanswered {
        /// The earliest time the message is worth delivering again.
        after: Duration,
    },
}

/// Where a partition goes back to: its first unanswered message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The message's offset: the partition is read again from here.
    pub offset: i64,
    /// How long the partition waits before it is read again.
    pub after: Duration,
}

/// What to do with one partition after a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settle {
    /// The offset to commit (the next one to read), when it moves forward
    /// from the last one committed.
    pub commit: Option<i64>,
    /// The first unanswered message, if any: seek back to it and hold the
    /// partition for a while.
    pub hold: Option<Hold>,
}

/// Settles one partition's batch: `committed` is the offset last committed
/// (`None` when unknown), `batch` each message's offset and [`Step`], in any
/// order.
///
/// - The commit stops at the lowest unanswered offset (it never passes a
///   message not answered); with none, it is one past the highest offset.
/// - A commit that would not move forward from `committed` is left out.
/// - The hold is the lowest unanswered message, with its own delay.
pub fn settle(committed: Option<i64>, batch: &[(i64, Step)]) -> Settle {
    let first_unanswered = batch
        .iter()
        .filter_map(|&(offset, step)| match step {
            Step::Unanswered { after } => Some(Hold { offset, after }),
            Step::Answered => None,
        })
        .min_by_key(|hold| hold.offset);
    let end = match first_unanswered {
        Some(hold) => Some(hold.offset),
        None => batch
            .iter()
            .map(|&(offset, _)| offset.saturating_add(1))
            .max(),
    };
    let commit = end.filter(|&end| committed.is_none_or(|committed| end > committed));
    Settle {
        commit,
        hold: first_unanswered,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use proptest::prelude::*;

    const LATER: Step = Step::Unanswered {
        after: Duration::from_millis(5),
    };

    #[test]
    fn an_answered_batch_commits_past_its_last_message() {
        let batch = [
            (3, Step::Answered),
            (4, Step::Answered),
            (7, Step::Answered),
        ];
        assert_eq!(
            settle(None, &batch),
            Settle {
                commit: Some(8),
                hold: None
            }
        );
    }

    #[test]
    fn the_commit_stops_at_the_first_unanswered_message_and_holds_it() {
        let batch = [
            (3, Step::Answered),
            (4, LATER),
            (5, Step::Answered),
            (6, LATER),
        ];
        let settled = settle(Some(3), &batch);
        assert_eq!(settled.commit, Some(4));
        assert_eq!(
            settled.hold,
            Some(Hold {
                offset: 4,
                after: Duration::from_millis(5)
            })
        );
    }

    #[test]
    fn a_held_first_message_commits_nothing_new() {
        let settled = settle(Some(4), &[(4, LATER), (5, Step::Answered)]);
        assert_eq!(settled.commit, None);
        assert_eq!(settled.hold.map(|h| h.offset), Some(4));
    }

    #[test]
    fn a_commit_never_moves_backwards() {
        assert_eq!(settle(Some(9), &[(5, Step::Answered)]).commit, None);
        assert_eq!(settle(Some(9), &[]), Settle::default());
    }

    #[test]
    fn the_batch_may_come_in_any_order() {
        let batch = [
            (6, Step::Answered),
            (4, LATER),
            (5, Step::Answered),
            (3, LATER),
        ];
        let settled = settle(None, &batch);
        assert_eq!(settled.commit, Some(3));
        assert_eq!(settled.hold.map(|h| h.offset), Some(3));
    }

    fn batches() -> impl Strategy<Value = (Option<i64>, Vec<(i64, Step)>)> {
        let step = prop_oneof![
            Just(Step::Answered),
            (0u64..50).prop_map(|ms| Step::Unanswered {
                after: Duration::from_millis(ms)
            }),
        ];
        let batch = proptest::collection::btree_map(0i64..200, step, 0..24)
            .prop_map(|m| m.into_iter().collect::<Vec<_>>());
        (proptest::option::of(0i64..200), batch)
    }

    proptest! {
        #[test]
        fn never_commits_past_an_unanswered_message((committed, batch) in batches()) {
            let settled = settle(committed, &batch);
            if let Some(commit) = settled.commit {
                // Forward only, and every message of the batch below the
                // commit is answered.
                prop_assert!(committed.is_none_or(|c| commit > c));
                for &(offset, step) in &batch {
                    if offset < commit {
                        prop_assert_eq!(step, Step::Answered);
                    }
                }
                match settled.hold {
                    Some(hold) => prop_assert_eq!(hold.offset, commit),
                    None => prop_assert_eq!(Some(commit), batch.iter().map(|b| b.0 + 1).max()),
                }
            }
            // The hold is the lowest unanswered message, with its delay.
            let lowest = batch.iter().find(|b| b.1 != Step::Answered);
            prop_assert_eq!(settled.hold.map(|h| (h.offset, Step::Unanswered { after: h.after })), lowest.copied());
            // Nothing answered past the last commit is lost: what is not
            // committed is read again from the hold (or was committed before).
            if settled.commit.is_none() {
                let end = settled.hold.map(|h| h.offset).or_else(|| batch.iter().map(|b| b.0 + 1).max());
                prop_assert!(end.is_none() || committed.is_some_and(|c| end <= Some(c)));
            }
        }
    }
}
