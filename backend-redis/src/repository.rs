//! [`RedisRepository`]: the repository over a standalone server or a cluster.

use std::fmt;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    escape_namespace, Capabilities, Completion, Error, FreshShare, OwnerToken, Record, RecordKey,
    Repository, Reservation, ReserveRequest, Status, Timestamp,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisError, RedisWrite, ToRedisArgs, Value};

use crate::codec::{self, ts_bytes};
use crate::error::{is_noscript, is_syntax_error, map_redis_error, BACKEND};
use crate::options::{
    parse_url_with, redact, RedisOptions, ReserveStrategy, Target, REDIS_HARD_MAX_RESULT_BYTES,
};
use crate::scripts::{LuaScript, Scripts};

mod complete_many;
mod read_first;

pub use read_first::BatchReads;

/// The longest id stored verbatim; longer ids are digested by
/// [`RecordKey::new`].
pub const MAX_ID_BYTES: usize = 1024;

/// A physical TTL never exceeds this (about 146 million years), so
/// `now + PX` cannot overflow on the server.
const MAX_PX: u64 = 1 << 62;

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

impl RedisRepository {
    /// Connects to the server or cluster at `url` and loads the scripts.
    ///
    /// Schemes ([`URL_SCHEMES`](crate::URL_SCHEMES)):
    /// `redis://[user:pass@]host[:port][/db]` (or `valkey://`), `rediss://…`
    /// (or `valkeys://`, feature `tls`),
    /// `redis+cluster://[user:pass@]host:port,host:port,…` and
    /// `rediss+cluster://…` (or `valkey+cluster://`, `valkeys+cluster://`;
    /// feature `cluster`), `unix:///path` (or `redis+unix://`,
    /// `valkey+unix://`). The query
    /// string takes the options of [`RedisOptions`]
    /// (`?reserve=script&response_timeout=2s`) and the `redis` crate's
    /// `protocol=resp3`.
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed URL, an unknown option or a scheme whose
    /// feature is off; [`Error::Unavailable`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// [`RedisRepository::connect`] with `options` as the defaults; options in
    /// the URL's query string override them.
    ///
    /// # Errors
    /// As [`RedisRepository::connect`].
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self, Error> {
        let (target, options) = parse_url_with(url, options)?;
        if options.connect_timeout.is_zero() || options.response_timeout.is_zero() {
            return Err(Error::config(
                "Redis connect_timeout and response_timeout must be positive",
            ));
        }
        let repo = match target {
            Target::Standalone(url) => {
                let client = open_client(&url)?;
                Self::from_client_with_options(client, &options).await?
            }
            Target::Cluster(nodes) => connect_cluster(nodes, &options).await?,
        };
        let repo = repo.with_options(&options);
        repo.preload_scripts().await?;
        Ok(repo)
    }

    /// Connects to the URL in `IDEMPOTENCY_REDIS_URL`, or else `REDIS_URL` (see
    /// [`RedisRepository::connect`]).
    ///
    /// # Errors
    /// [`Error::Config`] when neither variable is set; otherwise as
    /// [`RedisRepository::connect`].
    pub async fn from_env() -> Result<Self, Error> {
        let url = std::env::var("IDEMPOTENCY_REDIS_URL")
            .or_else(|_| std::env::var("REDIS_URL"))
            .map_err(|_| {
                Error::config("set IDEMPOTENCY_REDIS_URL (or REDIS_URL) to a redis:// URL")
            })?;
        Self::connect(&url).await
    }

    /// Connects with an existing client (your TLS, credentials, RESP3 settings),
    /// through a reconnecting [`ConnectionManager`] with this crate's default
    /// timeouts and retries, and loads the scripts.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the server cannot be reached.
    pub async fn from_client(client: redis::Client) -> Result<Self, Error> {
        #[cfg(feature = "tls")]
        install_crypto_provider();
        let repo = Self::from_client_with_options(client, &RedisOptions::default()).await?;
        repo.preload_scripts().await?;
        Ok(repo)
    }

    /// Uses an existing connection manager as it is (its timeouts and retries).
    /// Scripts are loaded on first use (`NOSCRIPT` → `EVAL`), or call
    /// [`RedisRepository::load_scripts`].
    pub fn from_connection_manager(manager: ConnectionManager) -> Self {
        Self::new(Conn::Standalone(manager))
    }

