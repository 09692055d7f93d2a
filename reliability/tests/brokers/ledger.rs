//! The broker scenarios' ledger: every handler call, effect and delivery per
//! key, the slowest poll; and the row it is judged by.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Entries {
    /// Per key: the consumers whose handler applied its effect, in order.
    effects: HashMap<String, Vec<usize>>,
    /// Per key: handler calls.
    calls: HashMap<String, u32>,
    /// Per key: deliveries reported by polls that returned.
    deliveries: HashMap<String, u32>,
    /// Per key: effects of a killed consumer that were not recorded in the
    /// store when it was killed (the contract allows each one more effect).
    allowed_extra: HashMap<String, u32>,
    /// Per consumer: handler calls.
    calls_by: HashMap<usize, u32>,
    /// Per key: what happened to it, stamped (the failing key's history).
    history: HashMap<String, Vec<String>>,
    slowest_poll: Duration,
    polls: u64,
    poll_errors: Vec<String>,
    /// Deliveries answered `Retry` (their key held elsewhere, …).
    retried: u64,
}

/// What the consumers of one scenario did, shared between their tasks.
#[derive(Clone)]
pub(crate) struct Ledger {
    entries: Arc<Mutex<Entries>>,
    started: Instant,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            entries: Arc::default(),
            started: Instant::now(),
        }
    }
}

impl Ledger {
    fn entries(&self) -> MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn note(&self, e: &mut Entries, key: &str, line: String) {
        let at = self.started.elapsed().as_millis();
        e.history
            .entry(key.to_owned())
            .or_default()
            .push(format!("{at:>6} ms {line}"));
    }

    /// Consumer `c`'s handler was called for `key`.
    pub(crate) fn call(&self, key: &str, c: usize) {
        let mut e = self.entries();
        *e.calls.entry(key.to_owned()).or_default() += 1;
        *e.calls_by.entry(c).or_default() += 1;
        self.note(&mut e, key, format!("c{c}: handler called"));
    }

    /// Consumer `c`'s handler applied `key`'s effect.
    pub(crate) fn apply(&self, key: &str, c: usize) {
        let mut e = self.entries();
        e.effects.entry(key.to_owned()).or_default().push(c);
        self.note(&mut e, key, format!("c{c}: effect applied"));
    }

    /// A poll of consumer `c` that returned answered `key` with `what`.
    pub(crate) fn delivered(&self, key: &str, c: usize, what: &str) {
        let mut e = self.entries();
        *e.deliveries.entry(key.to_owned()).or_default() += 1;
        self.note(&mut e, key, format!("c{c}: delivered, {what}"));
    }

    /// One poll that returned took `took`.
    pub(crate) fn poll(&self, took: Duration) {
        let mut e = self.entries();
        e.polls += 1;
        e.slowest_poll = e.slowest_poll.max(took);
    }

    /// A poll answered `n` deliveries `Retry`.
    pub(crate) fn retried(&self, n: u64) {
        self.entries().retried += n;
    }

    /// A poll failed (a receive error, a Kafka client error).
    pub(crate) fn poll_error(&self, c: usize, error: String) {
        self.entries().poll_errors.push(format!("c{c}: {error}"));
    }

    /// The poll errors so far that contain `needle`.
    pub(crate) fn poll_errors_with(&self, needle: &str) -> usize {
        self.entries()
            .poll_errors
            .iter()
            .filter(|e| e.contains(needle))
            .count()
    }

    /// `key`'s effect by a killed consumer was not recorded in the store
    /// when it was killed: one more effect is within the contract.
    pub(crate) fn allow_extra(&self, key: &str) {
        let mut e = self.entries();
        *e.allowed_extra.entry(key.to_owned()).or_default() += 1;
        self.note(
            &mut e,
            key,
            "killed before its effect was recorded".to_owned(),
        );
    }

    /// Keys whose effect consumer `c` applied.
    pub(crate) fn applied_by(&self, c: usize) -> Vec<String> {
        let mut keys: Vec<String> = self
            .entries()
            .effects
            .iter()
            .filter(|(_, by)| by.contains(&c))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys
    }

