//! What a broker does with a message once the manager answered it: the one
//! policy every consumer of this crate follows.
//!
//! | Answer | Disposition | Why |
//! |---|---|---|
//! | `Executed`, `Cached`, `Duplicate` | [`Ack`](Disposition::Ack) | the outcome is recorded (or was, by the first delivery) |
//! | `Unrecorded`, `Unprotected`, `LeaseLost` | [`Ack`](Disposition::Ack) | the handler ran; a redelivery would run it again (the contract says to acknowledge; each is counted) |
//! | `Error::InProgress` | [`Retry`](Disposition::Retry) after its `retry_after`, at least [`MIN_RETRY_AFTER`] | another consumer holds the key; its outcome is not known yet |
//! | a store outage (`Unavailable`, `Timeout`), `Config`, `Unsupported`, `Backend` | [`Retry`](Disposition::Retry) after the [`Backoff`] | the message is fine, the store or deployment is not: never drop it |
//! | the handler's transient failure (the key released, or stored for a retry) | [`Retry`](Disposition::Retry) after the [`Backoff`] | a redelivery runs the handler again |
//! | the handler's permanent failure (stored `Failed`), `PreviouslyFailed` | [`Reject`](Disposition::Reject) | every redelivery gets the same stored failure |
//! | `PayloadMismatch`, `InvalidKey`, `TooLarge`, `Codec`, `Corrupt` | [`Reject`](Disposition::Reject) | this message can never be answered by redelivering it |
//!
//! A rejected message goes to the broker's dead-letter route: the SQS
//! consumer's dead-letter queue (or, without one, back to the queue after
//! the backoff, for its redrive policy to move), a RabbitMQ dead-letter
//! exchange, the Kafka consumer's dead-letter topic or `on_reject` hook. The
//! one place a broker itself may drop it is a RabbitMQ queue without a
//! dead-letter exchange, which the RabbitMQ consumer warns about when it
//! starts.

use std::time::Duration;

use idempotency_core::{Error, ExecuteError, FailureKind, FailurePolicy, Outcome};

/// The least delay before a message whose key another consumer holds is
/// delivered again. The manager's `retry_after` estimates when the holder
/// finishes, from recent executions, and may be a few milliseconds; a broker
/// consumer that re-read its message (a Kafka partition's whole tail, an SQS
/// receive) that often would spin against the store for as long as the
/// holder runs.
pub const MIN_RETRY_AFTER: Duration = Duration::from_millis(250);

/// What the consumer does with one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Answered: acknowledge it (commit the offset, delete it, ack it).
    Ack(Answer),
    /// Not answered yet: have the broker deliver it again, no sooner than
    /// `after` (never in a hot loop).
    Retry {
        /// The earliest time the message is worth delivering again.
        after: Duration,
        /// Why, as a metrics label.
        reason: &'static str,
    },
    /// Never answered by redelivering it: dead-letter it.
    Reject {
        /// Why, as a metrics label.
        reason: &'static str,
    },
}

/// How an acknowledged message was answered (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The handler ran and its outcome is recorded.
    Executed,
    /// A duplicate, answered from the record.
    Duplicate,
    /// The handler ran; the outcome could not be recorded in time.
    Unrecorded,
    /// The handler ran without protection (fail-open during a store outage).
    Unprotected,
    /// The handler ran, but another attempt took the key over meanwhile.
    LeaseLost,
}

impl Answer {
    /// The label used in metrics and spans.
    pub fn as_str(self) -> &'static str {
        match self {
            Answer::Executed => "executed",
            Answer::Duplicate => "duplicate",
            Answer::Unrecorded => "unrecorded",
            Answer::Unprotected => "unprotected",
            Answer::LeaseLost => "lease_lost",
        }
    }
}

impl Disposition {
    /// The label used in metrics and spans: `ack`'s answer, or the reason.
    pub fn label(&self) -> &'static str {
        match self {
            Disposition::Ack(answer) => answer.as_str(),
            Disposition::Retry { reason, .. } | Disposition::Reject { reason } => reason,
        }
    }

    /// Whether the message is answered (to acknowledge, commit, delete).
    pub fn is_ack(&self) -> bool {
        matches!(self, Disposition::Ack(_))
    }

    /// Whether the message is to be delivered again.
    pub fn is_retry(&self) -> bool {
        matches!(self, Disposition::Retry { .. })
    }
}

/// Exponential backoff for messages redelivered because of a failure (not
/// for `InProgress`, which carries its own `retry_after`).
///
/// ```
/// use std::time::Duration;
/// use idempotency_consumers::Backoff;
/// let backoff = Backoff::default();
/// assert_eq!(backoff.delay(1), Duration::from_secs(1));
/// assert_eq!(backoff.delay(2), Duration::from_secs(2));
/// assert_eq!(backoff.delay(40), Duration::from_secs(300));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failed delivery.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// The delay before delivery `attempt + 1` after `attempt` deliveries
    /// (1-based) failed: `initial × 2^(attempt − 1)`, at most `max`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.initial
            .checked_mul(1u32 << doublings)
            .map_or(self.max, |d| d.min(self.max))
    }
}

