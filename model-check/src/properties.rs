//! What the checker verifies, over every reachable state.

use idempotency_core::decision::{reserve_transition, ReserveTransition};
use idempotency_core::stages::reserve_request;
use idempotency_core::OwnerToken;
use stateright::{Model, Property};

use crate::config::at;
use crate::model::IdempotencyModel;
use crate::state::{Outcome, Phase, State};

/// Safety: at most one handler effect per record life, unless an earlier
/// effect's outcome could not be recorded before its lease ended (the
/// contract's own exception).
pub const ONE_EFFECT: &str = "at most one effect per record life";
/// Safety: a handler applies its effect only while its owner holds the
/// record (never after a takeover).
pub const NO_STALE_EFFECT: &str = "no effect after a takeover";
/// Safety: no owner-checked write lands for an owner that does not hold the
/// record.
pub const NO_STALE_WRITE: &str = "no stale owner's write lands";
/// Safety: the local answer cache answers only for the live completed
/// record, live on every consumer's clock.
pub const LOCAL_ANSWER_LIVE: &str = "a local answer is the live record's";
/// Bounded liveness: a `Processing` record whose owner's execution has
/// ended is free for every consumer once `processing_timeout + clock_skew`
/// (plus the clocks' spread) has passed.
pub const ORPHAN_FREED: &str = "a key held by nobody is free within lease + skew";
/// Bounded liveness (as safety on the bounded runs): where nothing more can
/// happen, every delivery has been answered and no execution is left.
pub const NOTHING_HANGS: &str = "nothing hangs when nothing more can happen";
/// Liveness: every delivery is eventually answered.
pub const EVERY_DELIVERY_ANSWERED: &str = "every delivery is eventually answered";

/// Reachability checks: the model is not vacuous.
pub const EXAMPLES: [&str; 4] = [
    "the handler's effect happens",
    "a takeover happens",
    "a duplicate is answered from the store",
    "a delivery is answered in progress",
];

/// Every property.
pub fn all() -> Vec<Property<IdempotencyModel>> {
    vec![
        Property::always(ONE_EFFECT, |_, s: &State| {
            s.lives.iter().all(|l| l.effects <= 1 || l.excused)
        }),
        Property::always(NO_STALE_EFFECT, |_, s: &State| !s.stale_effect),
        Property::always(NO_STALE_WRITE, |_, s: &State| !s.stale_write),
        Property::always(LOCAL_ANSWER_LIVE, |_, s: &State| !s.stale_answer),
        Property::always(ORPHAN_FREED, orphan_freed),
        Property::always(NOTHING_HANGS, |m: &IdempotencyModel, s: &State| {
            let mut actions = Vec::new();
            m.actions(s, &mut actions);
            !actions.is_empty() || settled(s)
        }),
        Property::eventually(EVERY_DELIVERY_ANSWERED, |_, s: &State| settled(s)),
        Property::sometimes(EXAMPLES[0], |_, s: &State| {
            s.lives.iter().any(|l| l.effects > 0)
        }),
        Property::sometimes(EXAMPLES[1], |_, s: &State| {
            s.record.as_ref().is_some_and(|r| r.attempt > 1)
        }),
        Property::sometimes(EXAMPLES[2], |_, s: &State| answered(s, Outcome::Duplicate)),
        Property::sometimes(EXAMPLES[3], |_, s: &State| answered(s, Outcome::InProgress)),
    ]
}

fn answered(s: &State, outcome: Outcome) -> bool {
    s.consumers.iter().any(|c| c.answer == Some(outcome))
}

/// Every consumer has been delivered the key, and each delivery is
/// answered (or its process crashed) with no execution left running.
fn settled(s: &State) -> bool {
    s.consumers
        .iter()
        .all(|c| c.delivered > 0 && !c.live() && (c.answer.is_some() || c.phase == Phase::Crashed))
}

/// [`ORPHAN_FREED`], by the core's own reservation rule on each consumer's
/// clock.
fn orphan_freed(m: &IdempotencyModel, s: &State) -> bool {
    let (Some((_, since)), Some(record)) = (s.orphaned, &s.record) else {
        return true;
    };
    let c = &m.config;
    let bound = u16::from(since)
        + u16::from(c.clock_spread())
        + u16::from(c.processing_timeout)
        + u16::from(c.clock_skew);
    if u16::from(s.now) < bound {
        return true;
    }
    (0..s.consumers.len()).all(|i| {
        let now = at(m.local(s, i as u8));
        let req = reserve_request(&m.core, &m.key, OwnerToken::from_u128(u128::MAX), None, now);
        matches!(
            reserve_transition(Some(record), &req),
            ReserveTransition::Create | ReserveTransition::Takeover { .. }
        )
    })
}
