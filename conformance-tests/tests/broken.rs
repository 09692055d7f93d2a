//! The suite catches broken repositories: a catalogue of plausible flaws, each
//! one bug a backend author could really write, built into an otherwise
//! correct store. Every flaw must fail at least one check in every run, while
//! the flawless store passes everything (so the failures come from the flaw).
//!
//! `catalogue_table` (ignored; run it with
//! `cargo test -p idempotency-conformance --test broken -- --ignored --nocapture catalogue_table`)
//! runs the whole suite against each flaw, then the catching checks 20 more
//! times, and prints the table published in `conformance-tests/CATALOGUE.md`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_conformance::{run_all, run_check, Report};
use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    Capabilities, Completion, Error, OwnerToken, Record, RecordKey, Repository, Reservation,
    ReserveRequest, SharedRepository, Status, Timestamp,
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
}

#[derive(Debug)]
struct Fixture {
    flaw: Flaw,
    map: Mutex<HashMap<String, Record>>,
}

impl Fixture {
    fn shared(flaw: Flaw) -> SharedRepository {
        Arc::new(Fixture {
            flaw,
            map: Mutex::new(HashMap::new()),
        })
    }

    fn is(&self, flaw: Flaw) -> bool {
        self.flaw == flaw
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
        match self.flaw {
            Flaw::CollidingKeys => format!("{}:{id}", key.namespace()),
            Flaw::IgnoresNamespace => id,
            _ if id == key.id() => key.encode(),
            _ => RecordKey::new(key.namespace(), &id, 1 << 20)
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

    /// The record as the decision sees it (flaws that misjudge time).
    fn as_judged(&self, r: &Record, now: Timestamp) -> Record {
        let mut r = r.clone();
        if !self.expired(&r, now) && r.is_expired(now) {
            r.expires_at = Timestamp::MAX;
        }
        r
    }

    /// The request as the decision sees it.
    fn judged_request<'a>(
        &self,
        req: &ReserveRequest<'a>,
        existing: Option<&Record>,
    ) -> ReserveRequest<'a> {
        let mut judged = req.clone();
        match self.flaw {
            Flaw::IgnoresClockSkew => judged.clock_skew = Duration::ZERO,
            Flaw::LeaseBoundaryOffByOne => judged.clock_skew += MS,
            Flaw::EarlyTakeover => judged.now = req.now + MS,
            Flaw::RetriesFailedWithoutFlag => judged.retry_failed = true,
            Flaw::TakeoverDespiteFingerprintConflict
                if existing.is_some_and(|r| r.fingerprint.is_some()) =>
            {
                judged.fingerprint = None;
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
    ) -> Record {
        let mut r = reserved_record(existing, req, attempt);
        let Some(old) = existing else { return r };
        if attempt > 1 {
            match self.flaw {
                Flaw::TakeoverDropsFingerprint => r.fingerprint = req.fingerprint,
                Flaw::TakeoverKeepsOwner => r.owner = old.owner,
                Flaw::TakeoverResetsAttempt => r.attempt = 1,
                Flaw::TakeoverResetsCreatedAt => r.created_at = req.now,
                Flaw::TakeoverKeepsError => r.error.clone_from(&old.error),
                Flaw::TakeoverKeepsLease => r.lease_until = old.lease_until,
                Flaw::TakeoverKeepsExpiry => r.expires_at = old.expires_at,
                _ => {}
            }
        } else {
            match self.flaw {
                Flaw::RecreateKeepsAttempt => r.attempt = old.attempt + 1,
                Flaw::RecreateKeepsCreatedAt => r.created_at = old.created_at,
                _ => {}
            }
        }
        r
    }

    fn answer_existing(&self, mut r: Record) -> Reservation {
        if self.is(Flaw::ExistingWithoutResult) {
            r.result = None;
        }
        Reservation::Existing(r)
    }

    /// Whether `owner` may finish or extend the record (per the flaws).
    fn may_write(&self, r: &Record, owner: OwnerToken, now: Timestamp, op: &str) -> bool {
        let owner_ok = r.owner == owner
            || match op {
                "release" => self.is(Flaw::ReleaseIgnoresOwner),
                "extend" => self.is(Flaw::ExtendIgnoresOwner),
                _ => self.is(Flaw::IgnoresOwner),
            };
        let status_ok = r.status == Status::Processing
            || (op == "complete" && self.is(Flaw::CompleteIgnoresStatus))
            || (op == "extend" && self.is(Flaw::ExtendIgnoresStatus));
        let live = !self.expired(r, now) || self.is(Flaw::FencedIgnoresExpiry);
        let clock_ok = !self.is(Flaw::FencedByClock) || r.lease_until > now;
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
        let k = self.k(key);
        let lost = || Err(Error::LeaseLost { key: key.clone() });
        if !self.is(Flaw::CheckThenWrite) {
            // Check and write under one lock: atomic, as a store must be.
            let mut map = self.map.lock();
            if !map
                .get(&k)
                .is_some_and(|r| self.may_write(r, owner, now, op))
            {
                return lost();
            }
            f(&mut map, k);
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

    fn check_size(&self, value: Option<&[u8]>) -> Result<(), Error> {
        match value {
            Some(v) if v.len() > MAX_RESULT && !self.is(Flaw::AcceptsOversizedResults) => {
                Err(Error::TooLarge {
                    what: "result",
                    size: v.len(),
                    max: MAX_RESULT,
                })
            }
            _ => Ok(()),
        }
    }
}

/// The answers of a batch in its keys' order instead of the request order.
fn in_key_order<T>(keys: &[&RecordKey], answers: Vec<T>) -> Vec<T> {
    let mut pairs: Vec<(&&RecordKey, T)> = keys.iter().zip(answers).collect();
    pairs.sort_by(|a, b| a.0.cmp(b.0));
    pairs.into_iter().map(|(_, answer)| answer).collect()
}

#[async_trait]
impl Repository for Fixture {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("fixture").with_max_result_bytes(Some(MAX_RESULT))
    }

    async fn reserve_many(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let keys: Vec<&RecordKey> = requests.iter().map(|r| r.key).collect();
        let mut answers = Vec::with_capacity(requests.len());
        for req in requests {
            let held = self.map.lock().contains_key(&self.k(req.key));
            answers.push(if held && self.is(Flaw::ReserveManyAssumesAcquired) {
                Ok(Reservation::Acquired { attempt: 1 })
            } else {
                self.reserve(req).await
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
        let keys: Vec<&RecordKey> = completions.iter().map(|c| c.key).collect();
        let mut answers = Vec::with_capacity(completions.len());
        for c in &completions {
            let mut owner = c.owner;
            if self.is(Flaw::CompleteManyIgnoresOwner) {
                if let Some(r) = self.map.lock().get(&self.k(c.key)) {
                    owner = r.owner;
                }
            }
            answers.push(
                self.complete(c.key, owner, c.result, c.expires_at, now)
                    .await,
            );
        }
        if self.is(Flaw::CompleteManyKeyOrder) {
            return in_key_order(&keys, answers);
        }
        answers
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let k = self.k(req.key);
        let read = self.map.lock().get(&k).cloned();
        let gap =
            self.is(Flaw::NonAtomicReserve) || (self.is(Flaw::NonAtomicTakeover) && read.is_some());
        if gap {
            // The gap a network round trip makes between read and write: long
            // enough for every concurrent reserver to read the same state.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut map = self.map.lock();
        let existing = if gap { read } else { map.get(&k).cloned() };
        let judged_record = existing.as_ref().map(|r| self.as_judged(r, req.now));
        let judged = self.judged_request(&req, existing.as_ref());
        match reserve_transition(judged_record.as_ref(), &judged) {
            ReserveTransition::Create => {
                let record = self.reserved(existing.as_ref(), &req, 1);
                let attempt = record.attempt;
                map.insert(k, record);
                Ok(Reservation::Acquired { attempt })
            }
            ReserveTransition::Takeover { attempt } => {
                let record = self.reserved(existing.as_ref(), &req, attempt);
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
                _ => Ok(Reservation::Acquired { attempt }),
            },
            ReserveTransition::Existing => existing
                .map(|r| self.answer_existing(r))
                .ok_or_else(|| Error::corrupt(req.key, "fixture: no record to return")),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.check_size(result)?;
        let mut result = result.map(<[u8]>::to_vec);
        if self.is(Flaw::DropsEmptyResults) && result.as_ref().is_some_and(Vec::is_empty) {
            result = None;
        }
        if self.is(Flaw::TruncatesResults) {
            if let Some(r) = result.as_mut() {
                r.truncate(64 * 1024);
            }
        }
        let keep_expiry = self.is(Flaw::CompleteKeepsExpiry);
        self.owned(key, owner, now, "complete", |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.status = Status::Completed;
                r.result = result;
                if !keep_expiry {
                    r.expires_at = expires_at;
                }
                r.updated_at = now;
            }
        })
        .await
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
        self.check_size(error)?;
        let mut error = error.map(<[u8]>::to_vec);
        if self.is(Flaw::DropsEmptyErrors) && error.as_ref().is_some_and(Vec::is_empty) {
            error = None;
        }
        let retryable = match self.flaw {
            Flaw::EveryFailureRetryable => true,
            Flaw::NoFailureRetryable => false,
            _ => retryable,
        };
        let keep_expiry = self.is(Flaw::FailKeepsExpiry);
        self.owned(key, owner, now, "fail", |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.status = Status::Failed;
                r.error = error;
                r.retryable = retryable;
                if !keep_expiry {
                    r.expires_at = expires_at;
                }
                r.updated_at = now;
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
        self.owned(key, owner, now, "release", |map, k| {
            map.remove(&k);
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
        self.owned(key, owner, now, "extend", |map, k| {
            if let Some(r) = map.get_mut(&k) {
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
                r.updated_at = now;
            }
        })
        .await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        Ok(self
            .map
            .lock()
            .get(&self.k(key))
            .filter(|r| self.is(Flaw::GetReturnsExpired) || !self.expired(r, now))
            .cloned())
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        let existed = self.map.lock().remove(&self.k(key)).is_some();
        Ok(existed && !self.is(Flaw::DeleteReportsNothing))
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        let mut map = self.map.lock();
        let cutoff = if self.is(Flaw::PurgeOffByOne) {
            now + MS
        } else {
            now
        };
        let limit = if self.is(Flaw::PurgeIgnoresLimit) {
            usize::MAX
        } else {
            limit
        };
        let dead: Vec<String> = map
            .iter()
            .filter(|(_, r)| self.expired(r, cutoff))
            .map(|(k, _)| k.clone())
            .take(limit)
            .collect();
        for k in &dead {
            map.remove(k);
        }
        Ok(if self.is(Flaw::PurgeReportsNothing) {
            0
        } else {
            dead.len()
        })
    }
}

async fn report(flaw: Flaw) -> Report {
    run_all(Fixture::shared(flaw)).await
}

/// The checks `report` failed.
fn caught_by(report: &Report) -> Vec<&'static str> {
    report
        .outcomes()
        .iter()
        .filter(|o| o.result.is_err())
        .map(|o| o.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flawless_fixture_passes() {
    report(Flaw::None).await.assert_all_passed();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_flaw_of_the_catalogue_is_caught() {
    assert!(
        CATALOGUE.len() >= 40,
        "the catalogue has {} flaws",
        CATALOGUE.len()
    );
    let mut missed = Vec::new();
    for (flaw, description) in CATALOGUE {
        let report = report(*flaw).await;
        if caught_by(&report).is_empty() {
            missed.push(format!("{flaw:?}: {description}"));
        }
    }
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

/// Prints the catalogue table: each flaw, the checks that caught it in a full
/// run, and in how many of 20 further runs of those checks it was caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "regenerates conformance-tests/CATALOGUE.md; takes minutes"]
async fn catalogue_table() {
    println!("| # | flaw | caught by | caught in |\n|---|---|---|---|");
    for (i, (flaw, description)) in CATALOGUE.iter().enumerate() {
        let checks = caught_by(&report(*flaw).await);
        let mut caught = 0;
        for _ in 0..20 {
            let repo = Fixture::shared(*flaw);
            for name in &checks {
                let check = idempotency_conformance::check_named(name).expect("a check");
                if run_check(check, repo.clone()).await.is_err() {
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
