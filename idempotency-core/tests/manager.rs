#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Manager behaviour that needs a store failing on command: outage policies,
//! completion retries, lease extension, metrics and configuration. The
//! exactly-once scenarios under failure (one per defect of the execution-engine
//! issue) are in `tests/exactly_once.rs`.

use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{manager, store};
use idempotency_core::testing::{Fault, Operation, TokioClock};
use idempotency_core::{
    Config, Error, ExecuteError, FailurePolicy, HandlerError, IdempotencyManager, InProgressPolicy,
    MemoryRepository, OutagePolicy, Outcome, OwnerToken, Repository, ReserveRequest, Status,
};

fn ok<T>(v: T) -> Result<T, HandlerError<String>> {
    Ok(v)
}

#[tokio::test(start_paused = true)]
async fn outage_fails_closed_by_default() {
    let repo = store();
    repo.set_unavailable(true);
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let mut ran = false;
    let r = m
        .execute("k", &(), || async {
            ran = true;
            ok(1)
        })
        .await;
    assert!(
        matches!(r, Err(ExecuteError::Idempotency(ref e)) if e.is_retryable()),
        "{r:?}"
    );
    assert!(!ran, "fail-closed never runs the handler");
    // The ambiguous reserve was sent again with the same owner, twice.
    assert_eq!(repo.calls(Operation::Reserve), 3);
}

#[tokio::test(start_paused = true)]
async fn outage_fails_open_when_configured() {
    let repo = store();
    repo.set_unavailable(true);
    let config = Config {
        on_store_outage: OutagePolicy::FailOpen,
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let r = m.execute("k", &(), || async { ok(1) }).await.unwrap();
    assert!(matches!(r, Outcome::Unprotected(1)), "{r:?}");
    // Decisions of the state machine are never bypassed by fail-open.
    repo.set_unavailable(false);
    m.execute("dup", &1, || async { ok(1) }).await.unwrap();
    let mismatch = m.execute("dup", &2, || async { ok(1) }).await;
    assert!(matches!(
        mismatch,
        Err(ExecuteError::Idempotency(Error::PayloadMismatch { .. }))
    ));
}

#[tokio::test(start_paused = true)]
async fn a_finish_whose_reply_was_lost_is_not_lease_lost() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let m = manager(&repo, Config::default(), &clock);
    repo.inject(Operation::Complete, Fault::LoseReply, 1);
    let r = m.execute("k", &(), || async { ok(7) }).await.unwrap();
    assert!(matches!(r, Outcome::Executed(7)), "{r:?}");
    assert_eq!(repo.calls(Operation::Complete), 2, "retried once");
    let again = m.execute("k", &(), || async { ok(8) }).await.unwrap();
    assert!(matches!(again, Outcome::Cached(7)), "{again:?}");

    // The same for a stored failure.
    let stored = Config {
        failure_policy: FailurePolicy::Store,
        ..Config::default()
    };
    let m = manager(&repo, stored, &clock);
    repo.inject(Operation::Fail, Fault::LoseReply, 1);
    let failed = m
        .execute("f", &(), || async {
            Err::<u32, _>(HandlerError::permanent("declined".to_owned()))
        })
        .await;
    assert!(
        matches!(failed, Err(ExecuteError::Handler(ref e)) if e == "declined"),
        "{failed:?}"
    );
    let key = m.record_key("f").unwrap();
    let record = repo.inner().get(&key, clock.now()).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Failed);
}

#[tokio::test(start_paused = true)]
async fn completion_failure_until_the_lease_ends_is_unrecorded_with_the_value() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(10),
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    repo.inject(Operation::Complete, Fault::Hang, usize::MAX);
    let started = tokio::time::Instant::now();
    let r = m.execute("k", &(), || async { ok(7) }).await.unwrap();
    match r {
        Outcome::Unrecorded { value, error } => {
            assert_eq!(value, 7);
            assert!(matches!(error, Error::Timeout { .. }), "{error:?}");
        }
        other => panic!("expected Unrecorded, got {other:?}"),
    }
    // Retried until shortly before the lease ended, not longer.
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(8) && took <= Duration::from_secs(10) + Duration::from_secs(5),
        "{took:?}"
    );
    // The record stays Processing (protected) until its lease ends.
    let key = m.record_key("k").unwrap();
    let record = repo.inner().get(&key, clock.now()).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Processing);
}

