//! MariaDB (or MySQL): the shared server, one database every test shares
//! (tests keep apart by namespace or by table).

use std::time::Instant;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::docker::{
    announce, keep_for_process, on_harness, start_dedicated, start_ready, Dedicated, Kind, Origin,
    Probe, StartOptions,
};
use super::error::HarnessError;
use super::external::External;

/// The password the harness gives `root` in its containers.
const PASSWORD: &str = "mariadb";
/// The database the container creates at first start.
const DATABASE: &str = "idempotency";

/// Connection details of a MariaDB or MySQL server handed out by the harness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MariaDbServer {
    url: String,
    host: String,
    port: u16,
    origin: Origin,
}

/// The MariaDB server shared by every test of this test binary.
///
/// Started on first use from `IDEMPOTENCY_TEST_MARIADB_IMAGE` (default
/// `mariadb:11`) with testcontainers, or taken from
/// `IDEMPOTENCY_TEST_MARIADB_URL` (a `mysql://` URL naming a database the
/// tests may create tables in; a MySQL server works too). Isolate tests by
/// namespace ([`unique_namespace`](super::unique_namespace)) or with a table
/// of their own.
///
/// # Errors
///
/// [`HarnessError`] saying how to provide a server when there is neither Docker
/// nor `IDEMPOTENCY_TEST_MARIADB_URL`, or when the server does not answer.
pub async fn mariadb() -> Result<MariaDbServer, HarnessError> {
    static SHARED: tokio::sync::OnceCell<Result<MariaDbServer, HarnessError>> =
        tokio::sync::OnceCell::const_new();
    on_harness(async {
        SHARED
            .get_or_init(|| async {
                match External::from_env(Kind::MariaDb)? {
                    Some(external) => {
                        let server = MariaDbServer {
                            url: external.value.clone(),
                            host: external.host.clone(),
                            port: external.port,
                            origin: external.origin(),
                        };
                        external
                            .wait_ready(greeting_probe(external.host.clone(), external.port))
                            .await?;
                        Ok(server)
                    }
                    None => {
                        let begun = Instant::now();
                        let (started, _) =
                            start_ready(Kind::MariaDb, container_options(), |port| {
                                greeting_probe("127.0.0.1".to_owned(), port)
                            })
                            .await?;
                        let server = MariaDbServer::local(started.port, started.origin.clone());
                        announce(
                            Kind::MariaDb,
                            "shared",
                            &server.origin,
                            &server.url,
                            begun.elapsed(),
                        );
                        keep_for_process(started.container);
                        Ok(server)
                    }
                }
            })
            .await
            .clone()
    })
    .await
}

/// Same environment for the official image and the baked one; durability is
/// traded for speed (throw-away test data: the redo log is flushed about once
/// a second instead of at every commit).
fn container_options() -> StartOptions {
    StartOptions {
        env: environment(),
        cmd: [
            "mariadbd",
            "--innodb-flush-log-at-trx-commit=0",
            "--sync-binlog=0",
            "--max-connections=500",
            "--innodb-buffer-pool-size=64M",
        ]
        .map(str::to_owned)
        .to_vec(),
        ..StartOptions::default()
    }
}

fn environment() -> Vec<(&'static str, String)> {
    vec![
        ("MARIADB_ROOT_PASSWORD", PASSWORD.to_owned()),
        ("MARIADB_DATABASE", DATABASE.to_owned()),
    ]
}

/// Ready when the server sends its handshake (protocol version 10), which it
/// does only once it accepts clients: the images initialise their data
/// directory with networking off. An error packet ("too many connections",
/// "host blocked") is not ready.
fn greeting_probe(host: String, port: u16) -> Probe {
    std::sync::Arc::new(move || {
        let host = host.clone();
        Box::pin(async move {
            let mut stream = TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|e| format!("connect {host}:{port}: {e}"))?;
            // 3-byte length, 1-byte sequence number, then the first payload byte.
            let mut head = [0u8; 5];
            stream
                .read_exact(&mut head)
                .await
                .map_err(|e| format!("reading the server's greeting: {e}"))?;
            match head[4] {
                10 => Ok(()),
                0xff => Err("the server answered with an error packet".to_owned()),
                other => Err(format!("unexpected greeting (protocol version {other})")),
            }
        })
    })
}

impl MariaDbServer {
    fn local(port: u16, origin: Origin) -> Self {
        MariaDbServer {
            url: format!("mysql://root:{PASSWORD}@127.0.0.1:{port}/{DATABASE}"),
            host: "127.0.0.1".to_owned(),
            port,
            origin,
        }
    }

    /// A MariaDB server in a container of its own (always a container), for
    /// tests that pause, stop and restart it. Unlike the shared server it keeps
    /// the server's default durability (every commit flushed), so what it
    /// acknowledged survives a restart.
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable or the server does not answer.
    pub async fn dedicated() -> Result<Dedicated<MariaDbServer>, HarnessError> {
        on_harness(async {
            let begun = Instant::now();
            let cmd = vec!["mariadbd".to_owned(), "--max-connections=500".to_owned()];
            let (started, probe) = start_dedicated(Kind::MariaDb, environment(), cmd, |port| {
                greeting_probe("127.0.0.1".to_owned(), port)
            })
            .await?;
            let server = MariaDbServer::local(started.port, started.origin.clone());
            announce(
                Kind::MariaDb,
                "dedicated",
                &server.origin,
                &server.url,
                begun.elapsed(),
            );
            Ok(Dedicated::new(server, Kind::MariaDb, started, probe))
        })
        .await
    }

    /// `mysql://root:mariadb@127.0.0.1:PORT/idempotency` for a container, or
    /// the value of `IDEMPOTENCY_TEST_MARIADB_URL`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// [`url`](Self::url) with query options added (`table=…`, timeouts).
    pub fn url_with(&self, options: &str) -> String {
        let separator = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{separator}{options}", self.url)
    }

    /// Host name or address.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where the server comes from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }
}
