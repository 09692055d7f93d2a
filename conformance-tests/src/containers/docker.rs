//! Containers through testcontainers: the harness runtime, labels, start and
//! readiness, dedicated containers, and the clean-up at process exit.
//!
//! # Why a runtime of its own
//!
//! `#[tokio::test]` builds a new runtime per test, but the shared servers live
//! for the whole test binary. Everything that touches Docker or drives a
//! connection of the harness therefore runs on one process-wide runtime owned by
//! the harness; callers only await a `JoinHandle`, which works from any runtime
//! (or none). testcontainers' own drop logic never runs on a test's runtime.
//!
//! # Clean-up
//!
//! Statics are never dropped, so the shared containers cannot be removed by
//! `Drop`. Instead every container carries labels naming this process
//! (session id, pid, pid start time, boot id + pid namespace), and:
//! 1. a watchdog child process (`sh` + the `docker` CLI, in its own process
//!    group so Ctrl-C does not reach it) blocks on a pipe from this process; the
//!    pipe closes when the process ends in any way (normal exit, panic, signal,
//!    SIGKILL), and the watchdog then force-removes this session's containers;
//! 2. when a test process first talks to Docker it removes containers of earlier
//!    processes on the same machine whose owner is gone (covers a missing
//!    `docker` CLI or a killed watchdog);
//! 3. `scripts/test.sh` waits for its run's containers to disappear and removes
//!    any leftover of that run.
//!
//! Dedicated containers (owned by one test) are removed when their handle drops.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use testcontainers::bollard::models::{HostConfig, PortBinding};
use testcontainers::bollard::query_parameters::{
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
};
use testcontainers::bollard::Docker;
use testcontainers::core::client::ClientError;
use testcontainers::core::error::TestcontainersError;
use testcontainers::core::IntoContainerPort;
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, CopyTargetOptions, GenericImage, ImageExt};

use super::error::HarnessError;

const LABEL_HARNESS: &str = "org.idempotency-rs.harness";
const LABEL_SESSION: &str = "org.idempotency-rs.session";
const LABEL_PID: &str = "org.idempotency-rs.pid";
const LABEL_PID_START: &str = "org.idempotency-rs.pid-start";
const LABEL_HOST: &str = "org.idempotency-rs.host";
const LABEL_KIND: &str = "org.idempotency-rs.kind";
const LABEL_ROLE: &str = "org.idempotency-rs.role";
/// Set from `IDEMPOTENCY_TEST_RUN_ID`, so `scripts/test.sh` can find its run's containers.
const LABEL_RUN: &str = "org.idempotency-rs.run";

/// How long a server may take to answer its client after its container started.
const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The kinds of server, with their images, ports and variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Redis,
    Postgres,
    DynamoDb,
    MariaDb,
    /// Amazon SQS (moto).
    Sqs,
    RabbitMq,
}

