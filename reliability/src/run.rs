//! One run: consumers deliver every key several times, in random order, while
//! a fault is injected; then every key is redelivered until answered, and the
//! ledger of effects is checked.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency_core::{Error, ExecuteError, HandlerError, IdempotencyManager, Outcome};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use crate::figures::Figures;
use crate::scenario::Scenario;
use crate::target::{Backend, Target};

/// The size of a run.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Distinct keys.
    pub keys: usize,
    /// Deliveries of each key.
    pub deliveries: usize,
    /// Concurrent consumers (tasks).
    pub consumers: usize,
    /// Simulated processes: managers with their own connections; consumers
    /// are spread over them.
    pub processes: usize,
    /// The seed of the delivery order, delays and give-up points.
    pub seed: u64,
    /// Deliveries a consumer takes at once, as a broker's poll, through
    /// `execute_batch` (1: one at a time through `execute_detached`); only
    /// in scenarios where callers never give up (see
    /// [`Scenario::batches`]).
    pub batch: usize,
}

impl Plan {
    /// A run of a few seconds.
    pub fn short(seed: u64) -> Plan {
        Plan {
            keys: 40,
            deliveries: 3,
            consumers: 6,
            processes: 2,
            seed,
            batch: 1,
        }
    }

    /// [`Plan::short`] with polls of 8 deliveries through `execute_batch`.
    pub fn batched(seed: u64) -> Plan {
        Plan {
            batch: 8,
            ..Plan::short(seed)
        }
    }
}

/// What the checker collects while the run goes on.
#[derive(Default)]
struct Journal {
    /// Per key: (attempt, consumer) of every effect the handler applied.
    effects: HashMap<usize, Vec<(u32, usize)>>,
    answered: HashMap<usize, &'static str>,
    retryable: usize,
    wrong_class: Vec<String>,
    slowest: Duration,
    executions: usize,
    /// Per key: `execute` calls.
    deliveries: HashMap<usize, usize>,
    /// Per key: effects applied by consumers that crashed before recording.
    crashed_effects: HashMap<usize, usize>,
    /// Per key: what each delivery got, in order (for a failing history).
    history: HashMap<usize, Vec<String>>,
    /// When the run began: history lines carry the time since.
    started: Option<Instant>,
}

impl Journal {
    /// Adds a line to `key`'s history, stamped with the time since the run
    /// began (a reader can tell a takeover after the lease from one before).
    fn note(&mut self, key: usize, line: String) {
        let at = self.started.map_or(0, |s| s.elapsed().as_millis());
        self.history
            .entry(key)
            .or_default()
            .push(format!("{at:>6} ms {line}"));
    }
}

type Shared = Arc<Mutex<Journal>>;

