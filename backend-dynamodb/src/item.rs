//! The item format: attribute names and the record ⇄ item conversion.

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use idempotency_core::{Error, Fingerprint, OwnerToken, Record, RecordKey, Status, Timestamp};

/// A DynamoDB item as the SDK represents it.
pub(crate) type Item = HashMap<String, AttributeValue>;

/// The largest item this backend writes, in bytes.
///
/// DynamoDB documents "400 KB" per item (attribute names plus values); the
/// service accepts up to 409,600 bytes, emulators differ (moto stops at 405,000).
/// The decimal reading is safe everywhere and costs at most 2.3 % of the space.
pub(crate) const ITEM_LIMIT_BYTES: usize = 400_000;

/// DynamoDB's limit on a partition key value, in bytes.
pub(crate) const MAX_PARTITION_KEY_BYTES: usize = 2048;

/// The longest id this backend declares: the partition key is
/// `escaped(namespace) ":" id`, and an escaped namespace is at most
/// `3 × MAX_NAMESPACE_BYTES` bytes (every byte percent-encoded).
pub(crate) const MAX_ID_BYTES: usize =
    MAX_PARTITION_KEY_BYTES - 1 - 3 * idempotency_core::MAX_NAMESPACE_BYTES;

/// An upper bound of a number attribute's value size (DynamoDB: 1 byte per two
/// significant digits plus 1; moto: the decimal string's length) for the u64 and
/// u32 numbers this backend stores.
const MAX_NUMBER_BYTES: usize = 21;

/// The names of the attributes a record is stored under.
///
/// The defaults are readable names (`pk`, `status`, `owner`, …). Requests refer
/// to them through expression attribute name placeholders, so DynamoDB reserved
/// words (`status`, `owner`, `ttl`, …) are fine. Change them to fit an existing
/// table (its partition key, its TTL attribute) with
/// [`DynamoDbRepository::with_attribute_names`](crate::DynamoDbRepository::with_attribute_names):
///
/// ```
/// use idempotency_dynamodb::AttributeNames;
///
/// let mut names = AttributeNames::default()
///     .with_partition_key("id")
///     .with_ttl("expires");
/// assert!(names.validate().is_ok());
///
/// names.status = "id".to_owned(); // two attributes under one name
/// assert!(names.validate().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttributeNames {
    /// The table's partition key (String): the injective encoding of
    /// (namespace, id), [`RecordKey::encode`]. Default `pk`.
    pub partition_key: String,
    /// `processing`, `completed` or `failed` (String). Default `status`.
    pub status: String,
    /// The owner (fencing) token, 32 hex digits (String). Default `owner`.
    pub owner: String,
    /// The attempt number (Number). Default `attempt`.
    pub attempt: String,
    /// The payload fingerprint, 64 hex digits (String, absent when none).
    /// Default `fingerprint`.
    pub fingerprint: String,
    /// The cached result (Binary; `NULL` for an empty result; absent when none).
    /// Default `result`.
    pub result: String,
    /// The stored error (Binary; `NULL` when empty; absent when none).
    /// Default `error`.
    pub error: String,
    /// The lease's end, Unix milliseconds (Number). Default `lease_until`.
    pub lease_until: String,
    /// The logical expiry, Unix milliseconds (Number). Default `expires_at`.
    pub expires_at: String,
    /// Creation instant, Unix milliseconds (Number). Default `created_at`.
    pub created_at: String,
    /// Last change, Unix milliseconds (Number). Default `updated_at`.
    pub updated_at: String,
    /// The TTL attribute: `expires_at` in Unix seconds rounded up (Number).
    /// Enable DynamoDB TTL on it. Default `ttl`.
    pub ttl: String,
    /// Whether a `Failed` record may be taken over (Boolean, only on failed
    /// records). Default `retryable`.
    pub retryable: String,
}

