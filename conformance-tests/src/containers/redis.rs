//! Redis: the shared server, dedicated servers, and a tiny RESP client for
//! readiness and raw commands (so the harness needs no Redis crate).

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

/// Connection details of a Redis server handed out by the harness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisServer {
    url: String,
    host: String,
    port: u16,
    origin: Origin,
}

/// The Redis server shared by every test of this test binary.
///
/// Started on first use from `IDEMPOTENCY_TEST_REDIS_IMAGE` (default `redis:7`)
/// with testcontainers, or taken from `IDEMPOTENCY_TEST_REDIS_URL` when that is
/// set. Isolate tests with key prefixes from
/// [`unique_namespace`](super::unique_namespace), never by flushing.
///
/// # Errors
///
/// [`HarnessError`] saying how to provide a server when there is neither Docker
/// nor `IDEMPOTENCY_TEST_REDIS_URL`, or when the server does not answer. The
/// outcome is remembered: every test of the binary gets the same server or the
/// same error.
pub async fn redis() -> Result<RedisServer, HarnessError> {
    static SHARED: tokio::sync::OnceCell<Result<RedisServer, HarnessError>> =
        tokio::sync::OnceCell::const_new();
    on_harness(async {
        SHARED
            .get_or_init(|| async {
                match External::from_env(Kind::Redis)? {
                    Some(external) => {
                        let server = RedisServer {
                            url: external.value.clone(),
                            host: external.host.clone(),
                            port: external.port,
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
                            start_ready(Kind::Redis, StartOptions::default(), probe).await?;
                        let server = RedisServer::local(started.port, started.origin.clone());
                        announce(
                            Kind::Redis,
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

impl RedisServer {
    pub(crate) fn new(url: String, host: String, port: u16, origin: Origin) -> Self {
        RedisServer {
            url,
            host,
            port,
            origin,
        }
    }

    pub(crate) fn local(port: u16, origin: Origin) -> Self {
        RedisServer {
            url: format!("redis://127.0.0.1:{port}"),
            host: "127.0.0.1".to_owned(),
            port,
            origin,
        }
    }

    /// A Redis server in a container of its own (always a container, also when
    /// `IDEMPOTENCY_TEST_REDIS_URL` is set), for tests that stop and restart it.
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable or the server does not answer.
    pub async fn dedicated() -> Result<Dedicated<RedisServer>, HarnessError> {
        RedisServer::dedicated_with_args(&[]).await
    }

    /// Like [`RedisServer::dedicated`], with `redis-server` options, e.g.
    /// `["--appendonly", "yes", "--appendfsync", "always"]` for a server that
    /// keeps its records through a restart, or `["--save", ""]` for one that
    /// forgets them.
    ///
    /// # Errors
    ///
    /// [`HarnessError`] when Docker is unavailable or the server does not answer.
    pub async fn dedicated_with_args(
        args: &[&str],
    ) -> Result<Dedicated<RedisServer>, HarnessError> {
        let cmd: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        on_harness(async move {
            let begun = Instant::now();
            let (started, probe) = start_dedicated(Kind::Redis, Vec::new(), cmd, probe).await?;
            let server = RedisServer::local(started.port, started.origin.clone());
            announce(
                Kind::Redis,
                "dedicated",
                &server.origin,
                &server.url,
                begun.elapsed(),
            );
            Ok(Dedicated::new(server, Kind::Redis, started, probe))
        })
        .await
    }

    /// `redis://127.0.0.1:PORT` for a container, or the value of
    /// `IDEMPOTENCY_TEST_REDIS_URL`.
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

    /// Where the server comes from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Sends one command over a fresh plain-TCP connection and returns the reply
    /// (`["PING"]` → `Status("PONG")`). Meant for tests and set-up, not speed;
    /// servers behind TLS or a password are not supported.
    ///
    /// # Errors
    ///
    /// [`HarnessError::Operation`] on I/O errors or a malformed reply. An error
    /// reply of the server is `Ok(RedisReply::Error(..))`.
    pub async fn command(&self, args: &[&str]) -> Result<RedisReply, HarnessError> {
        let host = self.host.clone();
        let port = self.port;
        let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
        on_harness(async move {
            send_command(&host, port, &args).await.map_err(|e| {
                HarnessError::operation(format!("redis command {:?}", args.first()), e)
            })
        })
        .await
    }
}

/// A reply of the RESP2 protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RedisReply {
    /// `+OK`
    Status(String),
    /// `-ERR …`
    Error(String),
    /// `:42`
    Integer(i64),
    /// `$…`; `None` is the nil bulk string.
    Bulk(Option<Vec<u8>>),
    /// `*…`; `None` is the nil array.
    Array(Option<Vec<RedisReply>>),
}

pub(crate) fn probe(port: u16) -> Probe {
    Arc::new(move || {
        Box::pin(async move {
            match send_command("127.0.0.1", port, &["PING".to_owned()]).await? {
                RedisReply::Status(s) if s == "PONG" => Ok(()),
                other => Err(format!("PING answered {other:?}")),
            }
        })
    })
}

/// Any answer but `-LOADING` shows an external server is up; it may want a
/// password the harness does not know, which the backend's tests will report.
fn external_probe(host: String, port: u16) -> Probe {
    Arc::new(move || {
        let host = host.clone();
        Box::pin(async move {
            match send_command(&host, port, &["PING".to_owned()]).await? {
                RedisReply::Error(e) if e.starts_with("LOADING") => Err(e),
                _ => Ok(()),
            }
        })
    })
}

pub(crate) async fn send_command(
    host: &str,
    port: u16,
    args: &[String],
) -> Result<RedisReply, String> {
    let mut stream = TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("connect {host}:{port}: {e}"))?;
    let mut request = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        request.extend_from_slice(arg.as_bytes());
        request.extend_from_slice(b"\r\n");
    }
    stream
        .write_all(&request)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((reply, _)) = parse_reply(&buffer)? {
            return Ok(reply);
        }
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("connection closed before a complete reply".to_owned());
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

/// Parses one reply from the start of `input`: `Ok(None)` when more bytes are needed.
fn parse_reply(input: &[u8]) -> Result<Option<(RedisReply, usize)>, String> {
    let Some(line_end) = input.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let Some((&tag, line)) = input[..line_end].split_first() else {
        return Err("empty reply line".to_owned());
    };
    let line = String::from_utf8_lossy(line).into_owned();
    let rest = line_end + 2;
    let number = |s: &str| {
        s.parse::<i64>()
            .map_err(|_| format!("bad number in reply: {s:?}"))
    };
    match tag {
        b'+' => Ok(Some((RedisReply::Status(line), rest))),
        b'-' => Ok(Some((RedisReply::Error(line), rest))),
        b':' => Ok(Some((RedisReply::Integer(number(&line)?), rest))),
        b'$' => {
            let len = number(&line)?;
            if len < 0 {
                return Ok(Some((RedisReply::Bulk(None), rest)));
            }
            let len = usize::try_from(len).map_err(|e| e.to_string())?;
            if input.len() < rest + len + 2 {
                return Ok(None);
            }
            let body = input[rest..rest + len].to_vec();
            Ok(Some((RedisReply::Bulk(Some(body)), rest + len + 2)))
        }
        b'*' => {
            let count = number(&line)?;
            if count < 0 {
                return Ok(Some((RedisReply::Array(None), rest)));
            }
            let mut items = Vec::new();
            let mut used = rest;
            for _ in 0..count {
                match parse_reply(&input[used..])? {
                    Some((item, n)) => {
                        items.push(item);
                        used += n;
                    }
                    None => return Ok(None),
                }
            }
            Ok(Some((RedisReply::Array(Some(items)), used)))
        }
        other => Err(format!("unexpected reply type byte {other:#04x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_replies() {
        assert_eq!(
            parse_reply(b"+PONG\r\n"),
            Ok(Some((RedisReply::Status("PONG".into()), 7)))
        );
        assert_eq!(parse_reply(b"$3\r\nab"), Ok(None));
        assert_eq!(
            parse_reply(b"$-1\r\n"),
            Ok(Some((RedisReply::Bulk(None), 5)))
        );
        assert_eq!(
            parse_reply(b"*2\r\n:1\r\n$2\r\nhi\r\n"),
            Ok(Some((
                RedisReply::Array(Some(vec![
                    RedisReply::Integer(1),
                    RedisReply::Bulk(Some(b"hi".to_vec()))
                ])),
                16
            )))
        );
        assert_eq!(parse_reply(b"*2\r\n:1\r\n"), Ok(None));
    }
}
