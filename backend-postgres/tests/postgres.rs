//! PostgreSQL-specific behaviour beyond the conformance suite: storage layout,
//! corrupt rows, purging from several processes, contention across pools, and
//! timeouts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Completion, Error, OwnerToken, RecordKey, Repository, RepositoryExt, Reservation,
    ReserveRequest, Timestamp,
};
use idempotency_postgres::{PgRepository, ReservePlan};

const TABLE: &str = "idem_pg_specific";

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
    idempotency_core::Clock::now(&idempotency_core::SystemClock)
}

#[tokio::test]
async fn keys_are_stored_as_their_exact_bytes() {
    let repo = common::repository(TABLE).await;
    let ns = format!("{}\0:ns", common::unique("bytes"));
    let key = RecordKey::new(ns.as_str(), "a\0b:c", 1024).unwrap();
    repo.reserve(req(&key, now(), Duration::from_secs(30)))
        .await
        .unwrap();
    let (stored_ns, stored_id): (Vec<u8>, Vec<u8>) = sqlx::query_as(&format!(
        "SELECT namespace, id FROM {TABLE} WHERE namespace = $1"
    ))
    .bind(ns.as_bytes())
    .fetch_one(repo.pool())
    .await
    .unwrap();
    assert_eq!(stored_ns, ns.as_bytes());
    assert_eq!(stored_id, b"a\0b:c");
}

#[tokio::test]
async fn ids_longer_than_the_index_allows_are_refused_before_sql() {
    let repo = common::repository(TABLE).await;
    assert_eq!(repo.capabilities().max_id_bytes, 1024);
    let long = "x".repeat(2000);
    let key = RecordKey::new("ns", &long, 4096).unwrap();
    assert!(matches!(
        repo.reserve(req(&key, now(), Duration::from_secs(30)))
            .await,
        Err(Error::InvalidKey { .. })
    ));
    // Built with the declared capability, the same id is digested and works.
    let key = RecordKey::new("ns", &long, repo.capabilities().max_id_bytes).unwrap();
    assert!(key.is_digested());
    assert!(repo
        .reserve(req(&key, now(), Duration::from_secs(30)))
        .await
        .is_ok());
    assert!(repo.delete(&key).await.unwrap());
}

