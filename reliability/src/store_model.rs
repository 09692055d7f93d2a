//! The sequential contract of one key, as a [`Model`] for the checker: the
//! memory store's rules. `reserve` goes through the core's own decision
//! functions (`decision::reserve_transition`, `decision::reserved_record`),
//! which `MemoryRepository::reserve` applies; the owner-checked writes go
//! through the ones its `with_owned` applies (`decision::holds`,
//! `decision::finish_record`, `decision::extend_record`: a live
//! `Processing` record the owner holds, else `LeaseLost`).

use idempotency_core::decision::{
    extend_record, finish_record, holds, reserve_transition, reserved_record, ReserveTransition,
};
use idempotency_core::{OwnedReserveRequest, OwnerToken, Record, Reservation, Status, Timestamp};

use crate::linearizable::Model;

/// A store call on one key, with the caller's arguments.
#[derive(Debug, Clone)]
pub enum Call {
    /// `reserve` (or one request of `reserve_many`).
    Reserve(OwnedReserveRequest),
    /// `complete` (or one write of `complete_many`) and `fail`.
    Finish {
        /// The owner token.
        owner: OwnerToken,
        /// `Completed` or `Failed`.
        status: Status,
        /// The result or the stored error.
        value: Option<Vec<u8>>,
        /// Whether a failure is retryable.
        retryable: bool,
        /// The new expiry.
        expires_at: Timestamp,
        /// The caller's instant.
        now: Timestamp,
    },
    /// `extend`.
    Extend {
        /// The owner token.
        owner: OwnerToken,
        /// The new end of the lease.
        lease_until: Timestamp,
        /// The new expiry.
        expires_at: Timestamp,
        /// The caller's instant.
        now: Timestamp,
    },
    /// `release`.
    Release {
        /// The owner token.
        owner: OwnerToken,
        /// The caller's instant.
        now: Timestamp,
    },
    /// `get`.
    Get {
        /// The caller's instant.
        now: Timestamp,
    },
    /// `delete`.
    Delete,
    /// `purge_expired`, as it bears on this key (its count is the whole
    /// store's, so it is not checked here).
    Purge {
        /// The instant records must have expired by.
        now: Timestamp,
    },
}

/// A definite answer (an ambiguous one leaves the call pending).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `reserve`'s answer.
    Reserved(Reservation),
    /// An owner-checked write applied.
    Done,
    /// An owner-checked write refused.
    LeaseLost,
    /// `get`'s answer.
    Got(Option<Record>),
    /// `delete`'s answer.
    Deleted(bool),
    /// `purge_expired` answered (its count is not checked per key).
    Purged,
    /// Any other error: never the specification's answer.
    Error(String),
}

/// The contract of one key; its state is the record physically stored (live
/// or expired).
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreModel {
    /// Whether an owner-checked write the owner held may answer `LeaseLost`
    /// having been applied: a store client that re-sent the write within
    /// one call (its first attempt applied, its reply lost) finds the
    /// condition false. The engine checks every `LeaseLost` against the
    /// record read back (contract §4 step 3); strictly, the store's answer
    /// is not the sequential one.
    pub resent_writes: bool,
}

type State = Option<Record>;

impl Model for StoreModel {
    type State = State;
    type Input = Call;
    type Output = Answer;

