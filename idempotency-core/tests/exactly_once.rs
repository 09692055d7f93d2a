#![allow(clippy::unwrap_used, clippy::expect_used)]
//! One test per way the execution engine used to run a handler twice or block a
//! key for nothing (the execution-engine issue), each reproducing its scenario
//! deterministically with the fault-injecting repository and paused Tokio time.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{eventually, manager, store};
use idempotency_core::testing::{Fault, Operation, TokioClock};
use idempotency_core::{
    CancelPolicy, Config, Error, ExecuteError, ExecutionContext, FailurePolicy, HandlerError,
    IdempotencyManager, InProgressPolicy, JsonCodec, ManualClock, MemoryRepository, OutagePolicy,
    Outcome, Repository, Reservation, SharedRepository, Status,
};

/// A handler with an effect: counts its runs.
fn charge(runs: &AtomicU32) -> Result<u32, HandlerError<String>> {
    Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
}

/// 1. Lease extension moves expiry: a handler that outlives its TTL keeps its
///    record, so a duplicate meanwhile is `InProgress`, not a second run.
#[tokio::test(start_paused = true)]
async fn a_handler_outliving_its_ttl_keeps_its_record_with_extension() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        ttl: Duration::from_secs(30),
        processing_timeout: Duration::from_secs(30),
        lease_extension_interval: Some(Duration::from_secs(10)),
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    let runs = AtomicU32::new(0);
    let first = m.execute("k", &(), || async {
        let r = charge(&runs);
        tokio::time::sleep(Duration::from_secs(95)).await; // > 3 TTLs
        r
    });
    let duplicate = async {
        tokio::time::sleep(Duration::from_secs(80)).await;
        m.execute("k", &(), || async { charge(&runs) }).await
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    assert!(matches!(first, Ok(Outcome::Executed(1))), "{first:?}");
    assert!(
        matches!(
            duplicate,
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "{duplicate:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// 2. Clock skew is honoured by expiry too: a consumer whose clock runs ahead
///    (within the skew) does not treat a live lease's record as expired.
#[tokio::test(start_paused = true)]
async fn a_consumer_whose_clock_runs_ahead_does_not_rerun_a_live_lease() {
    let repo = store();
    let skew = Duration::from_secs(5);
    let config = Config {
        ttl: Duration::from_secs(65),
        processing_timeout: Duration::from_secs(60),
        clock_skew: skew,
        ..Config::default()
    };
    let clock = TokioClock::starting_now();
    let ahead = TokioClock::starting_at(clock.now() + Duration::from_secs(4));
    let slow = manager(&repo, config.clone(), &clock);
    let fast = manager(&repo, config, &ahead);
    let runs = AtomicU32::new(0);
    let first = slow.execute("k", &(), || async {
        let r = charge(&runs);
        tokio::time::sleep(Duration::from_secs(59)).await;
        r
    });
    let duplicate = async {
        // Just before the lease ends by the slow clock: the fast clock reads
        // past the lease, within the skew.
        tokio::time::sleep(Duration::from_secs(58)).await;
        fast.execute("k", &(), || async { charge(&runs) }).await
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    assert!(matches!(first, Ok(Outcome::Executed(1))), "{first:?}");
    assert!(
        matches!(
            duplicate,
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "{duplicate:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// 3. Extension runs beside the handler: a hanging `extend` neither pauses the
///    handler nor outlives its time box.
#[tokio::test(start_paused = true)]
async fn a_hanging_extension_does_not_pause_the_handler() {
    let repo = store();
    repo.inject(Operation::Extend, Fault::Hang, usize::MAX);
    let config = Config {
        processing_timeout: Duration::from_secs(30),
        lease_extension_interval: Some(Duration::from_secs(5)),
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let started = tokio::time::Instant::now();
    let handler_took = Arc::new(parking_lot::Mutex::new(Duration::ZERO));
    let r = m
        .execute("k", &(), || async {
            let t = tokio::time::Instant::now();
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            *handler_took.lock() = t.elapsed();
            Ok::<_, HandlerError<String>>(())
        })
        .await;
    assert!(matches!(r, Ok(Outcome::Executed(()))), "{r:?}");
    assert_eq!(
        *handler_took.lock(),
        Duration::from_secs(20),
        "never paused"
    );
    assert!(started.elapsed() < Duration::from_secs(21));
    assert!(
        repo.calls(Operation::Extend) >= 3,
        "extension was attempted"
    );
}

/// 3b. The keeper extends in time even when the cadence would be too late: a
///     handler that starts with less of its lease left than one interval (its
///     reserve answered late; the lease counts from when it was sent), and an
///     extension that failed with the next tick past the lease's end, retried
///     before the end. Either way, without it the lease ended unextended and a
///     redelivery ran the handler again beside the first run.
#[tokio::test(start_paused = true)]
async fn the_keeper_extends_before_the_lease_ends_whatever_the_cadence() {
    let late_reserve = (Operation::Reserve, Fault::Delay(Duration::from_secs(5)));
    let failed_extension = (Operation::Extend, Fault::Unavailable);
    for (operation, fault) in [late_reserve, failed_extension] {
        let repo = store();
        repo.inject(operation, fault, 1);
        let config = Config {
            processing_timeout: Duration::from_secs(10),
            lease_extension_interval: Some(Duration::from_secs(
                if operation == Operation::Reserve {
                    8
                } else {
                    6
                },
            )),
            store_timeout: Duration::from_secs(6),
            ..Config::default()
        };
        let m = manager(&repo, config, &TokioClock::starting_now());
        let runs = AtomicU32::new(0);
        let first = m.execute("k", &(), || async {
            let r = charge(&runs);
            // Paused time: advances the test's clock, waits for nothing.
            tokio::time::sleep(Duration::from_secs(30)).await;
            r
        });
        let redelivery = async {
            // Paused time, as above.
            tokio::time::sleep(Duration::from_secs(20)).await;
            m.execute("k", &(), || async { charge(&runs) }).await
        };
        let (first, redelivery) = tokio::join!(first, redelivery);
        assert!(
            matches!(first, Ok(Outcome::Executed(1))),
            "{fault:?}: {first:?}"
        );
        assert!(
            matches!(
                redelivery,
                Err(ExecuteError::Idempotency(Error::InProgress { .. }))
            ),
            "{fault:?}: {redelivery:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{fault:?}");
    }
}

/// 3e. An extension refused again and again late in the lease is still tried
///     before the lease ends: the backoff shrinks to what is left, so the
///     store's recovery in the lease's last stretch keeps the key (before, the
///     fifth refusal's backoff landed past the end, the lease was lost and a
///     redelivery ran the handler again beside the first run).
#[tokio::test(start_paused = true)]
async fn an_extension_refused_late_in_the_lease_is_retried_before_it_ends() {
    let repo = store();
    // Refused at 2.0, 2.04, 2.12, 2.28 and 2.6 s of a 3 s lease.
    repo.inject(Operation::Extend, Fault::Unavailable, 5);
    let config = Config {
        processing_timeout: Duration::from_secs(3),
        lease_extension_interval: Some(Duration::from_secs(2)),
        store_timeout: Duration::from_secs(1),
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let runs = AtomicU32::new(0);
    let first = m.execute("k", &(), || async {
        let r = charge(&runs);
        // Paused time: advances the test's clock, waits for nothing.
        tokio::time::sleep(Duration::from_secs(8)).await;
        r
    });
    let redelivery = async {
        // Paused time, as above.
        tokio::time::sleep(Duration::from_secs(5)).await;
        m.execute("k", &(), || async { charge(&runs) }).await
    };
    let (first, redelivery) = tokio::join!(first, redelivery);
    assert!(matches!(first, Ok(Outcome::Executed(1))), "{first:?}");
    assert!(
        matches!(
            redelivery,
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "{redelivery:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(repo.calls(Operation::Extend) > 5, "the sixth try was made");
}

/// 3d. The keeper never spins: when an extension moves nothing (a clock that
///     stands still) it keeps to its cadence, and when every extension is
///     refused it retries with backoff in the lease's last stretch only.
#[tokio::test(start_paused = true)]
async fn the_keeper_keeps_to_its_cadence_and_backoff() {
    for refused in [false, true] {
        let repo = store();
        if refused {
            repo.inject(Operation::Extend, Fault::Unavailable, usize::MAX);
        }
        let config = Config {
            processing_timeout: Duration::from_secs(10),
            lease_extension_interval: Some(Duration::from_secs(2)),
            ..Config::default()
        };
        let m = IdempotencyManager::with_parts(
            repo.clone() as SharedRepository,
            config,
            Arc::new(ManualClock::starting_now()),
            JsonCodec,
        )
        .unwrap();
        let _ = m
            .execute("k", &(), || async {
                // Paused time: a 30 s handler that waits for nothing.
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok::<_, HandlerError<String>>(())
            })
            .await;
        let calls = repo.calls(Operation::Extend);
        assert!(
            (4..=12).contains(&calls),
            "refused {refused}: {calls} extensions over a 10 s lease"
        );
    }
}

/// 3c. A completion refused for longer than the lease that was left when the
///     handler returned is retried for as long as the keeper extends the lease,
///     not given up as `Unrecorded` while the record stays ours.
#[tokio::test(start_paused = true)]
async fn completion_retries_follow_the_extended_lease() {
    // About 15 s of refused completions (backoff from 20 ms, capped at 1 s).
    let (repo, m, took) = refused_completions_ridden_out(10, 3, 20).await;
    assert!(took > Duration::from_secs(10), "{took:?}");
    // A store that takes every extension and refuses every completion holds
    // the execution for one more processing timeout at most.
    repo.inject(Operation::Complete, Fault::Unavailable, usize::MAX);
    let started = tokio::time::Instant::now();
    let r = m
        .execute("refused", &(), || async {
            Ok::<_, HandlerError<String>>(2)
        })
        .await;
    assert!(
        matches!(r, Ok(Outcome::Unrecorded { value: 2, .. })),
        "{r:?}"
    );
    let took = started.elapsed();
    assert!(
        took > Duration::from_secs(10) && took <= Duration::from_secs(20),
        "{took:?}"
    );
}

/// 4. A dropped execution does not make the key re-runnable while the handler's
///    effect may be happening: by default the lease is kept.
#[tokio::test(start_paused = true)]
async fn a_dropped_execution_keeps_its_lease_by_default() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let m = manager(&repo, Config::default(), &clock);
    let runs = AtomicU32::new(0);
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        m.execute("k", &(), || async {
            let r = charge(&runs); // the card is charged…
            tokio::time::sleep(Duration::from_secs(10)).await; // …the reply is slow
            r
        }),
    )
    .await;
    assert!(gave_up.is_err(), "the caller gave up");
    let retry = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(
        matches!(
            retry,
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "{retry:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let key = m.record_key("k").unwrap();
    let record = repo.inner().get(&key, clock.now()).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Processing);
}

/// 4. Release on cancel is opt-in.
#[tokio::test(start_paused = true)]
async fn release_on_cancel_is_opt_in() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        on_cancel: CancelPolicy::Release,
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    let key = m.record_key("k").unwrap();
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        m.execute("k", &(), || async {
            // Paused time (start_paused): advances at once, no real wait.
            tokio::time::sleep(Duration::from_secs(10)).await;
            Ok::<_, HandlerError<String>>(())
        }),
    )
    .await;
    assert!(gave_up.is_err());
    eventually(async || repo.inner().get(&key, clock.now()).await.unwrap().is_none()).await;
}

/// 4. Detached: the handler finishes although the caller left, and the retry
///    gets its stored outcome.
#[tokio::test(start_paused = true)]
async fn a_detached_execution_finishes_and_the_retry_replays_it() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs.clone();
        move |_ctx: ExecutionContext| async move {
            // Paused time (start_paused): advances at once, no real wait.
            tokio::time::sleep(Duration::from_secs(10)).await;
            charge(&runs)
        }
    };
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        m.execute_detached("k", &(), handler),
    )
    .await;
    assert!(gave_up.is_err());
    tokio::time::sleep(Duration::from_secs(10)).await;
    let retry = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(matches!(retry, Ok(Outcome::Cached(1))), "{retry:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// 4. Detached on the current thread (a handler that is not `Send`, as in
///    actix-web): the same, on a `LocalSet`.
#[tokio::test(start_paused = true)]
async fn a_detached_local_execution_finishes_and_the_retry_replays_it() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let runs = Arc::new(AtomicU32::new(0));
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async {
            let not_send = std::rc::Rc::new(());
            let handler = {
                let runs = runs.clone();
                move |_ctx: ExecutionContext| async move {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    drop(not_send);
                    charge(&runs)
                }
            };
            let gave_up = tokio::time::timeout(
                Duration::from_secs(1),
                m.execute_detached_local("k", &(), handler),
            )
            .await;
            assert!(gave_up.is_err());
            // Paused time (start_paused): advances at once, no real wait.
            tokio::time::sleep(Duration::from_secs(10)).await;
        })
        .await;
    let retry = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(matches!(retry, Ok(Outcome::Cached(1))), "{retry:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// 4b. A reserve that reaches the store after its caller gave up, and after
///    the cleanup's release found nothing there, does not hold the key for a
///    whole lease: the cleanup releases once more one store time box later,
///    and a redelivery then runs (before, it was answered "in progress" for
///    the 300 s of the orphan's lease).
#[tokio::test(start_paused = true)]
async fn a_reserve_landing_after_its_cleanup_does_not_hold_the_key() {
    let repo = store();
    repo.inject(Operation::Reserve, Fault::HoldOnTheWay, 1);
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let runs = AtomicU32::new(0);
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        m.execute("k", &(), || async { charge(&runs) }),
    )
    .await;
    assert!(gave_up.is_err(), "the caller gave up while reserving");
    eventually(async || repo.calls(Operation::Release) >= 1).await;
    let landed = repo.deliver_held().await;
    assert!(
        matches!(landed[..], [Ok(Reservation::Acquired { attempt: 1 })]),
        "{landed:?}"
    );
    let held = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(
        matches!(
            held,
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "the orphan holds the key until the second release: {held:?}"
    );
    // Paused time: one store time box (5 s), and the key is free again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let redelivery = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(
        matches!(redelivery, Ok(Outcome::Executed(1))),
        "{redelivery:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// 4c. A reserve applied by the store whose reply could not be read (a
///    non-retryable error after the write) leaves nothing behind: the record
///    it may have created under our token is released, so a redelivery runs
///    (before, the key stayed "in progress" for a whole lease).
#[tokio::test(start_paused = true)]
async fn a_reserve_whose_reply_could_not_be_read_leaves_nothing_behind() {
    let repo = store();
    repo.inject(Operation::Reserve, Fault::GarbleReply, 1);
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let runs = AtomicU32::new(0);
    let first = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(
        matches!(first, Err(ExecuteError::Idempotency(Error::Backend { .. }))),
        "{first:?}"
    );
    eventually(async || repo.calls(Operation::Release) >= 1).await;
    let redelivery = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(
        matches!(redelivery, Ok(Outcome::Executed(1))),
        "{redelivery:?}"
    );
}

/// 4. A drop after the handler returned, while its completion is retried,
///    still records the completion (in the background).
#[tokio::test(start_paused = true)]
async fn a_drop_while_recording_still_records_the_outcome() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let m = manager(&repo, Config::default(), &clock);
    repo.inject(Operation::Complete, Fault::Unavailable, 5);
    let runs = AtomicU32::new(0);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(50),
        m.execute("k", &(), || async { charge(&runs) }),
    )
    .await;
    assert!(gave_up.is_err(), "dropped during the completion retries");
    let key = m.record_key("k").unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let record = repo.inner().get(&key, clock.now()).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Completed);
    let retry = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(matches!(retry, Ok(Outcome::Cached(1))), "{retry:?}");
}

/// 5. A reserve whose reply was lost is sent again with the same owner token
///    and answered `Acquired`, not `InProgress` against ourselves.
#[tokio::test(start_paused = true)]
async fn a_reserve_whose_reply_was_lost_still_runs_the_handler_once() {
    let repo = store();
    repo.inject(Operation::Reserve, Fault::LoseReply, 1);
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let runs = AtomicU32::new(0);
    let r = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(matches!(r, Ok(Outcome::Executed(1))), "{r:?}");
    assert_eq!(repo.calls(Operation::Reserve), 2);
    let again = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(matches!(again, Ok(Outcome::Cached(1))), "{again:?}");
}

/// 5. A `complete` that the client re-sent after a reset answers `LeaseLost`
///    on the second send; it is recognised as ours.
#[tokio::test(start_paused = true)]
async fn a_resent_complete_is_not_lease_lost() {
    let repo = store();
    repo.inject(Operation::Complete, Fault::Resend, 1);
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(3) })
        .await;
    assert!(matches!(r, Ok(Outcome::Executed(3))), "{r:?}");
}

/// 6. A store failover of several seconds during the completion does not turn
///    a success into `Unrecorded`: the completion is retried (the lease
///    extended meanwhile) until shortly before the lease ends.
#[tokio::test(start_paused = true)]
async fn a_failover_during_the_completion_is_ridden_out() {
    // About 8 s of refused completions.
    let (_, _, took) = refused_completions_ridden_out(60, 20, 12).await;
    assert!(took >= Duration::from_secs(5), "{took:?}");
}

/// One execution with lease extension (`processing` and `interval` seconds)
/// whose first `refusals` completions are refused as outages: it ends
/// `Executed` with its record completed. The store, the manager and how long
/// the execution took.
async fn refused_completions_ridden_out(
    processing: u64,
    interval: u64,
    refusals: usize,
) -> (common::Store, IdempotencyManager, Duration) {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(processing),
        lease_extension_interval: Some(Duration::from_secs(interval)),
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    repo.inject(Operation::Complete, Fault::Unavailable, refusals);
    let started = tokio::time::Instant::now();
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(1) })
        .await;
    let took = started.elapsed();
    assert!(matches!(r, Ok(Outcome::Executed(1))), "{r:?}");
    let key = m.record_key("k").unwrap();
    let record = repo.inner().get(&key, clock.now()).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Completed);
    (repo, m, took)
}

