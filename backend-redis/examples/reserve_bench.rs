//! Measures the two reserve strategies against a Redis server: client latency and
//! throughput, and the server's CPU time per command (`INFO commandstats`).
//!
//! ```text
//! cargo run --release -p idempotency-redis --example reserve_bench -- redis://127.0.0.1:6379 20000 64
//! ```
//! Arguments: URL (default `$IDEMPOTENCY_TEST_REDIS_URL` or `redis://127.0.0.1:6379`),
//! keys per phase (default 20000), concurrency (default 64). It writes keys under a
//! random namespace that expire after 60 s; run it on an otherwise idle server.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use idempotency_core::{
    Clock, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest, SystemClock,
};
use idempotency_redis::{redis, RedisRepository, ReserveStrategy};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| {
        std::env::var("IDEMPOTENCY_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
    });
    let keys: usize = args.next().map_or(Ok(20_000), |s| s.parse())?;
    let concurrency: usize = args.next().map_or(Ok(64), |s| s.parse())?;
    let client = redis::Client::open(url.as_str())?;
    let mut admin = client.get_multiplexed_async_connection().await?;
    println!("{keys} keys per phase, {concurrency} in flight\n");
    println!(
        "{:<11} {:<10} {:>10} {:>9} {:>9} {:>14} {:>16}",
        "strategy", "phase", "ops/s", "p50 µs", "p99 µs", "server µs/op", "server cmds/op"
    );
    for strategy in [ReserveStrategy::SetNxGet, ReserveStrategy::Script] {
        let repo = RedisRepository::connect(&url)
            .await?
            .with_reserve_strategy(strategy);
        let ns = format!("bench-{:x}", rand::random::<u64>());
        let ids: Vec<RecordKey> = (0..keys)
            .map(|i| RecordKey::new(ns.as_str(), format!("k{i}"), 256))
            .collect::<Result<_, _>>()?;
        // Warm-up, so that connection setup does not count.
        let warm = RecordKey::new(ns.as_str(), "warm-up", 256)?;
        for _ in 0..100 {
            reserve(&repo, &warm).await?;
        }
        for phase in ["fresh", "duplicate"] {
            let before = commandstats(&mut admin).await?;
            let started = Instant::now();
            let mut latencies: Vec<Duration> = stream::iter(ids.iter())
                .map(|key| {
                    let repo = repo.clone();
                    async move {
                        let t = Instant::now();
                        let r = reserve(&repo, key).await;
                        r.map(|_| t.elapsed())
                    }
                })
                .buffer_unordered(concurrency)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<_, _>>()?;
            let elapsed = started.elapsed();
            let after = commandstats(&mut admin).await?;
            latencies.sort();
            let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p) as usize].as_micros();
            let (calls, usec, top) = delta(&before, &after);
            println!(
                "{:<11} {:<10} {:>10.0} {:>9} {:>9} {:>14.2} {:>16.2}",
                strategy.as_str(),
                phase,
                keys as f64 / elapsed.as_secs_f64(),
                pct(0.5),
                pct(0.99),
                usec as f64 / top as f64,
                calls as f64 / keys as f64,
            );
        }
    }
    Ok(())
}

async fn reserve(
    repo: &RedisRepository,
    key: &RecordKey,
) -> Result<Reservation, idempotency_core::Error> {
    let now = SystemClock.now();
    repo.reserve(ReserveRequest::new(
        key,
        OwnerToken::random(),
        now,
        Duration::from_secs(30),
        Duration::from_secs(60),
    ))
    .await
}

/// `cmdstat_<name>` → (calls, usec).
async fn commandstats(
    con: &mut redis::aio::MultiplexedConnection,
) -> Result<HashMap<String, (u64, u64)>, redis::RedisError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await?;
    let mut out = HashMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |f: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(f).and_then(|v| v.strip_prefix('=')))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        out.insert(name.to_owned(), (field("calls"), field("usec")));
    }
    Ok(out)
}

/// Server commands (all, including those run inside scripts), server µs spent
/// in top-level commands, and the number of top-level commands (SET / EVALSHA).
fn delta(
    before: &HashMap<String, (u64, u64)>,
    after: &HashMap<String, (u64, u64)>,
) -> (u64, u64, u64) {
    let d = |name: &str| {
        let (c0, u0) = before.get(name).copied().unwrap_or_default();
        let (c1, u1) = after.get(name).copied().unwrap_or_default();
        (c1.saturating_sub(c0), u1.saturating_sub(u0))
    };
    let all: u64 = after
        .keys()
        .filter(|k| !k.starts_with("info"))
        .map(|k| d(k).0)
        .sum();
    let (set_calls, set_usec) = d("set");
    let (eval_calls, eval_usec) = d("evalsha");
    if eval_calls > 0 {
        // Script strategy: EVALSHA's time includes its inner GET/SET.
        (all, eval_usec, eval_calls)
    } else {
        (all, set_usec, set_calls)
    }
}
