//! The stores under test: a server from the harness behind a fault proxy, and
//! one repository per simulated process.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idempotency_conformance::containers::{self, FaultProxy};
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
    /// PostgreSQL.
    Postgres,
    /// DynamoDB (the harness's moto server offline).
    Dynamodb,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::Postgres => "postgres",
            Backend::Dynamodb => "dynamodb",
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
    repos: Vec<SharedRepository>,
}

impl Target {
    /// `processes` repositories on `backend`, each with its own connections,
    /// through one fault proxy.
    ///
    /// # Errors
    /// When the server cannot be had or a repository cannot connect.
    pub async fn connect(backend: Backend, processes: usize) -> Result<Target, String> {
        if backend == Backend::Memory {
            let shared: SharedRepository = Arc::new(MemoryRepository::new());
            return Ok(Target {
                proxy: None,
                repos: vec![shared; processes],
            });
        }
        let (direct, proxy) = proxied_urls(backend).await?;
        // Created (migrated) once, directly, before the processes connect.
        idempotency::connect(&direct)
            .await
            .map_err(|e| format!("{backend}: {e}"))?;
        let proxied = proxy_url(backend, &direct, proxy.url());
        let mut repos = Vec::new();
        for _ in 0..processes {
            repos.push(
                idempotency::connect(&proxied)
                    .await
                    .map_err(|e| format!("{backend} through the proxy: {e}"))?,
            );
        }
        Ok(Target {
            proxy: Some(proxy),
            repos,
        })
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

/// The direct URL of the server (with its options) and a proxy in front of it.
async fn proxied_urls(backend: Backend) -> Result<(String, FaultProxy), String> {
    let harness = |e: containers::HarnessError| format!("{backend}: {e}");
    let (direct, server) = match backend {
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
            let direct = format!(
                "dynamodb://{TABLE}?region={}&endpoint={}&credentials=dummy&create_table=true",
                server.region(),
                server.endpoint()
            );
            (direct, server.endpoint().to_owned())
        }
        Backend::Memory => unreachable!("memory has no server"),
    };
    let proxy = FaultProxy::start(&server).await.map_err(harness)?;
    let direct = match backend {
        Backend::Postgres => with_query(&direct, &format!("table={TABLE}")),
        _ => direct,
    };
    Ok((direct, proxy))
}

/// The URL the processes use: through the proxy, with short timeouts (so an
/// outage shows as errors within a run, not as hangs).
fn proxy_url(backend: Backend, direct: &str, via: &str) -> String {
    match backend {
        Backend::Redis => with_query(via, "response_timeout=500ms&connect_timeout=500ms"),
        Backend::Postgres => with_query(
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
        Backend::Memory => direct.to_owned(),
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
