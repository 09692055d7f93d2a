//! `idempotency`: the operator tool of idempotency-rs. Inspect, evict, purge
//! and migrate the records of any store `idempotency::connect` knows, and
//! check a store's settings against what the library relies on.
//!
//! ```text
//! idempotency --url redis://127.0.0.1:6379 get idempotency:payments evt-42
//! IDEMPOTENCY_STORE_URL=postgres://… idempotency list --stuck --format json
//! IDEMPOTENCY_CLOCK_SKEW=2s idempotency --url sqlite://app.db evict orders o-1 --only-if-stuck
//! idempotency --url mysql://… doctor
//! ```
//!
//! Stuck records and purges are judged as consumers judge them
//! (`idempotency::decision`): a lease is over only `--clock-skew` after it
//! ended on this machine's clock, and `purge` removes only records expired
//! at least that long ago. Give the consumers' `clock_skew` (flag, or
//! `IDEMPOTENCY_CLOCK_SKEW`); without it the tool assumes
//! `idempotency::admin::default_clock_skew()`: the library's default or
//! 400 ms, whichever is larger.
//!
//! Exit status: 0 on success, 1 when a command fails (the store's error, or a
//! refusal such as evicting a live record without `--force`), 2 for a usage
//! error, 3 when `doctor` finds a failing check.

mod brokers;
mod view;

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use idempotency::admin::{default_clock_skew, Admin, Check, DoctorOptions, ListFilter, Verdict};
use idempotency::decision::{skew_cutoff, stuck};
use idempotency::{Clock, Error, RecordKey, SharedRepository, Status, SystemClock};
use serde_json::json;

/// The idempotency-rs operator tool: records of any store, by URL.
#[derive(Debug, Parser)]
#[command(name = "idempotency", version, about, long_about = None)]
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

/// A record's key: namespace and id, or `--key` with the encoded form.
#[derive(Debug, clap::Args)]
struct KeyArgs {
    /// The namespace (the manager's key prefix and scope, e.g. `idempotency:payments`).
    #[arg(required_unless_present = "key")]
    namespace: Option<String>,
    /// The id within the namespace.
    #[arg(required_unless_present = "key")]
    id: Option<String>,
    /// The record key's encoded form instead (`namespace:id`, the namespace's
    /// `%`, `:`, `{`, `}` percent-escaped), as stores and logs show it.
    #[arg(long, conflicts_with_all = ["namespace", "id"])]
    key: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One record, decoded: status, owner, lease and expiry, result preview.
    Get(KeyArgs),
    /// Records, where the store can enumerate them without blocking it.
    List {
        /// Only namespaces starting with this.
        #[arg(long)]
        namespace: Option<String>,
        /// Only records in this status.
        #[arg(long, value_enum)]
        status: Option<StatusArg>,
        /// Only stuck records: `processing`, the lease ended at least
        /// `--clock-skew` ago.
        #[arg(long)]
        stuck: bool,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Removes one record. A `processing` record that is not stuck (its
    /// lease ended less than `--clock-skew` ago, or runs on) is refused unless
    /// `--force`: its handler may still be running, and the next delivery
    /// runs it again.
    Evict {
        #[command(flatten)]
        key: KeyArgs,
        /// Only if the record is stuck: `processing`, the lease ended at
        /// least `--clock-skew` ago.
        #[arg(long)]
        only_if_stuck: bool,
        /// Remove a live `processing` record too.
        #[arg(long)]
        force: bool,
    },
    /// Removes records expired at least `--clock-skew` ago (the store's
    /// `purge_expired` at now less the skew), with progress.
    Purge {
        /// At most this many (default: all).
        #[arg(long)]
        limit: Option<usize>,
        /// Records per call to the store.
        #[arg(long, default_value_t = 500)]
        batch: usize,
    },
    /// Creates or upgrades what the store needs; idempotent.
    Migrate {
        /// Print what would be done, change nothing.
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

/// A failed command: the message, and the exit status.
pub(crate) struct Failure(String, u8);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let class = if e.is_retryable() {
            "retryable"
        } else {
            "not retryable"
        };
        Failure(format!("{e} ({class})"), 1)
    }
}

/// The bound of connecting and of calls on one record or one batch, unless
/// `--timeout` says otherwise.
const POINT_TIMEOUT: Duration = Duration::from_secs(30);

/// `call`, one call to the store, within `limit` (none: unbounded). A call
/// cut off may still have been applied: said so, as a retryable failure.
async fn within<T>(
    limit: impl Into<Option<Duration>>,
    call: impl Future<Output = Result<T, Error>>,
) -> Result<T, Failure> {
    let Some(limit) = limit.into() else {
        return Ok(call.await?);
    };
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => Ok(answer?),
        Err(_) => Err(Failure(
            format!(
                "the store did not answer within {} (--timeout); a change it was asked for may \
                 or may not have been applied (retryable)",
                humantime::format_duration(limit)
            ),
            1,
        )),
    }
}

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
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(out) => {
            emit(&out);
            ExitCode::SUCCESS
        }
        Err(Failure(message, code)) => {
            eprintln!("error: {message}");
            ExitCode::from(code)
        }
    }
}

