//! The suite catches broken repositories: a catalogue of plausible flaws, each
//! one bug a backend author could really write, built into an otherwise
//! correct store. Every flaw must fail at least one check in every run, while
//! the flawless store passes everything (so the failures come from the flaw).
//!
//! The fixture also offers the operator operations (`admin()`) and acts as
//! its own `StoreFaults` (an undecodable value under a key, a store that
//! stops answering), so the errors clause's fault checks run against every
//! flaw too.
//!
//! `catalogue_table` (ignored; run it with
//! `cargo test -p idempotency-conformance --test broken -- --ignored --nocapture catalogue_table`)
//! runs the whole suite and the fault checks against each flaw, then the
//! catching checks 20 more times, and prints the table published in
//! `conformance-tests/CATALOGUE.md`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use idempotency_conformance::{
    fault_check_named, run_all, run_check, run_fault_checks, CheckFailure, CheckResult, Report,
    SharedFaults, StoreFaults,
};
use idempotency_core::admin::{
    Admin, Check as AdminCheck, DoctorOptions, ListFilter, Listed, Listing, Stats,
};
use idempotency_core::decision::{
    fingerprints_conflict, lease_ended, reserve_transition, reserved_record, stuck,
    ReserveTransition,
};
use idempotency_core::{
    Capabilities, Completion, Error, Fingerprint, OwnerToken, Record, RecordKey, Repository,
    Reservation, ReserveRequest, SharedRepository, Status, Timestamp,
};
use parking_lot::Mutex;

const MS: Duration = Duration::from_millis(1);
/// The result limit the fixture declares.
const MAX_RESULT: usize = 1 << 20;

