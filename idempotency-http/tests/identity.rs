//! What a request is, for its key (issue #42, part 4): a key reused with
//! another request target (path or query string), or with a JSON body a
//! handler can tell apart, never answers with the first request's stored
//! response. In an in-process axum app whose records are scoped by route
//! template (`MatchedPath`), over the in-memory store.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{MatchedPath, Path, Query, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
use idempotency_http::{IdempotencyLayer, RequestFingerprint};
use tower::ServiceExt;

/// How often the handlers ran.
#[derive(Default)]
struct Runs(AtomicUsize);

impl Runs {
    fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// `POST /transfers?to=…`, `POST /accounts/{id}/charge` and `POST /payments`
/// (echoing its JSON body) behind a layer with `fingerprint`, over a manager
/// with `config`; records scoped by the matched route template.
fn app(fingerprint: RequestFingerprint, config: Config) -> (Router, Arc<Runs>) {
    let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config).unwrap();
    let layer = IdempotencyLayer::new(manager)
        .fingerprint(fingerprint)
        .route_extractor(|parts| {
            parts
                .extensions
                .get::<MatchedPath>()
                .map(|m| m.as_str().to_owned())
        });
    let runs = Arc::new(Runs::default());
    let router = Router::new()
        .route(
            "/transfers",
            post(
                |State(runs): State<Arc<Runs>>, Query(q): Query<HashMap<String, String>>| async move {
                    let n = runs.bump();
                    let to = q.get("to").cloned().unwrap_or_default();
                    (StatusCode::CREATED, format!("transfer {n} to {to}"))
                },
            ),
        )
        .route(
            "/accounts/{id}/charge",
            post(
                |State(runs): State<Arc<Runs>>, Path(id): Path<String>| async move {
                    let n = runs.bump();
                    (StatusCode::CREATED, format!("charge {n} on account {id}"))
                },
            ),
        )
        .route(
            "/payments",
            post(|State(runs): State<Arc<Runs>>, body: String| async move {
                let n = runs.bump();
                (StatusCode::CREATED, format!("payment {n}: {body}"))
            }),
        )
        .layer(layer)
        .with_state(runs.clone());
    (router, runs)
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    replayed: bool,
    slug: Option<String>,
    body: String,
}

async fn send(app: &Router, uri: &str, key: &str, body: &str) -> Reply {
    let request = Request::post(uri)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotency-replayed");
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8(bytes.to_vec()).unwrap();
    let slug = (status.is_client_error())
        .then(|| serde_json::from_str::<serde_json::Value>(&body).ok())
        .flatten()
        .and_then(|p| {
            p["type"]
                .as_str()
                .map(|t| t.rsplit('#').next().unwrap_or(t).to_owned())
        });
    Reply {
        status,
        replayed,
        slug,
        body,
    }
}

#[track_caller]
fn assert_key_reused(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{reply:?}");
    assert_eq!(reply.slug.as_deref(), Some("key-reused"), "{reply:?}");
    assert!(!reply.replayed, "{reply:?}");
}

#[track_caller]
fn assert_ran(reply: &Reply, body: &str) {
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert!(!reply.replayed, "{reply:?}");
    assert_eq!(reply.body, body);
}

#[track_caller]
fn assert_replayed(reply: &Reply, body: &str) {
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert!(reply.replayed, "{reply:?}");
    assert_eq!(reply.body, body);
}

/// `POST /transfers?to=alice` then `?to=bob`, one key and body: bob's
/// transfer is a reused key (`422`), never alice's stored `201`.
#[tokio::test]
async fn another_query_string_is_a_reused_key_not_a_replay() {
    let (app, runs) = app(RequestFingerprint::default(), Config::default());
    let alice = send(&app, "/transfers?to=alice", "k", "10").await;
    assert_ran(&alice, "transfer 1 to alice");
    assert_key_reused(&send(&app, "/transfers?to=bob", "k", "10").await);
    // The query is compared as sent: reordered parameters are another target.
    let (app2, _) = self::app(RequestFingerprint::default(), Config::default());
    send(&app2, "/transfers?to=alice&memo=x", "k", "10").await;
    assert_key_reused(&send(&app2, "/transfers?memo=x&to=alice", "k", "10").await);
    // No query at all is another target too.
    assert_key_reused(&send(&app, "/transfers", "k", "10").await);
    assert_eq!(
        runs.get(),
        1,
        "bob's transfer did not run under alice's key"
    );
    // Alice's retry still replays.
    assert_replayed(
        &send(&app, "/transfers?to=alice", "k", "10").await,
        "transfer 1 to alice",
    );
}

