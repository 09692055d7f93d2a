//! Runs rounds of operations at a given concurrency, interleaving library and
//! raw, and turns them into [`Measurement`]s.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use crate::stats::{Measurement, Samples};
use crate::workloads::{Derived, Lane, Workload};
use crate::{BoxError, Scenario, Variant};

/// How much to run for one backend.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Measured operations per variant, scenario and concurrency (split over the
    /// rounds).
    pub ops: usize,
    /// Measured rounds per variant (the order alternates: A B B A A B …).
    pub rounds: usize,
    /// Unmeasured operations per variant before the rounds.
    pub warmup: usize,
    /// Operations of the untimed round-trip counting pass, per variant and
    /// scenario.
    pub count_ops: usize,
    /// Concurrencies to run at.
    pub concurrencies: Vec<usize>,
    /// Scenarios to run, in order.
    pub scenarios: Vec<Scenario>,
    /// The shortest a measured round should take: rounds get more operations
    /// than `ops / rounds` when the warm-up shows they would be shorter (short
    /// rounds measure scheduler hiccups more than the code).
    pub min_round: Duration,
}

impl Plan {
    /// Operations one run of this plan performs (for the progress bar).
    pub fn total_ops(&self, with_round_trips: bool) -> u64 {
        self.scenarios
            .iter()
            .map(|&s| self.for_scenario(s).scenario_ops(with_round_trips))
            .sum()
    }

    /// Operations of one scenario under this plan.
    fn scenario_ops(&self, with_round_trips: bool) -> u64 {
        let per_concurrency = 2 * (self.per_round() * self.rounds + self.warmup);
        let counting = if with_round_trips {
            2 * self.count_ops
        } else {
            0
        };
        (self.concurrencies.len() * per_concurrency + counting) as u64
    }

    /// The plan for `scenario`: a batch scenario's operation is a batch of
    /// [`BATCH`](crate::workloads::BATCH) messages, so it runs that many
    /// times fewer operations for the same messages.
    pub fn for_scenario(&self, scenario: Scenario) -> Plan {
        if !scenario.is_batch() {
            return self.clone();
        }
        let batch = crate::workloads::BATCH;
        Plan {
            ops: (self.ops / batch).max(self.rounds.max(1)),
            warmup: self.warmup / batch,
            count_ops: (self.count_ops / batch).max(2),
            ..self.clone()
        }
    }

    /// Operations per round.
    pub fn per_round(&self) -> usize {
        self.ops.div_ceil(self.rounds.max(1)).max(1)
    }

    /// Operations per round for a backend whose slower variant ran the warm-up
    /// at `rate` ops/s: enough for [`Plan::min_round`], never fewer than
    /// [`Plan::per_round`], at most [`MAX_PER_ROUND`].
    pub fn per_round_at(&self, rate: f64) -> usize {
        let wanted = (rate * self.min_round.as_secs_f64()).ceil();
        let wanted = if wanted.is_finite() && wanted > 0.0 {
            // In range: clamped below.
            wanted.min(MAX_PER_ROUND as f64) as usize
        } else {
            0
        };
        self.per_round()
            .max(wanted)
            .min(MAX_PER_ROUND.max(self.per_round()))
    }
}

/// The most operations a round is stretched to by [`Plan::min_round`].
pub const MAX_PER_ROUND: usize = 1_000_000;

/// A fresh namespace for one round: keys never collide across rounds or runs.
pub fn round_namespace(backend: &str, scenario: Scenario, variant: Variant) -> String {
    format!(
        "{backend}-{scenario}-{variant}-{:016x}",
        rand::random::<u64>()
    )
}

