//! The Kafka consumer against a broker speaking the Kafka protocol:
//! librdkafka's mock cluster by default, a real cluster with
//! `IDEMPOTENCY_TEST_KAFKA_BROKERS` (see `kafka/support.rs`). Every test has
//! its own topics and groups.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "kafka/support.rs"]
mod support;

#[path = "kafka/abandoned.rs"]
mod abandoned;
#[path = "kafka/held.rs"]
mod held;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_consumers::kafka::rdkafka::consumer::Consumer;
use idempotency_consumers::kafka::rdkafka::message::{Headers, OwnedMessage};
use idempotency_consumers::kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use idempotency_consumers::kafka::rdkafka::Message;
use idempotency_consumers::kafka::{headers, KafkaConsumer, KafkaConsumerError, KeySource};
use idempotency_core::{ExecutionContext, HandlerError, MemoryRepository};
use parking_lot::Mutex;
use support::{backoff, counting, drive, key_of, manager, unique, Broker, Effects};

const LEASE: Duration = Duration::from_secs(10);
const LIMIT: Duration = Duration::from_secs(25);

fn consumer(
    broker: &Broker,
    store: &Arc<MemoryRepository>,
    group: &str,
    topic: &str,
) -> KafkaConsumer<idempotency_core::JsonCodec> {
    KafkaConsumer::builder(manager(store, LEASE), broker.client(group))
        .topics([topic])
        .linger(Duration::from_millis(200))
        .backoff(backoff())
        .on_reject(|_| async { Ok(()) })
        .build()
        .expect("consumer")
}

#[tokio::test]
async fn a_duplicate_runs_the_handler_once_and_is_committed_past() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    for key in ["a", "b", "a"] {
        broker.produce(&topic, 0, Some(key), "same", None).await;
    }
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let consumer = consumer(&broker, &store, &group, &topic);
    let effects = Effects::default();
    let tp = (topic.clone(), 0);
    drive(&consumer, counting(&effects), LIMIT, |c, _| {
        c.get(&tp) == Some(&3)
    })
    .await;
    assert_eq!(effects.calls("a"), 1);
    assert_eq!(effects.calls("b"), 1);
    assert_eq!(broker.committed(&group, &topic, 1).await, [Some(3)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_holds_its_partition_until_its_holder_completes() {
    let broker = Broker::start();
    let topic = broker.topic(2).await;
    broker.produce(&topic, 0, Some("free-1"), "p", None).await;
    broker
        .produce(&topic, 0, Some("held"), "held-payload", None)
        .await;
    broker.produce(&topic, 0, Some("free-2"), "p", None).await;
    broker.produce(&topic, 1, Some("other-1"), "p", None).await;
    broker.produce(&topic, 1, Some("other-2"), "p", None).await;
    let store = Arc::new(MemoryRepository::new());

    // Another consumer holds `held` until told to finish.
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
    let consumer = consumer(&broker, &store, &group, &topic);
    let effects = Effects::default();
    let (p0, p1) = ((topic.clone(), 0), (topic.clone(), 1));
    // The other partition goes on; this one stops right before `held`.
    let mut held_reports = 0;
    drive(&consumer, counting(&effects), LIMIT, |c, report| {
        held_reports += usize::from(report.held > 0);
        c.get(&p1) == Some(&2) && c.get(&p0) == Some(&1) && held_reports >= 3
    })
    .await;
    assert_eq!(
        broker.committed(&group, &topic, 2).await,
        [Some(1), Some(2)]
    );
    assert_eq!(
        effects.calls("free-2"),
        1,
        "ran once, the re-reads are duplicates"
    );

    finish.send(()).unwrap();
    assert!(holding.await.unwrap().is_ok());
    drive(&consumer, counting(&effects), LIMIT, |c, _| {
        c.get(&p0) == Some(&3)
    })
    .await;
    assert_eq!(
        broker.committed(&group, &topic, 2).await,
        [Some(3), Some(2)]
    );
    assert_eq!(
        effects.calls("held"),
        0,
        "answered from the holder's outcome"
    );
    assert_eq!(effects.calls("free-2"), 1);
}

#[tokio::test]
async fn a_transient_failure_is_retried_after_the_backoff_then_committed() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    for key in ["k-1", "flaky", "k-3"] {
        broker.produce(&topic, 0, Some(key), "p", None).await;
    }
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let consumer = consumer(&broker, &store, &group, &topic);
    let effects = Effects::default();
    let calls_at: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let handler = |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
        let key = key_of(&message);
        let call = effects.call(&key);
        if key == "flaky" {
            calls_at.lock().push(Instant::now());
        }
        let result = if key == "flaky" && call == 1 {
            Err(HandlerError::transient("the ledger timed out".to_owned()))
        } else {
            effects.apply(&key);
            Ok(1)
        };
        std::future::ready(result)
    };
    let tp = (topic.clone(), 0);
    drive(&consumer, handler, LIMIT, |c, _| c.get(&tp) == Some(&3)).await;
    let calls = calls_at.lock().clone();
    assert_eq!(calls.len(), 2, "failed once, then ran again");
    assert!(
        calls[1] - calls[0] >= backoff().delay(1),
        "retried after {:?}",
        calls[1] - calls[0]
    );
    assert_eq!(effects.calls("k-3"), 1, "re-read, not run again");
    assert_eq!(effects.applied().values().sum::<u32>(), 3);
    assert_eq!(broker.committed(&group, &topic, 1).await, [Some(3)]);
}

