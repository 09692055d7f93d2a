//! The repository contract's v2 points against the harness's Redis server, with
//! both reserve strategies (`SET … NX … GET` with the script for takeovers, and
//! the script for everything), each checked on the stored bytes and the key's
//! TTL as well as through the repository:
//!
//! 1. `fail` remembers `retryable` (flag bit 3), and only on a `Failed` record;
//! 2. `extend` raises the lease and `expires_at` to `max(stored, given)` and
//!    the key's TTL with it, never lowering any of them;
//! 3. a `reserve` re-sent by the owner of the live `Processing` record is
//!    `Acquired` with the stored attempt, writes nothing, and comes before the
//!    fingerprint check;
//! 4. `reserve` takes over a `Failed` record only when `retry_failed` and the
//!    record is retryable;
//! 5. a takeover keeps the stored fingerprint when the request has none, and
//!    clears `retryable`.
//!
//! Time is a [`ManualClock`]: instants are passed explicitly, nothing sleeps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idempotency_conformance::containers;
use idempotency_core::{
    Error, Fingerprint, ManualClock, OwnerToken, Record, RecordKey, Repository, Reservation,
    ReserveRequest, Status, Timestamp,
};
use idempotency_redis::{redis, RedisRepository, ReserveStrategy};

const TTL: Duration = Duration::from_secs(3600);
const LEASE: Duration = Duration::from_secs(30);
const STRATEGIES: [ReserveStrategy; 2] = [ReserveStrategy::SetNxGet, ReserveStrategy::Script];

/// Flag bits of the stored record (byte 54), as documented in the crate docs.
const FLAG_FINGERPRINT: u8 = 1;
const FLAG_ERROR: u8 = 4;
const FLAG_RETRYABLE: u8 = 8;

struct Fixture {
    repo: RedisRepository,
    admin: redis::aio::MultiplexedConnection,
    clock: ManualClock,
    strategy: ReserveStrategy,
}

async fn fixture(strategy: ReserveStrategy) -> Fixture {
    let server = containers::redis()
        .await
        .expect("a Redis server from the harness (see docs/testing.md)");
    let repo = RedisRepository::connect(server.url())
        .await
        .expect("connect to the harness's Redis server")
        .with_reserve_strategy(strategy);
    let admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    Fixture {
        repo,
        admin,
        clock: ManualClock::starting_now(),
        strategy,
    }
}

fn key(id: &str) -> RecordKey {
    RecordKey::new(containers::unique_namespace("redis-contract"), id, 256).unwrap()
}

fn fp(b: u8) -> Option<Fingerprint> {
    Some(Fingerprint::from_bytes([b; 32]))
}

impl Fixture {
    fn now(&self) -> Timestamp {
        self.clock.now()
    }

    fn request<'a>(&self, key: &'a RecordKey, owner: OwnerToken) -> ReserveRequest<'a> {
        let now = self.now();
        ReserveRequest::new(key, owner, now, LEASE, TTL)
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Reservation {
        self.repo.reserve(req).await.unwrap()
    }

    async fn acquire(&self, key: &RecordKey, owner: OwnerToken, fingerprint: Option<Fingerprint>) {
        let req = ReserveRequest {
            fingerprint,
            ..self.request(key, owner)
        };
        assert_eq!(
            self.reserve(req).await,
            Reservation::Acquired { attempt: 1 },
            "{:?}",
            self.strategy
        );
    }

    async fn record(&self, key: &RecordKey) -> Record {
        self.repo
            .get(key, self.now())
            .await
            .unwrap()
            .expect("a live record")
    }

    async fn raw(&mut self, key: &RecordKey) -> Vec<u8> {
        redis::cmd("GET")
            .arg(RedisRepository::redis_key(key))
            .query_async(&mut self.admin)
            .await
            .unwrap()
    }

    async fn pttl(&mut self, key: &RecordKey) -> i64 {
        redis::cmd("PTTL")
            .arg(RedisRepository::redis_key(key))
            .query_async(&mut self.admin)
            .await
            .unwrap()
    }
}