/// 7. Fail-open after a reserve whose replies were lost: the record created
///    under our token is completed afterwards, so a duplicate is answered from
///    it instead of being blocked for the whole lease.
#[tokio::test(start_paused = true)]
async fn fail_open_completes_the_record_a_lost_reserve_created() {
    let repo = store();
    repo.inject(Operation::Reserve, Fault::LoseReply, 3);
    let clock = TokioClock::starting_now();
    let config = Config {
        on_store_outage: OutagePolicy::FailOpen,
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    let runs = AtomicU32::new(0);
    let r = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(matches!(r, Ok(Outcome::Unprotected(1))), "{r:?}");
    let key = m.record_key("k").unwrap();
    eventually(async || {
        repo.inner()
            .get(&key, clock.now())
            .await
            .unwrap()
            .is_some_and(|r| r.status == Status::Completed)
    })
    .await;
    let dup = m.execute("k", &(), || async { charge(&runs) }).await;
    assert!(matches!(dup, Ok(Outcome::Cached(1))), "{dup:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// 7. Fail-closed after the same: the record is released, not left blocking
///    the key until its lease ends.
#[tokio::test(start_paused = true)]
async fn fail_closed_releases_the_record_a_lost_reserve_created() {
    let r = lost_reserve_is_released(&[(Fault::LoseReply, 3)]).await;
    assert!(matches!(r, Error::Timeout { .. }), "{r:?}");
}

/// 7b. A lost reply, then a store that refuses the re-send (a non-retryable
///     error): the record the lost attempt created is still released.
#[tokio::test(start_paused = true)]
async fn a_refusal_after_a_lost_reserve_still_releases_the_record() {
    let r = lost_reserve_is_released(&[(Fault::LoseReply, 1), (Fault::Refuse, 1)]).await;
    assert!(matches!(r, Error::Backend { .. }), "{r:?}");
}

/// Reserves through `faults` (each for its count of calls, in turn): the
/// execution fails, the record a lost attempt created is released, and the
/// next delivery runs. The execution's error.
async fn lost_reserve_is_released(faults: &[(Fault, usize)]) -> Error {
    let repo = store();
    for &(fault, times) in faults {
        repo.inject(Operation::Reserve, fault, times);
    }
    let clock = TokioClock::starting_now();
    let m = manager(&repo, Config::default(), &clock);
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(1) })
        .await;
    let Err(ExecuteError::Idempotency(error)) = r else {
        panic!("the execution succeeded: {r:?}")
    };
    let key = m.record_key("k").unwrap();
    eventually(async || repo.inner().get(&key, clock.now()).await.unwrap().is_none()).await;
    let retry = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(2) })
        .await;
    assert!(matches!(retry, Ok(Outcome::Executed(2))), "{retry:?}");
    error
}