fn journal(shared: &Shared) -> std::sync::MutexGuard<'_, Journal> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `scenario` on `backend` with `plan`.
///
/// # Errors
/// When the store cannot be set up; the scenario's own failures are in the
/// returned figures (see [`Figures::verdict`]).
pub async fn run(backend: Backend, scenario: Scenario, plan: Plan) -> Result<Figures, String> {
    let plan = Plan {
        keys: scenario.keys(plan.keys, plan.consumers),
        ..plan
    };
    let target = Arc::new(Target::connect(backend, plan.processes, scenario).await?);
    let prefix = format!("rel-{:016x}", rand::random::<u64>());
    let managers = (0..plan.consumers)
        .map(|c| {
            target.manager(
                c % plan.processes,
                scenario.config(&prefix),
                scenario.clock_offset(c),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let shared: Shared = Arc::default();
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let mut order: Vec<usize> = (0..plan.keys)
        .flat_map(|k| std::iter::repeat_n(k, plan.deliveries))
        .collect();
    order.shuffle(&mut rng);
    let queue = Arc::new(Mutex::new(VecDeque::from(order)));

    let started = Instant::now();
    journal(&shared).started = Some(started);
    let faults = tokio::spawn(inject(target.clone(), scenario));
    let consumers: Vec<_> = managers
        .into_iter()
        .enumerate()
        .map(|(c, m)| {
            let seed = plan.seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let pace = pace(scenario, plan);
            let queue = queue.clone();
            if plan.batch > 1 && scenario.batches() {
                let poll = Poll {
                    size: plan.batch,
                    pace: pace * u32::try_from(plan.batch).unwrap_or(u32::MAX),
                };
                return tokio::spawn(consume_polls(
                    c,
                    m,
                    scenario,
                    poll,
                    queue,
                    shared.clone(),
                    seed,
                ));
            }
            tokio::spawn(consume(c, m, scenario, pace, queue, shared.clone(), seed))
        })
        .collect();
    let mut panics = 0;
    for consumer in consumers {
        if consumer.await.is_err() {
            panics += 1;
        }
    }
    let faults_injected = faults.await.unwrap_or_default();
    if let Some(proxy) = &target.proxy {
        proxy.clear();
    }
    let redelivery = redeliver_unanswered(&target, scenario, &prefix, plan, &shared).await?;
    let lost_replies = target.proxy.as_ref().map_or(0, |p| p.lost_replies());
    let checked = target.history.check();
    let j = journal(&shared);
    let figures = Figures::collect(
        backend,
        scenario,
        plan,
        &FiguresInput {
            effects: &j.effects,
            answered: &j.answered,
            history: &j.history,
            executions: j.executions,
            deliveries: &j.deliveries,
            crashed_effects: &j.crashed_effects,
            retryable: j.retryable,
            wrong_class: &j.wrong_class,
            slowest: j.slowest,
            panics: panics + redelivery,
            faults: faults_injected,
            lost_replies,
            took: started.elapsed(),
        },
    );
    Ok(figures.with_linearizability(checked, &violations_dir()))
}

/// Where non-linearizable histories are written: `linearizability/` under
/// the build's target directory (`CARGO_TARGET_DIR`, else `target`).
fn violations_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| std::path::PathBuf::from("target"), Into::into)
        .join("linearizability")
}

/// What a run hands to [`Figures::collect`].
pub(crate) struct FiguresInput<'a> {
    pub(crate) effects: &'a HashMap<usize, Vec<(u32, usize)>>,
    pub(crate) answered: &'a HashMap<usize, &'static str>,
    pub(crate) history: &'a HashMap<usize, Vec<String>>,
    pub(crate) executions: usize,
    pub(crate) deliveries: &'a HashMap<usize, usize>,
    pub(crate) crashed_effects: &'a HashMap<usize, usize>,
    pub(crate) retryable: usize,
    pub(crate) wrong_class: &'a [String],
    pub(crate) slowest: Duration,
    pub(crate) panics: usize,
    pub(crate) faults: usize,
    pub(crate) lost_replies: u64,
    pub(crate) took: Duration,
}

/// One consumer: takes deliveries until the queue is empty; a delivery that
/// was not answered (in progress, a retryable error, the caller gave up) goes
/// back to the queue, as a broker would redeliver it.
/// The mean pause between one consumer's deliveries that spreads the first
/// deliveries over the scenario's fault schedule.
fn pace(scenario: Scenario, plan: Plan) -> Duration {
    let deliveries = u32::try_from(plan.keys * plan.deliveries)
        .unwrap_or(u32::MAX)
        .max(1);
    let consumers = u32::try_from(plan.consumers).unwrap_or(u32::MAX);
    scenario.span() * consumers / deliveries
}

async fn consume(
    consumer: usize,
    manager: IdempotencyManager,
    scenario: Scenario,
    pace: Duration,
    queue: Arc<Mutex<VecDeque<usize>>>,
    shared: Shared,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    // A consumer crashes once, then carries on as the process that replaced
    // it: every crash leaks what its future held (a pooled connection, a
    // request in flight), so crashes are bounded by the consumers.
    let mut crashed = false;
    loop {
        let next = queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front();
        let Some(key) = next else { break };
        arrive(&mut rng, pace).await;
        // Half the calls give up (every caller giving up on a slow store would
        // never see an answer: the key would go round forever).
        let cut_short = match scenario {
            Scenario::CallerGivesUp => rng.random_bool(0.5),
            Scenario::ConsumerCrash => !crashed && rng.random_bool(0.5),
            _ => false,
        }
        .then(|| Duration::from_millis(rng.random_range(0..30)));
        let (answer, crash) = deliver(&manager, scenario, key, consumer, cut_short, &shared).await;
        crashed |= crash;
        if let Some(pause) = answer {
            redeliver(&queue, pause, [key]).await;
        }
    }
}

