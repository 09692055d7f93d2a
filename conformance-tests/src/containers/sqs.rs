//! Amazon SQS-compatible server (moto): the shared server and queue names.
//!
//! # Which command runs
//!
//! - The official `motoserver/moto` image (the default where a registry is
//!   reachable) already runs `moto_server -H 0.0.0.0` on port 5000: it is
//!   started as it is.
//! - Any other image (the baked `idempotency-test/dynamodb:bookworm`, the
//!   fallback without a registry) is taken to have the baked layout: moto in
//!   `/opt/moto`. Its default entrypoint serialises every request (right for
//!   DynamoDB's conditional writes, wrong for SQS: one long-polling
//!   `ReceiveMessage` would stall every other client), so the harness replaces
//!   it with moto's own threaded server, `/opt/moto/bin/moto_server -H 0.0.0.0
//!   -p 5000`.
//!
//! Both serve on container port 5000; readiness is checked with a real SQS
//! call (`ListQueues`, JSON protocol).

use std::sync::Arc;
use std::time::Instant;

use super::docker::{
    announce, keep_for_process, on_harness, start_ready, Kind, Origin, Probe, StartOptions,
};
use super::dynamodb::json_call;
use super::error::HarnessError;
use super::external::{tcp_probe, External};

/// Region the harness hands out (moto keeps one set of queues per region).
const REGION: &str = "us-east-1";
/// moto accepts any credentials; these are the ones the harness hands out.
const ACCESS_KEY_ID: &str = "test";
const SECRET_ACCESS_KEY: &str = "test";
/// moto's threaded server in the baked image.
const BAKED_ENTRYPOINT: &str = "/opt/moto/bin/moto_server";

/// Connection details of an SQS-compatible server handed out by the harness.
///
/// Use [`endpoint`](Self::endpoint), [`region`](Self::region) and the dummy
/// credentials with any SQS client; isolate tests with
/// [`unique_queue_name`](Self::unique_queue_name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqsServer {
    endpoint: String,
    origin: Origin,
}

/// The SQS-compatible server shared by every test of this test binary.
///
/// Started on first use from `IDEMPOTENCY_TEST_SQS_IMAGE` (default
/// `motoserver/moto:latest`, else the baked `idempotency-test/dynamodb:bookworm`
/// with moto's threaded server; see the module docs) with testcontainers, or
/// taken from `IDEMPOTENCY_TEST_SQS_ENDPOINT` (e.g. `http://127.0.0.1:5000`).
///
/// # Errors
///
/// [`HarnessError`] saying how to provide a server when there is neither Docker
/// nor `IDEMPOTENCY_TEST_SQS_ENDPOINT`, or when the server does not answer.
pub async fn sqs() -> Result<SqsServer, HarnessError> {
    static SHARED: tokio::sync::OnceCell<Result<SqsServer, HarnessError>> =
        tokio::sync::OnceCell::const_new();
    on_harness(async {
        SHARED
            .get_or_init(|| async {
                match External::from_env(Kind::Sqs)? {
                    Some(external) => {
                        let server = SqsServer {
                            endpoint: external.value.trim_end_matches('/').to_owned(),
                            origin: external.origin(),
                        };
                        let probe = if external.wants_tls() {
                            tcp_probe(external.host.clone(), external.port)
                        } else {
                            list_queues_probe(external.host.clone(), external.port)
                        };
                        external.wait_ready(probe).await?;
                        Ok(server)
                    }
                    None => {
                        let begun = Instant::now();
                        let (started, _) = start_ready(Kind::Sqs, container_options(), |port| {
                            list_queues_probe("127.0.0.1".to_owned(), port)
                        })
                        .await?;
                        let server = SqsServer {
                            endpoint: format!("http://127.0.0.1:{}", started.port),
                            origin: started.origin.clone(),
                        };
                        announce(
                            Kind::Sqs,
                            "shared",
                            &server.origin,
                            &server.endpoint,
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

/// The official image as it is; any other with moto's threaded server.
fn container_options() -> StartOptions {
    let image = Kind::Sqs.image();
    if image.name.ends_with("motoserver/moto") {
        return StartOptions::default();
    }
    let port = Kind::Sqs.container_port().to_string();
    StartOptions {
        entrypoint: Some(BAKED_ENTRYPOINT.to_owned()),
        cmd: ["-H", "0.0.0.0", "-p", port.as_str()]
            .map(str::to_owned)
            .to_vec(),
        ..StartOptions::default()
    }
}

/// `ListQueues` answers 200 once moto serves SQS.
fn list_queues_probe(host: String, port: u16) -> Probe {
    Arc::new(move || {
        let host = host.clone();
        Box::pin(async move {
            let response =
                json_call(&host, port, REGION, "sqs", "AmazonSQS.ListQueues", "{}").await?;
            if response.status == 200 {
                Ok(())
            } else {
                Err(format!(
                    "ListQueues answered {}: {}",
                    response.status, response.body
                ))
            }
        })
    })
}

impl SqsServer {
    /// `http://127.0.0.1:PORT` for a container, or the value of
    /// `IDEMPOTENCY_TEST_SQS_ENDPOINT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The region to configure clients with (`us-east-1`).
    pub fn region(&self) -> &str {
        REGION
    }

    /// Dummy access key id (`test`).
    pub fn access_key_id(&self) -> &str {
        ACCESS_KEY_ID
    }

    /// Dummy secret access key (`test`).
    pub fn secret_access_key(&self) -> &str {
        SECRET_ACCESS_KEY
    }

    /// Where the server comes from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// A fresh queue name, `<prefix>-<random>` (valid SQS queue name
    /// characters only; append `.fifo` for a FIFO queue); one per test keeps
    /// tests apart on the shared server.
    pub fn unique_queue_name(&self, prefix: &str) -> String {
        super::unique_namespace(prefix).replace('.', "_")
    }
}
