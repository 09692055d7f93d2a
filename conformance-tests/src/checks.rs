//! The checks. Each is a plain `pub async fn check_…(repo) -> CheckResult` using
//! its own random namespace and manual clock, so any number run in parallel
//! against one repository.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use idempotency_core::{
    Config, Error, ExecuteError, FailurePolicy, HandlerError, InProgressPolicy, OwnerToken,
    RecordKey, Reservation, ReserveRequest, SharedRepository, Status, Timestamp,
    MAX_NAMESPACE_BYTES,
};

use crate::support::{ensure, ensure_eq, existing, failure, fp, lease_lost, Ctx, Held, LEASE, TTL};
use crate::{CheckFailure, CheckResult};

// ---------------------------------------------------------------- reserve

/// A fresh key: `Acquired { attempt: 1 }` and a `Processing` record with every
/// field as requested.
pub async fn check_reserve_creates_processing(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fresh");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        fingerprint: fp(7),
        ..cx.req(&key, owner)
    };
    let (now, lease, expires) = (req.now, req.lease_until, req.expires_at);
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 1 }
    );
    let r = cx.record(&key).await?;
    ensure_eq!(r.status, Status::Processing);
    ensure_eq!(r.owner, owner);
    ensure_eq!(r.attempt, 1);
    ensure_eq!(r.fingerprint, fp(7));
    ensure_eq!(r.lease_until, lease);
    ensure_eq!(r.expires_at, expires);
    ensure_eq!(r.created_at, now);
    ensure_eq!(r.updated_at, now);
    ensure!(
        r.result.is_none() && r.error.is_none(),
        "a new record has no result or error: {r:?}"
    );
    Ok(())
}

/// A live `Processing` record is returned unchanged to a second reserver.
pub async fn check_reserve_returns_live_processing(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("busy");
    let first = cx.acquire(&key).await?;
    let before = cx.record(&key).await?;
    cx.advance(Duration::from_secs(1));
    let r = existing(
        cx.reserve(&key, OwnerToken::random()).await?,
        "second reserve",
    )?;
    ensure_eq!(r.owner, first);
    ensure_eq!(r, before, "the existing record must be returned unchanged");
    ensure_eq!(cx.record(&key).await?, before, "and left unchanged");
    Ok(())
}

/// A `Completed` record is returned with its result, and never taken over.
pub async fn check_reserve_returns_completed(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let (key, owner) = cx.completed("done", Some(b"result")).await?;
    // Even long after its lease, within the TTL.
    cx.advance(LEASE * 10);
    let req = ReserveRequest {
        retry_failed: true,
        ..cx.req(&key, OwnerToken::random())
    };
    let r = existing(cx.repo.reserve(req).await?, "reserve of a completed key")?;
    ensure_eq!(r.status, Status::Completed);
    ensure_eq!(r.owner, owner);
    ensure_eq!(r.result.as_deref(), Some(&b"result"[..]));
    Ok(())
}

/// A `Failed` record is returned as is when `retry_failed` is off.
pub async fn check_reserve_returns_failed_without_retry(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let (key, _) = cx.failed("failed", Some(b"boom")).await?;
    cx.advance(LEASE * 2);
    let r = existing(
        cx.reserve(&key, OwnerToken::random()).await?,
        "reserve of a failed key",
    )?;
    ensure_eq!(r.status, Status::Failed);
    ensure_eq!(r.error.as_deref(), Some(&b"boom"[..]));
    Ok(())
}

/// A `Failed` record is taken over when `retry_failed` is on: new owner,
/// attempt 2, error cleared.
pub async fn check_reserve_takes_over_failed_with_retry(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let (key, old) = cx.failed("retry", Some(b"boom")).await?;
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        retry_failed: true,
        ..cx.req(&key, owner)
    };
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 2 }
    );
    let r = cx.record(&key).await?;
    ensure_eq!(
        (r.status, r.owner, r.attempt),
        (Status::Processing, owner, 2)
    );
    ensure!(
        r.error.is_none(),
        "the takeover clears the stored error: {r:?}"
    );
    lease_lost(
        cx.repo
            .complete(&key, old, None, cx.now() + TTL, cx.now())
            .await,
        "complete by the failed attempt's owner",
    )
}

/// A `Processing` record whose lease ran out is taken over; the old owner is
/// fenced off.
pub async fn check_reserve_takes_over_expired_lease(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("crashed");
    let old = cx.acquire(&key).await?;
    cx.advance(LEASE + Duration::from_millis(1));
    let new = OwnerToken::random();
    ensure_eq!(
        cx.reserve(&key, new).await?,
        Reservation::Acquired { attempt: 2 }
    );
    let r = cx.record(&key).await?;
    ensure_eq!((r.owner, r.attempt, r.status), (new, 2, Status::Processing));
    ensure_eq!(r.lease_until, cx.now() + LEASE);
    for (what, res) in [
        (
            "complete",
            cx.repo
                .complete(&key, old, Some(b"x"), cx.now() + TTL, cx.now())
                .await,
        ),
        (
            "fail",
            cx.repo
                .fail(&key, old, None, true, cx.now() + TTL, cx.now())
                .await,
        ),
        (
            "extend",
            cx.repo
                .extend(&key, old, cx.now() + LEASE, cx.now() + LEASE, cx.now())
                .await,
        ),
        ("release", cx.repo.release(&key, old, cx.now()).await),
    ] {
        lease_lost(res, &format!("{what} by the previous owner"))?;
    }
    ensure_eq!(
        cx.record(&key).await?.owner,
        new,
        "the new owner keeps the record"
    );
    Ok(())
}

/// The lease boundary: `lease_until == now` may be taken over, one millisecond
/// before may not.
pub async fn check_reserve_lease_boundary(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("boundary");
    cx.acquire(&key).await?;
    cx.advance(LEASE - Duration::from_millis(1));
    existing(
        cx.reserve(&key, OwnerToken::random()).await?,
        "1 ms before the lease ends",
    )?;
    cx.advance(Duration::from_millis(1));
    ensure_eq!(
        cx.reserve(&key, OwnerToken::random()).await?,
        Reservation::Acquired { attempt: 2 },
        "at lease_until == now"
    );
    Ok(())
}

/// Clock-skew tolerance delays takeovers by the skew, to the millisecond.
pub async fn check_reserve_honours_clock_skew(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("skew");
    cx.acquire(&key).await?;
    let skew = Duration::from_millis(5_500);
    cx.advance(LEASE + Duration::from_secs(1));
    let req = ReserveRequest {
        clock_skew: skew,
        ..cx.req(&key, OwnerToken::random())
    };
    existing(
        cx.repo.reserve(req).await?,
        "lease ended 1 s ago with 5.5 s skew tolerance",
    )?;
    cx.advance(Duration::from_secs(4));
    let req = ReserveRequest {
        clock_skew: skew,
        ..cx.req(&key, OwnerToken::random())
    };
    existing(
        cx.repo.reserve(req).await?,
        "lease ended 5 s ago with 5.5 s skew tolerance (a tolerance cut to whole seconds takes over)",
    )?;
    cx.advance(Duration::from_millis(500));
    let req = ReserveRequest {
        clock_skew: skew,
        ..cx.req(&key, OwnerToken::random())
    };
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 2 },
        "lease + skew <= now"
    );
    Ok(())
}

/// A record past `expires_at` is absent: reserve creates a fresh one (attempt 1),
/// whatever the old status, also for the owner that held it.
pub async fn check_reserve_after_expiry_creates_fresh(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let (done, _) = cx.completed("done", Some(b"old")).await?;
    let (failed, _) = cx.failed("failed", Some(b"old")).await?;
    let busy = cx.key("busy");
    cx.acquire(&busy).await?;
    // Its holder comes back after the expiry, re-sending its reserve.
    let own = cx.key("own");
    let holder = cx.acquire(&own).await?;
    cx.advance(TTL);
    for key in [&done, &failed, &busy, &own] {
        let owner = if key == &own {
            holder
        } else {
            OwnerToken::random()
        };
        ensure_eq!(
            cx.reserve(key, owner).await?,
            Reservation::Acquired { attempt: 1 },
            "expired record at {key}"
        );
        let r = cx.record(key).await?;
        ensure_eq!(
            (r.owner, r.attempt, r.status),
            (owner, 1, Status::Processing)
        );
        ensure!(
            r.result.is_none() && r.error.is_none() && !r.retryable,
            "no trace of the expired record: {r:?}"
        );
        ensure_eq!(
            (r.lease_until, r.expires_at),
            (cx.now() + LEASE, cx.now() + TTL),
            "the request's lease and expiry"
        );
        ensure_eq!(r.created_at, cx.now(), "a fresh record, not a takeover");
        ensure_eq!(r.updated_at, cx.now(), "a fresh record, written now");
    }
    Ok(())
}

