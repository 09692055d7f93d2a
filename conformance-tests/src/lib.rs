//! The conformance suite every idempotency-rs repository must pass — the bundled
//! backends and yours.
//!
//! It checks every operation of the repository contract (`idempotency_core::contract` §3: each
//! status × each operation × owner match/mismatch × live/expired), the manager's
//! decisions over that repository (§4), concurrency (many tasks racing one key,
//! many keys × many duplicates, racing takeovers: exactly one winner every time),
//! injective key encoding with adversarial ids, binary and large results and
//! errors up to the store's limit, and expiry driven purely by the caller's
//! clock.
//!
//! Every check creates its own random namespace and its own
//! [`ManualClock`](idempotency_core::ManualClock) starting at the wall-clock
//! time, so all checks can run in parallel against one shared store: the suite
//! never flushes anything and never sleeps to make time pass — with one
//! exception, for stores that declare `native_expiry`: the server's own timer
//! cannot be driven by the suite's clock, so
//! `check_native_expiry_follows_every_write` waits 2.5 s of real time to see
//! that every write moved it.
//!
//! # Running it for your backend
//!
//! One `#[tokio::test]` per check, named after it, for a factory returning a
//! fresh [`SharedRepository`] (called once per test, inside that test's runtime):
//!
//! ```
//! use std::sync::Arc;
//! use idempotency_core::{MemoryRepository, SharedRepository};
//!
//! async fn repository() -> SharedRepository {
//!     Arc::new(MemoryRepository::new())
//! }
//!
//! idempotency_conformance::conformance_tests!(repository);
//! # fn main() {}
//! ```
//!
//! Your crate needs `tokio` (features `macros`, `rt-multi-thread`) as a
//! dev-dependency. Or run everything at once and inspect the [`Report`]:
//!
//! ```
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
//! use std::sync::Arc;
//! let report = idempotency_conformance::run_all(Arc::new(idempotency_core::MemoryRepository::new())).await;
//! assert!(report.passed() >= 40);
//! report.assert_all_passed();
//! # });
//! ```
//!
//! # What it catches
//!
//! `CATALOGUE.md` beside this crate lists 152 plausible single-flaw backends
//! (non-atomic reserve or takeover, check-then-write fencing, off-by-one lease
//! and expiry boundaries, collations and truncated keys or namespaces,
//! takeovers that forget a field, extension that does not move expiry, batch
//! paths that drift from the single operations, an attempt counter in a
//! narrow column, operator listings and counts that misfilter (stuck leases
//! judged without the clock skew among them), corrupt
//! records or outages misreported, a clock-skew allowance cut to whole seconds,
//! a listing prefix read as a `LIKE` or glob pattern, a store's own TTL that
//! later writes do not move, a result limit with no room for the largest key,
//! …), the checks that catch each, and the
//! catch rate over 20 runs: every flaw, every run. Race checks run some
//! rounds joined in one task — the racers interleave at every await point, so a
//! read-then-write gap as small as one scheduler yield is hit deterministically
//! — in both orders (each side polled first: a store whose own `reserve` is a
//! read then a compare-and-swap exposes a racer's flaw only in one of them),
//! and some on separate threads behind a barrier.
//!
//! # The errors clause
//!
//! [`store_fault_tests!`] adds the checks that need to act on the store around
//! the repository (an undecodable record, a store that stops answering), for a
//! backend that implements [`StoreFaults`]; see its docs and `docs/testing.md`.
//!
//! Capabilities a backend lacks are declared in
//! [`Capabilities`](idempotency_core::Capabilities), not skipped: e.g. with
//! `native_expiry` the purge check accepts that `purge_expired` removes nothing,
//! but still requires expired records to be absent.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;

use futures::FutureExt;
use idempotency_core::SharedRepository;

#[cfg(feature = "containers")]
pub mod containers;

mod batch;
mod checks;
mod edges;
pub mod error_table;
mod failure_paths;
mod model;
mod operator;
mod report;
mod store_faults;
mod support;

pub use batch::*;
pub use checks::*;
pub use edges::*;
pub use failure_paths::*;
pub use model::check_model_based_sequences;
pub use operator::{check_admin_list_prefix_is_literal, check_admin_lists_and_counts};
pub use report::{CheckOutcome, Report};
pub use store_faults::{
    check_corrupt_record_is_reported_with_its_key, check_unreachable_store_is_a_retryable_error,
    fault_check_named, run_fault_checks, FaultCheck, SharedFaults, StoreFaults, FAULT_CHECKS,
    HANG_LIMIT,
};
pub use support::random_namespace;

