//! The stores under test: a server from the harness behind a fault proxy, and
//! one repository per simulated process.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::recorder::{History, Recorder};
use crate::scenario::Scenario;
use idempotency_conformance::containers::{
    self, Dedicated, DynamoDbServer, FaultProxy, MariaDbServer, PostgresServer, RedisServer,
};
use idempotency_core::{
    Clock, Config, IdempotencyManager, JsonCodec, MemoryRepository, SharedRepository, SystemClock,
    Timestamp,
};

/// A store kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The in-memory store (in-process faults only).
    Memory,
    /// Redis, standalone.
    Redis,
    /// Redis Cluster, three masters (in-process faults only: the cluster
    /// announces its nodes' own addresses, so one proxy cannot stand in front).
    RedisCluster,
    /// PostgreSQL.
    Postgres,
    /// DynamoDB (the harness's moto server offline).
    Dynamodb,
    /// SQLite: one file, each process its own connection (in-process faults
    /// only: there is no network to cut).
    Sqlite,
    /// MySQL protocol: the harness's MariaDB.
    Mysql,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis cluster",
            Backend::Postgres => "postgres",
            Backend::Dynamodb => "dynamodb",
            Backend::Sqlite => "sqlite",
            Backend::Mysql => "mysql",
        })
    }
}

/// The table the SQL and DynamoDB runs share (each run has its own key prefix).
const TABLE: &str = "idem_reliability";

/// Where the managers of one run store their records.
#[derive(Debug)]
pub struct Target {
    /// The proxy between the managers and the server (none for memory).
    pub proxy: Option<FaultProxy>,
    /// The run's own server, when the scenario acts on it.
    pub server: Option<OwnServer>,
    repos: Vec<SharedRepository>,
    /// Every store call of the run, for the linearizability check.
    pub history: History,
}

/// A server in a container of the run's own.
#[derive(Debug)]
pub enum OwnServer {
    /// Redis.
    Redis(Dedicated<RedisServer>),
    /// PostgreSQL.
    Postgres(Dedicated<PostgresServer>),
    /// DynamoDB (moto).
    Dynamodb(Dedicated<DynamoDbServer>),
    /// MariaDB.
    Mysql(Dedicated<MariaDbServer>),
}

impl OwnServer {
    async fn start(backend: Backend, scenario: Scenario) -> Result<OwnServer, String> {
        let harness = |e: containers::HarnessError| format!("{backend}: {e}");
        Ok(match backend {
            Backend::Redis => {
                // Durable: every write in the append-only file, fsynced before
                // the reply. Forgetful: no snapshot, no append-only file.
                let args: &[&str] = match scenario {
                    Scenario::ServerRestartForgetful => &["--save", "", "--appendonly", "no"],
                    _ => &["--appendonly", "yes", "--appendfsync", "always"],
                };
                OwnServer::Redis(
                    RedisServer::dedicated_with_args(args)
                        .await
                        .map_err(harness)?,
                )
            }
            Backend::Postgres => {
                OwnServer::Postgres(PostgresServer::dedicated().await.map_err(harness)?)
            }
            Backend::Dynamodb => {
                OwnServer::Dynamodb(DynamoDbServer::dedicated().await.map_err(harness)?)
            }
            Backend::Mysql => OwnServer::Mysql(MariaDbServer::dedicated().await.map_err(harness)?),
            Backend::Memory | Backend::RedisCluster | Backend::Sqlite => {
                return Err(format!("{backend}: no server of a run's own"))
            }
        })
    }

    fn url(&self) -> String {
        match self {
            OwnServer::Redis(s) => s.url().to_owned(),
            OwnServer::Postgres(s) => s.url().to_owned(),
            OwnServer::Dynamodb(s) => dynamodb_url(s.region(), s.endpoint()),
            OwnServer::Mysql(s) => s.url().to_owned(),
        }
    }

    fn endpoint(&self) -> String {
        match self {
            OwnServer::Dynamodb(s) => s.endpoint().to_owned(),
            _ => self.url(),
        }
    }

    /// Freezes the server (`docker pause`) for `d`.
    ///
    /// # Errors
    /// When Docker refuses.
    pub async fn pause_for(&self, d: Duration) -> Result<(), String> {
        let r = match self {
            OwnServer::Redis(s) => pause_for(s, d).await,
            OwnServer::Postgres(s) => pause_for(s, d).await,
            OwnServer::Dynamodb(s) => pause_for(s, d).await,
            OwnServer::Mysql(s) => pause_for(s, d).await,
        };
        r.map_err(|e| e.to_string())
    }