/// The expiry boundary: live at `expires_at - 1 ms`, gone at `expires_at`
/// (whatever the clock-skew allowance, which is for leases).
pub async fn check_expiry_boundary(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let (key, _) = cx.completed("edge", Some(b"r")).await?;
    let expires = cx.record(&key).await?.expires_at;
    cx.clock.set(expires - Duration::from_millis(1));
    ensure!(
        cx.repo.get(&key, cx.now()).await?.is_some(),
        "live 1 ms before expiry"
    );
    existing(
        cx.reserve(&key, OwnerToken::random()).await?,
        "1 ms before expiry",
    )?;
    cx.clock.set(expires);
    ensure!(
        cx.repo.get(&key, cx.now()).await?.is_none(),
        "absent at expires_at"
    );
    // The clock-skew allowance delays takeovers of leases, not expiry.
    let req = ReserveRequest {
        clock_skew: Duration::from_secs(5),
        ..cx.req(&key, OwnerToken::random())
    };
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 1 },
        "at expires_at, with a clock-skew allowance"
    );
    Ok(())
}

/// Differing fingerprints block the takeover of a stale lease.
pub async fn check_reserve_fingerprint_mismatch_blocks_takeover(
    repo: SharedRepository,
) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fp");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        fingerprint: fp(1),
        ..cx.req(&key, owner)
    };
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 1 }
    );
    cx.advance(LEASE * 2);
    let req = ReserveRequest {
        fingerprint: fp(2),
        ..cx.req(&key, OwnerToken::random())
    };
    let r = existing(
        cx.repo.reserve(req).await?,
        "stale lease, other fingerprint",
    )?;
    ensure_eq!((r.owner, r.fingerprint), (owner, fp(1)));
    Ok(())
}

/// Differing fingerprints block the takeover of a `Failed` record even with
/// `retry_failed`.
pub async fn check_reserve_fingerprint_mismatch_blocks_retry(
    repo: SharedRepository,
) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fp-failed");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        fingerprint: fp(1),
        ..cx.req(&key, owner)
    };
    cx.repo.reserve(req).await?;
    cx.repo
        .fail(&key, owner, Some(b"e"), true, cx.now() + TTL, cx.now())
        .await?;
    let req = ReserveRequest {
        fingerprint: fp(2),
        retry_failed: true,
        ..cx.req(&key, OwnerToken::random())
    };
    let r = existing(
        cx.repo.reserve(req).await?,
        "failed, retry, other fingerprint",
    )?;
    ensure_eq!(r.status, Status::Failed);
    Ok(())
}

/// A takeover proceeds when only one side carries a fingerprint, and the record
/// then carries the request's fingerprint (or none).
pub async fn check_reserve_takeover_with_one_fingerprint(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fp-one-side");
    let req = ReserveRequest {
        fingerprint: fp(1),
        ..cx.req(&key, OwnerToken::random())
    };
    cx.repo.reserve(req).await?;
    cx.advance(LEASE);
    ensure_eq!(
        cx.reserve(&key, OwnerToken::random()).await?,
        Reservation::Acquired { attempt: 2 },
        "request without fingerprint"
    );
    ensure_eq!(cx.record(&key).await?.fingerprint, fp(1));
    Ok(())
}

/// Equal fingerprints behave like none: duplicates see the record.
pub async fn check_reserve_same_fingerprint_is_duplicate(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fp-same");
    let req = ReserveRequest {
        fingerprint: fp(4),
        ..cx.req(&key, OwnerToken::random())
    };
    cx.repo.reserve(req.clone()).await?;
    let again = ReserveRequest {
        owner: OwnerToken::random(),
        ..req
    };
    let r = existing(cx.repo.reserve(again).await?, "same fingerprint")?;
    ensure_eq!(r.fingerprint, fp(4));
    Ok(())
}

/// Every takeover increments the attempt and keeps `created_at`.
pub async fn check_takeover_increments_attempt(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("attempts");
    cx.acquire(&key).await?;
    let created = cx.record(&key).await?.created_at;
    for attempt in 2..=4 {
        cx.advance(LEASE);
        ensure_eq!(
            cx.reserve(&key, OwnerToken::random()).await?,
            Reservation::Acquired { attempt }
        );
        let r = cx.record(&key).await?;
        ensure_eq!(r.attempt, attempt);
        ensure_eq!(r.created_at, created, "a takeover keeps created_at");
        ensure_eq!(r.updated_at, cx.now(), "a takeover sets updated_at");
    }
    Ok(())
}

/// A takeover writes the new lease and expiry.
pub async fn check_takeover_sets_new_lease_and_expiry(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("new-lease");
    cx.acquire(&key).await?;
    cx.advance(LEASE);
    let now = cx.now();
    let req = ReserveRequest {
        lease_until: now + Duration::from_secs(7),
        expires_at: now + Duration::from_secs(70),
        ..cx.req(&key, OwnerToken::random())
    };
    cx.repo.reserve(req).await?;
    let r = cx.record(&key).await?;
    ensure_eq!(r.lease_until, now + Duration::from_secs(7));
    ensure_eq!(r.expires_at, now + Duration::from_secs(70));
    Ok(())
}

// ---------------------------------------------------------------- complete / fail

/// The owner completes: `Completed`, result, new expiry, `updated_at`.
pub async fn check_complete_by_owner(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("complete");
    let owner = cx.acquire(&key).await?;
    cx.advance(Duration::from_secs(2));
    let expires = cx.now() + Duration::from_secs(120);
    cx.repo
        .complete(&key, owner, Some(b"ok"), expires, cx.now())
        .await?;
    let r = cx.record(&key).await?;
    ensure_eq!(r.status, Status::Completed);
    ensure_eq!(r.result.as_deref(), Some(&b"ok"[..]));
    ensure_eq!(r.expires_at, expires);
    ensure_eq!(r.updated_at, cx.now());
    ensure_eq!((r.owner, r.attempt), (owner, 1));
    Ok(())
}

/// Another owner cannot complete; the record is untouched.
pub async fn check_complete_wrong_owner(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("complete-wrong");
    cx.acquire(&key).await?;
    let before = cx.record(&key).await?;
    lease_lost(
        cx.repo
            .complete(
                &key,
                OwnerToken::random(),
                Some(b"x"),
                cx.now() + TTL,
                cx.now(),
            )
            .await,
        "complete by a stranger",
    )?;
    ensure_eq!(cx.record(&key).await?, before, "record untouched");
    Ok(())
}

/// The token, not the clock, decides: an owner whose lease ran out but whom
/// nobody took over still completes.
pub async fn check_complete_after_lease_expiry_without_takeover(
    repo: SharedRepository,
) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("late");
    let owner = cx.acquire(&key).await?;
    cx.advance(LEASE * 3);
    cx.repo
        .complete(&key, owner, Some(b"late"), cx.now() + TTL, cx.now())
        .await?;
    ensure_eq!(cx.status(&key).await?, Some(Status::Completed));
    Ok(())
}

/// Completing twice, or completing a failed record, is refused.
pub async fn check_complete_only_from_processing(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let (done, owner) = cx.completed("twice", Some(b"first")).await?;
    lease_lost(
        cx.repo
            .complete(&done, owner, Some(b"second"), cx.now() + TTL, cx.now())
            .await,
        "second complete",
    )?;
    ensure_eq!(
        cx.record(&done).await?.result.as_deref(),
        Some(&b"first"[..])
    );
    let (failed, owner) = cx.failed("failed", Some(b"e")).await?;
    lease_lost(
        cx.repo
            .complete(&failed, owner, None, cx.now() + TTL, cx.now())
            .await,
        "complete after fail",
    )?;
    ensure_eq!(cx.status(&failed).await?, Some(Status::Failed));
    Ok(())
}

/// Completing an absent or expired record is refused (and creates nothing).
pub async fn check_complete_absent_or_expired(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let absent = cx.key("absent");
    lease_lost(
        cx.repo
            .complete(
                &absent,
                OwnerToken::random(),
                None,
                cx.now() + TTL,
                cx.now(),
            )
            .await,
        "complete of an absent key",
    )?;
    ensure!(
        cx.repo.get(&absent, cx.now()).await?.is_none(),
        "complete created a record"
    );
    let key = cx.key("expired");
    let owner = cx.acquire(&key).await?;
    cx.advance(TTL);
    lease_lost(
        cx.repo
            .complete(&key, owner, None, cx.now() + TTL, cx.now())
            .await,
        "complete of an expired record",
    )?;
    ensure!(
        cx.repo.get(&key, cx.now()).await?.is_none(),
        "the expired record stays absent"
    );
    Ok(())
}

