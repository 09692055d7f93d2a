//! Coalescing: single reservations and completions that arrive while
//! [`coalesce_above`](crate::PgRepositoryBuilder::coalesce_above) of them
//! already have a statement in flight wait, and go together, in one statement
//! over arrays (the batch statements of `reserve_many` and `complete_many`),
//! as soon as one of those statements ends.
//!
//! Under load most of a one-statement operation's cost, on the client and on
//! the server, is the statement and its round trip, not the row: two send
//! calls, a wake-up, a parse-free bind and execute, a commit. Calls that would
//! each have waited for a connection or a CPU anyway share one instead. Below
//! the limit nothing changes (each call sends its own statement at once), so
//! coalescing adds no latency to a light load, and under load a call waits at
//! most for one statement to end before its own is sent.
//!
//! - **A slot per statement.** At most `limit` reservation or completion
//!   statements are in flight. A call that finds a slot free takes it and runs
//!   on its own, as without coalescing. A call that finds none waits in a
//!   queue. When a slot's statement ends and calls are waiting, the slot is
//!   handed to a task that sends them (completions first, then reservations;
//!   each kind in statements of up to [`MOST`] calls) until none wait, so no
//!   caller's cancellation strands the others.
//! - **The same answers.** A coalesced reservation is the reservation
//!   function's, per key, with its own caller's instants; a coalesced
//!   completion has `complete`'s conditions, with its own instant. One
//!   statement never carries a key twice (a second call for a key waits for
//!   the next statement). A statement's error is each of its calls' (an outage
//!   or a timeout: maybe applied, retried with the same owner token as for a
//!   single statement). A key locked past the batch statement's `lock_timeout`
//!   refuses the statement with nothing applied; its calls are then sent one by
//!   one.
//! - **Given up.** A caller that gives up while waiting is dropped from the
//!   queue before its statement is sent; one that gives up after is in the
//!   position of a single statement abandoned on the wire.

use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

use idempotency_core::{
    Completion, Error, Fingerprint, OwnerToken, RecordKey, Reservation, ReserveRequest, Timestamp,
};
use tokio::sync::oneshot;

/// The most calls one coalesced statement carries.
pub(crate) const MOST: usize = 128;

/// The default of [`coalesce_above`](crate::PgRepositoryBuilder::coalesce_above).
pub const DEFAULT_COALESCE_ABOVE: usize = 4;

/// The slots and the queues of one repository (shared by its clones).
pub(crate) struct Coalescer {
    /// How many statements may be in flight before calls wait; 0: off.
    limit: usize,
    /// Tests: every call, also alone, goes through the statements over arrays.
    over_arrays: bool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Slots taken: calls running on their own and tasks sending waiters.
    in_flight: usize,
    reserves: VecDeque<Waiting<ReserveCall, Reservation>>,
    completes: VecDeque<Waiting<CompleteCall, ()>>,
}

/// A call waiting in a queue, and where its answer goes.
pub(crate) struct Waiting<C, A> {
    pub(crate) call: C,
    answer: oneshot::Sender<Result<A, Error>>,
}

impl<C, A> Waiting<C, A> {
    /// A call that waits for the answer the receiver gets.
    pub(crate) fn new(call: C) -> (Self, oneshot::Receiver<Result<A, Error>>) {
        let (answer, receiver) = oneshot::channel();
        (Waiting { call, answer }, receiver)
    }

    /// Whether its caller gave up.
    pub(crate) fn gone(&self) -> bool {
        self.answer.is_closed()
    }

    /// Gives the waiting caller its answer (nobody may be waiting any more).
    pub(crate) fn answer(self, answer: Result<A, Error>) {
        let _ = self.answer.send(answer);
    }
}

/// What a call does on entering.
pub(crate) enum Entry<A> {
    /// A slot was free and is now the caller's: it sends its own statement
    /// and gives the slot back ([`Coalescer::leave`]) when that ends.
    Own,
    /// The call waits; its answer comes here.
    Queued(oneshot::Receiver<Result<A, Error>>),
}

