//! The suite catches broken repositories: each fixture below is a correct store
//! with one deliberate flaw, and the suite must fail the checks that flaw breaks
//! (while the flawless fixture passes everything, proving the failures come from
//! the flaw).

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use idempotency_conformance::{run_all, Report};
use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    Capabilities, Error, OwnerToken, Record, RecordKey, Repository, Reservation, ReserveRequest,
    SharedRepository, Status, Timestamp,
};
use parking_lot::Mutex;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Flaw {
    None,
    /// Reads, awaits (like a network round trip), then writes: not atomic.
    NonAtomicReserve,
    /// `complete`/`fail` do not compare the owner token.
    IgnoresOwner,
    /// Never treats a record as expired.
    IgnoresExpiry,
    /// `release` deletes whatever is there, completed records included.
    ReleaseIgnoresStatus,
    /// Stores `Some(empty)` results as `None`.
    DropsEmptyResults,
    /// Encodes keys as `namespace:id` — not injective.
    CollidingKeys,
    /// `extend` moves the lease but not the expiry.
    ExtendKeepsExpiry,
    /// `extend` sets the expiry as asked, also earlier.
    ExtendLowersExpiry,
    /// A `reserve` re-sent by the holder is answered `Existing`.
    ResendIsExisting,
    /// `fail` stores every failure as retryable.
    EveryFailureRetryable,
    /// A takeover stores the request's fingerprint, `None` included.
    TakeoverDropsFingerprint,
    /// `complete`, `fail`, `release` and `extend` check the owner, yield (a
    /// round trip), then write whatever is there: check-then-write.
    CheckThenWrite,
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

    fn k(&self, key: &RecordKey) -> String {
        if self.flaw == Flaw::CollidingKeys {
            format!("{}:{}", key.namespace(), key.id())
        } else {
            key.encode()
        }
    }

    fn live(&self, r: &Record, now: Timestamp) -> bool {
        self.flaw == Flaw::IgnoresExpiry || !r.is_expired(now)
    }

    async fn owned<T>(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        f: impl FnOnce(&mut HashMap<String, Record>, String) -> T,
    ) -> Result<T, Error> {
        let k = self.k(key);
        let ok = match self.map.lock().get(&k) {
            Some(r) => {
                self.live(r, now)
                    && r.status == Status::Processing
                    && (r.owner == owner || self.flaw == Flaw::IgnoresOwner)
            }
            None => false,
        };
        if !ok {
            return Err(Error::LeaseLost { key: key.clone() });
        }
        if self.flaw == Flaw::CheckThenWrite {
            // The smallest gap there is: one trip through the scheduler.
            tokio::task::yield_now().await;
        }
        let mut map = self.map.lock();
        Ok(f(&mut map, k))
    }
}

