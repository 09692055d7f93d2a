//! Clients, queues, managers and polling helpers of the SQS tests.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use aws_sdk_sqs::Client;
use idempotency_conformance::containers;
use idempotency_consumers::sqs::{PollReport, SqsConsumer, SqsMessage};
use idempotency_consumers::Backoff;
use idempotency_core::{
    Config, ExecutionContext, HandlerError, IdempotencyManager, MemoryRepository,
};

pub(crate) const KEY: &str = "idempotency-key";

pub(crate) async fn client() -> Client {
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
pub(crate) async fn queue(client: &Client, prefix: &str, visibility: u32) -> String {
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

pub(crate) fn string_attribute(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .unwrap()
}

pub(crate) async fn send(client: &Client, url: &str, body: &str, key: Option<&str>) {
    let mut request = client.send_message().queue_url(url).message_body(body);
    if let Some(key) = key {
        request = request.message_attributes(KEY, string_attribute(key));
    }
    request.send().await.expect("SendMessage");
}

/// Messages in the queue: (visible, in flight).
pub(crate) async fn counts(client: &Client, url: &str) -> (u64, u64) {
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

pub(crate) fn config(processing: Duration, extension: Option<Duration>) -> Config {
    Config {
        processing_timeout: processing,
        store_timeout: Duration::from_millis(500),
        lease_extension_interval: extension,
        ..Config::default()
    }
}

pub(crate) fn manager_on(repo: &Arc<MemoryRepository>, config: Config) -> IdempotencyManager {
    IdempotencyManager::new(repo.clone(), config).unwrap()
}

pub(crate) fn fast_backoff() -> Backoff {
    Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(100),
    }
}

pub(crate) async fn consumer(
    client: &Client,
    url: &str,
    manager: IdempotencyManager,
) -> SqsConsumer {
    SqsConsumer::builder(client.clone(), manager, url)
        .wait_time(Duration::from_secs(1))
        .backoff(fast_backoff())
        .build()
        .await
        .expect("a consumer")
}

/// A handler counting its runs, answering the body.
pub(crate) fn counting(
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
pub(crate) async fn poll_until_some<F, Fut>(
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

/// The process's metrics recorder (installed once for this test binary).
fn snapshotter() -> &'static metrics_util::debugging::Snapshotter {
    static SNAPSHOTTER: std::sync::OnceLock<metrics_util::debugging::Snapshotter> =
        std::sync::OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("no other metrics recorder");
        snapshotter
    })
}

/// Starts recording metrics (call before the counted work).
pub(crate) fn record_metrics() {
    snapshotter();
}

/// The sum of the counter `name` over the series with all these labels.
pub(crate) fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            let key = key.key();
            key.name() == name
                && labels
                    .iter()
                    .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
        })
        .map(|(.., value)| match value {
            metrics_util::debugging::DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}
