//! The consumers' side of the model: the engine's stages (reserve and its
//! re-sends, the handler under its lease, recording and its retries, the
//! guard of a dropped execution, the local answer cache), each decision by
//! the core's own function.

use idempotency_core::decision::{
    answer_serve_until, cached_answer, decide_duplicate, failure_action, finish_margin,
    finished_by, on_drop, DropAction, DropPhase, DuplicateDecision, FailureAction, FailureKind,
    FinishWrite,
};
use idempotency_core::stages::RESERVE_RETRIES;
use idempotency_core::{Status, Timestamp};

use crate::config::{at, TICK_MS};
use crate::model::IdempotencyModel;
use crate::state::{owner_token, Answer, Consumer, Op, Outcome, Phase, Reply, Request, State};
use crate::store::life_index;

impl IdempotencyModel {
    pub(crate) fn pt(&self) -> u8 {
        self.config.processing_timeout
    }

    /// Sends `op` for consumer `i`: as its execution's call, or its keeper's.
    pub(crate) fn send(&self, state: &mut State, i: u8, op: Op, keeper: bool) {
        let now = self.local(state, i);
        let c = &mut state.consumers[usize::from(i)];
        let call = c.next_call;
        c.next_call += 1;
        if keeper {
            c.keeper = Some(call);
        } else {
            c.call = Some(call);
        }
        state.requests.push(Request {
            from: i,
            call,
            owner: c.owner,
            now,
            op,
            delayed: false,
        });
        state.requests.sort();
    }

    pub(crate) fn send_write(&self, state: &mut State, i: u8, write: FinishWrite) {
        let op = match write {
            FinishWrite::Complete => Op::Complete,
            FinishWrite::Release => Op::Release,
            FinishWrite::Fail => {
                match failure_action(FailureKind::Default, self.core.failure_policy) {
                    FailureAction::StoreFailed { retryable } => Op::Fail { retryable },
                    FailureAction::Release => Op::Release,
                }
            }
        };
        self.send(state, i, op, false);
    }

    pub(crate) fn answer(state: &mut State, i: u8, outcome: Outcome) {
        let c = &mut state.consumers[usize::from(i)];
        if c.answer.is_none() {
            c.answer = Some(outcome);
        }
    }

    pub(crate) fn end(&self, state: &mut State, i: u8) {
        self.settle(state, i, Phase::Done);
    }

    /// The execution ends (`Done`) or its process crashes, and what no
    /// longer matters is cleared, so that states that differ only there are
    /// one. An effect whose outcome is not recorded excuses its life if the
    /// process crashed or the lease has ended on its own clock (the
    /// contract's condition "the completion can be recorded before the lease
    /// ends" failed); not if its completion was refused while its lease was
    /// still live — that is a takeover of a live lease.
    pub(crate) fn settle(&self, state: &mut State, i: u8, phase: Phase) {
        let local = self.local(state, i);
        let c = &state.consumers[usize::from(i)];
        let lease_over = phase == Phase::Crashed || local >= c.deadline;
        if let (Some(life), false, true) = (c.effect, c.recorded, lease_over) {
            if let Some(l) = state.lives.get_mut(usize::from(life)) {
                l.excused = true;
            }
        }
        let c = &mut state.consumers[usize::from(i)];
        *c = Consumer {
            delivered: c.delivered,
            owner: c.owner,
            phase,
            answer: c.answer,
            cache: c.cache,
            ..Consumer::new(i)
        };
    }

    /// A reserve attempt with this consumer's clock.
    pub(crate) fn send_reserve(&self, state: &mut State, i: u8, tries: u8, unsettled: Option<u8>) {
        let lease_until = self.local(state, i) + self.pt();
        let c = &mut state.consumers[usize::from(i)];
        c.may_hold = c.may_hold.max(lease_until);
        c.phase = Phase::Reserving {
            tries,
            unsettled,
            lease_until,
        };
        self.send(state, i, Op::Reserve, false);
    }