impl Kind {
    /// How many kinds there are (the slots of per-kind tables).
    const COUNT: usize = Kind::RabbitMq as usize + 1;

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Redis => "redis",
            Kind::Postgres => "postgres",
            Kind::DynamoDb => "dynamodb",
            Kind::MariaDb => "mariadb",
            Kind::Sqs => "sqs",
            Kind::RabbitMq => "rabbitmq",
        }
    }

    pub(crate) fn image_variable(self) -> &'static str {
        match self {
            Kind::Redis => "IDEMPOTENCY_TEST_REDIS_IMAGE",
            Kind::Postgres => "IDEMPOTENCY_TEST_POSTGRES_IMAGE",
            Kind::DynamoDb => "IDEMPOTENCY_TEST_DYNAMODB_IMAGE",
            Kind::MariaDb => "IDEMPOTENCY_TEST_MARIADB_IMAGE",
            Kind::Sqs => "IDEMPOTENCY_TEST_SQS_IMAGE",
            Kind::RabbitMq => "IDEMPOTENCY_TEST_RABBITMQ_IMAGE",
        }
    }

    fn default_image(self) -> &'static str {
        match self {
            Kind::Redis => "redis:7",
            Kind::Postgres => "postgres:16",
            Kind::DynamoDb => "amazon/dynamodb-local:latest",
            Kind::MariaDb => "mariadb:11",
            Kind::Sqs => "motoserver/moto:latest",
            Kind::RabbitMq => "rabbitmq:3",
        }
    }

    pub(crate) fn baked_image(self) -> &'static str {
        match self {
            Kind::Redis => "idempotency-test/redis:bookworm",
            Kind::Postgres => "idempotency-test/postgres:bookworm",
            Kind::DynamoDb => "idempotency-test/dynamodb:bookworm",
            Kind::MariaDb => "idempotency-test/mariadb:bookworm",
            // The baked moto image serves SQS too, with another command (see sqs.rs).
            Kind::Sqs => "idempotency-test/dynamodb:bookworm",
            Kind::RabbitMq => "idempotency-test/rabbitmq:bookworm",
        }
    }

    pub(crate) fn external_variable(self) -> &'static str {
        match self {
            Kind::Redis => "IDEMPOTENCY_TEST_REDIS_URL",
            Kind::Postgres => "IDEMPOTENCY_TEST_POSTGRES_URL",
            Kind::DynamoDb => "IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT",
            Kind::MariaDb => "IDEMPOTENCY_TEST_MARIADB_URL",
            Kind::Sqs => "IDEMPOTENCY_TEST_SQS_ENDPOINT",
            Kind::RabbitMq => "IDEMPOTENCY_TEST_RABBITMQ_URL",
        }
    }

    pub(crate) fn external_example(self) -> &'static str {
        match self {
            Kind::Redis => "redis://127.0.0.1:6379",
            Kind::Postgres => "postgres://postgres:postgres@127.0.0.1:5432/postgres",
            Kind::DynamoDb => "http://127.0.0.1:8000",
            Kind::MariaDb => "mysql://root:mariadb@127.0.0.1:3306/idempotency",
            Kind::Sqs => "http://127.0.0.1:5000",
            Kind::RabbitMq => "amqp://guest:guest@127.0.0.1:5672/%2f",
        }
    }

    pub(crate) fn container_port(self) -> u16 {
        match self {
            Kind::Redis => 6379,
            Kind::Postgres => 5432,
            Kind::DynamoDb => 8000,
            Kind::MariaDb => 3306,
            Kind::Sqs => 5000,
            Kind::RabbitMq => 5672,
        }
    }

    /// The image to start: `IDEMPOTENCY_TEST_<KIND>_IMAGE`; else the official
    /// one when the engine has it; else the locally baked one
    /// (`scripts/bake-images.sh`) when the engine has that; else the official one,
    /// to be pulled. So plain `cargo test` after baking needs no variable, and a
    /// machine with a registry keeps the official images.
    pub(crate) fn image(self) -> ImageRef {
        match std::env::var(self.image_variable()) {
            Ok(value) if !value.trim().is_empty() => ImageRef::parse(value.trim()),
            _ => ImageRef::parse(self.local_default()),
        }
    }

    /// The official image, or the baked one when only that is present (asked
    /// once per process).
    fn local_default(self) -> &'static str {
        static CHOSEN: [std::sync::OnceLock<&'static str>; Kind::COUNT] =
            [const { std::sync::OnceLock::new() }; Kind::COUNT];
        CHOSEN[self as usize].get_or_init(|| {
            if !image_present(self.default_image()) && image_present(self.baked_image()) {
                self.baked_image()
            } else {
                self.default_image()
            }
        })
    }

    /// The value of the variable naming an existing server, if set.
    pub(crate) fn external(self) -> Option<String> {
        match std::env::var(self.external_variable()) {
            Ok(value) if !value.trim().is_empty() => Some(value.trim().to_owned()),
            _ => None,
        }
    }
}

/// Whether the local Docker engine has `image` (no pull is attempted).
fn image_present(image: &str) -> bool {
    std::process::Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", image])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// `name[:tag]`, the tag defaulting to `latest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImageRef {
    pub(crate) name: String,
    pub(crate) tag: String,
}

impl ImageRef {
    pub(crate) fn parse(value: &str) -> ImageRef {
        // A colon after the last slash separates the tag; one before it belongs
        // to a registry host (`localhost:5000/redis`).
        match value.rsplit_once(':') {
            Some((name, tag)) if !tag.contains('/') && !name.is_empty() && !tag.is_empty() => {
                ImageRef {
                    name: name.to_owned(),
                    tag: tag.to_owned(),
                }
            }
            _ => ImageRef {
                name: value.to_owned(),
                tag: "latest".to_owned(),
            },
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.tag)
    }
}