    /// Handler calls of consumer `c`.
    pub(crate) fn calls_by(&self, c: usize) -> u32 {
        self.entries().calls_by.get(&c).copied().unwrap_or(0)
    }

    /// Keys with at least one effect.
    pub(crate) fn effected(&self) -> usize {
        self.entries().effects.len()
    }
}

/// What a scenario sets its row from, besides the ledger.
pub(crate) struct Setting {
    pub(crate) broker: &'static str,
    pub(crate) scenario: &'static str,
    pub(crate) seed: u64,
    /// Messages the producer sent.
    pub(crate) messages: usize,
    /// The keys sent (each must have its effect exactly once).
    pub(crate) keys: Vec<String>,
    /// Consumers polling at once (and how many were started in all).
    pub(crate) consumers: (usize, usize),
    /// Messages not acknowledged when the scenario ended (left in the queue,
    /// or between a partition's committed offset and its end).
    pub(crate) unacked: u64,
    /// The longest a poll that returned may take.
    pub(crate) poll_bound: Duration,
    /// The most deliveries a key may have (`None`: any number).
    pub(crate) deliveries_bound: Option<u32>,
    /// The most handler calls a key may have (`None`: any number).
    pub(crate) calls_bound: Option<u32>,
    pub(crate) took: Duration,
    /// What happened besides (the kill point, …).
    pub(crate) note: String,
}

/// One scenario's figures and verdict.
pub(crate) struct Row {
    pub(crate) setting: Setting,
    pub(crate) effects: (u32, u32),
    pub(crate) over_bound: Vec<String>,
    pub(crate) lost: Vec<String>,
    pub(crate) allowed_extra: u32,
    pub(crate) deliveries_max: u32,
    pub(crate) calls_max: u32,
    pub(crate) slowest_poll: Duration,
    pub(crate) polls: u64,
    pub(crate) poll_errors: usize,
    pub(crate) retried: u64,
    /// The first poll error, if any.
    pub(crate) first_poll_error: Option<String>,
    /// What the scenario set out to provoke and did not (it then tested
    /// nothing): fails the verdict.
    pub(crate) missing: Vec<String>,
    failing_history: Option<String>,
}

impl Row {
    pub(crate) fn collect(setting: Setting, ledger: &Ledger) -> Row {
        let e = ledger.entries();
        let effects = |k: &String| e.effects.get(k).map_or(0, |v| v.len() as u32);
        let allowed = |k: &String| 1 + e.allowed_extra.get(k).copied().unwrap_or(0);
        let over_bound: Vec<String> = setting
            .keys
            .iter()
            .filter(|k| effects(k) > allowed(k))
            .cloned()
            .collect();
        let lost: Vec<String> = setting
            .keys
            .iter()
            .filter(|k| effects(k) == 0)
            .cloned()
            .collect();
        let counts: Vec<u32> = setting.keys.iter().map(effects).collect();
        let max_of = |m: &HashMap<String, u32>| m.values().copied().max().unwrap_or(0);
        let failing = over_bound.first().or(lost.first()).map(|k| {
            let mut out = format!("history of {k}:\n");
            for line in e.history.get(k).into_iter().flatten() {
                let _ = writeln!(out, "  {line}");
            }
            out
        });
        Row {
            effects: (
                counts.iter().copied().min().unwrap_or(0),
                counts.iter().copied().max().unwrap_or(0),
            ),
            over_bound,
            lost,
            allowed_extra: e.allowed_extra.values().sum(),
            deliveries_max: max_of(&e.deliveries),
            calls_max: max_of(&e.calls),
            slowest_poll: e.slowest_poll,
            polls: e.polls,
            poll_errors: e.poll_errors.len(),
            retried: e.retried,
            first_poll_error: e.poll_errors.first().cloned(),
            missing: Vec::new(),
            failing_history: failing,
            setting,
        }
    }

