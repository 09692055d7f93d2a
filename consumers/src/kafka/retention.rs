//! How long a topic keeps its messages (`retention.ms`).

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use rdkafka::ClientConfig;

use super::KafkaConsumerError;

/// How long `topic` keeps messages (its `retention.ms`; `None`: forever, `-1`),
/// asked through the admin API of the cluster `client` names
/// (`bootstrap.servers`), for `idempotency doctor` and start-up checks:
/// records must outlive it ([`retention::judge`](crate::retention::judge)).
///
/// # Errors
/// [`KafkaConsumerError::Config`] when the topic does not exist or has no
/// `retention.ms`, or the cluster cannot be asked within `timeout`
/// ([`KafkaConsumerError::Kafka`]).
pub async fn topic_retention(
    client: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<Option<Duration>, KafkaConsumerError> {
    let admin: AdminClient<DefaultClientContext> = client.create()?;
    let options = AdminOptions::new().request_timeout(Some(timeout));
    let described = tokio::time::timeout(
        timeout,
        admin.describe_configs([&ResourceSpecifier::Topic(topic)], &options),
    )
    .await
    .map_err(|_| KafkaError::AdminOpCreation(format!("describe_configs of {topic} timed out")))??;
    let resource = described
        .into_iter()
        .next()
        .ok_or_else(|| KafkaConsumerError::Config(format!("no configuration for topic {topic}")))?
        .map_err(|code| {
            KafkaConsumerError::Config(format!("the configuration of topic {topic}: {code}"))
        })?;
    let value = resource
        .get("retention.ms")
        .and_then(|entry| entry.value.as_deref())
        .ok_or_else(|| KafkaConsumerError::Config(format!("topic {topic} has no retention.ms")))?;
    let millis: i64 = value.trim().parse().map_err(|_| {
        KafkaConsumerError::Config(format!("topic {topic}: retention.ms is `{value}`"))
    })?;
    Ok(u64::try_from(millis).ok().map(Duration::from_millis))
}
