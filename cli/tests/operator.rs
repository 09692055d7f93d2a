//! Issue #46: the tool takes back every key it prints, names HTTP records by
//! their request and shows their stored responses, never creates a file for
//! a read-only command, tells a Redis without persistence from one with
//! snapshots only, and says with its exit status whether a failure is worth
//! retrying. Against a SQLite file and the harness's Redis servers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use common::{check, json, run};
use http_body_util::{BodyExt, Full};
use idempotency::{
    Clock, Config, IdempotencyManager, OwnerToken, RecordKey, Repository, ReserveRequest,
    SystemClock,
};
use idempotency_conformance::containers::{self, RedisServer};
use idempotency_http::http::{Request, Response, StatusCode};
use idempotency_http::{IdempotencyBody, IdempotencyLayer};
use serde_json::Value;
use tower::{Layer, ServiceExt};

const HOUR: Duration = Duration::from_secs(3600);

/// Ids an operator meets: spaces, `%` (also escape-like), `:`, `|`,
/// non-ASCII, one long enough to be stored as its digest, and an HTTP
/// record's id (starting with `-`).
fn awkward_ids() -> Vec<String> {
    vec![
        "with space".to_owned(),
        "100%25 and 7%".to_owned(),
        "a:b:c".to_owned(),
        "x|y|z".to_owned(),
        "é✓ 日本".to_owned(),
        "z".repeat(400),
        "-|4:POST|7:/orders|k 1".to_owned(),
    ]
}

/// A completed record at `key`.
async fn completed(store: &dyn Repository, key: &RecordKey) {
    let now = SystemClock.now();
    let req = ReserveRequest::new(key, OwnerToken::random(), now, HOUR, HOUR);
    let owner = req.owner;
    store.reserve(req).await.unwrap();
    store
        .complete(key, owner, Some(b"done"), now + HOUR, now)
        .await
        .unwrap();
}

