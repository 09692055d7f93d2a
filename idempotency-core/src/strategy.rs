//! Key strategies: how an event's idempotency key is derived.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::Error;

/// An event as brokers deliver it: a type, an id unique per logical event (the
/// producer sets it; redeliveries repeat it), a payload and optional envelope data.
///
/// ```
/// use idempotency_core::Event;
/// let e = Event::new("PaymentRequested", "evt-1", serde_json::json!({"amount": 10}));
/// assert_eq!(e.event_type, "PaymentRequested");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The event's type, e.g. `ProcessPayment`.
    pub event_type: String,
    /// The producer's id of the event.
    pub event_id: String,
    /// The business payload.
    #[serde(default)]
    pub payload: Value,
    /// When the event was produced (ignored by content hashing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// Envelope metadata such as trace ids (ignored by content hashing).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub metadata: Value,
}

impl Event {
    /// An event with no timestamp and no metadata.
    pub fn new(event_type: impl Into<String>, event_id: impl Into<String>, payload: Value) -> Self {
        Event {
            event_type: event_type.into(),
            event_id: event_id.into(),
            payload,
            timestamp: None,
            metadata: Value::Null,
        }
    }
}

/// A custom key function: `event → custom part`; the key is `{event_type}:{custom}`.
pub type CustomKeyFn = Arc<dyn Fn(&Event) -> Result<String, Error> + Send + Sync>;

/// How the idempotency key of an event is derived.
///
/// ```
/// use idempotency_core::{Event, KeyStrategy};
/// use serde_json::json;
///
/// let e = Event::new("Charge", "evt-7", json!({"order": 1, "amount": 10}));
/// assert_eq!(KeyStrategy::EventBased.key_for(&e)?, "Charge:evt-7");
///
/// // The same content under another event id (a producer retry) gets the same key.
/// let retry = Event::new("Charge", "evt-8", json!({"amount": 10, "order": 1}));
/// let hash = KeyStrategy::content_hash();
/// assert_eq!(hash.key_for(&e)?, hash.key_for(&retry)?);
///
/// // Only chosen fields of the payload.
/// let by_order = KeyStrategy::content_hash_of(["order"]);
/// let other_amount = Event::new("Charge", "evt-9", json!({"order": 1, "amount": 99}));
/// assert_eq!(by_order.key_for(&e)?, by_order.key_for(&other_amount)?);
///
/// let custom = KeyStrategy::custom(|e| Ok(e.payload["order"].to_string()));
/// assert_eq!(custom.key_for(&e)?, "Charge:1");
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Clone, Default)]
pub enum KeyStrategy {
    /// `{event_type}:{event_id}` (default).
    #[default]
    EventBased,
    /// `{event_type}:{sha256 hex}` of the canonical JSON of the event without
    /// `event_id`, `timestamp` and `metadata`; with `fields`, of only those
    /// top-level payload fields.
    ContentHash {
        /// The payload fields hashed; `None` hashes the whole event.
        fields: Option<BTreeSet<String>>,
    },
    /// `{event_type}:{f(event)}`.
    Custom(CustomKeyFn),
}

impl fmt::Debug for KeyStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyStrategy::EventBased => f.write_str("EventBased"),
            KeyStrategy::ContentHash { fields } => f
                .debug_struct("ContentHash")
                .field("fields", fields)
                .finish(),
            KeyStrategy::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl KeyStrategy {
    /// Content hash over the whole event (minus id, timestamp, metadata).
    pub fn content_hash() -> Self {
        KeyStrategy::ContentHash { fields: None }
    }

    /// Content hash over the given top-level payload fields only.
    pub fn content_hash_of<I, S>(fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        KeyStrategy::ContentHash {
            fields: Some(fields.into_iter().map(Into::into).collect()),
        }
    }

    /// A custom key function.
    pub fn custom<F>(f: F) -> Self
    where
        F: Fn(&Event) -> Result<String, Error> + Send + Sync + 'static,
    {
        KeyStrategy::Custom(Arc::new(f))
    }

    /// The idempotency key of `event`.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when the event id (event-based) or the custom part is
    /// empty; [`Error::Codec`] when the event cannot be serialized.
    pub fn key_for(&self, event: &Event) -> Result<String, Error> {
        let part = match self {
            KeyStrategy::EventBased => event.event_id.clone(),
            KeyStrategy::ContentHash { fields } => content_hash(event, fields.as_ref())?,
            KeyStrategy::Custom(f) => f(event)?,
        };
        if part.is_empty() {
            return Err(Error::InvalidKey {
                reason: format!("the {self:?} key of a {} event is empty", event.event_type),
            });
        }
        Ok(crate::key::compose_parts(&event.event_type, &part))
    }
}

