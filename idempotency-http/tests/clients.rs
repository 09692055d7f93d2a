//! The layer against HTTP clients nobody on this project wrote: Python's
//! `requests` with urllib3's `Retry`, and Stripe's official Python SDK (issue
//! #46). A real axum server on `127.0.0.1` (random port) serves behind
//! [`IdempotencyLayer`](idempotency_http::IdempotencyLayer) over the in-memory
//! store; the clients run in a container of the baked
//! `idempotency-test/python-clients` image (`scripts/bake-images.sh
//! python-clients`; `IDEMPOTENCY_TEST_PYTHON_CLIENTS_IMAGE` names another) on
//! the host network, from the scripts in `tests/clients/`. Without Docker or
//! the image the tests fail, saying how to get it.
//!
//! The scripts report what each client saw (status, headers, the answers it
//! retried on); the server side counts handler runs and records every request
//! and answer outside the layer. Nothing sleeps: `/orders` is held in flight
//! until the duplicate was answered `409`, and the clients' own retry delays
//! (urllib3 follows `Retry-After`) set the pace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "clients/support.rs"]
mod support;

use std::sync::atomic::Ordering;

use axum::http::HeaderName;
use idempotency_conformance::containers::unique_namespace;
use serde_json::Value;
use support::{cut_first_answer, run_python, Server, EXPORT_LEN};

const REQUESTS_RETRY: &str = include_str!("clients/requests_retry.py");
const STRIPE_CUSTOMER: &str = include_str!("clients/stripe_customer.py");

fn header<'a>(outcome: &'a Value, name: &str) -> Option<&'a str> {
    outcome["headers"][name].as_str()
}

fn no_error(outcome: &Value) {
    assert!(
        outcome.get("error").is_none(),
        "the client failed: {outcome}"
    );
}

/// (a) Two `requests` clients with urllib3's `Retry(status_forcelist=[409,
/// 503], respect_retry_after_header=True)` send the same POST and key at
/// once. The handler runs once; the duplicate is answered `409` +
/// `Retry-After` while it runs, retries as told, and ends with the replayed
/// `201`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_urllib3_retry_waits_out_the_first_request_and_gets_its_replay() {
    let server = Server::start(None).await;
    // Held until the duplicate was turned away twice: it retried at least once.
    server
        .shared
        .hold_until_conflicts
        .store(2, Ordering::SeqCst);
    let key = unique_namespace("order");
    let result = run_python(
        REQUESTS_RETRY,
        &["in-flight".into(), server.url(), key.clone()],
    )
    .await;

    assert_eq!(
        server.shared.runs("orders"),
        1,
        "the handler ran once: {result}"
    );
    let clients = result["clients"].as_array().unwrap();
    for client in clients {
        no_error(client);
        assert_eq!(client["status"], 201, "{client}");
    }
    let (original, duplicate): (Vec<&Value>, Vec<&Value>) = clients
        .iter()
        .partition(|c| header(c, "idempotency-replayed").is_none());
    assert_eq!((original.len(), duplicate.len()), (1, 1), "{result}");
    let (original, duplicate) = (original[0], duplicate[0]);
    assert_eq!(original["body"]["held_until_conflicts"], true, "{result}");
    assert_eq!(original["retried_on"], serde_json::json!([]), "{original}");
    assert_eq!(header(duplicate, "idempotency-replayed"), Some("true"));
    assert_eq!(
        duplicate["body"], original["body"],
        "the replay is the first answer"
    );
    let retried_on = duplicate["retried_on"].as_array().unwrap();
    assert!(retried_on.len() >= 2, "{duplicate}");
    assert!(retried_on.iter().all(|s| s == 409), "{duplicate}");
    assert_eq!(duplicate["attempts"], retried_on.len() + 1);

    // Every request reached the server with the key; every 409 said when to retry.
    let seen = server.shared.seen();
    assert_eq!(seen.len(), retried_on.len() + 2, "{seen:?}");
    assert!(seen.iter().all(|s| s.key.as_deref() == Some(key.as_str())));
    for conflict in seen.iter().filter(|s| s.status == 409) {
        let after: u64 = conflict.retry_after.as_deref().unwrap().parse().unwrap();
        assert!(after >= 1, "{conflict:?}");
    }
}