/// Contract points 1 and 4: `fail` stores `retryable` (bit 3 of the flags, with
/// or without an error); a `Failed` record is taken over exactly when the
/// request has `retry_failed` and the record is retryable, and a refused
/// takeover leaves the stored bytes as they were. `complete` never sets the bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_remembers_retryable_and_gates_the_takeover() {
    for strategy in STRATEGIES {
        let mut f = fixture(strategy).await;
        for retryable in [false, true] {
            for error in [None, Some(&b"\0declined\xff"[..])] {
                let k = key("failed");
                let owner = OwnerToken::random();
                f.acquire(&k, owner, None).await;
                f.repo
                    .fail(&k, owner, error, retryable, f.now() + TTL, f.now())
                    .await
                    .unwrap();
                let stored = f.record(&k).await;
                assert_eq!(
                    (stored.status, stored.retryable, stored.error.as_deref()),
                    (Status::Failed, retryable, error),
                    "{strategy:?}"
                );
                let raw = f.raw(&k).await;
                let want_flags = (if error.is_some() { FLAG_ERROR } else { 0 })
                    | (if retryable { FLAG_RETRYABLE } else { 0 });
                assert_eq!(
                    raw[54], want_flags,
                    "{strategy:?} flags of the stored failure"
                );

                // Without retry_failed: never taken over.
                let taker = OwnerToken::random();
                let refused = f.reserve(f.request(&k, taker)).await;
                assert_eq!(
                    refused,
                    Reservation::Existing(stored.clone()),
                    "{strategy:?}"
                );
                assert_eq!(
                    f.raw(&k).await,
                    raw,
                    "{strategy:?}: a refusal writes nothing"
                );

                // With retry_failed: only a retryable failure.
                let req = ReserveRequest {
                    retry_failed: true,
                    ..f.request(&k, taker)
                };
                let got = f.reserve(req).await;
                if retryable {
                    assert_eq!(got, Reservation::Acquired { attempt: 2 }, "{strategy:?}");
                    let taken = f.record(&k).await;
                    assert_eq!(
                        (
                            taken.status,
                            taken.owner,
                            taken.retryable,
                            taken.error,
                            taken.result
                        ),
                        (Status::Processing, taker, false, None, None),
                        "{strategy:?}: the takeover clears the failure and its flag"
                    );
                    assert_eq!(f.raw(&k).await[54], 0, "{strategy:?}");
                } else {
                    assert_eq!(got, Reservation::Existing(stored), "{strategy:?}");
                    assert_eq!(f.raw(&k).await, raw, "{strategy:?}");
                }
            }
        }

        // `complete` never stores the flag; a later `fail` after a takeover
        // stores the new value, not the old one.
        let k = key("completed");
        let owner = OwnerToken::random();
        f.acquire(&k, owner, None).await;
        f.repo
            .complete(&k, owner, Some(b"ok"), f.now() + TTL, f.now())
            .await
            .unwrap();
        let done = f.record(&k).await;
        assert_eq!((done.status, done.retryable), (Status::Completed, false));
        let req = ReserveRequest {
            retry_failed: true,
            ..f.request(&k, OwnerToken::random())
        };
        assert_eq!(f.reserve(req).await, Reservation::Existing(done));

        let k = key("refailed");
        let first = OwnerToken::random();
        f.acquire(&k, first, None).await;
        f.repo
            .fail(&k, first, None, true, f.now() + TTL, f.now())
            .await
            .unwrap();
        let second = OwnerToken::random();
        let req = ReserveRequest {
            retry_failed: true,
            ..f.request(&k, second)
        };
        assert_eq!(
            f.reserve(req.clone()).await,
            Reservation::Acquired { attempt: 2 }
        );
        f.repo
            .fail(
                &k,
                second,
                Some(b"permanent"),
                false,
                f.now() + TTL,
                f.now(),
            )
            .await
            .unwrap();
        assert!(!f.record(&k).await.retryable, "{strategy:?}");
        let third = ReserveRequest {
            owner: OwnerToken::random(),
            ..req
        };
        assert!(
            matches!(f.reserve(third).await, Reservation::Existing(ref r) if r.attempt == 2),
            "{strategy:?}: a permanent failure after a retry is final"
        );
    }
}

