//! One request through the layer: decide, reserve, run, store, answer.

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use futures::future::{BoxFuture, LocalBoxFuture};
use futures::FutureExt;
use http::header::HeaderValue;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use idempotency_core::{
    BoxError, ExecuteError, ExecutionContext, HandlerError, IdempotencyManager, Outcome,
};
use tower::Service;

use crate::answers;
use crate::body::{collect_up_to, collect_up_to_by, drain, Collected, IdempotencyBody};
use crate::grpc::Dialect;
use crate::key::{parse_key, record_id, KeyError};
use crate::layer::{Protection, Settings};
use crate::problem::{Problem, ProblemKind};
use crate::stored::{RawBytesCodec, StoredResponse};

/// Room left in the stored record for trailers when capping the body.
const TRAILER_ALLOWANCE: usize = 256;

/// The most of a gRPC answer over the cache cap held in memory while it is
/// read to its final status (64 MiB; tonic's own default limit for a message
/// a client decodes is 4 MiB).
const GRPC_DRAIN_LIMIT: usize = 64 * 1024 * 1024;

/// Until when a response body is read (a gRPC answer to its status): a tenth
/// of the processing timeout (at most a second) before the lease ends, so that
/// its outcome is recorded while the lease holds. On Tokio's monotonic clock,
/// as the lease keeper counts it; each extension confirmed moves it.
fn drain_deadline(settings: &Settings, ctx: &ExecutionContext) -> tokio::time::Instant {
    let processing = settings.manager.config().processing_timeout;
    let margin = (processing / 10).min(std::time::Duration::from_secs(1));
    let deadline = ctx.lease_deadline();
    deadline.checked_sub(margin).unwrap_or(deadline)
}

/// Why the "handler" (the inner service and reading its body) did not produce a
/// response to store. Every variant releases the key.
pub(crate) enum Failure<E> {
    /// The inner service returned an error. (In a mutex only to make the
    /// failure `Sync`, which the manager needs while it releases the key,
    /// without asking the same of every service error type.)
    Service(Mutex<E>),
    /// The response is of a kind that is not stored (5xx by default).
    NotStored(StatusCode),
    /// The response body failed while it was being read, after the request
    /// body had failed too (an upload cut short that the handler streamed
    /// from): the request never arrived whole. (A response body that fails
    /// after a whole request is kept as not retained: the handler ran.)
    BodyFailed(StatusCode),
    /// The inner service refused the request (a `4xx`) after its body
    /// failed, unread by the fingerprint: the client's upload was cut short.
    RequestBodyFailed(StatusCode),
    /// The inner service panicked: released like a `500`, whatever the
    /// manager's failure policy (which would store a panic under
    /// `FailurePolicy::Store`, and answer every retry with that failure),
    /// then the panic continues in the request. (In a mutex for `Sync`, as
    /// above; taken once.)
    Panicked(Mutex<Option<Box<dyn Any + Send>>>),
}

impl<E> fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Service(_) => f.write_str("the inner service failed"),
            Failure::NotStored(status) => write!(f, "response {status} is not stored"),
            Failure::BodyFailed(status) => {
                write!(f, "the body of response {status} failed while being read")
            }
            Failure::RequestBodyFailed(status) => {
                write!(f, "response {status} answers a request body that failed")
            }
            Failure::Panicked(_) => f.write_str("the inner service panicked"),
        }
    }
}

type Answer<B, E> = Result<Response<IdempotencyBody<B>>, E>;

/// Where the handler leaves the response it produced for this call's client.
type Slot<B> = Arc<Mutex<Option<Response<IdempotencyBody<B>>>>>;

/// What an execution of the inner service answers the manager.
pub(crate) type Executed<E> = Result<Outcome<StoredResponse>, ExecuteError<Failure<E>>>;

/// One call of the inner service, as the manager runs it: once per key.
pub(crate) struct Job<S, ReqB, ResB> {
    shared: Arc<Settings>,
    inner: S,
    request: Request<IdempotencyBody<ReqB>>,
    /// Set should the request body fail while the inner service reads it.
    request_failed: Arc<AtomicBool>,
    slot: Slot<ResB>,
}