    /// Connects with an existing cluster client and loads the scripts on every
    /// primary.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the cluster cannot be reached.
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub async fn from_cluster_client(client: redis::cluster::ClusterClient) -> Result<Self, Error> {
        #[cfg(feature = "tls")]
        install_crypto_provider();
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| map_redis_error(e, None, "connect"))?;
        let repo = Self::from_cluster_connection(conn);
        repo.preload_scripts().await?;
        Ok(repo)
    }

    /// Uses an existing async cluster connection as it is. Scripts are loaded on
    /// first use on each node (`NOSCRIPT` → `EVAL`), or call
    /// [`RedisRepository::load_scripts`].
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub fn from_cluster_connection(conn: redis::cluster_async::ClusterConnection) -> Self {
        Self::new(Conn::Cluster(conn))
    }

    fn new(conn: Conn) -> Self {
        RedisRepository {
            conn,
            scripts: Arc::new(Scripts::new()),
            strategy: ReserveStrategy::default(),
            set_nx_get_supported: Arc::new(AtomicBool::new(true)),
            multi_key_scripts: Arc::new(AtomicBool::new(true)),
            max_result_bytes: RedisOptions::default().max_result_bytes,
            batch_reads: BatchReads::default(),
            reads_refused: Arc::new(AtomicBool::new(false)),
            fresh_share: Arc::new(FreshShare::new()),
            #[cfg(feature = "cluster")]
            nodes: None,
        }
    }

    async fn from_client_with_options(
        client: redis::Client,
        options: &RedisOptions,
    ) -> Result<Self, Error> {
        let addr = client.get_connection_info().addr().clone();
        let manager =
            match ConnectionManager::new_with_config(client, manager_config(options)).await {
                Ok(manager) => manager,
                Err(e) => {
                    let err = map_redis_error(e, None, "connect");
                    return Err(unless_another_service(err, &addr, options.connect_timeout).await);
                }
            };
        Ok(Self::from_connection_manager(manager).with_options(options))
    }

    fn with_options(self, options: &RedisOptions) -> Self {
        self.with_reserve_strategy(options.reserve_strategy)
            .with_max_result_bytes(options.max_result_bytes)
            .with_batch_reads(options.batch_reads)
    }

    /// Sets whether a batch's reservations (`reserve_many`) read their
    /// records first (default [`BatchReads::Adaptive`]).
    pub fn with_batch_reads(mut self, reads: BatchReads) -> Self {
        self.batch_reads = reads;
        self
    }

    /// Sets how `reserve` talks to Redis (default [`ReserveStrategy::SetNxGet`]).
    pub fn with_reserve_strategy(mut self, strategy: ReserveStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Sets the largest result or stored error accepted (default
    /// [`DEFAULT_MAX_RESULT_BYTES`](crate::DEFAULT_MAX_RESULT_BYTES); clamped to
    /// [`REDIS_HARD_MAX_RESULT_BYTES`]).
    pub fn with_max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = max.min(REDIS_HARD_MAX_RESULT_BYTES);
        self
    }

    /// The strategy `reserve` uses now: the configured one, or
    /// [`ReserveStrategy::Script`] once the server rejected `SET … NX … GET`.
    pub fn effective_strategy(&self) -> ReserveStrategy {
        if self.strategy == ReserveStrategy::SetNxGet
            && self.set_nx_get_supported.load(Ordering::Relaxed)
        {
            ReserveStrategy::SetNxGet
        } else {
            ReserveStrategy::Script
        }
    }

    /// The Redis key a record is stored under: [`RecordKey::encode`], prefixed
    /// with `{}` when the id contains a `{`.
    ///
    /// Redis Cluster hashes only the part of a key between its first `{` and
    /// the first `}` after it, when that part is not empty (a *hash tag*). The
    /// namespace escapes its braces, but the id is verbatim, so an id such as
    /// `/orders/{id}` (an HTTP route template) would put every key of the
    /// route on one slot. An empty hash tag at the start makes Redis hash the
    /// whole key instead. The prefix keeps the encoding injective: an encoded
    /// key never starts with `{` (the namespace escapes it), so a key starting
    /// with `{}` is always a prefixed one, and the rest is the injective
    /// [`RecordKey::encode`]. Keys of ids without `{` are unchanged.
    ///
    /// ```
    /// use idempotency_core::RecordKey;
    /// use idempotency_redis::RedisRepository;
    ///
    /// let key = RecordKey::new("idempotency:payments", "order-42", 1024)?;
    /// // The namespace's `:` is escaped; the id follows the first `:`.
    /// assert_eq!(RedisRepository::redis_key(&key), "idempotency%3Apayments:order-42");
    /// let key = RecordKey::new("idempotency:payments", "/orders/{id}", 1024)?;
    /// assert_eq!(RedisRepository::redis_key(&key), "{}idempotency%3Apayments:/orders/{id}");
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn redis_key(key: &RecordKey) -> String {
        let encoded = key.encode();
        if needs_empty_hash_tag(key) {
            format!("{EMPTY_HASH_TAG}{encoded}")
        } else {
            encoded
        }
    }

    /// The Lua scripts this repository runs (`EVALSHA`, falling back to `EVAL`
    /// after `NOSCRIPT`): `reserve` (only for takeovers, or on Redis < 7 where
    /// `SET … NX … GET` is rejected), `finish`, `release`, `extend`, and
    /// `complete_many` (a batch's completions, on a standalone server).
    ///
    /// ```no_run
    /// # async fn show() -> Result<(), idempotency_core::Error> {
    /// let repo = idempotency_redis::RedisRepository::connect("redis://127.0.0.1:6379").await?;
    /// for script in repo.scripts() {
    ///     println!("{} {} ({} bytes)", script.name(), script.sha(), script.source().len());
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn scripts(&self) -> [&LuaScript; 5] {
        self.scripts.all()
    }

    /// Loads every script into the server's script cache (`SCRIPT LOAD`; on a
    /// cluster, on every primary), so that no call meets `NOSCRIPT` until the
    /// cache is emptied again (restart, `SCRIPT FLUSH`, failover) — after which
    /// calls reload transparently.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the server cannot be reached.
    pub async fn load_scripts(&self) -> Result<(), Error> {
        for script in self.scripts.all() {
            let mut cmd = redis::cmd("SCRIPT");
            cmd.arg("LOAD").arg(script.source.as_bytes());
            self.conn
                .query(&cmd)
                .await
                .map_err(|e| map_redis_error(e, None, "load_scripts"))?;
        }
        Ok(())
    }

    /// [`load_scripts`](Self::load_scripts) when connecting: an outage is an
    /// error, anything else (e.g. an ACL without `SCRIPT`) only a warning, as
    /// calls load their scripts with `EVAL` when they need them.
    async fn preload_scripts(&self) -> Result<(), Error> {
        match self.load_scripts().await {
            Err(e) if e.is_store_outage() => Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "could not preload the Lua scripts; they will be sent with EVAL on first use");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// `cmd`, naming `key` when it names one. On a cluster reached by URL, a
    /// keyed command goes on our connection to the primary serving the key's
    /// slot and follows `MOVED` and `ASK` there (see `Nodes::send`): the
    /// cluster client's own redirections are unreliable while a slot moves
    /// under load (its `ASKING` and the command can be split by another
    /// request, and its slot refresh has been seen to stall every request
    /// until its timeout). Otherwise, or when the table or the primary cannot
    /// be reached, the command goes on the connection. (An `ASK` the cluster
    /// client gives up with is not followed here: its earlier attempts may
    /// have run the command.)
    async fn send(&self, cmd: &Cmd, key: Option<&RecordKey>) -> Result<Value, RedisError> {
        #[cfg(feature = "cluster")]
        if let (Some(nodes), Some(key)) = (self.nodes.as_ref(), key) {
            if let Some(table) = self.slot_table(nodes).await {
                if let Some(reply) = nodes.send(&table, Self::slot(key), cmd).await {
                    return reply;
                }
            }
        }
        let _ = key;
        self.conn.query(cmd).await
    }

    async fn query(
        &self,
        cmd: &Cmd,
        key: &RecordKey,
        operation: &'static str,
    ) -> Result<Value, Error> {
        self.send(cmd, Some(key))
            .await
            .map_err(|e| map_redis_error(e, Some(key), operation))
    }

    /// `EVALSHA`; after `NOSCRIPT`, `EVAL` with the source (which also caches it).
    async fn eval(
        &self,
        script: &LuaScript,
        key: &RecordKey,
        args: &[&[u8]],
        operation: &'static str,
    ) -> Result<Value, Error> {
        let build = |verb: &str, body: &[u8]| script_cmd(verb, body, key, args);
        match self
            .send(&build("EVALSHA", script.sha.as_bytes()), Some(key))
            .await
        {
            Ok(v) => Ok(v),
            Err(e) if is_noscript(&e) => {
                tracing::debug!(
                    script = script.name,
                    "NOSCRIPT: reloading the script with EVAL"
                );
                self.query(&build("EVAL", script.source.as_bytes()), key, operation)
                    .await
            }
            Err(e) => Err(map_redis_error(e, Some(key), operation)),
        }
    }

    /// Runs one command for the operator operations.
    pub(crate) async fn command(&self, cmd: &Cmd, operation: &'static str) -> Result<Value, Error> {
        self.send(cmd, None)
            .await
            .map_err(|e| map_redis_error(e, None, operation))
    }

    /// Whether this repository talks to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.conn.kind() == "cluster"
    }

    fn decode(key: &RecordKey, bytes: Vec<u8>) -> Result<Record, Error> {
        codec::decode_owned(bytes).map_err(|reason| Error::corrupt(key, reason))
    }

    fn check_size(&self, what: &'static str, value: Option<&[u8]>) -> Result<(), Error> {
        match value {
            Some(v) if v.len() > self.max_result_bytes => Err(Error::TooLarge {
                what,
                size: v.len(),
                max: self.max_result_bytes,
            }),
            _ => Ok(()),
        }
    }

    async fn reserve_with_script(
        &self,
        req: &ReserveRequest<'_>,
        fresh: &[u8],
        px: u64,
    ) -> Result<Reservation, Error> {
        let mut px_digits = itoa::Buffer::new();
        let px = px_digits.format(px).as_bytes();
        let now = ts_bytes(req.now);
        let cutoff = ts_bytes(req.lease_cutoff());
        let retry: &[u8] = if req.retry_failed { b"1" } else { b"0" };
        let reply = self
            .eval(
                &self.scripts.reserve,
                req.key,
                &[fresh, &now, &cutoff, retry, px],
                "reserve",
            )
            .await?;
        Self::script_reservation(req, reply)
    }

    /// `EVALSHA reserve` for `req`, to pipeline.
    fn reserve_script_cmd(&self, req: &ReserveRequest<'_>, fresh: &[u8], px: u64) -> Cmd {
        let mut px_digits = itoa::Buffer::new();
        let px = px_digits.format(px).as_bytes();
        let now = ts_bytes(req.now);
        let cutoff = ts_bytes(req.lease_cutoff());
        let retry: &[u8] = if req.retry_failed { b"1" } else { b"0" };
        let sha = self.scripts.reserve.sha.as_bytes();
        script_cmd("EVALSHA", sha, req.key, &[fresh, &now, &cutoff, retry, px])
    }

    /// The reservation the reserve script answered.
    fn script_reservation(req: &ReserveRequest<'_>, reply: Value) -> Result<Reservation, Error> {
        match reply {
            Value::Array(mut items) => match items.as_slice() {
                [Value::Int(1), Value::Int(attempt)] => u32::try_from(*attempt)
                    .map(|attempt| Reservation::Acquired { attempt })
                    .map_err(|_| unexpected("reserve", "an attempt out of range")),
                [Value::Int(0), Value::BulkString(_)] => match items.pop() {
                    Some(Value::BulkString(bytes)) => {
                        Ok(Reservation::Existing(Self::decode(req.key, bytes)?))
                    }
                    _ => Err(unexpected("reserve", "an unexpected array")),
                },
                _ => Err(unexpected("reserve", "an unexpected array")),
            },
            _ => Err(unexpected("reserve", "a reply that is not an array")),
        }
    }

    /// `complete` (`status` Completed) or `fail` (Failed, remembering
    /// `retryable`).
    #[allow(clippy::too_many_arguments)]
    async fn finish(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        status: Status,
        value: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let operation = if status == Status::Completed {
            "complete"
        } else {
            "fail"
        };
        let args = self.finish_args(owner, status, value, retryable, expires_at, now)?;
        let reply = self
            .eval(&self.scripts.finish, key, &args.slices(value), operation)
            .await?;
        owned_reply(reply, key, operation)
    }

    /// The finish script's arguments but the value (checked against the
    /// size limit).
    fn finish_args(
        &self,
        owner: OwnerToken,
        status: Status,
        value: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<FinishArgs, Error> {
        let what = if status == Status::Completed {
            "result"
        } else {
            "error"
        };
        self.check_size(what, value)?;
        let mut flags = 0;
        if value.is_some() {
            flags |= if status == Status::Completed {
                codec::FLAG_RESULT
            } else {
                codec::FLAG_ERROR
            };
        }
        if retryable && status == Status::Failed {
            flags |= codec::FLAG_RETRYABLE;
        }
        Ok(FinishArgs {
            owner: owner.to_bytes(),
            now: ts_bytes(now),
            expires: ts_bytes(expires_at),
            px: itoa::Buffer::new()
                .format(px(now, expires_at))
                .as_bytes()
                .to_vec(),
            code: [status.code()],
            flags: itoa::Buffer::new().format(flags).as_bytes().to_vec(),
        })
    }

    /// Each completion's `finish` arguments, by index in `writes`, and an
    /// answer already for each refused before anything is sent (a result
    /// over the size limit); `None` for the others. When every one was
    /// refused, their answers.
    fn completion_args(
        &self,
        writes: &[Completion<'_>],
        now: Timestamp,
    ) -> Result<(Answers<()>, Vec<Ready>), Completed> {
        let mut answers = Vec::with_capacity(writes.len());
        let mut ready = Vec::with_capacity(writes.len());
        for (i, w) in writes.iter().enumerate() {
            let completed = Status::Completed;
            match self.finish_args(w.owner, completed, w.result, false, w.expires_at, now) {
                Ok(args) => {
                    ready.push((i, args));
                    answers.push(None);
                }
                Err(e) => answers.push(Some(Err(e))),
            }
        }
        if ready.is_empty() {
            return Err(fill(answers, |_| Err(unexpected("complete", "no answer"))));
        }
        Ok((answers, ready))
    }

    /// Every completion's `EVALSHA finish` in one pipeline: to one primary of
    /// a cluster (whose keys hash to many slots, so no script may take them
    /// all), or to a standalone server for the keys `complete_many` did not
    /// complete or cannot take (see `complete_many.rs`); a script the server
    /// lost is reloaded through the single path.
    async fn complete_pipelined(
        &self,
        mut conn: impl redis::aio::ConnectionLike + Send,
        writes: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        let (mut answers, ready) = match self.completion_args(&writes, now) {
            Ok(args) => args,
            Err(answered) => return answered,
        };
        let mut pipe = redis::Pipeline::with_capacity(ready.len());
        pipe.ignore_errors();
        let sha = self.scripts.finish.sha.as_bytes();
        for (i, args) in &ready {
            let w = &writes[*i];
            pipe.add_command(script_cmd("EVALSHA", sha, w.key, &args.slices(w.result)));
        }
        let sent = ready.len();
        let replies = match pipe
            .query_async::<Vec<redis::RedisResult<Value>>>(&mut conn)
            .await
        {
            Ok(replies) if replies.len() == sent => replies,
            Ok(_) => return fill(answers, |_| Err(replies_missing("complete"))),
            Err(e) => {
                return fill(answers, |i| {
                    Err(map_redis_error(e.clone(), Some(writes[i].key), "complete"))
                })
            }
        };
        let mut replies = replies.into_iter();
        let mut again = Vec::new();
        for (i, answer) in answers.iter_mut().enumerate() {
            if answer.is_some() {
                continue;
            }
            *answer = match replies.next() {
                Some(Ok(reply)) => Some(owned_reply(reply, writes[i].key, "complete")),
                Some(Err(e)) if is_noscript(&e) || self.not_served(&e) => {
                    again.push(i);
                    None
                }
                Some(Err(e)) => Some(Err(map_redis_error(e, Some(writes[i].key), "complete"))),
                None => None,
            };
        }
        let resent = again.iter().map(|&i| {
            let w = writes[i];
            self.complete(w.key, w.owner, w.result, w.expires_at, now)
        });
        let mut resent = futures::future::join_all(resent).await.into_iter();
        fill(answers, |_| {
            resent
                .next()
                .unwrap_or_else(|| Err(unexpected("complete", "fewer replies than writes")))
        })
    }
}

impl RedisRepository {
    /// What `SET … NX PX … GET` answered for `req`: the reservation, or
    /// `None` when the script must decide (the record expired or is open to
    /// takeover, and may have changed since).
    fn set_nx_get_reservation(
        req: &ReserveRequest<'_>,
        reply: Value,
    ) -> Result<Option<Reservation>, Error> {
        let record = match reply {
            Value::Nil => return Ok(Some(Reservation::Acquired { attempt: 1 })),
            Value::BulkString(bytes) => Self::decode(req.key, bytes)?,
            _ => return Err(unexpected("reserve", "an unexpected reply to SET")),
        };
        Ok(Self::decided(req, record))
    }

    /// What the stored `record` answers for `req` with nothing written, or
    /// `None` when a write must decide (the record expired or is open to a
    /// takeover, and may have changed since).
    fn decided(req: &ReserveRequest<'_>, record: Record) -> Option<Reservation> {
        match reserve_transition(Some(&record), req) {
            ReserveTransition::Existing => Some(Reservation::Existing(record)),
            // Our own live reservation (a re-sent reserve): nothing needs
            // writing.
            ReserveTransition::AlreadyHeld { attempt } => Some(Reservation::Acquired { attempt }),
            ReserveTransition::Create | ReserveTransition::Takeover { .. } => None,
        }
    }

    /// A batch's reservations in one round trip (two when they read first
    /// and a record leaves a key open; see [`BatchReads`]); under the
    /// adaptive plan every answer counts into the recent share of fresh keys.
    async fn reserve_pipelined(
        &self,
        mut conn: impl redis::aio::ConnectionLike + Send,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let reads =
            self.batch_reads.now(&self.fresh_share) && !self.reads_refused.load(Ordering::Relaxed);
        let answers = if reads {
            match self.read_first(&mut conn, &requests).await {
                Ok(decided) => self.write_open(conn, requests, decided).await,
                Err(e) if e.is_store_outage() => {
                    requests.iter().map(|_| Err(e.for_another())).collect()
                }
                Err(e) => {
                    // Nothing was written: this batch writes instead.
                    tracing::warn!(error = %e, "the Redis server refused a batch's read; batches write first from now on");
                    self.reads_refused.store(true, Ordering::Relaxed);
                    self.write_pipelined(conn, requests).await
                }
            }
        } else {
            self.write_pipelined(conn, requests).await
        };
        if self.batch_reads == BatchReads::Adaptive {
            for answer in answers.iter().flatten() {
                self.fresh_share.observe(answer);
            }
        }
        answers
    }

    /// The requests the reads left open (`None` in `decided`) through
    /// [`Self::write_pipelined`]; every answer in order.
    async fn write_open(
        &self,
        conn: impl redis::aio::ConnectionLike + Send,
        requests: Vec<ReserveRequest<'_>>,
        decided: read_first::Decided,
    ) -> Vec<Result<Reservation, Error>> {
        let open: Vec<_> = requests
            .into_iter()
            .zip(&decided)
            .filter(|(_, answer)| answer.is_none())
            .map(|(req, _)| req)
            .collect();
        let mut written = if open.is_empty() {
            Vec::new()
        } else {
            self.write_pipelined(conn, open).await
        }
        .into_iter();
        fill(decided, |_| {
            written
                .next()
                .unwrap_or_else(|| Err(unexpected("reserve", "fewer answers than requests")))
        })
    }

    /// Every request's first command in one pipeline; what it cannot decide
    /// (a takeover, an expired record, a script the server lost, a server
    /// without `SET … GET`) goes through [`Repository::reserve`], concurrently.
    async fn write_pipelined(
        &self,
        mut conn: impl redis::aio::ConnectionLike + Send,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let set_nx_get = self.effective_strategy() == ReserveStrategy::SetNxGet;
        let mut pipe = redis::Pipeline::with_capacity(requests.len());
        pipe.ignore_errors();
        for req in &requests {
            let fresh = codec::head(&reserved_record(None, req, 1));
            let px = px(req.now, req.expires_at);
            pipe.add_command(if set_nx_get {
                set_nx_get_cmd(req, fresh.as_bytes(), px)
            } else {
                self.reserve_script_cmd(req, fresh.as_bytes(), px)
            });
        }
        let sent = pipe.query_async::<Vec<redis::RedisResult<Value>>>(&mut conn);
        let replies = match sent.await {
            Ok(replies) if replies.len() == requests.len() => replies,
            Ok(_) => {
                // Some commands may have been applied: as ambiguous as a lost
                // reply, so that the manager re-sends with the same token.
                return requests
                    .iter()
                    .map(|_| Err(replies_missing("reserve")))
                    .collect();
            }
            Err(e) => {
                return requests
                    .iter()
                    .map(|r| Err(map_redis_error(e.clone(), Some(r.key), "reserve")))
                    .collect()
            }
        };
        let mut answers: Vec<Option<Result<Reservation, Error>>> =
            Vec::with_capacity(replies.len());
        for (req, reply) in requests.iter().zip(replies) {
            answers.push(match reply {
                Ok(reply) if set_nx_get => Self::set_nx_get_reservation(req, reply).transpose(),
                Ok(reply) => Some(Self::script_reservation(req, reply)),
                Err(e) if is_noscript(&e) || is_syntax_error(&e) || self.not_served(&e) => None,
                Err(e) => Some(Err(map_redis_error(e, Some(req.key), "reserve"))),
            });
        }
        let again = requests
            .into_iter()
            .zip(&answers)
            .filter(|(_, answer)| answer.is_none())
            .map(|(req, _)| self.reserve(req));
        let mut again = futures::future::join_all(again).await.into_iter();
        fill(answers, |_| {
            again
                .next()
                .unwrap_or_else(|| Err(unexpected("reserve", "fewer answers than requests")))
        })
    }
}

impl RedisRepository {
    /// Whether a pipelined command came back refused by a node that does not
    /// serve its key's slot now (it was not executed); the slot table is then
    /// read again. Never on a standalone server.
    fn not_served(&self, err: &RedisError) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(nodes) = &self.nodes {
            if crate::nodes::is_not_served(err) {
                // `ASK`: the slot is moving, and the table still says
                // where it lives.
                if crate::nodes::asked_at(err).is_none() {
                    nodes.forget(None);
                }
                return true;
            }
        }
        let _ = err;
        false
    }

    /// The cluster slot of `key`'s record.
    #[cfg(feature = "cluster")]
    fn slot(key: &RecordKey) -> u16 {
        crate::nodes::slot_of(Self::redis_key(key).as_bytes())
    }

    /// The cluster's slot table: as last read, else read now (`CLUSTER
    /// SLOTS`, from a primary we hold a connection to, else through the
    /// cluster client); `None` when it cannot be read or used.
    #[cfg(feature = "cluster")]
    async fn slot_table(
        &self,
        nodes: &Arc<crate::nodes::Nodes>,
    ) -> Option<Arc<crate::nodes::SlotTable>> {
        nodes
            .table_or_read(|nodes| {
                let conn = self.conn.clone();
                async move {
                    match nodes.read_table().await {
                        Some(table) => Some(table),
                        None => {
                            let mut cmd = redis::cmd("CLUSTER");
                            cmd.arg("SLOTS");
                            match conn.query(&cmd).await {
                                Ok(reply) => crate::nodes::SlotTable::parse(&reply),
                                Err(_) => None,
                            }
                        }
                    }
                }
            })
            .await
    }

    /// A batch on a cluster: the keys grouped by the primary serving their
    /// slot, one pipeline per primary on our connection to it (see `nodes`);
    /// a key alone on its primary, or every key when the slot table or a
    /// primary cannot be reached, one by one as single commands.
    /// Answers in the batch's order.
    #[cfg(feature = "cluster")]
    async fn per_primary<'k, T, R, B, BF, S, SF>(
        &self,
        items: Vec<T>,
        key: impl Fn(&T) -> &'k RecordKey,
        batch: B,
        single: S,
    ) -> Vec<Result<R, Error>>
    where
        B: Fn(ConnectionManager, Vec<T>) -> BF,
        BF: std::future::Future<Output = Vec<Result<R, Error>>>,
        S: Fn(T) -> SF,
        SF: std::future::Future<Output = Result<R, Error>>,
    {
        use crate::nodes::by_primary;
        let one_by_one = |items: Vec<T>| futures::future::join_all(items.into_iter().map(&single));
        let Some(nodes) = self.nodes.as_ref() else {
            return one_by_one(items).await;
        };
        let Some(table) = self.slot_table(nodes).await else {
            return one_by_one(items).await;
        };
        let count = items.len();
        let slot = |item: &T| Self::slot(key(item));
        let (batch, one_by_one, table) = (&batch, &one_by_one, &*table);
        let sent =
            by_primary(items, table, slot)
                .into_iter()
                .map(|(primary, at, group)| async move {
                    let address = primary.and_then(|p| table.address(p));
                    let link = match address {
                        Some(address) if group.len() > 1 => nodes.link(address).await,
                        _ => None,
                    };
                    let answers = match link {
                        Some(link) => {
                            let answers = batch(link, group).await;
                            if answers
                                .iter()
                                .any(|a| matches!(a, Err(e) if e.is_store_outage()))
                            {
                                // The node failed as a whole: perhaps no longer a
                                // primary. Read the table and reconnect next time.
                                nodes.forget(address);
                            }
                            answers
                        }
                        None => one_by_one(group).await,
                    };
                    (at, answers)
                });
        let mut answers: Vec<Option<Result<R, Error>>> = (0..count).map(|_| None).collect();
        for (at, group) in futures::future::join_all(sent).await {
            for (i, answer) in at.into_iter().zip(group) {
                answers[i] = Some(answer);
            }
        }
        fill(answers, |_| {
            Err(unexpected("batch", "fewer answers than keys"))
        })
    }
}

