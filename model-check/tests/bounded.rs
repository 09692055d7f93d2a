//! The bounded runs of the model: every reachable state of small
//! configurations, checked against every property. A deeper run is
//! `cargo run -p idempotency-model --release --example deep` (README).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idempotency_core::{CancelPolicy, FailurePolicy};
use idempotency_model::properties::{
    EVERY_DELIVERY_ANSWERED, EXAMPLES, NOTHING_HANGS, NO_STALE_EFFECT, NO_STALE_WRITE, ONE_EFFECT,
};
use idempotency_model::{check, Broken, ModelConfig, Report};

fn run(config: ModelConfig) -> Report {
    let report = check(config.clone(), 2).unwrap();
    println!("{config:?}\n{report}");
    report
}

fn holds(config: ModelConfig) -> Report {
    let report = run(config);
    assert!(report.failures().is_empty(), "{report}");
    assert!(report.complete, "{report}");
    report
}

/// The core: two consumers whose clocks differ by the allowance, leases
/// ending, a crash, redeliveries and takeovers.
#[test]
fn crashes_takeovers_and_skew_within_the_allowance() {
    let report = holds(ModelConfig {
        max_time: 4,
        faults: 0,
        crashes: 1,
        deliveries: 2,
        ..ModelConfig::default()
    });
    assert!(report.missing_examples.is_empty(), "{report}");
}

/// Lost requests, late and lost replies, and the re-sends with the same
/// owner token that settle them (reserve, complete, get).
#[test]
fn lost_late_and_resent_calls() {
    let report = holds(ModelConfig {
        max_time: 3,
        faults: 1,
        crashes: 0,
        deliveries: 2,
        ..ModelConfig::default()
    });
    assert!(!report.missing_examples.contains(&EXAMPLES[0]), "{report}");
}

/// The lease keeper extends beside the handler and while it records.
#[test]
fn lease_extension() {
    holds(ModelConfig {
        max_time: 4,
        faults: 0,
        crashes: 1,
        deliveries: 1,
        extension: true,
        ..ModelConfig::default()
    });
}

/// A caller drops the execution while it reserves, runs or records, under
/// either cancel policy.
#[test]
fn dropped_executions_at_each_phase() {
    for on_cancel in [CancelPolicy::KeepLease, CancelPolicy::Release] {
        holds(ModelConfig {
            max_time: 4,
            faults: 0,
            crashes: 0,
            drops: 1,
            deliveries: 2,
            on_cancel,
            ..ModelConfig::default()
        });
    }
}

/// Handlers fail; failures are stored and taken over by a redelivery.
#[test]
fn stored_and_retried_failures() {
    holds(ModelConfig {
        max_time: 4,
        faults: 0,
        crashes: 1,
        deliveries: 2,
        handler_failures: true,
        failure_policy: FailurePolicy::StoreAndRetry,
        ..ModelConfig::default()
    });
}

/// The local answer cache answers redeliveries of completed keys.
#[test]
fn local_answer_cache() {
    holds(ModelConfig {
        max_time: 4,
        faults: 0,
        crashes: 1,
        deliveries: 2,
        answer_cache: Some(2),
        ..ModelConfig::default()
    });
}

/// The checker catches a store that takes a lease over without the skew
/// allowance: a consumer whose clock runs ahead takes over a live lease.
#[test]
fn a_takeover_without_the_skew_allowance_is_caught() {
    let report = run(ModelConfig {
        max_time: 2,
        faults: 0,
        crashes: 0,
        deliveries: 1,
        broken: Some(Broken::TakeoverWithoutSkew),
        ..ModelConfig::default()
    });
    let found = report
        .failure(NO_STALE_EFFECT)
        .or_else(|| report.failure(ONE_EFFECT))
        .expect("a counterexample");
    assert!(found.trace.contains("EFFECT"), "{}", found.trace);
}

/// The checker catches a `complete` applied without the owner check: a
/// stale owner's late completion lands on the new owner's record.
#[test]
fn an_owner_unchecked_complete_is_caught() {
    let report = run(ModelConfig {
        max_time: 3,
        faults: 1,
        crashes: 0,
        deliveries: 2,
        broken: Some(Broken::OwnerUncheckedComplete),
        ..ModelConfig::default()
    });
    let found = report.failure(NO_STALE_WRITE).expect("a counterexample");
    assert!(found.trace.contains("complete"), "{}", found.trace);
}

/// Beyond the contract's condition — clocks further apart than the
/// allowance — the guarantee does not hold, as the contract says.
#[test]
fn clocks_beyond_the_allowance_run_the_handler_twice() {
    let report = run(ModelConfig {
        clock_offsets: vec![0, 2],
        max_time: 2,
        faults: 0,
        crashes: 0,
        deliveries: 1,
        ..ModelConfig::default()
    });
    assert!(
        report.failure(NO_STALE_EFFECT).is_some() || report.failure(ONE_EFFECT).is_some(),
        "{report}"
    );
}

/// The liveness properties are not vacuous: consumers that wait for a lost
/// call for ever (no time box) leave a delivery unanswered, and the checker
/// says so.
#[test]
fn a_call_without_a_time_box_hangs_and_is_caught() {
    let report = run(ModelConfig {
        max_time: 3,
        faults: 1,
        crashes: 0,
        deliveries: 1,
        broken: Some(Broken::NoTimeBox),
        ..ModelConfig::default()
    });
    assert!(
        report.failure(NOTHING_HANGS).is_some()
            || report.failure(EVERY_DELIVERY_ANSWERED).is_some(),
        "{report}"
    );
}
