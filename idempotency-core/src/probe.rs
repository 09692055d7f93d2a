//! Telling "another service listens at that address" from an outage, when a
//! store is first connected to.
//!
//! A client pointed at the wrong port sees the same errors an outage gives: a
//! connection closed before any reply (PostgreSQL closes silently on a
//! request it cannot read; Redis does on an HTTP request), or bytes it cannot
//! parse. Classed as outages they are retryable, and an application retries a
//! misconfiguration for ever without saying what is wrong. [`foreign_service`]
//! asks the address itself, on fresh connections, whether it speaks the
//! protocol at all: used by the bundled backends when connecting, and
//! available to custom ones.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! use std::time::Duration;
//! use idempotency_core::probe::foreign_service;
//!
//! // A port where nothing listens is an outage, not another service.
//! let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
//! let port = listener.local_addr()?.port();
//! drop(listener);
//! let verdict = foreign_service("127.0.0.1", port, b"PING\r\n", Duration::from_secs(1), |reply| {
//!     reply.starts_with(b"+")
//! })
//! .await;
//! assert_eq!(verdict, None);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How many fresh connections must show another service before it is
/// believed, and the pause between them: a server restarting behind a proxy
/// closes connections silently for a moment too.
const TRIES: usize = 2;
const PAUSE: Duration = Duration::from_millis(200);

/// What one probe connection saw.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    /// Connecting failed (refused, unreachable) or nothing came back in
    /// time: no verdict, an outage looks the same.
    Nothing,
    /// Accepted, then closed without a byte.
    ClosedSilently,
    /// Accepted and answered these first bytes.
    Answered(Vec<u8>),
}

/// Whether `host:port` is a service that does not speak the expected
/// protocol: on two fresh connections 200 ms apart, each sends `hello` and the peer
/// either closes without a byte or answers bytes `speaks` rejects. Returns
/// what was seen, for the error message; `None` when the peer could not be
/// reached, did not answer within `timeout`, or answered as expected (an
/// outage, not a misconfiguration).
pub async fn foreign_service(
    host: &str,
    port: u16,
    hello: &[u8],
    timeout: Duration,
    speaks: impl Fn(&[u8]) -> bool,
) -> Option<String> {
    let mut seen = String::new();
    for attempt in 0..TRIES {
        if attempt > 0 {
            tokio::time::sleep(PAUSE).await;
        }
        seen = match probe(host, port, hello, timeout).await {
            Seen::Nothing => return None,
            Seen::Answered(bytes) if speaks(&bytes) => return None,
            Seen::Answered(bytes) => format!("it answered {}", printable(&bytes)),
            Seen::ClosedSilently => "it closed the connection without answering".to_owned(),
        };
    }
    Some(seen)
}

async fn probe(host: &str, port: u16, hello: &[u8], timeout: Duration) -> Seen {
    let exchange = async {
        let mut stream = TcpStream::connect((host, port)).await.ok()?;
        // A peer that closed at once may refuse the write: that is an answer.
        let _ = stream.write_all(hello).await;
        let mut buf = [0u8; 64];
        Some(match stream.read(&mut buf).await {
            Ok(0) => Seen::ClosedSilently,
            Ok(n) => Seen::Answered(buf[..n].to_vec()),
            Err(e) if is_closed(&e) => Seen::ClosedSilently,
            Err(_) => Seen::Nothing,
        })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or(Seen::Nothing)
}

fn is_closed(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionAborted
    )
}

/// The first bytes, as text where they are printable.
fn printable(bytes: &[u8]) -> String {
    let text: String = bytes
        .iter()
        .take(24)
        .flat_map(|&b| std::ascii::escape_default(b))
        .map(char::from)
        .collect();
    format!("\"{text}\"")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use tokio::net::TcpListener;

    /// A server that treats every connection with `serve`.
    async fn server<F, Fut>(serve: F) -> u16
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                serve(stream).await;
            }
        });
        port
    }

    fn resp(reply: &[u8]) -> bool {
        reply.starts_with(b"+") || reply.starts_with(b"-")
    }

    #[tokio::test]
    async fn a_silent_closer_or_another_protocol_is_another_service() {
        let silent = server(|s| async move { drop(s) }).await;
        let greeter = server(|mut s| async move {
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await;
        })
        .await;
        let t = Duration::from_secs(2);
        let seen = foreign_service("127.0.0.1", silent, b"PING\r\n", t, resp).await;
        assert!(seen.unwrap().contains("without answering"));
        let seen = foreign_service("127.0.0.1", greeter, b"PING\r\n", t, resp).await;
        assert!(seen.unwrap().contains("SSH-2.0"));
    }

    #[tokio::test]
    async fn the_right_protocol_or_no_answer_is_not() {
        let redis = server(|mut s| async move {
            let mut buf = [0u8; 16];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(b"+PONG\r\n").await;
        })
        .await;
        // Accepts and never answers (the probe's one connection waits).
        let mute = server(|s| async move {
            std::future::pending::<()>().await;
            drop(s);
        })
        .await;
        let t = Duration::from_millis(300);
        assert_eq!(
            foreign_service("127.0.0.1", redis, b"PING\r\n", t, resp).await,
            None
        );
        assert_eq!(
            foreign_service("127.0.0.1", mute, b"PING\r\n", t, resp).await,
            None
        );
    }
}
