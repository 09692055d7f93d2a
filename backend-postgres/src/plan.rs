//! Which statement a reservation sends first (alone or over arrays): the reservation
//! function, which answers every case, or a plain statement that answers the
//! common one for less and leaves the rest to the function.

use std::fmt;
use std::str::FromStr;

use idempotency_core::{Error, FreshShare, Reservation};

/// How a `reserve` on the repository's own connections reaches its answer,
/// alone or over arrays (a batch's `reserve_many`, coalesced calls: the same
/// statements for all the keys at once). Reservations on your connection
/// through [`PgRepository::in_transaction`](crate::PgRepository::in_transaction)
/// or the transactional manager always call the reservation function.
///
/// Every plan answers exactly as the reservation function does: each first
/// statement answers only the cases it decides alone, under the same rules,
/// and leaves every other case to the function, sent next on the same
/// connection. What differs is the cost. A plain `INSERT` or `SELECT` costs
/// the server about a quarter less than the PL/pgSQL call (measured with
/// pgbench on PostgreSQL 15, see BENCHMARKS.md), and a first statement that
/// does not answer costs a second round trip.
///
/// | plan | fresh key | duplicate (live record, not open to a takeover) or re-sent by its owner | takeover, expired row |
/// |---|---|---|---|
/// | [`Function`](Self::Function) | the function | the function | the function |
/// | [`InsertFirst`](Self::InsertFirst) | `INSERT … ON CONFLICT DO NOTHING RETURNING` | that insert (no row, nothing written) + the function | insert + function |
/// | [`ReadFirst`](Self::ReadFirst) | `SELECT` (no row) + the function | `SELECT` that reads and decides, as the function's first query | read + function |
/// | [`Adaptive`](Self::Adaptive) (default) | follows the recent mix | | |
///
/// ```
/// use idempotency_postgres::{PgRepository, ReservePlan};
///
/// // A consumer that mostly sees duplicates, e.g. replaying a topic.
/// let builder = PgRepository::builder().reserve_plan(ReservePlan::ReadFirst);
/// # let _ = builder;
/// assert_eq!("insert-first".parse::<ReservePlan>().unwrap(), ReservePlan::InsertFirst);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReservePlan {
    /// Follows the share of fresh keys among the repository's recent
    /// reservations, single or in batches (a moving average over about the
    /// last 32 keys, shared by its clones): [`InsertFirst`](Self::InsertFirst) while at least 85 % were
    /// fresh, [`ReadFirst`](Self::ReadFirst) while at most 15 % were, the
    /// [`Function`](Self::Function) in between and to begin with. A steady
    /// stream of new messages and a redelivery storm each get their cheaper
    /// statement; a steady mixed load pays no second round trip. (About 32
    /// keys decide: batches of 100 that alternate between all fresh and all
    /// duplicates pay the second statement each.)
    #[default]
    Adaptive,
    /// The reservation function for every reservation: one round trip always.
    Function,
    /// A plain insert first; the function when the key exists.
    InsertFirst,
    /// A plain read first; the function when it does not answer.
    ReadFirst,
}

impl ReservePlan {
    /// The name used in URLs (`reserve_plan=…`) and by [`FromStr`].
    pub fn as_str(self) -> &'static str {
        match self {
            ReservePlan::Adaptive => "adaptive",
            ReservePlan::Function => "function",
            ReservePlan::InsertFirst => "insert-first",
            ReservePlan::ReadFirst => "read-first",
        }
    }

    const ALL: [ReservePlan; 4] = [
        ReservePlan::Adaptive,
        ReservePlan::Function,
        ReservePlan::InsertFirst,
        ReservePlan::ReadFirst,
    ];
}

impl fmt::Display for ReservePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ReservePlan {
    type Err = Error;

    /// `adaptive`, `function`, `insert-first` or `read-first`.
    fn from_str(s: &str) -> Result<Self, Error> {
        ReservePlan::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                Error::config(format!(
                    "invalid PostgreSQL reserve plan {s:?}: expected adaptive, function, \
                     insert-first or read-first"
                ))
            })
    }
}

/// The statement a reservation starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum First {
    Function,
    Insert,
    Read,
}