/// `None` and `Some(empty)` are distinct results.
pub async fn check_complete_empty_and_missing_results(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let (none, _) = cx.completed("none", None).await?;
    let (empty, _) = cx.completed("empty", Some(b"")).await?;
    ensure_eq!(cx.record(&none).await?.result, None);
    ensure_eq!(cx.record(&empty).await?.result, Some(Vec::new()));
    let r = existing(cx.reserve(&empty, OwnerToken::random()).await?, "duplicate")?;
    ensure_eq!(
        r.result,
        Some(Vec::new()),
        "reserve returns the empty result too"
    );
    Ok(())
}

/// Results are opaque bytes: every byte value, NUL and invalid UTF-8 round-trip.
pub async fn check_binary_results_round_trip(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let all: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    let cases: [&[u8]; 4] = [&all, b"\0", b"\xff\xfe\x00\xc3\x28", b"a\0b\r\n"];
    for (i, bytes) in cases.iter().enumerate() {
        let (key, _) = cx.completed(&format!("bin-{i}"), Some(bytes)).await?;
        ensure_eq!(
            cx.record(&key).await?.result.as_deref(),
            Some(*bytes),
            "via get"
        );
        let r = existing(cx.reserve(&key, OwnerToken::random()).await?, "duplicate")?;
        ensure_eq!(r.result.as_deref(), Some(*bytes), "via reserve");
    }
    let (key, _) = cx.failed("bin-error", Some(&all)).await?;
    ensure_eq!(
        cx.record(&key).await?.error.as_deref(),
        Some(&all[..]),
        "error bytes"
    );
    let r = existing(cx.reserve(&key, OwnerToken::random()).await?, "duplicate")?;
    ensure_eq!(
        r.error.as_deref(),
        Some(&all[..]),
        "error bytes via reserve"
    );
    Ok(())
}

/// The largest key the contract allows (a 512-byte namespace, an id of
/// `max_id_bytes`), reserved with a fingerprint: the rest of the largest
/// record, beside which the declared result limit must still hold.
async fn hold_largest_key(cx: &Ctx, tag: &str) -> Result<(RecordKey, OwnerToken), CheckFailure> {
    let mut ns = format!("{}/{tag}/", cx.ns);
    ns.extend(std::iter::repeat_n(
        'n',
        MAX_NAMESPACE_BYTES.saturating_sub(ns.len()),
    ));
    let key = cx.key_in(&ns, &"i".repeat(cx.caps.max_id_bytes));
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        fingerprint: fp(9),
        ..cx.req(&key, owner)
    };
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 1 },
        "reserving the largest key"
    );
    Ok((key, owner))
}

/// A result as large as the store allows (capped at 1 MiB here) round-trips,
/// also under the largest key and with a fingerprint (a limit declared
/// without room for the rest of the record would refuse it).
pub async fn check_large_result_up_to_limit(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let size = cx.caps.max_result_bytes.unwrap_or(1 << 20).min(1 << 20);
    let big: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let (key, owner) = hold_largest_key(&cx, "big").await?;
    cx.repo
        .complete(&key, owner, Some(&big), cx.now() + TTL, cx.now())
        .await?;
    let r = existing(cx.reserve(&key, OwnerToken::random()).await?, "duplicate")?;
    ensure!(
        r.result.as_deref() == Some(&big[..]),
        "a {size}-byte result did not round-trip through reserve"
    );
    let r = cx.record(&key).await?;
    ensure!(
        r.result.as_deref() == Some(&big[..]),
        "a {size}-byte result did not round-trip through get"
    );
    if cx.caps.max_result_bytes.is_none() {
        unlimited_result_round_trips(&cx).await?;
    }
    Ok(())
}

/// The size standing for "any" when a store declares no result limit.
const UNLIMITED_PROBE: usize = 16 << 20;

/// A store that declares no result limit enforces none: a 16 MiB result (a
/// size past common server packet and item limits) round-trips. A limit the
/// store has must be declared, so the manager and callers can keep to it.
async fn unlimited_result_round_trips(cx: &Ctx) -> CheckResult {
    let huge = vec![0xa5u8; UNLIMITED_PROBE];
    let key = cx.key("unlimited");
    let owner = cx.acquire(&key).await?;
    let stored = cx
        .repo
        .complete(&key, owner, Some(&huge), cx.now() + TTL, cx.now())
        .await;
    ensure!(
        stored.is_ok(),
        "no result limit is declared, yet a {UNLIMITED_PROBE}-byte result was refused: \
         {stored:?} (declare the limit in Capabilities::max_result_bytes)"
    );
    let r = cx.record(&key).await?;
    ensure!(
        r.result.as_deref() == Some(&huge[..]),
        "no result limit is declared, yet a {UNLIMITED_PROBE}-byte result did not round-trip"
    );
    Ok(())
}

/// A result over the declared limit is refused with `TooLarge`, leaving the
/// record `Processing` and the owner able to complete without it.
pub async fn check_result_over_limit_is_refused(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let Some(max) = cx.caps.max_result_bytes else {
        // No declared limit: nothing to refuse (memory-only stores).
        return Ok(());
    };
    let key = cx.key("too-big");
    let owner = cx.acquire(&key).await?;
    let big = vec![7u8; max + 1];
    match cx
        .repo
        .complete(&key, owner, Some(&big), cx.now() + TTL, cx.now())
        .await
    {
        Err(Error::TooLarge { .. }) => {}
        other => {
            return Err(failure(format!(
                "a result of max+1 bytes gave {other:?}, expected TooLarge"
            )))
        }
    }
    ensure_eq!(cx.status(&key).await?, Some(Status::Processing));
    cx.repo
        .complete(&key, owner, None, cx.now() + TTL, cx.now())
        .await?;
    ensure_eq!(cx.status(&key).await?, Some(Status::Completed));
    Ok(())
}

/// The declared limit is the stored error's too: an error as large as the
/// store allows (capped at 1 MiB here) round-trips, and one byte more is
/// refused with `TooLarge`, leaving the record `Processing` for the owner to
/// fail with a shorter one (never stored cut short, never an error the
/// manager would take as an outage and retry until the lease ends).
pub async fn check_large_error_up_to_limit(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let size = cx.caps.max_result_bytes.unwrap_or(1 << 20).min(1 << 20);
    let big: Vec<u8> = (0..size).map(|i| (i % 241) as u8).collect();
    let (key, owner) = hold_largest_key(&cx, "big-error").await?;
    cx.repo
        .fail(&key, owner, Some(&big), true, cx.now() + TTL, cx.now())
        .await?;
    let r = existing(cx.reserve(&key, OwnerToken::random()).await?, "duplicate")?;
    ensure!(
        r.error.as_deref() == Some(&big[..]),
        "a {size}-byte error did not round-trip through reserve"
    );
    ensure!(
        cx.record(&key).await?.error.as_deref() == Some(&big[..]),
        "a {size}-byte error did not round-trip through get"
    );
    let Some(max) = cx.caps.max_result_bytes else {
        return Ok(());
    };
    let key = cx.key("error-too-big");
    let owner = cx.acquire(&key).await?;
    let over = vec![7u8; max + 1];
    match cx
        .repo
        .fail(&key, owner, Some(&over), false, cx.now() + TTL, cx.now())
        .await
    {
        Err(Error::TooLarge { .. }) => {}
        other => {
            return Err(failure(format!(
                "an error of max+1 bytes gave {other:?}, expected TooLarge"
            )))
        }
    }
    ensure_eq!(cx.status(&key).await?, Some(Status::Processing));
    cx.repo
        .fail(&key, owner, Some(b"short"), false, cx.now() + TTL, cx.now())
        .await?;
    ensure_eq!(cx.record(&key).await?.error.as_deref(), Some(&b"short"[..]));
    Ok(())
}

/// The owner fails: `Failed` with the error, expiry and `updated_at`.
pub async fn check_fail_by_owner(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fail");
    let owner = cx.acquire(&key).await?;
    cx.advance(Duration::from_secs(2));
    let expires = cx.now() + Duration::from_secs(90);
    cx.repo
        .fail(&key, owner, Some(b"card declined"), true, expires, cx.now())
        .await?;
    let r = cx.record(&key).await?;
    ensure_eq!(r.status, Status::Failed);
    ensure_eq!(r.error.as_deref(), Some(&b"card declined"[..]));
    ensure_eq!(r.result, None);
    ensure_eq!(r.expires_at, expires);
    ensure_eq!(r.updated_at, cx.now());
    ensure_eq!((r.owner, r.attempt), (owner, 1));
    Ok(())
}