/// Runs `ops` operations on keys `0..ops` of `ns` from `concurrency` tasks, each
/// taking the next key; returns the latency of every operation and the round's
/// wall-clock time.
///
/// # Errors
/// The first failed operation's error (the round stops).
pub async fn run_round(
    workload: Arc<dyn Workload>,
    variant: Variant,
    scenario: Scenario,
    ns: &str,
    ops: usize,
    concurrency: usize,
    progress: &ProgressBar,
) -> Result<Samples, BoxError> {
    const PROGRESS_BATCH: u64 = 64;
    let ns: Arc<str> = Arc::from(ns);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let (workload, ns, next, progress) =
                (workload.clone(), ns.clone(), next.clone(), progress.clone());
            tokio::spawn(async move {
                let mut nanos = Vec::with_capacity(ops / concurrency.max(1) + 1);
                let mut pending = 0;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ops {
                        break;
                    }
                    let t = Instant::now();
                    workload.op(variant, scenario, &ns, i, Lane::Timed).await?;
                    nanos.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
                    pending += 1;
                    if pending == PROGRESS_BATCH {
                        progress.inc(pending);
                        pending = 0;
                    }
                }
                progress.inc(pending);
                Ok::<_, BoxError>(nanos)
            })
        })
        .collect();
    let mut all = Vec::with_capacity(ops);
    for worker in workers {
        all.extend(worker.await??);
    }
    Ok(Samples::new(all, started.elapsed()))
}

/// Counts the round trips of `ops` sequential operations through
/// [`Lane::Counted`] (untimed). `None` when the backend has no server.
///
/// # Errors
/// A failed operation.
pub async fn count_round_trips(
    workload: &dyn Workload,
    variant: Variant,
    scenario: Scenario,
    ops: usize,
    progress: &ProgressBar,
) -> Result<Option<f64>, BoxError> {
    if ops == 0 || workload.round_trips().await?.is_none() {
        progress.inc(ops as u64);
        return Ok(None);
    }
    // Warm-up first, uncounted: connections prepare statements or load scripts
    // on first use.
    let warm = ops.min(20);
    let ns = round_namespace(workload.backend(), scenario, variant);
    prepare(workload, scenario, &ns, warm + ops).await?;
    for i in ops..ops + warm {
        workload
            .op(variant, scenario, &ns, i, Lane::Counted)
            .await?;
    }
    let before = workload.round_trips().await?.unwrap_or(0);
    for i in 0..ops {
        workload
            .op(variant, scenario, &ns, i, Lane::Counted)
            .await?;
        progress.inc(1);
    }
    let after = workload.round_trips().await?.unwrap_or(0);
    Ok(Some(after.saturating_sub(before) as f64 / ops as f64))
}

/// Before a round on `ns`: for a duplicate scenario, its `ops` keys completed
/// and the server's background work for them done.
async fn prepare(
    workload: &dyn Workload,
    scenario: Scenario,
    ns: &str,
    ops: usize,
) -> Result<(), BoxError> {
    if scenario.is_duplicate() {
        workload.populate(ns, ops).await?;
        workload.settle().await?;
    }
    Ok(())
}

/// The library/raw order of round `r`: A B, B A, A B, … (ABBA cancels linear
/// drift).
pub fn round_order(r: usize) -> [Variant; 2] {
    if r.is_multiple_of(2) {
        [Variant::Library, Variant::Raw]
    } else {
        [Variant::Raw, Variant::Library]
    }
}

