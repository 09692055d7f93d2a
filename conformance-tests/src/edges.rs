//! Edge cases real stores get wrong: keys that only a byte-exact comparison
//! tells apart, the owner token (not the clock) deciding every fenced
//! operation, and all of the token (not a prefix, not a number), refused
//! writes that leave no trace, an attempt counter wider than a byte, `fail`
//! at its edges, and expired records re-created by racing reservers.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use idempotency_core::{
    OwnerToken, RecordKey, Reservation, ReserveRequest, SharedRepository, Status,
    MAX_NAMESPACE_BYTES,
};

use crate::support::{ensure, ensure_eq, existing, failure, fp, lease_lost, Ctx, LEASE, TTL};
use crate::CheckResult;

/// Ids that differ only in case, in leading or trailing spaces, in Unicode
/// normalization form, or in the last byte of a long shared prefix (up to the
/// declared `max_id_bytes`) are distinct keys — what SQL collations, `CHAR(n)`
/// columns and truncating stores get wrong — and so are namespaces that
/// differ only so (up to the 512 bytes a namespace may have).
pub async fn check_keys_are_byte_exact(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let max = cx.caps.max_id_bytes;
    let prefix = "p".repeat(max - 1);
    let ids = [
        "order-1".to_owned(),
        "Order-1".to_owned(),
        "ORDER-1".to_owned(),
        "k".to_owned(),
        " k".to_owned(),
        "k ".to_owned(),
        "k  ".to_owned(),
        "k\t".to_owned(),
        "caf\u{e9}".to_owned(),   // NFC
        "cafe\u{301}".to_owned(), // NFD
        "\u{212b}".to_owned(),    // ANGSTROM SIGN
        "\u{c5}".to_owned(),      // its NFC equivalent
        "\u{ff21}".to_owned(),    // FULLWIDTH A
        "A".to_owned(),
        format!("{prefix}a"),
        format!("{prefix}b"),
        prefix.clone(),
        prefix[..max / 2].to_owned(),
    ];
    let mut keys = Vec::with_capacity(ids.len());
    for id in &ids {
        let key = cx.key(id);
        ensure!(!key.is_digested(), "{id:?} fits max_id_bytes ({max})");
        keys.push(key);
    }
    // The same holds for namespaces (a collation or a `CHAR(n)` column on
    // the namespace, not only on the id).
    for suffix in [
        "-scope",
        "-Scope",
        "-SCOPE",
        "-scope ",
        "-scope  ",
        " -scope",
        "-caf\u{e9}",
        "-cafe\u{301}",
    ] {
        keys.push(cx.key_in(&format!("{}{suffix}", cx.ns), "k"));
    }
    // Namespaces as long as allowed, apart only in their last byte, and one
    // byte shorter (what a narrower namespace column truncates).
    let long = format!("{}-{}", cx.ns, "n".repeat(MAX_NAMESPACE_BYTES));
    let long = &long[..MAX_NAMESPACE_BYTES - 1];
    for namespace in [format!("{long}a"), format!("{long}b"), long.to_owned()] {
        keys.push(cx.key_in(&namespace, "k"));
    }
    cx.assert_distinct(&keys).await
}

/// After its lease ran out, while nobody took over, the owner's `complete`,
/// `fail`, `release` and `extend` all succeed: the token decides, not the
/// clock.
pub async fn check_fenced_by_token_not_clock(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let later = |cx: &Ctx| cx.now() + TTL;
    for op in ["complete", "fail", "release", "extend"] {
        let key = cx.key(&format!("late-{op}"));
        let owner = cx.acquire(&key).await?;
        cx.advance(LEASE + Duration::from_secs(1));
        let now = cx.now();
        let done = match op {
            "complete" => cx
                .repo
                .complete(&key, owner, Some(b"late"), later(&cx), now),
            "fail" => cx
                .repo
                .fail(&key, owner, Some(b"late"), false, later(&cx), now),
            "release" => cx.repo.release(&key, owner, now),
            _ => cx.repo.extend(&key, owner, now + LEASE, later(&cx), now),
        }
        .await;
        ensure!(done.is_ok(), "late {op} by the owner: {done:?}");
        let status = cx.status(&key).await?;
        let expected = match op {
            "complete" => Some(Status::Completed),
            "fail" => Some(Status::Failed),
            "release" => None,
            _ => Some(Status::Processing),
        };
        ensure_eq!(status, expected, "after a late {op}");
        if op == "extend" {
            ensure_eq!(cx.record(&key).await?.lease_until, now + LEASE);
        }
    }
    Ok(())
}

