//! Stage 4: what a dropped execution leaves behind.
//!
//! The caller may drop the `execute` future at any await point (an HTTP client
//! disconnects, an outer timeout fires). What happens to the record depends on
//! the phase the execution was in, and is decided here only:
//!
//! | dropped while | the record | why |
//! |---|---|---|
//! | reserving | released in the background | no handler ran; a reserve whose reply was lost may have created it under our token |
//! | the handler runs | [`CancelPolicy`](crate::CancelPolicy): kept until its lease ends (default), or released | the handler may already have applied its effect |
//! | the outcome is recorded | the outcome is recorded in the background | the effect happened; only its record is missing |
//!
//! A reserve that failed for good also leaves the reserving phase behind, so
//! the record a lost reply may have created is released too. While a reserve
//! attempt of ours may still reach the store (unanswered, or failed
//! ambiguously), the release is sent once more one store time box later, so
//! that an attempt landing after the first release does not hold the key for
//! a whole lease.

use std::sync::Arc;

use crate::decision::{on_drop, DropAction, DropPhase};

use super::finish::{Finished, Pending};
use super::lease::Lease;
use super::Engine;

/// Where an execution is.
#[derive(Debug)]
pub(crate) enum Phase {
    Reserving,
    Running,
    Recording(Pending),
    Done,
}

/// Owns an execution's hold on its key; on drop, cleans up per [`Phase`].
#[derive(Debug)]
pub(crate) struct ExecutionGuard {
    pub(crate) engine: Arc<Engine>,
    pub(crate) lease: Arc<Lease>,
    pub(crate) phase: Phase,
}

impl ExecutionGuard {
    pub(crate) fn new(engine: Arc<Engine>, lease: Arc<Lease>) -> Self {
        ExecutionGuard {
            engine,
            lease,
            phase: Phase::Reserving,
        }
    }
}

impl Drop for ExecutionGuard {
    fn drop(&mut self) {
        // Whatever happened, this execution no longer keeps the lease.
        self.lease.mark_lost();
        let (phase, pending) = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Done => return,
            Phase::Reserving => (DropPhase::Reserving, None),
            Phase::Running => (DropPhase::Running, None),
            Phase::Recording(pending) => (DropPhase::Recording, Some(pending)),
        };
        let pending = match (on_drop(phase, self.engine.config.on_cancel), pending) {
            (DropAction::Keep, _) => {
                tracing::info!(key = %self.lease.key, lease_until = %self.lease.until(), "execution dropped while the handler ran; the record keeps its lease until it ends");
                return;
            }
            (DropAction::Record, Some(pending)) => pending,
            (DropAction::Release | DropAction::Record, _) => Pending::Release,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %self.lease.key, "execution dropped outside a Tokio runtime; the record stays as it is until its lease ends");
            return;
        };
        let (engine, lease) = (self.engine.clone(), self.lease.clone());
        runtime.spawn(async move {
            let again = matches!(pending, Pending::Release) && lease.reserve_may_land();
            if !engine.clean_up(&lease, pending).await || !again {
                return;
            }
            // A reserve of ours may still be on its way (its caller gave up
            // while it was sent, or it failed ambiguously): landing after the
            // release above, it would hold the key for nobody until its lease
            // ends. Once its time box has passed, release once more.
            super::pause(engine.config.store_timeout).await;
            engine.clean_up(&lease, Pending::Release).await;
        });
    }
}

impl Engine {
    /// Applies a dropped execution's `pending` write; whether it ended
    /// (applied, or another owner holds the key), rather than failed.
    async fn clean_up(&self, lease: &Lease, mut pending: Pending) -> bool {
        let deadline = self.cleanup_deadline(lease);
        match self.finish(lease, &mut pending, deadline).await {
            Finished::Applied | Finished::LeaseLost => true,
            Finished::Failed(e) => {
                tracing::warn!(key = %lease.key, error = %e, "could not clean up after a dropped execution; the record keeps its lease until it ends");
                false
            }
        }
    }
}
