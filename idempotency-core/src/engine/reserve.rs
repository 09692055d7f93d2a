//! Stage 1: reserve the key and decide what a duplicate gets.
//!
//! A `reserve` that fails ambiguously (a timeout or a reset: it may have been
//! applied) is retried with the **same owner token**: the contract answers a
//! re-sent reserve with `Acquired`, so a lost reply never turns into
//! `InProgress` against ourselves. What is left behind when every attempt fails
//! is cleaned up by the execution guard (see [`super::guard`]).
//!
//! A `reserve` answered [`Error::InProgress`] (a store that waited for another
//! transaction's lock on the key, until its bound) is a live holder the store
//! could not show: decided as a `Processing` record is, never retried as an
//! outage and never run unprotected.

use tokio::time::Instant;

use crate::config::InProgressPolicy;
use crate::decision::{decide_duplicate, DuplicateDecision};
use crate::error::Error;
use crate::key::Fingerprint;
use crate::metrics::Op;
use crate::repository::Reservation;
use crate::time::Timestamp;

use super::lease::Lease;
use super::{backoff, reserve_request, Engine};

/// How many times a reserve that failed ambiguously is sent again.
pub const RESERVE_RETRIES: u32 = 2;

/// The answer of the reservation stage.
#[derive(Debug)]
pub(crate) enum Reserved {
    /// This execution holds the key.
    Acquired {
        /// The attempt number (the fencing token).
        attempt: u32,
        /// The lease as requested by the earliest attempt that may have been
        /// applied (the earliest the lease can end, whichever attempt was).
        lease_until: Timestamp,
        /// The clock when that attempt was sent.
        sent_at: Timestamp,
        /// The same instant on Tokio's clock.
        sent: Instant,
    },
    /// A live record answers this delivery.
    Duplicate {
        /// What the delivery gets.
        decision: DuplicateDecision,
        /// An attempt of ours failed ambiguously on the way: it may still have
        /// created a record under our token, which must be released.
        unsettled: bool,
    },
}

/// A reserve attempt sent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sent {
    lease_until: Timestamp,
    sent_at: Timestamp,
    sent: Instant,
}

impl Engine {
    /// Reserves `lease.key` for `lease.owner`, waiting for a live holder as the
    /// in-progress policy says. Every attempt sent is noted in the lease (how
    /// long a record it may have created can hold the key).
    ///
    /// # Errors
    /// The store's error once the retries are spent — unless a live holder was
    /// already seen: then a store outage while waiting answers with that
    /// holder's `InProgress`, never with an error a fail-open policy would run
    /// the handler on beside the holder.
    pub(crate) async fn reserve(
        &self,
        lease: &Lease,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Reserved, Error> {
        self.reserve_after(lease, fingerprint, Earlier::default())
            .await
    }

    /// [`Engine::reserve`] after an earlier attempt for the same owner (a
    /// batch's), whose outcome `earlier` describes.
    pub(crate) async fn reserve_after(
        &self,
        lease: &Lease,
        fingerprint: Option<Fingerprint>,
        earlier: Earlier,
    ) -> Result<Reserved, Error> {
        // The wait counts from the first attempt, the batch's included.
        let waiting_since = earlier.sent.unwrap_or_else(Instant::now);
        let wait_until = match self.config.in_progress {
            InProgressPolicy::Wait { timeout, .. } => Some(waiting_since + timeout),
            InProgressPolicy::FailFast => None,
        };
        // The earliest attempt that failed ambiguously, over the whole wait:
        // it may land later and be the one that creates our record.
        let mut unsettled = earlier.unsettled;
        if unsettled.is_some() {
            lease.note_unsettled();
        }
        // An earlier attempt counts against the retries.
        let mut retries_spent = u32::from(unsettled.is_some());
        let mut seen_in_progress = earlier.in_progress;
        if earlier.refused {
            lease.note_refused();
        }
        // The earlier attempt was this owner's first: the pause that follows
        // a failed send, or the wait policy's poll, comes before the next.
        if let (Some(decision), InProgressPolicy::Wait { poll_interval, .. }, Some(until)) =
            (&seen_in_progress, self.config.in_progress, wait_until)
        {
            let remaining = until.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                // The wait ended during the batch's call: answered as a
                // single reservation would be at the end of its wait.
                return Ok(Reserved::Duplicate {
                    decision: decision.clone(),
                    unsettled: unsettled.is_some(),
                });
            }
            super::pause(poll_interval.min(remaining)).await;
        } else if unsettled.is_some() {
            super::pause(backoff(0)).await;
        }
        loop {
            let attempt =
                self.reserve_with_retries(lease, fingerprint, &mut unsettled, retries_spent);
            retries_spent = 0;
            let decision = match attempt.await {
                Ok((Reservation::Acquired { attempt }, sent)) => {
                    let first = unsettled.unwrap_or(sent);
                    return Ok(Reserved::Acquired {
                        attempt,
                        lease_until: first.lease_until,
                        sent_at: first.sent_at,
                        sent: first.sent,
                    });
                }
                Ok((Reservation::Existing(record), sent)) => {
                    self.remember_record(&lease.key, &record, sent.sent_at);
                    decide_duplicate(
                        record,
                        fingerprint.as_ref(),
                        self.now(),
                        self.config.clock_skew,
                    )
                }
                Err(e) => match held_elsewhere(&e) {
                    Some(decision) => decision,
                    None if e.is_store_outage() => match seen_in_progress {
                        Some(decision) => {
                            tracing::debug!(error = %e, "store failed while waiting for a live holder; answering in progress");
                            return Ok(Reserved::Duplicate {
                                decision,
                                unsettled: true,
                            });
                        }
                        None => return Err(e),
                    },
                    None => return Err(e),
                },
            };
            if let (DuplicateDecision::InProgress { .. }, Some(until)) = (&decision, wait_until) {
                if let InProgressPolicy::Wait { poll_interval, .. } = self.config.in_progress {
                    let remaining = until.saturating_duration_since(Instant::now());
                    if !remaining.is_zero() {
                        seen_in_progress = Some(decision);
                        super::pause(poll_interval.min(remaining)).await;
                        continue;
                    }
                }
            }
            return Ok(Reserved::Duplicate {
                decision,
                unsettled: unsettled.is_some(),
            });
        }
    }

