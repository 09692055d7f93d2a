//! The completions of a batch's items, sent together in one
//! [`Repository::complete_many`](crate::Repository::complete_many) call.
//!
//! Each item of a group that still runs after the group's reservation takes
//! part (those it answered as duplicates end before); an item whose handler
//! succeeded submits its completion and waits. The waiting completions are
//! sent when every item still taking part has submitted (the others answered
//! a duplicate on the single path, failed, or ended), or when the first of
//! them has waited [`LINGER`] — so a slow
//! handler never holds the others' completions for long. Only the first
//! attempt goes this way: a completion that fails (an outage, `LeaseLost`) is
//! retried, or checked against "finished by us", on the single path, with the
//! same owner token; so is one the group's call refused as a whole (an error
//! that is not this write's own answer). The call runs under the store timer
//! of the item that sends it: if it fires, every write of the call is retried
//! on its own.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use crate::error::Error;
use crate::key::{OwnerToken, RecordKey};
use crate::repository::Completion;
use crate::time::Timestamp;

use super::Engine;

/// The longest a submitted completion waits for the rest of its group.
pub(crate) const LINGER: Duration = Duration::from_millis(2);

/// A completion waiting to be sent.
struct Waiting {
    key: RecordKey,
    owner: OwnerToken,
    result: Option<Vec<u8>>,
    expires_at: Timestamp,
    reply: oneshot::Sender<Result<(), Error>>,
}

#[derive(Default)]
struct State {
    /// Items taking part that have not submitted yet.
    pending: usize,
    waiting: Vec<Waiting>,
}

/// The completions of one group.
#[derive(Default)]
pub(crate) struct Completions {
    state: Mutex<State>,
    changed: Notify,
}

impl std::fmt::Debug for Completions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock();
        f.debug_struct("Completions")
            .field("pending", &state.pending)
            .field("waiting", &state.waiting.len())
            .finish()
    }
}

/// One item's part in its group's completions; leaving (dropping it) without
/// submitting tells the others not to wait for it.
#[derive(Debug)]
pub(crate) struct Participant {
    completions: Arc<Completions>,
    submitted: bool,
}

impl Completions {
    /// A participant for each of `n` items.
    pub(crate) fn participants(n: usize) -> Vec<Participant> {
        let completions = Arc::new(Completions::default());
        completions.state.lock().pending = n;
        (0..n)
            .map(|_| Participant {
                completions: completions.clone(),
                submitted: false,
            })
            .collect()
    }

    /// The waiting completions, when they are to be sent now: everyone taking
    /// part has submitted, or `force` (a waiter's linger ran out).
    fn take(&self, force: bool) -> Vec<Waiting> {
        let mut state = self.state.lock();
        if state.waiting.is_empty() || !(force || state.pending == 0) {
            return Vec::new();
        }
        std::mem::take(&mut state.waiting)
    }
}

impl Participant {
    /// Sends this item's completion with its group's: `complete`'s answer for
    /// it. An answer lost on the way (the group's call dropped) is a
    /// `Timeout`: the caller retries with the same owner token.
    pub(crate) async fn complete(
        &mut self,
        engine: &Engine,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
    ) -> Result<(), Error> {
        let (reply, mut answer) = oneshot::channel();
        {
            let mut state = self.completions.state.lock();
            if !self.submitted {
                self.submitted = true;
                state.pending = state.pending.saturating_sub(1);
            }
            state.waiting.push(Waiting {
                key: key.clone(),
                owner,
                result: result.map(<[u8]>::to_vec),
                expires_at,
                reply,
            });
        }
        let linger = tokio::time::Instant::now() + LINGER;
        let lost = || Error::Timeout {
            backend: engine.caps.backend,
            operation: "complete",
        };
        loop {
            // Its own answer first: once it has come, this item sends no
            // other item's completion (a call its timer could cut short).
            match answer.try_recv() {
                Ok(got) => return got,
                Err(oneshot::error::TryRecvError::Closed) => return Err(lost()),
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
            // Registered before looking, so that a participant leaving in
            // between is not missed.
            let changed = self.completions.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let due = tokio::time::Instant::now() >= linger;
            let batch = self.completions.take(due);
            if !batch.is_empty() {
                send(engine, batch).await;
            }
            tokio::select! {
                biased;
                got = &mut answer => return got.unwrap_or_else(|_| Err(lost())),
                () = changed => {}
                () = tokio::time::sleep_until(linger), if !due => {}
            }
        }
    }
}

impl Participant {
    /// Takes no (further) part: the others stop waiting for this item (its
    /// handler failed, it ends on another path).
    pub(crate) fn leave(&mut self) {
        if !self.submitted {
            self.submitted = true;
            let mut state = self.completions.state.lock();
            state.pending = state.pending.saturating_sub(1);
            drop(state);
            self.completions.changed.notify_waiters();
        }
    }
}

impl Drop for Participant {
    fn drop(&mut self) {
        self.leave();
    }
}

/// One `complete_many` call for `batch`; each waiter gets its answer.
async fn send(engine: &Engine, batch: Vec<Waiting>) {
    let now = engine.now();
    let writes = batch
        .iter()
        .map(|w| Completion {
            key: &w.key,
            owner: w.owner,
            result: w.result.as_deref(),
            expires_at: w.expires_at,
        })
        .collect();
    let answers = engine.repo.complete_many(writes, now).await;
    let mut answers = answers.into_iter();
    for waiting in batch {
        let answer = answers.next().unwrap_or_else(|| {
            Err(Error::Unavailable {
                backend: engine.caps.backend,
                message: "complete_many answered fewer writes than it was sent".into(),
                source: None,
            })
        });
        // A waiter that is gone (its execution dropped) retries on its own.
        let _ = waiting.reply.send(answer);
    }
}
