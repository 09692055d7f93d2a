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

    fn owned<T>(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        f: impl FnOnce(&mut HashMap<String, Record>, String) -> T,
    ) -> Result<T, Error> {
        let mut map = self.map.lock();
        let k = self.k(key);
        let ok = match map.get(&k) {
            Some(r) => {
                self.live(r, now)
                    && r.status == Status::Processing
                    && (r.owner == owner || self.flaw == Flaw::IgnoresOwner)
            }
            None => false,
        };
        if ok {
            Ok(f(&mut map, k))
        } else {
            Err(Error::LeaseLost { key: key.clone() })
        }
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
                map.insert(k, reserved_record(existing.as_ref(), &req, attempt));
                Ok(Reservation::Acquired { attempt })
            }
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
    }

    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.owned(key, owner, now, |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.status = Status::Failed;
                r.error = error.map(<[u8]>::to_vec);
                r.expires_at = expires_at;
                r.updated_at = now;
            }
        })
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
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.owned(key, owner, now, |map, k| {
            if let Some(r) = map.get_mut(&k) {
                r.lease_until = lease_until;
                r.updated_at = now;
            }
        })
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