/// Where a server handed out by the harness comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Origin {
    /// A container the harness started with testcontainers.
    Container {
        /// The image, `name:tag`.
        image: String,
        /// The container's name.
        name: String,
        /// The container's id.
        id: String,
    },
    /// An existing server named by an environment variable.
    External {
        /// The variable, e.g. `IDEMPOTENCY_TEST_REDIS_URL`.
        variable: &'static str,
    },
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Container { image, name, id } => {
                let short = id.get(..12).unwrap_or(id);
                write!(f, "container {name} ({short}) from image {image}")
            }
            Origin::External { variable } => write!(f, "external server from {variable}"),
        }
    }
}

// ---------------------------------------------------------------------------
// The harness runtime

fn runtime() -> Result<&'static tokio::runtime::Runtime, HarnessError> {
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("idempotency-harness")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| HarnessError::operation("building the harness runtime", e))
}

/// Runs `future` on the harness runtime and waits for it from wherever we are.
pub(crate) async fn on_harness<T, F>(future: F) -> Result<T, HarnessError>
where
    F: Future<Output = Result<T, HarnessError>> + Send + 'static,
    T: Send + 'static,
{
    runtime()?
        .spawn(future)
        .await
        .map_err(|e| HarnessError::operation("harness task", e))?
}

/// Spawns a background task (e.g. a database connection) on the harness runtime.
pub(crate) fn spawn_on_harness<F>(future: F) -> Result<(), HarnessError>
where
    F: Future<Output = ()> + Send + 'static,
{
    drop(runtime()?.spawn(future));
    Ok(())
}

// ---------------------------------------------------------------------------
// Who we are (labels)

struct Identity {
    session: String,
    pid: u32,
    pid_start: String,
    /// Boot id and pid namespace: pids are only comparable when both match.
    host: String,
}

fn identity() -> &'static Identity {
    static IDENTITY: OnceLock<Identity> = OnceLock::new();
    IDENTITY.get_or_init(|| {
        let pid = std::process::id();
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        let pid_ns = std::fs::read_link("/proc/self/ns/pid")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let host = if boot.is_empty() || pid_ns.is_empty() {
            String::new()
        } else {
            format!("{boot}/{pid_ns}")
        };
        Identity {
            session: format!("{:016x}", rand::random::<u64>()),
            pid,
            pid_start: process_start(pid).unwrap_or_default(),
            host,
        }
    })
}

/// The start time of a process (field 22 of `/proc/<pid>/stat`), which tells a
/// live owner from a recycled pid.
fn process_start(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = stat.get(stat.rfind(')')? + 1..)?;
    after_name.split_whitespace().nth(19).map(str::to_owned)
}

// ---------------------------------------------------------------------------
// Docker: reachability, watchdog, orphan sweep

/// Checks once per process that Docker answers; the first success also starts
/// the exit watchdog and sweeps orphans of dead test processes.
async fn docker_ready() -> Result<(), String> {
    static READY: tokio::sync::OnceCell<Result<(), String>> = tokio::sync::OnceCell::const_new();
    READY
        .get_or_init(|| async {
            let host = std::env::var("DOCKER_HOST")
                .unwrap_or_else(|_| "unix:///var/run/docker.sock".to_owned());
            let docker = testcontainers::core::client::docker_client_instance()
                .await
                .map_err(|e| format!("{e} (DOCKER_HOST={host})"))?;
            docker
                .ping()
                .await
                .map_err(|e| format!("{e} (DOCKER_HOST={host})"))?;
            start_watchdog();
            reap_orphans(&docker).await;
            Ok(())
        })
        .await
        .clone()
}

const WATCHDOG_SCRIPT: &str = r#"cat >/dev/null 2>&1
ids=$(docker ps -aq --filter "label=org.idempotency-rs.session=$1" 2>/dev/null)
if [ -n "$ids" ]; then docker rm -fv $ids >/dev/null 2>&1; fi"#;

