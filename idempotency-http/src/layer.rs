//! The layer, its configuration, and the service it wraps around handlers.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::header::{self, HeaderName};
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::Body;
use idempotency_core::{BoxError, Codec, IdempotencyManager};
use tower::{Layer, Service};

use crate::body::IdempotencyBody;
use crate::fingerprint::RequestFingerprint;
use crate::grpc::{Dialect, GrpcStatusFilter};
use crate::key::{caller_from_header, CallerFn, DEFAULT_MAX_KEY_LENGTH};
use crate::problem::{Problem, ProblemResponder, DEFAULT_PROBLEM_TYPE_BASE};
use crate::stored::RawBytesCodec;

/// The default request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The default response header marking a replay (`Idempotency-Replayed: true`).
pub const IDEMPOTENCY_REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// The default cap on a request body read to fingerprint it: 2 MiB, axum's
/// default body limit.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;

/// The default cap on a response body kept for replays: 1 MiB (the manager's
/// default `max_result_size_bytes`; the smaller of the two applies).
pub const DEFAULT_MAX_CACHED_BODY: usize = 1024 * 1024;

/// How a route treats the `Idempotency-Key` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Protection {
    /// A request without a key is refused with `400` (the default for the
    /// configured methods).
    Required,
    /// A request with a key is protected; one without passes through
    /// unprotected.
    Optional,
    /// The layer does nothing: the request passes through untouched, key or
    /// not.
    Skip,
}

/// Which response headers are stored and replayed.
///
/// Hop-by-hop headers (`Connection`, `Keep-Alive`, `Proxy-Connection`,
/// `Proxy-Authenticate`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`),
/// `Content-Length` (recomputed from the stored body), `Date` (a replay is
/// answered now) and the replay marker are never stored, whatever the selection.
///
/// ```
/// use http::header::{HeaderName, LOCATION, CONTENT_TYPE};
/// use idempotency_http::HeaderSelection;
///
/// let default = HeaderSelection::default();
/// assert!(default.keeps(&LOCATION));
/// assert!(!default.keeps(&http::header::SET_COOKIE));
/// let only = HeaderSelection::Only(vec![CONTENT_TYPE, LOCATION]);
/// assert!(!only.keeps(&HeaderName::from_static("x-request-id")));
/// assert!(!only.keeps(&http::header::CONTENT_LENGTH));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderSelection {
    /// Every header except these (default: `Set-Cookie`, so a replay never
    /// hands out the first response's session).
    Except(Vec<HeaderName>),
    /// Only these headers.
    Only(Vec<HeaderName>),
}

impl Default for HeaderSelection {
    fn default() -> Self {
        HeaderSelection::Except(vec![header::SET_COOKIE])
    }
}

const NEVER_STORED: [HeaderName; 10] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::CONTENT_LENGTH,
    header::DATE,
];

impl HeaderSelection {
    /// Whether a header of this name is stored (before the layer also drops
    /// its replay marker).
    pub fn keeps(&self, name: &HeaderName) -> bool {
        if NEVER_STORED.contains(name) {
            return false;
        }
        match self {
            HeaderSelection::Except(names) => !names.contains(name),
            HeaderSelection::Only(names) => names.contains(name),
        }
    }
}

