//! PostgreSQL: the shared server, dedicated servers, a schema per test.

use std::sync::Arc;
use std::time::Instant;

use tokio_postgres::NoTls;

use super::docker::{
    announce, keep_for_process, on_harness, spawn_on_harness, start_dedicated, start_ready,
    Dedicated, Kind, Origin, Probe, StartOptions,
};
use super::error::HarnessError;
use super::external::{tcp_probe, External};

/// The password the harness gives the `postgres` user of its containers.
const PASSWORD: &str = "postgres";

/// Connection details of a PostgreSQL server handed out by the harness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresServer {
    url: String,
    host: String,
    port: u16,
    origin: Origin,
}

/// The PostgreSQL server shared by every test of this test binary.
///
/// Started on first use from `IDEMPOTENCY_TEST_POSTGRES_IMAGE` (default
/// `postgres:16`) with testcontainers, or taken from
/// `IDEMPOTENCY_TEST_POSTGRES_URL`. Isolate tests with
/// [`create_schema`](PostgresServer::create_schema).
///
/// # Errors
///
/// [`HarnessError`] saying how to provide a server when there is neither Docker
/// nor `IDEMPOTENCY_TEST_POSTGRES_URL`, or when the server does not answer.
pub async fn postgres() -> Result<PostgresServer, HarnessError> {
    static SHARED: tokio::sync::OnceCell<Result<PostgresServer, HarnessError>> =
        tokio::sync::OnceCell::const_new();
    on_harness(async {
        SHARED
            .get_or_init(|| async {
                match External::from_env(Kind::Postgres)? {
                    Some(external) => {
                        let server = PostgresServer {
                            url: external.value.clone(),
                            host: external.host.clone(),
                            port: external.port,
                            origin: external.origin(),
                        };
                        let probe = if external.wants_tls() {
                            tcp_probe(external.host.clone(), external.port)
                        } else {
                            external_probe(external.value.clone())
                        };
                        external.wait_ready(probe).await?;
                        Ok(server)
                    }
                    None => {
                        let begun = Instant::now();
                        let (started, _) =
                            start_ready(Kind::Postgres, container_options(), probe).await?;
                        let server = PostgresServer::local(started.port, started.origin.clone());
                        announce(
                            Kind::Postgres,
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
/// traded for speed (throw-away test data).
fn container_options() -> StartOptions {
    StartOptions {
        env: vec![("POSTGRES_PASSWORD", PASSWORD.to_owned())],
        cmd: server_args(),
        ..StartOptions::default()
    }
}

fn server_args() -> Vec<String> {
    [
        "postgres",
        "-c",
        "fsync=off",
        "-c",
        "synchronous_commit=off",
        "-c",
        "full_page_writes=off",
        "-c",
        "max_connections=200",
    ]
    .map(str::to_owned)
    .to_vec()
}

fn local_url(port: u16) -> String {
    format!("postgres://postgres:{PASSWORD}@127.0.0.1:{port}/postgres")
}

fn probe(port: u16) -> Probe {
    let url = local_url(port);
    Arc::new(move || {
        let url = url.clone();
        Box::pin(async move {
            let (client, connection) = tokio_postgres::connect(&url, NoTls)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let driver = tokio::spawn(connection);
            let result = client.query_one("SELECT 1", &[]).await;
            drop(client);
            let _ = driver.await;
            let row = result.map_err(|e| format!("SELECT 1: {e}"))?;
            match row.try_get::<_, i32>(0) {
                Ok(1) => Ok(()),
                other => Err(format!("SELECT 1 returned {other:?}")),
            }
        })
    })
}

/// A server that answers at all is up, also when it refuses our credentials
/// (the backend's tests then report that error).
fn external_probe(url: String) -> Probe {
    Arc::new(move || {
        let url = url.clone();
        Box::pin(async move {
            match tokio_postgres::connect(&url, NoTls).await {
                Ok((client, connection)) => {
                    drop(client);
                    let _ = connection.await;
                    Ok(())
                }
                Err(e) if e.as_db_error().is_some() => Ok(()),
                Err(e) => Err(format!("connect: {e}")),
            }
        })
    })
}

impl PostgresServer {
    fn local(port: u16, origin: Origin) -> Self {
        PostgresServer {
            url: local_url(port),
            host: "127.0.0.1".to_owned(),
            port,
            origin,
        }
    }

    /// A PostgreSQL server in a container of its own (always a container), for
    /// tests that stop and restart it.
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable or the server does not answer.
    pub async fn dedicated() -> Result<Dedicated<PostgresServer>, HarnessError> {
        on_harness(async {
            let begun = Instant::now();
            let options = container_options();
            let (started, probe) =
                start_dedicated(Kind::Postgres, options.env, options.cmd, probe).await?;
            let server = PostgresServer::local(started.port, started.origin.clone());
            announce(
                Kind::Postgres,
                "dedicated",
                &server.origin,
                &server.url,
                begun.elapsed(),
            );
            Ok(Dedicated::new(server, Kind::Postgres, started, probe))
        })
        .await
    }

    /// `postgres://postgres:postgres@127.0.0.1:PORT/postgres` for a container,
    /// or the value of `IDEMPOTENCY_TEST_POSTGRES_URL`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// [`url`](Self::url) with `schema` as the search path (the `options`
    /// connection parameter, understood by libpq, tokio-postgres and sqlx).
    pub fn url_with_schema(&self, schema: &str) -> String {
        let separator = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{separator}options=-csearch_path%3D{schema}", self.url)
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

    /// A connected client (no TLS). Its connection is driven by the harness, so
    /// the client works from any runtime and outlives the test's runtime.
    ///
    /// # Errors
    ///
    /// [`HarnessError::Operation`] when connecting fails.
    pub async fn client(&self) -> Result<tokio_postgres::Client, HarnessError> {
        let url = self.url.clone();
        on_harness(async move {
            let (client, connection) = tokio_postgres::connect(&url, NoTls)
                .await
                .map_err(|e| HarnessError::operation("connecting to PostgreSQL", e))?;
            spawn_on_harness(async move {
                let _ = connection.await;
            })?;
            Ok(client)
        })
        .await
    }

    /// Creates a fresh, empty schema with a random name (`t_…`) and returns the
    /// name: one per test keeps tests apart on the shared server.
    ///
    /// # Errors
    ///
    /// [`HarnessError::Operation`] when the server refuses.
    pub async fn create_schema(&self) -> Result<String, HarnessError> {
        let schema = format!("t_{:016x}", rand::random::<u64>());
        self.client()
            .await?
            .batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
            .await
            .map_err(|e| HarnessError::operation(format!("CREATE SCHEMA {schema}"), e))?;
        Ok(schema)
    }

    /// Drops a schema and everything in it (a courtesy for external servers;
    /// containers are thrown away anyway).
    ///
    /// # Errors
    ///
    /// [`HarnessError::Operation`] when the server refuses.
    pub async fn drop_schema(&self, schema: &str) -> Result<(), HarnessError> {
        let quoted = schema.replace('"', "\"\"");
        self.client()
            .await?
            .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{quoted}\" CASCADE"))
            .await
            .map_err(|e| HarnessError::operation(format!("DROP SCHEMA {schema}"), e))
    }
}

/// Re-exported so tests use the same version as the harness.
pub use tokio_postgres;
