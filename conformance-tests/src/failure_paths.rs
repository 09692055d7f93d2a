//! Checks of the contract points that matter when things go wrong: a `reserve`
//! re-sent after its reply was lost, lease extension moving expiry, failures
//! remembering whether they may be retried, takeovers keeping the fingerprint,
//! and every fenced operation racing a takeover.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Error, OwnerToken, RecordKey, Reservation, ReserveRequest, SharedRepository, Status,
};
use tokio::sync::Barrier;

use crate::support::{ensure, ensure_eq, existing, failure, fp, Ctx, LEASE, TTL};
use crate::{CheckFailure, CheckResult};

/// A `reserve` re-sent by the owner that holds the live `Processing` record
/// (its first reply was lost) answers `Acquired` with the stored attempt and
/// changes nothing, whatever fingerprint it carries; once another owner has
/// taken over, or the record is finished, the re-send sees the record.
pub async fn check_reserve_resent_by_holder(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("resent");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        fingerprint: fp(1),
        ..cx.req(&key, owner)
    };
    ensure_eq!(
        cx.repo.reserve(req.clone()).await?,
        Reservation::Acquired { attempt: 1 }
    );
    let before = cx.record(&key).await?;
    ensure_eq!(
        cx.repo.reserve(req.clone()).await?,
        Reservation::Acquired { attempt: 1 },
        "the same request again"
    );
    let other_fp = ReserveRequest {
        fingerprint: fp(2),
        ..req.clone()
    };
    ensure_eq!(
        cx.repo.reserve(other_fp).await?,
        Reservation::Acquired { attempt: 1 },
        "the holder's re-send is recognised before fingerprints are compared"
    );
    ensure_eq!(cx.record(&key).await?, before, "a re-send writes nothing");

    // Once the lease ended, nobody having taken over, the holder's re-send
    // is still a re-send: no takeover of its own record, no new lease.
    cx.advance(LEASE);
    let late = ReserveRequest {
        fingerprint: fp(1),
        ..cx.req(&key, owner)
    };
    ensure_eq!(
        cx.repo.reserve(late).await?,
        Reservation::Acquired { attempt: 1 },
        "the holder's re-send after its lease ended"
    );
    ensure_eq!(cx.record(&key).await?, before, "and writes nothing");

    // After a takeover the old owner's re-send is somebody else's record.
    let new = OwnerToken::random();
    ensure_eq!(
        cx.reserve(&key, new).await?,
        Reservation::Acquired { attempt: 2 }
    );
    let r = existing(cx.reserve(&key, owner).await?, "re-send after a takeover")?;
    ensure_eq!((r.owner, r.attempt), (new, 2));
    ensure_eq!(
        cx.reserve(&key, new).await?,
        Reservation::Acquired { attempt: 2 },
        "the new holder's re-send answers its own attempt"
    );

    // A finished record is never re-acquired by the owner that finished it.
    let (done, finisher) = cx.completed("resent-done", Some(b"r")).await?;
    let r = existing(cx.reserve(&done, finisher).await?, "re-send after complete")?;
    ensure_eq!(r.status, Status::Completed);
    Ok(())
}

/// `extend` moves expiry with the lease, in the same step: the record outlives
/// its first expiry, and neither the lease nor the expiry is ever moved
/// earlier (an older extension applied after a newer one, as a statement
/// abandoned by its caller's timeout can be, must not undo it); each is
/// raised on its own (a later expiry with an earlier lease moves the expiry).
pub async fn check_extend_moves_expiry(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("extend-expiry");
    let owner = OwnerToken::random();
    let first_expiry = cx.now() + LEASE + Duration::from_secs(5);
    let req = ReserveRequest {
        expires_at: first_expiry,
        ..cx.req(&key, owner)
    };
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 1 }
    );
    cx.advance(LEASE / 2);
    let lease = cx.now() + LEASE;
    let expiry = lease + Duration::from_secs(5);
    cx.repo.extend(&key, owner, lease, expiry, cx.now()).await?;
    let r = cx.record(&key).await?;
    ensure_eq!((r.lease_until, r.expires_at), (lease, expiry));
    // The same extension again at the same instant (a re-sent request whose
    // first reply was lost) changes nothing, and still answers ok.
    cx.repo.extend(&key, owner, lease, expiry, cx.now()).await?;
    ensure_eq!(cx.record(&key).await?, r, "a re-sent extension");

    // Past the first expiry the record is alive and still held.
    cx.advance(LEASE / 2 + Duration::from_secs(6));
    ensure!(
        cx.now() > first_expiry,
        "the clock is past the first expiry"
    );
    let r = existing(
        cx.reserve(&key, OwnerToken::random()).await?,
        "past the first expiry, inside the extended lease",
    )?;
    ensure_eq!((r.owner, r.status), (owner, Status::Processing));

    // An extension asking for an earlier lease and expiry (an older one
    // applied late) moves neither, and succeeds: the lease is held at least
    // that long.
    let shorter = cx.now() + Duration::from_secs(1);
    cx.repo
        .extend(&key, owner, shorter, shorter, cx.now())
        .await?;
    let r = cx.record(&key).await?;
    ensure_eq!(r.lease_until, lease, "the lease is never moved earlier");
    ensure_eq!(r.expires_at, expiry, "expiry is never moved earlier");
    // A later one still moves the lease alone while the expiry covers it.
    let later_lease = lease + Duration::from_secs(1);
    cx.repo
        .extend(&key, owner, later_lease, expiry, cx.now())
        .await?;
    let r = cx.record(&key).await?;
    ensure_eq!((r.lease_until, r.expires_at), (later_lease, expiry));
    // And a later expiry alone, with a lease that is not later: the expiry
    // moves, the lease does not.
    let later_expiry = expiry + Duration::from_secs(10);
    cx.repo
        .extend(&key, owner, lease, later_expiry, cx.now())
        .await?;
    let r = cx.record(&key).await?;
    ensure_eq!(
        (r.lease_until, r.expires_at),
        (later_lease, later_expiry),
        "each of the two is raised on its own"
    );
    cx.repo
        .complete(&key, owner, Some(b"done"), cx.now() + TTL, cx.now())
        .await?;
    ensure_eq!(cx.status(&key).await?, Some(Status::Completed));
    Ok(())
}