/// Whether a response is stored by default: what a retry of the same request
/// must see again, and nothing else.
///
/// - **2xx**: the request's effect happened; a retry must not repeat it.
/// - **`400 Bad Request`** and **`422 Unprocessable Content`**: the request
///   itself is wrong (malformed, failed validation); the same bytes get the same
///   answer, so replaying it is exact, and the key stays bound to the request.
///
/// Everything else leaves the key free, so the client's retry runs the handler
/// again: 3xx; `401`/`403` (the client may fix its credentials), `404`/`409`/
/// `410` (the resource's state may change), `408`/`425`/`429` ("retry later");
/// and 5xx. Choose otherwise with
/// [`IdempotencyLayer::store_response_if`].
///
/// ```
/// use http::StatusCode;
/// use idempotency_http::is_stored_by_default;
///
/// assert!(is_stored_by_default(StatusCode::CREATED));
/// assert!(is_stored_by_default(StatusCode::BAD_REQUEST));
/// assert!(is_stored_by_default(StatusCode::UNPROCESSABLE_ENTITY));
/// assert!(!is_stored_by_default(StatusCode::UNAUTHORIZED));
/// assert!(!is_stored_by_default(StatusCode::NOT_FOUND));
/// assert!(!is_stored_by_default(StatusCode::CONFLICT));
/// assert!(!is_stored_by_default(StatusCode::TOO_MANY_REQUESTS));
/// assert!(!is_stored_by_default(StatusCode::SERVICE_UNAVAILABLE));
/// ```
pub fn is_stored_by_default(status: StatusCode) -> bool {
    status.is_success()
        || matches!(
            status,
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY
        )
}

/// Decides from a response's head whether it is stored.
pub type StorePredicate = Arc<dyn Fn(&http::response::Parts) -> bool + Send + Sync>;
/// Names the route of a request (its template, e.g. `/orders/{id}`).
pub type RouteFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;
/// Checks a syntactically valid key further (e.g. "must be a UUID").
pub type KeyValidator = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

#[derive(Debug, Clone)]
struct RouteRule {
    method: Option<Method>,
    route: String,
    protection: Protection,
}

#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) manager: IdempotencyManager<RawBytesCodec>,
    /// The largest stored response the manager and the store accept.
    pub(crate) store_limit: usize,
    pub(crate) header: HeaderName,
    pub(crate) replayed_header: HeaderName,
    methods: Vec<Method>,
    default_protection: Protection,
    rules: Vec<RouteRule>,
    route_fn: Option<RouteFn>,
    pub(crate) caller_fn: Option<CallerFn>,
    /// The caller named from actix's own request, where the app's
    /// middleware left its extensions (see `actix_caller_identity`).
    #[cfg(feature = "actix")]
    pub(crate) actix_caller: Option<crate::actix::ActixCallerFn>,
    pub(crate) fingerprint: RequestFingerprint,
    pub(crate) max_key_length: usize,
    pub(crate) key_validator: Option<KeyValidator>,
    pub(crate) max_request_body: usize,
    pub(crate) max_cached_body: usize,
    pub(crate) store_if: StorePredicate,
    /// The final gRPC statuses stored (gRPC layers only).
    pub(crate) grpc_store_if: GrpcStatusFilter,
    pub(crate) stored_headers: HeaderSelection,
    pub(crate) problem_type_base: Arc<str>,
    /// The API's own answers to problems (HTTP only; problem+json without).
    pub(crate) problem_responder: Option<ProblemResponder>,
    pub(crate) outage_retry_after: Duration,
    pub(crate) in_progress_retry_after: Duration,
    pub(crate) dialect: Dialect,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("manager", &self.manager)
            .field("header", &self.header)
            .field("replayed_header", &self.replayed_header)
            .field("methods", &self.methods)
            .field("default_protection", &self.default_protection)
            .field("rules", &self.rules)
            .field("route_fn", &self.route_fn.is_some())
            .field("caller_fn", &self.caller_fn.is_some())
            .field("fingerprint", &self.fingerprint)
            .field("max_key_length", &self.max_key_length)
            .field("key_validator", &self.key_validator.is_some())
            .field("max_request_body", &self.max_request_body)
            .field("max_cached_body", &self.max_cached_body)
            .field("store_limit", &self.store_limit)
            .field("stored_headers", &self.stored_headers)
            .field("problem_type_base", &self.problem_type_base)
            .field("problem_responder", &self.problem_responder.is_some())
            .field("outage_retry_after", &self.outage_retry_after)
            .field("in_progress_retry_after", &self.in_progress_retry_after)
            .field("dialect", &self.dialect)
            .finish()
    }
}

