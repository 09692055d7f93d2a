//! Proves the round trips and statements of every operation.
//!
//! 1. Client → server protocol messages, counted by a TCP proxy in front of the
//!    server: once a connection has prepared the statements, every operation
//!    sends exactly one `Bind`, one `Execute`, one `Close` (of the unnamed
//!    portal) and one `Sync`, pipelined — one statement in one round trip, no
//!    `Parse`, no simple `Query`.
//! 2. Server side: `pg_stat_database.xact_commit` of a database created for the
//!    test. In autocommit every statement is its own transaction, so N more
//!    operations must cost exactly N more transactions.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idempotency_conformance::containers::{WireCounter, PING};
use idempotency_core::{
    Clock, Completion, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest, Status,
    SystemClock, Timestamp,
};
use idempotency_postgres::{PgRepository, ReservePlan};
use sqlx::{Connection, PgConnection};

const TABLE: &str = "idem_statements";

// ------------------------------------------------------------------ proxy

/// The same server through a new counting proxy (plain text, so the proxy can
/// read the messages).
async fn proxied() -> (String, WireCounter) {
    let counter = WireCounter::postgres(&common::server_url().await)
        .await
        .unwrap();
    (counter.url().to_owned(), counter)
}

fn request(key: &RecordKey, now: Timestamp, lease: Duration) -> ReserveRequest<'_> {
    ReserveRequest::new(
        key,
        OwnerToken::random(),
        now,
        lease,
        Duration::from_secs(3600),
    )
}

/// What sqlx pipelines for a prepared statement: `Bind`, `Execute`, `Close`
/// (the unnamed portal) and one `Sync` — the only message it then waits on.
fn one_round_trip() -> BTreeMap<char, u64> {
    [('B', 1), ('E', 1), ('C', 1), ('S', 1)]
        .into_iter()
        .collect()
}

