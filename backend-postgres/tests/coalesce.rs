//! Coalescing against a real server: calls that wait for a statement slot go
//! together in one statement, each with its own answer; a key goes once per
//! statement; a caller that gave up is not sent; a statement refused because
//! another transaction holds a key is sent again call by call.
//!
//! The slot (`coalesce_above(1)`) is held by a completion blocked on a row
//! lock that the test's own transaction holds, so that the calls entered
//! meanwhile wait, deterministically; committing that transaction ends the
//! blocked statement and sends the waiting calls. Statements are counted by a
//! proxy (`Execute` messages), the records read back from the table. Each
//! reserve plan's first statement over arrays is checked: the insert answers
//! fresh keys, the read duplicates, and the function the rest.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use idempotency_conformance::containers::WireCounter;
use idempotency_core::{
    Clock, Error, OwnerToken, Record, RecordKey, Repository, Reservation, ReserveRequest, Status,
    SystemClock,
};
use idempotency_postgres::{PgRepository, PgRepositoryBuilder, ReservePlan};
use sqlx::{Connection, PgConnection};

const TABLE: &str = "idem_coalesce";

type Call<'a, T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'a>>;

struct Setup {
    repo: PgRepository,
    counter: WireCounter,
    url: String,
    ns: String,
    /// Reserved keys whose completions hold the slot, one per blocking.
    busy: Vec<(RecordKey, OwnerToken)>,
    blocked: std::sync::atomic::AtomicUsize,
}

impl Setup {
    /// A repository with one statement slot, through a counting proxy.
    async fn new(plan: ReservePlan) -> Setup {
        Setup::with(plan, |builder| builder.coalesce_above(1)).await
    }

    /// [`Setup::new`] with `configure` applied last to the repository's
    /// builder.
    async fn with(
        plan: ReservePlan,
        configure: impl FnOnce(PgRepositoryBuilder) -> PgRepositoryBuilder,
    ) -> Setup {
        let url = common::server_url().await;
        common::repository(TABLE).await; // migrated
        let counter = WireCounter::postgres(&url).await.unwrap();
        let builder = PgRepository::builder()
            .table(TABLE)
            .coalesce_above(1)
            // The slot stays with a blocked call for as long as the test
            // holds it (otherwise the sender goes on after 100 ms).
            .coalesced_calls_detach_after(Duration::from_secs(60))
            .reserve_plan(plan)
            .max_connections(4)
            .operation_timeout(Duration::from_secs(10))
            // A single statement blocked on a row lock stays blocked until
            // the test commits (a batch statement still gives up at 100 ms).
            .lock_timeout(Duration::from_secs(9));
        let repo = configure(builder).connect(counter.url()).await.unwrap();
        let ns = common::unique("co");
        let mut busy = Vec::new();
        for i in 0..3 {
            let key = RecordKey::new(ns.as_str(), format!("busy{i}"), 1024).unwrap();
            let owner = OwnerToken::random();
            repo.reserve(request(&key, owner)).await.unwrap();
            busy.push((key, owner));
        }
        Setup {
            repo,
            counter,
            url,
            ns,
            busy,
            blocked: Default::default(),
        }
    }

    fn key(&self, id: &str) -> RecordKey {
        RecordKey::new(self.ns.as_str(), id, 1024).unwrap()
    }