#[tokio::test]
async fn a_reject_goes_to_the_dead_letter_topic_and_is_committed_past() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    let dead = broker.topic(1).await;
    // `flaky` fails once: its partition is read again from it, rejects
    // included, and they are not routed twice.
    broker
        .produce(&topic, 0, Some("k-1"), "p", Some(("id", "i-1")))
        .await;
    broker
        .produce(&topic, 0, Some("flaky"), "p", Some(("id", "i-f")))
        .await;
    broker.produce(&topic, 0, Some("no-id"), "p", None).await;
    broker
        .produce(&topic, 0, Some("k-3"), "bad", Some(("id", "i-3")))
        .await;
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let hooked: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let seen = hooked.clone();
    let consumer = KafkaConsumer::builder(manager(&store, LEASE), broker.client(&group))
        .topics([topic.as_str()])
        .key(KeySource::header("id"))
        .linger(Duration::from_millis(200))
        .backoff(backoff())
        .dead_letter_topic(&dead, None)
        .on_reject(move |rejected| {
            seen.lock().push(rejected.reason);
            async { Ok(()) }
        })
        .build()
        .unwrap();
    let effects = Effects::default();
    let handler = |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
        let bad = message.payload() == Some(b"bad".as_slice());
        let call = effects.call(&key_of(&message));
        std::future::ready(if bad {
            Err(HandlerError::permanent("no such account".to_owned()))
        } else if key_of(&message) == "flaky" && call == 1 {
            Err(HandlerError::transient("try again".to_owned()))
        } else {
            Ok(1)
        })
    };
    let tp = (topic.clone(), 0);
    drive(&consumer, handler, LIMIT, |c, _| c.get(&tp) == Some(&4)).await;
    assert_eq!(broker.committed(&group, &topic, 1).await, [Some(4)]);
    assert_eq!(effects.calls("flaky"), 2);
    assert_eq!(
        effects.calls("k-3"),
        1,
        "a stored failure is answered from the store"
    );
    let mut reasons = hooked.lock().clone();
    reasons.sort_unstable();
    assert_eq!(reasons, ["handler_failed", "invalid_key"]);

    let letters = broker.read(&dead, 2).await;
    let header = |m: &OwnedMessage, name: &str| {
        let headers = m.headers().unwrap();
        let value = headers
            .iter()
            .find(|h| h.key == name)
            .unwrap()
            .value
            .unwrap();
        String::from_utf8(value.to_vec()).unwrap()
    };
    let mut found: Vec<(String, String, String)> = letters
        .iter()
        .map(|m| {
            (
                key_of(m),
                header(m, headers::REASON),
                header(m, headers::SOURCE),
            )
        })
        .collect();
    found.sort();
    assert_eq!(
        found,
        [
            (
                "k-3".into(),
                "handler_failed".into(),
                format!("{topic}/0/3")
            ),
            ("no-id".into(), "invalid_key".into(), format!("{topic}/0/2")),
        ]
    );
    assert_eq!(
        broker.high_watermark(&dead).await,
        2,
        "each reject routed once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dropped_before_committing_leaves_its_messages_to_the_next_one() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    let keys = ["k-0", "k-1", "k-2", "stuck", "k-4"];
    for key in keys {
        broker.produce(&topic, 0, Some(key), "p", None).await;
    }
    // A short lease: the dropped consumer's hold on `stuck` ends soon.
    let store = Arc::new(MemoryRepository::new());
    let lease = Duration::from_secs(2);
    let group = unique("group");
    let effects = Effects::default();
    let first = KafkaConsumer::builder(manager(&store, lease), broker.client(&group))
        .topics([topic.as_str()])
        .linger(Duration::from_millis(300))
        .backoff(backoff())
        .on_reject(|_| async { Ok(()) })
        .build()
        .unwrap();
    let stuck_handler = |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
        let key = key_of(&message);
        effects.call(&key);
        let effects = effects.clone();
        async move {
            if key == "stuck" {
                std::future::pending::<()>().await;
            }
            effects.apply(&key);
            Ok::<u32, HandlerError<String>>(1)
        }
    };
    // Poll until the batch is running with its effects applied but `stuck`
    // hanging, then drop the poll and the consumer: nothing is committed.
    let deadline = Instant::now() + LIMIT;
    while effects.applied().len() < 4 {
        assert!(Instant::now() < deadline, "the batch never ran");
        let poll = first.poll_once(&stuck_handler);
        tokio::select! {
            report = poll => { report.unwrap(); }
            () = async {
                while effects.applied().len() < 4 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            } => {}
        }
    }
    drop(first);
    // Nothing at or past `stuck` (offset 3) is committed.
    let [committed] = broker.committed(&group, &topic, 1).await[..] else {
        panic!("one partition")
    };
    assert!(committed.is_none_or(|c| c <= 3), "{committed:?}");

    let second = KafkaConsumer::builder(manager(&store, lease), broker.client(&group))
        .topics([topic.as_str()])
        .linger(Duration::from_millis(200))
        .backoff(backoff())
        .on_reject(|_| async { Ok(()) })
        .build()
        .unwrap();
    let tp = (topic.clone(), 0);
    drive(&second, counting(&effects), LIMIT, |c, _| {
        c.get(&tp) == Some(&5)
    })
    .await;
    let applied = effects.applied();
    assert_eq!(applied.len(), keys.len(), "{applied:?}");
    assert!(
        applied.values().all(|&n| n == 1),
        "each effect once: {applied:?}"
    );
    assert_eq!(broker.committed(&group, &topic, 1).await, [Some(5)]);
}

