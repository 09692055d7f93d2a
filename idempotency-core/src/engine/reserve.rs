//! Stage 1: reserve the key and decide what a duplicate gets.
//!
//! A `reserve` that fails ambiguously (a timeout or a reset: it may have been
//! applied) is retried with the **same owner token**: the contract answers a
//! re-sent reserve with `Acquired`, so a lost reply never turns into
//! `InProgress` against ourselves. What is left behind when every attempt fails
//! is cleaned up by the execution guard (see [`super::guard`]).

use tokio::time::Instant;

use crate::config::InProgressPolicy;
use crate::decision::{decide_duplicate, DuplicateDecision};
use crate::error::Error;
use crate::key::{Fingerprint, OwnerToken, RecordKey};
use crate::metrics::Op;
use crate::repository::Reservation;
use crate::time::Timestamp;

use super::{backoff, reserve_request, Engine};

/// How many times a reserve that failed ambiguously is sent again.
pub(crate) const RESERVE_RETRIES: u32 = 2;

/// The answer of the reservation stage.
#[derive(Debug)]
pub(crate) enum Reserved {
    /// This execution holds the key.
    Acquired {
        /// The attempt number (the fencing token).
        attempt: u32,
        /// The lease as requested by the first attempt sent (the earliest it
        /// can end, whichever attempt was applied).
        lease_until: Timestamp,
        /// The clock when that attempt was sent.
        sent_at: Timestamp,
        /// The same instant on Tokio's clock.
        sent: Instant,
    },
    /// A live record answers this delivery.
    Duplicate(DuplicateDecision),
}

/// The first reserve attempt of an execution.
#[derive(Debug, Clone, Copy)]
struct FirstSent {
    lease_until: Timestamp,
    sent_at: Timestamp,
    sent: Instant,
}

impl Engine {
    /// Reserves `key` for `owner`, waiting for a live holder as the in-progress
    /// policy says.
    ///
    /// # Errors
    /// The store's error once the retries are spent.
    pub(crate) async fn reserve(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Reserved, Error> {
        let wait_until = match self.config.in_progress {
            InProgressPolicy::Wait { timeout, .. } => Some(tokio::time::Instant::now() + timeout),
            InProgressPolicy::FailFast => None,
        };
        loop {
            let (reservation, first) = self.reserve_with_retries(key, owner, fingerprint).await?;
            let record = match reservation {
                Reservation::Acquired { attempt } => {
                    return Ok(Reserved::Acquired {
                        attempt,
                        lease_until: first.lease_until,
                        sent_at: first.sent_at,
                        sent: first.sent,
                    })
                }
                Reservation::Existing(record) => record,
            };
            let decision = decide_duplicate(
                record,
                fingerprint.as_ref(),
                self.now(),
                self.config.clock_skew,
            );
            if let (DuplicateDecision::InProgress { .. }, Some(until)) = (&decision, wait_until) {
                if let InProgressPolicy::Wait { poll_interval, .. } = self.config.in_progress {
                    let remaining = until.saturating_duration_since(tokio::time::Instant::now());
                    if !remaining.is_zero() {
                        tokio::time::sleep(poll_interval.min(remaining)).await;
                        continue;
                    }
                }
            }
            return Ok(Reserved::Duplicate(decision));
        }
    }

    /// One reservation, sent again with the same owner after an ambiguous
    /// failure. Returns the answer and the first attempt sent (whichever attempt
    /// was applied, the lease cannot end before the first one's).
    async fn reserve_with_retries(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        fingerprint: Option<Fingerprint>,
    ) -> Result<(Reservation, FirstSent), Error> {
        let mut first = None;
        let mut retry = 0;
        loop {
            let now = self.now();
            let request = reserve_request(&self.config, key, owner, fingerprint, now);
            let sent = *first.get_or_insert(FirstSent {
                lease_until: request.lease_until,
                sent_at: now,
                sent: Instant::now(),
            });
            match self.store(Op::Reserve, self.repo.reserve(request)).await {
                Ok(reservation) => return Ok((reservation, sent)),
                Err(e) if e.is_store_outage() && retry < RESERVE_RETRIES => {
                    tracing::debug!(error = %e, retry, "reserve failed ambiguously; sending it again with the same owner token");
                    tokio::time::sleep(backoff(retry)).await;
                    retry += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