/// `fail` is refused on an expired record and on a `Failed` one, and keeps an
/// empty error apart from none.
pub async fn check_fail_edges(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fail-expired");
    let owner = OwnerToken::random();
    let short = ReserveRequest {
        expires_at: cx.now() + LEASE,
        ..cx.req(&key, owner)
    };
    cx.repo.reserve(short).await?;
    cx.advance(LEASE);
    lease_lost(
        cx.repo
            .fail(&key, owner, None, true, cx.now() + TTL, cx.now())
            .await,
        "fail of an expired record",
    )?;
    ensure!(
        cx.repo.get(&key, cx.now()).await?.is_none(),
        "the expired record stays expired"
    );

    let (failed, owner) = cx.failed("fail-twice", Some(b"first")).await?;
    lease_lost(
        cx.repo
            .fail(
                &failed,
                owner,
                Some(b"second"),
                false,
                cx.now() + TTL,
                cx.now(),
            )
            .await,
        "fail of a failed record",
    )?;
    let r = cx.record(&failed).await?;
    ensure_eq!(r.error.as_deref(), Some(&b"first"[..]));
    ensure!(r.retryable, "the first fail's classification is kept");

    for (id, error) in [("fail-none", None), ("fail-empty", Some(&b""[..]))] {
        let key = cx.key(id);
        let owner = cx.acquire(&key).await?;
        cx.repo
            .fail(&key, owner, error, false, cx.now() + TTL, cx.now())
            .await?;
        ensure_eq!(cx.record(&key).await?.error.as_deref(), error, "{id}");
    }
    Ok(())
}

/// An expired record that is still physically stored is re-created by exactly
/// one of many racing reservers, as a new record (attempt 1, nothing of the
/// old one kept). The racers are forced to meet, not left to the scheduler:
/// joined in one task (they interleave at every await point, so a read, a
/// yield, then an unconditional write is hit every time), then spawned on
/// separate threads and released together by a barrier, then joined again.
pub async fn check_concurrent_recreate_of_expired(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    for round in 0..3 {
        let key = cx.key(&format!("recreate-{round}"));
        let old = OwnerToken::random();
        let req = ReserveRequest {
            fingerprint: fp(1),
            expires_at: cx.now() + LEASE,
            ..cx.req(&key, old)
        };
        cx.repo.reserve(req).await?;
        cx.repo
            .complete(&key, old, Some(b"old"), cx.now() + LEASE, cx.now())
            .await?;
        cx.advance(LEASE);
        let answers = if round == 1 {
            let start = Arc::new(tokio::sync::Barrier::new(RECREATORS));
            let racers = (0..RECREATORS).map(|_| {
                let (cx, key, start) = (cx.clone(), key.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    recreate(&cx, &key).await
                })
            });
            let mut answers = Vec::with_capacity(RECREATORS);
            for joined in join_all(racers).await {
                answers.push(joined.map_err(|e| failure(e.to_string()))?);
            }
            answers
        } else {
            join_all((0..RECREATORS).map(|_| recreate(&cx, &key))).await
        };
        let mut winners = Vec::new();
        for answer in answers {
            let (owner, answer) = answer?;
            match answer {
                Reservation::Acquired { attempt } => winners.push((owner, attempt)),
                Reservation::Existing(r) => {
                    ensure_eq!(
                        r.status,
                        Status::Processing,
                        "round {round}: a loser's view"
                    )
                }
            }
        }
        ensure_eq!(winners.len(), 1, "round {round}: exactly one re-creates it");
        let (winner, attempt) = winners[0];
        ensure_eq!(attempt, 1, "round {round}: a new record");
        let r = cx.record(&key).await?;
        ensure_eq!((r.owner, r.attempt), (winner, 1), "round {round}");
        ensure!(
            r.result.is_none() && r.fingerprint.is_none() && r.created_at == cx.now(),
            "round {round}: nothing of the expired record is kept: {r:?}"
        );
    }
    Ok(())
}

/// Racers of each [`check_concurrent_recreate_of_expired`] round.
const RECREATORS: usize = 16;

/// A reservation of `key` by a new owner, with that owner.
async fn recreate(
    cx: &Ctx,
    key: &RecordKey,
) -> Result<(OwnerToken, Reservation), idempotency_core::Error> {
    let owner = OwnerToken::random();
    cx.repo
        .reserve(cx.req(key, owner))
        .await
        .map(|r| (owner, r))
}

