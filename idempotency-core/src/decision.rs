//! The state machine's decisions, as pure functions over a record.
//!
//! Nothing here performs I/O: the manager sequences repository calls around
//! these functions, and the in-memory store (and any store that reads, decides and
//! writes under a lock) applies [`reserve_transition`] directly. Keeping them pure
//! lets them be tested exhaustively (status × lease × fingerprint × policy).

use std::time::Duration;

use crate::config::FailurePolicy;
use crate::key::Fingerprint;
use crate::record::{Record, Status};
use crate::repository::ReserveRequest;
use crate::time::Timestamp;

mod writes;

pub use writes::{
    answer_serve_until, cached_answer, extend_record, finish_margin, finish_record, finished_by,
    holds, on_drop, DropAction, DropPhase, FinishWrite,
};

/// What `reserve` does to the record it finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveTransition {
    /// No live record: create `Processing`, attempt 1.
    Create,
    /// Take over the record: new owner, this attempt number.
    Takeover {
        /// `previous attempt + 1`.
        attempt: u32,
    },
    /// The requesting owner already holds the live `Processing` record (a
    /// `reserve` re-sent after its reply was lost): answer `Acquired` with the
    /// stored attempt and write nothing.
    AlreadyHeld {
        /// The stored attempt.
        attempt: u32,
    },
    /// Leave the record as it is and return it.
    Existing,
}

/// Whether two optional fingerprints are both present and differ.
pub fn fingerprints_conflict(stored: Option<&Fingerprint>, request: Option<&Fingerprint>) -> bool {
    matches!((stored, request), (Some(a), Some(b)) if a != b)
}

/// The latest instant that has passed on every clock within `clock_skew` of
/// this one: `now - clock_skew` (saturating at the epoch).
///
/// The one margin of the skew: a lease that ended by then is over for every
/// consumer ([`lease_ended`]), and a record that expired by then is gone for
/// every consumer (purges remove records expired by then, not by `now`).
/// SQL stores are given this instant, computed here, rather than the skew.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::decision::skew_cutoff;
/// use idempotency_core::Timestamp;
///
/// let now = Timestamp::from_millis(10_000);
/// assert_eq!(skew_cutoff(now, Duration::from_secs(2)), Timestamp::from_millis(8_000));
/// assert_eq!(skew_cutoff(now, Duration::from_secs(60)), Timestamp::EPOCH);
/// ```
pub fn skew_cutoff(now: Timestamp, clock_skew: Duration) -> Timestamp {
    now.saturating_sub(clock_skew)
}

/// Whether a lease running until `lease_until` has ended for every consumer
/// at `now` (this clock) under `clock_skew`: `lease_until <= now - clock_skew`.
///
/// The rule by which a consumer takes a `Processing` record over
/// ([`reserve_transition`]) and by which an operator calls it stuck
/// ([`stuck`]): a lease that ended on this clock less than `clock_skew` ago
/// may still be running on the holder's.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::decision::lease_ended;
/// use idempotency_core::Timestamp;
///
/// let (lease_until, skew) = (Timestamp::from_millis(3_000), Duration::from_secs(2));
/// // 0.3 s after the lease on this clock: still live within the skew.
/// assert!(!lease_ended(lease_until, Timestamp::from_millis(3_300), skew));
/// assert!(lease_ended(lease_until, Timestamp::from_millis(5_000), skew));
/// ```
pub fn lease_ended(lease_until: Timestamp, now: Timestamp, clock_skew: Duration) -> bool {
    lease_until <= skew_cutoff(now, clock_skew)
}

/// Whether `record` is stuck at `now` under `clock_skew`: `Processing` with
/// its lease [ended](lease_ended) — a consumer that stopped without recording
/// an outcome, which the next delivery takes over. Operator tools (listing,
/// counting, `evict --only-if-stuck`) use this, so they call stuck exactly
/// what consumers would take over.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::decision::stuck;
/// use idempotency_core::{OwnerToken, Record, Status, Timestamp};
///
/// let t = Timestamp::from_millis;
/// let record = Record {
///     status: Status::Processing,
///     owner: OwnerToken::random(),
///     attempt: 1,
///     fingerprint: None,
///     result: None,
///     error: None,
///     retryable: false,
///     lease_until: t(3_000),
///     expires_at: t(60_000),
///     created_at: t(0),
///     updated_at: t(0),
/// };
/// let skew = Duration::from_secs(2);
/// assert!(!stuck(&record, t(3_300), skew));
/// assert!(stuck(&record, t(5_000), skew));
/// assert!(!stuck(&Record { status: Status::Completed, ..record }, t(5_000), skew));
/// ```
pub fn stuck(record: &Record, now: Timestamp, clock_skew: Duration) -> bool {
    record.status == Status::Processing && lease_ended(record.lease_until, now, clock_skew)
}

