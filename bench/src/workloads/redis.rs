//! Redis: the library against redis-rs issuing the same commands on the same
//! connection manager — `SET … NX PX … GET` to reserve (a duplicate ends there)
//! and `EVALSHA` of the library's `finish` script to complete.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_conformance::containers::WireCounter;
use idempotency_core::{Clock, IdempotencyManager, SystemClock};
use idempotency_redis::redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
#[cfg(feature = "redis-cluster")]
use idempotency_redis::redis::cluster_async::ClusterConnection;
use idempotency_redis::redis::{self, Value};
use idempotency_redis::{BatchReads, RedisRepository};

use super::{config, execute, key_id, populate, receipt_bytes, Lane, Workload};
use crate::{BoxError, Scenario, Variant};

/// The library and the raw client (`C`: a connection manager, or a cluster
/// connection).
struct Side<C> {
    manager: IdempotencyManager,
    conn: C,
    finish_sha: String,
}

impl<C> Side<C> {
    /// The manager over `repo` (its scripts loaded), beside `conn`.
    async fn new(repo: RedisRepository, conn: C) -> Result<Self, BoxError> {
        repo.load_scripts().await?;
        let finish_sha = repo
            .scripts()
            .iter()
            .find(|s| s.name() == "finish")
            .map(|s| s.sha().to_owned())
            .ok_or("the Redis backend has no `finish` script")?;
        let manager = IdempotencyManager::new(Arc::new(repo), config())?;
        Ok(Side {
            manager,
            conn,
            finish_sha,
        })
    }
}

impl<C: ConnectionLike + Clone + Send + Sync> Side<C> {
    /// One operation on key `i` of `ns`, by the library or the raw client.
    async fn op(
        &self,
        ttl: Duration,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
    ) -> Result<(), BoxError> {
        match variant {
            Variant::Library => execute(&self.manager, scenario, ns, i).await,
            Variant::Raw => raw(self, ttl, scenario, ns, i).await,
        }
    }
}

impl Side<ConnectionManager> {
    /// The library's batches read first as
    /// `IDEMPOTENCY_BENCH_REDIS_BATCH_READS` says (`adaptive`, the default,
    /// `never` or `always`), to compare them in one sitting.
    async fn connect(url: &str) -> Result<Self, BoxError> {
        let conn = redis::Client::open(url)?.get_connection_manager().await?;
        let reads = match std::env::var("IDEMPOTENCY_BENCH_REDIS_BATCH_READS") {
            Ok(name) => BatchReads::parse(&name)
                .ok_or_else(|| format!("IDEMPOTENCY_BENCH_REDIS_BATCH_READS={name}: expected adaptive, never or always"))?,
            Err(_) => BatchReads::default(),
        };
        let repo = RedisRepository::from_connection_manager(conn.clone()).with_batch_reads(reads);
        Side::new(repo, conn).await
    }
}

/// Redis workload: a timed side, a side through the round-trip counter, and an
/// admin connection for `INFO`.
pub struct RedisWorkload {
    timed: Side<ConnectionManager>,
    counted: Side<ConnectionManager>,
    counter: WireCounter,
    admin: MultiplexedConnection,
    version: String,
    ttl: Duration,
}

impl std::fmt::Debug for RedisWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisWorkload")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl RedisWorkload {
    /// Connects both sides to `url` (plain `redis://`).
    ///
    /// # Errors
    /// When the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, BoxError> {
        let counter = WireCounter::redis(url).await?;
        let timed = Side::connect(url).await?;
        let counted = Side::connect(counter.url()).await?;
        let mut admin = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut admin)
            .await?;
        let version = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("unknown")
            .trim()
            .to_owned();
        Ok(RedisWorkload {
            timed,
            counted,
            counter,
            admin,
            version,
            ttl: config().ttl,
        })
    }
}

#[async_trait]
impl Workload for RedisWorkload {
    fn backend(&self) -> &'static str {
        "redis"
    }

    fn manager(&self, lane: Lane) -> &IdempotencyManager {
        match lane {
            Lane::Timed => &self.timed.manager,
            Lane::Counted => &self.counted.manager,
        }
    }

    fn describe(&self) -> String {
        format!(
            "Redis {} — one ConnectionManager (multiplexed) shared by library and raw",
            self.version
        )
    }

    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        populate(&self.timed.manager, ns, ops, 256).await
    }

    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        lane: Lane,
    ) -> Result<(), BoxError> {
        let side = match lane {
            Lane::Timed => &self.timed,
            Lane::Counted => &self.counted,
        };
        side.op(self.ttl, variant, scenario, ns, i).await
    }

    async fn round_trips(&self) -> Result<Option<u64>, BoxError> {
        Ok(Some(self.counter.round_trips_since(&BTreeMap::new())))
    }

    async fn server_commands(&self) -> Result<Option<u64>, BoxError> {
        let mut admin = self.admin.clone();
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut admin)
            .await?;
        Ok(Some(commandstats_total(&info)))
    }
}

