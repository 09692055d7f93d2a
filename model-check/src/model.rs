//! The model: consumers running the engine's stages against the store, with
//! every decision taken by idempotency-core's own functions.

use idempotency_core::decision::{
    answer_serve_until, cached_answer, decide_duplicate, failure_action, finish_margin,
    finished_by, on_drop, DropAction, DropPhase, DuplicateDecision, FailureAction, FailureKind,
    FinishWrite,
};
use idempotency_core::stages::RESERVE_RETRIES;
use idempotency_core::{Config, Error, RecordKey, Status, Timestamp};
use stateright::{Model, Property};

use crate::config::{at, ModelConfig, TICK_MS};
use crate::state::{
    owner_token, Answer, Consumer, Life, Op, Outcome, Phase, Reply, Request, State,
};
use crate::store::life_index;

/// One step of the model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// True time advances one tick (every clock with it), once every
    /// request in flight that is not delayed has landed.
    Tick,
    /// A request is delayed (a fault): it may land after later ticks.
    Delay(Request),
    /// Consumer `i` is delivered the key (again) and starts an execution.
    Deliver(u8),
    /// The store receives and applies a request, and its consumer receives
    /// the reply (discarded if it gave the call up).
    RoundTrip(Request),
    /// The store applies a request; its reply is late (a fault).
    ReplyLate(Request),
    /// A request is lost on its way (a fault).
    RequestLost(Request),
    /// A consumer receives a late reply (discarded if it gave the call up).
    Receives(Reply),
    /// A late reply is lost.
    ReplyLost(Reply),
    /// Consumer `i` gives up waiting for its call (its time box): once the
    /// request is lost, delayed, or applied with a late reply.
    GivesUp(u8),
    /// Consumer `i`'s lease keeper gives up waiting for its extension.
    KeeperGivesUp(u8),
    /// Consumer `i`'s handler applies its effect (only under a live lease)
    /// and returns success.
    Effect(u8),
    /// Consumer `i`'s handler returns an error (or stops: its lease is lost).
    HandlerFails(u8),
    /// Consumer `i`'s lease keeper sends an extension.
    Extends(u8),
    /// Consumer `i`'s process crashes.
    Crashes(u8),
    /// Consumer `i`'s caller drops the execution.
    Drops(u8),
}

/// The model checked: a [`ModelConfig`] with the library's configuration
/// and key.
#[derive(Debug, Clone)]
pub struct IdempotencyModel {
    /// The parameters.
    pub config: ModelConfig,
    /// The library's configuration (validated by it).
    pub core: Config,
    /// The key.
    pub key: RecordKey,
}

impl IdempotencyModel {
    /// The model for `config`.
    ///
    /// # Errors
    /// [`Error::Config`] when the library refuses the configuration.
    pub fn new(config: ModelConfig) -> Result<Self, Error> {
        Ok(IdempotencyModel {
            core: config.core_config()?,
            key: ModelConfig::key()?,
            config,
        })
    }

    /// Consumer `i`'s clock, in ticks.
    pub fn local(&self, state: &State, i: u8) -> u8 {
        state.now + self.config.clock_offsets[usize::from(i)]
    }

    fn pt(&self) -> u8 {
        self.config.processing_timeout
    }