/// The reservation rule of the repository contract, over the record currently
/// stored (expired or not).
pub fn reserve_transition(
    existing: Option<&Record>,
    req: &ReserveRequest<'_>,
) -> ReserveTransition {
    let Some(record) = existing.filter(|r| !r.is_expired(req.now)) else {
        return ReserveTransition::Create;
    };
    if record.status == Status::Processing && record.owner == req.owner {
        return ReserveTransition::AlreadyHeld {
            attempt: record.attempt,
        };
    }
    if fingerprints_conflict(record.fingerprint.as_ref(), req.fingerprint.as_ref()) {
        return ReserveTransition::Existing;
    }
    let takeover = match record.status {
        Status::Processing => lease_ended(record.lease_until, req.now, req.clock_skew),
        Status::Failed => req.retry_failed && record.retryable,
        Status::Completed => false,
    };
    if takeover {
        ReserveTransition::Takeover {
            attempt: record.attempt.saturating_add(1),
        }
    } else {
        ReserveTransition::Existing
    }
}

/// Builds the record a [`ReserveTransition::Create`] or
/// [`ReserveTransition::Takeover`] stores: on a takeover (`attempt > 1`) it keeps
/// `created_at` and, when the request carries none, the stored fingerprint (a
/// consumer without payload validation must not erase it).
pub fn reserved_record(
    existing: Option<&Record>,
    req: &ReserveRequest<'_>,
    attempt: u32,
) -> Record {
    let (created_at, fingerprint) = match existing {
        Some(r) if attempt > 1 => (r.created_at, req.fingerprint.or(r.fingerprint)),
        _ => (req.now, req.fingerprint),
    };
    Record {
        status: Status::Processing,
        owner: req.owner,
        attempt,
        fingerprint,
        result: None,
        error: None,
        retryable: false,
        lease_until: req.lease_until,
        expires_at: req.expires_at,
        created_at,
        updated_at: req.now,
    }
}

/// What a duplicate delivery gets when `reserve` returned an existing record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DuplicateDecision {
    /// The stored payload fingerprint differs from this request's.
    PayloadMismatch,
    /// Completed with a cached result: replay it.
    Replay(Vec<u8>),
    /// Completed without a cached result.
    Duplicate,
    /// Another attempt holds a live lease.
    InProgress {
        /// Time until the lease (plus skew tolerance) runs out.
        retry_after: Duration,
    },
    /// The earlier attempt failed and stored its error.
    PreviouslyFailed(Vec<u8>),
}

/// The decision for an [`Existing`](crate::Reservation::Existing) record (contract
/// §4 step 2).
pub fn decide_duplicate(
    record: Record,
    fingerprint: Option<&Fingerprint>,
    now: Timestamp,
    clock_skew: Duration,
) -> DuplicateDecision {
    if fingerprints_conflict(record.fingerprint.as_ref(), fingerprint) {
        return DuplicateDecision::PayloadMismatch;
    }
    match record.status {
        Status::Completed => match record.result {
            Some(bytes) => DuplicateDecision::Replay(bytes),
            None => DuplicateDecision::Duplicate,
        },
        Status::Processing => DuplicateDecision::InProgress {
            retry_after: (record.lease_until + clock_skew).duration_since(now),
        },
        Status::Failed => DuplicateDecision::PreviouslyFailed(record.error.unwrap_or_default()),
    }
}

/// How a handler's error is classified for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureKind {
    /// Let the configured [`FailurePolicy`] decide.
    #[default]
    Default,
    /// Retrying may succeed: release the record so a redelivery runs again.
    Transient,
    /// Retrying will not help: store `Failed` so duplicates get the error.
    Permanent,
}

/// What the manager does with the record after a handler error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureAction {
    /// Delete the record: the next delivery runs the handler again.
    Release,
    /// Store `Failed` with the error.
    StoreFailed {
        /// Whether a later delivery may take the failure over (only under
        /// [`FailurePolicy::StoreAndRetry`], never for a permanent error).
        retryable: bool,
    },
}

/// The action for a handler error of `kind` under `policy` (contract §4 step 5).
pub fn failure_action(kind: FailureKind, policy: FailurePolicy) -> FailureAction {
    match (kind, policy) {
        (FailureKind::Transient, _) => FailureAction::Release,
        (FailureKind::Permanent, _) => FailureAction::StoreFailed { retryable: false },
        (FailureKind::Default, FailurePolicy::Release) => FailureAction::Release,
        (FailureKind::Default, FailurePolicy::Store) => {
            FailureAction::StoreFailed { retryable: false }
        }
        (FailureKind::Default, FailurePolicy::StoreAndRetry) => {
            FailureAction::StoreFailed { retryable: true }
        }
    }
}

