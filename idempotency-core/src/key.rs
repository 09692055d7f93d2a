//! Record keys, owner (fencing) tokens and payload fingerprints.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::Error;

/// The prefix of an id that was replaced by its digest.
///
/// An id that itself starts with this prefix is digested too, so a raw id can never
/// equal the digest form of another id (barring a SHA-256 collision).
pub const DIGEST_PREFIX: &str = "sha256:";

/// The longest namespace accepted, in bytes. Namespaces are configuration
/// (prefix + scope), so a longer one is a mistake, not data.
pub const MAX_NAMESPACE_BYTES: usize = 512;

/// The address of a record: a namespace (the configured key prefix plus an optional
/// scope such as a handler name) and an id (the idempotency key itself).
///
/// Build one with [`RecordKey::new`], which validates the id and replaces an id
/// longer than the store can index by its SHA-256 digest (never truncating it).
/// Every backend encodes the pair injectively; [`RecordKey::encode`] is the shared
/// encoding for stores with a single string key.
///
/// ```
/// use idempotency_core::RecordKey;
///
/// let key = RecordKey::new("idempotency:payments", "order-42", 256)?;
/// assert_eq!(key.id(), "order-42");
///
/// let long = "x".repeat(10 * 1024);
/// let key = RecordKey::new("idempotency", &long, 256)?;
/// assert!(key.id().starts_with("sha256:"));
/// assert!(key.is_digested());
///
/// assert!(RecordKey::new("idempotency", "", 256).is_err());
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey {
    /// Shared: every key of a manager points at the manager's namespace.
    namespace: Arc<str>,
    /// Shared too: a store that keeps the key (the memory store) keeps a
    /// reference, not a copy.
    id: Arc<str>,
    digested: bool,
}

impl RecordKey {
    /// Validates `id` and builds the key; ids longer than `max_id_bytes` bytes (or
    /// starting with [`DIGEST_PREFIX`]) are replaced by `sha256:<hex>` of the id.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when the id is empty, or the namespace is longer than
    /// [`MAX_NAMESPACE_BYTES`].
    pub fn new(
        namespace: impl Into<String>,
        id: impl AsRef<str>,
        max_id_bytes: usize,
    ) -> Result<Self, Error> {
        Self::in_namespace(&Arc::from(namespace.into()), id.as_ref(), max_id_bytes)
    }