/// 8. Under store-and-retry a permanent failure is stored for good; only a
///    retryable one is taken over by the next delivery.
#[tokio::test(start_paused = true)]
async fn store_and_retry_retries_only_retryable_failures() {
    let repo = store();
    let config = Config {
        failure_policy: FailurePolicy::StoreAndRetry,
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let runs = AtomicU32::new(0);
    let fail = |permanent: bool| {
        let runs = &runs;
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let e = "card declined".to_owned();
            Err::<(), _>(if permanent {
                HandlerError::permanent(e)
            } else {
                HandlerError::new(e)
            })
        }
    };
    assert!(m.execute("permanent", &(), fail(true)).await.is_err());
    let again = m.execute("permanent", &(), fail(true)).await;
    assert!(
        matches!(
            again,
            Err(ExecuteError::Idempotency(Error::PreviouslyFailed { .. }))
        ),
        "{again:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a permanent failure is not retried"
    );
    assert!(m.execute("retryable", &(), fail(false)).await.is_err());
    let retried = m.execute("retryable", &(), fail(false)).await;
    assert!(
        matches!(retried, Err(ExecuteError::Handler(_))),
        "{retried:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "a retryable failure is taken over"
    );
}

/// 9. A takeover by a consumer without payload validation keeps the stored
///    fingerprint: a later different payload is still refused.
#[tokio::test(start_paused = true)]
async fn a_takeover_without_validation_keeps_the_fingerprint() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(10),
        ..Config::default()
    };
    let validating = manager(&repo, config.clone(), &clock);
    let blind = manager(
        &repo,
        Config {
            validate_payload: false,
            ..config
        },
        &clock,
    );
    // A consumer crashes mid-handler (its future leaked: no cleanup at all).
    let crashed = validating.execute("k", &1, || async {
        std::future::pending::<Result<u32, HandlerError<String>>>().await
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), Box::pin(crashed).as_mut()).await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    let taken = blind
        .execute("k", &1, || async { Ok::<_, HandlerError<String>>(7) })
        .await;
    assert!(matches!(taken, Ok(Outcome::Executed(7))), "{taken:?}");
    let other = validating
        .execute("k", &2, || async { Ok::<_, HandlerError<String>>(8) })
        .await;
    assert!(
        matches!(
            other,
            Err(ExecuteError::Idempotency(Error::PayloadMismatch { .. }))
        ),
        "{other:?}"
    );
}