/// Writes `text` and a newline to standard output; a reader that went away
/// (`| head`) is not an error.
fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}").and_then(|()| out.flush());
}

/// The URL to connect with: the SQL stores migrate on connect unless told
/// not to, and the tool must not change a store it only reads or checks
/// (`migrate` migrates through the admin operations).
fn without_migration(url: &str) -> String {
    let migrates = matches!(
        idempotency::StoreKind::from_url(url),
        Ok(idempotency::StoreKind::Sqlite
            | idempotency::StoreKind::Postgres
            | idempotency::StoreKind::MySql)
    );
    if !migrates || url.contains("migrate=") {
        return url.to_owned();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}migrate=false")
}

async fn run(cli: Cli) -> Result<String, Failure> {
    let url = cli.url.clone().ok_or_else(|| {
        Failure(
            "no store: pass --url or set IDEMPOTENCY_STORE_URL".to_owned(),
            2,
        )
    })?;
    // Calls on one record or batch, and connecting; calls over the whole
    // store (bounded only when asked).
    let limit = cli.timeout.unwrap_or(POINT_TIMEOUT);
    let whole = cli.timeout;
    let store = within(limit, idempotency::connect(&without_migration(&url))).await?;
    let json = cli.format == Format::Json;
    let Skew(skew) = cli.clock_skew;
    match cli.command {
        Command::Get(key) => get(&store, &key, skew, limit, json).await,
        Command::List {
            namespace,
            status,
            stuck,
            limit: most,
        } => {
            let filter = ListFilter {
                namespace_prefix: namespace,
                status: status.map(Status::from),
                stuck,
                clock_skew: skew,
                limit: most,
            };
            list(admin(&store, "list")?, &filter, whole, json).await
        }
        Command::Evict {
            key,
            only_if_stuck,
            force,
        } => {
            let evicting = Evicting {
                only_if_stuck,
                force,
                skew,
            };
            evict(&store, &key, evicting, limit, json).await
        }
        Command::Purge { limit: most, batch } => {
            let purging = Purging { most, batch, skew };
            purge(&store, purging, limit, json).await
        }
        Command::Migrate { dry_run } => {
            migrate(admin(&store, "migrate")?, dry_run, whole, json).await
        }
        Command::Stats => stats(admin(&store, "stats")?, skew, whole, json).await,
        Command::Doctor(brokers) => {
            let mut checks = within(
                whole,
                admin(&store, "doctor")?.doctor(&DoctorOptions { clock_skew: skew }),
            )
            .await?;
            checks.extend(brokers::retention_checks(&brokers, limit).await?);
            doctor(checks, json)
        }
        Command::Completions { .. } => Ok(String::new()),
    }
}

/// The store's admin operations, or a clear refusal.
fn admin<'a>(store: &'a SharedRepository, command: &str) -> Result<&'a dyn Admin, Failure> {
    store.admin().ok_or_else(|| {
        Failure(
            format!(
                "the {} store offers no operator operations, so `{command}` cannot run on it \
                 (get, evict and purge work on every store)",
                store.capabilities().backend
            ),
            1,
        )
    })
}