/// Another owner cannot fail the record; a completed record cannot be failed.
pub async fn check_fail_wrong_owner_or_state(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("fail-wrong");
    cx.acquire(&key).await?;
    lease_lost(
        cx.repo
            .fail(
                &key,
                OwnerToken::random(),
                None,
                true,
                cx.now() + TTL,
                cx.now(),
            )
            .await,
        "fail by a stranger",
    )?;
    ensure_eq!(cx.status(&key).await?, Some(Status::Processing));
    let (done, owner) = cx.completed("fail-done", Some(b"r")).await?;
    lease_lost(
        cx.repo
            .fail(&done, owner, None, true, cx.now() + TTL, cx.now())
            .await,
        "fail after complete",
    )?;
    ensure_eq!(cx.status(&done).await?, Some(Status::Completed));
    lease_lost(
        cx.repo
            .fail(
                &cx.key("fail-absent"),
                owner,
                None,
                true,
                cx.now() + TTL,
                cx.now(),
            )
            .await,
        "fail of an absent key",
    )
}

// ---------------------------------------------------------------- release / extend

/// The owner releases: the record is deleted — gone also for a caller whose
/// clock is behind (not merely expired at the releaser's instant), so
/// `delete` finds nothing — and the next reserve starts at attempt 1.
pub async fn check_release_by_owner(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("release");
    let owner = cx.acquire(&key).await?;
    cx.advance(Duration::from_secs(2));
    cx.repo.release(&key, owner, cx.now()).await?;
    ensure!(
        cx.repo.get(&key, cx.now()).await?.is_none(),
        "released record still visible"
    );
    let behind = cx.now() - Duration::from_secs(1);
    ensure!(
        cx.repo.get(&key, behind).await?.is_none(),
        "the released record is still visible to a caller whose clock is 1 s behind"
    );
    ensure!(
        !cx.repo.delete(&key).await?,
        "delete found the released record still stored"
    );
    cx.acquire(&key).await?;
    Ok(())
}

/// Release by a stranger, of a completed or failed record, or of an absent key
/// is refused and changes nothing.
pub async fn check_release_refused(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("release-wrong");
    cx.acquire(&key).await?;
    lease_lost(
        cx.repo.release(&key, OwnerToken::random(), cx.now()).await,
        "release by a stranger",
    )?;
    ensure_eq!(cx.status(&key).await?, Some(Status::Processing));
    let (done, owner) = cx.completed("release-done", Some(b"r")).await?;
    lease_lost(
        cx.repo.release(&done, owner, cx.now()).await,
        "release after complete",
    )?;
    ensure_eq!(cx.status(&done).await?, Some(Status::Completed));
    let (failed, owner) = cx.failed("release-failed", None).await?;
    lease_lost(
        cx.repo.release(&failed, owner, cx.now()).await,
        "release after fail",
    )?;
    ensure_eq!(cx.status(&failed).await?, Some(Status::Failed));
    lease_lost(
        cx.repo
            .release(&cx.key("release-absent"), owner, cx.now())
            .await,
        "release of an absent key",
    )
}

/// Releasing an expired record is refused (it is absent).
pub async fn check_release_expired(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("release-expired");
    let owner = cx.acquire(&key).await?;
    cx.advance(TTL);
    lease_lost(
        cx.repo.release(&key, owner, cx.now()).await,
        "release of an expired record",
    )
}

/// The owner extends the lease (stamping `updated_at`): a takeover at the old
/// lease end is refused.
pub async fn check_extend_by_owner(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("extend");
    let owner = cx.acquire(&key).await?;
    cx.advance(LEASE / 2);
    let until = cx.now() + LEASE;
    cx.repo.extend(&key, owner, until, until, cx.now()).await?;
    let r = cx.record(&key).await?;
    ensure_eq!(r.lease_until, until);
    ensure_eq!(r.status, Status::Processing);
    ensure_eq!(r.updated_at, cx.now(), "an extension sets updated_at");
    cx.advance(LEASE / 2);
    existing(
        cx.reserve(&key, OwnerToken::random()).await?,
        "at the old lease end",
    )?;
    cx.advance(LEASE / 2);
    ensure_eq!(
        cx.reserve(&key, OwnerToken::random()).await?,
        Reservation::Acquired { attempt: 2 },
        "at the extended lease end"
    );
    Ok(())
}

/// Extend by a stranger, of a finished record, or after a takeover is refused.
pub async fn check_extend_refused(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let key = cx.key("extend-wrong");
    let owner = cx.acquire(&key).await?;
    let before = cx.record(&key).await?;
    lease_lost(
        cx.repo
            .extend(
                &key,
                OwnerToken::random(),
                cx.now() + TTL,
                cx.now() + TTL,
                cx.now(),
            )
            .await,
        "extend by a stranger",
    )?;
    ensure_eq!(cx.record(&key).await?, before);
    cx.advance(LEASE);
    cx.reserve(&key, OwnerToken::random()).await?;
    lease_lost(
        cx.repo
            .extend(&key, owner, cx.now() + LEASE, cx.now() + LEASE, cx.now())
            .await,
        "extend after a takeover",
    )?;
    let (done, owner) = cx.completed("extend-done", None).await?;
    lease_lost(
        cx.repo
            .extend(&done, owner, cx.now() + LEASE, cx.now() + LEASE, cx.now())
            .await,
        "extend after complete",
    )?;
    let (failed, owner) = cx.failed("extend-failed", None).await?;
    lease_lost(
        cx.repo
            .extend(&failed, owner, cx.now() + LEASE, cx.now() + LEASE, cx.now())
            .await,
        "extend after fail",
    )?;
    let gone = cx.key("extend-expired");
    let owner = cx.acquire(&gone).await?;
    cx.advance(TTL);
    lease_lost(
        cx.repo
            .extend(&gone, owner, cx.now() + LEASE, cx.now() + LEASE, cx.now())
            .await,
        "extend of an expired record",
    )
}

// ---------------------------------------------------------------- get / delete / purge

/// `get` of an absent key is `None`; of an expired record too.
pub async fn check_get_absent_and_expired(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    ensure!(
        cx.repo.get(&cx.key("nothing"), cx.now()).await?.is_none(),
        "absent key"
    );
    let (key, _) = cx.completed("short", Some(b"r")).await?;
    ensure!(cx.repo.get(&key, cx.now()).await?.is_some(), "live record");
    cx.advance(TTL + Duration::from_secs(1));
    ensure!(
        cx.repo.get(&key, cx.now()).await?.is_none(),
        "expired record is absent"
    );
    Ok(())
}

/// How long the records of [`check_native_expiry_follows_every_write`] are
/// first stored for, by the store's own expiry.
const SHORT_NATIVE_TTL: Duration = Duration::from_millis(1500);

/// A store that expires records by itself (`native_expiry`: Redis key TTLs)
/// moves that expiry with every write that moves `expires_at`: a record
/// first stored for 1.5 s, then completed, failed, extended or taken over
/// with an expiry an hour away, is still stored 2.5 s later. A write that
/// kept the first TTL (`KEEPTTL`, a TTL attribute not updated) would let the
/// server drop a completed outcome, or a live lease, and a redelivery run the
/// handler again. The one check that waits in real time: the server's own
/// timer cannot be driven by the suite's clock.
pub async fn check_native_expiry_follows_every_write(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    if !cx.caps.native_expiry {
        return Ok(());
    }
    let t = cx.now();
    let later = t + Duration::from_secs(3600);
    let short = |key, now, lease_until| reserve_briefly(&cx, key, now, lease_until);
    let lease = t + Duration::from_secs(1);
    let completed = cx.key("ttl-completed");
    let owner = short(&completed, t, lease).await?;
    cx.repo
        .complete(&completed, owner, Some(b"r"), later, t)
        .await?;
    let failed = cx.key("ttl-failed");
    let owner = short(&failed, t, lease).await?;
    cx.repo
        .fail(&failed, owner, Some(b"e"), false, later, t)
        .await?;
    let extended = cx.key("ttl-extended");
    let owner = short(&extended, t, lease).await?;
    cx.repo.extend(&extended, owner, later, later, t).await?;
    // Written a second ago with a lease that ended half a second ago: taken
    // over now, with an expiry an hour away.
    let taken = cx.key("ttl-taken-over");
    let ago = t - Duration::from_secs(1);
    short(&taken, ago, ago + Duration::from_millis(500)).await?;
    let req = ReserveRequest {
        expires_at: later,
        ..cx.req(&taken, OwnerToken::random())
    };
    ensure_eq!(
        cx.repo.reserve(req).await?,
        Reservation::Acquired { attempt: 2 },
        "taking over {taken}"
    );
    // Real time, on purpose: the server's own timer is what is checked, and
    // no suite clock drives it (the suite's one real-time wait).
    tokio::time::sleep(SHORT_NATIVE_TTL + Duration::from_secs(1)).await;
    for (key, status) in [
        (&completed, Status::Completed),
        (&failed, Status::Failed),
        (&extended, Status::Processing),
        (&taken, Status::Processing),
    ] {
        ensure_eq!(
            cx.status(key).await?,
            Some(status),
            "{key} after its first expiry passed on the server, though a write moved it an hour away"
        );
    }
    Ok(())
}