impl Default for AttributeNames {
    fn default() -> Self {
        AttributeNames {
            partition_key: "pk".to_owned(),
            status: "status".to_owned(),
            owner: "owner".to_owned(),
            attempt: "attempt".to_owned(),
            fingerprint: "fingerprint".to_owned(),
            result: "result".to_owned(),
            error: "error".to_owned(),
            lease_until: "lease_until".to_owned(),
            expires_at: "expires_at".to_owned(),
            created_at: "created_at".to_owned(),
            updated_at: "updated_at".to_owned(),
            ttl: "ttl".to_owned(),
            retryable: "retryable".to_owned(),
        }
    }
}

impl AttributeNames {
    /// Sets [`AttributeNames::partition_key`].
    pub fn with_partition_key(mut self, name: impl Into<String>) -> Self {
        self.partition_key = name.into();
        self
    }

    /// Sets [`AttributeNames::ttl`].
    pub fn with_ttl(mut self, name: impl Into<String>) -> Self {
        self.ttl = name.into();
        self
    }

    fn all(&self) -> [(&'static str, &str); 13] {
        [
            ("partition_key", &self.partition_key),
            ("status", &self.status),
            ("owner", &self.owner),
            ("attempt", &self.attempt),
            ("fingerprint", &self.fingerprint),
            ("result", &self.result),
            ("error", &self.error),
            ("lease_until", &self.lease_until),
            ("expires_at", &self.expires_at),
            ("created_at", &self.created_at),
            ("updated_at", &self.updated_at),
            ("ttl", &self.ttl),
            ("retryable", &self.retryable),
        ]
    }

    /// Checks that every name is 1 to 255 bytes long and that no two are equal.
    ///
    /// # Errors
    /// [`Error::Config`] naming the offending attribute.
    pub fn validate(&self) -> Result<(), Error> {
        let all = self.all();
        for (i, (field, name)) in all.iter().enumerate() {
            if name.is_empty() || name.len() > 255 {
                return Err(Error::config(format!(
                    "DynamoDB attribute name for `{field}` must be 1 to 255 bytes long, got {} bytes",
                    name.len()
                )));
            }
            if let Some((other, _)) = all[..i].iter().find(|(_, n)| n == name) {
                return Err(Error::config(format!(
                    "DynamoDB attribute name `{name}` is used for both `{other}` and `{field}`"
                )));
            }
        }
        Ok(())
    }

    /// The bytes every stored item may take besides its result (or error) value:
    /// all attribute names, the longest partition key and the other values at
    /// their largest.
    pub(crate) fn item_overhead(&self) -> usize {
        let names: usize = self.all().iter().map(|(_, n)| n.len()).sum();
        names
            + MAX_PARTITION_KEY_BYTES
            + "processing".len()
            + 32 // owner
            + 64 // fingerprint
            + 6 * MAX_NUMBER_BYTES // attempt, 4 instants, ttl
            + 1 // retryable
            + 64 // margin for encodings we do not control
    }

    /// The largest result (or error) an item can hold with these names.
    pub(crate) fn max_value_bytes(&self) -> usize {
        ITEM_LIMIT_BYTES.saturating_sub(self.item_overhead())
    }
}

/// A number attribute.
pub(crate) fn num(n: u64) -> AttributeValue {
    AttributeValue::N(n.to_string())
}

/// A timestamp attribute (Unix milliseconds).
pub(crate) fn ts(t: Timestamp) -> AttributeValue {
    num(t.as_millis())
}

/// The TTL attribute's value: `expires_at` in Unix seconds, rounded up so the
/// record is never removed physically before its logical expiry.
pub(crate) fn ttl(expires_at: Timestamp) -> AttributeValue {
    num(expires_at.as_secs_ceil())
}

/// An owner token attribute.
pub(crate) fn owner(o: OwnerToken) -> AttributeValue {
    AttributeValue::S(o.to_string())
}

/// A status attribute.
pub(crate) fn status(s: Status) -> AttributeValue {
    AttributeValue::S(s.as_str().to_owned())
}

/// A result or error value: Binary, or `NULL` for an empty value (some DynamoDB
/// versions and emulators reject empty binary values).
pub(crate) fn bytes(b: &[u8]) -> AttributeValue {
    if b.is_empty() {
        AttributeValue::Null(true)
    } else {
        AttributeValue::B(Blob::new(b))
    }
}

/// The item a freshly reserved record is stored as.
pub(crate) fn record_to_item(names: &AttributeNames, pk: AttributeValue, r: &Record) -> Item {
    let mut item = Item::with_capacity(12);
    item.insert(names.partition_key.clone(), pk);
    item.insert(names.status.clone(), status(r.status));
    item.insert(names.owner.clone(), owner(r.owner));
    item.insert(names.attempt.clone(), num(u64::from(r.attempt)));
    if let Some(fp) = &r.fingerprint {
        item.insert(names.fingerprint.clone(), AttributeValue::S(fp.to_string()));
    }
    if let Some(v) = &r.result {
        item.insert(names.result.clone(), bytes(v));
    }
    if let Some(v) = &r.error {
        item.insert(names.error.clone(), bytes(v));
    }
    item.insert(names.lease_until.clone(), ts(r.lease_until));
    item.insert(names.expires_at.clone(), ts(r.expires_at));
    item.insert(names.created_at.clone(), ts(r.created_at));
    item.insert(names.updated_at.clone(), ts(r.updated_at));
    item.insert(names.ttl.clone(), ttl(r.expires_at));
    if r.status == Status::Failed {
        item.insert(names.retryable.clone(), AttributeValue::Bool(r.retryable));
    }
    item
}

/// Parses a stored item; anything malformed is [`Error::Corrupt`] naming `key`.
pub(crate) fn item_to_record(
    names: &AttributeNames,
    key: &RecordKey,
    item: &Item,
) -> Result<Record, Error> {
    let reader = Reader { names, key, item };
    let status_text = reader.string(&names.status, "status")?;
    let status = Status::parse(status_text)
        .ok_or_else(|| Error::corrupt(key, format!("unknown status {status_text:?}")))?;
    let owner = reader
        .string(&names.owner, "owner")?
        .parse::<OwnerToken>()
        .map_err(|e| e.with_key(key))?;
    let attempt = u32::try_from(reader.number(&names.attempt, "attempt")?)
        .map_err(|_| Error::corrupt(key, "attempt out of range"))?;
    let fingerprint = match item.get(&names.fingerprint) {
        None | Some(AttributeValue::Null(true)) => None,
        Some(AttributeValue::S(s)) => Some(s.parse::<Fingerprint>().map_err(|e| e.with_key(key))?),
        Some(_) => return Err(Error::corrupt(key, "fingerprint is not a String")),
    };
    // Failed items written before the attribute existed were all open to a
    // retrying takeover (`store_and_retry`): they stay so.
    let retryable = match item.get(&names.retryable) {
        None | Some(AttributeValue::Null(true)) => status == Status::Failed,
        Some(AttributeValue::Bool(b)) => status == Status::Failed && *b,
        Some(_) => return Err(Error::corrupt(key, "retryable is not a Boolean")),
    };
    Ok(Record {
        status,
        owner,
        attempt,
        fingerprint,
        retryable,
        result: reader.bytes(&names.result, "result")?,
        error: reader.bytes(&names.error, "error")?,
        lease_until: Timestamp::from_millis(reader.number(&names.lease_until, "lease_until")?),
        expires_at: Timestamp::from_millis(reader.number(&names.expires_at, "expires_at")?),
        created_at: Timestamp::from_millis(reader.number(&names.created_at, "created_at")?),
        updated_at: Timestamp::from_millis(reader.number(&names.updated_at, "updated_at")?),
    })
}

struct Reader<'a> {
    names: &'a AttributeNames,
    key: &'a RecordKey,
    item: &'a Item,
}

