//! What only SQLite shows: durability across reopening the file, several
//! processes (here: independent pools) sharing one file, another process's
//! lock, migrations, read-only files, byte-exact keys, purge.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::request;
use idempotency_core::{
    Config, Error, ExecuteError, HandlerError, IdempotencyManager, OwnerToken, RecordKey,
    Repository, Reservation,
};
use idempotency_sqlite::SqliteRepository;
use sqlx::{Connection, Executor, SqliteConnection};

fn manager(repo: SqliteRepository) -> IdempotencyManager {
    IdempotencyManager::new(Arc::new(repo), Config::default()).unwrap()
}

#[tokio::test]
async fn a_recorded_outcome_survives_reopening_the_file() {
    let path = common::fresh_path("durable");
    let runs = AtomicUsize::new(0);
    let handler = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, HandlerError<String>>("receipt-7".to_owned())
    };
    {
        let repo = common::repository_at(&path, "").await;
        let first = manager(repo.clone())
            .execute("order-7", &7, handler)
            .await
            .unwrap();
        assert!(
            matches!(first, idempotency_core::Outcome::Executed(_)),
            "{first:?}"
        );
        repo.pool().close().await;
    }
    let reopened = common::repository_at(&path, "").await;
    let again = manager(reopened)
        .execute("order-7", &7, handler)
        .await
        .unwrap();
    assert!(
        matches!(again, idempotency_core::Outcome::Cached(_)),
        "{again:?}"
    );
    assert_eq!(again.into_value().as_deref(), Some("receipt-7"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Four "processes" (each its own pool and connection to the file) deliver
/// every key twice, concurrently: each handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_sharing_the_file_run_each_key_once() {
    const KEYS: usize = 40;
    let path = common::fresh_path("shared");
    let mut managers = Vec::new();
    for _ in 0..4 {
        managers.push(manager(common::repository_at(&path, "").await));
    }
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let mut tasks = Vec::new();
    for (p, m) in managers.into_iter().enumerate() {
        let runs = runs.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..2 {
                for k in 0..KEYS {
                    // Each process walks the keys from another start.
                    let k = (k + p * 7 + round * 3) % KEYS;
                    let runs = runs.clone();
                    let out = m
                        .execute(&format!("key-{k}"), &k, || async move {
                            runs[k].fetch_add(1, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            Ok::<_, HandlerError<String>>(k)
                        })
                        .await;
                    match out {
                        Ok(_) | Err(ExecuteError::Idempotency(Error::InProgress { .. })) => {}
                        Err(e) => panic!("key {k}: {e:?}"),
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for (k, n) in runs.iter().enumerate() {
        assert_eq!(n.load(Ordering::SeqCst), 1, "key-{k} ran {n:?} times");
    }
}

/// Another process holding the write lock: a reservation waits for the busy
/// timeout, then fails with a retryable `Timeout`; once the lock is gone it
/// goes through.
#[tokio::test]
async fn another_process_s_lock_is_a_retryable_timeout() {
    let path = common::fresh_path("busy");
    let repo = common::repository_at(&path, "?busy_timeout=300ms").await;
    let mut other = SqliteConnection::connect(&common::url(&path, ""))
        .await
        .unwrap();
    other.execute("BEGIN IMMEDIATE").await.unwrap();

    let key = RecordKey::new("busy", "k", 1024).unwrap();
    let owner = OwnerToken::random();
    let started = Instant::now();
    let err = repo.reserve(request(&key, owner)).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded by the busy timeout"
    );

    other.execute("ROLLBACK").await.unwrap();
    let acquired = repo.reserve(request(&key, owner)).await.unwrap();
    assert!(matches!(acquired, Reservation::Acquired { attempt: 1 }));
}

#[tokio::test]
async fn migrations_are_idempotent_and_refuse_a_newer_schema() {
    let path = common::fresh_path("migrate");
    let repo = common::repository_at(&path, "").await;
    repo.migrate().await.unwrap();
    repo.migrate().await.unwrap();
    let (at, latest) = repo.schema_version().await.unwrap();
    assert_eq!(at, latest);
    sqlx::query(
        "INSERT INTO idempotency_schema_migrations (version, description, applied_at) \
         VALUES (999, 'from the future', 0)",
    )
    .execute(repo.pool())
    .await
    .unwrap();
    let err = repo.migrate().await.unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert!(err.to_string().contains("newer"), "{err}");
}

#[tokio::test]
async fn an_unmigrated_file_says_how_to_create_the_table() {
    let path = common::fresh_path("unmigrated");
    let repo = common::repository_at(&path, "?migrate=false").await;
    assert_eq!(repo.schema_version().await.unwrap().0, 0);
    let key = RecordKey::new("ns", "k", 1024).unwrap();
    let err = repo
        .reserve(request(&key, OwnerToken::random()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert!(err.to_string().contains("migrate"), "{err}");
}

#[tokio::test]
async fn a_read_only_file_is_a_configuration_error() {
    let path = common::fresh_path("readonly");
    common::repository_at(&path, "").await.pool().close().await;
    let repo = common::repository_at(&path, "?mode=ro&migrate=false").await;
    let key = RecordKey::new("ns", "k", 1024).unwrap();
    let err = repo
        .reserve(request(&key, OwnerToken::random()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert!(err.to_string().contains("read-only"), "{err}");
}

#[tokio::test]
async fn keys_are_compared_byte_for_byte() {
    let path = common::fresh_path("bytes");
    let repo = common::repository_at(&path, "").await;
    for id in ["Order-1", "order-1", "order-1 ", "order-1\u{0}", "ordér-1"] {
        let key = RecordKey::new("ns", id, 1024).unwrap();
        let answer = repo
            .reserve(request(&key, OwnerToken::random()))
            .await
            .unwrap();
        assert!(
            matches!(answer, Reservation::Acquired { attempt: 1 }),
            "{id:?} merged with another key: {answer:?}"
        );
    }
}

#[tokio::test]
async fn bad_urls_are_configuration_errors() {
    for url in [
        "sqlite://x.db?table=t",
        "sqlite://x.db?synchronous=off",
        "mysql://h/db",
    ] {
        let err = SqliteRepository::connect(url).await.unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{url}: {err:?}");
    }
}

/// A reservation abandoned at any point (the manager's store timer, a caller
/// that drops its future) leaves no transaction open on the pooled
/// connection: the next calls on it work and what they write is committed,
/// visible to another connection to the file. (Dropped between `BEGIN
/// IMMEDIATE` and the transaction's creation, a connection used to go back
/// to the pool inside the open transaction: later reservations failed, and
/// later writes were never committed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_abandoned_anywhere_leaves_no_transaction_open() {
    let path = common::fresh_path("abandoned");
    let repo = common::repository_at(&path, "").await;
    let other = common::repository_at(&path, "").await;
    for i in 0..300u64 {
        let key = RecordKey::new("abandoned", format!("k{i}"), 1024).unwrap();
        let abandoned = repo.reserve(common::request(&key, OwnerToken::random()));
        let _ = tokio::time::timeout(Duration::from_micros(i % 60 * 10), abandoned).await;
        let after = RecordKey::new("after", format!("k{i}"), 1024).unwrap();
        let owner = OwnerToken::random();
        let answer = repo.reserve(common::request(&after, owner)).await;
        assert!(
            matches!(answer, Ok(Reservation::Acquired { attempt: 1 })),
            "round {i}: {answer:?}"
        );
        let seen = other
            .get(
                &after,
                idempotency_core::Clock::now(&idempotency_core::SystemClock),
            )
            .await
            .unwrap();
        assert!(
            seen.is_some_and(|r| r.owner == owner),
            "round {i}: the reservation is not committed"
        );
    }
}