    /// One reservation, sent again with the same owner after an ambiguous
    /// failure. Returns the answer and the attempt that got it; attempts that
    /// failed ambiguously are kept in `unsettled` (the earliest).
    async fn reserve_with_retries(
        &self,
        lease: &Lease,
        fingerprint: Option<Fingerprint>,
        unsettled: &mut Option<Sent>,
        retries_spent: u32,
    ) -> Result<(Reservation, Sent), Error> {
        let mut retry = retries_spent;
        loop {
            let now = self.now();
            let request = reserve_request(&self.config, &lease.key, lease.owner, fingerprint, now);
            let sent = Sent {
                lease_until: request.lease_until,
                sent_at: now,
                sent: Instant::now(),
            };
            lease.note_sent(sent.lease_until, sent.sent_at, sent.sent);
            // The answer is not kept across the pause below: it would make
            // every execution's future larger by a record.
            let call = self.repo.reserve(request);
            let limit = self.config.store_timeout;
            let e = match self
                .call_sent_at(Op::Reserve, limit, sent.sent.into_std(), call)
                .await
            {
                Ok(reservation) => {
                    lease.note_answered();
                    return Ok((reservation, sent));
                }
                Err(e) => e,
            };
            if held_elsewhere(&e).is_some() {
                // Answered: nothing of this attempt is on its way. But while
                // an earlier attempt of ours may be (its reply lost), the
                // holder may be that attempt, its transaction not yet
                // committed: asked again with the same owner, the store
                // answers `Acquired` once it has. Never `InProgress`
                // against ourselves while a retry is left.
                lease.note_answered();
                if unsettled.is_none() || retry >= RESERVE_RETRIES {
                    return Err(e);
                }
            } else if !e.is_store_outage() {
                return Err(e);
            } else {
                unsettled.get_or_insert(sent);
                lease.note_unsettled();
                if retry >= RESERVE_RETRIES {
                    return Err(e);
                }
            }
            tracing::debug!(error = %e, retry, "reserve failed ambiguously; sending it again with the same owner token");
            drop(e);
            super::pause(backoff(retry)).await;
            retry += 1;
        }
    }
}

/// A reservation the store answered [`Error::InProgress`]: the key is held by
/// a holder it could not show — a PostgreSQL transaction not yet committed,
/// whose row the reservation waited for until its lock bound — and nothing
/// was applied. The store is reachable and the key live: what a live
/// `Processing` record gets (the wait policy polls again), never an outage,
/// so never a fail-open run beside the holder.
fn held_elsewhere(e: &Error) -> Option<DuplicateDecision> {
    match e {
        Error::InProgress { retry_after, .. } => Some(DuplicateDecision::InProgress {
            retry_after: *retry_after,
        }),
        _ => None,
    }
}

/// What an earlier attempt for the same owner (a batch's) left for
/// [`Engine::reserve_after`].
#[derive(Debug, Default)]
pub(crate) struct Earlier {
    /// It failed ambiguously: it may still land, the lease counts from it,
    /// and it counts against the retries.
    pub(crate) unsettled: Option<Sent>,
    /// It found a live holder (under the wait policy): a store outage while
    /// waiting answers with this, never with an error.
    pub(crate) in_progress: Option<DuplicateDecision>,
    /// The store answered it with an error that is not an outage (a record
    /// that does not decode, a refused statement): should the single attempts
    /// then meet an outage, the key is never run unprotected (fail-open) on
    /// it (see [`Lease::note_refused`]).
    pub(crate) refused: bool,
    /// When it was sent: the wait policy's timeout counts from then.
    pub(crate) sent: Option<Instant>,
}