fn start_watchdog() {
    static WATCHDOG: OnceLock<Option<Mutex<ChildStdin>>> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        if std::env::var("TESTCONTAINERS_COMMAND").is_ok_and(|v| v == "keep") {
            notice(format_args!(
                "TESTCONTAINERS_COMMAND=keep: containers are kept after the tests"
            ));
            return None;
        }
        if !on_path("docker") || !on_path("sh") {
            notice(format_args!(
                "no `docker` CLI on PATH: this process's containers are removed \
                 by the next test process instead of at exit"
            ));
            return None;
        }
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(WATCHDOG_SCRIPT)
            .arg("idempotency-harness-watchdog")
            .arg(&identity().session)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            // Its own process group: Ctrl-C on the test run must not kill it first.
            command.process_group(0);
        }
        match command.spawn() {
            Ok(mut child) => child.stdin.take().map(Mutex::new),
            Err(e) => {
                notice(format_args!("cannot start the clean-up watchdog: {e}"));
                None
            }
        }
    });
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// Removes containers of earlier test processes on this machine whose owner is gone.
async fn reap_orphans(docker: &Docker) {
    let me = identity();
    if me.host.is_empty() {
        return;
    }
    let filters = HashMap::from([(
        "label".to_owned(),
        vec![format!("{LABEL_HOST}={}", me.host)],
    )]);
    let options = ListContainersOptionsBuilder::new()
        .all(true)
        .filters(&filters)
        .build();
    let Ok(containers) = docker.list_containers(Some(options)).await else {
        return;
    };
    for container in containers {
        let labels = container.labels.unwrap_or_default();
        let Some(pid) = labels.get(LABEL_PID).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let started = labels.get(LABEL_PID_START).cloned().unwrap_or_default();
        if process_start(pid).is_some_and(|s| s == started) {
            continue; // its test process is still running
        }
        if let Some(id) = container.id {
            let options = RemoveContainerOptionsBuilder::new()
                .force(true)
                .v(true)
                .build();
            if docker.remove_container(&id, Some(options)).await.is_ok() {
                let short = id.get(..12).unwrap_or(&id);
                notice(format_args!(
                    "removed container {short} left by dead test process {pid}"
                ));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Starting containers

/// What to start besides the kind's defaults.
#[derive(Debug, Default)]
pub(crate) struct StartOptions {
    pub(crate) env: Vec<(&'static str, String)>,
    /// Replaces the image's entrypoint (its command is then `cmd`).
    pub(crate) entrypoint: Option<String>,
    pub(crate) cmd: Vec<String>,
    /// A fixed host port (dedicated containers keep it across restarts);
    /// `None` lets Docker pick one.
    pub(crate) host_port: Option<u16>,
    pub(crate) dedicated: bool,
    /// Run in the host's network namespace (Redis Cluster nodes, which must
    /// announce addresses the host can reach); the server then has to bind
    /// `127.0.0.1:host_port` itself.
    pub(crate) host_network: bool,
    /// Files to put in the container before it starts: absolute path and
    /// contents (mode 0644).
    pub(crate) files: Vec<(String, Vec<u8>)>,
}

pub(crate) struct Started {
    pub(crate) container: ContainerAsync<GenericImage>,
    pub(crate) port: u16,
    pub(crate) origin: Origin,
}

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// Starts a container of `kind` (on the harness runtime; call through [`on_harness`]).
pub(crate) async fn start_container(
    kind: Kind,
    options: StartOptions,
) -> Result<Started, HarnessError> {
    docker_ready()
        .await
        .map_err(|reason| HarnessError::docker_unavailable(kind, reason))?;
    let image = kind.image();
    let me = identity();
    let name = format!(
        "idempotency-{}-{}-{}",
        kind.name(),
        me.session.get(..8).unwrap_or(&me.session),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    );
    let container_port = kind.container_port();
    let port_key = format!("{container_port}/tcp");
    let binding = options.host_port.map(|p| p.to_string()).unwrap_or_default();

    let role = if options.dedicated {
        "dedicated"
    } else {
        "shared"
    };
    let mut generic = GenericImage::new(image.name.clone(), image.tag.clone());
    if !options.host_network {
        generic = generic.with_exposed_port(container_port.tcp());
    }
    if let Some(entrypoint) = &options.entrypoint {
        generic = generic.with_entrypoint(entrypoint);
    }
    let mut request = generic
        .with_container_name(name.clone())
        .with_label(LABEL_HARNESS, "1")
        .with_label(LABEL_SESSION, me.session.clone())
        .with_label(LABEL_PID, me.pid.to_string())
        .with_label(LABEL_PID_START, me.pid_start.clone())
        .with_label(LABEL_HOST, me.host.clone())
        .with_label(LABEL_KIND, kind.name())
        .with_label(LABEL_ROLE, role)
        .with_startup_timeout(Duration::from_secs(120));
    request = if options.host_network {
        request.with_network("host")
    } else {
        // Published on the loopback interface only, never on 0.0.0.0.
        request.with_host_config_modifier(move |config: &mut HostConfig| {
            config.publish_all_ports = Some(false);
            config.port_bindings = Some(HashMap::from([(
                port_key.clone(),
                Some(vec![PortBinding {
                    host_ip: Some("127.0.0.1".to_owned()),
                    host_port: Some(binding.clone()),
                }]),
            )]));
        })
    };
    if let Ok(run) = std::env::var("IDEMPOTENCY_TEST_RUN_ID") {
        request = request.with_label(LABEL_RUN, run);
    }
    for (key, value) in options.env {
        request = request.with_env_var(key, value);
    }
    if !options.cmd.is_empty() {
        request = request.with_cmd(options.cmd);
    }
    for (path, contents) in options.files {
        request = request.with_copy_to(CopyTargetOptions::new(path).with_mode(0o644), contents);
    }

    let container = request.start().await.map_err(|e| match e {
        TestcontainersError::Client(ClientError::PullImage { err, .. }) => {
            HarnessError::ImageUnavailable {
                kind: kind.name(),
                image: image.to_string(),
                reason: err.to_string(),
            }
        }
        other => HarnessError::Container {
            kind: kind.name(),
            image: image.to_string(),
            reason: other.to_string(),
        },
    })?;
    let mapped = match options.host_port {
        Some(port) if options.host_network => Ok(port),
        _ => container.get_host_port_ipv4(container_port.tcp()).await,
    };
    let port = match mapped {
        Ok(port) => port,
        Err(e) => {
            let _ = container.rm().await;
            return Err(HarnessError::Container {
                kind: kind.name(),
                image: image.to_string(),
                reason: format!("no host port for {container_port}/tcp: {e}"),
            });
        }
    };
    let origin = Origin::Container {
        image: image.to_string(),
        name,
        id: container.id().to_owned(),
    };
    Ok(Started {
        container,
        port,
        origin,
    })
}

/// The last lines a container printed, for error messages.
pub(crate) async fn container_logs(container: &ContainerAsync<GenericImage>) -> String {
    let mut out = Vec::new();
    if let Ok(stdout) = container.stdout_to_vec().await {
        out.extend(stdout);
    }
    if let Ok(stderr) = container.stderr_to_vec().await {
        out.extend(stderr);
    }
    let text = String::from_utf8_lossy(&out);
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(20)..].join("\n    ");
    if tail.is_empty() {
        "(no output)".to_owned()
    } else {
        format!("\n    {tail}")
    }
}

/// Keeps a shared container for the rest of the process (see the module docs
/// for how it is removed at exit).
pub(crate) fn keep_for_process(container: ContainerAsync<GenericImage>) {
    static KEPT: Mutex<Vec<ContainerAsync<GenericImage>>> = Mutex::new(Vec::new());
    match KEPT.lock() {
        Ok(mut kept) => kept.push(container),
        Err(poisoned) => poisoned.into_inner().push(container),
    }
}

/// Writes a line of the harness to the process's stderr directly: unlike
/// `eprintln!`, this is not captured by the test harness, so which images and
/// ports the tests use shows up in every `cargo test` output.
pub(crate) fn notice(args: fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "[idempotency-harness] {args}");
}

pub(crate) fn announce(kind: Kind, role: &str, origin: &Origin, address: &str, took: Duration) {
    notice(format_args!(
        "{} ({role}): {origin}, listening on {address}, ready after {:.1}s",
        kind.name(),
        took.as_secs_f64()
    ));
}

// ---------------------------------------------------------------------------
// Readiness

/// A readiness probe: one attempt to talk to the server with its real client.
pub(crate) type Probe = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

pub(crate) fn ready_timeout() -> Duration {
    std::env::var("IDEMPOTENCY_TEST_READY_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_READY_TIMEOUT)
}

/// Retries `probe` until it succeeds or `timeout` has passed.
pub(crate) async fn wait_ready(
    kind: Kind,
    target: &str,
    timeout: Duration,
    probe: &Probe,
) -> Result<(), HarnessError> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(50);
    loop {
        let last_error = match tokio::time::timeout(Duration::from_secs(10), probe()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => "no answer within 10s".to_owned(),
        };
        if started.elapsed() >= timeout {
            return Err(HarnessError::NotReady {
                kind: kind.name(),
                target: target.to_owned(),
                waited: started.elapsed(),
                last_error,
            });
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(500));
    }
}

/// Starts a container and waits until `probe(port)` succeeds; a container that
/// never gets ready is removed and its output is part of the error.
pub(crate) async fn start_ready(
    kind: Kind,
    options: StartOptions,
    probe_for: impl Fn(u16) -> Probe,
) -> Result<(Started, Probe), HarnessError> {
    let started = start_container(kind, options).await?;
    let probe = probe_for(started.port);
    let target = format!("127.0.0.1:{}", started.port);
    if let Err(e) = wait_ready(kind, &target, ready_timeout(), &probe).await {
        let logs = container_logs(&started.container).await;
        let _ = started.container.rm().await;
        return Err(match e {
            HarnessError::NotReady {
                kind,
                target,
                waited,
                last_error,
            } => HarnessError::NotReady {
                kind,
                target,
                waited,
                last_error: format!("{last_error}; container output:{logs}"),
            },
            other => other,
        });
    }
    Ok((started, probe))
}

/// A free port on 127.0.0.1 (free now; Docker binds it a moment later).
pub(crate) fn free_port() -> Result<u16, HarnessError> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|e| HarnessError::operation("finding a free port on 127.0.0.1", e))
}

/// Starts a dedicated container on a fixed free port, retrying with another
/// port if someone else took it in between.
pub(crate) async fn start_dedicated(
    kind: Kind,
    env: Vec<(&'static str, String)>,
    cmd: Vec<String>,
    probe_for: impl Fn(u16) -> Probe,
) -> Result<(Started, Probe), HarnessError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let options = StartOptions {
            env: env.clone(),
            entrypoint: None,
            cmd: cmd.clone(),
            host_port: Some(free_port()?),
            dedicated: true,
            host_network: false,
            files: Vec::new(),
        };
        match start_ready(kind, options, &probe_for).await {
            Err(HarnessError::Container { reason, .. })
                if attempt < 5
                    && (reason.contains("port is already allocated")
                        || reason.contains("address already in use")) => {}
            other => return other,
        }
    }
}

