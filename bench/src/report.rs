//! The report: JSON (all figures), a Markdown table and an SVG chart.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::stats::Measurement;
use crate::{BoxError, Scenario};

/// One library-vs-raw comparison.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Comparison {
    /// The backend.
    pub backend: String,
    /// The scenario.
    pub scenario: Scenario,
    /// Tasks at once.
    pub concurrency: usize,
    /// Library ops/s.
    pub library_ops_per_sec: f64,
    /// Raw ops/s.
    pub raw_ops_per_sec: f64,
    /// Library ÷ raw throughput over all rounds: the headline.
    pub ratio: f64,
    /// Library ÷ raw of each pair of adjacent rounds (round `i` of each
    /// variant; the order alternates A B B A, so a pair ran back to back): the
    /// spread shows how much of a difference is noise.
    #[serde(default)]
    pub round_ratios: Vec<f64>,
    /// What the library adds per operation, in µs of wall-clock time per
    /// operation (`1/library − 1/raw` throughput, at this concurrency).
    pub overhead_us: f64,
}

impl Comparison {
    /// The smallest, median and largest per-round ratio (`None` without rounds).
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

/// Pairs the library and raw lines of each (backend, scenario, concurrency).
pub fn compare(results: &[Measurement]) -> Vec<Comparison> {
    let mut pairs: BTreeMap<(usize, Scenario, usize), [Option<&Measurement>; 2]> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for m in results {
        if !order.contains(&m.backend.as_str()) {
            order.push(&m.backend);
        }
        let b = order.iter().position(|o| *o == m.backend).unwrap_or(0);
        pairs.entry((b, m.scenario, m.concurrency)).or_default()[m.variant as usize] = Some(m);
    }
    pairs
        .into_iter()
        .filter_map(|((b, scenario, concurrency), [lib, raw])| {
            let (lib, raw) = (lib?, raw?);
            let ratio = if raw.ops_per_sec > 0.0 {
                lib.ops_per_sec / raw.ops_per_sec
            } else {
                0.0
            };
            let per_op = |ops_per_sec: f64| {
                if ops_per_sec > 0.0 {
                    1e6 / ops_per_sec
                } else {
                    0.0
                }
            };
            let round_ratios = lib
                .round_ops_per_sec
                .iter()
                .zip(&raw.round_ops_per_sec)
                .map(|(l, r)| if *r > 0.0 { l / r } else { 0.0 })
                .collect();
            Some(Comparison {
                backend: order[b].to_owned(),
                scenario,
                concurrency,
                library_ops_per_sec: lib.ops_per_sec,
                raw_ops_per_sec: raw.ops_per_sec,
                ratio,
                round_ratios,
                overhead_us: per_op(lib.ops_per_sec) - per_op(raw.ops_per_sec),
            })
        })
        .collect()
}

/// Everything one run produced.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Unix time of the run, seconds.
    pub generated_at: u64,
    /// The machine.
    pub machine: BTreeMap<String, String>,
    /// The plan and options.
    pub config: BTreeMap<String, String>,
    /// Per backend: what it ran against.
    pub backends: BTreeMap<String, String>,
    /// Every measured line.
    pub results: Vec<Measurement>,
    /// Library vs raw.
    pub comparisons: Vec<Comparison>,
}

fn ops(v: f64) -> String {
    if v >= 100_000.0 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1_000.0 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.2}"))
}

