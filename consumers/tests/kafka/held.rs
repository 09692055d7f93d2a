//! Messages held, and those answered past a held one: read again, the
//! answered ones are not run again; holds are not shorter than 250 ms.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_consumers::kafka::rdkafka::message::OwnedMessage;
use idempotency_consumers::kafka::KafkaConsumer;
use idempotency_core::{ExecutionContext, HandlerError, MemoryRepository};

use crate::support::{backoff, counting, drive, key_of, manager, unique, Broker, Effects};
use crate::{LEASE, LIMIT};

// ---- Messages after a hold that were acknowledged with an outcome the
// store does not hold (`Unrecorded`, `Unprotected`) are read again with the
// held one: the consumer remembers them and does not run them again. ----

fn faulty_consumer(
    broker: &Broker,
    store: &Arc<idempotency_core::testing::FaultyRepository<MemoryRepository>>,
    group: &str,
    topic: &str,
    lease: Duration,
    outage: idempotency_core::OutagePolicy,
) -> KafkaConsumer<idempotency_core::JsonCodec> {
    let config = idempotency_core::Config {
        processing_timeout: lease,
        store_timeout: lease / 4,
        on_store_outage: outage,
        ..idempotency_core::Config::default()
    };
    let manager =
        idempotency_core::IdempotencyManager::new(store.clone(), config).expect("manager");
    KafkaConsumer::builder(manager, broker.client(group))
        .topics([topic])
        .linger(Duration::from_millis(200))
        .backoff(backoff())
        .on_reject(|_| async { Ok(()) })
        .build()
        .expect("consumer")
}

/// `flaky` (offset 0) fails transiently once and holds the partition; `k-2`
/// (offset 1) succeeds but its completion cannot be recorded before its
/// lease ends (`Outcome::Unrecorded`, acknowledged by the policy). The
/// partition is read again from `flaky`, `k-2` with it: its record is still
/// `Processing` (the store would hold it, then let it be taken over and run
/// again), but the consumer remembers it answered and does not run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrecorded_message_answered_past_a_hold_does_not_run_again() {
    use idempotency_core::testing::{Fault, FaultyRepository, Operation};
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    for key in ["flaky", "k-2"] {
        broker.produce(&topic, 0, Some(key), "p", None).await;
    }
    let store = Arc::new(FaultyRepository::new(MemoryRepository::new()));
    store.inject(Operation::CompleteMany, Fault::Unavailable, 10_000);
    store.inject(Operation::Complete, Fault::Unavailable, 10_000);
    let group = unique("group");
    let lease = Duration::from_secs(2);
    let consumer = faulty_consumer(
        &broker,
        &store,
        &group,
        &topic,
        lease,
        idempotency_core::OutagePolicy::FailClosed,
    );
    let effects = Effects::default();
    let handler = |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
        let key = key_of(&message);
        let call = effects.call(&key);
        let result = if key == "flaky" && call == 1 {
            Err(HandlerError::transient("the ledger timed out".to_owned()))
        } else {
            effects.apply(&key);
            Ok(1)
        };
        std::future::ready(result)
    };
    // Until the first poll with `k-2` in it has been answered.
    let tp = (topic.clone(), 0);
    drive(&consumer, &handler, LIMIT, |_, report| report.messages >= 2).await;
    assert_eq!(effects.calls("k-2"), 1);
    store.heal();
    drive(&consumer, &handler, LIMIT, |c, _| c.get(&tp) == Some(&2)).await;
    assert_eq!(
        effects.calls("k-2"),
        1,
        "k-2 was acknowledged (Unrecorded) but its handler ran again"
    );
}

/// Fail-open during an outage: `flaky` runs unprotected and fails
/// transiently (held); `k-2` runs unprotected (`Outcome::Unprotected`,
/// acknowledged). The partition is read again from `flaky`; `k-2`, answered
/// already, does not run unprotected a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unprotected_message_answered_past_a_hold_does_not_run_again() {
    use idempotency_core::testing::FaultyRepository;
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    for key in ["flaky", "k-2"] {
        broker.produce(&topic, 0, Some(key), "p", None).await;
    }
    let store = Arc::new(FaultyRepository::new(MemoryRepository::new()));
    store.set_unavailable(true);
    let group = unique("group");
    let consumer = faulty_consumer(
        &broker,
        &store,
        &group,
        &topic,
        LEASE,
        idempotency_core::OutagePolicy::FailOpen,
    );
    let effects = Effects::default();
    let handler = |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
        let key = key_of(&message);
        let call = effects.call(&key);
        let result = if key == "flaky" && call == 1 {
            Err(HandlerError::transient("the ledger timed out".to_owned()))
        } else {
            effects.apply(&key);
            Ok(1)
        };
        std::future::ready(result)
    };
    let tp = (topic.clone(), 0);
    drive(&consumer, &handler, LIMIT, |c, _| c.get(&tp) == Some(&2)).await;
    assert_eq!(
        effects.calls("k-2"),
        1,
        "k-2 was acknowledged (Unprotected) but its handler ran again"
    );
}