#[tokio::test]
async fn corrupt_rows_are_reported_with_their_key() {
    let repo = common::repository(TABLE).await;
    let ns = common::unique("corrupt");
    let corruptions = [
        ("owner", "owner = '\\x0102'::bytea"),
        ("fingerprint", "fingerprint = '\\x01'::bytea"),
        ("attempt", "attempt = 0"),
        ("created_at", "created_at = -5"),
    ];
    for (what, set) in corruptions {
        let key = RecordKey::new(ns.as_str(), what, 1024).unwrap();
        let t = now();
        repo.reserve(req(&key, t, Duration::from_secs(30)))
            .await
            .unwrap();
        sqlx::query(&format!(
            "UPDATE {TABLE} SET {set} WHERE namespace = $1 AND id = $2"
        ))
        .bind(key.namespace().as_bytes())
        .bind(key.id().as_bytes())
        .execute(repo.pool())
        .await
        .unwrap();
        for result in [
            repo.get(&key, t).await.map(|_| ()),
            repo.reserve(req(&key, t, Duration::from_secs(30)))
                .await
                .map(|_| ()),
        ] {
            match result {
                Err(Error::Corrupt {
                    key: Some(k),
                    reason,
                }) => {
                    assert_eq!(k, key, "{what}: {reason}")
                }
                other => panic!("{what}: expected Corrupt, got {other:?}"),
            }
        }
        // The record can still be deleted.
        assert!(repo.delete(&key).await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_processes_purge_concurrently_without_double_counting() {
    // A table of its own: the purge sees every expired row of its table.
    let table = common::unique("idem_purge");
    let repo = common::repository(&table).await;
    let t0 = now();
    let short = Duration::from_secs(10);
    let n = 300;
    let ns = common::unique("purge");
    // Insert expired and live rows in bulk through the repository.
    let mut expired = Vec::new();
    for i in 0..n {
        let key = RecordKey::new(ns.as_str(), format!("dead-{i}"), 1024).unwrap();
        let r = ReserveRequest {
            expires_at: t0 + short,
            ..req(&key, t0, short)
        };
        repo.reserve(r).await.unwrap();
        expired.push(key);
    }
    let live = RecordKey::new(ns.as_str(), "live", 1024).unwrap();
    repo.reserve(req(&live, t0, short)).await.unwrap();

    let purge_at = t0 + short + Duration::from_secs(1);
    // Before the purge: expired rows are absent to every operation.
    for key in expired.iter().take(5) {
        assert!(repo.get(key, purge_at).await.unwrap().is_none());
        assert!(matches!(
            repo.complete(key, OwnerToken::random(), None, purge_at, purge_at)
                .await,
            Err(Error::LeaseLost { .. })
        ));
    }
    let url = common::server_url().await;
    let purgers: Vec<_> = (0..4)
        .map(|_| {
            let (url, table) = (url.clone(), table.clone());
            tokio::spawn(async move {
                let repo = PgRepository::builder()
                    .table(table)
                    .max_connections(2)
                    .connect(&url)
                    .await
                    .unwrap();
                repo.purge_all_expired(purge_at, Duration::ZERO, 25).await
            })
        })
        .collect();
    let mut total = 0;
    for p in purgers {
        total += p.await.unwrap().unwrap();
    }
    assert_eq!(total, n, "each expired row is purged exactly once");
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{table}\""))
        .fetch_one(repo.pool())
        .await
        .unwrap();
    assert_eq!(left, 1, "only the live row remains");
    assert!(repo.get(&live, t0).await.unwrap().is_some());
    assert_eq!(repo.purge_expired(purge_at, 0).await.unwrap(), 0);
    common::drop_table(&repo, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_processes_take_over_one_at_a_time() {
    // Three "processes" (own pools) × 16 tasks race on one key per round; each
    // round's lease is stale, so exactly one takes it over.
    let url = common::server_url().await;
    let mut repos = Vec::new();
    for _ in 0..3 {
        repos.push(Arc::new(
            PgRepository::builder()
                .table(TABLE)
                .max_connections(4)
                .connect(&url)
                .await
                .unwrap(),
        ));
    }
    repos[0].migrate().await.unwrap();
    let ns = common::unique("race");
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let t0 = now();
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
            match t.await.unwrap() {
                Ok(Reservation::Acquired { attempt }) => winners.push(attempt),
                // A loser that waited for the winners' row lock longer than
                // the lock bound (a loaded machine) is told so: in progress.
                Ok(Reservation::Existing(_)) | Err(Error::InProgress { .. }) => {}
                Err(e) => panic!("round {round}: {e:?}"),
            }
        }
        assert_eq!(winners, vec![round + 1], "round {round}");
    }
}

/// A statement abandoned mid-way (the operation timeout fired while it waited
/// for a lock no bound of its own covers: the whole table, locked before the
/// statement could set one) leaves its connection with a reply still to come:
/// the next operations — on a repository of one connection — get their own
/// answers, not the late one (sqlx drains the connection before it is used
/// again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_statement_does_not_answer_the_next_one() {
    let table = common::unique("idem_abandoned");
    let repo = common::repository(&table).await;
    let ns = common::unique("abandoned");
    let locked = RecordKey::new(ns.as_str(), "locked", 1024).unwrap();
    let t = now();
    let lease = Duration::from_secs(30);
    let one = PgRepository::builder()
        .table(&table)
        .max_connections(1)
        .reserve_plan(ReservePlan::InsertFirst)
        .operation_timeout(Duration::from_millis(200))
        .connect(&common::server_url().await)
        .await
        .unwrap();
    let mut tx = repo.pool().begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE \"{table}\" IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = one.reserve(req(&locked, t, lease)).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    // The abandoned reserve is still queued behind the lock; release it so
    // that its reply would arrive now.
    tx.rollback().await.unwrap();
    for i in 0..5 {
        let fresh = RecordKey::new(ns.as_str(), format!("fresh-{i}"), 1024).unwrap();
        assert!(one.get(&fresh, t).await.unwrap().is_none(), "round {i}");
        assert_eq!(
            one.reserve(req(&fresh, t, lease)).await.unwrap(),
            Reservation::Acquired { attempt: 1 },
            "round {i}"
        );
        assert_eq!(one.get(&fresh, t).await.unwrap().unwrap().attempt, 1);
    }
    common::drop_table(&repo, &table).await;
}

