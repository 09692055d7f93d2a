//! `idempotency::connect` swaps stores by URL alone: the same manager code runs
//! against every backend, on real servers from the test harness.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency::{Config, HandlerError, IdempotencyManager, Outcome};
use idempotency_conformance::containers;

/// The same code for every store: one handler run for 16 concurrent deliveries
/// of a key, then a replay.
async fn exercise(url: &str, backend: &str) {
    let store = idempotency::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect({url}): {e}"));
    assert_eq!(store.capabilities().backend, backend);
    let config = Config {
        key_prefix: containers::unique_namespace("facade"),
        ..Config::default()
    };
    let manager = IdempotencyManager::new(store, config).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let tasks = (0..16).map(|_| {
        let (manager, runs) = (manager.clone(), runs.clone());
        tokio::spawn(async move {
            manager
                .execute("order-1", &serde_json::json!({"amount": 3}), || async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError<String>>("receipt".to_owned())
                })
                .await
        })
    });
    for t in futures_join(tasks).await {
        match t.unwrap() {
            Ok(_)
            | Err(idempotency::ExecuteError::Idempotency(idempotency::Error::InProgress {
                ..
            })) => {}
            Err(e) => panic!("{backend}: {e}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend}: one handler run");
    let replay = manager
        .execute("order-1", &serde_json::json!({"amount": 3}), || async {
            Ok::<_, HandlerError<String>>(String::new())
        })
        .await
        .unwrap();
    assert!(
        matches!(replay, Outcome::Cached(ref r) if r == "receipt"),
        "{backend}: {replay:?}"
    );
}

async fn futures_join<T>(
    tasks: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_by_url() {
    let server = containers::redis()
        .await
        .expect("a Redis server for the tests");
    exercise(server.url(), "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_by_url() {
    let server = containers::postgres()
        .await
        .expect("a PostgreSQL server for the tests");
    let schema = server.create_schema().await.expect("a schema");
    let url = server.url_with_schema(&schema);
    exercise(&url, "postgres").await;
    // Both URL schemes.
    exercise(&url.replacen("postgres://", "postgresql://", 1), "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamodb_by_url() {
    let server = containers::dynamodb()
        .await
        .expect("a DynamoDB server for the tests");
    let table = server.unique_table_name("facade");
    let url = format!(
        "dynamodb://{table}?region={}&endpoint={}&create_table=true",
        server.region(),
        server.endpoint()
    );
    exercise(&url, "dynamodb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_by_url() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("facade-sqlite");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{}.db", containers::unique_namespace("facade")));
    exercise(&format!("sqlite://{}", file.display()), "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_by_url() {
    let server = containers::mariadb()
        .await
        .expect("a MariaDB server for the tests");
    exercise(&server.url_with("table=idem_facade"), "mysql").await;
    let mariadb = server
        .url_with("table=idem_facade")
        .replacen("mysql://", "mariadb://", 1);
    exercise(&mariadb, "mysql").await;
}