    /// Sends `op` for consumer `i`: as its execution's call, or its keeper's.
    fn send(&self, state: &mut State, i: u8, op: Op, keeper: bool) {
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

    fn send_write(&self, state: &mut State, i: u8, write: FinishWrite) {
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

    fn answer(state: &mut State, i: u8, outcome: Outcome) {
        let c = &mut state.consumers[usize::from(i)];
        if c.answer.is_none() {
            c.answer = Some(outcome);
        }
    }

    fn end(state: &mut State, i: u8) {
        Self::settle(state, i, Phase::Done);
    }

    /// The execution ends (`Done`) or its process crashes: an effect whose
    /// outcome is not recorded excuses its life (the contract's condition
    /// failed), and what no longer matters is cleared, so that states that
    /// differ only there are one.
    fn settle(state: &mut State, i: u8, phase: Phase) {
        let c = &state.consumers[usize::from(i)];
        if let (Some(life), false) = (c.effect, c.recorded) {
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
    fn send_reserve(&self, state: &mut State, i: u8, tries: u8, unsettled: Option<u8>) {
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
    fn guard_drops(&self, state: &mut State, i: u8, phase: DropPhase, again: bool) {
        let c = &mut state.consumers[usize::from(i)];
        c.keeper = None;
        c.call = None;
        let pending = match &c.phase {
            Phase::Recording { write, .. } => Some(*write),
            _ => None,
        };
        let write = match (on_drop(phase, self.core.on_cancel), pending) {
            (DropAction::Keep, _) => return Self::end(state, i),
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
    fn may_retry(&self, state: &State, i: u8, tries: u8, background: bool) -> bool {
        let c = &state.consumers[usize::from(i)];
        let end = if background {
            c.deadline.max(c.may_hold)
        } else {
            c.deadline
        };
        let until = at(end).saturating_sub(finish_margin(self.core.processing_timeout));
        tries == 0 || at(self.local(state, i)) < until
    }

    fn on_reply(&self, state: &mut State, i: u8, answer: Answer) {
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
                    Self::end(state, i);
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
                    Self::end(state, i);
                }
            }
            // Nothing else is sent by the phase that waits for it.
            _ => {}
        }
    }

    fn remember(&self, state: &mut State, i: u8, expires_at: Timestamp, read_at: u8, life: u8) {
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

    fn applied(&self, state: &mut State, i: u8, write: FinishWrite) {
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
            Self::end(state, i);
        }
    }

    /// The call timed out (ambiguous: it may have been applied).
    fn gave_up(&self, state: &mut State, i: u8) {
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
                    Self::end(state, i);
                }
            }
            _ => {}
        }
    }

    fn deliver(&self, state: &mut State, i: u8) {
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
                return Self::end(state, i);
            }
            state.consumers[usize::from(i)].cache = None;
        }
        self.send_reserve(state, i, 0, None);
    }

    fn effect(&self, state: &mut State, i: u8) {
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

    fn handler_fails(&self, state: &mut State, i: u8) {
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
    fn update_ghosts(&self, state: &mut State) {
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
    fn on_time(state: &State, c: &Consumer, call: u8) -> bool {
        state
            .requests
            .iter()
            .any(|r| r.owner == c.owner && r.call == call && !r.delayed)
    }

    /// Consumer `reply.to` receives `reply` (if it still waits for it).
    fn receive(&self, state: &mut State, reply: Reply) {
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

fn duplicate_outcome(decision: &DuplicateDecision) -> Outcome {
    match decision {
        DuplicateDecision::Replay(_) | DuplicateDecision::Duplicate => Outcome::Duplicate,
        DuplicateDecision::InProgress { .. } => Outcome::InProgress,
        DuplicateDecision::PreviouslyFailed(_) | DuplicateDecision::PayloadMismatch => {
            Outcome::PreviouslyFailed
        }
    }
}

impl Model for IdempotencyModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let n = self.config.consumers();
        vec![State {
            now: 0,
            record: None,
            consumers: (0..n).map(|i| Consumer::new(i as u8)).collect(),
            requests: Vec::new(),
            replies: Vec::new(),
            faults: self.config.faults,
            crashes: self.config.crashes,
            drops: self.config.drops,
            lives: vec![Life::default()],
            orphaned: None,
            stale_effect: false,
            stale_write: false,
            stale_answer: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.now < self.config.max_time && state.requests.iter().all(|r| r.delayed) {
            actions.push(Action::Tick);
        }
        for r in &state.requests {
            actions.push(Action::RoundTrip(r.clone()));
            if state.faults > 0 {
                if !r.delayed {
                    actions.push(Action::Delay(r.clone()));
                }
                actions.push(Action::ReplyLate(r.clone()));
                actions.push(Action::RequestLost(r.clone()));
            }
        }
        for r in &state.replies {
            actions.push(Action::Receives(r.clone()));
            actions.push(Action::ReplyLost(r.clone()));
        }
        for (i, c) in state.consumers.iter().enumerate() {
            let i = i as u8;
            let local = self.local(state, i);
            let redeliverable = match c.phase {
                Phase::Idle | Phase::Crashed => true,
                Phase::Done => c.answer.is_some_and(Outcome::redelivered),
                _ => false,
            };
            if redeliverable && c.delivered < self.config.deliveries {
                actions.push(Action::Deliver(i));
            }
            if let Some(call) = c.call {
                if !Self::on_time(state, c, call) {
                    actions.push(Action::GivesUp(i));
                }
            }
            if let Some(call) = c.keeper {
                if !Self::on_time(state, c, call) {
                    actions.push(Action::KeeperGivesUp(i));
                }
            }
            let lease_live = !c.lost && local < c.deadline;
            if c.phase == Phase::Running {
                if lease_live {
                    actions.push(Action::Effect(i));
                }
                if self.config.handler_failures || !lease_live {
                    actions.push(Action::HandlerFails(i));
                }
            }
            let keeps = matches!(
                c.phase,
                Phase::Running
                    | Phase::Recording {
                        background: false,
                        ..
                    }
            );
            if self.config.extension
                && keeps
                && lease_live
                && c.keeper.is_none()
                && c.extended_at.is_none_or(|t| local > t)
            {
                actions.push(Action::Extends(i));
            }
            if c.live() {
                if state.crashes > 0 {
                    actions.push(Action::Crashes(i));
                }
                let foreground = !matches!(
                    c.phase,
                    Phase::Recording {
                        background: true,
                        ..
                    }
                );
                if state.drops > 0 && foreground {
                    actions.push(Action::Drops(i));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Tick => state.now += 1,
            Action::Deliver(i) => self.deliver(&mut state, i),
            Action::RoundTrip(req) => {
                state.requests.retain(|r| *r != req);
                let answer = self.apply(&mut state, &req);
                let reply = Reply {
                    to: req.from,
                    owner: req.owner,
                    call: req.call,
                    answer,
                };
                self.receive(&mut state, reply);
            }
            Action::ReplyLate(req) => {
                state.requests.retain(|r| *r != req);
                state.faults -= 1;
                let answer = self.apply(&mut state, &req);
                state.replies.push(Reply {
                    to: req.from,
                    owner: req.owner,
                    call: req.call,
                    answer,
                });
                state.replies.sort();
            }
            Action::Delay(req) => {
                state.faults -= 1;
                for r in state.requests.iter_mut().filter(|r| **r == req) {
                    r.delayed = true;
                }
                state.requests.sort();
            }
            Action::RequestLost(req) => {
                state.requests.retain(|r| *r != req);
                state.faults -= 1;
            }
            Action::ReplyLost(reply) => state.replies.retain(|r| *r != reply),
            Action::Receives(reply) => {
                state.replies.retain(|r| *r != reply);
                self.receive(&mut state, reply);
            }
            Action::GivesUp(i) => self.gave_up(&mut state, i),
            Action::KeeperGivesUp(i) => state.consumers[usize::from(i)].keeper = None,
            Action::Effect(i) => self.effect(&mut state, i),
            Action::HandlerFails(i) => self.handler_fails(&mut state, i),
            Action::Extends(i) => {
                let local = self.local(&state, i);
                state.consumers[usize::from(i)].extended_at = Some(local);
                self.send(&mut state, i, Op::Extend, true);
            }
            Action::Crashes(i) => {
                state.crashes -= 1;
                Self::settle(&mut state, i, Phase::Crashed);
            }
            Action::Drops(i) => {
                state.drops -= 1;
                Self::answer(&mut state, i, Outcome::Dropped);
                let phase = match state.consumers[usize::from(i)].phase {
                    Phase::Reserving { .. } => DropPhase::Reserving,
                    Phase::Running => DropPhase::Running,
                    _ => DropPhase::Recording,
                };
                // A reserve of ours may still land: the one it waited for.
                self.guard_drops(&mut state, i, phase, phase == DropPhase::Reserving);
            }
        }
        self.update_ghosts(&mut state);
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        crate::properties::all()
    }

    fn format_action(&self, action: &Action) -> String {
        crate::trace::describe(action)
    }
}