fn us(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The target the issue sets for a comparison, and whether it is met:
/// batches of 100 ≥ 5 × the same messages through `execute` (Redis and
/// PostgreSQL), Redis ≥ 0.9 × raw at 64 tasks, PostgreSQL ≥ 0.9 × raw at 16+
/// tasks, the manager's overhead over the memory store under 2 µs (one task),
/// and under 1 µs for a duplicate answered from the local answer cache.
pub fn target(c: &Comparison) -> Option<(String, bool)> {
    let batch = matches!(c.scenario, Scenario::BatchFresh | Scenario::BatchDuplicate);
    match c.backend.as_str() {
        "redis" | "postgres" if batch => Some(("≥ 5×".to_owned(), c.ratio >= 5.0)),
        _ if batch => None,
        "memory" if c.concurrency == 1 && c.scenario == Scenario::Cached => {
            Some(("< 1 µs".to_owned(), c.overhead_us < 1.0))
        }
        "redis" if c.concurrency >= 64 => Some(("≥ 0.90×".to_owned(), c.ratio >= 0.9)),
        "postgres" if c.concurrency >= 16 => Some(("≥ 0.90×".to_owned(), c.ratio >= 0.9)),
        "memory" if c.concurrency == 1 => Some(("< 2 µs".to_owned(), c.overhead_us < 2.0)),
        _ => None,
    }
}

impl Report {
    /// The Markdown report: the headline comparison, then every line.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "### Library ÷ raw client\n");
        let _ = writeln!(
            md,
            "| backend | scenario | tasks | library ops/s | raw ops/s | ratio | rounds: min / median / max | overhead µs/op | target |"
        );
        let _ = writeln!(md, "|---|---|--:|--:|--:|--:|--:|--:|---|");
        for c in &self.comparisons {
            let target = target(c).map_or_else(String::new, |(t, ok)| {
                format!("{t} {}", if ok { "✅" } else { "❌" })
            });
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | **{:.2}×** | {} | {:.2} | {} |",
                c.backend,
                c.scenario,
                c.concurrency,
                ops(c.library_ops_per_sec),
                ops(c.raw_ops_per_sec),
                c.ratio,
                c.round_spread().map_or_else(
                    || "–".to_owned(),
                    |(lo, mid, hi)| format!("{lo:.2} / {mid:.2} / {hi:.2}")
                ),
                c.overhead_us,
                target
            );
        }
        let _ = writeln!(md, "\n### Every line\n");
        let _ = writeln!(
            md,
            "| backend | scenario | tasks | variant | ops | ops/s | p50 µs | p99 µs | round trips/op | server cmds/op |"
        );
        let _ = writeln!(md, "|---|---|--:|---|--:|--:|--:|--:|--:|--:|");
        for m in &self.results {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                m.backend,
                m.scenario,
                m.concurrency,
                m.variant,
                m.ops,
                ops(m.ops_per_sec),
                us(m.p50_us),
                us(m.p99_us),
                opt(m.round_trips_per_op),
                opt(m.server_commands_per_op),
            );
        }
        let _ = writeln!(md, "\n### Setup\n");
        for (k, v) in self.machine.iter().chain(self.config.iter()) {
            let _ = writeln!(md, "- {k}: {v}");
        }
        for (k, v) in &self.backends {
            let _ = writeln!(md, "- {k}: {v}");
        }
        md
    }

    /// A horizontal bar chart of library ÷ raw per backend, scenario and
    /// concurrency, with the 0.9 target and parity marked. The memory store,
    /// whose "raw" is a bare function call, is labelled with its overhead in µs
    /// instead.
    pub fn svg(&self) -> String {
        let rows = &self.comparisons;
        let (left, bar_w, row_h, top) = (250.0_f64, 460.0_f64, 26.0_f64, 50.0_f64);
        let max = rows
            .iter()
            .filter(|c| c.backend != "memory")
            .map(|c| c.ratio)
            .fold(1.2_f64, f64::max)
            .min(3.0);
        let x = |v: f64| left + bar_w * (v.min(max) / max);
        let height = top + row_h * rows.len() as f64 + 40.0;
        let width = left + bar_w + 170.0;
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            svg,
            r##"<rect width="100%" height="100%" fill="#ffffff"/>"##
        );
        let _ = writeln!(
            svg,
            r#"<text x="{left}" y="22" font-size="14" font-weight="bold">idempotency-rs: library throughput ÷ raw client (same commands)</text>"#
        );
        for (i, c) in rows.iter().enumerate() {
            let y = top + row_h * i as f64;
            let label = format!("{} {} ×{}", c.backend, c.scenario, c.concurrency);
            let _ = writeln!(
                svg,
                r#"<text x="{:.0}" y="{:.0}" text-anchor="end">{label}</text>"#,
                left - 8.0,
                y + 16.0
            );
            if c.backend == "memory" {
                let _ = writeln!(
                    svg,
                    r##"<text x="{left}" y="{:.0}" fill="#555">manager overhead {:.2} µs/op ({} ops/s)</text>"##,
                    y + 16.0,
                    c.overhead_us,
                    ops(c.library_ops_per_sec)
                );
                continue;
            }
            let fill = match c.scenario {
                Scenario::Fresh => "#3b6fb6",
                Scenario::Duplicate => "#5aa469",
                Scenario::Cached => "#c2873a",
                Scenario::BatchFresh => "#7a5cb8",
                Scenario::BatchDuplicate => "#b85c8a",
            };
            let _ = writeln!(
                svg,
                r#"<rect x="{left}" y="{:.0}" width="{:.1}" height="{:.0}" fill="{fill}"/>"#,
                y + 4.0,
                x(c.ratio) - left,
                row_h - 8.0
            );
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.0}">{:.2}× ({} vs {} ops/s)</text>"#,
                x(c.ratio) + 6.0,
                y + 16.0,
                c.ratio,
                ops(c.library_ops_per_sec),
                ops(c.raw_ops_per_sec)
            );
        }
        let bottom = top + row_h * rows.len() as f64;
        for (v, dash, label) in [(0.9, "4,3", "0.9 target"), (1.0, "", "parity")] {
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.1}" y1="{top:.0}" x2="{x:.1}" y2="{bottom:.0}" stroke="#c0392b" stroke-dasharray="{dash}"/>"##,
                x = x(v)
            );
            let _ = writeln!(
                svg,
                r##"<text x="{x:.1}" y="{:.0}" text-anchor="middle" fill="#c0392b">{label}</text>"##,
                bottom + 16.0,
                x = x(v)
            );
        }
        let _ = writeln!(svg, "</svg>");
        svg
    }

    /// Writes `results.json`, `results.md` and `chart.svg` into `dir`.
    ///
    /// # Errors
    /// I/O errors.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>, BoxError> {
        std::fs::create_dir_all(dir)?;
        let files = [
            (
                dir.join("results.json"),
                serde_json::to_string_pretty(self)?,
            ),
            (dir.join("results.md"), self.markdown()),
            (dir.join("chart.svg"), self.svg()),
        ];
        let mut written = Vec::new();
        for (path, text) in files {
            std::fs::write(&path, text)?;
            written.push(path);
        }
        Ok(written)
    }
}