impl<S, ReqB, ResB> Job<S, ReqB, ResB>
where
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    pub(crate) async fn run(
        self,
        ctx: ExecutionContext,
    ) -> Result<StoredResponse, HandlerError<Failure<S::Error>>> {
        let call = Call {
            request: self.request,
            request_failed: &self.request_failed,
            slot: &self.slot,
        };
        let running = run(&self.shared, self.inner, call, &ctx);
        AssertUnwindSafe(running)
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                let failure = Failure::Panicked(Mutex::new(Some(panic)));
                Err(HandlerError::transient(failure))
            })
    }
}

/// How a job is detached from the request, so that a request future that is
/// dropped (a client that disconnects, a server that shuts down) does not
/// undo the protection: the inner service runs to completion and its response
/// is stored, so the client's retry gets it instead of running the handler
/// again. Tower services are `Send` and run on a task of their own
/// ([`Threaded`]); actix-web's are not and run on a task of the worker's
/// thread ([`Local`]).
pub(crate) trait Detach<S, ReqB, ResB>
where
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>>,
{
    /// The execution's future.
    type Future: Future<Output = Executed<S::Error>>;

    fn execute(
        manager: IdempotencyManager<RawBytesCodec>,
        id: String,
        fingerprint: Option<String>,
        job: Job<S, ReqB, ResB>,
    ) -> Self::Future;
}

/// Detached on a task of the runtime ([`IdempotencyManager::execute_detached`]).
#[derive(Debug)]
pub(crate) struct Threaded;

impl<S, ReqB, ResB> Detach<S, ReqB, ResB> for Threaded
where
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Future = BoxFuture<'static, Executed<S::Error>>;

    fn execute(
        manager: IdempotencyManager<RawBytesCodec>,
        id: String,
        fingerprint: Option<String>,
        job: Job<S, ReqB, ResB>,
    ) -> Self::Future {
        Box::pin(async move {
            manager
                .execute_detached(&id, &fingerprint, move |ctx| job.run(ctx))
                .await
        })
    }
}

/// Detached on a task of the current thread's `LocalSet`
/// ([`IdempotencyManager::execute_detached_local`]).
#[derive(Debug)]
#[cfg_attr(not(feature = "actix"), allow(dead_code))]
pub(crate) struct Local;

impl<S, ReqB, ResB> Detach<S, ReqB, ResB> for Local
where
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>> + 'static,
    S::Error: 'static,
    ReqB: 'static,
    ResB: Body<Data = Bytes> + 'static,
    ResB::Error: Into<BoxError>,
{
    type Future = LocalBoxFuture<'static, Executed<S::Error>>;

    fn execute(
        manager: IdempotencyManager<RawBytesCodec>,
        id: String,
        fingerprint: Option<String>,
        job: Job<S, ReqB, ResB>,
    ) -> Self::Future {
        Box::pin(async move {
            manager
                .execute_detached_local(&id, &fingerprint, move |ctx| job.run(ctx))
                .await
        })
    }
}

