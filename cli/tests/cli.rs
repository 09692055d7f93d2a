//! The `idempotency` tool run as a process against real stores: a SQLite
//! file, and the harness's Redis, PostgreSQL, MariaDB and DynamoDB servers.
//! Assertions read its `--format json` output and exit status, including
//! every doctor failure the issue names (a Redis that evicts, a PostgreSQL
//! never migrated, a DynamoDB table without TTL).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use idempotency::{
    Clock, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest, SystemClock, Timestamp,
};
use idempotency_conformance::containers::{self, RedisServer};
use serde_json::Value;

/// Runs the tool with `args` against `url`: exit status and parsed JSON
/// standard output (`Value::Null` when it is not JSON).
fn tool(url: &str, args: &[&str]) -> (i32, Value, String) {
    tool_with(url, args, &[])
}

/// [`tool`] with these environment variables set.
fn tool_with(url: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idempotency"))
        .args(["--format", "json", "--url", url])
        .args(args)
        .env_remove("IDEMPOTENCY_STORE_URL")
        .env_remove("IDEMPOTENCY_CLOCK_SKEW")
        .envs(env.iter().copied())
        .output()
        .expect("the tool runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), json, stderr)
}

/// The verdict of the check named `name` in a doctor report.
fn verdict<'a>(report: &'a Value, name: &str) -> &'a str {
    report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["name"] == name))
        .and_then(|c| c["verdict"].as_str())
        .unwrap_or_else(|| panic!("no check {name:?} in {report}"))
}

fn request(key: &RecordKey, now: Timestamp, lease: Duration, ttl: Duration) -> ReserveRequest<'_> {
    ReserveRequest::new(key, OwnerToken::random(), now, lease, ttl)
}

