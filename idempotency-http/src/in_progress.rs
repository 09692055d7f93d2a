//! When a duplicate of a request still in flight should come back: the time
//! the running request has left, as well as it can be told.
//!
//! The manager's `InProgress { retry_after }` is about one *typical*
//! execution (a running average of this manager's executions), never past
//! the holder's lease: right for a broker that redelivers, but for a request
//! that runs longer than the typical one it is far too short (a 2 ms average
//! against a 1.5 s call), and a gRPC client, whose retry policy allows a few
//! attempts and lets `grpc-retry-pushback-ms` override its backoff, spends
//! them all before the call ends. So the layer reads the holder's record once
//! and estimates what is left of it:
//!
//! - the typical execution minus how long the holder has run, while it has
//!   run less than that;
//! - otherwise (it runs longer than usual, or no execution has finished yet
//!   to tell what is typical) the longest hint,
//!   [`in_progress_retry_after`](crate::IdempotencyLayer::in_progress_retry_after);
//! - never past the holder's lease (a retry then may take over a crashed
//!   holder), never beyond the longest hint, never below
//!   [`MIN_IN_PROGRESS_RETRY`] (retrying sooner only spends attempts);
//! - a record no longer in progress (completed) is worth retrying at once:
//!   the floor; a record that cannot be read or is not there (released, or
//!   held by a transaction not yet committed), the manager's hint within
//!   those bounds.

use std::time::Duration;

use idempotency_core::{Record, Repository, Status, Timestamp};

use crate::layer::Settings;

/// The shortest retry hint of an in-progress answer: 100 ms (the usual
/// initial backoff of gRPC retry policies), or the longest hint if that is
/// shorter.
pub const MIN_IN_PROGRESS_RETRY: Duration = Duration::from_millis(100);

/// What the holder's record tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// Still running: for how long, and how much of its lease is left.
    Running {
        elapsed: Duration,
        lease_left: Duration,
    },
    /// No longer in progress: completed or failed.
    Done,
    /// The record could not be read, or is not there.
    Unknown,
}

impl Holder {
    /// Reads the holder of `id` from the manager's store, within the
    /// manager's `store_timeout` (a store that does not answer leaves the
    /// hint to the manager, never the answer waiting).
    async fn of(settings: &Settings, id: &str) -> Holder {
        let manager = &settings.manager;
        let Ok(key) = manager.record_key(id) else {
            return Holder::Unknown;
        };
        let now = manager.now();
        let read = manager.repository().get(&key, now);
        let Ok(read) = tokio::time::timeout(manager.config().store_timeout, read).await else {
            tracing::debug!("reading an in-progress record for its retry hint timed out");
            return Holder::Unknown;
        };
        match read {
            Ok(Some(record)) if record.status == Status::Processing => {
                Holder::running(&record, now, manager.config().clock_skew)
            }
            Ok(Some(_)) => Holder::Done,
            // Released for a retry, or held by a transaction not yet
            // committed (PostgreSQL), which the manager's hint accounts for.
            Ok(None) => Holder::Unknown,
            Err(e) => {
                tracing::debug!(error = %e, "reading an in-progress record for its retry hint failed");
                Holder::Unknown
            }
        }
    }

    /// A `Processing` record at `now`: it started when it was created (first
    /// attempt) or last taken over (a later attempt, whose record's last
    /// change is at the latest its last lease extension, so the time run is
    /// then at least the estimate); its lease ends as the manager's takeover
    /// rule says (`lease_until` plus the skew allowance).
    fn running(record: &Record, now: Timestamp, clock_skew: Duration) -> Holder {
        let started = if record.attempt <= 1 {
            record.created_at
        } else {
            record.updated_at
        };
        Holder::Running {
            elapsed: now.duration_since(started),
            lease_left: record
                .lease_until
                .saturating_add(clock_skew)
                .duration_since(now),
        }
    }
}

/// The retry hint of an in-progress answer (see the module docs), from the
/// manager's `retry_after` and the holder's record.
pub(crate) async fn retry_hint(settings: &Settings, id: &str, manager_hint: Duration) -> Duration {
    let holder = Holder::of(settings, id).await;
    time_left(manager_hint, holder, settings.in_progress_retry_after)
}