/// Runs `$e` and asserts the messages it sent.
macro_rules! measured {
    ($counts:expr, $name:expr, $expected:expr, $e:expr) => {{
        let before = $counts.snapshot();
        let out = $e;
        let delta = $counts.since(&before);
        assert_eq!(delta, $expected, "{}: messages sent {:?}", $name, delta);
        out
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_is_one_statement_in_one_round_trip() {
    let (via, counts) = proxied().await;
    // On a caller's connection the reserve plan is not used (the function
    // always answers): the insert-first plan changes nothing below.
    let repo = common::repository_with(TABLE, ReservePlan::InsertFirst).await;
    let mut conn = PgConnection::connect(&via).await.unwrap();
    let ns = common::unique("rt");
    let t = SystemClock.now();
    let key = |id: &str| RecordKey::new(ns.as_str(), id, 1024).unwrap();
    let lease = Duration::from_secs(30);
    let one = one_round_trip();

    // Warm-up: prepare every statement on this connection.
    {
        let mut ops = repo.in_transaction(&mut conn);
        let w = key("warm");
        let owner = OwnerToken::random();
        ops.reserve(ReserveRequest {
            owner,
            ..request(&w, t, lease)
        })
        .await
        .unwrap();
        ops.extend(&w, owner, t + lease, t + lease, t)
            .await
            .unwrap();
        ops.get(&w, t).await.unwrap();
        ops.complete(&w, owner, None, t + lease, t).await.unwrap();
        ops.delete(&w).await.unwrap();
        let owner = OwnerToken::random();
        ops.reserve(ReserveRequest {
            owner,
            ..request(&w, t, lease)
        })
        .await
        .unwrap();
        ops.fail(&w, owner, None, true, t + lease, t).await.unwrap();
        ops.release(&w, owner, t).await.unwrap_err();
        ops.delete(&w).await.unwrap();
        ops.purge_expired(Timestamp::EPOCH, 1).await.unwrap();
    }

    let k1 = key("k1");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        owner,
        ..request(&k1, t, Duration::from_millis(10))
    };
    let r = measured!(
        counts,
        "reserve (fresh key)",
        one,
        repo.in_transaction(&mut conn).reserve(req).await.unwrap()
    );
    assert_eq!(r, Reservation::Acquired { attempt: 1 });

    let r = measured!(
        counts,
        "reserve (duplicate)",
        one,
        repo.in_transaction(&mut conn)
            .reserve(request(&k1, t, lease))
            .await
            .unwrap()
    );
    assert!(matches!(r, Reservation::Existing(_)));

    let t2 = t + Duration::from_secs(1);
    let owner2 = OwnerToken::random();
    let req = ReserveRequest {
        owner: owner2,
        ..request(&k1, t2, lease)
    };
    let r = measured!(
        counts,
        "reserve (takeover)",
        one,
        repo.in_transaction(&mut conn).reserve(req).await.unwrap()
    );
    assert_eq!(r, Reservation::Acquired { attempt: 2 });

    measured!(
        counts,
        "extend",
        one,
        repo.in_transaction(&mut conn)
            .extend(&k1, owner2, t2 + lease, t2 + lease, t2)
            .await
            .unwrap()
    );
    measured!(
        counts,
        "complete",
        one,
        repo.in_transaction(&mut conn)
            .complete(&k1, owner2, Some(b"r"), t2 + Duration::from_secs(5), t2)
            .await
            .unwrap()
    );
    measured!(
        counts,
        "complete (lease lost)",
        one,
        repo.in_transaction(&mut conn)
            .complete(&k1, owner2, None, t2 + lease, t2)
            .await
            .unwrap_err()
    );
    let got = measured!(
        counts,
        "get",
        one,
        repo.in_transaction(&mut conn).get(&k1, t2).await.unwrap()
    );
    assert_eq!(got.unwrap().result.as_deref(), Some(&b"r"[..]));

    // Expired at t2 + 5 s: reserved afresh over the old row.
    let t3 = t2 + Duration::from_secs(10);
    let r = measured!(
        counts,
        "reserve (expired row)",
        one,
        repo.in_transaction(&mut conn)
            .reserve(request(&k1, t3, lease))
            .await
            .unwrap()
    );
    assert_eq!(r, Reservation::Acquired { attempt: 1 });

    let k2 = key("k2");
    let owner3 = OwnerToken::random();
    repo.in_transaction(&mut conn)
        .reserve(ReserveRequest {
            owner: owner3,
            ..request(&k2, t, lease)
        })
        .await
        .unwrap();
    measured!(
        counts,
        "fail",
        one,
        repo.in_transaction(&mut conn)
            .fail(&k2, owner3, Some(b"e"), true, t + lease, t)
            .await
            .unwrap()
    );
    let k3 = key("k3");
    let owner4 = OwnerToken::random();
    repo.in_transaction(&mut conn)
        .reserve(ReserveRequest {
            owner: owner4,
            ..request(&k3, t, lease)
        })
        .await
        .unwrap();
    measured!(
        counts,
        "release",
        one,
        repo.in_transaction(&mut conn)
            .release(&k3, owner4, t)
            .await
            .unwrap()
    );
    let existed = measured!(
        counts,
        "delete",
        one,
        repo.in_transaction(&mut conn).delete(&k2).await.unwrap()
    );
    assert!(existed);
    measured!(
        counts,
        "purge_expired",
        one,
        repo.in_transaction(&mut conn)
            .purge_expired(Timestamp::EPOCH, 100)
            .await
            .unwrap()
    );
    repo.in_transaction(&mut conn).delete(&k1).await.unwrap();
    conn.close().await.unwrap();
}

/// A repository with one connection, through a new counting proxy.
async fn one_proxied_connection(plan: ReservePlan) -> (PgRepository, WireCounter) {
    let (via, counts) = proxied().await;
    common::repository(TABLE).await; // migrated
                                     // A reservation blocked on a row lock stays blocked while a test looks.
    let repo = PgRepository::builder()
        .table(TABLE)
        .reserve_plan(plan)
        .max_connections(1)
        .lock_timeout(Duration::from_secs(4))
        .connect(&via)
        .await
        .unwrap();
    (repo, counts)
}

/// Waits until the pool holds `idle` idle connections: those the repository
/// gave back (sqlx pings each on its way back).
async fn pool_idle(repo: &PgRepository, idle: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while repo.pool().num_idle() != idle && Instant::now() < deadline {
        // Polls for sqlx's background release (its ping to a real server, and
        // the repository's real-time idle period), up to the deadline.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(repo.pool().num_idle(), idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_operations_execute_one_statement_each() {
    let (repo, counts) = one_proxied_connection(ReservePlan::Function).await;
    let ns = common::unique("pool");
    let t = SystemClock.now();
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let fresh = RecordKey::new(ns.as_str(), "fresh", 1024).unwrap();
    let lease = Duration::from_secs(30);

    // Warm-up.
    let owner = OwnerToken::random();
    repo.reserve(ReserveRequest {
        owner,
        ..request(&key, t, lease)
    })
    .await
    .unwrap();
    repo.reserve(request(&key, t, lease)).await.unwrap();
    repo.complete(&key, owner, None, t + lease, t)
        .await
        .unwrap();
    repo.purge_expired(Timestamp::EPOCH, 10).await.unwrap();

    // One Bind/Execute/Sync for the statement, and nothing else: the
    // repository keeps the connection for its next operation, so sqlx's check
    // of a connection returning to the pool (a ping, a lone Sync) is not sent.
    let expected = one_round_trip();
    let r = measured!(counts, "pooled reserve (fresh key)", expected, {
        repo.reserve(request(&fresh, t, lease)).await.unwrap()
    });
    assert!(matches!(r, Reservation::Acquired { .. }));
    let r = measured!(counts, "pooled reserve (duplicate)", expected, {
        repo.reserve(request(&key, t, lease)).await.unwrap()
    });
    assert!(matches!(r, Reservation::Existing(_)));
    measured!(counts, "pooled purge_expired", expected, {
        repo.purge_expired(Timestamp::EPOCH, 10).await.unwrap();
    });
    assert_eq!(
        repo.pool().num_idle(),
        0,
        "the connection is kept, not pooled"
    );

    // A batch is one statement, fresh keys and duplicates alike.
    let batch: Vec<RecordKey> = (0..100)
        .map(|i| RecordKey::new(ns.as_str(), format!("b{i}"), 1024).unwrap())
        .collect();
    let requests = || {
        batch
            .iter()
            .map(|k| request(k, t, lease))
            .collect::<Vec<_>>()
    };
    let warm: Vec<RecordKey> = (0..2)
        .map(|i| RecordKey::new(ns.as_str(), format!("w{i}"), 1024).unwrap())
        .collect();
    repo.reserve_many(warm.iter().map(|k| request(k, t, lease)).collect())
        .await;
    let answers = measured!(counts, "pooled reserve_many (100 fresh keys)", expected, {
        repo.reserve_many(requests()).await
    });
    assert!(answers
        .iter()
        .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))));
    let answers = measured!(counts, "pooled reserve_many (100 duplicates)", expected, {
        repo.reserve_many(requests()).await
    });
    assert!(answers
        .iter()
        .all(|a| matches!(a, Ok(Reservation::Existing(_)))));
    // Their completions, one statement too (after a warm-up of the statement).
    let mut owners = Vec::with_capacity(batch.len() + warm.len());
    for k in warm.iter().chain(&batch) {
        owners.push(repo.get(k, t).await.unwrap().unwrap().owner);
    }
    fn writes<'a>(
        keys: &'a [RecordKey],
        owners: &[OwnerToken],
        t: Timestamp,
    ) -> Vec<Completion<'a>> {
        keys.iter()
            .zip(owners)
            .map(|(key, owner)| Completion {
                key,
                owner: *owner,
                result: Some(b"r"),
                expires_at: t + Duration::from_secs(30),
            })
            .collect()
    }
    repo.complete_many(writes(&warm, &owners[..2], t), t).await;
    let answers = measured!(counts, "pooled complete_many (100 writes)", expected, {
        repo.complete_many(writes(&batch, &owners[2..], t), t).await
    });
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    for k in batch.iter().chain(&warm).chain([&key, &fresh]) {
        repo.delete(k).await.unwrap();
    }

    // Unused for a second, the connection goes back to the pool: one ping.
    let ping: BTreeMap<char, u64> = [(PING, 1)].into_iter().collect();
    measured!(
        counts,
        "an idle kept connection returning to the pool",
        ping,
        {
            pool_idle(&repo, 1).await;
        }
    );
}