/// Reserves `key` as of `now`, its lease ending at `lease_until`, stored for
/// [`SHORT_NATIVE_TTL`].
async fn reserve_briefly(
    cx: &Ctx,
    key: &RecordKey,
    now: Timestamp,
    lease_until: Timestamp,
) -> Result<OwnerToken, CheckFailure> {
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        now,
        lease_until,
        expires_at: now + SHORT_NATIVE_TTL,
        ..cx.req(key, owner)
    };
    cx.repo.reserve(req).await?;
    Ok(owner)
}

/// `delete` removes a record whatever its status and says whether one was
/// stored — also an expired one that no purge removed yet (in a store
/// without native expiry).
pub async fn check_delete(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let busy = cx.key("del-busy");
    cx.acquire(&busy).await?;
    let (done, _) = cx.completed("del-done", Some(b"r")).await?;
    let (failed, _) = cx.failed("del-failed", Some(b"e")).await?;
    for key in [&busy, &done, &failed] {
        ensure!(
            cx.repo.delete(key).await?,
            "delete of an existing record at {key} returned false"
        );
        ensure!(
            cx.repo.get(key, cx.now()).await?.is_none(),
            "deleted record visible"
        );
        ensure!(!cx.repo.delete(key).await?, "second delete returned true");
        cx.acquire(key).await?;
    }
    ensure!(
        !cx.repo.delete(&cx.key("del-absent")).await?,
        "delete of an absent key"
    );
    if !cx.caps.native_expiry {
        // Expired an hour ago by its writer's clock, and by the server's,
        // but stored until a purge: `delete` acts on what is stored.
        let stored = cx.key("del-expired");
        let long_ago = cx.now() - Duration::from_secs(7200);
        let req = ReserveRequest {
            now: long_ago,
            lease_until: long_ago + LEASE,
            expires_at: long_ago + TTL,
            ..cx.req(&stored, OwnerToken::random())
        };
        cx.repo.reserve(req).await?;
        ensure!(
            cx.repo.delete(&stored).await?,
            "delete of an expired record still stored (no native expiry) returned false"
        );
        ensure!(
            !cx.repo.delete(&stored).await?,
            "second delete of the expired record returned true"
        );
    }
    Ok(())
}

/// `purge_expired` removes expired records — those with `expires_at <= now`,
/// only those, at most `limit` a call (none for a limit of 0); backends with
/// native expiry may leave that to the server.
pub async fn check_purge_expired(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    // Work two hours in the past so that this purge can only reach records that
    // expired before any other check's (they all start at the wall clock).
    cx.clock.set(cx.now() - Duration::from_secs(7200));
    let start = cx.now();
    let short = Duration::from_secs(60);
    let mut expired = Vec::new();
    for i in 0..5 {
        let key = cx.key(&format!("purge-{i}"));
        let owner = OwnerToken::random();
        let req = ReserveRequest {
            expires_at: start + short,
            lease_until: start + short,
            ..cx.req(&key, owner)
        };
        cx.repo.reserve(req).await?;
        if i % 2 == 0 {
            cx.repo
                .complete(&key, owner, Some(b"r"), start + short, start)
                .await?;
        }
        expired.push(key);
    }
    let keep = cx.key("purge-keep");
    cx.acquire(&keep).await?;
    let purge_at = start + short + Duration::from_secs(1);
    // Expired at the purge, exactly.
    let exact = cx.key("purge-exact");
    let req = ReserveRequest {
        expires_at: purge_at,
        lease_until: purge_at,
        ..cx.req(&exact, OwnerToken::random())
    };
    cx.repo.reserve(req).await?;
    expired.push(exact);
    // Live at the purge: a record expiring one millisecond after it, whose
    // lease (a Processing record's) ended before it.
    let edge = cx.key("purge-edge");
    let req = ReserveRequest {
        expires_at: purge_at + Duration::from_millis(1),
        lease_until: start + short,
        ..cx.req(&edge, OwnerToken::random())
    };
    cx.repo.reserve(req).await?;
    cx.clock.set(purge_at);
    let nothing = cx.repo.purge_expired(purge_at, 0).await?;
    ensure_eq!(nothing, 0, "purge_expired(limit = 0) removes nothing");
    if !cx.caps.native_expiry {
        for key in &expired {
            ensure!(
                cx.repo.get(key, start).await?.is_some(),
                "{key} is gone after purge_expired(limit = 0)"
            );
        }
    }
    let first = cx.repo.purge_expired(purge_at, 2).await?;
    ensure!(first <= 2, "purge_expired(limit = 2) removed {first}");
    let mut total = first;
    for _ in 0..1000 {
        let n = cx.repo.purge_expired(purge_at, 100).await?;
        total += n;
        if n == 0 {
            break;
        }
    }
    if !cx.caps.native_expiry {
        ensure!(
            total >= expired.len(),
            "purged {total}, expected at least {}",
            expired.len()
        );
        for key in &expired {
            // Seen from before their expiry, purged records are physically gone.
            ensure!(
                cx.repo.get(key, start).await?.is_none(),
                "{key} survived purge_expired"
            );
        }
    }
    ensure!(
        cx.repo.get(&keep, purge_at).await?.is_some(),
        "purge removed a live record"
    );
    ensure!(
        cx.repo.get(&edge, purge_at).await?.is_some(),
        "purge removed a Processing record expiring 1 ms after the purge instant"
    );
    purge_races_recreate(&cx, start, purge_at).await?;
    for key in &expired {
        ensure!(
            cx.repo.get(key, purge_at).await?.is_none(),
            "expired record visible"
        );
    }
    Ok(())
}

/// Expired records re-created while a purge runs: every re-created record
/// survives the purge. Three rounds, the racers joined in one task and
/// interleaving at every await point: the purge polled first, the
/// re-creations first (a store whose `reserve` is a read then a
/// compare-and-swap has read before the purge lists), then both spawned on
/// separate threads behind a barrier. A purge that lists expired keys, then
/// deletes those keys without checking their expiry again, deletes a
/// re-created record in the first or second round, whatever the store's
/// `reserve` looks like.
async fn purge_races_recreate(cx: &Ctx, start: Timestamp, purge_at: Timestamp) -> CheckResult {
    for order in [
        RaceOrder::PurgeFirst,
        RaceOrder::RecreateFirst,
        RaceOrder::Spawned,
    ] {
        purge_race_round(cx, start, purge_at, order).await?;
    }
    Ok(())
}

/// Which racer a race check polls first.
#[derive(Debug, Clone, Copy)]
enum RaceOrder {
    PurgeFirst,
    RecreateFirst,
    Spawned,
}

async fn purge_race_round(
    cx: &Ctx,
    start: Timestamp,
    purge_at: Timestamp,
    order: RaceOrder,
) -> CheckResult {
    let keys: Vec<RecordKey> = (0..8)
        .map(|i| cx.key(&format!("purge-race-{order:?}-{i}")))
        .collect();
    for key in &keys {
        let req = ReserveRequest {
            now: start,
            lease_until: start + Duration::from_secs(1),
            expires_at: start + Duration::from_secs(2),
            ..cx.req(key, OwnerToken::random())
        };
        cx.repo.reserve(req).await?;
    }
    let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let (purged, recreated) = match order {
        RaceOrder::PurgeFirst => {
            futures::future::join(
                purge_each(cx, purge_at, keys.len()),
                recreate_all(cx, &keys, &owners),
            )
            .await
        }
        RaceOrder::RecreateFirst => {
            let (r, p) = futures::future::join(
                recreate_all(cx, &keys, &owners),
                purge_each(cx, purge_at, keys.len()),
            )
            .await;
            (p, r)
        }
        RaceOrder::Spawned => {
            let start = Arc::new(tokio::sync::Barrier::new(2));
            let purge = {
                let (repo, start, n) = (cx.repo.clone(), start.clone(), keys.len());
                tokio::spawn(async move {
                    start.wait().await;
                    for _ in 0..n {
                        repo.purge_expired(purge_at, 1).await?;
                        tokio::task::yield_now().await;
                    }
                    Ok::<_, Error>(())
                })
            };
            let recreate = {
                let (repo, keys, owners) = (cx.repo.clone(), keys.clone(), owners.clone());
                let now = cx.now();
                tokio::spawn(async move {
                    start.wait().await;
                    join_all(keys.iter().zip(&owners).map(|(key, owner)| {
                        repo.reserve(ReserveRequest::new(key, *owner, now, LEASE, TTL))
                    }))
                    .await
                })
            };
            let p = purge.await.map_err(|e| failure(e.to_string()))?;
            let r = recreate.await.map_err(|e| failure(e.to_string()))?;
            (p, r)
        }
    };
    purged?;
    for ((key, answer), owner) in keys.iter().zip(recreated).zip(owners) {
        ensure_eq!(
            answer?,
            Reservation::Acquired { attempt: 1 },
            "{order:?}: {key}"
        );
        let r = cx.repo.get(key, purge_at).await?;
        ensure!(
            r.is_some_and(|r| r.owner == owner),
            "{order:?}: the record re-created at {key} during a purge is gone"
        );
    }
    Ok(())
}