/// The gap before a consumer's next delivery: uniform over `[0, 2 × pace)`, so
/// that deliveries spread over the fault schedule (real time: the faults are a
/// real server's and proxy's).
async fn arrive(rng: &mut StdRng, pace: Duration) {
    let pace_us = u64::try_from(pace.as_micros()).unwrap_or(u64::MAX).max(1);
    // Real-time pacing of a soak against real servers (see above).
    tokio::time::sleep(Duration::from_micros(rng.random_range(0..2 * pace_us))).await;
}

/// Puts `keys` back on the queue after `pause`, as a broker redelivers what was
/// not acknowledged (a visibility timeout).
async fn redeliver(
    queue: &Mutex<VecDeque<usize>>,
    pause: Duration,
    keys: impl IntoIterator<Item = usize>,
) {
    // A real-time pause: the broker's redelivery delay against real servers.
    tokio::time::sleep(pause).await;
    queue
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(keys);
}

/// One delivery of `key`, cut short after `cut_short` when set (the caller
/// gives up, or the consumer crashes): `Some(pause)` when it must be
/// redelivered after `pause`, and whether the consumer crashed.
async fn deliver(
    manager: &IdempotencyManager,
    scenario: Scenario,
    key: usize,
    consumer: usize,
    cut_short: Option<Duration>,
    shared: &Shared,
) -> (Option<Duration>, bool) {
    let applied = Arc::new(AtomicBool::new(false));
    let handler = handler(scenario, key, consumer, shared.clone(), applied.clone());
    let id = format!("evt-{key}");
    let payload = serde_json::json!({ "event": key });
    let begun = Instant::now();
    let result = match (scenario, cut_short) {
        (Scenario::ConsumerCrash, Some(limit)) => {
            crash_after(manager.execute_with_context(&id, &payload, handler), limit).await
        }
        (_, Some(limit)) => {
            let call = AssertUnwindSafe(manager.execute_detached(&id, &payload, handler));
            tokio::time::timeout(limit, call).await.ok()
        }
        (_, None) => Some(AssertUnwindSafe(manager.execute_detached(&id, &payload, handler)).await),
    };
    let took = begun.elapsed();
    let mut j = journal(shared);
    j.slowest = j.slowest.max(took);
    j.executions += 1;
    *j.deliveries.entry(key).or_default() += 1;
    let Some(result) = result else {
        let crashed = scenario == Scenario::ConsumerCrash;
        let note = if crashed {
            let applied = applied.load(Ordering::SeqCst);
            if applied {
                *j.crashed_effects.entry(key).or_default() += 1;
            }
            format!("c{consumer}: crashed after {took:?} (effect applied: {applied})")
        } else {
            format!("c{consumer}: gave up after {took:?}")
        };
        j.note(key, note);
        return (Some(Duration::from_millis(50)), crashed);
    };
    (record(&mut j, key, consumer, result), false)
}

/// How a batch consumer polls.
#[derive(Debug, Clone, Copy)]
struct Poll {
    /// Deliveries per poll at most.
    size: usize,
    /// The mean pause between polls.
    pace: Duration,
}

/// A consumer that takes up to `poll.size` deliveries at once and hands them
/// to `execute_batch`; what was not answered goes back to the queue.
async fn consume_polls(
    consumer: usize,
    manager: IdempotencyManager,
    scenario: Scenario,
    poll: Poll,
    queue: Arc<Mutex<VecDeque<usize>>>,
    shared: Shared,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    loop {
        let keys: Vec<usize> = {
            let mut q = queue.lock().unwrap_or_else(PoisonError::into_inner);
            let n = poll.size.min(q.len());
            q.drain(..n).collect()
        };
        if keys.is_empty() {
            break;
        }
        arrive(&mut rng, poll.pace).await;
        let again = deliver_batch(&manager, scenario, &keys, consumer, &shared).await;
        if let Some(pause) = again.iter().map(|(_, p)| *p).max() {
            redeliver(&queue, pause, again.into_iter().map(|(key, _)| key)).await;
        }
    }
}

/// A handler of one batch item, taken once.
type ItemHandler =
    Box<dyn FnOnce(idempotency_core::ExecutionContext) -> HandlerFuture + Send + 'static>;

