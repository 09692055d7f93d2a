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
    Completion, Config, Error, ExecuteError, HandlerError, OwnerToken, RecordKey, Reservation,
    SharedRepository,
};

use crate::report::{CheckOutcome, Report};
use crate::support::{ensure, failure, Ctx, TTL};
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
/// held); no other write overwrites it either — `reserve_many` (its answer
/// for the key an error), `complete`, `fail`, `extend`, `release` and
/// `complete_many` of another owner are refused; the manager refuses without
/// running the handler, with a non-retryable error; `delete` clears it and
/// the key works again.
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
    writes_leave_it_corrupt(&cx, &key).await?;

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

/// The writes besides `reserve` over the corrupt record at `key`: none
/// succeeds, and the record is still there, still undecodable.
async fn writes_leave_it_corrupt(cx: &Ctx, key: &RecordKey) -> CheckResult {
    let fresh = cx.key("fresh-beside-corrupt");
    let batch = vec![
        cx.req(key, OwnerToken::random()),
        cx.req(&fresh, OwnerToken::random()),
    ];
    let answers = bounded("reserve_many", cx.repo.reserve_many(batch)).await?;
    ensure!(
        answers.len() == 2 && answers[0].is_err(),
        "reserve_many over a corrupt record answered {answers:?}, expected an error for {key}"
    );
    if let Some(Ok(other)) = answers.get(1) {
        ensure!(
            matches!(other, Reservation::Acquired { attempt: 1 }),
            "reserve_many of the fresh {fresh} beside a corrupt record: {other:?}"
        );
    }
    still_corrupt(cx, key, "reserve_many").await?;
    let (owner, now, later) = (OwnerToken::random(), cx.now(), cx.now() + TTL);
    for op in ["complete", "fail", "extend", "release", "complete_many"] {
        let done = match op {
            "complete" => bounded(op, cx.repo.complete(key, owner, Some(b"x"), later, now)).await?,
            "fail" => bounded(op, cx.repo.fail(key, owner, Some(b"x"), true, later, now)).await?,
            "extend" => bounded(op, cx.repo.extend(key, owner, later, later, now)).await?,
            "release" => bounded(op, cx.repo.release(key, owner, now)).await?,
            _ => {
                let write = Completion {
                    key,
                    owner,
                    result: Some(b"x"),
                    expires_at: later,
                };
                let answers = bounded(op, cx.repo.complete_many(vec![write], now)).await?;
                ensure!(answers.len() == 1, "{op}: {answers:?}");
                answers.into_iter().next().unwrap_or(Ok(()))
            }
        };
        ensure!(
            done.is_err(),
            "{op} by a stranger over a corrupt record succeeded"
        );
        still_corrupt(cx, key, op).await?;
    }
    Ok(())
}

/// `get` of `key` still answers `Corrupt` naming it (nothing overwrote it).
async fn still_corrupt(cx: &Ctx, key: &RecordKey, after: &str) -> CheckResult {
    let got = bounded("get", cx.repo.get(key, cx.now())).await?;
    ensure!(
        matches!(&got, Err(e) if names_key(e, key)),
        "after {after}, get of the corrupt record gave {got:?}: it was overwritten"
    );
    Ok(())
}

/// A retryable `Unavailable` or `Timeout`.
fn outage(outcome: &Result<(), Error>) -> bool {
    matches!(outcome, Err(e @ (Error::Unavailable { .. } | Error::Timeout { .. })) if e.is_retryable())
}

/// What one operation of [`the_rest_in_an_outage`] answered (each answer
/// of a batch), or the hang it was.
type Answered = Vec<(&'static str, Result<Result<(), Error>, crate::CheckFailure>)>;

async fn one(op: &'static str, f: BoxFuture<'_, Result<(), Error>>) -> Answered {
    vec![(op, bounded(op, f).await)]
}

async fn each(op: &'static str, f: BoxFuture<'_, Vec<Result<(), Error>>>) -> Answered {
    match bounded(op, f).await {
        Ok(answers) => answers.into_iter().map(|a| (op, Ok(a))).collect(),
        Err(hang) => vec![(op, Err(hang))],
    }
}

/// The other operations in an outage, concurrently, on keys of their own
/// (an operation the outage left ambiguous may have been applied): each
/// answer is a retryable `Unavailable` or `Timeout`, every answer of a batch
/// too — never a `LeaseLost` or an `Ok` standing for an error.
async fn the_rest_in_an_outage(cx: &Ctx) -> CheckResult {
    let keys: Vec<RecordKey> = (0..7).map(|i| cx.key(&format!("outage-{i}"))).collect();
    let (owner, now, later) = (OwnerToken::random(), cx.now(), cx.now() + TTL);
    let writes = keys[5..]
        .iter()
        .map(|key| Completion {
            key,
            owner,
            result: None,
            expires_at: later,
        })
        .collect();
    let reserves = keys[3..5]
        .iter()
        .map(|key| cx.req(key, OwnerToken::random()))
        .collect();
    let repo = &cx.repo;
    let all: Vec<BoxFuture<'_, Answered>> = vec![
        Box::pin(one(
            "complete",
            repo.complete(&keys[0], owner, None, later, now),
        )),
        Box::pin(one(
            "fail",
            repo.fail(&keys[1], owner, None, true, later, now),
        )),
        Box::pin(one("release", repo.release(&keys[2], owner, now))),
        Box::pin(one(
            "delete",
            Box::pin(async { repo.delete(&keys[2]).await.map(drop) }),
        )),
        Box::pin(each(
            "reserve_many",
            Box::pin(async {
                let answers = repo.reserve_many(reserves).await;
                answers.into_iter().map(|a| a.map(drop)).collect()
            }),
        )),
        Box::pin(each("complete_many", repo.complete_many(writes, now))),
    ];
    for (op, outcome) in futures::future::join_all(all).await.into_iter().flatten() {
        let outcome = outcome?;
        ensure!(
            outage(&outcome),
            "{op} with the store unreachable gave {outcome:?}, expected a retryable Unavailable or Timeout"
        );
    }
    Ok(())
}

/// An unreachable store: every operation answers a retryable `Unavailable` or
/// `Timeout` (ambiguous: it may have been applied) within the backend's
/// timeout — each answer of a batch too; the manager returns that error without running the handler; once
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
    the_rest_in_an_outage(&cx).await?;
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
