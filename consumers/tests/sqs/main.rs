//! The SQS consumer against a real SQS server (moto, from the harness).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod lambda;
mod run;
mod support;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_consumers::sqs::{SqsConsumer, SqsMessage, SETTLE_FAILURES};
use idempotency_consumers::{Answer, Disposition};
use idempotency_core::{
    Config, Error, ExecuteError, ExecutionContext, HandlerError, MemoryRepository, Outcome,
};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_run_once_and_are_all_deleted() {
    let client = client().await;
    let url = queue(&client, "dup", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = consumer(
        &client,
        &url,
        manager_on(&repo, config(Duration::from_secs(10), None)),
    )
    .await;
    send(&client, &url, "charge 10", Some("order-1")).await;
    send(&client, &url, "charge 10", Some("order-1")).await;
    send(&client, &url, "charge 20", Some("order-2")).await;
    let runs = Arc::new(AtomicU32::new(0));
    let handler = counting(&runs);

    let mut answered = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while answered.len() < 3 && Instant::now() < deadline {
        let report = consumer.poll_once(&handler).await.unwrap();
        assert_eq!(report.settled.deleted, report.messages.len(), "{report:?}");
        answered.extend(report.messages.into_iter().map(|h| h.disposition));
    }
    assert_eq!(answered.len(), 3);
    assert!(answered.iter().all(Disposition::is_ack), "{answered:?}");
    assert_eq!(
        answered
            .iter()
            .filter(|d| **d == Disposition::Ack(Answer::Duplicate))
            .count(),
        1
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The same key again, in a later receive: answered from the record.
    send(&client, &url, "charge 10", Some("order-1")).await;
    let report = poll_until_some(&consumer, &handler, Duration::from_secs(10)).await;
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Duplicate)
    );
    assert!(matches!(&report.messages[0].answer, Ok(Outcome::Cached(body)) if body == "charge 10"));
    assert_eq!(report.settled.deleted, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(counts(&client, &url).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_elsewhere_comes_back_after_retry_after_and_is_answered_once_done() {
    let client = client().await;
    let url = queue(&client, "held", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let manager = manager_on(&repo, config(Duration::from_secs(10), None));
    // One quick execution: the manager's retry_after is then about one
    // typical execution (milliseconds), not the holder's whole lease.
    manager
        .execute("warm-up", &(), || async {
            Ok::<_, HandlerError<String>>(())
        })
        .await
        .unwrap();
    let consumer = consumer(&client, &url, manager).await;

    // Another consumer holds the key until told to finish.
    let holder = manager_on(&repo, config(Duration::from_secs(10), None));
    let release = Arc::new(tokio::sync::Notify::new());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let held = tokio::spawn({
        let release = release.clone();
        async move {
            holder
                .execute("order-7", &"charge 70", || async move {
                    let _ = started_tx.send(());
                    release.notified().await;
                    Ok::<_, HandlerError<String>>("charge 70".to_owned())
                })
                .await
        }
    });
    started_rx.await.unwrap();

    send(&client, &url, "charge 70", Some("order-7")).await;
    let runs = Arc::new(AtomicU32::new(0));
    let handler = counting(&runs);
    let report = poll_until_some(&consumer, &handler, Duration::from_secs(10)).await;
    let retried_at = Instant::now();
    let Disposition::Retry { after, reason } = report.messages[0].disposition else {
        panic!("not retried: {report:?}");
    };
    assert_eq!(reason, "in_progress");
    assert!(after < Duration::from_secs(1), "retry_after {after:?}");
    assert_eq!((report.settled.deleted, report.settled.delayed), (0, 1));
    assert_eq!(
        counts(&client, &url).await,
        (0, 1),
        "kept, invisible for now"
    );

    release.notify_one();
    assert!(matches!(held.await.unwrap(), Ok(Outcome::Executed(_))));
    let report = poll_until_some(&consumer, &handler, Duration::from_secs(10)).await;
    // Visible again after the retry_after rounded up to a whole second.
    assert!(
        retried_at.elapsed() >= Duration::from_millis(900),
        "{:?}",
        retried_at.elapsed()
    );
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Duplicate)
    );
    assert_eq!(report.messages[0].receive_count, 2);
    assert_eq!(report.settled.deleted, 1);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the holder's run answered it"
    );
    assert_eq!(counts(&client, &url).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_retried_after_the_backoff_then_succeeds_once() {
    let client = client().await;
    let url = queue(&client, "transient", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = consumer(
        &client,
        &url,
        manager_on(&repo, config(Duration::from_secs(10), None)),
    )
    .await;
    send(&client, &url, "charge 30", Some("order-3")).await;
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs.clone();
        move |message: SqsMessage, _ctx: ExecutionContext| {
            let run = runs.fetch_add(1, Ordering::SeqCst);
            async move {
                if run == 0 {
                    Err(HandlerError::transient("the bank timed out".to_owned()))
                } else {
                    Ok(message.body)
                }
            }
        }
    };
    let report = poll_until_some(&consumer, &handler, Duration::from_secs(10)).await;
    let failed_at = Instant::now();
    assert!(matches!(
        report.messages[0].disposition,
        Disposition::Retry {
            reason: "handler_retry",
            ..
        }
    ));
    assert_eq!(report.settled.delayed, 1);

    let report = poll_until_some(&consumer, &handler, Duration::from_secs(10)).await;
    assert!(
        failed_at.elapsed() >= Duration::from_millis(900),
        "not in a hot loop"
    );
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Executed)
    );
    assert_eq!(report.messages[0].receive_count, 2);
    assert_eq!(report.settled.deleted, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(counts(&client, &url).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_failure_goes_to_the_dead_letter_queue_with_its_attributes() {
    let client = client().await;
    let url = queue(&client, "perm", 30).await;
    let dlq = queue(&client, "perm-dlq", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = SqsConsumer::builder(
        client.clone(),
        manager_on(&repo, config(Duration::from_secs(10), None)),
        &url,
    )
    .wait_time(Duration::from_secs(1))
    .dead_letter_queue(&dlq)
    .build()
    .await
    .unwrap();
    client
        .send_message()
        .queue_url(&url)
        .message_body("charge -5")
        .message_attributes(KEY, string_attribute("order-5"))
        .message_attributes("trace-id", string_attribute("t-55"))
        .send()
        .await
        .unwrap();
    let handler = |_message: SqsMessage, _ctx: ExecutionContext| async {
        Err::<String, _>(HandlerError::permanent("negative amount".to_owned()))
    };
    let report = poll_until_some(&consumer, handler, Duration::from_secs(10)).await;
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Reject {
            reason: "handler_failed"
        }
    );
    assert_eq!(
        (report.settled.dead_lettered, report.settled.deleted),
        (1, 1)
    );
    assert_eq!(counts(&client, &url).await, (0, 0));

    let received = client
        .receive_message()
        .queue_url(&dlq)
        .message_attribute_names("All")
        .wait_time_seconds(1)
        .send()
        .await
        .unwrap();
    let messages = received.messages();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].body(), Some("charge -5"));
    let attributes = messages[0].message_attributes().unwrap();
    assert_eq!(attributes[KEY].string_value(), Some("order-5"));
    assert_eq!(attributes["trace-id"].string_value(), Some("t-55"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_that_cannot_hold_a_message_for_the_lease_is_refused() {
    let client = client().await;
    let url = queue(&client, "short", 2).await;
    let repo = Arc::new(MemoryRepository::new());
    let refused = SqsConsumer::builder(
        client.clone(),
        manager_on(&repo, config(Duration::from_secs(10), None)),
        &url,
    )
    .build()
    .await
    .unwrap_err();
    assert!(
        matches!(&refused, Error::Config { message } if message.contains("VisibilityTimeout")),
        "{refused}"
    );
    assert!(!refused.is_retryable());

    // With lease extension, the consumer extends the visibility itself.
    let extended = SqsConsumer::builder(
        client.clone(),
        manager_on(
            &repo,
            config(Duration::from_secs(10), Some(Duration::from_secs(3))),
        ),
        &url,
    )
    .build()
    .await
    .unwrap();
    assert_eq!(extended.queue_visibility_timeout(), Duration::from_secs(2));
    assert_eq!(extended.heartbeat_interval(), Some(Duration::from_secs(1)));

    // A queue that does not exist is a configuration error too.
    let missing = SqsConsumer::builder(
        client.clone(),
        manager_on(&repo, config(Duration::from_secs(10), None)),
        format!("{url}-missing"),
    )
    .build()
    .await
    .unwrap_err();
    assert!(matches!(missing, Error::Config { .. }), "{missing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_keeps_a_slow_message_invisible_past_the_queue_timeout() {
    let client = client().await;
    let url = queue(&client, "slow", 2).await;
    let repo = Arc::new(MemoryRepository::new());
    let manager = manager_on(
        &repo,
        config(Duration::from_secs(3), Some(Duration::from_secs(1))),
    );
    let consumer = consumer(&client, &url, manager).await;
    send(&client, &url, "export", Some("export-1")).await;

    let done = AtomicBool::new(false);
    let runs = Arc::new(AtomicU32::new(0));
    let (started, mut handler_started) = tokio::sync::watch::channel(false);
    let slow = {
        let runs = runs.clone();
        move |message: SqsMessage, _ctx: ExecutionContext| {
            runs.fetch_add(1, Ordering::SeqCst);
            let _ = started.send(true);
            async move {
                tokio::time::sleep(Duration::from_millis(4500)).await;
                Ok::<_, HandlerError<String>>(message.body)
            }
        }
    };
    let work = async {
        let report = poll_until_some(&consumer, &slow, Duration::from_secs(10)).await;
        done.store(true, Ordering::SeqCst);
        report
    };
    // A second consumer polls the queue from the moment the handler runs
    // until the poll is answered: it must get nothing.
    let spy = async {
        handler_started.wait_for(|started| *started).await.unwrap();
        let mut stolen = 0;
        while !done.load(Ordering::SeqCst) {
            let received = client
                .receive_message()
                .queue_url(&url)
                .wait_time_seconds(1)
                .send()
                .await
                .unwrap();
            stolen += received.messages().len();
        }
        stolen
    };
    let (report, stolen) = tokio::join!(work, spy);
    assert_eq!(
        stolen, 0,
        "the message was delivered to another consumer meanwhile"
    );
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Executed)
    );
    assert_eq!(report.settled.deleted, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(counts(&client, &url).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_a_key_is_rejected_as_invalid_key() {
    record_metrics();
    let client = client().await;
    let url = queue(&client, "nokey", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = consumer(
        &client,
        &url,
        manager_on(&repo, config(Duration::from_secs(10), None)),
    )
    .await;
    send(&client, &url, "charge 1", None).await;
    let runs = Arc::new(AtomicU32::new(0));
    let report = poll_until_some(&consumer, counting(&runs), Duration::from_secs(10)).await;
    let handled = &report.messages[0];
    assert_eq!(
        handled.disposition,
        Disposition::Reject {
            reason: "invalid_key"
        }
    );
    assert!(handled.key.is_none());
    assert!(
        matches!(&handled.answer, Err(ExecuteError::Idempotency(Error::InvalidKey { reason })) if reason.contains(KEY)),
        "{:?}",
        handled.answer
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let rejected = [
        ("broker", "sqs"),
        ("disposition", "reject"),
        ("reason", "invalid_key"),
    ];
    assert!(counter(idempotency_consumers::metrics::MESSAGES, &rejected) >= 1);
    // No dead-letter queue: left to the redrive policy, visible again later.
    assert_eq!((report.settled.delayed, report.settled.deleted), (1, 0));
    assert_eq!(counts(&client, &url).await, (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delete_is_counted_and_the_redelivery_is_a_duplicate() {
    record_metrics();
    let client = client().await;
    let url = queue(&client, "undeleted", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = consumer(
        &client,
        &url,
        manager_on(&repo, config(Duration::from_secs(10), None)),
    )
    .await;
    send(&client, &url, "charge 40", Some("order-4")).await;
    let runs = Arc::new(AtomicU32::new(0));
    // The queue is purged while the handler runs: the receipt handle is no
    // longer valid, so SQS refuses the delete entry.
    let purging = {
        let (client, url, runs) = (client.clone(), url.clone(), runs.clone());
        move |message: SqsMessage, _ctx: ExecutionContext| {
            let (client, url) = (client.clone(), url.clone());
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                client.purge_queue().queue_url(url).send().await.unwrap();
                Ok::<_, HandlerError<String>>(message.body)
            }
        }
    };
    let report = poll_until_some(&consumer, &purging, Duration::from_secs(10)).await;
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Executed)
    );
    assert_eq!((report.settled.deleted, report.settled.failures), (0, 1));
    assert!(counter(SETTLE_FAILURES, &[("operation", "delete")]) >= 1);

    // The message delivered again (here: sent again) is answered from the
    // record and deleted; the handler does not run twice.
    send(&client, &url, "charge 40", Some("order-4")).await;
    let report = poll_until_some(&consumer, &purging, Duration::from_secs(10)).await;
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Duplicate)
    );
    assert_eq!((report.settled.deleted, report.settled.failures), (1, 0));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A queue that keeps messages longer than the records live is reported when
/// the consumer is built: a message delivered after its record expired would
/// run its handler again. Records that outlive the retention are not.
#[tokio::test]
async fn records_shorter_than_the_queues_retention_are_warned_about() {
    use std::sync::Mutex;
    use tracing_subscriber::fmt::MakeWriter;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Captured {
            self.clone()
        }
    }

    let client = support::client().await;
    let url = support::queue(&client, "retention", 30).await;
    let retention = Duration::from_secs(2 * 3600);
    client
        .set_queue_attributes()
        .queue_url(&url)
        .attributes(
            aws_sdk_sqs::types::QueueAttributeName::MessageRetentionPeriod,
            retention.as_secs().to_string(),
        )
        .send()
        .await
        .unwrap();
    let repo = Arc::new(MemoryRepository::new());
    for (ttl, warned) in [(Duration::from_secs(3600), true), (3 * retention, false)] {
        let captured = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_max_level(tracing::Level::WARN)
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let config = Config {
            ttl,
            ..support::config(Duration::from_secs(10), None)
        };
        support::consumer(&client, &url, support::manager_on(&repo, config)).await;
        let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            log.contains("runs its handler again"),
            warned,
            "ttl {ttl:?}, retention {retention:?}: {log}"
        );
    }
}

/// A key function's retryable failure (`Error::Unavailable`: a lookup service
/// down) is retried, by the same policy as the manager's answers: never
/// dead-lettered as if the message had no key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_functions_retryable_error_is_retried_not_dead_lettered() {
    let client = client().await;
    let url = queue(&client, "keyerr", 30).await;
    let dlq = queue(&client, "keyerr-dlq", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = SqsConsumer::builder(
        client.clone(),
        manager_on(&repo, config(Duration::from_secs(10), None)),
        &url,
    )
    .wait_time(Duration::from_secs(1))
    .dead_letter_queue(&dlq)
    .key(idempotency_consumers::sqs::KeySource::custom(
        |_m: &SqsMessage| {
            Err(Error::Unavailable {
                backend: "key-lookup",
                message: "the order service timed out".into(),
                source: None,
            })
        },
    ))
    .build()
    .await
    .unwrap();
    send(&client, &url, "charge 1", Some("order-1")).await;
    let runs = Arc::new(AtomicU32::new(0));
    let report = poll_until_some(&consumer, counting(&runs), Duration::from_secs(10)).await;
    let handled = &report.messages[0];
    assert!(
        handled.disposition.is_retry(),
        "a transient key error was {:?}; settled {:?}",
        handled.disposition,
        report.settled
    );
    assert!(
        matches!(
            handled.answer,
            Err(ExecuteError::Idempotency(Error::Unavailable { .. }))
        ),
        "{:?}",
        handled.answer
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        (report.settled.deleted, report.settled.dead_lettered),
        (0, 0),
        "{:?}",
        report.settled
    );
}

/// A backoff that starts at zero would make a failed message visible again
/// at once (a hot loop): refused when the consumer is built.
#[tokio::test]
async fn a_zero_backoff_is_refused() {
    let client = client().await;
    let url = queue(&client, "zero-backoff", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    for backoff in [
        idempotency_consumers::Backoff {
            initial: Duration::ZERO,
            max: Duration::from_secs(1),
        },
        idempotency_consumers::Backoff {
            initial: Duration::from_secs(2),
            max: Duration::from_secs(1),
        },
    ] {
        let built = SqsConsumer::builder(
            client.clone(),
            manager_on(&repo, config(Duration::from_secs(10), None)),
            &url,
        )
        .backoff(backoff)
        .build()
        .await;
        assert!(
            matches!(built, Err(Error::Config { .. })),
            "{backoff:?}: {built:?}"
        );
    }
}
