//! The contract's errors clause, which the trait alone cannot exercise: an
//! undecodable record is `Corrupt` naming its key, and an unreachable store is
//! a retryable `Unavailable` or `Timeout` within the backend's timeout — never
//! a panic, a hang, a silently overwritten record or a handler run.
//!
//! A backend opts in by giving these checks a [`StoreFaults`]: how to leave an
//! undecodable record under a key, and how to make its store unreachable and
//! reachable again (the harness's [`FaultProxy`](crate::containers) is one way).
//! Run them with [`run_fault_checks`] or one test each with
//! [`store_fault_tests!`](crate::store_fault_tests).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use idempotency_core::{
    Config, Error, ExecuteError, HandlerError, OwnerToken, RecordKey, Reservation, SharedRepository,
};

use crate::report::{CheckOutcome, Report};
use crate::support::{ensure, failure, Ctx};
use crate::CheckResult;

/// The longest one call may take while the store is unreachable before the
/// check calls it a hang. Give the repository under test a short operation
/// timeout (a second or two), so the checks run fast; this bound only catches
/// calls that never return.
pub const HANG_LIMIT: Duration = Duration::from_secs(60);

/// What a backend's tests can do to its store beyond the trait.
#[async_trait]
pub trait StoreFaults: Send + Sync {
    /// Leaves something under `key` that the repository cannot decode as a
    /// record — what a foreign writer, a newer record format or a torn write
    /// leaves — written around the repository (a raw command, a raw row).
    async fn corrupt(&self, key: &RecordKey) -> Result<(), String>;

    /// Makes the store stop answering the repository under test: requests go
    /// out and no reply comes (a black hole, the hardest case for timeouts),
    /// until [`reach`](Self::reach).
    async fn unreach(&self) -> Result<(), String>;

    /// Makes the store answer again.
    async fn reach(&self) -> Result<(), String>;
}

/// Shared [`StoreFaults`].
pub type SharedFaults = Arc<dyn StoreFaults>;

/// A check of the errors clause.
#[derive(Clone, Copy)]
pub struct FaultCheck {
    /// The check's name (and its generated test's).
    pub name: &'static str,
    /// Runs the check.
    pub run: fn(SharedRepository, SharedFaults) -> BoxFuture<'static, CheckResult>,
}

impl std::fmt::Debug for FaultCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultCheck")
            .field("name", &self.name)
            .finish()
    }
}

/// Every check of the errors clause. They change what the store answers, so
/// run them one at a time (as [`run_fault_checks`] does), on a repository of
/// their own.
pub const FAULT_CHECKS: &[FaultCheck] = &[
    FaultCheck {
        name: "check_corrupt_record_is_reported_with_its_key",
        run: |repo, faults| Box::pin(check_corrupt_record_is_reported_with_its_key(repo, faults)),
    },
    FaultCheck {
        name: "check_unreachable_store_is_a_retryable_error",
        run: |repo, faults| Box::pin(check_unreachable_store_is_a_retryable_error(repo, faults)),
    },
];

/// The fault check named `name`, if any.
pub fn fault_check_named(name: &str) -> Option<&'static FaultCheck> {
    FAULT_CHECKS.iter().find(|c| c.name == name)
}

/// Runs every fault check in turn (the store is made reachable again after
/// each, also after a failure).
pub async fn run_fault_checks(repo: SharedRepository, faults: SharedFaults) -> Report {
    let mut outcomes = Vec::new();
    for check in FAULT_CHECKS {
        let result = (check.run)(repo.clone(), faults.clone()).await;
        let healed = faults
            .reach()
            .await
            .map_err(|e| failure(format!("reach: {e}")));
        outcomes.push(CheckOutcome {
            name: check.name,
            result: result.and(healed),
        });
    }
    Report::new(outcomes)
}

/// Awaits `f`, or fails the check when it takes longer than [`HANG_LIMIT`].
async fn bounded<T>(
    what: &str,
    f: impl std::future::Future<Output = T>,
) -> Result<T, crate::CheckFailure> {
    tokio::time::timeout(HANG_LIMIT, f)
        .await
        .map_err(|_| failure(format!("{what}: no answer within {HANG_LIMIT:?} (a hang)")))
}

fn names_key(e: &Error, key: &RecordKey) -> bool {
    matches!(e, Error::Corrupt { key: Some(k), .. } if k == key)
}

