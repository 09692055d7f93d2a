//! The in-memory repository: the embedded default.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use parking_lot::Mutex;

use crate::admin::{Admin, Check, DoctorOptions, ListFilter, Listing, Stats};
use crate::decision::{
    extend_record, finish_record, holds, reserve_transition, reserved_record, ReserveTransition,
};
use crate::error::Error;
use crate::key::{OwnerToken, RecordKey};
use crate::record::{Record, Status};
use crate::repository::{Capabilities, Repository, Reservation, ReserveRequest};
use crate::time::Timestamp;

const DEFAULT_SHARDS: usize = 64;

/// One record in a shard's table, with its key's hash: a growing table moves
/// slots of a few words and never hashes a key again (a fresh key per execution grows
/// the tables all the time; moving whole records and rehashing every key was
/// half of an execution's cost).
#[derive(Debug)]
struct Slot {
    hash: u64,
    key: RecordKey,
    record: Box<Record>,
}

/// One shard's records, found by the hash [`MemoryRepository::locate`] computes.
#[derive(Debug, Default)]
struct Shard(HashTable<Slot>);

impl Shard {
    fn get(&self, hash: u64, key: &RecordKey) -> Option<&Record> {
        self.0.find(hash, |s| s.key == *key).map(|s| &*s.record)
    }

    fn get_mut(&mut self, hash: u64, key: &RecordKey) -> Option<&mut Record> {
        self.0
            .find_mut(hash, |s| s.key == *key)
            .map(|s| &mut *s.record)
    }

    fn remove(&mut self, hash: u64, key: &RecordKey) -> bool {
        match self.0.find_entry(hash, |s| s.key == *key) {
            Ok(slot) => {
                slot.remove();
                true
            }
            Err(_) => false,
        }
    }
}

/// A process-local repository: sharded hash maps, each operation atomic under its
/// shard's lock (held for a few hundred nanoseconds, never across an `.await`).
///
/// It protects against duplicates within one process only — use a shared store
/// (Redis, PostgreSQL, DynamoDB) when several processes consume the same stream.
/// Expired records are absent to every operation at once and are removed
/// physically when touched or by [`Repository::purge_expired`].
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{IdempotencyManager, MemoryRepository, Config, Outcome, HandlerError};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
/// let first = manager
///     .execute("order-1", &(), || async { Ok::<_, HandlerError<String>>(42) })
///     .await?;
/// let again = manager
///     .execute("order-1", &(), || async { Ok::<_, HandlerError<String>>(0) })
///     .await?;
/// assert!(matches!(first, Outcome::Executed(42)));
/// assert!(matches!(again, Outcome::Cached(42)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct MemoryRepository {
    shards: Box<[Mutex<Shard>]>,
    /// foldhash (randomly seeded per repository) instead of SipHash: several
    /// times faster on short keys, and still seeded, so keys an attacker chooses
    /// cannot be aimed at one bucket ahead of time.
    hasher: foldhash::fast::RandomState,
    max_result_bytes: Option<usize>,
    /// Round-robin cursor for `purge_expired`, so repeated calls make progress.
    purge_cursor: AtomicUsize,
}

impl Default for MemoryRepository {
    fn default() -> Self {
        MemoryRepository::new()
    }
}

impl MemoryRepository {
    /// An empty repository with 64 shards and no result size limit.
    pub fn new() -> Self {
        MemoryRepository::with_shards(DEFAULT_SHARDS)
    }

    /// An empty repository with `shards` shards (at least 1).
    pub fn with_shards(shards: usize) -> Self {
        MemoryRepository {
            shards: (0..shards.max(1))
                .map(|_| Mutex::new(Shard::default()))
                .collect(),
            hasher: Default::default(),
            max_result_bytes: None,
            purge_cursor: AtomicUsize::new(0),
        }
    }

    /// Declares (and enforces) a maximum result size, e.g. to test how the manager
    /// handles a store with a small limit.
    pub fn with_max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = Some(max);
        self
    }

    /// The number of records physically held (live or expired).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().0.len()).sum()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The key's hash and its shard. The shard comes from bits 32 and up, which
    /// a table uses neither for its bucket index (the low bits) nor for its tags
    /// (the top 7) until it holds billions of slots: the keys of one shard still
    /// spread over its table.
    fn locate(&self, key: &RecordKey) -> (u64, &Mutex<Shard>) {
        let hash = self.hasher.hash_one(key);
        let i = usize::try_from((hash >> 32) % self.shards.len() as u64).unwrap_or(0);
        (hash, &self.shards[i])
    }

    /// Runs `f` on the live `Processing` record `owner` holds; `LeaseLost`
    /// otherwise. `f` returns whether to keep the record.
    fn with_owned(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        f: impl FnOnce(&mut Record) -> bool,
    ) -> Result<(), Error> {
        let (hash, shard) = self.locate(key);
        let mut shard = shard.lock();
        match shard.get_mut(hash, key) {
            Some(r) if holds(r, owner, now) => {
                if !f(r) {
                    shard.remove(hash, key);
                }
                Ok(())
            }
            _ => Err(Error::LeaseLost { key: key.clone() }),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        status: Status,
        value: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.capabilities().check_value(
            if status == Status::Completed {
                "result"
            } else {
                "error"
            },
            value,
        )?;
        self.with_owned(key, owner, now, |r| {
            finish_record(r, status, value, retryable, expires_at, now);
            true
        })
    }
}

