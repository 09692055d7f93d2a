//! actix-specific parts of the middleware, in actix's in-process test
//! service over the in-memory store: the caller named from actix's own
//! request (what an authentication middleware left in its extensions), and
//! requests the layer does not protect going to the app untouched. The
//! example server (`examples/actix-server`) drives the rest with a real client
//! over a real store.

#![cfg(feature = "actix")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpMessage, HttpResponse};
use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
use idempotency_http::{IdempotencyLayer, Protection, RequestFingerprint};

/// What the app's authentication middleware establishes.
#[derive(Clone)]
struct UserId(&'static str);

fn manager() -> IdempotencyManager {
    IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap()
}

/// An app whose `POST /orders` counts its runs and answers the run number;
/// the user is taken from an `x-user` header by a stand-in for an
/// authentication middleware (registered after the idempotency layer, so
/// that it runs first).
async fn app(
    layer: IdempotencyLayer,
    runs: Arc<AtomicUsize>,
) -> impl Service<actix_http::Request, Response = ServiceResponse, Error = actix_web::Error> {
    let runs = web::Data::new(runs);
    test::init_service(
        App::new()
            .app_data(runs)
            .wrap(layer)
            .wrap_fn(|request, service| {
                let user = match request.headers().get("x-user").map(|v| v.as_bytes()) {
                    Some(b"alice") => Some(UserId("alice")),
                    Some(b"bob") => Some(UserId("bob")),
                    _ => None,
                };
                if let Some(user) = user {
                    request.extensions_mut().insert(user);
                }
                service.call(request)
            })
            .route(
                "/orders",
                web::post().to(|runs: web::Data<Arc<AtomicUsize>>| async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    HttpResponse::Created().body(format!("run {run}"))
                }),
            )
            .route(
                "/orders/{id}/notes",
                web::post().to(|runs: web::Data<Arc<AtomicUsize>>| async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    HttpResponse::Ok().body(format!("note {run}"))
                }),
            ),
    )
    .await
}

async fn post(
    app: &impl Service<actix_http::Request, Response = ServiceResponse, Error = actix_web::Error>,
    uri: &str,
    user: &str,
    key: Option<&str>,
) -> (StatusCode, bool, String) {
    let mut request = test::TestRequest::post()
        .uri(uri)
        .insert_header(("x-user", user));
    if let Some(key) = key {
        request = request.insert_header(("idempotency-key", key));
    }
    let response = test::call_service(app, request.to_request()).await;
    let status = response.status();
    let replayed = response.headers().contains_key("idempotency-replayed");
    let body = test::read_body(response).await;
    (status, replayed, String::from_utf8(body.to_vec()).unwrap())
}

#[actix_web::test]
async fn the_caller_is_named_from_actix_request_extensions() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(manager()).actix_caller_identity(|request| {
        request.extensions().get::<UserId>().map(|u| u.0.to_owned())
    });
    let app = app(layer, runs.clone()).await;

    let alice = post(&app, "/orders", "alice", Some("k")).await;
    assert_eq!(alice, (StatusCode::CREATED, false, "run 1".to_owned()));
    let bob = post(&app, "/orders", "bob", Some("k")).await;
    assert_eq!(
        bob,
        (StatusCode::CREATED, false, "run 2".to_owned()),
        "bob's own order ran"
    );
    let alice_again = post(&app, "/orders", "alice", Some("k")).await;
    assert_eq!(alice_again, (StatusCode::CREATED, true, "run 1".to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[actix_web::test]
async fn a_later_caller_policy_replaces_the_actix_one() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(manager())
        .actix_caller_identity(|request| {
            request.extensions().get::<UserId>().map(|u| u.0.to_owned())
        })
        .without_caller_identity();
    let app = app(layer, runs.clone()).await;
    post(&app, "/orders", "alice", Some("k")).await;
    let bob = post(&app, "/orders", "bob", Some("k")).await;
    assert_eq!(
        bob,
        (StatusCode::CREATED, true, "run 1".to_owned()),
        "one shared key space"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[actix_web::test]
async fn unprotected_routes_reach_the_app_untouched() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(manager()).route("/orders/{id}/notes", Protection::Skip);
    let app = app(layer, runs.clone()).await;
    // A skipped route ignores the key: both calls run.
    assert_eq!(
        post(&app, "/orders/7/notes", "alice", Some("k")).await,
        (StatusCode::OK, false, "note 1".to_owned())
    );
    assert_eq!(
        post(&app, "/orders/7/notes", "alice", Some("k")).await,
        (StatusCode::OK, false, "note 2".to_owned())
    );
    // And needs none; the protected route next to it still does.
    assert_eq!(
        post(&app, "/orders/7/notes", "alice", None).await.0,
        StatusCode::OK
    );
    assert_eq!(
        post(&app, "/orders", "alice", None).await.0,
        StatusCode::BAD_REQUEST
    );
}

/// `POST /accounts/{id}/charge` and `POST /transfers?to=…`, counting their
/// runs, behind `layer` (records scoped by actix's matched pattern).
async fn accounts(
    layer: IdempotencyLayer,
    runs: Arc<AtomicUsize>,
) -> impl Service<actix_http::Request, Response = ServiceResponse, Error = actix_web::Error> {
    test::init_service(
        App::new()
            .app_data(web::Data::new(runs))
            .wrap(layer)
            .route(
                "/accounts/{id}/charge",
                web::post().to(
                    |runs: web::Data<Arc<AtomicUsize>>, id: web::Path<String>| async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        HttpResponse::Created().body(format!("charge {run} on account {id}"))
                    },
                ),
            )
            .route(
                "/transfers",
                web::post().to(
                    |runs: web::Data<Arc<AtomicUsize>>,
                     q: web::Query<std::collections::HashMap<String, String>>| async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        let to = q.get("to").cloned().unwrap_or_default();
                        HttpResponse::Created().body(format!("transfer {run} to {to}"))
                    },
                ),
            ),
    )
    .await
}