/// `list` → `evict --key` with the key exactly as printed removes the
/// record, for every awkward id, in a namespace that needs escaping too;
/// then the key matches nothing, and says so with exit status 4.
async fn printed_keys_are_taken_back(url: &str) {
    let store = idempotency::connect(url).await.unwrap();
    let prefix = containers::unique_namespace("cli-keys");
    let namespace = format!("{prefix}:a b%{{c}}");
    let max = store.capabilities().max_id_bytes;
    for id in awkward_ids() {
        completed(
            store.as_ref(),
            &RecordKey::new(namespace.as_str(), &id, max).unwrap(),
        )
        .await;
    }
    let listed = json(url, &["list", "--namespace", &prefix]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let keys: Vec<String> = listed.json["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(keys.len(), awkward_ids().len(), "{}", listed.json);
    // The table prints the same keys, whole.
    let table = run(url, false, &["list", "--namespace", &prefix]);
    for key in &keys {
        assert!(
            table.stdout.contains(key.as_str()),
            "{key} in\n{}",
            table.stdout
        );
    }
    for key in &keys {
        let got = json(url, &["get", "--key", key]);
        assert_eq!(
            (got.code, &got.json["key"]),
            (0, &Value::from(key.as_str())),
            "{key}: {}",
            got.stderr
        );
        let shown = run(url, false, &["get", "--key", key]);
        assert!(shown.stdout.contains(key.as_str()), "{}", shown.stdout);
        let evicted = json(url, &["evict", "--key", key]);
        assert_eq!(
            (evicted.code, &evicted.json["removed"]),
            (0, &Value::Bool(true)),
            "{key}: {}",
            evicted.stderr
        );
        let again = run(url, false, &["evict", "--key", key]);
        assert_eq!(again.code, 4, "{key}: {}", again.stderr);
        assert!(
            again.stdout.contains("nothing to remove"),
            "{}",
            again.stdout
        );
        assert_eq!(json(url, &["get", "--key", key]).code, 4);
    }
    let empty = json(url, &["list", "--namespace", &prefix]);
    assert_eq!(empty.json["records"], Value::Array(Vec::new()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_printed_keys_are_taken_back() {
    printed_keys_are_taken_back(&common::sqlite_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_printed_keys_are_taken_back() {
    let redis = containers::redis().await.expect("a Redis server");
    printed_keys_are_taken_back(redis.url()).await;
}

/// A record the HTTP layer wrote, over a SQLite file: addressed by its
/// request (`--http-*`, the layer's own id function) or by `--id=` (its id
/// starts with `-`), its response shown as status, headers and body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_records_are_named_by_their_request_and_shown_decoded() {
    let url = common::sqlite_url();
    let store = idempotency::connect(&url).await.unwrap();
    let config = Config {
        key_prefix: containers::unique_namespace("cli-http"),
        ..Config::default()
    };
    let manager = IdempotencyManager::new(store, config)
        .unwrap()
        .scoped("http")
        .unwrap();
    let namespace = manager.record_key("x").unwrap().namespace().to_owned();
    let layer = IdempotencyLayer::new(manager).without_caller_identity();
    let service = layer.layer(tower::service_fn(
        |_: Request<IdempotencyBody<Full<Bytes>>>| async {
            let response = Response::builder()
                .status(StatusCode::CREATED)
                .header("content-type", "application/json")
                .header("location", "/orders/1")
                .body(Full::new(Bytes::from_static(br#"{"order":1}"#)))
                .unwrap();
            Ok::<_, Infallible>(response)
        },
    ));
    let request = Request::post("/orders")
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"item":"book"}"#)))
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let _ = response.into_body().collect().await.unwrap();

    let by_request = [
        "get",
        &namespace,
        "--http-method",
        "POST",
        "--http-route",
        "/orders",
        "--http-key",
        "k-1",
    ];
    let got = json(&url, &by_request);
    assert_eq!(got.code, 0, "{}", got.stderr);
    let response = &got.json["http_response"];
    assert_eq!(response["status"], 201, "{}", got.json);
    assert_eq!(response["body"]["order"], 1, "{}", got.json);
    assert!(
        response["headers"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!(["location", "/orders/1"])),
        "{response}"
    );
    assert_eq!(got.json["http_request"]["method"], "POST");
    assert_eq!(got.json["http_request"]["caller"], Value::Null);
    let id = got.json["id"].as_str().unwrap().to_owned();
    assert_eq!(id, "-|4:POST|7:/orders|k-1");

    // An id starting with `-`, without `--`: `--id=…` and `--id …`.
    let with_equals = format!("--id={id}");
    assert_eq!(json(&url, &["get", &namespace, &with_equals]).code, 0);
    let spaced = json(&url, &["get", &namespace, "--id", &id]);
    assert_eq!(
        (spaced.code, &spaced.json["id"]),
        (0, &Value::from(id.as_str()))
    );

    let table = run(&url, false, &by_request);
    for expected in [
        "201 Created",
        "location: /orders/1",
        r#""order": 1"#,
        "POST /orders",
    ] {
        assert!(
            table.stdout.contains(expected),
            "{expected} in\n{}",
            table.stdout
        );
    }
    assert!(!table.stdout.contains("hex_prefix"), "{}", table.stdout);

    let mut evict = by_request.to_vec();
    evict[0] = "evict";
    evict[3] = "post";
    let evicted = json(&url, &evict);
    assert_eq!(
        (evicted.code, &evicted.json["removed"]),
        (0, &Value::Bool(true)),
        "{}",
        evicted.stderr
    );
    assert_eq!(json(&url, &by_request).code, 4);
}

/// A read-only command on a mistyped SQLite path creates nothing and names
/// the command that would create the database; on a file never migrated,
/// every hint names `idempotency … migrate`, not a Rust function.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_never_create_a_file_and_hints_name_commands() {
    let path = common::sqlite_path();
    let url = format!("sqlite://{}", path.display());
    for args in [
        &["stats"][..],
        &["list"],
        &["get", "ns", "id"],
        &["doctor"],
        &["migrate", "--dry-run"],
        &["evict", "ns", "id"],
        &["purge"],
    ] {
        let out = json(&url, args);
        assert_eq!(out.code, 1, "{args:?}: {}", out.stderr);
        assert!(!path.exists(), "{args:?} created {}", path.display());
        assert!(
            out.stderr
                .contains(&format!("idempotency --url '{url}' migrate")),
            "{args:?}: {}",
            out.stderr
        );
    }
    // An empty file is no database set up by the library: said so, with the
    // command that sets it up.
    std::fs::File::create(&path).unwrap();
    let empty = json(&url, &["stats"]);
    assert_eq!(empty.code, 1, "{}", empty.stderr);
    assert!(
        empty
            .stderr
            .contains(&format!("`idempotency --url '{url}' migrate`")),
        "{}",
        empty.stderr
    );
    std::fs::remove_file(&path).unwrap();
    // A database an application opened without migrating (`migrate=false`).
    idempotency::connect(&format!("{url}?migrate=false"))
        .await
        .unwrap();
    let stats = json(&url, &["stats"]);
    assert_eq!(stats.code, 1, "{}", stats.stderr);
    assert!(
        stats
            .stderr
            .contains(&format!("`idempotency --url '{url}' migrate`")),
        "{}",
        stats.stderr
    );
    assert!(
        !stats.stderr.contains("::") && !stats.stderr.contains("()"),
        "{}",
        stats.stderr
    );
    let report = json(&url, &["doctor"]);
    assert_eq!(report.code, 3, "{}", report.stderr);
    let schema = check(&report.json, "schema version");
    assert_eq!(schema["verdict"], "fail");
    assert!(
        schema["fix"]
            .as_str()
            .unwrap()
            .contains("idempotency --url"),
        "{schema}"
    );
    assert!(
        !report.stdout.contains("::") && !report.stdout.contains("()"),
        "{}",
        report.stdout
    );
    assert_eq!(json(&url, &["migrate"]).code, 0);
    assert_eq!(json(&url, &["stats"]).code, 0);
}

/// Exit statuses: 75 for a store that cannot be reached (retry), 1 for a
/// misconfiguration, 2 for bad input, 4 for nothing matched; all documented
/// in `--help`.
#[test]
fn exit_statuses_tell_retryable_from_permanent() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let unreachable = json(
        &format!("redis://127.0.0.1:{port}"),
        &["--timeout", "5s", "get", "ns", "id"],
    );
    assert_eq!(unreachable.code, 75, "{}", unreachable.stderr);
    assert!(
        unreachable.stderr.contains("retryable"),
        "{}",
        unreachable.stderr
    );
    assert_eq!(json("mongodb://x", &["stats"]).code, 1);
    assert_eq!(json("sqlite://x.db?no_such_option=1", &["migrate"]).code, 1);
    assert_eq!(json("memory:", &["get", "--key", "no separator"]).code, 2);
    assert_eq!(json("memory:", &["get", "ns"]).code, 2);
    assert_eq!(
        json("memory:", &["evict", "--all", "--key", "ns:a"]).code,
        2
    );
    assert_eq!(json("memory:", &["list", "--bogus"]).code, 2);
    let missing = json("memory:", &["get", "ns", "nothing"]);
    assert_eq!(
        (missing.code, &missing.json["found"]),
        (4, &Value::Bool(false))
    );
    assert_eq!(json("memory:", &["evict", "ns", "nothing"]).code, 4);
    assert_eq!(
        json("memory:", &["evict", "--all", "--namespace", "none"]).code,
        4
    );

    let help = std::process::Command::new(env!("CARGO_BIN_EXE_idempotency"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("EXIT CODES"), "{help}");
    for code in ["0", "1", "2", "3", "4", "75"] {
        assert!(
            help.contains(&format!("\n  {code} ")),
            "exit code {code} in {help}"
        );
    }
}

/// `evict --all` removes what the filter matches under the single evict's
/// rules (a live lease is left), with its progress hidden off a terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evict_all_removes_what_the_filter_matches() {
    let url = common::sqlite_url();
    let store = idempotency::connect(&url).await.unwrap();
    let ns = containers::unique_namespace("cli-all");
    let now = SystemClock.now();
    for i in 0..40 {
        let key = RecordKey::new(ns.as_str(), format!("stuck {i}"), 256).unwrap();
        let past = now - Duration::from_secs(600);
        store
            .reserve(ReserveRequest::new(
                &key,
                OwnerToken::random(),
                past,
                Duration::from_secs(1),
                HOUR,
            ))
            .await
            .unwrap();
    }
    let live = RecordKey::new(ns.as_str(), "live", 256).unwrap();
    store
        .reserve(ReserveRequest::new(
            &live,
            OwnerToken::random(),
            now,
            HOUR,
            HOUR,
        ))
        .await
        .unwrap();

    let out = run(&url, false, &["evict", "--all", "--namespace", &ns]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("41 matched: removed 40, left 1 in place"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("--force"), "{}", out.stdout);
    assert!(
        !out.stderr.contains("/s"),
        "no progress off a terminal: {}",
        out.stderr
    );
    assert!(store.get(&live, SystemClock.now()).await.unwrap().is_some());
    let forced = json(&url, &["evict", "--all", "--namespace", &ns, "--force"]);
    assert_eq!(
        (forced.code, &forced.json["removed"]),
        (0, &Value::from(1)),
        "{}",
        forced.stderr
    );
    assert_eq!(json(&url, &["evict", "--all", "--namespace", &ns]).code, 4);
}

/// `appendonly no` and `save ""`: no persistence at all, a failure; snapshots
/// only: a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_fails_a_redis_without_persistence() {
    let none = RedisServer::dedicated_with_args(&["--appendonly", "no", "--save", ""])
        .await
        .expect("a Redis server of its own");
    let report = json(none.url(), &["doctor"]);
    assert_eq!(report.code, 3, "{}", report.stderr);
    let persistence = check(&report.json, "persistence");
    assert_eq!(persistence["verdict"], "fail", "{persistence}");
    assert!(
        persistence["detail"]
            .as_str()
            .unwrap()
            .contains("no persistence at all"),
        "{persistence}"
    );

    let snapshots = RedisServer::dedicated_with_args(&["--appendonly", "no", "--save", "3600 1"])
        .await
        .expect("a Redis server of its own");
    let report = json(snapshots.url(), &["doctor"]);
    let persistence = check(&report.json, "persistence");
    assert_eq!(persistence["verdict"], "warn", "{persistence}");
    assert!(
        persistence["detail"]
            .as_str()
            .unwrap()
            .contains("snapshots only"),
        "{persistence}"
    );
    assert_eq!(report.code, 0, "{} {}", report.json, report.stderr);
}