    /// The execution guard's drop (engine/guard.rs), by `decision::on_drop`.
    pub(crate) fn guard_drops(&self, state: &mut State, i: u8, phase: DropPhase, again: bool) {
        let c = &mut state.consumers[usize::from(i)];
        c.keeper = None;
        c.call = None;
        let pending = match &c.phase {
            Phase::Recording { write, .. } => Some(*write),
            _ => None,
        };
        let write = match (on_drop(phase, self.core.on_cancel), pending) {
            (DropAction::Keep, _) => return self.end(state, i),
            (DropAction::Record, Some(write)) => write,
            (DropAction::Release | DropAction::Record, _) => FinishWrite::Release,
        };
        let again = again && write == FinishWrite::Release;
        c.phase = Phase::Recording {
            write,
            tries: 0,
            checking: false,
            background: true,
            again,
        };
        self.send_write(state, i, write);
    }

    /// Whether a finishing write may be tried again (engine/finish.rs):
    /// always the second attempt, later ones only before the lease's end
    /// minus `decision::finish_margin`. A cleanup follows the latest lease
    /// a reserve of ours may have taken.
    pub(crate) fn may_retry(&self, state: &State, i: u8, tries: u8, background: bool) -> bool {
        let c = &state.consumers[usize::from(i)];
        let end = if background {
            c.deadline.max(c.may_hold)
        } else {
            c.deadline
        };
        let until = at(end).saturating_sub(finish_margin(self.core.processing_timeout));
        tries == 0 || at(self.local(state, i)) < until
    }

    pub(crate) fn on_reply(&self, state: &mut State, i: u8, answer: Answer) {
        let local = self.local(state, i);
        let c = state.consumers[usize::from(i)].clone();
        match (c.phase.clone(), answer) {
            (
                Phase::Reserving {
                    unsettled,
                    lease_until,
                    ..
                },
                Answer::Acquired(_),
            ) => {
                let c = &mut state.consumers[usize::from(i)];
                c.call = None;
                // The lease counts from the earliest attempt that may have
                // been applied (engine/reserve.rs).
                c.deadline = unsettled.unwrap_or(lease_until);
                c.phase = Phase::Running;
                if local >= c.deadline {
                    // Confirmed after its lease ended: not run (manager).
                    Self::answer(state, i, Outcome::StoreError);
                    self.guard_drops(state, i, DropPhase::Reserving, unsettled.is_some());
                }
            }
            (
                Phase::Reserving {
                    unsettled,
                    lease_until,
                    ..
                },
                Answer::Existing(record, life),
            ) => {
                let record = record.0;
                if record.status == Status::Completed {
                    let sent_at = lease_until - self.pt();
                    self.remember(state, i, record.expires_at, sent_at, life);
                }
                let decision = decide_duplicate(record, None, at(local), self.core.clock_skew);
                Self::answer(state, i, duplicate_outcome(&decision));
                if unsettled.is_some() {
                    self.guard_drops(state, i, DropPhase::Reserving, true);
                } else {
                    self.end(state, i);
                }
            }
            (Phase::Recording { write, .. }, Answer::Ok) => self.applied(state, i, write),
            (
                Phase::Recording {
                    write,
                    tries,
                    background,
                    again,
                    ..
                },
                Answer::LeaseLost,
            ) => {
                state.consumers[usize::from(i)].phase = Phase::Recording {
                    write,
                    tries,
                    checking: true,
                    background,
                    again,
                };
                self.send(state, i, Op::Get, false);
            }
            (Phase::Recording { write, .. }, Answer::Got(record)) => {
                let record = record.map(|r| r.0);
                if finished_by(record.as_ref(), c.owner, write) {
                    self.applied(state, i, write);
                } else {
                    let outcome = match write {
                        FinishWrite::Complete => Outcome::LeaseLost,
                        w => Outcome::HandlerFailed {
                            released: w == FinishWrite::Release,
                        },
                    };
                    Self::answer(state, i, outcome);
                    self.end(state, i);
                }
            }
            // Nothing else is sent by the phase that waits for it.
            _ => {}
        }
    }

