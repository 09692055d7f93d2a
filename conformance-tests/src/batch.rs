//! `reserve_many`: each request answered by `reserve`'s own rules, in order,
//! however many there are and whatever state each key is in; atomic per key
//! against concurrent single reservations. `complete_many`: each write
//! answered by `complete`'s own rules, in order, one refused write leaving
//! the others applied.

use std::time::Duration;

use futures::future::join_all;
use idempotency_core::decision::{reserve_transition, ReserveTransition};
use idempotency_core::{
    Completion, Error, OwnerToken, Record, RecordKey, Reservation, ReserveRequest,
    SharedRepository, Status,
};

use crate::support::{ensure, ensure_eq, failure, fp, Ctx, LEASE, TTL};
use crate::CheckResult;

/// A key in one state, with the request a batch sends for it.
struct Case {
    key: RecordKey,
    owner: OwnerToken,
    fingerprint: Option<idempotency_core::Fingerprint>,
    retry_failed: bool,
}

impl Case {
    fn new(key: RecordKey) -> Self {
        Case {
            key,
            owner: OwnerToken::random(),
            fingerprint: None,
            retry_failed: false,
        }
    }
}

/// Keys in every state `reserve` distinguishes — absent, live, our own
/// re-sent reservation, completed, failed (retry on and off), lease run out,
/// record expired, another payload's — interleaved with many fresh and
/// completed keys, reserved in one `reserve_many`: each answer is the one
/// `reserve`'s rules give for that key's record (checked with the core's
/// `reserve_transition`), in request order, and each acquired record is the
/// request's.
pub async fn check_reserve_many_follows_reserve(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let mut cases = Vec::new();
    // States that need time to pass first.
    let stale = cx.key("stale");
    cx.acquire(&stale).await?;
    let gone = cx.key("gone");
    let gone_owner = cx.acquire(&gone).await?;
    cx.repo
        .complete(&gone, gone_owner, None, cx.now() + LEASE, cx.now())
        .await?;
    cx.advance(LEASE + Duration::from_secs(1));
    cases.push(Case::new(stale));
    cases.push(Case::new(gone));
    // The rest at the current time.
    cases.push(Case::new(cx.key("fresh")));
    let busy = cx.key("busy");
    cx.acquire(&busy).await?;
    cases.push(Case::new(busy));
    let mine = cx.key("mine");
    let mine_owner = cx.acquire(&mine).await?;
    cases.push(Case {
        owner: mine_owner,
        fingerprint: fp(3),
        ..Case::new(mine)
    });
    cases.push(Case::new(cx.completed("done", Some(b"ok")).await?.0));
    cases.push(Case::new(cx.failed("failed", Some(b"no")).await?.0));
    cases.push(Case {
        retry_failed: true,
        ..Case::new(cx.failed("retry", Some(b"no")).await?.0)
    });
    let other_fp = cx.key("other-fp");
    let owner = OwnerToken::random();
    cx.repo
        .reserve(ReserveRequest {
            fingerprint: fp(1),
            ..cx.req(&other_fp, owner)
        })
        .await?;
    cx.repo
        .complete(&other_fp, owner, Some(b"r"), cx.now() + TTL, cx.now())
        .await?;
    cases.push(Case {
        fingerprint: fp(2),
        ..Case::new(other_fp)
    });
    for i in 0..60 {
        let case = if i % 2 == 0 {
            Case::new(cx.key(&format!("bulk-fresh-{i}")))
        } else {
            let result = format!("result-{i}");
            Case::new(
                cx.completed(&format!("bulk-done-{i}"), Some(result.as_bytes()))
                    .await?
                    .0,
            )
        };
        // Spread the special states through the batch.
        cases.insert((i * 7) % (cases.len() + 1), case);
    }
    let requests: Vec<ReserveRequest<'_>> = cases
        .iter()
        .map(|c| ReserveRequest {
            fingerprint: c.fingerprint,
            retry_failed: c.retry_failed,
            ..cx.req(&c.key, c.owner)
        })
        .collect();
    let mut expected = Vec::with_capacity(cases.len());
    for req in &requests {
        let before = cx.repo.get(req.key, req.now).await?;
        expected.push((reserve_transition(before.as_ref(), req), before));
    }
    let answers = cx.repo.reserve_many(requests.clone()).await;
    ensure_eq!(answers.len(), requests.len(), "one answer per request");
    for ((req, answer), (transition, before)) in requests.iter().zip(answers).zip(expected) {
        check_answer(&cx, req, answer?, transition, before).await?;
    }
    Ok(())
}

