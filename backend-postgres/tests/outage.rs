//! The server goes away mid-run: operations fail with the typed, retryable
//! `Unavailable`, never hang or panic, and the pool recovers once it is back.
//! The server is a dedicated container of the harness, stopped and started on
//! the same port.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_conformance::containers::PostgresServer;
use idempotency_core::{
    Clock, Config, Error, ExecuteError, HandlerError, IdempotencyManager, OwnerToken, RecordKey,
    Repository, Reservation, ReserveRequest, SystemClock,
};
use idempotency_postgres::PgRepository;

fn request(key: &RecordKey, owner: OwnerToken) -> ReserveRequest<'_> {
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(3600));
    ReserveRequest::new(key, owner, SystemClock.now(), lease, ttl)
}

/// One reserve + complete on a fresh key.
async fn work(repo: &PgRepository, i: usize) -> Result<(), Error> {
    let key = RecordKey::new("outage", format!("k-{i}"), 1024).unwrap();
    let owner = OwnerToken::random();
    match repo.reserve(request(&key, owner)).await? {
        Reservation::Acquired { .. } => {
            let now = SystemClock.now();
            repo.complete(
                &key,
                owner,
                Some(b"ok"),
                now + Duration::from_secs(3600),
                now,
            )
            .await
        }
        Reservation::Existing(_) => Ok(()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_mid_run_is_unavailable_then_recovers() {
    let server = PostgresServer::dedicated()
        .await
        .expect("a dedicated PostgreSQL container for the outage test");
    let repo = PgRepository::builder()
        .max_connections(3)
        .acquire_timeout(Duration::from_millis(500))
        .connect(server.url())
        .await
        .unwrap();
    repo.migrate().await.unwrap();
    let before = RecordKey::new("outage", "before", 1024).unwrap();
    let owner = OwnerToken::random();
    repo.reserve(request(&before, owner)).await.unwrap();

    // A bounded load loop runs across the outage and records every error.
    let stop = Arc::new(AtomicBool::new(false));
    let successes = Arc::new(AtomicUsize::new(0));
    let load = {
        let (repo, stop, successes) = (repo.clone(), stop.clone(), successes.clone());
        tokio::spawn(async move {
            let mut errors = Vec::new();
            for i in 0..100_000 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let started = Instant::now();
                match work(&repo, i).await {
                    Ok(()) => {
                        successes.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => {
                        // Bounded by the acquire timeout, never hanging.
                        assert!(
                            started.elapsed() < Duration::from_secs(10),
                            "{e:?} took too long"
                        );
                        errors.push(e);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            errors
        })
    };
    let wait_for = |n: usize| {
        let successes = successes.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while successes.load(Ordering::SeqCst) < n {
                assert!(Instant::now() < deadline, "no progress");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_for(20).await;

    server.stop().await.unwrap();
    // While it is down: typed, retryable errors from every operation.
    for _ in 0..3 {
        let key = RecordKey::new("outage", "down", 1024).unwrap();
        let now = SystemClock.now();
        let results = [
            repo.reserve(request(&key, OwnerToken::random()))
                .await
                .map(drop),
            repo.get(&key, now).await.map(drop),
            repo.complete(&key, owner, None, now, now).await,
            repo.purge_expired(now, 10).await.map(drop),
        ];
        for r in results {
            match r {
                Err(e @ Error::Unavailable { .. }) => {
                    assert!(e.is_retryable() && e.is_store_outage())
                }
                other => panic!("expected Unavailable while the server is down, got {other:?}"),
            }
        }
    }
    // The manager fails closed: the handler does not run.
    let manager = IdempotencyManager::new(Arc::new(repo.clone()), Config::default()).unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let err = manager
        .execute("while-down", &(), || async move {
            flag.store(true, Ordering::SeqCst);
            Ok::<_, HandlerError<String>>(())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err, ExecuteError::Idempotency(Error::Unavailable { .. })),
        "{err:?}"
    );
    assert!(!ran.load(Ordering::SeqCst));

    let before_restart = successes.load(Ordering::SeqCst);
    server.start().await.unwrap();
    // The same pool recovers: the load loop makes progress again.
    wait_for(before_restart + 20).await;
    stop.store(true, Ordering::SeqCst);
    let errors = load.await.unwrap();
    assert!(!errors.is_empty(), "the load loop never saw the outage");
    for e in &errors {
        assert!(
            matches!(e, Error::Unavailable { .. }),
            "an outage error that is not Unavailable: {e:?}"
        );
    }
    // Data written before the outage survived; the record is still usable.
    let stored = repo.get(&before, SystemClock.now()).await.unwrap().unwrap();
    assert_eq!(stored.owner, owner);
    let now = SystemClock.now();
    repo.complete(&before, owner, None, now + Duration::from_secs(60), now)
        .await
        .unwrap();
}