/// The raw reservation: the 87-byte record a user would write (format 1,
/// `Processing`, with a fingerprint), `SET key record NX PX ttl GET`, then (a
/// fresh key) `EVALSHA` of the library's `finish` script.
async fn raw<C: ConnectionLike + Clone + Send>(
    side: &Side<C>,
    ttl: Duration,
    scenario: Scenario,
    ns: &str,
    i: usize,
) -> Result<(), BoxError> {
    let mut conn = side.conn.clone();
    let key = format!("bench:{}", key_id(ns, i));
    let now = SystemClock.now().as_millis();
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    let expires = now + ttl_ms;
    let owner = rand::random::<u128>().to_be_bytes();
    let mut record = Vec::with_capacity(87);
    record.extend_from_slice(&[1, b'P']);
    record.extend_from_slice(&1u32.to_be_bytes());
    record.extend_from_slice(&now.to_be_bytes());
    record.extend_from_slice(&owner);
    record.extend_from_slice(&(now + 300_000).to_be_bytes());
    record.extend_from_slice(&expires.to_be_bytes());
    record.extend_from_slice(&now.to_be_bytes());
    record.push(1);
    record.extend_from_slice(&[0xab; 32]);
    let reply: Value = redis::cmd("SET")
        .arg(&key)
        .arg(&record)
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms)
        .arg("GET")
        .query_async(&mut conn)
        .await?;
    match (scenario, reply) {
        (Scenario::Duplicate, Value::BulkString(_)) => Ok(()),
        (Scenario::Fresh, Value::Nil) => {
            let done: Value = redis::cmd("EVALSHA")
                .arg(&side.finish_sha)
                .arg(1)
                .arg(&key)
                .arg(&owner[..])
                .arg(&now.to_be_bytes()[..])
                .arg(&expires.to_be_bytes()[..])
                .arg(ttl_ms)
                .arg("C")
                .arg("1")
                .arg(receipt_bytes(i))
                .query_async(&mut conn)
                .await?;
            match done {
                Value::Int(1) => Ok(()),
                other => Err(format!("raw complete of {key} answered {other:?}").into()),
            }
        }
        (scenario, other) => {
            Err(format!("raw {scenario} reserve of {key} answered {other:?}").into())
        }
    }
}

#[cfg(feature = "redis-cluster")]
/// Redis Cluster: the library (`RedisRepository::connect` of the cluster URL)
/// against the `redis` crate's cluster client issuing the same commands; no
/// round-trip counter (the nodes are reached at the addresses they announce).
pub struct RedisClusterWorkload {
    side: Side<ClusterConnection>,
    masters: usize,
    ttl: Duration,
}

#[cfg(feature = "redis-cluster")]
impl std::fmt::Debug for RedisClusterWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClusterWorkload")
            .field("masters", &self.masters)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "redis-cluster")]
impl RedisClusterWorkload {
    /// Connects both sides to `url` (`redis+cluster://h:p,h:p,…`). With
    /// `IDEMPOTENCY_BENCH_REDIS_CLUSTER_PER_KEY=1` in the environment, the
    /// library runs on a cluster connection passed in
    /// (`RedisRepository::from_cluster_connection`), whose batches go key by
    /// key — for comparison with the pipelines per master of a repository
    /// connected by URL.
    ///
    /// # Errors
    /// When the cluster cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, BoxError> {
        let hosts = url
            .strip_prefix("redis+cluster://")
            .ok_or("a Redis Cluster URL starts with redis+cluster://")?;
        let nodes: Vec<String> = hosts.split(',').map(|h| format!("redis://{h}")).collect();
        let client = redis::cluster::ClusterClient::new(nodes.clone())?;
        let conn = client.get_async_connection().await?;
        let repo = if std::env::var("IDEMPOTENCY_BENCH_REDIS_CLUSTER_PER_KEY").as_deref() == Ok("1")
        {
            RedisRepository::from_cluster_connection(client.get_async_connection().await?)
        } else {
            RedisRepository::connect(url).await?
        };
        let side = Side::new(repo, conn).await?;
        Ok(RedisClusterWorkload {
            side,
            masters: nodes.len(),
            ttl: config().ttl,
        })
    }
}

#[cfg(feature = "redis-cluster")]
#[async_trait]
impl Workload for RedisClusterWorkload {
    fn backend(&self) -> &'static str {
        "redis-cluster"
    }

    fn manager(&self, _lane: Lane) -> &IdempotencyManager {
        &self.side.manager
    }

    fn describe(&self) -> String {
        format!(
            "Redis Cluster of {} masters — the library's cluster connection, raw on the redis \
             crate's cluster client",
            self.masters
        )
    }

    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        populate(&self.side.manager, ns, ops, 256).await
    }

    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        _lane: Lane,
    ) -> Result<(), BoxError> {
        self.side.op(self.ttl, variant, scenario, ns, i).await
    }
}

/// The sum of `calls` over `INFO commandstats`, without `INFO` itself.
pub fn commandstats_total(info: &str) -> u64 {
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter(|l| !l.starts_with("info:"))
        .filter_map(|l| {
            l.split_once(':')?
                .1
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn commandstats_total_skips_info() {
        let info = "# Commandstats\r\ncmdstat_set:calls=10,usec=5,usec_per_call=0.5\r\n\
                    cmdstat_info:calls=7,usec=1\r\ncmdstat_evalsha:calls=3,usec=9\r\n";
        assert_eq!(super::commandstats_total(info), 13);
    }
}
