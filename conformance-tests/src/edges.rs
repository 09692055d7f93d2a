//! Edge cases real stores get wrong: keys that only a byte-exact comparison
//! tells apart, the owner token (not the clock) deciding every fenced
//! operation, `fail` at its edges, and expired records re-created by racing
//! reservers.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use idempotency_core::{OwnerToken, Reservation, ReserveRequest, SharedRepository, Status};

use crate::support::{ensure, ensure_eq, failure, fp, lease_lost, Ctx, LEASE, TTL};
use crate::CheckResult;

/// Ids that differ only in case, in leading or trailing spaces, in Unicode
/// normalization form, or in the last byte of a long shared prefix (up to the
/// declared `max_id_bytes`) are distinct keys — what SQL collations, `CHAR(n)`
/// columns and truncating stores get wrong.
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
/// old one kept).
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
        let racers = (0..16).map(|_| {
            let (cx, key) = (cx.clone(), key.clone());
            tokio::spawn(async move {
                let owner = OwnerToken::random();
                cx.repo
                    .reserve(cx.req(&key, owner))
                    .await
                    .map(|r| (owner, r))
            })
        });
        let mut winners = Vec::new();
        for joined in join_all(racers).await {
            let (owner, answer) = joined.map_err(|e| failure(e.to_string()))??;
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
