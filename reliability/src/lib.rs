//! Fault-injection runs of the idempotency layer against real stores.
//!
//! Consumers (tasks over several managers, each with its own connections,
//! standing for separate processes) deliver every key several times, in a
//! seeded random order, through [`IdempotencyManager::execute_detached`](idempotency_core::IdempotencyManager::execute_detached),
//! while one kind of fault is injected ([`Scenario`]): latency, a black hole,
//! connection resets and lost replies through a proxy between the managers and
//! the server; callers that give up, handlers slower than their lease, clocks
//! ahead in the process. Then every key is redelivered until answered, and a
//! checker compares each key's effects with the contract's bound, and checks
//! that every key was answered, nothing panicked, every error was of the right
//! class, and no call took longer than the contract's per-phase bound.
//!
//! `cargo run -p idempotency-reliability -- --minutes 10` soaks every backend
//! and writes `RELIABILITY.md`; `tests/scenarios.rs` runs every scenario once
//! per backend in the test suite.

mod figures;
mod run;
mod scenario;
mod target;

pub use figures::Figures;
pub use run::{run, Plan};
pub use scenario::Scenario;
pub use target::{Backend, Target};

/// The scenarios that apply to `backend` (the in-memory store has no network).
/// The in-memory store has no network and no server; a restart applies to
/// PostgreSQL only (the moto server and the test Redis keep records in memory:
/// a restart loses them, a documented limit, not a scenario with a bound).
pub fn scenarios_for(backend: Backend) -> Vec<Scenario> {
    Scenario::ALL
        .into_iter()
        .filter(|s| backend != Backend::Memory || !(s.needs_network() || s.needs_own_server()))
        .filter(|s| *s != Scenario::ServerRestart || backend == Backend::Postgres)
        .collect()
}