/// `n` purges of at most one record each, a scheduler trip between them.
async fn purge_each(cx: &Ctx, purge_at: Timestamp, n: usize) -> Result<(), Error> {
    for _ in 0..n {
        cx.repo.purge_expired(purge_at, 1).await?;
        tokio::task::yield_now().await;
    }
    Ok(())
}

/// One `reserve` of each key by its owner, all joined.
async fn recreate_all(
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

// ---------------------------------------------------------------- keys

const ADVERSARIAL: &[&str] = &[
    "a",
    ":",
    "a:b",
    "a:",
    ":a",
    "::",
    "#",
    "a#b",
    "/",
    "a/b",
    "{",
    "}",
    "{tag}",
    "%",
    "%3A",
    "\\",
    "\0",
    "a\0b",
    "\n",
    "\r\n",
    "\t",
    "\u{7f}",
    "\u{1b}[0m",
    "é",
    "e\u{301}",
    "日本",
    "🦀",
    "'",
    "\"",
    "' OR 1=1 --",
    " ",
    "a b",
    "*",
    "?",
];

/// The stored key is injective over (namespace, id) for adversarial strings: no
/// two pairs share a record.
pub async fn check_adversarial_keys_are_distinct(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let namespaces: Vec<String> = ["", ":", "a", "a:b", "{x}", "%", "\0", "é/#"]
        .iter()
        .map(|s| format!("{}{s}", cx.ns))
        .collect();
    let keys: Vec<RecordKey> = namespaces
        .iter()
        .flat_map(|ns| ADVERSARIAL.iter().map(|id| cx.key_in(ns, id)))
        .collect();
    cx.assert_distinct(&keys).await
}

/// Ids up to the store's limit are kept verbatim; longer ones are digested to
/// distinct keys that work like any other.
pub async fn check_long_ids(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let max = cx.caps.max_id_bytes;
    ensure!(
        max >= 71,
        "max_id_bytes ({max}) must hold a digest (71 bytes)"
    );
    let exact = "x".repeat(max);
    let key = cx.key(&exact);
    ensure!(!key.is_digested(), "an id of exactly max_id_bytes is kept");
    cx.acquire(&key).await?;
    let long_a = format!("{}a", "y".repeat(10 * 1024));
    let long_b = format!("{}b", "y".repeat(10 * 1024));
    let (a, b) = (cx.key(&long_a), cx.key(&long_b));
    ensure!(
        a.is_digested() && b.is_digested(),
        "10 KiB ids are digested"
    );
    cx.acquire(&a).await?;
    cx.acquire(&b).await?;
    existing(
        cx.reserve(&cx.key(&long_a), OwnerToken::random()).await?,
        "same long id",
    )?;
    Ok(())
}

/// Namespaces isolate: the same id in two namespaces is two records; `get`
/// and `delete` of one never reach the other's.
pub async fn check_namespaces_isolate(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let a = cx.key_in(&format!("{}-a", cx.ns), "same");
    let b = cx.key_in(&format!("{}-b", cx.ns), "same");
    let c = cx.key_in(&format!("{}-c", cx.ns), "same");
    let owner = cx.acquire(&a).await?;
    cx.repo
        .complete(&a, owner, Some(b"a's"), cx.now() + TTL, cx.now())
        .await?;
    for absent in [&b, &c] {
        let got = cx.repo.get(absent, cx.now()).await?;
        ensure!(
            got.is_none(),
            "get of {absent} returned {a}'s record: {got:?}"
        );
    }
    cx.acquire(&b).await?;
    ensure!(!cx.repo.delete(&c).await?, "delete of {c} found a record");
    ensure!(
        cx.repo.get(&a, cx.now()).await?.is_some() && cx.repo.get(&b, cx.now()).await?.is_some(),
        "deleting the absent {c} removed another namespace's record"
    );
    ensure!(cx.repo.delete(&a).await?, "delete a");
    ensure!(
        cx.repo.get(&b, cx.now()).await?.is_some(),
        "deleting a removed b"
    );
    prefix_namespaces_isolate(&cx).await
}

/// Namespaces one of which is a prefix of the other (`ns` and `ns2`, `a:`
/// and `a:b`): the same id in the longer one is not found through the
/// shorter one, nor the other way round (a lookup by `LIKE 'ns%'` or
/// `SCAN MATCH ns*`).
async fn prefix_namespaces_isolate(cx: &Ctx) -> CheckResult {
    for (short, long) in [("p", "p2"), ("q:", "q:b"), ("r", "r:")] {
        let short = cx.key_in(&format!("{}-{short}", cx.ns), "same");
        let long = cx.key_in(&format!("{}-{long}", cx.ns), "same");
        for (held, absent) in [(&long, &short), (&short, &long)] {
            let owner = cx.acquire(held).await?;
            cx.repo
                .complete(held, owner, Some(b"held"), cx.now() + TTL, cx.now())
                .await?;
            let got = cx.repo.get(absent, cx.now()).await?;
            ensure!(
                got.is_none(),
                "get of {absent} returned {held}'s record: {got:?}"
            );
            ensure!(cx.repo.delete(held).await?, "delete {held}");
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- concurrency

/// Many tasks reserve one key at once: exactly one acquires; the others see the
/// winner.
pub async fn check_concurrent_reserve_single_winner(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    for round in 0..5 {
        let key = cx.key(&format!("race-{round}"));
        let tasks = (0..32).map(|_| {
            let (cx, key) = (cx.clone(), key.clone());
            tokio::spawn(async move {
                let owner = OwnerToken::random();
                cx.reserve_answered(&key, owner).await.map(|r| (owner, r))
            })
        });
        let results = join_all(tasks).await;
        let mut winners = Vec::new();
        let mut seen_owners = HashSet::new();
        for r in results {
            let (owner, res) = r.map_err(|e| failure(format!("task panicked: {e}")))??;
            match res {
                Reservation::Acquired { attempt } => {
                    ensure_eq!(attempt, 1);
                    winners.push(owner);
                }
                Reservation::Existing(rec) => {
                    seen_owners.insert(rec.owner);
                }
            }
        }
        ensure_eq!(winners.len(), 1, "round {round}: exactly one winner");
        ensure!(
            seen_owners.iter().all(|o| *o == winners[0]),
            "losers must see the winner's record"
        );
        ensure_eq!(cx.record(&key).await?.owner, winners[0]);
    }
    Ok(())
}

/// Many keys, each delivered many times concurrently: one winner per key.
pub async fn check_concurrent_many_keys(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    let keys: Vec<RecordKey> = (0..25).map(|i| cx.key(&format!("many-{i}"))).collect();
    let wins = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for key in &keys {
        for _ in 0..8 {
            let (cx, key, wins) = (cx.clone(), key.clone(), wins.clone());
            tasks.push(tokio::spawn(async move {
                let owner = OwnerToken::random();
                if let Reservation::Acquired { .. } = cx.reserve_answered(&key, owner).await? {
                    wins.fetch_add(1, Ordering::SeqCst);
                    let result = key.id().as_bytes().to_vec();
                    cx.repo
                        .complete(&key, owner, Some(&result), cx.now() + TTL, cx.now())
                        .await?;
                }
                Ok::<_, Error>(())
            }));
        }
    }
    for r in join_all(tasks).await {
        r.map_err(|e| failure(format!("task panicked: {e}")))??;
    }
    ensure_eq!(
        wins.load(Ordering::SeqCst),
        keys.len(),
        "one winner per key"
    );
    for key in &keys {
        let r = cx.record(key).await?;
        ensure_eq!(r.status, Status::Completed);
        ensure_eq!(r.result.as_deref(), Some(key.id().as_bytes()));
    }
    Ok(())
}

/// Many tasks race to take over one stale lease: exactly one wins.
pub async fn check_concurrent_takeover_single_winner(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    for round in 0..5 {
        let key = cx.key(&format!("takeover-{round}"));
        cx.acquire(&key).await?;
        cx.advance(LEASE);
        let tasks = (0..16).map(|_| {
            let (cx, key) = (cx.clone(), key.clone());
            tokio::spawn(async move {
                let owner = OwnerToken::random();
                cx.reserve_answered(&key, owner).await.map(|r| (owner, r))
            })
        });
        let mut winners = Vec::new();
        for r in join_all(tasks).await {
            let (owner, res) = r.map_err(|e| failure(format!("task panicked: {e}")))??;
            if let Reservation::Acquired { attempt } = res {
                ensure_eq!(attempt, 2);
                winners.push(owner);
            }
        }
        ensure_eq!(winners.len(), 1, "round {round}: exactly one takeover");
        let r = cx.record(&key).await?;
        ensure_eq!((r.owner, r.attempt), (winners[0], 2));
    }
    Ok(())
}

/// The old owner completing while others take over: exactly one of them holds
/// the outcome, never both.
pub async fn check_complete_races_takeover(repo: SharedRepository) -> CheckResult {
    let cx = Arc::new(Ctx::new(repo));
    for round in 0..10 {
        let key = cx.key(&format!("complete-race-{round}"));
        let old = cx.acquire(&key).await?;
        cx.advance(LEASE);
        let completer = {
            let (cx, key) = (cx.clone(), key.clone());
            tokio::spawn(async move {
                cx.repo
                    .complete(&key, old, Some(b"old"), cx.now() + TTL, cx.now())
                    .await
            })
        };
        let taker = {
            let (cx, key) = (cx.clone(), key.clone());
            tokio::spawn(async move { cx.repo.reserve(cx.req(&key, OwnerToken::random())).await })
        };
        let completed = completer.await.map_err(|e| failure(e.to_string()))?;
        let taken = taker.await.map_err(|e| failure(e.to_string()))??;
        match (&completed, &taken) {
            (Ok(()), Reservation::Existing(r)) => {
                ensure_eq!(r.status, Status::Completed, "the taker saw the completion")
            }
            (Err(Error::LeaseLost { .. }), Reservation::Acquired { attempt: 2 }) => {}
            other => {
                return Err(failure(format!(
                    "round {round}: inconsistent outcome {other:?}"
                )))
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- the manager over the repository

fn ok<T>(v: T) -> Result<T, HandlerError<String>> {
    Ok(v)
}

/// The manager runs a key's handler once and replays the cached result.
pub async fn check_manager_executes_once_and_replays(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    let runs = AtomicUsize::new(0);
    let payload = serde_json::json!({"amount": 5});
    for delivery in 0..3 {
        let out = m
            .execute("evt-1", &payload, || async {
                runs.fetch_add(1, Ordering::SeqCst);
                ok(vec![1u8, 0, 255])
            })
            .await
            .map_err(|e| failure(format!("delivery {delivery}: {e}")))?;
        ensure_eq!(
            out.handler_ran(),
            delivery == 0,
            "delivery {delivery}: {out:?}"
        );
        ensure_eq!(out.into_value(), Some(vec![1u8, 0, 255]));
    }
    ensure_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}

/// With result caching off, duplicates are `Duplicate` and the handler still
/// runs once.
pub async fn check_manager_duplicate_without_cache(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        cache_results: false,
        ..Config::default()
    })?;
    let first = m
        .execute("k", &(), || async { ok(1) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(first, idempotency_core::Outcome::Executed(1)),
        "{first:?}"
    );
    let again = m
        .execute("k", &(), || async { ok(2) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(again, idempotency_core::Outcome::Duplicate),
        "{again:?}"
    );
    Ok(())
}

/// A result larger than the cache limit completes without a cached result.
pub async fn check_manager_oversized_result_not_cached(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        max_result_size_bytes: 64,
        ..Config::default()
    })?;
    let big = "z".repeat(1000);
    let first = m
        .execute("big", &(), || async { ok(big.clone()) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(&first, idempotency_core::Outcome::Executed(v) if *v == big),
        "{first:?}"
    );
    let again = m
        .execute("big", &(), || async { ok(String::new()) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(again, idempotency_core::Outcome::Duplicate),
        "protected, not cached: {again:?}"
    );
    Ok(())
}

/// A result over the store's own limit is completed without cache, not failed.
pub async fn check_manager_result_over_store_limit(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let Some(max) = cx.caps.max_result_bytes else {
        return Ok(());
    };
    let m = cx.manager(Config {
        max_result_size_bytes: usize::MAX,
        ..Config::default()
    })?;
    // A JSON string of max + 1 bytes once quoted.
    let big = "q".repeat(max);
    let first = m
        .execute("store-limit", &(), || async { ok(big.clone()) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(first, idempotency_core::Outcome::Executed(_)),
        "{first:?}"
    );
    let again = m
        .execute("store-limit", &(), || async { ok(String::new()) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(again, idempotency_core::Outcome::Duplicate),
        "{again:?}"
    );
    Ok(())
}

/// A duplicate while the first delivery runs gets `InProgress` with a
/// `retry_after` within the lease.
pub async fn check_manager_in_progress_fail_fast(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        processing_timeout: Duration::from_secs(30),
        ..Config::default()
    })?;
    let first = Held::start(&m, "slow", 1).await?;
    let dup = m.execute("slow", &(), || async { ok(2) }).await;
    match dup {
        Err(ExecuteError::Idempotency(Error::InProgress { retry_after, .. })) => {
            ensure!(
                retry_after <= Duration::from_secs(30) && retry_after > Duration::ZERO,
                "retry_after {retry_after:?} outside the lease"
            )
        }
        other => return Err(failure(format!("duplicate in flight gave {other:?}"))),
    }
    let out = first.finish().await?;
    ensure!(
        matches!(out, idempotency_core::Outcome::Executed(1)),
        "{out:?}"
    );
    Ok(())
}

/// With the wait policy, a duplicate waits for the first delivery and replays its
/// result.
pub async fn check_manager_in_progress_wait(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        in_progress: InProgressPolicy::Wait {
            timeout: Duration::from_secs(20),
            poll_interval: Duration::from_millis(10),
        },
        ..Config::default()
    })?;
    let first = Held::start(&m, "waited", 41).await?;
    let waiter = {
        let m = m.clone();
        tokio::spawn(async move { m.execute("waited", &(), || async { ok(0) }).await })
    };
    first.finish().await?;
    let out = waiter
        .await
        .map_err(|e| failure(e.to_string()))?
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(out, idempotency_core::Outcome::Cached(41)),
        "the waiter replays: {out:?}"
    );
    Ok(())
}

/// The same key with another payload is refused with `PayloadMismatch`.
pub async fn check_manager_payload_mismatch(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    m.execute("pay", &serde_json::json!({"amount": 1}), || async {
        ok(())
    })
    .await
    .map_err(|e| failure(e.to_string()))?;
    let r = m
        .execute("pay", &serde_json::json!({"amount": 2}), || async {
            ok(())
        })
        .await;
    ensure!(
        matches!(
            r,
            Err(ExecuteError::Idempotency(Error::PayloadMismatch { .. }))
        ),
        "{r:?}"
    );
    // Key order does not make a payload different.
    let same = m
        .execute("obj", &serde_json::json!({"a": 1, "b": 2}), || async {
            ok(())
        })
        .await;
    ensure!(same.is_ok(), "{same:?}");
    let reordered = m
        .execute("obj", &serde_json::json!({"b": 2, "a": 1}), || async {
            ok(())
        })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(reordered.is_duplicate(), "{reordered:?}");
    Ok(())
}

/// Default failure policy: a handler error releases the key and the redelivery
/// runs the handler again.
pub async fn check_manager_release_on_error(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    let r = m
        .execute("flaky", &(), || async {
            Err::<u8, _>(HandlerError::new("down".to_owned()))
        })
        .await;
    ensure!(
        matches!(r, Err(ExecuteError::Handler(ref e)) if e == "down"),
        "{r:?}"
    );
    ensure!(
        cx.repo
            .get(&m.record_key("flaky")?, cx.now())
            .await?
            .is_none(),
        "record released"
    );
    let again = m.execute("flaky", &(), || async { ok(7u8) }).await;
    ensure!(
        matches!(again, Ok(idempotency_core::Outcome::Executed(7))),
        "{again:?}"
    );
    Ok(())
}

/// Store policy: the failure is stored; duplicates get `PreviouslyFailed` with
/// the error, and the handler does not run again.
pub async fn check_manager_stored_failure(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        failure_policy: FailurePolicy::Store,
        ..Config::default()
    })?;
    let _ = m
        .execute("declined", &(), || async {
            Err::<u8, _>(HandlerError::new("card declined".to_owned()))
        })
        .await;
    let runs = AtomicUsize::new(0);
    let r = m
        .execute("declined", &(), || async {
            runs.fetch_add(1, Ordering::SeqCst);
            ok(1u8)
        })
        .await;
    match r {
        Err(ExecuteError::Idempotency(Error::PreviouslyFailed { error, .. })) => {
            ensure_eq!(error, b"card declined".to_vec())
        }
        other => return Err(failure(format!("expected PreviouslyFailed, got {other:?}"))),
    }
    ensure_eq!(runs.load(Ordering::SeqCst), 0);
    Ok(())
}

/// Store-and-retry policy: the failure is stored, and the next delivery runs
/// again (attempt 2).
pub async fn check_manager_store_and_retry(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        failure_policy: FailurePolicy::StoreAndRetry,
        ..Config::default()
    })?;
    let _ = m
        .execute("retry", &(), || async {
            Err::<u8, _>(HandlerError::new("boom".to_owned()))
        })
        .await;
    ensure_eq!(
        cx.record(&m.record_key("retry")?).await?.status,
        Status::Failed
    );
    let again = m.execute("retry", &(), || async { ok(3u8) }).await;
    ensure!(
        matches!(again, Ok(idempotency_core::Outcome::Executed(3))),
        "{again:?}"
    );
    ensure_eq!(cx.record(&m.record_key("retry")?).await?.attempt, 2);
    Ok(())
}

/// Per-call classification overrides the policy: transient releases, permanent
/// stores.
pub async fn check_manager_error_classification(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let store = cx.manager(Config {
        failure_policy: FailurePolicy::Store,
        ..Config::default()
    })?;
    let _ = store
        .execute("t", &(), || async {
            Err::<u8, _>(HandlerError::transient("timeout".to_owned()))
        })
        .await;
    ensure!(
        cx.repo
            .get(&store.record_key("t")?, cx.now())
            .await?
            .is_none(),
        "transient releases"
    );
    let release = cx.manager(Config::default())?;
    let _ = release
        .execute("p", &(), || async {
            Err::<u8, _>(HandlerError::permanent("invalid".to_owned()))
        })
        .await;
    ensure_eq!(
        cx.record(&release.record_key("p")?).await?.status,
        Status::Failed,
        "permanent stores"
    );
    Ok(())
}

/// A consumer crashed mid-handler (its record stays `Processing`): after the
/// lease, the redelivery takes over and runs; the crashed owner is fenced off.
pub async fn check_manager_takeover_after_crash(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        processing_timeout: LEASE,
        ..Config::default()
    })?;
    let key = m.record_key("crash")?;
    let crashed = OwnerToken::random();
    cx.repo.reserve(cx.req(&key, crashed)).await?;
    let early = m.execute("crash", &(), || async { ok(1) }).await;
    ensure!(
        matches!(
            early,
            Err(ExecuteError::Idempotency(Error::InProgress { .. }))
        ),
        "{early:?}"
    );
    cx.advance(LEASE);
    let late = m.execute("crash", &(), || async { ok(2) }).await;
    ensure!(
        matches!(late, Ok(idempotency_core::Outcome::Executed(2))),
        "{late:?}"
    );
    ensure_eq!(cx.record(&key).await?.attempt, 2);
    lease_lost(
        cx.repo
            .complete(&key, crashed, None, cx.now() + TTL, cx.now())
            .await,
        "the crashed owner coming back",
    )
}

