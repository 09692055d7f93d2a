//! Stage 2: run under the lease.
//!
//! The lease keeper runs *beside* the handler (one `select!`, the handler polled
//! first), never in its way: a store call that hangs delays the next extension,
//! not the handler. Each extension is time-boxed below the extension interval
//! and the lease's end. The keeper also runs while the outcome is recorded, so
//! completion retries during a store blip keep the key protected.
//!
//! The handler sees its lease through [`ExecutionContext`]: its attempt number
//! (a fencing token), its owner token, and a signal that fires when the lease
//! can no longer be confirmed.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::Error;
use crate::key::{OwnerToken, RecordKey};
use crate::metrics::Op;
use crate::time::Timestamp;

use super::Engine;

/// One execution's hold on its key, shared by the engine and the handler's
/// [`ExecutionContext`].
pub(crate) struct Lease {
    /// When the first reserve was about to be sent: the key has been held
    /// (or sought) since.
    created: Instant,
    pub(crate) key: RecordKey,
    pub(crate) owner: OwnerToken,
    attempt: AtomicU32,
    /// The last confirmed `lease_until`, by the manager's clock (ms).
    until: AtomicU64,
    /// The same instant on Tokio's clock, which timers use (so paused-time
    /// tests drive it).
    deadline: Mutex<Instant>,
    /// The latest instant a record created by one of our reserve attempts
    /// (answered or not) can hold its lease: how long cleaning up after an
    /// unanswered attempt is worth retrying.
    may_hold_until: Mutex<Instant>,
    /// Whether a reserve attempt failed ambiguously: a record it may have
    /// created under our token is to be released, whatever error ends the
    /// reservation.
    unsettled: AtomicBool,
    /// Whether the latest reserve attempt is still unanswered (or was
    /// answered with an error): it may reach the store after whatever
    /// follows, a cleanup's release included.
    unanswered: AtomicBool,
    /// Whether the store refused a reserve attempt with an error that is not
    /// an outage: the key is never run unprotected (fail-open) after it.
    refused: AtomicBool,
    /// The earliest expiry a completion attempt of ours asked for (ms;
    /// `u64::MAX` before any): the record, if completed, expires no earlier.
    completion_expiry: AtomicU64,
    lost: AtomicBool,
    /// Whether a handler waits on [`Lease::wait_lost`] (only then is there
    /// anybody to notify).
    watched: AtomicBool,
    lost_notify: Notify,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("attempt", &self.attempt())
            .field("until", &self.until())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl Lease {
    /// How long since the first reserve was sent: at the end of an execution,
    /// how long this execution held the key.
    pub(crate) fn held_for(&self) -> Duration {
        self.created.elapsed()
    }

    pub(crate) fn new(key: RecordKey, owner: OwnerToken) -> Self {
        let created = Instant::now();
        Lease {
            key,
            owner,
            created,
            attempt: AtomicU32::new(0),
            until: AtomicU64::new(0),
            deadline: Mutex::new(created),
            unsettled: AtomicBool::new(false),
            unanswered: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            completion_expiry: AtomicU64::new(u64::MAX),
            may_hold_until: Mutex::new(created),
            lost: AtomicBool::new(false),
            watched: AtomicBool::new(false),
            lost_notify: Notify::new(),
        }
    }

    /// Records that the store holds the lease until `until`, as confirmed by a
    /// call sent at `sent_at` (the lease is counted from the send, never from
    /// the answer). Never moves the lease back.
    pub(crate) fn confirm(&self, until: Timestamp, sent_at: Timestamp, sent: Instant) {
        let previous = self.until.fetch_max(until.as_millis(), Ordering::SeqCst);
        if until.as_millis() > previous {
            let local = sent + until.duration_since(sent_at);
            let mut deadline = self.deadline.lock();
            *deadline = (*deadline).max(local);
        }
    }

    /// A reserve attempt asking for a lease until `until` (manager's clock)
    /// was sent at `sent_at` (`sent` on Tokio's clock): whatever its answer, a
    /// record it created holds the key until then at most.
    pub(crate) fn note_sent(&self, until: Timestamp, sent_at: Timestamp, sent: Instant) {
        let local = sent + until.duration_since(sent_at);
        let mut may_hold = self.may_hold_until.lock();
        *may_hold = (*may_hold).max(local);
        self.unanswered.store(true, Ordering::Relaxed);
    }

    /// The store answered the latest reserve attempt (an `Acquired` or an
    /// `Existing`): nothing of it is left on its way.
    pub(crate) fn note_answered(&self) {
        self.unanswered.store(false, Ordering::Relaxed);
    }

    /// The store refused a reserve attempt with an error that is not an
    /// outage (a batch's answer for this key): whatever error ends the
    /// reservation, the handler is not run unprotected on the key.
    pub(crate) fn note_refused(&self) {
        self.refused.store(true, Ordering::Relaxed);
    }

    /// A completion attempt asking for `expires_at` is about to be sent.
    pub(crate) fn note_completion_sent(&self, expires_at: Timestamp) {
        self.completion_expiry
            .fetch_min(expires_at.as_millis(), Ordering::Relaxed);
    }

    /// The earliest expiry a completion attempt of ours asked for: whichever
    /// attempt was applied, the completed record expires no earlier.
    pub(crate) fn completion_expiry(&self) -> Option<Timestamp> {
        match self.completion_expiry.load(Ordering::Relaxed) {
            u64::MAX => None,
            ms => Some(Timestamp::from_millis(ms)),
        }
    }

    /// Whether [`note_refused`](Self::note_refused) was called.
    pub(crate) fn was_refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Whether a reserve attempt of ours may still reach the store: the
    /// latest went unanswered, or an earlier one failed ambiguously.
    pub(crate) fn reserve_may_land(&self) -> bool {
        self.unanswered.load(Ordering::Relaxed) || self.was_unsettled()
    }

    /// A reserve attempt failed ambiguously (it may have been applied).
    pub(crate) fn note_unsettled(&self) {
        self.unsettled.store(true, Ordering::Relaxed);
    }

    /// Whether a reserve attempt failed ambiguously.
    pub(crate) fn was_unsettled(&self) -> bool {
        self.unsettled.load(Ordering::Relaxed)
    }

    /// The later of the confirmed lease's end and what an unanswered reserve
    /// attempt may hold (see [`note_sent`](Self::note_sent)).
    pub(crate) fn may_hold_until(&self) -> Instant {
        (*self.may_hold_until.lock()).max(self.deadline())
    }

    pub(crate) fn set_attempt(&self, attempt: u32) {
        self.attempt.store(attempt, Ordering::SeqCst);
    }

    pub(crate) fn attempt(&self) -> u32 {
        self.attempt.load(Ordering::SeqCst)
    }

    pub(crate) fn until(&self) -> Timestamp {
        Timestamp::from_millis(self.until.load(Ordering::SeqCst))
    }

    /// When the lease ends, on Tokio's clock.
    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock()
    }

