//! `execute_batch`: one reservation call per group of keys, one run per key,
//! answers in input order, and each item as safe as a single execution
//! (lost batch replies, failures of one item, a dropped batch).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{manager, store};
use idempotency_core::testing::{Fault, Operation, TokioClock};
use idempotency_core::{
    AnswerCacheConfig, Config, Error, ExecuteError, HandlerError, IdempotencyManager, Outcome,
};

type Answer = Result<Outcome<u32>, ExecuteError<String>>;

/// Runs a batch whose handler doubles the payload and counts its runs per key.
async fn double(m: &IdempotencyManager, items: &[(&str, u32)], concurrency: usize) -> Vec<Answer> {
    m.execute_batch(items, concurrency, |i, _ctx| {
        let value = items[i].1;
        async move {
            tokio::task::yield_now().await;
            Ok::<_, HandlerError<String>>(value * 2)
        }
    })
    .await
}

/// The wait policy for a live holder: up to `timeout`, polling every
/// `poll_interval`.
fn waiting(timeout: Duration, poll_interval: Duration) -> Config {
    Config {
        in_progress: idempotency_core::InProgressPolicy::Wait {
            timeout,
            poll_interval,
        },
        ..Config::default()
    }
}

/// Starts an execution of `key` whose handler never returns (a live holder),
/// once its handler has started.
async fn hold(m: &IdempotencyManager, key: &'static str) -> tokio::task::JoinHandle<Answer> {
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let m = m.clone();
    let holder = tokio::spawn(async move {
        m.execute(key, &1u32, || async move {
            started_tx.send(()).unwrap();
            std::future::pending::<Result<u32, HandlerError<String>>>().await
        })
        .await
    });
    started_rx.await.unwrap();
    holder
}

fn outcome(a: &Answer) -> Option<(&'static str, u32)> {
    match a {
        Ok(Outcome::Executed(v)) => Some(("executed", *v)),
        Ok(Outcome::Cached(v)) => Some(("cached", *v)),
        _ => None,
    }
}

#[tokio::test(start_paused = true)]
async fn answers_in_order_and_runs_each_key_once() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let runs = AtomicUsize::new(0);
    let items = [("a", 1), ("b", 2), ("a", 1), ("c", 3), ("a", 9), ("b", 2)];
    let answers = m
        .execute_batch(&items, 64, |i, _ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            let v = items[i].1;
            async move { Ok::<_, HandlerError<String>>(v * 2) }
        })
        .await;
    assert_eq!(answers.len(), items.len());
    assert_eq!(outcome(&answers[0]), Some(("executed", 2)));
    assert_eq!(outcome(&answers[1]), Some(("executed", 4)));
    assert_eq!(outcome(&answers[2]), Some(("cached", 2)));
    assert_eq!(outcome(&answers[3]), Some(("executed", 6)));
    assert!(
        matches!(
            &answers[4],
            Err(ExecuteError::Idempotency(Error::PayloadMismatch { .. }))
        ),
        "the same key with another payload: {:?}",
        answers[4]
    );
    assert_eq!(outcome(&answers[5]), Some(("cached", 4)));
    assert_eq!(runs.load(Ordering::SeqCst), 3, "one run per key");
    // Three occurrences of `a`: three waves, one call each.
    assert_eq!(repo.calls(Operation::ReserveMany), 3);
    assert_eq!(repo.calls(Operation::Reserve), 0, "no single reserve");
}

#[tokio::test(start_paused = true)]
async fn a_batch_of_duplicates_is_one_call() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
    let items: Vec<(&str, u32)> = keys.iter().map(|k| (k.as_str(), 7)).collect();
    assert!(double(&m, &items, 100)
        .await
        .iter()
        .all(|a| outcome(a) == Some(("executed", 14))));
    let before = repo.calls(Operation::ReserveMany);
    let again = double(&m, &items, 100).await;
    assert!(again.iter().all(|a| outcome(a) == Some(("cached", 14))));
    assert_eq!(repo.calls(Operation::ReserveMany), before + 1);
    assert_eq!(
        repo.calls(Operation::CompleteMany),
        1,
        "no completion for a duplicate"
    );
}

#[tokio::test(start_paused = true)]
async fn a_groups_completions_are_one_call() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
    let items: Vec<(&str, u32)> = keys.iter().map(|k| (k.as_str(), 1)).collect();
    let answers = double(&m, &items, 100).await;
    assert!(answers.iter().all(|a| outcome(a) == Some(("executed", 2))));
    assert_eq!(repo.calls(Operation::CompleteMany), 1);
    assert_eq!(repo.calls(Operation::Complete), 0, "none on its own");
}