// ---------------------------------------------------------------------------
// Dedicated containers

/// A server in a container of its own, owned by one test, that the test may
/// stop and start (outage tests). It keeps its host port across restarts, so
/// clients reconnect to the same URL. Dereferences to the server's connection
/// details. The container is removed when this handle drops (or by
/// [`remove`](Dedicated::remove)).
pub struct Dedicated<S> {
    server: S,
    inner: Option<Arc<DedicatedInner>>,
}

struct DedicatedInner {
    kind: Kind,
    port: u16,
    container: ContainerAsync<GenericImage>,
    probe: Probe,
}

impl<S> Dedicated<S> {
    pub(crate) fn new(server: S, kind: Kind, started: Started, probe: Probe) -> Self {
        Dedicated {
            server,
            inner: Some(Arc::new(DedicatedInner {
                kind,
                port: started.port,
                container: started.container,
                probe,
            })),
        }
    }

    fn inner(&self) -> Result<Arc<DedicatedInner>, HarnessError> {
        self.inner
            .clone()
            .ok_or_else(|| HarnessError::operation("dedicated container", "already removed"))
    }

    /// The server's connection details.
    pub fn server(&self) -> &S {
        &self.server
    }

    /// Stops the container (`docker stop`): the server is unreachable until
    /// [`start`](Dedicated::start).
    pub async fn stop(&self) -> Result<(), HarnessError> {
        let inner = self.inner()?;
        on_harness(async move {
            inner
                .container
                .stop_with_timeout(Some(10))
                .await
                .map_err(|e| {
                    HarnessError::operation(
                        format!("stopping the {} container", inner.kind.name()),
                        e,
                    )
                })
        })
        .await
    }

