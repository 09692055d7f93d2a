//! What part of a request must match for a key to be reused.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use sha2::{Digest, Sha256};

/// A custom fingerprint: the bytes to digest for a request (its head and its
/// whole body).
pub type FingerprintFn = Arc<dyn Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync>;

/// Which parts of a request form its fingerprint, the SHA-256 digest stored with
/// the record. A key reused with a request of another fingerprint is refused
/// with `422 Unprocessable Content`.
///
/// **The request target counts in every mode.** Each fingerprint but
/// [`Disabled`](Self::Disabled) covers the request's path and query string as
/// sent (`/accounts/1/charge?to=alice`), whatever else it covers: records are
/// scoped by the route template (`/accounts/{id}/charge`), so without the
/// target a key reused on `/accounts/2/charge`, or with `?to=bob`, would be
/// answered with the first request's response. The query is compared as raw
/// bytes: `?a=1&b=2` and `?b=2&a=1` (or `%41` and `A`) are two targets, since
/// a handler can tell them apart (repeated parameters, their order) and a
/// client retrying sends the same bytes; strip a part that must not count
/// (a tracking parameter) before the layer. When no fingerprint is compared
/// (`Disabled`, or a manager whose `validate_payload` is off), the record is
/// scoped by the target instead of the route template, so another target is a
/// request of its own.
///
/// Variants that include the body read it whole before the handler runs, up to
/// [`IdempotencyLayer::max_request_body`](crate::IdempotencyLayer::max_request_body)
/// (larger bodies get `413`); the others leave the body streaming.
///
/// ```
/// use idempotency_http::RequestFingerprint;
///
/// // The JSON body with the `Content-Type` header (and, as always, the target).
/// let fingerprint = RequestFingerprint::custom(|parts, body| {
///     let mut material = parts
///         .headers
///         .get(http::header::CONTENT_TYPE)
///         .map(|v| v.as_bytes().to_vec())
///         .unwrap_or_default();
///     material.push(0);
///     material.extend_from_slice(body);
///     material
/// });
/// # let _ = fingerprint;
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum RequestFingerprint {
    /// Method, target (path and query string) and body (the default). The
    /// path is the request's own (`/orders/42`), not the route template, so
    /// one key on two resources of the same route is a mismatch, and so is one
    /// key with two query strings. A request without a query string has the
    /// digest it had before the query counted.
    #[default]
    MethodPathBody,
    /// The same parts as [`MethodPathBody`](Self::MethodPathBody), which
    /// covers the query string too; kept so that records written under it
    /// keep matching (its digests differ from `MethodPathBody`'s).
    MethodPathQueryBody,
    /// Method, target and the body as JSON means it: for a JSON body
    /// (`Content-Type` `application/json` or `…+json`) that parses, its
    /// canonical form ([`idempotency_core::canonical_json_text`]: members
    /// sorted by name, insignificant whitespace dropped, strings unescaped,
    /// numbers by their exact value), so a retry that serializes the same
    /// document differently still matches; any other body as bytes, and so a
    /// body JSON cannot read without loss (a member name repeated in one
    /// object, which parsers read differently). Two bodies a handler can tell
    /// apart never match: numbers keep every digit (never rounded through
    /// `f64`) and whether they are integers (`1` is not `1.0`; `1.0`, `1.00`
    /// and `1e0` are one number). Raw bytes stay the default: they are exact,
    /// cost no parsing, and a client retrying sends the same bytes.
    MethodPathJsonBody,
    /// Method and target; the body is not read (for large uploads).
    MethodPath,
    /// The body (and the target).
    Body,
    /// No fingerprint: a reused key always replays, whatever the body. Records
    /// are then scoped by the target (path and query) instead of the route
    /// template, so a key reused on another target runs as a request of its
    /// own rather than replaying another resource's response.
    Disabled,
    /// The digest of the bytes a function returns (and of the target).
    Custom(FingerprintFn),
}

impl RequestFingerprint {
    /// A custom fingerprint over the bytes `f` returns for a request's head and
    /// body; the request target is added to them.
    pub fn custom(f: impl Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync + 'static) -> Self {
        RequestFingerprint::Custom(Arc::new(f))
    }