/// One poll through `execute_batch`; returns the keys to redeliver and after
/// how long.
async fn deliver_batch(
    manager: &IdempotencyManager,
    scenario: Scenario,
    keys: &[usize],
    consumer: usize,
    shared: &Shared,
) -> Vec<(usize, Duration)> {
    let handlers: Vec<Mutex<Option<ItemHandler>>> = keys
        .iter()
        .map(|&key| {
            let applied = Arc::new(AtomicBool::new(false));
            let h: ItemHandler =
                Box::new(handler(scenario, key, consumer, shared.clone(), applied));
            Mutex::new(Some(h))
        })
        .collect();
    let items: Vec<(String, serde_json::Value)> = keys
        .iter()
        .map(|k| (format!("evt-{k}"), serde_json::json!({ "event": k })))
        .collect();
    // A key polled n times in one batch runs in n waves, one after another:
    // each wave is one call's worth of the contract's per-phase bound.
    let mut seen: HashMap<usize, usize> = HashMap::new();
    let waves = keys
        .iter()
        .map(|k| {
            let n = seen.entry(*k).or_default();
            *n += 1;
            *n
        })
        .max()
        .unwrap_or(1);
    let begun = Instant::now();
    let answers = manager.execute_batch(&items, keys.len(), |i, ctx| {
        let taken = handlers[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match taken {
            Some(h) => h(ctx),
            None => Box::pin(async {
                Err(HandlerError::new(
                    "a batch item's handler ran twice".to_owned(),
                ))
            }),
        }
    });
    let answers = answers.await;
    let took = begun.elapsed() / u32::try_from(waves).unwrap_or(u32::MAX);
    let mut j = journal(shared);
    j.slowest = j.slowest.max(took);
    let mut again = Vec::new();
    for (&key, result) in keys.iter().zip(answers) {
        j.executions += 1;
        *j.deliveries.entry(key).or_default() += 1;
        if let Some(pause) = record(&mut j, key, consumer, result) {
            again.push((key, pause));
        }
    }
    again
}

/// Polls `call` for `limit`, then leaks it as a crashed process would leave
/// it: never polled again and never dropped, so nothing of it cleans up (no
/// release, no recording, no lease extension). `None` when it crashed.
async fn crash_after<F: std::future::Future>(call: F, limit: Duration) -> Option<F::Output> {
    let mut call = Box::pin(call);
    match tokio::time::timeout(limit, call.as_mut()).await {
        Ok(output) => Some(output),
        Err(_) => {
            std::mem::forget(call);
            None
        }
    }
}

/// The future of one handler run.
type HandlerFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<u64, HandlerError<String>>> + Send>>;

/// The handler of one delivery: takes the scenario's time, then applies its
/// effect to the ledger.
fn handler(
    scenario: Scenario,
    key: usize,
    consumer: usize,
    shared: Shared,
    applied: Arc<AtomicBool>,
) -> impl FnOnce(idempotency_core::ExecutionContext) -> HandlerFuture + Send + 'static {
    move |ctx| {
        Box::pin(async move {
            tokio::time::sleep(scenario.handler_time()).await;
            let mut j = journal(&shared);
            j.effects
                .entry(key)
                .or_default()
                .push((ctx.attempt(), consumer));
            j.note(
                key,
                format!("c{consumer}: effect of attempt {}", ctx.attempt()),
            );
            drop(j);
            applied.store(true, Ordering::SeqCst);
            Ok(key as u64)
        })
    }
}

/// Notes what a delivery got; `Some(pause)` when it must be redelivered.
fn record(
    j: &mut Journal,
    key: usize,
    consumer: usize,
    result: Result<Outcome<u64>, ExecuteError<String>>,
) -> Option<Duration> {
    let (note, redeliver) = match result {
        Ok(outcome) => {
            let kind = outcome_kind(&outcome);
            j.answered.entry(key).or_insert(kind);
            (kind.to_owned(), None)
        }
        Err(ExecuteError::Idempotency(Error::InProgress { retry_after, .. })) => (
            format!("in progress, retry after {retry_after:?}"),
            Some(retry_after.clamp(Duration::from_millis(5), Duration::from_millis(200))),
        ),
        Err(ExecuteError::Idempotency(e)) if e.is_retryable() => {
            j.retryable += 1;
            (format!("retryable: {e}"), Some(Duration::from_millis(50)))
        }
        // Not retryable under a transient fault: reported, and not redelivered
        // (a permanent error would go round forever).
        Err(e) => {
            j.wrong_class.push(format!("evt-{key}: {e}"));
            j.answered.entry(key).or_insert("wrong-class error");
            (format!("not retryable: {e}"), None)
        }
    };
    j.note(key, format!("c{consumer}: {note}"));
    redeliver
}

