//! Metric names and recording helpers (through the [`metrics`] facade: install
//! any recorder, e.g. `metrics-exporter-prometheus`, to export them).
//!
//! | name | kind | meaning |
//! |---|---|---|
//! | `idempotency_cache_hits` | counter | duplicates answered with a cached result |
//! | `idempotency_cache_misses` | counter | first deliveries: the handler ran |
//! | `idempotency_duplicates_blocked` | counter | deliveries that did not run the handler (cached, duplicate, in progress, previously failed, payload mismatch) |
//! | `idempotency_keys_active` | gauge | keys this process holds (`Processing`) right now |
//! | `idempotency_lease_lost` | counter | completions refused because another owner took over |
//! | `idempotency_fail_open` | counter | handler runs without protection during a store outage |
//! | `idempotency_answer_cache_hits` | counter | deliveries answered from the local answer cache (no round trip) |
//! | `idempotency_answer_cache_misses` | counter | deliveries the local answer cache could not answer (they went to the store); hit ratio = hits / (hits + misses) |
//! | `idempotency_operation_duration_seconds` | histogram | latency per repository operation, labels `backend`, `operation`, `outcome` |
//!
//! Every metric carries a `backend` label.

use std::time::Duration;

use metrics::{Key, Label, Level, Metadata};

/// Counter: duplicates answered with a cached result.
pub const CACHE_HITS: &str = "idempotency_cache_hits";
/// Counter: first deliveries (the handler ran).
pub const CACHE_MISSES: &str = "idempotency_cache_misses";
/// Counter: deliveries that did not run the handler.
pub const DUPLICATES_BLOCKED: &str = "idempotency_duplicates_blocked";
/// Gauge: keys held by this process.
pub const KEYS_ACTIVE: &str = "idempotency_keys_active";
/// Counter: completions refused because the lease was lost.
pub const LEASE_LOST: &str = "idempotency_lease_lost";
/// Counter: unprotected runs during an outage (fail-open).
pub const FAIL_OPEN: &str = "idempotency_fail_open";
/// Counter: deliveries answered from the local answer cache.
pub const ANSWER_CACHE_HITS: &str = "idempotency_answer_cache_hits";
/// Counter: deliveries the local answer cache could not answer.
pub const ANSWER_CACHE_MISSES: &str = "idempotency_answer_cache_misses";
/// Histogram: repository operation latency in seconds.
pub const OPERATION_DURATION: &str = "idempotency_operation_duration_seconds";

/// The repository operations the manager times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Reserve,
    Complete,
    Fail,
    Release,
    Extend,
    Get,
}

impl Op {
    const ALL: [Op; 6] = [
        Op::Reserve,
        Op::Complete,
        Op::Fail,
        Op::Release,
        Op::Extend,
        Op::Get,
    ];

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Op::Reserve => "reserve",
            Op::Complete => "complete",
            Op::Fail => "fail",
            Op::Release => "release",
            Op::Extend => "extend",
            Op::Get => "get",
        }
    }
}

/// The manager's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    CacheHits,
    CacheMisses,
    DuplicatesBlocked,
    LeaseLost,
    FailOpen,
    AnswerCacheHits,
    AnswerCacheMisses,
}

impl Counter {
    const ALL: [Counter; 7] = [
        Counter::CacheHits,
        Counter::CacheMisses,
        Counter::DuplicatesBlocked,
        Counter::LeaseLost,
        Counter::FailOpen,
        Counter::AnswerCacheHits,
        Counter::AnswerCacheMisses,
    ];

    const fn name(self) -> &'static str {
        match self {
            Counter::CacheHits => CACHE_HITS,
            Counter::CacheMisses => CACHE_MISSES,
            Counter::DuplicatesBlocked => DUPLICATES_BLOCKED,
            Counter::LeaseLost => LEASE_LOST,
            Counter::FailOpen => FAIL_OPEN,
            Counter::AnswerCacheHits => ANSWER_CACHE_HITS,
            Counter::AnswerCacheMisses => ANSWER_CACHE_MISSES,
        }
    }
}

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// One manager's metric keys, labelled and hashed once when the manager is
/// built: recording then allocates and hashes nothing. Each call still asks the
/// current recorder (global or thread-local) for its handle, so a recorder
/// installed after the manager was built receives everything from then on.
#[derive(Debug)]
pub(crate) struct Metrics {
    counters: [Key; Counter::ALL.len()],
    keys_active: Key,
    /// `Op::ALL × [ok, error]`.
    durations: [Key; Op::ALL.len() * 2],
}

impl Metrics {
    pub(crate) fn new(backend: &'static str) -> Self {
        let label = || Label::from_static_parts("backend", backend);
        Metrics {
            counters: Counter::ALL.map(|c| Key::from_parts(c.name(), vec![label()])),
            keys_active: Key::from_parts(KEYS_ACTIVE, vec![label()]),
            durations: std::array::from_fn(|i| {
                let op = Op::ALL[i / 2];
                let outcome = if i.is_multiple_of(2) { "ok" } else { "error" };
                Key::from_parts(
                    OPERATION_DURATION,
                    vec![
                        label(),
                        Label::from_static_parts("operation", op.as_str()),
                        Label::from_static_parts("outcome", outcome),
                    ],
                )
            }),
        }
    }

    /// Records one repository operation's latency.
    pub(crate) fn operation(&self, op: Op, elapsed: Duration, ok: bool) {
        let key = &self.durations[op as usize * 2 + usize::from(!ok)];
        metrics::with_recorder(|r| r.register_histogram(key, &METADATA))
            .record(elapsed.as_secs_f64());
    }

    /// Increments a counter.
    pub(crate) fn count(&self, counter: Counter) {
        let key = &self.counters[counter as usize];
        metrics::with_recorder(|r| r.register_counter(key, &METADATA)).increment(1);
    }

    /// Counts a key as held until the guard drops.
    pub(crate) fn active(&self) -> ActiveKey<'_> {
        self.keys_active_gauge().increment(1.0);
        ActiveKey(self)
    }

    fn keys_active_gauge(&self) -> metrics::Gauge {
        metrics::with_recorder(|r| r.register_gauge(&self.keys_active, &METADATA))
    }
}

/// Counts one held key in `idempotency_keys_active` while alive.
pub(crate) struct ActiveKey<'a>(&'a Metrics);

impl Drop for ActiveKey<'_> {
    fn drop(&mut self) {
        self.0.keys_active_gauge().decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_documented_labels() {
        let m = Metrics::new("memory");
        let key = &m.durations[Op::Fail as usize * 2 + 1];
        assert_eq!(key.name(), OPERATION_DURATION);
        let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
        assert_eq!(
            labels,
            vec![
                ("backend", "memory"),
                ("operation", "fail"),
                ("outcome", "error")
            ]
        );
        assert_eq!(m.counters[Counter::LeaseLost as usize].name(), LEASE_LOST);
        assert_eq!(m.keys_active.name(), KEYS_ACTIVE);
    }
}
