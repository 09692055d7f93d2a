//! What only MySQL/MariaDB shows: byte-exact keys against collations and
//! PAD SPACE, values against `max_allowed_packet`, migrations, racing
//! takeovers from several pools, row-lock waits
//! bounded by timeouts, chunked purges.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Clock, Error, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest, SystemClock,
    Timestamp,
};
use idempotency_mysql::{sqlx, MySqlRepository};

fn req(key: &RecordKey, now: Timestamp, lease: Duration) -> ReserveRequest<'_> {
    ReserveRequest::new(
        key,
        OwnerToken::random(),
        now,
        lease,
        Duration::from_secs(3600),
    )
}

fn namespace(prefix: &str) -> String {
    common::unique_table(prefix)
}

#[tokio::test]
async fn keys_differing_only_in_case_padding_or_nul_are_distinct() {
    let repo = common::repository("idem_mysql", "").await;
    let ns = namespace("exact");
    let t = SystemClock.now();
    // Each would merge with another under a case-insensitive or PAD SPACE
    // collation (or a CHAR column).
    for id in [
        "a", "A", "a ", "a  ", "a\0", "\u{e9}", "e\u{301}", "ß", "ss",
    ] {
        let key = RecordKey::new(ns.as_str(), id, 1024).unwrap();
        assert_eq!(
            repo.reserve(req(&key, t, Duration::from_secs(30)))
                .await
                .unwrap(),
            Reservation::Acquired { attempt: 1 },
            "{id:?} is a key of its own"
        );
    }
}

#[tokio::test]
async fn values_are_capped_below_the_servers_packet_size() {
    let repo = common::repository("idem_mysql", "").await;
    let packet: u64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS UNSIGNED)")
        .fetch_one(repo.pool())
        .await
        .unwrap();
    let cap = repo.capabilities().max_result_bytes.unwrap();
    assert!(
        cap as u64 <= packet,
        "cap {cap} must fit in a {packet}-byte packet"
    );
    assert!(cap >= 1024 * 1024, "cap {cap} leaves a usable size");

    let ns = namespace("packet");
    let t = SystemClock.now();
    let key = RecordKey::new(ns.as_str(), "at-cap", 1024).unwrap();
    let r = req(&key, t, Duration::from_secs(30));
    let owner = r.owner;
    repo.reserve(r).await.unwrap();
    let too_big = vec![7u8; cap + 1];
    let err = repo
        .complete(&key, owner, Some(&too_big), t + Duration::from_secs(60), t)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }), "{err:?}");
    assert!(!err.is_retryable());
    // The largest accepted value goes through the server and back intact.
    let value: Vec<u8> = (0..cap).map(|i| (i % 251) as u8).collect();
    repo.complete(&key, owner, Some(&value), t + Duration::from_secs(60), t)
        .await
        .unwrap();
    let stored = repo.get(&key, t).await.unwrap().unwrap();
    assert_eq!(stored.result.as_deref().map(<[u8]>::len), Some(cap));
    assert!(stored.result.as_deref() == Some(value.as_slice()));
}

