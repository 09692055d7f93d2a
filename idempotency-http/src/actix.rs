//! actix-web middleware: the same [`IdempotencyLayer`], wrapped around an
//! actix-web app (feature `actix`).
//!
//! actix-web is not built on tower and its services are not `Send`, so the
//! request crosses into the layer's code (the same decision, storage and
//! replay as for tower services) through a small adapter: the request head and
//! body become an `http` 1 request, the app's response an `http` 1 response,
//! and back. The execution is detached on the worker's thread: a client that
//! disconnects does not undo the protection; the handler finishes and its
//! response is stored for the retry.
//!
//! ```no_run
//! use std::sync::Arc;
//! use actix_web::{web, App, HttpResponse, HttpServer};
//! use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
//! use idempotency_http::IdempotencyLayer;
//!
//! # async fn serve() -> std::io::Result<()> {
//! let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())
//!     .expect("valid configuration");
//! let layer = IdempotencyLayer::new(manager);
//! HttpServer::new(move || {
//!     App::new()
//!         .wrap(layer.clone())
//!         .route("/orders", web::post().to(|| async { HttpResponse::Created().body("order 1") }))
//! })
//! .bind(("127.0.0.1", 8080))?
//! .run()
//! .await
//! # }
//! ```
//!
//! Requests the layer does not protect (other methods, routes set to
//! [`Protection::Skip`](crate::Protection::Skip)) go to the app untouched, unconverted; with a
//! [`route_extractor`](crate::IdempotencyLayer::route_extractor), which reads
//! the converted request, every request is converted first.
//!
//! **Caller identity.** The default (a digest of `Authorization`) and
//! [`caller_from_header`](crate::caller_from_header) read headers, which cross over. actix's request
//! extensions do not (actix keeps them in its own type, which cannot be
//! copied): to name the caller from what an authentication middleware
//! established, use [`IdempotencyLayer::actix_caller_identity`], which reads
//! actix's `HttpRequest`. Register that middleware with a later `.wrap` than
//! this one, so that it runs first.
//!
//! What is not carried across: response extensions set by the app (actix
//! keeps them on its own response type) and trailers (actix-web's HTTP/1 and
//! HTTP/2 responses carry none).
//!
//! Two things to know:
//! - The middleware runs the execution on the current thread's `LocalSet`,
//!   which every actix-web worker (and `#[actix_web::main]`,
//!   `#[actix_web::test]`) provides; calling the middleware's service on a
//!   thread without one panics, as `tokio::task::spawn_local` does.
//! - An `Err` from the wrapped service (an inner middleware that fails rather
//!   than answering) releases the key like a `5xx`: the retry runs the
//!   handler again. Errors a handler returns are answers (actix turns them
//!   into responses) and are stored or not by their status.

use std::cell::RefCell;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::{
    Payload, Service as ActixService, ServiceRequest, ServiceResponse, Transform,
};
use actix_web::error::{ErrorInternalServerError, PayloadError};
use actix_web::{HttpRequest, HttpResponse};
use bytes::Bytes;
use futures::future::{ready as ready_future, LocalBoxFuture, Ready};
use futures::stream::LocalBoxStream;
use futures::{StreamExt, TryStreamExt};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyStream, StreamBody};
use idempotency_core::BoxError;
use pin_project_lite::pin_project;

use crate::body::IdempotencyBody;
use crate::layer::{IdempotencyLayer, MatchedRoute, Settings};
use crate::service::{handle, Local};

/// The request body as the layer reads it: actix's payload stream.
type RequestBody = StreamBody<LocalBoxStream<'static, Result<Frame<Bytes>, PayloadError>>>;

impl<S, B> Transform<S, ServiceRequest> for IdempotencyLayer
where
    S: ActixService<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
        + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Transform = IdempotencyMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready_future(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            layer: self.clone(),
        }))
    }
}

/// The service [`IdempotencyLayer`] wraps around an actix-web app.
#[derive(Debug)]
pub struct IdempotencyMiddleware<S> {
    service: Rc<S>,
    layer: IdempotencyLayer,
}