/// The calls one statement carries, each key once.
pub(crate) enum Batch {
    Reserve(Vec<Waiting<ReserveCall, Reservation>>),
    Complete(Vec<Waiting<CompleteCall, ()>>),
}

/// A reservation's arguments, owned while it waits.
pub(crate) struct ReserveCall {
    key: RecordKey,
    owner: OwnerToken,
    fingerprint: Option<Fingerprint>,
    now: Timestamp,
    lease_until: Timestamp,
    expires_at: Timestamp,
    retry_failed: bool,
    clock_skew: std::time::Duration,
}

impl ReserveCall {
    pub(crate) fn of(r: &ReserveRequest<'_>) -> Self {
        ReserveCall {
            key: r.key.clone(),
            owner: r.owner,
            fingerprint: r.fingerprint,
            now: r.now,
            lease_until: r.lease_until,
            expires_at: r.expires_at,
            retry_failed: r.retry_failed,
            clock_skew: r.clock_skew,
        }
    }

    pub(crate) fn request(&self) -> ReserveRequest<'_> {
        ReserveRequest {
            key: &self.key,
            owner: self.owner,
            fingerprint: self.fingerprint,
            now: self.now,
            lease_until: self.lease_until,
            expires_at: self.expires_at,
            retry_failed: self.retry_failed,
            clock_skew: self.clock_skew,
        }
    }
}

/// A completion's arguments, owned while it waits.
pub(crate) struct CompleteCall {
    key: RecordKey,
    owner: OwnerToken,
    result: Option<Vec<u8>>,
    expires_at: Timestamp,
    pub(crate) now: Timestamp,
}

impl CompleteCall {
    pub(crate) fn new(
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Self {
        CompleteCall {
            key: key.clone(),
            owner,
            result: result.map(<[u8]>::to_vec),
            expires_at,
            now,
        }
    }

    pub(crate) fn completion(&self) -> Completion<'_> {
        Completion {
            key: &self.key,
            owner: self.owner,
            result: self.result.as_deref(),
            expires_at: self.expires_at,
        }
    }

    pub(crate) fn key(&self) -> &RecordKey {
        &self.key
    }

    pub(crate) fn owner(&self) -> OwnerToken {
        self.owner
    }

    pub(crate) fn result(&self) -> Option<&[u8]> {
        self.result.as_deref()
    }

    pub(crate) fn expires_at(&self) -> Timestamp {
        self.expires_at
    }
}

