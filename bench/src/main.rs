//! `idempotency-bench`: see the crate docs (`src/lib.rs`) and `BENCHMARKS.md`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idempotency_bench::args::{Args, USAGE};
use idempotency_bench::driver::{self, human};
use idempotency_bench::report::{self, Report};
use idempotency_bench::workloads::memory::MemoryWorkload;
use idempotency_bench::workloads::Workload;
use idempotency_bench::BoxError;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Keeps harness servers alive for the run.
type Keep = Vec<Box<dyn std::any::Any + Send>>;

#[tokio::main]
async fn main() {
    match run().await {
        Ok(()) => {}
        Err(e) => {
            eprintln!("idempotency-bench: {e}");
            std::process::exit(1);
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let args = Args::parse(std::env::args().skip(1), |k| std::env::var(k).ok())?;
    if args.help {
        print!("{USAGE}");
        return Ok(());
    }
    if cfg!(debug_assertions) {
        eprintln!("warning: a debug build; run with --release for representative numbers");
    }
    let mut keep: Keep = Vec::new();
    let mut results = Vec::new();
    let mut backends = BTreeMap::new();
    let started = Instant::now();
    for backend in &args.backends {
        let workload = connect(backend, &args, &mut keep).await?;
        let plan = args.plan_for(backend);
        backends.insert(backend.clone(), workload.describe());
        eprintln!("== {backend}: {}", workload.describe());
        let progress = progress_bar(plan.total_ops(true));
        let measured = driver::run_backend(workload.clone(), &plan, &progress).await;
        progress.finish_and_clear();
        if let Err(e) = workload.cleanup().await {
            eprintln!("warning: could not clean up after {backend}: {e}");
        }
        let measured = measured?;
        for c in report::compare(&measured) {
            eprintln!(
                "   {:<9} ×{:<3} library {:>10.0} ops/s   raw {:>10.0} ops/s   ratio {:.2}×   overhead {:.2} µs/op",
                c.scenario.as_str(),
                c.concurrency,
                c.library_ops_per_sec,
                c.raw_ops_per_sec,
                c.ratio,
                c.overhead_us
            );
        }
        results.extend(measured);
    }
    if !args.backends.is_empty() {
        write_report(&args, started, results, backends)?;
    }
    if let Some(brokers) = idempotency_bench::brokers::run_all(&args).await? {
        println!("{}", brokers.markdown());
        for path in brokers.write(&args.out)? {
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

/// Prints and writes the store benchmark's report.
fn write_report(
    args: &Args,
    started: Instant,
    results: Vec<idempotency_bench::stats::Measurement>,
    backends: BTreeMap<String, String>,
) -> Result<(), BoxError> {
    let mut config = BTreeMap::new();
    config.insert(
        "ops".to_owned(),
        format!(
            "at least {} per variant, scenario and concurrency (memory {}, dynamodb {}); the tables give the count measured",
            args.plan.ops, args.memory_ops, args.dynamodb_ops
        ),
    );
    config.insert(
        "rounds".to_owned(),
        format!(
            "{} per variant, interleaved A B B A …, each stretched to ≥ {} ms at the warm-up's rate",
            args.plan.rounds,
            args.plan.min_round.as_millis()
        ),
    );
    config.insert(
        "concurrency".to_owned(),
        format!("{:?}", args.plan.concurrencies),
    );
    config.insert("duration".to_owned(), human(started.elapsed()));
    let report = Report {
        generated_at: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        machine: report::machine(),
        config,
        backends,
        comparisons: report::compare(&results),
        results,
    };
    println!("{}", report.markdown());
    for path in report.write(&args.out)? {
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} ops ({per_sec}, eta {eta}) {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// Connects `backend` to its server: a URL from the options, else the test
/// harness (a container, or `IDEMPOTENCY_TEST_*` variables).
async fn connect(
    backend: &str,
    args: &Args,
    keep: &mut Keep,
) -> Result<Arc<dyn Workload>, BoxError> {
    // Unused by some feature sets (the in-process stores need no server).
    let _ = (args, &keep);
    match backend {
        "memory" => Ok(Arc::new(MemoryWorkload::new()?)),
        #[cfg(feature = "redis")]
        "redis" => {
            let url = match &args.redis_url {
                Some(url) => url.clone(),
                None => {
                    let server = idempotency_conformance::containers::redis().await?;
                    let url = server.url().to_owned();
                    keep.push(Box::new(server));
                    url
                }
            };
            Ok(Arc::new(
                idempotency_bench::workloads::redis::RedisWorkload::connect(&url).await?,
            ))
        }
        #[cfg(feature = "redis-cluster")]
        "redis-cluster" => {
            let url = match &args.redis_cluster_url {
                Some(url) => url.clone(),
                None => {
                    let cluster = idempotency_conformance::containers::redis_cluster().await?;
                    let url = cluster.cluster_url();
                    keep.push(Box::new(cluster));
                    url
                }
            };
            Ok(Arc::new(
                idempotency_bench::workloads::redis::RedisClusterWorkload::connect(&url).await?,
            ))
        }
        #[cfg(feature = "postgres")]
        "postgres" => {
            let url = match &args.postgres_url {
                Some(url) => url.clone(),
                None => {
                    let server = idempotency_conformance::containers::postgres().await?;
                    let url = server.url().to_owned();
                    keep.push(Box::new(server));
                    url
                }
            };
            Ok(Arc::new(
                idempotency_bench::workloads::postgres::PostgresWorkload::connect(
                    &url,
                    args.postgres_pool,
                )
                .await?,
            ))
        }
        #[cfg(feature = "mysql")]
        "mysql" => {
            let url = match &args.mysql_url {
                Some(url) => url.clone(),
                None => {
                    let server = idempotency_conformance::containers::mariadb().await?;
                    let url = server.url().to_owned();
                    keep.push(Box::new(server));
                    url
                }
            };
            Ok(Arc::new(
                idempotency_bench::workloads::mysql::MySqlWorkload::connect(&url, args.mysql_pool)
                    .await?,
            ))
        }
        #[cfg(feature = "dynamodb")]
        "dynamodb" => {
            let (endpoint, region) = match &args.dynamodb_endpoint {
                Some(e) => (e.clone(), args.dynamodb_region.clone()),
                None => {
                    let server = idempotency_conformance::containers::dynamodb().await?;
                    let pair = (server.endpoint().to_owned(), server.region().to_owned());
                    keep.push(Box::new(server));
                    pair
                }
            };
            Ok(Arc::new(
                idempotency_bench::workloads::dynamodb::DynamoDbWorkload::connect(
                    &endpoint, &region,
                )
                .await?,
            ))
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(Arc::new(
            idempotency_bench::workloads::sqlite::SqliteWorkload::connect(
                &args.out.join("sqlite"),
                &args.sqlite_synchronous,
            )
            .await?,
        )),
        other => Err(format!("backend {other:?} is not compiled in").into()),
    }
}