/// `fail` stores whether the failure is retryable; `retry_failed` takes over
/// only retryable failures, and the takeover resets the flag.
pub async fn check_fail_remembers_retryable(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    for retryable in [false, true] {
        let key = cx.key(&format!("retryable-{retryable}"));
        let owner = cx.acquire(&key).await?;
        cx.repo
            .fail(&key, owner, Some(b"e"), retryable, cx.now() + TTL, cx.now())
            .await?;
        let r = cx.record(&key).await?;
        ensure_eq!((r.status, r.retryable), (Status::Failed, retryable));
        let retry = ReserveRequest {
            retry_failed: true,
            ..cx.req(&key, OwnerToken::random())
        };
        let answer = cx.repo.reserve(retry).await?;
        if retryable {
            ensure_eq!(answer, Reservation::Acquired { attempt: 2 });
            let r = cx.record(&key).await?;
            ensure_eq!((r.status, r.retryable), (Status::Processing, false));
            ensure_eq!(r.error, None, "the takeover clears the error");
        } else {
            let r = existing(answer, "retry of a permanent failure")?;
            ensure_eq!(
                (r.status, r.retryable, r.owner),
                (Status::Failed, false, owner)
            );
        }
    }
    Ok(())
}

/// Both takeover paths (a stale `Processing` record, a retryable `Failed`
/// one) keep the stored fingerprint when the request carries none, keep
/// `created_at`, and write every other field anew.
pub async fn check_takeover_paths_write_every_field(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    for path in ["stale", "failed"] {
        let key = cx.key(&format!("takeover-{path}"));
        let old = OwnerToken::random();
        let first = ReserveRequest {
            fingerprint: fp(9),
            ..cx.req(&key, old)
        };
        cx.repo.reserve(first).await?;
        let created = cx.record(&key).await?.created_at;
        cx.advance(Duration::from_secs(1));
        if path == "failed" {
            cx.repo
                .fail(&key, old, Some(b"boom"), true, cx.now() + TTL, cx.now())
                .await?;
        } else {
            cx.advance(LEASE);
        }
        let new = OwnerToken::random();
        let req = ReserveRequest {
            retry_failed: true,
            lease_until: cx.now() + LEASE * 2,
            expires_at: cx.now() + TTL * 2,
            ..cx.req(&key, new)
        };
        let (lease, expires, now) = (req.lease_until, req.expires_at, req.now);
        ensure_eq!(
            cx.repo.reserve(req).await?,
            Reservation::Acquired { attempt: 2 },
            "{path}"
        );
        let r = cx.record(&key).await?;
        ensure_eq!(
            (r.status, r.owner, r.attempt),
            (Status::Processing, new, 2),
            "{path}"
        );
        ensure_eq!((r.lease_until, r.expires_at), (lease, expires), "{path}");
        ensure_eq!(
            r.fingerprint,
            fp(9),
            "{path}: the stored fingerprint is kept"
        );
        ensure!(
            r.result.is_none() && r.error.is_none(),
            "{path}: result and error are cleared: {r:?}"
        );
        ensure!(!r.retryable, "{path}: retryable is reset: {r:?}");
        ensure_eq!(r.created_at, created, "{path}");
        ensure_eq!(r.updated_at, now, "{path}");
    }
    Ok(())
}

/// The fenced operations of an owner whose lease just ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fenced {
    Complete,
    Fail,
    Release,
    Extend,
}

/// Rounds per operation in [`check_fenced_operations_race_takeover`].
const FENCED_RACE_ROUNDS: usize = 24;

