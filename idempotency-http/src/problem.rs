//! `application/problem+json` answers (RFC 9457) of the layer itself.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::body::IdempotencyBody;

/// The default base of problem `type` URIs: the crate README's section on
/// problems, one anchor per [`ProblemKind::slug`].
pub const DEFAULT_PROBLEM_TYPE_BASE: &str =
    "https://github.com/idempotency-rs/idempotency-rs/blob/main/idempotency-http/README.md#";

/// The answers the layer gives instead of running the handler. Each is an
/// `application/problem+json` body with `type` (the configured base followed by
/// the [`slug`](ProblemKind::slug)), `title`, `status` and `detail`.
///
/// ```
/// use idempotency_http::ProblemKind;
/// assert_eq!(ProblemKind::KeyReused.status(), http::StatusCode::UNPROCESSABLE_ENTITY);
/// assert_eq!(ProblemKind::InProgress.slug(), "in-progress");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// `400`: the route requires an `Idempotency-Key` and the request has none.
    MissingKey,
    /// `400`: the key is empty, too long, has forbidden characters, is
    /// malformed, repeated, or refused by the validator.
    InvalidKey,
    /// `400`: the request body could not be read (to fingerprint it).
    UnreadableBody,
    /// `409` with `Retry-After`: a request with this key is being processed.
    InProgress,
    /// `409`: the key's request was processed, but its response was not stored
    /// (its body exceeded the cache cap, or the store could not hold it), so it
    /// cannot be replayed. The problem carries the original `original_status`
    /// where known. Retrying does not help: use a new key.
    ResponseNotRetained,
    /// `413`: the body is larger than the layer reads to fingerprint it.
    BodyTooLarge,
    /// `422`: the key was used before with a different request (fingerprint).
    KeyReused,
    /// `500`: the stored response could not be read back (corrupt record, or
    /// one written by something else under the same namespace).
    StoredResponseUnreadable,
    /// `500`: the store failed in a way that is not an outage (configuration,
    /// unexpected record state).
    StoreError,
    /// `503` with `Retry-After`: the store is unreachable and the outage
    /// policy is fail-closed; the handler did not run.
    StoreUnavailable,
}

impl ProblemKind {
    /// The HTTP status of the answer.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemKind::MissingKey | ProblemKind::InvalidKey | ProblemKind::UnreadableBody => {
                StatusCode::BAD_REQUEST
            }
            ProblemKind::InProgress | ProblemKind::ResponseNotRetained => StatusCode::CONFLICT,
            ProblemKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::StoredResponseUnreadable | ProblemKind::StoreError => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            ProblemKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The last segment of the problem's `type` URI.
    pub fn slug(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => "missing-key",
            ProblemKind::InvalidKey => "invalid-key",
            ProblemKind::UnreadableBody => "unreadable-body",
            ProblemKind::InProgress => "in-progress",
            ProblemKind::ResponseNotRetained => "response-not-retained",
            ProblemKind::BodyTooLarge => "body-too-large",
            ProblemKind::KeyReused => "key-reused",
            ProblemKind::StoredResponseUnreadable => "stored-response-unreadable",
            ProblemKind::StoreError => "store-error",
            ProblemKind::StoreUnavailable => "store-unavailable",
        }
    }

    /// The problem's `title`.
    pub fn title(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => "Idempotency-Key is missing",
            ProblemKind::InvalidKey => "Idempotency-Key is invalid",
            ProblemKind::UnreadableBody => "The request body could not be read",
            ProblemKind::InProgress => "A request with this Idempotency-Key is being processed",
            ProblemKind::ResponseNotRetained => {
                "The response to this Idempotency-Key was not retained"
            }
            ProblemKind::BodyTooLarge => "The request body is too large",
            ProblemKind::KeyReused => "Idempotency-Key was used for a different request",
            ProblemKind::StoredResponseUnreadable => "The stored response could not be read",
            ProblemKind::StoreError => "The idempotency store failed",
            ProblemKind::StoreUnavailable => "The idempotency store is unavailable",
        }
    }
}

/// The JSON members, in RFC 9457's order.
#[derive(serde::Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'static str,
    status: u16,
    detail: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    original_status: Option<u16>,
}

/// One answer: a kind, a detail, and optional extras.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) kind: ProblemKind,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) original_status: Option<StatusCode>,
}

impl Problem {
    pub(crate) fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            detail: detail.into(),
            retry_after: None,
            original_status: None,
        }
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub(crate) fn original_status(mut self, status: StatusCode) -> Self {
        self.original_status = Some(status);
        self
    }

    pub(crate) fn into_response<B>(self, type_base: &str) -> Response<IdempotencyBody<B>> {
        let status = self.kind.status();
        let body = ProblemBody {
            kind: format!("{type_base}{}", self.kind.slug()),
            title: self.kind.title(),
            status: status.as_u16(),
            detail: &self.detail,
            original_status: self.original_status.map(|s| s.as_u16()),
        };
        // Serializing these plain fields cannot fail; an empty body would
        // still carry the status.
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = Response::new(IdempotencyBody::full(Bytes::from(bytes), None));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(after) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        response
    }
}

/// Whole seconds for `Retry-After`, rounded up, at least 1.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    let secs = after
        .as_secs()
        .saturating_add(u64::from(after.subsec_nanos() > 0));
    secs.max(1)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use http_body_util::{BodyExt, Full};

    #[test]
    fn renders_rfc9457_with_retry_after() {
        let response: Response<IdempotencyBody<Full<Bytes>>> =
            Problem::new(ProblemKind::InProgress, "held")
                .retry_after(Duration::from_millis(1500))
                .into_response("urn:x:");
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(response.headers()[RETRY_AFTER], "2");
        let bytes = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(response.into_body().collect())
            .unwrap()
            .to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "type": "urn:x:in-progress",
                "title": "A request with this Idempotency-Key is being processed",
                "status": 409,
                "detail": "held",
            })
        );
    }

    #[test]
    fn retry_after_rounds_up_and_is_positive() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::MAX), u64::MAX, "saturates");
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
        assert_eq!(retry_after_secs(Duration::from_millis(3001)), 4);
    }

    #[test]
    fn every_kind_has_a_distinct_slug_and_an_error_status() {
        use ProblemKind::*;
        let all = [
            MissingKey,
            InvalidKey,
            UnreadableBody,
            InProgress,
            ResponseNotRetained,
            BodyTooLarge,
            KeyReused,
            StoredResponseUnreadable,
            StoreError,
            StoreUnavailable,
        ];
        let slugs: std::collections::HashSet<_> = all.iter().map(|k| k.slug()).collect();
        assert_eq!(slugs.len(), all.len());
        assert!(all
            .iter()
            .all(|k| k.status().is_client_error() || k.status().is_server_error()));
    }
}