/// 10. Keys are injective above the record key: scopes and multi-step keys.
#[tokio::test]
async fn scopes_and_steps_compose_injectively() {
    let m = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap();
    assert_ne!(
        m.scoped("a").unwrap().scoped("b").unwrap().namespace(),
        m.scoped("a:b").unwrap().namespace()
    );
    let ok = |v: u32| move || async move { Ok::<_, HandlerError<String>>(v) };
    let first = m.step("a:b", "c", &(), ok(1)).await.unwrap();
    let second = m.step("a", "b:c", &(), ok(2)).await.unwrap();
    assert!(matches!(first, Outcome::Executed(1)));
    assert!(matches!(second, Outcome::Executed(2)), "{second:?}");
}

/// Without lease extension the context still tells the truth: its owner
/// token is the one the store holds the record under, and `lease_lost` fires
/// when the processing timeout has passed (nobody extends it), so a long
/// handler can stop before a redelivery takes the key over.
#[tokio::test(start_paused = true)]
async fn without_extension_the_context_names_its_owner_and_loses_the_lease_at_the_timeout() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(10),
        lease_extension_interval: None,
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    let started = tokio::time::Instant::now();
    let key = m.record_key("k").unwrap();
    let (repo_ref, clock_ref, key_ref) = (&repo, &clock, &key);
    let r = m
        .execute_with_context("k", &(), |ctx: ExecutionContext| async move {
            let stored = repo_ref
                .inner()
                .get(key_ref, clock_ref.now())
                .await
                .unwrap()
                .expect("the record of the running execution");
            assert_eq!(
                stored.owner,
                ctx.owner(),
                "the context's owner token is the record's"
            );
            assert_eq!(stored.attempt, ctx.attempt());
            assert!(!ctx.is_lease_lost());
            ctx.lease_lost().await;
            Ok::<_, HandlerError<String>>(started.elapsed())
        })
        .await;
    let Ok(Outcome::Executed(lost_after)) = r else {
        panic!("{r:?}");
    };
    assert!(
        lost_after >= Duration::from_secs(10) && lost_after < Duration::from_secs(11),
        "{lost_after:?}"
    );
}

