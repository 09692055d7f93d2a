//! gRPC: the same layer for gRPC services, unary methods replayed from their
//! stored response message and trailers.
//!
//! [`IdempotencyLayer::grpc`](crate::IdempotencyLayer::grpc) makes a layer that speaks gRPC instead of HTTP
//! problem documents: the key comes from the `idempotency-key` metadata entry,
//! answers are gRPC statuses (trailers-only responses), a response is stored
//! when its `grpc-status` says a retry should see it again, and no method is
//! protected until it is named with [`IdempotencyLayer::unary`](crate::IdempotencyLayer::unary). With the
//! feature `tonic`, [`IdempotencyLayer::tonic`](crate::IdempotencyLayer::tonic) turns it into a layer for
//! `tonic::transport::Server::layer`.
//!
//! | case | gRPC status | `idempotency-problem` |
//! |---|---|---|
//! | first call | the method's own | – |
//! | retry after a stored answer | the stored one, replayed (message and trailers), with `idempotency-replayed: true` | – |
//! | missing or malformed key | `INVALID_ARGUMENT` | `missing-key`, `invalid-key` |
//! | same key, another request message | `FAILED_PRECONDITION` | `key-reused` |
//! | same key, first call still running | `ABORTED`, with `retry-after` and `grpc-retry-pushback-ms` | `in-progress` |
//! | key used, answer too large to keep | `FAILED_PRECONDITION` | `response-not-retained` |
//! | request message over the read limit | `RESOURCE_EXHAUSTED` | `body-too-large` |
//! | store unreachable (fail-closed) | `UNAVAILABLE`, with `retry-after` | `store-unavailable` |
//! | store failure, unreadable record | `INTERNAL` | `store-error`, `stored-response-unreadable` |
//!
//! The `grpc-message` speaks of calls, metadata and answers
//! (``/shop.Orders/Create requires `idempotency-key` metadata with a unique
//! key per call``). The in-progress pushback is the time the running call has
//! left as well as the layer can tell (see
//! [`in_progress_retry_after`](crate::IdempotencyLayer::in_progress_retry_after)),
//! in milliseconds, and `retry-after` the same in whole seconds, rounded up:
//! a client whose retry policy honours `grpc-retry-pushback-ms` (gRPC's retry
//! design lets it override the backoff) comes back when the call should be
//! done rather than spending its few attempts at once. A layer's
//! [`problem_responder`](crate::IdempotencyLayer::problem_responder) does not
//! apply: gRPC clients read the status and message from trailers.
//!
//! Stored answers: `OK` and the deterministic client errors `INVALID_ARGUMENT`,
//! `FAILED_PRECONDITION` and `OUT_OF_RANGE` (the same request fails the same
//! way again). Every other status (`UNAVAILABLE`, `INTERNAL`, `UNAUTHENTICATED`,
//! `NOT_FOUND`, …) leaves the key free for a retry, like 5xx and 401/403/404
//! in HTTP. Widen or narrow the list with
//! [`IdempotencyLayer::store_grpc_status_if`](crate::IdempotencyLayer::store_grpc_status_if).
//! The status is only known at the end of the answer: an answer larger than
//! the cache cap is read to its trailers (in memory, as tonic already holds a
//! unary message) before the layer decides, and a stored one is then kept
//! without its message (a retry gets `response-not-retained`). That read is
//! bounded: past 64 MiB, or shortly before the key's lease ends (a tenth of
//! the processing timeout, at most a second, before it; each lease extension
//! confirmed moves that point), the layer stops waiting, passes the rest
//! through, and keeps the key with its status unknown: the method ran, so a
//! retry is refused rather than run again. An answer whose body fails before
//! its status is kept the same way.
//!
//! **Streaming methods are left alone** unless named with
//! [`IdempotencyLayer::route`](crate::IdempotencyLayer::route): a stream is not one answer. Replaying it
//! means storing every message (up to the cache cap) before the first replay
//! can start; fingerprinting a client stream means reading all of it first;
//! and the key's lease is held for as long as the stream lasts; an opted-in
//! stream is read to its end (its final status decides) before the client
//! sees it. Protect the unary call that starts the work instead.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::{HeaderMap, Response};
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

