//! `idempotency`: the operator tool of idempotency-rs. Inspect, evict, purge
//! and migrate the records of any store `idempotency::connect` knows, and
//! check a store's settings against what the library relies on.
//!
//! ```text
//! idempotency --url redis://127.0.0.1:6379 get idempotency:payments evt-42
//! IDEMPOTENCY_STORE_URL=postgres://… idempotency list --stuck --format json
//! idempotency --url sqlite://app.db evict --key 'idempotency%3Apayments:evt-42'
//! idempotency --url sqlite://app.db get idempotency:http --http-method POST --http-route /orders --http-key k-1
//! IDEMPOTENCY_CLOCK_SKEW=2s idempotency --url sqlite://app.db evict --all --stuck
//! idempotency --url mysql://… doctor
//! ```
//!
//! Keys are printed one way everywhere, the form `--key` reads back (see
//! `keys`). Stuck records and purges are judged as consumers judge them
//! (`idempotency::decision`): a lease is over only `--clock-skew` after it
//! ended on this machine's clock, and `purge` removes only records expired
//! at least that long ago. Give the consumers' `clock_skew` (flag, or
//! `IDEMPOTENCY_CLOCK_SKEW`); without it the tool assumes
//! `idempotency::admin::default_clock_skew()`: the library's default or
//! 400 ms, whichever is larger.
//!
//! Exit statuses tell a retryable failure (75) from a permanent one (1),
//! bad input (2), a failed doctor check (3) and nothing matched (4): see
//! `exit` and `idempotency --help`.

mod brokers;
mod commands;
mod exit;
mod http_view;
mod keys;
mod progress;
mod store;
mod view;

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use idempotency::admin::{default_clock_skew, Admin, Check, DoctorOptions, ListFilter, Verdict};
use idempotency::{SharedRepository, Status, SystemClock};
use serde_json::json;

use crate::commands::{Ctx, Evicting, Purging};
use crate::exit::{within, Failure, DOCTOR_FAILED, EXIT_CODES_HELP};
use crate::keys::KeyArgs;
use crate::store::Access;

/// The short help's pointer to the exit statuses.
const EXIT_CODES_SHORT: &str = "Exit codes: 0 ok, 1 permanent failure, 2 bad input, 3 doctor \
                                found a failing check, 4 nothing matched, 75 retryable (store \
                                unreachable or timed out). Details: --help";

/// The idempotency-rs operator tool: records of any store, by URL.
#[derive(Debug, Parser)]
#[command(
    name = "idempotency",
    version,
    about,
    long_about = None,
    after_help = EXIT_CODES_SHORT,
    after_long_help = EXIT_CODES_HELP
)]
struct Cli {
    /// The store: memory:, sqlite://path, redis://…, postgres://…,
    /// mysql://…, dynamodb://TABLE?…
    #[arg(
        long,
        env = "IDEMPOTENCY_STORE_URL",
        global = true,
        hide_env_values = true
    )]
    url: Option<String>,

    /// Output for people (aligned tables) or scripts (JSON).
    #[arg(long, value_enum, default_value_t = Format::Table, global = true)]
    format: Format,

    /// How long one call to the store may take: a store that stops answering
    /// fails the command after this, instead of hanging it. Connecting and
    /// the calls on one record or one batch (`get`, `evict`, each batch of
    /// `purge`) are bounded by 30 s unless given; calls that walk the whole
    /// store (`list`, `stats`, `migrate`, `doctor`) only when given.
    #[arg(long, value_parser = parse_timeout, global = true)]
    timeout: Option<Duration>,

    /// The consumers' `clock_skew` (their `Config::clock_skew`). A lease
    /// counts as ended, its record stuck (`list --stuck`, `stats`, `evict`),
    /// only this long after `lease_until` on this machine's clock, as
    /// consumers take over; `purge` removes only records expired at least
    /// this long ago; `doctor` judges the clock offset against it. The
    /// default is conservative: the library's default `clock_skew` or 400 ms,
    /// whichever is larger; give the consumers' value when they set one.
    #[arg(
        long,
        env = "IDEMPOTENCY_CLOCK_SKEW",
        value_parser = parse_skew,
        default_value_t = Skew(default_clock_skew()),
        global = true
    )]
    clock_skew: Skew,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Table,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StatusArg {
    Processing,
    Completed,
    Failed,
}

impl From<StatusArg> for Status {
    fn from(s: StatusArg) -> Status {
        match s {
            StatusArg::Processing => Status::Processing,
            StatusArg::Completed => Status::Completed,
            StatusArg::Failed => Status::Failed,
        }
    }
}

