//! The body type the layer hands to the inner service and returns to the client.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use idempotency_core::BoxError;
use pin_project_lite::pin_project;

pin_project! {
    /// An HTTP body that is either the original body, untouched, or frames the
    /// layer buffered (a replayed response, a request body read for its
    /// fingerprint, the first part of a response larger than the cache cap)
    /// followed by the rest of the original body.
    ///
    /// The layer's service takes `Request<B>` and calls the inner service with
    /// `Request<IdempotencyBody<B>>`; it returns `Response<IdempotencyBody<R>>`
    /// for an inner `Response<R>`. Data is [`Bytes`]; errors are boxed.
    ///
    /// ```
    /// use http_body_util::BodyExt;
    /// use idempotency_http::IdempotencyBody;
    ///
    /// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
    /// let body = IdempotencyBody::new(http_body_util::Full::new(bytes::Bytes::from("hi")));
    /// assert_eq!(body.collect().await?.to_bytes(), "hi");
    /// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    /// # }).map_err(|e| e.to_string())?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
        // Set when the body yields an error (see `IdempotencyBody::watched`).
        failed: Option<Arc<AtomicBool>>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
        },
        Buffered {
            frames: VecDeque<Frame<Bytes>>,
            rest: Option<Pin<Box<B>>>,
            error: Option<BoxError>,
        },
    }
}

impl<B> IdempotencyBody<B> {
    /// Wraps `body`, passing its frames through untouched.
    pub fn new(body: B) -> Self {
        IdempotencyBody {
            kind: Kind::Inner { body },
            failed: None,
        }
    }

    /// The same body, setting `failed` when it yields an error (a request
    /// body cut short by its client), for the layer to see after the inner
    /// service read it.
    pub(crate) fn watched(mut self, failed: Arc<AtomicBool>) -> Self {
        self.failed = Some(failed);
        self
    }

    /// A complete body from bytes and optional trailers.
    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let mut frames = VecDeque::with_capacity(2);
        if !data.is_empty() {
            frames.push_back(Frame::data(data));
        }
        if let Some(t) = trailers {
            frames.push_back(Frame::trailers(t));
        }
        Self::buffered(frames, None, None)
    }

    /// Buffered frames, then the rest of the original body (if any), then an
    /// error (if any).
    pub(crate) fn buffered(
        frames: VecDeque<Frame<Bytes>>,
        rest: Option<Pin<Box<B>>>,
        error: Option<BoxError>,
    ) -> Self {
        IdempotencyBody {
            kind: Kind::Buffered {
                frames,
                rest,
                error,
            },
            failed: None,
        }
    }
}

impl<B> fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { .. } => f.write_str("IdempotencyBody::Inner"),
            Kind::Buffered {
                frames,
                rest,
                error,
            } => f
                .debug_struct("IdempotencyBody::Buffered")
                .field("frames", &frames.len())
                .field("rest", &rest.is_some())
                .field("error", error)
                .finish(),
        }
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = poll_kind(this.kind, cx);
        if let (Poll::Ready(Some(Err(_))), Some(failed)) = (&polled, this.failed) {
            failed.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Buffered {
                frames,
                rest,
                error,
            } => {
                frames.is_empty()
                    && error.is_none()
                    && rest.as_ref().is_none_or(|b| b.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Buffered {
                frames,
                rest,
                error,
            } => {
                let buffered: u64 = frames
                    .iter()
                    .filter_map(Frame::data_ref)
                    .map(|d| d.len() as u64)
                    .sum();
                match rest {
                    None if error.is_none() => SizeHint::with_exact(buffered),
                    // A body that failed is not as long as what came of it:
                    // announced with that length (`Content-Length`), it would
                    // reach the client looking whole. Without an upper bound
                    // the transport chunks it and cuts it at the failure.
                    None => {
                        let mut hint = SizeHint::new();
                        hint.set_lower(buffered);
                        hint
                    }
                    Some(body) => {
                        let inner = body.size_hint();
                        let mut hint = SizeHint::new();
                        hint.set_lower(inner.lower().saturating_add(buffered));
                        if let Some(upper) = inner.upper() {
                            hint.set_upper(upper.saturating_add(buffered));
                        }
                        hint
                    }
                }
            }
        }
    }
}