/// Tokens that differ from `owner` in one bit: the lowest, the highest, and
/// either side of the middle.
fn neighbours(owner: OwnerToken) -> [OwnerToken; 4] {
    [0, 63, 64, 127].map(|bit| OwnerToken::from_u128(owner.as_u128() ^ (1u128 << bit)))
}

/// A token that differs from the holder's in a single bit is a stranger's:
/// its `complete`, `fail`, `extend` and `release` are refused, its `reserve`
/// sees the record, and none of them changes the record — not even its
/// `updated_at`, a second later. The same for the late writes of the owners
/// of a completed and of a failed record. What a store comparing tokens as
/// numbers (a Lua double), by a prefix or through a narrow column, or
/// stamping `updated_at` before it checks the owner, gets wrong.
pub async fn check_refused_writes_touch_nothing(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let held = cx.key("held");
    let holder = cx.acquire(&held).await?;
    let (done, done_owner) = cx.completed("done", Some(b"r")).await?;
    let (failed, failed_owner) = cx.failed("failed", Some(b"e")).await?;
    cx.advance(Duration::from_secs(1));
    let mut writers: Vec<(&RecordKey, OwnerToken, String)> = neighbours(holder)
        .into_iter()
        .chain([OwnerToken::random()])
        .map(|o| {
            (
                &held,
                o,
                format!("the stranger {o} (the holder is {holder})"),
            )
        })
        .collect();
    writers.push((&done, done_owner, "the owner of a completed record".into()));
    writers.push((&failed, failed_owner, "the owner of a failed record".into()));
    for (key, who, what) in writers {
        let before = cx.record(key).await?;
        let (now, later) = (cx.now(), cx.now() + TTL);
        for op in ["complete", "fail", "extend", "release"] {
            let refused = match op {
                "complete" => cx.repo.complete(key, who, Some(b"x"), later, now).await,
                "fail" => cx.repo.fail(key, who, Some(b"x"), true, later, now).await,
                "extend" => cx.repo.extend(key, who, later, later, now).await,
                _ => cx.repo.release(key, who, now).await,
            };
            lease_lost(refused, &format!("{op} by {what}"))?;
            ensure_eq!(
                cx.record(key).await?,
                before,
                "a refused {op} by {what} leaves the record as it was"
            );
        }
        let seen = existing(cx.reserve(key, who).await?, &format!("reserve by {what}"))?;
        ensure_eq!(seen, before, "reserve by {what} sees the record");
        ensure_eq!(cx.record(key).await?, before, "and changes nothing");
    }
    cx.repo
        .complete(&held, holder, Some(b"mine"), cx.now() + TTL, cx.now())
        .await?;
    ensure_eq!(
        cx.status(&held).await?,
        Some(Status::Completed),
        "the holder"
    );
    Ok(())
}

/// Takeovers every store must count through: past one byte (255, and 127).
const MANY_TAKEOVERS: u32 = 257;
/// Past two bytes (65,535, and 32,767): counted up to while the store answers
/// fast enough (an in-memory store gets there in well under a second).
const MORE_TAKEOVERS: u32 = 65_537;
/// How long the check keeps counting past [`MANY_TAKEOVERS`].
const TAKEOVER_BUDGET: Duration = Duration::from_secs(2);

/// The attempt (the fencing token handlers see) counts every takeover, past
/// what one byte holds — and past what two bytes hold, as far as the store
/// answers within a couple of seconds: a store that keeps it in a `TINYINT`
/// or a `SMALLINT` wraps it (or fails) and hands out an attempt number that
/// was used before.
pub async fn check_attempt_counts_past_a_byte(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("many-takeovers");
    let lease = Duration::from_millis(1);
    let started = std::time::Instant::now();
    let mut last = 0;
    for attempt in 1..=MORE_TAKEOVERS {
        if attempt > MANY_TAKEOVERS && started.elapsed() > TAKEOVER_BUDGET {
            break;
        }
        let req = ReserveRequest {
            lease_until: cx.now() + lease,
            ..cx.req(&key, OwnerToken::random())
        };
        let answer = cx.repo.reserve(req).await?;
        if answer != (Reservation::Acquired { attempt }) {
            return Err(failure(format!(
                "reservation {attempt} of one key, each after the last one's lease, answered \
                 {answer:?}, expected Acquired {{ attempt: {attempt} }}"
            )));
        }
        cx.advance(lease);
        last = attempt;
    }
    ensure_eq!(cx.record(&key).await?.attempt, last);
    Ok(())
}