/// How a reconnecting connection (a standalone server's, or ours to a
/// cluster's primary) connects, times out and retries.
fn manager_config(options: &RedisOptions) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(options.connect_timeout))
        .set_response_timeout(Some(options.response_timeout))
        .set_number_of_retries(options.reconnect_retries)
        .set_min_delay(Duration::from_millis(100))
        .set_max_delay(Duration::from_secs(2))
}

/// `SET key fresh NX PX px GET`: creates the reservation if there is no
/// record, and returns the record there was.
fn set_nx_get_cmd(req: &ReserveRequest<'_>, fresh: &[u8], px: u64) -> Cmd {
    let mut cmd = Cmd::with_capacity(7, key_len(req.key) + fresh.len() + 32);
    cmd.arg("SET")
        .arg(KeyArg(req.key))
        .arg(fresh)
        .arg("NX")
        .arg("PX")
        .arg(px)
        .arg("GET");
    cmd
}

/// Answers by index in a batch, `None` until known.
type Answers<T> = Vec<Option<Result<T, Error>>>;

/// A completion on its way: its index in the batch and its `finish` arguments.
type Ready = (usize, FinishArgs);

/// One answer per completion of a batch, in order.
type Completed = Vec<Result<(), Error>>;

/// The finish script's arguments, owned (the value is the caller's).
struct FinishArgs {
    owner: [u8; 16],
    now: [u8; 8],
    expires: [u8; 8],
    px: Vec<u8>,
    code: [u8; 1],
    flags: Vec<u8>,
}

