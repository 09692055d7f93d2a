//! Latency samples and the figures derived from them.

use std::time::Duration;

use serde::Serialize;

/// Per-operation latencies of one or more rounds, in nanoseconds.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    nanos: Vec<u64>,
    elapsed: Duration,
    /// Operations and wall-clock time of each round, in order.
    rounds: Vec<(usize, Duration)>,
}

impl Samples {
    /// Samples of one round that took `elapsed` on the wall clock.
    pub fn new(nanos: Vec<u64>, elapsed: Duration) -> Self {
        Samples {
            rounds: vec![(nanos.len(), elapsed)],
            nanos,
            elapsed,
        }
    }

    /// Adds another round (or rounds).
    pub fn merge(&mut self, other: Samples) {
        self.nanos.extend(other.nanos);
        self.elapsed += other.elapsed;
        self.rounds.extend(other.rounds);
    }

    /// Operations per second of each round, in order.
    pub fn round_ops_per_sec(&self) -> Vec<f64> {
        self.rounds
            .iter()
            .map(|&(ops, elapsed)| rate(ops, elapsed))
            .collect()
    }

    /// Operations measured.
    pub fn ops(&self) -> usize {
        self.nanos.len()
    }

    /// Wall-clock time of all rounds together.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// Operations per second over all rounds (0 when nothing was measured).
    pub fn ops_per_sec(&self) -> f64 {
        rate(self.nanos.len(), self.elapsed)
    }

    /// The `q` quantile (0 ≤ q ≤ 1) of the latencies in µs, nearest rank.
    pub fn quantile_us(&mut self, q: f64) -> f64 {
        if self.nanos.is_empty() {
            return 0.0;
        }
        self.nanos.sort_unstable();
        let rank = (q.clamp(0.0, 1.0) * self.nanos.len() as f64).ceil() as usize;
        let index = rank.clamp(1, self.nanos.len()) - 1;
        self.nanos[index] as f64 / 1_000.0
    }
}

fn rate(ops: usize, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        ops as f64 / secs
    } else {
        0.0
    }
}

/// One measured line of the report.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Measurement {
    /// `memory`, `redis`, `postgres` or `dynamodb`.
    pub backend: String,
    /// The scenario.
    pub scenario: crate::Scenario,
    /// Tasks issuing operations at once.
    pub concurrency: usize,
    /// Library or raw client.
    pub variant: crate::Variant,
    /// Operations measured (over all rounds).
    pub ops: usize,
    /// Throughput over all rounds.
    pub ops_per_sec: f64,
    /// Throughput of each measured round, in the order run.
    #[serde(default)]
    pub round_ops_per_sec: Vec<f64>,
    /// Median latency per operation, µs.
    pub p50_us: f64,
    /// 99th-percentile latency per operation, µs.
    pub p99_us: f64,
    /// Client → server round trips per operation, counted in a separate pass
    /// (`None` for the in-memory store).
    pub round_trips_per_op: Option<f64>,
    /// Server commands per operation, for Redis `INFO commandstats` (which also
    /// counts commands run inside scripts).
    pub server_commands_per_op: Option<f64>,
}

impl Measurement {
    /// Builds the line from merged samples.
    pub fn from_samples(
        backend: &str,
        scenario: crate::Scenario,
        concurrency: usize,
        variant: crate::Variant,
        mut samples: Samples,
    ) -> Self {
        Measurement {
            backend: backend.to_owned(),
            scenario,
            concurrency,
            variant,
            ops: samples.ops(),
            ops_per_sec: samples.ops_per_sec(),
            round_ops_per_sec: samples.round_ops_per_sec(),
            p50_us: samples.quantile_us(0.50),
            p99_us: samples.quantile_us(0.99),
            round_trips_per_op: None,
            server_commands_per_op: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let mut s = Samples::new(
            (1..=100).map(|i| i * 1_000).collect(),
            Duration::from_secs(2),
        );
        assert_eq!(s.quantile_us(0.5), 50.0);
        assert_eq!(s.quantile_us(0.99), 99.0);
        assert_eq!(s.quantile_us(1.0), 100.0);
        assert_eq!(s.quantile_us(0.0), 1.0);
        assert_eq!(s.ops_per_sec(), 50.0);
    }

    #[test]
    fn merged_rounds_add_ops_and_time() {
        let mut a = Samples::new(vec![1_000; 10], Duration::from_millis(10));
        a.merge(Samples::new(vec![3_000; 30], Duration::from_millis(30)));
        assert_eq!(a.ops(), 40);
        assert!((a.ops_per_sec() - 1_000.0).abs() < 1e-9);
        assert_eq!(a.round_ops_per_sec(), vec![1_000.0, 1_000.0]);
        assert_eq!(a.quantile_us(0.5), 3.0);
    }

    #[test]
    fn empty_samples_report_zero() {
        let mut s = Samples::default();
        assert_eq!(s.ops_per_sec(), 0.0);
        assert_eq!(s.quantile_us(0.99), 0.0);
    }
}
