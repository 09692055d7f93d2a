//! The in-progress answer's read of the holder's record (`in_progress.rs`)
//! is bounded by the manager's `store_timeout`: a store whose `get` never
//! answers still gets the duplicate its 409 (with the manager's hint). And a
//! handler's own response never carries the replay marker.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use idempotency_core::{
    async_trait, Capabilities, Config, Error, IdempotencyManager, MemoryRepository, OwnerToken,
    Record, RecordKey, Repository, Reservation, ReserveRequest, Timestamp,
};
use idempotency_http::IdempotencyLayer;
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

/// The memory store, except that `get` never answers (a black-holed read).
#[derive(Debug, Default)]
struct GetHangs(MemoryRepository, bool);

#[async_trait]
impl Repository for GetHangs {
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        self.0.reserve(request).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.0.complete(key, owner, result, expires_at, now).await
    }
    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.0
            .fail(key, owner, error, retryable, expires_at, now)
            .await
    }
    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.0.release(key, owner, now).await
    }
    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.0
            .extend(key, owner, lease_until, expires_at, now)
            .await
    }
    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        if self.1 {
            std::future::pending::<()>().await;
        }
        self.0.get(key, now).await
    }
    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        self.0.delete(key).await
    }
    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        self.0.purge_expired(now, limit).await
    }
}

#[tokio::test(start_paused = true)]
async fn an_in_progress_answer_is_bounded_by_the_store_timeout() {
    in_progress_answer(true).await;
}

/// Control: the same flow with a `get` that answers gets its 409.
#[tokio::test(start_paused = true)]
async fn control_an_answering_get_gives_the_409() {
    in_progress_answer(false).await;
}

async fn in_progress_answer(get_hangs: bool) {
    let config = Config {
        store_timeout: Duration::from_millis(200),
        ..Config::default()
    };
    let manager = IdempotencyManager::new(
        Arc::new(GetHangs(MemoryRepository::new(), get_hangs)),
        config,
    )
    .unwrap();
    let started = Arc::new(Notify::new());
    let (gate, opened) = watch::channel(false);
    let slow = {
        let started = started.clone();
        move || async move {
            started.notify_waiters();
            opened.clone().wait_for(|open| *open).await.unwrap();
            (StatusCode::CREATED, "done")
        }
    };
    let router = Router::new()
        .route("/slow", post(slow))
        .layer(IdempotencyLayer::new(manager));
    let send = |router: Router| async move {
        let request = Request::post("/slow")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap();
        router.oneshot(request).await.unwrap().status()
    };

    let notified = started.notified();
    let first = tokio::spawn(send(router.clone()));
    notified.await;
    // The duplicate is decided in progress by the reserve alone; its answer
    // must come within the store timeout (a few times it, to be generous).
    let busy = tokio::time::timeout(Duration::from_secs(10), send(router.clone())).await;
    assert_eq!(
        busy.ok(),
        Some(StatusCode::CONFLICT),
        "the duplicate's 409 never came: the holder's record read hangs past store_timeout"
    );
    gate.send(true).unwrap();
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);
}

/// The replay marker is the layer's word for "this is a replay": a first
/// response must not carry it, even when the handler (a proxy forwarding an
/// upstream's headers) set it; the layer strips it only from what it stores.
#[tokio::test]
async fn a_first_response_never_carries_the_replay_marker() {
    let manager =
        IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap();
    let router = Router::new()
        .route(
            "/proxy",
            post(|| async { ([("idempotent-replayed", "true")], "upstream said so") }),
        )
        .layer(
            IdempotencyLayer::new(manager)
                .replayed_header(http::HeaderName::from_static("idempotent-replayed")),
        );
    let request = Request::post("/proxy")
        .header("idempotency-key", "fresh")
        .body(Body::empty())
        .unwrap();
    let first = router.oneshot(request).await.unwrap();
    assert!(
        first.headers().get("idempotent-replayed").is_none(),
        "a first response is marked as a replay"
    );
}
