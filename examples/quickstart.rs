//! Quickstart: at-least-once delivery made exactly-once.
//!
//! A simulated broker delivers 24 `ProcessPayment` events, most of them more than
//! once, to four concurrent consumers. One consumer crashes in the middle of a
//! handler (its process "dies": no cleanup runs, the record stays `Processing`);
//! after the lease runs out, the broker's redelivery is taken over by another
//! consumer. The table shows every event's side effect applied exactly once.
//!
//! ```text
//! cargo run --example quickstart
//! IDEMPOTENCY_STORE_URL=redis://127.0.0.1:6379 cargo run --example quickstart --features redis
//! IDEMPOTENCY_STORE_URL="sqlite://${TMPDIR:-/tmp}/idempotency-quickstart.db" cargo run --example quickstart --features sqlite
//! ```
//!
//! The store's URL is printed with its password redacted (`redact_url`).
//!
//! Time is simulated with a `ManualClock`: the broker's redelivery delay moves
//! it forward instead of sleeping.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{
    Config, Error, ExecuteError, HandlerError, IdempotencyManager, JsonCodec, ManualClock, Outcome,
};

const EVENTS: usize = 24;
const CONSUMERS: usize = 4;
const CRASHING_EVENT: usize = 7;
const LEASE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
struct Delivery {
    event: usize,
    amount: u64,
}

#[derive(Debug, Default, Clone)]
struct Row {
    deliveries: u32,
    handler_runs: u32,
    replays: u32,
    in_progress: u32,
    crashed: u32,
    applied: u32,
    takeovers: u32,
}

#[derive(Default)]
struct World {
    /// Deliveries waiting in the broker.
    queue: VecDeque<Delivery>,
    /// Deliveries the broker will retry after its redelivery delay
    /// (unacknowledged: in progress elsewhere, or their consumer crashed).
    delayed: Vec<Delivery>,
    rows: BTreeMap<usize, Row>,
    /// The side effect: money moved per event.
    ledger: BTreeMap<usize, u64>,
    crash_done: bool,
}

type Shared = Arc<Mutex<World>>;

fn lock(world: &Shared) -> std::sync::MutexGuard<'_, World> {
    world
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A small deterministic generator, so every run shows the same table.
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// The file a `sqlite:` URL names, as an absolute path (so a relative URL
/// says where it put the database); `None` for other stores and in memory.
fn sqlite_file(url: &str) -> Option<std::path::PathBuf> {
    let path = url.strip_prefix("sqlite:")?.split('?').next()?;
    let path = path.strip_prefix("//").unwrap_or(path);
    if path.is_empty() || path == ":memory:" {
        return None;
    }
    std::path::absolute(path).ok()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Unset or empty (`IDEMPOTENCY_STORE_URL= cargo run …`): the in-memory store.
    let url = idempotency::store_url_from_env();
    let store = idempotency::connect(&url).await?;
    let clock = ManualClock::starting_now();
    let config = Config {
        key_prefix: format!("quickstart-{:08x}", std::process::id()),
        processing_timeout: LEASE,
        ..Config::default()
    };
    let manager =
        IdempotencyManager::with_parts(store.clone(), config, Arc::new(clock.clone()), JsonCodec)?
            .scoped("ProcessPayment")?;

    // The broker: each event 1–3 times, shuffled.
    let world: Shared = Arc::default();
    {
        let mut w = lock(&world);
        let mut seed = 0x9E37_79B9_7F4A_7C15;
        let mut all = Vec::new();
        for event in 1..=EVENTS {
            let amount = 10 + next(&mut seed) % 90;
            let copies = 1 + next(&mut seed) % 3;
            for _ in 0..copies.max(if event == CRASHING_EVENT { 2 } else { 1 }) {
                all.push(Delivery { event, amount });
            }
            w.rows.insert(event, Row::default());
        }
        for i in (1..all.len()).rev() {
            let j = usize::try_from(next(&mut seed) % (i as u64 + 1)).unwrap_or(0);
            all.swap(i, j);
        }
        // The crashing consumer picks its event up first.
        if let Some(pos) = all.iter().position(|d| d.event == CRASHING_EVENT) {
            let d = all.remove(pos);
            all.insert(0, d);
        }
        w.queue = all.into();
    }

    // Never the password: the URL is printed with its credentials redacted.
    println!(
        "store: {} ({} backend)",
        idempotency::redact_url(&url),
        store.capabilities().backend
    );
    if let Some(file) = sqlite_file(&url) {
        println!("database file: {}", file.display());
    }
    println!("{EVENTS} events, {CONSUMERS} consumers, consumer 0 crashes while handling event {CRASHING_EVENT}\n");

    let mut round = 0;
    loop {
        let consumers = (0..CONSUMERS).map(|id| {
            let (world, manager) = (world.clone(), manager.clone());
            tokio::spawn(consume(id, world, manager))
        });
        for c in futures_join(consumers).await {
            c??;
        }
        let mut w = lock(&world);
        if w.delayed.is_empty() {
            break;
        }
        // The broker's redelivery delay (visibility timeout) passes.
        round += 1;
        println!(
            "redelivery round {round}: {} unacknowledged deliveries, {}s later",
            w.delayed.len(),
            LEASE.as_secs()
        );
        clock.advance(LEASE);
        let delayed = std::mem::take(&mut w.delayed);
        w.queue.extend(delayed);
    }

    // Takeovers, read back from the store.
    let now = manager.now();
    let events: Vec<usize> = lock(&world).rows.keys().copied().collect();
    for event in events {
        let key = manager.record_key(&format!("evt-{event}"))?;
        let attempt = store.get(&key, now).await?.map_or(1, |r| r.attempt);
        if let Some(row) = lock(&world).rows.get_mut(&event) {
            row.takeovers = attempt.saturating_sub(1);
        }
    }

    let w = lock(&world);
    println!(
        "\n{:>6} {:>10} {:>8} {:>7} {:>11} {:>7} {:>9} {:>7}",
        "event",
        "deliveries",
        "handler",
        "replays",
        "in-progress",
        "crashed",
        "takeovers",
        "applied"
    );
    let mut total = Row::default();
    let mut exactly_once = true;
    for (event, row) in &w.rows {
        println!(
            "{:>6} {:>10} {:>8} {:>7} {:>11} {:>7} {:>9} {:>7}",
            format!("evt-{event}"),
            row.deliveries,
            row.handler_runs,
            row.replays,
            row.in_progress,
            row.crashed,
            row.takeovers,
            row.applied
        );
        exactly_once &= row.applied == 1;
        total.deliveries += row.deliveries;
        total.handler_runs += row.handler_runs;
        total.replays += row.replays;
        total.in_progress += row.in_progress;
        total.crashed += row.crashed;
        total.takeovers += row.takeovers;
        total.applied += row.applied;
    }
    println!(
        "{:>6} {:>10} {:>8} {:>7} {:>11} {:>7} {:>9} {:>7}",
        "total",
        total.deliveries,
        total.handler_runs,
        total.replays,
        total.in_progress,
        total.crashed,
        total.takeovers,
        total.applied
    );
    let moved: u64 = w.ledger.values().sum();
    println!("\nmoney moved: {moved} over {} events", w.ledger.len());
    if exactly_once && w.ledger.len() == EVENTS {
        println!("every event's side effect applied exactly once ✔");
        Ok(())
    } else {
        Err("some side effect was not applied exactly once".into())
    }
}

