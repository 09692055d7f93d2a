//! The SQS consumer against a real SQS server (moto, from the harness).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use aws_sdk_sqs::Client;
use idempotency_conformance::containers;
use idempotency_consumers::sqs::lambda::{handle_event, LambdaOptions, SqsEvent};
use idempotency_consumers::sqs::{KeySource, PollReport, SqsConsumer, SqsMessage};
use idempotency_consumers::{Answer, Backoff, Disposition};
use idempotency_core::{
    Config, Error, ExecuteError, ExecutionContext, HandlerError, IdempotencyManager,
    MemoryRepository, Outcome,
};

const KEY: &str = "idempotency-key";

async fn client() -> Client {
    let server = containers::sqs()
        .await
        .expect("an SQS server for the tests");
    let credentials = Credentials::new(
        server.access_key_id(),
        server.secret_access_key(),
        None,
        None,
        "tests",
    );
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(server.region().to_owned()))
        .endpoint_url(server.endpoint())
        .credentials_provider(credentials)
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Client::from_conf(config)
}

/// A fresh queue with this visibility timeout (seconds); its URL.
async fn queue(client: &Client, prefix: &str, visibility: u32) -> String {
    let server = containers::sqs().await.unwrap();
    client
        .create_queue()
        .queue_name(server.unique_queue_name(prefix))
        .attributes(
            QueueAttributeName::VisibilityTimeout,
            visibility.to_string(),
        )
        .send()
        .await
        .expect("CreateQueue")
        .queue_url()
        .expect("a queue URL")
        .to_owned()
}

fn string_attribute(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .unwrap()
}

async fn send(client: &Client, url: &str, body: &str, key: Option<&str>) {
    let mut request = client.send_message().queue_url(url).message_body(body);
    if let Some(key) = key {
        request = request.message_attributes(KEY, string_attribute(key));
    }
    request.send().await.expect("SendMessage");
}

/// Messages in the queue: (visible, in flight).
async fn counts(client: &Client, url: &str) -> (u64, u64) {
    let output = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .expect("GetQueueAttributes");
    let attributes = output.attributes().cloned().unwrap_or_default();
    let count = |name| {
        attributes
            .get(&name)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (
        count(QueueAttributeName::ApproximateNumberOfMessages),
        count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    )
}

fn config(processing: Duration, extension: Option<Duration>) -> Config {
    Config {
        processing_timeout: processing,
        store_timeout: Duration::from_millis(500),
        lease_extension_interval: extension,
        ..Config::default()
    }
}

fn manager_on(repo: &Arc<MemoryRepository>, config: Config) -> IdempotencyManager {
    IdempotencyManager::new(repo.clone(), config).unwrap()
}

fn fast_backoff() -> Backoff {
    Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(100),
    }
}

async fn consumer(client: &Client, url: &str, manager: IdempotencyManager) -> SqsConsumer {
    SqsConsumer::builder(client.clone(), manager, url)
        .wait_time(Duration::from_secs(1))
        .backoff(fast_backoff())
        .build()
        .await
        .expect("a consumer")
}

/// A handler counting its runs, answering the body.
fn counting(
    runs: &Arc<AtomicU32>,
) -> impl Fn(SqsMessage, ExecutionContext) -> std::future::Ready<Result<String, HandlerError<String>>>
{
    let runs = runs.clone();
    move |message, _ctx| {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(message.body))
    }
}

