//! A key held by a live transaction is "in progress", never an outage (issue
//! #42, part 1).
//!
//! A [`PgTransactionalManager`] holds key K: its row inserted, not committed,
//! while its handler runs. Duplicates of K reach a plain
//! [`IdempotencyManager`] over the same repository, on a pool of four
//! connections (the holder's transaction has one), with a store timeout of
//! one second. Their reservations wait for K's row lock at most the
//! repository's `lock_timeout`, on the server, and are answered `InProgress`:
//! never retried as an outage, never run beside the holder under fail-open,
//! and never leaving a pooled connection blocked behind the transaction, so a
//! duplicate of an already completed key L is still answered from its record.
//! The holder holds K until the test has its answers (at most [`HOLD`]); the
//! effects of each key are counted. The repository's own answer (every
//! reserve plan, each way of setting the bound, on the caller's transaction)
//! is checked at the end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Clock, Config, Error, ExecuteError, HandlerError, IdempotencyManager, InProgressPolicy,
    OutagePolicy, Outcome, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest,
    SystemClock, Timestamp,
};
use idempotency_postgres::{
    PgRepository, PgTransactionalManager, ReservePlan, DEFAULT_LOCK_TIMEOUT,
};
use sqlx::PgConnection;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const TABLE: &str = "idem_held_by_tx";

/// The longest the holder keeps K (it lets go as soon as the test has its
/// answers): longer than the three reserve attempts of one second each that
/// turned a duplicate into an outage before.
const HOLD: Duration = Duration::from_secs(5);

/// A bound on every answer the test waits for, so that a regression fails
/// instead of hanging.
const ANSWER_WITHIN: Duration = Duration::from_secs(20);

type Answer = Result<Outcome<String>, ExecuteError<String>>;

/// The repository under test on a pool of four, its managers' configuration,
/// and the count of each key's effects.
struct World {
    repo: PgRepository,
    config: Config,
    k: Arc<AtomicUsize>,
    l: Arc<AtomicUsize>,
}

