//! The store: the in-memory store's decision logic applied to the model's
//! record. Every decision is the core's own function
//! (`decision::reserve_transition`, `decision::reserved_record`,
//! `decision::holds`, `decision::finish_record`, `decision::extend_record`,
//! and the request from `stages::reserve_request`), sequenced exactly as
//! `MemoryRepository` sequences them; only a [`Broken`] parameter swaps one
//! out.

use std::time::Duration;

use idempotency_core::decision::{
    extend_record, finish_record, holds, reserve_transition, reserved_record, ReserveTransition,
};
use idempotency_core::stages::reserve_request;
use idempotency_core::{Record, Status, Timestamp};

use crate::config::{at, Broken};
use crate::model::IdempotencyModel;
use crate::state::{Answer, Life, Op, RecordView, Request, State};

impl IdempotencyModel {
    /// Applies `req` to the store; the reply to send back.
    pub(crate) fn apply(&self, state: &mut State, req: &Request) -> Answer {
        let now = at(req.now);
        match req.op {
            Op::Reserve => self.reserve(state, req, now),
            Op::Get => {
                if state.record.as_ref().is_some_and(|r| r.is_expired(now)) {
                    state.record = None;
                }
                Answer::Got(state.record.clone().map(|r| Box::new(RecordView(r))))
            }
            Op::Complete => {
                let expires_at = now + self.core.ttl;
                self.owned_write(state, req, now, |r| {
                    finish_record(r, Status::Completed, None, false, expires_at, now);
                    true
                })
            }
            Op::Fail { retryable } => {
                let expires_at = now + self.core.ttl;
                self.owned_write(state, req, now, |r| {
                    finish_record(r, Status::Failed, Some(b"e"), retryable, expires_at, now);
                    true
                })
            }
            Op::Release => self.owned_write(state, req, now, |_| false),
            Op::Extend => {
                // As the lease keeper asks (engine/lease.rs).
                let until = now + self.core.processing_timeout;
                let expires_at = until + self.core.clock_skew;
                self.owned_write(state, req, now, |r| {
                    extend_record(r, until, expires_at, now);
                    true
                })
            }
        }
    }

    fn reserve(&self, state: &mut State, req: &Request, now: Timestamp) -> Answer {
        let mut request = reserve_request(&self.core, &self.key, req.owner, None, now);
        if self.config.broken == Some(Broken::TakeoverWithoutSkew) {
            request.clock_skew = Duration::ZERO;
        }
        let existing = state.record.as_ref();
        let (replacement, answer) = match reserve_transition(existing, &request) {
            ReserveTransition::Create => {
                state.lives.push(Life::default());
                (
                    Some(reserved_record(None, &request, 1)),
                    Answer::Acquired(1),
                )
            }
            ReserveTransition::Takeover { attempt } => (
                Some(reserved_record(existing, &request, attempt)),
                Answer::Acquired(attempt),
            ),
            ReserveTransition::AlreadyHeld { attempt } => (None, Answer::Acquired(attempt)),
            ReserveTransition::Existing => match existing {
                Some(r) => {
                    let life = life_index(state);
                    (
                        None,
                        Answer::Existing(Box::new(RecordView(r.clone())), life),
                    )
                }
                None => (None, Answer::LeaseLost),
            },
        };
        if let Some(record) = replacement {
            state.record = Some(normalized(record));
        }
        answer
    }

    /// An owner-checked write (`MemoryRepository::with_owned`): `f` applies
    /// it and says whether to keep the record.
    fn owned_write(
        &self,
        state: &mut State,
        req: &Request,
        now: Timestamp,
        f: impl FnOnce(&mut Record) -> bool,
    ) -> Answer {
        let Some(record) = state.record.as_mut() else {
            return Answer::LeaseLost;
        };
        let applies = match (self.config.broken, &req.op) {
            (Some(Broken::OwnerUncheckedComplete), Op::Complete) => {
                !record.is_expired(now) && record.status == Status::Processing
            }
            _ => holds(record, req.owner, now),
        };
        if !applies {
            return Answer::LeaseLost;
        }
        // Ghost, the model's own truth rather than the decision's: the
        // writer is not the one holding the record.
        if record.owner != req.owner || record.status != Status::Processing {
            state.stale_write = true;
        }
        if matches!(req.op, Op::Complete | Op::Fail { .. }) {
            for c in state.consumers.iter_mut().filter(|c| c.owner == req.owner) {
                c.recorded = true;
            }
        }
        if f(record) {
            *record = normalized(record.clone());
        } else {
            state.record = None;
        }
        Answer::Ok
    }
}

/// The current life's index (ghost).
pub(crate) fn life_index(state: &State) -> u8 {
    u8::try_from(state.lives.len().saturating_sub(1)).unwrap_or(u8::MAX)
}

/// The record without its bookkeeping instants (`created_at`,
/// `updated_at`), which no decision reads: states that differ only there
/// are one state to the checker.
fn normalized(mut record: Record) -> Record {
    record.created_at = Timestamp::EPOCH;
    record.updated_at = Timestamp::EPOCH;
    record
}