    /// [`RecordKey::new`] in a namespace the caller already holds, without
    /// copying it (the manager builds one key per call).
    pub(crate) fn in_namespace(
        namespace: &Arc<str>,
        id: &str,
        max_id_bytes: usize,
    ) -> Result<Self, Error> {
        if id.is_empty() {
            return Err(Error::InvalidKey {
                reason: "the idempotency key is empty".into(),
            });
        }
        if namespace.len() > MAX_NAMESPACE_BYTES {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the namespace is {} bytes long; at most {MAX_NAMESPACE_BYTES} are allowed",
                    namespace.len()
                ),
            });
        }
        let digest_needed =
            id.len() > max_id_bytes.max(DIGEST_PREFIX.len() + 64) || id.starts_with(DIGEST_PREFIX);
        let namespace = Arc::clone(namespace);
        if digest_needed {
            Ok(RecordKey {
                namespace,
                id: Arc::from(digest_id(id)),
                digested: true,
            })
        } else {
            Ok(RecordKey {
                namespace,
                id: Arc::from(id),
                digested: false,
            })
        }
    }

    /// The key of a record as a store lists or logs it: like
    /// [`new`](Self::new), except that an id which already is a digest
    /// ([`DIGEST_PREFIX`] and 64 lowercase hex digits, the form `new` gives a
    /// long id) is kept as it is, not digested a second time. Operator tools
    /// use it to address a record whose listed id is a digest.
    ///
    /// ```
    /// use idempotency_core::RecordKey;
    /// let long = RecordKey::new("orders", "x".repeat(1000), 256)?;
    /// let listed = RecordKey::from_stored("orders", long.id(), 256)?;
    /// assert_eq!(listed, long);
    /// // Anything else is built as `new` builds it.
    /// assert_eq!(RecordKey::from_stored("orders", "o-1", 256)?, RecordKey::new("orders", "o-1", 256)?);
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_stored(
        namespace: impl Into<String>,
        id: impl AsRef<str>,
        max_id_bytes: usize,
    ) -> Result<Self, Error> {
        let id = id.as_ref();
        let key = Self::new(namespace, id, max_id_bytes)?;
        if !is_digest(id) {
            return Ok(key);
        }
        Ok(RecordKey {
            namespace: key.namespace,
            id: Arc::from(id),
            digested: true,
        })
    }

    /// The namespace (prefix and scope).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The id as stored: the caller's id, or its digest.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether the caller's id was replaced by its digest.
    pub fn is_digested(&self) -> bool {
        self.digested
    }

    /// The one-string encoding of (namespace, id), injective over all pairs.
    ///
    /// The namespace is percent-escaped (`%`, `:`, `{`, `}` and control
    /// characters), so the first `:` always separates it from the id, which follows
    /// verbatim. Braces are escaped so a namespace never forms a Redis Cluster hash
    /// tag: records of one namespace spread over all slots.
    ///
    /// ```
    /// use idempotency_core::RecordKey;
    /// let a = RecordKey::new("a:b", "c", 256)?;
    /// let b = RecordKey::new("a", "b:c", 256)?;
    /// assert_eq!(a.encode(), "a%3Ab:c");
    /// assert_eq!(b.encode(), "a:b:c");
    /// assert_ne!(a.encode(), b.encode());
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(self.namespace.len() + self.id.len() + 1);
        escape_namespace_into(&self.namespace, &mut out);
        out.push(':');
        out.push_str(&self.id);
        out
    }

    /// The key whose [`encode`](Self::encode)d form is `encoded` (what an
    /// operator copies from a store or a log), with ids longer than
    /// `max_id_bytes` digested as [`new`](Self::new) does; an id that already
    /// is a digest is kept (see [`from_stored`](Self::from_stored)), so
    /// `decode(&key.encode())` is `key` for every key.
    ///
    /// ```
    /// use idempotency_core::RecordKey;
    /// let key = RecordKey::new("idempotency:payments", "order:42", 256)?;
    /// assert_eq!(RecordKey::decode(&key.encode(), 256)?, key);
    /// let long = RecordKey::new("idempotency:payments", "y".repeat(300), 256)?;
    /// assert_eq!(RecordKey::decode(&long.encode(), 256)?, long);
    /// assert!(RecordKey::decode("no separator", 256).is_err());
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidKey`] without a `:` separator, with a malformed escape,
    /// or when [`new`](Self::new) refuses the parts.
    pub fn decode(encoded: &str, max_id_bytes: usize) -> Result<Self, Error> {
        let invalid = |reason: &str| Error::InvalidKey {
            reason: format!("{encoded:?} is not an encoded record key: {reason}"),
        };
        let (escaped, id) = encoded
            .split_once(':')
            .ok_or_else(|| invalid("no `:` between namespace and id"))?;
        let mut bytes = Vec::with_capacity(escaped.len());
        let mut rest = escaped.as_bytes();
        while let Some((&b, tail)) = rest.split_first() {
            if b != b'%' {
                bytes.push(b);
                rest = tail;
                continue;
            }
            let hex = tail
                .get(..2)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| invalid("a `%` not followed by two hex digits"))?;
            bytes.push(hex);
            rest = &tail[2..];
        }
        let namespace =
            String::from_utf8(bytes).map_err(|_| invalid("the namespace is not UTF-8"))?;
        RecordKey::from_stored(namespace, id, max_id_bytes)
    }
}

/// Whether `id` is the digest form [`RecordKey::new`] gives a long id.
fn is_digest(id: &str) -> bool {
    id.strip_prefix(DIGEST_PREFIX).is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// One part of a composed key or namespace, with `%` and `:` percent-escaped so
/// that `:` always separates parts: borrowed when there is nothing to escape.
///
/// ```
/// use idempotency_core::escape_part;
/// assert_eq!(escape_part("orders"), "orders");
/// assert_eq!(escape_part("order:created"), "order%3Acreated");
/// assert_eq!(escape_part("100%"), "100%25");
/// ```
pub fn escape_part(part: &str) -> Cow<'_, str> {
    if !part.contains(['%', ':']) {
        return Cow::Borrowed(part);
    }
    let mut out = String::with_capacity(part.len() + 6);
    for c in part.chars() {
        match c {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `head:tail`, composed injectively: `head` is escaped with [`escape_part`],
/// so the first `:` always ends it, and `tail` follows verbatim. Key strategies
/// (`{event_type}:{event_id}`) and multi-step keys (`{event_id}:{step}`) use
/// it, so `("order:created", "1")` and `("order", "created:1")` are two keys.
///
/// ```
/// use idempotency_core::compose_parts;
/// assert_eq!(compose_parts("Charge", "evt-7"), "Charge:evt-7");
/// assert_ne!(compose_parts("order:created", "1"), compose_parts("order", "created:1"));
/// ```
pub fn compose_parts(head: &str, tail: &str) -> String {
    let head = escape_part(head);
    let mut out = String::with_capacity(head.len() + 1 + tail.len());
    out.push_str(&head);
    out.push(':');
    out.push_str(tail);
    out
}

/// Appends the escaped form of a namespace (see [`RecordKey::encode`]).
pub fn escape_namespace_into(namespace: &str, out: &mut String) {
    // Writing into a `String` cannot fail.
    let _ = escape_namespace_to(namespace, out);
}

/// The escaped form of a namespace (see [`RecordKey::encode`]), borrowed when
/// nothing needs escaping (printable ASCII without `%`, `:`, `{` or `}`), so a
/// backend can write `escape_namespace(ns)`, `:` and the id into its own buffer
/// without building the key.
///
/// ```
/// use idempotency_core::{escape_namespace, RecordKey};
/// use std::borrow::Cow;
/// assert!(matches!(escape_namespace("idempotency"), Cow::Borrowed("idempotency")));
/// assert_eq!(escape_namespace("a:b"), "a%3Ab");
/// let key = RecordKey::new("a:b", "c", 256)?;
/// assert_eq!(format!("{}:{}", escape_namespace(key.namespace()), key.id()), key.encode());
/// # Ok::<(), idempotency_core::Error>(())
/// ```
pub fn escape_namespace(namespace: &str) -> Cow<'_, str> {
    if needs_no_escaping(namespace) {
        Cow::Borrowed(namespace)
    } else {
        let mut out = String::with_capacity(namespace.len() + 8);
        escape_namespace_into(namespace, &mut out);
        Cow::Owned(out)
    }
}

fn needs_no_escaping(namespace: &str) -> bool {
    namespace
        .bytes()
        .all(|b| (0x20..0x7f).contains(&b) && !matches!(b, b'%' | b':' | b'{' | b'}'))
}

fn escape_namespace_to<W: fmt::Write + ?Sized>(namespace: &str, out: &mut W) -> fmt::Result {
    // The common case is copied whole.
    if needs_no_escaping(namespace) {
        return out.write_str(namespace);
    }
    for c in namespace.chars() {
        match c {
            '%' | ':' | '{' | '}' => push_percent(c, out)?,
            c if c.is_control() => push_percent(c, out)?,
            c => out.write_char(c)?,
        }
    }
    Ok(())
}

fn push_percent<W: fmt::Write + ?Sized>(c: char, out: &mut W) -> fmt::Result {
    let mut buf = [0u8; 4];
    for b in c.encode_utf8(&mut buf).bytes() {
        out.write_char('%')?;
        out.write_char(char::from(HEX[usize::from(b >> 4)]))?;
        out.write_char(char::from(HEX[usize::from(b & 0xf)]))?;
    }
    Ok(())
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn digest_id(id: &str) -> String {
    let digest = Sha256::digest(id.as_bytes());
    format!("{DIGEST_PREFIX}{}", hex::encode(digest))
}

/// The key as the user wrote it, `namespace:id` (the namespace is usually the
/// manager's `key_prefix` and scope), without the stored form's escaping; only
/// characters that cannot be printed (controls, invisible format characters)
/// are escaped, so a key in an error message or a log line is one line.
///
/// ```
/// use idempotency_core::RecordKey;
/// let key = RecordKey::new("idempotency:payments", "order 42/é", 256)?;
/// assert_eq!(key.to_string(), "idempotency:payments:order 42/é");
/// assert_eq!(key.encode(), "idempotency%3Apayments:order 42/é");
/// let odd = RecordKey::new("ns", "a\nb\u{0}", 256)?;
/// assert_eq!(odd.to_string(), "ns:a\\nb\\0");
/// # Ok::<(), idempotency_core::Error>(())
/// ```
impl fmt::Display for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_printable(f, &self.namespace)?;
        f.write_str(":")?;
        write_printable(f, &self.id)
    }
}