/// The route template a framework matched (actix-web's `match_pattern`),
/// carried to [`Settings::route_of`] in the request's extensions.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "actix"), allow(dead_code))]
pub(crate) struct MatchedRoute(pub(crate) String);

impl Settings {
    pub(crate) fn route_of(&self, parts: &Parts) -> String {
        if let Some(route) = self.route_fn.as_ref().and_then(|f| f(parts)) {
            return route;
        }
        if let Some(MatchedRoute(route)) = parts.extensions.get::<MatchedRoute>() {
            return route.clone();
        }
        #[cfg(feature = "axum")]
        if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
            return matched.as_str().to_owned();
        }
        parts.uri.path().to_owned()
    }

    /// The one place the caller policy is set: a new one replaces any other,
    /// the actix-side one included.
    pub(crate) fn set_caller(&mut self, caller: Option<CallerFn>) {
        self.caller_fn = caller;
        #[cfg(feature = "actix")]
        {
            self.actix_caller = None;
        }
    }

    /// Whether a request is surely unprotected, judged on its method and a
    /// route found without its `http` parts (a framework's matched pattern,
    /// or its path): only when no route extractor is set.
    #[cfg_attr(not(feature = "actix"), allow(dead_code))]
    pub(crate) fn skips(&self, method: &Method, route: &str) -> bool {
        self.route_fn.is_none() && self.protection(method, route) == Protection::Skip
    }

    pub(crate) fn protection(&self, method: &Method, route: &str) -> Protection {
        let mut route_wide = None;
        for rule in self.rules.iter().rev().filter(|r| r.route == route) {
            match &rule.method {
                Some(m) if m == method => return rule.protection,
                Some(_) => {}
                None => {
                    route_wide.get_or_insert(rule.protection);
                }
            }
        }
        if !self.methods.contains(method) {
            return Protection::Skip;
        }
        route_wide.unwrap_or(self.default_protection)
    }

    pub(crate) fn select_headers(&self, headers: &HeaderMap) -> HeaderMap {
        let mut kept = HeaderMap::new();
        for (name, value) in headers {
            if *name != self.replayed_header && self.stored_headers.keeps(name) {
                kept.append(name.clone(), value.clone());
            }
        }
        kept
    }

    /// The answer to a problem: the responder's or a problem document in
    /// HTTP, a trailers-only status in gRPC.
    pub(crate) fn problem<B>(&self, problem: Problem) -> Response<IdempotencyBody<B>> {
        let problem = problem.with_type_base(self.problem_type_base.clone());
        match self.dialect {
            Dialect::Http => problem.into_response(self.problem_responder.as_ref()),
            Dialect::Grpc => problem.into_grpc_response(),
        }
    }
}

/// A [`tower::Layer`] that makes non-idempotent HTTP requests idempotent with
/// the `Idempotency-Key` header (see the [crate docs](crate) for the
/// semantics and status codes).
///
/// Cheap to clone; every service it builds shares the manager and the
/// configuration.
///
/// ```
/// use std::sync::Arc;
/// use http::{header::HeaderName, Method};
/// use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
/// use idempotency_http::{caller_from_header, IdempotencyLayer, Protection, RequestFingerprint};
///
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?
///     .scoped("http")?;
/// let layer = IdempotencyLayer::new(manager)
///     .methods([Method::POST, Method::PATCH])               // the default
///     .caller_identity(caller_from_header(HeaderName::from_static("x-api-key")))
///     .route("/search", Protection::Skip)                   // a read-only POST
///     .route_method(Method::PUT, "/documents/{id}", Protection::Optional) // opt a PUT in
///     .fingerprint(RequestFingerprint::MethodPathBody)      // the default
///     .max_cached_body(256 * 1024);
///
/// assert_eq!(layer.protection(&Method::POST, "/orders"), Protection::Required);
/// assert_eq!(layer.protection(&Method::POST, "/search"), Protection::Skip);
/// assert_eq!(layer.protection(&Method::PUT, "/documents/{id}"), Protection::Optional);
/// assert_eq!(layer.protection(&Method::GET, "/orders"), Protection::Skip);
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    settings: Arc<Settings>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.settings.fmt(f)
    }
}

