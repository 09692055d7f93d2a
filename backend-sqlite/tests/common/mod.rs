//! A fresh database file per test, under Cargo's temporary directory for
//! integration tests.

#![allow(dead_code, unreachable_pub, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use idempotency_core::{Clock, OwnerToken, RecordKey, ReserveRequest, SystemClock};
use idempotency_sqlite::SqliteRepository;

/// A path no other test uses.
pub fn fresh_path(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("idempotency-sqlite");
    std::fs::create_dir_all(&dir).expect("a directory for test databases");
    dir.join(format!("{name}-{:016x}.db", rand::random::<u64>()))
}

/// The URL of `path`, with `options` (`""` or `"?…"`).
pub fn url(path: &std::path::Path, options: &str) -> String {
    format!("sqlite://{}{options}", path.display())
}

/// A migrated repository over a new file.
pub async fn repository_at(path: &std::path::Path, options: &str) -> SqliteRepository {
    SqliteRepository::connect(&url(path, options))
        .await
        .expect("open a SQLite database file")
}

/// A reservation of `key` by `owner` now: a 30 s lease, an hour's expiry.
pub fn request(key: &RecordKey, owner: OwnerToken) -> ReserveRequest<'_> {
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(3600));
    ReserveRequest::new(key, owner, SystemClock.now(), lease, ttl)
}
