//! What one run measured, the verdict against the contract's bound, and the
//! report's rows.

use std::fmt::Write as _;
use std::time::Duration;

use crate::recorder::Linearizability;
use crate::run::{FiguresInput, Plan};
use crate::scenario::{Bound, Scenario};
use crate::target::Backend;

/// The figures of one run.
#[derive(Debug, Clone)]
pub struct Figures {
    /// The store.
    pub backend: Backend,
    /// The fault.
    pub scenario: Scenario,
    /// The plan's seed (replay with it).
    pub seed: u64,
    /// Keys delivered.
    pub keys: usize,
    /// `execute` calls made (deliveries and redeliveries).
    pub executions: usize,
    /// Faults injected (windows, resets, lost replies).
    pub faults: usize,
    /// Replies the proxy dropped.
    pub lost_replies: u64,
    /// The most effects one key had.
    pub max_effects: usize,
    /// Keys with more effects than the bound.
    pub over_bound: Vec<usize>,
    /// Keys answered without any effect (lost work).
    pub without_effect: Vec<usize>,
    /// Keys never answered.
    pub unanswered: Vec<usize>,
    /// Panics of consumers.
    pub panics: usize,
    /// The slowest `execute` call.
    pub slowest: Duration,
    /// Retryable errors (the store was unavailable or timed out).
    pub retryable: usize,
    /// Errors of the wrong class (not retryable, under a transient fault).
    pub wrong_class: Vec<String>,
    /// How long the run took.
    pub took: Duration,
    /// The history of the first failing key, when there is one.
    pub failing_history: Option<String>,
    /// The check of every store call's history against the sequential
    /// contract (`None` until [`Figures::with_linearizability`]).
    pub linearizability: Option<Linearizability>,
    /// Where the non-linearizable histories were written, if any.
    pub violations_file: Option<String>,
}

impl Figures {
    pub(crate) fn collect(
        backend: Backend,
        scenario: Scenario,
        plan: Plan,
        input: &FiguresInput<'_>,
    ) -> Figures {
        let effects = |k: &usize| input.effects.get(k).map_or(0, Vec::len);
        let keys: Vec<usize> = (0..plan.keys).collect();
        let limit = |k: &usize| match scenario.bound() {
            Bound::One => 1,
            Bound::OnePlusCrashed => 1 + input.crashed_effects.get(k).copied().unwrap_or(0),
            Bound::PerDelivery => input.deliveries.get(k).copied().unwrap_or(0),
        };
        let over_bound: Vec<usize> = keys
            .iter()
            .copied()
            .filter(|k| effects(k) > limit(k))
            .collect();
        let without_effect: Vec<usize> = keys
            .iter()
            .copied()
            .filter(|k| input.answered.contains_key(k) && effects(k) == 0)
            .collect();
        let unanswered: Vec<usize> = keys
            .iter()
            .copied()
            .filter(|k| !input.answered.contains_key(k))
            .collect();
        let failing = over_bound
            .first()
            .or(without_effect.first())
            .or(unanswered.first())
            .map(|k| history(*k, input));
        Figures {
            backend,
            scenario,
            seed: plan.seed,
            keys: plan.keys,
            executions: input.executions,
            faults: input.faults,
            lost_replies: input.lost_replies,
            max_effects: keys.iter().map(effects).max().unwrap_or(0),
            over_bound,
            without_effect,
            unanswered,
            panics: input.panics,
            slowest: input.slowest,
            retryable: input.retryable,
            wrong_class: input.wrong_class.to_vec(),
            took: input.took,
            failing_history: failing,
            linearizability: None,
            violations_file: None,
        }
    }