pub(crate) async fn handle<D, S, ReqB, ResB>(
    shared: Arc<Settings>,
    inner: S,
    request: Request<ReqB>,
) -> Answer<ResB, S::Error>
where
    D: Detach<S, ReqB, ResB>,
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>>,
    ReqB: Body<Data = Bytes>,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    let settings = &*shared;
    let (parts, body) = request.into_parts();
    let route = settings.route_of(&parts);
    let protection = settings.protection(&parts.method, &route);
    if protection == Protection::Skip {
        return pass_through(inner, parts, body).await;
    }
    let key = match parse_key(&parts.headers, &settings.header, settings.max_key_length) {
        Ok(Some(key)) => key,
        Ok(None) if protection == Protection::Optional => {
            return pass_through(inner, parts, body).await;
        }
        Ok(None) => {
            let problem = answers::missing_key(settings, &parts.method, &route);
            return Ok(settings.problem(problem));
        }
        Err(e) => return Ok(settings.problem(answers::invalid_key(settings, &e))),
    };
    if let Some(validate) = &settings.key_validator {
        if let Err(reason) = validate(&key) {
            let e = KeyError::Rejected(reason);
            return Ok(settings.problem(answers::invalid_key(settings, &e)));
        }
    }
    let caller = settings.caller_fn.as_ref().and_then(|f| f(&parts));
    let validated = settings.manager.config().validate_payload;
    let scope = settings.fingerprint.record_scope(validated, &parts, &route);
    let id = record_id(caller.as_deref(), &parts.method, scope, &key);

    // Whether the request body, streamed to the inner service unread by the
    // fingerprint, failed (a client that went away mid-upload).
    let request_failed = Arc::new(AtomicBool::new(false));
    let (body, fingerprint) = if settings.fingerprint.reads_body() {
        match collect_up_to(body, settings.max_request_body).await {
            Collected::Complete { data, trailers } => {
                let fingerprint = settings.fingerprint.compute(&parts, &data);
                (IdempotencyBody::full(data, trailers), fingerprint)
            }
            Collected::Overflow { .. } => {
                return Ok(settings.problem(answers::body_too_large(settings)));
            }
            Collected::Failed { error, .. } => {
                // The transport's own words stay in the log: they may name
                // internals (addresses, limits) a client has no use for.
                tracing::debug!(route = %route, error = %error, "reading the request body failed");
                return Ok(settings.problem(answers::unreadable_body(settings)));
            }
        }
    } else {
        let fingerprint = settings.fingerprint.compute(&parts, &[]);
        let watched = IdempotencyBody::new(body).watched(request_failed.clone());
        (watched, fingerprint)
    };
    let request = Request::from_parts(parts, body);

    // The response the inner service produced in this call, as the client
    // must get it (all headers, streaming rest of an oversized body); the
    // manager only sees its stored form.
    let slot: Slot<ResB> = Arc::new(Mutex::new(None));
    let job = Job {
        shared: shared.clone(),
        inner,
        request,
        request_failed,
        slot: slot.clone(),
    };
    let outcome = D::execute(settings.manager.clone(), id.clone(), fingerprint, job).await;
    // Only a replay carries the replay marker: a handler that forwards one
    // (a proxy to an API that sends the same header) must not mark the
    // first response as a replay.
    let mut produced = slot
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .map(|mut response| {
            response.headers_mut().remove(&settings.replayed_header);
            response
        });

    match outcome {
        Ok(Outcome::Cached(stored)) => Ok(replay(settings, stored)),
        Ok(Outcome::Duplicate) => {
            Ok(settings.problem(answers::not_retained(settings.dialect, None)))
        }
        Ok(outcome) => {
            match &outcome {
                Outcome::LeaseLost(_) => tracing::warn!(
                    route = %route,
                    "the response was produced after another attempt took the key over; \
                     answering it, but the handler may have run twice"
                ),
                Outcome::Unrecorded { error, .. } => tracing::error!(
                    route = %route,
                    error = %error,
                    "the response was produced but could not be recorded; a retry after the \
                     lease ends would run the handler again"
                ),
                Outcome::Unprotected(_) => tracing::warn!(
                    route = %route,
                    "the store is unavailable; the request ran unprotected (fail-open)"
                ),
                _ => {}
            }
            match (produced.take(), outcome.into_value()) {
                (Some(response), _) => Ok(response),
                (None, Some(stored)) => Ok(first_response(stored)),
                (None, None) => Ok(settings.problem(answers::no_response(settings))),
            }
        }
        Err(ExecuteError::Handler(Failure::Service(e))) => {
            Err(e.into_inner().unwrap_or_else(PoisonError::into_inner))
        }
        Err(ExecuteError::Handler(Failure::Panicked(panic))) => {
            let panic = panic.into_inner().unwrap_or_else(PoisonError::into_inner);
            std::panic::resume_unwind(
                panic.unwrap_or_else(|| Box::new("the inner service panicked")),
            )
        }
        Err(ExecuteError::Handler(failure)) => match produced.take() {
            Some(response) => Ok(response),
            None => {
                Ok(settings.problem(Problem::new(ProblemKind::StoreError, failure.to_string())))
            }
        },
        Err(ExecuteError::Idempotency(e)) => {
            let problem = answers::problem_for(settings, &route, &id, e).await;
            Ok(settings.problem(problem))
        }
    }
}

async fn pass_through<S, ReqB, ResB>(
    mut inner: S,
    parts: Parts,
    body: ReqB,
) -> Answer<ResB, S::Error>
where
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>>,
{
    let response = inner
        .call(Request::from_parts(parts, IdempotencyBody::new(body)))
        .await?;
    Ok(response.map(IdempotencyBody::new))
}

/// What one call of the inner service takes and where its response goes.
struct Call<'a, ReqB, ResB> {
    request: Request<IdempotencyBody<ReqB>>,
    request_failed: &'a AtomicBool,
    slot: &'a Slot<ResB>,
}