#[tokio::test(start_paused = true)]
async fn a_slow_handler_does_not_hold_the_others_completions() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let items = [("fast-1", 1u32), ("slow", 2), ("fast-2", 3)];
    let batch = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute_batch(&items, 4, |i, _ctx| async move {
                if i == 1 {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                Ok::<_, HandlerError<String>>(items[i].1 * 2)
            })
            .await
        })
    };
    // The fast ones are recorded long before the slow handler ends (paused
    // time: the sleeps advance the test's clock, they do not wait).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let fast = double(&m, &[("fast-1", 1), ("fast-2", 3)], 2).await;
    assert!(
        fast.iter()
            .all(|a| outcome(a).is_some_and(|(o, _)| o == "cached")),
        "{fast:?}"
    );
    let answers = batch.await.unwrap();
    assert!(answers
        .iter()
        .all(|a| outcome(a).is_some_and(|(o, _)| o == "executed")));
    assert_eq!(
        repo.calls(Operation::CompleteMany),
        2,
        "the fast pair, then the slow one"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_completion_reply_is_recognised_as_ours() {
    faulted_batches_run_once(Operation::CompleteMany).await;
}

/// Each fault on the group's `operation` call — a lost reply, an outage, a
/// re-send, a refusal of the call as a whole (no item's own answer) — and
/// still every handler runs once, every item answers `Executed`, and the
/// keys are recorded (a second delivery is answered from the record).
async fn faulted_batches_run_once(operation: Operation) {
    for fault in [
        Fault::LoseReply,
        Fault::Unavailable,
        Fault::Resend,
        Fault::Refuse,
    ] {
        let repo = store();
        let m = manager(&repo, Config::default(), &TokioClock::starting_now());
        repo.inject(operation, fault, 1);
        let runs = AtomicUsize::new(0);
        let items = [("a", 1u32), ("b", 2), ("c", 3)];
        let answers = m
            .execute_batch(&items, 8, |i, _ctx| {
                runs.fetch_add(1, Ordering::SeqCst);
                let v = items[i].1;
                async move { Ok::<_, HandlerError<String>>(v * 2) }
            })
            .await;
        for (a, (_, v)) in answers.iter().zip(items) {
            // Re-sent with the same owner token, each key is ours.
            assert_eq!(outcome(a), Some(("executed", v * 2)), "{fault:?}: {a:?}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{fault:?}");
        let again = double(&m, &items, 8).await;
        assert!(again
            .iter()
            .all(|a| outcome(a).is_some_and(|(o, _)| o == "cached")));
    }
}

#[tokio::test(start_paused = true)]
async fn groups_are_the_concurrency_and_bound_the_running_handlers() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let (running, peak) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    let items: Vec<(&str, ())> = keys.iter().map(|k| (k.as_str(), ())).collect();
    let answers = m
        .execute_batch(&items, 3, |i, _ctx| {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            let running = &running;
            async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, HandlerError<String>>(i as u32)
            }
        })
        .await;
    for (i, a) in answers.iter().enumerate() {
        assert_eq!(outcome(a), Some(("executed", i as u32)));
    }
    assert_eq!(peak.load(Ordering::SeqCst), 3);
    assert_eq!(
        repo.calls(Operation::ReserveMany),
        4,
        "groups of 3, 3, 3, 1"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_batch_reply_never_runs_a_handler_twice_nor_blocks_the_key() {
    faulted_batches_run_once(Operation::ReserveMany).await;
}

#[tokio::test(start_paused = true)]
async fn one_items_failure_leaves_the_others_alone() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let items = [("ok-1", 1), ("bad", 2), ("ok-2", 3)];
    let answers = m
        .execute_batch(&items, 8, |i, _ctx| {
            let (key, v) = items[i];
            async move {
                if key == "bad" {
                    Err(HandlerError::new("declined".to_owned()))
                } else {
                    Ok(v)
                }
            }
        })
        .await;
    assert_eq!(outcome(&answers[0]), Some(("executed", 1)));
    assert!(matches!(&answers[1], Err(ExecuteError::Handler(e)) if e == "declined"));
    assert_eq!(outcome(&answers[2]), Some(("executed", 3)));
    // Released (the default policy): the redelivery runs it again.
    let retry = double(&m, &[("bad", 2)], 1).await;
    assert_eq!(outcome(&retry[0]), Some(("executed", 4)));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_batch_keeps_running_keys_and_leaves_later_groups_unreserved() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let started = Arc::new(AtomicUsize::new(0));
    let items = [("a", 1u32), ("b", 2), ("c", 3), ("d", 4)];
    let batch = {
        let (m, started) = (m.clone(), started.clone());
        tokio::spawn(async move {
            m.execute_batch(&items, 2, |_, _ctx| {
                started.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<Result<u32, HandlerError<String>>>()
            })
            .await
        })
    };
    common::eventually(async || started.load(Ordering::SeqCst) == 2).await;
    batch.abort();
    assert!(batch.await.unwrap_err().is_cancelled());
    // The running handlers may have had their effect: their keys keep the lease.
    for (key, payload) in [("a", 1), ("b", 2)] {
        let answer = double(&m, &[(key, payload)], 1).await;
        assert!(
            matches!(
                &answer[0],
                Err(ExecuteError::Idempotency(Error::InProgress { .. }))
            ),
            "{key}: {:?}",
            answer[0]
        );
    }
    // The second group was never reserved.
    let later = double(&m, &[("c", 3), ("d", 4)], 2).await;
    assert_eq!(outcome(&later[0]), Some(("executed", 6)));
    assert_eq!(outcome(&later[1]), Some(("executed", 8)));
}

#[tokio::test(start_paused = true)]
async fn the_local_answer_cache_answers_before_the_store() {
    let repo = store();
    let config = Config {
        answer_cache: Some(AnswerCacheConfig::default()),
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let items = [("a", 1), ("b", 2)];
    double(&m, &items, 8).await;
    let calls = repo.calls(Operation::ReserveMany);
    let again = double(&m, &items, 8).await;
    assert!(again
        .iter()
        .all(|a| outcome(a).is_some_and(|(o, _)| o == "cached")));
    assert_eq!(repo.calls(Operation::ReserveMany), calls, "no round trip");
    // Invalid keys are answered per item, the rest still run.
    let mixed = double(&m, &[("", 1), ("c", 5)], 8).await;
    assert!(matches!(
        &mixed[0],
        Err(ExecuteError::Idempotency(Error::InvalidKey { .. }))
    ));
    assert_eq!(outcome(&mixed[1]), Some(("executed", 10)));
}

#[tokio::test(start_paused = true)]
async fn an_outage_while_waiting_for_a_holder_never_runs_beside_it() {
    use idempotency_core::OutagePolicy;
    let repo = store();
    let config = Config {
        on_store_outage: OutagePolicy::FailOpen,
        ..waiting(Duration::from_secs(5), Duration::from_millis(50))
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let holder = hold(&m, "k").await;
    // The batch sees the holder; then the store goes away while it waits.
    repo.inject(Operation::Reserve, Fault::Unavailable, 10);
    let runs = AtomicUsize::new(0);
    let answers = m
        .execute_batch(&[("k", 1u32)], 4, |_, _ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError<String>>(2) }
        })
        .await;
    assert!(
        matches!(
            &answers[0],
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "{:?}",
        answers[0]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "never beside the holder");
    holder.abort();
}

/// Under the wait policy, the wait for a live holder counts from the batch's
/// call, as a single reservation's counts from its first attempt: a batch call
/// that took longer than the wait answers "in progress" when it returns,
/// without waiting a whole timeout more.
#[tokio::test(start_paused = true)]
async fn the_wait_for_a_holder_counts_from_the_batch_call() {
    let repo = store();
    let config = waiting(Duration::from_secs(1), Duration::from_millis(300));
    let m = manager(&repo, config, &TokioClock::starting_now());
    let holder = hold(&m, "k").await;
    repo.inject(
        Operation::ReserveMany,
        Fault::Delay(Duration::from_secs(2)),
        1,
    );
    let started = tokio::time::Instant::now();
    let answers = double(&m, &[("k", 1)], 4).await;
    assert!(
        matches!(
            &answers[0],
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "{:?}",
        answers[0]
    );
    let took = started.elapsed();
    assert!(took < Duration::from_millis(2_500), "{took:?}");
    holder.abort();
}

/// A key the batch call refused (not an outage: a record that does not
/// decode, a statement refused) is never run unprotected when its single
/// retries then meet an outage: it ends with the outage (retryable: the
/// message comes again), not with a fail-open run on a key the store refused.
#[tokio::test(start_paused = true)]
async fn a_key_the_batch_refused_is_not_run_unprotected_when_the_store_then_fails() {
    use idempotency_core::OutagePolicy;
    let repo = store();
    repo.inject(Operation::ReserveMany, Fault::Refuse, 1);
    repo.inject(Operation::Reserve, Fault::Unavailable, 10);
    let config = Config {
        on_store_outage: OutagePolicy::FailOpen,
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    let runs = AtomicUsize::new(0);
    let answers = m
        .execute_batch(&[("a", 1u32), ("b", 2)], 4, |_, _ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError<String>>(2) }
        })
        .await;
    for answer in &answers {
        match answer {
            Err(ExecuteError::Idempotency(e @ Error::Unavailable { .. })) => {
                assert!(e.is_retryable(), "{e:?}");
            }
            other => panic!("the outage, never an unprotected run: {other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "never run unprotected");
    assert!(
        repo.calls(Operation::Reserve) >= 2,
        "each key tried on its own"
    );
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_lets_the_rest_of_its_group_finish() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let batch = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute_batch(&[("boom", 0u32), ("slow", 1)], 4, |i, _ctx| async move {
                if i == 0 {
                    panic!("handler bug");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, HandlerError<String>>(7u32)
            })
            .await
        })
    };
    assert!(batch.await.unwrap_err().is_panic(), "the panic continues");
    // `slow` ran to completion and was recorded; `boom` was released.
    let after = double(&m, &[("slow", 1), ("boom", 0)], 4).await;
    assert_eq!(outcome(&after[0]), Some(("cached", 7)));
    assert_eq!(outcome(&after[1]), Some(("executed", 0)));
}

/// A stored result whose decoding panics (a user's `Deserialize` with a bug).
#[derive(Debug, serde::Serialize, PartialEq)]
struct Touchy(u32);

/// The value whose decoding panics.
const UNLUCKY: u32 = 13;

impl<'de> serde::Deserialize<'de> for Touchy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = u32::deserialize(d)?;
        assert_ne!(v, UNLUCKY, "decoder bug");
        Ok(Touchy(v))
    }
}

#[tokio::test(start_paused = true)]
async fn a_panic_decoding_a_duplicates_answer_lets_the_rest_of_its_group_finish() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    let stored = m
        .execute("unlucky", &0u32, || async {
            Ok::<_, HandlerError<String>>(Touchy(UNLUCKY))
        })
        .await
        .unwrap();
    assert!(matches!(stored, Outcome::Executed(Touchy(UNLUCKY))));
    let batch = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute_batch(&[("unlucky", 0u32), ("slow", 1)], 4, |_, _ctx| async {
                tokio::task::yield_now().await;
                Ok::<_, HandlerError<String>>(Touchy(7))
            })
            .await
        })
    };
    assert!(batch.await.unwrap_err().is_panic(), "the panic continues");
    // `slow` ran to completion and was recorded.
    let again = m
        .execute("slow", &1u32, || async {
            Ok::<_, HandlerError<String>>(Touchy(0))
        })
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Cached(Touchy(7))), "{again:?}");
}

