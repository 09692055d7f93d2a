//! Every scenario once per backend: each key's effects within the contract's
//! bound, every key answered, no panic, errors of the right class, no call
//! past its bound, every key's history of store calls linearizable against
//! the memory store's sequential rules. A failure prints the seed and the failing key's history.

use idempotency_reliability::{run, scenarios_for, Backend, Figures, Plan, Scenario};

async fn every_scenario(backend: Backend) {
    scenarios(backend, &scenarios_for(backend), Plan::short).await;
}

/// The fault scenarios a batch consumer meets most (a slow store, lost
/// replies, resets, all of them in turn, a handler longer than its lease)
/// with consumers that poll 8 deliveries at a time (`execute_batch`).
async fn batches(backend: Backend) {
    let batched: Vec<Scenario> = scenarios_for(backend)
        .into_iter()
        .filter(|s| {
            matches!(
                s,
                Scenario::Baseline
                    | Scenario::LostReplies
                    | Scenario::Resets
                    | Scenario::Mixed
                    | Scenario::SlowHandlerExtended
                    | Scenario::ClockAhead
            )
        })
        .collect();
    scenarios(backend, &batched, Plan::batched).await;
}

async fn scenarios(backend: Backend, scenarios: &[Scenario], plan: fn(u64) -> Plan) {
    let seed = std::env::var("IDEMPOTENCY_RELIABILITY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("{}", Figures::header());
    let mut failures = Vec::new();
    let mut checks = Vec::new();
    for &scenario in scenarios {
        let figures = run(backend, scenario, plan(seed))
            .await
            .unwrap_or_else(|e| panic!("{backend} / {scenario}: {e}"));
        println!("{}", figures.row());
        if let Err(e) = figures.verdict() {
            failures.push(e);
        }
        checks.push(figures.linearizability_row());
    }
    // Every store call's history against the sequential contract.
    println!("\n{}", Figures::linearizability_header());
    for row in &checks {
        println!("{row}");
    }
    if failures.is_empty() {
        return;
    }
    // The failing histories, ordered events per key, kept for reading.
    let path = std::env::temp_dir().join(format!(
        "idempotency-reliability-{}-{seed}.txt",
        backend.to_string().replace(' ', "-")
    ));
    let written = std::fs::write(&path, failures.join("\n\n")).map_or_else(
        |e| format!("(not written: {e})"),
        |()| path.display().to_string(),
    );
    panic!(
        "replay with IDEMPOTENCY_RELIABILITY_SEED={seed}; histories in {written}:\n{}",
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory() {
    every_scenario(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite() {
    every_scenario(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis() {
    every_scenario(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_cluster() {
    every_scenario(Backend::RedisCluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres() {
    every_scenario(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamodb() {
    every_scenario(Backend::Dynamodb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql() {
    every_scenario(Backend::Mysql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_batches() {
    batches(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_batches() {
    batches(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_batches() {
    batches(Backend::Postgres).await;
}
