//! [`FreshShare`]: the recent share of fresh keys, for stores that pick
//! their first statement by the mix they see.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::repository::Reservation;

/// Fixed-point one: the share is kept in `0..=ONE`.
const ONE: u32 = 1 << 16;
/// The moving average's weight of each new answer: 1/32.
const WEIGHT_SHIFT: u32 = 5;
/// At or above this share, keys are mostly fresh (85 %).
const MOSTLY_FRESH: u32 = ONE / 100 * 85;
/// At or below this share, keys are mostly duplicates (15 %).
const MOSTLY_DUPLICATES: u32 = ONE / 100 * 15;

/// The share of fresh keys among a store's recent reservations: a moving
/// average over about the last 32 answers, starting at one half (neither
/// mostly fresh nor mostly duplicates). A store whose cheapest first
/// statement depends on whether the key exists (an insert for fresh keys, a
/// read for duplicates) uses it to guess; what a reservation answers never
/// depends on it.
///
/// Updated with a relaxed load and store, not a compare-and-swap loop: an
/// update lost to a concurrent one only delays the average by one answer.
///
/// ```
/// use idempotency_core::{FreshShare, Reservation};
///
/// let share = FreshShare::new();
/// assert!(!share.mostly_fresh() && !share.mostly_duplicates());
/// for _ in 0..100 {
///     share.observe(&Reservation::Acquired { attempt: 1 });
/// }
/// assert!(share.mostly_fresh());
/// ```
#[derive(Debug)]
pub struct FreshShare(AtomicU32);

impl Default for FreshShare {
    fn default() -> Self {
        Self::new()
    }
}

impl FreshShare {
    /// One half: no guess yet.
    pub fn new() -> Self {
        FreshShare(AtomicU32::new(ONE / 2))
    }

    /// Counts a reservation's answer: a first attempt acquired as fresh (an
    /// expired record overwritten, or a re-sent reserve of a first attempt,
    /// counts alike: rare, and only a guess is at stake), an existing record
    /// as a duplicate, and a takeover as half of each (neither a plain insert
    /// nor a plain read decides it).
    pub fn observe(&self, answer: &Reservation) {
        let target = match answer {
            Reservation::Acquired { attempt: 1 } => ONE,
            Reservation::Acquired { .. } => ONE / 2,
            Reservation::Existing(_) => 0,
        };
        let share = self.0.load(Ordering::Relaxed);
        let next = if target >= share {
            share + ((target - share) >> WEIGHT_SHIFT)
        } else {
            share - ((share - target) >> WEIGHT_SHIFT)
        };
        self.0.store(next, Ordering::Relaxed);
    }

    /// At least 85 % of the recent keys were fresh.
    pub fn mostly_fresh(&self) -> bool {
        self.0.load(Ordering::Relaxed) >= MOSTLY_FRESH
    }

    /// At most 15 % of the recent keys were fresh.
    pub fn mostly_duplicates(&self) -> bool {
        self.0.load(Ordering::Relaxed) <= MOSTLY_DUPLICATES
    }
}
