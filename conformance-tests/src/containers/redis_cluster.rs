//! Redis Cluster: three masters, each in its own container.
//!
//! Cluster nodes tell clients where slots live (`MOVED 127.0.0.1:PORT`), so the
//! addresses they announce must be reachable from the tests. The nodes therefore
//! run in the host's network namespace, bound to `127.0.0.1` on free ports
//! (Linux Docker engines; Docker Desktop's host network is the VM's).

use std::time::{Duration, Instant};

use super::docker::{
    free_port, keep_for_process, notice, on_harness, ready_timeout, start_ready, Dedicated, Kind,
    Origin, Probe, StartOptions, Started,
};
use super::error::HarnessError;
use super::redis::{probe, send_command, RedisReply, RedisServer};

/// The variable naming an existing cluster: comma-separated node URLs.
const CLUSTER_VARIABLE: &str = "IDEMPOTENCY_TEST_REDIS_CLUSTER_URLS";
const NODES: usize = 3;
const SLOTS: u32 = 16384;

/// Connection details of a Redis Cluster handed out by the harness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisClusterServer {
    nodes: Vec<RedisServer>,
}

impl RedisClusterServer {
    /// The masters (or the nodes of `IDEMPOTENCY_TEST_REDIS_CLUSTER_URLS`);
    /// [`RedisServer::command`] talks to one node, without following `MOVED`.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// One `redis://127.0.0.1:PORT` URL per node; any of them seeds a cluster client.
    pub fn urls(&self) -> Vec<&str> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `redis+cluster://host:port,host:port,…`: the URL of the whole cluster,
    /// as `idempotency-redis` (feature `cluster`) and the root crate read it.
    pub fn cluster_url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{}:{}", n.host(), n.port()))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// A three-master cluster of its own for one test, all 16384 slots
    /// assigned, for what the shared one must not see: slots moved between
    /// masters (`CLUSTER SETSLOT`, `MIGRATE`). Its containers
    /// are removed when the handle drops. Needs Docker, even where
    /// `IDEMPOTENCY_TEST_REDIS_CLUSTER_URLS` names a cluster for the shared one.
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable or the cluster does not
    /// become healthy.
    pub async fn dedicated() -> Result<DedicatedRedisCluster, HarnessError> {
        on_harness(async {
            let nodes = start_cluster(true).await?;
            let server = RedisClusterServer {
                nodes: nodes.iter().map(|(server, _, _)| server.clone()).collect(),
            };
            let nodes = nodes
                .into_iter()
                .map(|(server, started, probe)| Dedicated::new(server, Kind::Redis, started, probe))
                .collect();
            Ok(DedicatedRedisCluster {
                server,
                _containers: nodes,
            })
        })
        .await
    }
}

/// A Redis Cluster owned by one test ([`RedisClusterServer::dedicated`]);
/// dereferences to its connection details; dropping it removes the nodes'
/// containers.
#[derive(Debug)]
pub struct DedicatedRedisCluster {
    server: RedisClusterServer,
    _containers: Vec<Dedicated<RedisServer>>,
}

impl std::ops::Deref for DedicatedRedisCluster {
    type Target = RedisClusterServer;

    fn deref(&self) -> &RedisClusterServer {
        &self.server
    }
}

/// A Redis Cluster of three masters (no replicas) shared by every test of this
/// test binary, all 16384 slots assigned; or the cluster named by
/// `IDEMPOTENCY_TEST_REDIS_CLUSTER_URLS` (comma-separated node URLs).
///
/// The nodes run `IDEMPOTENCY_TEST_REDIS_IMAGE` (Redis 7 or later) in the
/// host's network namespace, bound to `127.0.0.1`.
///
/// # Errors
///
/// [`HarnessError`] when there is neither Docker nor the variable, or when the
/// cluster does not become healthy.
pub async fn redis_cluster() -> Result<RedisClusterServer, HarnessError> {
    static SHARED: tokio::sync::OnceCell<Result<RedisClusterServer, HarnessError>> =
        tokio::sync::OnceCell::const_new();
    on_harness(async {
        SHARED
            .get_or_init(|| async {
                match std::env::var(CLUSTER_VARIABLE) {
                    Ok(value) if !value.trim().is_empty() => external_cluster(&value),
                    _ => shared_cluster().await,
                }
            })
            .await
            .clone()
    })
    .await
}

fn external_cluster(value: &str) -> Result<RedisClusterServer, HarnessError> {
    let urls: Vec<String> = value
        .split(',')
        .map(|url| url.trim().to_owned())
        .filter(|url| !url.is_empty())
        .collect();
    if urls.is_empty() {
        return Err(HarnessError::External {
            variable: CLUSTER_VARIABLE,
            value: value.to_owned(),
            reason: "expected comma-separated node URLs, e.g. redis://127.0.0.1:7000,redis://127.0.0.1:7001".to_owned(),
        });
    }
    let mut nodes = Vec::new();
    for url in urls {
        let invalid = |reason: String| HarnessError::External {
            variable: CLUSTER_VARIABLE,
            value: value.to_owned(),
            reason,
        };
        let parsed = url::Url::parse(&url).map_err(|e| invalid(format!("{url}: {e}")))?;
        let host = match parsed.host() {
            Some(url::Host::Domain(domain)) => domain.to_owned(),
            Some(url::Host::Ipv4(address)) => address.to_string(),
            Some(url::Host::Ipv6(address)) => address.to_string(),
            None => return Err(invalid(format!("{url}: no host"))),
        };
        let port = parsed.port().unwrap_or(6379);
        let origin = Origin::External {
            variable: CLUSTER_VARIABLE,
        };
        nodes.push(RedisServer::new(url, host, port, origin));
    }
    notice(format_args!(
        "redis cluster: using the nodes from {CLUSTER_VARIABLE} ({value})"
    ));
    Ok(RedisClusterServer { nodes })
}