    /// A transaction of the test's own (not through the proxy) holding `id`
    /// reserved, uncommitted.
    async fn hold(&self, id: &str) -> Holder {
        let mut conn = PgConnection::connect(&self.url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        let key = self.key(id);
        let answer = self
            .repo
            .in_transaction(&mut conn)
            .reserve(request(&key, OwnerToken::random()))
            .await
            .unwrap();
        assert!(matches!(answer, Reservation::Acquired { .. }));
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        Holder { conn, pid }
    }

    /// Takes the one slot with the completion of a busy key (a new one each
    /// time), blocked on the row lock of a transaction of the test's own
    /// until that commits; returns once the server shows it waiting for that
    /// transaction.
    async fn block_slot(&self) -> (Holder, Call<'_, ()>) {
        let next = self
            .blocked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (busy, owner) = &self.busy[next];
        let mut conn = PgConnection::connect(&self.url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        sqlx::query(&format!(
            "SELECT 1 FROM {TABLE} WHERE namespace = $1 AND id = $2 FOR UPDATE"
        ))
        .bind(busy.namespace().as_bytes())
        .bind(busy.id().as_bytes())
        .execute(&mut conn)
        .await
        .unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        let holder = Holder { conn, pid };
        let expiry = SystemClock.now() + Duration::from_secs(600);
        let mut blocked = self
            .repo
            .complete(busy, *owner, None, expiry, SystemClock.now());
        assert!(futures::poll!(&mut blocked).is_pending());
        let mut direct = PgConnection::connect(&self.url).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(holder.pid)
            .fetch_one(&mut direct)
            .await
            .unwrap();
            if waiting > 0 {
                break;
            }
            assert!(Instant::now() < deadline, "the completion never blocked");
            // Drive the blocked call until its statement is on the server.
            if let Ok(ended) = tokio::time::timeout(Duration::from_millis(5), &mut blocked).await {
                panic!("the completion ended without blocking: {ended:?}");
            }
        }
        (holder, blocked)
    }

    fn statements_since(&self, before: &std::collections::BTreeMap<char, u64>) -> u64 {
        let since = self.counter.since(before);
        since.get(&'E').copied().unwrap_or(0)
    }

    async fn record(&self, key: &RecordKey) -> Option<Record> {
        self.repo.get(key, SystemClock.now()).await.unwrap()
    }
}

fn request(key: &RecordKey, owner: OwnerToken) -> ReserveRequest<'_> {
    let (lease, ttl) = (Duration::from_secs(60), Duration::from_secs(3600));
    ReserveRequest::new(key, owner, SystemClock.now(), lease, ttl)
}

/// Polls `call` once, so that it enters (it must wait for the slot).
async fn enter<T>(call: &mut Call<'_, T>) {
    assert!(matches!(futures::poll!(call), Poll::Pending));
}

/// A transaction of the test's own and its server process.
struct Holder {
    conn: PgConnection,
    pid: i32,
}

