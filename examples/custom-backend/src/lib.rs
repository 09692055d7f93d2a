//! An idempotency-rs repository over a key-value store that offers only `get`,
//! compare-and-swap and delete-if-version — the primitives of etcd, Consul or a
//! versioned object store.
//!
//! Unlike the bundled in-memory store (a lock held across read-decide-write),
//! every operation here is an optimistic loop: read the value and its version,
//! decide with the core's pure functions, and write only if the version is
//! unchanged; on a conflict, read again. Records are stored in a small binary
//! format of this crate's own.
//!
//! ```
//! use std::sync::Arc;
//! use custom_backend_example::CasRepository;
//! use idempotency_core::{Config, HandlerError, IdempotencyManager};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let manager = IdempotencyManager::new(Arc::new(CasRepository::default()), Config::default()).unwrap();
//! let out = manager.execute("k", &(), || async { Ok::<_, HandlerError<String>>(1) }).await.unwrap();
//! assert!(out.handler_ran());
//! # });
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::admin::{Admin, Check, DoctorOptions, ListFilter, Listing, Stats};
use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    Capabilities, Error, Fingerprint, OwnerToken, Record, RecordKey, Repository, Reservation,
    ReserveRequest, Status, Timestamp,
};
use parking_lot::Mutex;

/// The store this repository is written against: versioned bytes with CAS.
#[derive(Debug, Default)]
pub struct CasStore {
    map: Mutex<BTreeMap<String, (u64, Vec<u8>)>>,
    next_version: Mutex<u64>,
}

impl CasStore {
    /// The value and its version.
    pub fn get(&self, key: &str) -> Option<(u64, Vec<u8>)> {
        self.map.lock().get(key).cloned()
    }

    /// Writes `value` if the current version is `expected` (`None`: absent).
    pub fn compare_and_swap(&self, key: &str, expected: Option<u64>, value: Vec<u8>) -> bool {
        let mut map = self.map.lock();
        if map.get(key).map(|(v, _)| *v) != expected {
            return false;
        }
        let mut next = self.next_version.lock();
        *next += 1;
        map.insert(key.to_owned(), (*next, value));
        true
    }

    /// Deletes if the current version is `expected`.
    pub fn delete_if(&self, key: &str, expected: u64) -> bool {
        let mut map = self.map.lock();
        if map.get(key).map(|(v, _)| *v) != Some(expected) {
            return false;
        }
        map.remove(key);
        true
    }

    /// Deletes unconditionally; whether something was there.
    pub fn delete(&self, key: &str) -> bool {
        self.map.lock().remove(key).is_some()
    }

    /// Every key (for purging).
    pub fn keys(&self) -> Vec<String> {
        self.map.lock().keys().cloned().collect()
    }
}

/// The repository: `RecordKey::encode()` as the store key, records in a binary
/// format, every write a compare-and-swap.
#[derive(Debug, Default)]
pub struct CasRepository {
    store: CasStore,
}

/// CAS conflicts before giving up with `Unavailable` (only reachable under
/// extreme contention).
const MAX_CONFLICTS: usize = 10_000;

impl CasRepository {
    fn read(&self, key: &str, rk: &RecordKey) -> Result<Option<(u64, Record)>, Error> {
        match self.store.get(key) {
            None => Ok(None),
            Some((version, bytes)) => {
                Ok(Some((version, decode(&bytes).map_err(|e| e.with_key(rk))?)))
            }
        }
    }

    /// Applies `f` to the live `Processing` record `owner` holds; `f` returns
    /// the new record, or `None` to delete it.
    fn update_owned(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        f: impl Fn(&Record) -> Option<Record>,
    ) -> Result<(), Error> {
        let k = key.encode();
        for _ in 0..MAX_CONFLICTS {
            let Some((version, record)) = self.read(&k, key)? else {
                return Err(Error::LeaseLost { key: key.clone() });
            };
            if record.is_expired(now)
                || record.status != Status::Processing
                || record.owner != owner
            {
                return Err(Error::LeaseLost { key: key.clone() });
            }
            let written = match f(&record) {
                Some(new) => self.store.compare_and_swap(&k, Some(version), encode(&new)),
                None => self.store.delete_if(&k, version),
            };
            if written {
                return Ok(());
            }
        }
        Err(contended())
    }
}

fn contended() -> Error {
    Error::Unavailable {
        backend: "cas-example",
        message: "too many compare-and-swap conflicts".into(),
        source: None,
    }
}