    /// Stops and starts the server.
    ///
    /// # Errors
    /// When Docker refuses or the server does not come back.
    pub async fn restart(&self) -> Result<(), String> {
        let r = match self {
            OwnServer::Redis(s) => s.restart().await,
            OwnServer::Postgres(s) => s.restart().await,
            OwnServer::Dynamodb(s) => s.restart().await,
            OwnServer::Mysql(s) => s.restart().await,
        };
        r.map_err(|e| e.to_string())
    }
}

async fn pause_for<S>(server: &Dedicated<S>, d: Duration) -> Result<(), containers::HarnessError> {
    server.pause().await?;
    tokio::time::sleep(d).await;
    server.unpause().await
}

fn dynamodb_url(region: &str, endpoint: &str) -> String {
    format!("dynamodb://{TABLE}?region={region}&endpoint={endpoint}&credentials=dummy&create_table=true")
}

impl Target {
    /// `processes` repositories on `backend`, each with its own connections,
    /// through one fault proxy.
    ///
    /// # Errors
    /// When the server cannot be had or a repository cannot connect.
    pub async fn connect(
        backend: Backend,
        processes: usize,
        scenario: Scenario,
    ) -> Result<Target, String> {
        if backend == Backend::Memory {
            let history = History::default();
            let shared = Recorder::wrap(Arc::new(MemoryRepository::new()), history.clone());
            return Ok(Target {
                proxy: None,
                server: None,
                repos: vec![shared; processes],
                history,
            });
        }
        if backend == Backend::RedisCluster {
            return Target::cluster(processes).await;
        }
        if backend == Backend::Sqlite {
            return Target::sqlite(processes).await;
        }
        let server = match scenario.needs_own_server() {
            true => Some(OwnServer::start(backend, scenario).await?),
            false => None,
        };
        let (direct, proxy) = proxied_urls(backend, server.as_ref()).await?;
        // Created (migrated) once, directly, before the processes connect.
        idempotency::connect(&direct)
            .await
            .map_err(|e| format!("{backend}: {e}"))?;
        let proxied = proxy_url(backend, &direct, proxy.url());
        let repos = connect_each(
            |i| process_url(backend, &proxied, i + scenario as usize),
            processes,
            &format!("{backend} through the proxy"),
        )
        .await?;
        Ok(Target::recorded(repos, Some(proxy), server))
    }

    /// `processes` repositories on the harness's Redis Cluster, each with its
    /// own connections, without a proxy.
    async fn cluster(processes: usize) -> Result<Target, String> {
        let cluster = containers::redis_cluster()
            .await
            .map_err(|e| format!("redis cluster: {e}"))?;
        let hosts: Vec<String> = cluster
            .nodes()
            .iter()
            .map(|n| format!("{}:{}", n.host(), n.port()))
            .collect();
        let url = format!(
            "redis+cluster://{}?response_timeout=500ms&connect_timeout=500ms",
            hosts.join(",")
        );
        let repos = connect_each(|_| url.clone(), processes, "redis cluster").await?;
        Ok(Target::recorded(repos, None, None))
    }

    /// `processes` repositories on one new SQLite file, each with its own
    /// connection (a simulated process sharing the file).
    async fn sqlite(processes: usize) -> Result<Target, String> {
        let file = std::env::temp_dir().join(format!(
            "{}.db",
            containers::unique_namespace("idempotency-reliability")
        ));
        let url = format!("sqlite://{}?busy_timeout=2s", file.display());
        let repos = connect_each(|_| url.clone(), processes, "sqlite").await?;
        Ok(Target::recorded(repos, None, None))
    }

    /// A target over `repos`, each wrapped in a [`Recorder`] of one shared
    /// history.
    fn recorded(
        repos: Vec<SharedRepository>,
        proxy: Option<FaultProxy>,
        server: Option<OwnServer>,
    ) -> Target {
        let history = History::default();
        Target {
            repos: repos
                .into_iter()
                .map(|r| Recorder::wrap(r, history.clone()))
                .collect(),
            proxy,
            server,
            history,
        }
    }

    /// The manager of process `index`, with its clock `offset` ahead.
    ///
    /// # Errors
    /// An invalid configuration.
    pub fn manager(
        &self,
        index: usize,
        config: Config,
        offset: Duration,
    ) -> Result<IdempotencyManager, String> {
        let repo = self.repos[index % self.repos.len()].clone();
        IdempotencyManager::with_parts(repo, config, Arc::new(AheadClock(offset)), JsonCodec)
            .map_err(|e| e.to_string())
    }
}

