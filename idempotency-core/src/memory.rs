//! The in-memory repository: the embedded default.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use parking_lot::Mutex;

use crate::decision::{reserve_transition, reserved_record, ReserveTransition};
use crate::error::Error;
use crate::key::{OwnerToken, RecordKey};
use crate::record::{Record, Status};
use crate::repository::{Capabilities, Repository, Reservation, ReserveRequest};
use crate::time::Timestamp;

const DEFAULT_SHARDS: usize = 64;

/// One shard's records. foldhash (randomly seeded per map) instead of SipHash:
/// several times faster on short keys, and still seeded, so keys an attacker
/// chooses cannot be aimed at one bucket ahead of time.
type Shard = HashMap<RecordKey, Record, foldhash::fast::RandomState>;

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
    /// Picks the shard. Seeded independently of the shards' own hashers, so the
    /// keys of one shard still spread over its table.
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
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &RecordKey) -> &Mutex<Shard> {
        let h = self.hasher.hash_one(key);
        let i = usize::try_from(h % self.shards.len() as u64).unwrap_or(0);
        &self.shards[i]
    }

    fn check_size(&self, what: &'static str, value: Option<&[u8]>) -> Result<(), Error> {
        match (self.max_result_bytes, value) {
            (Some(max), Some(v)) if v.len() > max => Err(Error::TooLarge {
                what,
                size: v.len(),
                max,
            }),
            _ => Ok(()),
        }
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
        let mut shard = self.shard(key).lock();
        match shard.get_mut(key) {
            Some(r) if !r.is_expired(now) && r.status == Status::Processing && r.owner == owner => {
                if !f(r) {
                    shard.remove(key);
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
        self.check_size(
            if status == Status::Completed {
                "result"
            } else {
                "error"
            },
            value,
        )?;
        self.with_owned(key, owner, now, |r| {
            r.status = status;
            let value = value.map(<[u8]>::to_vec);
            if status == Status::Completed {
                r.result = value;
            } else {
                r.error = value;
            }
            r.retryable = retryable;
            r.expires_at = expires_at;
            r.updated_at = now;
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
        let mut shard = self.shard(req.key).lock();
        let existing = shard.get(req.key);
        match reserve_transition(existing, &req) {
            ReserveTransition::Create => {
                shard.insert(req.key.clone(), reserved_record(None, &req, 1));
                Ok(Reservation::Acquired { attempt: 1 })
            }
            ReserveTransition::Takeover { attempt } => {
                let record = reserved_record(existing, &req, attempt);
                shard.insert(req.key.clone(), record);
                Ok(Reservation::Acquired { attempt })
            }
            ReserveTransition::AlreadyHeld { attempt } => Ok(Reservation::Acquired { attempt }),
            ReserveTransition::Existing => match existing {
                Some(r) => Ok(Reservation::Existing(r.clone())),
                None => Err(Error::corrupt(req.key, "reserve found no record to return")),
            },
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
            r.lease_until = lease_until;
            r.expires_at = r.expires_at.max(expires_at);
            r.updated_at = now;
            true
        })
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        let mut shard = self.shard(key).lock();
        match shard.get(key) {
            Some(r) if r.is_expired(now) => {
                shard.remove(key);
                Ok(None)
            }
            other => Ok(other.cloned()),
        }
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        Ok(self.shard(key).lock().remove(key).is_some())
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
            let expired: Vec<RecordKey> = shard
                .iter()
                .filter(|(_, r)| r.is_expired(now))
                .map(|(k, _)| k.clone())
                .take(limit - removed)
                .collect();
            for k in expired {
                shard.remove(&k);
                removed += 1;
            }
        }
        Ok(removed)
    }
}