#[tokio::test]
async fn a_revocation_commits_what_is_answered() {
    let broker = Broker::start();
    let topic = broker.topic(2).await;
    for partition in 0..2 {
        for i in 0..3 {
            let key = format!("p{partition}-{i}");
            broker
                .produce(&topic, partition, Some(&key), "p", None)
                .await;
        }
    }
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let consumer = consumer(&broker, &store, &group, &topic);
    let effects = Effects::default();
    // On the mock, the commits after each batch fail (a permanent error the
    // client does not retry), so the answered offsets are still pending when
    // the partitions are revoked.
    let failing = [RDKafkaRespErr::RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE; 64];
    if let Some(mock) = broker.mock() {
        mock.request_errors(RDKafkaApiKey::OffsetCommit, &failing);
    }
    let mut answered = 0;
    let mut failed = false;
    drive(&consumer, counting(&effects), LIMIT, |_, report| {
        answered += report.acked;
        failed |= matches!(report.commit_error, Some(KafkaConsumerError::Kafka(_)));
        answered == 6
    })
    .await;
    if let Some(mock) = broker.mock() {
        assert!(failed, "the injected commit errors failed the commits");
        assert_eq!(broker.committed(&group, &topic, 2).await, [None, None]);
        mock.clear_request_errors(RDKafkaApiKey::OffsetCommit);
    }
    // Leaving the group revokes both partitions; the revocation commits.
    consumer.inner().unsubscribe();
    let report = consumer.poll_once(counting(&effects)).await.unwrap();
    assert!(
        report.committed.is_empty(),
        "committed by the revocation, not the poll: {report:?}"
    );
    assert_eq!(
        broker.committed(&group, &topic, 2).await,
        [Some(3), Some(3)]
    );
    assert!(effects.applied().values().all(|&n| n == 1));
}