/// The context: attempt numbers are fencing tokens, and the lease-lost signal
/// fires when another owner takes over.
#[tokio::test(start_paused = true)]
async fn the_handler_sees_its_attempt_and_loses_its_lease() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(10),
        lease_extension_interval: Some(Duration::from_secs(3)),
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    // Extension keeps failing: the lease ends unconfirmed and the signal fires
    // at its end, so the handler stops before a takeover runs it again.
    repo.inject(Operation::Extend, Fault::Unavailable, usize::MAX);
    let started = tokio::time::Instant::now();
    let first = m
        .execute_with_context("k", &(), |ctx: ExecutionContext| async move {
            assert_eq!(ctx.attempt(), 1);
            ctx.lease_lost().await;
            Err::<u32, _>(HandlerError::transient("stopped: lease lost".to_owned()))
        })
        .await;
    assert!(matches!(first, Err(ExecuteError::Handler(_))), "{first:?}");
    let lost_after = started.elapsed();
    assert!(
        lost_after >= Duration::from_secs(10) && lost_after < Duration::from_secs(11),
        "{lost_after:?}"
    );
    repo.heal();
    // A crashed attempt, then a takeover: the fencing token grows.
    let crashed = m.execute_with_context("fenced", &(), |_ctx| async {
        std::future::pending::<Result<u32, HandlerError<String>>>().await
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), Box::pin(crashed).as_mut()).await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    let taken = m
        .execute_with_context("fenced", &(), |ctx: ExecutionContext| async move {
            Ok::<_, HandlerError<String>>(ctx.attempt())
        })
        .await;
    assert!(matches!(taken, Ok(Outcome::Executed(2))), "{taken:?}");
}