macro_rules! flaws {
    ($($(#[doc = $doc:literal])+ $name:ident,)*) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Flaw {
            None,
            /// The flawless two-step store: every write a read, a round
            /// trip, then a compare-and-swap against what was read.
            CasNone,
            $($name,)*
        }

        /// Every flaw of the catalogue, with its one-line description.
        const CATALOGUE: &[(Flaw, &str)] = &[$((Flaw::$name, concat!($($doc),+)),)*];
    };
}

flaws! {
    /// `reserve` reads, awaits a round trip, then writes: not atomic.
    NonAtomicReserve,
    /// Taking over an existing record reads, awaits, then writes.
    NonAtomicTakeover,
    /// A `reserve` re-sent by the holder is answered `Existing`.
    ResendIsExisting,
    /// A re-sent `reserve` by the holder rewrites the record from the request.
    ResendRewritesRecord,
    /// A takeover stores the request's fingerprint, `None` included.
    TakeoverDropsFingerprint,
    /// A takeover keeps the old owner token.
    TakeoverKeepsOwner,
    /// A takeover restarts the attempt at 1.
    TakeoverResetsAttempt,
    /// A takeover sets `created_at` to now.
    TakeoverResetsCreatedAt,
    /// Taking over a failed record keeps its error.
    TakeoverKeepsError,
    /// A takeover keeps the old lease.
    TakeoverKeepsLease,
    /// A takeover keeps the old expiry.
    TakeoverKeepsExpiry,
    /// The lease is judged without the clock-skew allowance.
    IgnoresClockSkew,
    /// A lease is taken over only strictly after `lease_until + skew`.
    LeaseBoundaryOffByOne,
    /// A lease is taken over one millisecond before it ends.
    EarlyTakeover,
    /// A record is expired only strictly after `expires_at`.
    ExpiryOffByOne,
    /// Failed records are taken over without `retry_failed`.
    RetriesFailedWithoutFlag,
    /// A takeover ignores a fingerprint conflict.
    TakeoverDespiteFingerprintConflict,
    /// Re-creating an expired record continues its attempt count.
    RecreateKeepsAttempt,
    /// Re-creating an expired record keeps its `created_at`.
    RecreateKeepsCreatedAt,
    /// `reserve` returns existing records without their result (a missing column).
    ExistingWithoutResult,
    /// `complete`/`fail` do not compare the owner token.
    IgnoresOwner,
    /// `release` does not compare the owner token.
    ReleaseIgnoresOwner,
    /// `extend` does not compare the owner token.
    ExtendIgnoresOwner,
    /// `complete` accepts a record that is already finished.
    CompleteIgnoresStatus,
    /// `extend` accepts a record that is already finished.
    ExtendIgnoresStatus,
    /// `release` deletes whatever is there, finished records included.
    ReleaseIgnoresStatus,
    /// Fenced operations are refused once the lease ran out (the clock decides, not the token).
    FencedByClock,
    /// Fenced operations accept an expired record.
    FencedIgnoresExpiry,
    /// `complete`, `fail`, `release` and `extend` check, await, then write.
    CheckThenWrite,
    /// `complete` keeps the old expiry.
    CompleteKeepsExpiry,
    /// `fail` keeps the old expiry.
    FailKeepsExpiry,
    /// `complete` stores `Some(empty)` results as `None`.
    DropsEmptyResults,
    /// `fail` stores `Some(empty)` errors as `None`.
    DropsEmptyErrors,
    /// Results are silently truncated to 64 KiB.
    TruncatesResults,
    /// Results over the declared limit are stored instead of refused.
    AcceptsOversizedResults,
    /// Every failure is stored as retryable.
    EveryFailureRetryable,
    /// No failure is stored as retryable.
    NoFailureRetryable,
    /// `extend` moves the lease but not the expiry.
    ExtendKeepsExpiry,
    /// `extend` sets the expiry as asked, also earlier.
    ExtendLowersExpiry,
    /// `extend` leaves the lease where it was.
    ExtendKeepsLease,
    /// `extend` sets the lease as asked, also earlier (an older extension applied late undoes a newer one).
    ExtendLowersLease,
    /// Records never expire.
    IgnoresExpiry,
    /// `get` returns expired records.
    GetReturnsExpired,
    /// `delete` always answers `false`.
    DeleteReportsNothing,
    /// `purge_expired` ignores its limit.
    PurgeIgnoresLimit,
    /// `purge_expired` also removes records expiring within the next millisecond.
    PurgeOffByOne,
    /// `purge_expired` answers 0 whatever it removed.
    PurgeReportsNothing,
    /// Keys are encoded as `namespace:id`, which is not injective.
    CollidingKeys,
    /// Ids are compared case-insensitively (a SQL collation).
    CaseInsensitiveIds,
    /// Ids are stored with trailing spaces trimmed (a `CHAR(n)` column).
    TrimsIds,
    /// Ids are Unicode-normalized before storing.
    NormalizesIds,
    /// Ids are truncated to 64 bytes while 1024 are declared.
    TruncatesIds,
    /// The namespace is not part of the stored key.
    IgnoresNamespace,
    /// `reserve_many` answers in key order (the batch was sorted to lock in order, the answers not mapped back).
    ReserveManyKeyOrder,
    /// `reserve_many` answers `Acquired` for every key, also those it found held (a batch insert's row count misread).
    ReserveManyAssumesAcquired,
    /// `complete_many` answers in key order.
    CompleteManyKeyOrder,
    /// `complete_many` matches records by key alone (a batch `UPDATE` joined without the owner).
    CompleteManyIgnoresOwner,
    /// One oversized result fails every write of a `complete_many`.
    CompleteManyFailsTogether,
    /// `reserve_many` judges every request at the first request's instant (one `now` for the whole batch).
    ReserveManyFirstNow,
    /// `reserve_many` judges leases without the clock-skew allowance (the batch script never got it).
    ReserveManyIgnoresSkew,
    /// `reserve_many` takes a lease over only strictly after `lease_until + skew`.
    ReserveManyLeaseBoundary,
    /// `reserve_many` sees a record as live at its exact `expires_at`.
    ReserveManyExpiryOffByOne,
    /// `reserve_many` writes the first request's lease and expiry into every record it acquires.
    ReserveManyFirstLease,
    /// `reserve_many` creates records without the request's fingerprint (a column missing from the batch insert).
    ReserveManyCreatesWithoutFingerprint,
    /// `reserve_many`'s takeovers set `created_at` to now (the batch upsert writes every column).
    ReserveManyTakeoverResetsCreatedAt,
    /// `reserve_many` sends chunks of 100 and re-sends the first chunk for every later one (an offset never advanced).
    ReserveManyChunkOffset,
    /// `reserve_many` and `complete_many` read the batch's first element: an empty batch panics.
    EmptyBatchPanics,
    /// `complete_many` gives every record the first write's expiry (one `expires_at` parameter for the batch).
    CompleteManySharedExpiry,
    /// `complete_many` stores results through a lossy UTF-8 conversion (the batch path sends strings).
    CompleteManyLossyResults,
    /// `complete_many` accepts a record at its exact `expires_at`.
    CompleteManyExpiryOffByOne,
    /// `complete_many`'s batch `UPDATE` clears the fingerprint.
    CompleteManyClearsFingerprint,
    /// `complete_many` sends chunks of 100 and re-sends the first chunk for every later one.
    CompleteManyChunkOffset,
    /// `fail` leaves `updated_at` as it was.
    FailKeepsUpdatedAt,
    /// `extend` leaves `updated_at` as it was.
    ExtendKeepsUpdatedAt,
    /// A refused `complete`, `fail`, `release` or `extend` still stamps `updated_at` (the stamp is written before the owner check).
    RefusedWriteStampsUpdatedAt,
    /// `extend` raises the expiry only together with a later lease.
    ExtendExpiryOnlyWithLease,
    /// `release` marks the record expired at `now` instead of deleting it (a consumer whose clock is behind still sees it held).
    ReleaseExpiresInstead,
    /// `purge_expired` spares records expiring exactly at `now` (`expires_at < now`).
    PurgeSparesExactExpiry,
    /// `purge_expired` treats a limit of 0 as no limit.
    PurgeZeroLimitUnbounded,
    /// `purge_expired` selects expired keys, awaits, then deletes those keys without checking their expiry again.
    PurgeDeletesByKey,
    /// Owner tokens are compared as Lua numbers (doubles): tokens equal in their top 53 bits match.
    OwnerComparedAsDouble,
    /// `reserve` answers `Existing` with a copy read before its conditional write, not the record the write saw.
    StaleExistingCopy,
    /// `reserve` sees a record as live until `expires_at + skew` (the skew allowance applied to expiry too).
    ExpiryJudgedWithSkew,
    /// A holder's re-sent `reserve` after its lease ended takes its own record over (attempt + 1, new lease).
    ResendAfterLeaseTakesOver,
    /// Re-creating an expired failed record keeps its `retryable` flag.
    RecreateKeepsRetryable,
    /// `get` of an absent key returns a live record with the same id in another namespace (a query that forgot the namespace).
    GetFallsBackAcrossNamespaces,
    /// The attempt is stored in one byte (a `TINYINT UNSIGNED` column): it wraps after 255.
    AttemptInOneByte,
    /// `complete` also stores the result as the error (one value column read back into both).
    CompleteAlsoSetsError,
    /// Fingerprints are compared with a bare `<>`: a missing one on either side blocks a takeover (NULL is not false).
    FingerprintNullBlocksTakeover,
    /// Timestamps are stored in whole seconds (milliseconds dropped).
    TimestampsInSeconds,
    /// Namespaces are compared case-insensitively (a SQL collation on the namespace column).
    CaseInsensitiveNamespaces,
    /// Namespaces are stored with trailing spaces trimmed (a `CHAR(n)` column).
    TrimsNamespaces,
    /// `admin().list` ignores the namespace prefix.
    ListIgnoresPrefix,
    /// `admin().list` lists expired records.
    ListShowsExpired,
    /// `admin().list`'s stuck filter lists every `Processing` record, its lease ended or not.
    ListStuckIgnoresLease,
    /// `admin().list` never says it was cut short by its limit.
    ListNeverTruncated,
    /// `admin().stats` counts expired records in their status.
    StatsCountsExpired,
    /// `admin().stats` counts every `Processing` record as stuck.
    StatsEveryLeaseStuck,
    /// A new record stores the lease as its expiry and the expiry as its lease.
    NewRecordSwapsLeaseAndExpiry,
    /// Taking over a failed record keeps its `retryable` flag.
    TakeoverKeepsRetryable,
    /// `fail` clears the fingerprint (the failure path writes every column).
    FailClearsFingerprint,
    /// `extend` is refused once the lease ran out, though nobody took over.
    ExtendRefusedAfterLease,
    /// `delete` removes the id in every namespace.
    DeleteIgnoresNamespace,
    /// `purge_expired` also removes `Processing` records whose lease ended.
    PurgeEndedLeases,
    /// A holder's re-sent `reserve` is answered attempt 1, whatever its attempt.
    ResendAnswersAttemptOne,
    /// `reserve` judges leases and expiry by the server's clock, not the caller's `now`.
    JudgesByWallClock,
    /// A result of exactly the declared limit is refused (`>=`).
    RefusesResultAtLimit,
    /// `complete_many` is all or nothing: one refused write refuses them all (a transaction rolled back).
    CompleteManyAllOrNothing,
    /// `extend` that changes nothing (a re-sent extension) answers `LeaseLost` (a count of changed rows).
    ExtendNoOpIsLeaseLost,
    /// `get` hides `Processing` records whose lease ended.
    GetHidesEndedLeases,
    /// `delete` answers `true` only for a record that is live by the server's clock.
    DeleteOnlyLive,
    /// The attempt is stored in two bytes (a `SMALLINT UNSIGNED` column): it wraps after 65535.
    AttemptInTwoBytes,
    /// `complete_many` reads every record, awaits, then writes them all (a batch read and an unconditional batch write).
    CompleteManyCheckThenWrite,
    /// `reserve_many` reads every record, awaits, then writes them all.
    ReserveManyCheckThenWrite,
    /// Namespaces are truncated to 255 bytes while 512 are allowed (a `VARBINARY(255)` column).
    TruncatesNamespaces,
    /// `reserve`'s `Existing` answer carries the error decoded as UTF-8 text (lossy).
    ExistingErrorLossy,
    /// Re-creating an expired record keeps its old `updated_at`.
    RecreateKeepsUpdatedAt,
    /// `admin().list` ignores the status filter.
    ListIgnoresStatus,
    /// `admin().list` returns one record more than its limit (the `LIMIT n + 1` probe row kept).
    ListKeepsProbeRow,
    /// Fingerprints are compared before the holder's re-send is recognised.
    ResendChecksFingerprintFirst,
    /// A holder's re-sent `reserve` of its own expired record answers `Acquired` and writes nothing.
    ResendOfExpiredRecordWritesNothing,
    /// `purge_expired` judges expiry by the server's clock, not the caller's `now`.
    PurgeByWallClock,
    /// The clock-skew allowance is applied the wrong way (`lease_until - skew <= now`).
    SkewWrongDirection,
    /// `reserve_many` takes over failed records under `retry_failed` whether or not they are retryable.
    ReserveManyIgnoresRetryable,
    /// `reserve_many` ignores fingerprint conflicts (the batch statement has no fingerprint condition).
    ReserveManyIgnoresFingerprints,
    /// `get` returns results truncated to 64 KiB (a read buffer of its own).
    GetTruncatesResults,
    /// `reserve` treats an undecodable record as absent and creates over it.
    ReserveOverwritesCorrupt,
    /// `reserve_many` treats an undecodable record as absent and creates over it (the batch path skips the decode check).
    ReserveManyOverwritesCorrupt,
    /// `get` answers none for an undecodable record.
    CorruptIsAbsentToGet,
    /// `complete`, `fail` and `release` answer `LeaseLost` when the store is unreachable (an error read as no row matched).
    FencedOutageIsLeaseLost,
    /// `complete_many` answers `LeaseLost` for every write when the store is unreachable.
    CompleteManyHidesOutage,
    /// The clock-skew allowance is cut to whole seconds (a script or SQL parameter given `as_secs()`).
    SkewInWholeSeconds,
    /// `reserve_many` cuts the clock-skew allowance to whole seconds.
    ReserveManySkewInWholeSeconds,
    /// Stored errors are silently truncated to 64 KiB (a `BLOB` error column).
    TruncatesErrors,
    /// Errors over the declared limit are stored instead of refused (the size check guards results only).
    AcceptsOversizedErrors,
    /// `admin().list` matches its prefix as a SQL `LIKE` pattern (`_`, `%` unescaped).
    ListPrefixAsLikePattern,
    /// `admin().list` matches its prefix as a glob (`SCAN MATCH prefix*` with `*`, `?`, `[` unescaped).
    ListPrefixAsGlob,
    /// A store with its own expiry keeps the reservation's TTL through later writes (`KEEPTTL`): the server drops a completed, failed, extended or taken-over record at the first expiry.
    NativeTtlKeptByWrites,
    /// The store's item limit counts the key and fingerprint too, and the declared result limit leaves room for a short key only (DynamoDB's 400 KB item).
    ItemLimitCountsTheKey,
    /// `admin().list`'s stuck filter ignores the clock-skew allowance (`lease_until <= now`): a lease that ended within the skew, which consumers still honour, is listed stuck.
    ListStuckIgnoresSkew,
    /// `admin().stats` counts stuck leases without the clock-skew allowance (`lease_until <= now`).
    StatsStuckIgnoresSkew,
    /// On a store whose writes are a read, then a compare-and-swap (etcd, DynamoDB conditions), `purge_expired` lists expired keys, then deletes them without a condition.
    CasPurgeDeletesByKey,
    /// On a store whose writes are a read, then a compare-and-swap, `reserve_many` reads every key, then writes every decision without a condition.
    CasReserveManyCheckThenWrite,
    /// On a store whose writes are a read, then a compare-and-swap, `complete_many` reads every record, then writes without a condition.
    CasCompleteManyCheckThenWrite,
    /// Re-creating an expired record reads it, awaits, then writes without a condition (only the absent-key path is conditional).
    RecreateCheckThenWrite,
    /// `reserve_many` reads, awaits, then writes each key in turn (a `GET` then a `SET` per key).
    ReserveManyPerKeyGap,
    /// `purge_expired` lists expired keys, waits a real round trip (2 ms), then deletes those keys without a condition.
    PurgeDeletesAfterRoundTrip,
    /// `get` of an absent key returns a live record with the same id in a namespace the key's is a prefix of (`LIKE 'ns%'`, `SCAN MATCH ns*`).
    GetMatchesNamespacePrefix,
    /// `admin().list`'s stuck filter ignores the status: a completed or failed record whose old lease ended is listed stuck.
    ListStuckIgnoresStatus,
    /// `admin().stats` counts completed and failed records whose old lease ended as stuck.
    StatsStuckIgnoresStatus,
    /// `admin().list` recovers namespace and id by splitting `namespace:id` at its last `:`.
    ListSplitsAtLastColon,
    /// Declares no result limit, yet refuses results over 4 MiB (a server's packet limit left undeclared).
    UndeclaredResultLimit,
}

#[derive(Debug)]
struct Fixture {
    flaw: Flaw,
    /// Whether every write is a read, a round trip, then a compare-and-swap
    /// (a correct two-step store, as over etcd), not one atomic step.
    cas: bool,
    map: Mutex<HashMap<String, Record>>,
    /// Keys holding something that does not decode (`StoreFaults::corrupt`).
    corrupt: Mutex<HashSet<String>>,
    /// Whether the store stopped answering (`StoreFaults::unreach`).
    down: AtomicBool,
    /// When the store's own timer drops each key, by the wall clock (under
    /// [`Flaw::NativeTtlKeptByWrites`] only: set when a record is created,
    /// never moved).
    native_expiry: Mutex<HashMap<String, std::time::Instant>>,
}

/// Instants floored to whole seconds (a store keeping seconds).
fn in_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_millis(t.as_millis() / 1000 * 1000)
}