/// The handler the manager runs once per key: call the inner service, then keep
/// the response (up to the cap) or release the key.
async fn run<S, ReqB, ResB>(
    settings: &Settings,
    mut inner: S,
    call: Call<'_, ReqB, ResB>,
    ctx: &ExecutionContext,
) -> Result<StoredResponse, HandlerError<Failure<S::Error>>>
where
    S: Service<Request<IdempotencyBody<ReqB>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    let Call {
        request,
        request_failed,
        slot,
    } = call;
    let response = inner
        .call(request)
        .await
        .map_err(|e| HandlerError::transient(Failure::Service(Mutex::new(e))))?;
    let (head, body) = response.into_parts();
    let status = head.status;
    if !(settings.store_if)(&head)
        || !settings
            .dialect
            .may_store_head(&head.headers, &settings.grpc_store_if)
    {
        hand_over(slot, head, IdempotencyBody::new(body));
        return Err(HandlerError::transient(Failure::NotStored(status)));
    }
    if answers_a_cut_upload(status, request_failed) {
        hand_over(slot, head, IdempotencyBody::new(body));
        return Err(HandlerError::transient(Failure::RequestBodyFailed(status)));
    }
    if settings.dialect == Dialect::Http && is_event_stream(&head.headers) {
        // Read as it comes, and perhaps never ending (a heartbeat): held
        // back to be stored, the client would see nothing until its end.
        // Streamed through at once, as a body over the cap: the handler ran,
        // so the key completes without it.
        tracing::debug!(%status, "event stream: streamed through, not retained for replays");
        hand_over(slot, head, IdempotencyBody::new(body));
        return Ok(StoredResponse::not_retained(status, None));
    }
    let headers = settings.select_headers(&head.headers);
    let room = settings
        .store_limit
        .saturating_sub(StoredResponse::head_len(&headers) + 4 + TRAILER_ALLOWANCE);
    let cap = settings.max_cached_body.min(room);
    // Read within the lease: the outcome must be recorded before it ends, or
    // a retry takes the key over and runs the handler again. A body still
    // coming then streams through, kept as not retained (the handler ran).
    let lease_end = || drain_deadline(settings, ctx);
    let reading = collect_up_to_by(body, cap, Some(lease_end));
    let collected = unwinding(reading, |error| Collected::Failed {
        frames: VecDeque::new(),
        error,
    });
    match collected.await {
        // The upload was cut while the response was read (a head sent before
        // the handler read the whole request): as above.
        Collected::Complete { data, trailers } if answers_a_cut_upload(status, request_failed) => {
            hand_over(slot, head, IdempotencyBody::full(data, trailers));
            Err(HandlerError::transient(Failure::RequestBodyFailed(status)))
        }
        Collected::Complete { data, trailers } => {
            let stores = settings.dialect.stores_complete(
                &head.headers,
                trailers.as_ref(),
                &settings.grpc_store_if,
            );
            let stored = stores.then(|| StoredResponse {
                status,
                headers,
                body: Some(data.clone()),
                trailers: trailers.clone(),
            });
            hand_over(slot, head, IdempotencyBody::full(data, trailers));
            stored.ok_or(HandlerError::transient(Failure::NotStored(status)))
        }
        Collected::Overflow { frames, rest } if settings.dialect == Dialect::Grpc => {
            // The final status, which decides, is at the end: read to it,
            // within bounds (memory, and the lease: the outcome must be
            // recorded before the lease ends, or a retry runs again).
            let reading = drain(frames, rest, GRPC_DRAIN_LIMIT, lease_end);
            let drained = match unwinding(reading.map(Ok), Err).await {
                Ok(drained) => drained,
                Err(error) => {
                    return body_failed(slot, head, VecDeque::new(), error, request_failed)
                }
            };
            if let Some(error) = drained.error {
                return body_failed(slot, head, drained.frames, error, request_failed);
            }
            if let Some(rest) = drained.rest {
                // Too large or too slow to judge: the method ran, so the key
                // is kept (a retry is refused, never run again), its answer
                // not retained and its status unknown.
                tracing::warn!(%status, "gRPC answer too large or too slow to read to its status; kept as not retained");
                hand_over(
                    slot,
                    head,
                    IdempotencyBody::buffered(drained.frames, Some(rest), None),
                );
                return Ok(StoredResponse::not_retained(status, None));
            }
            let trailers = drained.trailers.as_ref();
            let stores =
                settings
                    .dialect
                    .stores_complete(&head.headers, trailers, &settings.grpc_store_if);
            let kept = settings.dialect.outcome_trailers(&head.headers, trailers);
            hand_over(
                slot,
                head,
                IdempotencyBody::buffered(drained.frames, None, None),
            );
            stores
                .then(|| StoredResponse::not_retained(status, kept))
                .ok_or(HandlerError::transient(Failure::NotStored(status)))
        }
        Collected::Overflow { frames, rest } => {
            tracing::debug!(
                %status,
                cap,
                "response body over the cache cap, or still coming as the lease ends: streamed \
                 through, not retained for replays"
            );
            hand_over(
                slot,
                head,
                IdempotencyBody::buffered(frames, Some(rest), None),
            );
            Ok(StoredResponse::not_retained(status, None))
        }
        Collected::Failed { frames, error } => {
            body_failed(slot, head, frames, error, request_failed)
        }
    }
}