/// Records are scoped by actix's route pattern (`/accounts/{id}/charge`):
/// a key reused on another account, or with another query string, is `422`
/// under every fingerprint that compares, never the first account's replay.
#[actix_web::test]
async fn another_resource_or_query_of_a_route_is_a_reused_key() {
    let body_only = RequestFingerprint::custom(|_, body| body.to_vec());
    for fingerprint in [
        RequestFingerprint::default(),
        RequestFingerprint::Body,
        body_only,
    ] {
        let runs = Arc::new(AtomicUsize::new(0));
        let layer = IdempotencyLayer::new(manager()).fingerprint(fingerprint.clone());
        let app = accounts(layer, runs.clone()).await;
        let first = post(&app, "/accounts/1/charge", "alice", Some("k")).await;
        assert_eq!(
            first,
            (
                StatusCode::CREATED,
                false,
                "charge 1 on account 1".to_owned()
            )
        );
        let other = post(&app, "/accounts/2/charge", "alice", Some("k")).await;
        assert_eq!(
            other.0,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{fingerprint:?}: {other:?}"
        );
        assert!(other.2.contains("key-reused"), "{other:?}");
        let alice = post(&app, "/transfers?to=alice", "alice", Some("t")).await;
        assert_eq!(alice.0, StatusCode::CREATED);
        let bob = post(&app, "/transfers?to=bob", "alice", Some("t")).await;
        assert_eq!(bob.0, StatusCode::UNPROCESSABLE_ENTITY, "{bob:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{fingerprint:?}");
        let again = post(&app, "/accounts/1/charge", "alice", Some("k")).await;
        assert_eq!(
            again,
            (
                StatusCode::CREATED,
                true,
                "charge 1 on account 1".to_owned()
            )
        );
    }
}

/// With no fingerprint compared, records are scoped by the target: another
/// account runs as a request of its own.
#[actix_web::test]
async fn without_a_fingerprint_another_resource_is_its_own_request() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(manager()).fingerprint(RequestFingerprint::Disabled);
    let app = accounts(layer, runs.clone()).await;
    post(&app, "/accounts/1/charge", "alice", Some("k")).await;
    let other = post(&app, "/accounts/2/charge", "alice", Some("k")).await;
    assert_eq!(
        other,
        (
            StatusCode::CREATED,
            false,
            "charge 2 on account 2".to_owned()
        )
    );
    let bob = post(&app, "/transfers?to=bob", "alice", Some("k")).await;
    assert_eq!(
        bob,
        (StatusCode::CREATED, false, "transfer 3 to bob".to_owned())
    );
    assert_eq!(
        post(&app, "/accounts/2/charge", "alice", Some("k")).await,
        (
            StatusCode::CREATED,
            true,
            "charge 2 on account 2".to_owned()
        )
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// The problem responder and the replay marker's name work the same in
/// actix: a Stripe-style body with the layer's status, and
/// `Idempotent-Replayed` on replays.
#[actix_web::test]
async fn custom_problem_answers_and_replay_marker() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(manager())
        .replayed_header(idempotency_http::http::HeaderName::from_static(
            "idempotent-replayed",
        ))
        .problem_responder(|problem| {
            let body = format!(
                r#"{{"error":{{"type":"invalid_request_error","code":"{}"}}}}"#,
                problem.kind().slug()
            );
            let mut response = idempotency_http::http::Response::new(bytes::Bytes::from(body));
            *response.status_mut() = problem.status();
            response
        });
    let app = app(layer, runs.clone()).await;

    let missing =
        test::call_service(&app, test::TestRequest::post().uri("/orders").to_request()).await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert_eq!(missing.headers().get("cache-control").unwrap(), "no-store");
    let body = test::read_body(missing).await;
    assert_eq!(
        body,
        r#"{"error":{"type":"invalid_request_error","code":"missing-key"}}"#
    );

    let request = || {
        test::TestRequest::post()
            .uri("/orders")
            .insert_header(("idempotency-key", "k"))
            .to_request()
    };
    let first = test::call_service(&app, request()).await;
    assert!(!first.headers().contains_key("idempotent-replayed"));
    let retry = test::call_service(&app, request()).await;
    assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
    assert!(!retry.headers().contains_key("idempotency-replayed"));
    assert_eq!(test::read_body(retry).await, "run 1");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
