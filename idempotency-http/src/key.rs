//! The `Idempotency-Key` header: parsing, validation and the record id it
//! becomes.

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::request::Parts;
use http::{HeaderMap, Method};
use sha2::{Digest, Sha256};

/// The default longest key, in bytes (Stripe's limit).
pub const DEFAULT_MAX_KEY_LENGTH: usize = 255;

/// Why a request's key was refused (answered with `400 Bad Request`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The header appears more than once.
    Repeated,
    /// The key is empty.
    Empty,
    /// The key is longer than the configured maximum.
    TooLong {
        /// The maximum, in bytes.
        max: usize,
    },
    /// A character outside the allowed set: visible ASCII (`0x21`–`0x7E`)
    /// without `"`, `\` and `,` for a bare key; printable ASCII (`0x20`–`0x7E`)
    /// for a quoted (Structured Field string) key.
    InvalidCharacter,
    /// A quoted key with a missing closing quote or an escape other than `\"`
    /// and `\\`.
    BadQuoting,
    /// Refused by the configured key validator.
    Rejected(String),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Repeated => f.write_str("the idempotency key header appears more than once"),
            KeyError::Empty => f.write_str("the idempotency key is empty"),
            KeyError::TooLong { max } => {
                write!(f, "the idempotency key is longer than {max} bytes")
            }
            KeyError::InvalidCharacter => f.write_str(
                "the idempotency key contains a character outside visible ASCII \
                 (bare keys: 0x21-0x7E without '\"', '\\' and ','; quoted keys: 0x20-0x7E)",
            ),
            KeyError::BadQuoting => f.write_str(
                "the quoted idempotency key is malformed (closing quote, or an escape other \
                 than \\\" and \\\\)",
            ),
            KeyError::Rejected(reason) => write!(f, "the idempotency key was refused: {reason}"),
        }
    }
}

impl std::error::Error for KeyError {}

/// Reads the key from `headers`: `Ok(None)` when the header is absent.
///
/// Accepts the IETF draft's form, a Structured Field string (`"8e03978e-…"`,
/// with `\"` and `\\` escapes), and the bare form Stripe and most clients send
/// (`8e03978e-…`); both name the same key. Surrounding whitespace is ignored.
/// The length is checked before anything else, so a huge header costs nothing.
pub(crate) fn parse_key(
    headers: &HeaderMap,
    name: &HeaderName,
    max_len: usize,
) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_value(value.as_bytes(), max_len).map(Some)
}

fn parse_value(raw: &[u8], max_len: usize) -> Result<String, KeyError> {
    let raw = raw.trim_ascii();
    // A quoted key carries two quotes and at most one backslash per character.
    if raw.len() > max_len.saturating_mul(2).saturating_add(2) {
        return Err(KeyError::TooLong { max: max_len });
    }
    let key = match raw {
        [b'"', ..] => unquote(raw)?,
        _ => {
            if raw
                .iter()
                .any(|b| !matches!(b, 0x21..=0x7e) || matches!(b, b'"' | b'\\' | b','))
            {
                return Err(KeyError::InvalidCharacter);
            }
            raw.iter().map(|&b| char::from(b)).collect()
        }
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong { max: max_len });
    }
    Ok(key)
}

/// RFC 8941 §4.2.5: a string is `"` printable-ASCII with `\"`/`\\` escapes `"`.
fn unquote(raw: &[u8]) -> Result<String, KeyError> {
    let mut out = String::with_capacity(raw.len());
    let mut bytes = raw.iter().skip(1);
    loop {
        match bytes.next() {
            None => return Err(KeyError::BadQuoting),
            Some(b'"') => break,
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(char::from(c)),
                _ => return Err(KeyError::BadQuoting),
            },
            Some(&c @ 0x20..=0x7e) => out.push(char::from(c)),
            Some(_) => return Err(KeyError::InvalidCharacter),
        }
    }
    if bytes.next().is_some() {
        // Parameters (`"k";a=1`) or garbage after the string.
        return Err(KeyError::BadQuoting);
    }
    Ok(out)
}