#[tokio::test(start_paused = true)]
async fn a_reservation_confirmed_after_its_lease_ended_does_not_run() {
    let repo = store();
    let config = Config {
        processing_timeout: Duration::from_secs(10),
        store_timeout: Duration::from_secs(4),
        ..Config::default()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    // The batch is applied and its reply lost; the re-sends hang, the last
    // one answers after the lease asked for by the batch has ended.
    repo.inject(Operation::ReserveMany, Fault::ApplyThenHang, 1);
    repo.inject(Operation::Reserve, Fault::Hang, 1);
    repo.inject(Operation::Reserve, Fault::Delay(Duration::from_secs(3)), 1);
    let runs = AtomicUsize::new(0);
    let answers = m
        .execute_batch(&[("k", 1u32)], 4, |_, _ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError<String>>(2) }
        })
        .await;
    assert!(
        matches!(
            &answers[0],
            Err(ExecuteError::Idempotency(Error::Timeout { .. }))
        ),
        "{:?}",
        answers[0]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// Under fail-open, a key repeated in one poll whose first occurrence ran
/// unprotected (the store down) is not run again by the later ones, whether
/// the store is still down or back (where a reserve would find no record and
/// acquire it): they are answered `Duplicate`, or `PayloadMismatch` for
/// another payload, without a store call.
#[tokio::test(start_paused = true)]
async fn a_key_run_unprotected_is_not_run_again_in_its_batch() {
    use idempotency_core::OutagePolicy;
    for store_back in [false, true] {
        let repo = store();
        let config = Config {
            on_store_outage: OutagePolicy::FailOpen,
            ..Config::default()
        };
        let m = manager(&repo, config, &TokioClock::starting_now());
        // The first wave's batch call and its re-sends fail; with
        // `store_back`, the store answers again from the second wave on.
        let (many, single) = if store_back { (1, 3) } else { (100, 100) };
        repo.inject(Operation::ReserveMany, Fault::Unavailable, many);
        repo.inject(Operation::Reserve, Fault::Unavailable, single);
        let runs = AtomicUsize::new(0);
        let items = [("m-1", 1u32), ("m-1", 1), ("m-1", 2)];
        let answers = m
            .execute_batch(&items, 8, |i, _ctx| {
                runs.fetch_add(1, Ordering::SeqCst);
                let v = items[i].1;
                async move { Ok::<_, HandlerError<String>>(v * 2) }
            })
            .await;
        assert!(
            matches!(&answers[0], Ok(Outcome::Unprotected(2))),
            "{store_back}: {:?}",
            answers[0]
        );
        assert!(
            matches!(&answers[1], Ok(Outcome::Duplicate)),
            "{store_back}: {:?}",
            answers[1]
        );
        assert!(
            matches!(
                &answers[2],
                Err(ExecuteError::Idempotency(Error::PayloadMismatch { .. }))
            ),
            "{store_back}: {:?}",
            answers[2]
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{store_back}: one run");
        assert_eq!(
            repo.calls(Operation::ReserveMany),
            1,
            "later waves ask nobody"
        );
    }
}

/// A repository that panics while one item's reservation is retried alone (a
/// custom backend's bug) does not unwind through the rest of its group: the
/// other items run and record their outcomes, then the panic continues.
#[tokio::test(start_paused = true)]
async fn a_repository_panic_in_one_items_reservation_spares_the_group() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    // The group's call fails, each item re-sends alone, and the first re-send
    // panics.
    repo.inject(Operation::ReserveMany, Fault::Unavailable, 1);
    repo.inject(Operation::Reserve, Fault::Panic, 1);
    let runs = Arc::new(AtomicUsize::new(0));
    let batch = {
        let (m, runs) = (m.clone(), runs.clone());
        tokio::spawn(async move {
            let items = [("a", 1u32), ("b", 2), ("c", 3)];
            m.execute_batch(&items, 8, |i, _ctx| {
                runs.fetch_add(1, Ordering::SeqCst);
                let v = items[i].1;
                async move {
                    // Paused Tokio time: no real time passes.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Ok::<_, HandlerError<String>>(v * 2)
                }
            })
            .await
        })
    };
    assert!(batch.await.unwrap_err().is_panic(), "the panic continues");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the other two ran");
    let again = double(&m, &[("a", 1), ("b", 2), ("c", 3)], 8).await;
    let seen: Vec<_> = again.iter().map(outcome).collect();
    assert_eq!(
        seen,
        [
            Some(("executed", 2)),
            Some(("cached", 4)),
            Some(("cached", 6))
        ],
        "the others were recorded, the panicked one left free"
    );
}

/// After a batch's reservation call fails, its items are sent again one by
/// one with the single path's pause first, as a single execution's second
/// send is: never at once against a store that has just failed.
#[tokio::test(start_paused = true)]
async fn a_failed_batch_call_is_sent_again_after_a_pause() {
    let repo = store();
    let m = manager(&repo, Config::default(), &TokioClock::starting_now());
    repo.inject(Operation::ReserveMany, Fault::Unavailable, 1);
    let batch = {
        let m = m.clone();
        tokio::spawn(async move { double(&m, &[("a", 1), ("b", 2)], 8).await })
    };
    // Not a fixed wait: the test runs on paused Tokio time, where this sleep
    // lets the batch run until it waits (the failed call answers at once)
    // and the clock then jumps 10 ms, short of the 20 ms back-off.
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(repo.calls(Operation::ReserveMany), 1);
    assert_eq!(repo.calls(Operation::Reserve), 0, "not sent again at once");
    let answers = batch.await.unwrap();
    assert_eq!(repo.calls(Operation::Reserve), 2, "each item once more");
    let seen: Vec<_> = answers.iter().map(outcome).collect();
    assert_eq!(seen, [Some(("executed", 2)), Some(("executed", 4))]);
}