#[tokio::test]
async fn run_stops_on_shutdown_after_committing_the_batch_in_hand() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    for i in 0..4 {
        broker
            .produce(&topic, 0, Some(&format!("k-{i}")), "p", None)
            .await;
    }
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let consumer = consumer(&broker, &store, &group, &topic);
    let effects = Effects::default();
    // The first handler asks for the shutdown: the batch it is part of still
    // finishes and is committed before `run` returns.
    let stop = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (effects, stop) = (effects.clone(), stop.clone());
        move |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
            let key = key_of(&message);
            effects.call(&key);
            effects.apply(&key);
            stop.notify_one();
            std::future::ready(Ok::<u32, HandlerError<String>>(1))
        }
    };
    let run = consumer.run(handler, stop.notified());
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("run stopped")
        .unwrap();
    let answered = effects.applied().len();
    assert!(answered >= 1);
    let committed = broker.committed(&group, &topic, 1).await;
    assert_eq!(committed, [Some(i64::try_from(answered).unwrap())]);
}

#[tokio::test]
async fn an_inconsistent_configuration_fails_to_build() {
    let store = Arc::new(MemoryRepository::new());
    let mut client = idempotency_consumers::kafka::rdkafka::ClientConfig::new();
    client
        .set("bootstrap.servers", "localhost:1")
        .set("group.id", "g");
    let build = |client: &idempotency_consumers::kafka::rdkafka::ClientConfig| {
        KafkaConsumer::builder(manager(&store, LEASE), client.clone())
            .topics(["t"])
            .on_reject(|_| async { Ok(()) })
    };
    let built = build(&client).build().unwrap();
    // `run` and `poll_once` can be spawned.
    fn spawnable<F: std::future::Future + Send>(_: F) {}
    spawnable(built.run(counting(&Effects::default()), async {}));
    spawnable(built.poll_once(counting(&Effects::default())));
    let no_route = KafkaConsumer::builder(manager(&store, LEASE), client.clone()).topics(["t"]);
    let cases = [
        build(&client).topics(Vec::<String>::new()).build(),
        build(&client).batch_size(0).build(),
        build(&client).linger(Duration::ZERO).build(),
        build(client.clone().set("enable.auto.commit", "true")).build(),
        build(client.clone().set("max.poll.interval.ms", "1000")).build(),
        // 10 groups of one key, one after another: up to ten leases.
        build(client.clone().set("max.poll.interval.ms", "60000"))
            .batch_size(10)
            .concurrency(1)
            .build(),
        build(&client).reject_timeout(Duration::ZERO).build(),
        build(client.clone().set("group.id", "")).build(),
        no_route.build(),
    ];
    // Six groups of a 10 s lease fit in a minute.
    build(client.clone().set("max.poll.interval.ms", "60000"))
        .batch_size(6)
        .concurrency(1)
        .build()
        .expect("six leases fit");
    for case in cases {
        let error = case.expect_err("inconsistent");
        assert!(matches!(error, KafkaConsumerError::Config(_)), "{error}");
        assert!(!error.is_retryable());
    }
}

/// A topic's retention, as `doctor` reads it to judge it against the
/// records' ttl. librdkafka's mock cluster does not answer `DescribeConfigs`:
/// there the call must end within its timeout with a typed, retryable error
/// (never hang); a real cluster (`IDEMPOTENCY_TEST_KAFKA_BROKERS`) answers
/// with the topic's `retention.ms`, and a topic that does not exist is a
/// configuration error.
#[tokio::test]
async fn a_topics_retention_is_read_through_the_admin_api() {
    use idempotency_consumers::kafka::topic_retention;
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    let client = broker.client(&unique("doctor"));
    let timeout = Duration::from_secs(2);
    let started = Instant::now();
    let answer = topic_retention(&client, &topic, timeout).await;
    assert!(
        started.elapsed() < timeout + Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    if broker.mock().is_some() {
        let error = answer.expect_err("the mock cluster does not implement DescribeConfigs");
        assert!(error.is_retryable(), "{error:?}");
        return;
    }
    let retention = answer.expect("the topic's retention");
    // The broker's default (7 days) unless the topic sets one; `None` is forever.
    assert!(
        retention.is_none_or(|r| r >= Duration::from_secs(3600)),
        "{retention:?}"
    );
    let missing = topic_retention(&client, &unique("no-such-topic"), timeout).await;
    assert!(
        matches!(missing, Err(KafkaConsumerError::Config(_))),
        "{missing:?}"
    );
}