/// `max_allowed_packet` lowered on the server after the repository read it
/// (an operator's `SET GLOBAL`, a proxy with a smaller limit): a result that
/// no longer fits is `TooLarge`, not an error the manager would retry until
/// the lease ends and then leave the record to run again; the manager records
/// the execution without its result, the duplicate runs nothing, and later
/// values are checked against the lowered size before any statement. A
/// dedicated server: the setting is the whole server's.
#[tokio::test]
async fn a_packet_size_lowered_since_connect_is_too_large_not_an_outage() {
    use idempotency_conformance::containers::MariaDbServer;
    use idempotency_core::{Config, HandlerError, IdempotencyManager, Outcome};
    use std::sync::atomic::{AtomicUsize, Ordering};
    const LOWERED: usize = 1024 * 1024;

    let server = MariaDbServer::dedicated()
        .await
        .unwrap_or_else(|e| panic!("a dedicated MariaDB server: {e}"));
    let table = namespace("lowered");
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .test_before_acquire(true)
        .connect_lazy(server.url())
        .unwrap();
    // Two repositories that read the size before it was lowered: one
    // called directly, one behind a manager.
    let repo = MySqlRepository::from_pool(pool.clone(), &table)
        .await
        .unwrap();
    repo.migrate().await.unwrap();
    let managed = MySqlRepository::from_pool(pool.clone(), &table)
        .await
        .unwrap();
    assert!(repo.capabilities().max_result_bytes.unwrap() > 2 * LOWERED);

    let t = SystemClock.now();
    let ttl = t + Duration::from_secs(60);
    let ns = namespace("packet");
    let key = RecordKey::new(ns.as_str(), "lowered", 1024).unwrap();
    let r = req(&key, t, Duration::from_secs(30));
    let owner = r.owner;
    repo.reserve(r).await.unwrap();

    // Lowered from a connection of its own; then every connection opened
    // before is cut (the pool, which tests a connection before handing it
    // out, replaces them): the repositories' next statements go over
    // connections with the lowered packet size.
    let mut admin = <sqlx::MySqlConnection as sqlx::Connection>::connect(server.url())
        .await
        .unwrap();
    sqlx::query(&format!("SET GLOBAL max_allowed_packet = {LOWERED}"))
        .execute(&mut admin)
        .await
        .unwrap();
    let others: Vec<i64> = sqlx::query_scalar(
        "SELECT ID FROM information_schema.PROCESSLIST \
         WHERE ID <> CONNECTION_ID() AND USER = 'root'",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    assert!(!others.is_empty(), "the pool's connections");
    for id in others {
        // One that ended meanwhile is gone already.
        let _ = sqlx::query(&format!("KILL {id}")).execute(&mut admin).await;
    }

    // Through the manager: the handler runs once, its execution is recorded
    // without the result, and the duplicate does not run it again.
    let config = Config {
        max_result_size_bytes: usize::MAX,
        ..Config::default()
    };
    let manager = IdempotencyManager::new(Arc::new(managed), config)
        .unwrap()
        .scoped(&ns)
        .unwrap();
    let runs = AtomicUsize::new(0);
    let handler = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, HandlerError<String>>("r".repeat(2 * LOWERED))
    };
    let first = manager.execute("payment", &(), handler).await.unwrap();
    assert!(matches!(&first, Outcome::Executed(v) if v.len() == 2 * LOWERED));
    let again = manager.execute("payment", &(), handler).await.unwrap();
    assert!(matches!(again, Outcome::Duplicate), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Called directly: `TooLarge`, not retryable, nothing applied; the owner
    // still completes, without the value.
    let big = vec![7u8; 2 * LOWERED];
    let err = repo
        .complete(&key, owner, Some(&big), ttl, t)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::TooLarge { what: "result", size, max } if size == big.len() && max < LOWERED),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    repo.complete(&key, owner, None, ttl, t).await.unwrap();
    assert_eq!(repo.get(&key, t).await.unwrap().unwrap().result, None);
    // The lowered size is known from now on: checked before any statement.
    assert!(repo.capabilities().max_result_bytes.unwrap() < LOWERED);
}

/// A server that ends idle sessions (`wait_timeout`, here 2 s) closes the
/// pool's connections while the application is quiet: a connection idle
/// that long is pinged before it is handed out and replaced, so the first
/// operation after the quiet spell succeeds instead of failing on it. A
/// dedicated server: the setting is the whole server's.
#[tokio::test]
async fn connections_the_server_ended_while_idle_are_replaced() {
    use idempotency_conformance::containers::MariaDbServer;

    let server = MariaDbServer::dedicated()
        .await
        .unwrap_or_else(|e| panic!("a dedicated MariaDB server: {e}"));
    let mut admin = <sqlx::MySqlConnection as sqlx::Connection>::connect(server.url())
        .await
        .unwrap();
    sqlx::query("SET GLOBAL wait_timeout = 2")
        .execute(&mut admin)
        .await
        .unwrap();
    let table = namespace("idle");
    let url = format!("{}?table={table}&max_connections=2", server.url());
    let repo = MySqlRepository::connect(&url).await.unwrap();
    let t = SystemClock.now();
    let ns = namespace("idle");
    let first = RecordKey::new(ns.as_str(), "first", 1024).unwrap();
    repo.reserve(req(&first, t, Duration::from_secs(30)))
        .await
        .unwrap();
    // Until the server ended every session but this one (polled, bounded).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE ID <> CONNECTION_ID() AND USER = 'root'",
        )
        .fetch_one(&mut admin)
        .await
        .unwrap();
        if left == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "sessions still open");
        // Keep this session alive meanwhile; a real wait on the server's timer.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = RecordKey::new(ns.as_str(), "after", 1024).unwrap();
    repo.reserve(req(&after, t, Duration::from_secs(30)))
        .await
        .unwrap_or_else(|e| panic!("the first operation after a quiet spell: {e:?}"));
}