// ------------------------------------------------------------ reserve plans

/// The statements executed since `before`; with `whole`, checked to be
/// whole round trips of statements prepared before (nothing prepared,
/// nothing else sent).
fn statements_since(counts: &WireCounter, before: &BTreeMap<char, u64>, whole: bool) -> u64 {
    let sent = counts.since(before);
    let n = sent.get(&'E').copied().unwrap_or(0);
    if whole {
        let expected: BTreeMap<char, u64> = one_round_trip()
            .into_iter()
            .map(|(m, c)| (m, c * n))
            .collect();
        assert_eq!(sent, expected, "messages sent");
    }
    n
}

/// The statements a reservation of each kind costs under `repo`'s plan now
/// (fresh key, duplicate of a completed record, takeover of a lapsed lease),
/// each checked to be whole round trips of prepared statements (nothing
/// prepared, nothing else sent) and answered as the reservation rule says.
/// Without `counts` (a warm-up), only the answers are checked.
async fn reserve_costs(repo: &PgRepository, counts: Option<&WireCounter>, ns: &str) -> [u64; 3] {
    let t = SystemClock.now();
    let lease = Duration::from_secs(30);
    let id = rand::random::<u64>();
    let key = |what: &str| RecordKey::new(ns, format!("{what}-{id}"), 1024).unwrap();
    let (done, stale) = (key("done"), key("stale"));
    let owner = OwnerToken::random();
    repo.reserve(ReserveRequest {
        owner,
        ..request(&done, t, lease)
    })
    .await
    .unwrap();
    repo.complete(&done, owner, Some(b"r"), t + lease, t)
        .await
        .unwrap();
    repo.reserve(request(&stale, t, Duration::from_millis(1)))
        .await
        .unwrap();
    let later = t + Duration::from_secs(1);

    let mut costs = [0; 3];
    for (i, (key, now)) in [(key("fresh"), t), (done, t), (stale, later)]
        .iter()
        .enumerate()
    {
        let before = counts.map(WireCounter::snapshot);
        let answer = repo.reserve(request(key, *now, lease)).await.unwrap();
        if let (Some(counts), Some(before)) = (counts, before) {
            costs[i] = statements_since(counts, &before, true);
        }
        match (i, answer) {
            (0, Reservation::Acquired { attempt: 1 })
            | (2, Reservation::Acquired { attempt: 2 }) => {}
            (1, Reservation::Existing(r)) => assert_eq!(r.result.as_deref(), Some(&b"r"[..])),
            (i, other) => panic!("case {i}: {other:?}"),
        }
    }
    costs
}

