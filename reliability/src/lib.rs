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
//! Every store call of a run goes through a [`Recorder`], which logs its
//! arguments (the caller's instants included) and its answer on one logical
//! clock; after the run, each key's history is checked for linearizability
//! ([`linearizable`], a Wing–Gong–Lowe search) against the memory store's
//! sequential rules ([`StoreModel`]). Calls that never answered, or answered
//! an ambiguous error, are pending: applied at any point after their call,
//! or never. A non-linearizable history fails the run and is written under
//! `$CARGO_TARGET_DIR/linearizability/`.
//!
//! `cargo run -p idempotency-reliability -- --minutes 10` soaks every backend
//! and writes `RELIABILITY.md`; `tests/scenarios.rs` runs every scenario once
//! per backend in the test suite.

mod figures;
pub mod linearizable;
mod recorder;
mod run;
mod scenario;
mod store_model;
mod target;

pub use figures::Figures;
pub use recorder::{History, Linearizability, Recorder};
pub use run::{run, Plan};
pub use scenario::{Bound, Scenario};
pub use store_model::{Answer, Call, StoreModel};
pub use target::{Backend, Target};

/// The scenarios that apply to `backend`: the in-memory store and SQLite have
/// no network and no server, the Redis Cluster no proxy (in-process faults only); a durable restart applies to PostgreSQL, MySQL and to Redis with an
/// append-only file, a forgetful one to Redis without persistence (its stated
/// bound: one effect per delivery).
pub fn scenarios_for(backend: Backend) -> Vec<Scenario> {
    Scenario::ALL
        .into_iter()
        .filter(|s| {
            let in_process = matches!(
                backend,
                Backend::Memory | Backend::RedisCluster | Backend::Sqlite
            );
            !in_process || !(s.needs_network() || s.needs_own_server())
        })
        // SQLite: a crash here leaks the consumer's future (`mem::forget`);
        // one leaked inside a reservation keeps its transaction, and with it
        // the file's write lock, for good, where a real crash releases it
        // (the OS closes the file, and the next open rolls an unfinished
        // transaction back). Takeovers after a holder stops answering are
        // checked for SQLite by the conformance suite.
        .filter(|s| !(backend == Backend::Sqlite && *s == Scenario::ConsumerCrash))
        // Restarts: PostgreSQL, MySQL, and Redis with and without persistence (the
        // DynamoDB emulator keeps its tables in memory: a restart is a store
        // that forgets, which DynamoDB itself is not).
        .filter(|s| match s {
            Scenario::ServerRestart => {
                matches!(backend, Backend::Postgres | Backend::Mysql | Backend::Redis)
            }
            Scenario::ServerRestartForgetful => backend == Backend::Redis,
            _ => true,
        })
        .collect()
}