fn record_key(store: &SharedRepository, args: &KeyArgs) -> Result<RecordKey, Failure> {
    let max = store.capabilities().max_id_bytes;
    let key = match (&args.key, &args.namespace, &args.id) {
        (Some(encoded), _, _) => RecordKey::decode(encoded, max)?,
        (None, Some(namespace), Some(id)) => RecordKey::new(namespace.as_str(), id, max)?,
        _ => return Err(Failure("give NAMESPACE ID, or --key".to_owned(), 2)),
    };
    Ok(key)
}

async fn get(
    store: &SharedRepository,
    args: &KeyArgs,
    skew: Duration,
    limit: Duration,
    json: bool,
) -> Result<String, Failure> {
    let key = record_key(store, args)?;
    let at = view::At::now(skew);
    let record = within(limit, store.get(&key, at.now)).await?;
    Ok(match (record, json) {
        (Some(r), true) => {
            let mut value = view::record_json(key.namespace(), key.id(), &r, at);
            value["found"] = json!(true);
            value.to_string()
        }
        (Some(r), false) => view::record_table(key.namespace(), key.id(), &r, at),
        (None, true) => {
            json!({"found": false, "namespace": key.namespace(), "id": key.id()}).to_string()
        }
        (None, false) => format!("no live record for {key} (never reserved, expired, or removed)"),
    })
}

async fn list(
    admin: &dyn Admin,
    filter: &ListFilter,
    limit: Option<Duration>,
    json: bool,
) -> Result<String, Failure> {
    let at = view::At::now(filter.clock_skew);
    let listing = within(limit, admin.list(filter, at.now)).await?;
    if json {
        let records: Vec<_> = listing
            .records
            .iter()
            .map(|l| view::record_json(&l.namespace, &l.id, &l.record, at))
            .collect();
        return Ok(json!({"records": records, "truncated": listing.truncated}).to_string());
    }
    let mut out = view::listing_table(&listing.records, at);
    out.push_str(&format!("\n{} record(s)", listing.records.len()));
    if listing.truncated {
        out.push_str(&format!(
            "; more match (raise --limit above {})",
            filter.limit
        ));
    }
    Ok(out)
}

/// What `evict` may remove.
#[derive(Debug, Clone, Copy)]
struct Evicting {
    only_if_stuck: bool,
    force: bool,
    /// The consumers' clock skew: stuck is `decision::stuck` under it.
    skew: Duration,
}

async fn evict(
    store: &SharedRepository,
    args: &KeyArgs,
    Evicting {
        only_if_stuck,
        force,
        skew,
    }: Evicting,
    limit: Duration,
    json: bool,
) -> Result<String, Failure> {
    let key = record_key(store, args)?;
    let at = view::At::now(skew);
    let now = at.now;
    let Some(record) = within(limit, store.get(&key, now)).await? else {
        return Ok(if json {
            json!({"removed": false, "reason": "no live record"}).to_string()
        } else {
            format!("no live record for {key}: nothing to remove")
        });
    };
    let processing = record.status == Status::Processing;
    let stuck = stuck(&record, now, skew);
    if only_if_stuck && !stuck {
        let why = match processing {
            true => format!("its {}", view::lease_text(&record, at)),
            false => format!("{} records are never stuck", record.status),
        };
        return Err(Failure(
            format!(
                "{key} is {} and not stuck ({why}): left in place (--only-if-stuck)",
                record.status
            ),
            1,
        ));
    }
    if processing && !stuck && !force {
        return Err(Failure(
            format!(
                "{key} is processing and not stuck: its {}. Its handler may still be running, \
                 and removing the record lets the next delivery run the handler again. Add \
                 --force to remove it anyway",
                view::lease_text(&record, at)
            ),
            1,
        ));
    }
    let removed = remove(store, &key, &record, now, limit).await?;
    Ok(if json {
        json!({"removed": removed, "was": view::record_json(key.namespace(), key.id(), &record, at)})
            .to_string()
    } else if removed {
        format!(
            "removed {key} ({}); the next delivery of this key runs its handler",
            record.status
        )
    } else {
        format!("{key} was already gone")
    })
}