    /// Starts the stopped container again and waits until the server answers
    /// its client, on the same host port as before.
    pub async fn start(&self) -> Result<(), HarnessError> {
        let inner = self.inner()?;
        on_harness(async move {
            inner.container.start().await.map_err(|e| {
                HarnessError::operation(format!("starting the {} container", inner.kind.name()), e)
            })?;
            let target = format!("127.0.0.1:{}", inner.port);
            wait_ready(inner.kind, &target, ready_timeout(), &inner.probe).await
        })
        .await
    }

    /// Freezes the server's processes (`docker pause`): connections stay open,
    /// nothing is answered, until [`unpause`](Dedicated::unpause) — a server
    /// stalled by a long GC, swapping, or a frozen VM.
    pub async fn pause(&self) -> Result<(), HarnessError> {
        let inner = self.inner()?;
        on_harness(async move {
            inner.container.pause().await.map_err(|e| {
                HarnessError::operation(format!("pausing the {} container", inner.kind.name()), e)
            })
        })
        .await
    }

    /// Resumes a paused server.
    pub async fn unpause(&self) -> Result<(), HarnessError> {
        let inner = self.inner()?;
        on_harness(async move {
            inner.container.unpause().await.map_err(|e| {
                HarnessError::operation(format!("unpausing the {} container", inner.kind.name()), e)
            })
        })
        .await
    }