use crate::body::IdempotencyBody;
use crate::problem::{retry_after_secs, Problem, ProblemKind};

/// gRPC status codes the layer answers or stores (the numbering of the gRPC
/// specification, as `tonic::Code` has it).
pub mod code {
    /// Success.
    pub const OK: i32 = 0;
    /// The request is malformed.
    pub const INVALID_ARGUMENT: i32 = 3;
    /// A resource (here: the request's size) is exhausted.
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    /// The system is not in the state the request needs.
    pub const FAILED_PRECONDITION: i32 = 9;
    /// A concurrency conflict: retry later.
    pub const ABORTED: i32 = 10;
    /// Out of the valid range.
    pub const OUT_OF_RANGE: i32 = 11;
    /// An internal error.
    pub const INTERNAL: i32 = 13;
    /// Transiently unavailable: retry.
    pub const UNAVAILABLE: i32 = 14;
}

/// The metadata entry naming the layer's own answers (the problem's slug).
pub const IDEMPOTENCY_PROBLEM: HeaderName = HeaderName::from_static("idempotency-problem");

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// What gRPC's `grpc-message` must percent-encode: controls, non-ASCII (always
/// encoded by `utf8_percent_encode`) and `%` itself.
const GRPC_MESSAGE_SET: &AsciiSet = &CONTROLS.add(b'%');

/// The language a layer answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// HTTP statuses and problem documents (RFC 9457).
    Http,
    /// gRPC statuses in trailers-only responses.
    Grpc,
}

impl Dialect {
    /// Whether a response with this head may still be stored once its body is
    /// read (HTTP: the head predicate already decided; gRPC: a trailers-only
    /// answer carries its final status in the head, anything else waits for
    /// its trailers).
    pub(crate) fn may_store_head(self, head: &HeaderMap, stored: &GrpcStatusFilter) -> bool {
        match self {
            Dialect::Http => true,
            Dialect::Grpc => grpc_status(Some(head)).is_none_or(|code| stored(code)),
        }
    }

    /// Whether a complete response with this head and these trailers is
    /// stored (gRPC: by its final `grpc-status`, in the trailers or, for a
    /// trailers-only response, in the head; a response without one is a
    /// broken stream and never stored; HTTP: the head already decided).
    pub(crate) fn stores_complete(
        self,
        head: &HeaderMap,
        trailers: Option<&HeaderMap>,
        stored: &GrpcStatusFilter,
    ) -> bool {
        match self {
            Dialect::Http => true,
            Dialect::Grpc => final_grpc_status(head, trailers).is_some_and(|code| stored(code)),
        }
    }

    /// What a record whose response was not retained keeps to name the
    /// outcome in later answers: nothing in HTTP (the status is kept anyway),
    /// the final `grpc-status` in gRPC.
    pub(crate) fn outcome_trailers(
        self,
        head: &HeaderMap,
        trailers: Option<&HeaderMap>,
    ) -> Option<HeaderMap> {
        match self {
            Dialect::Http => None,
            Dialect::Grpc => final_grpc_status(head, trailers).map(|code| {
                let mut kept = HeaderMap::new();
                kept.insert(GRPC_STATUS, HeaderValue::from(code));
                kept
            }),
        }
    }

    /// The outcome of a processed request, as answers name it: `status 201`,
    /// or `grpc-status 0`.
    pub(crate) fn outcome(
        self,
        status: http::StatusCode,
        head: &HeaderMap,
        trailers: Option<&HeaderMap>,
    ) -> String {
        match (self, final_grpc_status(head, trailers)) {
            (Dialect::Grpc, Some(code)) => format!("grpc-status {code}"),
            (Dialect::Grpc, None) => "grpc-status unknown".to_owned(),
            (Dialect::Http, _) => format!("status {}", status.as_u16()),
        }
    }
}

/// Which final gRPC statuses a gRPC layer stores
/// ([`IdempotencyLayer::store_grpc_status_if`](crate::IdempotencyLayer::store_grpc_status_if)).
pub(crate) type GrpcStatusFilter = std::sync::Arc<dyn Fn(i32) -> bool + Send + Sync>;