/// Polls until a poll answers at least one message (bounded).
async fn poll_until_some<F, Fut>(
    consumer: &SqsConsumer,
    handler: F,
    within: Duration,
) -> PollReport<String, String>
where
    F: Fn(SqsMessage, ExecutionContext) -> Fut,
    Fut: std::future::Future<Output = Result<String, HandlerError<String>>>,
{
    let deadline = Instant::now() + within;
    loop {
        let report = consumer.poll_once(&handler).await.expect("a receive");
        if !report.messages.is_empty() {
            return report;
        }
        assert!(Instant::now() < deadline, "no message within {within:?}");
    }
}

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
    // No dead-letter queue: left to the redrive policy, visible again later.
    assert_eq!((report.settled.delayed, report.settled.deleted), (1, 0));
    assert_eq!(counts(&client, &url).await, (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_finishes_the_poll_under_way_when_shut_down() {
    let client = client().await;
    let url = queue(&client, "run", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = consumer(
        &client,
        &url,
        manager_on(&repo, config(Duration::from_secs(10), None)),
    )
    .await;
    for i in 0..3 {
        send(
            &client,
            &url,
            &format!("charge {i}"),
            Some(&format!("order-{i}")),
        )
        .await;
    }
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs.clone();
        move |message: SqsMessage, _ctx: ExecutionContext| {
            // Asked to stop from inside the first poll's handlers.
            let _ = stop.send(true);
            runs.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, HandlerError<String>>(message.body) }
        }
    };
    let shutdown = async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let stats = tokio::time::timeout(Duration::from_secs(20), consumer.run(shutdown, handler))
        .await
        .expect("run stops when told to");
    assert!(stats.polls >= 1);
    assert_eq!(stats.deleted, stats.messages, "{stats:?}");
    assert_eq!(u64::from(runs.load(Ordering::SeqCst)), stats.messages);
    let (visible, in_flight) = counts(&client, &url).await;
    assert_eq!(in_flight, 0, "every received message was settled");
    assert_eq!(visible + stats.messages, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_messages_are_keyed_by_their_deduplication_id() {
    let client = client().await;
    let server = containers::sqs().await.unwrap();
    let url = client
        .create_queue()
        .queue_name(format!("{}.fifo", server.unique_queue_name("fifo")))
        .attributes(QueueAttributeName::FifoQueue, "true")
        .attributes(QueueAttributeName::VisibilityTimeout, "30")
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_owned();
    let repo = Arc::new(MemoryRepository::new());
    let consumer = SqsConsumer::builder(
        client.clone(),
        manager_on(&repo, config(Duration::from_secs(10), None)),
        &url,
    )
    .key(KeySource::DeduplicationId)
    .wait_time(Duration::from_secs(1))
    .build()
    .await
    .unwrap();
    client
        .send_message()
        .queue_url(&url)
        .message_body("ship 1")
        .message_group_id("order-1")
        .message_deduplication_id("ship-order-1")
        .send()
        .await
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let report = poll_until_some(&consumer, counting(&runs), Duration::from_secs(10)).await;
    assert_eq!(report.messages[0].key.as_deref(), Some("ship-order-1"));
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Executed)
    );
    assert_eq!(report.settled.deleted, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn lambda_reports_every_message_not_acknowledged() {
    let repo = Arc::new(MemoryRepository::new());
    let manager = manager_on(&repo, config(Duration::from_secs(10), None));
    // order-9 is held by another attempt.
    let holder = manager_on(&repo, config(Duration::from_secs(10), None));
    let release = Arc::new(tokio::sync::Notify::new());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let held = tokio::spawn({
        let release = release.clone();
        async move {
            holder
                .execute("order-9", &"9", || async move {
                    let _ = started_tx.send(());
                    release.notified().await;
                    Ok::<_, HandlerError<String>>("9".to_owned())
                })
                .await
        }
    });
    started_rx.await.unwrap();

    let record = |id: &str, body: &str, key: Option<&str>| {
        let attributes = key.map_or_else(HashMap::new, |k| {
            HashMap::from([(
                KEY,
                serde_json::json!({"stringValue": k, "dataType": "String"}),
            )])
        });
        serde_json::json!({
            "messageId": id, "body": body, "messageAttributes": attributes,
            "attributes": {"ApproximateReceiveCount": "1"}, "eventSource": "aws:sqs",
        })
    };
    let event: SqsEvent = serde_json::from_value(serde_json::json!({"Records": [
        record("ok", "1", Some("order-1")),
        record("dup", "1", Some("order-1")),
        record("perm", "-1", Some("order-2")),
        record("flaky", "flaky", Some("order-3")),
        record("nokey", "4", None),
        record("held", "9", Some("order-9")),
    ]}))
    .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs.clone();
        move |message: SqsMessage, _ctx: ExecutionContext| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                match message.body.as_str() {
                    "-1" => Err(HandlerError::permanent("negative".to_owned())),
                    "flaky" => Err(HandlerError::transient("timeout".to_owned())),
                    _ => Ok(message.body),
                }
            }
        }
    };
    let response = handle_event(&manager, &LambdaOptions::default(), &event, handler).await;
    assert_eq!(
        serde_json::to_value(&response).unwrap(),
        serde_json::json!({"batchItemFailures": [
            {"itemIdentifier": "perm"},
            {"itemIdentifier": "flaky"},
            {"itemIdentifier": "nokey"},
            {"itemIdentifier": "held"},
        ]})
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "ok, perm, flaky; not dup, nokey, held"
    );
    release.notify_one();
    held.await.unwrap().unwrap();
}