    /// The lease can no longer be counted on (or the execution ended).
    pub(crate) fn mark_lost(&self) {
        if !self.lost.swap(true, Ordering::SeqCst) && self.watched.load(Ordering::SeqCst) {
            self.lost_notify.notify_waiters();
        }
    }

    /// Whether the lease was marked lost, or was confirmed once and has ended
    /// since (without extension nobody marks that: it is judged here).
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
            || (self.is_confirmed() && self.deadline() <= Instant::now())
    }

    fn is_confirmed(&self) -> bool {
        self.until.load(Ordering::SeqCst) > 0
    }

    async fn wait_lost(&self) {
        self.watched.store(true, Ordering::SeqCst);
        loop {
            let notified = self.lost_notify.notified();
            if self.is_lost() {
                return;
            }
            if self.is_confirmed() {
                // The lease's end, as it stands now; an extension moves it,
                // and the loop looks again.
                tokio::select! {
                    () = notified => {}
                    () = tokio::time::sleep_until(self.deadline()) => {}
                }
            } else {
                notified.await;
            }
        }
    }
}

/// What a handler knows of its execution: pass a handler taking it to
/// [`IdempotencyManager::execute_with_context`](crate::IdempotencyManager::execute_with_context).
///
/// - [`attempt`](Self::attempt) is a **fencing token**: 1 for a new record, +1
///   on every takeover, so a consumer that lost its lease (paused, partitioned)
///   carries a smaller number than the one that took over. Downstream writes can
///   carry it, and a store can refuse an older one:
///   `UPDATE accounts SET balance = balance - $2, fence = $3 WHERE id = $1 AND fence < $3`.
/// - [`lease_lost`](Self::lease_lost) resolves when the lease can no longer be
///   confirmed — extension failed until the lease ended, another owner took
///   over, or (without lease extension) the processing timeout passed — so a
///   long handler can stop before another consumer's takeover runs it again.
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{Config, ExecutionContext, HandlerError, IdempotencyManager, MemoryRepository};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
/// let outcome = manager
///     .execute_with_context("order-1", &(), |ctx: ExecutionContext| async move {
///         assert_eq!(ctx.attempt(), 1); // the first attempt on this key
///         tokio::select! {
///             _ = ctx.lease_lost() => Err(HandlerError::transient("lease lost; stopping".to_owned())),
///             receipt = async { Ok("charged".to_owned()) } => receipt,
///         }
///     })
///     .await?;
/// assert_eq!(outcome.into_value().as_deref(), Some("charged"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct ExecutionContext(Arc<Lease>);

