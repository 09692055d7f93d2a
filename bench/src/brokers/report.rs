//! The broker benchmark's figures: per line, library ÷ raw, Markdown and
//! JSON (`brokers.json`, `brokers.md`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{BoxError, Scenario, Variant};

/// One measured line: a broker over a store, a scenario, a variant.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BrokerMeasurement {
    /// `kafka` or `sqs`.
    pub broker: String,
    /// The library's store (`memory`, `redis`); the raw loop has none.
    pub store: String,
    /// `fresh` or `duplicate`.
    pub scenario: Scenario,
    /// Library or raw.
    pub variant: Variant,
    /// Messages consumed over the measured rounds.
    pub messages: usize,
    /// Messages per second over the measured rounds.
    pub messages_per_sec: f64,
    /// Messages per second of each measured round, in the order run.
    pub round_messages_per_sec: Vec<f64>,
    /// Polls that returned messages.
    pub polls: usize,
    /// Deliveries of messages already consumed (the broker's own
    /// duplicates; SQS is at least once), not in `messages`.
    pub redelivered: usize,
    /// Median duration of such a poll (receive, handle, commit or delete), µs.
    pub poll_p50_us: f64,
    /// 99th percentile of the same, µs.
    pub poll_p99_us: f64,
}

/// Library ÷ raw for one broker, store and scenario.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BrokerComparison {
    /// The broker.
    pub broker: String,
    /// The library's store.
    pub store: String,
    /// The scenario.
    pub scenario: Scenario,
    /// Library messages/s.
    pub library_messages_per_sec: f64,
    /// Raw messages/s.
    pub raw_messages_per_sec: f64,
    /// Library ÷ raw over all rounds: the headline.
    pub ratio: f64,
    /// Library ÷ raw of each pair of adjacent rounds.
    pub round_ratios: Vec<f64>,
    /// What the library adds per message, µs of wall-clock time.
    pub overhead_us_per_message: f64,
}

impl BrokerComparison {
    /// Smallest, median and largest per-round ratio.
    pub fn round_spread(&self) -> Option<(f64, f64, f64)> {
        let mut r = self.round_ratios.clone();
        r.sort_by(f64::total_cmp);
        let n = r.len();
        let median = match n {
            0 => return None,
            n if n % 2 == 1 => r[n / 2],
            n => (r[n / 2 - 1] + r[n / 2]) / 2.0,
        };
        Some((r[0], median, r[n - 1]))
    }
}

/// Pairs the library and raw lines of each broker, store and scenario.
pub fn compare(lines: &[BrokerMeasurement]) -> Vec<BrokerComparison> {
    let mut pairs: BTreeMap<(String, String, Scenario), [Option<&BrokerMeasurement>; 2]> =
        BTreeMap::new();
    for m in lines {
        pairs
            .entry((m.broker.clone(), m.store.clone(), m.scenario))
            .or_default()[m.variant as usize] = Some(m);
    }
    let div = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let per_message = |rate: f64| div(1e6, rate);
    pairs
        .into_iter()
        .filter_map(|((broker, store, scenario), [lib, raw])| {
            let (lib, raw) = (lib?, raw?);
            Some(BrokerComparison {
                broker,
                store,
                scenario,
                library_messages_per_sec: lib.messages_per_sec,
                raw_messages_per_sec: raw.messages_per_sec,
                ratio: div(lib.messages_per_sec, raw.messages_per_sec),
                round_ratios: lib
                    .round_messages_per_sec
                    .iter()
                    .zip(&raw.round_messages_per_sec)
                    .map(|(l, r)| div(*l, *r))
                    .collect(),
                overhead_us_per_message: per_message(lib.messages_per_sec)
                    - per_message(raw.messages_per_sec),
            })
        })
        .collect()
}

/// Everything a broker run produced.
#[derive(Debug, Serialize)]
pub struct BrokerReport {
    /// Unix time of the run, seconds.
    pub generated_at: u64,
    /// The machine.
    pub machine: BTreeMap<String, String>,
    /// The plan and options.
    pub config: BTreeMap<String, String>,
    /// Per broker and store: what it ran against.
    pub setups: BTreeMap<String, String>,
    /// Every measured line.
    pub results: Vec<BrokerMeasurement>,
    /// Library vs raw.
    pub comparisons: Vec<BrokerComparison>,
}

