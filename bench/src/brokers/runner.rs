//! `--brokers`: connects each broker and store, runs the plans, builds the
//! report.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{compare, run, store, BrokerReport, BrokerWorkload};
use crate::args::Args;
use crate::driver::human;
use crate::BoxError;

/// Keeps harness servers alive for the run.
type Keep = Vec<Box<dyn std::any::Any + Send>>;

/// Runs every broker of `args` over every store of `args`; `None` when no
/// broker was asked for.
///
/// # Errors
/// A server that cannot be reached, a failed round.
pub async fn run_all(args: &Args) -> Result<Option<BrokerReport>, BoxError> {
    if args.brokers.is_empty() {
        return Ok(None);
    }
    let started = Instant::now();
    let mut keep: Keep = Vec::new();
    let mut results = Vec::new();
    let mut setups = BTreeMap::new();
    let mut config = BTreeMap::new();
    for broker in &args.brokers {
        let plan = args.broker_plan(broker);
        config.insert(
            format!("{broker} plan"),
            format!(
                "{} messages per variant and scenario in {} rounds of {} (interleaved A B B A …), after a warm-up round of {}",
                plan.per_round() * plan.rounds.max(1),
                plan.rounds.max(1),
                plan.per_round(),
                plan.warmup
            ),
        );
        for store_name in &args.broker_stores {
            let redis_url = redis_url(args, store_name, &mut keep).await?;
            let (repo, store_setup) = store(store_name, redis_url.as_deref()).await?;
            let workload = connect(broker, store_name, repo, &store_setup, args, &mut keep).await?;
            eprintln!("== {broker} over {store_name}: {}", workload.describe());
            setups.insert(format!("{broker} over {store_name}"), workload.describe());
            let progress = progress_bar(plan.total_messages());
            let measured = run(&*workload, &plan, &progress).await;
            progress.finish_and_clear();
            let measured = measured?;
            for c in compare(&measured) {
                eprintln!(
                    "   {:<9} library {:>8.0} msg/s   raw {:>8.0} msg/s   ratio {:.2}×   overhead {:.1} µs/msg",
                    c.scenario.as_str(),
                    c.library_messages_per_sec,
                    c.raw_messages_per_sec,
                    c.ratio,
                    c.overhead_us_per_message
                );
            }
            results.extend(measured);
        }
    }
    config.insert("duration".to_owned(), human(started.elapsed()));
    config.insert(
        "load".to_owned(),
        std::fs::read_to_string("/proc/loadavg").map_or_else(
            |_| "unknown".to_owned(),
            |l| format!("loadavg at the end: {}", l.trim()),
        ),
    );
    Ok(Some(BrokerReport {
        generated_at: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        machine: crate::report::machine(),
        config,
        setups,
        comparisons: compare(&results),
        results,
    }))
}

fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} msgs ({per_sec}, eta {eta}) {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// The Redis URL for the `redis` store: `--redis-url`, else the harness.
async fn redis_url(args: &Args, store: &str, keep: &mut Keep) -> Result<Option<String>, BoxError> {
    let _ = (args, &keep);
    if store != "redis" {
        return Ok(None);
    }
    #[cfg(feature = "redis")]
    {
        if let Some(url) = &args.redis_url {
            return Ok(Some(url.clone()));
        }
        let server = idempotency_conformance::containers::redis().await?;
        let url = server.url().to_owned();
        keep.push(Box::new(server));
        Ok(Some(url))
    }
    #[cfg(not(feature = "redis"))]
    Ok(None)
}

async fn connect(
    broker: &str,
    store: &str,
    repo: idempotency_core::SharedRepository,
    store_setup: &str,
    args: &Args,
    keep: &mut Keep,
) -> Result<Arc<dyn BrokerWorkload>, BoxError> {
    let _ = (store, &repo, store_setup, args, &keep);
    match broker {
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Arc::new(
            super::kafka::KafkaWorkload::connect(
                args.kafka_brokers.as_deref(),
                store,
                repo,
                store_setup,
                args.kafka_concurrency,
            )
            .await?,
        )),
        #[cfg(feature = "sqs")]
        "sqs" => {
            let endpoint = sqs_endpoint(args, keep).await?;
            Ok(Arc::new(
                super::sqs::SqsWorkload::connect(
                    &endpoint,
                    store,
                    repo,
                    store_setup,
                    args.sqs_pollers,
                )
                .await?,
            ))
        }
        #[cfg(feature = "rabbitmq")]
        "rabbitmq" => {
            let url = match &args.rabbitmq_url {
                Some(url) => url.clone(),
                None => {
                    let server = idempotency_conformance::containers::rabbitmq().await?;
                    let url = server.url().to_owned();
                    keep.push(Box::new(server));
                    url
                }
            };
            Ok(Arc::new(
                super::rabbitmq::RabbitWorkload::connect(&url, store, repo, store_setup).await?,
            ))
        }
        other => Err(format!("broker {other:?} is not compiled in").into()),
    }
}

/// `--sqs-endpoint` (test credentials), else the harness's server.
#[cfg(feature = "sqs")]
async fn sqs_endpoint(args: &Args, keep: &mut Keep) -> Result<super::sqs::Endpoint, BoxError> {
    if let Some(url) = &args.sqs_endpoint {
        return Ok(super::sqs::Endpoint {
            url: url.clone(),
            region: "us-east-1".to_owned(),
            access_key_id: "bench".to_owned(),
            secret_access_key: "bench".to_owned(),
        });
    }
    let server = idempotency_conformance::containers::sqs().await?;
    let endpoint = super::sqs::Endpoint {
        url: server.endpoint().to_owned(),
        region: server.region().to_owned(),
        access_key_id: server.access_key_id().to_owned(),
        secret_access_key: server.secret_access_key().to_owned(),
    };
    keep.push(Box::new(server));
    Ok(endpoint)
}