impl IdempotencyLayer {
    /// A layer over `manager`, with the defaults: `Idempotency-Key` required on
    /// POST and PATCH, fingerprint over method, path and body, 2xx, 400 and
    /// 422 responses stored (see [`is_stored_by_default`]) up to 1 MiB of
    /// body.
    ///
    /// The manager's [`Config`](idempotency_core::Config) still decides the
    /// replay window (`ttl`), the lease (`processing_timeout`, optionally
    /// extended), waiting for an in-flight duplicate instead of answering 409
    /// (`in_progress`), the store-outage policy (`on_store_outage`), whether
    /// payloads are compared (`validate_payload`) and the largest stored
    /// response (`max_result_size_bytes`, and the store's own limit). Its
    /// result codec is replaced by the layer's compact binary response format;
    /// give it a scope of its own (`manager.scoped("http")`) so HTTP records
    /// never meet a consumer's.
    pub fn new<C: Codec + Clone>(manager: IdempotencyManager<C>) -> Self {
        let manager = manager.with_codec(RawBytesCodec);
        if let Err(e) = manager.record_key("probe") {
            tracing::error!(
                error = %e,
                "the manager's namespace is unusable: every protected request will get 500"
            );
        }
        let config = manager.config();
        let store_limit = if config.cache_results {
            let store = manager
                .repository()
                .capabilities()
                .max_result_bytes
                .unwrap_or(usize::MAX);
            config.max_result_size_bytes.min(store)
        } else {
            tracing::warn!(
                "the manager's cache_results is off: no response can be replayed, every \
                 duplicate will get 410 response-not-retained"
            );
            0
        };
        IdempotencyLayer {
            settings: Arc::new(Settings {
                manager,
                store_limit,
                header: IDEMPOTENCY_KEY,
                replayed_header: IDEMPOTENCY_REPLAYED,
                methods: vec![Method::POST, Method::PATCH],
                default_protection: Protection::Required,
                rules: Vec::new(),
                route_fn: None,
                caller_fn: Some(Arc::new(caller_from_header(http::header::AUTHORIZATION))),
                #[cfg(feature = "actix")]
                actix_caller: None,
                fingerprint: RequestFingerprint::default(),
                max_key_length: DEFAULT_MAX_KEY_LENGTH,
                key_validator: None,
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                max_cached_body: DEFAULT_MAX_CACHED_BODY,
                store_if: Arc::new(|head: &http::response::Parts| {
                    is_stored_by_default(head.status)
                }),
                stored_headers: HeaderSelection::default(),
                problem_type_base: Arc::from(DEFAULT_PROBLEM_TYPE_BASE),
                problem_responder: None,
                outage_retry_after: Duration::from_secs(1),
                in_progress_retry_after: Duration::from_secs(1),
                dialect: Dialect::Http,
                grpc_store_if: Arc::new(crate::grpc::is_grpc_stored_by_default),
            }),
        }
    }