async fn commit(mut holder: Holder) {
    sqlx::query("COMMIT")
        .execute(&mut holder.conn)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_reservations_share_one_statement_each_with_its_own_answer() {
    let s = Setup::new(ReservePlan::Function).await;
    let (holder, blocked) = s.block_slot().await;

    let keys: Vec<RecordKey> = (0..10).map(|i| s.key(&format!("k{i}"))).collect();
    let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let before = s.counter.snapshot();
    let mut calls: Vec<Call<'_, Reservation>> = keys
        .iter()
        .zip(&owners)
        .map(|(k, &o)| s.repo.reserve(request(k, o)))
        .collect();
    for call in &mut calls {
        enter(call).await;
    }
    assert_eq!(
        s.statements_since(&before),
        0,
        "the calls wait for the slot"
    );
    commit(holder).await;
    blocked.await.unwrap();
    for call in calls {
        assert_eq!(call.await.unwrap(), Reservation::Acquired { attempt: 1 });
    }
    assert_eq!(
        s.statements_since(&before),
        1,
        "ten reservations, one statement"
    );
    for (key, owner) in keys.iter().zip(owners) {
        let record = s.record(key).await.expect("reserved");
        assert_eq!((record.status, record.owner), (Status::Processing, owner));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_completions_share_one_statement_and_a_stranger_loses_its_lease() {
    let s = Setup::new(ReservePlan::Function).await;
    let keys: Vec<RecordKey> = (0..6).map(|i| s.key(&format!("c{i}"))).collect();
    let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    for (key, &owner) in keys.iter().zip(&owners) {
        s.repo.reserve(request(key, owner)).await.unwrap();
    }
    let (holder, blocked) = s.block_slot().await;

    let before = s.counter.snapshot();
    let t = SystemClock.now();
    let expiry = t + Duration::from_secs(600);
    let results: Vec<Vec<u8>> = (0..keys.len())
        .map(|i| format!("r{i}").into_bytes())
        .collect();
    let mut calls: Vec<Call<'_, ()>> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            // The last completion is a stranger's: not the owner.
            let owner = if i + 1 == keys.len() {
                OwnerToken::random()
            } else {
                owners[i]
            };
            s.repo.complete(key, owner, Some(&results[i]), expiry, t)
        })
        .collect();
    for call in &mut calls {
        enter(call).await;
    }
    commit(holder).await;
    blocked.await.unwrap();
    let answers: Vec<_> = futures::future::join_all(calls).await;
    assert_eq!(
        s.statements_since(&before),
        1,
        "six completions, one statement"
    );
    for (i, answer) in answers.into_iter().enumerate() {
        let record = s.record(&keys[i]).await.unwrap();
        if i + 1 == keys.len() {
            assert!(matches!(answer, Err(Error::LeaseLost { .. })), "{answer:?}");
            assert_eq!(record.status, Status::Processing);
        } else {
            answer.unwrap();
            assert_eq!(record.status, Status::Completed);
            assert_eq!(record.result.as_deref(), Some(&results[i][..]));
            assert_eq!(record.expires_at, expiry);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_goes_once_per_statement_and_the_second_caller_sees_the_first() {
    let s = Setup::new(ReservePlan::Function).await;
    let (holder, blocked) = s.block_slot().await;

    let (twice, other) = (s.key("twice"), s.key("other"));
    let (first, second) = (OwnerToken::random(), OwnerToken::random());
    let before = s.counter.snapshot();
    let mut a = s.repo.reserve(request(&twice, first));
    let mut b = s.repo.reserve(request(&twice, second));
    let mut c = s.repo.reserve(request(&other, OwnerToken::random()));
    for call in [&mut a, &mut b, &mut c] {
        enter(call).await;
    }
    commit(holder).await;
    blocked.await.unwrap();
    assert_eq!(a.await.unwrap(), Reservation::Acquired { attempt: 1 });
    assert_eq!(c.await.unwrap(), Reservation::Acquired { attempt: 1 });
    match b.await.unwrap() {
        Reservation::Existing(record) => assert_eq!(record.owner, first),
        other => panic!("the second caller of a key must see the first: {other:?}"),
    }
    assert_eq!(
        s.statements_since(&before),
        2,
        "[twice, other], then [twice]"
    );
}

/// Two reservations enter while the slot is blocked; `meanwhile` runs, the
/// first caller gives up, and the slot is freed: the second is acquired by
/// one statement, and the first reserved nothing.
async fn the_first_of_two_gives_up(s: &Setup, meanwhile: impl Future<Output = ()>) {
    let (holder, blocked) = s.block_slot().await;
    let (gone, kept) = (s.key("gone"), s.key("kept"));
    let before = s.counter.snapshot();
    let mut given_up = s.repo.reserve(request(&gone, OwnerToken::random()));
    let mut waiting = s.repo.reserve(request(&kept, OwnerToken::random()));
    enter(&mut given_up).await;
    enter(&mut waiting).await;
    meanwhile.await;
    drop(given_up);
    commit(holder).await;
    blocked.await.unwrap();
    assert_eq!(waiting.await.unwrap(), Reservation::Acquired { attempt: 1 });
    // One statement either way; what it carried shows in the table.
    assert_eq!(s.statements_since(&before), 1);
    assert!(
        s.record(&gone).await.is_none(),
        "a caller that gave up reserved nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gave_up_while_waiting_is_never_sent() {
    let s = Setup::new(ReservePlan::Function).await;
    the_first_of_two_gives_up(&s, async {}).await;
}

/// The statement's calls are taken from the queue by a second slot's task,
/// which then waits for the one connection turn (held by the blocked
/// completion); a caller that gives up meanwhile is left out of the
/// statement once the turn comes. On a single-threaded runtime, so that both
/// calls are queued before that task takes them, and it has taken them (and
/// waits for the turn) before the first caller gives up.
#[tokio::test(flavor = "current_thread")]
async fn a_caller_that_gave_up_while_its_statement_waited_for_a_connection_is_left_out() {
    let s = Setup::with(ReservePlan::Function, |builder| {
        builder.coalesce_above(2).held_connections(1)
    })
    .await;
    // The second slot's task runs: it takes both calls and waits for the
    // turn (nothing else is ready on this thread; each yield lets it go on).
    let taken = async {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    };
    the_first_of_two_gives_up(&s, taken).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_refused_for_a_locked_key_is_sent_again_call_by_call() {
    let s = Setup::new(ReservePlan::Function).await;
    // Another transaction holds `locked` for as long as the test says.
    let locker = s.hold("locked").await;
    let (holder, blocked) = s.block_slot().await;

    let (locked, free) = (s.key("locked"), s.key("free"));
    let before = s.counter.snapshot();
    let mut on_locked = s.repo.reserve(request(&locked, OwnerToken::random()));
    let mut on_free = s.repo.reserve(request(&free, OwnerToken::random()));
    enter(&mut on_locked).await;
    enter(&mut on_free).await;
    commit(holder).await;
    blocked.await.unwrap();
    // The shared statement meets `locked` past its lock_timeout and applies
    // nothing; `free` goes again on its own while `locked` still waits.
    assert_eq!(on_free.await.unwrap(), Reservation::Acquired { attempt: 1 });
    commit(locker).await;
    assert!(matches!(on_locked.await.unwrap(), Reservation::Existing(_)));
    assert_eq!(
        s.statements_since(&before),
        3,
        "[locked, free], then each alone"
    );
}

/// Enters one reservation per `(key, owner)` while the slot is blocked, then
/// frees the slot; the answers, and the statements the waiting calls took.
async fn reserve_waiting(s: &Setup, calls: &[(&RecordKey, OwnerToken)]) -> (Vec<Reservation>, u64) {
    let (holder, blocked) = s.block_slot().await;
    let before = s.counter.snapshot();
    let mut waiting: Vec<Call<'_, Reservation>> = calls
        .iter()
        .map(|&(key, owner)| s.repo.reserve(request(key, owner)))
        .collect();
    for call in &mut waiting {
        enter(call).await;
    }
    commit(holder).await;
    blocked.await.unwrap();
    let mut answers = Vec::new();
    for call in waiting {
        answers.push(call.await.unwrap());
    }
    (answers, s.statements_since(&before))
}

/// Completes `key` for `owner` with a result, outside the test's batches.
async fn completed(s: &Setup, key: &RecordKey) {
    let owner = OwnerToken::random();
    s.repo.reserve(request(key, owner)).await.unwrap();
    let t = SystemClock.now();
    let result: &[u8] = b"done";
    s.repo
        .complete(key, owner, Some(result), t + Duration::from_secs(600), t)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_first_answers_fresh_keys_in_one_plain_insert() {
    let s = Setup::new(ReservePlan::InsertFirst).await;
    let keys: Vec<RecordKey> = (0..6).map(|i| s.key(&format!("f{i}"))).collect();
    let calls: Vec<_> = keys.iter().map(|k| (k, OwnerToken::random())).collect();
    let (answers, statements) = reserve_waiting(&s, &calls).await;
    assert!(answers
        .iter()
        .all(|a| *a == Reservation::Acquired { attempt: 1 }));
    assert_eq!(statements, 1, "six fresh keys, one insert");
    for (key, owner) in calls {
        assert_eq!(s.record(key).await.unwrap().owner, owner);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_first_leaves_existing_keys_to_the_function() {
    let s = Setup::new(ReservePlan::InsertFirst).await;
    let (fresh, done, live, stale) = (s.key("fresh"), s.key("done"), s.key("live"), s.key("stale"));
    completed(&s, &done).await;
    let holder = OwnerToken::random();
    s.repo.reserve(request(&live, holder)).await.unwrap();
    let t = SystemClock.now();
    let lapsed = ReserveRequest {
        lease_until: t,
        ..request(&stale, OwnerToken::random())
    };
    s.repo.reserve(lapsed).await.unwrap();
    let calls = [&fresh, &done, &live, &stale].map(|k| (k, OwnerToken::random()));
    let (answers, statements) = reserve_waiting(&s, &calls).await;
    assert_eq!(answers[0], Reservation::Acquired { attempt: 1 });
    match &answers[1] {
        Reservation::Existing(r) => assert_eq!(r.status, Status::Completed),
        other => panic!("a completed key is a duplicate: {other:?}"),
    }
    match &answers[2] {
        Reservation::Existing(r) => assert_eq!((r.status, r.owner), (Status::Processing, holder)),
        other => panic!("a live lease is in progress: {other:?}"),
    }
    assert_eq!(
        answers[3],
        Reservation::Acquired { attempt: 2 },
        "a lapsed lease is taken over"
    );
    assert_eq!(
        statements, 2,
        "the insert, then the function for the three it left"
    );
    assert_eq!(s.record(&stale).await.unwrap().owner, calls[3].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_first_answers_duplicates_in_one_plain_read_and_leaves_the_rest() {
    let s = Setup::new(ReservePlan::ReadFirst).await;
    let done: Vec<RecordKey> = (0..5).map(|i| s.key(&format!("d{i}"))).collect();
    for key in &done {
        completed(&s, key).await;
    }
    let calls: Vec<_> = done.iter().map(|k| (k, OwnerToken::random())).collect();
    let (answers, statements) = reserve_waiting(&s, &calls).await;
    for answer in &answers {
        match answer {
            Reservation::Existing(r) => {
                assert_eq!(r.status, Status::Completed);
                assert_eq!(r.result.as_deref(), Some(&b"done"[..]));
            }
            other => panic!("a completed key is a duplicate: {other:?}"),
        }
    }
    assert_eq!(statements, 1, "five duplicates, one read");

    // A fresh key and a re-sent reserve of our own: the read answers the
    // re-sent one (acquired, nothing written), the function the fresh one.
    let (fresh, mine) = (s.key("fresh"), s.key("mine"));
    let owner = OwnerToken::random();
    s.repo.reserve(request(&mine, owner)).await.unwrap();
    let calls = [
        (&fresh, OwnerToken::random()),
        (&mine, owner),
        (&done[0], OwnerToken::random()),
    ];
    let (answers, statements) = reserve_waiting(&s, &calls).await;
    assert_eq!(answers[0], Reservation::Acquired { attempt: 1 });
    assert_eq!(answers[1], Reservation::Acquired { attempt: 1 });
    assert!(matches!(&answers[2], Reservation::Existing(r) if r.status == Status::Completed));
    assert_eq!(
        statements, 2,
        "the read, then the function for the fresh key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaked_caller_future_holds_no_slot() {
    // A consumer that crashed in-process, or a future kept and never polled
    // again: the one slot must not stay with it.
    let s = Setup::new(ReservePlan::Function).await;
    let next = s.key("next");
    // Polled once, the call takes the free slot and its sender starts. On a
    // loaded machine the sender can answer before that poll returns; then
    // nothing was leaked, and another key is tried.
    let mut leaked = false;
    for i in 0..20 {
        let key = s.key(&format!("leaked{i}"));
        let mut call = s.repo.reserve(request(&key, OwnerToken::random()));
        if futures::poll!(&mut call).is_pending() {
            std::mem::forget(call);
            leaked = true;
            break;
        }
    }
    assert!(leaked, "no call was left pending after one poll");
    for i in 0..3 {
        let key = s.key(&format!("next{i}"));
        let answer = s.repo.reserve(request(&key, OwnerToken::random())).await;
        assert_eq!(answer.unwrap(), Reservation::Acquired { attempt: 1 });
    }
    let answer = s.repo.reserve(request(&next, OwnerToken::random())).await;
    assert_eq!(answer.unwrap(), Reservation::Acquired { attempt: 1 });
}

/// A call blocked on a row lock that another transaction holds (here a key
/// reserved in an uncommitted transaction) does not hold its slot, nor the
/// calls queued behind it, for the operation timeout: the sender leaves it to
/// a task of its own and sends the next waiting calls; the blocked call still
/// gets its answer once the lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_blocked_on_a_row_lock_does_not_hold_its_slot() {
    let s = Setup::new(ReservePlan::Function).await;
    let repo = PgRepository::builder()
        .table(TABLE)
        .coalesce_above(1)
        .operation_timeout(Duration::from_secs(30))
        .lock_timeout(Duration::from_secs(20))
        .connect(&s.url)
        .await
        .unwrap();
    let locker = s.hold("locked").await;
    let locked = s.key("locked");
    let mut blocked = repo.reserve(request(&locked, OwnerToken::random()));
    enter(&mut blocked).await;
    let free: Vec<RecordKey> = (0..5).map(|i| s.key(&format!("free{i}"))).collect();
    let others = free
        .iter()
        .map(|key| repo.reserve(request(key, OwnerToken::random())));
    for answer in futures::future::join_all(others).await {
        assert_eq!(answer.unwrap(), Reservation::Acquired { attempt: 1 });
    }
    assert!(
        matches!(futures::poll!(&mut blocked), Poll::Pending),
        "the blocked call still waits for the lock"
    );
    commit(locker).await;
    assert!(matches!(blocked.await.unwrap(), Reservation::Existing(_)));
}
