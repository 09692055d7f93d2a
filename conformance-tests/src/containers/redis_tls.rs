//! Redis behind TLS: a container of the Redis image with a TLS port, and a
//! throw-away certificate authority made in-process (no `openssl` on the host).
//!
//! The server runs in the host's network namespace, bound to `127.0.0.1`, with
//! a plain port (for the readiness probe and raw commands) beside the TLS one,
//! like the cluster nodes.

use std::time::Instant;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

use super::docker::{
    announce, free_port, on_harness, start_ready, Dedicated, Kind, StartOptions, Started,
};
use super::error::HarnessError;
use super::redis::{probe, RedisServer};

/// Where the certificates go in the container.
const CERT_DIR: &str = "/idempotency-tls";

/// A TLS-enabled Redis server of its own; removed when dropped.
///
/// [`plain`](Self::plain) is the same server's unencrypted port (the harness's
/// probe and [`RedisServer::command`] use it); [`tls_url`](Self::tls_url) is
/// the `rediss://` URL, whose certificate is signed by [`ca_pem`](Self::ca_pem)
/// for `127.0.0.1` and `localhost`. Clients are not asked for certificates.
#[derive(Debug)]
pub struct RedisTlsServer {
    plain: Dedicated<RedisServer>,
    tls_port: u16,
    ca_pem: String,
}

impl RedisTlsServer {
    /// Starts a TLS Redis from `IDEMPOTENCY_TEST_REDIS_IMAGE` (Redis 6 or later,
    /// built with TLS: the official image and the baked one are).
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable, the certificates cannot be
    /// made, or the server does not answer.
    pub async fn start() -> Result<RedisTlsServer, HarnessError> {
        on_harness(async {
            let begun = Instant::now();
            let certificates = Certificates::generate()?;
            let (started, tls_port) = start_server(&certificates).await?;
            let server = RedisServer::local(started.port, started.origin.clone());
            announce(
                Kind::Redis,
                "dedicated, TLS",
                server.origin(),
                &format!("rediss://127.0.0.1:{tls_port}"),
                begun.elapsed(),
            );
            let probe = probe(started.port);
            Ok(RedisTlsServer {
                plain: Dedicated::new(server, Kind::Redis, started, probe),
                tls_port,
                ca_pem: certificates.ca_pem,
            })
        })
        .await
    }

    /// `rediss://127.0.0.1:PORT`.
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port)
    }

    /// The TLS port.
    pub fn tls_port(&self) -> u16 {
        self.tls_port
    }

    /// The certificate authority that signed the server's certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The same server's plain-text port.
    pub fn plain(&self) -> &RedisServer {
        &self.plain
    }
}

/// A CA and a server certificate it signed, all PEM.
struct Certificates {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

impl Certificates {
    fn generate() -> Result<Certificates, HarnessError> {
        let failed = |e: rcgen::Error| HarnessError::operation("making test certificates", e);
        let ca_key = KeyPair::generate().map_err(failed)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(failed)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "idempotency-test-ca");
        let ca_cert = ca.self_signed(&ca_key).map_err(failed)?;

        let key = KeyPair::generate().map_err(failed)?;
        let mut server =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .map_err(failed)?;
        server
            .distinguished_name
            .push(DnType::CommonName, "127.0.0.1");
        let cert = server.signed_by(&key, &ca_cert, &ca_key).map_err(failed)?;
        Ok(Certificates {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

async fn start_server(certificates: &Certificates) -> Result<(Started, u16), HarnessError> {
    let port = free_port()?;
    let tls_port = free_port()?;
    let file = |name: &str| format!("{CERT_DIR}/{name}");
    let cmd = [
        "redis-server",
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &file("server.crt"),
        "--tls-key-file",
        &file("server.key"),
        "--tls-ca-cert-file",
        &file("ca.crt"),
        "--tls-auth-clients",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    .map(str::to_owned)
    .to_vec();
    let options = StartOptions {
        cmd,
        host_port: Some(port),
        host_network: true,
        dedicated: true,
        files: vec![
            (file("ca.crt"), certificates.ca_pem.clone().into_bytes()),
            (
                file("server.crt"),
                certificates.cert_pem.clone().into_bytes(),
            ),
            // Readable by the server's user; a test key, thrown away with the container.
            (
                file("server.key"),
                certificates.key_pem.clone().into_bytes(),
            ),
        ],
        ..StartOptions::default()
    };
    let (started, _) = start_ready(Kind::Redis, options, probe).await?;
    Ok((started, tls_port))
}