/// Why a check failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckFailure {
    /// What went wrong, with the suite's source location.
    pub message: String,
}

impl fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CheckFailure {}

/// The result of one check.
pub type CheckResult = Result<(), CheckFailure>;

/// A boxed check future.
pub type CheckFuture = Pin<Box<dyn Future<Output = CheckResult> + Send>>;

/// One named check of the suite.
#[derive(Clone, Copy)]
pub struct Check {
    /// The check's name: its function's (and its generated test's) name.
    pub name: &'static str,
    /// Runs the check against a repository.
    pub run: fn(SharedRepository) -> CheckFuture,
}

impl fmt::Debug for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Check").field("name", &self.name).finish()
    }
}

/// Runs one check, turning a panic (of the check or of the repository) into a
/// failure.
pub async fn run_check(check: &Check, repo: SharedRepository) -> CheckResult {
    match AssertUnwindSafe((check.run)(repo)).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("non-string panic");
            Err(CheckFailure {
                message: format!("panicked: {message}"),
            })
        }
    }
}

/// The check named `name`, if any.
pub fn check_named(name: &str) -> Option<&'static Check> {
    ALL_CHECKS.iter().find(|c| c.name == name)
}

/// Runs every check against `repo`, eight at a time, and reports each outcome.
pub async fn run_all(repo: SharedRepository) -> Report {
    use futures::StreamExt;
    let outcomes = futures::stream::iter(ALL_CHECKS.iter())
        .map(|check| {
            let repo = repo.clone();
            async move {
                CheckOutcome {
                    name: check.name,
                    result: run_check(check, repo).await,
                }
            }
        })
        .buffered(8)
        .collect()
        .await;
    Report::new(outcomes)
}

/// Defines [`ALL_CHECKS`] and the [`conformance_tests!`] macro from one list.
macro_rules! define_suite {
    ($d:tt $($name:ident),* $(,)?) => {
        paste_checks! { $($name),* }

        /// Expands to one `#[tokio::test]` per conformance check, named after
        /// it, each calling `$factory().await` for a fresh
        /// [`SharedRepository`](idempotency_core::SharedRepository).
        ///
        /// Requires `tokio` with `macros` and `rt-multi-thread` among the
        /// calling crate's dev-dependencies.
        #[macro_export]
        macro_rules! conformance_tests {
            ($d factory:path) => {
                $(
                    #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
                    async fn $name() {
                        let repo: $crate::__private::SharedRepository = $d factory().await;
                        let check = $crate::check_named(stringify!($name))
                            .unwrap_or_else(|| panic!("no check named {}", stringify!($name)));
                        if let Err(failure) = $crate::run_check(check, repo).await {
                            panic!("conformance check `{}` failed: {}", stringify!($name), failure);
                        }
                    }
                )*
            };
        }
    };
}

macro_rules! paste_checks {
    ($($name:ident),*) => {
        /// Every check of the suite, in a stable order.
        pub const ALL_CHECKS: &[Check] = &[
            $(Check {
                name: stringify!($name),
                run: |repo| -> CheckFuture { Box::pin($name(repo)) },
            }),*
        ];
    };
}