    /// What scopes a request's record besides its caller, method and key:
    /// the `route` (template), or the request target (path and query) when
    /// no fingerprint is compared (`Disabled`, or a manager that does not
    /// `validate` payloads). Otherwise the fingerprint covers the target, so
    /// a key reused on another target of the route is a mismatch, never
    /// another resource's replay.
    pub(crate) fn record_scope<'a>(
        &self,
        validate: bool,
        parts: &'a Parts,
        route: &'a str,
    ) -> &'a str {
        if validate && !matches!(self, RequestFingerprint::Disabled) {
            route
        } else {
            request_target(parts)
        }
    }

    /// Whether the body must be read to compute it.
    pub(crate) fn reads_body(&self) -> bool {
        matches!(
            self,
            RequestFingerprint::MethodPathBody
                | RequestFingerprint::MethodPathQueryBody
                | RequestFingerprint::MethodPathJsonBody
                | RequestFingerprint::Body
                | RequestFingerprint::Custom(_)
        )
    }

    /// The fingerprint as 64 hex digits, or `None` when disabled. `body` is
    /// empty when [`reads_body`](Self::reads_body) is false.
    pub(crate) fn compute(&self, parts: &Parts, body: &[u8]) -> Option<String> {
        let mut h = Sha256::new();
        // A tag per variant keeps the inputs of different variants apart.
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_be_bytes());
            h.update(bytes);
        };
        match self {
            RequestFingerprint::Disabled => return None,
            RequestFingerprint::MethodPathBody => {
                method_and_target(&mut field, b"method-path-body", parts);
                field(body);
            }
            RequestFingerprint::MethodPathQueryBody => {
                field(b"method-path-query-body");
                field(parts.method.as_str().as_bytes());
                target(&mut field, parts);
                field(body);
            }
            RequestFingerprint::MethodPathJsonBody => {
                method_and_target(&mut field, b"method-path-json-body", parts);
                match canonical_json_body(parts, body) {
                    Some(canonical) => {
                        field(b"json");
                        field(&canonical);
                    }
                    None => {
                        field(b"bytes");
                        field(body);
                    }
                }
            }
            RequestFingerprint::MethodPath => {
                method_and_target(&mut field, b"method-path", parts);
            }
            RequestFingerprint::Body => {
                field(b"target-body");
                target(&mut field, parts);
                field(body);
            }
            RequestFingerprint::Custom(f) => {
                field(b"target-custom");
                target(&mut field, parts);
                field(&f(parts, body));
            }
        }
        Some(hex::encode(h.finalize()))
    }
}

/// The path and the query string (`-` for none, else `?` and its raw bytes).
fn target(field: &mut impl FnMut(&[u8]), parts: &Parts) {
    field(parts.uri.path().as_bytes());
    match parts.uri.query() {
        None => field(b"-"),
        Some(q) => {
            field(b"?");
            field(q.as_bytes());
        }
    }
}

/// The tag, the method and the request target. Without a query string:
/// `tag`, the method and the path, the fields these variants wrote before the
/// query counted, so the fingerprints of such requests (and the records that
/// hold them) are unchanged; with one, `tag` marked, the method and the target.
fn method_and_target(field: &mut impl FnMut(&[u8]), tag: &[u8], parts: &Parts) {
    if parts.uri.query().is_none() {
        field(tag);
        field(parts.method.as_str().as_bytes());
        field(parts.uri.path().as_bytes());
    } else {
        field(&[tag, b"+query"].concat());
        field(parts.method.as_str().as_bytes());
        target(field, parts);
    }
}

/// The request target as the layer compares it: path and query, as sent.
fn request_target(parts: &Parts) -> &str {
    parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |target| target.as_str())
}

/// The canonical JSON of a JSON body that reads without loss, else `None`.
fn canonical_json_body(parts: &Parts, body: &[u8]) -> Option<Vec<u8>> {
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)?
        .to_str()
        .ok()?;
    let essence = content_type.split(';').next()?.trim().to_ascii_lowercase();
    if essence != "application/json" && !essence.ends_with("+json") {
        return None;
    }
    idempotency_core::canonical_json_text(body)
        .ok()
        .map(String::into_bytes)
}

