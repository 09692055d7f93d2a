//! The operator operations ([`Admin`]) of the Redis store: listing and
//! sampled counts with `SCAN` (a cursor: never blocks the server), and a
//! check of the settings the library relies on (eviction, persistence,
//! replication, cluster slots, the clock).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::admin::{Admin, Check, DoctorOptions, ListFilter, Listing, Stats, Verdict};
use idempotency_core::{escape_namespace, Clock, Error, Record, RecordKey, SystemClock, Timestamp};
use redis::cmd;

use crate::codec;
use crate::RedisRepository;

/// Keys asked per `SCAN` step.
const SCAN_COUNT: usize = 500;
/// Keys `stats` looks at before it reports a sample instead of all.
const STATS_SAMPLE: usize = 10_000;

/// `s` with glob characters escaped, for `SCAN … MATCH`.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A key of this store, decoded; `None` for another application's key.
fn record_key(redis_key: &[u8]) -> Option<RecordKey> {
    let text = std::str::from_utf8(redis_key).ok()?;
    let text = text.strip_prefix("{}").unwrap_or(text);
    RecordKey::decode(text, usize::MAX).ok()
}

impl RedisRepository {
    fn standalone_only(&self, what: &str) -> Result<(), Error> {
        if self.is_cluster() {
            return Err(Error::config(format!(
                "{what} scans one server's keys; on a Redis Cluster run it against each \
                 master's redis:// URL"
            )));
        }
        Ok(())
    }

    /// Scans keys matching the namespace prefix (a cursor, `SCAN_COUNT` a
    /// step) and hands each record to `visit` until it returns false or the
    /// scan ends; whether the scan ended.
    async fn scan(
        &self,
        prefix: Option<&str>,
        mut visit: impl FnMut(RecordKey, Record) -> bool + Send,
    ) -> Result<bool, Error> {
        // Keys are the encoded namespace, `:`, the id; some carry a `{}`
        // hash tag first.
        let encoded = glob_escape(&escape_namespace(prefix.unwrap_or("")));
        let mut cursor: u64 = 0;
        loop {
            let mut scan = cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(format!("*{encoded}*"))
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let reply = self.command(&scan, "admin").await?;
            let (next, keys): (u64, Vec<Vec<u8>>) =
                redis::from_redis_value(reply).map_err(|e| Error::backend("redis", e))?;
            let keys: Vec<(Vec<u8>, RecordKey)> = keys
                .into_iter()
                .filter_map(|k| record_key(&k).map(|r| (k, r)))
                .filter(|(_, r)| prefix.is_none_or(|p| r.namespace().starts_with(p)))
                .collect();
            if !keys.is_empty() {
                let mut get = cmd("MGET");
                for (k, _) in &keys {
                    get.arg(k);
                }
                let values: Vec<Option<Vec<u8>>> =
                    redis::from_redis_value(self.command(&get, "admin").await?)
                        .map_err(|e| Error::backend("redis", e))?;
                for ((_, key), value) in keys.into_iter().zip(values) {
                    // Gone since the scan, or another application's value.
                    let Some(record) = value.and_then(|v| codec::decode_owned(v).ok()) else {
                        continue;
                    };
                    if !visit(key, record) {
                        return Ok(false);
                    }
                }
            }
            if next == 0 {
                return Ok(true);
            }
            cursor = next;
        }
    }

    /// `INFO section` of every node the connection reaches (one for a
    /// standalone server; a cluster answers per node): node and fields.
    async fn info(&self, section: &str) -> Result<Vec<(String, HashMap<String, String>)>, Error> {
        let mut info = cmd("INFO");
        info.arg(section);
        let reply = self.command(&info, "admin").await?;
        let parse = |text: &str| -> HashMap<String, String> {
            text.lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
                .collect()
        };
        if let Ok(text) = redis::from_redis_value::<String>(reply.clone()) {
            return Ok(vec![("server".to_owned(), parse(&text))]);
        }
        let per_node: HashMap<String, String> =
            redis::from_redis_value(reply).map_err(|e| Error::backend("redis", e))?;
        let mut nodes: Vec<_> = per_node.into_iter().map(|(n, t)| (n, parse(&t))).collect();
        nodes.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(nodes)
    }