/// `complete`, `fail`, `release` and `extend` by the old owner at its lease
/// end race a takeover: either the operation came strictly first (and the
/// taker sees its effect) or it is refused and the new owner's record is
/// intact. A store that checks the owner, then writes in a second step, fails
/// this.
pub async fn check_fenced_operations_race_takeover(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    for op in [
        Fenced::Complete,
        Fenced::Fail,
        Fenced::Release,
        Fenced::Extend,
    ] {
        for round in 0..FENCED_RACE_ROUNDS {
            race_round(&cx, op, round)
                .await
                .map_err(|f| failure(format!("{op:?}, round {round}: {}", f.message)))?;
        }
    }
    Ok(())
}

/// How the two racers of a round are started. Spawned tasks behind a barrier
/// race on separate threads; joined in one task (polled in order, after `lead`
/// and `lag` scheduler yields) they interleave at every await point of a
/// store's operation: a check-then-write store is caught deterministically
/// there, whatever the width of its gap, and by the spawned rounds on real
/// servers too.
#[derive(Debug, Clone, Copy)]
enum Start {
    Spawned,
    Joined { lead: u8, lag: u8 },
}

const STARTS: [Start; 4] = [
    Start::Joined { lead: 0, lag: 0 },
    Start::Spawned,
    Start::Joined { lead: 0, lag: 1 },
    Start::Joined { lead: 1, lag: 0 },
];

async fn yields(n: u8) {
    for _ in 0..n {
        tokio::task::yield_now().await;
    }
}

async fn fenced_op(cx: &Ctx, key: &RecordKey, old: OwnerToken, op: Fenced) -> Result<(), Error> {
    let (now, later) = (cx.now(), cx.now() + TTL);
    match op {
        Fenced::Complete => cx.repo.complete(key, old, Some(b"old"), later, now).await,
        Fenced::Fail => cx.repo.fail(key, old, None, true, later, now).await,
        Fenced::Release => cx.repo.release(key, old, now).await,
        Fenced::Extend => cx.repo.extend(key, old, later, later, now).await,
    }
}

async fn race_round(cx: &Arc<Ctx>, op: Fenced, round: usize) -> CheckResult {
    let key = cx.key(&format!("fenced-{op:?}-{round}"));
    let old = cx.acquire(&key).await?;
    cx.advance(LEASE);
    let new = OwnerToken::random();
    let (fenced, taken) = match STARTS[round % STARTS.len()] {
        Start::Joined { lead, lag } => {
            futures::future::join(
                async {
                    yields(lead).await;
                    fenced_op(cx, &key, old, op).await
                },
                async {
                    yields(lag).await;
                    cx.repo.reserve(cx.req(&key, new)).await
                },
            )
            .await
        }
        Start::Spawned => spawned_race(cx, &key, old, new, op).await?,
    };
    let taken = taken?;
    judge_race(cx, &key, op, old, new, fenced, taken).await
}

async fn spawned_race(
    cx: &Arc<Ctx>,
    key: &RecordKey,
    old: OwnerToken,
    new: OwnerToken,
    op: Fenced,
) -> Result<(Result<(), Error>, Result<Reservation, Error>), CheckFailure> {
    let start = Arc::new(Barrier::new(2));
    let fenced = {
        let (cx, key, start) = (cx.clone(), key.clone(), start.clone());
        tokio::spawn(async move {
            start.wait().await;
            fenced_op(&cx, &key, old, op).await
        })
    };
    let taker = {
        let (cx, key) = (cx.clone(), key.clone());
        tokio::spawn(async move {
            start.wait().await;
            cx.repo.reserve(cx.req(&key, new)).await
        })
    };
    let fenced = fenced.await.map_err(|e| failure(e.to_string()))?;
    let taken = taker.await.map_err(|e| failure(e.to_string()))?;
    Ok((fenced, taken))
}

/// Only two histories are allowed: the fenced operation strictly first (the
/// taker sees its effect), or refused (the new owner's record intact).
async fn judge_race(
    cx: &Ctx,
    key: &RecordKey,
    op: Fenced,
    old: OwnerToken,
    new: OwnerToken,
    fenced: Result<(), Error>,
    taken: Reservation,
) -> CheckResult {
    let after = cx.record(key).await?;
    match (&fenced, &taken) {
        (Err(Error::LeaseLost { .. }), Reservation::Acquired { attempt: 2 }) => {
            ensure_eq!(
                (after.status, after.owner, after.attempt),
                (Status::Processing, new, 2),
                "the new owner's record is intact"
            );
        }
        (Ok(()), Reservation::Existing(seen)) => {
            let status = match op {
                Fenced::Complete => Status::Completed,
                // Failed without retry_failed, or still held after extension.
                Fenced::Fail => Status::Failed,
                Fenced::Extend => Status::Processing,
                Fenced::Release => {
                    return Err(failure("a released key must be re-created, not seen"))
                }
            };
            ensure_eq!((seen.status, seen.owner), (status, old), "the taker saw it");
            ensure_eq!((after.status, after.owner), (status, old));
        }
        (Ok(()), Reservation::Acquired { attempt: 1 }) if op == Fenced::Release => {
            ensure_eq!((after.owner, after.attempt), (new, 1), "re-created");
        }
        other => return Err(failure(format!("outcome the contract forbids: {other:?}"))),
    }
    Ok(())
}
