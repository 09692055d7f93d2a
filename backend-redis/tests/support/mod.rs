//! Dedicated `redis-server` processes for the tests that stop, restart, count or
//! cluster a server: bound to 127.0.0.1 on free ports, in temporary directories,
//! killed (and their directories removed) when the guard drops.
//!
//! The binaries are `redis-server` and `redis-cli` from `PATH` (Debian:
//! `apt-get install -y redis-server redis-tools`), or the paths in
//! `IDEMPOTENCY_TEST_REDIS_SERVER` / `IDEMPOTENCY_TEST_REDIS_CLI`.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn binary(env: &str, default: &str) -> String {
    std::env::var(env).unwrap_or_else(|_| default.to_owned())
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// Sends one inline command and returns the raw reply (enough for PING and
/// `CLUSTER INFO`).
fn raw_command(port: u16, command: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(format!("{command}\r\n").as_bytes()).ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    let n = stream.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One `redis-server` child process.
#[derive(Debug)]
pub struct RedisProcess {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

impl RedisProcess {
    /// Starts a server without persistence on a free port.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        let dir =
            std::env::temp_dir().join(format!("idempotency-redis-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        let mut process = RedisProcess {
            child: None,
            port: free_port(),
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        process.spawn();
        process
    }

    fn spawn(&mut self) {
        let server = binary("IDEMPOTENCY_TEST_REDIS_SERVER", "redis-server");
        let child = Command::new(&server)
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `{server}` ({e}); these tests need a local Redis server binary: \
                     `apt-get install -y redis-server redis-tools`, or set IDEMPOTENCY_TEST_REDIS_SERVER"
                )
            });
        self.child = Some(child);
        let port = self.port;
        wait_until(
            "redis-server to answer PING",
            Duration::from_secs(15),
            || raw_command(port, "PING").is_some_and(|r| r.starts_with("+PONG")),
        );
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL, like a crash) and waits until the port is closed.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let port = self.port;
        wait_until("redis-server to stop", Duration::from_secs(10), || {
            TcpStream::connect(("127.0.0.1", port)).is_err()
        });
    }

    /// Starts the server again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A three-master Redis Cluster of local processes.
#[derive(Debug)]
pub struct RedisCluster {
    pub nodes: Vec<RedisProcess>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<RedisProcess> = (0..3)
            .map(|_| {
                RedisProcess::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ])
            })
            .collect();
        let cli = binary("IDEMPOTENCY_TEST_REDIS_CLI", "redis-cli");
        let mut create = Command::new(&cli);
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let output = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run `{cli}` ({e}): `apt-get install -y redis-tools`, or set IDEMPOTENCY_TEST_REDIS_CLI")
            });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        for node in &nodes {
            let port = node.port;
            wait_until(
                "the cluster to be ok on every node",
                Duration::from_secs(30),
                || {
                    raw_command(port, "CLUSTER INFO")
                        .is_some_and(|r| r.contains("cluster_state:ok"))
                },
            );
        }
        RedisCluster { nodes }
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }
}

/// A `redis-server` with TLS on `tls_port` (plain port kept for readiness),
/// certificates from a throw-away CA made with the `openssl` CLI.
#[derive(Debug)]
pub struct TlsRedis {
    pub server: RedisProcess,
    pub tls_port: u16,
    pub ca_pem: Vec<u8>,
    dir: PathBuf,
}

impl TlsRedis {
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idempotency-redis-tls-{:016x}",
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        let openssl = binary("IDEMPOTENCY_TEST_OPENSSL", "openssl");
        let run = |args: &[&str]| {
            let out = Command::new(&openssl)
                .args(args)
                .current_dir(&dir)
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("cannot run `{openssl}` ({e}): install openssl, or set IDEMPOTENCY_TEST_OPENSSL"));
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=idempotency-test-ca",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ]);
        std::fs::write(
            dir.join("san.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .expect("write san.ext");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ]);
        let ca_pem = std::fs::read(dir.join("ca.crt")).expect("read ca.crt");
        let tls_port = free_port();
        let path = |f: &str| dir.join(f).to_string_lossy().into_owned();
        let (cert, key, ca) = (path("server.crt"), path("server.key"), path("ca.crt"));
        let port = tls_port.to_string();
        let server = RedisProcess::start_with(&[
            "--tls-port",
            &port,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "no",
        ]);
        TlsRedis {
            server,
            tls_port,
            ca_pem,
            dir,
        }
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