impl fmt::Debug for ExecutionContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ExecutionContext").field(&self.0).finish()
    }
}

impl ExecutionContext {
    pub(crate) fn new(lease: Arc<Lease>) -> Self {
        ExecutionContext(lease)
    }

    /// The record key this execution holds.
    pub fn key(&self) -> &RecordKey {
        &self.0.key
    }

    /// The attempt number: a fencing token, monotonic per key while the record
    /// exists (see the type's docs). `0` for an unprotected run (the store was
    /// unreachable and the outage policy is fail-open).
    pub fn attempt(&self) -> u32 {
        self.0.attempt()
    }

    /// The random owner token of this attempt.
    pub fn owner(&self) -> OwnerToken {
        self.0.owner
    }

    /// The lease's end as last confirmed by the store (manager's clock).
    pub fn lease_until(&self) -> Timestamp {
        self.0.until()
    }

    /// The lease's end as last confirmed by the store, on Tokio's monotonic
    /// clock (the one its timers use, so paused-time tests drive it): a
    /// deadline for work that must end while the lease holds, unmoved by a
    /// wall clock that steps. Each extension confirmed moves it later; it is
    /// in the past for an unprotected run (fail-open), which holds no lease.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use idempotency_core::{Config, ExecutionContext, HandlerError, IdempotencyManager, MemoryRepository};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// let outcome = manager
    ///     .execute_with_context("export-7", &(), |ctx: ExecutionContext| async move {
    ///         // Stop a second before the lease ends, so the outcome is
    ///         // recorded while it still holds.
    ///         let stop = ctx.lease_deadline() - Duration::from_secs(1);
    ///         let work = async { "exported".to_owned() };
    ///         tokio::time::timeout_at(stop, work)
    ///             .await
    ///             .map_err(|_| HandlerError::transient("out of lease".to_owned()))
    ///     })
    ///     .await?;
    /// assert_eq!(outcome.into_value().as_deref(), Some("exported"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn lease_deadline(&self) -> Instant {
        self.0.deadline()
    }

    /// Whether the lease can no longer be confirmed (or the execution ended).
    pub fn is_lease_lost(&self) -> bool {
        self.0.is_lost()
    }

    /// Resolves when the lease can no longer be confirmed: the extension failed
    /// until the lease ended, the store answered that another owner holds the
    /// key, or the lease ran out without extension. Also resolves once the
    /// execution has ended (its outcome recorded, or its future dropped).
    pub async fn lease_lost(&self) {
        self.0.wait_lost().await;
    }
}

impl Engine {
    /// Runs `work` (the handler, then the recording of its outcome) beside the
    /// lease keeper.
    ///
    /// Without lease extension there is nothing to keep: the lease's end is
    /// judged by [`Lease::is_lost`] when the handler asks, and no timer is
    /// armed for executions that never ask.
    pub(crate) async fn under_lease<W: Future>(&self, lease: &Lease, work: W) -> W::Output {
        let Some(interval) = self.config.lease_extension_interval else {
            return work.await;
        };
        // Boxed: only executions with extension pay for the keeper's timers.
        let keeper = Box::pin(self.keep_lease(lease, interval));
        tokio::select! {
            biased;
            out = work => out,
            never = keeper => match never {},
        }
    }

