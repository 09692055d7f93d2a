//! `doctor`'s broker checks: each broker's retention judged against the
//! records' ttl (records must outlive every delivery of their message).

use std::time::Duration;

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idempotency::admin::Check;
use idempotency::consumers::kafka::rdkafka::ClientConfig;
use idempotency::consumers::kafka::topic_retention;
use idempotency::consumers::retention::{judge, CHECK};
use idempotency::consumers::sqs::message_retention;

use crate::exit::Failure;

/// The brokers `doctor` looks at.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct Brokers {
    /// The consumers' record ttl (their `Config::ttl`), judged against each
    /// broker's retention given below: a message the broker still holds after
    /// its record expired runs its handler again.
    #[arg(long, env = "IDEMPOTENCY_TTL", value_parser = crate::parse_timeout)]
    ttl: Option<Duration>,
    /// An SQS queue the consumers read (its URL; repeatable). Credentials and
    /// region from the AWS SDK's default chain (`AWS_REGION`, …).
    #[arg(long = "sqs-queue", value_name = "URL")]
    sqs_queues: Vec<String>,
    /// An SQS-compatible endpoint instead of AWS's (an emulator).
    #[arg(long, env = "IDEMPOTENCY_SQS_ENDPOINT", value_name = "URL")]
    sqs_endpoint: Option<String>,
    /// A Kafka topic the consumers read (repeatable), on `--kafka-brokers`.
    #[arg(long = "kafka-topic", value_name = "TOPIC", requires = "kafka_brokers")]
    kafka_topics: Vec<String>,
    /// The Kafka cluster's bootstrap servers.
    #[arg(long, env = "IDEMPOTENCY_KAFKA_BROKERS", value_name = "HOST:PORT,…")]
    kafka_brokers: Option<String>,
}

impl Brokers {
    fn any(&self) -> bool {
        !self.sqs_queues.is_empty() || !self.kafka_topics.is_empty()
    }
}

/// One check per queue and topic named; none when none is.
///
/// # Errors
/// When brokers are named without `--ttl`.
pub(crate) async fn retention_checks(
    brokers: &Brokers,
    limit: Duration,
) -> Result<Vec<Check>, Failure> {
    if !brokers.any() {
        return Ok(Vec::new());
    }
    let ttl = brokers.ttl.ok_or_else(|| {
        Failure::usage(
            "--sqs-queue and --kafka-topic are judged against the consumers' record ttl: \
             give --ttl (the consumers' ttl) or IDEMPOTENCY_TTL",
        )
    })?;
    let mut checks = Vec::new();
    if !brokers.sqs_queues.is_empty() {
        let client = sqs_client(brokers.sqs_endpoint.as_deref()).await;
        for queue in &brokers.sqs_queues {
            let source = format!("SQS queue {queue}");
            checks.push(match message_retention(&client, queue, limit).await {
                Ok(retention) => judge(&source, ttl, Some(retention)),
                Err(e) => unreadable(&source, &e.to_string()),
            });
        }
    }
    if let Some(servers) = &brokers.kafka_brokers {
        let mut client = ClientConfig::new();
        client.set("bootstrap.servers", servers);
        for topic in &brokers.kafka_topics {
            let source = format!("Kafka topic {topic}");
            checks.push(match topic_retention(&client, topic, limit).await {
                Ok(retention) => judge(&source, ttl, retention),
                Err(e) => unreadable(&source, &e.to_string()),
            });
        }
    }
    Ok(checks)
}

/// A broker `doctor` could not ask: not judged, said so.
fn unreadable(source: &str, error: &str) -> Check {
    Check::warn(
        CHECK,
        format!("{source}: its retention could not be read ({error})"),
        "check the name, the credentials and that the broker answers, or compare its \
         retention with the records' ttl by hand",
    )
}

/// An SQS client: AWS's endpoint and the SDK's default chain, or an
/// emulator's endpoint (region `us-east-1` and dummy keys unless the
/// environment gives them).
async fn sqs_client(endpoint: Option<&str>) -> aws_sdk_sqs::Client {
    let mut loader = aws_config::defaults(BehaviorVersion::latest());
    loader = match endpoint {
        Some(endpoint) => {
            let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".to_owned());
            let mut loader = loader
                .endpoint_url(endpoint)
                .region(Region::new(region))
                .http_client(http_client(endpoint));
            if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
                let dummy = Credentials::new("test", "test", None, None, "idempotency-doctor");
                loader = loader.credentials_provider(dummy);
            }
            loader
        }
        None => loader.http_client(http_client("https:")),
    };
    aws_sdk_sqs::Client::new(&loader.load().await)
}

fn http_client(endpoint: &str) -> aws_sdk_sqs::config::SharedHttpClient {
    use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
    let builder = aws_smithy_http_client::Builder::new();
    if endpoint.starts_with("http:") {
        builder.build_http()
    } else {
        builder
            .tls_provider(Provider::Rustls(CryptoMode::Ring))
            .build_https()
    }
}