#[async_trait]
impl Repository for MemoryRepository {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("memory")
            .with_max_result_bytes(self.max_result_bytes)
            .with_max_id_bytes(4096)
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let (hash, shard) = self.locate(req.key);
        let mut shard = shard.lock();
        // One probe decides and writes: a fresh key's slot is found once.
        let entry = shard.0.entry(hash, |s| s.key == *req.key, |s| s.hash);
        let existing = match &entry {
            Entry::Occupied(slot) => Some(&*slot.get().record),
            Entry::Vacant(_) => None,
        };
        let (replacement, answer) = match reserve_transition(existing, &req) {
            ReserveTransition::Create => (
                Some(reserved_record(None, &req, 1)),
                Reservation::Acquired { attempt: 1 },
            ),
            ReserveTransition::Takeover { attempt } => (
                Some(reserved_record(existing, &req, attempt)),
                Reservation::Acquired { attempt },
            ),
            ReserveTransition::AlreadyHeld { attempt } => (None, Reservation::Acquired { attempt }),
            ReserveTransition::Existing => match existing {
                Some(r) => (None, Reservation::Existing(r.clone())),
                None => return Err(Error::corrupt(req.key, "reserve found no record to return")),
            },
        };
        match (replacement, entry) {
            (Some(record), Entry::Occupied(mut slot)) => *slot.get_mut().record = record,
            (Some(record), Entry::Vacant(slot)) => {
                slot.insert(Slot {
                    hash,
                    key: req.key.clone(),
                    record: Box::new(record),
                });
            }
            (None, _) => {}
        }
        Ok(answer)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.finish(
            key,
            owner,
            Status::Completed,
            result,
            false,
            expires_at,
            now,
        )
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
        self.finish(
            key,
            owner,
            Status::Failed,
            error,
            retryable,
            expires_at,
            now,
        )
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.with_owned(key, owner, now, |_| false)
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.with_owned(key, owner, now, |r| {
            extend_record(r, lease_until, expires_at, now);
            true
        })
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        let (hash, shard) = self.locate(key);
        let mut shard = shard.lock();
        match shard.get(hash, key) {
            Some(r) if r.is_expired(now) => {
                shard.remove(hash, key);
                Ok(None)
            }
            other => Ok(other.cloned()),
        }
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        let (hash, shard) = self.locate(key);
        Ok(shard.lock().remove(hash, key))
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        let n = self.shards.len();
        let start = self.purge_cursor.fetch_add(1, Ordering::Relaxed);
        let mut removed = 0;
        for i in 0..n {
            if removed >= limit {
                break;
            }
            let mut shard = self.shards[(start + i) % n].lock();
            let mut budget = limit - removed;
            shard.0.retain(|s| {
                let purge = budget > 0 && s.record.is_expired(now);
                budget -= usize::from(purge);
                !purge
            });
            removed = limit - budget;
        }
        Ok(removed)
    }
}

/// Listing and counting walk the shards one lock at a time (each held for
/// one shard's scan, never across an `.await`).
#[async_trait]
impl Admin for MemoryRepository {
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        let mut listing = Listing::default();
        for shard in self.shards.iter() {
            for slot in shard.lock().0.iter() {
                if !listing.offer(filter, &slot.key, (*slot.record).clone(), now) {
                    return Ok(listing);
                }
            }
        }
        Ok(listing)
    }

    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        let mut stats = Stats::default();
        for shard in self.shards.iter() {
            for slot in shard.lock().0.iter() {
                stats.count(slot.key.namespace(), &slot.record, now, clock_skew);
            }
        }
        Ok(stats)
    }

    async fn migrate(&self, _dry_run: bool) -> Result<Vec<String>, Error> {
        Ok(Vec::new())
    }

    async fn doctor(&self, _options: &DoctorOptions) -> Result<Vec<Check>, Error> {
        Ok(vec![Check::warn(
            "persistence",
            "the in-memory store keeps records in this process only: another process, or \
             this one after a restart, runs every handler again",
            "use a shared store (sqlite://, redis://, postgres://, mysql://, dynamodb://) when \
             several processes consume the same messages or a restart must not repeat effects",
        )])
    }
}