#[async_trait]
impl Repository for CasRepository {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("cas-example").with_max_result_bytes(Some(1 << 20))
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let k = req.key.encode();
        for _ in 0..MAX_CONFLICTS {
            let current = self.read(&k, req.key)?;
            let version = current.as_ref().map(|(v, _)| *v);
            let record = current.map(|(_, r)| r);
            let (new, attempt) = match reserve_transition(record.as_ref(), &req) {
                ReserveTransition::Existing => {
                    return record
                        .map(Reservation::Existing)
                        .ok_or_else(|| Error::corrupt(req.key, "no record to return"))
                }
                // A re-sent reserve from the owner that holds the record
                // (its first reply was lost): answer as the first time.
                ReserveTransition::AlreadyHeld { attempt } => {
                    return Ok(Reservation::Acquired { attempt })
                }
                ReserveTransition::Create => (reserved_record(None, &req, 1), 1),
                ReserveTransition::Takeover { attempt } => {
                    (reserved_record(record.as_ref(), &req, attempt), attempt)
                }
            };
            if self.store.compare_and_swap(&k, version, encode(&new)) {
                return Ok(Reservation::Acquired { attempt });
            }
        }
        Err(contended())
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        check_size(result)?;
        self.update_owned(key, owner, now, |r| {
            Some(Record {
                status: Status::Completed,
                result: result.map(<[u8]>::to_vec),
                expires_at,
                updated_at: now,
                ..r.clone()
            })
        })
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
        check_size(error)?;
        self.update_owned(key, owner, now, |r| {
            Some(Record {
                status: Status::Failed,
                error: error.map(<[u8]>::to_vec),
                retryable,
                expires_at,
                updated_at: now,
                ..r.clone()
            })
        })
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.update_owned(key, owner, now, |_| None)
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.update_owned(key, owner, now, |r| {
            Some(Record {
                // Extension moves the lease and expiry later, never earlier
                // (an older extension applied late must not undo a newer one).
                lease_until: r.lease_until.max(lease_until),
                expires_at: r.expires_at.max(expires_at),
                updated_at: now,
                ..r.clone()
            })
        })
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        Ok(self
            .read(&key.encode(), key)?
            .map(|(_, r)| r)
            .filter(|r| !r.is_expired(now)))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        Ok(self.store.delete(&key.encode()))
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        let mut removed = 0;
        for k in self.store.keys() {
            if removed >= limit {
                break;
            }
            if let Some((version, bytes)) = self.store.get(&k) {
                // Unreadable records are left for an operator, not purged blindly.
                if let Ok(r) = decode(&bytes) {
                    if r.is_expired(now) && self.store.delete_if(&k, version) {
                        removed += 1;
                    }
                }
            }
        }
        Ok(removed)
    }
}

impl CasRepository {
    /// Every readable record with its key (a store that can enumerate its
    /// keys; one that cannot would not implement `Admin`).
    fn records(&self) -> impl Iterator<Item = (RecordKey, Record)> + '_ {
        self.store.keys().into_iter().filter_map(|k| {
            let key = RecordKey::decode(&k, usize::MAX).ok()?;
            let (_, bytes) = self.store.get(&k)?;
            Some((key, decode(&bytes).ok()?))
        })
    }
}

/// The operator operations the `idempotency` command-line tool uses (`list`,
/// `stats`, `migrate`, `doctor`); `get`, `evict` and `purge` need only the
/// `Repository` trait.
#[async_trait]
impl Admin for CasRepository {
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        let mut listing = Listing::default();
        for (key, record) in self.records() {
            if !listing.offer(filter, &key, record, now) {
                break;
            }
        }
        Ok(listing)
    }

    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        let mut stats = Stats::default();
        for (key, record) in self.records() {
            stats.count(key.namespace(), &record, now, clock_skew);
        }
        Ok(stats)
    }

    /// Nothing to create: the store needs no schema.
    async fn migrate(&self, _dry_run: bool) -> Result<Vec<String>, Error> {
        Ok(Vec::new())
    }

    async fn doctor(&self, _options: &DoctorOptions) -> Result<Vec<Check>, Error> {
        Ok(vec![Check::warn(
            "persistence",
            "this example store lives in the process's memory",
            "back the CasStore with a durable compare-and-swap store",
        )])
    }
}

fn check_size(value: Option<&[u8]>) -> Result<(), Error> {
    match value {
        Some(v) if v.len() > 1 << 20 => Err(Error::TooLarge {
            what: "result",
            size: v.len(),
            max: 1 << 20,
        }),
        _ => Ok(()),
    }
}