/// One answer against the rule's transition and the record after.
async fn check_answer(
    cx: &Ctx,
    req: &ReserveRequest<'_>,
    answer: Reservation,
    transition: ReserveTransition,
    before: Option<Record>,
) -> CheckResult {
    let key = req.key;
    let attempt = match (transition, answer) {
        (ReserveTransition::Existing, Reservation::Existing(record)) => {
            ensure_eq!(
                Some(&record),
                before.as_ref(),
                "{key}: the record, unchanged"
            );
            ensure_eq!(cx.record(key).await?, record, "{key}: nothing written");
            return Ok(());
        }
        (ReserveTransition::AlreadyHeld { attempt }, Reservation::Acquired { attempt: got }) => {
            ensure_eq!(got, attempt, "{key}: our own reservation, re-sent");
            ensure_eq!(
                Some(cx.record(key).await?),
                before,
                "{key}: a re-send writes nothing"
            );
            return Ok(());
        }
        (ReserveTransition::Create, Reservation::Acquired { attempt }) => {
            ensure_eq!(attempt, 1, "{key}: a new record");
            attempt
        }
        (ReserveTransition::Takeover { attempt }, Reservation::Acquired { attempt: got }) => {
            ensure_eq!(got, attempt, "{key}: a takeover's attempt");
            attempt
        }
        (transition, answer) => {
            return Err(failure(format!(
                "{key}: reserve's rule says {transition:?}, reserve_many answered {answer:?}"
            )))
        }
    };
    let r = cx.record(key).await?;
    ensure!(
        r.status == Status::Processing && r.owner == req.owner && r.attempt == attempt,
        "{key}: the acquired record is the request's: {r:?}"
    );
    ensure_eq!(r.lease_until, req.lease_until, "{key}: the request's lease");
    ensure_eq!(r.expires_at, req.expires_at, "{key}: the request's expiry");
    Ok(())
}

/// A `reserve_many` and single `reserve`s of other owners race on the same
/// fresh keys: each key has exactly one winner, and its record is the
/// winner's (per-key atomicity; no lock or script spans two keys wrongly).
pub async fn check_reserve_many_races_single_reserves(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let keys: Vec<RecordKey> = (0..40).map(|i| cx.key(&format!("race-{i}"))).collect();
    let batch_owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let single_owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let requests = keys
        .iter()
        .zip(&batch_owners)
        .map(|(k, o)| cx.req(k, *o))
        .collect();
    // The singles go in reverse order, so that the two sides meet half way.
    let singles = keys
        .iter()
        .zip(&single_owners)
        .rev()
        .map(|(k, o)| cx.repo.reserve(cx.req(k, *o)));
    let (batch, singles) = futures::join!(cx.repo.reserve_many(requests), join_all(singles));
    ensure_eq!(batch.len(), keys.len(), "one answer per request");
    let singles: Vec<_> = singles.into_iter().rev().collect();
    for (i, (b, s)) in batch.into_iter().zip(singles).enumerate() {
        let key = &keys[i];
        let won = |r: &Reservation| matches!(r, Reservation::Acquired { attempt: 1 });
        let (b, s) = (b?, s?);
        let winner = match (won(&b), won(&s)) {
            (true, false) => batch_owners[i],
            (false, true) => single_owners[i],
            (b_won, s_won) => {
                return Err(failure(format!(
                    "{key}: batch acquired {b_won}, single acquired {s_won}: exactly one must \
                     ({b:?} / {s:?})"
                )))
            }
        };
        ensure_eq!(
            cx.record(key).await?.owner,
            winner,
            "{key}: the winner's record"
        );
    }
    Ok(())
}

/// A write of a `complete_many` with what `complete` must answer for it.
struct Write {
    key: RecordKey,
    owner: OwnerToken,
    result: Option<Vec<u8>>,
    too_large: bool,
}

impl Write {
    fn new(key: RecordKey, owner: OwnerToken, result: Option<&[u8]>) -> Self {
        Write {
            key,
            owner,
            result: result.map(<[u8]>::to_vec),
            too_large: false,
        }
    }
}