impl Coalescer {
    /// Coalescing once `limit` statements are in flight; 0: never.
    pub(crate) fn new(limit: usize, over_arrays: bool) -> Self {
        Coalescer {
            limit,
            over_arrays,
            state: Mutex::new(State::default()),
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Whether a lone call also goes through the statements over arrays.
    pub(crate) fn over_arrays(&self) -> bool {
        self.over_arrays
    }

    /// A reservation enters: see [`Entry`].
    pub(crate) fn enter_reserve(&self, request: &ReserveRequest<'_>) -> Entry<Reservation> {
        self.enter(|s| &mut s.reserves, || ReserveCall::of(request))
    }

    /// A completion enters: see [`Entry`].
    pub(crate) fn enter_complete(&self, call: impl FnOnce() -> CompleteCall) -> Entry<()> {
        self.enter(|s| &mut s.completes, call)
    }

    fn enter<C, A>(
        &self,
        queue: impl FnOnce(&mut State) -> &mut VecDeque<Waiting<C, A>>,
        call: impl FnOnce() -> C,
    ) -> Entry<A> {
        if self.limit == 0 {
            return Entry::Own;
        }
        let mut state = self.lock();
        if state.in_flight < self.limit {
            state.in_flight += 1;
            return Entry::Own;
        }
        let (waiting, receiver) = Waiting::new(call());
        queue(&mut state).push_back(waiting);
        Entry::Queued(receiver)
    }

    /// A slot's statement ended. `true`: calls are waiting and the slot stays
    /// taken, for a task that sends them; `false`: the slot is free.
    pub(crate) fn leave(&self) -> bool {
        if self.limit == 0 {
            return false;
        }
        let mut state = self.lock();
        state.forget_given_up();
        if state.reserves.is_empty() && state.completes.is_empty() {
            state.in_flight -= 1;
            false
        } else {
            true
        }
    }

    /// Frees the slot of a task that could not run to its end (no runtime, or
    /// the runtime shutting down cancelled it): the waiting calls, none of
    /// them sent, get an error at once (an outage: retried elsewhere, if at
    /// all), rather than waiting for their timeout.
    pub(crate) fn abandon(&self) {
        let mut state = self.lock();
        state.in_flight -= 1;
        let gone = || Error::Unavailable {
            backend: crate::error::BACKEND,
            message: "not sent: the task that sends coalesced statements could not run \
                      (no Tokio runtime, or it is shutting down)"
                .into(),
            source: None,
        };
        for waiting in state.reserves.drain(..) {
            waiting.answer(Err(gone()));
        }
        for waiting in state.completes.drain(..) {
            waiting.answer(Err(gone()));
        }
    }

    /// The next statement's calls for a kept slot: completions first (they
    /// end executions), then reservations; `None` when nobody waits.
    pub(crate) fn next_batch(&self) -> Option<Batch> {
        let mut state = self.lock();
        state.forget_given_up();
        if !state.completes.is_empty() {
            return Some(Batch::Complete(take_distinct(&mut state.completes, |c| {
                &c.key
            })));
        }
        if !state.reserves.is_empty() {
            return Some(Batch::Reserve(take_distinct(&mut state.reserves, |c| {
                &c.key
            })));
        }
        None
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain counters and queues.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl State {
    /// Drops the calls whose callers gave up before their statement was sent.
    fn forget_given_up(&mut self) {
        self.reserves.retain(|w| !w.answer.is_closed());
        self.completes.retain(|w| !w.answer.is_closed());
    }
}

/// Takes up to [`MOST`] calls from the front of `queue`, each key once; a
/// later call for a key taken stays, in order, for the next statement.
fn take_distinct<C, A>(
    queue: &mut VecDeque<Waiting<C, A>>,
    key: impl Fn(&C) -> &RecordKey,
) -> Vec<Waiting<C, A>> {
    let hasher = std::collections::hash_map::RandomState::new();
    let mut keys = HashSet::with_capacity(queue.len().min(MOST));
    let mut batch = Vec::with_capacity(queue.len().min(MOST));
    let mut later = VecDeque::new();
    while let Some(waiting) = queue.pop_front() {
        if batch.len() == MOST {
            later.push_back(waiting);
            later.extend(queue.drain(..));
            break;
        }
        // Two keys of one hash are both deferred but the first: never a key
        // twice, at worst a key later than it could have gone.
        if keys.insert(hasher.hash_one(key(&waiting.call))) {
            batch.push(waiting);
        } else {
            later.push_back(waiting);
        }
    }
    *queue = later;
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> RecordKey {
        RecordKey::new("ns", id, 256).unwrap()
    }

    fn reserve(coalescer: &Coalescer, id: &str) -> Entry<Reservation> {
        let key = key(id);
        let request = ReserveRequest {
            key: &key,
            owner: OwnerToken::random(),
            fingerprint: None,
            now: Timestamp::from_millis(1),
            lease_until: Timestamp::from_millis(2),
            expires_at: Timestamp::from_millis(3),
            retry_failed: false,
            clock_skew: std::time::Duration::ZERO,
        };
        coalescer.enter_reserve(&request)
    }

    fn ids(batch: Option<Batch>) -> Vec<String> {
        match batch {
            Some(Batch::Reserve(calls)) => {
                calls.iter().map(|w| w.call.key.id().to_owned()).collect()
            }
            Some(Batch::Complete(calls)) => {
                calls.iter().map(|w| w.call.key.id().to_owned()).collect()
            }
            None => Vec::new(),
        }
    }

    #[test]
    fn calls_run_on_their_own_until_the_limit_then_wait() {
        let c = Coalescer::new(2, false);
        assert!(matches!(reserve(&c, "a"), Entry::Own));
        assert!(matches!(reserve(&c, "b"), Entry::Own));
        let _waiting = reserve(&c, "c");
        assert!(matches!(_waiting, Entry::Queued(_)));
        // The slot that ends is kept for the waiting call; the other is freed.
        assert!(c.leave());
        assert_eq!(ids(c.next_batch()), ["c"]);
        assert_eq!(ids(c.next_batch()), Vec::<String>::new());
        assert!(!c.leave());
        assert!(!c.leave());
        assert!(matches!(reserve(&c, "d"), Entry::Own));
    }

    #[test]
    fn off_never_queues() {
        let c = Coalescer::new(0, false);
        for id in ["a", "b", "c"] {
            assert!(matches!(reserve(&c, id), Entry::Own));
        }
        assert!(!c.leave());
    }

    #[test]
    fn a_statement_carries_a_key_once_and_completions_go_first() {
        let c = Coalescer::new(1, false);
        assert!(matches!(reserve(&c, "busy"), Entry::Own));
        let waiting: Vec<_> = ["a", "b", "a", "c", "a"]
            .iter()
            .map(|id| reserve(&c, id))
            .collect();
        let done = c.enter_complete(|| {
            CompleteCall::new(
                &key("z"),
                OwnerToken::random(),
                None,
                Timestamp::from_millis(9),
                Timestamp::from_millis(1),
            )
        });
        assert!(c.leave());
        assert_eq!(ids(c.next_batch()), ["z"]);
        assert_eq!(ids(c.next_batch()), ["a", "b", "c"]);
        assert_eq!(ids(c.next_batch()), ["a"]);
        assert_eq!(ids(c.next_batch()), ["a"]);
        assert!(c.next_batch().is_none());
        drop((waiting, done));
    }

    #[test]
    fn a_caller_that_gave_up_is_not_sent() {
        let c = Coalescer::new(1, false);
        assert!(matches!(reserve(&c, "busy"), Entry::Own));
        let gone = reserve(&c, "gone");
        let kept = reserve(&c, "kept");
        drop(gone);
        assert!(c.leave());
        assert_eq!(ids(c.next_batch()), ["kept"]);
        drop(kept);
        // Nobody waits any more: the slot is freed.
        let _late = reserve(&c, "late");
        drop(_late);
        assert!(!c.leave());
    }

    #[test]
    fn a_statement_carries_at_most_most_calls() {
        let c = Coalescer::new(1, false);
        assert!(matches!(reserve(&c, "busy"), Entry::Own));
        let waiting: Vec<_> = (0..MOST + 3).map(|i| reserve(&c, &i.to_string())).collect();
        assert!(c.leave());
        assert_eq!(ids(c.next_batch()).len(), MOST);
        assert_eq!(ids(c.next_batch()).len(), 3);
        drop(waiting);
    }

    #[test]
    fn abandoning_answers_every_waiting_call() {
        let c = Coalescer::new(1, false);
        assert!(matches!(reserve(&c, "busy"), Entry::Own));
        let Entry::Queued(mut rx) = reserve(&c, "a") else {
            panic!("the second call should wait");
        };
        assert!(c.leave());
        c.abandon();
        assert!(matches!(rx.try_recv(), Ok(Err(Error::Unavailable { .. }))));
        // The slot is free again.
        assert!(matches!(reserve(&c, "b"), Entry::Own));
    }
}
