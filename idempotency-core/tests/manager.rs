#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Manager behaviour that needs a store failing on command: outage policies,
//! completion retries, lease auto-extension, cancellation and metrics.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    Capabilities, Config, Error, ExecuteError, HandlerError, IdempotencyManager, JsonCodec,
    ManualClock, MemoryRepository, OutagePolicy, OwnerToken, Record, RecordKey, Repository,
    Reservation, ReserveRequest, SharedRepository, Status, Timestamp,
};

/// A memory store whose operations fail with `Unavailable` while switched off.
#[derive(Debug, Default)]
struct Flaky {
    inner: MemoryRepository,
    down: AtomicBool,
    /// Only `complete` fails (the store dies after the handler ran).
    complete_down: AtomicBool,
    /// The next `complete` or `fail` is applied, but its reply is lost.
    lose_finish_reply: AtomicBool,
    extends: AtomicUsize,
}

impl Flaky {
    /// A lost reply: the store applied the write, the caller saw a timeout.
    fn lost(&self, applied: Result<(), Error>, operation: &'static str) -> Result<(), Error> {
        applied?;
        if self.lose_finish_reply.swap(false, Ordering::SeqCst) {
            return Err(Error::Timeout {
                backend: "flaky",
                operation,
            });
        }
        Ok(())
    }
}

impl Flaky {
    fn check(&self) -> Result<(), Error> {
        if self.down.load(Ordering::SeqCst) {
            Err(Error::Unavailable {
                backend: "flaky",
                message: "connection refused".into(),
                source: None,
            })
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl Repository for Flaky {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("flaky")
    }
    async fn reserve(&self, r: ReserveRequest<'_>) -> Result<Reservation, Error> {
        self.check()?;
        self.inner.reserve(r).await
    }
    async fn complete(
        &self,
        k: &RecordKey,
        o: OwnerToken,
        r: Option<&[u8]>,
        e: Timestamp,
        n: Timestamp,
    ) -> Result<(), Error> {
        self.check()?;
        if self.complete_down.load(Ordering::SeqCst) {
            return Err(Error::Timeout {
                backend: "flaky",
                operation: "complete",
            });
        }
        let applied = self.inner.complete(k, o, r, e, n).await;
        self.lost(applied, "complete")
    }
    async fn fail(
        &self,
        k: &RecordKey,
        o: OwnerToken,
        r: Option<&[u8]>,
        e: Timestamp,
        n: Timestamp,
    ) -> Result<(), Error> {
        self.check()?;
        let applied = self.inner.fail(k, o, r, e, n).await;
        self.lost(applied, "fail")
    }
    async fn release(&self, k: &RecordKey, o: OwnerToken, n: Timestamp) -> Result<(), Error> {
        self.check()?;
        self.inner.release(k, o, n).await
    }
    async fn extend(
        &self,
        k: &RecordKey,
        o: OwnerToken,
        l: Timestamp,
        n: Timestamp,
    ) -> Result<(), Error> {
        self.check()?;
        self.extends.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(k, o, l, n).await
    }
    async fn get(&self, k: &RecordKey, n: Timestamp) -> Result<Option<Record>, Error> {
        self.check()?;
        self.inner.get(k, n).await
    }
    async fn delete(&self, k: &RecordKey) -> Result<bool, Error> {
        self.check()?;
        self.inner.delete(k).await
    }
    async fn purge_expired(&self, n: Timestamp, l: usize) -> Result<usize, Error> {
        self.check()?;
        self.inner.purge_expired(n, l).await
    }
}

fn manager(repo: Arc<Flaky>, config: Config, clock: &ManualClock) -> IdempotencyManager {
    IdempotencyManager::with_parts(
        repo as SharedRepository,
        config,
        Arc::new(clock.clone()),
        JsonCodec,
    )
    .unwrap()
}

#[tokio::test]
async fn outage_fails_closed_by_default() {
    let repo = Arc::new(Flaky::default());
    repo.down.store(true, Ordering::SeqCst);
    let m = manager(
        repo.clone(),
        Config::default(),
        &ManualClock::starting_now(),
    );
    let ran = AtomicBool::new(false);
    let r = m
        .execute("k", &(), || async {
            ran.store(true, Ordering::SeqCst);
            Ok::<_, HandlerError<String>>(1)
        })
        .await;
    assert!(
        matches!(r, Err(ExecuteError::Idempotency(ref e)) if e.is_retryable()),
        "{r:?}"
    );
    assert!(
        !ran.load(Ordering::SeqCst),
        "fail-closed never runs the handler"
    );
}

#[tokio::test]
async fn outage_fails_open_when_configured() {
    let repo = Arc::new(Flaky::default());
    repo.down.store(true, Ordering::SeqCst);
    let config = Config {
        on_store_outage: OutagePolicy::FailOpen,
        ..Config::default()
    };
    let m = manager(repo.clone(), config, &ManualClock::starting_now());
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(1) })
        .await
        .unwrap();
    assert!(
        matches!(r, idempotency_core::Outcome::Unprotected(1)),
        "{r:?}"
    );
    // Decisions of the state machine are never bypassed by fail-open.
    repo.down.store(false, Ordering::SeqCst);
    m.execute("dup", &1, || async { Ok::<_, HandlerError<String>>(1) })
        .await
        .unwrap();
    let mismatch = m
        .execute("dup", &2, || async { Ok::<_, HandlerError<String>>(1) })
        .await;
    assert!(matches!(
        mismatch,
        Err(ExecuteError::Idempotency(Error::PayloadMismatch { .. }))
    ));
}