/// One request's answer from [`Engine::reserve_batch`].
#[derive(Debug)]
pub(crate) enum BatchReserved {
    /// Decided.
    Done(Result<Reserved, Error>),
    /// To be finished on the single path ([`Engine::reserve_after`]).
    Again(Earlier),
}

impl BatchReserved {
    fn unsettled(sent: Sent) -> Self {
        BatchReserved::Again(Earlier {
            unsettled: Some(sent),
            sent: Some(sent.sent),
            ..Earlier::default()
        })
    }

    /// Refused (maybe for the batch's sake rather than the key's own), and
    /// possibly applied all the same.
    fn refused(sent: Sent) -> Self {
        BatchReserved::Again(Earlier {
            unsettled: Some(sent),
            refused: true,
            sent: Some(sent.sent),
            ..Earlier::default()
        })
    }
}

impl Engine {
    /// Reserves every lease's key in one [`Repository::reserve_many`] call,
    /// time-boxed like one `reserve`; one answer per lease, in order.
    ///
    /// [`Repository::reserve_many`]: crate::Repository::reserve_many
    pub(crate) async fn reserve_batch(
        &self,
        items: &[(std::sync::Arc<Lease>, Option<Fingerprint>)],
    ) -> Vec<BatchReserved> {
        let now = self.now();
        let sent = Sent {
            lease_until: now + self.config.processing_timeout,
            sent_at: now,
            sent: Instant::now(),
        };
        let requests = items
            .iter()
            .map(|(lease, fingerprint)| {
                lease.note_sent(sent.lease_until, sent.sent_at, sent.sent);
                reserve_request(&self.config, &lease.key, lease.owner, *fingerprint, now)
            })
            .collect();
        let call = self.repo.reserve_many(requests);
        let answers = self
            .call_sent_at(
                Op::Reserve,
                self.config.store_timeout,
                sent.sent.into_std(),
                async { Ok(call.await) },
            )
            .await;
        match answers {
            Ok(answers) if answers.len() == items.len() => answers
                .into_iter()
                .zip(items)
                .map(|(answer, (lease, fingerprint))| {
                    if matches!(answer, Ok(_) | Err(Error::InProgress { .. })) {
                        lease.note_answered();
                    }
                    self.batch_answer(answer, lease, fingerprint.as_ref(), sent)
                })
                .collect(),
            Ok(answers) => {
                tracing::error!(
                    backend = self.caps.backend,
                    requests = items.len(),
                    answers = answers.len(),
                    "reserve_many answered with the wrong number of answers; reserving one key at a time"
                );
                items.iter().map(|_| BatchReserved::refused(sent)).collect()
            }
            Err(_timeout) => items
                .iter()
                .map(|_| BatchReserved::unsettled(sent))
                .collect(),
        }
    }

    fn batch_answer(
        &self,
        answer: Result<Reservation, Error>,
        lease: &Lease,
        fingerprint: Option<&Fingerprint>,
        sent: Sent,
    ) -> BatchReserved {
        let decision = match answer {
            Ok(Reservation::Acquired { attempt }) => {
                return BatchReserved::Done(Ok(Reserved::Acquired {
                    attempt,
                    lease_until: sent.lease_until,
                    sent_at: sent.sent_at,
                    sent: sent.sent,
                }))
            }
            Ok(Reservation::Existing(record)) => {
                self.remember_record(&lease.key, &record, sent.sent_at);
                decide_duplicate(record, fingerprint, self.now(), self.config.clock_skew)
            }
            Err(e) => match held_elsewhere(&e) {
                Some(decision) => decision,
                None if e.is_store_outage() => return BatchReserved::unsettled(sent),
                None => {
                    // Maybe the batch's error rather than this key's (a
                    // statement refused as a whole): the single path gives
                    // the key's own. Counted as possibly applied (a reply
                    // that failed to decode after the write): the lease from
                    // the batch's send, and what it may have created released
                    // should the key end in error.
                    tracing::debug!(error = %e, "a batch's reservation failed; reserving on its own");
                    return BatchReserved::refused(sent);
                }
            },
        };
        let waits = matches!(self.config.in_progress, InProgressPolicy::Wait { .. });
        if waits && matches!(decision, DuplicateDecision::InProgress { .. }) {
            return BatchReserved::Again(Earlier {
                in_progress: Some(decision),
                sent: Some(sent.sent),
                ..Earlier::default()
            });
        }
        BatchReserved::Done(Ok(Reserved::Duplicate {
            decision,
            unsettled: false,
        }))
    }
}