/// How the handler's own failures are classified for this delivery: the
/// [`FailureKind`] it returned resolved against the manager's
/// [`FailurePolicy`] (see [`classify`]).
pub fn failure_redelivers(kind: FailureKind, policy: FailurePolicy) -> bool {
    match kind {
        FailureKind::Transient => true,
        FailureKind::Permanent => false,
        FailureKind::Default => !matches!(policy, FailurePolicy::Store),
    }
}

/// The disposition of one answer of [`IdempotencyManager::execute`] or
/// [`execute_batch`](idempotency_core::IdempotencyManager::execute_batch).
///
/// `handler_redelivers` tells, for a handler failure, whether the manager
/// left the key for a redelivery ([`failure_redelivers`] of the kind the
/// handler returned); `attempt` is the message's delivery count (1 for the
/// first delivery), for the [`Backoff`].
///
/// ```
/// use std::time::Duration;
/// use idempotency_consumers::{classify, Answer, Backoff, Disposition, MIN_RETRY_AFTER};
/// use idempotency_core::{Error, ExecuteError, Outcome, RecordKey};
///
/// let backoff = Backoff::default();
/// let done: Result<Outcome<u32>, ExecuteError<String>> = Ok(Outcome::Cached(7));
/// assert_eq!(classify(&done, false, 1, &backoff), Disposition::Ack(Answer::Duplicate));
///
/// let busy: Result<Outcome<u32>, ExecuteError<String>> = Err(ExecuteError::Idempotency(
///     Error::InProgress { key: RecordKey::new("orders", "k-1", 256)?, retry_after: Duration::from_millis(750) },
/// ));
/// assert_eq!(
///     classify(&busy, false, 3, &backoff),
///     Disposition::Retry { after: Duration::from_millis(750), reason: "in_progress" },
/// );
///
/// // A holder expected to finish in 3 ms is asked again no sooner than the floor.
/// let soon: Result<Outcome<u32>, ExecuteError<String>> = Err(ExecuteError::Idempotency(
///     Error::InProgress { key: RecordKey::new("orders", "k-1", 256)?, retry_after: Duration::from_millis(3) },
/// ));
/// assert!(matches!(classify(&soon, false, 1, &backoff), Disposition::Retry { after, .. } if after == MIN_RETRY_AFTER));
///
/// let bug: Result<Outcome<u32>, ExecuteError<String>> = Err(ExecuteError::Handler("no such account".into()));
/// assert_eq!(classify(&bug, false, 1, &backoff), Disposition::Reject { reason: "handler_failed" });
/// assert!(classify(&bug, true, 2, &backoff).is_retry());
/// # Ok::<(), idempotency_core::Error>(())
/// ```
///
/// [`IdempotencyManager::execute`]: idempotency_core::IdempotencyManager::execute
pub fn classify<T, E>(
    answer: &Result<Outcome<T>, ExecuteError<E>>,
    handler_redelivers: bool,
    attempt: u32,
    backoff: &Backoff,
) -> Disposition {
    let retry = |reason| Disposition::Retry {
        after: backoff.delay(attempt.max(1)),
        reason,
    };
    match answer {
        Ok(outcome) => Disposition::Ack(answered(outcome)),
        Err(ExecuteError::Handler(_)) if handler_redelivers => retry("handler_retry"),
        Err(ExecuteError::Handler(_)) => Disposition::Reject {
            reason: "handler_failed",
        },
        Err(ExecuteError::Idempotency(error)) => match error {
            Error::InProgress { retry_after, .. } => Disposition::Retry {
                after: (*retry_after).max(MIN_RETRY_AFTER),
                reason: "in_progress",
            },
            Error::Unavailable { .. } | Error::Timeout { .. } => retry("store_unavailable"),
            Error::LeaseLost { .. } => retry("lease_lost"),
            Error::Config { .. } | Error::Unsupported { .. } | Error::Backend { .. } => {
                retry("store_error")
            }
            Error::PreviouslyFailed { .. } => Disposition::Reject {
                reason: "previously_failed",
            },
            Error::PayloadMismatch { .. } => Disposition::Reject {
                reason: "payload_mismatch",
            },
            Error::InvalidKey { .. } => Disposition::Reject {
                reason: "invalid_key",
            },
            Error::TooLarge { .. } => Disposition::Reject {
                reason: "too_large",
            },
            Error::Codec { .. } => Disposition::Reject { reason: "codec" },
            Error::Corrupt { .. } => Disposition::Reject { reason: "corrupt" },
            // A variant added later: keep the message rather than lose it.
            _ => retry("store_error"),
        },
    }
}

fn answered<T>(outcome: &Outcome<T>) -> Answer {
    match outcome {
        Outcome::Executed(_) => Answer::Executed,
        Outcome::Cached(_) | Outcome::Duplicate => Answer::Duplicate,
        Outcome::Unrecorded { .. } => Answer::Unrecorded,
        Outcome::Unprotected(_) => Answer::Unprotected,
        Outcome::LeaseLost(_) => Answer::LeaseLost,
        // A variant added later ran the handler or answered from the record.
        _ => Answer::Executed,
    }
}