/// Which records `list` shows and `evict --all` removes.
#[derive(Debug, Clone, Default, clap::Args)]
struct FilterArgs {
    /// Only namespaces starting with this.
    #[arg(long = "namespace", value_name = "PREFIX")]
    namespace_prefix: Option<String>,
    /// Only records in this status.
    #[arg(long, value_enum)]
    status: Option<StatusArg>,
    /// Only stuck records: `processing`, the lease ended at least
    /// `--clock-skew` ago.
    #[arg(long)]
    stuck: bool,
    /// At most this many (default: 100 for `list`, 1000 for `evict --all`).
    #[arg(long)]
    limit: Option<usize>,
}

impl FilterArgs {
    fn any(&self) -> bool {
        self.namespace_prefix.is_some()
            || self.status.is_some()
            || self.stuck
            || self.limit.is_some()
    }

    fn filter(&self, skew: Duration, default_limit: usize) -> ListFilter {
        ListFilter {
            namespace_prefix: self.namespace_prefix.clone(),
            status: self.status.map(Status::from),
            stuck: self.stuck,
            clock_skew: skew,
            limit: self.limit.unwrap_or(default_limit),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One record, decoded: status, owner, lease and expiry, result preview
    /// (a stored HTTP response as status, headers and body). Exit status 4
    /// when no live record has the key.
    Get(KeyArgs),
    /// Records, where the store can enumerate them without blocking it. The
    /// `key` column is what `get --key` and `evict --key` take.
    List(FilterArgs),
    /// Removes one record, or with `--all` every record the filter matches
    /// (with progress). A `processing` record that is not stuck (its lease
    /// ended less than `--clock-skew` ago, or runs on) is refused unless
    /// `--force`: its handler may still be running, and the next delivery
    /// runs it again. Exit status 4 when nothing matches.
    Evict {
        #[command(flatten)]
        key: KeyArgs,
        /// Every record `--namespace`, `--status`, `--stuck` and `--limit`
        /// match (as `list` does), each under the rules of a single evict.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        filter: FilterArgs,
        /// Only if the record is stuck: `processing`, the lease ended at
        /// least `--clock-skew` ago.
        #[arg(long)]
        only_if_stuck: bool,
        /// Remove a live `processing` record too.
        #[arg(long)]
        force: bool,
    },
    /// Removes records expired at least `--clock-skew` ago (the store's
    /// `purge_expired` at now less the skew), with progress on a terminal
    /// (count, rate, elapsed).
    Purge {
        /// At most this many (default: all).
        #[arg(long)]
        limit: Option<usize>,
        /// Records per call to the store.
        #[arg(long, default_value_t = 500)]
        batch: usize,
    },
    /// Creates or upgrades what the store needs (and the SQLite file); idempotent.
    Migrate {
        /// Print what would be done, change nothing (and create no file).
        #[arg(long)]
        dry_run: bool,
    },
    /// Live records by namespace and status (sampled where counting is
    /// expensive, and labelled so).
    Stats,
    /// Checks the store's settings against what the library relies on; exit
    /// status 3 when a check fails. The clock offset is judged against
    /// `--clock-skew`; each broker named (`--sqs-queue`, `--kafka-topic`)
    /// has its retention judged against `--ttl`.
    Doctor(brokers::Brokers),
    /// Shell completions, to standard output.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

impl Command {
    /// What the command does to the store.
    fn access(&self) -> Access {
        match self {
            Command::Get(_) | Command::List(_) | Command::Stats | Command::Doctor(_) => {
                Access::Read
            }
            Command::Migrate { dry_run: true } => Access::Read,
            Command::Migrate { dry_run: false } => Access::Migrate,
            Command::Evict { .. } | Command::Purge { .. } | Command::Completions { .. } => {
                Access::Write
            }
        }
    }
}

pub(crate) fn parse_timeout(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("a timeout must be positive".to_owned()),
        d => Ok(d),
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    idempotency::parse_duration(s).ok_or_else(|| format!("{s:?} is not a duration such as 400ms"))
}

/// The consumers' clock skew, shown as a duration (`2s`, `400ms`) in `--help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Skew(Duration);

impl std::fmt::Display for Skew {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

fn parse_skew(s: &str) -> Result<Skew, String> {
    parse_duration(s).map(Skew)
}

/// The bound of connecting and of calls on one record or one batch, unless
/// `--timeout` says otherwise.
const POINT_TIMEOUT: Duration = Duration::from_secs(30);

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Completions { shell } = cli.command {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "idempotency", &mut script);
        emit(&String::from_utf8_lossy(&script));
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(exit::PERMANENT);
        }
    };
    let url = cli.url.clone().unwrap_or_default();
    match runtime.block_on(run(cli)) {
        Ok(out) => {
            emit(&out);
            ExitCode::from(exit::OK)
        }
        Err(Failure { message, code }) => {
            eprintln!("error: {}", store::tool_hints(&message, &url));
            ExitCode::from(code)
        }
    }
}

/// Writes `text` and a newline to standard output; a reader that went away
/// (`| head`) is not an error.
pub(crate) fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}").and_then(|()| out.flush());
}

