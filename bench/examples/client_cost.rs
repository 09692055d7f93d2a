//! The client-side cost of one operation, for `valgrind --tool=callgrind`.
//!
//! Wall-clock ratios on a shared 2-core machine move by ±10 % from run to run;
//! instruction counts do not. This program runs `OPS` operations of one variant
//! and scenario against a Redis server on a single-threaded runtime, through the
//! benchmark's own Redis workload (the library's manager, or the raw client
//! issuing the same commands). Under callgrind, the difference between a run of
//! `2 × OPS` and one of `OPS` is what `OPS` operations cost the client process:
//! the program's start-up cancels out, and the server runs in another process.
//! `bench/client-cost.sh` does that arithmetic for every combination.
//!
//! ```text
//! cargo run --release -p idempotency-bench --example client_cost -- \
//!     redis://127.0.0.1:6379 library duplicate 1000
//! ```

use idempotency_bench::workloads::redis::RedisWorkload;
use idempotency_bench::workloads::{Lane, Workload};
use idempotency_bench::{BoxError, Scenario, Variant};

const USAGE: &str = "usage: client_cost REDIS_URL library|raw fresh|duplicate OPS";

fn main() {
    if let Err(e) = run() {
        eprintln!("client_cost: {e}\n{USAGE}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, variant, scenario, ops] = args.as_slice() else {
        return Err("expected 4 arguments".into());
    };
    let variant = match variant.as_str() {
        "library" => Variant::Library,
        "raw" => Variant::Raw,
        other => return Err(format!("unknown variant {other:?}").into()),
    };
    let scenario = match scenario.as_str() {
        "fresh" => Scenario::Fresh,
        "duplicate" => Scenario::Duplicate,
        other => return Err(format!("unknown scenario {other:?}").into()),
    };
    let ops: usize = ops.parse()?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let workload = RedisWorkload::connect(url).await?;
            let ns = idempotency_bench::driver::round_namespace("cost", scenario, variant);
            // Duplicates all hit one completed key, so the set-up does not grow
            // with OPS; fresh executions each take a new key.
            if scenario == Scenario::Duplicate {
                workload.populate(&ns, 1).await?;
            }
            for i in 0..ops {
                let key = if scenario == Scenario::Duplicate {
                    0
                } else {
                    i
                };
                workload
                    .op(variant, scenario, &ns, key, Lane::Timed)
                    .await?;
            }
            Ok(())
        })
}