    /// Adds a later run of the same backend and scenario: counts are summed,
    /// maxima kept, failing keys and errors gathered (the first failing
    /// history kept).
    pub fn absorb(&mut self, other: Figures) {
        self.keys += other.keys;
        self.executions += other.executions;
        self.faults += other.faults;
        self.lost_replies += other.lost_replies;
        self.max_effects = self.max_effects.max(other.max_effects);
        self.over_bound.extend(other.over_bound);
        self.without_effect.extend(other.without_effect);
        self.unanswered.extend(other.unanswered);
        self.panics += other.panics;
        self.slowest = self.slowest.max(other.slowest);
        self.retryable += other.retryable;
        self.wrong_class.extend(other.wrong_class);
        self.took += other.took;
        if self.failing_history.is_none() {
            self.failing_history = other.failing_history;
        }
        match (&mut self.linearizability, &other.linearizability) {
            (Some(mine), Some(theirs)) => mine.absorb(theirs),
            (None, Some(theirs)) => self.linearizability = Some(theirs.clone()),
            _ => {}
        }
        if self.violations_file.is_none() {
            self.violations_file = other.violations_file;
        }
    }

    /// The longest an `execute` may take in these runs: the contract's bound
    /// per phase (reserve `3 × store_timeout + 60 ms`, the handler, recording
    /// until shortly before the lease ends) plus a margin of two seconds for
    /// the machine.
    pub fn call_bound(&self) -> Duration {
        let config = self.scenario.config("bound");
        config.store_timeout * 3
            + Duration::from_millis(60)
            + self.scenario.handler_time()
            + config.processing_timeout
            + Duration::from_secs(2)
    }

    /// `Ok` when the run kept the contract's bounds, else what it broke.
    ///
    /// # Errors
    /// A description of every broken bound and the first failing key's history.
    pub fn verdict(&self) -> Result<(), String> {
        let mut broken = Vec::new();
        if !self.over_bound.is_empty() {
            broken.push(format!(
                "keys with more effects than the bound ({}): {:?}",
                self.scenario.bound(),
                self.over_bound
            ));
        }
        if !self.without_effect.is_empty() {
            broken.push(format!(
                "keys answered without an effect: {:?}",
                self.without_effect
            ));
        }
        if !self.unanswered.is_empty() {
            broken.push(format!("keys never answered: {:?}", self.unanswered));
        }
        if self.panics > 0 {
            broken.push(format!("{} panics", self.panics));
        }
        if !self.wrong_class.is_empty() {
            broken.push(format!("errors of the wrong class: {:?}", self.wrong_class));
        }
        if self.slowest > self.call_bound() {
            broken.push(format!(
                "a call took {:?}, more than the bound {:?}",
                self.slowest,
                self.call_bound()
            ));
        }
        let held = self.scenario.store_keeps_records();
        if let Some(l) = self
            .linearizability
            .as_ref()
            .filter(|l| held && !l.violations.is_empty())
        {
            broken.push(format!(
                "{} of {} keys' store histories not linearizable (written to {}):\n{}",
                l.violations.len(),
                l.keys,
                self.violations_file.as_deref().unwrap_or("(not written)"),
                l.violations[0]
            ));
        }
        if broken.is_empty() {
            return Ok(());
        }
        let mut message = format!(
            "{} / {} (seed {}): {}",
            self.backend,
            self.scenario,
            self.seed,
            broken.join("; ")
        );
        if let Some(history) = &self.failing_history {
            let _ = write!(message, "\n{history}");
        }
        Err(message)
    }