/// Writes for records in every state `complete` distinguishes — our live
/// record (with a result, an empty one, none), our record whose lease ran out
/// untaken, one taken over by another owner, another owner's, an absent key,
/// an expired record, a completed and a failed one, a result over the
/// declared limit — interleaved with many fresh records of their own results,
/// in one `complete_many`: each answer is `complete`'s for that write, in
/// order (`Ok` exactly for the owner's processing record), an applied write
/// stores its own result and expiry, a refused one changes nothing.
pub async fn check_complete_many_follows_complete(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let mut writes = Vec::new();
    // States that need time to pass first.
    let late = cx.key("late");
    writes.push(Write::new(
        late.clone(),
        cx.acquire(&late).await?,
        Some(b"late"),
    ));
    let taken = cx.key("taken");
    writes.push(Write::new(
        taken.clone(),
        cx.acquire(&taken).await?,
        Some(b"lost"),
    ));
    let expired = cx.key("expired");
    let expired_owner = OwnerToken::random();
    cx.repo
        .reserve(ReserveRequest {
            expires_at: cx.now() + LEASE * 2,
            ..cx.req(&expired, expired_owner)
        })
        .await?;
    writes.push(Write::new(expired, expired_owner, None));
    cx.advance(LEASE * 3);
    cx.acquire_over(&taken).await?;
    // The rest at the current time.
    for (id, result) in [("mine", &b"mine"[..]), ("mine-empty", &b""[..])] {
        let key = cx.key(id);
        writes.push(Write::new(
            key.clone(),
            cx.acquire(&key).await?,
            Some(result),
        ));
    }
    let bare = cx.key("mine-none");
    writes.push(Write::new(bare.clone(), cx.acquire(&bare).await?, None));
    let other = cx.key("other");
    cx.acquire(&other).await?;
    writes.push(Write::new(other, OwnerToken::random(), Some(b"not mine")));
    writes.push(Write::new(cx.key("absent"), OwnerToken::random(), None));
    let (done, owner) = cx.completed("done", Some(b"first")).await?;
    writes.push(Write::new(done, owner, Some(b"second")));
    let (failed, owner) = cx.failed("failed", Some(b"e")).await?;
    writes.push(Write::new(failed, owner, None));
    if let Some(max) = cx.caps.max_result_bytes {
        let big = cx.key("too-big");
        writes.push(Write {
            too_large: true,
            ..Write::new(
                big.clone(),
                cx.acquire(&big).await?,
                Some(&vec![7; max + 1]),
            )
        });
    }
    for i in 0..60 {
        let key = cx.key(&format!("bulk-{i}"));
        let result = format!("result-{i}");
        let write = Write::new(
            key.clone(),
            cx.acquire(&key).await?,
            Some(result.as_bytes()),
        );
        // Spread the special states through the batch.
        writes.insert((i * 7) % (writes.len() + 1), write);
    }
    let expires_at = cx.now() + TTL;
    let now = cx.now();
    let mut before = Vec::with_capacity(writes.len());
    for w in &writes {
        before.push(cx.repo.get(&w.key, now).await?);
    }
    let batch = writes
        .iter()
        .map(|w| Completion {
            key: &w.key,
            owner: w.owner,
            result: w.result.as_deref(),
            expires_at,
        })
        .collect();
    let answers = cx.repo.complete_many(batch, now).await;
    ensure_eq!(answers.len(), writes.len(), "one answer per write");
    for ((w, answer), before) in writes.iter().zip(answers).zip(before) {
        check_write(&cx, w, answer, before, expires_at).await?;
    }
    Ok(())
}

/// One `complete_many` answer against `complete`'s rule and the record after.
async fn check_write(
    cx: &Ctx,
    w: &Write,
    answer: Result<(), Error>,
    before: Option<Record>,
    expires_at: idempotency_core::Timestamp,
) -> CheckResult {
    let key = &w.key;
    let processing = before
        .as_ref()
        .filter(|r| r.status == Status::Processing && r.owner == w.owner);
    let owned = processing.is_some();
    let after = cx.repo.get(key, cx.now()).await?;
    match answer {
        Ok(()) if owned && !w.too_large => {
            let r = after.ok_or_else(|| failure(format!("{key}: completed, then absent")))?;
            let attempt = processing.map(|was| was.attempt);
            ensure!(
                r.status == Status::Completed && r.owner == w.owner && Some(r.attempt) == attempt,
                "{key}: the owner's record, completed: {r:?}"
            );
            ensure_eq!(r.result, w.result, "{key}: the write's own result");
            ensure_eq!(r.expires_at, expires_at, "{key}: the write's expiry");
        }
        Err(Error::TooLarge { .. }) if w.too_large => {
            ensure_eq!(after, before, "{key}: a refused result writes nothing");
        }
        Err(Error::LeaseLost { .. }) if !owned && !w.too_large => {
            ensure_eq!(after, before, "{key}: a refused write changes nothing");
        }
        answer => {
            return Err(failure(format!(
                "{key}: complete's rule says {}, complete_many answered {answer:?}",
                if w.too_large {
                    "TooLarge"
                } else if owned {
                    "Ok"
                } else {
                    "LeaseLost"
                }
            )))
        }
    }
    Ok(())
}