/// The server's clock.
fn wall_clock() -> Timestamp {
    Timestamp::from_system_time(std::time::SystemTime::now())
}

/// Another fingerprint than `f`.
fn flipped(f: Fingerprint) -> Fingerprint {
    let mut bytes = *f.as_bytes();
    bytes[0] ^= 0xff;
    Fingerprint::from_bytes(bytes)
}

/// The top 53 bits of a token: what survives a conversion to a double.
fn as_double(owner: OwnerToken) -> u128 {
    owner.as_u128() >> 75
}

impl Fixture {
    fn shared(flaw: Flaw) -> SharedRepository {
        Self::with_faults(flaw).0
    }

    /// The fixture, and the faults acting on it.
    fn with_faults(flaw: Flaw) -> (SharedRepository, SharedFaults) {
        let cas = matches!(
            flaw,
            Flaw::CasNone
                | Flaw::CasPurgeDeletesByKey
                | Flaw::CasReserveManyCheckThenWrite
                | Flaw::CasCompleteManyCheckThenWrite
        );
        let fixture = Arc::new(Fixture {
            flaw,
            cas,
            map: Mutex::new(HashMap::new()),
            corrupt: Mutex::new(HashSet::new()),
            down: AtomicBool::new(false),
            native_expiry: Mutex::new(HashMap::new()),
        });
        (fixture.clone(), fixture)
    }