/// Each plain statement answers its own case alone, in one round trip, and
/// every other case costs it and the function; the function answers each in
/// one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_reserve_plan_costs_what_its_table_says() {
    for (plan, expected) in [
        (ReservePlan::Function, [1, 1, 1]),
        (ReservePlan::InsertFirst, [1, 2, 2]),
        (ReservePlan::ReadFirst, [2, 1, 2]),
    ] {
        let (repo, counts) = one_proxied_connection(plan).await;
        let ns = common::unique("plan");
        // Warm-up: prepares every statement the plan sends.
        reserve_costs(&repo, None, &ns).await;
        assert_eq!(
            reserve_costs(&repo, Some(&counts), &ns).await,
            expected,
            "{plan}"
        );
    }
}

/// Statements a batch of ten keys costs under `repo`'s plan now: fresh keys,
/// then the same keys again (duplicates of live reservations), each answered
/// as the reservation rule says. With `prepared`, each is checked to be a
/// whole round trip of a statement prepared before.
async fn batch_costs(
    repo: &PgRepository,
    counts: &WireCounter,
    ns: &str,
    prepared: bool,
) -> [u64; 2] {
    let t = SystemClock.now();
    let lease = Duration::from_secs(30);
    let id = rand::random::<u64>();
    let keys: Vec<RecordKey> = (0..10)
        .map(|i| RecordKey::new(ns, format!("batch-{id}-{i}"), 1024).unwrap())
        .collect();
    let mut costs = [0; 2];
    for (fresh, cost) in [true, false].into_iter().zip(&mut costs) {
        let before = counts.snapshot();
        let answers = repo
            .reserve_many(keys.iter().map(|k| request(k, t, lease)).collect())
            .await;
        *cost = statements_since(counts, &before, prepared);
        for answer in answers {
            match answer.unwrap() {
                Reservation::Acquired { attempt: 1 } if fresh => {}
                Reservation::Existing(r) if !fresh => assert_eq!(r.status, Status::Processing),
                other => panic!("fresh {fresh}: {other:?}"),
            }
        }
    }
    costs
}