    /// `Ok` when every key had its effect exactly once (within the allowance
    /// for killed consumers), every message was acknowledged, and every bound
    /// held; else what broke, with the seed and the failing key's history.
    pub(crate) fn verdict(&self) -> Result<(), String> {
        let s = &self.setting;
        let mut broken = self.missing.clone();
        if !self.over_bound.is_empty() {
            broken.push(format!("keys with a double effect: {:?}", self.over_bound));
        }
        if !self.lost.is_empty() {
            broken.push(format!("keys lost (no effect): {:?}", self.lost));
        }
        if s.unacked > 0 {
            broken.push(format!("{} messages never acknowledged", s.unacked));
        }
        if self.slowest_poll > s.poll_bound {
            broken.push(format!(
                "a poll took {:?}, past its bound {:?}",
                self.slowest_poll, s.poll_bound
            ));
        }
        if let Some(bound) = s.deliveries_bound.filter(|b| self.deliveries_max > *b) {
            broken.push(format!(
                "a key was delivered {} times (bound {bound})",
                self.deliveries_max
            ));
        }
        if let Some(bound) = s.calls_bound.filter(|b| self.calls_max > *b) {
            broken.push(format!(
                "a key's handler ran {} times (bound {bound})",
                self.calls_max
            ));
        }
        if broken.is_empty() {
            return Ok(());
        }
        let mut message = format!(
            "{} / {} (seed {}): {}",
            s.broker,
            s.scenario,
            s.seed,
            broken.join("; ")
        );
        if let Some(history) = &self.failing_history {
            let _ = write!(message, "\n{history}");
        }
        Err(message)
    }

    pub(crate) fn header() -> &'static str {
        "| broker | scenario | messages | keys | consumers (started) | effects/key (min–max) | extra allowed | lost | unacked at end | deliveries/key (max) | handler calls/key (max) | retried | polls | poll errors | slowest poll | poll bound | took | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    }

    pub(crate) fn row(&self) -> String {
        let s = &self.setting;
        format!(
            "| {} | {} | {} | {} | {} ({}) | {}–{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} s | {} |",
            s.broker,
            s.scenario,
            s.messages,
            s.keys.len(),
            s.consumers.0,
            s.consumers.1,
            self.effects.0,
            self.effects.1,
            self.allowed_extra,
            self.lost.len(),
            s.unacked,
            if self.deliveries_max == 0 { "–".to_owned() } else { self.deliveries_max.to_string() },
            self.calls_max,
            self.retried,
            self.polls,
            self.poll_errors,
            if self.polls == 0 { "–".to_owned() } else { format!("{} ms", self.slowest_poll.as_millis()) },
            if self.polls == 0 { "–".to_owned() } else { format!("{} ms", s.poll_bound.as_millis()) },
            s.took.as_secs_f64(),
            if self.verdict().is_ok() { "✅" } else { "❌" }
        )
    }
}

/// Per key, a handler time drawn from `range` (milliseconds) with the seed.
pub(crate) fn handler_times(
    keys: &[String],
    seed: u64,
    range: std::ops::Range<u64>,
) -> Arc<BTreeMap<String, Duration>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Arc::new(
        keys.iter()
            .map(|k| {
                (
                    k.clone(),
                    Duration::from_millis(rng.random_range(range.clone())),
                )
            })
            .collect(),
    )
}

/// The keys of a scenario: `k-0` … `k-{n-1}`.
pub(crate) fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("k-{i}")).collect()
}

/// Waits until `done` holds (checked every 100 ms) or `deadline` passes;
/// whether it held.
pub(crate) async fn until<F, Fut>(deadline: tokio::time::Instant, mut done: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    loop {
        if done().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// After consumer `c` was killed: each key whose effect it applied but whose
/// outcome the store does not hold as completed may have its effect once more
/// (the contract's bound for a crash between the effect and the record).
pub(crate) async fn allow_unrecorded(
    ledger: &Ledger,
    manager: &idempotency_core::IdempotencyManager,
    c: usize,
) {
    for key in ledger.applied_by(c) {
        let completed = match manager.record_key(&key) {
            Ok(record_key) => matches!(
                manager.repository().get(&record_key, manager.now()).await,
                Ok(Some(r)) if r.status == idempotency_core::Status::Completed
            ),
            Err(_) => false,
        };
        if !completed {
            ledger.allow_extra(&key);
        }
    }
}