#[tokio::test(start_paused = true)]
async fn lease_is_extended_while_the_handler_runs() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(30),
        lease_extension_interval: Some(Duration::from_secs(10)),
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    let key = m.record_key("long").unwrap();
    let start = clock.now();
    let r = m
        .execute("long", &(), || async {
            tokio::time::sleep(Duration::from_secs(45)).await;
            let record = repo.inner().get(&key, clock.now()).await.unwrap().unwrap();
            assert!(record.lease_until > start + Duration::from_secs(30));
            ok(())
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(())));
    assert!(repo.calls(Operation::Extend) >= 4);
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
                let repo = store();
                let m = manager(&repo, Config::default(), &TokioClock::starting_now());
                for _ in 0..3 {
                    m.execute("k", &(), || async { ok(1) }).await.unwrap();
                }
                // Two runs without protection during an outage (fail-open).
                let open = Config {
                    on_store_outage: OutagePolicy::FailOpen,
                    ..Config::default()
                };
                let m = manager(&repo, open, &TokioClock::starting_now());
                repo.set_unavailable(true);
                for key in ["open-1", "open-2"] {
                    let r = m.execute(key, &(), || async { ok(2) }).await.unwrap();
                    assert!(matches!(r, Outcome::Unprotected(2)), "{r:?}");
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
    assert_eq!(
        counters.get("idempotency_fail_open"),
        Some(&2),
        "{counters:?}"
    );
}

#[tokio::test]
async fn invalid_configuration_is_rejected() {
    for bad in [
        Config {
            ttl: Duration::from_secs(1),
            ..Config::default()
        },
        // The TTL must cover the lease plus the skew allowance.
        Config {
            ttl: Duration::from_secs(300),
            clock_skew: Duration::from_millis(1),
            ..Config::default()
        },
        Config {
            store_timeout: Duration::ZERO,
            ..Config::default()
        },
        // A store call that may outlast the lease.
        Config {
            store_timeout: Duration::from_secs(300),
            ..Config::default()
        },
        Config {
            key_prefix: String::new(),
            ..Config::default()
        },
        Config {
            key_prefix: "p".repeat(600),
            ..Config::default()
        },
        Config {
            in_progress: idempotency_core::InProgressPolicy::Wait {
                timeout: Duration::ZERO,
                poll_interval: Duration::from_millis(10),
            },
            ..Config::default()
        },
        Config {
            lease_extension_interval: Some(Duration::from_secs(300)),
            ..Config::default()
        },
    ] {
        let r = IdempotencyManager::new(Arc::new(MemoryRepository::new()), bad);
        assert!(matches!(r, Err(Error::Config { .. })));
    }
}

#[tokio::test]
async fn corrupt_cached_result_is_a_codec_error_naming_the_key() {
    let repo = Arc::new(MemoryRepository::new());
    let m = IdempotencyManager::new(repo.clone(), Config::default()).unwrap();
    m.execute("k", &(), || async { ok("text".to_owned()) })
        .await
        .unwrap();
    // The result type changed between deployments: the cached bytes do not fit.
    let r = m.execute("k", &(), || async { ok(5u64) }).await;
    assert!(
        matches!(r, Err(ExecuteError::Idempotency(Error::Codec { .. }))),
        "{r:?}"
    );
    let message = r.unwrap_err().to_string();
    assert!(
        message.contains("idempotency:k") && message.contains("cannot decode"),
        "{message}"
    );
}