/// A batch starts as a single reservation does under each plan, over
/// arrays: the plain insert answers fresh keys alone and the plain read
/// duplicates alone, in one statement for the whole batch; the keys a plain
/// statement leaves cost one more, the function over arrays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_follows_the_reserve_plan() {
    for (plan, expected) in [
        (ReservePlan::Function, [1, 1]),
        (ReservePlan::InsertFirst, [1, 2]),
        (ReservePlan::ReadFirst, [2, 1]),
    ] {
        let (repo, counts) = one_proxied_connection(plan).await;
        let ns = common::unique("batch-plan");
        // Warm-up: prepares every statement the plan sends.
        batch_costs(&repo, &counts, &ns, false).await;
        assert_eq!(
            batch_costs(&repo, &counts, &ns, true).await,
            expected,
            "{plan}"
        );
    }
    // The adaptive plan learns from batches too: a batch of fresh keys sends
    // the next batch's insert first.
    let (repo, counts) = one_proxied_connection(ReservePlan::Adaptive).await;
    let ns = common::unique("batch-adaptive");
    // (Counted in statements: the first of each kind is prepared on the way,
    // and the repository's first reservation checks the schema first.)
    let t = SystemClock.now();
    let lease = Duration::from_secs(30);
    let first = RecordKey::new(ns.as_str(), "first", 1024).unwrap();
    repo.reserve(request(&first, t, lease)).await.unwrap();
    assert_eq!(
        batch_costs(&repo, &counts, &ns, false).await,
        [1, 1],
        "at first"
    );
    let fresh: Vec<RecordKey> = (0..100)
        .map(|i| RecordKey::new(ns.as_str(), format!("f{i}"), 1024).unwrap())
        .collect();
    let hundred = || fresh.iter().map(|k| request(k, t, lease)).collect();
    let answers = repo.reserve_many(hundred()).await;
    assert!(answers
        .iter()
        .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))));
    assert_eq!(
        batch_costs(&repo, &counts, &ns, false).await,
        [1, 2],
        "after a batch of fresh keys: the insert first"
    );
    // A batch of duplicates (the same keys, other owners) turns it to the read.
    let answers = repo.reserve_many(hundred()).await;
    assert!(answers
        .iter()
        .all(|a| matches!(a, Ok(Reservation::Existing(_)))));
    assert_eq!(
        batch_costs(&repo, &counts, &ns, false).await,
        [2, 1],
        "after a batch of duplicates: the read first"
    );
}

/// The adaptive plan starts with the function, sends the insert first once
/// fresh keys dominate, and the read first once duplicates do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_plan_follows_the_mix_of_keys() {
    let (repo, counts) = one_proxied_connection(ReservePlan::Adaptive).await;
    let ns = common::unique("adaptive");
    let t = SystemClock.now();
    let lease = Duration::from_secs(30);
    // Statements sent for a fresh key and for a duplicate.
    let measured = async |repo: &PgRepository| {
        let [fresh, duplicate, _] = reserve_costs(repo, Some(&counts), &ns).await;
        [fresh, duplicate]
    };
    assert_eq!(measured(&repo).await, [1, 1], "at first: the function");

    let keys: Vec<RecordKey> = (0..100)
        .map(|i| RecordKey::new(ns.as_str(), format!("k{i}"), 1024).unwrap())
        .collect();
    for k in &keys {
        repo.reserve(request(k, t, lease)).await.unwrap();
    }
    assert_eq!(
        measured(&repo).await,
        [1, 2],
        "after fresh keys: insert first"
    );

    for k in keys.iter().chain(&keys) {
        repo.reserve(request(k, t, lease)).await.unwrap();
    }
    assert_eq!(
        measured(&repo).await,
        [2, 1],
        "after duplicates: read first"
    );
}

/// An operation that does not end with the server's answer gives its
/// connection back to sqlx's pool, which drains it with its ping in the
/// background; the next operation is one round trip on a clean connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_operation_gives_its_connection_back_to_the_pool() {
    let (repo, counts) = one_proxied_connection(ReservePlan::Function).await;
    let ns = common::unique("cancel");
    let t = SystemClock.now();
    let lease = Duration::from_secs(30);
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let warm = RecordKey::new(ns.as_str(), "warm", 1024).unwrap();
    repo.reserve(request(&warm, t, lease)).await.unwrap();
    repo.get(&warm, t).await.unwrap();

    // Block the reservation on a row lock, and give up on it.
    let mut holder = PgConnection::connect(&common::server_url().await)
        .await
        .unwrap();
    let mut tx = holder.begin().await.unwrap();
    let owner = OwnerToken::random();
    repo.in_transaction(&mut tx)
        .reserve(ReserveRequest {
            owner,
            ..request(&key, t, lease)
        })
        .await
        .unwrap();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        repo.reserve(request(&key, t, lease)),
    )
    .await;
    assert!(gave_up.is_err(), "the reservation waits on the row lock");
    assert_eq!(repo.pool().num_idle(), 0, "its statement is still running");
    tx.rollback().await.unwrap();
    // The statement ends; sqlx's ping drains its answer and pools the connection.
    pool_idle(&repo, 1).await;

    // The abandoned reservation took effect on the server (a timeout is "maybe
    // applied"): the next one finds its record, in one round trip.
    let before = counts.snapshot();
    let r = repo.reserve(request(&key, t, lease)).await.unwrap();
    assert!(matches!(r, Reservation::Existing(_)), "{r:?}");
    assert_eq!(counts.since(&before), one_round_trip());
    repo.delete(&key).await.unwrap();
    repo.delete(&warm).await.unwrap();
    holder.close().await.unwrap();
}

