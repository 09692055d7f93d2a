//! `reserve_many`: each request answered by `reserve`'s own rules, in order,
//! however many there are and whatever state each key is in; atomic per key
//! against concurrent single reservations. `complete_many`: each write
//! answered by `complete`'s own rules, in order, one refused write leaving
//! the others applied.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    Completion, Error, OwnerToken, Record, RecordKey, Reservation, ReserveRequest,
    SharedRepository, Status, Timestamp,
};

use tokio::sync::Barrier;

use crate::support::{ensure, ensure_eq, failure, fp, Ctx, LEASE, TTL};
use crate::CheckResult;

/// A key in one state, with the request a batch sends for it.
struct Case {
    key: RecordKey,
    owner: OwnerToken,
    fingerprint: Option<idempotency_core::Fingerprint>,
    retry_failed: bool,
    /// The request's own instant, when not the batch's.
    now: Option<Timestamp>,
    clock_skew: Duration,
}

impl Case {
    fn new(key: RecordKey) -> Self {
        Case {
            key,
            owner: OwnerToken::random(),
            fingerprint: None,
            retry_failed: false,
            now: None,
            clock_skew: Duration::ZERO,
        }
    }
}

/// Reserves `key` for a new owner at `now` with this lease and expiry.
async fn reserve_at(
    cx: &Ctx,
    key: &RecordKey,
    now: Timestamp,
    lease_until: Timestamp,
    expires_at: Timestamp,
) -> CheckResult {
    let req = ReserveRequest {
        now,
        lease_until,
        expires_at,
        ..cx.req(key, OwnerToken::random())
    };
    match cx.repo.reserve(req).await? {
        Reservation::Acquired { attempt: 1 } => Ok(()),
        other => Err(failure(format!("reserving {key} gave {other:?}"))),
    }
}

