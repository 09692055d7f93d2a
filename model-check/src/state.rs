//! The model's state: the store's one record, the consumers, the messages in
//! flight, and the ghost variables the properties read.

use idempotency_core::decision::FinishWrite;
use idempotency_core::{OwnerToken, Record};

/// The owner token of a consumer's `delivery`-th execution.
pub fn owner_token(consumer: u8, delivery: u8) -> OwnerToken {
    OwnerToken::from_u128(u128::from(consumer) * 16 + u128::from(delivery) + 1)
}

/// A store operation, with the sender's clock when it was sent.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// `reserve`, built by the library's `reserve_request` at `now`.
    Reserve,
    /// `complete` (no cached result), expiry `now + ttl`.
    Complete,
    /// `fail`, expiry `now + ttl`.
    Fail {
        /// Whether a later delivery may take the failure over.
        retryable: bool,
    },
    /// `release`.
    Release,
    /// `extend` to `now + processing_timeout`, expiry that plus the skew.
    Extend,
    /// `get`, after a `LeaseLost`.
    Get,
}

/// A request on its way to the store.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    /// The sending consumer.
    pub from: u8,
    /// Its call number within the execution (replies to calls it gave up
    /// are discarded).
    pub call: u8,
    /// The owner token it acts for.
    pub owner: OwnerToken,
    /// The sender's clock (ticks) when it was sent.
    pub now: u8,
    /// The operation.
    pub op: Op,
    /// Delayed (a fault): it may land after the tick it was sent in. A
    /// round trip otherwise takes less than a tick.
    pub delayed: bool,
}

/// The store's answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answer {
    /// `reserve`: acquired with this attempt.
    Acquired(u32),
    /// `reserve`: an existing record (boxed: the rest are small), and
    /// (ghost) the life it belongs to.
    Existing(Box<RecordView>, u8),
    /// An owner-checked write applied.
    Ok,
    /// An owner-checked write refused.
    LeaseLost,
    /// `get`: the live record, if any.
    Got(Option<Box<RecordView>>),
}

/// A record as a reply carries it (ordered, so replies can be kept sorted).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordView(pub Record);

impl PartialOrd for RecordView {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RecordView {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let key = |r: &Record| {
            (
                r.status.code(),
                r.owner,
                r.attempt,
                r.lease_until,
                r.expires_at,
                r.retryable,
            )
        };
        key(&self.0).cmp(&key(&other.0))
    }
}

/// A reply on its way back.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Reply {
    /// The consumer it goes to.
    pub to: u8,
    /// The owner whose call it answers.
    pub owner: OwnerToken,
    /// The call it answers.
    pub call: u8,
    /// The answer.
    pub answer: Answer,
}

/// What a delivery was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The handler ran and its completion is recorded.
    Executed,
    /// A duplicate: the stored outcome (`Cached`/`Duplicate`).
    Duplicate,
    /// Answered from the local answer cache, no store call.
    LocalAnswer,
    /// Another attempt holds a live lease.
    InProgress,
    /// The earlier attempt failed and stored it.
    PreviouslyFailed,
    /// The handler failed; its failure was recorded (released or stored).
    HandlerFailed {
        /// Released (a redelivery runs again) rather than stored.
        released: bool,
    },
    /// The work was done, another owner holds the key.
    LeaseLost,
    /// The outcome could not be recorded before the lease ended.
    Unrecorded,
    /// The store failed (fail-closed).
    StoreError,
    /// The caller dropped the execution.
    Dropped,
}

impl Outcome {
    /// Whether the broker delivers it again (contract §6: not acknowledged).
    pub fn redelivered(self) -> bool {
        matches!(
            self,
            Outcome::InProgress
                | Outcome::StoreError
                | Outcome::Dropped
                | Outcome::HandlerFailed { released: true }
        )
    }
}