#[tokio::test]
async fn migrations_are_idempotent_concurrent_and_versioned() {
    let table = common::unique_table("idem_migrate");
    let url = common::server()
        .await
        .url_with(&format!("table={table}&migrate=false"));
    let repo = MySqlRepository::connect(&url).await.unwrap();
    assert_eq!(repo.schema_version().await.unwrap(), (0, 1));

    // Before migrating: a configuration error naming the table and the fix.
    let key = RecordKey::new("ns", "k", 1024).unwrap();
    let err = repo
        .reserve(req(&key, SystemClock.now(), Duration::from_secs(5)))
        .await
        .unwrap_err();
    match &err {
        Error::Config { message } => {
            assert!(
                message.contains(&table) && message.contains("migrate"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }

    // Four processes starting together; then once more.
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let repo = repo.clone();
            tokio::spawn(async move { repo.migrate().await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    repo.migrate().await.unwrap();
    assert_eq!(repo.schema_version().await.unwrap(), (1, 1));
    let applied: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idempotency_schema_migrations WHERE table_name = ?",
    )
    .bind(&table)
    .fetch_one(repo.pool())
    .await
    .unwrap();
    assert_eq!(applied, 1, "version 1 recorded once");
    assert!(matches!(
        repo.reserve(req(&key, SystemClock.now(), Duration::from_secs(5)))
            .await
            .unwrap(),
        Reservation::Acquired { attempt: 1 }
    ));

    // A table migrated by a newer library is refused, not altered.
    sqlx::query(
        "INSERT INTO idempotency_schema_migrations (table_name, version, description, applied_at) \
         VALUES (?, 99, 'from the future', 0)",
    )
    .bind(&table)
    .execute(repo.pool())
    .await
    .unwrap();
    match repo.migrate().await {
        Err(Error::Config { message }) => assert!(message.contains("99"), "{message}"),
        other => panic!("{other:?}"),
    }
    drop_table(&repo, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_processes_take_over_one_at_a_time() {
    // Three "processes" (own pools) × 16 tasks race on one key per round; each
    // round's lease is stale, so exactly one takes it over.
    let url = common::server()
        .await
        .url_with("table=idem_mysql&max_connections=4");
    let mut repos = Vec::new();
    for _ in 0..3 {
        repos.push(Arc::new(MySqlRepository::connect(&url).await.unwrap()));
    }
    let ns = namespace("race");
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let t0 = SystemClock.now();
    let lease = Duration::from_millis(10);
    assert!(matches!(
        repos[0].reserve(req(&key, t0, lease)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    ));
    for round in 1..=10u32 {
        let at = t0 + Duration::from_millis(u64::from(round) * 100);
        let tasks: Vec<_> = (0..48)
            .map(|i| {
                let (repo, key) = (repos[i % 3].clone(), key.clone());
                tokio::spawn(async move { repo.reserve(req(&key, at, lease)).await })
            })
            .collect();
        let mut winners = Vec::new();
        for t in tasks {
            if let Reservation::Acquired { attempt } = t.await.unwrap().unwrap() {
                winners.push(attempt);
            }
        }
        assert_eq!(winners, vec![round + 1], "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_on_row_locks_are_bounded_by_timeouts() {
    let repo = common::repository("idem_mysql", "").await;
    let ns = namespace("locked");
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let t = SystemClock.now();
    // A stale reservation, and an open transaction holding its row lock.
    repo.reserve(req(&key, t, Duration::from_millis(1)))
        .await
        .unwrap();
    let mut tx = repo.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idem_mysql WHERE namespace = ? AND id = ? FOR UPDATE")
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .execute(&mut *tx)
        .await
        .unwrap();

    // The takeover waits for the lock; the operation timeout bounds the wait.
    let bounded = common::repository("idem_mysql", "&operation_timeout=300ms").await;
    let later = t + Duration::from_secs(1);
    let takeover = req(&key, later, Duration::from_secs(30));
    let err = bounded.reserve(takeover.clone()).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Timeout {
                operation: "reserve",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_retryable());

    tx.rollback().await.unwrap();
    // Released: the timed-out reservation, sent again with its owner token,
    // holds the key whether or not the abandoned statement applied meanwhile.
    assert_eq!(
        bounded.reserve(takeover).await.unwrap(),
        Reservation::Acquired { attempt: 2 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purges_work_in_chunks_and_concurrently_without_double_counting() {
    // A table of its own: the purge sees every expired row of its table.
    let table = common::unique_table("idem_purge");
    let repo = common::repository(&table, "").await;
    let t0 = SystemClock.now();
    let short = Duration::from_secs(10);
    let n = 330;
    let ns = namespace("purge");
    for i in 0..n {
        let key = RecordKey::new(ns.as_str(), format!("dead-{i}"), 1024).unwrap();
        let r = ReserveRequest {
            expires_at: t0 + short,
            ..req(&key, t0, short)
        };
        repo.reserve(r).await.unwrap();
    }
    let live = RecordKey::new(ns.as_str(), "live", 1024).unwrap();
    repo.reserve(req(&live, t0, short)).await.unwrap();

    let purge_at = t0 + short + Duration::from_secs(1);
    // A limit is honoured across chunks.
    assert_eq!(repo.purge_expired(purge_at, 130).await.unwrap(), 130);
    let url = common::server()
        .await
        .url_with(&format!("table={table}&max_connections=2"));
    let purgers: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let repo = MySqlRepository::connect(&url).await.unwrap();
                let mut total = 0;
                loop {
                    let done = repo.purge_expired(purge_at, 25).await.unwrap();
                    if done == 0 {
                        return total;
                    }
                    total += done;
                }
            })
        })
        .collect();
    let mut total = 130;
    for p in purgers {
        total += p.await.unwrap();
    }
    assert_eq!(total, n, "each expired row is purged exactly once");
    let left: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM `{table}`"))
        .fetch_one(repo.pool())
        .await
        .unwrap();
    assert_eq!(left, 1, "only the live row remains");
    assert!(repo.get(&live, t0).await.unwrap().is_some());
    assert_eq!(repo.purge_expired(purge_at, 0).await.unwrap(), 0);
    drop_table(&repo, &table).await;
}

#[tokio::test]
async fn a_mariadb_url_is_the_same_store() {
    let url = common::server().await.url_with("table=idem_mysql");
    let mariadb = url.replacen("mysql://", "mariadb://", 1);
    let a = MySqlRepository::connect(&url).await.unwrap();
    let b = idempotency_mysql::connect(&mariadb).await.unwrap();
    let ns = namespace("scheme");
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let t = SystemClock.now();
    assert!(matches!(
        a.reserve(req(&key, t, Duration::from_secs(30)))
            .await
            .unwrap(),
        Reservation::Acquired { .. }
    ));
    assert!(matches!(
        b.reserve(req(&key, t, Duration::from_secs(30)))
            .await
            .unwrap(),
        Reservation::Existing(_)
    ));
}

async fn drop_table(repo: &MySqlRepository, table: &str) {
    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`"))
        .execute(repo.pool())
        .await;
    let _ = sqlx::query("DELETE FROM idempotency_schema_migrations WHERE table_name = ?")
        .bind(table)
        .execute(repo.pool())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_reservations_leave_no_transaction_on_pooled_connections() {
    // One connection, and takeovers cancelled at every point by a timeout
    // around a millisecond: whatever was in flight, the connection must come
    // back to the pool without an open transaction (one would hold the next
    // fresh key's row uncommitted and locked, and another process would take
    // the key again once that connection closed).
    let repo = common::repository("idem_mysql", "&max_connections=1&operation_timeout=5s").await;
    let ns = namespace("cancel");
    let t0 = SystemClock.now();
    let stale = RecordKey::new(ns.as_str(), "stale", 1024).unwrap();
    repo.reserve(req(&stale, t0, Duration::from_millis(1)))
        .await
        .unwrap();
    for round in 0..60u64 {
        let at = t0 + Duration::from_secs(round + 1);
        let budget = Duration::from_micros(100 + round * 40);
        let _ = tokio::time::timeout(
            budget,
            repo.reserve(req(&stale, at, Duration::from_millis(1))),
        )
        .await;
    }
    let in_transaction: u64 = sqlx::query_scalar("SELECT @@in_transaction")
        .fetch_one(repo.pool())
        .await
        .unwrap();
    assert_eq!(in_transaction, 0);
    // A fresh key reserved through that connection is committed: another
    // process sees it held.
    let fresh = RecordKey::new(ns.as_str(), "fresh", 1024).unwrap();
    let t = SystemClock.now();
    assert!(matches!(
        repo.reserve(req(&fresh, t, Duration::from_secs(30)))
            .await
            .unwrap(),
        Reservation::Acquired { attempt: 1 }
    ));
    let other = common::repository("idem_mysql", "&operation_timeout=2s").await;
    assert!(matches!(
        other
            .reserve(req(&fresh, t, Duration::from_secs(30)))
            .await
            .unwrap(),
        Reservation::Existing(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_migration_does_not_keep_the_lock() {
    // 64 characters: the longest name MySQL allows, longer than a lock name may be.
    let table = format!("m{}", "x".repeat(47)) + &format!("{:016x}", rand::random::<u64>());
    assert_eq!(table.len(), 64);
    let url = common::server()
        .await
        .url_with(&format!("table={table}&migrate=false&max_connections=1"));
    let repo = MySqlRepository::connect(&url).await.unwrap();
    for micros in (50..2_000).step_by(150) {
        let _ = tokio::time::timeout(Duration::from_micros(micros), repo.migrate()).await;
    }
    // Another process migrates at once (a leaked lock would hold it for a minute).
    let other = MySqlRepository::connect(&url).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), other.migrate())
        .await
        .expect("the lock was released")
        .unwrap();
    assert_eq!(other.schema_version().await.unwrap(), (1, 1));
    drop_table(&other, &table).await;
}

#[tokio::test]
async fn an_existing_table_with_collated_keys_is_refused() {
    let table = common::unique_table("idem_text_keys");
    let admin = common::repository("idem_mysql", "").await;
    sqlx::query(&format!(
        "CREATE TABLE `{table}` (namespace VARCHAR(255) NOT NULL, id VARCHAR(255) NOT NULL, \
         PRIMARY KEY (namespace, id)) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci"
    ))
    .execute(admin.pool())
    .await
    .unwrap();
    let url = common::server().await.url_with(&format!("table={table}"));
    match MySqlRepository::connect(&url).await {
        Err(Error::Config { message }) => {
            assert!(
                message.contains("VARBINARY") && message.contains(&table),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    drop_table(&admin, &table).await;
}

#[tokio::test]
async fn connections_wait_for_row_locks_about_as_long_as_an_operation() {
    let repo = common::repository("idem_mysql", "&operation_timeout=1500ms").await;
    let wait: u64 = sqlx::query_scalar("SELECT CAST(@@innodb_lock_wait_timeout AS UNSIGNED)")
        .fetch_one(repo.pool())
        .await
        .unwrap();
    assert_eq!(wait, 2, "1.5 s rounded up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_per_execution() {
    use idempotency_conformance::containers::WireCounter;
    use idempotency_core::{Config, HandlerError, IdempotencyManager, Outcome};

    let counter = WireCounter::mysql(common::server().await.url())
        .await
        .unwrap();
    // One connection: no statement is prepared mid-count on a new one.
    let repo = MySqlRepository::connect(&format!(
        "{}&table=idem_mysql&max_connections=1",
        counter.url()
    ))
    .await
    .unwrap();
    let config = Config {
        key_prefix: namespace("trips"),
        processing_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let manager = IdempotencyManager::new(Arc::new(repo.clone()), config.clone()).unwrap();
    let handler = || async { Ok::<_, HandlerError<String>>(7u32) };
    // A stale reservation of `key` by another consumer, for the takeover.
    let stale = |key: &str| {
        let key = RecordKey::new(config.key_prefix.as_str(), key, 1024).unwrap();
        let repo = repo.clone();
        async move {
            let t = SystemClock.now() - Duration::from_secs(60);
            repo.reserve(req(&key, t, Duration::from_secs(1)))
                .await
                .unwrap();
        }
    };
    // Every statement prepared once on the connection first.
    stale("warm-takeover").await;
    for key in ["warm", "warm", "warm-takeover"] {
        manager.execute(key, &1, handler).await.unwrap();
    }
    stale("takeover").await;

    let mut trips = Vec::new();
    for (key, expected) in [
        ("fresh", "executed"),
        ("fresh", "cached"),
        ("takeover", "executed"),
    ] {
        let before = counter.snapshot();
        let outcome = manager.execute(key, &1, handler).await.unwrap();
        let got = match outcome {
            Outcome::Executed(_) => "executed",
            Outcome::Cached(_) => "cached",
            _ => "other",
        };
        assert_eq!(got, expected, "{key}: {outcome:?}");
        trips.push(counter.round_trips_since(&before));
    }
    // Fresh: INSERT, UPDATE. Duplicate: INSERT (duplicate key), SELECT.
    // Takeover: INSERT, SELECT, compare-and-set UPDATE, UPDATE.
    assert_eq!(trips, vec![2, 2, 4]);
}
