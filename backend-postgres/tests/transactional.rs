//! Transactional mode: the record and the business writes commit or roll back
//! together.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Config, Error, ExecuteError, FailurePolicy, HandlerError, IdempotencyManager, ManualClock,
    Outcome, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest, Status,
};
use idempotency_postgres::{PgRepository, PgTransactionalManager};
use sqlx::PgConnection;

/// A repository on the shared transactional table, plus a fresh business table.
struct World {
    repo: PgRepository,
    orders: String,
    clock: ManualClock,
    ns: String,
}

impl World {
    async fn new() -> World {
        World::on(common::repository("idem_tx_records").await).await
    }

    /// A repository whose reservations wait for another transaction's hold
    /// on a key up to 4 s (instead of 250 ms): duplicates stay blocked while
    /// a test looks, and get the holder's outcome.
    async fn patient() -> World {
        let builder = PgRepository::builder()
            .table("idem_tx_records")
            .lock_timeout(Duration::from_secs(4));
        World::on(common::repository_from(builder).await).await
    }

    async fn on(repo: PgRepository) -> World {
        let orders = common::unique("idem_tx_orders");
        sqlx::query(&format!(
            "CREATE TABLE {orders} (id text PRIMARY KEY, amount integer NOT NULL)"
        ))
        .execute(repo.pool())
        .await
        .unwrap();
        World {
            repo,
            orders,
            clock: ManualClock::starting_now(),
            ns: common::unique("tx"),
        }
    }

    fn manager(&self, config: Config) -> PgTransactionalManager {
        let config = Config {
            key_prefix: self.ns.clone(),
            ..config
        };
        PgTransactionalManager::new(self.repo.clone(), config)
            .unwrap()
            .with_clock(Arc::new(self.clock.clone()))
    }

    async fn orders(&self) -> Vec<(String, i32)> {
        sqlx::query_as(&format!(
            "SELECT id, amount FROM {} ORDER BY id",
            self.orders
        ))
        .fetch_all(self.repo.pool())
        .await
        .unwrap()
    }

    async fn record_status(&self, id: &str) -> Option<Status> {
        let key = RecordKey::new(self.ns.as_str(), id, 1024).unwrap();
        self.repo
            .get(&key, self.clock.now())
            .await
            .unwrap()
            .map(|r| r.status)
    }

