//! Tests of the `idempotency` facade against real servers: `tests/stores.rs`
//! runs the same manager code on every store `idempotency::connect` reaches
//! by URL. A crate of its own so that the facade's dev-dependencies stay
//! light: `cargo run --example quickstart` builds no test harness.