/// Contract point 2: `extend` raises the lease and the expiry, with the
/// key's TTL, in one step — a handler that outlives the record's first expiry
/// keeps its record — and a lower (or equal) expiry changes neither the stored
/// expiry nor the TTL. The comparison is exact to the millisecond across the
/// 32-bit halves the script compares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_raises_expiry_and_ttl_never_lowers_them() {
    let mut f = fixture(ReserveStrategy::SetNxGet).await;
    let t0 = f.now();
    let k = key("long-handler");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        lease_until: t0 + Duration::from_secs(5),
        expires_at: t0 + Duration::from_secs(10),
        ..f.request(&k, owner)
    };
    assert_eq!(f.reserve(req).await, Reservation::Acquired { attempt: 1 });
    let t = f.pttl(&k).await;
    assert!((1..=10_000).contains(&t), "PTTL after reserve: {t}");

    // Extended past the original expiry: record and TTL follow.
    f.clock.advance(Duration::from_secs(4));
    let now = f.now();
    let lease = now + Duration::from_secs(60);
    let expires = now + Duration::from_secs(120);
    f.repo.extend(&k, owner, lease, expires, now).await.unwrap();
    let r = f.record(&k).await;
    assert_eq!(
        (r.lease_until, r.expires_at, r.updated_at),
        (lease, expires, now)
    );
    let t = f.pttl(&k).await;
    assert!(
        (110_000..=120_000).contains(&t),
        "PTTL after extending to 120 s: {t}"
    );

    // The handler outlives the first expiry (t0 + 10 s): its record is there
    // and it completes.
    f.clock.advance(Duration::from_secs(30));
    let later = f.now();
    assert!(later > t0 + Duration::from_secs(10));
    assert_eq!(f.record(&k).await.owner, owner);

    // A lower expiry with a later lease: the lease moves, the expiry and the
    // TTL do not.
    let lower = later + Duration::from_secs(20);
    let moved = lease + Duration::from_secs(5);
    f.repo.extend(&k, owner, moved, lower, later).await.unwrap();
    let r = f.record(&k).await;
    assert_eq!(
        (r.lease_until, r.expires_at, r.updated_at),
        (moved, expires, later)
    );
    let t = f.pttl(&k).await;
    assert!(
        t > 100_000,
        "PTTL lowered to {t} ms by an extend with an earlier expiry"
    );

    // Equal, one millisecond less, one millisecond more: exact.
    for (given, want) in [
        (expires, expires),
        (expires - Duration::from_millis(1), expires),
        (
            expires + Duration::from_millis(1),
            expires + Duration::from_millis(1),
        ),
    ] {
        f.repo
            .extend(&k, owner, later + LEASE, given, later)
            .await
            .unwrap();
        assert_eq!(f.record(&k).await.expires_at, want, "given {given:?}");
    }
    // Across a change of the high 32-bit half (2^32 ms ≈ 49.7 days later).
    let far = later + Duration::from_millis(1 << 32);
    f.repo
        .extend(&k, owner, later + LEASE, far, later)
        .await
        .unwrap();
    assert_eq!(f.record(&k).await.expires_at, far);
    let t = f.pttl(&k).await;
    assert!(
        t > (1 << 32) - 10_000,
        "PTTL after extending by 2^32 ms: {t}"
    );
    f.repo
        .extend(&k, owner, later + LEASE, expires, later)
        .await
        .unwrap();
    assert_eq!(f.record(&k).await.expires_at, far, "never lowered");
    assert!(f.pttl(&k).await > (1 << 32) - 10_000);
    // The lease likewise, also across the high half: an older extension
    // applied late (an earlier lease) moves nothing, and answers ok.
    f.repo.extend(&k, owner, far, far, later).await.unwrap();
    f.repo
        .extend(&k, owner, later + LEASE, far, later)
        .await
        .unwrap();
    assert_eq!(f.record(&k).await.lease_until, far, "lease never lowered");
    let just_later = far + Duration::from_millis(1);
    f.repo
        .extend(&k, owner, just_later, just_later, later)
        .await
        .unwrap();
    assert_eq!(f.record(&k).await.lease_until, just_later);

    // The record is unchanged but for lease, expiry and updated_at; it completes.
    let r = f.record(&k).await;
    assert_eq!(
        (r.status, r.attempt, r.created_at),
        (Status::Processing, 1, t0)
    );
    f.repo
        .complete(&k, owner, Some(b"late"), later + TTL, later)
        .await
        .unwrap();
    assert_eq!(f.record(&k).await.status, Status::Completed);

    // Someone else's extend is refused and leaves expiry and TTL alone.
    let k2 = key("not-yours");
    let holder = OwnerToken::random();
    f.acquire(&k2, holder, None).await;
    let before = f.raw(&k2).await;
    let r = f
        .repo
        .extend(
            &k2,
            OwnerToken::random(),
            later + TTL,
            later + TTL * 10,
            later,
        )
        .await;
    assert!(matches!(r, Err(Error::LeaseLost { .. })), "{r:?}");
    assert_eq!(f.raw(&k2).await, before);
    assert!(f.pttl(&k2).await <= 3_600_000);
}

