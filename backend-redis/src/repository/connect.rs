//! Connecting and building: from a URL, the environment, a client or a
//! connection; the options; loading the scripts; and, when a connection
//! fails, whether another service listens at the address.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Error, FreshShare};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{BatchReads, Conn, RedisRepository};
use crate::error::map_redis_error;
use crate::options::{
    parse_url_with, redact, RedisOptions, ReserveStrategy, Target, REDIS_HARD_MAX_RESULT_BYTES,
};
use crate::scripts::{LuaScript, Scripts};

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