fn rate(v: f64) -> String {
    if v >= 100_000.0 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1_000.0 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

fn us(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

impl BrokerReport {
    /// The Markdown tables: library ÷ raw, then every line.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "### Brokers: library ÷ raw consumer loop\n");
        let _ = writeln!(
            md,
            "| broker | store | scenario | library msg/s | raw msg/s | ratio | rounds: min / median / max | overhead µs/msg |"
        );
        let _ = writeln!(md, "|---|---|---|--:|--:|--:|--:|--:|");
        for c in &self.comparisons {
            let spread = c.round_spread().map_or_else(
                || "–".to_owned(),
                |(lo, mid, hi)| format!("{lo:.2} / {mid:.2} / {hi:.2}"),
            );
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | **{:.2}×** | {} | {:.1} |",
                c.broker,
                c.store,
                c.scenario,
                rate(c.library_messages_per_sec),
                rate(c.raw_messages_per_sec),
                c.ratio,
                spread,
                c.overhead_us_per_message
            );
        }
        let _ = writeln!(md, "\n### Brokers: every line\n");
        let _ = writeln!(
            md,
            "| broker | store | scenario | variant | messages | msg/s | polls | msg/poll | poll p50 µs | poll p99 µs | redelivered |"
        );
        let _ = writeln!(md, "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|");
        for m in &self.results {
            // No poll timed (RabbitMQ's library consumer has none to time).
            let polls = if m.polls > 0 {
                format!(
                    "{} | {:.1} | {} | {}",
                    m.polls,
                    m.messages as f64 / m.polls as f64,
                    us(m.poll_p50_us),
                    us(m.poll_p99_us)
                )
            } else {
                "– | – | – | –".to_owned()
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {polls} | {} |",
                m.broker,
                m.store,
                m.scenario,
                m.variant,
                m.messages,
                rate(m.messages_per_sec),
                m.redelivered
            );
        }
        let _ = writeln!(md, "\n### Brokers: setup\n");
        for (k, v) in self.machine.iter().chain(&self.config).chain(&self.setups) {
            let _ = writeln!(md, "- {k}: {v}");
        }
        md
    }

    /// Writes `brokers.json` and `brokers.md` into `dir`.
    ///
    /// # Errors
    /// I/O errors.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>, BoxError> {
        std::fs::create_dir_all(dir)?;
        let files = [
            (
                dir.join("brokers.json"),
                serde_json::to_string_pretty(self)?,
            ),
            (dir.join("brokers.md"), self.markdown()),
        ];
        let mut written = Vec::new();
        for (path, text) in files {
            std::fs::write(&path, text)?;
            written.push(path);
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(variant: Variant, rates: &[f64]) -> BrokerMeasurement {
        BrokerMeasurement {
            broker: "kafka".to_owned(),
            store: "memory".to_owned(),
            scenario: Scenario::Fresh,
            variant,
            messages: 1_000,
            messages_per_sec: rates.iter().sum::<f64>() / rates.len() as f64,
            round_messages_per_sec: rates.to_vec(),
            polls: 10,
            redelivered: 0,
            poll_p50_us: 1.0,
            poll_p99_us: 2.0,
        }
    }

    #[test]
    fn comparisons_pair_library_and_raw() {
        let c = compare(&[
            line(Variant::Library, &[800.0, 900.0]),
            line(Variant::Raw, &[1_000.0, 1_000.0]),
        ]);
        assert_eq!(c.len(), 1);
        assert!((c[0].ratio - 0.85).abs() < 1e-9);
        let (lo, mid, hi) = c[0].round_spread().unwrap();
        assert!((lo - 0.8).abs() < 1e-9 && (mid - 0.85).abs() < 1e-9 && (hi - 0.9).abs() < 1e-9);
        assert!((c[0].overhead_us_per_message - (1e6 / 850.0 - 1e3)).abs() < 1e-6);
        let report = BrokerReport {
            generated_at: 0,
            machine: BTreeMap::new(),
            config: BTreeMap::new(),
            setups: BTreeMap::new(),
            results: vec![line(Variant::Library, &[1.0])],
            comparisons: c,
        };
        let md = report.markdown();
        assert!(md.contains("**0.85×**") && md.contains("| 100.0 |"), "{md}");
    }
}
