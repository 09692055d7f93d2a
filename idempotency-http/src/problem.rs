//! `application/problem+json` answers (RFC 9457) of the layer itself.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::body::IdempotencyBody;
use crate::layer::IdempotencyLayer;

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
    /// `410 Gone`: the key's request was processed, but its response was not
    /// stored (its body exceeded the cache cap, or the store could not hold
    /// it), so it cannot be replayed — permanently: no `Retry-After`, and a
    /// client that retries on `409` must not retry this. The problem carries
    /// the original `original_status` where known. Use a new key for a new
    /// request.
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
            ProblemKind::InProgress => StatusCode::CONFLICT,
            ProblemKind::ResponseNotRetained => StatusCode::GONE,
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

/// One answer of the layer itself, as a [problem responder](ProblemResponder)
/// sees it: what happened ([`kind`](Self::kind)), the status and the
/// `Retry-After` the layer chose, a human-readable [`detail`](Self::detail),
/// and the first response's status where the answer concerns it.
///
/// ```
/// use http::StatusCode;
/// use idempotency_http::{Problem, ProblemKind};
///
/// fn describe(problem: &Problem) -> String {
///     match (problem.kind(), problem.retry_after_secs()) {
///         (ProblemKind::InProgress, Some(secs)) => format!("busy, retry in {secs} s"),
///         (kind, _) => format!("{} ({})", kind.slug(), problem.status()),
///     }
/// }
/// # let _ = describe;
/// ```
#[derive(Debug, Clone)]
pub struct Problem {
    kind: ProblemKind,
    detail: String,
    retry_after: Option<Duration>,
    original_status: Option<StatusCode>,
    type_base: Arc<str>,
}