#[async_trait]
impl Repository for Fixture {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("fixture")
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let k = self.k(req.key);
        let mut existing = self.map.lock().get(&k).cloned();
        if self.flaw == Flaw::IgnoresExpiry {
            if let Some(r) = existing.as_mut() {
                r.expires_at = Timestamp::MAX;
            }
        }
        if self.flaw == Flaw::NonAtomicReserve {
            // The gap between read and write that a network round trip makes:
            // long enough for every concurrent reserver to read the same state,
            // so the race the suite must catch happens on every run.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let mut map = self.map.lock();
        if self.flaw != Flaw::NonAtomicReserve {
            existing = map.get(&k).cloned();
            if self.flaw == Flaw::IgnoresExpiry {
                if let Some(r) = existing.as_mut() {
                    r.expires_at = Timestamp::MAX;
                }
            }
        }
        match reserve_transition(existing.as_ref(), &req) {
            ReserveTransition::Create => {
                map.insert(k, reserved_record(None, &req, 1));
                Ok(Reservation::Acquired { attempt: 1 })
            }
            ReserveTransition::Takeover { attempt } => {
                let mut record = reserved_record(existing.as_ref(), &req, attempt);
                if self.flaw == Flaw::TakeoverDropsFingerprint {
                    record.fingerprint = req.fingerprint;
                }
                map.insert(k, record);
                Ok(Reservation::Acquired { attempt })
            }
            ReserveTransition::AlreadyHeld { .. } if self.flaw == Flaw::ResendIsExisting => {
                existing
                    .map(Reservation::Existing)
                    .ok_or_else(|| Error::corrupt(req.key, "fixture: no record to return"))
            }
            ReserveTransition::AlreadyHeld { attempt } => Ok(Reservation::Acquired { attempt }),
            ReserveTransition::Existing => map
                .get(&k)
                .cloned()
                .or(existing)
                .map(Reservation::Existing)
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
        let drop_empty = self.flaw == Flaw::DropsEmptyResults;
        self.owned(key, owner, now, |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.status = Status::Completed;
                r.result = result
                    .filter(|b| !(drop_empty && b.is_empty()))
                    .map(<[u8]>::to_vec);
                r.expires_at = expires_at;
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
        self.owned(key, owner, now, |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.status = Status::Failed;
                r.error = error.map(<[u8]>::to_vec);
                r.retryable = retryable || self.flaw == Flaw::EveryFailureRetryable;
                r.expires_at = expires_at;
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
        if self.flaw == Flaw::ReleaseIgnoresStatus {
            self.map.lock().remove(&self.k(key));
            return Ok(());
        }
        self.owned(key, owner, now, |map, k| {
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
        self.owned(key, owner, now, |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.lease_until = lease_until;
                r.expires_at = match self.flaw {
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
            .filter(|r| self.live(r, now))
            .cloned())
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        Ok(self.map.lock().remove(&self.k(key)).is_some())
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        let mut map = self.map.lock();
        let dead: Vec<String> = map
            .iter()
            .filter(|(_, r)| !self.live(r, now))
            .map(|(k, _)| k.clone())
            .take(limit)
            .collect();
        for k in &dead {
            map.remove(k);
        }
        Ok(dead.len())
    }
}

async fn report(flaw: Flaw) -> Report {
    run_all(Fixture::shared(flaw)).await
}

fn assert_fails(report: &Report, checks: &[&str]) {
    for check in checks {
        assert!(report.failed(check), "`{check}` should fail:\n{report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flawless_fixture_passes() {
    report(Flaw::None).await.assert_all_passed();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn non_atomic_reserve_is_caught() {
    let r = report(Flaw::NonAtomicReserve).await;
    assert_fails(
        &r,
        &[
            "check_concurrent_reserve_single_winner",
            "check_concurrent_takeover_single_winner",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ignoring_the_owner_is_caught() {
    let r = report(Flaw::IgnoresOwner).await;
    assert_fails(
        &r,
        &[
            "check_complete_wrong_owner",
            "check_fail_wrong_owner_or_state",
            "check_reserve_takes_over_expired_lease",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ignoring_expiry_is_caught() {
    let r = report(Flaw::IgnoresExpiry).await;
    assert_fails(
        &r,
        &[
            "check_get_absent_and_expired",
            "check_reserve_after_expiry_creates_fresh",
            "check_expiry_boundary",
            "check_manager_ttl_expiry",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn releasing_finished_records_is_caught() {
    let r = report(Flaw::ReleaseIgnoresStatus).await;
    assert_fails(&r, &["check_release_refused", "check_release_expired"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropping_empty_results_is_caught() {
    let r = report(Flaw::DropsEmptyResults).await;
    assert_fails(&r, &["check_complete_empty_and_missing_results"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn colliding_key_encoding_is_caught() {
    let r = report(Flaw::CollidingKeys).await;
    assert_fails(&r, &["check_adversarial_keys_are_distinct"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extension_that_keeps_expiry_is_caught() {
    let r = report(Flaw::ExtendKeepsExpiry).await;
    assert_fails(&r, &["check_extend_moves_expiry"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extension_that_lowers_expiry_is_caught() {
    let r = report(Flaw::ExtendLowersExpiry).await;
    assert_fails(&r, &["check_extend_moves_expiry"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resent_reserve_answered_existing_is_caught() {
    let r = report(Flaw::ResendIsExisting).await;
    assert_fails(&r, &["check_reserve_resent_by_holder"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retrying_permanent_failures_is_caught() {
    let r = report(Flaw::EveryFailureRetryable).await;
    assert_fails(&r, &["check_fail_remembers_retryable"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn takeover_dropping_the_fingerprint_is_caught() {
    let r = report(Flaw::TakeoverDropsFingerprint).await;
    assert_fails(
        &r,
        &[
            "check_takeover_paths_write_every_field",
            "check_reserve_takeover_with_one_fingerprint",
        ],
    );
}

/// The race check must catch a check-then-write store on every run: run it
/// many times and require every run to fail it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_then_write_fencing_is_caught_every_run() {
    let check = idempotency_conformance::check_named("check_fenced_operations_race_takeover")
        .expect("the check exists");
    for run in 0..20 {
        let result =
            idempotency_conformance::run_check(check, Fixture::shared(Flaw::CheckThenWrite)).await;
        assert!(
            result.is_err(),
            "run {run}: a check-then-write store passed"
        );
    }
}