// ------------------------------------------------------------- server side

#[derive(Clone, Copy, Debug)]
enum Op {
    ReserveFresh,
    ReserveDuplicate,
    Complete,
    Get,
    Purge,
}

/// Opens a connection to `db_url`, does the same setup every time, then `n`
/// operations of `op`, and closes the connection.
async fn session(repo: &PgRepository, db_url: &str, op: Op, n: usize, ns: &str) {
    let mut conn = PgConnection::connect(db_url).await.unwrap();
    let t = SystemClock.now();
    let lease = Duration::from_secs(30);
    let mut ops = repo.in_transaction(&mut conn);
    let mut owners = Vec::new();
    for i in 0..25 {
        let key = RecordKey::new(ns, format!("setup-{i}"), 1024).unwrap();
        let owner = OwnerToken::random();
        ops.reserve(ReserveRequest {
            owner,
            ..request(&key, t, lease)
        })
        .await
        .unwrap();
        owners.push((key, owner));
    }
    for (i, (key, owner)) in owners.iter().enumerate().take(n) {
        match op {
            Op::ReserveFresh => {
                let fresh =
                    RecordKey::new(ns, format!("fresh-{i}-{}", rand::random::<u64>()), 1024)
                        .unwrap();
                ops.reserve(request(&fresh, t, lease)).await.unwrap();
            }
            Op::ReserveDuplicate => {
                ops.reserve(request(key, t, lease)).await.unwrap();
            }
            Op::Complete => ops
                .complete(key, *owner, Some(b"r"), t + lease, t)
                .await
                .unwrap(),
            Op::Get => {
                ops.get(key, t).await.unwrap();
            }
            Op::Purge => {
                // Nothing of this session is expired: the statement alone.
                ops.purge_expired(Timestamp::EPOCH, 10).await.unwrap();
            }
        }
    }
    // Same cleanup every time.
    for (key, _) in &owners {
        ops.delete(key).await.unwrap();
    }
    conn.close().await.unwrap();
}

/// `xact_commit` of `db` once no backend is connected to it (a backend flushes
/// its statistics when it exits).
async fn commits(admin: &sqlx::PgPool, db: &str) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (backends, commits): (i32, i64) = sqlx::query_as(
            "SELECT numbackends, xact_commit FROM pg_stat_database WHERE datname = $1",
        )
        .bind(db)
        .fetch_one(admin)
        .await
        .unwrap();
        if backends == 0 {
            return commits;
        }
        assert!(Instant::now() < deadline, "backends of {db} did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_counts_one_transaction_per_operation() {
    let (admin, db, db_url) = common::fresh_database("idem_stmt").await;

    {
        let setup = PgRepository::builder()
            .table(TABLE)
            .connect(&db_url)
            .await
            .unwrap();
        setup.migrate().await.unwrap();
        setup.pool().close().await;
    }
    let repo = PgRepository::builder()
        .table(TABLE)
        .reserve_plan(ReservePlan::Function)
        .connect_lazy(&db_url)
        .unwrap();

    let (small, large) = (5usize, 25usize);
    for op in [
        Op::ReserveFresh,
        Op::ReserveDuplicate,
        Op::Complete,
        Op::Get,
        Op::Purge,
    ] {
        let mut seen = Vec::new();
        // Autovacuum may visit the new database and add commits of its own:
        // noise only adds, so one exact measurement out of three proves the count.
        for attempt in 0..3 {
            let ns = format!("{}-{attempt}", common::unique("xact"));
            let c0 = commits(&admin, &db).await;
            session(&repo, &db_url, op, small, &ns).await;
            let c1 = commits(&admin, &db).await;
            session(&repo, &db_url, op, large, &ns).await;
            let c2 = commits(&admin, &db).await;
            let per_extra = (c2 - c1) - (c1 - c0);
            seen.push(per_extra);
            if per_extra == (large - small) as i64 {
                break;
            }
        }
        assert!(
            seen.contains(&((large - small) as i64)),
            "{op:?}: {} more operations cost {seen:?} more transactions",
            large - small
        );
    }
    sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
}