/// Contract point 3: the owner of the live `Processing` record re-sending its
/// `reserve` gets `Acquired` with the stored attempt — also with another
/// fingerprint (the check comes first) and after its lease ended — and the
/// stored bytes do not change. Everyone else still gets `Existing`; a finished
/// record is `Existing` for its former owner too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_resent_by_the_owner_is_acquired_without_a_write() {
    for strategy in STRATEGIES {
        let mut f = fixture(strategy).await;
        let k = key("resent");
        let owner = OwnerToken::random();
        f.acquire(&k, owner, fp(1)).await;
        let raw = f.raw(&k).await;

        f.clock.advance(Duration::from_secs(1));
        for fingerprint in [fp(1), None, fp(2)] {
            let req = ReserveRequest {
                fingerprint,
                ..f.request(&k, owner)
            };
            assert_eq!(
                f.reserve(req).await,
                Reservation::Acquired { attempt: 1 },
                "{strategy:?} fingerprint {fingerprint:?}"
            );
            assert_eq!(f.raw(&k).await, raw, "{strategy:?}: nothing written");
        }

        // Another owner: in progress.
        let other = OwnerToken::random();
        assert!(
            matches!(f.reserve(f.request(&k, other)).await, Reservation::Existing(ref r) if r.owner == owner),
            "{strategy:?}"
        );

        // The lease ended: the owner still holds the record (no new attempt);
        // another consumer would take it over.
        f.clock.advance(LEASE);
        assert_eq!(
            f.reserve(f.request(&k, owner)).await,
            Reservation::Acquired { attempt: 1 },
            "{strategy:?}: stale lease, same owner"
        );
        assert_eq!(f.raw(&k).await, raw, "{strategy:?}");
        assert_eq!(
            f.reserve(ReserveRequest {
                fingerprint: fp(1),
                ..f.request(&k, other)
            })
            .await,
            Reservation::Acquired { attempt: 2 },
            "{strategy:?}: takeover"
        );
        // Now the new owner's re-send answers attempt 2; the old owner is out.
        assert_eq!(
            f.reserve(f.request(&k, other)).await,
            Reservation::Acquired { attempt: 2 }
        );
        assert!(matches!(
            f.reserve(f.request(&k, owner)).await,
            Reservation::Existing(ref r) if r.owner == other && r.attempt == 2
        ));

        // Finished: the former owner's reserve is a duplicate like any other.
        f.repo
            .complete(&k, other, Some(b"r"), f.now() + TTL, f.now())
            .await
            .unwrap();
        assert!(matches!(
            f.reserve(f.request(&k, other)).await,
            Reservation::Existing(ref r) if r.status == Status::Completed
        ));

        // Logically expired: the same owner creates a new record (attempt 1).
        let k2 = key("resent-expired");
        let req = ReserveRequest {
            expires_at: f.now() + Duration::from_secs(5),
            ..f.request(&k2, owner)
        };
        assert_eq!(f.reserve(req).await, Reservation::Acquired { attempt: 1 });
        f.clock.advance(Duration::from_secs(5));
        assert_eq!(
            f.reserve(f.request(&k2, owner)).await,
            Reservation::Acquired { attempt: 1 }
        );
        assert_eq!(f.record(&k2).await.created_at, f.now(), "{strategy:?}");
    }
}

