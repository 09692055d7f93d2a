//! The benchmark's machinery on tiny runs: every operation's answer is checked
//! (a duplicate where a first delivery was expected fails the run), round trips
//! are counted exactly, and the report is written. No timing is asserted:
//! benchmarks are not tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use idempotency_bench::driver::{self, Plan};
use idempotency_bench::report::{self, Report};
use idempotency_bench::stats::Measurement;
use idempotency_bench::workloads::memory::MemoryWorkload;
use idempotency_bench::workloads::Workload;
use idempotency_bench::{Scenario, Variant};
use indicatif::ProgressBar;

fn tiny() -> Plan {
    Plan {
        ops: 40,
        rounds: 2,
        warmup: 5,
        count_ops: 10,
        concurrencies: vec![1, 8],
        scenarios: vec![Scenario::Fresh, Scenario::Duplicate],
        min_round: std::time::Duration::ZERO,
    }
}

/// The scenarios derived from a workload: duplicates answered by the local
/// answer cache, polls of 100 through `execute_batch` against the same
/// messages one at a time.
async fn derived(workload: Arc<dyn Workload>) -> Vec<Measurement> {
    let plan = Plan {
        ops: 400,
        rounds: 2,
        warmup: 0,
        count_ops: 200,
        concurrencies: vec![1, 4],
        scenarios: vec![
            Scenario::Cached,
            Scenario::BatchFresh,
            Scenario::BatchDuplicate,
        ],
        min_round: std::time::Duration::ZERO,
    };
    let progress = ProgressBar::hidden();
    let results = driver::run_backend(workload.clone(), &plan, &progress)
        .await
        .unwrap();
    workload.cleanup().await.unwrap();
    assert_eq!(results.len(), 3 * 2 * 2);
    for m in &results {
        let expected = if m.scenario.is_batch() { 4 } else { 400 };
        assert_eq!(m.ops, expected, "{m:?}");
    }
    assert_eq!(progress.position(), plan.total_ops(true));
    results
}

/// Round trips of the derived scenarios: a cached duplicate makes none; a
/// poll of 100 duplicates is one, against 100 one at a time.
fn assert_derived_round_trips(results: &[Measurement]) {
    for c in [1, 4] {
        let cached = |v| find(results, Scenario::Cached, v, c).round_trips_per_op;
        assert_eq!(cached(Variant::Library), Some(0.0), "cached, library");
        assert_eq!(cached(Variant::Raw), Some(1.0), "cached, raw client");
        let batch = |v| find(results, Scenario::BatchDuplicate, v, c).round_trips_per_op;
        assert_eq!(
            batch(Variant::Library),
            Some(1.0),
            "a poll of 100 duplicates"
        );
        assert_eq!(
            batch(Variant::Raw),
            Some(100.0),
            "100 duplicates one at a time"
        );
    }
}

fn find(results: &[Measurement], scenario: Scenario, variant: Variant, c: usize) -> &Measurement {
    results
        .iter()
        .find(|m| m.scenario == scenario && m.variant == variant && m.concurrency == c)
        .unwrap()
}

async fn run(workload: Arc<dyn Workload>) -> Vec<Measurement> {
    let plan = tiny();
    let progress = ProgressBar::hidden();
    let results = driver::run_backend(workload.clone(), &plan, &progress)
        .await
        .unwrap();
    workload.cleanup().await.unwrap();
    // 2 scenarios × 2 concurrencies × 2 variants, each with every operation.
    assert_eq!(results.len(), 8);
    for m in &results {
        assert_eq!(m.ops, plan.ops, "{m:?}");
        assert!(m.ops_per_sec > 0.0 && m.p50_us <= m.p99_us, "{m:?}");
    }
    assert_eq!(progress.position(), plan.total_ops(true));
    results
}

