//! A delivery as the handler sees it, its idempotency key and its attempt.

use std::fmt;
use std::sync::Arc;

use idempotency_core::{Event, KeyStrategy};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use serde::{Serialize, Serializer};

/// The header quorum queues set on a redelivery: how many times the message
/// was delivered before.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// One message of a poll, handed to the handler.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Message {
    /// The idempotency key (empty for a message without one, which is
    /// rejected without reaching the handler).
    pub key: String,
    /// The body.
    pub body: Vec<u8>,
    /// The AMQP properties (headers, `message_id`, content type, …).
    pub properties: BasicProperties,
    /// The exchange it was published to (empty for the default exchange).
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Whether the broker delivered it before (a requeue, or a consumer that
    /// died holding it).
    pub redelivered: bool,
    /// The delivery count, this one included: `x-delivery-count + 1` on quorum
    /// queues, else 2 for a redelivery and 1 otherwise.
    pub attempt: u32,
    /// The delivery tag on the consumer's channel.
    pub delivery_tag: u64,
}

impl Message {
    /// A header's value as text: strings as they are, numbers and booleans
    /// printed; `None` when absent or of another type.
    pub fn header(&self, name: &str) -> Option<String> {
        header_text(self.properties.headers().as_ref(), name)
    }
}

/// A key function over the body and properties; `None` means no key.
pub type CustomKeyFn = Arc<dyn Fn(&[u8], &BasicProperties) -> Option<String> + Send + Sync>;

/// Where a message's idempotency key comes from. A message without one (the
/// header or property missing or empty, the function answering `None`, a
/// body that is not an [`Event`]) is rejected with reason `invalid_key` and
/// never reaches the handler.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum KeySource {
    /// The `message_id` property (default).
    #[default]
    MessageId,
    /// A header, e.g. `x-idempotency-key` (string or number values).
    Header(String),
    /// A function of the body and properties.
    Custom(CustomKeyFn),
    /// The body read as an [`Event`] (JSON), keyed by a [`KeyStrategy`].
    Event(KeyStrategy),
}

impl KeySource {
    /// The key from header `name`.
    pub fn header(name: impl Into<String>) -> Self {
        KeySource::Header(name.into())
    }

    /// The key from a function of the body and properties.
    pub fn custom<F>(f: F) -> Self
    where
        F: Fn(&[u8], &BasicProperties) -> Option<String> + Send + Sync + 'static,
    {
        KeySource::Custom(Arc::new(f))
    }

    /// The key of the body read as an [`Event`], by `strategy`.
    pub fn event(strategy: KeyStrategy) -> Self {
        KeySource::Event(strategy)
    }

    /// The key of one message, or why there is none.
    pub(crate) fn key_of(
        &self,
        body: &[u8],
        properties: &BasicProperties,
    ) -> Result<String, String> {
        let key = match self {
            KeySource::MessageId => properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_owned())
                .ok_or_else(|| "no message_id property".to_owned())?,
            KeySource::Header(name) => header_text(properties.headers().as_ref(), name)
                .ok_or_else(|| format!("no {name} header of a string or number type"))?,
            KeySource::Custom(f) => {
                f(body, properties).ok_or_else(|| "the key function found no key".to_owned())?
            }
            KeySource::Event(strategy) => {
                let event: Event = serde_json::from_slice(body)
                    .map_err(|e| format!("the body is not an event: {e}"))?;
                strategy.key_for(&event).map_err(|e| e.to_string())?
            }
        };
        if key.is_empty() {
            return Err("the key is empty".to_owned());
        }
        Ok(key)
    }
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::MessageId => f.write_str("MessageId"),
            KeySource::Header(name) => f.debug_tuple("Header").field(name).finish(),
            KeySource::Custom(_) => f.write_str("Custom(..)"),
            KeySource::Event(strategy) => f.debug_tuple("Event").field(strategy).finish(),
        }
    }
}

fn header_text(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    let value = headers?.inner().get(name)?;
    match value {
        // A key that is not UTF-8 is no key: a lossy reading would give two
        // keys that differ only in their invalid bytes one record.
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice()).ok().map(str::to_owned),
        other => integer(other).map(|n| n.to_string()),
    }
}

fn integer(value: &AMQPValue) -> Option<i128> {
    Some(match value {
        AMQPValue::ShortShortInt(n) => i128::from(*n),
        AMQPValue::ShortShortUInt(n) => i128::from(*n),
        AMQPValue::ShortInt(n) => i128::from(*n),
        AMQPValue::ShortUInt(n) => i128::from(*n),
        AMQPValue::LongInt(n) => i128::from(*n),
        AMQPValue::LongUInt(n) => i128::from(*n),
        AMQPValue::LongLongInt(n) => i128::from(*n),
        AMQPValue::Timestamp(n) => i128::from(*n),
        _ => return None,
    })
}