    fn step(&self, state: &State, call: &Call, answer: Option<&Answer>) -> Vec<State> {
        let expect = |spec: Answer, next: State| match answer {
            None => vec![next],
            Some(a) if *a == spec => vec![next],
            Some(_) => vec![],
        };
        match call {
            Call::Reserve(request) => {
                let (next, spec) = reserve(state.as_ref(), request);
                expect(Answer::Reserved(spec), next)
            }
            Call::Finish {
                owner,
                status,
                value,
                retryable,
                expires_at,
                now,
            } => owned(self, state, (*owner, *now), answer, |r| {
                finish_record(r, *status, value.as_deref(), *retryable, *expires_at, *now);
                true
            }),
            Call::Extend {
                owner,
                lease_until,
                expires_at,
                now,
            } => owned(self, state, (*owner, *now), answer, |r| {
                extend_record(r, *lease_until, *expires_at, *now);
                true
            }),
            Call::Release { owner, now } => owned(self, state, (*owner, *now), answer, |_| false),
            Call::Get { now } => {
                let live = state.clone().filter(|r| !r.is_expired(*now));
                expect(Answer::Got(live), state.clone())
            }
            Call::Delete => match (state, answer) {
                // An expired record may or may not still be stored.
                (Some(_), Some(Answer::Deleted(_)) | None) => vec![None],
                (None, _) => expect(Answer::Deleted(false), None),
                (Some(_), Some(_)) => vec![],
            },
            Call::Purge { now } => match (state, answer) {
                (_, Some(a)) if *a != Answer::Purged => vec![],
                // Removed, or left for a later batch (its limit).
                (Some(r), _) if r.is_expired(*now) => vec![None, state.clone()],
                _ => vec![state.clone()],
            },
        }
    }
}

/// `reserve`'s next state and answer, by the core's decision functions.
fn reserve(existing: Option<&Record>, request: &OwnedReserveRequest) -> (State, Reservation) {
    let req = request.request();
    match reserve_transition(existing, &req) {
        ReserveTransition::Create => (
            Some(reserved_record(None, &req, 1)),
            Reservation::Acquired { attempt: 1 },
        ),
        ReserveTransition::Takeover { attempt } => (
            Some(reserved_record(existing, &req, attempt)),
            Reservation::Acquired { attempt },
        ),
        ReserveTransition::AlreadyHeld { attempt } => {
            (existing.cloned(), Reservation::Acquired { attempt })
        }
        ReserveTransition::Existing => match existing {
            Some(r) => (Some(r.clone()), Reservation::Existing(r.clone())),
            // The transition never answers `Existing` without a record.
            None => (None, Reservation::Acquired { attempt: 0 }),
        },
    }
}