impl FinishArgs {
    /// The script's arguments in order, `value` last.
    fn slices<'a>(&'a self, value: Option<&'a [u8]>) -> [&'a [u8]; 7] {
        [
            &self.owner,
            &self.now,
            &self.expires,
            &self.px,
            &self.code,
            &self.flags,
            value.unwrap_or_default(),
        ]
    }
}

/// Every answer, the missing ones (`None`) from `rest`, by index.
fn fill<T>(
    answers: Vec<Option<Result<T, Error>>>,
    mut rest: impl FnMut(usize) -> Result<T, Error>,
) -> Vec<Result<T, Error>> {
    answers
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.unwrap_or_else(|| rest(i)))
        .collect()
}

/// `EVAL`/`EVALSHA` of `body` over one key.
fn script_cmd(verb: &str, body: &[u8], key: &RecordKey, args: &[&[u8]]) -> Cmd {
    let data =
        verb.len() + body.len() + key_len(key) + args.iter().map(|a| a.len()).sum::<usize>() + 1;
    let mut cmd = Cmd::with_capacity(args.len() + 4, data);
    cmd.arg(verb).arg(body).arg(1).arg(KeyArg(key));
    for a in args {
        cmd.arg(*a);
    }
    cmd
}

/// `PX` for a record expiring at `expires_at`, seen at `now`: at least 1 ms.
fn px(now: Timestamp, expires_at: Timestamp) -> u64 {
    expires_at
        .as_millis()
        .saturating_sub(now.as_millis())
        .clamp(1, MAX_PX)
}