async fn run(cli: Cli) -> Result<String, Failure> {
    let url = cli
        .url
        .clone()
        .ok_or_else(|| Failure::usage("no store: pass --url or set IDEMPOTENCY_STORE_URL"))?;
    let Skew(skew) = cli.clock_skew;
    let ctx = Ctx {
        // Calls on one record or batch, and connecting; calls over the
        // whole store (bounded only when asked).
        limit: cli.timeout.unwrap_or(POINT_TIMEOUT),
        whole: cli.timeout,
        skew,
        json: cli.format == Format::Json,
    };
    let access = cli.command.access();
    let connect_url = store::connect_url(&url, access)?;
    let store = within(ctx.limit, idempotency::connect(&connect_url))
        .await
        .map_err(|failure| store::connect_failure(&url, access, failure))?;
    match cli.command {
        Command::Get(key) => commands::get(&store, &key, ctx).await,
        Command::List(filter) => {
            commands::list(admin(&store, "list")?, &filter.filter(skew, 100), ctx).await
        }
        Command::Evict {
            key,
            all,
            filter,
            only_if_stuck,
            force,
        } => {
            let rules = Evicting {
                only_if_stuck,
                force,
            };
            if all {
                if key.is_given() {
                    return Err(Failure::usage(
                        "evict --all takes a filter (--namespace, --status, --stuck, --limit), \
                         not a key",
                    ));
                }
                let filter = filter.filter(skew, 1000);
                let admin = admin(&store, "evict --all")?;
                return commands::evict_all(&store, admin, &filter, rules, ctx).await;
            }
            if filter.any() {
                return Err(Failure::usage(
                    "--namespace, --status, --stuck and --limit select records for evict --all",
                ));
            }
            commands::evict(&store, &key, rules, ctx).await
        }
        Command::Purge { limit: most, batch } => {
            commands::purge(&store, Purging { most, batch }, ctx).await
        }
        Command::Migrate { dry_run } => migrate(admin(&store, "migrate")?, dry_run, ctx).await,
        Command::Stats => stats(admin(&store, "stats")?, ctx).await,
        Command::Doctor(brokers) => {
            let mut checks = within(
                ctx.whole,
                admin(&store, "doctor")?.doctor(&DoctorOptions { clock_skew: skew }),
            )
            .await?;
            checks.extend(brokers::retention_checks(&brokers, ctx.limit).await?);
            doctor(checks, &url, ctx.json)
        }
        Command::Completions { .. } => Ok(String::new()),
    }
}

/// The store's admin operations, or a clear refusal.
fn admin<'a>(store: &'a SharedRepository, command: &str) -> Result<&'a dyn Admin, Failure> {
    store.admin().ok_or_else(|| {
        Failure::permanent(format!(
            "the {} store offers no operator operations, so `{command}` cannot run on it \
             (get, evict and purge work on every store)",
            store.capabilities().backend
        ))
    })
}

async fn migrate(admin: &dyn Admin, dry_run: bool, ctx: Ctx) -> Result<String, Failure> {
    let steps = within(ctx.whole, admin.migrate(dry_run)).await?;
    Ok(if ctx.json {
        json!({"dry_run": dry_run, "steps": steps}).to_string()
    } else if steps.is_empty() {
        "up to date: nothing to do".to_owned()
    } else {
        let head = if dry_run { "would do" } else { "done" };
        format!("{head}:\n  {}", steps.join("\n  "))
    })
}

async fn stats(admin: &dyn Admin, ctx: Ctx) -> Result<String, Failure> {
    use idempotency::Clock;
    let stats = within(ctx.whole, admin.stats(SystemClock.now(), ctx.skew)).await?;
    Ok(if ctx.json {
        serde_json::to_string(&stats).unwrap_or_default()
    } else {
        view::stats_table(&stats, ctx.skew)
    })
}

/// The report, its hints naming this tool's commands; exit status 3 when a
/// check failed.
fn doctor(mut checks: Vec<Check>, url: &str, json: bool) -> Result<String, Failure> {
    for check in &mut checks {
        check.detail = store::tool_hints(&check.detail, url);
        check.fix = check.fix.as_deref().map(|fix| store::tool_hints(fix, url));
    }
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    let out = if json {
        json!({"ok": failed == 0, "checks": checks}).to_string()
    } else {
        view::checks_table(&checks)
    };
    if failed > 0 {
        // The report goes to standard output either way; the status says it failed.
        emit(&out);
        return Err(Failure::new(
            format!("{failed} check(s) failed"),
            DOCTOR_FAILED,
        ));
    }
    Ok(out)
}
