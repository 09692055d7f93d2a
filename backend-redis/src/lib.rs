//! Redis backend of [idempotency-rs](idempotency_core): every decision in one
//! round trip, on a standalone server or a Redis Cluster.
//!
//! ```no_run
//! use std::sync::Arc;
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, Outcome};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // `rediss://…` with the `tls` feature, `redis+cluster://h1:6379,h2:6379` with `cluster`.
//! let repo = idempotency_redis::connect("redis://127.0.0.1:6379").await?;
//! let manager = IdempotencyManager::new(Arc::new(repo), Config::default())?;
//!
//! // The broker delivers the same message twice: the handler runs once.
//! for _ in 0..2 {
//!     let outcome = manager
//!         .execute("ProcessPayment:evt-42", &serde_json::json!({"amount": 10}), || async {
//!             Ok::<_, HandlerError<String>>("receipt-1".to_string())
//!         })
//!         .await?;
//!     assert!(matches!(outcome, Outcome::Executed(_) | Outcome::Cached(_)));
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Build a [`RedisRepository`] from a URL ([`connect`], [`RedisRepository::connect`],
//! [`RedisRepository::from_env`]), or from your own [`redis::Client`],
//! [`ConnectionManager`](redis::aio::ConnectionManager) or cluster client
//! ([`RedisRepository::from_client`], [`RedisRepository::from_connection_manager`],
//! `from_cluster_client`, `from_cluster_connection`). The standalone connection
//! reconnects by itself after a connection loss; meanwhile calls fail fast with
//! [`Error::Unavailable`](idempotency_core::Error::Unavailable) (retryable).
//!
//! On Redis Cluster reached by URL (`redis+cluster://`, feature `cluster`),
//! every command on a record goes on a connection of the repository's own to
//! the master serving its key's slot (from `CLUSTER SLOTS`, read again whenever a node
//! says the slot moved), and follows `MOVED` and `ASK` itself, `ASK` with
//! `ASKING` in the same pipeline as the command: while a slot migrates, the
//! `redis` crate's cluster client lets another request take the `ASKING`
//! flag under load, and after a migration its slot refresh was seen to hold
//! every request until its response timeout. A command none of this placed
//! (the table unreadable, no connection to the master, redirections run out,
//! a node answering `TRYAGAIN`, `CLUSTERDOWN`, `LOADING` or `READONLY` during
//! a failover: executed nowhere) goes through the cluster client, which waits
//! those out; so do the commands that name no record (`CLUSTER SLOTS`,
//! `SCRIPT LOAD`, the operator's `SCAN`). The table and the connection to a
//! master are each read or opened by a task of its own, once for all the
//! operations that need them meanwhile (they wait for it, each within its own
//! timeout; one that gives up does not abort it); a master whose connection could not be opened is not tried
//! again for as long as the attempt took, at least a second (its commands go
//! through the cluster client meanwhile, without a connection attempt each),
//! and an unreadable table is not asked for again for five seconds. A cluster connection passed in (`from_cluster_*`) is used
//! as it is, redirections included.
//!
//! # What it guarantees
//!
//! | | |
//! |---|---|
//! | Atomicity | every operation is one `SET`/`GET`/`DEL` or one Lua script on one key (a batch's completions on a standalone server: one script over many keys, each decided as alone): exactly one `reserve` wins a key, exactly one wins a takeover |
//! | Fencing | `complete`, `fail`, `release`, `extend` are scripts that compare the stored owner token byte for byte; a lost lease leaves the record untouched ([`LeaseLost`](idempotency_core::Error::LeaseLost)) |
//! | Expiry | logical expiry (`expires_at <= now`, the caller's `now`) is checked by every operation; the key's physical TTL is `PX = expires_at - now` (at least 1 ms), so the server evicts a record when the caller's clock reaches its expiry, never before |
//! | Lease and expiry | `extend` raises the lease and `expires_at` to `max(stored, given)`, with the key's TTL, in the same script: a handler that outlives the record's first expiry keeps its record; the lease, the expiry and the TTL are never lowered |
//! | Re-sent reserve | a `reserve` whose owner token already holds the live `Processing` record answers `Acquired` with the stored attempt and writes nothing (in the `SET … NX … GET` reply or in the script), so a reserve retried after a lost reply never sees itself as in progress |
//! | Stored failures | `fail` remembers whether the failure is retryable (flag bit 3); `reserve` with `retry_failed` takes over only a retryable `Failed` record. A takeover keeps the stored fingerprint when the request has none, and clears the retryable flag |
//! | Bytes | results and errors are opaque: NUL, non-UTF-8 and empty values round-trip; `Some(empty)` ≠ `None` |
//! | Keys | the Redis key is [`RecordKey::encode`](idempotency_core::RecordKey::encode), injective over (namespace, id), prefixed with an empty hash tag `{}` when the id contains `{` ([`RedisRepository::redis_key`]): braces in namespaces are escaped and ids never form a hash tag, so records spread over all cluster slots, also for ids like `/orders/{id}` |
//! | Foreign data | a value under our key that is not a record (wrong type, unknown format) is [`Corrupt { key }`](idempotency_core::Error::Corrupt), never a panic |
//! | Cluster | each script a cluster runs touches a single key, so everything runs unchanged on Redis Cluster (feature `cluster`); `complete_many`, over many keys, runs only on a standalone connection (by URL, `from_client` or `from_connection_manager`; see the batch row below for proxies in front of shards) |
//!
//! # Commands per operation
//!
//! | operation | round trips | commands |
//! |---|---|---|
//! | `reserve`, new key | 1 | `SET key record NX PX ttl GET` |
//! | `reserve`, live record (duplicate, in progress, other payload, or the caller's own reservation re-sent) | 1 | `SET … NX … GET`, which returns the stored record |
//! | `reserve`, logically expired record, or a takeover (stale lease, retryable `Failed` + `retry_failed`) | 2 | `SET … NX … GET`, then `EVALSHA reserve` decides again atomically |
//! | `complete` / `fail` | 1 | `EVALSHA finish` (runs `GET` + `SET … PX`) |
//! | `release` | 1 | `EVALSHA release` (runs `GET` + `DEL`) |
//! | `extend` | 1 | `EVALSHA extend` (runs `GET` + `SET … PX` when the expiry rises, else `SET … KEEPTTL`) |
//! | `get` | 1 | `GET` |
//! | `delete` | 1 | `DEL` |
//! | `purge_expired` | 0 | none: Redis expires keys itself (`native_expiry`) |
//! | `reserve_many`, `complete_many` (an `execute_batch` group) | 1 per server; on a cluster 1 per master, in parallel; on a standalone server, completions 1 more when the script left keys to `finish` alone | the same commands, pipelined (what a pipeline cannot decide — a takeover, a single script's `NOSCRIPT` — goes on its own). Reservations read first while the recent batches were mostly duplicates ([`BatchReads`], `batch_reads=adaptive|never|always`): one `MGET` (a cluster master: a pipeline of `GET`s) answers every key whose record decides it without a write — a duplicate, our own live reservation — at about a third of a `SET … NX PX … GET`'s server time per key, and only the keys left open get the pipeline of writes (a second round trip; a batch of duplicates is 1). On a standalone server the completions are `EVALSHA complete_many` over up to 100 keys per call (a result over 256 KiB in a call of its own), each key decided as `finish` would alone. Only the script's "completed" is final: a key it answered otherwise (a lost lease, a foreign value; rare) is sent again on its own as `EVALSHA finish` (one more round trip), whose answer stands, so that a proxy routing the whole call to the shard of its first key (twemproxy, Envoy) cannot turn another shard's completion into a lost lease. So are the keys of a call refused as a whole for anything but an outage (`CROSSSLOT`, or a proxy's refusal in its own words). A server that answers `CROSSSLOT`, or whose script left a key that `finish` then completed, gets `EVALSHA finish` per key, pipelined, from then on. On a cluster reached by URL, the keys are grouped by the master serving their slot (`CLUSTER SLOTS`, read again whenever a node refuses a key) and each group is sent on a connection of the repository's own to that master, never through the cluster client, which re-sends a whole pipeline when one command is redirected; a key the master does not serve now (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, `LOADING`, `READONLY`: not executed) goes on its own, as a single operation. On a cluster connection passed in (`from_cluster_*`), one command per key |
//!
//! So a **fresh execution** through the manager costs **2 commands** (reserve +
//! complete) and a **duplicate 1**; the test `commands_per_operation` (in
//! `tests/redis.rs`) proves every row with `INFO commandstats` on a server of its
//! own. With [`ReserveStrategy::Script`] every `reserve` is one `EVALSHA reserve`,
//! takeovers included.
//!
//! Scripts are loaded once (`SCRIPT LOAD` when connecting; on a cluster, on every
//! primary). When a server has lost its script cache (restart, `SCRIPT FLUSH`,
//! failover) the call that meets `NOSCRIPT` resends that script once with `EVAL`,
//! which caches it again — transparently, one extra command per script and server
//! (for a batch's completions, one per call of up to 100 keys in the pipeline
//! that met it).
//!
//! # Why `SET … NX PX … GET` and not one script
//!
//! Both reserve in one round trip. Measured with `examples/reserve_bench.rs`
//! (Redis 7.0.15 on localhost, one multiplexed connection, 64 reservations in
//! flight, 20 000 keys per phase, on a busy 2-core machine; two runs):
//!
//! | strategy | phase | ops/s | server µs per reserve |
//! |---|---|---|---|
//! | `set-nx-get` | new keys | 122 000 – 132 000 | 1.5 – 2.1 |
//! | `set-nx-get` | duplicates | 120 000 – 164 000 | 0.7 – 1.1 |
//! | `script` | new keys | 59 000 – 79 000 | 6.1 – 8.1 |
//! | `script` | duplicates | 77 000 – 84 000 | 5.4 – 6.0 |
//!
//! The native command costs the single-threaded server 4–8 times less CPU per
//! reservation (no script invocation, no Lua string handling) and nearly doubles
//! throughput, on exactly the two paths that matter: new keys and duplicates.
//! Its price is a second round trip in the rare takeover case (a consumer
//! crashed, or a stored failure is retried), where the script re-decides
//! atomically, so correctness never rests on the first read.
//! [`ReserveStrategy::SetNxGet`] is therefore the default; it needs Redis ≥ 7.0
//! (`NX` with `GET`), and on an older server the repository falls back to
//! [`ReserveStrategy::Script`] by itself (the scripts need Redis ≥ 6.0; only
//! 7.0 is tested).
//!
//! # Record format (version 1)
//!
//! One binary-safe Redis string, so that `SET … NX … GET` can return it and the
//! scripts can read it with `string.sub`/`struct.unpack`:
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 1 | format version, `1` |
//! | 1 | 1 | status: `P` processing, `C` completed, `F` failed |
//! | 2 | 4 | attempt (u32, big-endian) |
//! | 6 | 8 | `created_at`, ms since the Unix epoch (u64, big-endian) |
//! | 14 | 16 | owner token (u128, big-endian) |
//! | 30 | 8 | `lease_until` (u64 ms) |
//! | 38 | 8 | `expires_at` (u64 ms) |
//! | 46 | 8 | `updated_at` (u64 ms) |
//! | 54 | 1 | flags: bit 0 fingerprint, bit 1 result, bit 2 error, bit 3 retryable (`Failed` only) |
//! | 55 | 32 | fingerprint (SHA-256), only with bit 0 |
//! | 55 or 87 | rest | the result (bit 1) or the error (bit 2), verbatim |
//!
//! The scripts compare instants as (high, low) 32-bit halves, exact over the
//! whole `u64` range (Lua numbers are doubles), and owner tokens and fingerprints
//! as byte strings. A later format gets a new version byte; readers reject
//! versions they do not know as corrupt instead of misreading them.
//!
//! Bit 3 (retryable) came later within version 1: records written before it
//! never set it and still decode (a `Failed` record among them counts as not
//! retryable, so it is not taken over and expires with its TTL). Readers that
//! predate the bit reject a record carrying it as corrupt, so finish a rolling
//! upgrade before relying on stored retryable failures.
//!
//! # Upgrading
//!
//! - Ids containing `{` are stored under a new key (`{}` + the former key; see
//!   [`RedisRepository::redis_key`]). Records of such ids written by an earlier
//!   version are not found by this one: a delivery of such a key in the
//!   window of the upgrade runs the handler again. Other keys are unchanged.
//! - The record format is compatible (see above); the scripts' SHA-1s change,
//!   and both versions' scripts can live in the script cache side by side.
//!
//! # Limits
//!
//! - Results and stored errors: [`DEFAULT_MAX_RESULT_BYTES`] (16 MiB) by
//!   default, configurable up to [`REDIS_HARD_MAX_RESULT_BYTES`] (Redis's
//!   512 MB string limit); larger ones get
//!   [`TooLarge`](idempotency_core::Error::TooLarge) and the manager completes
//!   without caching them.
//! - Ids up to [`MAX_ID_BYTES`] bytes are stored verbatim; the manager digests
//!   longer ones (SHA-256).
//! - Options in the URL's query string: see [`RedisOptions`]
//!   (`?reserve=script&response_timeout=2s&max_result_bytes=1048576`).
//!
//! # Persistence caveat
//!
//! A record is only as durable as Redis makes it. A server without AOF
//! (`appendonly no`, the default) loses every record written since its last RDB
//! snapshot when it restarts or crashes; with `appendfsync everysec` up to about
//! a second of writes is at risk; an asynchronous replica promoted by a failover
//! can miss the last acknowledged writes. For idempotency that means:
//!
//! - a **duplicate** delivered after the loss finds no record and **runs the
//!   handler again** — for those keys the guarantee degrades to at-least-once;
//! - a lost `Processing` record lets a second consumer start the same work while
//!   the first still runs; the first one's `complete` then answers
//!   [`LeaseLost`](idempotency_core::Error::LeaseLost) (the manager reports it,
//!   carrying the handler's value), so the double execution is visible, not
//!   silent.
//!
//! Where a repeated side effect is unacceptable, run Redis with `appendonly yes`
//! and `appendfsync always` (or accept the `everysec` window), and
//! `maxmemory-policy noeviction`: with an eviction policy Redis may drop records
//! (all of which carry a TTL) before they expire, with the same effect as a loss;
//! under `noeviction` a full server refuses writes instead (`OOM`), and
//! `reserve` fails (fail-closed by default) rather than forgetting. `OOM`, like
//! `NOREPLICAS` (below `min-replicas-to-write`) and `MISCONF` (after a failed
//! snapshot), is a retryable [`Error::Unavailable`](idempotency_core::Error::Unavailable):
//! nothing was written, so the manager retries a refused completion with the
//! same owner token until shortly before the lease ends.
//!
//! # Features
//!
//! - `tls`: `rediss://` and `rediss+cluster://` with rustls (ring, installed as
//!   the process default unless the application installed a provider) and the
//!   platform's root certificates. For a private CA, pass a client built with
//!   `redis::Client::build_with_tls` to [`RedisRepository::from_client`]. An
//!   untrusted certificate is a [`Config`](idempotency_core::Error::Config)
//!   error; so is `#insecure` (no verification) unless the application enables
//!   the `redis` crate's `tls-rustls-insecure` feature itself. Without `tls`,
//!   TLS URLs are a `Config` error naming the feature.
//! - `cluster`: `redis+cluster://[user:pass@]host:port,host:port,…` and the
//!   `from_cluster_*` constructors, with the `redis` crate's async cluster
//!   client.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod codec;
mod error;
#[cfg(feature = "cluster")]
mod nodes;
mod options;
mod repository;
mod scripts;

pub use options::{
    RedisOptions, ReserveStrategy, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_RESPONSE_TIMEOUT, REDIS_HARD_MAX_RESULT_BYTES, URL_SCHEMES,
};
pub use repository::{BatchReads, RedisRepository, MAX_ID_BYTES};
pub use scripts::LuaScript;

/// The `redis` crate this backend is built on, for building clients and
/// connection managers of the same version.
pub use redis;

/// Connects to `url` and loads the scripts (see [`RedisRepository::connect`] for
/// the schemes and options): what `idempotency::connect` calls for Redis URLs.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// // URL errors are configuration errors, found before any connection attempt.
/// let err = idempotency_redis::connect("redis://127.0.0.1:6379?reserve=sometimes")
///     .await
///     .unwrap_err();
/// assert!(matches!(err, idempotency_core::Error::Config { .. }));
/// # });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// As [`RedisRepository::connect`].
pub async fn connect(url: &str) -> Result<RedisRepository, idempotency_core::Error> {
    RedisRepository::connect(url).await
}