/// Writes `s`, escaping only what cannot be printed.
fn write_printable(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    for c in s.chars() {
        if c.is_control() || is_invisible_format(c) {
            write!(f, "{}", c.escape_debug())?;
        } else {
            write!(f, "{c}")?;
        }
    }
    Ok(())
}

/// Zero-width and direction-changing characters: printed, they hide or
/// reorder what surrounds them.
fn is_invisible_format(c: char) -> bool {
    matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
}

/// The random token of the attempt holding a record: a fencing token.
///
/// Every `complete`/`fail`/`release`/`extend` names the owner it acts for; the
/// store applies it only while that owner still holds the record.
///
/// ```
/// use idempotency_core::OwnerToken;
/// let a = OwnerToken::random();
/// let parsed: OwnerToken = a.to_string().parse()?;
/// assert_eq!(a, parsed);
/// assert_ne!(a, OwnerToken::random());
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerToken(u128);

impl OwnerToken {
    /// A fresh random token: 128 bits drawn from the operating system's
    /// random source at every call.
    ///
    /// Never from a generator whose state lives in the process: a process
    /// that forks (a prefork server, a worker pool) or a VM snapshot restored
    /// twice would carry that state into every copy, and the copies would
    /// draw the same tokens in the same order. Two executions with one token
    /// are one owner to the store: the second copy's reservation of a key the
    /// first holds would be taken as the holder's own re-sent reserve, and
    /// both would run the handler. The operating system's source is reseeded
    /// by the kernel, which tells the copies apart (a VM generation ID after
    /// a snapshot is restored).
    ///
    /// If the operating system's source fails (it does not on any supported
    /// platform), the token comes from the thread's generator mixed with the
    /// process id, which still tells forked copies apart.
    pub fn random() -> Self {
        use rand::TryRngCore;
        let mut bytes = [0u8; 16];
        match rand::rngs::OsRng.try_fill_bytes(&mut bytes) {
            Ok(()) => OwnerToken::from_bytes(bytes),
            Err(e) => {
                tracing::warn!(error = %e, "the operating system's random source failed; owner token from the thread's generator and the process id");
                OwnerToken(rand::random::<u128>() ^ u128::from(std::process::id()))
            }
        }
    }