/// A [`ReservePlan`] and, for the adaptive one, the recent share of fresh
/// keys.
#[derive(Debug)]
pub(crate) struct Planner {
    plan: ReservePlan,
    share: FreshShare,
}

impl Planner {
    pub(crate) fn new(plan: ReservePlan) -> Self {
        Planner {
            plan,
            share: FreshShare::new(),
        }
    }

    /// The statement the next reservation starts with.
    pub(crate) fn first(&self) -> First {
        match self.plan {
            ReservePlan::Function => First::Function,
            ReservePlan::InsertFirst => First::Insert,
            ReservePlan::ReadFirst => First::Read,
            ReservePlan::Adaptive if self.share.mostly_fresh() => First::Insert,
            ReservePlan::Adaptive if self.share.mostly_duplicates() => First::Read,
            ReservePlan::Adaptive => First::Function,
        }
    }

    /// Counts a reservation's answer into the share of fresh keys (see
    /// [`FreshShare::observe`]).
    pub(crate) fn observe(&self, answer: &Reservation) {
        if self.plan == ReservePlan::Adaptive {
            self.share.observe(answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_core::{OwnerToken, Record, Status, Timestamp};

    fn existing() -> Reservation {
        let now = Timestamp::from_millis(1_000);
        Reservation::Existing(Record {
            status: Status::Completed,
            owner: OwnerToken::random(),
            attempt: 1,
            fingerprint: None,
            result: Some(b"r".to_vec()),
            error: None,
            retryable: false,
            lease_until: now,
            expires_at: now,
            created_at: now,
            updated_at: now,
        })
    }

    fn fresh() -> Reservation {
        Reservation::Acquired { attempt: 1 }
    }

    fn run(p: &Planner, answer: &Reservation, times: usize) {
        for _ in 0..times {
            p.observe(answer);
        }
    }

    #[test]
    fn adaptive_begins_with_the_function_and_follows_the_mix() {
        let p = Planner::new(ReservePlan::Adaptive);
        assert_eq!(p.first(), First::Function);
        // A few answers do not move it: a short burst keeps one round trip.
        run(&p, &fresh(), 10);
        assert_eq!(p.first(), First::Function);
        run(&p, &fresh(), 60);
        assert_eq!(p.first(), First::Insert);
        // A redelivery storm turns it over to reads within about 100 answers.
        run(&p, &existing(), 40);
        assert_eq!(p.first(), First::Function);
        run(&p, &existing(), 60);
        assert_eq!(p.first(), First::Read);
        // Takeovers pull it back to the function.
        run(&p, &Reservation::Acquired { attempt: 3 }, 100);
        assert_eq!(p.first(), First::Function);
    }

    #[test]
    fn a_steady_mix_stays_where_the_guess_pays() {
        // 19 fresh keys in 20 (95 %): the insert goes first.
        let p = Planner::new(ReservePlan::Adaptive);
        for i in 0..2_000 {
            p.observe(&if i % 20 == 0 { existing() } else { fresh() });
        }
        assert_eq!(p.first(), First::Insert);
        // Half and half: the function, whatever the order.
        let p = Planner::new(ReservePlan::Adaptive);
        for i in 0..2_000 {
            p.observe(&if i % 2 == 0 { existing() } else { fresh() });
            assert_eq!(p.first(), First::Function, "after {i}");
        }
    }

    #[test]
    fn fixed_plans_ignore_answers() {
        for (plan, first) in [
            (ReservePlan::Function, First::Function),
            (ReservePlan::InsertFirst, First::Insert),
            (ReservePlan::ReadFirst, First::Read),
        ] {
            let p = Planner::new(plan);
            run(&p, &existing(), 200);
            run(&p, &fresh(), 5);
            assert_eq!(p.first(), first, "{plan}");
        }
    }

    #[test]
    fn names_round_trip_and_typos_are_config_errors() {
        for plan in ReservePlan::ALL {
            assert_eq!(plan.as_str().parse::<ReservePlan>().unwrap(), plan);
        }
        match "insert_first".parse::<ReservePlan>() {
            Err(Error::Config { message }) => {
                assert!(message.contains("insert-first"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }
}