    /// `Unavailable` while the store is unreachable.
    fn reachable(&self) -> Result<(), Error> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::unavailable("fixture", "the store does not answer"));
        }
        Ok(())
    }

    /// `Corrupt` naming `key` when its value does not decode.
    fn decodable(&self, key: &RecordKey) -> Result<(), Error> {
        if self.corrupt.lock().contains(&self.k(key)) {
            return Err(Error::corrupt(key, "fixture: not a record"));
        }
        Ok(())
    }

    fn is(&self, flaw: Flaw) -> bool {
        self.flaw == flaw
    }

    /// The map, locked, once `k` still holds what was `read` one round trip
    /// earlier (the compare of a compare-and-swap); read again and retried
    /// otherwise. Under the lock the write that follows is conditional on it.
    async fn compared(
        &self,
        k: &str,
        read: &mut Option<Record>,
    ) -> parking_lot::MutexGuard<'_, HashMap<String, Record>> {
        loop {
            tokio::task::yield_now().await;
            let map = self.map.lock();
            if map.get(k) == read.as_ref() {
                return map;
            }
            *read = map.get(k).cloned();
        }
    }

    /// The map, locked for one atomic step, or after a compare-and-swap's
    /// read and round trip (`cas`).
    async fn locked(&self, k: &str) -> parking_lot::MutexGuard<'_, HashMap<String, Record>> {
        if !self.cas {
            return self.map.lock();
        }
        let mut read = self.map.lock().get(k).cloned();
        self.compared(k, &mut read).await
    }

    fn k(&self, key: &RecordKey) -> String {
        let id = key.id();
        let id = match self.flaw {
            Flaw::CaseInsensitiveIds => id.to_lowercase(),
            Flaw::TrimsIds => id.trim_end().to_owned(),
            Flaw::NormalizesIds => id
                .replace("e\u{301}", "\u{e9}")
                .replace('\u{212b}', "\u{c5}"),
            Flaw::TruncatesIds => id.chars().take(64).collect(),
            _ => id.to_owned(),
        };
        let ns = match self.flaw {
            Flaw::CaseInsensitiveNamespaces => key.namespace().to_lowercase(),
            Flaw::TrimsNamespaces => key.namespace().trim_end().to_owned(),
            Flaw::TruncatesNamespaces => {
                let ns = key.namespace();
                let mut end = ns.len().min(255);
                while !ns.is_char_boundary(end) {
                    end -= 1;
                }
                ns[..end].to_owned()
            }
            _ => key.namespace().to_owned(),
        };
        match self.flaw {
            Flaw::CollidingKeys => format!("{}:{id}", key.namespace()),
            Flaw::IgnoresNamespace => id,
            _ if id == key.id() && ns == key.namespace() => key.encode(),
            _ => RecordKey::new(ns, &id, 1 << 20)
                .map(|k| k.encode())
                .unwrap_or_else(|_| key.encode()),
        }
    }

    fn expired(&self, r: &Record, now: Timestamp) -> bool {
        match self.flaw {
            Flaw::IgnoresExpiry => false,
            Flaw::ExpiryOffByOne => now > r.expires_at,
            _ => r.is_expired(now),
        }
    }

    /// The record as `reserve` (or `reserve_many`: `batch`) judges it
    /// (flaws that misjudge time or fingerprints).
    fn as_judged(&self, r: &Record, req: &ReserveRequest<'_>, batch: bool) -> Record {
        let mut r = r.clone();
        let live = match self.flaw {
            Flaw::ReserveManyExpiryOffByOne if batch => req.now <= r.expires_at,
            Flaw::JudgesByWallClock => wall_clock() < r.expires_at,
            Flaw::ExpiryJudgedWithSkew => req.now < r.expires_at + req.clock_skew,
            _ => !self.expired(&r, req.now),
        };
        if live && r.is_expired(req.now) {
            r.expires_at = Timestamp::MAX;
        }
        if batch && self.is(Flaw::ReserveManyIgnoresRetryable) && r.status == Status::Failed {
            r.retryable = true;
        }
        if self.is(Flaw::FingerprintNullBlocksTakeover) && r.fingerprint.is_none() {
            // No stored fingerprint against the request's: a conflict.
            r.fingerprint = req.fingerprint.map(flipped);
        }
        r
    }

    /// The request as the decision sees it.
    fn judged_request<'a>(
        &self,
        req: &ReserveRequest<'a>,
        existing: Option<&Record>,
        batch: bool,
    ) -> ReserveRequest<'a> {
        let mut judged = req.clone();
        match self.flaw {
            Flaw::IgnoresClockSkew => judged.clock_skew = Duration::ZERO,
            Flaw::ReserveManyIgnoresSkew if batch => judged.clock_skew = Duration::ZERO,
            Flaw::SkewInWholeSeconds => {
                judged.clock_skew = Duration::from_secs(req.clock_skew.as_secs());
            }
            Flaw::ReserveManySkewInWholeSeconds if batch => {
                judged.clock_skew = Duration::from_secs(req.clock_skew.as_secs());
            }
            Flaw::LeaseBoundaryOffByOne => judged.clock_skew += MS,
            Flaw::ReserveManyLeaseBoundary if batch => judged.clock_skew += MS,
            Flaw::EarlyTakeover => judged.now = req.now + MS,
            Flaw::JudgesByWallClock => judged.now = wall_clock(),
            Flaw::SkewWrongDirection => {
                judged.now = req.now + req.clock_skew;
                judged.clock_skew = Duration::ZERO;
            }
            Flaw::ReserveManyIgnoresFingerprints if batch => judged.fingerprint = None,
            Flaw::RetriesFailedWithoutFlag => judged.retry_failed = true,
            Flaw::TakeoverDespiteFingerprintConflict
                if existing.is_some_and(|r| r.fingerprint.is_some()) =>
            {
                judged.fingerprint = None;
            }
            Flaw::FingerprintNullBlocksTakeover
                if existing.is_some_and(|r| r.fingerprint.is_some())
                    && req.fingerprint.is_none() =>
            {
                // The stored one against none: a conflict.
                judged.fingerprint = existing.and_then(|r| r.fingerprint).map(flipped);
            }
            _ => {}
        }
        judged
    }

    /// The record a takeover or creation stores.
    fn reserved(
        &self,
        existing: Option<&Record>,
        req: &ReserveRequest<'_>,
        attempt: u32,
        batch: bool,
    ) -> Record {
        let mut r = reserved_record(existing, req, attempt);
        if batch && attempt == 1 && self.is(Flaw::ReserveManyCreatesWithoutFingerprint) {
            r.fingerprint = None;
        }
        if attempt == 1 && self.is(Flaw::NewRecordSwapsLeaseAndExpiry) {
            std::mem::swap(&mut r.lease_until, &mut r.expires_at);
        }
        self.in_store(&mut r);
        let Some(old) = existing else { return r };
        if attempt > 1 {
            match self.flaw {
                Flaw::TakeoverDropsFingerprint => r.fingerprint = req.fingerprint,
                Flaw::TakeoverKeepsOwner => r.owner = old.owner,
                Flaw::TakeoverResetsAttempt => r.attempt = 1,
                Flaw::TakeoverResetsCreatedAt => r.created_at = req.now,
                Flaw::ReserveManyTakeoverResetsCreatedAt if batch => r.created_at = req.now,
                Flaw::TakeoverKeepsError => r.error.clone_from(&old.error),
                Flaw::TakeoverKeepsLease => r.lease_until = old.lease_until,
                Flaw::TakeoverKeepsExpiry => r.expires_at = old.expires_at,
                Flaw::AttemptInOneByte => r.attempt = attempt % 256,
                Flaw::AttemptInTwoBytes => r.attempt = attempt % 65536,
                Flaw::TakeoverKeepsRetryable => r.retryable = old.retryable,
                _ => {}
            }
        } else {
            match self.flaw {
                Flaw::RecreateKeepsAttempt => r.attempt = old.attempt + 1,
                Flaw::RecreateKeepsCreatedAt => r.created_at = old.created_at,
                Flaw::RecreateKeepsRetryable => r.retryable = old.retryable,
                Flaw::RecreateKeepsUpdatedAt => r.updated_at = old.updated_at,
                _ => {}
            }
        }
        r
    }

    /// What the store keeps of a record it writes (per the flaws).
    fn in_store(&self, r: &mut Record) {
        if self.is(Flaw::TimestampsInSeconds) {
            r.lease_until = in_seconds(r.lease_until);
            r.expires_at = in_seconds(r.expires_at);
            r.created_at = in_seconds(r.created_at);
            r.updated_at = in_seconds(r.updated_at);
        }
    }

    fn answer_existing(&self, mut r: Record) -> Reservation {
        if self.is(Flaw::ExistingWithoutResult) {
            r.result = None;
        }
        if self.is(Flaw::ExistingErrorLossy) {
            r.error = r
                .error
                .map(|e| String::from_utf8_lossy(&e).into_owned().into_bytes());
        }
        Reservation::Existing(r)
    }

    /// Whether `owner` may finish or extend the record (per the flaws).
    fn may_write(&self, r: &Record, owner: OwnerToken, now: Timestamp, op: &str) -> bool {
        let same_owner = if self.is(Flaw::OwnerComparedAsDouble) {
            as_double(r.owner) == as_double(owner)
        } else {
            r.owner == owner
        };
        let owner_ok = same_owner
            || match op {
                "release" => self.is(Flaw::ReleaseIgnoresOwner),
                "extend" => self.is(Flaw::ExtendIgnoresOwner),
                _ => self.is(Flaw::IgnoresOwner),
            };
        let completing = op.starts_with("complete");
        let status_ok = r.status == Status::Processing
            || (completing && self.is(Flaw::CompleteIgnoresStatus))
            || (op == "extend" && self.is(Flaw::ExtendIgnoresStatus));
        let live = if op == "complete_many" && self.is(Flaw::CompleteManyExpiryOffByOne) {
            now <= r.expires_at
        } else {
            !self.expired(r, now) || self.is(Flaw::FencedIgnoresExpiry)
        };
        let clock_ok = !(self.is(Flaw::FencedByClock)
            || (op == "extend" && self.is(Flaw::ExtendRefusedAfterLease)))
            || r.lease_until > now;
        owner_ok && status_ok && live && clock_ok
    }

    async fn owned(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        op: &str,
        f: impl FnOnce(&mut HashMap<String, Record>, String),
    ) -> Result<(), Error> {
        let lost = || Err(Error::LeaseLost { key: key.clone() });
        if self.is(Flaw::FencedOutageIsLeaseLost) && op != "extend" && self.reachable().is_err() {
            return lost();
        }
        self.reachable()?;
        self.decodable(key)?;
        let k = self.k(key);
        if !self.is(Flaw::CheckThenWrite) {
            // Check and write under one lock (or one compare-and-swap):
            // atomic, as a store must be.
            let mut map = self.locked(&k).await;
            if !map
                .get(&k)
                .is_some_and(|r| self.may_write(r, owner, now, op))
            {
                if self.is(Flaw::RefusedWriteStampsUpdatedAt) {
                    if let Some(r) = map.get_mut(&k) {
                        r.updated_at = now;
                    }
                }
                return lost();
            }
            f(&mut map, k.clone());
            if let Some(r) = map.get_mut(&k) {
                self.in_store(r);
            }
            return Ok(());
        }
        let ok = self
            .map
            .lock()
            .get(&k)
            .is_some_and(|r| self.may_write(r, owner, now, op));
        if !ok {
            return lost();
        }
        // The smallest gap there is: one trip through the scheduler.
        tokio::task::yield_now().await;
        f(&mut self.map.lock(), k);
        Ok(())
    }

    /// Under [`Flaw::ItemLimitCountsTheKey`]: the whole item (key,
    /// fingerprint, value) within the declared limit plus 256 bytes.
    fn check_item_size(&self, key: &RecordKey, value: Option<&[u8]>) -> Result<(), Error> {
        let size = key.namespace().len() + key.id().len() + 32 + value.map_or(0, <[u8]>::len);
        if self.is(Flaw::ItemLimitCountsTheKey) && size > MAX_RESULT + 256 {
            return Err(Error::TooLarge {
                what: "item",
                size,
                max: MAX_RESULT + 256,
            });
        }
        Ok(())
    }

    fn check_size(&self, value: Option<&[u8]>) -> Result<(), Error> {
        if self.is(Flaw::UndeclaredResultLimit) {
            let (size, max) = (value.map_or(0, <[u8]>::len), 4 << 20);
            if size > max {
                return Err(Error::TooLarge {
                    what: "result",
                    size,
                    max,
                });
            }
            return Ok(());
        }
        match value {
            Some(v)
                if (v.len() > MAX_RESULT
                    || (v.len() == MAX_RESULT && self.is(Flaw::RefusesResultAtLimit)))
                    && !self.is(Flaw::AcceptsOversizedResults) =>
            {
                Err(Error::TooLarge {
                    what: "result",
                    size: v.len(),
                    max: MAX_RESULT,
                })
            }
            _ => Ok(()),
        }
    }

    /// `reserve`, or one request of `reserve_many` (`batch`).
    async fn reserve_as(&self, req: ReserveRequest<'_>, batch: bool) -> Result<Reservation, Error> {
        self.reachable()?;
        let k = self.k(req.key);
        let overwrite = self.is(Flaw::ReserveOverwritesCorrupt)
            || (batch && self.is(Flaw::ReserveManyOverwritesCorrupt));
        if overwrite && self.corrupt.lock().remove(&k) {
            self.map.lock().remove(&k);
        }
        self.decodable(req.key)?;
        let mut read = self.map.lock().get(&k).cloned();
        let gap =
            self.is(Flaw::NonAtomicReserve) || (self.is(Flaw::NonAtomicTakeover) && read.is_some());
        let yield_gap = (self.is(Flaw::RecreateCheckThenWrite)
            && read.as_ref().is_some_and(|r| r.is_expired(req.now)))
            || (batch && self.is(Flaw::ReserveManyPerKeyGap));
        if yield_gap {
            // Read, one trip through the scheduler, then an unconditional write.
            tokio::task::yield_now().await;
        }
        let gap = gap || yield_gap;
        if gap {
            if !yield_gap {
                // The gap a network round trip makes between read and write: long
                // enough for every concurrent reserver to read the same state.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        } else if self.is(Flaw::StaleExistingCopy) {
            // A read, then the conditional write one round trip later.
            tokio::task::yield_now().await;
        }
        let mut map = if self.cas && !gap {
            self.compared(&k, &mut read).await
        } else {
            self.map.lock()
        };
        let existing = if gap {
            read.clone()
        } else {
            map.get(&k).cloned()
        };
        let judged_record = existing.as_ref().map(|r| self.as_judged(r, &req, batch));
        let judged = self.judged_request(&req, existing.as_ref(), batch);
        let mut transition = reserve_transition(judged_record.as_ref(), &judged);
        if let Some(r) = existing.as_ref().filter(|r| {
            self.is(Flaw::ResendOfExpiredRecordWritesNothing)
                && r.status == Status::Processing
                && r.owner == req.owner
        }) {
            return Ok(Reservation::Acquired { attempt: r.attempt });
        }
        if let (ReserveTransition::AlreadyHeld { .. }, Some(r)) = (transition, &existing) {
            if self.is(Flaw::ResendChecksFingerprintFirst)
                && fingerprints_conflict(r.fingerprint.as_ref(), req.fingerprint.as_ref())
            {
                transition = ReserveTransition::Existing;
            }
        }
        if let (ReserveTransition::AlreadyHeld { attempt }, Some(r)) = (transition, &existing) {
            if self.is(Flaw::ResendAfterLeaseTakesOver) && r.lease_until <= req.lease_cutoff() {
                transition = ReserveTransition::Takeover {
                    attempt: attempt + 1,
                };
            }
        }
        match transition {
            ReserveTransition::Create => {
                let record = self.reserved(existing.as_ref(), &req, 1, batch);
                let attempt = record.attempt;
                if self.is(Flaw::NativeTtlKeptByWrites) {
                    let ttl = req.expires_at.duration_since(req.now);
                    let at = std::time::Instant::now() + ttl;
                    self.native_expiry.lock().insert(k.clone(), at);
                }
                map.insert(k, record);
                Ok(Reservation::Acquired { attempt })
            }
            ReserveTransition::Takeover { attempt } => {
                let record = self.reserved(existing.as_ref(), &req, attempt, batch);
                let attempt = record.attempt;
                map.insert(k, record);
                Ok(Reservation::Acquired { attempt })
            }
            ReserveTransition::AlreadyHeld { attempt } => match self.flaw {
                Flaw::ResendIsExisting => existing
                    .map(|r| self.answer_existing(r))
                    .ok_or_else(|| Error::corrupt(req.key, "fixture: no record")),
                Flaw::ResendRewritesRecord => {
                    map.insert(k, reserved_record(None, &req, attempt));
                    Ok(Reservation::Acquired { attempt })
                }
                Flaw::ResendAnswersAttemptOne => Ok(Reservation::Acquired { attempt: 1 }),
                _ => Ok(Reservation::Acquired { attempt }),
            },
            ReserveTransition::Existing => {
                let shown = if self.is(Flaw::StaleExistingCopy) {
                    read.or(existing)
                } else {
                    existing
                };
                shown
                    .map(|r| self.answer_existing(r))
                    .ok_or_else(|| Error::corrupt(req.key, "fixture: no record to return"))
            }
        }
    }

    /// `complete`, or one write of `complete_many` (`batch`).
    async fn complete_as(
        &self,
        c: Completion<'_>,
        now: Timestamp,
        batch: bool,
    ) -> Result<(), Error> {
        self.check_size(c.result)?;
        self.check_item_size(c.key, c.result)?;
        let mut result = c.result.map(<[u8]>::to_vec);
        if self.is(Flaw::DropsEmptyResults) && result.as_ref().is_some_and(Vec::is_empty) {
            result = None;
        }
        if self.is(Flaw::TruncatesResults) {
            if let Some(r) = result.as_mut() {
                r.truncate(64 * 1024);
            }
        }
        if batch && self.is(Flaw::CompleteManyLossyResults) {
            result = result.map(|r| String::from_utf8_lossy(&r).into_owned().into_bytes());
        }
        let keep_expiry = self.is(Flaw::CompleteKeepsExpiry);
        let also_error = self.is(Flaw::CompleteAlsoSetsError);
        let clear_fingerprint = batch && self.is(Flaw::CompleteManyClearsFingerprint);
        let op = if batch { "complete_many" } else { "complete" };
        self.owned(c.key, c.owner, now, op, |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.status = Status::Completed;
                if also_error {
                    r.error.clone_from(&result);
                }
                r.result = result;
                if !keep_expiry {
                    r.expires_at = c.expires_at;
                }
                if clear_fingerprint {
                    r.fingerprint = None;
                }
                r.updated_at = now;
            }
        })
        .await
    }
}