/// Records are scoped by the route template; a fingerprint that leaves the
/// concrete path out (`Body`, a custom one) still never replays
/// `/accounts/1/charge`'s response for `/accounts/2/charge`: every fingerprint
/// covers the request target.
#[tokio::test]
async fn fingerprints_without_the_path_still_tell_resources_apart() {
    let body_only = RequestFingerprint::custom(|_, body| body.to_vec());
    for fingerprint in [RequestFingerprint::Body, body_only] {
        let (app, runs) = app(fingerprint.clone(), Config::default());
        let first = send(&app, "/accounts/1/charge", "k", "5").await;
        assert_ran(&first, "charge 1 on account 1");
        let other = send(&app, "/accounts/2/charge", "k", "5").await;
        assert_key_reused(&other);
        assert_eq!(runs.get(), 1, "{fingerprint:?}");
        // The query too.
        assert_key_reused(&send(&app, "/accounts/1/charge?x=1", "k", "5").await);
        assert_replayed(
            &send(&app, "/accounts/1/charge", "k", "5").await,
            "charge 1 on account 1",
        );
    }
}

/// With no fingerprint compared (`Disabled`, or a manager that does not
/// validate payloads), records are scoped by the target: another account or
/// another query runs as a request of its own, and each replays its own
/// response.
#[tokio::test]
async fn without_a_fingerprint_records_are_scoped_by_the_target() {
    let unvalidated = Config {
        validate_payload: false,
        ..Config::default()
    };
    for (fingerprint, config) in [
        (RequestFingerprint::Disabled, Config::default()),
        (RequestFingerprint::default(), unvalidated),
    ] {
        let (app, runs) = app(fingerprint, config);
        assert_ran(
            &send(&app, "/accounts/1/charge", "k", "5").await,
            "charge 1 on account 1",
        );
        assert_ran(
            &send(&app, "/accounts/2/charge", "k", "5").await,
            "charge 2 on account 2",
        );
        assert_ran(
            &send(&app, "/transfers?to=alice", "k", "5").await,
            "transfer 3 to alice",
        );
        assert_ran(
            &send(&app, "/transfers?to=bob", "k", "5").await,
            "transfer 4 to bob",
        );
        // Each target replays its own response, whatever the body.
        assert_replayed(
            &send(&app, "/accounts/2/charge", "k", "other").await,
            "charge 2 on account 2",
        );
        assert_replayed(
            &send(&app, "/transfers?to=alice", "k", "5").await,
            "transfer 3 to alice",
        );
        assert_eq!(runs.get(), 4);
    }
}

/// `MethodPathJsonBody`: two JSON numbers a handler can tell apart are two
/// requests (`422`); the same document written otherwise is a retry.
#[tokio::test]
async fn json_numbers_keep_every_digit() {
    let (app, runs) = app(RequestFingerprint::MethodPathJsonBody, Config::default());
    let first = r#"{"amount": 0.1, "to": "alice"}"#;
    assert_ran(
        &send(&app, "/payments", "exact", first).await,
        &format!("payment 1: {first}"),
    );
    // Digits past f64's precision: another amount.
    assert_key_reused(
        &send(
            &app,
            "/payments",
            "exact",
            r#"{"amount": 0.10000000000000000001, "to": "alice"}"#,
        )
        .await,
    );
    // Integers past 64 bits.
    send(&app, "/payments", "big", r#"{"id": 18446744073709551617}"#).await;
    assert_key_reused(&send(&app, "/payments", "big", r#"{"id": 18446744073709551616}"#).await);
    assert_eq!(runs.get(), 2);
    // The same document, re-serialized: a retry.
    assert_replayed(
        &send(
            &app,
            "/payments",
            "exact",
            r#"{"to":"alice","amount":1e-1}"#,
        )
        .await,
        &format!("payment 1: {first}"),
    );
    assert_eq!(runs.get(), 2);
}

/// `MethodPathJsonBody`: a body that repeats a member name is not the object
/// with one of its values (parsers differ on which one counts).
#[tokio::test]
async fn a_repeated_json_member_is_not_the_object_without_it() {
    let (app, runs) = app(RequestFingerprint::MethodPathJsonBody, Config::default());
    let repeated = r#"{"to": "alice", "to": "bob"}"#;
    assert_ran(
        &send(&app, "/payments", "k", repeated).await,
        &format!("payment 1: {repeated}"),
    );
    assert_key_reused(&send(&app, "/payments", "k", r#"{"to": "bob"}"#).await);
    assert_key_reused(&send(&app, "/payments", "k", r#"{"to": "alice"}"#).await);
    assert_eq!(runs.get(), 1);
    assert_replayed(
        &send(&app, "/payments", "k", repeated).await,
        &format!("payment 1: {repeated}"),
    );
}