/// Contract point 5: a takeover without a request fingerprint keeps the stored
/// one (and it keeps guarding the key); with one it stores the request's; the
/// takeover of a retryable failure clears the error and the flag. Checked on
/// the stored bytes: flags and the fingerprint at bytes 55..87.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_keeps_the_stored_fingerprint() {
    for strategy in STRATEGIES {
        let mut f = fixture(strategy).await;

        // A stale Processing record with a fingerprint, taken over without one.
        let k = key("stale");
        let first = OwnerToken::random();
        f.acquire(&k, first, fp(7)).await;
        let created = f.now();
        f.clock.advance(LEASE);
        let second = OwnerToken::random();
        assert_eq!(
            f.reserve(f.request(&k, second)).await,
            Reservation::Acquired { attempt: 2 },
            "{strategy:?}"
        );
        let r = f.record(&k).await;
        assert_eq!(
            (r.owner, r.attempt, r.fingerprint, r.created_at, r.retryable),
            (second, 2, fp(7), created, false),
            "{strategy:?}"
        );
        let raw = f.raw(&k).await;
        assert_eq!(
            (raw.len(), raw[54], &raw[55..87]),
            (87, FLAG_FINGERPRINT, &[7u8; 32][..])
        );
        // The kept fingerprint still refuses another payload after the next
        // stale lease, and admits the same one.
        f.clock.advance(LEASE);
        let third = OwnerToken::random();
        assert!(matches!(
            f.reserve(ReserveRequest { fingerprint: fp(8), ..f.request(&k, third) }).await,
            Reservation::Existing(ref r) if r.owner == second
        ));
        assert_eq!(
            f.reserve(ReserveRequest {
                fingerprint: fp(7),
                ..f.request(&k, third)
            })
            .await,
            Reservation::Acquired { attempt: 3 }
        );
        assert_eq!(f.record(&k).await.fingerprint, fp(7));

        // No stored fingerprint: the request's is stored.
        let k = key("no-stored-fp");
        let first = OwnerToken::random();
        f.acquire(&k, first, None).await;
        f.clock.advance(LEASE);
        assert_eq!(
            f.reserve(ReserveRequest {
                fingerprint: fp(3),
                ..f.request(&k, OwnerToken::random())
            })
            .await,
            Reservation::Acquired { attempt: 2 }
        );
        assert_eq!(f.record(&k).await.fingerprint, fp(3), "{strategy:?}");
        let raw = f.raw(&k).await;
        assert_eq!((raw.len(), raw[54]), (87, FLAG_FINGERPRINT));

        // Neither: none.
        let k = key("no-fp");
        f.acquire(&k, OwnerToken::random(), None).await;
        f.clock.advance(LEASE);
        assert_eq!(
            f.reserve(f.request(&k, OwnerToken::random())).await,
            Reservation::Acquired { attempt: 2 }
        );
        let raw = f.raw(&k).await;
        assert_eq!((raw.len(), raw[54]), (55, 0), "{strategy:?}");

        // A retryable failure with a fingerprint and an error, taken over
        // without a fingerprint: fingerprint kept, error and flag gone.
        let k = key("failed-fp");
        let first = OwnerToken::random();
        f.acquire(&k, first, fp(9)).await;
        f.repo
            .fail(&k, first, Some(b"timeout"), true, f.now() + TTL, f.now())
            .await
            .unwrap();
        assert_eq!(
            f.raw(&k).await[54],
            FLAG_FINGERPRINT | FLAG_ERROR | FLAG_RETRYABLE
        );
        let taker = OwnerToken::random();
        assert_eq!(
            f.reserve(ReserveRequest {
                retry_failed: true,
                ..f.request(&k, taker)
            })
            .await,
            Reservation::Acquired { attempt: 2 }
        );
        let r = f.record(&k).await;
        assert_eq!(
            (r.status, r.owner, r.fingerprint, r.error, r.retryable),
            (Status::Processing, taker, fp(9), None, false),
            "{strategy:?}"
        );
        let raw = f.raw(&k).await;
        assert_eq!(
            (raw.len(), raw[54], &raw[55..87]),
            (87, FLAG_FINGERPRINT, &[9u8; 32][..])
        );
    }
}
