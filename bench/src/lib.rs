//! `idempotency-bench`: measures every store of idempotency-rs against the raw
//! client issuing the same server commands, in one run, interleaved.
//!
//! For each enabled backend, each scenario (fresh executions, duplicate replies)
//! and each concurrency, the runner alternates rounds of the **library** (an
//! [`IdempotencyManager`](idempotency_core::IdempotencyManager) around a trivial
//! handler) and of the **raw** baseline (the same commands through the same
//! client and connection setup, without the library), in the order A B B A A B …
//! so that machine drift cancels, and reports ops/s, p50/p99 latency and server
//! round trips per operation. The headline is the ratio library ÷ raw.
//!
//! For the in-memory store the raw baseline is the handler called directly, so
//! the difference is the manager's own overhead per execution.
//!
//! See `BENCHMARKS.md` at the workspace root for how to run it and the results.

pub mod args;
pub mod brokers;
pub mod driver;
pub mod report;
pub mod stats;
pub mod workloads;

use std::fmt;

use serde::{Deserialize, Serialize};

/// A boxed error for the benchmark's plumbing.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a round measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// First deliveries: reserve → trivial handler → complete.
    Fresh,
    /// Redeliveries of completed keys: answered from the stored record.
    Duplicate,
    /// Redeliveries of keys this process completed: answered from the local
    /// answer cache (`Config::answer_cache`); the raw client still reads the
    /// record.
    Cached,
    /// Polls of first deliveries: one `execute_batch` of 100 messages; the
    /// other side is the same messages through `execute`, one at a time.
    BatchFresh,
    /// Polls of redeliveries, batch against one at a time likewise.
    BatchDuplicate,
}

impl Scenario {
    /// Every scenario, in report order.
    pub const ALL: [Scenario; 5] = [
        Scenario::Fresh,
        Scenario::Duplicate,
        Scenario::Cached,
        Scenario::BatchFresh,
        Scenario::BatchDuplicate,
    ];

    /// `fresh`, `duplicate`, `cached`, `batch-fresh` or `batch-duplicate`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scenario::Fresh => "fresh",
            Scenario::Duplicate => "duplicate",
            Scenario::Cached => "cached",
            Scenario::BatchFresh => "batch-fresh",
            Scenario::BatchDuplicate => "batch-duplicate",
        }
    }

    /// The scenario named `s`.
    pub fn parse(s: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether its keys are completed before the round (a redelivery).
    pub fn is_duplicate(self) -> bool {
        matches!(
            self,
            Scenario::Duplicate | Scenario::Cached | Scenario::BatchDuplicate
        )
    }

    /// Whether an operation is one batch of
    /// [`BATCH`](crate::workloads::BATCH) messages (and the other side is
    /// the same messages one at a time through the library).
    pub fn is_batch(self) -> bool {
        matches!(self, Scenario::BatchFresh | Scenario::BatchDuplicate)
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who issues the commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// The library: `IdempotencyManager::execute` over the backend.
    Library,
    /// The raw client issuing the same commands.
    Raw,
}

impl Variant {
    /// `library` or `raw`.
    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Library => "library",
            Variant::Raw => "raw",
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