/// The signal also fires when the store answers that another owner holds the
/// key.
#[tokio::test(start_paused = true)]
async fn lease_lost_fires_when_another_owner_took_over() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        processing_timeout: Duration::from_secs(10),
        lease_extension_interval: Some(Duration::from_secs(3)),
        ..Config::default()
    };
    let m = manager(&repo, config, &clock);
    let key = m.record_key("k").unwrap();
    let r = m
        .execute_with_context("k", &(), |ctx: ExecutionContext| {
            let repo = repo.clone();
            let key = key.clone();
            async move {
                // An operator evicts the record; the next extension is refused.
                repo.inner().delete(&key).await.unwrap();
                ctx.lease_lost().await;
                assert!(ctx.is_lease_lost());
                Ok::<_, HandlerError<String>>(())
            }
        })
        .await;
    assert!(matches!(r, Ok(Outcome::LeaseLost(()))), "{r:?}");
}

/// Waiting for a live holder, then an outage: the answer is the holder's
/// `InProgress`, never a fail-open run beside the holder.
#[tokio::test(start_paused = true)]
async fn an_outage_while_waiting_for_a_holder_is_not_a_fail_open_run() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        on_store_outage: OutagePolicy::FailOpen,
        in_progress: InProgressPolicy::Wait {
            timeout: Duration::from_secs(10),
            poll_interval: Duration::from_millis(100),
        },
        ..Config::default()
    };
    let m = Arc::new(manager(&repo, config, &clock));
    let (release_holder, holder_may_finish) = tokio::sync::oneshot::channel::<()>();
    let holder = tokio::spawn({
        let m = m.clone();
        async move {
            m.execute("k", &(), || async {
                let _ = holder_may_finish.await;
                Ok::<_, HandlerError<String>>(1)
            })
            .await
        }
    });
    eventually(async || repo.calls(Operation::Reserve) == 1).await;
    let runs = Arc::new(AtomicU32::new(0));
    let waiter = tokio::spawn({
        let (m, runs) = (m.clone(), runs.clone());
        async move { m.execute("k", &(), || async { charge(&runs) }).await }
    });
    eventually(async || repo.calls(Operation::Reserve) == 2).await;
    repo.set_unavailable(true);
    let r = waiter.await.unwrap();
    assert!(
        matches!(r, Err(ExecuteError::Idempotency(Error::InProgress { .. }))),
        "{r:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no run beside the holder");
    repo.heal();
    release_holder.send(()).unwrap();
    assert!(matches!(holder.await.unwrap(), Ok(Outcome::Executed(1))));
}