/// Prepended to the Redis key of an id containing `{`: an empty hash tag, so
/// that Redis Cluster hashes the whole key (see [`RedisRepository::redis_key`]).
const EMPTY_HASH_TAG: &str = "{}";

/// Whether the id could form a hash tag: the namespace never holds a brace, so
/// only the id's first `{` can open one.
fn needs_empty_hash_tag(key: &RecordKey) -> bool {
    key.id().as_bytes().contains(&b'{')
}

/// A record key as a command argument, written straight into the command's
/// buffer: the same bytes as [`RedisRepository::redis_key`], without building
/// a `String` per call.
struct KeyArg<'a>(&'a RecordKey);

impl ToRedisArgs for KeyArg<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let namespace = escape_namespace(self.0.namespace());
        let tag: &[u8] = if needs_empty_hash_tag(self.0) {
            EMPTY_HASH_TAG.as_bytes()
        } else {
            b""
        };
        let mut arg = out.writer_for_next_arg();
        // The writer appends to the command's `Vec`: it cannot fail.
        for part in [tag, namespace.as_bytes(), b":", self.0.id().as_bytes()] {
            let _ = arg.write_all(part);
        }
    }
}

/// Room for a key's encoding: the namespace may grow when escaped, and the
/// command grows past this if it does.
fn key_len(key: &RecordKey) -> usize {
    EMPTY_HASH_TAG.len() + key.namespace().len() + 1 + key.id().len()
}