    /// `CONFIG GET name` on every node it reaches; `None` where the command
    /// is not allowed (managed services often refuse it).
    async fn config(&self, name: &str) -> Option<Vec<(String, String)>> {
        let mut get = cmd("CONFIG");
        get.arg("GET").arg(name);
        let reply = self.command(&get, "admin").await.ok()?;
        if let Ok(map) = redis::from_redis_value::<HashMap<String, String>>(reply.clone()) {
            return map
                .get(name)
                .map(|v| vec![("server".to_owned(), v.clone())]);
        }
        let per_node: HashMap<String, HashMap<String, String>> =
            redis::from_redis_value(reply).ok()?;
        let mut values: Vec<_> = per_node
            .into_iter()
            .filter_map(|(node, map)| Some((node, map.get(name)?.clone())))
            .collect();
        values.sort();
        Some(values)
    }

    async fn eviction_check(&self) -> Check {
        let name = "maxmemory-policy";
        let Some(values) = self.config(name).await.filter(|v| !v.is_empty()) else {
            return Check::warn(
                name,
                "CONFIG GET is not allowed here (a managed Redis?), so the policy is unknown",
                "check in the provider's console that the eviction policy is noeviction",
            );
        };
        worst(values.into_iter().map(|(node, policy)| {
            let check = if policy == "noeviction" {
                Check::pass(
                    name,
                    "noeviction: under memory pressure writes fail (a retryable error), \
                     records are never dropped",
                )
            } else {
                Check::fail(
                    name,
                    format!(
                        "{policy}: under memory pressure Redis evicts keys, live records \
                         included (every record has a TTL, so volatile-* policies evict them \
                         too), and an evicted record's next delivery runs its handler again"
                    ),
                    "CONFIG SET maxmemory-policy noeviction (and in redis.conf), or give \
                     idempotency records a Redis of their own",
                )
            };
            (node, check)
        }))
    }

    async fn persistence_check(&self) -> Result<Check, Error> {
        let name = "persistence";
        let fsync = self.config("appendfsync").await.unwrap_or_default();
        let save = self.config("save").await.unwrap_or_default();
        let nodes = self.info("persistence").await?;
        Ok(worst(nodes.into_iter().map(|(node, info)| {
            let aof = info.get("aof_enabled").map(String::as_str) == Some("1");
            let of_node = |values: &[(String, String)]| {
                values
                    .iter()
                    .find(|(n, _)| *n == node || n == "server")
                    .map(|(_, v)| v.clone())
            };
            let node_fsync = of_node(&fsync);
            let node_fsync = node_fsync.as_deref();
            // `save ""`: no snapshot points; unknown where CONFIG GET is refused.
            let snapshots = of_node(&save).map(|points| !points.trim().is_empty());
            let check = match (aof, node_fsync) {
                (true, Some("always")) => Check::pass(
                    name,
                    "append-only file, fsync on every write: a restart keeps every record",
                ),
                (true, fsync) => Check::warn(
                    name,
                    format!(
                        "append-only file with appendfsync {}: a crash loses up to a second \
                         of records, and their next deliveries run again",
                        fsync.unwrap_or("unknown")
                    ),
                    "appendfsync always, when a repeated effect after a crash is unacceptable",
                ),
                (false, _) if snapshots == Some(false) => Check::fail(
                    name,
                    "no persistence at all (appendonly no, save \"\"): a restart loses every \
                     record, and every key's next delivery runs its handler again",
                    "CONFIG SET appendonly yes and appendfsync always (and in redis.conf); \
                     snapshots alone (save) keep only the records of the last snapshot",
                ),
                (false, _) => Check::warn(
                    name,
                    match snapshots {
                        Some(_) => {
                            "snapshots only (appendonly no): a restart loses the records \
                             written since the last snapshot, and their next deliveries run \
                             again"
                        }
                        None => {
                            "no append-only file, snapshot settings unknown (CONFIG GET \
                             refused): a restart loses the records written since the last \
                             snapshot (or all of them), and their next deliveries run again"
                        }
                    },
                    "appendonly yes, appendfsync always",
                ),
            };
            (node, check)
        })))
    }

    async fn replication_check(&self) -> Result<Check, Error> {
        let name = "replication";
        let cluster = self.is_cluster();
        let nodes = self.info("replication").await?;
        Ok(worst(nodes.into_iter().map(|(node, info)| {
            let role = info.get("role").cloned().unwrap_or_default();
            let replicas: u64 = info
                .get("connected_slaves")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            let check = match (role.as_str(), replicas) {
                ("master", 0) => {
                    Check::pass(name, "a primary without replicas: no failover window")
                }
                ("master", n) => Check::warn(
                    name,
                    format!(
                        "a primary with {n} replica(s), replicated asynchronously: a failover \
                         can lose the last records, and their next deliveries run again"
                    ),
                    "accept the window, or fail over only with replicas in sync (WAIT-based \
                     tooling)",
                ),
                // A cluster's replicas are expected; the client writes to masters.
                (_, _) if cluster => Check::pass(name, "a replica of a cluster master"),
                (role, _) => Check::fail(
                    name,
                    format!("this server is a {role}: it refuses writes (READONLY)"),
                    "point the URL at the primary",
                ),
            };
            (node, check)
        })))
    }