async fn shared_cluster() -> Result<RedisClusterServer, HarnessError> {
    let mut servers = Vec::new();
    for (server, started, _) in start_cluster(false).await? {
        servers.push(server);
        keep_for_process(started.container);
    }
    Ok(RedisClusterServer { nodes: servers })
}

/// Starts the masters and forms the cluster: each node's server, container
/// and readiness probe.
async fn start_cluster(
    dedicated: bool,
) -> Result<Vec<(RedisServer, Started, Probe)>, HarnessError> {
    let role = if dedicated { "dedicated" } else { "shared" };
    let begun = Instant::now();
    let mut nodes: Vec<(u16, u16, Started, Probe)> = Vec::new();
    for _ in 0..NODES {
        match start_node(dedicated).await {
            Ok(node) => nodes.push(node),
            Err(e) => {
                for (_, _, started, _) in nodes {
                    let _ = started.container.rm().await;
                }
                return Err(e);
            }
        }
    }
    let ports: Vec<(u16, u16)> = nodes
        .iter()
        .map(|(port, bus, _, _)| (*port, *bus))
        .collect();
    if let Err(e) = form_cluster(&ports).await {
        for (_, _, started, _) in nodes {
            let _ = started.container.rm().await;
        }
        return Err(e);
    }
    let mut formed = Vec::new();
    for (port, _, started, probe) in nodes {
        let server = RedisServer::local(port, started.origin.clone());
        notice(format_args!(
            "redis cluster node ({role}): {}, listening on {}",
            server.origin(),
            server.url()
        ));
        formed.push((server, started, probe));
    }
    notice(format_args!(
        "redis cluster ({role}): {NODES} masters ready after {:.1}s",
        begun.elapsed().as_secs_f64()
    ));
    Ok(formed)
}

async fn start_node(dedicated: bool) -> Result<(u16, u16, Started, Probe), HarnessError> {
    let port = free_port()?;
    let bus = free_port()?;
    let cmd = [
        "redis-server".to_owned(),
        "--port".to_owned(),
        port.to_string(),
        "--bind".to_owned(),
        "127.0.0.1".to_owned(),
        "--cluster-enabled".to_owned(),
        "yes".to_owned(),
        "--cluster-port".to_owned(),
        bus.to_string(),
        "--cluster-config-file".to_owned(),
        format!("nodes-{port}.conf"),
        "--cluster-node-timeout".to_owned(),
        "5000".to_owned(),
        "--save".to_owned(),
        String::new(),
        "--appendonly".to_owned(),
        "no".to_owned(),
    ]
    .to_vec();
    let options = StartOptions {
        cmd,
        host_port: Some(port),
        host_network: true,
        dedicated,
        ..StartOptions::default()
    };
    let (started, probe) = start_ready(Kind::Redis, options, probe).await?;
    Ok((port, bus, started, probe))
}

async fn command(port: u16, args: &[String]) -> Result<RedisReply, HarnessError> {
    let reply = send_command("127.0.0.1", port, args)
        .await
        .map_err(|e| HarnessError::operation(format!("redis cluster node {port}: {args:?}"), e))?;
    match reply {
        RedisReply::Error(e) => Err(HarnessError::operation(
            format!("redis cluster node {port}: {args:?}"),
            e,
        )),
        other => Ok(other),
    }
}

/// Splits the slots evenly, introduces the nodes, and waits until every node
/// sees a healthy cluster.
async fn form_cluster(ports: &[(u16, u16)]) -> Result<(), HarnessError> {
    let count = u32::try_from(ports.len()).unwrap_or(1).max(1);
    for (index, (port, _)) in (0u32..).zip(ports) {
        let first = index * SLOTS / count;
        let last = (index + 1) * SLOTS / count - 1;
        let args = [
            "CLUSTER",
            "ADDSLOTSRANGE",
            &first.to_string(),
            &last.to_string(),
        ]
        .map(str::to_owned);
        command(*port, &args).await?;
    }
    if let Some(((seed, _), others)) = ports.split_first() {
        for (port, bus) in others {
            let args = [
                "CLUSTER",
                "MEET",
                "127.0.0.1",
                &port.to_string(),
                &bus.to_string(),
            ]
            .map(str::to_owned);
            command(*seed, &args).await?;
        }
    }
    let deadline = Instant::now() + ready_timeout();
    loop {
        let mut last = String::new();
        let mut healthy = true;
        for (port, _) in ports {
            let info = command(*port, &["CLUSTER".to_owned(), "INFO".to_owned()]).await?;
            let text = match info {
                RedisReply::Bulk(Some(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
                other => format!("{other:?}"),
            };
            let ok = text.contains("cluster_state:ok")
                && text.contains(&format!("cluster_known_nodes:{}", ports.len()))
                && text.contains(&format!("cluster_slots_ok:{SLOTS}"));
            if !ok {
                healthy = false;
                last = format!("node {port}: {}", text.replace("\r\n", " "));
                break;
            }
        }
        if healthy {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(HarnessError::NotReady {
                kind: "redis cluster",
                target: format!("{} nodes on 127.0.0.1", ports.len()),
                waited: ready_timeout(),
                last_error: last,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