/// What `statement` (one of the reservation statements, bound as the
/// function is) answers for `req` inside a transaction that is then rolled
/// back: `acquired` if it answered at all, and whether it assigned a
/// transaction id (took a row lock or wrote).
async fn reserve_writes(
    repo: &PgRepository,
    statement: &str,
    req: &ReserveRequest<'_>,
) -> (Option<bool>, bool) {
    let mut tx = repo.pool().begin().await.unwrap();
    let row = sqlx::query(statement)
        .bind(req.key.namespace().as_bytes())
        .bind(req.key.id().as_bytes())
        .bind(req.owner.to_bytes().to_vec())
        .bind(req.fingerprint.map(|f| f.as_bytes().to_vec()))
        .bind(i64::try_from(req.now.as_millis()).unwrap())
        .bind(i64::try_from(req.lease_cutoff().as_millis()).unwrap())
        .bind(i64::try_from(req.lease_until.as_millis()).unwrap())
        .bind(i64::try_from(req.expires_at.as_millis()).unwrap())
        .bind(req.retry_failed)
        .fetch_optional(&mut *tx)
        .await
        .unwrap();
    let acquired = row.map(|row| sqlx::Row::get::<bool, _>(&row, 0));
    let xid: Option<String> = sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    (acquired, xid.is_some())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_of_live_records_are_read_only() {
    let repo = common::repository(TABLE).await;
    let ns = common::unique("ro");
    let t = SystemClock.now();
    let lease = Duration::from_secs(30);
    let done = RecordKey::new(ns.as_str(), "done", 1024).unwrap();
    let held = RecordKey::new(ns.as_str(), "held", 1024).unwrap();
    let stale = RecordKey::new(ns.as_str(), "stale", 1024).unwrap();
    let fresh = RecordKey::new(ns.as_str(), "fresh", 1024).unwrap();
    let first = request(&done, t, lease);
    let done_owner = first.owner;
    assert!(matches!(
        repo.reserve(first).await.unwrap(),
        Reservation::Acquired { .. }
    ));
    repo.complete(
        &done,
        done_owner,
        Some(b"r"),
        t + Duration::from_secs(3600),
        t,
    )
    .await
    .unwrap();
    assert!(matches!(
        repo.reserve(request(&held, t, lease)).await.unwrap(),
        Reservation::Acquired { .. }
    ));
    assert!(matches!(
        repo.reserve(request(&stale, t, Duration::from_millis(1)))
            .await
            .unwrap(),
        Reservation::Acquired { .. }
    ));
    let later = t + Duration::from_millis(10);
    let sql = repo.statements();
    let (function, insert, read) = (sql.reserve(), sql.reserve_insert(), sql.reserve_read());
    let writes = async |statement: &str, key: &RecordKey| {
        reserve_writes(&repo, statement, &request(key, later, lease)).await
    };

    // Duplicates of a completed record and of a live lease: no lock, no xid,
    // through the function and through the plain read.
    for statement in [function, read] {
        assert_eq!(writes(statement, &done).await, (Some(false), false));
        assert_eq!(writes(statement, &held).await, (Some(false), false));
    }
    // A takeover of a stale lease and a fresh key still write, under the lock.
    assert_eq!(writes(function, &stale).await, (Some(true), true));
    assert_eq!(writes(function, &fresh).await, (Some(true), true));
    // The plain insert answers the fresh key alone; meeting any existing key
    // it answers nothing and takes no transaction id (the function decides).
    assert_eq!(writes(insert, &fresh).await, (Some(true), true));
    for key in [&done, &held, &stale] {
        assert_eq!(writes(insert, key).await, (None, false), "{key:?}");
    }
    // The plain read leaves the fresh key and the takeover to the function.
    for key in [&fresh, &stale] {
        assert_eq!(writes(read, key).await, (None, false), "{key:?}");
    }
}