impl Fixture {
    /// `reserve_many` as one read of every key, a round trip, then one
    /// write of every decision.
    async fn reserve_many_in_two_steps(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let read: Vec<Option<Record>> = {
            let map = self.map.lock();
            requests
                .iter()
                .map(|r| map.get(&self.k(r.key)).cloned())
                .collect()
        };
        tokio::task::yield_now().await;
        let mut map = self.map.lock();
        requests
            .iter()
            .zip(read)
            .map(
                |(req, existing)| match reserve_transition(existing.as_ref(), req) {
                    ReserveTransition::Create => {
                        map.insert(self.k(req.key), reserved_record(None, req, 1));
                        Ok(Reservation::Acquired { attempt: 1 })
                    }
                    ReserveTransition::Takeover { attempt } => {
                        let record = reserved_record(existing.as_ref(), req, attempt);
                        map.insert(self.k(req.key), record);
                        Ok(Reservation::Acquired { attempt })
                    }
                    ReserveTransition::AlreadyHeld { attempt } => {
                        Ok(Reservation::Acquired { attempt })
                    }
                    ReserveTransition::Existing => existing
                        .map(Reservation::Existing)
                        .ok_or_else(|| Error::corrupt(req.key, "fixture: no record")),
                },
            )
            .collect()
    }