define_suite! { $
    check_reserve_creates_processing,
    check_reserve_returns_live_processing,
    check_reserve_returns_completed,
    check_reserve_returns_failed_without_retry,
    check_reserve_takes_over_failed_with_retry,
    check_reserve_takes_over_expired_lease,
    check_reserve_lease_boundary,
    check_reserve_honours_clock_skew,
    check_reserve_after_expiry_creates_fresh,
    check_expiry_boundary,
    check_reserve_fingerprint_mismatch_blocks_takeover,
    check_reserve_fingerprint_mismatch_blocks_retry,
    check_reserve_takeover_with_one_fingerprint,
    check_reserve_same_fingerprint_is_duplicate,
    check_takeover_increments_attempt,
    check_takeover_sets_new_lease_and_expiry,
    check_attempt_counts_past_a_byte,
    check_complete_by_owner,
    check_complete_wrong_owner,
    check_complete_after_lease_expiry_without_takeover,
    check_complete_only_from_processing,
    check_complete_absent_or_expired,
    check_complete_empty_and_missing_results,
    check_binary_results_round_trip,
    check_large_result_up_to_limit,
    check_result_over_limit_is_refused,
    check_large_error_up_to_limit,
    check_fail_by_owner,
    check_fail_wrong_owner_or_state,
    check_fail_edges,
    check_fenced_by_token_not_clock,
    check_refused_writes_touch_nothing,
    check_release_by_owner,
    check_release_refused,
    check_release_expired,
    check_extend_by_owner,
    check_extend_refused,
    check_extend_moves_expiry,
    check_reserve_resent_by_holder,
    check_reserve_many_follows_reserve,
    check_reserve_many_races_single_reserves,
    check_complete_many_races_takeovers,
    check_complete_many_follows_complete,
    check_fail_remembers_retryable,
    check_takeover_paths_write_every_field,
    check_get_absent_and_expired,
    check_native_expiry_follows_every_write,
    check_delete,
    check_purge_expired,
    check_admin_lists_and_counts,
    check_admin_list_prefix_is_literal,
    check_adversarial_keys_are_distinct,
    check_keys_are_byte_exact,
    check_long_ids,
    check_namespaces_isolate,
    check_concurrent_reserve_single_winner,
    check_concurrent_many_keys,
    check_concurrent_takeover_single_winner,
    check_concurrent_recreate_of_expired,
    check_complete_races_takeover,
    check_fenced_operations_race_takeover,
    check_manager_executes_once_and_replays,
    check_manager_duplicate_without_cache,
    check_manager_oversized_result_not_cached,
    check_manager_result_over_store_limit,
    check_manager_in_progress_fail_fast,
    check_manager_in_progress_wait,
    check_manager_payload_mismatch,
    check_manager_release_on_error,
    check_manager_stored_failure,
    check_manager_store_and_retry,
    check_manager_error_classification,
    check_manager_takeover_after_crash,
    check_manager_reports_lease_lost,
    check_manager_key_validation,
    check_manager_concurrent_deliveries,
    check_manager_panic_releases,
    check_manager_ttl_expiry,
    check_manager_scopes_isolate,
    check_capabilities_are_coherent,
    check_model_based_sequences,
}

/// One `#[tokio::test]` per check of the errors clause ([`FAULT_CHECKS`]), for
/// a factory returning a fresh repository and the [`StoreFaults`] that act on
/// its store (called once per test; give each call a store path of its own,
/// e.g. its own [`FaultProxy`](crate::containers::FaultProxy), so the tests
/// can run in parallel).
///
/// ```
/// use std::sync::Arc;
/// use idempotency_conformance::{SharedFaults, StoreFaults};
/// use idempotency_core::{MemoryRepository, RecordKey, SharedRepository};
///
/// struct NoStore;
///
/// #[async_trait::async_trait]
/// impl StoreFaults for NoStore {
///     async fn corrupt(&self, _: &RecordKey) -> Result<(), String> { Err("in memory".into()) }
///     async fn unreach(&self) -> Result<(), String> { Err("in memory".into()) }
///     async fn reach(&self) -> Result<(), String> { Ok(()) }
/// }
///
/// async fn repository_and_faults() -> (SharedRepository, SharedFaults) {
///     (Arc::new(MemoryRepository::new()), Arc::new(NoStore))
/// }
///
/// // In a test file: idempotency_conformance::store_fault_tests!(repository_and_faults);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! store_fault_tests {
    ($factory:path) => {
        $crate::__store_fault_tests!(
            $factory;
            check_corrupt_record_is_reported_with_its_key,
            check_unreachable_store_is_a_retryable_error
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __store_fault_tests {
    ($factory:path; $($name:ident),*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let (repo, faults) = $factory().await;
                let check = $crate::fault_check_named(stringify!($name))
                    .unwrap_or_else(|| panic!("no fault check named {}", stringify!($name)));
                let result = (check.run)(repo, faults.clone()).await;
                let healed = faults.reach().await;
                if let Err(failure) = result {
                    panic!("conformance check `{}` failed: {}", stringify!($name), failure);
                }
                healed.expect("make the store reachable again");
            }
        )*
    };
}

#[doc(hidden)]
pub mod __private {
    pub use idempotency_core::SharedRepository;
}
