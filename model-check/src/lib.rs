//! A model checker over idempotency-core's own decisions (issue #47).
//!
//! [`IdempotencyModel`] is a [stateright](https://docs.rs/stateright) model of
//! N consumers delivered one key, one store, leases and their extension,
//! clocks within and beyond the skew allowance, lost and late requests and
//! replies (reserve, complete, fail, release, extend, get), callers that drop
//! an execution at each phase, crashes, redeliveries and the local answer
//! cache. Its transitions call the core's decision functions — the store's
//! `reserve_transition`/`reserved_record`/`holds`/`finish_record`/
//! `extend_record`, the engine's `stages::reserve_request`,
//! `decide_duplicate`, `failure_action`, `finish_margin`, `finished_by`,
//! `on_drop`, `answer_serve_until`/`cached_answer` and `RESERVE_RETRIES` —
//! so the checker checks the code, not a paraphrase of it. See
//! `model-check/README.md`.
//!
//! ```
//! use idempotency_model::{check, ModelConfig};
//!
//! let config = ModelConfig { max_time: 3, crashes: 0, faults: 0, deliveries: 1, ..ModelConfig::default() };
//! let report = check(config, 1)?;
//! assert!(report.failures().is_empty(), "{report}");
//! # Ok::<(), idempotency_core::Error>(())
//! ```

pub mod config;
mod consumer;
pub mod model;
pub mod properties;
pub mod state;
mod store;
pub mod trace;

use std::fmt;
use std::time::{Duration, Instant};

use stateright::{Checker, Expectation, HasDiscoveries, Model};

pub use config::{Broken, ModelConfig};
pub use model::{Action, IdempotencyModel};
pub use state::State;

/// A property's discovery: a counterexample (a failure) or an example.
#[derive(Debug, Clone)]
pub struct Discovery {
    /// The property's name.
    pub property: &'static str,
    /// Whether it is a counterexample (an `always` or `eventually`
    /// property that does not hold).
    pub failure: bool,
    /// The path, as numbered steps.
    pub trace: String,
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct Report {
    /// States generated (with repeats).
    pub states: usize,
    /// Distinct states.
    pub unique_states: usize,
    /// The longest path explored.
    pub max_depth: usize,
    /// How long the run took.
    pub elapsed: Duration,
    /// Whether every reachable state was explored.
    pub complete: bool,
    /// Every discovery.
    pub discoveries: Vec<Discovery>,
    /// The `sometimes` properties with no example (the model may be vacuous
    /// there).
    pub missing_examples: Vec<&'static str>,
}

impl Report {
    /// The counterexamples found.
    pub fn failures(&self) -> Vec<&Discovery> {
        self.discoveries.iter().filter(|d| d.failure).collect()
    }

    /// The counterexample of `property`, if one was found.
    pub fn failure(&self, property: &str) -> Option<&Discovery> {
        self.failures().into_iter().find(|d| d.property == property)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} states ({} distinct), depth {}, {:.2?}{}",
            self.states,
            self.unique_states,
            self.max_depth,
            self.elapsed,
            if self.complete {
                ""
            } else {
                " (stopped early)"
            }
        )?;
        for d in self.failures() {
            writeln!(f, "VIOLATED: {}\n{}", d.property, d.trace)?;
        }
        if !self.missing_examples.is_empty() {
            writeln!(f, "no example of: {}", self.missing_examples.join(", "))?;
        }
        Ok(())
    }
}

/// Checks `config` breadth-first on `threads` threads, exploring every
/// reachable state (stopping at the first counterexample).
///
/// # Errors
/// [`idempotency_core::Error::Config`] when the library refuses the
/// configuration.
pub fn check(config: ModelConfig, threads: usize) -> Result<Report, idempotency_core::Error> {
    let model = IdempotencyModel::new(config)?;
    let started = Instant::now();
    let checker = model
        .clone()
        .checker()
        .threads(threads.max(1))
        .finish_when(HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    let elapsed = started.elapsed();
    let properties = model.properties();
    let found = checker.discoveries();
    let mut discoveries: Vec<Discovery> = found
        .iter()
        .filter_map(|(name, path)| {
            let property = properties.iter().find(|p| p.name == *name)?;
            // The ghost flags stay set: cut an invariant's path at the first
            // state that breaks it.
            let states = path.clone().into_states();
            let end = match property.expectation {
                Expectation::Always => states
                    .iter()
                    .position(|s| !(property.condition)(&model, s))
                    .unwrap_or(states.len().saturating_sub(1)),
                _ => states.len().saturating_sub(1),
            };
            Some(Discovery {
                property: name,
                failure: property.expectation.discovery_is_failure(),
                trace: trace::format_path(&model, path, end),
            })
        })
        .collect();
    discoveries.sort_by_key(|d| d.property);
    let missing_examples = properties::EXAMPLES
        .iter()
        .copied()
        .filter(|name| !found.contains_key(name))
        .collect();
    let complete = !discoveries.iter().any(|d| d.failure);
    Ok(Report {
        states: checker.state_count(),
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed,
        complete,
        discoveries,
        missing_examples,
    })
}