/// One frame of the body's kind.
fn poll_kind<B>(
    kind: Pin<&mut Kind<B>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match kind.project() {
        KindProj::Inner { body } => match body.poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        },
        KindProj::Buffered {
            frames,
            rest,
            error,
        } => {
            if let Some(frame) = frames.pop_front() {
                return Poll::Ready(Some(Ok(frame)));
            }
            if let Some(body) = rest {
                match body.as_mut().poll_frame(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(frame))) => return Poll::Ready(Some(Ok(frame))),
                    Poll::Ready(Some(Err(e))) => {
                        *rest = None;
                        return Poll::Ready(Some(Err(e.into())));
                    }
                    Poll::Ready(None) => *rest = None,
                }
            }
            Poll::Ready(error.take().map(Err))
        }
    }
}

/// What reading a body up to a cap gave.
pub(crate) enum Collected<B> {
    /// The whole body, within the cap.
    Complete {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// More than the cap: the frames read so far and the rest, unread.
    Overflow {
        frames: VecDeque<Frame<Bytes>>,
        rest: Pin<Box<B>>,
    },
    /// The body failed after these frames.
    Failed {
        frames: VecDeque<Frame<Bytes>>,
        error: BoxError,
    },
}

/// Reads `body` until it ends, fails, or holds more than `cap` data bytes.
/// A body whose declared size exceeds `cap` is not read at all.
pub(crate) async fn collect_up_to<B>(body: B, cap: usize) -> Collected<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    collect_up_to_by(body, cap, None::<fn() -> tokio::time::Instant>).await
}

/// [`collect_up_to`], also stopping at the instant `deadline` answers (asked
/// again when it passes, since it may have moved: a lease extended): a body
/// still coming then is answered as one over the cap (the frames read so far,
/// and the rest).
pub(crate) async fn collect_up_to_by<B, D>(body: B, cap: usize, deadline: Option<D>) -> Collected<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    D: Fn() -> tokio::time::Instant,
{
    let mut body = Box::pin(body);
    let cap64 = u64::try_from(cap).unwrap_or(u64::MAX);
    let mut frames = VecDeque::new();
    if body.size_hint().lower() > cap64 {
        return Collected::Overflow { frames, rest: body };
    }
    let mut len = 0usize;
    loop {
        let next = match &deadline {
            None => body.frame().await,
            Some(deadline) => match next_frame_by(&mut body, deadline).await {
                Some(next) => next,
                None => return Collected::Overflow { frames, rest: body },
            },
        };
        match next {
            None => break,
            Some(Err(e)) => {
                return Collected::Failed {
                    frames,
                    error: e.into(),
                }
            }
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    len = len.saturating_add(data.len());
                }
                frames.push_back(frame);
                if len > cap {
                    return Collected::Overflow { frames, rest: body };
                }
            }
        }
    }
    let mut data = BytesMut::with_capacity(len);
    let mut trailers: Option<HeaderMap> = None;
    let mut single = None;
    let data_frames = frames.iter().filter(|f| f.is_data()).count();
    for frame in frames {
        match frame.into_data() {
            Ok(chunk) if data_frames == 1 => single = Some(chunk),
            Ok(chunk) => data.extend_from_slice(&chunk),
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(t);
                }
            }
        }
    }
    Collected::Complete {
        data: single.unwrap_or_else(|| data.freeze()),
        trailers,
    }
}

/// The next frame of `body`, or `None` once the instant `deadline` answers
/// has passed (asked again when it passes, since it may have moved: a lease
/// extended).
async fn next_frame_by<B, D>(
    body: &mut Pin<Box<B>>,
    deadline: &D,
) -> Option<Option<Result<Frame<Bytes>, B::Error>>>
where
    B: Body<Data = Bytes>,
    D: Fn() -> tokio::time::Instant,
{
    loop {
        match tokio::time::timeout_at(deadline(), body.frame()).await {
            Ok(next) => return Some(next),
            // Moved on meanwhile (the lease was extended): wait on.
            Err(_) if deadline() > tokio::time::Instant::now() => {}
            Err(_) => return None,
        }
    }
}

/// A body read by [`drain`]: to its end, or as far as its bounds allowed.
pub(crate) struct Drained<B> {
    /// Every frame read, in order (trailers included).
    pub(crate) frames: VecDeque<Frame<Bytes>>,
    /// The trailers, merged (none when cut short).
    pub(crate) trailers: Option<HeaderMap>,
    /// Why the body ended early, if it failed.
    pub(crate) error: Option<BoxError>,
    /// The unread rest, when the bounds were reached first.
    pub(crate) rest: Option<Pin<Box<B>>>,
}