    /// `complete_many` as one read of every record, a round trip, then one
    /// unconditional write of those it found the owner's.
    async fn complete_many_in_two_steps(
        &self,
        completions: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        let owned: Vec<bool> = {
            let map = self.map.lock();
            completions
                .iter()
                .map(|c| {
                    map.get(&self.k(c.key))
                        .is_some_and(|r| self.may_write(r, c.owner, now, "complete"))
                })
                .collect()
        };
        tokio::task::yield_now().await;
        let mut map = self.map.lock();
        completions
            .iter()
            .zip(owned)
            .map(|(c, owned)| {
                self.check_size(c.result)?;
                let record = map.get_mut(&self.k(c.key)).filter(|_| owned);
                let Some(r) = record else {
                    return Err(Error::LeaseLost { key: c.key.clone() });
                };
                r.status = Status::Completed;
                r.result = c.result.map(<[u8]>::to_vec);
                r.expires_at = c.expires_at;
                r.updated_at = now;
                Ok(())
            })
            .collect()
    }
}

/// The answers of a batch in its keys' order instead of the request order.
fn in_key_order<T>(keys: &[&RecordKey], answers: Vec<T>) -> Vec<T> {
    let mut pairs: Vec<(&&RecordKey, T)> = keys.iter().zip(answers).collect();
    pairs.sort_by(|a, b| a.0.cmp(b.0));
    pairs.into_iter().map(|(_, answer)| answer).collect()
}

/// The chunk size of the chunking flaws.
const CHUNK: usize = 100;

#[async_trait]
impl Repository for Fixture {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("fixture")
            .with_max_result_bytes(
                Some(MAX_RESULT).filter(|_| !self.is(Flaw::UndeclaredResultLimit)),
            )
            .with_native_expiry(self.is(Flaw::NativeTtlKeptByWrites))
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }

    async fn reserve_many(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        if let Err(down) = self.reachable() {
            let down = down.to_string();
            return requests
                .iter()
                .map(|_| Err(Error::unavailable("fixture", down.clone())))
                .collect();
        }
        let first = self.is(Flaw::EmptyBatchPanics).then(|| requests[0].now);
        let (first_now, first_lease, first_expiry) = match requests.first() {
            Some(r) => (r.now, r.lease_until, r.expires_at),
            None => (
                first.unwrap_or(Timestamp::EPOCH),
                Timestamp::EPOCH,
                Timestamp::EPOCH,
            ),
        };
        let keys: Vec<&RecordKey> = requests.iter().map(|r| r.key).collect();
        if self.is(Flaw::ReserveManyCheckThenWrite) || self.is(Flaw::CasReserveManyCheckThenWrite) {
            return self.reserve_many_in_two_steps(requests).await;
        }
        let mut answers = Vec::with_capacity(requests.len());
        for (i, req) in requests.iter().enumerate() {
            let mut req = if i >= CHUNK && self.is(Flaw::ReserveManyChunkOffset) {
                requests[i % CHUNK].clone()
            } else {
                req.clone()
            };
            match self.flaw {
                Flaw::ReserveManyFirstNow => req.now = first_now,
                Flaw::ReserveManyFirstLease => {
                    req.lease_until = first_lease;
                    req.expires_at = first_expiry;
                }
                _ => {}
            }
            let held = self.map.lock().contains_key(&self.k(req.key));
            answers.push(if held && self.is(Flaw::ReserveManyAssumesAcquired) {
                Ok(Reservation::Acquired { attempt: 1 })
            } else {
                self.reserve_as(req, true).await
            });
        }
        if self.is(Flaw::ReserveManyKeyOrder) {
            return in_key_order(&keys, answers);
        }
        answers
    }

    async fn complete_many(
        &self,
        completions: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        if self.reachable().is_err() {
            return completions
                .iter()
                .map(|c| {
                    if self.is(Flaw::CompleteManyHidesOutage) {
                        Err(Error::LeaseLost { key: c.key.clone() })
                    } else {
                        self.reachable()
                    }
                })
                .collect();
        }
        let first_expiry = if self.is(Flaw::EmptyBatchPanics) {
            Some(completions[0].expires_at)
        } else {
            completions.first().map(|c| c.expires_at)
        };
        let oversized = completions
            .iter()
            .find_map(|c| c.result.filter(|r| r.len() > MAX_RESULT));
        if let (Some(big), true) = (oversized, self.is(Flaw::CompleteManyFailsTogether)) {
            let size = big.len();
            return completions
                .iter()
                .map(|_| {
                    Err(Error::TooLarge {
                        what: "result",
                        size,
                        max: MAX_RESULT,
                    })
                })
                .collect();
        }
        if self.is(Flaw::CompleteManyAllOrNothing) {
            let all_ok = {
                let map = self.map.lock();
                completions.iter().all(|c| {
                    self.check_size(c.result).is_ok()
                        && map
                            .get(&self.k(c.key))
                            .is_some_and(|r| self.may_write(r, c.owner, now, "complete"))
                })
            };
            if !all_ok {
                return completions
                    .iter()
                    .map(|c| Err(Error::LeaseLost { key: c.key.clone() }))
                    .collect();
            }
        }
        if self.is(Flaw::CompleteManyCheckThenWrite) || self.is(Flaw::CasCompleteManyCheckThenWrite)
        {
            return self.complete_many_in_two_steps(completions, now).await;
        }
        let keys: Vec<&RecordKey> = completions.iter().map(|c| c.key).collect();
        let mut answers = Vec::with_capacity(completions.len());
        for (i, c) in completions.iter().enumerate() {
            let mut c = if i >= CHUNK && self.is(Flaw::CompleteManyChunkOffset) {
                completions[i % CHUNK]
            } else {
                *c
            };
            if self.is(Flaw::CompleteManyIgnoresOwner) {
                if let Some(r) = self.map.lock().get(&self.k(c.key)) {
                    c.owner = r.owner;
                }
            }
            if let (Some(expiry), true) = (first_expiry, self.is(Flaw::CompleteManySharedExpiry)) {
                c.expires_at = expiry;
            }
            answers.push(self.complete_as(c, now, true).await);
        }
        if self.is(Flaw::CompleteManyKeyOrder) {
            return in_key_order(&keys, answers);
        }
        answers
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        self.reserve_as(req, false).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let c = Completion {
            key,
            owner,
            result,
            expires_at,
        };
        self.complete_as(c, now, false).await
    }

    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        if !self.is(Flaw::AcceptsOversizedErrors) {
            self.check_size(error)?;
        }
        self.check_item_size(key, error)?;
        let mut error = error.map(<[u8]>::to_vec);
        if self.is(Flaw::TruncatesErrors) {
            if let Some(e) = error.as_mut() {
                e.truncate(64 * 1024);
            }
        }
        if self.is(Flaw::DropsEmptyErrors) && error.as_ref().is_some_and(Vec::is_empty) {
            error = None;
        }
        let retryable = match self.flaw {
            Flaw::EveryFailureRetryable => true,
            Flaw::NoFailureRetryable => false,
            _ => retryable,
        };
        let keep_expiry = self.is(Flaw::FailKeepsExpiry);
        let stamp = !self.is(Flaw::FailKeepsUpdatedAt);
        let clear_fingerprint = self.is(Flaw::FailClearsFingerprint);
        self.owned(key, owner, now, "fail", |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.status = Status::Failed;
                if clear_fingerprint {
                    r.fingerprint = None;
                }
                r.error = error;
                r.retryable = retryable;
                if !keep_expiry {
                    r.expires_at = expires_at;
                }
                if stamp {
                    r.updated_at = now;
                }
            }
        })
        .await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        if self.is(Flaw::ReleaseIgnoresStatus) {
            self.map.lock().remove(&self.k(key));
            return Ok(());
        }
        let expire = self.is(Flaw::ReleaseExpiresInstead);
        self.owned(key, owner, now, "release", |map, k| {
            if expire {
                if let Some(r) = map.get_mut(&k) {
                    r.expires_at = now;
                    r.updated_at = now;
                }
            } else {
                map.remove(&k);
            }
        })
        .await
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let flaw = self.flaw;
        if flaw == Flaw::ExtendNoOpIsLeaseLost {
            let unchanged = self.map.lock().get(&self.k(key)).is_some_and(|r| {
                r.lease_until >= lease_until && r.expires_at >= expires_at && r.updated_at == now
            });
            if unchanged {
                return Err(Error::LeaseLost { key: key.clone() });
            }
        }
        self.owned(key, owner, now, "extend", |map, k| {
            if let Some(r) = map.get_mut(&k) {
                if flaw == Flaw::ExtendExpiryOnlyWithLease && lease_until <= r.lease_until {
                    return;
                }
                r.lease_until = match flaw {
                    Flaw::ExtendKeepsLease => r.lease_until,
                    Flaw::ExtendLowersLease => lease_until,
                    _ => r.lease_until.max(lease_until),
                };
                r.expires_at = match flaw {
                    Flaw::ExtendKeepsExpiry => r.expires_at,
                    Flaw::ExtendLowersExpiry => expires_at,
                    _ => r.expires_at.max(expires_at),
                };
                if flaw != Flaw::ExtendKeepsUpdatedAt {
                    r.updated_at = now;
                }
            }
        })
        .await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        self.reachable()?;
        if self.is(Flaw::CorruptIsAbsentToGet) && self.decodable(key).is_err() {
            return Ok(None);
        }
        self.decodable(key)?;
        let mut map = self.map.lock();
        let dropped = self
            .native_expiry
            .lock()
            .get(&self.k(key))
            .is_some_and(|at| *at <= std::time::Instant::now());
        if dropped {
            map.remove(&self.k(key));
        }
        let live = |r: &&Record| {
            (self.is(Flaw::GetReturnsExpired) || !self.expired(r, now))
                && !(self.is(Flaw::GetHidesEndedLeases)
                    && r.status == Status::Processing
                    && r.lease_until <= now)
        };
        let mut found = map.get(&self.k(key)).filter(live).cloned();
        if self.is(Flaw::GetTruncatesResults) {
            if let Some(result) = found.as_mut().and_then(|r| r.result.as_mut()) {
                result.truncate(64 * 1024);
            }
        }
        let falls_back =
            self.is(Flaw::GetFallsBackAcrossNamespaces) || self.is(Flaw::GetMatchesNamespacePrefix);
        if found.is_some() || !falls_back {
            return Ok(found);
        }
        if self.is(Flaw::GetMatchesNamespacePrefix) {
            let under = |other: &RecordKey| {
                other.id() == key.id() && other.namespace().starts_with(key.namespace())
            };
            return Ok(map
                .iter()
                .filter(|(k, _)| RecordKey::decode(k, usize::MAX).is_ok_and(|o| under(&o)))
                .map(|(_, r)| r)
                .find(live)
                .cloned());
        }
        Ok(map
            .iter()
            .filter(|(k, _)| {
                RecordKey::decode(k, usize::MAX).is_ok_and(|other| other.id() == key.id())
            })
            .map(|(_, r)| r)
            .find(live)
            .cloned())
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        self.reachable()?;
        if self.corrupt.lock().remove(&self.k(key)) {
            return Ok(true);
        }
        let mut map = self.map.lock();
        if self.is(Flaw::DeleteIgnoresNamespace) {
            let same_id: Vec<String> = map
                .keys()
                .filter(|k| RecordKey::decode(k, usize::MAX).is_ok_and(|o| o.id() == key.id()))
                .cloned()
                .collect();
            for k in &same_id {
                map.remove(k);
            }
            return Ok(!same_id.is_empty());
        }
        let removed = map.remove(&self.k(key));
        if self.is(Flaw::DeleteOnlyLive) {
            return Ok(removed.is_some_and(|r| !r.is_expired(wall_clock())));
        }
        Ok(removed.is_some() && !self.is(Flaw::DeleteReportsNothing))
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        self.reachable()?;
        let cutoff = match self.flaw {
            Flaw::PurgeOffByOne => now + MS,
            Flaw::PurgeByWallClock => wall_clock(),
            _ => now,
        };
        let limit = match self.flaw {
            Flaw::PurgeIgnoresLimit => usize::MAX,
            Flaw::PurgeZeroLimitUnbounded if limit == 0 => usize::MAX,
            _ => limit,
        };
        let dead: Vec<String> = self
            .map
            .lock()
            .iter()
            .filter(|(_, r)| match self.flaw {
                Flaw::PurgeSparesExactExpiry => r.expires_at < cutoff,
                Flaw::PurgeEndedLeases if r.lease_expired(cutoff) => true,
                _ => self.expired(r, cutoff),
            })
            .map(|(k, _)| k.clone())
            .take(limit)
            .collect();
        if self.is(Flaw::PurgeDeletesAfterRoundTrip) {
            // The flaw itself: a network round trip between the listing and
            // the deletes, real time as the suite's racers (it runs against
            // real servers) are.
            tokio::time::sleep(2 * MS).await;
        }
        if self.is(Flaw::PurgeDeletesByKey)
            || self.is(Flaw::CasPurgeDeletesByKey)
            || self.is(Flaw::PurgeDeletesAfterRoundTrip)
        {
            // The keys selected, then deleted in a second statement.
            tokio::task::yield_now().await;
            let mut map = self.map.lock();
            for k in &dead {
                map.remove(k);
            }
            return Ok(dead.len());
        }
        if self.cas {
            // Listed, then one conditional delete a round trip later.
            tokio::task::yield_now().await;
        }
        let mut map = self.map.lock();
        let mut removed = 0;
        for k in &dead {
            // Expired as selected, and still expired when deleted.
            let ended = |r: &Record| self.is(Flaw::PurgeEndedLeases) && r.lease_expired(cutoff);
            if map
                .get(k)
                .is_some_and(|r| self.expired(r, cutoff) || ended(r))
            {
                map.remove(k);
                removed += 1;
            }
        }
        Ok(if self.is(Flaw::PurgeReportsNothing) {
            0
        } else {
            removed
        })
    }
}

