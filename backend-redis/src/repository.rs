//! [`RedisRepository`]: the repository over a standalone server or a cluster.
//!
//! This file is the table of contents: the repository, and its
//! [`Repository`] implementation, each operation handing over to the module
//! of its concern:
//! - `connect`: connecting and building (URLs, clients, options, the scripts'
//!   preload, the probe for another service at the address);
//! - `reserve`: one key's reservation (`SET … NX … GET`, or the script);
//! - `finish`: the owner-checked writes (`complete`, `fail`, `release`,
//!   `extend`), and a batch's completions as `EVALSHA finish` per key;
//! - `reserve_many` and `read_first`: a batch's reservations;
//! - `complete_many`: a batch's completions, and the `complete_many` script;
//! - `cluster`: Redis Cluster's routing of keyed commands and batches;
//! - `commands`: keys as arguments, sending a command or a script, and the
//!   replies' common shapes.
//!
//! The operator operations are in `crate::admin`.

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use async_trait::async_trait;
use idempotency_core::{
    Capabilities, Completion, Error, FreshShare, OwnerToken, Record, RecordKey, Repository,
    Reservation, ReserveRequest, Status, Timestamp,
};
use redis::aio::ConnectionManager;
use redis::{Cmd, RedisError, Value};

use crate::error::BACKEND;
use crate::options::ReserveStrategy;
use crate::scripts::Scripts;

mod cluster;
mod commands;
mod complete_many;
mod connect;
mod finish;
mod read_first;
mod reserve;
mod reserve_many;

use commands::{unexpected, KeyArg};
pub use read_first::BatchReads;

/// The longest id stored verbatim; longer ids are digested by
/// [`RecordKey::new`].
pub const MAX_ID_BYTES: usize = 1024;

/// The connection: a reconnecting standalone connection or a cluster connection.
#[derive(Clone)]
enum Conn {
    Standalone(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Conn {
    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Conn::Standalone(c) => cmd.query_async(&mut c.clone()).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Conn::Standalone(_) => "standalone",
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => "cluster",
        }
    }
}

/// A [`Repository`] on Redis, standalone or Redis Cluster (feature `cluster`).
/// [`ReserveStrategy::SetNxGet`] needs Redis ≥ 7.0 (or Valkey); the scripts
/// use nothing newer than Redis 6.0 (`KEEPTTL`), and on a server that rejects
/// `SET … NX … GET` the repository switches to [`ReserveStrategy::Script`] by
/// itself (the tests run against Redis 7.0). Every decision is one round trip; see the crate docs for the
/// commands per operation, the record format and the persistence caveat.
///
/// Cloning is cheap and shares the connection; calls from many tasks are
/// multiplexed over it. After a connection loss the connection is re-established
/// in the background; calls made meanwhile fail with [`Error::Unavailable`] (or
/// [`Error::Timeout`]) instead of hanging or panicking, and later calls succeed
/// again on the same repository.
#[derive(Clone)]
pub struct RedisRepository {
    conn: Conn,
    scripts: Arc<Scripts>,
    strategy: ReserveStrategy,
    /// Cleared when the server rejects `SET … NX … GET` (Redis < 7.0).
    set_nx_get_supported: Arc<AtomicBool>,
    /// Cleared when a standalone server shows that the `complete_many`
    /// script cannot see all its keys (a proxy in front of shards, or a
    /// cluster node reached by a standalone URL): it refused the keys as
    /// spread over slots, or a key the script did not complete was then
    /// completed on its own.
    multi_key_scripts: Arc<AtomicBool>,
    max_result_bytes: usize,
    /// Whether a batch's reservations read their records first.
    batch_reads: BatchReads,
    /// Set when the server refused a batch's read for anything but an
    /// outage (an ACL without `MGET`, `CROSSSLOT`, a proxy): batches write
    /// first from then on.
    reads_refused: Arc<AtomicBool>,
    /// The recent share of fresh keys (for [`BatchReads::Adaptive`]).
    fresh_share: Arc<FreshShare>,
    /// On a cluster reached by URL: the slot table and our connections to its
    /// primaries, for keyed commands and batches (see `nodes`).
    #[cfg(feature = "cluster")]
    nodes: Option<Arc<crate::nodes::Nodes>>,
}

impl fmt::Debug for RedisRepository {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRepository")
            .field("connection", &self.conn.kind())
            .field("reserve_strategy", &self.effective_strategy())
            .field("max_result_bytes", &self.max_result_bytes)
            .finish()
    }
}

#[async_trait]
impl Repository for RedisRepository {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(BACKEND)
            .with_max_result_bytes(Some(self.max_result_bytes))
            .with_max_id_bytes(MAX_ID_BYTES)
            .with_native_expiry(true)
    }

    fn admin(&self) -> Option<&dyn idempotency_core::admin::Admin> {
        Some(self)
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        self.reserve_one(req).await
    }

    /// One pipeline of reservations on a standalone server (one round trip);
    /// on a cluster reached by URL, one pipeline per primary, on a connection
    /// of the repository's own to it (one round trip per primary, in
    /// parallel; see the crate docs); on a cluster connection passed in, one
    /// command per key, concurrently.
    async fn reserve_many(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        self.reserve_batch(requests).await
    }

    /// On a standalone server, the `complete_many` script over up to 100
    /// keys per call, every call in one pipeline (one round trip), and the
    /// keys it did not complete again on their own (one more); on a cluster,
    /// or on a server whose scripts cannot see all their keys, `EVALSHA
    /// finish` per key, pipelined as for `reserve_many`.
    async fn complete_many(
        &self,
        completions: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        self.complete_batch(completions, now).await
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
        self.finish(
            key,
            owner,
            Status::Failed,
            error,
            retryable,
            expires_at,
            now,
        )
        .await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.release_lease(key, owner, now).await
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.extend_lease(key, owner, lease_until, expires_at, now)
            .await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(KeyArg(key));
        match self.query(&cmd, key, "get").await? {
            Value::Nil => Ok(None),
            Value::BulkString(bytes) => {
                let record = Self::decode(key, bytes)?;
                Ok((!record.is_expired(now)).then_some(record))
            }
            _ => Err(unexpected("get", "an unexpected reply to GET")),
        }
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(KeyArg(key));
        match self.query(&cmd, key, "delete").await? {
            Value::Int(n) => Ok(n > 0),
            _ => Err(unexpected("delete", "an unexpected reply to DEL")),
        }
    }

    /// Redis removes expired keys by itself (`PX`), so this removes nothing.
    async fn purge_expired(&self, _now: Timestamp, _limit: usize) -> Result<usize, Error> {
        Ok(0)
    }
}
