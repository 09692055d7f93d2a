//! A TCP proxy that can make a server unreachable: while cut, it is a black hole
//! (connections are accepted, requests are read and held, nothing is answered),
//! which is what a network partition or a paused server looks like to a client,
//! and the hardest case for its timeouts. Healing forwards what was held, late,
//! as TCP would after a partition.

use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::error::HarnessError;

/// A proxy on 127.0.0.1 to one server, with a switch that cuts it off.
///
/// Runs on the caller's Tokio runtime; stops accepting when dropped.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency_conformance::containers::HarnessError> {
/// use idempotency_conformance::containers::{redis, FaultProxy};
/// let server = redis().await?;
/// let proxy = FaultProxy::start(server.url()).await?;
/// // … connect a client to proxy.url() …
/// proxy.cut(); // requests now go unanswered
/// proxy.heal();
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct FaultProxy {
    url: String,
    local: SocketAddr,
    cut: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy to the server of `url` (`redis://`, `postgres://`,
    /// `http://`: any URL with a host and a port). [`url`](Self::url) is the
    /// same URL through the proxy; for PostgreSQL, add `sslmode=disable` if the
    /// client would otherwise ask for TLS (the proxy forwards bytes unchanged,
    /// so TLS works too).
    ///
    /// # Errors
    /// [`HarnessError::Operation`] for a URL without host or port, or a port
    /// that cannot be bound.
    pub async fn start(url: &str) -> Result<FaultProxy, HarnessError> {
        let parsed =
            url::Url::parse(url).map_err(|e| HarnessError::operation("parse the server URL", e))?;
        let host = parsed
            .host_str()
            .ok_or_else(|| HarnessError::operation("proxy the server URL", "it has no host"))?
            .to_owned();
        let port = parsed
            .port_or_known_default()
            .ok_or_else(|| HarnessError::operation("proxy the server URL", "it has no port"))?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::operation("bind the fault proxy", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| HarnessError::operation("bind the fault proxy", e))?;
        let mut via = parsed.clone();
        via.set_host(Some("127.0.0.1"))
            .and_then(|()| {
                via.set_port(Some(local.port()))
                    .map_err(|()| url::ParseError::InvalidPort)
            })
            .map_err(|e| HarnessError::operation("build the proxied URL", e))?;
        let (cut, open) = watch::channel(false);
        let accept = tokio::spawn(accept_loop(listener, (host, port), open));
        Ok(FaultProxy {
            url: via.to_string(),
            local,
            cut,
            accept,
        })
    }

    /// The server's URL through the proxy.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The proxy's address, `127.0.0.1:PORT`.
    pub fn address(&self) -> SocketAddr {
        self.local
    }

    /// Stops forwarding, both ways, on every connection, and holds new ones.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Forwards again, held bytes first.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }

    /// Whether the proxy is cut.
    pub fn is_cut(&self) -> bool {
        *self.cut.borrow()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Waits while the proxy is cut; `false` once the proxy is gone.
async fn wait_open(open: &mut watch::Receiver<bool>) -> bool {
    open.wait_for(|cut| !*cut).await.is_ok()
}

async fn accept_loop(listener: TcpListener, target: (String, u16), open: watch::Receiver<bool>) {
    while let Ok((client, _)) = listener.accept().await {
        let target = target.clone();
        let mut open = open.clone();
        tokio::spawn(async move {
            if !wait_open(&mut open).await {
                return;
            }
            let Ok(server) = TcpStream::connect((target.0.as_str(), target.1)).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::join!(pump(cr, sw, open.clone()), pump(sr, cw, open));
        });
    }
}

/// Copies `from` to `to`, holding what it read while the proxy is cut.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut open: watch::Receiver<bool>,
) {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        if !wait_open(&mut open).await {
            break;
        }
        let n = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !wait_open(&mut open).await || to.write_all(&chunk[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