/// A batch statement waits at most its 100 ms `lock_timeout` for a row lock:
/// then the whole statement is refused, nothing applied, and `reserve_many`
/// sends each key on its own at once, where the locked key is `InProgress`
/// and the others get their own answers (a completion batch answers a
/// definite, non-outage error for each write, which the manager retries
/// alone). Under every reserve plan: the plain insert over arrays waits on
/// the key's uncommitted row as the function does, and the plain read, which
/// sees no such row, leaves both keys to the function.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_do_not_wait_on_a_locked_key() {
    for plan in [
        ReservePlan::Function,
        ReservePlan::InsertFirst,
        ReservePlan::ReadFirst,
    ] {
        let repo = common::repository_with(TABLE, plan).await;
        let ns = common::unique("batch-locked");
        let locked = RecordKey::new(ns.as_str(), "locked", 1024).unwrap();
        let free = RecordKey::new(ns.as_str(), "free", 1024).unwrap();
        let t = now();
        let lease = Duration::from_secs(30);
        let mut tx = repo.pool().begin().await.unwrap();
        let holder = OwnerToken::random();
        repo.in_transaction(&mut tx)
            .reserve(ReserveRequest {
                owner: holder,
                ..req(&locked, t, lease)
            })
            .await
            .unwrap();
        let free_request = req(&free, t, lease);
        let ours = free_request.owner;
        let answers = repo
            .reserve_many(vec![free_request, req(&locked, t, lease)])
            .await;
        assert_eq!(
            answers[0].as_ref().unwrap(),
            &Reservation::Acquired { attempt: 1 },
            "{plan}"
        );
        let e = answers[1].as_ref().unwrap_err();
        assert!(
            matches!(e, Error::InProgress { key, .. } if *key == locked) && !e.is_store_outage(),
            "{plan}: {e:?}"
        );
        assert_eq!(
            repo.get(&free, t).await.unwrap().unwrap().owner,
            ours,
            "{plan}"
        );
        tx.rollback().await.unwrap();
    }
    let repo = common::repository(TABLE).await;
    let ns = common::unique("batch-locked");
    let locked = RecordKey::new(ns.as_str(), "locked", 1024).unwrap();
    let free = RecordKey::new(ns.as_str(), "free", 1024).unwrap();
    let t = now();
    let lease = Duration::from_secs(30);
    let holder = OwnerToken::random();

    // The same for completions: the free key's record is ours, the statement
    // still refused as a whole while the other write waits on its row (which
    // an open transaction's extend has locked).
    repo.reserve(ReserveRequest {
        owner: holder,
        ..req(&locked, t, lease)
    })
    .await
    .unwrap();
    let mut tx = repo.pool().begin().await.unwrap();
    repo.in_transaction(&mut tx)
        .extend(&locked, holder, t + lease * 2, t + lease * 3, t)
        .await
        .unwrap();
    let owner = OwnerToken::random();
    repo.reserve(ReserveRequest {
        owner,
        ..req(&free, t, lease)
    })
    .await
    .unwrap();
    let writes = vec![
        Completion {
            key: &free,
            owner,
            result: Some(b"r"),
            expires_at: t + lease,
        },
        Completion {
            key: &locked,
            owner: holder,
            result: None,
            expires_at: t + lease,
        },
    ];
    let answers = repo.complete_many(writes.clone(), t).await;
    for a in &answers {
        let e = a.as_ref().unwrap_err();
        assert!(
            matches!(e, Error::Backend { .. }) && !e.is_store_outage(),
            "{e:?}"
        );
    }
    assert_eq!(
        repo.get(&free, t).await.unwrap().unwrap().status,
        idempotency_core::Status::Processing
    );
    tx.rollback().await.unwrap();
    let answers = repo.complete_many(writes, t).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
}

