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
//! the limit each call goes alone, at once (on a task of the repository's
//! own: one task hop), and under load a call waits at most for one statement
//! to end before its own is sent.
//!
//! - **A slot per task.** Every call waits in a queue; at most `limit` tasks
//!   of the repository's own send the waiting calls, each one statement at a
//!   time (completions first, then reservations; each kind in statements of
//!   up to [`MOST`] calls) until none wait. A call that finds a slot free
//!   starts such a task, which finds it alone and sends it at once, as
//!   without coalescing. The slots belong to those tasks, never to a caller's
//!   future: a caller that gives up, or whose future is leaked and never
//!   polled again, strands nobody and holds no slot.
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
//!   queue before its statement is sent; a reservation whose caller gives up
//!   while its statement waits for a connection is left out of it once the
//!   connection is there (a completion in a shared statement is sent: it is
//!   owner-checked, and may still record an outcome). One that gives up after
//!   is in the position of a single statement abandoned on the wire.

use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

use idempotency_core::{
    Completion, Error, OwnedReserveRequest, OwnerToken, RecordKey, Reservation, ReserveRequest,
    Timestamp,
};
use tokio::sync::oneshot;

/// The most calls one coalesced statement carries.
pub(crate) const MOST: usize = 128;

/// The most bytes of results one coalesced completion carries (a call over it
/// goes alone): the statement's bind message stays far below PostgreSQL's
/// 1 GiB message limit whatever results the manager allows (up to 16 MiB
/// each), and no statement holds gigabytes of copies.
pub(crate) const MOST_BYTES: usize = 32 * 1024 * 1024;

/// The default of [`coalesce_above`](crate::PgRepositoryBuilder::coalesce_above).
pub const DEFAULT_COALESCE_ABOVE: usize = 2;

/// How long a sending task waits for calls it sent on statements of their
/// own (a lone call, or calls sent again after their shared statement was
/// refused) before it leaves them to finish on tasks of their own and sends
/// the next waiting calls: a statement waiting on a row lock (a key another
/// transaction holds) must not hold a slot, and every call queued behind it,
/// for the whole operation timeout.
pub(crate) const DETACH_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// The slots and the queues of one repository (shared by its clones).
pub(crate) struct Coalescer {
    /// How many statements may be in flight before calls wait; 0: off.
    limit: usize,
    /// Tests: every call, also alone, goes through the statements over arrays.
    over_arrays: bool,
    /// See [`DETACH_AFTER`] (tests lengthen it to hold a slot on purpose).
    detach_after: std::time::Duration,
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
    /// Coalescing is off: the caller sends its own statement.
    Alone,
    /// The call waits for its answer in the queue; `send`: a slot was free
    /// and is now taken for a task the caller starts
    /// (`PgRepository::send_waiting`), which sends the waiting calls.
    Queued {
        answer: oneshot::Receiver<Result<A, Error>>,
        send: bool,
    },
}

/// The calls one statement carries, each key once.
pub(crate) enum Batch {
    Reserve(Vec<Waiting<ReserveCall, Reservation>>),
    Complete(Vec<Waiting<CompleteCall, ()>>),
}