#[tokio::test(start_paused = true)]
async fn a_completion_whose_reply_was_lost_is_not_lease_lost() {
    let repo = Arc::new(Flaky::default());
    let clock = ManualClock::starting_now();
    let m = manager(repo.clone(), Config::default(), &clock);
    // The store records the completion, the reply times out, the manager
    // retries and finds the record completed under its own owner token.
    repo.lose_finish_reply.store(true, Ordering::SeqCst);
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(7) })
        .await
        .unwrap();
    assert!(matches!(r, idempotency_core::Outcome::Executed(7)), "{r:?}");
    assert!(
        !repo.lose_finish_reply.load(Ordering::SeqCst),
        "the reply was lost"
    );
    let again = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(8) })
        .await
        .unwrap();
    assert!(
        matches!(again, idempotency_core::Outcome::Cached(7)),
        "{again:?}"
    );

    // The same for a stored failure (StoreAndRetry keeps the error).
    let store = Config {
        failure_policy: idempotency_core::FailurePolicy::StoreAndRetry,
        ..Config::default()
    };
    let m = manager(repo.clone(), store, &clock);
    repo.lose_finish_reply.store(true, Ordering::SeqCst);
    let failed = m
        .execute("f", &(), || async {
            Err::<u32, _>(HandlerError::permanent("declined".to_owned()))
        })
        .await;
    assert!(
        matches!(failed, Err(ExecuteError::Handler(ref e)) if e == "declined"),
        "{failed:?}"
    );
    assert!(!repo.lose_finish_reply.load(Ordering::SeqCst));
    let key = m.record_key("f").unwrap();
    let record = repo.inner.get(&key, clock.now()).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Failed);
}

#[tokio::test(start_paused = true)]
async fn completion_failure_is_reported_with_the_value() {
    let repo = Arc::new(Flaky::default());
    repo.complete_down.store(true, Ordering::SeqCst);
    let clock = ManualClock::starting_now();
    let m = manager(repo.clone(), Config::default(), &clock);
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(7) })
        .await
        .unwrap();
    match r {
        idempotency_core::Outcome::Unrecorded { value, error } => {
            assert_eq!(value, 7);
            assert!(matches!(error, Error::Timeout { .. }));
        }
        other => panic!("expected Unrecorded, got {other:?}"),
    }
    // The record stays Processing (protected) until its lease ends.
    let key = m.record_key("k").unwrap();
    assert_eq!(
        repo.inner
            .get(&key, clock.now())
            .await
            .unwrap()
            .unwrap()
            .status,
        Status::Processing
    );
}

#[tokio::test(start_paused = true)]
async fn completion_retries_through_a_blip() {
    let repo = Arc::new(Flaky::default());
    repo.complete_down.store(true, Ordering::SeqCst);
    let m = manager(
        repo.clone(),
        Config::default(),
        &ManualClock::starting_now(),
    );
    let heal = {
        let repo = repo.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            repo.complete_down.store(false, Ordering::SeqCst);
        })
    };
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(7) })
        .await
        .unwrap();
    heal.await.unwrap();
    assert!(matches!(r, idempotency_core::Outcome::Executed(7)), "{r:?}");
}