fn content_hash(event: &Event, fields: Option<&BTreeSet<String>>) -> Result<String, Error> {
    let hashed = match fields {
        None => {
            let mut v =
                serde_json::to_value(event).map_err(|e| Error::Codec { source: e.into() })?;
            if let Value::Object(map) = &mut v {
                for k in ["event_id", "timestamp", "metadata"] {
                    map.remove(k);
                }
            }
            v
        }
        Some(fields) => {
            let mut picked = serde_json::Map::new();
            for f in fields {
                picked.insert(
                    f.clone(),
                    event.payload.get(f).cloned().unwrap_or(Value::Null),
                );
            }
            Value::Object(picked)
        }
    };
    crate::canonical::with_canonical(&hashed, |canonical| hex::encode(Sha256::digest(canonical)))
}

/// The canonical JSON of a value: object keys sorted, no insignificant whitespace.
///
/// ```
/// let s = idempotency_core::canonical_json(&serde_json::json!({"b": [1, {"d": 0, "c": 1}], "a": null}))?;
/// assert_eq!(s, r#"{"a":null,"b":[1,{"c":1,"d":0}]}"#);
/// # Ok::<(), idempotency_core::Error>(())
/// ```
///
/// # Errors
/// [`Error::Codec`] when the value cannot be serialized.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<String, Error> {
    // Byte for byte what going through `serde_json::Value` (whose objects are
    // `BTreeMap`s) gives, without building the tree: see `crate::canonical`.
    let bytes = crate::canonical::to_vec(value)?;
    String::from_utf8(bytes).map_err(|e| Error::Codec { source: e.into() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn content_hash_ignores_envelope_and_key_order() {
        let mut a = Event::new("T", "1", json!({"x": 1, "y": [1, 2]}));
        a.timestamp = Some("2026-01-01T00:00:00Z".into());
        a.metadata = json!({"trace": "abc"});
        let b = Event::new("T", "2", json!({"y": [1, 2], "x": 1}));
        let s = KeyStrategy::content_hash();
        assert_eq!(s.key_for(&a).unwrap(), s.key_for(&b).unwrap());
        let c = Event::new("T", "1", json!({"x": 2, "y": [1, 2]}));
        assert_ne!(s.key_for(&a).unwrap(), s.key_for(&c).unwrap());
        // The event type is part of the key.
        let d = Event::new("U", "1", json!({"x": 1, "y": [1, 2]}));
        assert_ne!(s.key_for(&a).unwrap(), s.key_for(&d).unwrap());
    }

    #[test]
    fn empty_parts_are_rejected() {
        let e = Event::new("T", "", json!({}));
        assert!(matches!(
            KeyStrategy::EventBased.key_for(&e),
            Err(Error::InvalidKey { .. })
        ));
        let custom = KeyStrategy::custom(|_| Ok(String::new()));
        assert!(custom.key_for(&e).is_err());
    }

    #[test]
    fn missing_fields_hash_as_null() {
        let s = KeyStrategy::content_hash_of(["a"]);
        let with_null = Event::new("T", "1", json!({"a": null}));
        let without = Event::new("T", "1", json!({}));
        assert_eq!(s.key_for(&with_null).unwrap(), s.key_for(&without).unwrap());
    }
}
