//! The execution engine: the stages of one execution, in the order they run.
//!
//! 1. [`reserve`]: reserve the key (retrying an ambiguous failure with the same
//!    owner token) and decide what a duplicate gets;
//! 2. [`lease`]: run the handler under its lease, extending it beside the
//!    handler, never in its way, and telling the handler when the lease can no
//!    longer be confirmed;
//! 3. [`finish`]: record the outcome (complete, fail or release), retrying until
//!    shortly before the lease ends and recognising our own earlier writes;
//! 4. [`guard`]: what a dropped execution leaves behind, per phase.
//!
//! Each policy lives in exactly one of these modules; the manager only strings
//! them together, and the PostgreSQL transactional manager reuses the pieces it
//! needs.

pub(crate) mod answers;
pub(crate) mod completions;
pub(crate) mod finish;
pub(crate) mod guard;
pub(crate) mod lease;
pub(crate) mod reserve;

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::config::{Config, FailurePolicy};
use crate::error::Error;
use crate::key::{Fingerprint, OwnerToken, RecordKey};
use crate::metrics::{Metrics, Op};
use crate::repository::{Capabilities, ReserveRequest, SharedRepository};
use crate::time::{Clock, Timestamp};

/// What every stage shares: the store, the configuration, the clock.
pub(crate) struct Engine {
    pub(crate) repo: SharedRepository,
    pub(crate) config: Config,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) caps: Capabilities,
    pub(crate) metrics: Arc<Metrics>,
    /// How long executions of this manager hold a key, for `retry_after` hints.
    pub(crate) hold_time: HoldTime,
    /// The local answer cache, when configured.
    pub(crate) answers: Option<answers::Answers>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("repo", &self.repo)
            .field("config", &self.config)
            .field("clock", &self.clock)
            .field("answers", &self.answers)
            .finish()
    }
}

impl Engine {
    pub(crate) fn new(repo: SharedRepository, config: Config, clock: Arc<dyn Clock>) -> Self {
        let caps = repo.capabilities();
        Engine {
            metrics: Arc::new(Metrics::new(caps.backend)),
            hold_time: HoldTime::default(),
            answers: config
                .answer_cache
                .map(|c| answers::Answers::new(c, config.clock_skew)),
            repo,
            config,
            clock,
            caps,
        }
    }

    /// One store call, measured and time-boxed by `limit`: a call that does not
    /// answer in time is [`Error::Timeout`] (ambiguous: it may have been
    /// applied). A call that completes on its first poll (the memory store)
    /// never arms a timer.
    pub(crate) async fn call<T, F>(&self, op: Op, limit: Duration, call: F) -> Result<T, Error>
    where
        F: Future<Output = Result<T, Error>>,
    {
        self.call_sent_at(op, limit, Instant::now(), call).await
    }

    /// [`Engine::call`] for a call whose caller already read the clock when
    /// it built it (`started`), so that it is not read twice.
    pub(crate) async fn call_sent_at<T, F>(
        &self,
        op: Op,
        limit: Duration,
        started: Instant,
        call: F,
    ) -> Result<T, Error>
    where
        F: Future<Output = Result<T, Error>>,
    {
        let mut call = pin!(call);
        // The timer is armed only when the call does not answer on its first
        // poll (the memory store always does), and boxed: a timer is large,
        // and every execution's future would carry it.
        let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
        let result = std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = call.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
            timer.as_mut().poll(cx).map(|()| {
                Err(Error::Timeout {
                    backend: self.caps.backend,
                    operation: op.as_str(),
                })
            })
        })
        .await;
        // A store's answer that another holder has the key (`InProgress`,
        // see `reserve`) is an answer, not a failed call.
        let answered = matches!(&result, Ok(_) | Err(Error::InProgress { .. }));
        self.metrics.operation(op, started.elapsed(), answered);
        result
    }

    /// [`Engine::call`] with the configured store timeout.
    pub(crate) async fn store<T, F>(&self, op: Op, call: F) -> Result<T, Error>
    where
        F: Future<Output = Result<T, Error>>,
    {
        self.call(op, self.config.store_timeout, call).await
    }

    pub(crate) fn now(&self) -> Timestamp {
        self.clock.now()
    }
}

/// The reservation a configuration asks for at `now`: lease `processing_timeout`,
/// expiry `ttl` (validated to cover the lease plus the skew allowance).
pub fn reserve_request<'k>(
    config: &Config,
    key: &'k RecordKey,
    owner: OwnerToken,
    fingerprint: Option<Fingerprint>,
    now: Timestamp,
) -> ReserveRequest<'k> {
    ReserveRequest {
        key,
        owner,
        fingerprint,
        now,
        lease_until: now + config.processing_timeout,
        expires_at: now + config.ttl,
        retry_failed: config.failure_policy == FailurePolicy::StoreAndRetry,
        clock_skew: config.clock_skew,
    }
}

/// Sleeps for `d` on a boxed timer: pauses happen on cold paths (retries,
/// waiting for a holder), and an unboxed timer would enlarge every execution's
/// future by its size.
pub(crate) async fn pause(d: Duration) {
    Box::pin(tokio::time::sleep(d)).await;
}

/// The pauses between attempts of a store call that failed ambiguously; the
/// number of retries is their count.
pub(crate) fn backoff(attempt: u32) -> Duration {
    // 20 ms, 40 ms, 80 ms … capped at 1 s.
    Duration::from_millis(20u64.saturating_mul(1 << attempt.min(6))).min(Duration::from_secs(1))
}

/// A running average (exponentially weighted, 1/8 per sample) of how long this
/// manager's executions hold a key, from the first reserve to the recorded
/// outcome: the hint an `InProgress` answer gives for when to retry.
#[derive(Debug, Default)]
pub(crate) struct HoldTime {
    /// Microseconds; 0 until the first sample.
    average_us: std::sync::atomic::AtomicU64,
}

impl HoldTime {
    /// The smallest hint given: retrying sooner only costs round trips.
    const FLOOR: Duration = Duration::from_millis(1);

    pub(crate) fn observe(&self, held: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let sample = u64::try_from(held.as_micros()).unwrap_or(u64::MAX).max(1);
        // A lost update under contention only drops one sample.
        let old = self.average_us.load(Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        self.average_us.store(new.max(1), Relaxed);
    }

    /// When a duplicate should retry, given the holder's lease ends in
    /// `lease_left`: after about one typical execution, never after the lease
    /// ends; the lease's end itself before any execution has finished.
    pub(crate) fn hint(&self, lease_left: Duration) -> Duration {
        match self.average_us.load(std::sync::atomic::Ordering::Relaxed) {
            0 => lease_left,
            us => Duration::from_micros(us).max(Self::FLOOR).min(lease_left),
        }
    }
}

#[cfg(test)]
mod hold_time_tests {
    use super::*;

    #[test]
    fn hints_follow_the_executions_and_never_pass_the_lease() {
        let t = HoldTime::default();
        let lease = Duration::from_secs(300);
        assert_eq!(t.hint(lease), lease, "no sample yet: the lease's end");
        t.observe(Duration::from_millis(5));
        assert_eq!(t.hint(lease), Duration::from_millis(5));
        assert_eq!(t.hint(Duration::from_millis(2)), Duration::from_millis(2));
        for _ in 0..64 {
            t.observe(Duration::from_millis(80));
        }
        let h = t.hint(lease);
        assert!(
            h > Duration::from_millis(70) && h <= Duration::from_millis(80),
            "{h:?}"
        );
        t.observe(Duration::ZERO);
        assert!(t.hint(lease) >= HoldTime::FLOOR);
    }
}