/// An undecodable record: `get` and `reserve` answer `Corrupt` naming the key
/// (a reserve that overwrote it could run a handler whose outcome the record
/// held); the manager refuses without running the handler, with a
/// non-retryable error; `delete` clears it and the key works again.
pub async fn check_corrupt_record_is_reported_with_its_key(
    repo: SharedRepository,
    faults: SharedFaults,
) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    let key = m.record_key("corrupt")?;
    faults
        .corrupt(&key)
        .await
        .map_err(|e| failure(format!("corrupt: {e}")))?;

    let got = bounded("get", cx.repo.get(&key, cx.now())).await?;
    ensure!(
        matches!(&got, Err(e) if names_key(e, &key)),
        "get of a corrupt record gave {got:?}, expected Corrupt naming {key}"
    );
    let reserved = bounded(
        "reserve",
        cx.repo.reserve(cx.req(&key, OwnerToken::random())),
    )
    .await?;
    ensure!(
        matches!(&reserved, Err(e) if names_key(e, &key)),
        "reserve over a corrupt record gave {reserved:?}, expected Corrupt naming {key}"
    );

    let runs = AtomicUsize::new(0);
    let out = m
        .execute("corrupt", &(), || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError<String>>(1)
        })
        .await;
    ensure!(
        runs.load(Ordering::SeqCst) == 0,
        "the handler ran over a corrupt record"
    );
    match &out {
        Err(ExecuteError::Idempotency(e)) if names_key(e, &key) && !e.is_retryable() => {}
        other => {
            return Err(failure(format!(
                "execute over a corrupt record gave {other:?}, expected a non-retryable Corrupt naming {key}"
            )))
        }
    }

    ensure!(
        bounded("delete", cx.repo.delete(&key)).await??,
        "delete found no corrupt record to remove"
    );
    let again = cx.repo.reserve(cx.req(&key, OwnerToken::random())).await?;
    ensure!(
        matches!(again, Reservation::Acquired { attempt: 1 }),
        "after deleting the corrupt record: {again:?}"
    );
    Ok(())
}

/// An unreachable store: every operation answers a retryable `Unavailable` or
/// `Timeout` (ambiguous: it may have been applied) within the backend's
/// timeout; the manager returns that error without running the handler; once
/// the store answers again, the same repository works without being rebuilt,
/// and the reserve left ambiguous during the outage is settled by its owner
/// re-sending it (`Acquired`, same attempt: reserve is idempotent per token).
pub async fn check_unreachable_store_is_a_retryable_error(
    repo: SharedRepository,
    faults: SharedFaults,
) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        store_timeout: Duration::from_secs(2),
        ..Config::default()
    })?;
    let held = cx.key("held");
    let held_owner = cx.acquire(&held).await?;
    let ambiguous = cx.key("ambiguous");
    let owner = OwnerToken::random();

    faults
        .unreach()
        .await
        .map_err(|e| failure(format!("unreach: {e}")))?;
    let now = cx.now();
    let outcomes: Vec<(&str, Result<(), Error>)> = vec![
        (
            "reserve",
            bounded("reserve", cx.repo.reserve(cx.req(&ambiguous, owner)))
                .await?
                .map(|_| ()),
        ),
        (
            "get",
            bounded("get", cx.repo.get(&held, now)).await?.map(|_| ()),
        ),
        (
            "extend",
            bounded(
                "extend",
                cx.repo.extend(
                    &held,
                    held_owner,
                    now + crate::support::LEASE,
                    now + crate::support::TTL,
                    now,
                ),
            )
            .await?,
        ),
    ];
    for (op, outcome) in outcomes {
        match outcome {
            Err(e @ (Error::Unavailable { .. } | Error::Timeout { .. })) if e.is_retryable() => {}
            other => {
                return Err(failure(format!(
                    "{op} with the store unreachable gave {other:?}, expected a retryable Unavailable or Timeout"
                )))
            }
        }
    }
    let runs = AtomicUsize::new(0);
    let out = bounded(
        "execute",
        m.execute("outage", &(), || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError<String>>(1)
        }),
    )
    .await?;
    ensure!(
        runs.load(Ordering::SeqCst) == 0,
        "the handler ran while the store was unreachable (fail-closed is the default)"
    );
    ensure!(
        matches!(&out, Err(ExecuteError::Idempotency(e)) if e.is_retryable()),
        "execute with the store unreachable gave {out:?}, expected a retryable error"
    );

    faults
        .reach()
        .await
        .map_err(|e| failure(format!("reach: {e}")))?;
    let resent = bounded("reserve after the outage", async {
        // The first calls after the outage may still meet a connection the
        // outage broke: a retryable error there is fine, a few times.
        let mut last = None;
        for _ in 0..10 {
            match cx.repo.reserve(cx.req(&ambiguous, owner)).await {
                Err(e) if e.is_retryable() => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
        Err(last.unwrap_or_else(|| Error::unavailable("check", "no attempt")))
    })
    .await??;
    ensure!(
        matches!(resent, Reservation::Acquired { attempt: 1 }),
        "the owner re-sending its ambiguous reserve after the outage got {resent:?}"
    );
    cx.repo
        .complete(
            &held,
            held_owner,
            None,
            cx.now() + crate::support::TTL,
            cx.now(),
        )
        .await?;
    let after = m
        .execute("after-outage", &(), || async {
            Ok::<_, HandlerError<String>>(2)
        })
        .await
        .map_err(|e| failure(format!("execute after the outage: {e}")))?;
    ensure!(after.handler_ran(), "after the outage: {after:?}");
    Ok(())
}
