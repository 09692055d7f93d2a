//! The stored record and its status.

use std::fmt;

use crate::error::Error;
use crate::key::{Fingerprint, OwnerToken, RecordKey};
use crate::time::Timestamp;

/// Where a record is in its life: `Processing → Completed | Failed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// An attempt holds the key and is running the handler.
    Processing,
    /// The handler succeeded; duplicates get the cached result (if any).
    Completed,
    /// The handler failed and the failure was stored.
    Failed,
}

impl Status {
    /// The stable name backends store: `processing`, `completed`, `failed`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Status::Processing => "processing",
            Status::Completed => "completed",
            Status::Failed => "failed",
        }
    }

    /// Parses [`Status::as_str`]'s output.
    pub fn parse(s: &str) -> Option<Status> {
        match s {
            "processing" => Some(Status::Processing),
            "completed" => Some(Status::Completed),
            "failed" => Some(Status::Failed),
            _ => None,
        }
    }

    /// A one-byte code for compact encodings (`P`, `C`, `F`).
    pub const fn code(self) -> u8 {
        match self {
            Status::Processing => b'P',
            Status::Completed => b'C',
            Status::Failed => b'F',
        }
    }

    /// Parses [`Status::code`]'s output.
    pub const fn from_code(c: u8) -> Option<Status> {
        match c {
            b'P' => Some(Status::Processing),
            b'C' => Some(Status::Completed),
            b'F' => Some(Status::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One idempotency record, as a repository returns it (contract §2).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Record {
    /// Where the record is in its life.
    pub status: Status,
    /// The fencing token of the attempt holding (or that last held) the record.
    pub owner: OwnerToken,
    /// 1 for a new record, +1 on every takeover.
    pub attempt: u32,
    /// Digest of the payload of the attempt holding the record, when validated.
    pub fingerprint: Option<Fingerprint>,
    /// The cached outcome of a `Completed` record (binary-safe, may be empty).
    pub result: Option<Vec<u8>>,
    /// The stored outcome of a `Failed` record.
    pub error: Option<Vec<u8>>,
    /// Whether a `Failed` record may be taken over by a later delivery (the
    /// handler's failure was retryable); `false` for every other status.
    pub retryable: bool,
    /// While `Processing`: from this instant another consumer may take over.
    pub lease_until: Timestamp,
    /// From this instant the record is logically gone, in every status.
    pub expires_at: Timestamp,
    /// When the record was first created.
    pub created_at: Timestamp,
    /// When the record last changed.
    pub updated_at: Timestamp,
}

impl Record {
    /// Whether the record is logically gone at `now` (`expires_at <= now`).
    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.expires_at <= now
    }

    /// Whether the record is `Processing` with a lease that ran out before
    /// `cutoff` (`lease_until <= cutoff`); `cutoff` is `now - clock_skew`.
    pub fn lease_expired(&self, cutoff: Timestamp) -> bool {
        self.status == Status::Processing && self.lease_until <= cutoff
    }
}

/// A record's columns as a SQL store keeps them, read but not yet checked:
/// [`into_record`](Self::into_record) turns them into a [`Record`] or says
/// what is wrong, naming the key (never a panic, never a record made up).
///
/// ```
/// use idempotency_core::{RecordKey, Status, StoredColumns};
/// let key = RecordKey::new("ns", "id", 256)?;
/// let columns = StoredColumns {
///     status: b"completed".to_vec(),
///     owner: vec![7; 16],
///     attempt: 1,
///     fingerprint: None,
///     result: Some(b"42".to_vec()),
///     error: None,
///     retryable: false,
///     lease_until: 1_000,
///     expires_at: 2_000,
///     created_at: 500,
///     updated_at: 900,
/// };
/// assert_eq!(columns.into_record(&key)?.status, Status::Completed);
/// let bad = StoredColumns { owner: vec![1, 2], ..StoredColumns::default() };
/// assert!(bad.into_record(&key).is_err());
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredColumns {
    /// `processing`, `completed` or `failed`, as text bytes.
    pub status: Vec<u8>,
    /// The owner token: 16 bytes.
    pub owner: Vec<u8>,
    /// The attempt, at least 1.
    pub attempt: i64,
    /// The payload fingerprint, if any.
    pub fingerprint: Option<Vec<u8>>,
    /// The cached result.
    pub result: Option<Vec<u8>>,
    /// The stored error.
    pub error: Option<Vec<u8>>,
    /// Whether a failure may be retried (meaningful for `failed` only).
    pub retryable: bool,
    /// Milliseconds since the epoch.
    pub lease_until: i64,
    /// Milliseconds since the epoch.
    pub expires_at: i64,
    /// Milliseconds since the epoch.
    pub created_at: i64,
    /// Milliseconds since the epoch.
    pub updated_at: i64,
}

impl StoredColumns {
    /// The record these columns hold.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming `key` for an unknown status, an owner that is
    /// not 16 bytes, an attempt below 1 or above `u32::MAX`, a malformed
    /// fingerprint or a negative timestamp.
    pub fn into_record(self, key: &RecordKey) -> Result<Record, Error> {
        let status = std::str::from_utf8(&self.status)
            .ok()
            .and_then(Status::parse)
            .ok_or_else(|| {
                let shown = String::from_utf8_lossy(&self.status);
                Error::corrupt(key, format!("unknown status {shown:?}"))
            })?;
        let owner = <[u8; 16]>::try_from(self.owner.as_slice())
            .map(OwnerToken::from_bytes)
            .map_err(|_| {
                Error::corrupt(key, format!("owner is {} bytes, not 16", self.owner.len()))
            })?;
        let attempt = u32::try_from(self.attempt)
            .ok()
            .filter(|a| *a >= 1)
            .ok_or_else(|| Error::corrupt(key, format!("attempt {} out of range", self.attempt)))?;
        let fingerprint = self
            .fingerprint
            .map(|f| Fingerprint::try_from_slice(&f))
            .transpose()
            .map_err(|e| e.with_key(key))?;
        let timestamp = |raw: i64, column: &str| {
            u64::try_from(raw)
                .map(Timestamp::from_millis)
                .map_err(|_| Error::corrupt(key, format!("negative timestamp {raw} in {column}")))
        };
        Ok(Record {
            status,
            owner,
            attempt,
            fingerprint,
            result: self.result,
            error: self.error,
            retryable: status == Status::Failed && self.retryable,
            lease_until: timestamp(self.lease_until, "lease_until")?,
            expires_at: timestamp(self.expires_at, "expires_at")?,
            created_at: timestamp(self.created_at, "created_at")?,
            updated_at: timestamp(self.updated_at, "updated_at")?,
        })
    }
}
