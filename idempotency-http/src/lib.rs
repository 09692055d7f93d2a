//! A [`tower::Layer`] implementing the `Idempotency-Key` HTTP header (IETF
//! HTTPAPI draft "The Idempotency-Key HTTP Header Field", Stripe's idempotent
//! requests) on top of [`idempotency_core`]: a client that retries a POST after
//! a timeout gets the first response again instead of a second order.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use axum::{body::Body, routing::post, Router};
//! use http::{Request, StatusCode};
//! use http_body_util::BodyExt;
//! use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
//! use idempotency_http::IdempotencyLayer;
//! use tower::ServiceExt;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! // Any store: `idempotency::connect("redis://…")` in production.
//! let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?
//!     .scoped("http")?;
//! static ORDERS: AtomicUsize = AtomicUsize::new(0);
//! let app = Router::new()
//!     .route("/orders", post(|body: String| async move {
//!         let n = ORDERS.fetch_add(1, Ordering::SeqCst) + 1;
//!         (StatusCode::CREATED, format!("order {n}: {body}"))
//!     }))
//!     .layer(IdempotencyLayer::new(manager));
//!
//! let order = |key: &str, body: &'static str| {
//!     Request::post("/orders").header("idempotency-key", key).body(Body::from(body)).unwrap()
//! };
//!
//! // First request: the handler runs.
//! let first = app.clone().oneshot(order("k-1", "2 books")).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(first.into_body().collect().await?.to_bytes(), "order 1: 2 books");
//!
//! // The client retries: the same response, replayed; the handler does not run.
//! let retry = app.clone().oneshot(order("k-1", "2 books")).await?;
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotency-replayed"], "true");
//! assert_eq!(retry.into_body().collect().await?.to_bytes(), "order 1: 2 books");
//! assert_eq!(ORDERS.load(Ordering::SeqCst), 1);
//!
//! // The same key with another body is refused.
//! let reused = app.clone().oneshot(order("k-1", "3 books")).await?;
//! assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
//! assert_eq!(reused.headers()["content-type"], "application/problem+json");
//!
//! // POST without a key is refused; GET is not the layer's business.
//! let missing = app.clone().oneshot(Request::post("/orders").body(Body::empty())?).await?;
//! assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! # }).map_err(|e| e.to_string())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # What the layer answers
//!
//! For the protected methods (POST and PATCH by default; routes opt in or out
//! with [`IdempotencyLayer::route`] and [`IdempotencyLayer::route_method`]):
//!
//! | situation | answer | handler runs |
//! |---|---|---|
//! | first request with a key | the handler's response | yes |
//! | retry after a stored response | the stored status, headers (with the handler's sensitive marks, which keep HTTP/2 from indexing them) and body, plus `Idempotency-Replayed: true` | no |
//! | retry while the first is in flight | `409` + `Retry-After`, the time the first has left as well as the layer can tell (or wait, with the manager's `InProgressPolicy::Wait`) | no |
//! | same key, same route and method, different request (path, query string, body) | `422` | no |
//! | same key on another route or method | a record of its own (the scope below): the handler's response | yes |
//! | no key on a route that requires one | `400` | no |
//! | key empty, over 255 bytes, bad characters, repeated header | `400` | no |
//! | body over [`max_request_body`](IdempotencyLayer::max_request_body) (when fingerprinted) | `413` | no |
//! | retry after a response whose body exceeded the cache cap | `410 Gone` (`response-not-retained`, with `original_status`; no `Retry-After`: retrying never helps) | no |
//! | retry after a `5xx` (or `408`, `425`, `429`) | the handler's new response | yes, again |
//! | store unreachable, fail-closed manager (default) | `503` + `Retry-After` | no |
//! | store unreachable, fail-open manager | the handler's response, unprotected | yes |
//! | stored response unreadable (corrupt record) | `500` | no |
//! | other methods (GET, HEAD, …), [`Protection::Skip`] routes | untouched | yes |
//!
//! Every answer of the layer itself is `application/problem+json` (RFC 9457)
//! with `type`, `title`, `status` and `detail`; [`ProblemKind`] lists them.
//! An API with its own error format answers them itself with
//! [`IdempotencyLayer::problem_responder`] (the layer still adds
//! `Retry-After` where the kind carries one). The two answers a retrying
//! client must tell apart have distinct statuses: in progress is `409
//! Conflict` with `Retry-After` (the IETF draft's and Stripe's answer to a
//! concurrent request: retrying after the hint gets the replay), a response
//! that was not retained `410 Gone` without it (permanent: a client that
//! retries `409` must not retry this key).
//!
//! # The model
//!
//! - **Key**: the `Idempotency-Key` header (configurable name), as a
//!   Structured Field string (`"…"`, the draft's form) or bare (Stripe's);
//!   1–255 bytes of visible ASCII by default, plus an optional
//!   [validator](IdempotencyLayer::key_validator).
//! - **Scope**: the record id is [`record_id`]`(caller, method, route, key)`,
//!   encoded injectively, inside the manager's namespace. The route is the
//!   matched template (`/orders/{id}`, with the `axum` feature or a
//!   [route extractor](IdempotencyLayer::route_extractor)) or else the path.
//!   When no fingerprint is compared ([`RequestFingerprint::Disabled`], or
//!   a manager whose `validate_payload` is off), the request target (path and
//!   query, `/orders/42?x=1`) takes the route's place, so a key never answers
//!   one target with another's response.
//!   The [caller identity](IdempotencyLayer::caller_identity) defaults to a
//!   digest of the `Authorization` header, so clients that authenticate with
//!   it never replay one another's responses; requests without it share one
//!   anonymous scope, so an application that authenticates otherwise (a
//!   session cookie, mTLS, an API-key header) sets a caller identity that names
//!   the principal, or one client's key can answer another's request.
//!   [`without_caller_identity`](IdempotencyLayer::without_caller_identity)
//!   is the explicit opt-out.
//! - **Fingerprint**: SHA-256 over method, request target (path and query
//!   string, as sent) and body by default ([`RequestFingerprint`];
//!   `MethodPathJsonBody` compares JSON bodies by their lossless canonical
//!   form), stored with the record; a different request under the same key is
//!   a `422`. Every mode covers the target, so a key reused on another
//!   resource of the route (`/accounts/2/charge` after `/accounts/1/charge`)
//!   or with another query string (`?to=bob` after `?to=alice`) is refused,
//!   never answered with the first response; `?a=1&b=2` and `?b=2&a=1` are
//!   two targets (raw bytes: a handler can tell them apart).
//! - **State machine**: the manager's ([`idempotency_core::IdempotencyManager`]):
//!   one request acquires the key with a lease, every concurrent duplicate gets
//!   `409` (or waits), a request whose lease ran out (crashed instance) is taken
//!   over with a new fencing token, records expire after the manager's `ttl`.
//!   If the client disconnects (the response future is dropped), the handler
//!   runs to the end on its own task and its response is stored for the
//!   retry; if the handler panics, the key is released (like a `500`, whatever
//!   the manager's failure policy), so the retry runs it. A response body
//!   that panics after its head is handled as one that fails (below): the
//!   handler ran, so the key is kept.
//! - **What is stored**: the status, the [selected headers](HeaderSelection)
//!   (all but hop-by-hop, `Content-Length`, `Date` and `Set-Cookie` by
//!   default), the body and any trailers, in a compact binary form, when
//!   [the response is stored](is_stored_by_default) (2xx, 400 and 422 by
//!   default). A body is read up to the cap
//!   ([`max_cached_body`](IdempotencyLayer::max_cached_body), the manager's
//!   `max_result_size_bytes` and the store's limit, whichever is smallest); a
//!   larger one, or one still coming shortly before the lease ends (with lease
//!   extension on, each extension confirmed moves that deadline), streams through to
//!   the first client, the key completes without it, and retries get
//!   `410 response-not-retained`, so the handler still runs once. So does a
//!   server-sent event stream (`text/event-stream`), streamed through at once
//!   rather than held back until it ends (it may never end). Responses that are not stored release the key, and so does
//!   a `4xx` to a request whose body failed while the inner service read it
//!   (an upload cut short, under a fingerprint that does not read the body),
//!   also when its head came first and the upload failed while its body was
//!   read: it answers the broken transfer, not the request. A response body that
//!   fails while it is read is kept as not retained (the handler ran; a retry
//!   is refused, not run again), unless the request body had failed first;
//!   the first client gets the bytes that came without a length that would
//!   make them look whole, so its transport reports the cut. One gap: a
//!   response that had already streamed past the cap was recorded as not
//!   retained when it passed it, so an upload it proxies that fails later
//!   does not release the key (the full retry gets `410` too); under
//!   `MethodPath`, keep streamed uploads' responses below the cap, or let the
//!   client use a new key after a cut upload.
//!
//! # Frameworks
//!
//! One [`IdempotencyLayer`], one behaviour, in every framework:
//!
//! | framework | setup | example server |
//! |---|---|---|
//! | axum, hyper, any tower HTTP service | `Router::new().route(…).layer(IdempotencyLayer::new(manager))` | `examples/http-server` |
//! | actix-web (feature `actix`) | `App::new().wrap(IdempotencyLayer::new(manager)).route(…)` (see [`actix`]) | `examples/actix-server` |
//! | tonic, gRPC (feature `tonic`) | `Server::builder().layer(IdempotencyLayer::grpc(manager).unary("/shop.Orders/Create").tonic())` (see [`grpc`]) | `examples/grpc-server` |
//!
//! actix-web's services are not `Send`; its middleware runs the same code as
//! the tower layer, with the handler detached on the worker's thread instead
//! of a task of its own. gRPC answers with gRPC statuses instead of problem
//! documents and protects only the unary methods it is told about.
//!
//! # Services
//!
//! The layer works with any `tower::Service<http::Request<B>>` whose body has
//! [`Bytes`](bytes::Bytes) data — axum routers (`Router::layer` puts it behind
//! routing, where `MatchedPath` is known), hyper services, tonic services
//! (through [`IdempotencyLayer::tonic`], which hands them their own body
//! type). The inner service receives `Request<IdempotencyBody<B>>`.
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
//! use idempotency_http::{IdempotencyBody, IdempotencyLayer};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
//! let service = IdempotencyLayer::new(manager).layer(service_fn(
//!     |request: Request<IdempotencyBody<Full<Bytes>>>| async move {
//!         let body = request.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
//!         Ok::<_, String>(Response::new(Full::new(body)))
//!     },
//! ));
//! let request = Request::post("/echo")
//!     .header("idempotency-key", "\"structured-field-form\"")
//!     .body(Full::new(Bytes::from("hello")))?;
//! let response = service.oneshot(request).await?;
//! assert_eq!(response.status(), StatusCode::OK);
//! assert_eq!(response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes(), "hello");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).map_err(|e| e.to_string())?;
//! # let _ = std::marker::PhantomData::<Infallible>;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Cargo features
//!
//! | feature | effect |
//! |---|---|
//! | `axum` | without a custom route extractor, scope records by axum's `MatchedPath` (the route template) when the request carries it |
//! | `actix` | [`IdempotencyLayer`] is actix-web middleware ([`actix`]); the route is actix's matched pattern |
//! | `tonic` | [`IdempotencyLayer::tonic`]: the gRPC layer for `tonic::transport::Server::layer` ([`grpc`]) |
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "actix")]
#[cfg_attr(docsrs, doc(cfg(feature = "actix")))]
pub mod actix;
mod answers;
mod body;
mod fingerprint;
pub mod grpc;
mod in_progress;
mod key;
mod layer;
mod problem;
mod service;
mod stored;

pub use body::IdempotencyBody;
pub use fingerprint::{FingerprintFn, RequestFingerprint};
/// The `http` crate (1.x) the layer's types come from: actix-web users, whose
/// framework uses `http` 0.2, name headers for the layer with it.
pub use http;
pub use in_progress::MIN_IN_PROGRESS_RETRY;
pub use key::{
    caller_from_header, parse_record_id, record_id, CallerFn, KeyError, RecordIdParts,
    DEFAULT_MAX_KEY_LENGTH,
};
pub use layer::{
    is_stored_by_default, HeaderSelection, Idempotency, IdempotencyLayer, KeyValidator, Protection,
    RouteFn, StorePredicate, DEFAULT_MAX_CACHED_BODY, DEFAULT_MAX_REQUEST_BODY, IDEMPOTENCY_KEY,
    IDEMPOTENCY_REPLAYED,
};
pub use problem::{Problem, ProblemKind, ProblemResponder, DEFAULT_PROBLEM_TYPE_BASE};
pub use stored::{FormatError as StoredResponseError, StoredResponse};