/// Where a consumer's current execution is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Phase {
    /// No execution (before a redelivery).
    Idle,
    /// Reserving: `tries` re-sends so far; `unsettled` the lease an earlier
    /// attempt that failed ambiguously asked for (the lease counts from it).
    Reserving {
        /// Re-sends so far.
        tries: u8,
        /// The earliest ambiguous attempt's `lease_until` (ticks, own clock).
        unsettled: Option<u8>,
        /// The current attempt's `lease_until`.
        lease_until: u8,
    },
    /// The handler runs.
    Running,
    /// Recording `write`; `background` once the caller has gone.
    Recording {
        /// The write.
        write: FinishWrite,
        /// Retries so far.
        tries: u8,
        /// Waiting for the `get` that checks a `LeaseLost`.
        checking: bool,
        /// The caller dropped it (or the reserve failed): a cleanup.
        background: bool,
        /// A second release follows (a reserve of ours may still land).
        again: bool,
    },
    /// The execution ended.
    Done,
    /// The process crashed.
    Crashed,
}

/// One consumer process.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Consumer {
    /// Deliveries started.
    pub delivered: u8,
    /// The current execution's owner token.
    pub owner: OwnerToken,
    /// Its phase.
    pub phase: Phase,
    /// The answer its delivery got, once it has one.
    pub answer: Option<Outcome>,
    /// The call the execution waits for.
    pub call: Option<u8>,
    /// The lease keeper's call in flight, if any.
    pub keeper: Option<u8>,
    /// The next call number.
    pub next_call: u8,
    /// The lease's end as confirmed (ticks, own clock); 0 before.
    pub deadline: u8,
    /// The latest lease a reserve of ours asked for (ticks, own clock).
    pub may_hold: u8,
    /// The keeper saw `LeaseLost`.
    pub lost: bool,
    /// When the keeper last sent (it never sends twice in a tick).
    pub extended_at: Option<u8>,
    /// Ghost: the handler's effect happened in this execution, in this life.
    pub effect: Option<u8>,
    /// Ghost: its completion (or failure) landed.
    pub recorded: bool,
    /// When recording began (own clock) and the expiry the first
    /// completion asked for: the answer cache's entry.
    pub written: Option<(u8, u8)>,
    /// The local answer cache's entry: serve until (ticks, own clock), and
    /// the record life it came from (ghost).
    pub cache: Option<(u8, u8)>,
}

impl Consumer {
    /// A consumer whose first delivery has not started.
    pub fn new(index: u8) -> Self {
        Consumer {
            delivered: 0,
            owner: owner_token(index, 0),
            phase: Phase::Idle,
            answer: None,
            call: None,
            keeper: None,
            next_call: 0,
            deadline: 0,
            may_hold: 0,
            lost: false,
            extended_at: None,
            effect: None,
            recorded: false,
            written: None,
            cache: None,
        }
    }

    /// Whether an execution is under way (its owner may still write).
    pub fn live(&self) -> bool {
        matches!(
            self.phase,
            Phase::Reserving { .. } | Phase::Running | Phase::Recording { .. }
        )
    }
}

/// Ghost: one life of the record (from its creation to its expiry or
/// release).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Life {
    /// Handler effects attributed to it.
    pub effects: u8,
    /// A holder's effect whose outcome was not recorded before its lease
    /// ended (a crash, a lost or late completion): the contract's condition
    /// "the completion can be recorded before the lease ends" failed, and a
    /// later attempt running the handler again is the documented outcome.
    pub excused: bool,
}

/// The whole model state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// True time, in ticks.
    pub now: u8,
    /// The store's record (physically: an expired one stays until replaced).
    pub record: Option<Record>,
    /// The consumers.
    pub consumers: Vec<Consumer>,
    /// Requests on their way to the store (sorted).
    pub requests: Vec<Request>,
    /// Replies on their way back, late (sorted): a reply that is not late
    /// reaches its consumer in the step the store applies the request.
    pub replies: Vec<Reply>,
    /// Faults left.
    pub faults: u8,
    /// Crashes left.
    pub crashes: u8,
    /// Drops left.
    pub drops: u8,
    /// Ghost: the record's lives; the last is the current one while a
    /// record is stored.
    pub lives: Vec<Life>,
    /// Ghost: since when (true time) the record is `Processing` under an
    /// owner with no live execution, and that owner.
    pub orphaned: Option<(OwnerToken, u8)>,
    /// Ghost: a handler effect happened while its consumer did not hold
    /// the record.
    pub stale_effect: bool,
    /// Ghost: an owner-checked write landed for an owner that does not hold
    /// the record.
    pub stale_write: bool,
    /// Ghost: the local answer cache answered for a record that is no
    /// longer the live completed one on every clock.
    pub stale_answer: bool,
}