    /// A layer for gRPC services over `manager` (see [`crate::grpc`]): the key
    /// from the `idempotency-key` metadata entry, answers as gRPC statuses,
    /// `OK` and the deterministic client errors stored, caller identity from
    /// the `authorization` metadata entry; no method is protected until it is
    /// named with [`unary`](Self::unary). With the feature `tonic`, hand it to
    /// tonic's server with [`tonic`](Self::tonic).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use http::Method;
    /// use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// use idempotency_http::{IdempotencyLayer, Protection};
    ///
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?
    ///     .scoped("grpc")?;
    /// let layer = IdempotencyLayer::grpc(manager).unary("/shop.Orders/Create");
    /// assert_eq!(layer.protection(&Method::POST, "/shop.Orders/Create"), Protection::Required);
    /// assert_eq!(layer.protection(&Method::POST, "/shop.Orders/Watch"), Protection::Skip);
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn grpc<C: Codec + Clone>(manager: IdempotencyManager<C>) -> Self {
        IdempotencyLayer::new(manager)
            .methods([Method::POST])
            .default_protection(Protection::Skip)
            // gRPC answers HTTP 200; anything else is a proxy's or the
            // transport's error. The final `grpc-status` decides the rest.
            .store_response_if(|head| head.status == http::StatusCode::OK)
            .edit(|s| s.dialect = Dialect::Grpc)
    }

    /// Protects the unary gRPC method at `path` (`/package.Service/Method`):
    /// calls without an `idempotency-key` are refused with `INVALID_ARGUMENT`.
    /// Use [`route`](Self::route) with [`Protection::Optional`] to protect
    /// only the calls that carry a key.
    pub fn unary(self, path: impl Into<String>) -> Self {
        self.route(path, Protection::Required)
    }

    /// The layer for `tonic::transport::Server::layer` (feature `tonic`).
    #[cfg(feature = "tonic")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
    pub fn tonic(self) -> crate::grpc::TonicLayer {
        crate::grpc::TonicLayer(self)
    }

    pub(crate) fn edit(mut self, f: impl FnOnce(&mut Settings)) -> Self {
        f(Arc::make_mut(&mut self.settings));
        self
    }

    /// The request header carrying the key (default [`IDEMPOTENCY_KEY`]).
    pub fn header(self, name: HeaderName) -> Self {
        self.edit(|s| s.header = name)
    }

    /// The response header set to `true` on replays (default
    /// [`IDEMPOTENCY_REPLAYED`], `Idempotency-Replayed`; Stripe's clients read
    /// `Idempotent-Replayed`). A header of that name in a handler's response
    /// is never stored.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// # use idempotency_http::IdempotencyLayer;
    /// # let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// let layer = IdempotencyLayer::new(manager)
    ///     .replayed_header(http::HeaderName::from_static("idempotent-replayed"));
    /// # let _ = layer;
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn replayed_header(self, name: HeaderName) -> Self {
        self.edit(|s| s.replayed_header = name)
    }