/// The record id of a request: caller identity, method, route and key, encoded
/// injectively. The layer passes the route template as `route`, or the request
/// target (path and query, `/orders/42?x=1`) when it compares no fingerprint
/// (see [`RequestFingerprint`](crate::RequestFingerprint)).
///
/// Every part but the key is length-prefixed (`<bytes>:<text>`; an absent
/// caller is `-`), and the key comes last, so two different tuples never give
/// the same id whatever characters they contain. The manager then places the id
/// in its namespace and replaces ids longer than the store indexes by their
/// SHA-256 digest (never truncating them).
///
/// Useful to find or delete a record by hand (`manager.record_key(&id)`).
///
/// ```
/// use http::Method;
/// use idempotency_http::record_id;
///
/// assert_eq!(record_id(None, &Method::POST, "/orders", "k-1"), "-|4:POST|7:/orders|k-1");
/// assert_eq!(
///     record_id(Some("tenant-a"), &Method::POST, "/orders/{id}", "k-1"),
///     "8:tenant-a|4:POST|12:/orders/{id}|k-1",
/// );
/// // Separators inside parts cannot forge another tuple.
/// assert_ne!(
///     record_id(Some("a|4:POST"), &Method::POST, "/x", "k"),
///     record_id(Some("a"), &Method::POST, "/x", "k"),
/// );
/// ```
pub fn record_id(caller: Option<&str>, method: &Method, route: &str, key: &str) -> String {
    let caller_len = caller.map_or(1, |c| c.len() + 6);
    let mut id =
        String::with_capacity(caller_len + method.as_str().len() + route.len() + key.len() + 16);
    match caller {
        None => id.push('-'),
        Some(c) => push_prefixed(&mut id, c),
    }
    id.push('|');
    push_prefixed(&mut id, method.as_str());
    id.push('|');
    push_prefixed(&mut id, route);
    id.push('|');
    id.push_str(key);
    id
}

/// The parts of a record id [`record_id`] built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordIdParts<'a> {
    /// The caller identity (`None`: anonymous).
    pub caller: Option<&'a str>,
    /// The request method.
    pub method: &'a str,
    /// The route (template or request target).
    pub route: &'a str,
    /// The `Idempotency-Key`.
    pub key: &'a str,
}

/// The parts of an id [`record_id`] built; `None` for an id of another
/// form (a record not written by this layer). The inverse of `record_id`,
/// for operator tools that show what request a record answers.
///
/// ```
/// use http::Method;
/// use idempotency_http::{parse_record_id, record_id, RecordIdParts};
///
/// let id = record_id(Some("t|1"), &Method::POST, "/orders", "k:1");
/// assert_eq!(
///     parse_record_id(&id),
///     Some(RecordIdParts { caller: Some("t|1"), method: "POST", route: "/orders", key: "k:1" })
/// );
/// assert_eq!(parse_record_id("evt-42"), None);
/// ```
pub fn parse_record_id(id: &str) -> Option<RecordIdParts<'_>> {
    let (caller, rest) = match id.strip_prefix("-|") {
        Some(rest) => (None, rest),
        None => {
            let (caller, rest) = take_prefixed(id)?;
            (Some(caller), rest)
        }
    };
    let (method, rest) = take_prefixed(rest)?;
    let (route, key) = take_prefixed(rest)?;
    Method::from_bytes(method.as_bytes()).ok()?;
    (!key.is_empty()).then_some(RecordIdParts {
        caller,
        method,
        route,
        key,
    })
}

/// `<bytes>:<text>|` at the start of `s`: the text and what follows the `|`.
fn take_prefixed(s: &str) -> Option<(&str, &str)> {
    let (len, rest) = s.split_once(':')?;
    if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let len: usize = len.parse().ok()?;
    let part = rest.get(..len)?;
    let rest = rest.get(len..)?.strip_prefix('|')?;
    Some((part, rest))
}

fn push_prefixed(out: &mut String, part: &str) {
    out.push_str(&part.len().to_string());
    out.push(':');
    out.push_str(part);
}

