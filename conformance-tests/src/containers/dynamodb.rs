//! DynamoDB-compatible server (`amazon/dynamodb-local`, or moto in the baked
//! image): the shared server, dedicated servers, table names, and a minimal
//! HTTP client for readiness and raw API calls (so the harness needs no AWS SDK).

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::docker::{
    announce, keep_for_process, on_harness, start_dedicated, start_ready, Dedicated, Kind, Origin,
    Probe, StartOptions,
};
use super::error::HarnessError;
use super::external::{tcp_probe, External};

/// Region the harness uses unless `IDEMPOTENCY_TEST_DYNAMODB_REGION` says otherwise.
const DEFAULT_REGION: &str = "us-east-1";
/// Emulators accept any credentials; these are the ones the harness hands out.
const ACCESS_KEY_ID: &str = "test";
const SECRET_ACCESS_KEY: &str = "test";

/// Connection details of a DynamoDB-compatible server handed out by the harness.
///
/// Use [`endpoint`](Self::endpoint), [`region`](Self::region) and the fixed
/// dummy credentials with any DynamoDB client; the emulators do not check
/// signatures. Isolate tests with [`unique_table_name`](Self::unique_table_name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamoDbServer {
    endpoint: String,
    host: String,
    port: u16,
    region: String,
    origin: Origin,
}