/// A handler that outlives its lease and is taken over gets `LeaseLost` with its
/// value, and the record is the new owner's.
pub async fn check_manager_reports_lease_lost(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        processing_timeout: LEASE,
        ..Config::default()
    })?;
    let key = m.record_key("slowpoke")?;
    let thief = OwnerToken::random();
    let taken = std::sync::Mutex::new(None);
    let out = m
        .execute("slowpoke", &(), || async {
            cx.advance(LEASE);
            let r = cx.repo.reserve(cx.req(&key, thief)).await;
            if let Ok(mut slot) = taken.lock() {
                *slot = Some(r);
            }
            ok(5)
        })
        .await
        .map_err(|e| failure(e.to_string()))?;
    let taken = taken.lock().map_err(|_| failure("poisoned"))?.take();
    ensure!(
        matches!(taken, Some(Ok(Reservation::Acquired { attempt: 2 }))),
        "takeover during the handler: {taken:?}"
    );
    ensure!(
        matches!(out, idempotency_core::Outcome::LeaseLost(5)),
        "{out:?}"
    );
    ensure_eq!(cx.record(&key).await?.owner, thief);
    Ok(())
}

/// Keys: empty → `InvalidKey`; 10 KiB → digested and still protected.
pub async fn check_manager_key_validation(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    let empty = m.execute("", &(), || async { ok(1) }).await;
    ensure!(
        matches!(
            empty,
            Err(ExecuteError::Idempotency(Error::InvalidKey { .. }))
        ),
        "{empty:?}"
    );
    let long = "k".repeat(10 * 1024);
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        m.execute(&long, &(), || async {
            runs.fetch_add(1, Ordering::SeqCst);
            ok(1)
        })
        .await
        .map_err(|e| failure(e.to_string()))?;
    }
    ensure_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}

