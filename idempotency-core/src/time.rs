//! Instants and clocks.
//!
//! Every instant the layer writes into a record (lease, expiry, bookkeeping) comes
//! from a [`Clock`] owned by the caller, never from the store's server. That keeps
//! every backend behaving the same, and lets tests drive expiry with a
//! [`ManualClock`] instead of sleeping.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time: whole milliseconds since the Unix epoch (UTC).
///
/// Millisecond precision is what every backend stores natively (Redis `PX`,
/// Postgres `bigint`, DynamoDB numbers), so no backend rounds differently.
///
/// ```
/// use idempotency_core::Timestamp;
/// use std::time::Duration;
///
/// let t = Timestamp::from_millis(1_000);
/// assert_eq!((t + Duration::from_secs(2)).as_millis(), 3_000);
/// assert_eq!(t.saturating_sub(Duration::from_secs(5)), Timestamp::EPOCH);
/// assert_eq!(Timestamp::from_millis(3_000).duration_since(t), Duration::from_secs(2));
/// ```
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);
    /// The largest representable instant.
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// An instant `millis` milliseconds after the Unix epoch.
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Whole seconds since the Unix epoch, rounded up (what TTL attributes want:
    /// a record must never be physically removed before its logical expiry).
    pub const fn as_secs_ceil(self) -> u64 {
        self.0.div_ceil(1000)
    }

    /// Converts a [`SystemTime`]; instants before the epoch clamp to it.
    pub fn from_system_time(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            Err(_) => Timestamp::EPOCH,
        }
    }

    /// Converts to a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_millis(d)))
    }

    /// `self - d`, saturating at [`Timestamp::EPOCH`].
    pub fn saturating_sub(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_sub(duration_millis(d)))
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    pub fn duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

fn duration_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl std::ops::Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, rhs: Duration) -> Timestamp {
        self.saturating_add(rhs)
    }
}

impl std::ops::Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, rhs: Duration) -> Timestamp {
        self.saturating_sub(rhs)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// The source of every instant the layer uses.
///
/// Implementations must be cheap to call; the manager reads the clock once per
/// decision.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// The wall clock ([`SystemTime::now`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_system_time(SystemTime::now())
    }
}

/// A clock that only moves when told to: tests drive leases and TTLs with it.
///
/// Clones share the same instant.
///
/// ```
/// use idempotency_core::{Clock, ManualClock, Timestamp};
/// use std::time::Duration;
///
/// let clock = ManualClock::new(Timestamp::from_millis(10));
/// let same = clock.clone();
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(same.now(), Timestamp::from_millis(15));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            now: Arc::new(AtomicU64::new(start.as_millis())),
        }
    }

    /// A clock standing at the current wall-clock time (useful with backends whose
    /// servers evict by their own clock, such as Redis `PX`).
    pub fn starting_now() -> Self {
        ManualClock::new(SystemClock.now())
    }

    /// The clock's current instant (also available through [`Clock::now`]).
    pub fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.now.load(Ordering::SeqCst))
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now.fetch_add(duration_millis(d), Ordering::SeqCst);
    }

    /// Sets the clock to `t` (may move backwards, to simulate skew).
    pub fn set(&self, t: Timestamp) {
        self.now.store(t.as_millis(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        ManualClock::now(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates() {
        assert_eq!(Timestamp::MAX + Duration::from_secs(1), Timestamp::MAX);
        assert_eq!(Timestamp::EPOCH - Duration::from_secs(1), Timestamp::EPOCH);
        assert_eq!(Timestamp::from_millis(1001).as_secs_ceil(), 2);
        assert_eq!(Timestamp::from_millis(1000).as_secs_ceil(), 1);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now() > Timestamp::from_millis(1_577_836_800_000));
    }
}