/// Whether a serialized result of `size` bytes is cached (contract §4 step 4): caching
/// is on and it fits `min(max_result_size, store limit)`.
pub fn should_cache_result(
    size: usize,
    caching: bool,
    max_result_size: usize,
    store_limit: Option<usize>,
) -> bool {
    caching && size <= store_limit.map_or(max_result_size, |s| s.min(max_result_size))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{OwnerToken, RecordKey};

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn record(status: Status, lease_until: u64, expires_at: u64, fp: Option<u8>) -> Record {
        Record {
            status,
            owner: OwnerToken::from_u128(1),
            attempt: 3,
            fingerprint: fp.map(|b| Fingerprint::from_bytes([b; 32])),
            result: (status == Status::Completed).then(|| b"r".to_vec()),
            error: (status == Status::Failed).then(|| b"e".to_vec()),
            retryable: status == Status::Failed,
            lease_until: t(lease_until),
            expires_at: t(expires_at),
            created_at: t(1),
            updated_at: t(2),
        }
    }

    const STATUSES: [Status; 3] = [Status::Processing, Status::Completed, Status::Failed];
    const FPS: [Option<u8>; 3] = [None, Some(1), Some(2)];

    /// Every status × lease (live, at cutoff, stale) × expiry × fingerprint pair ×
    /// retry_failed × skew, checked against the contract's rule written out
    /// independently.
    /// Every (retry_failed, retryable, ours).
    const BOOLS3: [(bool, bool, bool); 8] = [
        (false, false, false),
        (false, false, true),
        (false, true, false),
        (false, true, true),
        (true, false, false),
        (true, false, true),
        (true, true, false),
        (true, true, true),
    ];

    #[test]
    fn reserve_transition_exhaustive() {
        let key = RecordKey::new("ns", "id", 256).unwrap();
        let now = 1_000;
        // Every combination, built with plain loops (nested closures nine deep
        // take rustfmt minutes).
        let mut cases = Vec::new();
        for &status in STATUSES.iter() {
            for lease in [now - 500, now - 100, now, now + 100] {
                for expires in [now - 1, now, now + 1, now + 10_000] {
                    for (stored_fp, req_fp) in FPS.into_iter().flat_map(|s| FPS.map(|r| (s, r))) {
                        for (retry_failed, retryable, ours) in BOOLS3 {
                            for skew in [0, 100, 400] {
                                cases.push((
                                    status,
                                    lease,
                                    expires,
                                    stored_fp,
                                    req_fp,
                                    retry_failed,
                                    retryable,
                                    ours,
                                    skew,
                                ));
                            }
                        }
                    }
                }
            }
        }
        for (status, lease, expires, stored_fp, req_fp, retry_failed, retryable, ours, skew) in
            cases
        {
            let mut rec = record(status, lease, expires, stored_fp);
            rec.retryable = retryable;
            let owner = if ours {
                rec.owner
            } else {
                OwnerToken::from_u128(2)
            };
            let req = ReserveRequest {
                key: &key,
                owner,
                fingerprint: req_fp.map(|b| Fingerprint::from_bytes([b; 32])),
                now: t(now),
                lease_until: t(now + 30),
                expires_at: t(now + 60),
                retry_failed,
                clock_skew: Duration::from_millis(skew),
            };
            let got = reserve_transition(Some(&rec), &req);
            // The contract's rule, written out independently.
            let expired = expires <= now;
            let conflict = matches!((stored_fp, req_fp), (Some(a), Some(b)) if a != b);
            let stale = lease + skew <= now;
            let want = if expired {
                ReserveTransition::Create
            } else if ours && status == Status::Processing {
                ReserveTransition::AlreadyHeld { attempt: 3 }
            } else if conflict {
                ReserveTransition::Existing
            } else if (status == Status::Processing && stale)
                || (status == Status::Failed && retry_failed && retryable)
            {
                ReserveTransition::Takeover { attempt: 4 }
            } else {
                ReserveTransition::Existing
            };
            assert_eq!(
                got, want,
                "{status:?} lease={lease} exp={expires} fp={stored_fp:?}/{req_fp:?} \
                 retry={retry_failed} retryable={retryable} ours={ours} skew={skew}"
            );
        }
        let req = ReserveRequest {
            key: &key,
            owner: OwnerToken::from_u128(2),
            fingerprint: None,
            now: t(now),
            lease_until: t(now + 30),
            expires_at: t(now + 60),
            retry_failed: false,
            clock_skew: Duration::ZERO,
        };
        assert_eq!(reserve_transition(None, &req), ReserveTransition::Create);
    }

    #[test]
    fn reserved_record_keeps_created_at_only_on_takeover() {
        let key = RecordKey::new("ns", "id", 256).unwrap();
        let old = record(Status::Failed, 0, 10_000, Some(1));
        let req = ReserveRequest {
            key: &key,
            owner: OwnerToken::from_u128(9),
            fingerprint: None,
            now: t(500),
            lease_until: t(600),
            expires_at: t(900),
            retry_failed: true,
            clock_skew: Duration::ZERO,
        };
        let taken = reserved_record(Some(&old), &req, 4);
        assert_eq!(taken.created_at, t(1));
        assert_eq!(taken.owner, OwnerToken::from_u128(9));
        // No request fingerprint: the stored one is kept.
        assert_eq!(
            (
                taken.result,
                taken.error,
                taken.fingerprint,
                taken.retryable
            ),
            (None, None, old.fingerprint, false)
        );
        let with_fp = ReserveRequest {
            fingerprint: Some(Fingerprint::from_bytes([7; 32])),
            ..req.clone()
        };
        assert_eq!(
            reserved_record(Some(&old), &with_fp, 4).fingerprint,
            with_fp.fingerprint
        );
        assert_eq!(taken.status, Status::Processing);
        let fresh = reserved_record(Some(&old), &req, 1);
        assert_eq!(fresh.created_at, t(500));
        assert_eq!(fresh.fingerprint, None);
    }

    #[test]
    fn duplicate_decisions_exhaustive() {
        let now = t(1_000);
        for status in STATUSES {
            for stored_fp in FPS {
                for req_fp in FPS {
                    for cached in [false, true] {
                        let mut rec = record(status, 1_200, 5_000, stored_fp);
                        if !cached {
                            rec.result = None;
                            rec.error = None;
                        }
                        let fp = req_fp.map(|b| Fingerprint::from_bytes([b; 32]));
                        let got =
                            decide_duplicate(rec, fp.as_ref(), now, Duration::from_millis(50));
                        let conflict = matches!((stored_fp, req_fp), (Some(a), Some(b)) if a != b);
                        let want = match (conflict, status, cached) {
                            (true, _, _) => DuplicateDecision::PayloadMismatch,
                            (false, Status::Completed, true) => {
                                DuplicateDecision::Replay(b"r".to_vec())
                            }
                            (false, Status::Completed, false) => DuplicateDecision::Duplicate,
                            (false, Status::Processing, _) => DuplicateDecision::InProgress {
                                retry_after: Duration::from_millis(250),
                            },
                            (false, Status::Failed, true) => {
                                DuplicateDecision::PreviouslyFailed(b"e".to_vec())
                            }
                            (false, Status::Failed, false) => {
                                DuplicateDecision::PreviouslyFailed(Vec::new())
                            }
                        };
                        assert_eq!(got, want);
                    }
                }
            }
        }
    }

    #[test]
    fn in_progress_retry_after_never_negative() {
        let rec = record(Status::Processing, 900, 5_000, None);
        assert_eq!(
            decide_duplicate(rec, None, t(1_000), Duration::ZERO),
            DuplicateDecision::InProgress {
                retry_after: Duration::ZERO
            }
        );
    }

    #[test]
    fn failure_actions_exhaustive() {
        use FailureAction::*;
        use FailureKind as K;
        use FailurePolicy as P;
        let kept = StoreFailed { retryable: false };
        let retried = StoreFailed { retryable: true };
        let table = [
            (K::Default, P::Release, Release),
            (K::Default, P::Store, kept),
            (K::Default, P::StoreAndRetry, retried),
            (K::Transient, P::Release, Release),
            (K::Transient, P::Store, Release),
            (K::Transient, P::StoreAndRetry, Release),
            (K::Permanent, P::Release, kept),
            (K::Permanent, P::Store, kept),
            (K::Permanent, P::StoreAndRetry, kept),
        ];
        for (kind, policy, want) in table {
            assert_eq!(failure_action(kind, policy), want, "{kind:?} {policy:?}");
        }
    }

    #[test]
    fn result_caching_limits() {
        assert!(should_cache_result(10, true, 10, None));
        assert!(!should_cache_result(11, true, 10, None));
        assert!(!should_cache_result(10, true, 100, Some(9)));
        assert!(should_cache_result(9, true, 100, Some(9)));
        assert!(!should_cache_result(0, false, 100, None));
    }
}
