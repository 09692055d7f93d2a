//! SQLite out of memory. The heap limit that provokes it (`PRAGMA
//! hard_heap_limit`) holds for the whole process and can only be lowered, so
//! the store runs out of memory in a child process (this binary again, running
//! this same test in its child role), and this process checks the file after.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Command;

use idempotency_core::{Clock, Error, OwnerToken, RecordKey, Repository, Reservation, SystemClock};

/// Set in the child process: the database file it works on.
const CHILD_PATH: &str = "IDEMPOTENCY_TEST_SQLITE_NOMEM_PATH";

const TEST: &str = "memory_exhausted_is_a_retryable_outage_that_applied_nothing";

fn key() -> RecordKey {
    RecordKey::new("nomem", "k", 1024).unwrap()
}

#[tokio::test]
async fn memory_exhausted_is_a_retryable_outage_that_applied_nothing() {
    if let Some(path) = std::env::var_os(CHILD_PATH) {
        return reserve_out_of_memory(Path::new(&path)).await;
    }
    let path = common::fresh_path("nomem");
    drop(common::repository_at(&path, "").await); // create and migrate

    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(CHILD_PATH, &path)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&child.stdout);
    assert!(
        child.status.success() && report.contains("1 passed"),
        "the child process: {report}\n{}",
        String::from_utf8_lossy(&child.stderr)
    );

    // The reservation that ran out of memory wrote nothing: the key is free.
    let repo = common::repository_at(&path, "").await;
    let key = key();
    assert_eq!(repo.get(&key, SystemClock.now()).await.unwrap(), None);
    let acquired = repo
        .reserve(common::request(&key, OwnerToken::random()))
        .await
        .unwrap();
    assert!(matches!(acquired, Reservation::Acquired { attempt: 1 }));
}

/// The child's part: a reservation on `path` past the heap limit fails with a
/// retryable outage.
async fn reserve_out_of_memory(path: &Path) {
    let repo = common::repository_at(path, "?migrate=false").await;
    // Below what SQLite already holds: its next allocation fails, which may
    // already be one the pragma's own statement makes after setting it.
    let limited = sqlx::query("PRAGMA hard_heap_limit = 1")
        .execute(repo.pool())
        .await;
    assert!(
        limited.is_ok()
            || limited
                .as_ref()
                .is_err_and(|e| e.to_string().contains("out of memory")),
        "{limited:?}"
    );
    let key = key();
    let err = repo
        .reserve(common::request(&key, OwnerToken::random()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.is_retryable() && err.is_store_outage(), "{err:?}");
    assert!(err.to_string().contains("reserve"), "{err}");
}