/// Four records under `ns`: completed (with a JSON result), live processing,
/// stuck processing (lease ended), expired; returns their keys in that order.
async fn populate(store: &dyn Repository, ns: &str) -> Vec<RecordKey> {
    let key = |id: &str| RecordKey::new(ns, id, 256).unwrap();
    let keys = vec![key("done"), key("live"), key("stuck"), key("expired")];
    let now = SystemClock.now();
    let hour = Duration::from_secs(3600);
    let done = request(&keys[0], now, hour, hour);
    let owner = done.owner;
    assert!(matches!(
        store.reserve(done).await.unwrap(),
        Reservation::Acquired { .. }
    ));
    store
        .complete(
            &keys[0],
            owner,
            Some(br#"{"receipt":"r-7"}"#),
            now + hour,
            now,
        )
        .await
        .unwrap();
    store
        .reserve(request(&keys[1], now, hour, hour))
        .await
        .unwrap();
    let past = now - Duration::from_secs(600);
    store
        .reserve(request(&keys[2], past, Duration::from_secs(1), hour))
        .await
        .unwrap();
    store
        .reserve(request(
            &keys[3],
            past,
            Duration::from_secs(1),
            Duration::from_secs(2),
        ))
        .await
        .unwrap();
    keys
}

/// What every store with admin operations answers alike, on records of a
/// fresh namespace.
async fn common_commands(url: &str, ns: &str) {
    let store = idempotency::connect(url).await.unwrap();
    populate(store.as_ref(), ns).await;

    let (code, got, err) = tool(url, &["get", ns, "done"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(got["found"], true);
    assert_eq!(got["status"], "completed");
    assert_eq!(
        got["result"]["receipt"], "r-7",
        "JSON results are shown as JSON: {got}"
    );
    assert_eq!(got["result_bytes"], 17);
    let encoded = RecordKey::new(ns, "done", 256).unwrap().encode();
    let (_, by_key, _) = tool(url, &["get", "--key", &encoded]);
    assert_eq!(by_key["status"], "completed");
    let (_, missing, _) = tool(url, &["get", ns, "nothing"]);
    assert_eq!(missing["found"], false);

    let (code, listed, err) = tool(url, &["list", "--namespace", ns]);
    assert_eq!(code, 0, "{err}");
    let ids: Vec<&str> = listed["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        ["done", "live", "stuck"],
        "expired records are not listed"
    );
    let (_, stuck, _) = tool(url, &["list", "--namespace", ns, "--stuck"]);
    assert_eq!(stuck["records"][0]["id"], "stuck");
    assert_eq!(stuck["records"].as_array().unwrap().len(), 1);
    let (_, completed, _) = tool(url, &["list", "--namespace", ns, "--status", "completed"]);
    assert_eq!(completed["records"].as_array().unwrap().len(), 1);
    let (_, one, _) = tool(url, &["list", "--namespace", ns, "--limit", "1"]);
    assert_eq!(one["records"].as_array().unwrap().len(), 1);
    assert_eq!(one["truncated"], true);

    let (code, stats, err) = tool(url, &["stats"]);
    assert_eq!(code, 0, "{err}");
    let mine = stats["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["namespace"] == ns)
        .unwrap_or_else(|| panic!("{ns} in {stats}"));
    assert_eq!(
        (&mine["processing"], &mine["stuck"], &mine["completed"]),
        (&2.into(), &1.into(), &1.into())
    );

    // Evicting a live reservation is refused; stuck is allowed; --force works.
    let (code, _, err) = tool(url, &["evict", ns, "live"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--force") && err.contains("run the handler again"),
        "{err}"
    );
    let (code, _, err) = tool(url, &["evict", ns, "done", "--only-if-stuck"]);
    assert_eq!(code, 1, "{err}");
    let (code, evicted, _) = tool(url, &["evict", ns, "stuck", "--only-if-stuck"]);
    assert_eq!((code, &evicted["removed"]), (0, &Value::Bool(true)));
    let (code, forced, _) = tool(url, &["evict", ns, "live", "--force"]);
    assert_eq!((code, &forced["removed"]), (0, &Value::Bool(true)));
    let (_, gone, _) = tool(url, &["get", ns, "live"]);
    assert_eq!(gone["found"], false);
}

fn sqlite_url() -> String {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{}.db", containers::unique_namespace("cli")));
    format!("sqlite://{}", file.display())
}

/// The lease of issue #42's scenario.
const LEASE: Duration = Duration::from_secs(3);
/// The consumers' clock skew of the scenario, as the operator gives it.
const SKEW: [(&str, &str); 1] = [("IDEMPOTENCY_CLOCK_SKEW", "2s")];

/// A `Processing` record at `key` with a lease of [`LEASE`] that ended `ago`
/// before now on this machine's clock; its owner.
async fn hold(store: &dyn Repository, key: &RecordKey, ago: Duration) -> OwnerToken {
    let now = SystemClock.now();
    let req = request(key, now - LEASE - ago, LEASE, Duration::from_secs(3600));
    let owner = req.owner;
    let reserved = store.reserve(req).await.unwrap();
    assert!(
        matches!(reserved, Reservation::Acquired { .. }),
        "{reserved:?}"
    );
    owner
}

/// Issue #42's scenario, by the tool: consumers allow a clock skew of 2 s
/// (`IDEMPOTENCY_CLOCK_SKEW=2s`, or `--clock-skew 2s`). A lease that ended
/// 0.3 s ago on the operator's clock may still run on the holder's: `list
/// --stuck`, `stats` and `evict --only-if-stuck` leave it alone (and its
/// holder completes); one that ended 2.5 s ago is stuck for all three. Each
/// command gets a namespace of its own and a record written just before it,
/// so the 1.7 s left of the skew is the command's alone.
async fn stuck_only_past_the_clock_skew(url: &str, ns: &str) {
    let store = idempotency::connect(url).await.unwrap();
    let store = store.as_ref();
    let key = |ns: &str, id: &str| RecordKey::new(ns, id, 256).unwrap();
    let recent = Duration::from_millis(300);
    let past = Duration::from_millis(2500);
    let ids = |listed: &Value| -> Vec<String> {
        let mut ids: Vec<String> = listed["records"]
            .as_array()
            .unwrap_or_else(|| panic!("{listed}"))
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };

    let listing = format!("{ns}:list");
    hold(store, &key(&listing, "past"), past).await;
    hold(store, &key(&listing, "recent"), recent).await;
    let (code, listed, err) = tool_with(url, &["list", "--namespace", &listing, "--stuck"], &SKEW);
    assert_eq!(code, 0, "{err}");
    assert_eq!(ids(&listed), ["past"], "list --stuck: {listed}");
    let (_, all, _) = tool_with(url, &["list", "--namespace", &listing], &SKEW);
    let recent_json = all["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == "recent")
        .unwrap_or_else(|| panic!("{all}"));
    assert_eq!(
        (&recent_json["lease_ended"], &recent_json["stuck"]),
        (&Value::Bool(false), &Value::Bool(false)),
        "{recent_json}"
    );
    // Without the skew, both leases have ended: the skew makes the difference.
    let (_, unskewed, _) = tool(
        url,
        &[
            "list",
            "--namespace",
            &listing,
            "--stuck",
            "--clock-skew",
            "0s",
        ],
    );
    assert_eq!(ids(&unskewed), ["past", "recent"], "{unskewed}");

    let counting = format!("{ns}:stats");
    hold(store, &key(&counting, "past"), past).await;
    hold(store, &key(&counting, "recent"), recent).await;
    let (code, stats, err) = tool_with(url, &["stats"], &SKEW);
    assert_eq!(code, 0, "{err}");
    let mine = stats["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["namespace"] == counting.as_str())
        .unwrap_or_else(|| panic!("{counting} in {stats}"));
    assert_eq!(
        (&mine["processing"], &mine["stuck"]),
        (&2.into(), &1.into()),
        "stats: {mine}"
    );

    let evicting = format!("{ns}:evict");
    let held = key(&evicting, "recent");
    let owner = hold(store, &held, recent).await;
    let (code, _, err) = tool_with(
        url,
        &["evict", &evicting, "recent", "--only-if-stuck"],
        &SKEW,
    );
    assert_eq!(
        code, 1,
        "evict --only-if-stuck released a lease within the skew: {err}"
    );
    assert!(
        err.contains("not stuck") && err.contains("clock skew"),
        "{err}"
    );
    // The flag wins over the environment.
    let args = [
        "evict",
        &evicting,
        "recent",
        "--only-if-stuck",
        "--clock-skew",
        "2s",
    ];
    let (code, _, err) = tool_with(url, &args, &[("IDEMPOTENCY_CLOCK_SKEW", "0s")]);
    assert_eq!(
        code, 1,
        "--clock-skew 2s released a lease within the skew: {err}"
    );
    let now = SystemClock.now();
    store
        .complete(
            &held,
            owner,
            Some(b"done"),
            now + Duration::from_secs(3600),
            now,
        )
        .await
        .expect("the holder still holds its lease and completes");
    hold(store, &key(&evicting, "past"), past).await;
    let (code, evicted, err) =
        tool_with(url, &["evict", &evicting, "past", "--only-if-stuck"], &SKEW);
    assert_eq!(
        (code, &evicted["removed"]),
        (0, &Value::Bool(true)),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_stuck_and_purge_keep_the_clock_skew() {
    let url = sqlite_url();
    let ns = containers::unique_namespace("cli");
    stuck_only_past_the_clock_skew(&url, &ns).await;

    // `purge` keeps the skew as a margin: a record that expired 0.3 s ago on
    // this clock may be live on a consumer's clock behind it.
    let store = idempotency::connect(&url).await.unwrap();
    let expired = |id: &str, ago: Duration| {
        let store = &store;
        let key = RecordKey::new(&ns, id, 256).unwrap();
        async move {
            let now = SystemClock.now();
            let req = request(&key, now - LEASE - ago, LEASE, LEASE);
            let expires_at = req.expires_at;
            store.reserve(req).await.unwrap();
            (key, expires_at)
        }
    };
    let (old, old_expiry) = expired("old", Duration::from_secs(3600)).await;
    let (recent, recent_expiry) = expired("recent", Duration::from_millis(300)).await;
    let (code, purged, err) = tool_with(&url, &["purge"], &SKEW);
    assert_eq!(
        (code, &purged["purged"]),
        (0, &Value::from(1)),
        "{purged} {err}"
    );
    let ms = Duration::from_millis(1);
    assert!(
        store
            .get(&recent, recent_expiry - ms)
            .await
            .unwrap()
            .is_some(),
        "purge removed a record expired less than the clock skew ago"
    );
    assert!(store.get(&old, old_expiry - ms).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stuck_keeps_the_clock_skew() {
    let shared = containers::redis().await.expect("a Redis server");
    let ns = containers::unique_namespace("cli");
    stuck_only_past_the_clock_skew(shared.url(), &ns).await;
}

#[test]
fn the_clock_skew_is_documented_in_help() {
    let out = Command::new(env!("CARGO_BIN_EXE_idempotency"))
        .arg("--help")
        .env_remove("IDEMPOTENCY_CLOCK_SKEW")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let default = humantime::format_duration(idempotency::admin::default_clock_skew());
    assert!(
        help.contains("--clock-skew")
            && help.contains("IDEMPOTENCY_CLOCK_SKEW")
            && help.contains(&format!("[default: {default}]")),
        "{help}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_from_unmigrated_to_purged() {
    let url = sqlite_url();
    // The tool never creates the file on its own (tests/operator.rs), nor
    // migrates it: doctor finds a database opened without migrating
    // (`migrate=false`) unmigrated.
    idempotency::connect(&format!("{url}?migrate=false"))
        .await
        .unwrap();
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(verdict(&report, "schema version"), "fail");
    let (code, plan, _) = tool(&url, &["migrate", "--dry-run"]);
    assert_eq!(code, 0);
    assert_eq!(plan["steps"].as_array().unwrap().len(), 1);
    assert_eq!(tool(&url, &["doctor"]).0, 3, "a dry run changes nothing");
    assert_eq!(tool(&url, &["migrate"]).0, 0);
    let (code, again, _) = tool(&url, &["migrate"]);
    assert_eq!((code, again["steps"].as_array().unwrap().len()), (0, 0));
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 0, "{report} {err}");

    let ns = containers::unique_namespace("cli");
    common_commands(&url, &ns).await;
    let (code, purged, _) = tool(&url, &["purge", "--batch", "1"]);
    assert_eq!((code, &purged["purged"]), (0, &Value::from(1)));
    let (_, report, _) = tool(&url, &["doctor"]);
    assert_eq!(verdict(&report, "purge"), "pass");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_commands_and_an_evicting_redis() {
    let shared = containers::redis().await.expect("a Redis server");
    let ns = containers::unique_namespace("cli");
    common_commands(shared.url(), &ns).await;
    let (_, report, _) = tool(shared.url(), &["doctor"]);
    assert_eq!(verdict(&report, "maxmemory-policy"), "pass");
    assert_eq!(verdict(&report, "clock offset"), "pass");

    let evicting = RedisServer::dedicated_with_args(&["--maxmemory-policy", "allkeys-lru"])
        .await
        .expect("a Redis server of its own");
    let (code, report, err) = tool(evicting.url(), &["doctor"]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(verdict(&report, "maxmemory-policy"), "fail");
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "maxmemory-policy")
        .unwrap();
    assert!(
        check["detail"].as_str().unwrap().contains("allkeys-lru"),
        "{check}"
    );
    assert!(
        check["fix"].as_str().unwrap().contains("noeviction"),
        "{check}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_commands_and_an_unmigrated_postgres() {
    let server = containers::postgres().await.expect("a PostgreSQL server");
    let schema = server.create_schema().await.unwrap();
    let url = idempotency_conformance::error_table::url_with::query(
        server.url(),
        &format!("schema={schema}"),
    );
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(verdict(&report, "schema version"), "fail");
    let (_, plan, _) = tool(&url, &["migrate", "--dry-run"]);
    assert!(plan["steps"].as_array().unwrap().len() >= 3, "{plan}");
    assert_eq!(tool(&url, &["doctor"]).0, 3, "a dry run changes nothing");
    assert_eq!(tool(&url, &["migrate"]).0, 0);
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 0, "{report} {err}");
    assert_eq!(verdict(&report, "purge index"), "pass");

    common_commands(&url, &containers::unique_namespace("cli")).await;
    let (code, purged, _) = tool(&url, &["purge"]);
    assert_eq!((code, &purged["purged"]), (0, &Value::from(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_commands_and_an_unmigrated_table() {
    let server = containers::mariadb().await.expect("a MariaDB server");
    let table = containers::unique_namespace("cli").replace('-', "_");
    let url = server.url_with(&format!("table={table}"));
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(verdict(&report, "schema version"), "fail");
    assert_eq!(tool(&url, &["migrate"]).0, 0);
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 0, "{report} {err}");
    assert_eq!(verdict(&report, "read_only"), "pass");
    // The harness's server flushes its log once a second, for speed.
    assert_eq!(verdict(&report, "innodb_flush_log_at_trx_commit"), "warn");

    common_commands(&url, &containers::unique_namespace("cli")).await;
    let (code, purged, _) = tool(&url, &["purge"]);
    assert_eq!((code, &purged["purged"]), (0, &Value::from(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_commands_and_a_table_without_ttl() {
    let server = containers::dynamodb().await.expect("a DynamoDB server");
    let table = server.unique_table_name("cli");
    server
        .call(
            "CreateTable",
            &serde_json::json!({
                "TableName": table,
                "AttributeDefinitions": [{"AttributeName": "pk", "AttributeType": "S"}],
                "KeySchema": [{"AttributeName": "pk", "KeyType": "HASH"}],
                "BillingMode": "PAY_PER_REQUEST",
            })
            .to_string(),
        )
        .await
        .unwrap();
    let url = format!(
        "dynamodb://{table}?region={}&endpoint={}&credentials=dummy",
        server.region(),
        server.endpoint()
    );
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(verdict(&report, "TTL"), "fail");
    assert_eq!(verdict(&report, "key schema"), "pass");
    let (_, plan, _) = tool(&url, &["migrate", "--dry-run"]);
    assert_eq!(plan["steps"][0], "enable TTL on `ttl`");
    assert_eq!(tool(&url, &["doctor"]).0, 3, "a dry run changes nothing");
    assert_eq!(tool(&url, &["migrate"]).0, 0);
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 0, "{report} {err}");
    assert_eq!(verdict(&report, "clock offset"), "pass");

    common_commands(&url, &containers::unique_namespace("cli")).await;
}

#[test]
fn usage_errors_and_missing_stores_are_reported() {
    let out = Command::new(env!("CARGO_BIN_EXE_idempotency"))
        .arg("stats")
        .env_remove("IDEMPOTENCY_STORE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("IDEMPOTENCY_STORE_URL"));
    let (code, _, err) = tool("memory:", &["get"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = tool("mongodb://x", &["stats"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("unknown store scheme") && err.contains("not retryable"),
        "{err}"
    );
}

/// A server that accepts connections and never answers (a store behind a
/// dead link): the tool fails after its `--timeout`, saying so, instead of
/// hanging.
#[test]
fn a_store_that_never_answers_fails_after_the_timeout() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    // Holds what it accepts open, unanswered; a bounded number of them (the
    // tool connects a few times at most), then the thread ends with the test.
    std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().take(16).collect();
        std::thread::park();
        drop(held);
    });
    let (code, _, err) = tool("memory:", &["--timeout", "0s", "stats"]);
    assert_eq!(code, 2, "a zero timeout is a usage error: {err}");
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("postgres://user@127.0.0.1:{port}/db"),
    ] {
        for args in [&["get", "ns", "id"][..], &["purge"][..], &["stats"][..]] {
            let mut all = vec!["--timeout", "300ms"];
            all.extend_from_slice(args);
            let (code, _, err) = tool(&url, &all);
            assert_eq!(code, 75, "{url} {args:?}: {err}");
            assert!(
                err.contains("did not answer within 300ms") && err.contains("retryable"),
                "{url} {args:?}: {err}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_slots_are_checked_and_listing_says_where_to_run() {
    let cluster = containers::redis_cluster().await.expect("a Redis Cluster");
    let url = cluster.cluster_url();
    // The harness's cluster keeps nothing on disk (`--save "" --appendonly
    // no`): a failing check.
    let (code, report, err) = tool(&url, &["doctor"]);
    assert_eq!(code, 3, "{report} {err}");
    assert_eq!(verdict(&report, "persistence"), "fail");
    assert_eq!(verdict(&report, "cluster slots"), "pass");
    assert_eq!(verdict(&report, "maxmemory-policy"), "pass");
    let (code, _, err) = tool(&url, &["list"]);
    assert_eq!(code, 1);
    assert!(err.contains("each master"), "{err}");
}

/// `doctor` judges a broker's retention against the consumers' record ttl:
/// an SQS queue that keeps messages 4 days (SQS's default) under records that
/// live an hour is a warning (a message delivered after its record expired
/// runs again), not under records that live 5 days; a queue that does not
/// exist is reported, not judged; brokers without `--ttl` are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_judges_a_queues_retention_against_the_ttl() {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    let sqs = containers::sqs().await.expect("an SQS server");
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(sqs.region().to_owned()))
        .endpoint_url(sqs.endpoint())
        .credentials_provider(Credentials::new(
            sqs.access_key_id(),
            sqs.secret_access_key(),
            None,
            None,
            "cli-tests",
        ))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    let client = aws_sdk_sqs::Client::from_conf(config);
    let queue = client
        .create_queue()
        .queue_name(sqs.unique_queue_name("doctor"))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_owned();
    let url = sqlite_url();
    let (code, _, err) = tool(&url, &["migrate"]);
    assert_eq!(code, 0, "{err}");
    let env = [
        ("IDEMPOTENCY_SQS_ENDPOINT", sqs.endpoint()),
        ("AWS_REGION", sqs.region()),
        ("AWS_ACCESS_KEY_ID", sqs.access_key_id()),
        ("AWS_SECRET_ACCESS_KEY", sqs.secret_access_key()),
    ];
    let doctor = |ttl: &str, queue: &str| {
        tool_with(&url, &["doctor", "--ttl", ttl, "--sqs-queue", queue], &env)
    };
    for (ttl, expected) in [("1h", "warn"), ("5d", "pass")] {
        let (code, report, err) = doctor(ttl, &queue);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            verdict(&report, "broker retention"),
            expected,
            "ttl {ttl}: {report}"
        );
    }
    let missing = format!("{}-missing", queue);
    let (code, report, err) = doctor("5d", &missing);
    assert_eq!(code, 0, "{err}");
    assert_eq!(verdict(&report, "broker retention"), "warn", "{report}");
    assert!(report.to_string().contains("could not be read"), "{report}");

    let (code, _, err) = tool_with(&url, &["doctor", "--sqs-queue", &queue], &env);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--ttl"), "{err}");
}