impl<'a> Reader<'a> {
    fn get(&self, name: &str, field: &str) -> Result<&'a AttributeValue, Error> {
        self.item.get(name).ok_or_else(|| {
            Error::corrupt(
                self.key,
                format!("attribute `{name}` ({field}) is missing from the item in the table"),
            )
        })
    }

    fn string(&self, name: &str, field: &str) -> Result<&'a str, Error> {
        match self.get(name, field)? {
            AttributeValue::S(s) => Ok(s),
            _ => Err(Error::corrupt(
                self.key,
                format!("attribute `{name}` ({field}) is not a String"),
            )),
        }
    }

    fn number(&self, name: &str, field: &str) -> Result<u64, Error> {
        match self.get(name, field)? {
            AttributeValue::N(n) => n.trim().parse::<u64>().map_err(|_| {
                Error::corrupt(
                    self.key,
                    format!("attribute `{name}` ({field}) is not a non-negative integer: {n:?}"),
                )
            }),
            _ => Err(Error::corrupt(
                self.key,
                format!("attribute `{name}` ({field}) is not a Number"),
            )),
        }
    }

    fn bytes(&self, name: &str, field: &str) -> Result<Option<Vec<u8>>, Error> {
        match self.item.get(name) {
            None => Ok(None),
            Some(AttributeValue::B(b)) => Ok(Some(b.as_ref().to_vec())),
            Some(AttributeValue::Null(true)) => Ok(Some(Vec::new())),
            Some(_) => Err(Error::corrupt(
                self.key,
                format!(
                    "attribute `{name}` ({field}) is neither Binary nor NULL (table item of {})",
                    self.names.partition_key
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn sample(result: Option<Vec<u8>>) -> Record {
        Record {
            status: Status::Completed,
            owner: OwnerToken::from_u128(7),
            attempt: 3,
            fingerprint: Some(Fingerprint::of_bytes(b"x")),
            result,
            error: None,
            retryable: false,
            lease_until: Timestamp::from_millis(10),
            expires_at: Timestamp::from_millis(1_001),
            created_at: Timestamp::from_millis(1),
            updated_at: Timestamp::from_millis(2),
        }
    }

    #[test]
    fn round_trips_including_empty_and_binary_results() {
        let names = AttributeNames::default();
        let key = RecordKey::new("ns", "id", 64).unwrap();
        for result in [
            None,
            Some(Vec::new()),
            Some(vec![0, 255, 0]),
            Some(b"ok".to_vec()),
        ] {
            let rec = sample(result);
            let item = record_to_item(&names, AttributeValue::S(key.encode()), &rec);
            assert_eq!(item_to_record(&names, &key, &item).unwrap(), rec);
        }
        let item = record_to_item(&names, AttributeValue::S(key.encode()), &sample(None));
        assert_eq!(item.get("ttl"), Some(&AttributeValue::N("2".into())));
    }

    #[test]
    fn malformed_items_are_corrupt_with_the_key() {
        let names = AttributeNames::default();
        let key = RecordKey::new("ns", "id", 64).unwrap();
        let good = record_to_item(&names, AttributeValue::S(key.encode()), &sample(None));
        let mutations: [(&str, Option<AttributeValue>); 6] = [
            ("status", Some(AttributeValue::S("weird".into()))),
            ("owner", Some(AttributeValue::S("zz".into()))),
            ("attempt", Some(AttributeValue::N("-1".into()))),
            ("expires_at", None),
            ("result", Some(AttributeValue::S("text".into()))),
            ("fingerprint", Some(AttributeValue::S("abc".into()))),
        ];
        for (attr, value) in mutations {
            let mut item = good.clone();
            match value {
                Some(v) => item.insert(attr.to_owned(), v),
                None => item.remove(attr),
            };
            match item_to_record(&names, &key, &item) {
                Err(Error::Corrupt { key: Some(k), .. }) => assert_eq!(k, key),
                other => panic!("{attr}: {other:?}"),
            }
        }
    }

    #[test]
    fn names_are_validated() {
        assert!(AttributeNames::default().validate().is_ok());
        let bad = [
            AttributeNames {
                owner: String::new(),
                ..AttributeNames::default()
            },
            AttributeNames {
                error: "result".into(),
                ..AttributeNames::default()
            },
            AttributeNames::default().with_ttl("x".repeat(256)),
            AttributeNames::default().with_partition_key("ttl"),
        ];
        for n in bad {
            assert!(matches!(n.validate(), Err(Error::Config { .. })), "{n:?}");
        }
    }

    #[test]
    fn limits() {
        assert_eq!(MAX_ID_BYTES, 511);
        let max = AttributeNames::default().max_value_bytes();
        assert!(max > 390_000 && max < ITEM_LIMIT_BYTES, "{max}");
    }
}