/// The DynamoDB-compatible server shared by every test of this test binary.
///
/// Started on first use from `IDEMPOTENCY_TEST_DYNAMODB_IMAGE` (default
/// `amazon/dynamodb-local:latest`, in memory, one database for all
/// credentials) with testcontainers, or taken from
/// `IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT`.
///
/// # Errors
///
/// [`HarnessError`] saying how to provide a server when there is neither Docker
/// nor `IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT`, or when the server does not answer.
pub async fn dynamodb() -> Result<DynamoDbServer, HarnessError> {
    static SHARED: tokio::sync::OnceCell<Result<DynamoDbServer, HarnessError>> =
        tokio::sync::OnceCell::const_new();
    on_harness(async {
        SHARED
            .get_or_init(|| async {
                match External::from_env(Kind::DynamoDb)? {
                    Some(external) => {
                        let server = DynamoDbServer {
                            endpoint: external.value.trim_end_matches('/').to_owned(),
                            host: external.host.clone(),
                            port: external.port,
                            region: region(),
                            origin: external.origin(),
                        };
                        let probe = if external.wants_tls() {
                            tcp_probe(external.host.clone(), external.port)
                        } else {
                            external_probe(external.host.clone(), external.port)
                        };
                        external.wait_ready(probe).await?;
                        Ok(server)
                    }
                    None => {
                        let begun = Instant::now();
                        let (started, _) =
                            start_ready(Kind::DynamoDb, container_options(), probe).await?;
                        let server = DynamoDbServer::local(started.port, started.origin.clone());
                        announce(
                            Kind::DynamoDb,
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

fn region() -> String {
    std::env::var("IDEMPOTENCY_TEST_DYNAMODB_REGION")
        .ok()
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_REGION.to_owned())
}

/// `amazon/dynamodb-local` keeps one database per access key and region unless
/// told `-sharedDb`; the baked moto image takes no arguments.
fn container_options() -> StartOptions {
    let image = Kind::DynamoDb.image();
    let cmd = if image.name.ends_with("dynamodb-local") {
        ["-jar", "DynamoDBLocal.jar", "-inMemory", "-sharedDb"]
            .map(str::to_owned)
            .to_vec()
    } else {
        Vec::new()
    };
    StartOptions {
        cmd,
        ..StartOptions::default()
    }
}

fn probe(port: u16) -> Probe {
    Arc::new(move || {
        Box::pin(async move {
            let response = call("127.0.0.1", port, DEFAULT_REGION, "ListTables", "{}").await?;
            if response.status == 200 && response.body.contains("TableNames") {
                Ok(())
            } else {
                Err(format!(
                    "ListTables answered {}: {}",
                    response.status, response.body
                ))
            }
        })
    })
}

/// Any HTTP answer to `ListTables` shows an external endpoint is up.
fn external_probe(host: String, port: u16) -> Probe {
    Arc::new(move || {
        let host = host.clone();
        Box::pin(async move {
            call(&host, port, &region(), "ListTables", "{}")
                .await
                .map(drop)
        })
    })
}

impl DynamoDbServer {
    fn local(port: u16, origin: Origin) -> Self {
        DynamoDbServer {
            endpoint: format!("http://127.0.0.1:{port}"),
            host: "127.0.0.1".to_owned(),
            port,
            region: region(),
            origin,
        }
    }

    /// A DynamoDB-compatible server in a container of its own (always a
    /// container), for tests that stop and restart it. Data does not survive a
    /// restart (both emulators keep it in memory).
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable or the server does not answer.
    pub async fn dedicated() -> Result<Dedicated<DynamoDbServer>, HarnessError> {
        on_harness(async {
            let begun = Instant::now();
            let options = container_options();
            let (started, probe) =
                start_dedicated(Kind::DynamoDb, options.env, options.cmd, probe).await?;
            let server = DynamoDbServer::local(started.port, started.origin.clone());
            announce(
                Kind::DynamoDb,
                "dedicated",
                &server.origin,
                &server.endpoint,
                begun.elapsed(),
            );
            Ok(Dedicated::new(server, Kind::DynamoDb, started, probe))
        })
        .await
    }

    /// `http://127.0.0.1:PORT` for a container, or the value of
    /// `IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The region to configure clients with (`IDEMPOTENCY_TEST_DYNAMODB_REGION`,
    /// default `us-east-1`).
    pub fn region(&self) -> &str {
        &self.region
    }

    /// Dummy access key id (`test`).
    pub fn access_key_id(&self) -> &str {
        ACCESS_KEY_ID
    }

    /// Dummy secret access key (`test`).
    pub fn secret_access_key(&self) -> &str {
        SECRET_ACCESS_KEY
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

    /// A fresh table name, `<prefix>-<random>` (valid DynamoDB table name
    /// characters only); one per test keeps tests apart on the shared server.
    pub fn unique_table_name(&self, prefix: &str) -> String {
        super::unique_namespace(prefix)
    }

    /// Calls one DynamoDB JSON API operation (`"ListTables"`, `"CreateTable"`, …)
    /// with a JSON body, over plain HTTP with a placeholder signature (emulators
    /// do not verify it). Meant for tests and set-up.
    ///
    /// # Errors
    ///
    /// [`HarnessError::Operation`] on I/O errors or a malformed HTTP response; an
    /// error answer of the server is an `Ok` response with its status.
    pub async fn call(
        &self,
        operation: &str,
        body: &str,
    ) -> Result<DynamoDbResponse, HarnessError> {
        let host = self.host.clone();
        let port = self.port;
        let region = self.region.clone();
        let operation = operation.to_owned();
        let body = body.to_owned();
        on_harness(async move {
            call(&host, port, &region, &operation, &body)
                .await
                .map_err(|e| HarnessError::operation(format!("DynamoDB {operation}"), e))
        })
        .await
    }
}

/// The answer to [`DynamoDbServer::call`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DynamoDbResponse {
    /// HTTP status (200 on success, 400 for client errors such as a failed condition).
    pub status: u16,
    /// The JSON body.
    pub body: String,
}

async fn call(
    host: &str,
    port: u16,
    region: &str,
    operation: &str,
    body: &str,
) -> Result<DynamoDbResponse, String> {
    let target = format!("DynamoDB_20120810.{operation}");
    json_call(host, port, region, "dynamodb", &target, body).await
}

/// One call of an AWS JSON-protocol API (`X-Amz-Target: <target>`) with a
/// placeholder signature, for `service` (`dynamodb`, `sqs`) in its
/// credential scope.
pub(super) async fn json_call(
    host: &str,
    port: u16,
    region: &str,
    service: &str,
    target: &str,
    body: &str,
) -> Result<DynamoDbResponse, String> {
    let mut stream = TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("connect {host}:{port}: {e}"))?;
    // Both emulators read the access key and region from the credential scope
    // but do not verify the signature; moto also routes by it.
    let request = format!(
        "POST / HTTP/1.1\r\n\
         Host: {host}:{port}\r\n\
         Content-Type: application/x-amz-json-1.0\r\n\
         X-Amz-Target: {target}\r\n\
         X-Amz-Date: 20240101T000000Z\r\n\
         Authorization: AWS4-HMAC-SHA256 Credential={ACCESS_KEY_ID}/20240101/{region}/{service}/aws4_request, \
         SignedHeaders=content-type;host;x-amz-date;x-amz-target, Signature={signature}\r\n\
         Content-Length: {length}\r\n\
         Connection: close\r\n\
         \r\n\
         {body}",
        signature = "0".repeat(64),
        length = body.len(),
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .await
        .map_err(|e| format!("read: {e}"))?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Result<DynamoDbResponse, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| {
            if raw.is_empty() {
                "connection closed without a response".to_owned()
            } else {
                "incomplete HTTP response".to_owned()
            }
        })?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let body = &raw[split + 4..];
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let chunked = lines.any(|line| {
        let line = line.to_ascii_lowercase();
        line.starts_with("transfer-encoding:") && line.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(DynamoDbResponse {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut input: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = input
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunk header")?;
        let size_text = String::from_utf8_lossy(&input[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        input = &input[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if input.len() < size + 2 {
            return Err("truncated chunk".to_owned());
        }
        out.extend_from_slice(&input[..size]);
        input = &input[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_responses() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{\"TableNames\":[]}";
        assert_eq!(
            parse_response(plain),
            Ok(DynamoDbResponse {
                status: 200,
                body: "{\"TableNames\":[]}".into()
            })
        );
        let chunked =
            b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(chunked),
            Ok(DynamoDbResponse {
                status: 400,
                body: "{\"a\":1}".into()
            })
        );
        assert!(parse_response(b"").is_err());
    }
}