/// Facts about this machine for the report.
pub fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    m.insert("cpu".to_owned(), cpu);
    m.insert(
        "cores".to_owned(),
        std::thread::available_parallelism().map_or_else(|_| "?".to_owned(), |n| n.to_string()),
    );
    if let Ok(kernel) = std::fs::read_to_string("/proc/sys/kernel/osrelease") {
        m.insert("kernel".to_owned(), kernel.trim().to_owned());
    }
    m.insert(
        "build".to_owned(),
        if cfg!(debug_assertions) {
            "debug (numbers are not representative: use --release)".to_owned()
        } else {
            "release".to_owned()
        },
    );
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Variant;

    fn line(backend: &str, variant: Variant, c: usize, ops_per_sec: f64) -> Measurement {
        Measurement {
            backend: backend.to_owned(),
            scenario: Scenario::Fresh,
            concurrency: c,
            variant,
            ops: 1000,
            ops_per_sec,
            round_ops_per_sec: vec![ops_per_sec / 2.0, ops_per_sec, ops_per_sec * 2.0],
            p50_us: 10.0,
            p99_us: 20.0,
            round_trips_per_op: Some(2.0),
            server_commands_per_op: None,
        }
    }

    #[test]
    fn comparisons_pair_library_and_raw() {
        let results = vec![
            line("redis", Variant::Library, 64, 45_000.0),
            line("redis", Variant::Raw, 64, 50_000.0),
            line("memory", Variant::Library, 1, 1_000_000.0),
            line("memory", Variant::Raw, 1, 10_000_000.0),
            line("postgres", Variant::Library, 16, 100.0), // no raw: no comparison
        ];
        let c = compare(&results);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].backend, "redis");
        assert!((c[0].ratio - 0.9).abs() < 1e-9);
        assert_eq!(c[0].round_ratios.len(), 3);
        let (lo, mid, hi) = c[0].round_spread().unwrap();
        assert!((lo - 0.9).abs() < 1e-9 && (mid - 0.9).abs() < 1e-9 && (hi - 0.9).abs() < 1e-9);
        assert_eq!(target(&c[0]), Some(("≥ 0.90×".to_owned(), true)));
        assert_eq!(c[1].backend, "memory");
        assert!((c[1].overhead_us - 0.9).abs() < 1e-9);
        assert_eq!(target(&c[1]).map(|t| t.1), Some(true));
    }

    #[test]
    fn batches_are_held_to_five_times_one_at_a_time() {
        let batch = |backend: &str, ratio: f64| Comparison {
            scenario: Scenario::BatchFresh,
            ratio,
            ..compare(&[
                line(backend, Variant::Library, 16, 1.0),
                line(backend, Variant::Raw, 16, 1.0),
            ])
            .remove(0)
        };
        assert_eq!(
            target(&batch("postgres", 6.7)),
            Some(("≥ 5×".to_owned(), true))
        );
        assert_eq!(
            target(&batch("redis", 4.5)),
            Some(("≥ 5×".to_owned(), false))
        );
        assert_eq!(target(&batch("sqlite", 9.0)), None);
    }

    #[test]
    fn round_spread_is_min_median_max() {
        let mut c = compare(&[
            line("redis", Variant::Library, 64, 45_000.0),
            line("redis", Variant::Raw, 64, 50_000.0),
        ])
        .remove(0);
        c.round_ratios = vec![0.95, 0.7, 1.1, 0.8];
        assert_eq!(c.round_spread(), Some((0.7, 0.875, 1.1)));
        c.round_ratios.clear();
        assert_eq!(c.round_spread(), None);
    }

    #[test]
    fn markdown_and_svg_show_every_comparison() {
        let results = vec![
            line("redis", Variant::Library, 64, 45_000.0),
            line("redis", Variant::Raw, 64, 50_000.0),
        ];
        let report = Report {
            generated_at: 0,
            machine: machine(),
            config: BTreeMap::new(),
            backends: BTreeMap::new(),
            comparisons: compare(&results),
            results,
        };
        let md = report.markdown();
        assert!(
            md.contains("| redis | fresh | 64 | 45.0k | 50.0k | **0.90×** | 0.90 / 0.90 / 0.90 |"),
            "{md}"
        );
        assert!(md.contains("| redis | fresh | 64 | raw | 1000 | 50.0k | 10.0 | 20.0 | 2.00 | – |"));
        let svg = report.svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("0.90× (45.0k vs 50.0k ops/s)"));
        assert_eq!(svg.matches("<rect").count(), 2); // background + one bar
    }
}
