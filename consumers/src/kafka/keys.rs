//! Where a message's idempotency key comes from, and what its fingerprint is
//! computed over.

use std::fmt;
use std::sync::Arc;

use idempotency_core::{Event, KeyStrategy};
use rdkafka::message::{Headers, Message, OwnedMessage};
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

/// A closure deriving a key from a message (`Err` says why there is none).
pub type KeyFn = Arc<dyn Fn(&OwnedMessage) -> Result<String, String> + Send + Sync>;

/// Where a message's idempotency key comes from. A message without one (no
/// such header, no key, a value that is not UTF-8, an empty one) is rejected
/// as `invalid_key`: no redelivery can give it one.
///
/// ```
/// use idempotency_consumers::kafka::KeySource;
/// use idempotency_core::KeyStrategy;
///
/// let _ = KeySource::header("idempotency-key");
/// let _ = KeySource::MessageKey;
/// let _ = KeySource::event(KeyStrategy::EventBased);
/// let _ = KeySource::payload(|message| {
///     use idempotency_consumers::kafka::rdkafka::Message;
///     let payload = message.payload().ok_or("no payload")?;
///     let order: serde_json::Value = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
///     Ok(order["order_id"].to_string())
/// });
/// ```
#[derive(Clone, Default)]
pub enum KeySource {
    /// The message's Kafka key, as UTF-8 (default).
    #[default]
    MessageKey,
    /// The value of the first header of this name, as UTF-8.
    Header(String),
    /// The payload read as an [`Event`] (JSON) and keyed by the strategy.
    Event(KeyStrategy),
    /// A closure over the message.
    Payload(KeyFn),
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::MessageKey => f.write_str("MessageKey"),
            KeySource::Header(name) => f.debug_tuple("Header").field(name).finish(),
            KeySource::Event(strategy) => f.debug_tuple("Event").field(strategy).finish(),
            KeySource::Payload(_) => f.write_str("Payload(..)"),
        }
    }
}

impl KeySource {
    /// The value of the header `name`.
    pub fn header(name: impl Into<String>) -> Self {
        KeySource::Header(name.into())
    }

    /// The payload read as an [`Event`] and keyed by `strategy`.
    pub fn event(strategy: KeyStrategy) -> Self {
        KeySource::Event(strategy)
    }

    /// A closure over the message.
    pub fn payload<F>(f: F) -> Self
    where
        F: Fn(&OwnedMessage) -> Result<String, String> + Send + Sync + 'static,
    {
        KeySource::Payload(Arc::new(f))
    }

    /// The message's key, or why it has none.
    pub(crate) fn key_of(&self, message: &OwnedMessage) -> Result<String, String> {
        let key = match self {
            KeySource::MessageKey => {
                utf8(message.key()).ok_or_else(|| "no UTF-8 message key".to_owned())?
            }
            KeySource::Header(name) => {
                let value = message
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == name).map(|h| h.value));
                utf8(value.flatten()).ok_or_else(|| format!("no UTF-8 header `{name}`"))?
            }
            KeySource::Event(strategy) => {
                let payload = message.payload().ok_or("no payload")?;
                let event: Event = serde_json::from_slice(payload)
                    .map_err(|e| format!("the payload is not an event: {e}"))?;
                strategy.key_for(&event).map_err(|e| e.to_string())?
            }
            KeySource::Payload(f) => f(message)?,
        };
        if key.is_empty() {
            return Err("the key is empty".into());
        }
        Ok(key)
    }
}

fn utf8(bytes: Option<&[u8]>) -> Option<String> {
    bytes
        .and_then(|b| std::str::from_utf8(b).ok())
        .map(str::to_owned)
}

/// What a message's fingerprint is computed over: its payload's bytes (a
/// producer's retry repeats them exactly), as text when they are UTF-8, else
/// as `{"base16": "…"}`; no payload is `null`. Headers and key are not part of
/// it.
#[derive(Debug, Clone)]
pub(crate) struct PayloadBytes(pub(crate) Arc<OwnedMessage>);

impl Serialize for PayloadBytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0.payload() {
            None => serializer.serialize_none(),
            Some(bytes) => match std::str::from_utf8(bytes) {
                Ok(text) => serializer.serialize_str(text),
                Err(_) => {
                    let mut map = serializer.serialize_map(Some(1))?;
                    map.serialize_entry("base16", &base16(bytes))?;
                    map.end()
                }
            },
        }
    }
}

fn base16(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        text.push(char::from(DIGITS[usize::from(b >> 4)]));
        text.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::Timestamp;

    fn message(key: Option<&[u8]>, payload: Option<&[u8]>, header: Option<&str>) -> OwnedMessage {
        let headers = header.map(|value| {
            OwnedHeaders::new().insert(Header {
                key: "idem",
                value: Some(value),
            })
        });
        OwnedMessage::new(
            payload.map(<[u8]>::to_vec),
            key.map(<[u8]>::to_vec),
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            headers,
        )
    }

    #[test]
    fn keys_come_from_the_chosen_source_or_say_why_not() {
        let m = message(
            Some(b"k-1"),
            Some(br#"{"event_type":"E","event_id":"e-1"}"#),
            Some("h-1"),
        );
        assert_eq!(KeySource::MessageKey.key_of(&m).unwrap(), "k-1");
        assert_eq!(KeySource::header("idem").key_of(&m).unwrap(), "h-1");
        assert!(KeySource::header("other").key_of(&m).is_err());
        assert_eq!(
            KeySource::event(KeyStrategy::EventBased)
                .key_of(&m)
                .unwrap(),
            "E:e-1"
        );
        let none = message(None, Some(b"\xff"), Some(""));
        assert!(KeySource::MessageKey.key_of(&none).is_err());
        assert!(KeySource::header("idem").key_of(&none).is_err(), "empty");
        assert!(KeySource::event(KeyStrategy::EventBased)
            .key_of(&none)
            .is_err());
        let closure = KeySource::payload(|m| Ok(format!("p-{}", m.offset())));
        assert_eq!(closure.key_of(&none).unwrap(), "p-0");
    }

    #[test]
    fn payloads_fingerprint_as_text_or_base16() {
        let text = PayloadBytes(Arc::new(message(None, Some(b"hi"), None)));
        assert_eq!(serde_json::to_string(&text).unwrap(), r#""hi""#);
        let bytes = PayloadBytes(Arc::new(message(None, Some(b"\x00\xff"), None)));
        assert_eq!(
            serde_json::to_string(&bytes).unwrap(),
            r#"{"base16":"00ff"}"#
        );
        let none = PayloadBytes(Arc::new(message(None, None, None)));
        assert_eq!(serde_json::to_string(&none).unwrap(), "null");
    }
}