/// Round trips of library and raw are the same, and what the backend's design
/// says: `fresh` reserve + complete, `duplicate` the reserve alone.
fn assert_round_trips(results: &[Measurement], fresh: f64, duplicate: f64) {
    for variant in [Variant::Library, Variant::Raw] {
        for c in [1, 8] {
            assert_eq!(
                find(results, Scenario::Fresh, variant, c).round_trips_per_op,
                Some(fresh),
                "{variant} fresh"
            );
            assert_eq!(
                find(results, Scenario::Duplicate, variant, c).round_trips_per_op,
                Some(duplicate),
                "{variant} duplicate"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_run_writes_a_complete_report() {
    let results = run(Arc::new(MemoryWorkload::new().unwrap())).await;
    assert!(results.iter().all(|m| m.round_trips_per_op.is_none()));
    let comparisons = report::compare(&results);
    assert_eq!(comparisons.len(), 4);
    let report = Report {
        generated_at: 0,
        machine: report::machine(),
        config: Default::default(),
        backends: Default::default(),
        comparisons,
        results,
    };
    let dir = std::env::temp_dir().join(format!("idem-bench-{:016x}", rand::random::<u64>()));
    let files = report.write(&dir).unwrap();
    assert_eq!(files.len(), 3);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["results"].as_array().unwrap().len(), 8);
    assert_eq!(json["results"][0]["variant"], "library");
    assert!(std::fs::read_to_string(dir.join("chart.svg"))
        .unwrap()
        .contains("manager overhead"));
    std::fs::remove_dir_all(dir).unwrap();
    // Every answer of the derived scenarios is checked as they run.
    derived(Arc::new(MemoryWorkload::new().unwrap())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_round_trips_match_the_raw_client() {
    use idempotency_bench::workloads::redis::RedisWorkload;
    let server = idempotency_conformance::containers::redis().await.unwrap();
    let results = run(Arc::new(
        RedisWorkload::connect(server.url()).await.unwrap(),
    ))
    .await;
    // SET NX GET + EVALSHA; a duplicate is the SET alone.
    assert_round_trips(&results, 2.0, 1.0);
    // INFO commandstats also counts the script's inner GET and SET.
    let lib = find(&results, Scenario::Fresh, Variant::Library, 1);
    assert_eq!(lib.server_commands_per_op, Some(4.0));
    let dup = find(&results, Scenario::Duplicate, Variant::Raw, 8);
    assert_eq!(dup.server_commands_per_op, Some(1.0));
    let workload = RedisWorkload::connect(server.url()).await.unwrap();
    assert_derived_round_trips(&derived(Arc::new(workload)).await);
}

/// The Redis Cluster workload runs every scenario and checks every answer
/// (no round trips are counted on a cluster).
#[cfg(feature = "redis-cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_runs_every_scenario() {
    use idempotency_bench::workloads::redis::RedisClusterWorkload;
    let cluster = idempotency_conformance::containers::redis_cluster()
        .await
        .unwrap();
    let url = cluster.cluster_url();
    let results = run(Arc::new(RedisClusterWorkload::connect(&url).await.unwrap())).await;
    assert!(results.iter().all(|m| m.round_trips_per_op.is_none()));
    derived(Arc::new(RedisClusterWorkload::connect(&url).await.unwrap())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_round_trips_match_the_raw_client() {
    use idempotency_bench::workloads::postgres::PostgresWorkload;
    let server = idempotency_conformance::containers::postgres()
        .await
        .unwrap();
    let workload = PostgresWorkload::connect(server.url(), 4).await.unwrap();
    let results = run(Arc::new(workload)).await;
    // The reserve function + the completing UPDATE; a duplicate is the call.
    // Each statement is one round trip, library and raw alike (the raw
    // client's pings as its connections return to sqlx's pool are not
    // counted; the library keeps its connections and sends none).
    assert_round_trips(&results, 2.0, 1.0);
    let workload = PostgresWorkload::connect(server.url(), 4).await.unwrap();
    assert_derived_round_trips(&derived(Arc::new(workload)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_requests_match_the_raw_client() {
    use idempotency_bench::workloads::dynamodb::DynamoDbWorkload;
    let server = idempotency_conformance::containers::dynamodb()
        .await
        .unwrap();
    let workload = DynamoDbWorkload::connect(server.endpoint(), server.region())
        .await
        .unwrap();
    let results = run(Arc::new(workload)).await;
    // Conditional PutItem + UpdateItem; a duplicate is the failed PutItem.
    assert_round_trips(&results, 2.0, 1.0);
}

/// A tiny broker run: `plan` on `workload`, every round checked as it runs
/// (each message consumed once; the handler run for every fresh message and,
/// through the library, for no duplicate), the report written.
#[cfg(any(feature = "kafka", feature = "sqs", feature = "rabbitmq"))]
async fn broker_run(
    workload: &dyn idempotency_bench::brokers::BrokerWorkload,
    plan: &idempotency_bench::brokers::BrokerPlan,
) {
    use idempotency_bench::brokers::{self, BrokerReport};
    let progress = ProgressBar::hidden();
    let results = brokers::run(workload, plan, &progress).await.unwrap();
    assert_eq!(progress.position(), plan.total_messages());
    // fresh and duplicate × library and raw.
    assert_eq!(results.len(), 4);
    for m in &results {
        assert_eq!(m.messages, plan.per_round() * plan.rounds, "{m:?}");
        assert_eq!(m.round_messages_per_sec.len(), plan.rounds, "{m:?}");
        // RabbitMQ's library consumer has no poll of its own to time.
        let polls_timed = !(m.broker == "rabbitmq" && m.variant == Variant::Library);
        assert!(m.messages_per_sec > 0.0, "{m:?}");
        assert_eq!(m.polls > 0, polls_timed, "{m:?}");
        assert!(m.poll_p50_us <= m.poll_p99_us, "{m:?}");
    }
    let comparisons = brokers::compare(&results);
    assert_eq!(comparisons.len(), 2);
    assert!(comparisons.iter().all(|c| c.ratio > 0.0));
    let dir = std::env::temp_dir().join(format!("bench-brokers-{}", rand::random::<u64>()));
    let report = BrokerReport {
        generated_at: 0,
        machine: report::machine(),
        config: Default::default(),
        setups: Default::default(),
        results,
        comparisons,
    };
    let written = report.write(&dir).unwrap();
    assert_eq!(written.len(), 2);
    let md = std::fs::read_to_string(dir.join("brokers.md")).unwrap();
    assert!(md.contains(&format!("| {} | memory | duplicate |", workload.broker())));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Kafka on librdkafka's mock cluster: 2 × 2 × (200 + 100 warm-up) messages.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_against_its_raw_loop() {
    use idempotency_bench::brokers::{kafka::KafkaWorkload, store, BrokerPlan};
    let (repo, setup) = store("memory", None).await.unwrap();
    let workload = KafkaWorkload::connect(None, "memory", repo, &setup, 16)
        .await
        .unwrap();
    let plan = BrokerPlan {
        messages: 200,
        poll: 100,
        rounds: 2,
        warmup: 100,
        scenarios: vec![Scenario::Fresh, Scenario::Duplicate],
    };
    broker_run(&workload, &plan).await;
}

/// SQS on the harness's server (slow: moto): 2 × 2 × 60 messages, no
/// warm-up round, ten poll loops a variant.
#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_consumer_against_its_raw_loop() {
    use idempotency_bench::brokers::sqs::{Endpoint, SqsWorkload};
    use idempotency_bench::brokers::{store, BrokerPlan, SQS_POLLERS};
    let server = idempotency_conformance::containers::sqs().await.unwrap();
    let endpoint = Endpoint {
        url: server.endpoint().to_owned(),
        region: server.region().to_owned(),
        access_key_id: server.access_key_id().to_owned(),
        secret_access_key: server.secret_access_key().to_owned(),
    };
    let (repo, setup) = store("memory", None).await.unwrap();
    let workload = SqsWorkload::connect(&endpoint, "memory", repo, &setup, SQS_POLLERS)
        .await
        .unwrap();
    let plan = BrokerPlan {
        messages: 50,
        poll: 10,
        rounds: 2,
        warmup: 0,
        scenarios: vec![Scenario::Fresh, Scenario::Duplicate],
    };
    broker_run(&workload, &plan).await;
}

/// RabbitMQ on the harness's broker (most of the time is its start): 2 × 2 ×
/// 200 messages, no warm-up round.
#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_consumer_against_its_raw_loop() {
    use idempotency_bench::brokers::{rabbitmq::RabbitWorkload, store, BrokerPlan};
    let server = idempotency_conformance::containers::rabbitmq()
        .await
        .unwrap();
    let (repo, setup) = store("memory", None).await.unwrap();
    let workload = RabbitWorkload::connect(server.url(), "memory", repo, &setup)
        .await
        .unwrap();
    let plan = BrokerPlan {
        messages: 200,
        poll: 100,
        rounds: 2,
        warmup: 0,
        scenarios: vec![Scenario::Fresh, Scenario::Duplicate],
    };
    broker_run(&workload, &plan).await;
}