/// A reserve applied but unanswered, then a 5 s outage: the cleanup keeps
/// retrying through the outage (up to the lease the lost attempt may hold),
/// so the key is free when the store is back, not blocked for the lease.
#[tokio::test(start_paused = true)]
async fn the_cleanup_after_a_failed_reserve_outlasts_the_outage() {
    let repo = store();
    repo.inject(Operation::Reserve, Fault::LoseReply, 1);
    let clock = TokioClock::starting_now();
    let m = manager(&repo, Config::default(), &clock);
    let outage = tokio::spawn({
        let repo = repo.clone();
        async move {
            while repo.calls(Operation::Reserve) < 1 {
                tokio::task::yield_now().await;
            }
            repo.set_unavailable(true);
            tokio::time::sleep(Duration::from_secs(5)).await;
            repo.heal();
        }
    });
    let r = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(1) })
        .await;
    assert!(
        matches!(&r, Err(ExecuteError::Idempotency(e)) if e.is_retryable()),
        "{r:?}"
    );
    outage.await.unwrap();
    let key = m.record_key("k").unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    eventually(async || repo.inner().get(&key, clock.now()).await.unwrap().is_none()).await;
    let retry = m
        .execute("k", &(), || async { Ok::<_, HandlerError<String>>(2) })
        .await;
    assert!(matches!(retry, Ok(Outcome::Executed(2))), "{retry:?}");
}