    /// [`stop`](Dedicated::stop), then [`start`](Dedicated::start).
    pub async fn restart(&self) -> Result<(), HarnessError> {
        self.stop().await?;
        self.start().await
    }

    /// Removes the container now (dropping the handle does the same).
    pub async fn remove(mut self) -> Result<(), HarnessError> {
        match self.inner.take() {
            Some(inner) => on_harness(remove_inner(inner)).await,
            None => Ok(()),
        }
    }
}

async fn remove_inner(inner: Arc<DedicatedInner>) -> Result<(), HarnessError> {
    match Arc::try_unwrap(inner) {
        Ok(inner) => inner.container.rm().await.map_err(|e| {
            HarnessError::operation(format!("removing the {} container", inner.kind.name()), e)
        }),
        // Still borrowed by an abandoned stop/start: the last owner's drop removes it.
        Err(_shared) => Ok(()),
    }
}

impl<S> Drop for Dedicated<S> {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let Ok(runtime) = runtime() else {
            return;
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        drop(runtime.spawn(async move {
            let _ = remove_inner(inner).await;
            let _ = done_tx.send(());
        }));
        // Wait (bounded) so the container is gone when the test ends.
        let _ = done_rx.recv_timeout(Duration::from_secs(30));
    }
}

impl<S> Deref for Dedicated<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.server
    }
}

impl<S: fmt::Debug> fmt::Debug for Dedicated<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dedicated")
            .field("server", &self.server)
            .field(
                "container",
                &self
                    .inner
                    .as_ref()
                    .map(|inner| inner.container.id().to_owned()),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references_parse() {
        assert_eq!(
            ImageRef::parse("redis:7"),
            ImageRef {
                name: "redis".into(),
                tag: "7".into()
            }
        );
        assert_eq!(ImageRef::parse("redis").tag, "latest");
        assert_eq!(
            ImageRef::parse("localhost:5000/redis"),
            ImageRef {
                name: "localhost:5000/redis".into(),
                tag: "latest".into()
            }
        );
        assert_eq!(
            ImageRef::parse("localhost:5000/idempotency-test/redis:bookworm").to_string(),
            "localhost:5000/idempotency-test/redis:bookworm"
        );
    }

    #[test]
    fn own_process_start_is_readable() {
        if cfg!(target_os = "linux") {
            assert!(process_start(std::process::id()).is_some());
        }
    }
}