/// Keys in every state `reserve` distinguishes — absent, live, our own
/// re-sent reservation, completed, failed (retry on and off; retryable and
/// not), lease run out (for the same payload and for another), record
/// expired, another payload's — and on every boundary of the rule (a
/// lease ending exactly at the request's instant or 1 ms after it, with and
/// without a skew allowance; an expiry exactly at it or 1 ms after it; a
/// request whose own instant is later than the batch's first), interleaved
/// with many fresh and completed keys (more than a hundred in all), reserved
/// in one `reserve_many`, each request with its own lease and expiry: each
/// answer is the one `reserve`'s rules give for that key's record at that
/// request's instant (checked with the core's `reserve_transition`), in
/// request order, and each acquired record is exactly the one `reserve`
/// would store for the request. An empty batch has no answers.
pub async fn check_reserve_many_follows_reserve(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let none = cx.repo.reserve_many(Vec::new()).await;
    ensure!(none.is_empty(), "an empty batch has no answers: {none:?}");
    let mut cases = Vec::new();
    // States that need time to pass first.
    let stale = cx.key("stale");
    cx.repo
        .reserve(ReserveRequest {
            fingerprint: fp(6),
            ..cx.req(&stale, OwnerToken::random())
        })
        .await?;
    let stale_other_fp = cx.key("stale-other-fp");
    cx.repo
        .reserve(ReserveRequest {
            fingerprint: fp(7),
            ..cx.req(&stale_other_fp, OwnerToken::random())
        })
        .await?;
    let gone = cx.key("gone");
    let gone_owner = cx.acquire(&gone).await?;
    cx.repo
        .complete(&gone, gone_owner, None, cx.now() + LEASE, cx.now())
        .await?;
    cx.advance(LEASE + Duration::from_secs(1));
    cases.push(Case::new(stale));
    // Open to takeover, but not by another payload.
    cases.push(Case {
        fingerprint: fp(8),
        ..Case::new(stale_other_fp)
    });
    cases.push(Case::new(gone));
    // The rest at the current time, `t`.
    let t = cx.now();
    let ms = Duration::from_millis(1);
    let secs = Duration::from_secs;
    cases.push(Case {
        fingerprint: fp(5),
        ..Case::new(cx.key("fresh"))
    });
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
    // A failure that is not retryable is not taken over, retry or not.
    let permanent = cx.key("permanent");
    let owner = cx.acquire(&permanent).await?;
    cx.repo
        .fail(
            &permanent,
            owner,
            Some(b"no"),
            false,
            cx.now() + TTL,
            cx.now(),
        )
        .await?;
    cases.push(Case {
        retry_failed: true,
        ..Case::new(permanent)
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
    // The boundaries, records written in the past of `t`.
    let before = t - secs(10);
    for (id, lease_until, expires_at, skew) in [
        // A lease ending exactly at t is taken over; 1 ms later it is not.
        ("lease-edge", t, t + TTL, 0),
        ("lease-live", t + ms, t + TTL, 0),
        // With a 5.5 s allowance (milliseconds: an allowance cut to whole
        // seconds would take over early): a lease that ended 5 s ago is
        // still held, one that ended 5.5 s ago is not.
        ("skew-live", t - secs(5), t + TTL, 5_500),
        (
            "skew-edge",
            t - Duration::from_millis(5_500),
            t + TTL,
            5_500,
        ),
        // A record expiring exactly at t is gone; 1 ms later it is there
        // (its lease ended: taken over).
        ("expiry-edge", t - secs(1), t, 0),
        ("expiry-live", t - secs(1), t + ms, 0),
    ] {
        let key = cx.key(id);
        reserve_at(&cx, &key, before, lease_until, expires_at).await?;
        cases.push(Case {
            clock_skew: Duration::from_millis(skew),
            ..Case::new(key)
        });
    }
    // A request whose own instant is the end of the lease it finds.
    let late = cx.key("late");
    cx.acquire(&late).await?;
    cases.push(Case {
        now: Some(t + LEASE),
        ..Case::new(late)
    });
    for i in 0..120 {
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
    // The batch's first request is at the batch's instant.
    cases.insert(0, Case::new(cx.key("first")));
    let requests: Vec<ReserveRequest<'_>> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let now = c.now.unwrap_or(t);
            // Each request its own lease and expiry.
            let own = Duration::from_millis(u64::try_from(i).unwrap_or(0));
            ReserveRequest {
                fingerprint: c.fingerprint,
                retry_failed: c.retry_failed,
                now,
                lease_until: now + LEASE + own,
                expires_at: now + TTL + own,
                clock_skew: c.clock_skew,
                ..cx.req(&c.key, c.owner)
            }
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
    // What `reserve` stores: the request's owner, lease, expiry and
    // fingerprint (else the stored one, on a takeover), `created_at` kept by
    // a takeover, nothing of a result, an error or a retryable failure.
    let want = reserved_record(before.as_ref(), req, attempt);
    ensure_eq!(r, want, "{key}: the acquired record is the request's");
    Ok(())
}

/// How the two sides of a [`check_reserve_many_races_single_reserves`]
/// round meet.
#[derive(Debug, Clone, Copy)]
enum ManyRace {
    /// Joined in one task, the batch polled first.
    BatchFirst,
    /// Joined in one task, the single reservations polled first.
    SinglesFirst,
    /// Spawned on separate threads behind a barrier.
    Spawned,
    /// Two batches of the same keys, in opposite orders, joined.
    TwoBatches,
}

/// A `reserve_many` and single `reserve`s of other owners race on the same
/// fresh keys: each key has exactly one winner, and its record is the
/// winner's (per-key atomicity; no lock or script spans two keys wrongly).
/// Four rounds: joined in one task with the batch polled first, then the
/// singles first (the racers interleave at every await point, so a batch
/// that reads every key and then writes loses to a store whose `reserve`
/// is itself a read then a compare-and-swap in one of them), spawned on
/// separate threads behind a barrier, and two batches of the same keys in
/// opposite orders.
pub async fn check_reserve_many_races_single_reserves(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    for race in [
        ManyRace::BatchFirst,
        ManyRace::SinglesFirst,
        ManyRace::Spawned,
        ManyRace::TwoBatches,
    ] {
        many_race_round(&cx, race).await?;
    }
    Ok(())
}

async fn many_race_round(cx: &Arc<Ctx>, race: ManyRace) -> CheckResult {
    let keys: Vec<RecordKey> = (0..40)
        .map(|i| cx.key(&format!("race-{race:?}-{i}")))
        .collect();
    let batch_owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let single_owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let (batch, singles) = match race {
        ManyRace::BatchFirst => futures::join!(
            batch_of(cx, &keys, &batch_owners),
            singles_of(cx, &keys, &single_owners)
        ),
        ManyRace::SinglesFirst => {
            let (s, b) = futures::join!(
                singles_of(cx, &keys, &single_owners),
                batch_of(cx, &keys, &batch_owners)
            );
            (b, s)
        }
        ManyRace::TwoBatches => {
            let (rev_keys, rev_owners): (Vec<RecordKey>, Vec<OwnerToken>) = keys
                .iter()
                .cloned()
                .zip(single_owners.iter().copied())
                .rev()
                .unzip();
            let (b, mut s) = futures::join!(
                batch_of(cx, &keys, &batch_owners),
                batch_of(cx, &rev_keys, &rev_owners)
            );
            s.reverse();
            (b, s)
        }
        ManyRace::Spawned => {
            let start = Arc::new(Barrier::new(2));
            let batch = {
                let (cx, keys, owners, start) = (
                    cx.clone(),
                    keys.clone(),
                    batch_owners.clone(),
                    start.clone(),
                );
                tokio::spawn(async move {
                    start.wait().await;
                    batch_of(&cx, &keys, &owners).await
                })
            };
            let singles = {
                let (cx, keys, owners) = (cx.clone(), keys.clone(), single_owners.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    singles_of(&cx, &keys, &owners).await
                })
            };
            let b = batch.await.map_err(|e| failure(e.to_string()))?;
            let s = singles.await.map_err(|e| failure(e.to_string()))?;
            (b, s)
        }
    };
    ensure_eq!(batch.len(), keys.len(), "{race:?}: one answer per request");
    for (i, (b, s)) in batch.into_iter().zip(singles).enumerate() {
        let key = &keys[i];
        let won = |r: &Reservation| matches!(r, Reservation::Acquired { attempt: 1 });
        let (b, s) = (b?, s?);
        let winner = match (won(&b), won(&s)) {
            (true, false) => batch_owners[i],
            (false, true) => single_owners[i],
            (b_won, s_won) => {
                return Err(failure(format!(
                    "{race:?}, {key}: batch acquired {b_won}, the other side acquired {s_won}: \
                     exactly one must ({b:?} / {s:?})"
                )))
            }
        };
        ensure_eq!(
            cx.record(key).await?.owner,
            winner,
            "{race:?}, {key}: the winner's record"
        );
    }
    Ok(())
}

/// One `reserve_many` of `keys`, each by its owner.
async fn batch_of(
    cx: &Ctx,
    keys: &[RecordKey],
    owners: &[OwnerToken],
) -> Vec<Result<Reservation, Error>> {
    let requests = keys
        .iter()
        .zip(owners)
        .map(|(k, o)| cx.req(k, *o))
        .collect();
    cx.repo.reserve_many(requests).await
}

/// Single `reserve`s of `keys` joined, sent in reverse order (so that they
/// meet a batch half way); the answers in the keys' order.
async fn singles_of(
    cx: &Ctx,
    keys: &[RecordKey],
    owners: &[OwnerToken],
) -> Vec<Result<Reservation, Error>> {
    let singles = keys
        .iter()
        .zip(owners)
        .rev()
        .map(|(k, o)| cx.repo.reserve(cx.req(k, *o)));
    let mut answers = join_all(singles).await;
    answers.reverse();
    answers
}

/// Keys per round of [`check_complete_many_races_takeovers`].
const RACE_KEYS: usize = 8;

/// A `complete_many` by owners whose leases just ended races single
/// takeovers of the same keys — joined in one task (the batch polled first,
/// then the takeovers first: they interleave at every await point) and
/// spawned on separate threads: for each key, either the completion came
/// first (applied, and the taker sees the completed record) or it is refused
/// and the taker holds the key. A batch that reads every record, then writes
/// in a second step, fails this.
pub async fn check_complete_many_races_takeovers(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    for round in 0..6 {
        let keys: Vec<RecordKey> = (0..RACE_KEYS)
            .map(|i| cx.key(&format!("complete-many-race-{round}-{i}")))
            .collect();
        let mut olds = Vec::with_capacity(keys.len());
        for key in &keys {
            olds.push(cx.acquire(key).await?);
        }
        cx.advance(LEASE);
        let takers: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
        let (completed, taken) = match round % 3 {
            0 => {
                let (c, t) = futures::join!(
                    complete_all(&cx, &keys, &olds),
                    take_all(&cx, &keys, &takers)
                );
                (c, t)
            }
            1 => {
                let (t, c) = futures::join!(
                    take_all(&cx, &keys, &takers),
                    complete_all(&cx, &keys, &olds)
                );
                (c, t)
            }
            _ => {
                let start = Arc::new(Barrier::new(2));
                let batch = {
                    let (cx, keys, olds, start) =
                        (cx.clone(), keys.clone(), olds.clone(), start.clone());
                    tokio::spawn(async move {
                        start.wait().await;
                        complete_all(&cx, &keys, &olds).await
                    })
                };
                let singles = {
                    let (cx, keys, takers) = (cx.clone(), keys.clone(), takers.clone());
                    tokio::spawn(async move {
                        start.wait().await;
                        take_all(&cx, &keys, &takers).await
                    })
                };
                let c = batch.await.map_err(|e| failure(e.to_string()))?;
                let t = singles.await.map_err(|e| failure(e.to_string()))?;
                (c, t)
            }
        };
        ensure_eq!(completed.len(), keys.len(), "one answer per write");
        for (i, (done, took)) in completed.into_iter().zip(taken).enumerate() {
            let key = &keys[i];
            let r = cx.record(key).await?;
            match (done, took?) {
                (Ok(()), Reservation::Existing(seen)) => {
                    ensure!(
                        seen.status == Status::Completed && seen.owner == olds[i],
                        "round {round}, {key}: completed first, the taker sees it: {seen:?}"
                    );
                    ensure_eq!(r, seen, "round {round}, {key}: the completed record");
                }
                (Err(Error::LeaseLost { .. }), Reservation::Acquired { attempt: 2 }) => {
                    ensure!(
                        r.status == Status::Processing && r.owner == takers[i] && r.attempt == 2,
                        "round {round}, {key}: refused, the taker's record intact: {r:?}"
                    );
                }
                other => {
                    return Err(failure(format!(
                        "round {round}, {key}: inconsistent outcome {other:?}, record {r:?}"
                    )))
                }
            }
        }
    }
    Ok(())
}

/// The old owners' completions of `keys`, in one `complete_many`.
async fn complete_all(
    cx: &Ctx,
    keys: &[RecordKey],
    owners: &[OwnerToken],
) -> Vec<Result<(), Error>> {
    let (now, later) = (cx.now(), cx.now() + TTL);
    let batch = keys
        .iter()
        .zip(owners)
        .map(|(key, owner)| Completion {
            key,
            owner: *owner,
            result: Some(b"old"),
            expires_at: later,
        })
        .collect();
    cx.repo.complete_many(batch, now).await
}

/// Takeovers of `keys`, one `reserve` each, concurrently.
async fn take_all(
    cx: &Ctx,
    keys: &[RecordKey],
    owners: &[OwnerToken],
) -> Vec<Result<Reservation, Error>> {
    join_all(
        keys.iter()
            .zip(owners)
            .map(|(key, owner)| cx.repo.reserve(cx.req(key, *owner))),
    )
    .await
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
/// record (with a result, an empty one, none, a binary one; with a
/// fingerprint), our record whose lease ran out untaken, one taken over by
/// another owner, another owner's, an absent key, an expired record, one
/// expiring exactly at the batch's instant, a completed and a failed one, a
/// result over the declared limit — interleaved with many fresh records of
/// their own results (more than a hundred writes in all), each write with its
/// own expiry, in one `complete_many` a second after the records were
/// written: each answer is `complete`'s for that write, in order (`Ok`
/// exactly for the owner's live processing record), an applied write turns
/// the record into exactly what `complete` would (its own result and expiry,
/// `updated_at` the batch's instant, every other field kept), a refused one
/// changes nothing at all. An empty batch has no answers.
pub async fn check_complete_many_follows_complete(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let none = cx.repo.complete_many(Vec::new(), cx.now()).await;
    ensure!(none.is_empty(), "an empty batch has no answers: {none:?}");
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
    for (id, result) in [
        ("mine", &b"mine"[..]),
        ("mine-empty", &b""[..]),
        ("mine-binary", &b"\xff\x00\xfe\x80\xc3\x28"[..]),
    ] {
        let key = cx.key(id);
        writes.push(Write::new(
            key.clone(),
            cx.acquire(&key).await?,
            Some(result),
        ));
    }
    let bare = cx.key("mine-none");
    writes.push(Write::new(bare.clone(), cx.acquire(&bare).await?, None));
    let printed = cx.key("mine-fingerprint");
    let printed_owner = OwnerToken::random();
    cx.repo
        .reserve(ReserveRequest {
            fingerprint: fp(4),
            ..cx.req(&printed, printed_owner)
        })
        .await?;
    writes.push(Write::new(printed, printed_owner, Some(b"printed")));
    // Live until the batch's instant, exactly.
    let edge = cx.key("expiry-edge");
    let edge_owner = OwnerToken::random();
    let batch_at = cx.now() + Duration::from_secs(1);
    cx.repo
        .reserve(ReserveRequest {
            lease_until: batch_at,
            expires_at: batch_at,
            ..cx.req(&edge, edge_owner)
        })
        .await?;
    writes.push(Write::new(edge, edge_owner, Some(b"too late")));
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
    for i in 0..120 {
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
    // A second later (what a write stamps shows), each write its own expiry.
    cx.clock.set(batch_at);
    let now = cx.now();
    let expiry = |i: usize| now + TTL + Duration::from_millis(u64::try_from(i).unwrap_or(0));
    let mut before = Vec::with_capacity(writes.len());
    for w in &writes {
        before.push(cx.repo.get(&w.key, now).await?);
    }
    let batch = writes
        .iter()
        .enumerate()
        .map(|(i, w)| Completion {
            key: &w.key,
            owner: w.owner,
            result: w.result.as_deref(),
            expires_at: expiry(i),
        })
        .collect();
    let answers = cx.repo.complete_many(batch, now).await;
    ensure_eq!(answers.len(), writes.len(), "one answer per write");
    for (i, ((w, answer), before)) in writes.iter().zip(answers).zip(before).enumerate() {
        check_write(&cx, w, answer, before, expiry(i)).await?;
    }
    Ok(())
}

/// One `complete_many` answer against `complete`'s rule and the record after.
async fn check_write(
    cx: &Ctx,
    w: &Write,
    answer: Result<(), Error>,
    before: Option<Record>,
    expires_at: Timestamp,
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
            let want = processing.map(|was| Record {
                status: Status::Completed,
                result: w.result.clone(),
                expires_at,
                updated_at: cx.now(),
                ..was.clone()
            });
            ensure_eq!(
                Some(r),
                want,
                "{key}: the owner's record, completed with the write's own result and expiry"
            );
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