/// The delivery count, this one included: `x-delivery-count + 1` (quorum
/// queues count earlier deliveries), else 2 for a redelivery, 1 otherwise.
pub(crate) fn attempt_of(properties: &BasicProperties, redelivered: bool) -> u32 {
    let counted = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(DELIVERY_COUNT_HEADER))
        .and_then(integer)
        .and_then(|n| u32::try_from(n).ok());
    match counted {
        Some(n) => n.saturating_add(1),
        None if redelivered => 2,
        None => 1,
    }
}

/// What the manager fingerprints: the body, as text when it is UTF-8 (JSON
/// bodies fingerprint as their text), else as `{"bytes": "<hex>"}` — an
/// object, so no text body fingerprints like a binary one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Body<'a>(pub(crate) &'a [u8]);

impl Serialize for Body<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        use std::fmt::Write;
        match std::str::from_utf8(self.0) {
            Ok(text) => serializer.serialize_str(text),
            Err(_) => {
                let mut hex = String::with_capacity(self.0.len() * 2);
                for byte in self.0 {
                    let _ = write!(hex, "{byte:02x}");
                }
                let mut map = serializer.serialize_map(Some(1))?;
                map.serialize_entry("bytes", &hex)?;
                map.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use lapin::types::{LongString, ShortString};

    fn with_headers(pairs: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (name, value) in pairs {
            table.insert(ShortString::from(*name), value.clone());
        }
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn attempts_come_from_the_delivery_count_or_the_flag() {
        let none = BasicProperties::default();
        assert_eq!(attempt_of(&none, false), 1);
        assert_eq!(attempt_of(&none, true), 2);
        let counted = with_headers(&[(DELIVERY_COUNT_HEADER, AMQPValue::LongLongInt(3))]);
        assert_eq!(attempt_of(&counted, true), 4);
        let negative = with_headers(&[(DELIVERY_COUNT_HEADER, AMQPValue::LongInt(-1))]);
        assert_eq!(attempt_of(&negative, true), 2);
    }

    #[test]
    fn keys_come_from_the_configured_source() {
        let props = with_headers(&[
            ("x-key", AMQPValue::LongString(LongString::from("k-1"))),
            ("x-num", AMQPValue::LongUInt(42)),
            ("x-empty", AMQPValue::LongString(LongString::from(""))),
            (
                "x-binary",
                AMQPValue::LongString(LongString::from(vec![0xff, 0xfe])),
            ),
        ])
        .with_message_id(ShortString::from("m-1"));
        assert_eq!(KeySource::MessageId.key_of(b"", &props).unwrap(), "m-1");
        assert_eq!(
            KeySource::header("x-key").key_of(b"", &props).unwrap(),
            "k-1"
        );
        assert_eq!(
            KeySource::header("x-num").key_of(b"", &props).unwrap(),
            "42"
        );
        assert!(KeySource::header("x-empty").key_of(b"", &props).is_err());
        // Not UTF-8: no key (a lossy reading would merge distinct keys).
        assert!(KeySource::header("x-binary").key_of(b"", &props).is_err());
        assert!(KeySource::header("x-none").key_of(b"", &props).is_err());
        assert!(KeySource::MessageId
            .key_of(b"", &BasicProperties::default())
            .is_err());
        let custom = KeySource::custom(|body, _| Some(String::from_utf8_lossy(body).into_owned()));
        assert_eq!(custom.key_of(b"abc", &props).unwrap(), "abc");
        let event = KeySource::event(KeyStrategy::EventBased);
        let body = br#"{"event_type":"Charge","event_id":"e-1","payload":{}}"#;
        assert_eq!(event.key_of(body, &props).unwrap(), "Charge:e-1");
        assert!(event.key_of(b"not json", &props).is_err());
    }

    #[test]
    fn bodies_fingerprint_as_text_or_hex() {
        assert_eq!(
            serde_json::to_string(&Body(b"{\"a\":1}")).unwrap(),
            r#""{\"a\":1}""#
        );
        assert_eq!(
            serde_json::to_string(&Body(&[0xff, 0x00])).unwrap(),
            r#"{"bytes":"ff00"}"#
        );
        // A text body never fingerprints like a binary one.
        assert_ne!(
            serde_json::to_string(&Body(b"bytes:ff00")).unwrap(),
            serde_json::to_string(&Body(&[0xff, 0x00])).unwrap()
        );
    }
}