/// (b) The same client, on a key whose response was not retained (its body
/// is over the layer's `max_cached_body`): the retry is answered at once with
/// `410 Gone`, without `Retry-After`, so the client does not retry, and the
/// handler does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_urllib3_retry_gets_410_at_once_for_a_response_not_retained() {
    let server = Server::start(None).await;
    let key = unique_namespace("export");
    let result = run_python(
        REQUESTS_RETRY,
        &["not-retained".into(), server.url(), key.clone()],
    )
    .await;

    let (first, retry) = (&result["first"], &result["retry"]);
    no_error(first);
    no_error(retry);
    assert_eq!(first["status"], 200, "{first}");
    assert_eq!(
        first["body_len"], EXPORT_LEN,
        "the first client got the whole body"
    );
    assert_eq!(
        server.shared.runs("exports"),
        1,
        "the handler ran once: {result}"
    );

    assert_eq!(retry["status"], 410, "{retry}");
    assert_eq!(header(retry, "retry-after"), None, "{retry}");
    assert!(
        header(retry, "content-type").is_some_and(|t| t.starts_with("application/problem+json")),
        "{retry}"
    );
    assert_eq!(
        retry["retried_on"],
        serde_json::json!([]),
        "no retry: {retry}"
    );
    assert_eq!(retry["attempts"], 1);
    let statuses: Vec<u16> = server.shared.seen().iter().map(|s| s.status).collect();
    assert_eq!(statuses, [200, 410]);
}

/// (c) Stripe's Python SDK creates a customer; the first connection is cut
/// after the handler ran, before any answer. The SDK retries (network retries
/// on) with the same `Idempotency-Key`, and gets the first answer replayed,
/// marked `Idempotent-Replayed: true` as Stripe marks it: one customer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_sdk_retry_after_a_cut_connection_gets_the_one_customer_replayed() {
    let server = Server::start(Some(HeaderName::from_static("idempotent-replayed"))).await;
    let proxy = cut_first_answer(server.addr).await;
    let result = run_python(STRIPE_CUSTOMER, &[format!("http://{proxy}")]).await;

    no_error(&result);
    assert_eq!(server.shared.runs("customers"), 1, "one customer: {result}");
    assert_eq!(result["id"], "cus_idem0000000001", "{result}");
    assert_eq!(result["object"], "customer");
    assert_eq!(result["class"], "Customer");
    assert_eq!(result["email"], "ada@example.com");
    assert_eq!(result["name"], "Ada Lovelace");
    assert_eq!(result["replayed"], "true", "{result}");

    // The SDK's own key, the same on every retry. The answer the cut hid was
    // the handler's 200, the last one its replay; a retry that came before
    // the first request's record was completed was told 409 (the SDK retries
    // that too).
    let seen = server.shared.seen();
    assert!(seen.len() >= 2, "{seen:?}");
    assert!(seen.iter().all(|s| s.path == "/v1/customers"), "{seen:?}");
    let key = seen[0]
        .key
        .as_deref()
        .expect("the SDK sent an Idempotency-Key");
    assert!(
        seen.iter().all(|s| s.key.as_deref() == Some(key)),
        "{seen:?}"
    );
    let statuses: Vec<u16> = seen.iter().map(|s| s.status).collect();
    assert_eq!(statuses.first(), Some(&200), "{seen:?}");
    assert_eq!(statuses.last(), Some(&200), "{seen:?}");
    assert!(
        statuses[1..statuses.len() - 1].iter().all(|s| *s == 409),
        "{seen:?}"
    );
}