    async fn cluster_check(&self) -> Result<Option<Check>, Error> {
        if !self.is_cluster() {
            return Ok(None);
        }
        let mut state = cmd("CLUSTER");
        state.arg("INFO");
        let text: String = redis::from_redis_value(self.command(&state, "admin").await?)
            .map_err(|e| Error::backend("redis", e))?;
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_owned())
        };
        let ok = field("cluster_state").as_deref() == Some("ok")
            && field("cluster_slots_ok").as_deref() == Some("16384");
        Ok(Some(if ok {
            Check::pass("cluster slots", "all 16384 slots served")
        } else {
            Check::fail(
                "cluster slots",
                format!(
                    "cluster_state {}, slots ok {}: keys in uncovered slots fail",
                    field("cluster_state").unwrap_or_default(),
                    field("cluster_slots_ok").unwrap_or_default()
                ),
                "assign every slot to a master (redis-cli --cluster fix)",
            )
        }))
    }

    async fn clock_check(&self, options: &DoctorOptions) -> Result<Check, Error> {
        let before = SystemClock.now();
        let (secs, micros): (u64, u64) =
            redis::from_redis_value(self.command(&cmd("TIME"), "admin").await?)
                .map_err(|e| Error::backend("redis", e))?;
        let after = SystemClock.now();
        let server = Timestamp::from_millis(secs * 1000 + micros / 1000);
        Ok(Check::clock_offset(
            server,
            before,
            after,
            options.clock_skew,
        ))
    }
}

#[async_trait]
impl Admin for RedisRepository {
    /// `SCAN` with a cursor (standalone servers), in the server's order.
    /// `SCAN` may return a key twice (the keyspace rehashed between calls):
    /// each listed once (remembering only the listed ones).
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        self.standalone_only("list")?;
        let mut listing = Listing::default();
        let mut listed = HashSet::new();
        self.scan(filter.namespace_prefix.as_deref(), |key, record| {
            if listed.contains(&key) {
                return true;
            }
            let before = listing.records.len();
            let more = listing.offer(filter, &key, record, now);
            if listing.records.len() > before {
                listed.insert(key);
            }
            more
        })
        .await?;
        Ok(listing)
    }

    /// Counts from up to 10,000 records found by `SCAN`; labelled as a sample
    /// when there are more.
    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        self.standalone_only("stats")?;
        let mut stats = Stats::default();
        // `SCAN` may return a key twice: each counted once (at most the
        // sample's keys are remembered).
        let mut seen = HashSet::new();
        let complete = self
            .scan(None, |key, record| {
                if seen.contains(&key) {
                    return true;
                }
                stats.count(key.namespace(), &record, now, clock_skew);
                seen.insert(key);
                seen.len() < STATS_SAMPLE
            })
            .await?;
        if !complete {
            stats.sampled = Some(seen.len() as u64);
        }
        Ok(stats)
    }

    /// Nothing to create: the scripts are loaded when a repository connects.
    async fn migrate(&self, _dry_run: bool) -> Result<Vec<String>, Error> {
        Ok(Vec::new())
    }

    async fn doctor(&self, options: &DoctorOptions) -> Result<Vec<Check>, Error> {
        let mut checks = vec![
            self.eviction_check().await,
            self.persistence_check().await?,
            self.replication_check().await?,
        ];
        checks.extend(self.cluster_check().await?);
        checks.push(self.clock_check(options).await?);
        Ok(checks)
    }
}

/// The most severe of per-node checks (fail over warn over pass), naming its
/// node when there are several.
fn worst(checks: impl Iterator<Item = (String, Check)>) -> Check {
    let rank = |c: &Check| match c.verdict {
        Verdict::Pass => 0,
        Verdict::Warn => 1,
        Verdict::Fail => 2,
    };
    let checks: Vec<(String, Check)> = checks.collect();
    let several = checks.len() > 1;
    let Some((node, mut check)) = checks.into_iter().max_by_key(|(_, c)| rank(c)) else {
        return Check::warn("node", "no node answered", "check the URL");
    };
    if several {
        check.detail = format!("{node}: {}", check.detail);
    }
    check
}