impl Problem {
    pub(crate) fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            detail: detail.into(),
            retry_after: None,
            original_status: None,
            type_base: Arc::from(DEFAULT_PROBLEM_TYPE_BASE),
        }
    }

    pub(crate) fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub(crate) fn with_original_status(mut self, status: StatusCode) -> Self {
        self.original_status = Some(status);
        self
    }

    pub(crate) fn with_type_base(mut self, base: Arc<str>) -> Self {
        self.type_base = base;
        self
    }

    /// What the answer is about.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The HTTP status the layer answers with ([`ProblemKind::status`]).
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// When to retry, for the kinds that carry it
    /// ([`InProgress`](ProblemKind::InProgress),
    /// [`StoreUnavailable`](ProblemKind::StoreUnavailable)); `None` for the
    /// others, which a retry with the same key does not fix.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// [`retry_after`](Self::retry_after) in whole seconds, rounded up and
    /// at least 1: the `Retry-After` header's value.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(retry_after_secs)
    }

    /// A sentence for the client (no internals: store errors are logged, not
    /// echoed).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The status of the first response to the key, for
    /// [`ResponseNotRetained`](ProblemKind::ResponseNotRetained) when known.
    pub fn original_status(&self) -> Option<StatusCode> {
        self.original_status
    }

    /// The problem's `type` URI: the layer's
    /// [`problem_type_base`](crate::IdempotencyLayer::problem_type_base)
    /// followed by the [`slug`](ProblemKind::slug).
    pub fn type_uri(&self) -> String {
        format!("{}{}", self.type_base, self.kind.slug())
    }

    /// The layer's default answer: an `application/problem+json` document
    /// (RFC 9457) with `type`, `title`, `status`, `detail` and, where known,
    /// `original_status`; `Cache-Control: no-store` and, for the kinds that
    /// carry it, `Retry-After`. A responder can fall back to it for the kinds
    /// it leaves alone.
    pub fn to_problem_json(&self) -> Response<Bytes> {
        let status = self.status();
        let body = ProblemBody {
            kind: self.type_uri(),
            title: self.kind.title(),
            status: status.as_u16(),
            detail: &self.detail,
            original_status: self.original_status.map(|s| s.as_u16()),
        };
        // Serializing these plain fields cannot fail; an empty body would
        // still carry the status.
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = Response::new(Bytes::from(bytes));
        *response.status_mut() = status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        self.complete(response)
    }

    /// Adds what every answer of the kind must carry when the response lacks
    /// it: `Retry-After` (for the kinds with a [`retry_after`](Self::retry_after))
    /// and `Cache-Control: no-store`. Headers already set are kept.
    fn complete(&self, mut response: Response<Bytes>) -> Response<Bytes> {
        let headers = response.headers_mut();
        if let (Some(secs), false) = (self.retry_after_secs(), headers.contains_key(RETRY_AFTER)) {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        if !headers.contains_key(CACHE_CONTROL) {
            headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        response
    }

    /// The HTTP answer: the responder's, or the problem document.
    pub(crate) fn into_response<B>(
        self,
        responder: Option<&ProblemResponder>,
    ) -> Response<IdempotencyBody<B>> {
        let response = match responder {
            Some(respond) => self.complete(respond(&self)),
            None => self.to_problem_json(),
        };
        response.map(|body| IdempotencyBody::full(body, None))
    }
}

/// Makes the HTTP answer to a [`Problem`] in the API's own error format
/// ([`IdempotencyLayer::problem_responder`](crate::IdempotencyLayer::problem_responder)).
pub type ProblemResponder = Arc<dyn Fn(&Problem) -> Response<Bytes> + Send + Sync>;

impl IdempotencyLayer {
    /// The base of the problem `type` URIs (default
    /// [`DEFAULT_PROBLEM_TYPE_BASE`]); the [`ProblemKind::slug`](crate::ProblemKind::slug)
    /// is appended.
    pub fn problem_type_base(self, base: impl Into<String>) -> Self {
        let base: Arc<str> = Arc::from(base.into());
        self.edit(|s| s.problem_type_base = base)
    }

    /// Answers the layer's own problems in the API's error format instead of
    /// `application/problem+json` (the default, [`Problem::to_problem_json`]).
    /// The responder gets every [`Problem`] the layer answers over HTTP
    /// (every [`ProblemKind`](crate::ProblemKind)), with the status and the
    /// retry hint the layer decided, and returns the whole response; it may
    /// fall back to [`Problem::to_problem_json`] for kinds it leaves alone.
    ///
    /// The response is sent as returned, with two additions when it lacks
    /// them: `Retry-After` (the layer's, in whole seconds) for the kinds that
    /// carry one ([`InProgress`](crate::ProblemKind::InProgress),
    /// [`StoreUnavailable`](crate::ProblemKind::StoreUnavailable)), so
    /// retrying clients keep their hint, and `Cache-Control: no-store`. Keep
    /// the [status](Problem::status): clients decide on it whether to retry
    /// (`409` and `503` do, `410` and `422` do not).
    ///
    /// gRPC layers ([`grpc`](Self::grpc)) ignore it: their answers are gRPC
    /// statuses, with the detail in `grpc-message` and the kind in the
    /// `idempotency-problem` trailer, the form gRPC clients read.
    ///
    /// Stripe's error format:
    ///
    /// ```
    /// use std::sync::Arc;
    /// use bytes::Bytes;
    /// use http::header::{HeaderValue, CONTENT_TYPE};
    /// use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// use idempotency_http::{IdempotencyLayer, Problem, ProblemKind};
    ///
    /// fn stripe_error(problem: &Problem) -> http::Response<Bytes> {
    ///     let kind = match problem.kind() {
    ///         ProblemKind::InProgress | ProblemKind::KeyReused => "idempotency_error",
    ///         ProblemKind::StoreUnavailable | ProblemKind::StoreError
    ///         | ProblemKind::StoredResponseUnreadable => "api_error",
    ///         _ => "invalid_request_error",
    ///     };
    ///     let body = serde_json::json!({
    ///         "error": { "type": kind, "code": problem.kind().slug(), "message": problem.detail() }
    ///     });
    ///     let mut response = http::Response::new(Bytes::from(body.to_string()));
    ///     *response.status_mut() = problem.status();
    ///     response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    ///     response // Retry-After is added for in-progress and store-unavailable
    /// }
    ///
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// let layer = IdempotencyLayer::new(manager).problem_responder(stripe_error);
    /// # let _ = layer;
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn problem_responder(
        self,
        f: impl Fn(&Problem) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|s| s.problem_responder = Some(Arc::new(f)))
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
                .with_retry_after(Duration::from_millis(1500))
                .with_type_base(Arc::from("urn:x:"))
                .into_response(None);
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
        let statuses: Vec<u16> = all.iter().map(|k| k.status().as_u16()).collect();
        assert_eq!(statuses, [400, 400, 400, 409, 410, 413, 422, 500, 500, 503]);
        let slugs: std::collections::HashSet<_> = all.iter().map(|k| k.slug()).collect();
        assert_eq!(slugs.len(), all.len());
        assert!(all
            .iter()
            .all(|k| k.status().is_client_error() || k.status().is_server_error()));
    }

    fn custom(problem: &Problem) -> Response<Bytes> {
        let body = format!(r#"{{"error":{{"type":"{}"}}}}"#, problem.kind().slug());
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = problem.status();
        response
    }

    #[test]
    fn a_responder_gets_the_decided_status_and_retry_after_is_added() {
        let responder: ProblemResponder = Arc::new(custom);
        let busy = Problem::new(ProblemKind::InProgress, "held")
            .with_retry_after(Duration::from_millis(2500));
        assert_eq!(busy.retry_after_secs(), Some(3));
        let response: Response<IdempotencyBody<Full<Bytes>>> = busy.into_response(Some(&responder));
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(
            response.headers()[RETRY_AFTER],
            "3",
            "added: omitted by the responder"
        );
        assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
        assert!(
            response.headers().get(CONTENT_TYPE).is_none(),
            "the responder's own"
        );

        // A responder's own Retry-After and Cache-Control are kept.
        let own: ProblemResponder = Arc::new(|problem: &Problem| {
            let mut response = custom(problem);
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("7"));
            response
                .headers_mut()
                .insert(CACHE_CONTROL, HeaderValue::from_static("private"));
            response
        });
        let response: Response<IdempotencyBody<Full<Bytes>>> =
            Problem::new(ProblemKind::StoreUnavailable, "down")
                .with_retry_after(Duration::from_secs(1))
                .into_response(Some(&own));
        assert_eq!(response.headers()[RETRY_AFTER], "7");
        assert_eq!(response.headers()[CACHE_CONTROL], "private");

        // Kinds without a retry hint get none.
        let gone: Response<IdempotencyBody<Full<Bytes>>> =
            Problem::new(ProblemKind::ResponseNotRetained, "gone")
                .with_original_status(StatusCode::CREATED)
                .into_response(Some(&responder));
        assert_eq!(gone.status(), StatusCode::GONE);
        assert!(gone.headers().get(RETRY_AFTER).is_none());
    }
}
