//! Stage 3: record the outcome.
//!
//! A finishing write (`complete`, `fail`, `release`) that fails ambiguously is
//! retried with the same owner token until shortly before the lease ends: a
//! store failover of a few seconds must not turn a success into `Unrecorded`.
//! Every `LeaseLost` is checked against "finished by us": a client library that
//! re-sent our write after a lost reply (the Redis cluster client, the AWS SDK)
//! makes our own applied write look like somebody else's.

use tokio::time::Instant;

use crate::codec::Codec;
use crate::decision::{finish_margin, finished_by, FinishWrite};
use crate::error::Error;
use crate::metrics::Op;

use super::completions::Participant;
use super::guard::{ExecutionGuard, Phase};
use super::lease::Lease;
use super::{backoff, Engine};

/// A write that finishes an execution.
#[derive(Debug)]
pub(crate) enum Pending {
    /// `Processing → Completed`, with the cached result if any.
    Complete(Option<Vec<u8>>),
    /// `Processing → Failed` with the stored error.
    Fail {
        /// The stored error.
        error: Vec<u8>,
        /// Whether a later delivery may take it over.
        retryable: bool,
    },
    /// Delete the record so a redelivery runs again.
    Release,
}

impl Pending {
    fn op(&self) -> Op {
        match self {
            Pending::Complete(_) => Op::Complete,
            Pending::Fail { .. } => Op::Fail,
            Pending::Release => Op::Release,
        }
    }
}

/// The error stored instead of a handler's error the store refused as too large.
const ERROR_TOO_LARGE: &[u8] = b"the handler's error was too large to store";

impl Pending {
    /// The write to send instead when the store refused this one as too
    /// large: a completion without its cached result, a failure with a short
    /// placeholder message; none for a write that carries no value.
    fn smaller(&self) -> Option<Pending> {
        match self {
            Pending::Complete(Some(_)) => Some(Pending::Complete(None)),
            Pending::Fail { error, retryable } if error.as_slice() != ERROR_TOO_LARGE => {
                Some(Pending::Fail {
                    error: ERROR_TOO_LARGE.to_vec(),
                    retryable: *retryable,
                })
            }
            _ => None,
        }
    }
}

/// How a finishing write ended.
#[derive(Debug)]
pub(crate) enum Finished {
    /// Applied (perhaps by an earlier attempt whose reply was lost).
    Applied,
    /// Another owner holds the key: the write was not applied.
    LeaseLost,
    /// The store kept failing until the deadline, or failed permanently.
    Failed(Error),
}

impl Engine {
    /// The result bytes to cache for `value` (see
    /// [`cacheable_result`](crate::stages::cacheable_result)).
    pub(crate) fn result_bytes<T: serde::Serialize, C: Codec>(
        &self,
        codec: &C,
        value: &T,
    ) -> Option<Vec<u8>> {
        crate::stages::cacheable_result(codec, &self.config, self.caps.max_result_bytes, value)
    }

    /// Until when a failing finish is retried: shortly before the lease ends
    /// (a tenth of the processing timeout, at most a second, before it).
    pub(crate) fn finish_deadline(&self, lease: &Lease) -> Instant {
        self.before_end(lease.deadline())
    }

    /// Until when cleaning up after a dropped or failed execution is retried:
    /// shortly before the lease ends, or before the lease a reserve attempt
    /// that was never answered may have taken ends, whichever is later (the
    /// outage that failed the reserve must not also starve its cleanup).
    pub(crate) fn cleanup_deadline(&self, lease: &Lease) -> Instant {
        self.before_end(lease.may_hold_until())
    }

    fn before_end(&self, end: Instant) -> Instant {
        let margin = finish_margin(self.config.processing_timeout);
        end.checked_sub(margin).unwrap_or(end)
    }

    /// Applies `pending` for the lease's owner, retrying ambiguous failures
    /// until `deadline`, or later should the lease keeper extend the lease
    /// (see [`Engine::retry_until`]; at least once). When the store refused the value as
    /// too large, `pending` is left as the smaller write that was sent instead
    /// (what the store now holds, should it be applied).
    pub(crate) async fn finish(
        &self,
        lease: &Lease,
        pending: &mut Pending,
        deadline: Instant,
    ) -> Finished {
        self.finish_in(lease, pending, deadline, None).await
    }

    /// [`Engine::finish_in`] of the write a guard in the recording phase holds.
    pub(crate) async fn finish_guarded(
        &self,
        guard: &mut ExecutionGuard,
        deadline: Instant,
        batch: Option<&mut Participant>,
    ) -> Finished {
        let ExecutionGuard { lease, phase, .. } = guard;
        match phase {
            Phase::Recording(pending) => self.finish_in(lease, pending, deadline, batch).await,
            _ => {
                self.finish_in(lease, &mut Pending::Release, deadline, None)
                    .await
            }
        }
    }