impl World {
    async fn new(policy: OutagePolicy, in_progress: InProgressPolicy) -> World {
        common::repository(TABLE).await; // migrated
        let repo = PgRepository::builder()
            .table(TABLE)
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&common::server_url().await)
            .await
            .unwrap();
        let config = Config {
            key_prefix: common::unique("held"),
            on_store_outage: policy,
            in_progress,
            store_timeout: Duration::from_secs(1),
            ..Config::default()
        };
        World {
            repo,
            config,
            k: Arc::default(),
            l: Arc::default(),
        }
    }

    fn plain(&self) -> IdempotencyManager {
        IdempotencyManager::new(Arc::new(self.repo.clone()), self.config.clone()).unwrap()
    }

    fn plain_with(&self, in_progress: InProgressPolicy) -> IdempotencyManager {
        let config = Config {
            in_progress,
            ..self.config.clone()
        };
        IdempotencyManager::new(Arc::new(self.repo.clone()), config).unwrap()
    }

    /// A delivery of `key` to `manager` on a task of its own; its handler
    /// counts one effect of the key.
    fn deliver(&self, manager: &IdempotencyManager, key: &'static str) -> JoinHandle<Answer> {
        let manager = manager.clone();
        let effects = if key == "K" {
            self.k.clone()
        } else {
            self.l.clone()
        };
        tokio::spawn(async move {
            manager
                .execute(key, &key, || async move {
                    effects.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError<String>>(format!("{key} done"))
                })
                .await
        })
    }

    /// L, completed before the test begins.
    async fn complete_l(&self) {
        let done = self.deliver(&self.plain(), "L").await.unwrap().unwrap();
        assert!(matches!(done, Outcome::Executed(_)), "{done:?}");
    }

    /// The transactional manager holds K: once this returns, K's row is
    /// inserted and locked by its open transaction (whose server process id
    /// is returned), until `release` is sent or [`HOLD`] passes.
    async fn hold_k(&self) -> Holder {
        let manager = PgTransactionalManager::new(self.repo.clone(), self.config.clone()).unwrap();
        let (started, pid) = oneshot::channel();
        let (release, released) = oneshot::channel::<()>();
        let effects = self.k.clone();
        let task = tokio::spawn(async move {
            manager
                .execute("K", &"K", move |conn: &mut PgConnection| {
                    Box::pin(async move {
                        effects.fetch_add(1, Ordering::SeqCst);
                        let (me,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
                            .fetch_one(&mut *conn)
                            .await
                            .unwrap();
                        started.send(me).unwrap();
                        let _ = tokio::time::timeout(HOLD, released).await;
                        Ok::<_, HandlerError<String>>("K done".to_owned())
                    })
                })
                .await
        });
        Holder {
            pid: pid.await.unwrap(),
            release,
            task,
        }
    }

    /// How many sessions wait for a lock the backend `pid` holds.
    async fn waiting_behind(&self, pid: i32) -> i64 {
        waiting_behind(&self.repo, pid).await
    }

    /// Waits (bounded, polling the server: no clock drives another
    /// session's lock wait) until a session waits for the backend `pid`.
    async fn until_waiting_behind(&self, pid: i32) {
        for _ in 0..2000 {
            if self.waiting_behind(pid).await > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("no session waited behind backend {pid} within 10 s");
    }
}

/// How many sessions wait for a lock the backend `pid` holds.
async fn waiting_behind(repo: &PgRepository, pid: i32) -> i64 {
    let (waiting,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
    )
    .bind(pid)
    .fetch_one(repo.pool())
    .await
    .unwrap();
    waiting
}

struct Holder {
    pid: i32,
    release: oneshot::Sender<()>,
    task: JoinHandle<Answer>,
}

impl Holder {
    /// Lets the handler return; the transaction commits K.
    async fn commit(self) {
        let _ = self.release.send(());
        let done = answer(self.task).await;
        assert!(
            matches!(&done, Ok(Outcome::Executed(v)) if v == "K done"),
            "{done:?}"
        );
    }
}

async fn answer(task: JoinHandle<Answer>) -> Answer {
    tokio::time::timeout(ANSWER_WITHIN, task)
        .await
        .expect("answered")
        .unwrap()
}

fn in_progress(answer: &Answer) -> bool {
    matches!(
        answer,
        Err(ExecuteError::Idempotency(Error::InProgress { .. }))
    )
}

/// The scenario under one outage policy, answering duplicates at once.
async fn duplicates_of_a_key_held_by_a_transaction(policy: OutagePolicy) {
    let w = World::new(policy, InProgressPolicy::FailFast).await;
    w.complete_l().await;
    let holder = w.hold_k().await;

    // Three duplicates of K and one of L at once: the holder's transaction
    // has one of the four connections, the duplicates of K the others.
    let plain = w.plain();
    let dups: Vec<_> = (0..3).map(|_| w.deliver(&plain, "K")).collect();
    let l = w.deliver(&plain, "L");
    for dup in dups {
        let dup = answer(dup).await;
        assert!(
            in_progress(&dup),
            "{policy:?}: a duplicate of K got {dup:?}"
        );
        if let Err(ExecuteError::Idempotency(Error::InProgress { retry_after, .. })) = dup {
            assert!(retry_after <= DEFAULT_LOCK_TIMEOUT, "{retry_after:?}");
        }
    }
    let l = answer(l).await;
    assert!(
        matches!(&l, Ok(Outcome::Cached(v)) if v == "L done"),
        "{policy:?}: L got {l:?}"
    );
    // Each duplicate's statement ended on the server: nothing waits behind
    // the transaction, no pooled connection is held by an abandoned wait.
    assert_eq!(w.waiting_behind(holder.pid).await, 0);
    assert_eq!(
        w.k.load(Ordering::SeqCst),
        1,
        "{policy:?}: K ran beside its holder"
    );

    holder.commit().await;
    let after = answer(w.deliver(&plain, "K")).await;
    assert!(
        matches!(&after, Ok(Outcome::Cached(v)) if v == "K done"),
        "{after:?}"
    );
    assert_eq!(w.k.load(Ordering::SeqCst), 1, "{policy:?}: effects of K");
    assert_eq!(w.l.load(Ordering::SeqCst), 1, "{policy:?}: effects of L");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_held_by_a_transaction_is_in_progress_under_fail_open() {
    duplicates_of_a_key_held_by_a_transaction(OutagePolicy::FailOpen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_held_by_a_transaction_is_in_progress_under_fail_closed() {
    duplicates_of_a_key_held_by_a_transaction(OutagePolicy::FailClosed).await;
}

/// Under the wait policy a duplicate polls while the transaction holds the
/// key: past its wait it gets `InProgress` (never an outage, never run
/// beside the holder); one still waiting when the transaction commits gets
/// its result.
/// A `store_timeout` the lock wait could outlast (150 ms against the default
/// 250 ms): the manager's own timer would fire first, the reservation would
/// be a `Timeout` (an outage), and fail-open would run the handler beside
/// the holder. Refused when the manager is built; twice the wait is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_timeout_the_lock_wait_could_outlast_is_refused() {
    let world = World::new(OutagePolicy::FailOpen, InProgressPolicy::FailFast).await;
    let wait = world.repo.statements().lock_timeout();
    let store: idempotency_core::SharedRepository = Arc::new(world.repo.clone());
    assert_eq!(store.capabilities().max_lock_wait, Some(wait));
    let with = |store_timeout| Config {
        store_timeout,
        ..world.config.clone()
    };
    let short = IdempotencyManager::new(store.clone(), with(Duration::from_millis(150)));
    assert!(
        matches!(&short, Err(idempotency_core::Error::Config { message }) if message.contains("lock wait")),
        "{short:?}"
    );
    IdempotencyManager::new(store, with(wait * 2)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_duplicates_poll_a_key_held_by_a_transaction() {
    for policy in [OutagePolicy::FailOpen, OutagePolicy::FailClosed] {
        let short = InProgressPolicy::Wait {
            timeout: Duration::from_millis(1500),
            poll_interval: Duration::from_millis(50),
        };
        let w = World::new(policy, short).await;
        let holder = w.hold_k().await;
        let waited_out: Vec<_> = (0..3).map(|_| w.deliver(&w.plain(), "K")).collect();
        for dup in waited_out {
            let dup = answer(dup).await;
            assert!(in_progress(&dup), "{policy:?}: {dup:?}");
        }
        assert_eq!(w.k.load(Ordering::SeqCst), 1, "{policy:?}");

        let long = InProgressPolicy::Wait {
            timeout: Duration::from_secs(15),
            poll_interval: Duration::from_millis(50),
        };
        let waiting = w.deliver(&w.plain_with(long), "K");
        w.until_waiting_behind(holder.pid).await;
        holder.commit().await;
        let got = answer(waiting).await;
        assert!(
            matches!(&got, Ok(Outcome::Cached(v)) if v == "K done"),
            "{policy:?}: {got:?}"
        );
        assert_eq!(w.k.load(Ordering::SeqCst), 1, "{policy:?}");
    }
}

/// A batch with K in it: K is `InProgress` on its own, the other keys of the
/// group get their own answers (a fresh key runs, a completed one replays),
/// nothing runs beside the holder, whichever outage policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_with_a_key_held_by_a_transaction() {
    for policy in [OutagePolicy::FailOpen, OutagePolicy::FailClosed] {
        let w = World::new(policy, InProgressPolicy::FailFast).await;
        w.complete_l().await;
        let holder = w.hold_k().await;
        let items = [("K", "K"), ("M", "M"), ("L", "L"), ("K", "K")];
        let (k, l, m) = (w.k.clone(), w.l.clone(), Arc::new(AtomicUsize::new(0)));
        let answers = w
            .plain()
            .execute_batch(&items, 8, |i, _ctx| {
                match items[i].0 {
                    "K" => &k,
                    "L" => &l,
                    _ => &m,
                }
                .fetch_add(1, Ordering::SeqCst);
                async move { Ok::<_, HandlerError<String>>(format!("{} done", items[i].0)) }
            })
            .await;
        assert!(in_progress(&answers[0]), "{policy:?}: {:?}", answers[0]);
        assert!(
            matches!(&answers[1], Ok(Outcome::Executed(v)) if v == "M done"),
            "{answers:?}"
        );
        assert!(
            matches!(&answers[2], Ok(Outcome::Cached(v)) if v == "L done"),
            "{answers:?}"
        );
        assert!(in_progress(&answers[3]), "{policy:?}: {:?}", answers[3]);
        assert_eq!(w.waiting_behind(holder.pid).await, 0);
        holder.commit().await;
        let effects = [&w.k, &w.l, &m].map(|c| c.load(Ordering::SeqCst));
        assert_eq!(effects, [1, 1, 1], "{policy:?}: effects of K, L, M");
    }
}

/// Another transactional delivery of K waits for the holder at most the
/// repository's `lock_timeout`, then gets `InProgress` and leaves its
/// transaction; with a longer `lock_timeout` it waits for the commit and
/// replays the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transactional_duplicate_waits_at_most_the_lock_timeout() {
    let w = World::new(OutagePolicy::FailClosed, InProgressPolicy::FailFast).await;
    let holder = w.hold_k().await;
    let tx = PgTransactionalManager::new(w.repo.clone(), w.config.clone()).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let duplicate = |tx: PgTransactionalManager, runs: Arc<AtomicUsize>| {
        tokio::spawn(async move {
            tx.execute("K", &"K", move |_conn: &mut PgConnection| {
                Box::pin(async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError<String>>("again".to_owned())
                })
            })
            .await
        })
    };
    let dup = answer(duplicate(tx, runs.clone())).await;
    assert!(in_progress(&dup), "{dup:?}");
    assert_eq!(w.waiting_behind(holder.pid).await, 0);

    let patient = PgRepository::builder()
        .table(TABLE)
        .lock_timeout(Duration::from_secs(4))
        .connect(&common::server_url().await)
        .await
        .unwrap();
    let tx = PgTransactionalManager::new(patient, w.config.clone()).unwrap();
    let waiting = duplicate(tx, runs.clone());
    w.until_waiting_behind(holder.pid).await;
    holder.commit().await;
    let got = answer(waiting).await;
    assert!(
        matches!(&got, Ok(Outcome::Cached(v)) if v == "K done"),
        "{got:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(w.k.load(Ordering::SeqCst), 1);
}

// ------------------------------------------------------- the repository

fn req(key: &RecordKey, now: Timestamp, lease: Duration) -> ReserveRequest<'_> {
    ReserveRequest::new(
        key,
        OwnerToken::random(),
        now,
        lease,
        Duration::from_secs(3600),
    )
}

fn now() -> Timestamp {
    SystemClock.now()
}

/// A reservation waits for a key that another transaction holds (its
/// reservation not committed) at most the repository's `lock_timeout`, on
/// the server — through every reserve plan, whether the bound is the
/// default, derived from a short operation timeout or set (here in the URL,
/// over a role setting the caller passed for its own statements) — and is
/// then answered `InProgress`: the store answered and the key is held, not
/// an outage. Nothing was applied, and no session is left waiting behind the
/// holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_on_row_locks_are_answered_in_progress() {
    let repo = common::repository(TABLE).await;
    let ns = common::unique("locked");
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let t = now();
    // An open transaction holds the key's row lock.
    let mut tx = repo.pool().begin().await.unwrap();
    assert!(matches!(
        repo.in_transaction(&mut tx)
            .reserve(req(&key, t, Duration::from_secs(30)))
            .await
            .unwrap(),
        Reservation::Acquired { .. }
    ));
    let (holder,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();

    let url = common::server_url().await;
    let sep = if url.contains('?') { '&' } else { '?' };
    let mut repos = Vec::new();
    for plan in [
        ReservePlan::Function,
        ReservePlan::InsertFirst,
        ReservePlan::ReadFirst,
    ] {
        let planned = common::repository_with(TABLE, plan).await;
        repos.push((planned, DEFAULT_LOCK_TIMEOUT));
    }
    let short = PgRepository::builder()
        .table(TABLE)
        .operation_timeout(Duration::from_millis(300))
        .connect(&url)
        .await
        .unwrap();
    repos.push((short, Duration::from_millis(150)));
    let set = PgRepository::from_url(&format!(
        "{url}{sep}table={TABLE}&lock_timeout=40ms&options=-c%20lock_timeout%3D60000"
    ))
    .await
    .unwrap();
    repos.push((set, Duration::from_millis(40)));
    for (repo, bound) in &repos {
        assert_eq!(repo.statements().lock_timeout(), *bound);
        let err = repo
            .reserve(req(&key, t, Duration::from_secs(30)))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::InProgress { key: k, retry_after } if *k == key && retry_after == bound),
            "{repo:?}: {err:?}"
        );
        assert!(err.is_retryable() && !err.is_store_outage());
        assert_eq!(
            waiting_behind(repo, holder).await,
            0,
            "the refused statement still waits on the server"
        );
    }

    tx.rollback().await.unwrap();
    // Nothing of the refused reservations was applied: the key is fresh.
    assert_eq!(
        repo.reserve(req(&key, t, Duration::from_secs(30)))
            .await
            .unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
}

/// A reservation on the caller's own transaction waits for another
/// transaction's hold on the key at most the repository's `lock_timeout`
/// too, and leaves the caller's own `lock_timeout` as it was once it
/// answers: the bound is the reservation's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_in_a_transaction_keeps_the_callers_lock_timeout() {
    let repo = common::repository(TABLE).await;
    let ns = common::unique("caller-lock");
    let (held, free) = (
        RecordKey::new(ns.as_str(), "held", 1024).unwrap(),
        RecordKey::new(ns.as_str(), "free", 1024).unwrap(),
    );
    let t = now();
    let mut holder = repo.pool().begin().await.unwrap();
    repo.in_transaction(&mut holder)
        .reserve(req(&held, t, Duration::from_secs(30)))
        .await
        .unwrap();

    let mut tx = repo.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '7s'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let answer = repo
        .in_transaction(&mut tx)
        .reserve(req(&free, t, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(answer, Reservation::Acquired { attempt: 1 });
    let setting: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(setting, "7s");
    // The held key: refused after the repository's bound, not the caller's 7 s.
    let err = repo
        .in_transaction(&mut tx)
        .reserve(req(&held, t, Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err:?}");
    tx.rollback().await.unwrap();
    holder.rollback().await.unwrap();
}

/// A completion, failure, extension, release or delete on the repository's
/// own connections that waits for a row another transaction holds (here an
/// uncommitted extension of it) gives up at the lock bound on the server: a
/// retryable `Timeout`, nothing applied, no session left waiting behind the
/// holder, so no pooled connection stays blocked after its caller gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_waiting_for_a_held_row_give_up_at_the_lock_timeout() {
    let repo = common::repository(TABLE).await;
    let ns = common::unique("held-row");
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let (t, lease, ttl) = (now(), Duration::from_secs(30), Duration::from_secs(3600));
    let owner = OwnerToken::random();
    let reserved = repo
        .reserve(ReserveRequest {
            owner,
            ..req(&key, t, lease)
        })
        .await
        .unwrap();
    assert_eq!(reserved, Reservation::Acquired { attempt: 1 });
    let mut tx = repo.pool().begin().await.unwrap();
    repo.in_transaction(&mut tx)
        .extend(&key, owner, t + lease * 2, t + ttl, t)
        .await
        .unwrap();
    let (holder,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();

    let later = t + Duration::from_millis(1);
    let answers = [
        (
            "complete",
            repo.complete(&key, owner, Some(b"r"), later + ttl, later)
                .await,
        ),
        (
            "fail",
            repo.fail(&key, owner, None, false, later + ttl, later)
                .await,
        ),
        (
            "extend",
            repo.extend(&key, owner, later + lease, later + ttl, later)
                .await,
        ),
        ("release", repo.release(&key, owner, later).await),
        ("delete", repo.delete(&key).await.map(|_| ())),
    ];
    for (operation, answer) in answers {
        let err = answer.unwrap_err();
        assert!(
            matches!(err, Error::Timeout { operation: o, .. } if o == operation),
            "{operation}: {err:?}"
        );
        assert_eq!(waiting_behind(&repo, holder).await, 0, "{operation}");
    }
    tx.rollback().await.unwrap();
    let record = repo.get(&key, later).await.unwrap().unwrap();
    assert_eq!(
        (record.owner, record.attempt),
        (owner, 1),
        "nothing applied"
    );
    repo.complete(&key, owner, Some(b"r"), later + ttl, later)
        .await
        .unwrap();
}