fn outcome_kind(outcome: &Outcome<u64>) -> &'static str {
    match outcome {
        Outcome::Executed(_) => "executed",
        Outcome::Cached(_) => "cached",
        Outcome::Duplicate => "duplicate",
        Outcome::LeaseLost(_) => "lease lost",
        Outcome::Unrecorded { .. } => "unrecorded",
        Outcome::Unprotected(_) => "unprotected",
        _ => "other",
    }
}

/// After the faults: every key not yet answered is redelivered until it is,
/// for at most two leases plus ten seconds. Returns the panics seen.
async fn redeliver_unanswered(
    target: &Target,
    scenario: Scenario,
    prefix: &str,
    plan: Plan,
    shared: &Shared,
) -> Result<usize, String> {
    let manager = target.manager(0, scenario.config(prefix), Duration::ZERO)?;
    let deadline = Instant::now() + scenario.lease() * 2 + Duration::from_secs(10);
    let mut panics = 0;
    for key in 0..plan.keys {
        while !journal(shared).answered.contains_key(&key) && Instant::now() < deadline {
            let m = manager.clone();
            let s = shared.clone();
            let delivery = tokio::spawn(async move {
                deliver(&m, Scenario::Baseline, key, usize::MAX, None, &s)
                    .await
                    .0
            });
            match delivery.await {
                Ok(Some(pause)) => tokio::time::sleep(pause).await,
                Ok(None) => {}
                Err(_) => panics += 1,
            }
        }
    }
    Ok(panics)
}

/// Injects `scenario`'s fault while the consumers run; returns how many
/// faults were injected.
async fn inject(target: Arc<Target>, scenario: Scenario) -> usize {
    let Some(proxy) = target.proxy.as_ref() else {
        return 0;
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    if let Some(server) = &target.server {
        let done = match scenario {
            Scenario::ServerRestart | Scenario::ServerRestartForgetful => server.restart().await,
            _ => server.pause_for(Duration::from_secs(1)).await,
        };
        if let Err(e) = done {
            eprintln!("{scenario}: {e}");
            return 0;
        }
        return 1;
    }
    let mut faults = 0;
    let kinds: &[Scenario] = match scenario {
        Scenario::Mixed => &[
            Scenario::Latency,
            Scenario::BlackHole,
            Scenario::Resets,
            Scenario::LostReplies,
        ],
        s if s.needs_network() => std::slice::from_ref(match s {
            Scenario::Latency => &Scenario::Latency,
            Scenario::BlackHole => &Scenario::BlackHole,
            Scenario::Resets => &Scenario::Resets,
            _ => &Scenario::LostReplies,
        }),
        _ => &[],
    };
    for kind in kinds {
        faults += one_fault(proxy, *kind).await;
        proxy.clear();
    }
    faults
}

async fn one_fault(
    proxy: &idempotency_conformance::containers::FaultProxy,
    kind: Scenario,
) -> usize {
    const WINDOW: Duration = Duration::from_secs(1);
    match kind {
        Scenario::Latency => {
            proxy.set_latency(Duration::from_millis(2), Duration::from_millis(3));
            tokio::time::sleep(WINDOW).await;
            1
        }
        Scenario::BlackHole => {
            proxy.cut();
            tokio::time::sleep(WINDOW).await;
            1
        }
        Scenario::Resets => {
            let until = Instant::now() + WINDOW;
            let mut n = 0;
            while Instant::now() < until {
                proxy.reset();
                n += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            n
        }
        _ => {
            proxy.lose_replies(0.2);
            tokio::time::sleep(WINDOW).await;
            usize::try_from(proxy.lost_replies())
                .unwrap_or(usize::MAX)
                .max(1)
        }
    }
}