/// A key held elsewhere for long (a slow holder) while this manager's own
/// executions are fast: `retry_after` is about one of them (milliseconds).
/// The partition's hold lasts at least 250 ms (`MIN_HOLD`), so it is read
/// again a dozen times in 3 s, not every few milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_in_progress_key_is_reread_no_faster_than_the_hold_floor() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    broker.produce(&topic, 0, Some("fast"), "p", None).await;
    let store = Arc::new(MemoryRepository::new());
    let holder = manager(&store, LEASE);
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (finish, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let holding = tokio::spawn(async move {
        holder
            .execute("held", "held-payload", || async move {
                started_tx.send(()).unwrap();
                finish_rx.await.unwrap();
                Ok::<u32, HandlerError<String>>(7)
            })
            .await
    });
    started.await.unwrap();
    let group = unique("group");
    // A short linger (the builder accepts any above zero).
    let consumer = KafkaConsumer::builder(manager(&store, LEASE), broker.client(&group))
        .topics([topic.as_str()])
        .linger(Duration::from_millis(10))
        .backoff(backoff())
        .on_reject(|_| async { Ok(()) })
        .build()
        .expect("consumer");
    let effects = Effects::default();
    // A first execution of this manager finishes (a few ms): the hint.
    let tp = (topic.clone(), 0);
    drive(&consumer, counting(&effects), LIMIT, |c, _| {
        c.get(&tp) == Some(&1)
    })
    .await;
    broker
        .produce(&topic, 0, Some("held"), "held-payload", None)
        .await;
    let mut start: Option<Instant> = None;
    let mut rereads = 0u32;
    drive(&consumer, counting(&effects), LIMIT, |_, report| {
        rereads += u32::try_from(report.retried).unwrap();
        if report.retried > 0 && start.is_none() {
            start = Some(Instant::now());
        }
        start.is_some_and(|s| s.elapsed() >= Duration::from_secs(3))
    })
    .await;
    finish.send(()).unwrap();
    holding.await.unwrap().unwrap();
    eprintln!("re-reads of the held message in 3 s: {rereads}");
    // Holds last at least 250 ms: 3 s is at most ~12 re-reads (plus fetches).
    assert!(
        (1..=15).contains(&rereads),
        "the held message was answered InProgress {rereads} times in 3 s"
    );
}

/// An `on_reject` hook that never answers is given up after the
/// `reject_timeout`: the message stays unanswered (its partition held, no
/// commit past it), and the poll returns; read again, the hook is called
/// again and its answer lets the commit pass the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_on_reject_hook_that_hangs_is_timed_out_and_holds_its_message() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    broker.produce(&topic, 0, None, "no key", None).await;
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let seen = calls.clone();
    let consumer = KafkaConsumer::builder(manager(&store, LEASE), broker.client(&group))
        .topics([topic.as_str()])
        .linger(Duration::from_millis(200))
        .backoff(backoff())
        .reject_timeout(Duration::from_millis(300))
        .on_reject(move |_| {
            let first = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
            async move {
                if first {
                    std::future::pending::<()>().await;
                }
                Ok(())
            }
        })
        .build()
        .unwrap();
    let effects = Effects::default();
    let tp = (topic.clone(), 0);
    let mut held = false;
    let driven = drive(&consumer, counting(&effects), LIMIT, |c, report| {
        if report.retried > 0 {
            let past = report.committed.get(&tp).is_some_and(|&o| o > 0);
            assert!(!past, "committed past the unrouted message: {report:?}");
            held = true;
        }
        c.get(&tp) == Some(&1)
    });
    tokio::time::timeout(LIMIT, driven)
        .await
        .expect("a hanging hook hung the consumer");
    assert!(held, "the timed-out hook held the message");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(effects.calls(""), 0);
    assert_eq!(broker.committed(&group, &topic, 1).await, [Some(1)]);
}
