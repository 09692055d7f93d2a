//! What each message gets: duplicates, keys held elsewhere, transient and
//! permanent failures, missing keys, header keys, metrics.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_runs_the_handler_once_and_both_are_acked() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-1"), "charge 10").await;
    broker.publish(&queue, Some("order-1"), "charge 10").await;
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let running = spawn(
        consumer(manager(), &queue, &log).build().unwrap(),
        &broker.url,
        runs.clone(),
    )
    .await;

    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    let answers: Vec<Disposition> = seen.iter().map(|s| s.disposition).collect();
    assert_eq!(
        answers,
        [
            Disposition::Ack(Answer::Executed),
            Disposition::Ack(Answer::Duplicate)
        ]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        broker.ready(&queue).await,
        0,
        "both acked, none requeued at shutdown"
    );
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_elsewhere_comes_back_no_sooner_than_retry_after() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let repo: SharedRepository = Arc::new(MemoryRepository::new());
    // Another consumer holds the key, its lease kept alive, until released.
    let mut holder_config = Config {
        processing_timeout: Duration::from_millis(1500),
        store_timeout: Duration::from_millis(300),
        ttl: Duration::from_secs(120),
        ..Config::default()
    };
    holder_config.lease_extension_interval = Some(Duration::from_millis(300));
    let holder = IdempotencyManager::new(repo.clone(), holder_config).unwrap();
    let release = Arc::new(Notify::new());
    let started = Arc::new(Notify::new());
    let holding = {
        let (release, started) = (release.clone(), started.clone());
        tokio::spawn(async move {
            holder
                .execute("order-7", "charge 70", || async move {
                    started.notify_one();
                    release.notified().await;
                    Ok::<_, HandlerError<String>>(9usize)
                })
                .await
        })
    };
    started.notified().await;
    broker.publish(&queue, Some("order-7"), "charge 70").await;

    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager_on(repo, Duration::from_secs(10)), &queue, &log);
    let running = spawn(consumer.build().unwrap(), &broker.url, runs.clone()).await;
    let first = answers(&log, 1).await.remove(0);
    let Disposition::Retry { after, reason } = first.disposition else {
        panic!("a held key is retried, not {first:?}");
    };
    assert_eq!(reason, "in_progress");
    assert!(
        after > Duration::ZERO && after <= Duration::from_millis(1500),
        "{after:?}"
    );
    // The held delivery does not stop the consumer: another message is
    // answered meanwhile.
    broker.publish(&queue, Some("order-7b"), "charge 71").await;
    let other = wait_for(&log, |s| s.key == "order-7b").await;
    assert_eq!(other.disposition, Disposition::Ack(Answer::Executed));
    assert!(
        other.at.duration_since(first.at) < after,
        "answered {:?} after the hold began, not within its {after:?}",
        other.at.duration_since(first.at)
    );
    release.notify_one();
    assert!(holding.await.unwrap().unwrap().handler_ran());

    wait_for(&log, |s| s.key == "order-7" && s.disposition.is_ack()).await;
    running.stop().await.unwrap();
    let seen: Vec<Seen> = log
        .lock()
        .iter()
        .filter(|s| s.key == "order-7")
        .cloned()
        .collect();
    let second = seen.last().unwrap();
    assert!(second.redelivered, "{second:?}");
    assert!(
        second.at.duration_since(first.at) >= after,
        "redelivered after {:?}, sooner than {after:?}",
        second.at.duration_since(first.at)
    );
    // A still-live holder may have been seen more than once; the last answer
    // is the recorded one.
    assert!(
        seen[..seen.len() - 1]
            .iter()
            .all(|s| s.disposition.is_retry()),
        "{seen:?}"
    );
    assert_eq!(second.disposition, Disposition::Ack(Answer::Duplicate));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "order-7 ran in the holder only"
    );
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_retried_after_the_backoff_then_acked() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-2"), "charge 20").await;
    let log = Log::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let running = spawn_with(
        consumer(manager(), &queue, &log).build().unwrap(),
        &broker.url,
        move |_| {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(HandlerError::transient(
                    "payment gateway timed out".to_owned(),
                ));
            }
            Ok(())
        },
    )
    .await;

    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    assert_eq!(
        seen[0].disposition,
        Disposition::Retry {
            after: Duration::from_millis(300),
            reason: "handler_retry"
        }
    );
    assert_eq!(seen[1].disposition, Disposition::Ack(Answer::Executed));
    assert!(seen[1].redelivered);
    assert!(seen[1].at.duration_since(seen[0].at) >= Duration::from_millis(300));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_count_attempts_and_the_backoff_grows() {
    let broker = Broker::start().await;
    let queue = containers::unique_namespace("quorum");
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    broker
        .channel
        .queue_declare(queue.as_str().into(), durable, arguments)
        .await
        .unwrap();
    broker.publish(&queue, Some("order-9"), "charge 90").await;
    let log = Log::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let running = spawn_with(consumer, &broker.url, move |_| {
        if counted.fetch_add(1, Ordering::SeqCst) < 2 {
            return Err(HandlerError::transient("not yet".to_owned()));
        }
        Ok(())
    })
    .await;

    let seen = answers(&log, 3).await;
    running.stop().await.unwrap();
    let attempts: Vec<u32> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [1, 2, 3], "x-delivery-count + 1: {seen:?}");
    let retry = |ms| Disposition::Retry {
        after: Duration::from_millis(ms),
        reason: "handler_retry",
    };
    assert_eq!(seen[0].disposition, retry(300));
    assert_eq!(seen[1].disposition, retry(600));
    assert_eq!(seen[2].disposition, Disposition::Ack(Answer::Executed));
    assert!(seen[2].at.duration_since(seen[1].at) >= Duration::from_millis(600));
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_failure_is_dead_lettered() {
    let broker = Broker::start().await;
    let (queue, dlx) = broker.queue(true).await;
    let (exchange, dead) = dlx.unwrap();
    broker.publish(&queue, Some("order-3"), "charge -1").await;
    let log = Log::default();
    let consumer = consumer(manager(), &queue, &log).dead_letter_exchange(&exchange);
    let running = spawn_with(consumer.build().unwrap(), &broker.url, |_| {
        Err(HandlerError::permanent("negative amount".to_owned()))
    })
    .await;

    let dead_letter = take_one(&broker, &dead).await;
    running.stop().await.unwrap();
    assert_eq!(dead_letter.delivery.data, b"charge -1");
    let death = dead_letter.delivery.properties.headers().as_ref().unwrap();
    assert!(death.contains_key("x-death"), "{death:?}");
    let seen = log.lock().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].disposition,
        Disposition::Reject {
            reason: "handler_failed"
        }
    );
    assert_eq!(broker.ready(&queue).await, 0);
    for q in [&queue, &dead] {
        broker.delete(q).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_a_key_is_rejected_without_running() {
    let broker = Broker::start().await;
    let (queue, dlx) = broker.queue(true).await;
    let (exchange, dead) = dlx.unwrap();
    broker.publish(&queue, None, "no id").await;
    broker.publish(&queue, Some("order-4"), "with id").await;
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager(), &queue, &log).dead_letter_exchange(&exchange);
    let running = spawn(consumer.build().unwrap(), &broker.url, runs.clone()).await;

    let dead_letter = take_one(&broker, &dead).await;
    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    assert_eq!(dead_letter.delivery.data, b"no id");
    let keyless = seen.iter().find(|s| s.key.is_empty()).unwrap();
    assert_eq!(
        keyless.disposition,
        Disposition::Reject {
            reason: "invalid_key"
        }
    );
    let keyed = seen.iter().find(|s| s.key == "order-4").unwrap();
    assert_eq!(keyed.disposition, Disposition::Ack(Answer::Executed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the keyed message ran");
    for q in [&queue, &dead] {
        broker.delete(q).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispositions_and_redeliveries_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, None, "no id").await;
    broker.publish(&queue, Some("order-10"), "charge 100").await;
    let log = Log::default();
    let calls = AtomicUsize::new(0);
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let connection = connect(&broker.url).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(
        &connection,
        |message, _ctx| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    return Err(HandlerError::transient("once".to_owned()));
                }
                Ok(message.body.len())
            }
        },
        async {
            let _ = stopped.await;
        },
    );
    // The recorder is installed around the consumer's polls only.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut run = std::pin::pin!(run);
    let counted = std::future::poll_fn(|cx| {
        metrics::with_local_recorder(&recorder, || run.as_mut().poll(cx))
    });
    let (ended, ()) = tokio::join!(counted, async {
        answers(&log, 3).await;
        drop(stop);
    });
    ended.unwrap();

    let counters: Vec<(String, Vec<String>, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => Some((
                key.key().name().to_owned(),
                key.key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect(),
                n,
            )),
            _ => None,
        })
        .collect();
    let count = |name: &str, labels: &[&str]| {
        counters
            .iter()
            .filter(|(n, l, _)| n == name && labels.iter().all(|x| l.iter().any(|y| y == x)))
            .map(|(_, _, v)| v)
            .sum::<u64>()
    };
    let messages = idempotency_consumers::metrics::MESSAGES;
    let rabbit = "broker=rabbitmq";
    assert_eq!(
        count(messages, &[rabbit, "reason=invalid_key"]),
        1,
        "{counters:?}"
    );
    assert_eq!(count(messages, &[rabbit, "reason=handler_retry"]), 1);
    assert_eq!(
        count(messages, &[rabbit, "disposition=ack", "reason=executed"]),
        1
    );
    let redelivered = idempotency_consumers::metrics::REDELIVERED;
    assert_eq!(count(redelivered, &[rabbit]), 1, "{counters:?}");
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_come_from_a_header_when_configured() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let mut headers = FieldTable::default();
    headers.insert(
        "x-idempotency-key".into(),
        AMQPValue::LongString("h-1".into()),
    );
    for _ in 0..2 {
        let properties = BasicProperties::default().with_headers(headers.clone());
        broker
            .channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                b"x",
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager(), &queue, &log).keys(KeySource::header("x-idempotency-key"));
    let running = spawn(consumer.build().unwrap(), &broker.url, runs.clone()).await;
    let seen = answers(&log, 2).await;
    running.stop().await.unwrap();
    assert!(
        seen.iter()
            .all(|s| s.key == "h-1" && s.disposition.is_ack()),
        "{seen:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    broker.delete(&queue).await;
}