#[tokio::test(start_paused = true)]
async fn lease_is_extended_while_the_handler_runs() {
    let repo = Arc::new(Flaky::default());
    let clock = ManualClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(30),
        lease_extension_interval: Some(Duration::from_secs(10)),
        ..Config::default()
    };
    let m = manager(repo.clone(), config, &clock);
    let key = m.record_key("long").unwrap();
    let start = clock.now();
    let r = m
        .execute("long", &(), || async {
            // 45 s of (paused, auto-advancing) Tokio time, with the store's
            // clock following it.
            for _ in 0..45 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                clock.advance(Duration::from_secs(1));
            }
            let record = repo.inner.get(&key, clock.now()).await.unwrap().unwrap();
            assert!(
                record.lease_until > start + Duration::from_secs(30),
                "lease was extended"
            );
            Ok::<_, HandlerError<String>>(())
        })
        .await
        .unwrap();
    assert!(matches!(r, idempotency_core::Outcome::Executed(())));
    assert!(
        repo.extends.load(Ordering::SeqCst) >= 4,
        "{} extends",
        repo.extends.load(Ordering::SeqCst)
    );
}

#[tokio::test]
async fn cancelled_execution_releases_the_key() {
    let repo = Arc::new(Flaky::default());
    let clock = ManualClock::starting_now();
    let m = manager(repo.clone(), Config::default(), &clock);
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let task = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute("cancel", &(), || async move {
                let _ = entered_tx.send(());
                std::future::pending::<Result<(), HandlerError<String>>>().await
            })
            .await
        })
    };
    entered_rx.await.unwrap();
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let key = m.record_key("cancel").unwrap();
    // The release runs in a spawned task: wait for it (bounded).
    for _ in 0..1000 {
        if repo.inner.get(&key, clock.now()).await.unwrap().is_none() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(
        repo.inner.get(&key, clock.now()).await.unwrap().is_none(),
        "released after cancellation"
    );
}

#[test]
fn metrics_are_recorded() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let repo = Arc::new(Flaky::default());
                let m = manager(repo, Config::default(), &ManualClock::starting_now());
                for _ in 0..3 {
                    m.execute("k", &(), || async { Ok::<_, HandlerError<String>>(1) })
                        .await
                        .unwrap();
                }
            })
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

#[tokio::test]
async fn invalid_configuration_is_rejected() {
    let bad = Config {
        ttl: Duration::from_secs(1),
        ..Config::default()
    };
    let r = IdempotencyManager::new(Arc::new(MemoryRepository::new()), bad);
    assert!(matches!(r, Err(Error::Config { .. })));
}

#[tokio::test]
async fn corrupt_cached_result_is_a_codec_error_not_a_panic() {
    let repo = Arc::new(MemoryRepository::new());
    let m = IdempotencyManager::new(repo.clone(), Config::default()).unwrap();
    m.execute("k", &(), || async {
        Ok::<_, HandlerError<String>>("text".to_owned())
    })
    .await
    .unwrap();
    // The result type changed between deployments: the cached bytes do not fit.
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(5u64) })
        .await;
    assert!(
        matches!(r, Err(ExecuteError::Idempotency(Error::Codec { .. }))),
        "{r:?}"
    );
}

#[tokio::test]
async fn stored_errors_are_capped_to_the_limit() {
    let repo = Arc::new(MemoryRepository::new().with_max_result_bytes(1024));
    let config = Config {
        failure_policy: idempotency_core::FailurePolicy::Store,
        ..Config::default()
    };
    let m = IdempotencyManager::new(repo.clone(), config).unwrap();
    let huge = "é".repeat(4096);
    let r = m
        .execute("k", &(), || async {
            Err::<(), _>(HandlerError::new(huge.clone()))
        })
        .await;
    assert!(matches!(r, Err(ExecuteError::Handler(_))));
    match m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(()) })
        .await
    {
        Err(ExecuteError::Idempotency(Error::PreviouslyFailed { error, .. })) => {
            assert!(error.len() <= 1024);
            assert!(
                String::from_utf8(error).is_ok(),
                "truncated on a character boundary"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn waiting_duplicate_gives_up_after_its_timeout() {
    let repo = Arc::new(Flaky::default());
    let clock = ManualClock::starting_now();
    let config = Config {
        in_progress: idempotency_core::InProgressPolicy::Wait {
            timeout: Duration::from_secs(2),
            poll_interval: Duration::from_millis(100),
        },
        ..Config::default()
    };
    let m = manager(repo.clone(), config, &clock);
    let key = m.record_key("held").unwrap();
    let now = clock.now();
    repo.reserve(ReserveRequest {
        key: &key,
        owner: OwnerToken::random(),
        fingerprint: None,
        now,
        lease_until: now + Duration::from_secs(300),
        expires_at: now + Duration::from_secs(3600),
        retry_failed: false,
        clock_skew: Duration::ZERO,
    })
    .await
    .unwrap();
    let started = tokio::time::Instant::now();
    let r = m
        .execute("held", &(), || async { Ok::<_, HandlerError<String>>(1) })
        .await;
    assert!(
        matches!(r, Err(ExecuteError::Idempotency(Error::InProgress { .. }))),
        "{r:?}"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}