/// `processes` repositories, process `i` on `url(i)`, each with connections
/// of its own (a simulated process); `what` names them in errors.
async fn connect_each(
    url: impl Fn(usize) -> String,
    processes: usize,
    what: &str,
) -> Result<Vec<SharedRepository>, String> {
    let mut repos = Vec::with_capacity(processes);
    for i in 0..processes {
        let repo = idempotency::connect(&url(i))
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        repos.push(repo);
    }
    Ok(repos)
}

/// The direct URL of the server (with its options) and a proxy in front of it:
/// the run's own server, or the harness's shared one.
async fn proxied_urls(
    backend: Backend,
    own: Option<&OwnServer>,
) -> Result<(String, FaultProxy), String> {
    let harness = |e: containers::HarnessError| format!("{backend}: {e}");
    let (direct, server) = match (backend, own) {
        (_, Some(own)) => (own.url(), own.endpoint()),
        _ => shared_urls(backend).await?,
    };
    let proxy = FaultProxy::start(&server).await.map_err(harness)?;
    let direct = match backend {
        Backend::Postgres | Backend::Mysql => with_query(&direct, &format!("table={TABLE}")),
        _ => direct,
    };
    Ok((direct, proxy))
}

/// The direct URL and the proxied server address of the harness's server.
async fn shared_urls(backend: Backend) -> Result<(String, String), String> {
    let harness = |e: containers::HarnessError| format!("{backend}: {e}");
    Ok(match backend {
        Backend::Redis => {
            let server = containers::redis().await.map_err(harness)?;
            let url = server.url().to_owned();
            (url.clone(), url)
        }
        Backend::Postgres => {
            let server = containers::postgres().await.map_err(harness)?;
            let url = server.url().to_owned();
            (url.clone(), url)
        }
        Backend::Dynamodb => {
            let server = containers::dynamodb().await.map_err(harness)?;
            let direct = dynamodb_url(server.region(), server.endpoint());
            (direct, server.endpoint().to_owned())
        }
        Backend::Mysql => {
            let server = containers::mariadb().await.map_err(harness)?;
            let url = server.url().to_owned();
            (url.clone(), url)
        }
        Backend::Memory | Backend::RedisCluster | Backend::Sqlite => {
            return Err(format!("{backend}: not behind a proxy"))
        }
    })
}

/// The URL the processes use: through the proxy, with short timeouts (so an
/// outage shows as errors within a run, not as hangs).
fn proxy_url(backend: Backend, direct: &str, via: &str) -> String {
    match backend {
        Backend::Redis => with_query(via, "response_timeout=500ms&connect_timeout=500ms"),
        Backend::Postgres | Backend::Mysql => with_query(
            via,
            &format!("table={TABLE}&operation_timeout=500ms&acquire_timeout=2s"),
        ),
        Backend::Dynamodb => {
            let endpoint = via.trim_end_matches('/');
            direct
                .split_once("&endpoint=")
                .map(|(head, tail)| {
                    let rest = tail.split_once('&').map_or("", |(_, rest)| rest);
                    format!("{head}&endpoint={endpoint}&{rest}&timeout=2s")
                })
                .unwrap_or_else(|| direct.to_owned())
        }
        Backend::Memory | Backend::RedisCluster | Backend::Sqlite => direct.to_owned(),
    }
}

/// The reserve plans PostgreSQL processes take turns at.
const POSTGRES_PLANS: [&str; 3] = ["adaptive", "insert-first", "read-first"];

/// How far PostgreSQL processes coalesce, in turns: every call past the
/// first in flight, or none.
const POSTGRES_COALESCING: [usize; 2] = [1, 0];

/// The URL of the process in turn `index` (its index plus the scenario's, so
/// that two processes still meet every plan across the scenarios): PostgreSQL
/// processes take turns at the reserve plans, so that each plan's first
/// statements meet the faults while racing another plan on the same keys, and
/// at coalescing, so that shared statements meet them too.
fn process_url(backend: Backend, url: &str, index: usize) -> String {
    match backend {
        Backend::Postgres => with_query(
            url,
            &format!(
                "reserve_plan={}&coalesce_above={}",
                POSTGRES_PLANS[index % POSTGRES_PLANS.len()],
                POSTGRES_COALESCING[index % POSTGRES_COALESCING.len()]
            ),
        ),
        _ => url.to_owned(),
    }
}

fn with_query(url: &str, query: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{query}")
}

/// The system clock, `0` ahead.
#[derive(Debug)]
struct AheadClock(Duration);

impl Clock for AheadClock {
    fn now(&self) -> Timestamp {
        SystemClock.now() + self.0
    }
}
