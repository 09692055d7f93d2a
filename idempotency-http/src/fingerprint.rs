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
/// Variants that include the body read it whole before the handler runs, up to
/// [`IdempotencyLayer::max_request_body`](crate::IdempotencyLayer::max_request_body)
/// (larger bodies get `413`); the others leave the body streaming.
///
/// ```
/// use idempotency_http::RequestFingerprint;
///
/// // Only the JSON body counts, with the `Content-Type` header.
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
    /// Method, path and body (the default). The path is the request's own
    /// (`/orders/42`), not the route template, so one key on two resources of
    /// the same route is a mismatch.
    #[default]
    MethodPathBody,
    /// Method, path, query string and body.
    MethodPathQueryBody,
    /// Method, path and the body as JSON means it: for a JSON body
    /// (`Content-Type` `application/json` or `…+json`) that parses, its
    /// canonical form (object keys sorted, insignificant whitespace dropped),
    /// so a retry that serializes the same document differently still matches;
    /// any other body as bytes. Raw bytes stay the default: they are exact,
    /// cost no parsing, and a client retrying sends the same bytes.
    MethodPathJsonBody,
    /// Method and path; the body is not read (for large uploads).
    MethodPath,
    /// The body alone.
    Body,
    /// No fingerprint: a reused key always replays, whatever the request.
    Disabled,
    /// The digest of the bytes a function returns.
    Custom(FingerprintFn),
}

impl RequestFingerprint {
    /// A custom fingerprint over the bytes `f` returns for a request's head and
    /// body.
    pub fn custom(f: impl Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync + 'static) -> Self {
        RequestFingerprint::Custom(Arc::new(f))
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
                field(b"method-path-body");
                field(parts.method.as_str().as_bytes());
                field(parts.uri.path().as_bytes());
                field(body);
            }
            RequestFingerprint::MethodPathQueryBody => {
                field(b"method-path-query-body");
                field(parts.method.as_str().as_bytes());
                field(parts.uri.path().as_bytes());
                match parts.uri.query() {
                    None => field(b"-"),
                    Some(q) => {
                        field(b"?");
                        field(q.as_bytes());
                    }
                }
                field(body);
            }
            RequestFingerprint::MethodPathJsonBody => {
                field(b"method-path-json-body");
                field(parts.method.as_str().as_bytes());
                field(parts.uri.path().as_bytes());
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
                field(b"method-path");
                field(parts.method.as_str().as_bytes());
                field(parts.uri.path().as_bytes());
            }
            RequestFingerprint::Body => {
                field(b"body");
                field(body);
            }
            RequestFingerprint::Custom(f) => {
                field(b"custom");
                field(&f(parts, body));
            }
        }
        Some(hex::encode(h.finalize()))
    }
}

/// The canonical JSON of a JSON body that parses, else `None`.
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
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    idempotency_core::canonical_json(&value)
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
        let cases: [(F, [bool; 4]); 5] = [
            // sees: path, query, method, body
            (F::MethodPathBody, [true, false, true, true]),
            (F::MethodPathQueryBody, [true, true, true, true]),
            (F::MethodPath, [true, false, true, false]),
            (F::Body, [false, false, false, true]),
            (
                F::custom(|p, b| [p.uri.path().as_bytes(), b].concat()),
                [true, false, false, true],
            ),
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