/// The estimate, bounded by `longest` and the floor.
pub(crate) fn time_left(manager_hint: Duration, holder: Holder, longest: Duration) -> Duration {
    let floor = MIN_IN_PROGRESS_RETRY.min(longest);
    let estimate = match holder {
        Holder::Done => floor,
        Holder::Unknown => manager_hint,
        Holder::Running {
            elapsed,
            lease_left,
        } => {
            // The manager's hint is the lesser of a typical execution and the
            // lease left: below the lease left, it is the typical execution.
            let typical = (manager_hint < lease_left).then_some(manager_hint);
            let left = match typical {
                Some(typical) if elapsed < typical => typical - elapsed,
                _ => longest,
            };
            left.min(lease_left)
        }
    };
    estimate.min(longest).max(floor)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const LONGEST: Duration = Duration::from_secs(1);

    fn running(elapsed_ms: u32, lease_left_ms: u32) -> Holder {
        Holder::Running {
            elapsed: MS * elapsed_ms,
            lease_left: MS * lease_left_ms,
        }
    }

    #[test]
    fn a_typical_execution_minus_the_time_run() {
        // Typical 800 ms, 300 ms run: 500 ms left.
        assert_eq!(time_left(MS * 800, running(300, 29_700), LONGEST), MS * 500);
        // Almost done: the floor, not a 1 ms hint.
        assert_eq!(time_left(MS * 800, running(799, 29_201), LONGEST), MS * 100);
        // Typical beyond the longest hint: the longest.
        assert_eq!(time_left(MS * 5000, running(100, 29_900), LONGEST), LONGEST);
    }

    #[test]
    fn longer_than_typical_or_unknown_is_the_longest_hint() {
        // The reported case: a 2 ms average, a call running for 50 ms of 1.5 s.
        assert_eq!(time_left(MS * 2, running(50, 29_950), LONGEST), LONGEST);
        // No execution finished yet: the manager's hint is the lease left.
        assert_eq!(time_left(MS * 30_000, running(0, 30_000), LONGEST), LONGEST);
        let longest = Duration::from_secs(5);
        assert_eq!(time_left(MS * 2, running(50, 29_950), longest), longest);
    }

    #[test]
    fn never_past_the_lease_nor_below_the_floor() {
        assert_eq!(time_left(MS * 2, running(50, 400), LONGEST), MS * 400);
        assert_eq!(time_left(MS * 2, running(50, 10), LONGEST), MS * 100);
        // A longest hint under the floor wins.
        assert_eq!(time_left(MS * 2, running(50, 400), MS * 20), MS * 20);
    }

    #[test]
    fn done_or_unreadable_records() {
        assert_eq!(time_left(MS * 700, Holder::Done, LONGEST), MS * 100);
        assert_eq!(time_left(MS * 700, Holder::Unknown, LONGEST), MS * 700);
        assert_eq!(time_left(MS * 2, Holder::Unknown, LONGEST), MS * 100);
        assert_eq!(time_left(MS * 9000, Holder::Unknown, LONGEST), LONGEST);
    }

    #[test]
    fn the_holder_is_read_from_its_record() {
        let now = Timestamp::from_millis(100_000);
        let mut record = Record {
            status: Status::Processing,
            owner: idempotency_core::OwnerToken::random(),
            attempt: 1,
            fingerprint: None,
            result: None,
            error: None,
            retryable: false,
            lease_until: Timestamp::from_millis(125_000),
            expires_at: Timestamp::from_millis(3_700_000),
            created_at: Timestamp::from_millis(95_000),
            updated_at: Timestamp::from_millis(99_000),
        };
        assert_eq!(
            Holder::running(&record, now, MS * 500),
            Holder::Running {
                elapsed: MS * 5000,
                lease_left: MS * 25_500
            }
        );
        record.attempt = 2;
        assert_eq!(
            Holder::running(&record, now, Duration::ZERO),
            Holder::Running {
                elapsed: MS * 1000,
                lease_left: MS * 25_000
            }
        );
    }
}