/// The errors clause's faults, acting on the fixture itself.
#[async_trait]
impl StoreFaults for Fixture {
    async fn corrupt(&self, key: &RecordKey) -> Result<(), String> {
        let k = self.k(key);
        self.map.lock().remove(&k);
        self.corrupt.lock().insert(k);
        Ok(())
    }

    async fn unreach(&self) -> Result<(), String> {
        self.down.store(true, Ordering::SeqCst);
        Ok(())
    }

    async fn reach(&self) -> Result<(), String> {
        self.down.store(false, Ordering::SeqCst);
        Ok(())
    }
}

impl Fixture {
    /// Whether `namespace` is under `prefix`: literally, or as the flawed
    /// listing's pattern reads it.
    fn prefix_matches(&self, prefix: &str, namespace: &str) -> bool {
        let (p, t): (Vec<char>, Vec<char>) =
            (prefix.chars().collect(), namespace.chars().collect());
        match self.flaw {
            Flaw::ListPrefixAsLikePattern => pattern_prefix(&p, &t, false),
            Flaw::ListPrefixAsGlob => pattern_prefix(&p, &t, true),
            _ => namespace.starts_with(prefix),
        }
    }
}

/// Whether `text` starts with something `pattern` matches: as SQL `LIKE`
/// (`_` one character, `%` any run), or as a glob (`?`, `*`, `[set]`).
fn pattern_prefix(pattern: &[char], text: &[char], glob: bool) -> bool {
    let (any_one, any_run) = if glob { ('?', '*') } else { ('_', '%') };
    match pattern.split_first() {
        None => true,
        Some((&c, rest)) if c == any_run => {
            (0..=text.len()).any(|skip| pattern_prefix(rest, &text[skip..], glob))
        }
        Some((&'[', rest)) if glob => {
            match (rest.iter().position(|&c| c == ']'), text.split_first()) {
                (Some(end), Some((t, tail))) => {
                    rest[..end].contains(t) && pattern_prefix(&rest[end + 1..], tail, glob)
                }
                _ => false,
            }
        }
        Some((&c, rest)) => match text.split_first() {
            Some((&t, tail)) => (c == any_one || c == t) && pattern_prefix(rest, tail, glob),
            None => false,
        },
    }
}