impl<S, B> ActixService<ServiceRequest> for IdempotencyMiddleware<S>
where
    S: ActixService<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
        + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Self::Error>>;

    actix_web::dev::forward_ready!(service);

    fn call(&self, request: ServiceRequest) -> Self::Future {
        let (service, settings) = (self.service.clone(), self.layer.settings());
        Box::pin(async move {
            if skips(&settings, request.request()) {
                return Ok(service.call(request).await?.map_into_boxed_body());
            }
            let (head, payload) = request.into_parts();
            let mut converted = to_http_request(&head, payload)?;
            if let Some(caller) = &settings.actix_caller {
                converted
                    .extensions_mut()
                    .insert(ActixCaller(caller(&head)));
            }
            // The app's request: actix needs it unshared while it routes, so it
            // lives in this cell, taken by the app's call and put back with
            // its response.
            let cell = Rc::new(RefCell::new(Some(head)));
            let inner = App {
                service,
                head: cell.clone(),
            };
            let response = handle::<Local, _, _, _>(settings, inner, converted).await?;
            let head = cell.borrow_mut().take().ok_or_else(|| {
                ErrorInternalServerError("the request went missing in the idempotency middleware")
            })?;
            Ok(ServiceResponse::new(head, to_actix_response(response)?))
        })
    }
}

/// Names the caller from actix's request (see
/// [`IdempotencyLayer::actix_caller_identity`]).
pub(crate) type ActixCallerFn = Arc<dyn Fn(&HttpRequest) -> Option<String> + Send + Sync>;

/// The caller [`ActixCallerFn`] named, carried to the layer's caller policy.
#[derive(Debug, Clone)]
struct ActixCaller(Option<String>);

impl IdempotencyLayer {
    /// Names the caller from actix-web's own request, where the app's
    /// authentication middleware left what it established (actix's request
    /// extensions do not cross over to the `http` request other caller
    /// functions read): records are scoped by it, like
    /// [`caller_identity`](Self::caller_identity), which it replaces. Only for
    /// actix-web apps; `None` is the anonymous caller.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use actix_web::HttpMessage;
    /// use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
    /// use idempotency_http::IdempotencyLayer;
    ///
    /// /// What the app's authentication middleware inserts.
    /// #[derive(Clone)]
    /// struct UserId(u64);
    ///
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// let layer = IdempotencyLayer::new(manager).actix_caller_identity(|request| {
    ///     request.extensions().get::<UserId>().map(|user| user.0.to_string())
    /// });
    /// # let _ = layer;
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn actix_caller_identity(
        self,
        f: impl Fn(&HttpRequest) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|s| {
            s.set_caller(Some(Arc::new(|parts: &http::request::Parts| {
                parts
                    .extensions
                    .get::<ActixCaller>()
                    .and_then(|caller| caller.0.clone())
            })));
            s.actix_caller = Some(Arc::new(f));
        })
    }
}

/// Whether the layer surely leaves this request alone, judged on actix's
/// request without converting it.
fn skips(settings: &Settings, request: &HttpRequest) -> bool {
    let Ok(method) = http::Method::from_bytes(request.method().as_str().as_bytes()) else {
        return false;
    };
    let route = request.match_pattern();
    settings.skips(&method, route.as_deref().unwrap_or(request.path()))
}

/// The wrapped app as a tower service of `http` 1 requests and responses.
struct App<S> {
    service: Rc<S>,
    head: Rc<RefCell<Option<HttpRequest>>>,
}