    /// Records `check`, writing its violations (if any) under `dir`.
    pub fn with_linearizability(mut self, check: Linearizability, dir: &std::path::Path) -> Self {
        if !check.violations.is_empty() {
            let name = format!(
                "{}-{}-{}.txt",
                self.backend.to_string().replace(' ', "-"),
                self.scenario.to_string().replace([' ', ',', '(', ')'], "-"),
                self.seed
            );
            let path = dir.join(name);
            let written = std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&path, check.violations.join("\n")));
            self.violations_file = Some(match written {
                Ok(()) => path.display().to_string(),
                Err(e) => format!("(not written to {}: {e})", path.display()),
            });
        }
        self.linearizability = Some(check);
        self
    }

    /// The linearizability table's header.
    pub fn linearizability_header() -> &'static str {
        "| backend | scenario | store calls checked | keys | linearizable | check time |\n|---|---|---|---|---|---|"
    }

    /// The linearizability table's row (`unknown`: a key's search ran out of
    /// its budget, reported as such, never as a pass).
    pub fn linearizability_row(&self) -> String {
        let Some(l) = &self.linearizability else {
            return format!(
                "| {} | {} | – | – | not checked | – |",
                self.backend, self.scenario
            );
        };
        let verdict = match (l.verdict(), self.scenario.store_keeps_records()) {
            (v, false) if v == "NO" => "no (expected: the store forgot its records)".to_owned(),
            (v, _) => v,
        };
        format!(
            "| {} | {} | {} | {} | {} | {} ms |",
            self.backend,
            self.scenario,
            l.operations,
            l.keys,
            verdict,
            l.took.as_millis()
        )
    }

    /// The report's header.
    pub fn header() -> &'static str {
        "| backend | scenario | keys | executions | faults | effects/key (max) | bound | unanswered | panics | slowest call | call bound | retryable errors | wrong-class errors | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    }

    /// The report's row.
    pub fn row(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ms | {} ms | {} | {} | {} |",
            self.backend,
            self.scenario,
            self.keys,
            self.executions,
            self.faults,
            self.max_effects,
            self.scenario.bound(),
            self.unanswered.len(),
            self.panics,
            self.slowest.as_millis(),
            self.call_bound().as_millis(),
            self.retryable,
            self.wrong_class.len(),
            if self.verdict().is_ok() { "✅" } else { "❌" }
        )
    }
}

