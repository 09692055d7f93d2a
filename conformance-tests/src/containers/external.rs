//! Servers named by environment variables (CI service containers, a local
//! server): no container is started for them.

use std::sync::Arc;

use tokio::net::TcpStream;

use super::docker::{notice, ready_timeout, wait_ready, Kind, Origin, Probe};
use super::error::HarnessError;

/// A server from `IDEMPOTENCY_TEST_<KIND>_URL` / `_ENDPOINT`.
#[derive(Debug, Clone)]
pub(crate) struct External {
    kind: Kind,
    pub(crate) value: String,
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl External {
    /// The server named by the kind's variable, if it is set.
    pub(crate) fn from_env(kind: Kind) -> Result<Option<External>, HarnessError> {
        let Some(value) = kind.external() else {
            return Ok(None);
        };
        let invalid = |reason: String| HarnessError::External {
            variable: kind.external_variable(),
            value: value.clone(),
            reason,
        };
        let url = url::Url::parse(&value).map_err(|e| {
            invalid(format!(
                "not a URL ({e}); expected e.g. {}",
                kind.external_example()
            ))
        })?;
        let host = match url.host() {
            Some(url::Host::Domain(domain)) => domain.to_owned(),
            Some(url::Host::Ipv4(address)) => address.to_string(),
            Some(url::Host::Ipv6(address)) => address.to_string(),
            None => return Err(invalid("the URL has no host".to_owned())),
        };
        let default_port = match kind {
            Kind::Redis => Some(6379),
            Kind::Postgres => Some(5432),
            Kind::MariaDb => Some(3306),
            Kind::RabbitMq => Some(5672),
            Kind::DynamoDb | Kind::Sqs => None,
        };
        let port = url
            .port_or_known_default()
            .or(default_port)
            .ok_or_else(|| invalid("the URL has no port".to_owned()))?;
        Ok(Some(External {
            kind,
            value,
            host,
            port,
        }))
    }

    pub(crate) fn origin(&self) -> Origin {
        Origin::External {
            variable: self.kind.external_variable(),
        }
    }

    /// Waits until `probe` succeeds (a protocol-level check chosen by the
    /// kind; `tcp_probe` when TLS or credentials get in the way).
    pub(crate) async fn wait_ready(&self, probe: Probe) -> Result<(), HarnessError> {
        wait_ready(self.kind, &self.value, ready_timeout(), &probe)
            .await
            .map_err(|e| HarnessError::External {
                variable: self.kind.external_variable(),
                value: self.value.clone(),
                reason: e.to_string(),
            })?;
        notice(format_args!(
            "{}: using the server from {} ({})",
            self.kind.name(),
            self.kind.external_variable(),
            self.value
        ));
        Ok(())
    }

    /// Whether the URL asks for TLS, which the harness's own probes do not speak.
    pub(crate) fn wants_tls(&self) -> bool {
        let lower = self.value.to_ascii_lowercase();
        lower.starts_with("rediss:")
            || lower.starts_with("amqps:")
            || lower.starts_with("https:")
            || lower.contains("sslmode=require")
            || lower.contains("sslmode=verify")
    }
}

/// Only checks that something accepts TCP connections.
pub(crate) fn tcp_probe(host: String, port: u16) -> Probe {
    Arc::new(move || {
        let host = host.clone();
        Box::pin(async move {
            TcpStream::connect((host.as_str(), port))
                .await
                .map(drop)
                .map_err(|e| format!("connect {host}:{port}: {e}"))
        })
    })
}