    pub(crate) fn remember(
        &self,
        state: &mut State,
        i: u8,
        expires_at: Timestamp,
        read_at: u8,
        life: u8,
    ) {
        let (Some(cache), skew) = (self.core.answer_cache, self.core.clock_skew) else {
            return;
        };
        if let Some(until) = answer_serve_until(expires_at, at(read_at), skew, cache.max_staleness)
        {
            let ticks = until.as_millis().div_ceil(TICK_MS);
            state.consumers[usize::from(i)].cache =
                Some((u8::try_from(ticks).unwrap_or(u8::MAX), life));
        }
    }

    pub(crate) fn applied(&self, state: &mut State, i: u8, write: FinishWrite) {
        let c = state.consumers[usize::from(i)].clone();
        let Phase::Recording {
            background, again, ..
        } = c.phase
        else {
            return;
        };
        let outcome = match write {
            FinishWrite::Complete => {
                if let (Some((written_at, expires)), Some(life)) = (c.written, c.effect) {
                    self.remember(state, i, at(expires), written_at, life);
                }
                Outcome::Executed
            }
            w => Outcome::HandlerFailed {
                released: w == FinishWrite::Release,
            },
        };
        if !background {
            Self::answer(state, i, outcome);
        }
        if again {
            // The guard's second release (engine/guard.rs): a reserve of
            // ours may still land after the first.
            let c = &mut state.consumers[usize::from(i)];
            c.phase = Phase::Recording {
                write: FinishWrite::Release,
                tries: 0,
                checking: false,
                background: true,
                again: false,
            };
            self.send_write(state, i, FinishWrite::Release);
        } else {
            self.end(state, i);
        }
    }

    /// The call timed out (ambiguous: it may have been applied).
    pub(crate) fn gave_up(&self, state: &mut State, i: u8) {
        let c = state.consumers[usize::from(i)].clone();
        state.consumers[usize::from(i)].call = None;
        match c.phase {
            Phase::Reserving {
                tries,
                unsettled,
                lease_until,
            } => {
                let unsettled = unsettled.or(Some(lease_until));
                if u32::from(tries) < RESERVE_RETRIES {
                    self.send_reserve(state, i, tries + 1, unsettled);
                } else {
                    // Fail-closed: the store's error; the guard releases
                    // what a lost reply may have created.
                    Self::answer(state, i, Outcome::StoreError);
                    self.guard_drops(state, i, DropPhase::Reserving, true);
                }
            }
            Phase::Recording {
                write,
                tries,
                checking,
                background,
                again,
            } => {
                if !checking && self.may_retry(state, i, tries, background) {
                    state.consumers[usize::from(i)].phase = Phase::Recording {
                        write,
                        tries: tries + 1,
                        checking: false,
                        background,
                        again,
                    };
                    self.send_write(state, i, write);
                } else {
                    let outcome = match write {
                        FinishWrite::Complete => Outcome::Unrecorded,
                        w => Outcome::HandlerFailed {
                            released: w == FinishWrite::Release,
                        },
                    };
                    Self::answer(state, i, outcome);
                    self.end(state, i);
                }
            }
            _ => {}
        }
    }

    pub(crate) fn deliver(&self, state: &mut State, i: u8) {
        let local = self.local(state, i);
        let c = &mut state.consumers[usize::from(i)];
        if c.phase == Phase::Crashed {
            // A new process: nothing of the old one's memory.
            c.cache = None;
        }
        let cache = c.cache;
        *c = Consumer {
            delivered: c.delivered + 1,
            owner: owner_token(i, c.delivered),
            cache,
            ..Consumer::new(i)
        };
        if let Some((serve_until, life)) = cache {
            if cached_answer(None, None, at(serve_until), None, at(local)).is_some() {
                // Ghost: the answer's record must still be the live completed
                // one, on every consumer's clock.
                let latest = state.now + self.config.clock_offsets.iter().max().unwrap_or(&0);
                let live = matches!(&state.record, Some(r) if r.status == Status::Completed
                    && r.expires_at > at(latest));
                if !live || life_index(state) != life {
                    state.stale_answer = true;
                }
                Self::answer(state, i, Outcome::LocalAnswer);
                return self.end(state, i);
            }
            state.consumers[usize::from(i)].cache = None;
        }
        self.send_reserve(state, i, 0, None);
    }

