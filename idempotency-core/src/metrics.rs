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
//! | `idempotency_operation_duration_seconds` | histogram | latency per repository operation, labels `backend`, `operation`, `outcome` |
//!
//! Every metric carries a `backend` label.

use std::time::Duration;

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
/// Histogram: repository operation latency in seconds.
pub const OPERATION_DURATION: &str = "idempotency_operation_duration_seconds";

pub(crate) fn operation(backend: &'static str, op: &'static str, elapsed: Duration, ok: bool) {
    metrics::histogram!(
        OPERATION_DURATION,
        "backend" => backend,
        "operation" => op,
        "outcome" => if ok { "ok" } else { "error" }
    )
    .record(elapsed.as_secs_f64());
}

pub(crate) fn count(name: &'static str, backend: &'static str) {
    metrics::counter!(name, "backend" => backend).increment(1);
}

/// Increments [`KEYS_ACTIVE`] and decrements it again on drop (also on panic or
/// cancellation).
pub(crate) struct ActiveKey(&'static str);

impl ActiveKey {
    pub(crate) fn new(backend: &'static str) -> Self {
        metrics::gauge!(KEYS_ACTIVE, "backend" => backend).increment(1.0);
        ActiveKey(backend)
    }
}

impl Drop for ActiveKey {
    fn drop(&mut self) {
        metrics::gauge!(KEYS_ACTIVE, "backend" => self.0).decrement(1.0);
    }
}