/// Whether the response is a server-sent event stream (`text/event-stream`).
fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// Whether a response with `status` refuses a request whose body was cut
/// short (axum's "failed to buffer the request body"): an answer to this
/// attempt's transport, not to the request, so it is not stored and the
/// client's full retry runs.
fn answers_a_cut_upload(status: StatusCode, request_failed: &AtomicBool) -> bool {
    status.is_client_error() && request_failed.load(Ordering::Acquire)
}

/// `reading` the response body, with a panic there turned into the body's
/// failure (`failed`): the handler ran (its head says so), so the key is kept
/// as for a body that fails, never released for a retry to run the handler
/// again — as a panicking `Serialize` records the success in the manager.
async fn unwinding<T>(reading: impl Future<Output = T>, failed: impl FnOnce(BoxError) -> T) -> T {
    match AssertUnwindSafe(reading).catch_unwind().await {
        Ok(read) => read,
        // The panic hook has reported the panic and its message.
        Err(_) => {
            tracing::error!("the response body panicked while it was read");
            failed("the response body panicked".into())
        }
    }
}

/// Leaves the response for this call's client.
fn hand_over<B>(slot: &Slot<B>, head: http::response::Parts, body: IdempotencyBody<B>) {
    *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(Response::from_parts(head, body));
}

/// The response body failed while it was read: the client gets what was read
/// and the error. The handler ran (its head says so), so the key is kept with
/// its answer not retained: a retry is refused, never run again, as for a body
/// too large or too slow to keep. Only when the request body had failed too
/// (the handler streamed an upload that was cut short) is the key released:
/// the request never arrived whole, and the client's full retry must run.
fn body_failed<B, E>(
    slot: &Slot<B>,
    head: http::response::Parts,
    frames: VecDeque<Frame<Bytes>>,
    error: BoxError,
    request_failed: &AtomicBool,
) -> Result<StoredResponse, HandlerError<Failure<E>>> {
    let status = head.status;
    let released = request_failed.load(Ordering::Acquire);
    if released {
        tracing::warn!(%status, error = %error, "the response body failed after the request body did; releasing the key");
    } else {
        tracing::warn!(%status, error = %error, "the response body failed; kept as not retained (the handler ran)");
    }
    hand_over(
        slot,
        head,
        IdempotencyBody::buffered(frames, None, Some(error)),
    );
    if released {
        return Err(HandlerError::transient(Failure::BodyFailed(status)));
    }
    Ok(StoredResponse::not_retained(status, None))
}

fn replay<B>(settings: &Settings, stored: StoredResponse) -> Response<IdempotencyBody<B>> {
    let StoredResponse {
        status,
        headers,
        body,
        trailers,
    } = stored;
    let Some(body) = body else {
        let outcome = settings
            .dialect
            .outcome(status, &headers, trailers.as_ref());
        return settings.problem(answers::not_retained(
            settings.dialect,
            Some((status, outcome)),
        ));
    };
    let mut response = Response::new(IdempotencyBody::full(body, trailers));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response.headers_mut().insert(
        settings.replayed_header.clone(),
        HeaderValue::from_static("true"),
    );
    response
}

/// The first response rebuilt from its stored form (only when the produced
/// response went missing, which the flow above never lets happen).
fn first_response<B>(stored: StoredResponse) -> Response<IdempotencyBody<B>> {
    let mut response = Response::new(IdempotencyBody::full(
        stored.body.unwrap_or_default(),
        stored.trailers,
    ));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    response
}