#[tokio::test]
async fn non_finite_payloads_are_refused_before_the_handler() {
    let m = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap();
    for payload in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        #[derive(serde::Serialize)]
        struct Payment {
            amount: f64,
        }
        let r = m
            .execute("pay", &Payment { amount: payload }, || async {
                ok::<u8>(1)
            })
            .await;
        assert!(
            matches!(r, Err(ExecuteError::Idempotency(Error::Codec { .. }))),
            "{r:?}"
        );
        let r = m
            .execute("pay-raw", &payload, || async { ok::<u8>(2) })
            .await;
        match r {
            Err(ExecuteError::Idempotency(e @ Error::Codec { .. })) => {
                assert!(!e.is_retryable());
                assert!(e.to_string().contains("non-finite number"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn stored_errors_are_capped_to_the_limit() {
    let repo = Arc::new(MemoryRepository::new().with_max_result_bytes(1024));
    let config = Config {
        failure_policy: FailurePolicy::Store,
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
    match m.execute("k", &(), || async { ok(()) }).await {
        Err(ExecuteError::Idempotency(Error::PreviouslyFailed { error, .. })) => {
            assert!(error.len() <= 1024);
            assert!(
                String::from_utf8(error).is_ok(),
                "cut on a character boundary"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn waiting_duplicate_gives_up_after_its_timeout() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        in_progress: InProgressPolicy::Wait {
            timeout: Duration::from_secs(2),
            poll_interval: Duration::from_millis(100),
        },
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
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
    let r = m.execute("held", &(), || async { ok(1) }).await;
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

#[tokio::test(start_paused = true)]
async fn a_store_call_that_never_answers_times_out() {
    let repo = store();
    repo.inject(Operation::Reserve, Fault::Hang, usize::MAX);
    let config = Config {
        store_timeout: Duration::from_secs(2),
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let started = tokio::time::Instant::now();
    let r = m.execute("k", &(), || async { ok(1) }).await;
    assert!(
        matches!(r, Err(ExecuteError::Idempotency(Error::Timeout { .. }))),
        "{r:?}"
    );
    // Three attempts of at most 2 s each, plus the pauses between them.
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(6) && took < Duration::from_secs(7),
        "{took:?}"
    );
}

/// `retry_after` follows how long executions take, not the 300 s lease.
#[tokio::test(start_paused = true)]
async fn in_progress_hints_a_retry_after_about_one_execution() {
    let m = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap();
    let quick = || async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        ok(1u8)
    };
    let (hold, held) = tokio::sync::oneshot::channel::<()>();
    let first = m.execute("warm", &(), quick).await.unwrap();
    assert!(first.handler_ran());
    let holder = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute("busy", &(), || async move {
                let _ = held.await;
                ok(2u8)
            })
            .await
        })
    };
    tokio::task::yield_now().await;
    match m.execute("busy", &(), || async { ok(3u8) }).await {
        Err(ExecuteError::Idempotency(Error::InProgress { retry_after, .. })) => {
            assert!(
                retry_after >= Duration::from_millis(1) && retry_after <= Duration::from_millis(10),
                "{retry_after:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    hold.send(()).unwrap();
    assert!(holder.await.unwrap().unwrap().handler_ran());
}

/// Durations near `Duration::MAX` (a wait timeout, an extension interval)
/// are configuration errors, not a panic when the manager adds them to an
/// instant; the longest accepted ones run.
#[tokio::test(start_paused = true)]
async fn durations_past_the_bound_are_refused_and_those_at_it_run() {
    let wait = |timeout| InProgressPolicy::Wait {
        timeout,
        poll_interval: Duration::from_millis(100),
    };
    for bad in [
        Config {
            in_progress: wait(Duration::MAX),
            ..Config::default()
        },
        Config {
            lease_extension_interval: Some(Duration::MAX - Duration::from_secs(1)),
            processing_timeout: Duration::MAX,
            ttl: Duration::MAX,
            ..Config::default()
        },
    ] {
        let r = IdempotencyManager::new(Arc::new(MemoryRepository::new()), bad);
        assert!(matches!(r, Err(Error::Config { .. })), "{r:?}");
    }
    // At the bound: a duplicate waits on a held key until its holder
    // finishes, and the holder's lease is extended.
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        in_progress: wait(idempotency_core::MAX_DURATION),
        ttl: idempotency_core::MAX_DURATION,
        processing_timeout: idempotency_core::MAX_DURATION / 2,
        clock_skew: idempotency_core::MAX_DURATION / 4,
        lease_extension_interval: Some(idempotency_core::MAX_DURATION / 4),
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    let (release, hold) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute("long", &(), || async {
                hold.await.ok();
                ok(7)
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await; // paused time: the holder reserves
    let duplicate = {
        let m = m.clone();
        tokio::spawn(async move { m.execute("long", &(), || async { ok(8) }).await })
    };
    tokio::time::sleep(Duration::from_secs(60)).await; // paused time: the duplicate polls
    release.send(()).unwrap();
    assert!(matches!(holder.await.unwrap(), Ok(Outcome::Executed(7))));
    assert!(matches!(duplicate.await.unwrap(), Ok(Outcome::Cached(7))));
}

/// A store whose real result limit is below the one it declared refuses the
/// completion as too large; the smaller write it then gets (no cached
/// result) is one more attempt under the recording phase's bound, not a new
/// round of retries after the deadline.
#[tokio::test(start_paused = true)]
async fn a_completion_refused_as_too_large_keeps_the_recording_bound() {
    let repo = Arc::new(idempotency_core::testing::FaultyRepository::new(
        common::SmallerThanDeclared(MemoryRepository::new()),
    ));
    let clock = TokioClock::starting_now();
    let (processing, store_timeout) = (Duration::from_secs(10), Duration::from_secs(1));
    let config = Config {
        processing_timeout: processing,
        store_timeout,
        ..Config::default()
    };
    let m = IdempotencyManager::with_parts(
        repo.clone() as idempotency_core::SharedRepository,
        config,
        Arc::new(clock.clone()),
        idempotency_core::JsonCodec,
    )
    .unwrap();
    // Three completions time out; the fourth reaches the store late in the
    // phase and is refused as too large; whatever is sent after that hangs.
    repo.inject(Operation::Complete, Fault::Hang, 3)
        .inject(
            Operation::Complete,
            Fault::Delay(Duration::from_millis(950)),
            1,
        )
        .inject(Operation::Complete, Fault::Hang, usize::MAX);
    let started = tokio::time::Instant::now();
    let r = m
        .execute("big", &(), || async {
            tokio::time::sleep(Duration::from_secs(5)).await; // paused time: the handler's work
            ok("a result longer than eight bytes".to_owned())
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Unrecorded { .. }), "{r:?}");
    // Retries stop a tenth of the processing timeout (at most 1 s) before
    // the lease ends; an attempt begun before then lasts one store timeout
    // at most.
    let bound = processing - Duration::from_secs(1) + store_timeout;
    let took = started.elapsed();
    assert!(
        took <= bound,
        "recording ran {took:?}, past the bound {bound:?}"
    );
}