    /// The methods the layer protects (default POST and PATCH). Others pass
    /// through untouched unless a [`route_method`](Self::route_method) rule
    /// opts them in.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.edit(|s| s.methods = methods.into_iter().collect())
    }

    /// How routes without a rule treat the key, for the configured methods
    /// (default [`Protection::Required`]). Set [`Protection::Skip`] and opt
    /// routes in with [`route`](Self::route) to protect only some.
    pub fn default_protection(self, protection: Protection) -> Self {
        self.edit(|s| s.default_protection = protection)
    }

    /// The protection of `route` (as the route extractor names it: the
    /// matched template with the `axum` feature or a custom
    /// [`route_extractor`](Self::route_extractor), else the path) for the
    /// configured methods. Later rules override earlier ones.
    pub fn route(self, route: impl Into<String>, protection: Protection) -> Self {
        let route = route.into();
        self.edit(|s| {
            s.rules.push(RouteRule {
                method: None,
                route,
                protection,
            })
        })
    }

    /// The protection of `method` on `route`, whether or not `method` is one of
    /// the configured methods (opt a PUT or DELETE in, or a POST out). It
    /// takes precedence over [`route`](Self::route) rules.
    pub fn route_method(
        self,
        method: Method,
        route: impl Into<String>,
        protection: Protection,
    ) -> Self {
        let route = route.into();
        self.edit(|s| {
            s.rules.push(RouteRule {
                method: Some(method),
                route,
                protection,
            })
        })
    }

    /// How to name a request's route, for scoping records and matching rules.
    /// When it returns `None` (or none is set), the route is axum's
    /// `MatchedPath` (feature `axum`) or else the request path.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// # use idempotency_http::IdempotencyLayer;
    /// # let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// // Without the `axum` feature, read axum's matched route yourself:
    /// let layer = IdempotencyLayer::new(manager).route_extractor(|parts| {
    ///     parts
    ///         .extensions
    ///         .get::<axum::extract::MatchedPath>()
    ///         .map(|m| m.as_str().to_owned())
    /// });
    /// # let _ = layer;
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn route_extractor(
        self,
        f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|s| s.route_fn = Some(Arc::new(f)))
    }

    /// How to name the caller (tenant, account, API key digest): records are
    /// scoped by it, so one caller never receives another's response for the
    /// same key. The default is the SHA-256 of the `Authorization` header
    /// ([`caller_from_header`](crate::caller_from_header)): clients with other
    /// credentials never share a key space; requests without the header share
    /// the anonymous one. Run the layer inside your authentication and name the
    /// caller from what it established (a request extension holding the user
    /// id) when credentials rotate or several credentials belong to one tenant.
    pub fn caller_identity(
        self,
        f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|s| s.set_caller(Some(Arc::new(f))))
    }

    /// Every client shares one key space: two clients sending the same key to
    /// the same route with the same body get one execution, and the second
    /// receives the first's stored response. Only for a single trusted client
    /// (a backend calling itself); otherwise keep a caller identity.
    pub fn without_caller_identity(self) -> Self {
        self.edit(|s| s.set_caller(None))
    }

    /// Which parts of a request must match when a key is reused (default
    /// [`RequestFingerprint::MethodPathBody`]). Every mode covers the request
    /// target (path and query string) as well, so a key reused on another
    /// resource of the same route template, or with another query, is a `422`;
    /// with [`RequestFingerprint::Disabled`], records are scoped by the target
    /// instead.
    pub fn fingerprint(self, fingerprint: RequestFingerprint) -> Self {
        self.edit(|s| s.fingerprint = fingerprint)
    }

    /// The longest key accepted, in bytes (default 255).
    pub fn max_key_length(self, max: usize) -> Self {
        self.edit(|s| s.max_key_length = max)
    }

    /// A further check of syntactically valid keys; an `Err(reason)` answers
    /// `400` with the reason.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// # use idempotency_http::IdempotencyLayer;
    /// # let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// let layer = IdempotencyLayer::new(manager).key_validator(|key| {
    ///     let uuid_like = key.len() == 36 && key.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
    ///     if uuid_like { Ok(()) } else { Err("use a UUID".to_owned()) }
    /// });
    /// # let _ = layer;
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn key_validator(
        self,
        f: impl Fn(&str) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|s| s.key_validator = Some(Arc::new(f)))
    }

    /// The largest request body read to fingerprint it (default 2 MiB); a
    /// larger body is answered `413`. Irrelevant for fingerprints without the
    /// body.
    pub fn max_request_body(self, max: usize) -> Self {
        self.edit(|s| s.max_request_body = max)
    }

    /// The largest response body stored for replays (default 1 MiB; the
    /// manager's `max_result_size_bytes` and the store's limit apply too). A
    /// larger body is streamed to the first client as it comes, the key is
    /// completed without it, and later requests with the key get `410`
    /// [`ResponseNotRetained`](crate::ProblemKind::ResponseNotRetained): the
    /// handler still runs once.
    pub fn max_cached_body(self, max: usize) -> Self {
        self.edit(|s| s.max_cached_body = max)
    }

    /// Which responses are stored, by their head (default
    /// [`is_stored_by_default`] on the status). A response that is not stored
    /// releases the key, so a retry runs the handler again.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// # use idempotency_http::IdempotencyLayer;
    /// # let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// // Store successes only, and let handlers opt a response out with a header.
    /// let layer = IdempotencyLayer::new(manager).store_response_if(|head| {
    ///     head.status.is_success() && !head.headers.contains_key("x-no-replay")
    /// });
    /// # let _ = layer;
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn store_response_if(
        self,
        f: impl Fn(&http::response::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.edit(|s| s.store_if = Arc::new(f))
    }

    /// Which final `grpc-status` codes a gRPC layer ([`grpc`](Self::grpc))
    /// stores (default [`is_grpc_stored_by_default`](crate::grpc::is_grpc_stored_by_default)):
    /// judged on the trailers, or on the head of a trailers-only answer; a
    /// status that is not stored releases the key, so a retry runs the method
    /// again. HTTP layers decide with [`store_response_if`](Self::store_response_if)
    /// and ignore this.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// use idempotency_http::grpc::{code, is_grpc_stored_by_default};
    /// use idempotency_http::IdempotencyLayer;
    /// # let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// // Also keep ALREADY_EXISTS (6): this service answers it for an order
    /// // placed before, and a retry should see that answer again.
    /// let layer = IdempotencyLayer::grpc(manager)
    ///     .unary("/shop.Orders/Create")
    ///     .store_grpc_status_if(|status| status == 6 || is_grpc_stored_by_default(status));
    /// # let _ = (layer, code::OK);
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn store_grpc_status_if(self, f: impl Fn(i32) -> bool + Send + Sync + 'static) -> Self {
        self.edit(|s| s.grpc_store_if = Arc::new(f))
    }

    /// Which response headers are stored and replayed (default: all but
    /// `Set-Cookie`; see [`HeaderSelection`]).
    pub fn stored_headers(self, selection: HeaderSelection) -> Self {
        self.edit(|s| s.stored_headers = selection)
    }

    /// The `Retry-After` of the `503` answered during a store outage with a
    /// fail-closed manager (default 1 s).
    pub fn outage_retry_after(self, after: Duration) -> Self {
        self.edit(|s| s.outage_retry_after = after)
    }

    /// The longest `Retry-After` of the `409` (gRPC: `ABORTED` with
    /// `grpc-retry-pushback-ms`) answered while a request with the key is in
    /// flight (default 1 s). The hint is the time the running request has
    /// left, estimated from its record (one store read per such answer): a
    /// typical execution of the manager minus the time it has run, or this
    /// longest hint when it runs longer than usual or nothing is known yet;
    /// never past the holder's lease (after which a retry would take the key
    /// over), never below [`MIN_IN_PROGRESS_RETRY`](crate::MIN_IN_PROGRESS_RETRY)
    /// (100 ms, or this if shorter).
    pub fn in_progress_retry_after(self, after: Duration) -> Self {
        self.edit(|s| s.in_progress_retry_after = after)
    }

    /// How a request with `method` on `route` treats the key.
    pub fn protection(&self, method: &Method, route: &str) -> Protection {
        self.settings.protection(method, route)
    }

    #[cfg_attr(not(feature = "actix"), allow(dead_code))]
    pub(crate) fn settings(&self) -> Arc<Settings> {
        self.settings.clone()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency {
            inner,
            settings: self.settings.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around an inner HTTP service.
///
/// It takes `Request<B>` and calls the inner service with
/// `Request<IdempotencyBody<B>>`; it answers `Response<IdempotencyBody<R>>`.
/// Errors of the inner service are passed on (and release the key).
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("settings", &self.settings)
            .finish()
    }
}

impl<S> Idempotency<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Consumes into the wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S>
where
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResB>>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        // The ready service goes into the future; a clone stays for the next
        // call (tower's usual pattern).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(crate::service::handle::<crate::service::Threaded, _, _, _>(
            self.settings.clone(),
            inner,
            request,
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use idempotency_core::{Config, MemoryRepository};

    fn layer() -> IdempotencyLayer {
        let manager =
            IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap();
        IdempotencyLayer::new(manager)
    }

    #[test]
    fn protection_rules_resolve_by_precedence() {
        use Protection::*;
        let l = layer()
            .route("/a", Optional)
            .route("/a", Skip) // later route-wide rule wins
            .route_method(Method::POST, "/a", Required) // method rule beats route rule
            .route_method(Method::PUT, "/put", Required) // opt-in of another method
            .route("/put", Skip); // route-wide rules never opt a method in
        assert_eq!(l.protection(&Method::POST, "/a"), Required);
        assert_eq!(l.protection(&Method::PATCH, "/a"), Skip);
        assert_eq!(l.protection(&Method::PUT, "/put"), Required);
        assert_eq!(l.protection(&Method::PUT, "/other"), Skip);
        assert_eq!(l.protection(&Method::POST, "/other"), Required);
        assert_eq!(l.protection(&Method::DELETE, "/a"), Skip);

        let opt_in_only = layer()
            .default_protection(Skip)
            .route("/payments", Required);
        assert_eq!(opt_in_only.protection(&Method::POST, "/orders"), Skip);
        assert_eq!(opt_in_only.protection(&Method::POST, "/payments"), Required);
        assert_eq!(opt_in_only.protection(&Method::GET, "/payments"), Skip);

        let with_put = layer().methods([Method::PUT]);
        assert_eq!(with_put.protection(&Method::PUT, "/x"), Required);
        assert_eq!(with_put.protection(&Method::POST, "/x"), Skip);
    }

    #[test]
    fn builders_do_not_affect_clones_already_made() {
        let base = layer();
        let changed = base.clone().default_protection(Protection::Skip);
        assert_eq!(base.protection(&Method::POST, "/"), Protection::Required);
        assert_eq!(changed.protection(&Method::POST, "/"), Protection::Skip);
    }

    #[test]
    fn stored_headers_drop_hop_by_hop_and_the_marker() {
        let l = layer();
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("content-type", "application/json"),
            ("location", "/orders/1"),
            ("set-cookie", "session=1"),
            ("connection", "close"),
            ("transfer-encoding", "chunked"),
            ("content-length", "10"),
            ("date", "Sat, 21 Nov 2026 12:00:00 GMT"),
            ("idempotency-replayed", "true"),
            ("x-multi", "a"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        headers.append("x-multi", http::HeaderValue::from_static("b"));
        let kept = l.settings.select_headers(&headers);
        let names: Vec<&str> = kept.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["content-type", "location", "x-multi"]);
        assert_eq!(kept.get_all("x-multi").iter().count(), 2);

        let only = layer().stored_headers(HeaderSelection::Only(vec![header::LOCATION]));
        let kept = only.settings.select_headers(&headers);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[header::LOCATION], "/orders/1");
    }

    #[test]
    fn default_store_policy() {
        for code in [200, 201, 204, 400, 422] {
            assert!(
                is_stored_by_default(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
        for code in [
            101, 303, 401, 403, 404, 408, 409, 410, 425, 429, 500, 502, 503, 504,
        ] {
            assert!(
                !is_stored_by_default(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
    }

    #[test]
    fn store_limit_follows_config_and_store() {
        let small_store = Arc::new(MemoryRepository::new().with_max_result_bytes(1000));
        let manager = IdempotencyManager::new(small_store, Config::default()).unwrap();
        assert_eq!(IdempotencyLayer::new(manager).settings.store_limit, 1000);
        let config = Config {
            max_result_size_bytes: 500,
            ..Config::default()
        };
        let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config).unwrap();
        assert_eq!(IdempotencyLayer::new(manager).settings.store_limit, 500);
        let config = Config {
            cache_results: false,
            ..Config::default()
        };
        let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config).unwrap();
        assert_eq!(IdempotencyLayer::new(manager).settings.store_limit, 0);
    }
}