/// The `grpc-status` of a header or trailer map.
fn grpc_status(map: Option<&HeaderMap>) -> Option<i32> {
    map?.get(GRPC_STATUS)?.to_str().ok()?.parse().ok()
}

/// The final status of a response: the trailers', or the head's for a
/// trailers-only response.
fn final_grpc_status(head: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<i32> {
    grpc_status(trailers).or_else(|| grpc_status(Some(head)))
}

/// Whether a gRPC status is stored by default: `OK`, `INVALID_ARGUMENT`,
/// `FAILED_PRECONDITION`, `OUT_OF_RANGE`.
///
/// ```
/// use idempotency_http::grpc::{code, is_grpc_stored_by_default};
/// assert!(is_grpc_stored_by_default(code::OK));
/// assert!(is_grpc_stored_by_default(code::INVALID_ARGUMENT));
/// assert!(!is_grpc_stored_by_default(code::UNAVAILABLE));
/// ```
pub fn is_grpc_stored_by_default(code: i32) -> bool {
    matches!(
        code,
        code::OK | code::INVALID_ARGUMENT | code::FAILED_PRECONDITION | code::OUT_OF_RANGE
    )
}

impl ProblemKind {
    /// The gRPC status code of the answer (see the [module docs](self)).
    ///
    /// ```
    /// use idempotency_http::{grpc::code, ProblemKind};
    /// assert_eq!(ProblemKind::InProgress.grpc_code(), code::ABORTED);
    /// ```
    pub fn grpc_code(self) -> i32 {
        match self {
            ProblemKind::MissingKey | ProblemKind::InvalidKey | ProblemKind::UnreadableBody => {
                code::INVALID_ARGUMENT
            }
            ProblemKind::InProgress => code::ABORTED,
            ProblemKind::KeyReused | ProblemKind::ResponseNotRetained => code::FAILED_PRECONDITION,
            ProblemKind::BodyTooLarge => code::RESOURCE_EXHAUSTED,
            ProblemKind::StoredResponseUnreadable | ProblemKind::StoreError => code::INTERNAL,
            ProblemKind::StoreUnavailable => code::UNAVAILABLE,
        }
    }
}

impl Problem {
    /// The problem as a trailers-only gRPC response.
    pub(crate) fn into_grpc_response<B>(self) -> Response<IdempotencyBody<B>> {
        let mut response = Response::new(IdempotencyBody::full(Bytes::new(), None));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(GRPC_STATUS, HeaderValue::from(self.kind().grpc_code()));
        let message = utf8_percent_encode(self.detail(), GRPC_MESSAGE_SET).to_string();
        if let Ok(message) = HeaderValue::from_str(&message) {
            headers.insert(GRPC_MESSAGE, message);
        }
        headers.insert(
            IDEMPOTENCY_PROBLEM,
            HeaderValue::from_static(self.kind().slug()),
        );
        if let Some(after) = self.retry_after() {
            headers.insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(after)),
            );
            headers.insert(GRPC_PUSHBACK, HeaderValue::from(pushback_ms(after)));
        }
        response
    }
}

fn pushback_ms(after: Duration) -> u64 {
    u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(feature = "tonic")]
pub use self::tonic_layer::{TonicIdempotency, TonicLayer};

#[cfg(feature = "tonic")]
mod tonic_layer {
    use std::task::{Context, Poll};

    use http::Request;
    use tower::{Layer, Service};

    use crate::body::IdempotencyBody;
    use crate::layer::{Idempotency, IdempotencyLayer};

    /// [`IdempotencyLayer`] for `tonic::transport::Server::layer`: tonic's
    /// services take `tonic::body::Body`, so the layer's request body is
    /// handed to them as one. Made by [`IdempotencyLayer::tonic`](crate::IdempotencyLayer::tonic).
    #[derive(Debug, Clone)]
    pub struct TonicLayer(pub(crate) IdempotencyLayer);

    impl<S> Layer<S> for TonicLayer {
        type Service = Idempotency<TonicIdempotency<S>>;

        fn layer(&self, inner: S) -> Self::Service {
            self.0.layer(TonicIdempotency(inner))
        }
    }

    /// A tonic service behind the layer (see [`TonicLayer`]).
    #[derive(Debug, Clone)]
    pub struct TonicIdempotency<S>(S);