    /// Waits (bounded, polling the server) until some session is blocked on a
    /// lock held by the backend `holder`: the duplicate is queued behind the open
    /// transaction, not answered and not running.
    async fn wait_until_blocked_by(&self, holder: i32) {
        for _ in 0..2000 {
            let (waiting,): (i64,) = sqlx::query_as(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(holder)
            .fetch_one(self.repo.pool())
            .await
            .unwrap();
            if waiting > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("no session queued behind backend {holder} within 10 s");
    }

    async fn drop_orders(&self) {
        sqlx::query(&format!("DROP TABLE {}", self.orders))
            .execute(self.repo.pool())
            .await
            .unwrap();
    }
}

/// A handler that inserts an order and counts its runs.
/// The server process id of the handler's connection (its transaction's owner).
async fn backend_pid(conn: &mut PgConnection) -> i32 {
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    pid
}

fn insert_order(
    table: String,
    id: &'static str,
    amount: i32,
    runs: Arc<AtomicUsize>,
) -> impl for<'c> FnOnce(
    &'c mut PgConnection,
) -> idempotency_core::BoxFuture<'c, Result<String, HandlerError<String>>> {
    move |conn: &mut PgConnection| {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            sqlx::query(&format!("INSERT INTO {table} (id, amount) VALUES ($1, $2)"))
                .bind(id)
                .bind(amount)
                .execute(&mut *conn)
                .await
                .map_err(|e| HandlerError::transient(e.to_string()))?;
            Ok(format!("receipt-{id}"))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_commits_business_write_and_record_together() {
    let w = World::new().await;
    let m = w.manager(Config::default());
    let runs = Arc::new(AtomicUsize::new(0));

    let first = m
        .execute(
            "order-1",
            &1,
            insert_order(w.orders.clone(), "o1", 10, runs.clone()),
        )
        .await
        .unwrap();
    assert!(
        matches!(&first, Outcome::Executed(r) if r == "receipt-o1"),
        "{first:?}"
    );
    assert_eq!(w.orders().await, vec![("o1".to_owned(), 10)]);
    assert_eq!(w.record_status("order-1").await, Some(Status::Completed));

    // The redelivery replays the result without running (or writing) again.
    let again = m
        .execute(
            "order-1",
            &1,
            insert_order(w.orders.clone(), "o1", 10, runs.clone()),
        )
        .await
        .unwrap();
    assert!(
        matches!(&again, Outcome::Cached(r) if r == "receipt-o1"),
        "{again:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(w.orders().await.len(), 1);

    // The non-transactional manager over the same table sees the same record.
    let config = Config {
        key_prefix: w.ns.clone(),
        ..Config::default()
    };
    let plain = IdempotencyManager::new(Arc::new(w.repo.clone()), config)
        .unwrap()
        .with_clock(Arc::new(w.clock.clone()));
    let seen = plain
        .execute("order-1", &1, || async {
            Ok::<_, HandlerError<String>>("other".to_owned())
        })
        .await
        .unwrap();
    assert!(
        matches!(&seen, Outcome::Cached(r) if r == "receipt-o1"),
        "{seen:?}"
    );
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_error_rolls_back_business_write_and_record_together() {
    let w = World::new().await;
    let m = w.manager(Config::default());
    let orders = w.orders.clone();
    let err = m
        .execute("order-2", &2, move |conn: &mut PgConnection| {
            Box::pin(async move {
                sqlx::query(&format!(
                    "INSERT INTO {orders} (id, amount) VALUES ('o2', 20)"
                ))
                .execute(&mut *conn)
                .await
                .map_err(|e| HandlerError::transient(e.to_string()))?;
                // The write happened inside the transaction; now the handler fails.
                Err::<String, _>(HandlerError::new("card declined".to_owned()))
            })
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ExecuteError::Handler(e) if e == "card declined"),
        "{err:?}"
    );
    assert!(
        w.orders().await.is_empty(),
        "the business write survived the rollback"
    );
    assert_eq!(
        w.record_status("order-2").await,
        None,
        "the record survived the rollback"
    );

    // Nothing remains, so the redelivery runs and commits.
    let runs = Arc::new(AtomicUsize::new(0));
    let retry = m
        .execute(
            "order-2",
            &2,
            insert_order(w.orders.clone(), "o2", 20, runs.clone()),
        )
        .await
        .unwrap();
    assert!(matches!(retry, Outcome::Executed(_)), "{retry:?}");
    assert_eq!(w.orders().await, vec![("o2".to_owned(), 20)]);
    assert_eq!(w.record_status("order-2").await, Some(Status::Completed));
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_failure_rolls_back_the_write_and_keeps_the_error() {
    let w = World::new().await;
    let m = w.manager(Config {
        failure_policy: FailurePolicy::Store,
        ..Config::default()
    });
    let orders = w.orders.clone();
    let err = m
        .execute("order-3", &3, move |conn: &mut PgConnection| {
            Box::pin(async move {
                sqlx::query(&format!(
                    "INSERT INTO {orders} (id, amount) VALUES ('o3', 30)"
                ))
                .execute(&mut *conn)
                .await
                .map_err(|e| HandlerError::transient(e.to_string()))?;
                Err::<String, _>(HandlerError::new("out of stock".to_owned()))
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ExecuteError::Handler(_)));
    assert!(w.orders().await.is_empty());
    assert_eq!(w.record_status("order-3").await, Some(Status::Failed));

    let runs = Arc::new(AtomicUsize::new(0));
    let dup = m
        .execute(
            "order-3",
            &3,
            insert_order(w.orders.clone(), "o3", 30, runs.clone()),
        )
        .await
        .unwrap_err();
    match dup {
        ExecuteError::Idempotency(Error::PreviouslyFailed { error, .. }) => {
            assert_eq!(error, b"out of stock")
        }
        other => panic!("expected PreviouslyFailed, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // A transient error under the same policy releases instead.
    let err = m
        .execute("order-3b", &3, |_conn: &mut PgConnection| {
            Box::pin(async { Err::<String, _>(HandlerError::transient("timeout".to_owned())) })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ExecuteError::Handler(_)));
    assert_eq!(w.record_status("order-3b").await, None);
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_waits_for_the_open_transaction_then_replays() {
    let w = World::patient().await;
    let m = w.manager(Config::default());
    let runs = Arc::new(AtomicUsize::new(0));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<i32>();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();

    let first = {
        let (m, orders, runs) = (m.clone(), w.orders.clone(), runs.clone());
        tokio::spawn(async move {
            m.execute("order-4", &4, move |conn: &mut PgConnection| {
                Box::pin(async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    sqlx::query(&format!(
                        "INSERT INTO {orders} (id, amount) VALUES ('o4', 40)"
                    ))
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| HandlerError::transient(e.to_string()))?;
                    started_tx.send(backend_pid(conn).await).unwrap();
                    finish_rx.await.unwrap();
                    Ok::<_, HandlerError<String>>("receipt-o4".to_owned())
                })
            })
            .await
        })
    };
    let holder = started_rx.await.unwrap();

    let second = {
        let (m, orders, runs) = (m.clone(), w.orders.clone(), runs.clone());
        tokio::spawn(async move {
            m.execute("order-4", &4, insert_order(orders, "o4", 40, runs))
                .await
        })
    };
    // The duplicate is blocked on the row lock while the first transaction is
    // open, within its lock bound (it neither runs the handler nor answers
    // InProgress yet; past the bound it would: see `held_by_transaction.rs`).
    w.wait_until_blocked_by(holder).await;
    assert!(
        !second.is_finished(),
        "the duplicate did not wait for the open transaction"
    );
    assert_eq!(
        w.record_status("order-4").await,
        None,
        "an uncommitted record is visible"
    );

    finish_tx.send(()).unwrap();
    let first = first.await.unwrap().unwrap();
    assert!(matches!(first, Outcome::Executed(_)), "{first:?}");
    let second = second.await.unwrap().unwrap();
    assert!(
        matches!(&second, Outcome::Cached(r) if r == "receipt-o4"),
        "{second:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(w.orders().await.len(), 1);
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_runs_after_the_open_transaction_rolls_back() {
    let w = World::patient().await;
    let m = w.manager(Config::default());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<i32>();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute("order-5", &5, move |conn: &mut PgConnection| {
                Box::pin(async move {
                    started_tx.send(backend_pid(conn).await).unwrap();
                    finish_rx.await.unwrap();
                    Err::<String, _>(HandlerError::new("boom".to_owned()))
                })
            })
            .await
        })
    };
    let holder = started_rx.await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let second = {
        let (m, orders, runs) = (m.clone(), w.orders.clone(), runs.clone());
        tokio::spawn(async move {
            m.execute("order-5", &5, insert_order(orders, "o5", 50, runs))
                .await
        })
    };
    w.wait_until_blocked_by(holder).await;
    assert!(!second.is_finished());
    finish_tx.send(()).unwrap();
    assert!(matches!(
        first.await.unwrap(),
        Err(ExecuteError::Handler(_))
    ));
    let second = second.await.unwrap().unwrap();
    assert!(matches!(second, Outcome::Executed(_)), "{second:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(w.orders().await, vec![("o5".to_owned(), 50)]);
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_deliveries_write_exactly_once() {
    let w = World::patient().await;
    let m = w.manager(Config::default());
    let runs = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (m, orders, runs) = (m.clone(), w.orders.clone(), runs.clone());
            tokio::spawn(async move {
                m.execute("order-6", &6, insert_order(orders, "o6", 60, runs))
                    .await
            })
        })
        .collect();
    let mut executed = 0;
    for t in tasks {
        match t.await.unwrap().unwrap() {
            Outcome::Executed(_) => executed += 1,
            Outcome::Cached(r) => assert_eq!(r, "receipt-o6"),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(w.orders().await.len(), 1);
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_handler_rolls_back() {
    let w = World::new().await;
    let m = w.manager(Config::default());
    let orders = w.orders.clone();
    let joined = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute("order-7", &7, move |conn: &mut PgConnection| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "INSERT INTO {orders} (id, amount) VALUES ('o7', 70)"
                    ))
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                    panic!("handler bug");
                    #[allow(unreachable_code)]
                    Ok::<String, HandlerError<String>>(String::new())
                })
            })
            .await
        })
        .await
    };
    assert!(joined.unwrap_err().is_panic());
    let runs = Arc::new(AtomicUsize::new(0));
    // The dropped transaction rolled back: the key is free and nothing was written.
    let retry = m
        .execute(
            "order-7",
            &7,
            insert_order(w.orders.clone(), "o7", 70, runs),
        )
        .await
        .unwrap();
    assert!(matches!(retry, Outcome::Executed(_)), "{retry:?}");
    assert_eq!(w.orders().await, vec![("o7".to_owned(), 70)]);
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_mismatch_is_refused() {
    let w = World::new().await;
    let m = w.manager(Config::default());
    let runs = Arc::new(AtomicUsize::new(0));
    m.execute(
        "order-8",
        &8,
        insert_order(w.orders.clone(), "o8", 80, runs.clone()),
    )
    .await
    .unwrap();
    let err = m
        .execute(
            "order-8",
            &9,
            insert_order(w.orders.clone(), "o8", 80, runs.clone()),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ExecuteError::Idempotency(Error::PayloadMismatch { .. })
        ),
        "{err:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    w.drop_orders().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_transaction_handle_commits_or_rolls_back_with_the_caller() {
    let w = World::new().await;
    let now = w.clock.now();
    let key = RecordKey::new(w.ns.as_str(), "manual", 1024).unwrap();
    let request = |owner| ReserveRequest {
        key: &key,
        owner,
        fingerprint: None,
        now,
        lease_until: now + Duration::from_secs(30),
        expires_at: now + Duration::from_secs(3600),
        retry_failed: false,
        clock_skew: Duration::ZERO,
    };
    let insert = format!("INSERT INTO {} (id, amount) VALUES ('m', 1)", w.orders);

    // Rolled back: neither the record nor the write remain.
    let owner = OwnerToken::random();
    let mut tx = w.repo.pool().begin().await.unwrap();
    let r = w
        .repo
        .in_transaction(&mut tx)
        .reserve(request(owner))
        .await
        .unwrap();
    assert_eq!(r, Reservation::Acquired { attempt: 1 });
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    let mut ops = w.repo.in_transaction(&mut tx);
    ops.complete(
        &key,
        owner,
        Some(b"done"),
        now + Duration::from_secs(3600),
        now,
    )
    .await
    .unwrap();
    // Inside the transaction its own changes are visible.
    assert_eq!(
        ops.get(&key, now).await.unwrap().unwrap().status,
        Status::Completed
    );
    tx.rollback().await.unwrap();
    assert!(w.repo.get(&key, now).await.unwrap().is_none());
    assert!(w.orders().await.is_empty());

    // Committed: both are there.
    let owner = OwnerToken::random();
    let mut tx = w.repo.pool().begin().await.unwrap();
    let mut ops = w.repo.in_transaction(&mut tx);
    assert_eq!(
        ops.reserve(request(owner)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    let until = now + Duration::from_secs(60);
    ops.extend(&key, owner, until, until, now).await.unwrap();
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    let mut ops = w.repo.in_transaction(&mut tx);
    ops.fail(
        &key,
        owner,
        Some(b"kept"),
        false,
        now + Duration::from_secs(3600),
        now,
    )
    .await
    .unwrap();
    assert!(matches!(
        ops.release(&key, owner, now).await,
        Err(Error::LeaseLost { .. })
    ));
    tx.commit().await.unwrap();
    let stored = w.repo.get(&key, now).await.unwrap().unwrap();
    assert_eq!(
        (stored.status, stored.error.as_deref()),
        (Status::Failed, Some(&b"kept"[..]))
    );
    assert_eq!(w.orders().await.len(), 1);

    let mut conn = w.repo.pool().acquire().await.unwrap();
    assert!(w.repo.in_transaction(&mut conn).delete(&key).await.unwrap());
    w.drop_orders().await;
}

/// The repository's operation timeout bounds this crate's statements only: a
/// business statement in the handler's transaction may run longer (it used to
/// be cancelled by a connection-wide `statement_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_statements_may_outlast_the_operation_timeout() {
    let w = World::new().await;
    let repo = PgRepository::builder()
        .table(w.repo.table())
        .operation_timeout(Duration::from_millis(100))
        .connect(&common::server_url().await)
        .await
        .unwrap();
    let config = Config {
        key_prefix: w.ns.clone(),
        ..Config::default()
    };
    let m = PgTransactionalManager::new(repo, config).unwrap();
    let out = m
        .execute("slow-order", &1, slow_order(w.orders.clone()))
        .await
        .unwrap();
    assert!(
        matches!(&out, Outcome::Executed(r) if r == "done"),
        "{out:?}"
    );
    assert_eq!(w.orders().await, vec![("slow".to_owned(), 1)]);
    assert_eq!(w.record_status("slow-order").await, Some(Status::Completed));
    w.drop_orders().await;
}

/// A handler whose first statement takes 400 ms on the server.
fn slow_order(
    table: String,
) -> impl for<'c> FnOnce(
    &'c mut PgConnection,
) -> idempotency_core::BoxFuture<'c, Result<String, HandlerError<String>>> {
    move |conn: &mut PgConnection| {
        Box::pin(async move {
            let fail = |e: sqlx::Error| HandlerError::permanent(e.to_string());
            sqlx::query("SELECT pg_sleep(0.4)")
                .execute(&mut *conn)
                .await
                .map_err(fail)?;
            sqlx::query(&format!(
                "INSERT INTO {table} (id, amount) VALUES ('slow', 1)"
            ))
            .execute(&mut *conn)
            .await
            .map_err(fail)?;
            Ok("done".to_owned())
        })
    }
}

/// The transactional manager shares the manager's front: scopes follow the
/// same rules (one too long is refused when it is made, not at every call)
/// and name the same records, and executions are counted in the same metrics.
#[test]
fn shares_the_managers_front() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let world = World::new().await;
            let tx = world.manager(Config::default());
            let long = "s".repeat(600);
            assert!(
                matches!(tx.scoped(&long), Err(Error::InvalidKey { .. })),
                "a scope longer than the namespace allows is refused"
            );
            let tx = tx.scoped("orders").unwrap();
            let config = Config {
                key_prefix: world.ns.clone(),
                ..Config::default()
            };
            let plain = IdempotencyManager::new(Arc::new(world.repo.clone()), config)
                .unwrap()
                .scoped("orders")
                .unwrap();
            assert_eq!(tx.namespace(), plain.namespace());

            let runs = Arc::new(AtomicUsize::new(0));
            for expect_run in [true, false] {
                let handler = insert_order(world.orders.clone(), "o-1", 5, runs.clone());
                let answer = tx.execute("o-1", &5, handler).await.unwrap();
                assert_eq!(answer.handler_ran(), expect_run, "{answer:?}");
            }
            let replay = plain
                .execute("o-1", &5, || async {
                    Err::<String, _>(HandlerError::permanent("ran again".to_owned()))
                })
                .await
                .unwrap();
            assert!(matches!(replay, Outcome::Cached(_)), "{replay:?}");
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            world.drop_orders().await;
        });
    });
    let counters: std::collections::HashMap<String, u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => Some((key.key().name().to_owned(), n)),
            _ => None,
        })
        .collect();
    // One run (the transactional one), two replays (one from each manager).
    assert_eq!(
        counters.get("idempotency_cache_misses"),
        Some(&1),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("idempotency_cache_hits"),
        Some(&2),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("idempotency_duplicates_blocked"),
        Some(&2),
        "{counters:?}"
    );
}