/// Runs the whole plan for one backend: per scenario, the round-trip count,
/// then per concurrency a warm-up and interleaved measured rounds.
///
/// # Errors
/// The first failure.
pub async fn run_backend(
    workload: Arc<dyn Workload>,
    plan: &Plan,
    progress: &ProgressBar,
) -> Result<Vec<Measurement>, BoxError> {
    let backend = workload.backend();
    let mut out = Vec::new();
    let plain = workload;
    for &scenario in &plan.scenarios {
        let plan = &plan.for_scenario(scenario);
        let workload: Arc<dyn Workload> = match scenario {
            Scenario::Fresh | Scenario::Duplicate => plain.clone(),
            _ => Arc::new(Derived::new(plain.clone(), scenario)?),
        };
        let mut trips = [None, None];
        for (slot, variant) in [Variant::Library, Variant::Raw].into_iter().enumerate() {
            progress.set_message(format!(
                "{backend} {scenario}: counting round trips ({variant})"
            ));
            trips[slot] =
                count_round_trips(&*workload, variant, scenario, plan.count_ops, progress).await?;
        }
        for &concurrency in &plan.concurrencies {
            progress.set_message(format!("{backend} {scenario} ×{concurrency}: warm-up"));
            let mut slowest = f64::INFINITY;
            for variant in [Variant::Library, Variant::Raw] {
                let ns = round_namespace(backend, scenario, variant);
                prepare(&*workload, scenario, &ns, plan.warmup).await?;
                let warm = run_round(
                    workload.clone(),
                    variant,
                    scenario,
                    &ns,
                    plan.warmup,
                    concurrency,
                    progress,
                )
                .await?;
                slowest = slowest.min(warm.ops_per_sec());
            }
            let per_round = if plan.warmup > 0 {
                plan.per_round_at(slowest)
            } else {
                plan.per_round()
            };
            let rounds = plan.rounds.max(1);
            progress.inc_length(((per_round - plan.per_round()) * rounds * 2) as u64);
            let mut samples = [Samples::default(), Samples::default()];
            let mut commands = [0u64, 0u64];
            let mut have_commands = true;
            for r in 0..plan.rounds.max(1) {
                progress.set_message(format!(
                    "{backend} {scenario} ×{concurrency}: round {}/{}",
                    r + 1,
                    plan.rounds.max(1)
                ));
                for variant in round_order(r) {
                    let slot = variant as usize;
                    let ns = round_namespace(backend, scenario, variant);
                    prepare(&*workload, scenario, &ns, per_round).await?;
                    let before = workload.server_commands().await?;
                    let round = run_round(
                        workload.clone(),
                        variant,
                        scenario,
                        &ns,
                        per_round,
                        concurrency,
                        progress,
                    )
                    .await?;
                    let after = workload.server_commands().await?;
                    match (before, after) {
                        (Some(b), Some(a)) => commands[slot] += a.saturating_sub(b),
                        _ => have_commands = false,
                    }
                    samples[slot].merge(round);
                }
            }
            for (slot, variant) in [Variant::Library, Variant::Raw].into_iter().enumerate() {
                let s = std::mem::take(&mut samples[slot]);
                let ops = s.ops();
                let mut m = Measurement::from_samples(backend, scenario, concurrency, variant, s);
                m.round_trips_per_op = trips[slot];
                if have_commands && ops > 0 {
                    m.server_commands_per_op = Some(commands[slot] as f64 / ops as f64);
                }
                out.push(m);
            }
        }
    }
    Ok(out)
}

/// Renders a duration as the report does (`1.23 s`, `456 ms`).
pub fn human(d: Duration) -> String {
    if d.as_secs() >= 1 {
        format!("{:.2} s", d.as_secs_f64())
    } else {
        format!("{} ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_abba() {
        let order: Vec<_> = (0..4).flat_map(round_order).collect();
        use Variant::{Library as L, Raw as R};
        assert_eq!(order, vec![L, R, R, L, L, R, R, L]);
    }

    #[test]
    fn plan_counts_every_operation_for_the_progress_bar() {
        let plan = Plan {
            ops: 100,
            rounds: 4,
            warmup: 10,
            count_ops: 5,
            concurrencies: vec![1, 64],
            scenarios: Scenario::ALL.to_vec(),
            min_round: Duration::from_millis(200),
        };
        assert_eq!(plan.per_round(), 25);
        // 3 single scenarios × (2 concurrencies × 2 variants × (100 + 10) + 2 × 5),
        // 2 batch scenarios × (2 × 2 × (4 batches + no warm-up) + 2 × 2).
        assert_eq!(
            plan.total_ops(true),
            3 * (2 * 2 * 110 + 10) + 2 * (2 * 2 * 4 + 2 * 2)
        );
        // Rounds stretch to 200 ms at the warm-up's rate, within bounds.
        assert_eq!(plan.per_round_at(1_000.0), 200);
        assert_eq!(plan.per_round_at(10.0), 25);
        assert_eq!(plan.per_round_at(f64::INFINITY), 25);
        assert_eq!(plan.per_round_at(1e12), MAX_PER_ROUND);
        let no_stretch = Plan {
            min_round: Duration::ZERO,
            ..plan
        };
        assert_eq!(no_stretch.per_round_at(1e6), 25);
    }
}
