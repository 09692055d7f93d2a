//! The decisions of the owner-checked writes (`complete`, `fail`, `release`,
//! `extend`), of the engine around them (how long a finishing write is
//! retried, whether a refused write was ours after all, what a dropped
//! execution leaves behind) and of the local answer cache: pure functions the
//! in-memory store and the engine apply, and the model checker
//! (`model-check/`) calls on its model state.

use std::time::Duration;

use crate::config::CancelPolicy;
use crate::key::{Fingerprint, OwnerToken};
use crate::record::{Record, Status};
use crate::time::Timestamp;

use super::{fingerprints_conflict, DuplicateDecision};

/// Whether `owner` holds `record` at `now`: the record is live, `Processing`
/// and `owner`'s — the condition under which `complete`, `fail`, `release`
/// and `extend` apply (contract §3); otherwise they answer `LeaseLost` and
/// leave the record untouched. The token decides, not the lease: an owner
/// whose lease ran out but whom nobody took over still holds the record.
///
/// ```
/// use idempotency_core::decision::holds;
/// use idempotency_core::{OwnerToken, Record, Status, Timestamp};
///
/// let owner = OwnerToken::from_u128(7);
/// let t = Timestamp::from_millis;
/// let record = Record {
///     status: Status::Processing,
///     owner,
///     attempt: 1,
///     fingerprint: None,
///     result: None,
///     error: None,
///     retryable: false,
///     lease_until: t(1_000),
///     expires_at: t(5_000),
///     created_at: t(0),
///     updated_at: t(0),
/// };
/// assert!(holds(&record, owner, Timestamp::from_millis(2_000)));
/// assert!(holds(&record, owner, Timestamp::from_millis(4_000)), "past the lease, nobody took over");
/// assert!(!holds(&record, owner, Timestamp::from_millis(5_000)), "expired");
/// assert!(!holds(&record, OwnerToken::from_u128(8), Timestamp::from_millis(2_000)));
/// ```
pub fn holds(record: &Record, owner: OwnerToken, now: Timestamp) -> bool {
    !record.is_expired(now) && record.status == Status::Processing && record.owner == owner
}

/// Applies a `complete` (`status` [`Status::Completed`], `value` the cached
/// result) or a `fail` (`status` [`Status::Failed`], `value` the error) to a
/// record its owner [holds].
pub fn finish_record(
    record: &mut Record,
    status: Status,
    value: Option<&[u8]>,
    retryable: bool,
    expires_at: Timestamp,
    now: Timestamp,
) {
    record.status = status;
    let value = value.map(<[u8]>::to_vec);
    if status == Status::Completed {
        record.result = value;
    } else {
        record.error = value;
    }
    record.retryable = retryable;
    record.expires_at = expires_at;
    record.updated_at = now;
}

/// Applies an `extend` to a record its owner [holds]: the lease and the
/// expiry rise to at least the given instants, never lower (an older
/// extension applied after a newer one moves neither back).
pub fn extend_record(
    record: &mut Record,
    lease_until: Timestamp,
    expires_at: Timestamp,
    now: Timestamp,
) {
    record.lease_until = record.lease_until.max(lease_until);
    record.expires_at = record.expires_at.max(expires_at);
    record.updated_at = now;
}

/// A write that finishes an execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishWrite {
    /// `complete`.
    Complete,
    /// `fail`.
    Fail,
    /// `release`.
    Release,
}

/// After a finishing write was answered `LeaseLost`: whether it was applied
/// by us after all (a lost reply, a write a client re-sent), judged on the
/// record read back (`None`: none live). A completed or failed record under
/// our token is ours; for a release, a record that is gone (contract §4
/// step 3).
///
/// ```
/// use idempotency_core::decision::{finished_by, FinishWrite};
/// use idempotency_core::OwnerToken;
///
/// assert!(finished_by(None, OwnerToken::from_u128(1), FinishWrite::Release));
/// assert!(!finished_by(None, OwnerToken::from_u128(1), FinishWrite::Complete));
/// ```
pub fn finished_by(record: Option<&Record>, owner: OwnerToken, write: FinishWrite) -> bool {
    let ours = |status| matches!(record, Some(r) if r.owner == owner && r.status == status);
    match write {
        FinishWrite::Complete => ours(Status::Completed),
        FinishWrite::Fail => ours(Status::Failed),
        FinishWrite::Release => record.is_none(),
    }
}