/// The operator operations, over the same map (and flaws).
#[async_trait]
impl Admin for Fixture {
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        let mut listing = Listing::default();
        let prefix = filter
            .namespace_prefix
            .as_deref()
            .filter(|_| !self.is(Flaw::ListIgnoresPrefix));
        for (k, r) in self.map.lock().iter() {
            let Ok(key) = RecordKey::decode(k, usize::MAX) else {
                continue;
            };
            let skew = match self.flaw {
                Flaw::ListStuckIgnoresSkew => Duration::ZERO,
                _ => filter.clock_skew,
            };
            let is_stuck = stuck(r, now, skew)
                || (r.status == Status::Processing && self.is(Flaw::ListStuckIgnoresLease))
                || (self.is(Flaw::ListStuckIgnoresStatus) && lease_ended(r.lease_until, now, skew));
            let admitted = (!r.is_expired(now) || self.is(Flaw::ListShowsExpired))
                && prefix.is_none_or(|p| self.prefix_matches(p, key.namespace()))
                && (filter.status.is_none_or(|s| r.status == s)
                    || self.is(Flaw::ListIgnoresStatus))
                && (!filter.stuck || is_stuck);
            if !admitted {
                continue;
            }
            let limit = if self.is(Flaw::ListKeepsProbeRow) {
                filter.limit + 1
            } else {
                filter.limit
            };
            if listing.records.len() >= limit {
                listing.truncated = !self.is(Flaw::ListNeverTruncated);
                break;
            }
            let flat = format!("{}:{}", key.namespace(), key.id());
            let (namespace, id) = match flat.rsplit_once(':') {
                Some(split) if self.is(Flaw::ListSplitsAtLastColon) => split,
                _ => (key.namespace(), key.id()),
            };
            listing.records.push(Listed {
                namespace: namespace.to_owned(),
                id: id.to_owned(),
                record: r.clone(),
            });
        }
        Ok(listing)
    }

    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        let mut stats = Stats::default();
        for (k, r) in self.map.lock().iter() {
            let Ok(key) = RecordKey::decode(k, usize::MAX) else {
                continue;
            };
            match self.flaw {
                Flaw::StatsCountsExpired => {
                    let is_stuck = stuck(r, now, clock_skew);
                    stats.add(key.namespace(), r.status, is_stuck, 1);
                }
                Flaw::StatsEveryLeaseStuck if !r.is_expired(now) => {
                    let stuck = r.status == Status::Processing;
                    stats.add(key.namespace(), r.status, stuck, 1);
                }
                Flaw::StatsStuckIgnoresSkew => stats.count(key.namespace(), r, now, Duration::ZERO),
                _ => stats.count(key.namespace(), r, now, clock_skew),
            }
        }
        if self.is(Flaw::StatsStuckIgnoresStatus) {
            // A second count of its own, `WHERE lease_until <= cutoff`
            // without the status.
            for counts in &mut stats.namespaces {
                counts.stuck = self
                    .map
                    .lock()
                    .iter()
                    .filter(|(k, r)| {
                        RecordKey::decode(k, usize::MAX)
                            .is_ok_and(|key| key.namespace() == counts.namespace)
                            && !r.is_expired(now)
                            && lease_ended(r.lease_until, now, clock_skew)
                    })
                    .count() as u64;
            }
        }
        Ok(stats)
    }

    async fn migrate(&self, _dry_run: bool) -> Result<Vec<String>, Error> {
        Ok(Vec::new())
    }

    async fn doctor(&self, _options: &DoctorOptions) -> Result<Vec<AdminCheck>, Error> {
        Ok(Vec::new())
    }
}

/// The whole suite and the errors clause against the fixture with `flaw`.
async fn reports(flaw: Flaw) -> [Report; 2] {
    let (repo, faults) = Fixture::with_faults(flaw);
    let suite = run_all(repo.clone()).await;
    [suite, run_fault_checks(repo, faults).await]
}

/// The checks `reports` failed.
fn caught_by(reports: &[Report]) -> Vec<&'static str> {
    reports
        .iter()
        .flat_map(Report::outcomes)
        .filter(|o| o.result.is_err())
        .map(|o| o.name)
        .collect()
}

/// Runs the check (of the suite, or of the errors clause) named `name`.
async fn rerun(name: &str, repo: SharedRepository, faults: SharedFaults) -> CheckResult {
    if let Some(check) = idempotency_conformance::check_named(name) {
        return run_check(check, repo).await;
    }
    let unknown = || CheckFailure {
        message: format!("no check named {name}"),
    };
    let check = fault_check_named(name).ok_or_else(unknown)?;
    let result = (check.run)(repo, faults.clone()).await;
    let healed = faults
        .reach()
        .await
        .map_err(|message| CheckFailure { message });
    result.and(healed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flawless_fixture_passes() {
    for report in reports(Flaw::None).await {
        report.assert_all_passed();
    }
}

/// The two-step store (every write a read, a round trip, then a
/// compare-and-swap, as over etcd) is correct: it passes everything too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flawless_two_step_fixture_passes() {
    for report in reports(Flaw::CasNone).await {
        report.assert_all_passed();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_flaw_of_the_catalogue_is_caught() {
    assert!(
        CATALOGUE.len() >= 40,
        "the catalogue has {} flaws",
        CATALOGUE.len()
    );
    // Four flaws at a time, each on a fixture of its own: most of a flaw's
    // run is waiting (fault checks pause between attempts), not work.
    let missed: Vec<String> = futures::stream::iter(CATALOGUE.iter())
        .map(|(flaw, description)| async move {
            let caught = !caught_by(&reports(*flaw).await).is_empty();
            (!caught).then(|| format!("{flaw:?}: {description}"))
        })
        .buffer_unordered(4)
        .filter_map(|missed| async move { missed })
        .collect()
        .await;
    assert!(
        missed.is_empty(),
        "flaws the suite lets through:\n{}",
        missed.join("\n")
    );
}

/// The fenced-race check must catch a check-then-write store on every run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_then_write_fencing_is_caught_every_run() {
    let check = idempotency_conformance::check_named("check_fenced_operations_race_takeover")
        .expect("the check exists");
    for run in 0..20 {
        let result = run_check(check, Fixture::shared(Flaw::CheckThenWrite)).await;
        assert!(
            result.is_err(),
            "run {run}: a check-then-write store passed"
        );
    }
}

/// Flaws only a race reveals, each with the check that must catch it in
/// every one of 20 consecutive runs (forced interleavings, not luck).
const RACE_FLAWS: &[(Flaw, &str)] = &[
    (Flaw::PurgeDeletesByKey, "check_purge_expired"),
    (Flaw::CasPurgeDeletesByKey, "check_purge_expired"),
    (Flaw::PurgeDeletesAfterRoundTrip, "check_purge_expired"),
    (
        Flaw::ReserveManyCheckThenWrite,
        "check_reserve_many_races_single_reserves",
    ),
    (
        Flaw::CasReserveManyCheckThenWrite,
        "check_reserve_many_races_single_reserves",
    ),
    (
        Flaw::ReserveManyPerKeyGap,
        "check_reserve_many_races_single_reserves",
    ),
    (
        Flaw::CasCompleteManyCheckThenWrite,
        "check_complete_many_races_takeovers",
    ),
    (
        Flaw::RecreateCheckThenWrite,
        "check_concurrent_recreate_of_expired",
    ),
];

/// Each race flaw fails its check in each of 20 runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn race_flaws_are_caught_every_run() {
    let missed: Vec<String> = futures::stream::iter(RACE_FLAWS.iter())
        .map(|(flaw, name)| async move {
            let check = idempotency_conformance::check_named(name).expect("the check exists");
            let mut passed = 0;
            for _ in 0..20 {
                if run_check(check, Fixture::shared(*flaw)).await.is_ok() {
                    passed += 1;
                }
            }
            (passed > 0).then(|| format!("{flaw:?} passed {name} in {passed} of 20 runs"))
        })
        .buffer_unordered(4)
        .filter_map(|missed| async move { missed })
        .collect()
        .await;
    assert!(missed.is_empty(), "{}", missed.join("\n"));
}

/// Prints the catalogue table: each flaw, the checks that caught it in a full
/// run, and in how many of 20 further runs of those checks it was caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "regenerates conformance-tests/CATALOGUE.md; takes minutes"]
async fn catalogue_table() {
    println!("| # | flaw | caught by | caught in |\n|---|---|---|---|");
    // `CATALOGUE_FROM=n` prints the rows from the n-th on only.
    let from: usize = std::env::var("CATALOGUE_FROM")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    for (i, (flaw, description)) in CATALOGUE.iter().enumerate().skip(from.saturating_sub(1)) {
        let checks = caught_by(&reports(*flaw).await);
        let mut caught = 0;
        for _ in 0..20 {
            let (repo, faults) = Fixture::with_faults(*flaw);
            for name in &checks {
                if rerun(name, repo.clone(), faults.clone()).await.is_err() {
                    caught += 1;
                    break;
                }
            }
        }
        let by = checks
            .iter()
            .map(|c| format!("`{c}`"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {} | {} | {by} | {caught}/20 |",
            i + 1,
            description.trim()
        );
    }
}