/// A pipeline answered with fewer replies than commands: some may have run,
/// as ambiguous as a lost reply (an outage, so that the manager re-sends with
/// the same owner token).
fn replies_missing(operation: &str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        message: format!("{operation}: a pipeline answered with replies missing"),
        source: None,
    }
}

fn unexpected(operation: &str, what: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("{operation}: the server answered {what}"),
        source: None,
    }
}

/// The answer of an owner-checked script: 1 applied, 0 lease lost.
fn owned_reply(reply: Value, key: &RecordKey, operation: &'static str) -> Result<(), Error> {
    match reply {
        Value::Int(1) => Ok(()),
        Value::Int(0) => Err(Error::LeaseLost { key: key.clone() }),
        _ => Err(unexpected(operation, "neither 0 nor 1")),
    }
}

/// An outage while connecting may be another service at the address (it
/// closed the connection without a reply: PostgreSQL does, and so does a
/// TLS-only port asked in plain text): asks the address whether it speaks
/// Redis's protocol at all, and makes that a [`Error::Config`].
async fn unless_another_service(
    err: Error,
    addr: &redis::ConnectionAddr,
    timeout: Duration,
) -> Error {
    let redis::ConnectionAddr::Tcp(host, port) = addr else {
        return err;
    };
    if !matches!(err, Error::Unavailable { .. }) {
        return err;
    }
    // Every RESP2 and RESP3 reply starts with one of these type bytes.
    let speaks_resp = |reply: &[u8]| {
        reply
            .first()
            .is_some_and(|b| b"+-:$*_,#!=(%~|>".contains(b))
    };
    match idempotency_core::probe::foreign_service(
        host,
        *port,
        b"*1\r\n$4\r\nPING\r\n",
        timeout,
        speaks_resp,
    )
    .await
    {
        Some(seen) => Error::config(format!(
            "{host}:{port} accepts connections but is not a Redis server ({seen}): another \
             service listens there, or a TLS-only port (use rediss://); check the URL's port"
        )),
        None => err,
    }
}

