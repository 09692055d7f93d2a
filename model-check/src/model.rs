//! The model: consumers running the engine's stages against the store, with
//! every decision taken by idempotency-core's own functions.

use idempotency_core::decision::DropPhase;
use idempotency_core::{Config, Error, RecordKey};
use stateright::{Model, Property};

use crate::config::{Broken, ModelConfig};
use crate::state::{Consumer, Life, Op, Outcome, Phase, Reply, Request, State};

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
            let time_box = self.config.broken != Some(Broken::NoTimeBox);
            if let Some(call) = c.call {
                if time_box && !Self::on_time(state, c, call) {
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
                self.settle(&mut state, i, Phase::Crashed);
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