/// An owner-checked write: `apply` (which returns whether the record stays)
/// on the live `Processing` record `owner` holds and `Done`, else `LeaseLost`
/// and no change.
fn owned(
    model: &StoreModel,
    state: &State,
    (owner, now): (OwnerToken, Timestamp),
    answer: Option<&Answer>,
    apply: impl FnOnce(&mut Record) -> bool,
) -> Vec<State> {
    let held = state.as_ref().is_some_and(|r| holds(r, owner, now));
    let (spec, next) = match (held, state.clone()) {
        (true, Some(mut r)) => {
            let keep = apply(&mut r);
            (Answer::Done, keep.then_some(r))
        }
        _ => (Answer::LeaseLost, state.clone()),
    };
    match answer {
        Some(Answer::LeaseLost) if held && model.resent_writes => vec![next],
        Some(a) if *a != spec => vec![],
        _ => vec![next],
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use idempotency_core::{RecordKey, ReserveRequest};

    use super::*;
    use crate::linearizable::{check, Operation, Verdict};

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(1_000_000 + ms)
    }

    fn reserve_call(owner: OwnerToken, now: u64, lease_ms: u64) -> Call {
        let key = RecordKey::new("ns", "k", 1024).unwrap();
        let req = ReserveRequest::new(
            &key,
            owner,
            t(now),
            Duration::from_millis(lease_ms),
            Duration::from_secs(60),
        );
        Call::Reserve(OwnedReserveRequest::from(&req))
    }

    fn complete(owner: OwnerToken, now: u64) -> Call {
        Call::Finish {
            owner,
            status: Status::Completed,
            value: Some(b"r".to_vec()),
            retryable: false,
            expires_at: t(60_000),
            now: t(now),
        }
    }

    fn op(call: u64, ret: Option<u64>, input: Call, answer: Answer) -> Operation<Call, Answer> {
        Operation {
            call,
            answer: ret.map(|r| (r, answer)),
            input,
        }
    }

    fn acquired(attempt: u32) -> Answer {
        Answer::Reserved(Reservation::Acquired { attempt })
    }

    fn verdict(h: &[Operation<Call, Answer>]) -> Verdict {
        check(&StoreModel::default(), None, h, 100_000)
    }

    #[test]
    fn two_concurrent_reserves_both_acquired_is_not_linearizable() {
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        let h = [
            op(0, Some(2), reserve_call(a, 0, 10_000), acquired(1)),
            op(1, Some(3), reserve_call(b, 0, 10_000), acquired(1)),
        ];
        assert_eq!(verdict(&h), Verdict::NotLinearizable);
    }

    #[test]
    fn one_acquires_the_other_sees_it_is_linearizable() {
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        let first = reserve_call(a, 0, 10_000);
        let Call::Reserve(request) = &first else {
            unreachable!()
        };
        let record = reserved_record(None, &request.request(), 1);
        let h = [
            op(0, Some(2), first.clone(), acquired(1)),
            op(
                1,
                Some(3),
                reserve_call(b, 0, 10_000),
                Answer::Reserved(Reservation::Existing(record)),
            ),
            op(4, Some(5), complete(a, 5), Answer::Done),
        ];
        assert_eq!(verdict(&h), Verdict::Linearizable);
    }

    #[test]
    fn a_complete_applied_after_a_takeover_is_not_linearizable() {
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        let h = [
            op(0, Some(1), reserve_call(a, 0, 100), acquired(1)),
            // b's clock is past a's lease: a takeover.
            op(2, Some(3), reserve_call(b, 1_000, 10_000), acquired(2)),
            op(4, Some(5), complete(a, 1_001), Answer::Done),
        ];
        assert_eq!(verdict(&h), Verdict::NotLinearizable);
        let refused = [
            h[0].clone(),
            h[1].clone(),
            op(4, Some(5), complete(a, 1_001), Answer::LeaseLost),
        ];
        assert_eq!(verdict(&refused), Verdict::Linearizable);
    }

    #[test]
    fn a_resent_write_answered_lease_lost_passes_only_the_relaxed_model() {
        let a = OwnerToken::random();
        let first = reserve_call(a, 0, 10_000);
        let h = [
            op(0, Some(1), first, acquired(1)),
            op(2, Some(3), complete(a, 2), Answer::LeaseLost),
            op(4, Some(5), complete(a, 4), Answer::LeaseLost),
        ];
        assert_eq!(verdict(&h), Verdict::NotLinearizable);
        let relaxed = StoreModel {
            resent_writes: true,
        };
        assert_eq!(check(&relaxed, None, &h, 100_000), Verdict::Linearizable);
    }

    #[test]
    fn a_lost_reply_leaves_the_call_pending_and_a_resend_is_harmless() {
        let a = OwnerToken::random();
        let h = [
            // The reply was lost: the reserve may or may not have been applied.
            op(0, None, reserve_call(a, 0, 10_000), acquired(0)),
            op(2, Some(3), reserve_call(a, 1, 10_000), acquired(1)),
            op(4, Some(5), complete(a, 5), Answer::Done),
            op(6, Some(7), complete(a, 6), Answer::LeaseLost),
        ];
        assert_eq!(verdict(&h), Verdict::Linearizable);
    }

    #[test]
    fn a_read_of_a_result_before_its_complete_was_called_is_not_linearizable() {
        let a = OwnerToken::random();
        let first = reserve_call(a, 0, 10_000);
        let Call::Reserve(request) = &first else {
            unreachable!()
        };
        let mut done = reserved_record(None, &request.request(), 1);
        done.status = Status::Completed;
        done.result = Some(b"r".to_vec());
        done.expires_at = t(60_000);
        done.updated_at = t(5);
        let h = [
            op(0, Some(1), first.clone(), acquired(1)),
            op(2, Some(3), Call::Get { now: t(4) }, Answer::Got(Some(done))),
            op(4, Some(5), complete(a, 5), Answer::Done),
        ];
        assert_eq!(verdict(&h), Verdict::NotLinearizable);
    }
}