/// Many concurrent deliveries of one key through the manager: the handler runs
/// exactly once; the others replay or are told it is in progress.
pub async fn check_manager_concurrent_deliveries(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    let runs = Arc::new(AtomicUsize::new(0));
    for round in 0..3 {
        let key = format!("burst-{round}");
        let tasks = (0..24).map(|_| {
            let (m, runs, key) = (m.clone(), runs.clone(), key.clone());
            tokio::spawn(async move {
                m.execute(&key, &(), || async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    ok(round)
                })
                .await
            })
        });
        for r in join_all(tasks).await {
            match r.map_err(|e| failure(e.to_string()))? {
                Ok(out) => ensure!(out.value() == Some(&round), "{out:?}"),
                Err(ExecuteError::Idempotency(Error::InProgress { .. })) => {}
                Err(e) => return Err(failure(format!("unexpected {e:?}"))),
            }
        }
    }
    ensure_eq!(runs.load(Ordering::SeqCst), 3, "one run per key");
    Ok(())
}

fn panicking_handler() -> Result<i32, HandlerError<String>> {
    panic!("handler panicked (expected by the conformance suite)")
}

/// A panicking handler releases its record (no poisoned key): the redelivery
/// runs.
pub async fn check_manager_panic_releases(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    let task = {
        let m = m.clone();
        tokio::spawn(async move {
            m.execute("panics", &(), || async { panicking_handler() })
                .await
        })
    };
    ensure!(task.await.is_err(), "the panic propagates to the caller");
    let again = m.execute("panics", &(), || async { ok(9) }).await;
    ensure!(
        matches!(again, Ok(idempotency_core::Outcome::Executed(9))),
        "{again:?}"
    );
    Ok(())
}

/// Expiry is driven by the caller's clock only: after the TTL, the same key runs
/// again.
pub async fn check_manager_ttl_expiry(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config {
        ttl: Duration::from_secs(600),
        processing_timeout: Duration::from_secs(60),
        ..Config::default()
    })?;
    m.execute("ttl", &(), || async { ok(1) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    cx.advance(Duration::from_secs(599));
    let dup = m
        .execute("ttl", &(), || async { ok(2) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(dup.is_duplicate(), "within the TTL: {dup:?}");
    cx.advance(Duration::from_secs(1));
    let again = m
        .execute("ttl", &(), || async { ok(3) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(
        matches!(again, idempotency_core::Outcome::Executed(3)),
        "after the TTL: {again:?}"
    );
    Ok(())
}

/// Scoped managers keep the same id apart.
pub async fn check_manager_scopes_isolate(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo);
    let m = cx.manager(Config::default())?;
    let (a, b) = (m.scoped("email")?, m.scoped("ship")?);
    let x = a
        .execute("evt", &(), || async { ok(1) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    let y = b
        .execute("evt", &(), || async { ok(2) })
        .await
        .map_err(|e| failure(e.to_string()))?;
    ensure!(x.handler_ran() && y.handler_ran(), "{x:?} {y:?}");
    Ok(())
}

/// The in-memory store's declared capabilities are coherent (every backend).
pub async fn check_capabilities_are_coherent(repo: SharedRepository) -> CheckResult {
    let caps = repo.capabilities();
    ensure!(!caps.backend.is_empty(), "backend name");
    ensure!(
        caps.max_id_bytes >= 71,
        "max_id_bytes {}",
        caps.max_id_bytes
    );
    if let Some(max) = caps.max_result_bytes {
        ensure!(
            max >= 1024,
            "a store should hold at least 1 KiB results, declares {max}"
        );
    }
    Ok(())
}