#[tokio::test]
async fn far_future_instants_keep_their_order() {
    let repo = common::repository(TABLE).await;
    let ns = common::unique("far");
    let key = RecordKey::new(ns.as_str(), "k", 1024).unwrap();
    let t = now();
    let r = ReserveRequest {
        lease_until: Timestamp::MAX,
        expires_at: Timestamp::MAX,
        ..req(&key, t, Duration::ZERO)
    };
    repo.reserve(r).await.unwrap();
    // Stored clamped to the largest bigint, still after every representable `now`.
    let stored = repo
        .get(&key, Timestamp::from_millis(i64::MAX as u64 - 1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.expires_at, Timestamp::from_millis(i64::MAX as u64));
    assert_eq!(stored.lease_until, stored.expires_at);
    assert!(repo.delete(&key).await.unwrap());
}

/// Opens a transaction on its own connection that holds `key`'s row lock
/// (an uncommitted reservation).
async fn hold_row_lock(
    repo: &PgRepository,
    key: &RecordKey,
) -> (sqlx::PgConnection, idempotency_core::OwnerToken) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&common::server_url().await)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    let owner = OwnerToken::random();
    let r = repo
        .in_transaction(&mut conn)
        .reserve(ReserveRequest {
            owner,
            ..req(key, now(), Duration::from_secs(30))
        })
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Acquired { .. }));
    (conn, owner)
}

/// A pool passed in keeps half of itself for its owner: with every one of
/// the repository's turns blocked on a row lock, the caller's own queries
/// still get connections at once, further operations wait their turn no
/// longer than the pool's acquire timeout (`Unavailable`, never a hang), and
/// all of them go on once the lock is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_pool_keeps_its_owners_share() {
    let setup = common::repository(TABLE).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(500))
        .connect(&common::server_url().await)
        .await
        .unwrap();
    // Reservations stay blocked on the row lock while the test looks.
    let repo = PgRepository::builder()
        .table(TABLE)
        .lock_timeout(Duration::from_secs(4))
        .build_with_pool(pool.clone())
        .unwrap();
    let ns = common::unique("share");
    let key = RecordKey::new(ns.as_str(), "locked", 1024).unwrap();
    let (mut holder, _) = hold_row_lock(&setup, &key).await;

    // Two reservations (the repository's two turns) wait on the lock.
    let blocked: Vec<_> = (0..2)
        .map(|_| {
            let repo = repo.clone();
            let key = key.clone();
            tokio::spawn(async move {
                repo.reserve(req(&key, now(), Duration::from_secs(30)))
                    .await
            })
        })
        .collect();
    tokio::task::yield_now().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pool.size() < 2 && std::time::Instant::now() < deadline {
        // Polls a real pool opening real connections (no clock drives that),
        // up to the deadline.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The owner's share: two connections at once.
    let mut own = Vec::new();
    for _ in 0..2 {
        own.push(pool.acquire().await.expect("the owner's share of the pool"));
    }
    // A third operation has no turn within the acquire timeout.
    let other = RecordKey::new(ns.as_str(), "other", 1024).unwrap();
    let err = repo.get(&other, now()).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    drop(own);

    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let answers: Vec<Reservation> = futures::future::join_all(blocked)
        .await
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
    assert_eq!(
        answers
            .iter()
            .filter(|r| matches!(r, Reservation::Acquired { .. }))
            .count(),
        1,
        "{answers:?}"
    );
    assert!(repo.get(&other, now()).await.unwrap().is_none());
    repo.delete(&key).await.unwrap();
}

/// Closing the pool is not held up by the connections the repository keeps:
/// they go back at once, `close()` finishes, and operations then fail as an
/// outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_pool_takes_back_the_kept_connections() {
    // Eight calls at once on a connection each (coalescing would send them on
    // fewer, leaving one of the pool's five idle).
    let repo = common::repository_not_coalescing(TABLE).await;
    let ns = common::unique("close");
    let keys: Vec<RecordKey> = (0..8)
        .map(|i| RecordKey::new(ns.as_str(), format!("k{i}"), 1024).unwrap())
        .collect();
    let ops = keys
        .iter()
        .map(|k| repo.reserve(req(k, now(), Duration::from_secs(30))));
    for r in futures::future::join_all(ops).await {
        r.unwrap();
    }
    for k in &keys {
        repo.delete(k).await.unwrap();
    }
    assert!(repo.pool().size() > 0);
    // Kept, unless one sat unused for a second already (a loaded machine):
    // then it went back to the pool, as it should.
    assert!(
        (repo.pool().num_idle() as u32) < repo.pool().size(),
        "the repository keeps them"
    );
    tokio::time::timeout(Duration::from_secs(10), repo.pool().close())
        .await
        .expect("close() finishes while connections are kept");
    let err = repo.get(&keys[0], now()).await.unwrap_err();
    assert!(err.is_store_outage(), "{err:?}");
}