    impl<S, B> Service<Request<IdempotencyBody<B>>> for TonicIdempotency<S>
    where
        S: Service<Request<tonic::body::Body>>,
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<idempotency_core::BoxError>,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = S::Future;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            self.0.poll_ready(cx)
        }

        fn call(&mut self, request: Request<IdempotencyBody<B>>) -> Self::Future {
            self.0.call(request.map(tonic::body::Body::new))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| (HeaderName::from_static(n), HeaderValue::from_static(v)))
            .collect()
    }

    #[test]
    fn the_final_status_decides_what_is_stored() {
        let ok = headers(&[("grpc-status", "0")]);
        let unavailable = headers(&[("grpc-status", "14")]);
        let invalid = headers(&[("grpc-status", "3")]);
        let head = headers(&[("content-type", "application/grpc")]);
        let by_default: GrpcStatusFilter = std::sync::Arc::new(is_grpc_stored_by_default);
        let stores = |head: &HeaderMap, trailers: Option<&HeaderMap>| {
            Dialect::Grpc.stores_complete(head, trailers, &by_default)
        };
        assert!(stores(&head, Some(&ok)));
        assert!(!stores(&head, Some(&unavailable)));
        // Trailers-only: the status is in the head.
        assert!(stores(&invalid, None));
        assert!(!stores(&unavailable, None));
        // No status anywhere (a broken stream): not an answer to keep.
        assert!(!stores(&head, None));
        // The trailers' status wins over a head's.
        assert!(!stores(&ok, Some(&unavailable)));
        assert!(Dialect::Http.stores_complete(&head, None, &by_default));
        // Before the body: only a trailers-only head can rule storing out.
        assert!(Dialect::Grpc.may_store_head(&head, &by_default));
        assert!(!Dialect::Grpc.may_store_head(&unavailable, &by_default));
    }

    #[test]
    fn a_wider_filter_stores_more_statuses() {
        let not_found = headers(&[("grpc-status", "5")]);
        let head = headers(&[("content-type", "application/grpc")]);
        let with_not_found: GrpcStatusFilter =
            std::sync::Arc::new(|code| code == 5 || is_grpc_stored_by_default(code));
        assert!(Dialect::Grpc.stores_complete(&head, Some(&not_found), &with_not_found));
        assert!(Dialect::Grpc.may_store_head(&not_found, &with_not_found));
    }

    #[test]
    fn outcomes_are_named_in_the_dialect() {
        let ok = headers(&[("grpc-status", "0")]);
        let head = headers(&[("content-type", "application/grpc")]);
        let status = http::StatusCode::OK;
        assert_eq!(
            Dialect::Grpc.outcome(status, &head, Some(&ok)),
            "grpc-status 0"
        );
        assert_eq!(
            Dialect::Grpc.outcome(status, &head, None),
            "grpc-status unknown"
        );
        assert_eq!(
            Dialect::Http.outcome(status, &head, Some(&ok)),
            "status 200"
        );
        let kept = Dialect::Grpc.outcome_trailers(&head, Some(&ok)).unwrap();
        assert_eq!(
            Dialect::Grpc.outcome(status, &HeaderMap::new(), Some(&kept)),
            "grpc-status 0"
        );
        assert!(Dialect::Http.outcome_trailers(&head, Some(&ok)).is_none());
    }

    #[test]
    fn problems_are_trailers_only_statuses_with_an_encoded_message() {
        let problem = Problem::new(ProblemKind::InProgress, "100% busy: «wait»\n")
            .with_retry_after(Duration::from_millis(1500));
        let response = problem.into_grpc_response::<http_body_util::Empty<Bytes>>();
        let h = response.headers();
        assert_eq!(response.status(), http::StatusCode::OK);
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["grpc-status"], "10");
        assert_eq!(
            h["grpc-message"], "100%25 busy: %C2%ABwait%C2%BB%0A",
            "controls, non-ASCII and % encoded"
        );
        assert_eq!(h["idempotency-problem"], "in-progress");
        assert_eq!(h["retry-after"], "2");
        assert_eq!(h["grpc-retry-pushback-ms"], "1500");
        assert!(http_body::Body::is_end_stream(response.body()));
    }
}