    /// [`Engine::finish`], whose first attempt at a completion goes with its
    /// batch group's (`batch`) when it has one.
    ///
    /// The attempts at one finishing write: after the first, an attempt
    /// starts only before the retry deadline ([`Engine::retry_until`]), except
    /// the second, which is always made: the phase's bound in the contract.
    /// A store that refuses the value as too large (its real limit is below
    /// the one it declared) gets the smaller write (see [`Pending::smaller`])
    /// as the next of these attempts, at once, never as a round of its own.
    pub(crate) async fn finish_in(
        &self,
        lease: &Lease,
        pending: &mut Pending,
        deadline: Instant,
        mut batch: Option<&mut Participant>,
    ) -> Finished {
        let mut retry = 0;
        let mut batched = batch.is_some() && matches!(pending, Pending::Complete(_));
        loop {
            // The error is not kept across the awaits below (it would enlarge
            // every execution's future).
            let write = self.write_first(lease, pending, batch.take());
            let e = match self.store(pending.op(), write).await {
                Ok(()) => return Finished::Applied,
                Err(e) => e,
            };
            if let Error::LeaseLost { .. } = e {
                drop(e);
                return match self.finished_by_us(lease, pending).await {
                    Ok(true) => Finished::Applied,
                    Ok(false) => Finished::LeaseLost,
                    // Unknown: say so, rather than claim another owner.
                    Err(e) => Finished::Failed(e),
                };
            }
            if let (Error::TooLarge { .. }, Some(smaller)) = (&e, pending.smaller()) {
                // Keep the protection (the record, and whether a failure may
                // be retried); drop the cached result or the error's message.
                batched = false;
                if retry == 0 || Instant::now() < self.retry_until(lease, deadline) {
                    tracing::debug!(error = %e, "the store refused the value as too large; recording without it");
                    drop(e);
                    *pending = smaller;
                    retry += 1;
                    continue;
                }
                return Finished::Failed(e);
            }
            if std::mem::take(&mut batched) && !matches!(e, Error::TooLarge { .. }) {
                // The group's call failed as a whole (a statement refused for
                // another write's sake, an encoding limit): not this write's
                // own answer. Once more on its own, at once.
                tracing::debug!(error = %e, "a batch's completion failed; completing on its own");
                drop(e);
                retry = 1;
                continue;
            }
            let until = self.retry_until(lease, deadline);
            if !(e.is_store_outage() && (retry == 0 || Instant::now() + backoff(retry) < until)) {
                return Finished::Failed(e);
            }
            tracing::warn!(error = %e, operation = pending.op().as_str(), retry, "could not record the outcome; retrying with the same owner token");
            drop(e);
            super::pause(backoff(retry)).await;
            retry += 1;
        }
    }

    /// Until when a failing finish is retried: `deadline`, or later as the
    /// lease keeper moves the lease's end (it extends while the outcome is
    /// recorded), but never more than one processing timeout past `deadline`,
    /// so that a store that takes extensions and keeps refusing the write
    /// cannot hold the execution for ever.
    fn retry_until(&self, lease: &Lease, deadline: Instant) -> Instant {
        let followed = deadline.max(self.finish_deadline(lease));
        match deadline.checked_add(self.config.processing_timeout) {
            Some(cap) => followed.min(cap),
            None => followed,
        }
    }

    /// [`Engine::write`], or for a completion with a batch group, the
    /// group's call.
    async fn write_first(
        &self,
        lease: &Lease,
        pending: &Pending,
        batch: Option<&mut Participant>,
    ) -> Result<(), Error> {
        match (batch, pending) {
            (Some(batch), Pending::Complete(result)) => {
                let expires_at = self.now() + self.config.ttl;
                lease.note_completion_sent(expires_at);
                // Boxed: the group's machinery would enlarge every execution's
                // future, batched or not.
                Box::pin(batch.complete(
                    self,
                    &lease.key,
                    lease.owner,
                    result.as_deref(),
                    expires_at,
                ))
                .await
            }
            (batch, _) => {
                if let Some(batch) = batch {
                    batch.leave();
                }
                self.write(lease, pending).await
            }
        }
    }

    async fn write(&self, lease: &Lease, pending: &Pending) -> Result<(), Error> {
        let (key, owner, now) = (&lease.key, lease.owner, self.now());
        let expires_at = now + self.config.ttl;
        match pending {
            Pending::Complete(result) => {
                lease.note_completion_sent(expires_at);
                self.repo
                    .complete(key, owner, result.as_deref(), expires_at, now)
                    .await
            }
            Pending::Fail { error, retryable } => {
                self.repo
                    .fail(key, owner, Some(error), *retryable, expires_at, now)
                    .await
            }
            Pending::Release => self.repo.release(key, owner, now).await,
        }
    }

    /// After `LeaseLost`: whether our own write was applied after all (a lost
    /// reply, a write the client re-sent). A completed or failed record under
    /// our owner token is ours; for a release, a record that is gone.
    ///
    /// # Errors
    /// The store's error when the record cannot be read.
    async fn finished_by_us(&self, lease: &Lease, pending: &Pending) -> Result<bool, Error> {
        let record = self
            .store(Op::Get, self.repo.get(&lease.key, self.now()))
            .await?;
        let write = match pending {
            Pending::Complete(_) => FinishWrite::Complete,
            Pending::Fail { .. } => FinishWrite::Fail,
            Pending::Release => FinishWrite::Release,
        };
        Ok(finished_by(record.as_ref(), lease.owner, write))
    }
}