/// A transactional execution leaves its connection outside any transaction,
/// rolled back or committed, before the repository keeps it for the next
/// operation: the server shows none of the repository's sessions idle inside
/// a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_is_never_inside_a_transaction() {
    use idempotency_core::HandlerError;
    let url = common::server_url().await;
    common::repository(TABLE).await; // migrated
    let app = common::unique("txkept");
    let sep = if url.contains('?') { '&' } else { '?' };
    let repo = PgRepository::builder()
        .table(TABLE)
        .max_connections(2)
        .connect(&format!("{url}{sep}application_name={app}"))
        .await
        .unwrap();
    let admin = common::repository(TABLE).await;
    let open_transactions = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
        )
        .bind(&app)
        .fetch_one(admin.pool())
        .await
        .unwrap()
    };
    let manager =
        idempotency_postgres::PgTransactionalManager::new(repo.clone(), Default::default())
            .unwrap();
    let failing = manager
        .execute(&format!("{app}-fails"), &1, |conn| {
            Box::pin(async move {
                sqlx::query("SELECT 1").execute(conn).await.unwrap();
                Err::<u32, _>(HandlerError::new("no".to_owned()))
            })
        })
        .await;
    assert!(failing.is_err());
    assert_eq!(open_transactions().await, 0, "after a rollback");
    let done = manager
        .execute(&format!("{app}-ok"), &1, |_| {
            Box::pin(async { Ok::<u32, HandlerError<String>>(7) })
        })
        .await
        .unwrap();
    assert!(matches!(done, idempotency_core::Outcome::Executed(7)));
    assert_eq!(open_transactions().await, 0, "after a commit");
    let again = manager
        .execute(&format!("{app}-ok"), &1, |_| {
            Box::pin(async { Ok::<u32, HandlerError<String>>(8) })
        })
        .await
        .unwrap();
    assert!(matches!(again, idempotency_core::Outcome::Cached(7)));
    assert_eq!(open_transactions().await, 0, "after a duplicate");
}

/// Completions and lease extensions are HOT updates (migration 4): with the
/// instants the manager uses (a reservation expiring `ttl` after it is made,
/// a completion `ttl` after it ends), no indexed column changes, so PostgreSQL
/// writes each new version beside the old one without new index entries. The
/// counts are the transaction's own (`pg_stat_xact_user_tables`), exact and
/// immediate.
#[tokio::test]
async fn completions_and_extensions_are_hot_updates() {
    let table = common::unique("idem_hot");
    let repo = common::repository(&table).await;
    let ns = common::unique("hot");
    let (ttl, lease) = (Duration::from_secs(3600), Duration::from_secs(30));
    let t0 = now();
    let mut tx = repo.pool().begin().await.unwrap();
    let n = 40_u64;
    for i in 0..n {
        let key = RecordKey::new(ns.as_str(), format!("k{i}"), 1024).unwrap();
        let request = ReserveRequest {
            expires_at: t0 + ttl,
            ..req(&key, t0, lease)
        };
        let owner = request.owner;
        let mut ops = repo.in_transaction(&mut tx);
        assert_eq!(
            ops.reserve(request).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
        let later = t0 + Duration::from_millis(10 + i);
        if i % 2 == 0 {
            ops.extend(&key, owner, later + lease, later + lease, later)
                .await
                .unwrap();
        }
        let result = format!("receipt {i}");
        ops.complete(&key, owner, Some(result.as_bytes()), later + ttl, later)
            .await
            .unwrap();
    }
    let (updates, hot): (i64, i64) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = $1",
    )
    .bind(&table)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(updates, i64::try_from(n + n / 2).unwrap());
    assert_eq!(hot, updates, "every completion and extension is HOT");
    common::drop_table(&repo, &table).await;
}