    /// Extends the lease every `interval`, and sooner when less of the lease is
    /// left than one attempt's time box: a handler that started late in its
    /// lease (slow or re-sent reserves count it from the first attempt), or an
    /// extension that failed, retried with backoff until the lease ends. Marks
    /// the lease lost when it ends unconfirmed or another owner holds the key.
    /// Never returns: it is dropped with the execution.
    async fn keep_lease(&self, lease: &Lease, interval: Duration) -> Infallible {
        // Each attempt's time box (the contract's timeout table).
        let time_box = (interval / 2).min(self.config.store_timeout);
        // Ticks keep their cadence whatever an extension costs.
        let mut next_tick = Instant::now() + interval;
        let mut failures = 0;
        let mut not_before = Instant::now();
        loop {
            let deadline = lease.deadline();
            let due = extension_due(next_tick, deadline, time_box, not_before);
            if due >= deadline {
                tokio::time::sleep_until(deadline).await;
                if lease.deadline() <= Instant::now() {
                    return lost(
                        lease,
                        "the lease ended without confirmation; another consumer may take over",
                    )
                    .await;
                }
                continue;
            }
            tokio::time::sleep_until(due).await;
            let now = Instant::now();
            if next_tick <= now {
                next_tick = (next_tick + interval).max(now);
            }
            // Never past the lease's end.
            let limit = time_box.min(deadline.saturating_duration_since(now));
            match self.extend(lease, limit).await {
                Ok(()) => {
                    failures = 0;
                    // An extension that did not move the lease's end (a clock
                    // standing still) waits for the cadence, never spins.
                    not_before = if lease.deadline() > deadline {
                        Instant::now()
                    } else {
                        next_tick
                    };
                }
                Err(Error::LeaseLost { .. }) => {
                    return lost(
                        lease,
                        "lease lost while the handler runs; another attempt took over",
                    )
                    .await;
                }
                Err(_) => {
                    failures += 1;
                    let backoff = super::backoff(failures);
                    not_before = retry_after(Instant::now(), lease.deadline(), backoff);
                }
            }
        }
    }

    /// One extension, time-boxed by `limit`.
    async fn extend(&self, lease: &Lease, limit: Duration) -> Result<(), Error> {
        let sent = Instant::now();
        let now = self.now();
        let until = now + self.config.processing_timeout;
        let expires_at = until + self.config.clock_skew;
        let call = self
            .repo
            .extend(&lease.key, lease.owner, until, expires_at, now);
        let r = self
            .call_sent_at(Op::Extend, limit, sent.into_std(), call)
            .await;
        match &r {
            Ok(()) => {
                lease.confirm(until, now, sent);
                tracing::trace!(lease_until = %until, "lease extended");
            }
            Err(Error::LeaseLost { .. }) => {}
            Err(e) => tracing::warn!(error = %e, "could not extend the lease; will retry"),
        }
        r
    }
}

/// Marks the lease lost (`why`), and keeps the keeper from returning: it is
/// dropped with the execution.
async fn lost(lease: &Lease, why: &'static str) -> Infallible {
    tracing::warn!(key = %lease.key, "{why}");
    lease.mark_lost();
    std::future::pending().await
}

/// When the keeper tries again after a failed extension: after `backoff`, or
/// sooner when less than two backoffs of the lease are left, so that a failure
/// near the lease's end still leaves a try before `deadline` (halving what is
/// left each time, down to the shortest backoff: never a spin).
fn retry_after(now: Instant, deadline: Instant, backoff: Duration) -> Instant {
    let half_left = deadline.saturating_duration_since(now) / 2;
    if half_left >= super::backoff(0) {
        now + backoff.min(half_left)
    } else {
        now + backoff
    }
}

/// When the keeper tries its next extension: at the cadence's `tick`, or
/// earlier, so that an attempt of `time_box` still ends before the lease's
/// `deadline`; never before `not_before` (the backoff after a failure). At or
/// after `deadline`: no attempt can help, the lease ends.
fn extension_due(
    tick: Instant,
    deadline: Instant,
    time_box: Duration,
    not_before: Instant,
) -> Instant {
    let latest = deadline.checked_sub(time_box).unwrap_or(not_before);
    tick.min(latest).max(not_before)
}
