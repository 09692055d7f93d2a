//! The stored record and its status.

use std::fmt;

use crate::key::{Fingerprint, OwnerToken};
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