/// The ordered history of one key: every delivery's answer and every effect.
fn history(key: usize, input: &FiguresInput<'_>) -> String {
    let mut out = format!("history of evt-{key}:\n");
    for line in input.history.get(&key).into_iter().flatten() {
        let _ = writeln!(out, "  {line}");
    }
    for (attempt, consumer) in input.effects.get(&key).into_iter().flatten() {
        let _ = writeln!(out, "  effect: attempt {attempt} by c{consumer}");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn figures(effects: &[(usize, usize)], answered: &[usize], wrong: &[&str]) -> Figures {
        let effects: HashMap<usize, Vec<(u32, usize)>> = effects
            .iter()
            .map(|&(k, n)| (k, (0..n).map(|i| (i as u32 + 1, i)).collect()))
            .collect();
        let answered: HashMap<usize, &'static str> =
            answered.iter().map(|&k| (k, "executed")).collect();
        let wrong: Vec<String> = wrong.iter().map(|s| (*s).to_owned()).collect();
        let history = HashMap::from([(1, vec!["c0: executed".to_owned()])]);
        let input = FiguresInput {
            effects: &effects,
            answered: &answered,
            history: &history,
            executions: 6,
            deliveries: &HashMap::new(),
            crashed_effects: &HashMap::new(),
            retryable: 0,
            wrong_class: &wrong,
            slowest: Duration::from_millis(5),
            panics: 0,
            faults: 0,
            lost_replies: 0,
            took: Duration::from_secs(1),
        };
        let plan = Plan {
            keys: 3,
            ..Plan::short(7)
        };
        Figures::collect(Backend::Memory, Scenario::Baseline, plan, &input)
    }

    #[test]
    fn the_checker_passes_exactly_once_and_catches_every_broken_bound() {
        figures(&[(0, 1), (1, 1), (2, 1)], &[0, 1, 2], &[])
            .verdict()
            .unwrap();
        let doubled = figures(&[(0, 1), (1, 2), (2, 1)], &[0, 1, 2], &[]);
        let e = doubled.verdict().unwrap_err();
        assert!(
            e.contains("more effects than the bound (1)") && e.contains("history of evt-1"),
            "{e}"
        );
        let lost = figures(&[(0, 1), (2, 1)], &[0, 1, 2], &[])
            .verdict()
            .unwrap_err();
        assert!(lost.contains("without an effect: [1]"), "{lost}");
        let blocked = figures(&[(0, 1), (1, 1)], &[0, 1], &[])
            .verdict()
            .unwrap_err();
        assert!(blocked.contains("never answered: [2]"), "{blocked}");
        let wrong = figures(&[(0, 1), (1, 1), (2, 1)], &[0, 1, 2], &["evt-0: config"]);
        assert!(wrong.verdict().unwrap_err().contains("wrong class"));
        let mut slow = figures(&[(0, 1), (1, 1), (2, 1)], &[0, 1, 2], &[]);
        slow.slowest = slow.call_bound() + Duration::from_millis(1);
        assert!(slow.verdict().unwrap_err().contains("more than the bound"));
    }

    /// The bounds other than "one": each crashed consumer's effect is allowed
    /// once more; "per delivery" allows as many effects as `execute` calls.
    #[test]
    fn stated_bounds_allow_exactly_what_they_state() {
        let effects: HashMap<usize, Vec<(u32, usize)>> =
            HashMap::from([(0, vec![(1, 0), (2, 1)]), (1, vec![(1, 0), (2, 1)])]);
        let answered = HashMap::from([(0, "executed"), (1, "executed")]);
        let crashed = HashMap::from([(0, 1)]);
        let deliveries = HashMap::from([(0, 2), (1, 1)]);
        let history = HashMap::new();
        let input = FiguresInput {
            effects: &effects,
            answered: &answered,
            history: &history,
            executions: 3,
            deliveries: &deliveries,
            crashed_effects: &crashed,
            retryable: 0,
            wrong_class: &[],
            slowest: Duration::from_millis(5),
            panics: 0,
            faults: 0,
            lost_replies: 0,
            took: Duration::from_secs(1),
        };
        let plan = Plan {
            keys: 2,
            ..Plan::short(7)
        };
        let crash = Figures::collect(Backend::Memory, Scenario::ConsumerCrash, plan, &input);
        assert_eq!(
            crash.over_bound,
            vec![1],
            "key 0 had a crash after its effect"
        );
        let per = Figures::collect(Backend::Memory, Scenario::ClockBeyondSkew, plan, &input);
        assert_eq!(
            per.over_bound,
            vec![1],
            "key 1 had one delivery, two effects"
        );
        let one = Figures::collect(Backend::Memory, Scenario::Baseline, plan, &input);
        assert_eq!(one.over_bound, vec![0, 1]);
    }

    #[test]
    fn a_non_linearizable_history_fails_the_run_and_is_written_out() {
        let dir = std::env::temp_dir().join(format!("linear-{:x}", rand::random::<u64>()));
        let bad = Linearizability {
            operations: 3,
            keys: 1,
            violations: vec!["non-linearizable history of evt-1".to_owned()],
            ..Linearizability::default()
        };
        let f = figures(&[(0, 1), (1, 1), (2, 1)], &[0, 1, 2], &[])
            .with_linearizability(bad.clone(), &dir);
        let e = f.verdict().unwrap_err();
        assert!(
            e.contains("1 of 1 keys' store histories not linearizable"),
            "{e}"
        );
        let file = f.violations_file.clone().unwrap();
        assert!(std::fs::read_to_string(&file).unwrap().contains("evt-1"));
        assert!(f.linearizability_row().contains("| NO |"));
        // A store that forgets on restart: reported, not held against the run.
        let mut forgetful = f.clone();
        forgetful.scenario = Scenario::ServerRestartForgetful;
        forgetful.verdict().unwrap();
        assert!(forgetful.linearizability_row().contains("expected"));
        // Out of budget: reported unknown, never yes.
        let unknown = Linearizability {
            unknown: vec!["evt-2".to_owned()],
            ..Linearizability::default()
        };
        let u =
            figures(&[(0, 1), (1, 1), (2, 1)], &[0, 1, 2], &[]).with_linearizability(unknown, &dir);
        assert!(u.linearizability_row().contains("| unknown |"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
