//! The local answer cache (`Config::answer_cache`): duplicates of completed
//! keys answered with no store call, never past the record's expiry or the
//! staleness bound, and never for a record that may still change.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::future::Future;
use std::time::Duration;

use common::{manager, store, Store};
use idempotency_core::testing::{Operation, TokioClock};
use idempotency_core::{
    AnswerCacheConfig, Config, Error, ExecuteError, FailurePolicy, HandlerError,
    IdempotencyManager, Outcome, Repository,
};

const STALENESS: Duration = Duration::from_secs(10);

fn cached_config() -> Config {
    Config {
        ttl: Duration::from_secs(600),
        processing_timeout: Duration::from_secs(60),
        answer_cache: Some(AnswerCacheConfig {
            max_bytes: 1 << 20,
            max_staleness: STALENESS,
        }),
        ..Config::default()
    }
}

async fn run(m: &IdempotencyManager, key: &str, payload: u32) -> Result<Outcome<u32>, Error> {
    m.execute(key, &payload, || async move {
        Ok::<_, HandlerError<String>>(payload * 10)
    })
    .await
    .map_err(|e| match e {
        ExecuteError::Idempotency(e) => e,
        ExecuteError::Handler(h) => panic!("handler error {h}"),
    })
}

fn reserves(repo: &Store) -> usize {
    repo.calls(Operation::Reserve)
}

#[tokio::test(start_paused = true)]
async fn a_duplicate_of_our_own_completion_costs_no_store_call() {
    let repo = store();
    let m = manager(&repo, cached_config(), &TokioClock::starting_now());
    assert!(matches!(
        run(&m, "k", 1).await.unwrap(),
        Outcome::Executed(10)
    ));
    let calls = reserves(&repo);
    for _ in 0..5 {
        assert!(matches!(
            run(&m, "k", 1).await.unwrap(),
            Outcome::Cached(10)
        ));
    }
    assert_eq!(reserves(&repo), calls, "answered in-process");
    // The same decision the store would give: another payload is refused.
    assert!(matches!(
        run(&m, "k", 2).await,
        Err(Error::PayloadMismatch { .. })
    ));
    assert_eq!(reserves(&repo), calls);
    let stats = m.answer_cache_stats().unwrap();
    assert_eq!((stats.hits, stats.misses), (6, 1));
    // Scopes share the cache, but not their keys.
    let scoped = m.scoped("other").unwrap();
    assert!(matches!(
        run(&scoped, "k", 1).await.unwrap(),
        Outcome::Executed(10)
    ));
}

#[tokio::test(start_paused = true)]
async fn another_consumers_completion_is_cached_after_one_read() {
    let repo = store();
    let clock = TokioClock::starting_now();
    let other = manager(&repo, Config::default(), &clock);
    run(&other, "k", 1).await.unwrap();
    let m = manager(&repo, cached_config(), &clock);
    let before = reserves(&repo);
    for _ in 0..3 {
        assert!(matches!(
            run(&m, "k", 1).await.unwrap(),
            Outcome::Cached(10)
        ));
    }
    assert_eq!(reserves(&repo), before + 1, "one read, then in-process");
}

#[tokio::test(start_paused = true)]
async fn completions_without_a_result_answer_duplicate() {
    let repo = store();
    let config = Config {
        cache_results: false,
        ..cached_config()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    run(&m, "k", 1).await.unwrap();
    let calls = reserves(&repo);
    assert!(matches!(run(&m, "k", 1).await.unwrap(), Outcome::Duplicate));
    assert_eq!(reserves(&repo), calls);
}

#[tokio::test(start_paused = true)]
async fn an_entry_never_outlives_its_record() {
    let repo = store();
    let config = Config {
        clock_skew: Duration::from_secs(2),
        answer_cache: Some(AnswerCacheConfig {
            max_bytes: 1 << 20,
            max_staleness: Duration::from_secs(3600),
        }),
        ..cached_config()
    };
    let ttl = config.ttl;
    let m = manager(&repo, config, &TokioClock::starting_now());
    run(&m, "k", 1).await.unwrap();
    // Served until the record's expiry less the skew allowance …
    tokio::time::advance(ttl - Duration::from_secs(3)).await;
    let calls = reserves(&repo);
    assert!(matches!(
        run(&m, "k", 1).await.unwrap(),
        Outcome::Cached(10)
    ));
    assert_eq!(reserves(&repo), calls);
    // … and from then on the store decides (here: the record expired, so the
    // delivery runs again).
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(matches!(
        run(&m, "k", 1).await.unwrap(),
        Outcome::Cached(10)
    ));
    assert_eq!(reserves(&repo), calls + 1, "asked the store");
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(matches!(
        run(&m, "k", 1).await.unwrap(),
        Outcome::Executed(10)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_deleted_record_is_answered_at_most_the_staleness_bound() {
    let repo = store();
    let m = manager(&repo, cached_config(), &TokioClock::starting_now());
    run(&m, "k", 1).await.unwrap();
    // An operator evicts the record.
    assert!(repo.delete(&m.record_key("k").unwrap()).await.unwrap());
    tokio::time::advance(STALENESS - Duration::from_millis(1)).await;
    assert!(matches!(
        run(&m, "k", 1).await.unwrap(),
        Outcome::Cached(10)
    ));
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(
        matches!(run(&m, "k", 1).await.unwrap(), Outcome::Executed(10)),
        "past the bound the store decides"
    );
}

#[tokio::test(start_paused = true)]
async fn processing_and_failed_records_are_never_cached() {
    let repo = store();
    let config = Config {
        failure_policy: FailurePolicy::Store,
        ..cached_config()
    };
    let m = manager(&repo, config, &TokioClock::starting_now());
    // Failed: every duplicate asks the store.
    let failed = m
        .execute("f", &0u32, || async {
            Err::<u32, _>(HandlerError::new("card declined".to_owned()))
        })
        .await;
    assert!(matches!(failed, Err(ExecuteError::Handler(_))));
    for expected in 1..=2 {
        let calls = reserves(&repo);
        assert!(matches!(
            run(&m, "f", 0).await,
            Err(Error::PreviouslyFailed { .. })
        ));
        assert_eq!(
            reserves(&repo),
            calls + 1,
            "duplicate {expected} asked the store"
        );
    }
    // Processing: duplicates get InProgress from the store each time.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute("p", &0u32, || async move {
                started_tx.send(()).unwrap();
                finish_rx.await.unwrap();
                Ok::<_, HandlerError<String>>(7u32)
            })
            .await
        })
    };
    started_rx.await.unwrap();
    for _ in 0..2 {
        let calls = reserves(&repo);
        assert!(matches!(
            run(&m, "p", 0).await,
            Err(Error::InProgress { .. })
        ));
        assert_eq!(reserves(&repo), calls + 1);
    }
    finish_tx.send(()).unwrap();
    assert!(matches!(
        holder.await.unwrap().unwrap(),
        Outcome::Executed(7)
    ));
    let calls = reserves(&repo);
    assert!(matches!(run(&m, "p", 0).await.unwrap(), Outcome::Cached(7)));
    assert_eq!(reserves(&repo), calls, "completed: now cached");
}

