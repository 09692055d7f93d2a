//! A batch's reservations read first: one `MGET` (on a cluster's primary, a
//! pipeline of `GET`s) for every key, and `SET … NX … GET` only for the keys
//! the stored records leave open.
//!
//! A redelivered poll is mostly duplicates, and a duplicate's stored record
//! decides it without a write: a live record that is not open to a takeover
//! answers `Existing`, our own live reservation (a re-sent reserve) answers
//! `Acquired` with its attempt, exactly as `SET … NX … GET` would have
//! answered from the same record, at the instant of the read. A read costs
//! the server a fraction of a `SET … NX PX … GET` per key (one command for
//! the whole batch on a standalone server), and the client no record to
//! encode per key. A key with no record, an expired one, or one open to a
//! takeover is left to the writes, sent next: a second round trip, which is
//! why the read goes first only while the recent reservations were mostly
//! duplicates (see [`BatchReads`](crate::BatchReads)).

use idempotency_core::FreshShare;
use idempotency_core::{Error, Reservation, ReserveRequest};
use redis::aio::ConnectionLike;
use redis::{RedisError, Value};

use super::commands::KeyArg;
use super::RedisRepository;
use crate::error::map_redis_error;

/// Whether a batch's reservations read their records first.
///
/// A server that refuses the read for anything but an outage (an ACL without
/// `MGET`, `CROSSSLOT` from a cluster node reached by a standalone URL)
/// gets that batch's writes instead, and every later batch writes first.
/// Reads go where the writes go; behind an endpoint that may reach a lagging
/// replica (a failover in progress), a read may answer from a record the
/// primary has since changed, as any read of it would: a duplicate answered
/// with an outcome since deleted, or "in progress" for a key since released
/// (the caller retries later). Every write still goes to the primary, and
/// the manager runs a handler only on a reservation confirmed within the
/// lease it asked for.
///
/// ```
/// use idempotency_redis::BatchReads;
///
/// assert_eq!(BatchReads::parse("always"), Some(BatchReads::Always));
/// assert_eq!(BatchReads::parse(BatchReads::Adaptive.as_str()), Some(BatchReads::Adaptive));
/// assert_eq!(BatchReads::parse("sometimes"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BatchReads {
    /// Read first while at most 15 % of the keys of the repository's recent
    /// batches (a moving average over about the last 32, shared by its
    /// clones) were fresh; write first otherwise and to begin with (single
    /// reservations are one `SET … NX … GET` whatever the mix). A redelivery storm gets one cheap read
    /// per batch; a stream of new messages pays no second round trip.
    #[default]
    Adaptive,
    /// Always `SET … NX … GET` first: one round trip for any batch.
    Never,
    /// Always read first: one round trip for a batch of duplicates, two for
    /// a batch with a key the records leave open.
    Always,
}

impl BatchReads {
    /// The name used in URLs (`batch_reads=…`): `adaptive`, `never` or
    /// `always`.
    pub const fn as_str(self) -> &'static str {
        match self {
            BatchReads::Adaptive => "adaptive",
            BatchReads::Never => "never",
            BatchReads::Always => "always",
        }
    }

    /// Parses [`BatchReads::as_str`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        [BatchReads::Adaptive, BatchReads::Never, BatchReads::Always]
            .into_iter()
            .find(|r| r.as_str() == s)
    }

    /// Whether the next batch reads first, given the recent mix.
    pub(crate) fn now(self, share: &FreshShare) -> bool {
        match self {
            BatchReads::Adaptive => share.mostly_duplicates(),
            BatchReads::Never => false,
            BatchReads::Always => true,
        }
    }
}

/// Per request: the answer its stored record decides, or `None` for the
/// writes.
pub(super) type Decided = Vec<Option<Result<Reservation, Error>>>;

impl RedisRepository {
    /// Reads every request's record in one round trip (`MGET` on a
    /// standalone server; a pipeline of `GET`s on a cluster primary, whose
    /// keys hash to many slots) and answers the requests their records
    /// decide. A reply that is not a string (a key of another type: `MGET`
    /// answers nil, `GET` an error) decides nothing: the write answers it as
    /// it would have.
    ///
    /// # Errors
    /// The call's own error (nothing was written); a reply of another shape
    /// than one value per key is [`Error::Backend`].
    pub(super) async fn read_first(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        requests: &[ReserveRequest<'_>],
    ) -> Result<Decided, Error> {
        let replies = self.read_records(conn, requests).await.map_err(|e| {
            let key = requests.first().map(|r| r.key);
            map_redis_error(e, key, "reserve")
        })?;
        if replies.len() != requests.len() {
            // Not an outage (nothing was written, and the server answered):
            // something between us and it answers reads otherwise, so
            // batches write first from then on.
            return Err(super::commands::unexpected(
                "reserve",
                "a read with a reply per key missing",
            ));
        }
        Ok(requests
            .iter()
            .zip(replies)
            .map(|(req, reply)| match reply {
                Value::BulkString(bytes) => match Self::decode(req.key, bytes) {
                    Ok(record) => Self::decided(req, record).map(Ok),
                    Err(e) => Some(Err(e)),
                },
                _ => None,
            })
            .collect())
    }

    /// The records, one reply per request, in order.
    async fn read_records(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        requests: &[ReserveRequest<'_>],
    ) -> Result<Vec<Value>, RedisError> {
        if self.is_cluster() {
            let mut pipe = redis::Pipeline::with_capacity(requests.len());
            pipe.ignore_errors();
            for req in requests {
                pipe.cmd("GET").arg(KeyArg(req.key));
            }
            let replies: Vec<redis::RedisResult<Value>> = pipe.query_async(conn).await?;
            return Ok(replies
                .into_iter()
                .map(|r| r.unwrap_or(Value::Nil))
                .collect());
        }
        let mut cmd = redis::cmd("MGET");
        for req in requests {
            cmd.arg(KeyArg(req.key));
        }
        match cmd.query_async::<Value>(conn).await? {
            Value::Array(values) => Ok(values),
            _ => Ok(Vec::new()),
        }
    }
}