    /// A token from its 128-bit value.
    pub const fn from_u128(v: u128) -> Self {
        OwnerToken(v)
    }

    /// The token's 128-bit value.
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// The 16 big-endian bytes of the token.
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// A token from 16 big-endian bytes.
    pub const fn from_bytes(b: [u8; 16]) -> Self {
        OwnerToken(u128::from_be_bytes(b))
    }
}

impl fmt::Display for OwnerToken {
    /// 32 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({self})")
    }
}

impl FromStr for OwnerToken {
    type Err = Error;
    /// Exactly what [`Display`](fmt::Display) writes: 32 lowercase hex
    /// digits. Nothing else parses (no sign, no upper case): a store that
    /// compares the stored text (a DynamoDB condition) and the manager that
    /// compares parsed tokens must never disagree on whether two owners are
    /// the same.
    fn from_str(s: &str) -> Result<Self, Error> {
        let text = canonical_hex(s, 32)
            .ok_or_else(|| Error::corrupt_value("owner token", "not 32 lowercase hex digits"))?;
        u128::from_str_radix(text, 16)
            .map(OwnerToken)
            .map_err(|_| Error::corrupt_value("owner token", "not 32 lowercase hex digits"))
    }
}

/// `s` if it is exactly `digits` lowercase hex digits.
fn canonical_hex(s: &str, digits: usize) -> Option<&str> {
    (s.len() == digits && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(s)
}

/// A SHA-256 digest of a request payload, stored with the record to detect one key
/// reused with another payload.
///
/// ```
/// use idempotency_core::Fingerprint;
/// let a = Fingerprint::of_json(&serde_json::json!({"b": 1, "a": 2}))?;
/// let b = Fingerprint::of_json(&serde_json::json!({"a": 2, "b": 1}))?;
/// assert_eq!(a, b); // canonical JSON: key order does not matter
/// assert_eq!(a, a.to_string().parse()?);
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of raw bytes.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Fingerprint(Sha256::digest(bytes).into())
    }

    /// The fingerprint of a value's canonical JSON (object keys sorted, no
    /// insignificant whitespace).
    ///
    /// # Errors
    /// [`Error::Codec`] when the value cannot be serialized to JSON.
    pub fn of_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<Self, Error> {
        // One digest call over the whole canonical JSON, hashed in place in the
        // serializer's buffer: measured cheaper than streaming the serializer's
        // many small writes into the digest.
        crate::canonical::with_canonical(value, Fingerprint::of_bytes)
    }

    /// A fingerprint from its 32 digest bytes.
    pub const fn from_bytes(b: [u8; 32]) -> Self {
        Fingerprint(b)
    }

    /// The 32 digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A fingerprint from a byte slice that must be 32 bytes long.
    ///
    /// # Errors
    /// [`Error::Corrupt`]-style value error when the length is wrong.
    pub fn try_from_slice(b: &[u8]) -> Result<Self, Error> {
        <[u8; 32]>::try_from(b)
            .map(Fingerprint)
            .map_err(|_| Error::corrupt_value("fingerprint", "not 32 bytes"))
    }
}

