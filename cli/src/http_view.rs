//! Records the HTTP layer (idempotency-http) wrote: the request an id names
//! (`idempotency_http::parse_record_id`), and the stored response decoded
//! with the layer's own format (`idempotency_http::StoredResponse`): status,
//! headers and body instead of a hex prefix.

use idempotency_http::http::HeaderMap;
use idempotency_http::{parse_record_id, StoredResponse};
use serde_json::{json, Value};

/// The request an HTTP record's id names, as JSON; `None` for other ids.
pub(crate) fn request_json(id: &str) -> Option<Value> {
    let parts = parse_record_id(id)?;
    Some(json!({
        "caller": parts.caller,
        "method": parts.method,
        "route": parts.route,
        "key": parts.key,
    }))
}

/// The request for a person: "POST /orders, Idempotency-Key k-1, anonymous caller".
pub(crate) fn request_text(id: &str) -> Option<String> {
    let parts = parse_record_id(id)?;
    let caller = parts
        .caller
        .map_or_else(|| "anonymous caller".to_owned(), |c| format!("caller {c}"));
    Some(format!(
        "{} {}, Idempotency-Key {}, {caller}",
        parts.method, parts.route, parts.key
    ))
}

/// A stored result as an HTTP response, when it is one.
pub(crate) fn response(bytes: &[u8]) -> Option<StoredResponse> {
    StoredResponse::decode(bytes).ok()
}

/// The response as JSON: status, headers (sensitive values withheld), body
/// as `body_value` shows bytes, trailers.
pub(crate) fn response_json(r: &StoredResponse, body_value: impl Fn(&[u8]) -> Value) -> Value {
    json!({
        "status": r.status().as_u16(),
        "reason": r.status().canonical_reason(),
        "headers": headers_json(r.headers()),
        "body_retained": r.body().is_some(),
        "body_bytes": r.body().map(|b| b.len()),
        "body": r.body().map(|b| body_value(b)),
        "trailers": r.trailers().map(headers_json),
    })
}

fn headers_json(headers: &HeaderMap) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|(name, value)| json!([name.as_str(), header_value(value)]))
            .collect(),
    )
}

/// A header's value for display: withheld when the handler marked it
/// sensitive (a `Set-Cookie`, a token), lossy where it is not UTF-8.
fn header_value(value: &idempotency_http::http::HeaderValue) -> String {
    if value.is_sensitive() {
        return format!("(sensitive, {} bytes)", value.len());
    }
    String::from_utf8_lossy(value.as_bytes()).into_owned()
}

/// The status line and headers for a person, one per line.
pub(crate) fn head_text(r: &StoredResponse) -> String {
    let mut out = format!(
        "{} {}",
        r.status().as_u16(),
        r.status().canonical_reason().unwrap_or("")
    );
    for (name, value) in r.headers() {
        out.push_str(&format!("\n{name}: {}", header_value(value)));
    }
    out
}

/// The trailers for a person, when there are any.
pub(crate) fn trailers_text(r: &StoredResponse) -> Option<String> {
    let trailers = r.trailers()?;
    Some(
        trailers
            .iter()
            .map(|(name, value)| format!("{name}: {}", header_value(value)))
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_ids_name_their_request() {
        let id = idempotency_http::record_id(
            None,
            &idempotency_http::http::Method::POST,
            "/orders",
            "k-1",
        );
        assert_eq!(
            request_text(&id).as_deref(),
            Some("POST /orders, Idempotency-Key k-1, anonymous caller")
        );
        assert_eq!(
            request_json(&id).map(|v| v["route"].clone()),
            Some(json!("/orders"))
        );
        assert_eq!(request_text("evt-42"), None);
        assert!(response(b"{\"receipt\":1}").is_none());
    }
}
