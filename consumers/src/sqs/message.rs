//! One received message as handlers see it, and where its idempotency key
//! comes from.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use aws_sdk_sqs::types::{Message, MessageAttributeValue, MessageSystemAttributeName};
use idempotency_core::{Error, Event, KeyStrategy};

/// One SQS message of a poll (or of a Lambda event), as the handler gets it.
#[derive(Debug, Clone)]
pub struct SqsMessage {
    /// SQS's id of the message.
    pub message_id: String,
    /// The body (also what the payload fingerprint is computed over).
    pub body: String,
    /// The message attributes with a string value (`String` and `Number`
    /// types, custom subtypes included), by name.
    pub attributes: HashMap<String, String>,
    /// How many times SQS delivered it, this time included
    /// (`ApproximateReceiveCount`; 1 when SQS did not say).
    pub receive_count: u32,
    /// `MessageDeduplicationId` (FIFO queues).
    pub deduplication_id: Option<String>,
    /// `MessageGroupId` (FIFO queues).
    pub group_id: Option<String>,
    /// The receipt handle (none for a Lambda record).
    pub(crate) receipt_handle: Option<String>,
    /// The attributes as SQS gave them, forwarded to the dead-letter queue.
    pub(crate) raw_attributes: HashMap<String, MessageAttributeValue>,
}

impl SqsMessage {
    /// Whether SQS delivered it before (`receive_count > 1`).
    pub fn redelivered(&self) -> bool {
        self.receive_count > 1
    }

    /// The receipt handle of this delivery (`None` for a Lambda record).
    pub fn receipt_handle(&self) -> Option<&str> {
        self.receipt_handle.as_deref()
    }

    /// A message of a `ReceiveMessage` answer.
    pub(crate) fn from_sdk(message: &Message) -> SqsMessage {
        let system = message.attributes();
        let system = |name: MessageSystemAttributeName| system.and_then(|a| a.get(&name)).cloned();
        let raw_attributes = message.message_attributes().cloned().unwrap_or_default();
        let attributes = raw_attributes
            .iter()
            .filter_map(|(name, value)| Some((name.clone(), value.string_value()?.to_owned())))
            .collect();
        SqsMessage {
            message_id: message.message_id().unwrap_or_default().to_owned(),
            body: message.body().unwrap_or_default().to_owned(),
            attributes,
            receive_count: parse_count(
                system(MessageSystemAttributeName::ApproximateReceiveCount).as_deref(),
            ),
            deduplication_id: system(MessageSystemAttributeName::MessageDeduplicationId),
            group_id: system(MessageSystemAttributeName::MessageGroupId),
            receipt_handle: message.receipt_handle().map(str::to_owned),
            raw_attributes,
        }
    }
}

/// `ApproximateReceiveCount` as a number, at least 1.
pub(crate) fn parse_count(value: Option<&str>) -> u32 {
    value
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(1)
        .max(1)
}

/// A key function over a whole message.
pub type KeyFn = Arc<dyn Fn(&SqsMessage) -> Result<String, Error> + Send + Sync>;

/// Where a message's idempotency key comes from.
///
/// A message whose key cannot be found (no such attribute, no deduplication
/// id, a body that does not parse, an empty key) is answered
/// [`Reject`](crate::Disposition::Reject) with reason `invalid_key` and an
/// [`Error::InvalidKey`] saying why; its handler does not run.
///
/// ```
/// use idempotency_consumers::sqs::KeySource;
/// use idempotency_core::KeyStrategy;
///
/// let by_attribute = KeySource::attribute("idempotency-key");
/// let fifo = KeySource::DeduplicationId;
/// let by_event = KeySource::event(KeyStrategy::EventBased); // body = an `Event` in JSON
/// let by_body = KeySource::body(|body| Ok(body.split(':').next().unwrap_or("").to_owned()));
/// # let _ = (by_attribute, fifo, by_event, by_body);
/// ```
#[derive(Clone)]
pub enum KeySource {
    /// A message attribute's string value (the default is
    /// `idempotency-key`).
    Attribute(String),
    /// The message's `MessageDeduplicationId` (FIFO queues).
    DeduplicationId,
    /// The body parsed as an [`Event`] (JSON), keyed by a [`KeyStrategy`].
    Event(KeyStrategy),
    /// A function of the message (body and attributes).
    Custom(KeyFn),
}