/// Reads the `rest` of an overflowing body to its end after the `frames`
/// already read, keeping every frame: for answers that can only be judged at
/// their end (gRPC's final status). Stops early, leaving the rest unread,
/// once more than `max_bytes` of data are held or at the instant `deadline`
/// answers (asked again when it passes, as for [`collect_up_to_by`]).
pub(crate) async fn drain<B, D>(
    mut frames: VecDeque<Frame<Bytes>>,
    mut rest: Pin<Box<B>>,
    max_bytes: usize,
    deadline: D,
) -> Drained<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    D: Fn() -> tokio::time::Instant,
{
    let mut held: usize = frames
        .iter()
        .filter_map(Frame::data_ref)
        .map(Bytes::len)
        .sum();
    let mut error = None;
    loop {
        if held > max_bytes {
            return cut_short(frames, rest);
        }
        let Some(next) = next_frame_by(&mut rest, &deadline).await else {
            return cut_short(frames, rest);
        };
        match next {
            None => break,
            Some(Ok(frame)) => {
                held = held.saturating_add(frame.data_ref().map_or(0, Bytes::len));
                frames.push_back(frame);
            }
            Some(Err(e)) => {
                error = Some(e.into());
                break;
            }
        }
    }
    let mut trailers: Option<HeaderMap> = None;
    for t in frames.iter().filter_map(Frame::trailers_ref) {
        trailers
            .get_or_insert_with(HeaderMap::new)
            .extend(t.clone());
    }
    Drained {
        frames,
        trailers,
        error,
        rest: None,
    }
}

fn cut_short<B>(frames: VecDeque<Frame<Bytes>>, rest: Pin<Box<B>>) -> Drained<B> {
    Drained {
        frames,
        trailers: None,
        error: None,
        rest: Some(rest),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};

    type Chunks =
        StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>>;

    fn chunks(parts: &[&'static [u8]], fail: bool) -> Chunks {
        let mut items: Vec<Result<Frame<Bytes>, std::io::Error>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p))))
            .collect();
        if fail {
            items.push(Err(std::io::Error::other("boom")));
        }
        StreamBody::new(futures::stream::iter(items))
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn collects_within_the_cap() {
        run(async {
            match collect_up_to(chunks(&[b"ab", b"cd"], false), 4).await {
                Collected::Complete { data, trailers } => {
                    assert_eq!(data, "abcd");
                    assert!(trailers.is_none());
                }
                _ => panic!("expected complete"),
            }
        });
    }

    #[test]
    fn overflow_keeps_every_byte_in_order() {
        run(async {
            let Collected::Overflow { frames, rest } =
                collect_up_to(chunks(&[b"ab", b"cd", b"ef"], false), 3).await
            else {
                panic!("expected overflow")
            };
            let body = IdempotencyBody::buffered(frames, Some(rest), None);
            assert_eq!(body.collect().await.unwrap().to_bytes(), "abcdef");
        });
    }

    #[test]
    fn declared_size_over_the_cap_is_not_read() {
        run(async {
            let Collected::Overflow { frames, rest } =
                collect_up_to(Full::new(Bytes::from_static(b"0123456789")), 5).await
            else {
                panic!("expected overflow")
            };
            assert!(frames.is_empty());
            let body = IdempotencyBody::buffered(frames, Some(rest), None);
            assert_eq!(body.size_hint().exact(), Some(10));
            assert_eq!(body.collect().await.unwrap().to_bytes(), "0123456789");
        });
    }

    #[test]
    fn failure_is_replayed_after_the_frames() {
        run(async {
            let Collected::Failed { frames, error } =
                collect_up_to(chunks(&[b"ab"], true), 100).await
            else {
                panic!("expected failure")
            };
            let mut body = IdempotencyBody::<Full<Bytes>>::buffered(frames, None, Some(error));
            let first = body.frame().await.unwrap().unwrap();
            assert_eq!(first.into_data().unwrap(), "ab");
            assert!(body.frame().await.unwrap().is_err());
            assert!(body.frame().await.is_none());
        });
    }

    #[test]
    fn full_bodies_carry_trailers_and_exact_sizes() {
        run(async {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let body = IdempotencyBody::<Full<Bytes>>::full(Bytes::from("xyz"), Some(trailers));
            assert_eq!(body.size_hint().exact(), Some(3));
            assert!(!body.is_end_stream());
            let collected = body.collect().await.unwrap();
            assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
            assert_eq!(collected.to_bytes(), "xyz");
            let empty = IdempotencyBody::<Full<Bytes>>::full(Bytes::new(), None);
            assert!(empty.is_end_stream());
        });
    }
}