#[tokio::test(start_paused = true)]
async fn hits_and_misses_are_counted_as_metrics() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let repo = store();
    let m = manager(&repo, cached_config(), &TokioClock::starting_now());
    // The local recorder is installed only around the synchronous polls.
    let fut = async {
        for _ in 0..4 {
            run(&m, "k", 1).await.unwrap();
        }
    };
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| metrics::with_local_recorder(&recorder, || fut.as_mut().poll(cx)))
        .await;
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
        counters.get("idempotency_answer_cache_hits"),
        Some(&3),
        "{counters:?}"
    );
    assert_eq!(counters.get("idempotency_answer_cache_misses"), Some(&1));
}

#[tokio::test(start_paused = true)]
async fn without_the_option_every_duplicate_asks_the_store() {
    let repo = store();
    let m = manager(
        &repo,
        Config {
            answer_cache: None,
            ..cached_config()
        },
        &TokioClock::starting_now(),
    );
    run(&m, "k", 1).await.unwrap();
    let calls = reserves(&repo);
    run(&m, "k", 1).await.unwrap();
    assert_eq!(reserves(&repo), calls + 1);
    assert!(m.answer_cache_stats().is_none());
}

#[tokio::test(start_paused = true)]
async fn a_result_the_store_refused_is_not_replayed_from_memory() {
    let repo = std::sync::Arc::new(common::SmallerThanDeclared(
        idempotency_core::MemoryRepository::new(),
    ));
    let m = IdempotencyManager::with_parts(
        repo,
        cached_config(),
        std::sync::Arc::new(TokioClock::starting_now()),
        idempotency_core::JsonCodec,
    )
    .unwrap();
    let big = "a result longer than eight bytes".to_owned();
    let first = m
        .execute("k", &(), || async {
            Ok::<_, HandlerError<String>>(big.clone())
        })
        .await
        .unwrap();
    assert!(matches!(first, Outcome::Executed(_)));
    // The store kept the completion without its result: so does the cache.
    let again = m
        .execute("k", &(), || async {
            Ok::<_, HandlerError<String>>(String::new())
        })
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Duplicate), "{again:?}");
}

/// An own completion is served from the cache only until the expiry the store
/// was asked for: a manager clock stepped back between the handler's return
/// and the completion that was applied (a retried write) gives the record an
/// earlier expiry than the handler's return would, and the cache keeps to it
/// (with a staleness bound that does not cut it shorter).
#[tokio::test(start_paused = true)]
async fn an_own_completion_is_cached_until_the_expiry_the_store_was_asked_for() {
    use idempotency_core::testing::Fault;
    use idempotency_core::{JsonCodec, ManualClock, SharedRepository};
    use std::sync::Arc;
    let repo = store();
    let clock = Arc::new(ManualClock::starting_now());
    let config = Config {
        ttl: Duration::from_secs(60),
        processing_timeout: Duration::from_secs(30),
        answer_cache: Some(AnswerCacheConfig {
            max_bytes: 1 << 20,
            max_staleness: Duration::from_secs(3600),
        }),
        ..Config::default()
    };
    let m = IdempotencyManager::with_parts(
        repo.clone() as SharedRepository,
        config,
        clock.clone(),
        JsonCodec,
    )
    .unwrap();
    // The first completion is refused; while its retry waits, the clock
    // steps back 10 s: the applied write asks for an expiry 50 s after the
    // handler returned.
    repo.inject(Operation::Complete, Fault::Unavailable, 1);
    let start = clock.now();
    let stepping = async {
        common::eventually(async || repo.calls(Operation::Complete) >= 1).await;
        clock.set(start - Duration::from_secs(10));
    };
    let (first, ()) = tokio::join!(run(&m, "k", 1), stepping);
    assert!(matches!(first.unwrap(), Outcome::Executed(10)));
    // 55 s after the handler returned: the record expired 5 s ago.
    clock.set(start + Duration::from_secs(55));
    let reserves_before = reserves(&repo);
    assert!(
        matches!(run(&m, "k", 1).await.unwrap(), Outcome::Executed(10)),
        "the expired record runs again, not answered from the cache"
    );
    assert_eq!(reserves(&repo), reserves_before + 1, "asked of the store");
}
