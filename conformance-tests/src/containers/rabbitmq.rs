//! RabbitMQ: the shared broker, queue names, and a minimal AMQP 0-9-1
//! handshake for readiness (so the harness needs no AMQP client crate).

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::docker::{
    announce, keep_for_process, on_harness, start_dedicated, start_ready, Dedicated, Kind, Origin,
    Probe,
};
use super::error::HarnessError;
use super::external::{tcp_probe, External};

/// The user both the official image and the baked one accept from outside
/// the container.
const USER: &str = "guest";
const PASSWORD: &str = "guest";

/// Connection details of a RabbitMQ broker handed out by the harness.
///
/// [`url`](Self::url) is an `amqp://` URL with credentials and the default
/// virtual host, for any AMQP 0-9-1 client. Isolate tests with
/// [`unique_queue_name`](Self::unique_queue_name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RabbitMqServer {
    url: String,
    host: String,
    port: u16,
    origin: Origin,
}

/// The RabbitMQ broker shared by every test of this test binary.
///
/// Started on first use from `IDEMPOTENCY_TEST_RABBITMQ_IMAGE` (default
/// `rabbitmq:3`, or the baked `idempotency-test/rabbitmq:bookworm`) with
/// testcontainers, or taken from `IDEMPOTENCY_TEST_RABBITMQ_URL` (e.g.
/// `amqp://guest:guest@127.0.0.1:5672/%2f`). Ready once the broker answers an
/// AMQP handshake and accepts the `guest` login.
///
/// # Errors
///
/// [`HarnessError`] saying how to provide a broker when there is neither Docker
/// nor `IDEMPOTENCY_TEST_RABBITMQ_URL`, or when the broker does not answer.
pub async fn rabbitmq() -> Result<RabbitMqServer, HarnessError> {
    static SHARED: tokio::sync::OnceCell<Result<RabbitMqServer, HarnessError>> =
        tokio::sync::OnceCell::const_new();
    on_harness(async {
        SHARED
            .get_or_init(|| async {
                match External::from_env(Kind::RabbitMq)? {
                    Some(external) => {
                        let server = RabbitMqServer {
                            url: external.value.clone(),
                            host: external.host.clone(),
                            port: external.port,
                            origin: external.origin(),
                        };
                        // Its credentials are the URL's: only check that it listens.
                        external
                            .wait_ready(tcp_probe(external.host.clone(), external.port))
                            .await?;
                        Ok(server)
                    }
                    None => {
                        let begun = Instant::now();
                        let (started, _) =
                            start_ready(Kind::RabbitMq, Default::default(), probe).await?;
                        let server = RabbitMqServer::local(started.port, started.origin.clone());
                        announce(
                            Kind::RabbitMq,
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

impl RabbitMqServer {
    /// A RabbitMQ broker in a container of its own (always a container, also
    /// when `IDEMPOTENCY_TEST_RABBITMQ_URL` is set), for tests that stop,
    /// restart or pause it. It keeps its port, its definitions and its
    /// persistent messages across [`restart`](Dedicated::restart) (same
    /// container, same node name, same data directory).
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable or the broker does not answer.
    pub async fn dedicated() -> Result<Dedicated<RabbitMqServer>, HarnessError> {
        RabbitMqServer::dedicated_with_settings(&[]).await
    }

    /// Like [`RabbitMqServer::dedicated`], with settings of the broker's
    /// `rabbit` application, each passed as `-rabbit NAME VALUE` to the Erlang
    /// VM (`RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS`, read by both the official
    /// image and Debian's `rabbitmq-server`). E.g.
    /// `[("consumer_timeout", "3000"), ("channel_tick_interval", "250")]`
    /// for a broker that closes a channel whose delivery stayed unacknowledged
    /// for 3 s, checked four times a second (RabbitMQ checks the timeout on
    /// each channel's tick, every 60 s by default).
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable, a setting is not a plain
    /// Erlang term, or the broker does not answer.
    pub async fn dedicated_with_settings(
        settings: &[(&str, &str)],
    ) -> Result<Dedicated<RabbitMqServer>, HarnessError> {
        let args = erl_args(settings)?;
        let env = if args.is_empty() {
            Vec::new()
        } else {
            vec![("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", args)]
        };
        on_harness(async move {
            let begun = Instant::now();
            let (started, probe) = start_dedicated(Kind::RabbitMq, env, Vec::new(), probe).await?;
            let server = RabbitMqServer::local(started.port, started.origin.clone());
            announce(
                Kind::RabbitMq,
                "dedicated",
                &server.origin,
                &server.url,
                begun.elapsed(),
            );
            Ok(Dedicated::new(server, Kind::RabbitMq, started, probe))
        })
        .await
    }

    fn local(port: u16, origin: Origin) -> Self {
        RabbitMqServer {
            url: format!("amqp://{USER}:{PASSWORD}@127.0.0.1:{port}/%2f"),
            host: "127.0.0.1".to_owned(),
            port,
            origin,
        }
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f` for a container, or the value of
    /// `IDEMPOTENCY_TEST_RABBITMQ_URL`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Host name or address.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where the broker comes from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// A fresh queue (or exchange) name, `<prefix>-<random>`; one per test
    /// keeps tests apart on the shared broker.
    pub fn unique_queue_name(&self, prefix: &str) -> String {
        super::unique_namespace(prefix)
    }
}

/// `-rabbit NAME VALUE ...`; names and values are plain atoms or numbers, so
/// nothing needs quoting through the shell scripts that pass them on.
fn erl_args(settings: &[(&str, &str)]) -> Result<String, HarnessError> {
    let plain = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
    };
    let mut out = Vec::with_capacity(settings.len());
    for (name, value) in settings {
        if !plain(name) || !plain(value) {
            return Err(HarnessError::operation(
                "a RabbitMQ setting",
                format!("{name:?} = {value:?} is not a plain Erlang atom or number"),
            ));
        }
        out.push(format!("-rabbit {name} {value}"));
    }
    Ok(out.join(" "))
}

fn probe(port: u16) -> Probe {
    Arc::new(move || Box::pin(async move { handshake("127.0.0.1", port).await }))
}

/// Opens an AMQP 0-9-1 connection up to `Connection.Tune`, which the broker
/// sends only after it accepted the login: proves the broker is up and
/// `guest` may log in from outside the container.
async fn handshake(host: &str, port: u16) -> Result<(), String> {
    let mut stream = TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("connect {host}:{port}: {e}"))?;
    stream
        .write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .map_err(|e| format!("send the protocol header: {e}"))?;
    expect_method(&mut stream, (10, 10), "Connection.Start").await?;
    stream
        .write_all(&start_ok())
        .await
        .map_err(|e| format!("send Connection.StartOk: {e}"))?;
    expect_method(&mut stream, (10, 30), "Connection.Tune").await
}

/// Reads one frame and checks it is the method `(class, method)`.
async fn expect_method(stream: &mut TcpStream, want: (u16, u16), name: &str) -> Result<(), String> {
    let mut header = [0u8; 7];
    stream
        .read_exact(&mut header)
        .await
        .map_err(|e| format!("waiting for {name}: {e}"))?;
    if header[0] != 1 {
        return Err(format!(
            "expected {name}, got a frame of type {} (not AMQP 0-9-1?)",
            header[0]
        ));
    }
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
    if size > 1 << 20 {
        return Err(format!("a {size}-byte frame while waiting for {name}"));
    }
    let mut payload = vec![0u8; size + 1];
    stream
        .read_exact(&mut payload)
        .await
        .map_err(|e| format!("reading {name}: {e}"))?;
    let got = match payload.get(..4) {
        Some(id) => (
            u16::from_be_bytes([id[0], id[1]]),
            u16::from_be_bytes([id[2], id[3]]),
        ),
        None => return Err(format!("a short frame while waiting for {name}")),
    };
    if got == want {
        Ok(())
    } else if got == (10, 50) {
        Err(format!(
            "the broker closed the connection instead of {name} (login refused?)"
        ))
    } else {
        Err(format!("expected {name}, got method {}.{}", got.0, got.1))
    }
}

/// `Connection.StartOk`: no client properties, PLAIN login as guest.
fn start_ok() -> Vec<u8> {
    let response = format!("\0{USER}\0{PASSWORD}");
    let mut payload = Vec::new();
    payload.extend_from_slice(&10u16.to_be_bytes());
    payload.extend_from_slice(&11u16.to_be_bytes());
    payload.extend_from_slice(&0u32.to_be_bytes()); // client-properties: empty table
    short_string(&mut payload, "PLAIN");
    payload.extend_from_slice(&(response.len() as u32).to_be_bytes());
    payload.extend_from_slice(response.as_bytes());
    short_string(&mut payload, "en_US");
    let mut frame = vec![1u8, 0, 0];
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(&payload);
    frame.push(0xCE);
    frame
}

fn short_string(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::unwrap_used)]
    fn settings_become_erl_args_and_odd_ones_are_refused() {
        assert_eq!(erl_args(&[]).unwrap(), "");
        assert_eq!(
            erl_args(&[
                ("consumer_timeout", "3000"),
                ("channel_tick_interval", "250")
            ])
            .unwrap(),
            "-rabbit consumer_timeout 3000 -rabbit channel_tick_interval 250"
        );
        assert!(erl_args(&[("consumer_timeout", "3000 -s init stop")]).is_err());
        assert!(erl_args(&[("", "1")]).is_err());
    }

    #[test]
    fn start_ok_is_one_well_formed_frame() {
        let frame = start_ok();
        assert_eq!(frame[0], 1, "a method frame");
        assert_eq!(&frame[1..3], &[0, 0], "on channel 0");
        let size = u32::from_be_bytes([frame[3], frame[4], frame[5], frame[6]]) as usize;
        assert_eq!(frame.len(), 7 + size + 1);
        assert_eq!(frame.last(), Some(&0xCE));
        assert_eq!(&frame[7..11], &[0, 10, 0, 11], "Connection.StartOk");
    }
}