impl fmt::Display for Fingerprint {
    /// 64 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl FromStr for Fingerprint {
    type Err = Error;
    /// Exactly what [`Display`](fmt::Display) writes: 64 lowercase hex
    /// digits (as for [`OwnerToken`], so that comparing texts and comparing
    /// digests agree).
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::corrupt_value("fingerprint", "not 64 lowercase hex digits");
        let text = canonical_hex(s, 64).ok_or_else(bad)?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out).map_err(|_| bad())?;
        Ok(Fingerprint(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_fingerprint_is_the_digest_of_the_canonical_json() {
        #[derive(serde::Serialize)]
        struct Payment {
            zeta: u32,
            alpha: Vec<&'static str>,
            nested: std::collections::HashMap<&'static str, f64>,
        }
        let p = Payment {
            zeta: 7,
            alpha: vec!["a\"quote", "ünï"],
            nested: [("y", 1.5), ("x", -2.0)].into_iter().collect(),
        };
        let canonical = crate::strategy::canonical_json(&p).unwrap();
        assert_eq!(
            canonical,
            r#"{"alpha":["a\"quote","ünï"],"nested":{"x":-2.0,"y":1.5},"zeta":7}"#
        );
        assert_eq!(
            Fingerprint::of_json(&p).unwrap(),
            Fingerprint::of_bytes(canonical.as_bytes())
        );
        // Longer than the digest's buffer, with a token longer than it too.
        let long = serde_json::json!({"b": "x".repeat(300), "a": (0..200).collect::<Vec<_>>()});
        let canonical = crate::strategy::canonical_json(&long).unwrap();
        assert!(canonical.len() > 1000);
        assert_eq!(
            Fingerprint::of_json(&long).unwrap(),
            Fingerprint::of_bytes(canonical.as_bytes())
        );
    }

    #[test]
    fn fingerprint_of_values_left_to_the_value_route() {
        // Bool keys are not handled by the direct serializer: `Value` decides.
        let by_bool: std::collections::BTreeMap<bool, u8> = [(true, 1), (false, 2)].into();
        let canonical = crate::strategy::canonical_json(&by_bool).unwrap();
        assert_eq!(canonical, r#"{"false":2,"true":1}"#);
        assert_eq!(
            Fingerprint::of_json(&by_bool).unwrap(),
            Fingerprint::of_bytes(canonical.as_bytes())
        );
        assert!(matches!(
            Fingerprint::of_json(&u128::MAX),
            Err(Error::Codec { .. })
        ));
    }
    use std::collections::HashSet;

    #[test]
    fn encoding_is_injective_on_adversarial_pairs() {
        let parts = [
            "", "a", ":", "a:", ":a", "%", "%3A", "{", "}", "{a}", "#", "/", "\0", "\n", "é",
            "a:b", "a%b", "🦀",
        ];
        let mut seen = HashSet::new();
        let mut count = 0;
        for ns in parts {
            for id in parts.iter().filter(|s| !s.is_empty()) {
                let key = RecordKey::new(ns, id, 256).unwrap();
                assert_eq!(
                    format!("{}:{}", escape_namespace(key.namespace()), key.id()),
                    key.encode()
                );
                assert!(seen.insert(key.encode()), "collision for ({ns:?}, {id:?})");
                count += 1;
            }
        }
        assert_eq!(seen.len(), count);
    }

    #[test]
    fn long_and_prefixed_ids_are_digested_deterministically() {
        let long = "k".repeat(10 * 1024);
        let a = RecordKey::new("ns", &long, 256).unwrap();
        let b = RecordKey::new("ns", &long, 256).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.id().len(), DIGEST_PREFIX.len() + 64);
        // A raw id that looks like a digest is digested again: no collision.
        let fake = RecordKey::new("ns", a.id(), 256).unwrap();
        assert_ne!(fake.id(), a.id());
        // Ids up to the limit are kept verbatim.
        let exact = "e".repeat(256);
        assert_eq!(RecordKey::new("ns", &exact, 256).unwrap().id(), exact);
    }

    #[test]
    fn rejects_empty_id_and_huge_namespace() {
        assert!(matches!(
            RecordKey::new("ns", "", 256),
            Err(Error::InvalidKey { .. })
        ));
        assert!(matches!(
            RecordKey::new("n".repeat(MAX_NAMESPACE_BYTES + 1), "a", 256),
            Err(Error::InvalidKey { .. })
        ));
    }

    #[test]
    fn tokens_round_trip() {
        let t = OwnerToken::random();
        assert_eq!(OwnerToken::from_bytes(t.to_bytes()), t);
        assert!("zz".parse::<OwnerToken>().is_err());
        assert!("g".repeat(32).parse::<OwnerToken>().is_err());
        assert_eq!(t.to_string().parse::<OwnerToken>().unwrap(), t);
        // Only the text Display writes: a sign or upper case would parse to
        // a token whose text compares unequal in a store.
        let padded = format!("+{}", &"1".repeat(31));
        assert!(padded.parse::<OwnerToken>().is_err());
        assert!("A".repeat(32).parse::<OwnerToken>().is_err());
        assert!("a".repeat(32).parse::<OwnerToken>().is_ok());
        let spaced = format!(" {}", "a".repeat(31));
        assert!(spaced.parse::<OwnerToken>().is_err());
        let f = Fingerprint::of_bytes(b"x");
        assert_eq!(Fingerprint::try_from_slice(f.as_bytes()).unwrap(), f);
        assert!(Fingerprint::try_from_slice(b"short").is_err());
        assert_eq!(f.to_string().parse::<Fingerprint>().unwrap(), f);
        assert!(f.to_string().to_uppercase().parse::<Fingerprint>().is_err());
        assert!("ab".repeat(31).parse::<Fingerprint>().is_err());
    }
}