/// A reservation's arguments, owned while it waits.
pub(crate) type ReserveCall = OwnedReserveRequest;

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
            detach_after: DETACH_AFTER,
            state: Mutex::new(State::default()),
        }
    }

    /// With calls sent alone detached after `after` (see [`DETACH_AFTER`]).
    pub(crate) fn detaching_after(mut self, after: std::time::Duration) -> Self {
        self.detach_after = after;
        self
    }

    /// See [`DETACH_AFTER`].
    pub(crate) fn detach_after(&self) -> std::time::Duration {
        self.detach_after
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
        self.enter(|s| &mut s.reserves, || ReserveCall::from(request))
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
            return Entry::Alone;
        }
        let mut state = self.lock();
        let (waiting, answer) = Waiting::new(call());
        queue(&mut state).push_back(waiting);
        let send = state.in_flight < self.limit;
        if send {
            state.in_flight += 1;
        }
        Entry::Queued { answer, send }
    }

    /// A task sending waiting calls found none. `true`: calls came meanwhile
    /// and the slot stays taken, for a task that sends them; `false`: the
    /// slot is free.
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
            let size = |c: &CompleteCall| c.result.as_ref().map_or(0, Vec::len);
            return Some(Batch::Complete(take_distinct(
                &mut state.completes,
                |c| &c.key,
                size,
            )));
        }
        if !state.reserves.is_empty() {
            return Some(Batch::Reserve(take_distinct(
                &mut state.reserves,
                |c| c.key(),
                |_| 0,
            )));
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

/// Whether a completion with `its` bytes of result joins a statement that
/// carries `bytes` of results so far (`first`: none yet): the first whatever
/// its size, then up to [`MOST_BYTES`] in all.
pub(crate) fn joins(bytes: usize, its: usize, first: bool) -> bool {
    first || bytes.saturating_add(its) <= MOST_BYTES
}

/// Takes up to [`MOST`] calls (and [`MOST_BYTES`] of their `size`; the
/// first call whatever its size) from the front of `queue`, each key once; a
/// later call for a key taken, or one over the byte budget, stays, in order,
/// for the next statement.
fn take_distinct<C, A>(
    queue: &mut VecDeque<Waiting<C, A>>,
    key: impl Fn(&C) -> &RecordKey,
    size: impl Fn(&C) -> usize,
) -> Vec<Waiting<C, A>> {
    let hasher = std::collections::hash_map::RandomState::new();
    let mut keys = HashSet::with_capacity(queue.len().min(MOST));
    let mut batch = Vec::with_capacity(queue.len().min(MOST));
    let mut later = VecDeque::new();
    let mut bytes = 0usize;
    while let Some(waiting) = queue.pop_front() {
        if batch.len() == MOST {
            later.push_back(waiting);
            later.extend(queue.drain(..));
            break;
        }
        let its = size(&waiting.call);
        let fits = joins(bytes, its, batch.is_empty());
        // Two keys of one hash are both deferred but the first: never a key
        // twice, at worst a key later than it could have gone. A call over
        // the budget keeps its key's later calls behind it.
        let first_of_its_key = keys.insert(hasher.hash_one(key(&waiting.call)));
        if first_of_its_key && fits {
            bytes = bytes.saturating_add(its);
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

    /// Whether the call entered took a slot (its caller starts a sender).
    fn sends(entry: &Entry<Reservation>) -> bool {
        matches!(entry, Entry::Queued { send: true, .. })
    }

    fn ids(batch: Option<Batch>) -> Vec<String> {
        match batch {
            Some(Batch::Reserve(calls)) => {
                calls.iter().map(|w| w.call.key().id().to_owned()).collect()
            }
            Some(Batch::Complete(calls)) => {
                calls.iter().map(|w| w.call.key.id().to_owned()).collect()
            }
            None => Vec::new(),
        }
    }

    #[test]
    fn calls_start_senders_up_to_the_limit_then_only_wait() {
        let c = Coalescer::new(2, false);
        let entered: Vec<_> = ["a", "b", "c"].iter().map(|id| reserve(&c, id)).collect();
        assert_eq!(
            entered.iter().map(sends).collect::<Vec<_>>(),
            [true, true, false]
        );
        // The first sender takes every waiting call; the second finds none.
        assert_eq!(ids(c.next_batch()), ["a", "b", "c"]);
        assert!(c.next_batch().is_none());
        assert!(!c.leave());
        assert!(!c.leave());
        assert!(sends(&reserve(&c, "d")));
    }

    #[test]
    fn off_never_queues() {
        let c = Coalescer::new(0, false);
        for id in ["a", "b", "c"] {
            assert!(matches!(reserve(&c, id), Entry::Alone));
        }
        assert!(!c.leave());
    }

    #[test]
    fn a_statement_carries_a_key_once_and_completions_go_first() {
        let c = Coalescer::new(1, false);
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
        assert_eq!(ids(c.next_batch()), ["z"]);
        assert_eq!(ids(c.next_batch()), ["a", "b", "c"]);
        assert_eq!(ids(c.next_batch()), ["a"]);
        assert_eq!(ids(c.next_batch()), ["a"]);
        assert!(c.next_batch().is_none());
        drop((waiting, done));
    }

    #[test]
    fn a_completion_statement_carries_at_most_most_bytes_of_results() {
        let c = Coalescer::new(1, false);
        let blocker = reserve(&c, "blocker");
        assert_eq!(ids(c.next_batch()), ["blocker"]);
        let third = MOST_BYTES / 3 + 1;
        let complete = |id: &str, len: usize| {
            let result = vec![0u8; len];
            c.enter_complete(|| {
                CompleteCall::new(
                    &key(id),
                    OwnerToken::random(),
                    Some(&result),
                    Timestamp::from_millis(9),
                    Timestamp::from_millis(1),
                )
            })
        };
        // Two thirds fit, a third does not: it and its key's later call wait
        // for the next statement, in order; a call over the budget goes alone.
        let waiting = [
            complete("a", third),
            complete("b", third),
            complete("c", third),
            complete("small", 10),
            complete("c", 10),
            complete("huge", MOST_BYTES * 2),
        ];
        assert_eq!(ids(c.next_batch()), ["a", "b", "small"]);
        assert_eq!(ids(c.next_batch()), ["c"]);
        assert_eq!(ids(c.next_batch()), ["c"]);
        assert_eq!(ids(c.next_batch()), ["huge"]);
        assert!(c.next_batch().is_none());
        drop((blocker, waiting));
    }

    #[test]
    fn a_caller_that_gave_up_is_not_sent() {
        let c = Coalescer::new(1, false);
        let first = reserve(&c, "first");
        let gone = reserve(&c, "gone");
        let kept = reserve(&c, "kept");
        drop(gone);
        assert_eq!(ids(c.next_batch()), ["first", "kept"]);
        let late = reserve(&c, "late");
        assert!(!sends(&late), "the slot is still the sender's");
        drop(late);
        // Nobody waits any more: the slot is freed.
        assert!(!c.leave());
        drop((first, kept));
    }

    #[test]
    fn a_statement_carries_at_most_most_calls() {
        let c = Coalescer::new(1, false);
        let waiting: Vec<_> = (0..MOST + 3).map(|i| reserve(&c, &i.to_string())).collect();
        assert_eq!(ids(c.next_batch()).len(), MOST);
        assert_eq!(ids(c.next_batch()).len(), 3);
        drop(waiting);
    }

    #[test]
    fn abandoning_answers_every_waiting_call_and_frees_the_slot() {
        let c = Coalescer::new(1, false);
        let entered = [reserve(&c, "a"), reserve(&c, "b")];
        c.abandon();
        for entry in entered {
            let Entry::Queued { mut answer, .. } = entry else {
                panic!("coalescing is on");
            };
            assert!(matches!(
                answer.try_recv(),
                Ok(Err(Error::Unavailable { .. }))
            ));
        }
        assert!(sends(&reserve(&c, "c")));
    }
}