impl Default for KeySource {
    fn default() -> Self {
        KeySource::Attribute(DEFAULT_KEY_ATTRIBUTE.to_owned())
    }
}

/// The attribute [`KeySource::default`] reads.
pub const DEFAULT_KEY_ATTRIBUTE: &str = "idempotency-key";

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Attribute(name) => f.debug_tuple("Attribute").field(name).finish(),
            KeySource::DeduplicationId => f.write_str("DeduplicationId"),
            KeySource::Event(strategy) => f.debug_tuple("Event").field(strategy).finish(),
            KeySource::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl KeySource {
    /// The key is the string value of the message attribute `name`.
    pub fn attribute(name: impl Into<String>) -> Self {
        KeySource::Attribute(name.into())
    }

    /// The body parsed as an [`Event`], keyed by `strategy`.
    pub fn event(strategy: KeyStrategy) -> Self {
        KeySource::Event(strategy)
    }

    /// The key is `f(body)`.
    pub fn body<F>(f: F) -> Self
    where
        F: Fn(&str) -> Result<String, Error> + Send + Sync + 'static,
    {
        KeySource::Custom(Arc::new(move |message: &SqsMessage| f(&message.body)))
    }

    /// The key is `f(message)`.
    pub fn custom<F>(f: F) -> Self
    where
        F: Fn(&SqsMessage) -> Result<String, Error> + Send + Sync + 'static,
    {
        KeySource::Custom(Arc::new(f))
    }

    /// The idempotency key of `message`.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when the message has none (or an empty one).
    pub fn key_of(&self, message: &SqsMessage) -> Result<String, Error> {
        let invalid = |reason: String| Error::InvalidKey { reason };
        let key = match self {
            KeySource::Attribute(name) => {
                message.attributes.get(name).cloned().ok_or_else(|| {
                    invalid(format!(
                        "message {} has no string attribute {name:?}",
                        message.message_id
                    ))
                })?
            }
            KeySource::DeduplicationId => message.deduplication_id.clone().ok_or_else(|| {
                invalid(format!(
                    "message {} has no MessageDeduplicationId (not from a FIFO queue?)",
                    message.message_id
                ))
            })?,
            KeySource::Event(strategy) => {
                let event: Event = serde_json::from_str(&message.body).map_err(|e| {
                    invalid(format!(
                        "the body of message {} is not an event: {e}",
                        message.message_id
                    ))
                })?;
                strategy.key_for(&event)?
            }
            KeySource::Custom(f) => f(message)?,
        };
        if key.is_empty() {
            return Err(invalid(format!(
                "the {self:?} key of message {} is empty",
                message.message_id
            )));
        }
        Ok(key)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn message(body: &str, attributes: &[(&str, &str)]) -> SqsMessage {
        SqsMessage {
            message_id: "m-1".into(),
            body: body.into(),
            attributes: attributes
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            receive_count: 1,
            deduplication_id: None,
            group_id: None,
            receipt_handle: None,
            raw_attributes: HashMap::new(),
        }
    }

    #[test]
    fn keys_come_from_where_they_are_told() {
        let m = message(
            r#"{"event_type":"Charge","event_id":"e-1"}"#,
            &[("k", "order-1"), ("empty", "")],
        );
        assert_eq!(KeySource::attribute("k").key_of(&m).unwrap(), "order-1");
        assert_eq!(
            KeySource::event(KeyStrategy::EventBased)
                .key_of(&m)
                .unwrap(),
            "Charge:e-1"
        );
        let body = KeySource::body(|b| Ok(b.len().to_string()));
        assert_eq!(body.key_of(&m).unwrap(), m.body.len().to_string());
        for source in [
            KeySource::attribute("missing"),
            KeySource::attribute("empty"),
            KeySource::DeduplicationId,
        ] {
            assert!(matches!(source.key_of(&m), Err(Error::InvalidKey { .. })));
        }
        let not_an_event = message("plain text", &[]);
        assert!(matches!(
            KeySource::event(KeyStrategy::EventBased).key_of(&not_an_event),
            Err(Error::InvalidKey { .. })
        ));
    }

    #[test]
    fn receive_counts_are_at_least_one() {
        assert_eq!(parse_count(Some("3")), 3);
        assert_eq!(parse_count(Some("0")), 1);
        assert_eq!(parse_count(Some("x")), 1);
        assert_eq!(parse_count(None), 1);
    }
}