/// A result whose `Serialize` panics.
#[derive(Debug)]
struct Bomb;

impl serde::Serialize for Bomb {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("this result cannot be serialized")
    }
}

impl<'de> serde::Deserialize<'de> for Bomb {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <()>::deserialize(d).map(|()| Bomb)
    }
}

/// The handler succeeded, then encoding its result panicked: the success is
/// recorded (without a cached result), never released for a second run, even
/// with `on_cancel = Release`.
#[tokio::test(start_paused = true)]
async fn a_panic_after_the_effect_records_the_success() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let config = Config {
        on_cancel: CancelPolicy::Release,
        ..Config::default()
    };
    let m = Arc::new(manager(&repo, config, &clock));
    let runs = Arc::new(AtomicU32::new(0));
    let first = tokio::spawn({
        let (m, runs) = (m.clone(), runs.clone());
        async move {
            m.execute("k", &(), || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError<String>>(Bomb)
            })
            .await
        }
    });
    assert!(first.await.unwrap_err().is_panic());
    let key = m.record_key("k").unwrap();
    eventually(async || {
        repo.inner()
            .get(&key, clock.now())
            .await
            .unwrap()
            .is_some_and(|r| r.status == Status::Completed)
    })
    .await;
    let dup = m
        .execute("k", &(), || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError<String>>(0u32)
        })
        .await;
    assert!(matches!(dup, Ok(Outcome::Duplicate)), "{dup:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