// Format v2: b"I2" status(1) retryable(1) attempt(4) owner(16) lease(8)
// expires(8) created(8) updated(8) then three optional fields (fingerprint,
// result, error), each a presence byte and, when present, a u32 length and the
// bytes. Format v1 (b"I1") is v2 without the retryable byte; its failed records
// were written before failures were classified and read as retryable, as every
// failure was then.

fn encode(r: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + r.result.as_ref().map_or(0, Vec::len));
    out.extend_from_slice(b"I2");
    out.push(r.status.code());
    out.push(u8::from(r.retryable));
    out.extend_from_slice(&r.attempt.to_be_bytes());
    out.extend_from_slice(&r.owner.to_bytes());
    for t in [r.lease_until, r.expires_at, r.created_at, r.updated_at] {
        out.extend_from_slice(&t.as_millis().to_be_bytes());
    }
    let fp = r.fingerprint.map(|f| f.as_bytes().to_vec());
    for field in [&fp, &r.result, &r.error] {
        match field {
            None => out.push(0),
            Some(bytes) => {
                out.push(1);
                out.extend_from_slice(
                    &u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes(),
                );
                out.extend_from_slice(bytes);
            }
        }
    }
    out
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.0.len() < n {
            return Err(Error::corrupt_value("record", "truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        self.take(N)?
            .try_into()
            .map_err(|_| Error::corrupt_value("record", "truncated"))
    }
    fn optional(&mut self) -> Result<Option<Vec<u8>>, Error> {
        match self.array::<1>()?[0] {
            0 => Ok(None),
            1 => {
                let len = u32::from_be_bytes(self.array()?) as usize;
                Ok(Some(self.take(len)?.to_vec()))
            }
            _ => Err(Error::corrupt_value("record", "bad presence byte")),
        }
    }
}

fn decode(bytes: &[u8]) -> Result<Record, Error> {
    let mut r = Reader(bytes);
    let version = r.take(2)?;
    if version != b"I1" && version != b"I2" {
        return Err(Error::corrupt_value("record", "unknown format"));
    }
    let status = Status::from_code(r.array::<1>()?[0])
        .ok_or_else(|| Error::corrupt_value("record", "unknown status"))?;
    let retryable = if version == b"I1" {
        status == Status::Failed
    } else {
        match r.array::<1>()?[0] {
            0 => false,
            1 => true,
            _ => return Err(Error::corrupt_value("record", "bad retryable byte")),
        }
    };
    let attempt = u32::from_be_bytes(r.array()?);
    let owner = OwnerToken::from_bytes(r.array()?);
    let mut times = [Timestamp::EPOCH; 4];
    for t in &mut times {
        *t = Timestamp::from_millis(u64::from_be_bytes(r.array()?));
    }
    let fingerprint = r
        .optional()?
        .map(|b| Fingerprint::try_from_slice(&b))
        .transpose()?;
    let result = r.optional()?;
    let error = r.optional()?;
    if !r.0.is_empty() {
        return Err(Error::corrupt_value("record", "trailing bytes"));
    }
    Ok(Record {
        status,
        owner,
        attempt,
        fingerprint,
        result,
        error,
        retryable,
        lease_until: times[0],
        expires_at: times[1],
        created_at: times[2],
        updated_at: times[3],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn corrupt_bytes_are_a_typed_error() {
        let repo = CasRepository::default();
        let key = RecordKey::new("ns", "id", 256).unwrap();
        repo.store
            .compare_and_swap(&key.encode(), None, b"garbage".to_vec());
        match repo.get(&key, Timestamp::EPOCH).await {
            Err(Error::Corrupt { key: Some(k), .. }) => assert_eq!(k, key),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn records_round_trip_and_format_1_failures_read_as_retryable() {
        let record = Record {
            status: Status::Failed,
            owner: OwnerToken::from_bytes([7; 16]),
            attempt: 3,
            fingerprint: None,
            result: None,
            error: Some(b"boom".to_vec()),
            retryable: false,
            lease_until: Timestamp::from_millis(1),
            expires_at: Timestamp::from_millis(2),
            created_at: Timestamp::from_millis(3),
            updated_at: Timestamp::from_millis(4),
        };
        assert_eq!(decode(&encode(&record)).unwrap(), record);
        // Format 1 is format 2 without the retryable byte.
        let mut v1 = encode(&record);
        v1.remove(3);
        v1[1] = b'1';
        assert!(decode(&v1).unwrap().retryable);
    }
}