/// Removes the record read as `record`, and only that one. A `processing`
/// record goes through `release` with its owner's token: if it was taken
/// over or finished since it was read, the token no longer holds it and
/// nothing is removed (a plain delete would remove the new consumer's live
/// reservation, and its handler would run again). Other records do not
/// change hands, so a plain delete is exact.
async fn remove(
    store: &SharedRepository,
    key: &RecordKey,
    record: &idempotency::Record,
    now: idempotency::Timestamp,
    limit: Duration,
) -> Result<bool, Failure> {
    if record.status != Status::Processing {
        return within(limit, store.delete(key)).await;
    }
    let released = within(limit, async {
        match store.release(key, record.owner, now).await {
            Err(Error::LeaseLost { .. }) => Ok(false),
            answer => answer.map(|()| true),
        }
    })
    .await?;
    match released {
        true => Ok(true),
        false => Err(Failure(
            format!(
                "{key} changed since it was read (taken over, finished or removed): left in \
                 place; read it again"
            ),
            1,
        )),
    }
}

/// What `purge` removes.
#[derive(Debug, Clone, Copy)]
struct Purging {
    /// At most this many records (none: all).
    most: Option<usize>,
    /// Records per call to the store.
    batch: usize,
    /// The consumers' clock skew: the margin kept (`decision::skew_cutoff`).
    skew: Duration,
}

async fn purge(
    store: &SharedRepository,
    Purging { most, batch, skew }: Purging,
    limit: Duration,
    json: bool,
) -> Result<String, Failure> {
    let batch = batch.max(1);
    let most = most.unwrap_or(usize::MAX);
    // Expired for every consumer: a consumer whose clock is behind this one's
    // (by up to the skew) still reads a record expired more recently.
    let before = skew_cutoff(SystemClock.now(), skew);
    let bar = if json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new_spinner().with_message("purging expired records")
    };
    let mut total = 0;
    loop {
        let want = batch.min(most - total);
        if want == 0 {
            break;
        }
        let n = within(limit, store.purge_expired(before, want)).await?;
        total += n;
        bar.set_position(total as u64);
        if n < want {
            break;
        }
    }
    bar.finish_and_clear();
    let native = store.capabilities().native_expiry;
    Ok(if json {
        json!({
            "purged": total,
            "native_expiry": native,
            "expired_before": view::instant(before),
        })
        .to_string()
    } else if native && total == 0 {
        "purged 0 records (this store removes expired records itself)".to_owned()
    } else {
        format!(
            "purged {total} record(s) expired by {} (now less --clock-skew {})",
            view::instant(before),
            humantime::format_duration(skew)
        )
    })
}

async fn migrate(
    admin: &dyn Admin,
    dry_run: bool,
    limit: Option<Duration>,
    json: bool,
) -> Result<String, Failure> {
    let steps = within(limit, admin.migrate(dry_run)).await?;
    Ok(if json {
        json!({"dry_run": dry_run, "steps": steps}).to_string()
    } else if steps.is_empty() {
        "up to date: nothing to do".to_owned()
    } else {
        let head = if dry_run { "would do" } else { "done" };
        format!("{head}:\n  {}", steps.join("\n  "))
    })
}

async fn stats(
    admin: &dyn Admin,
    skew: Duration,
    limit: Option<Duration>,
    json: bool,
) -> Result<String, Failure> {
    let stats = within(limit, admin.stats(SystemClock.now(), skew)).await?;
    Ok(if json {
        serde_json::to_string(&stats).unwrap_or_default()
    } else {
        view::stats_table(&stats, skew)
    })
}

fn doctor(checks: Vec<Check>, json: bool) -> Result<String, Failure> {
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    let out = if json {
        json!({"ok": failed == 0, "checks": checks}).to_string()
    } else {
        view::checks_table(&checks)
    };
    if failed > 0 {
        // The report goes to standard output either way; the status says it failed.
        emit(&out);
        return Err(Failure(format!("{failed} check(s) failed"), 3));
    }
    Ok(out)
}