/// One consumer: pulls deliveries until the queue is empty.
async fn consume(id: usize, world: Shared, manager: IdempotencyManager) -> Result<(), Error> {
    loop {
        let Some(delivery) = lock(&world).queue.pop_front() else {
            return Ok(());
        };
        let event = delivery.event;
        if let Some(row) = lock(&world).rows.get_mut(&event) {
            row.deliveries += 1;
        }
        let crash_now = id == 0 && event == CRASHING_EVENT && !lock(&world).crash_done;
        if crash_now {
            crash_mid_handler(&world, &manager, delivery).await;
            continue;
        }
        let handler = {
            let world = world.clone();
            move || async move {
                tokio::task::yield_now().await;
                let mut w = lock(&world);
                *w.ledger.entry(event).or_default() += delivery.amount;
                if let Some(row) = w.rows.get_mut(&event) {
                    row.handler_runs += 1;
                    row.applied += 1;
                }
                Ok::<_, HandlerError<String>>(format!("receipt-{event}-{}", delivery.amount))
            }
        };
        let payload = serde_json::json!({ "amount": delivery.amount });
        match manager
            .execute(&format!("evt-{event}"), &payload, handler)
            .await
        {
            Ok(Outcome::Cached(_) | Outcome::Duplicate) => {
                if let Some(row) = lock(&world).rows.get_mut(&event) {
                    row.replays += 1;
                }
            }
            Ok(_) => {}
            Err(ExecuteError::Idempotency(Error::InProgress { .. })) => {
                let mut w = lock(&world);
                if let Some(row) = w.rows.get_mut(&event) {
                    row.in_progress += 1;
                }
                // Not acknowledged: the broker redelivers it later.
                w.delayed.push(delivery);
            }
            Err(ExecuteError::Idempotency(e)) => return Err(e),
            Err(ExecuteError::Handler(e)) => return Err(Error::config(e)),
        }
    }
}

/// The consumer's process dies inside the handler, before the side effect:
/// the execution future is leaked (never polled again, never dropped), so no
/// cleanup runs — exactly what the store sees after `kill -9`.
async fn crash_mid_handler(world: &Shared, manager: &IdempotencyManager, delivery: Delivery) {
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let key = format!("evt-{}", delivery.event);
    let payload = serde_json::json!({ "amount": delivery.amount });
    let mut execution = Box::pin(manager.execute(&key, &payload, move || async move {
        let _ = entered_tx.send(());
        std::future::pending::<Result<String, HandlerError<String>>>().await
    }));
    tokio::select! {
        _ = &mut execution => {}
        _ = entered_rx => {}
    }
    std::mem::forget(execution);
    let mut w = lock(world);
    w.crash_done = true;
    if let Some(row) = w.rows.get_mut(&delivery.event) {
        row.crashed += 1;
    }
    w.delayed.push(delivery);
}

async fn futures_join<T>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await);
    }
    out
}
