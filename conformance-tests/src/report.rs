//! The outcome of a whole run.

use std::fmt;

use crate::CheckResult;

/// The outcome of one check.
#[derive(Debug, Clone)]
pub struct CheckOutcome {
    /// The check's name.
    pub name: &'static str,
    /// Its result.
    pub result: CheckResult,
}

/// The outcomes of [`run_all`](crate::run_all).
#[derive(Debug, Clone)]
pub struct Report {
    outcomes: Vec<CheckOutcome>,
}

impl Report {
    pub(crate) fn new(outcomes: Vec<CheckOutcome>) -> Self {
        Report { outcomes }
    }

    /// Every outcome, in suite order.
    pub fn outcomes(&self) -> &[CheckOutcome] {
        &self.outcomes
    }

    /// How many checks passed.
    pub fn passed(&self) -> usize {
        self.outcomes.iter().filter(|o| o.result.is_ok()).count()
    }

    /// The failed checks.
    pub fn failures(&self) -> impl Iterator<Item = &CheckOutcome> {
        self.outcomes.iter().filter(|o| o.result.is_err())
    }

    /// Whether the check `name` failed.
    pub fn failed(&self, name: &str) -> bool {
        self.outcomes
            .iter()
            .any(|o| o.name == name && o.result.is_err())
    }

    /// Panics, listing every failure, unless all checks passed.
    pub fn assert_all_passed(&self) {
        if self.failures().next().is_some() {
            panic!("conformance failures:\n{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for o in &self.outcomes {
            match &o.result {
                Ok(()) => writeln!(f, "  ok    {}", o.name)?,
                Err(e) => writeln!(f, "  FAIL  {}: {e}", o.name)?,
            }
        }
        write!(
            f,
            "{} passed, {} failed",
            self.passed(),
            self.outcomes.len() - self.passed()
        )
    }
}