    pub(crate) fn effect(&self, state: &mut State, i: u8) {
        let local = self.local(state, i);
        let owner = state.consumers[usize::from(i)].owner;
        let holds =
            matches!(&state.record, Some(r) if r.owner == owner && r.status == Status::Processing);
        let life = life_index(state);
        if holds {
            if let Some(l) = state.lives.last_mut() {
                l.effects += 1;
            }
        } else {
            state.stale_effect = true;
        }
        let c = &mut state.consumers[usize::from(i)];
        c.effect = Some(life);
        if self.config.answer_cache.is_some() {
            c.written = Some((local, local + self.config.ttl));
        }
        c.phase = Phase::Recording {
            write: FinishWrite::Complete,
            tries: 0,
            checking: false,
            background: false,
            again: false,
        };
        self.send_write(state, i, FinishWrite::Complete);
    }

    pub(crate) fn handler_fails(&self, state: &mut State, i: u8) {
        let write = match failure_action(FailureKind::Default, self.core.failure_policy) {
            FailureAction::Release => FinishWrite::Release,
            FailureAction::StoreFailed { .. } => FinishWrite::Fail,
        };
        state.consumers[usize::from(i)].phase = Phase::Recording {
            write,
            tries: 0,
            checking: false,
            background: false,
            again: false,
        };
        self.send_write(state, i, write);
    }

    /// Ghosts kept after every step: a holder whose effect is not recorded
    /// once its lease ended (or that crashed) excuses its life; whether the
    /// record is orphaned.
    pub(crate) fn update_ghosts(&self, state: &mut State) {
        for i in 0..state.consumers.len() {
            let local = self.local(state, i as u8);
            let c = &state.consumers[i];
            if let (Some(life), false) = (c.effect, c.recorded) {
                if c.phase == Phase::Crashed || local >= c.deadline {
                    if let Some(l) = state.lives.get_mut(usize::from(life)) {
                        l.excused = true;
                    }
                }
            }
        }
        let orphan = match &state.record {
            Some(r) if r.status == Status::Processing => {
                let held = state
                    .consumers
                    .iter()
                    .any(|c| c.owner == r.owner && c.live());
                (!held).then_some(r.owner)
            }
            _ => None,
        };
        state.orphaned = match (orphan, state.orphaned) {
            (Some(owner), Some((o, since))) if o == owner => Some((o, since)),
            (Some(owner), _) => Some((owner, state.now)),
            (None, _) => None,
        };
    }

    /// Whether `c`'s request of `call` is on its way and on time: its
    /// reply comes within the time box, which is not given up before.
    pub(crate) fn on_time(state: &State, c: &Consumer, call: u8) -> bool {
        state
            .requests
            .iter()
            .any(|r| r.owner == c.owner && r.call == call && !r.delayed)
    }

    /// Consumer `reply.to` receives `reply` (if it still waits for it).
    pub(crate) fn receive(&self, state: &mut State, reply: Reply) {
        let c = &mut state.consumers[usize::from(reply.to)];
        if c.phase == Phase::Crashed || c.owner != reply.owner {
            return;
        }
        if c.keeper == Some(reply.call) {
            c.keeper = None;
            match reply.answer {
                Answer::Ok => {
                    let sent = c.extended_at.unwrap_or(0);
                    c.deadline = c.deadline.max(sent + self.config.processing_timeout);
                }
                Answer::LeaseLost => c.lost = true,
                _ => {}
            }
        } else if c.call == Some(reply.call) {
            c.call = None;
            self.on_reply(state, reply.to, reply.answer);
        }
    }
}

pub(crate) fn duplicate_outcome(decision: &DuplicateDecision) -> Outcome {
    match decision {
        DuplicateDecision::Replay(_) | DuplicateDecision::Duplicate => Outcome::Duplicate,
        DuplicateDecision::InProgress { .. } => Outcome::InProgress,
        DuplicateDecision::PreviouslyFailed(_) | DuplicateDecision::PayloadMismatch => {
            Outcome::PreviouslyFailed
        }
    }
}