/// A function that names the caller of a request (tenant, account, API key
/// digest), so that one caller can never replay another's response.
pub type CallerFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// A caller identity from a request header, as the SHA-256 hex digest of its
/// value: secrets such as API keys never reach the store in clear. Requests
/// without the header share the anonymous scope.
///
/// ```
/// use http::{header::HeaderName, Request};
/// use idempotency_http::caller_from_header;
///
/// let identify = caller_from_header(HeaderName::from_static("x-api-key"));
/// let (alice, _) = Request::post("/").header("x-api-key", "sk_alice").body(()).unwrap().into_parts();
/// let (bob, _) = Request::post("/").header("x-api-key", "sk_bob").body(()).unwrap().into_parts();
/// let (nobody, _) = Request::post("/").body(()).unwrap().into_parts();
/// assert_ne!(identify(&alice), identify(&bob));
/// assert_eq!(identify(&alice).map(|id| id.len()), Some(64));
/// assert_eq!(identify(&nobody), None);
/// ```
pub fn caller_from_header(
    name: HeaderName,
) -> impl Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static {
    move |parts: &Parts| {
        parts
            .headers
            .get(&name)
            .map(|v| hex::encode(Sha256::digest(v.as_bytes())))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use http::HeaderValue;
    use std::collections::HashSet;

    fn parse(raw: &[u8]) -> Result<String, KeyError> {
        parse_value(raw, DEFAULT_MAX_KEY_LENGTH)
    }

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        assert_eq!(parse(b"abc-123").unwrap(), "abc-123");
        assert_eq!(parse(b"\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse(b"  abc  ").unwrap(), "abc");
        assert_eq!(
            parse(br#""a \"quoted\" \\ key""#).unwrap(),
            r#"a "quoted" \ key"#
        );
        assert_eq!(
            parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
    }

    #[test]
    fn refuses_bad_keys() {
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse(b"a b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a,b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\"b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"caf\xc3\xa9"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"\xff\xfe"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\tb"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"\"abc"), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\"a\\nb\""), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\"abc\";p=1"), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\"caf\xc3\xa9\""), Err(KeyError::InvalidCharacter));
        let at_limit = "k".repeat(DEFAULT_MAX_KEY_LENGTH);
        assert_eq!(parse(at_limit.as_bytes()).unwrap(), at_limit);
        let over = "k".repeat(DEFAULT_MAX_KEY_LENGTH + 1);
        assert_eq!(
            parse(over.as_bytes()),
            Err(KeyError::TooLong {
                max: DEFAULT_MAX_KEY_LENGTH
            })
        );
        let huge = vec![b'k'; 1 << 20];
        assert!(matches!(parse(&huge), Err(KeyError::TooLong { .. })));
        let quoted_over = format!("\"{over}\"");
        assert!(matches!(
            parse(quoted_over.as_bytes()),
            Err(KeyError::TooLong { .. })
        ));
    }

    #[test]
    fn header_presence_and_repetition() {
        let name = HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        assert_eq!(parse_key(&headers, &name, 10), Ok(None));
        headers.insert(&name, HeaderValue::from_static("k1"));
        assert_eq!(parse_key(&headers, &name, 10), Ok(Some("k1".into())));
        headers.append(&name, HeaderValue::from_static("k2"));
        assert_eq!(parse_key(&headers, &name, 10), Err(KeyError::Repeated));
    }

    #[test]
    fn record_ids_are_injective_on_adversarial_parts() {
        let parts = [
            "", "-", "|", "a|b", "1:a", "4:POST", "a", "/", "é", "\0", "12:x|",
        ];
        let methods = [Method::POST, Method::PATCH];
        let mut seen = HashSet::new();
        let mut n = 0;
        for caller in std::iter::once(None).chain(parts.iter().map(|p| Some(*p))) {
            for method in &methods {
                for route in parts {
                    for key in parts.iter().filter(|k| !k.is_empty()) {
                        n += 1;
                        let id = record_id(caller, method, route, key);
                        let parts = RecordIdParts {
                            caller,
                            method: method.as_str(),
                            route,
                            key,
                        };
                        assert_eq!(parse_record_id(&id), Some(parts), "{id:?}");
                        assert!(
                            seen.insert(id),
                            "collision: {caller:?} {method} {route:?} {key:?}"
                        );
                    }
                }
            }
        }
        assert_eq!(seen.len(), n);
    }
}