fn open_client(url: &str) -> Result<redis::Client, Error> {
    #[cfg(feature = "tls")]
    install_crypto_provider();
    redis::Client::open(url)
        .map_err(|e| Error::config(format!("invalid Redis URL {}: {e}", redact(url))))
}

/// rustls needs a process-wide crypto provider; install ring's unless the
/// application installed one already.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: one provider is set.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(feature = "cluster")]
async fn connect_cluster(
    nodes: Vec<String>,
    options: &RedisOptions,
) -> Result<RedisRepository, Error> {
    #[cfg(feature = "tls")]
    install_crypto_provider();
    let template = nodes.first().cloned().unwrap_or_default();
    let client = redis::cluster::ClusterClient::builder(nodes)
        .connection_timeout(options.connect_timeout)
        .response_timeout(options.response_timeout)
        .build()
        .map_err(|e| Error::config(format!("invalid Redis Cluster URL: {e}")))?;
    let conn = client
        .get_async_connection()
        .await
        .map_err(|e| map_redis_error(e, None, "connect"))?;
    let mut repo = RedisRepository::from_cluster_connection(conn);
    repo.nodes = crate::nodes::Nodes::new(&template, manager_config(options)).map(Arc::new);
    Ok(repo)
}

#[cfg(not(feature = "cluster"))]
async fn connect_cluster(
    _nodes: Vec<String>,
    _options: &RedisOptions,
) -> Result<RedisRepository, Error> {
    Err(Error::config(
        "Redis Cluster URLs need the `cluster` feature of idempotency-redis \
         (`redis-cluster` of the idempotency crate)",
    ))
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
        // A reservation carries no result: the record is its fixed part only.
        let fresh = codec::head(&reserved_record(None, &req, 1));
        let fresh = fresh.as_bytes();
        let px = px(req.now, req.expires_at);
        if self.effective_strategy() == ReserveStrategy::SetNxGet {
            match self
                .send(&set_nx_get_cmd(&req, fresh, px), Some(req.key))
                .await
            {
                Ok(reply) => {
                    if let Some(answer) = Self::set_nx_get_reservation(&req, reply)? {
                        return Ok(answer);
                    }
                }
                Err(e) if is_syntax_error(&e) => {
                    tracing::warn!(
                        "the Redis server rejects `SET … NX … GET` (Redis < 7.0); \
                         reserving with the script from now on"
                    );
                    self.set_nx_get_supported.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(map_redis_error(e, Some(req.key), "reserve")),
            }
        }
        self.reserve_with_script(&req, fresh, px).await
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
        match &self.conn {
            Conn::Standalone(conn) if requests.len() > 1 => {
                self.reserve_pipelined(conn.clone(), requests).await
            }
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) if requests.len() > 1 && self.nodes.is_some() => {
                let batch = |link, group| self.reserve_pipelined(link, group);
                self.per_primary(requests, |r| r.key, batch, |r| self.reserve(r))
                    .await
            }
            _ => futures::future::join_all(requests.into_iter().map(|r| self.reserve(r))).await,
        }
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
        match &self.conn {
            Conn::Standalone(conn) if completions.len() > 1 => {
                if self.multi_key_scripts.load(Ordering::Relaxed) {
                    self.complete_scripted(conn.clone(), completions, now).await
                } else {
                    self.complete_pipelined(conn.clone(), completions, now)
                        .await
                }
            }
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) if completions.len() > 1 && self.nodes.is_some() => {
                let batch = |link, group| self.complete_pipelined(link, group, now);
                self.per_primary(
                    completions,
                    |c| c.key,
                    batch,
                    |c| self.complete(c.key, c.owner, c.result, c.expires_at, now),
                )
                .await
            }
            _ => {
                let each = completions
                    .into_iter()
                    .map(|c| self.complete(c.key, c.owner, c.result, c.expires_at, now));
                futures::future::join_all(each).await
            }
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
        let reply = self
            .eval(
                &self.scripts.release,
                key,
                &[&owner.to_bytes(), &ts_bytes(now)],
                "release",
            )
            .await?;
        owned_reply(reply, key, "release")
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let mut px_digits = itoa::Buffer::new();
        let px = px_digits.format(px(now, expires_at)).as_bytes();
        let reply = self
            .eval(
                &self.scripts.extend,
                key,
                &[
                    &owner.to_bytes(),
                    &ts_bytes(now),
                    &ts_bytes(lease_until),
                    &ts_bytes(expires_at),
                    px,
                ],
                "extend",
            )
            .await?;
        owned_reply(reply, key, "extend")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn px_is_positive_and_bounded() {
        let t = Timestamp::from_millis;
        assert_eq!(px(t(1_000), t(4_000)), 3000);
        assert_eq!(px(t(5_000), t(4_000)), 1);
        assert_eq!(px(t(5_000), t(5_000)), 1);
        assert_eq!(px(t(0), Timestamp::MAX), MAX_PX);
    }

    #[test]
    fn key_argument_is_the_redis_key() {
        for (ns, id) in [
            ("idempotency", "order-42"),
            ("a:b", "c:d"),
            ("{tag}%", "{42}"),
            ("ns\n\u{85}é", "🦀"),
            ("routes", "/orders/{id}/items/{item}"),
            ("routes", "{"),
            ("routes", "}{}"),
        ] {
            let key = RecordKey::new(ns, id, MAX_ID_BYTES).unwrap();
            let mut cmd = Cmd::with_capacity(1, key_len(&key));
            cmd.arg(KeyArg(&key));
            let args: Vec<_> = cmd
                .args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(bytes) => bytes.to_vec(),
                    _ => Vec::new(),
                })
                .collect();
            assert_eq!(args, [RedisRepository::redis_key(&key).into_bytes()]);
        }
    }

    /// Every (namespace, id) over an alphabet of the characters that matter
    /// (braces, the separator, the escape character and what an escape
    /// produces), up to 3 characters each: distinct keys get distinct Redis
    /// keys; ids without `{` keep [`RecordKey::encode`], the others get `{}`
    /// in front; and only those start with `{`.
    #[test]
    fn redis_keys_are_injective() {
        const ALPHABET: [char; 7] = ['{', '}', ':', '%', '7', 'B', 'a'];
        fn strings(max: usize) -> Vec<String> {
            let mut all = vec![String::new()];
            let mut last = vec![String::new()];
            for _ in 0..max {
                last = last
                    .iter()
                    .flat_map(|s| ALPHABET.iter().map(move |c| format!("{s}{c}")))
                    .collect();
                all.extend(last.iter().cloned());
            }
            all
        }
        let parts = strings(3);
        let mut seen = std::collections::HashMap::with_capacity(parts.len() * parts.len());
        for ns in &parts {
            for id in parts.iter().filter(|id| !id.is_empty()) {
                let key = RecordKey::new(ns.as_str(), id, MAX_ID_BYTES).unwrap();
                let redis_key = RedisRepository::redis_key(&key);
                if id.contains('{') {
                    assert_eq!(redis_key, format!("{{}}{}", key.encode()));
                } else {
                    assert_eq!(redis_key, key.encode());
                    assert!(!redis_key.starts_with('{'), "{redis_key}");
                }
                if let Some(previous) = seen.insert(redis_key.clone(), (ns, id)) {
                    panic!("{previous:?} and {:?} both map to {redis_key:?}", (ns, id));
                }
            }
        }
    }

    /// With the client's slot function: the keys of one route template spread
    /// over the slots, where [`RecordKey::encode`] alone puts them on one; a
    /// namespace with braces never formed a tag.
    #[cfg(feature = "cluster")]
    #[test]
    fn brace_ids_spread_over_slots() {
        use redis::cluster_routing::Slot;
        use std::collections::HashSet;
        for template in ["/orders/{id}", "{tenant}:{order}", "x{y}z", "{"] {
            let keys: Vec<RecordKey> = (0..1000)
                .map(|i| RecordKey::new("api", format!("{template}-{i}"), MAX_ID_BYTES).unwrap())
                .collect();
            let slots: HashSet<Slot> = keys
                .iter()
                .map(|k| Slot::for_key(RedisRepository::redis_key(k)))
                .collect();
            // 1000 keys over 16384 slots: about 970 distinct ones expected.
            assert!(slots.len() > 900, "{template}: {} slots", slots.len());
            let former: HashSet<Slot> = keys.iter().map(|k| Slot::for_key(k.encode())).collect();
            if template != "{" {
                assert_eq!(former.len(), 1, "{template}: the former encoding");
            }
        }
        let keys: HashSet<Slot> = (0..1000)
            .map(|i| {
                let key = RecordKey::new("{tenant}", format!("order-{i}"), MAX_ID_BYTES).unwrap();
                Slot::for_key(RedisRepository::redis_key(&key))
            })
            .collect();
        assert!(keys.len() > 900, "{} slots", keys.len());
    }
}