impl<S, B, ReqB> tower::Service<http::Request<IdempotencyBody<ReqB>>> for App<S>
where
    S: ActixService<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
        + 'static,
    B: MessageBody + 'static,
    ReqB: Body<Data = Bytes> + 'static,
    ReqB::Error: Into<BoxError>,
{
    type Response = http::Response<FromActix<B>>;
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The middleware's own readiness is the app's.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<IdempotencyBody<ReqB>>) -> Self::Future {
        let (service, cell) = (self.service.clone(), self.head.clone());
        Box::pin(async move {
            let head = cell.borrow_mut().take().ok_or_else(|| {
                ErrorInternalServerError("the request went missing in the idempotency middleware")
            })?;
            let stream = BodyStream::new(request.into_body())
                .try_filter_map(|frame| std::future::ready(Ok(frame.into_data().ok())))
                .map_err(|e| PayloadError::Io(std::io::Error::other(e)));
            let payload = Payload::from(stream.boxed_local());
            let response = service
                .call(ServiceRequest::from_parts(head, payload))
                .await?;
            let (head, response) = response.into_parts();
            *cell.borrow_mut() = Some(head);
            from_actix_response(response)
        })
    }
}

fn to_http_request(
    head: &HttpRequest,
    payload: Payload,
) -> Result<http::Request<RequestBody>, actix_web::Error> {
    let mut request = http::Request::builder()
        .method(head.method().as_str())
        .uri(head.uri().to_string());
    for (name, value) in head.headers() {
        request = request.header(name.as_str(), value.as_bytes());
    }
    let body = StreamBody::new(payload.map_ok(Frame::data).boxed_local());
    let mut request = request
        .body(body)
        .map_err(|e| actix_web::error::ErrorBadRequest(e.to_string()))?;
    if let Some(pattern) = head.match_pattern() {
        request.extensions_mut().insert(MatchedRoute(pattern));
    }
    Ok(request)
}

fn from_actix_response<B: MessageBody>(
    response: HttpResponse<B>,
) -> Result<http::Response<FromActix<B>>, actix_web::Error> {
    let mut converted = http::Response::builder().status(response.status().as_u16());
    for (name, value) in response.headers() {
        converted = converted.header(name.as_str(), value.as_bytes());
    }
    converted
        .body(FromActix {
            body: response.into_body(),
        })
        .map_err(ErrorInternalServerError)
}

fn to_actix_response<Bd>(response: http::Response<Bd>) -> Result<HttpResponse, actix_web::Error>
where
    Bd: Body<Data = Bytes> + 'static,
    Bd::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    let status = actix_web::http::StatusCode::from_u16(parts.status.as_u16())
        .map_err(ErrorInternalServerError)?;
    let mut converted = HttpResponse::build(status);
    for (name, value) in &parts.headers {
        converted.append_header((name.as_str(), value.as_bytes()));
    }
    Ok(converted.body(ToActix { body }))
}

pin_project! {
    /// The app's response body as an `http_body::Body`.
    pub(crate) struct FromActix<B> {
        #[pin]
        body: B,
    }
}

impl<B: MessageBody> Body for FromActix<B> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(match ready!(self.project().body.poll_next(cx)) {
            Some(Ok(data)) => Some(Ok(Frame::data(data))),
            // actix's errors are not `Send`: keep their message.
            Some(Err(e)) => Some(Err(e.into().to_string().into())),
            None => None,
        })
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.body.size(), BodySize::None | BodySize::Sized(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.body.size() {
            BodySize::None => SizeHint::with_exact(0),
            BodySize::Sized(n) => SizeHint::with_exact(n),
            BodySize::Stream => SizeHint::default(),
        }
    }
}

pin_project! {
    /// A layer's response body as an actix `MessageBody` (trailers dropped).
    struct ToActix<Bd> {
        #[pin]
        body: Bd,
    }
}

impl<Bd> MessageBody for ToActix<Bd>
where
    Bd: Body<Data = Bytes>,
    Bd::Error: Into<BoxError>,
{
    type Error = std::io::Error;

    fn size(&self) -> BodySize {
        match (self.body.is_end_stream(), self.body.size_hint().exact()) {
            (true, _) => BodySize::Sized(0),
            (false, Some(n)) => BodySize::Sized(n),
            (false, None) => BodySize::Stream,
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let mut body = self.project().body;
        loop {
            return Poll::Ready(match ready!(body.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => Some(Ok(data)),
                    Err(_trailers) => continue,
                },
                Some(Err(e)) => Some(Err(std::io::Error::other(e.into()))),
                None => None,
            });
        }
    }
}