/// `purge_after` only chooses where a purge looks; the expiry decides what it
/// deletes: a completion that shortens the expiry is purged on time, and a
/// record whose expiry a completion or an extension moved past its
/// reservation's is not purged before it.
#[tokio::test]
async fn purges_follow_the_expiry_the_last_write_set() {
    let table = common::unique("idem_purge_at");
    let repo = common::repository(&table).await;
    let ns = common::unique("purge_at");
    let t0 = now();
    let s = Duration::from_secs;
    let key = |id: &str| RecordKey::new(ns.as_str(), id, 1024).unwrap();
    let (shortened, extended, completed_late) =
        (key("shortened"), key("extended"), key("completed-late"));
    let reserve = |key, expires| {
        let request = ReserveRequest {
            expires_at: t0 + expires,
            ..req(key, t0, s(5))
        };
        let owner = request.owner;
        let repo = repo.clone();
        async move {
            assert!(matches!(
                repo.reserve(request).await.unwrap(),
                Reservation::Acquired { .. }
            ));
            owner
        }
    };
    // Reserved for an hour, completed with ten seconds left.
    let owner = reserve(&shortened, s(3600)).await;
    repo.complete(&shortened, owner, None, t0 + s(10), t0 + s(1))
        .await
        .unwrap();
    // Reserved for ten seconds, the lease extended to twenty.
    let owner = reserve(&extended, s(10)).await;
    repo.extend(&extended, owner, t0 + s(20), t0 + s(20), t0 + s(1))
        .await
        .unwrap();
    // Reserved for ten seconds, completed at five for ten more.
    let owner = reserve(&completed_late, s(10)).await;
    repo.complete(&completed_late, owner, None, t0 + s(15), t0 + s(5))
        .await
        .unwrap();

    // Physically present: what a purge deleted is gone from the table.
    let stored = |key: &RecordKey| {
        let (repo, table, id) = (repo.clone(), table.clone(), key.id().to_owned());
        async move {
            sqlx::query_scalar::<_, bool>(&format!(
                "SELECT EXISTS (SELECT 1 FROM \"{table}\" WHERE id = $1)"
            ))
            .bind(id.as_bytes())
            .fetch_one(repo.pool())
            .await
            .unwrap()
        }
    };
    assert_eq!(repo.purge_expired(t0 + s(11), 100).await.unwrap(), 1);
    assert!(
        !stored(&shortened).await,
        "purged when its shortened expiry passed"
    );
    assert!(stored(&extended).await && stored(&completed_late).await);
    assert!(repo
        .get(&completed_late, t0 + s(11))
        .await
        .unwrap()
        .is_some());
    assert_eq!(repo.purge_expired(t0 + s(16), 100).await.unwrap(), 1);
    assert!(!stored(&completed_late).await);
    assert!(repo.get(&extended, t0 + s(16)).await.unwrap().is_some());
    assert_eq!(repo.purge_expired(t0 + s(21), 100).await.unwrap(), 1);
    assert!(!stored(&extended).await);
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{table}\""))
        .fetch_one(repo.pool())
        .await
        .unwrap();
    assert_eq!(left, 0);
    common::drop_table(&repo, &table).await;
}

/// `doctor`'s HOT check passes on a migrated table and, once an index covers a
/// column that completions change (here through an expression), warns and
/// names the column.
#[tokio::test]
async fn the_doctor_names_an_index_that_stops_hot_completions() {
    use idempotency_core::admin::{Admin, Check, DoctorOptions, Verdict};
    let table = common::unique("idem_doc_hot");
    let repo = common::repository(&table).await;
    let checks = || async {
        let checks = repo.doctor(&DoctorOptions::default()).await.unwrap();
        let named =
            |name: &str| -> Check { checks.iter().find(|c| c.name == name).cloned().unwrap() };
        (named("HOT updates"), named("purge index"))
    };
    let (hot, index) = checks().await;
    assert_eq!(hot.verdict, Verdict::Pass, "{hot:?}");
    assert!(hot.detail.contains("fillfactor 85"), "{hot:?}");
    assert_eq!(index.verdict, Verdict::Pass, "{index:?}");
    sqlx::query(&format!(
        "CREATE INDEX \"{table}_by_second\" ON \"{table}\" ((expires_at / 1000))"
    ))
    .execute(repo.pool())
    .await
    .unwrap();
    let (hot, _) = checks().await;
    assert_eq!(hot.verdict, Verdict::Warn, "{hot:?}");
    assert!(hot.detail.contains("indexed expires_at"), "{hot:?}");
    common::drop_table(&repo, &table).await;
}