impl fmt::Debug for RequestFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RequestFingerprint::MethodPathBody => "MethodPathBody",
            RequestFingerprint::MethodPathQueryBody => "MethodPathQueryBody",
            RequestFingerprint::MethodPathJsonBody => "MethodPathJsonBody",
            RequestFingerprint::MethodPath => "MethodPath",
            RequestFingerprint::Body => "Body",
            RequestFingerprint::Disabled => "Disabled",
            RequestFingerprint::Custom(_) => "Custom(..)",
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn json_request(content_type: &str) -> Parts {
        http::Request::post("/orders")
            .header(http::header::CONTENT_TYPE, content_type)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn json_fingerprints_ignore_key_order_and_whitespace_only() {
        let f = RequestFingerprint::MethodPathJsonBody;
        let json = json_request("application/json; charset=utf-8");
        let a = f.compute(&json, br#"{"amount": 5, "currency": "EUR"}"#);
        let b = f.compute(&json, b"{\"currency\":\"EUR\",\n \"amount\":5}");
        let other = f.compute(&json, br#"{"amount": 6, "currency": "EUR"}"#);
        assert_eq!(a, b);
        assert_ne!(a, other);
        // Not JSON, or not parseable: the bytes count.
        let text = json_request("text/plain");
        assert_ne!(
            f.compute(&text, br#"{"a":1,"b":2}"#),
            f.compute(&text, br#"{"b":2,"a":1}"#)
        );
        assert_ne!(f.compute(&json, b"{broken"), f.compute(&json, b"{broken "));
        assert!(f
            .compute(&json_request("application/problem+json"), b"{}")
            .is_some());
        // The raw default keeps telling the two serializations apart.
        let raw = RequestFingerprint::MethodPathBody;
        assert_ne!(
            raw.compute(&json, br#"{"amount": 5, "currency": "EUR"}"#),
            raw.compute(&json, b"{\"currency\":\"EUR\",\n \"amount\":5}")
        );
    }
    use http::Request;

    fn parts(method: &str, uri: &str) -> Parts {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn each_mode_sees_exactly_its_parts() {
        use RequestFingerprint as F;
        let base = parts("POST", "/orders/1?x=1");
        let other_path = parts("POST", "/orders/2?x=1");
        let other_query = parts("POST", "/orders/1?x=2");
        let other_method = parts("PATCH", "/orders/1?x=1");
        let cases: [(F, [bool; 4]); 6] = [
            // sees: path, query, method, body. The target (path and query) in
            // every mode.
            (F::MethodPathBody, [true, true, true, true]),
            (F::MethodPathQueryBody, [true, true, true, true]),
            (F::MethodPathJsonBody, [true, true, true, true]),
            (F::MethodPath, [true, true, true, false]),
            (F::Body, [true, true, false, true]),
            (F::custom(|_, b| b.to_vec()), [true, true, false, true]),
        ];
        for (mode, [path, query, method, body]) in cases {
            let fp = mode.compute(&base, b"{}").unwrap();
            assert_eq!(fp.len(), 64);
            assert_eq!(
                fp,
                mode.compute(&base, b"{}").unwrap(),
                "{mode:?} deterministic"
            );
            assert_eq!(
                fp != mode.compute(&other_path, b"{}").unwrap(),
                path,
                "{mode:?} path"
            );
            assert_eq!(
                fp != mode.compute(&other_query, b"{}").unwrap(),
                query,
                "{mode:?} query"
            );
            assert_eq!(
                fp != mode.compute(&other_method, b"{}").unwrap(),
                method,
                "{mode:?} method"
            );
            if mode.reads_body() {
                assert_eq!(
                    fp != mode.compute(&base, b"{ }").unwrap(),
                    body,
                    "{mode:?} body"
                );
            } else {
                assert!(!body);
            }
        }
        assert_eq!(F::Disabled.compute(&base, b""), None);
        assert!(!F::Disabled.reads_body());
    }

    /// The digest these modes gave before the query counted.
    fn digest_without_query(tag: &[u8], parts: &Parts, rest: &[&[u8]]) -> String {
        let mut h = Sha256::new();
        let fields = [
            tag,
            parts.method.as_str().as_bytes(),
            parts.uri.path().as_bytes(),
        ];
        for bytes in fields.iter().chain(rest) {
            h.update((bytes.len() as u64).to_be_bytes());
            h.update(bytes);
        }
        hex::encode(h.finalize())
    }

    #[test]
    fn requests_without_a_query_keep_their_digest() {
        use RequestFingerprint as F;
        let plain = parts("POST", "/orders/1");
        let body = b"{}";
        assert_eq!(
            F::MethodPathBody.compute(&plain, body).unwrap(),
            digest_without_query(b"method-path-body", &plain, &[body])
        );
        assert_eq!(
            F::MethodPath.compute(&plain, body).unwrap(),
            digest_without_query(b"method-path", &plain, &[])
        );
        assert_eq!(
            F::MethodPathJsonBody.compute(&plain, body).unwrap(),
            digest_without_query(b"method-path-json-body", &plain, &[b"bytes", body])
        );
        // With a query string (even an empty one), another digest.
        for uri in ["/orders/1?", "/orders/1?to=alice"] {
            assert_ne!(
                F::MethodPathBody
                    .compute(&parts("POST", uri), body)
                    .unwrap(),
                digest_without_query(b"method-path-body", &plain, &[body])
            );
        }
    }

    #[test]
    fn the_query_counts_as_raw_bytes() {
        let f = RequestFingerprint::MethodPathBody;
        let fp = |uri: &str| f.compute(&parts("POST", uri), b"").unwrap();
        assert_ne!(fp("/x?to=alice"), fp("/x?to=bob"));
        assert_ne!(fp("/x?a=1&b=2"), fp("/x?b=2&a=1"));
        assert_ne!(fp("/x?a=%41"), fp("/x?a=A"));
        assert_ne!(fp("/x"), fp("/x?"));
        assert_eq!(fp("/x?a=1&b=2"), fp("/x?a=1&b=2"));
        // An absolute-form target is compared by its path and query.
        assert_eq!(fp("http://example.com/x?a=1"), fp("/x?a=1"));
    }

    #[test]
    fn json_fingerprints_tell_apart_what_a_handler_can() {
        let f = RequestFingerprint::MethodPathJsonBody;
        let json = json_request("application/json");
        let fp = |body: &[u8]| f.compute(&json, body).unwrap();
        // Past f64's precision, and past 64 bits.
        assert_ne!(
            fp(br#"{"amount": 0.1}"#),
            fp(br#"{"amount": 0.10000000000000000001}"#)
        );
        assert_ne!(fp(b"[18446744073709551616]"), fp(b"[18446744073709551617]"));
        assert_ne!(fp(b"[9007199254740993.0]"), fp(b"[9007199254740992.0]"));
        assert_ne!(fp(b"[1]"), fp(b"[1.0]"));
        // A repeated member name is compared as bytes: never equal to the
        // object without it, in either order.
        assert_ne!(fp(br#"{"a":1,"a":2}"#), fp(br#"{"a":2}"#));
        assert_ne!(fp(br#"{"a":1,"a":2}"#), fp(br#"{"a":1}"#));
        assert_ne!(fp(br#"{"a":1,"a":2}"#), fp(br#"{"a":2,"a":1}"#));
        assert_eq!(fp(br#"{"a":1,"a":2}"#), fp(br#"{"a":1,"a":2}"#));
        // The same number written otherwise still matches.
        assert_eq!(fp(br#"{"b": 2.50, "a": 1e0}"#), fp(br#"{"a":1.0,"b":2.5}"#));
    }

    #[test]
    fn fields_cannot_run_into_each_other() {
        let f = RequestFingerprint::MethodPathBody;
        // "/ab" + "c" vs "/a" + "bc"
        assert_ne!(
            f.compute(&parts("POST", "/ab"), b"c"),
            f.compute(&parts("POST", "/a"), b"bc")
        );
        let q = RequestFingerprint::MethodPathQueryBody;
        assert_ne!(
            q.compute(&parts("POST", "/a"), b""),
            q.compute(&parts("POST", "/a?"), b"")
        );
    }
}
