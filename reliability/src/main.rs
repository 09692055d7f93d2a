//! Soaks the stores: every scenario in turn, for `--minutes` per backend, and
//! writes the figures into RELIABILITY.md (between its results markers).

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use clap::Parser;
use idempotency_reliability::{run, scenarios_for, Backend, Figures, Plan, Scenario};

/// Fault-injection soak of the idempotency layer against real stores.
#[derive(Debug, Parser)]
struct Args {
    /// Backends to soak.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Backend::Memory, Backend::Sqlite, Backend::Redis, Backend::RedisCluster, Backend::Postgres, Backend::Mysql, Backend::Dynamodb])]
    backends: Vec<Backend>,
    /// Scenarios to run (all that apply to each backend by default).
    #[arg(long, value_enum, value_delimiter = ',')]
    scenarios: Vec<Scenario>,
    /// Minutes per backend (every scenario in turn until they pass).
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// The first run's seed (each later run adds one); random by default.
    #[arg(long)]
    seed: Option<u64>,
    /// The report to update between `<!-- results -->` and `<!-- /results -->`.
    #[arg(long, default_value = "RELIABILITY.md")]
    out: std::path::PathBuf,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let mut seed = args.seed.unwrap_or_else(rand::random::<u64>);
    let first_seed = seed;
    let mut totals: BTreeMap<(usize, usize), Figures> = BTreeMap::new();
    for (b, backend) in args.backends.iter().enumerate() {
        let until = Instant::now() + Duration::from_secs_f64(args.minutes * 60.0);
        while Instant::now() < until {
            let chosen = scenarios_for(*backend)
                .into_iter()
                .filter(|s| args.scenarios.is_empty() || args.scenarios.contains(s));
            for scenario in chosen {
                let figures = run(*backend, scenario, Plan::short(seed)).await?;
                eprintln!("{}", figures.row());
                let s = Scenario::ALL
                    .iter()
                    .position(|x| *x == scenario)
                    .unwrap_or(0);
                match totals.entry((b, s)) {
                    Entry::Vacant(slot) => {
                        slot.insert(figures);
                    }
                    Entry::Occupied(mut total) => total.get_mut().absorb(figures),
                }
                seed = seed.wrapping_add(1);
            }
        }
    }
    let table = std::iter::once(Figures::header().to_owned())
        .chain(totals.values().map(Figures::row))
        .collect::<Vec<_>>()
        .join("\n");
    let linear = std::iter::once(Figures::linearizability_header().to_owned())
        .chain(totals.values().map(Figures::linearizability_row))
        .collect::<Vec<_>>()
        .join("\n");
    let failures: Vec<String> = totals.values().filter_map(|f| f.verdict().err()).collect();
    let section = format!(
        "Soak of {} minute(s) per backend, seeds from {first_seed}, on a machine with {} cores \
         (`keys` and `executions` summed over the runs):\n\n{table}\n\n\
         Linearizability of every key's history of store calls (summed over the runs):\n\n\
         {linear}\n",
        args.minutes,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    write_results(&args.out, &section)?;
    println!("{table}");
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

/// Replaces the text between the results markers of `path`.
fn write_results(path: &std::path::Path, section: &str) -> Result<(), String> {
    const START: &str = "<!-- results -->";
    const END: &str = "<!-- /results -->";
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (head, rest) = text
        .split_once(START)
        .ok_or_else(|| format!("{}: no {START} marker", path.display()))?;
    let (_, tail) = rest
        .split_once(END)
        .ok_or_else(|| format!("{}: no {END} marker", path.display()))?;
    let updated = format!("{head}{START}\n{section}{END}{tail}");
    std::fs::write(path, updated).map_err(|e| format!("{}: {e}", path.display()))
}