/// How long before the lease's end a finishing write stops being retried: a
/// tenth of the processing timeout, at most a second (contract §4 step 3).
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::decision::finish_margin;
///
/// assert_eq!(finish_margin(Duration::from_secs(4)), Duration::from_millis(400));
/// assert_eq!(finish_margin(Duration::from_secs(300)), Duration::from_secs(1));
/// ```
pub fn finish_margin(processing_timeout: Duration) -> Duration {
    (processing_timeout / 10).min(Duration::from_secs(1))
}

/// Where an execution was when its caller dropped it (contract §4 step 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropPhase {
    /// Reserving the key.
    Reserving,
    /// The handler runs.
    Running,
    /// The outcome is being recorded.
    Recording,
}

/// What a dropped execution does with its record, in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropAction {
    /// Release it (no handler ran, or the cancel policy says so).
    Release,
    /// Leave it until its lease ends: the handler's effect may be happening.
    Keep,
    /// Record the pending outcome: the effect happened, only its record is
    /// missing.
    Record,
}

/// What an execution dropped in `phase` leaves behind under `on_cancel`.
///
/// ```
/// use idempotency_core::decision::{on_drop, DropAction, DropPhase};
/// use idempotency_core::CancelPolicy;
///
/// assert_eq!(on_drop(DropPhase::Running, CancelPolicy::KeepLease), DropAction::Keep);
/// assert_eq!(on_drop(DropPhase::Reserving, CancelPolicy::KeepLease), DropAction::Release);
/// ```
pub fn on_drop(phase: DropPhase, on_cancel: CancelPolicy) -> DropAction {
    match (phase, on_cancel) {
        (DropPhase::Reserving, _) => DropAction::Release,
        (DropPhase::Running, CancelPolicy::KeepLease) => DropAction::Keep,
        (DropPhase::Running, CancelPolicy::Release) => DropAction::Release,
        (DropPhase::Recording, _) => DropAction::Record,
    }
}

/// Until when the local answer cache may serve a completed record's answer
/// read (or written) at `read_at` (contract §4, local answers): before the
/// record's `expires_at - clock_skew`, and for at most `max_staleness`;
/// `None` when that is already past.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::decision::answer_serve_until;
/// use idempotency_core::Timestamp;
///
/// let t = Timestamp::from_millis;
/// let skew = Duration::from_secs(5);
/// assert_eq!(answer_serve_until(t(60_000), t(0), skew, Duration::from_secs(10)), Some(t(10_000)));
/// assert_eq!(answer_serve_until(t(5_000), t(0), skew, Duration::from_secs(10)), None);
/// ```
pub fn answer_serve_until(
    expires_at: Timestamp,
    read_at: Timestamp,
    clock_skew: Duration,
    max_staleness: Duration,
) -> Option<Timestamp> {
    let serve_until = expires_at
        .saturating_sub(clock_skew)
        .min(read_at.saturating_add(max_staleness));
    (serve_until > read_at).then_some(serve_until)
}

/// The answer a cached completed record gives a duplicate at `now`, or
/// `None` once `serve_until` has passed: `PayloadMismatch` for a conflicting
/// fingerprint, else the cached result or `Duplicate`.
pub fn cached_answer(
    stored: Option<&Fingerprint>,
    result: Option<&[u8]>,
    serve_until: Timestamp,
    fingerprint: Option<&Fingerprint>,
    now: Timestamp,
) -> Option<DuplicateDecision> {
    if now >= serve_until {
        return None;
    }
    Some(if fingerprints_conflict(stored, fingerprint) {
        DuplicateDecision::PayloadMismatch
    } else {
        match result {
            Some(bytes) => DuplicateDecision::Replay(bytes.to_vec()),
            None => DuplicateDecision::Duplicate,
        }
    })
}
