//! A TCP proxy that injects network faults between a client and its server:
//! - a black hole ([`cut`](FaultProxy::cut)): connections are accepted,
//!   requests read and held, nothing answered — a partition or a paused server
//!   as the client sees it, and the hardest case for its timeouts; healing
//!   forwards what was held, late, as TCP would after a partition;
//! - latency and jitter on every chunk, both ways;
//! - connection resets ([`reset`](FaultProxy::reset)): every open connection
//!   is closed at once;
//! - lost replies ([`lose_replies`](FaultProxy::lose_replies)): a request is
//!   forwarded and applied, its reply dropped and the connection closed — what
//!   a client sees when the network fails after the server acted.
//!
//! Written here rather than with `noxious` (a Toxiproxy port): that crate runs
//! as a separate server driven over HTTP, while the tests need faults switched
//! from inside the process, per test, without another service to start.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::error::HarnessError;

/// A proxy on 127.0.0.1 to one server, with switches for network faults.
///
/// Runs on the caller's Tokio runtime; stops accepting when dropped.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency_conformance::containers::HarnessError> {
/// use std::time::Duration;
/// use idempotency_conformance::containers::{redis, FaultProxy};
/// let server = redis().await?;
/// let proxy = FaultProxy::start(server.url()).await?;
/// // … connect a client to proxy.url() …
/// proxy.cut(); // requests now go unanswered
/// proxy.heal();
/// proxy.set_latency(Duration::from_millis(5), Duration::from_millis(5));
/// proxy.lose_replies(0.1); // one reply in ten is lost, its connection closed
/// proxy.reset(); // close every open connection
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct FaultProxy {
    url: String,
    local: SocketAddr,
    faults: Arc<Faults>,
    accept: JoinHandle<()>,
}

/// The switches, shared with every connection.
#[derive(Debug)]
struct Faults {
    cut: watch::Sender<bool>,
    /// Bumped by `reset`: connections of an older generation close.
    generation: watch::Sender<u64>,
    latency_us: AtomicU64,
    jitter_us: AtomicU64,
    /// Probability of losing a reply, in millionths.
    reply_loss_ppm: AtomicU32,
    lost_replies: AtomicU64,
}

impl FaultProxy {
    /// Starts a proxy to the server of `url` (`redis://`, `postgres://`,
    /// `http://`: any URL with a host and a port). [`url`](Self::url) is the
    /// same URL through the proxy (bytes are forwarded unchanged, so TLS works
    /// too).
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
        let (listener, local, via) = listen_for(&parsed, "the fault proxy").await?;
        let faults = Arc::new(Faults {
            cut: watch::channel(false).0,
            generation: watch::channel(0).0,
            latency_us: AtomicU64::new(0),
            jitter_us: AtomicU64::new(0),
            reply_loss_ppm: AtomicU32::new(0),
            lost_replies: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, (host, port), faults.clone()));
        Ok(FaultProxy {
            url: via.to_string(),
            local,
            faults,
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
        self.faults.cut.send_replace(true);
    }

    /// Forwards again, held bytes first.
    pub fn heal(&self) {
        self.faults.cut.send_replace(false);
    }

    /// Whether the proxy is cut.
    pub fn is_cut(&self) -> bool {
        *self.faults.cut.borrow()
    }

    /// Delays every chunk, both ways, by `base` plus a uniform random part of
    /// `jitter` (zero for none).
    pub fn set_latency(&self, base: Duration, jitter: Duration) {
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.faults.latency_us.store(us(base), Ordering::Relaxed);
        self.faults.jitter_us.store(us(jitter), Ordering::Relaxed);
    }

    /// Closes every open connection (new ones are accepted as before).
    pub fn reset(&self) {
        self.faults.generation.send_modify(|g| *g += 1);
    }

    /// Loses each reply with probability `p` (0 for none): the request was
    /// forwarded (and applied by the server); its reply is dropped and the
    /// connection closed.
    pub fn lose_replies(&self, p: f64) {
        let ppm = (p.clamp(0.0, 1.0) * 1_000_000.0).round();
        // In range by the clamp.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        self.faults
            .reply_loss_ppm
            .store(ppm as u32, Ordering::Relaxed);
    }

    /// How many replies were lost so far.
    pub fn lost_replies(&self) -> u64 {
        self.faults.lost_replies.load(Ordering::Relaxed)
    }

    /// Lifts every fault: heals, no latency, no lost replies.
    pub fn clear(&self) {
        self.heal();
        self.set_latency(Duration::ZERO, Duration::ZERO);
        self.lose_replies(0.0);
    }
}

/// A listener on a free port of 127.0.0.1 for a proxy (`what`, for errors) to
/// the server of `url`, and `url` rewritten to go through it.
pub(super) async fn listen_for(
    url: &url::Url,
    what: &str,
) -> Result<(TcpListener, SocketAddr, url::Url), HarnessError> {
    let bind = |e: std::io::Error| HarnessError::operation(format!("bind {what}"), e);
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(bind)?;
    let local = listener.local_addr().map_err(bind)?;
    let mut via = url.clone();
    via.set_host(Some("127.0.0.1"))
        .and_then(|()| {
            via.set_port(Some(local.port()))
                .map_err(|()| url::ParseError::InvalidPort)
        })
        .map_err(|e| HarnessError::operation("build the proxied URL", e))?;
    Ok((listener, local, via))
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset();
    }
}

impl Faults {
    /// Waits while the proxy is cut; `false` once the proxy is gone.
    async fn open(&self) -> bool {
        self.cut.subscribe().wait_for(|cut| !*cut).await.is_ok()
    }

    async fn delay(&self) {
        let base = self.latency_us.load(Ordering::Relaxed);
        let jitter = self.jitter_us.load(Ordering::Relaxed);
        let us = base.saturating_add(if jitter == 0 {
            0
        } else {
            rand::random::<u64>() % jitter
        });
        if us > 0 {
            tokio::time::sleep(Duration::from_micros(us)).await;
        }
    }

    fn lose_this_reply(&self) -> bool {
        let ppm = self.reply_loss_ppm.load(Ordering::Relaxed);
        let lost = ppm > 0 && rand::random::<u32>() % 1_000_000 < ppm;
        if lost {
            self.lost_replies.fetch_add(1, Ordering::Relaxed);
        }
        lost
    }
}

async fn accept_loop(listener: TcpListener, target: (String, u16), faults: Arc<Faults>) {
    while let Ok((client, _)) = listener.accept().await {
        let target = target.clone();
        let faults = faults.clone();
        tokio::spawn(async move {
            let mut generation = faults.generation.subscribe();
            generation.mark_unchanged();
            tokio::select! {
                () = connection(client, target, &faults) => {}
                _ = generation.changed() => {}
            }
        });
    }
}

/// One proxied connection, until either side closes or a reply is lost.
async fn connection(client: TcpStream, target: (String, u16), faults: &Faults) {
    if !faults.open().await {
        return;
    }
    let Ok(server) = TcpStream::connect((target.0.as_str(), target.1)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // A lost reply ends the whole connection: the select drops both halves.
    tokio::select! {
        () = pump(cr, sw, faults, false) => {}
        () = pump(sr, cw, faults, true) => {}
    }
}

/// Copies `from` to `to`, holding what it read while the proxy is cut.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    faults: &Faults,
    replies: bool,
) {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        faults.delay().await;
        if !faults.open().await || (replies && faults.lose_this_reply()) {
            return;
        }
        if to.write_all(&chunk[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The corrupting function of a [`ProxyFaults`].
type Corrupt = Box<
    dyn Fn(idempotency_core::RecordKey) -> futures::future::BoxFuture<'static, Result<(), String>>
        + Send
        + Sync,
>;

/// [`StoreFaults`](crate::StoreFaults) for a store behind a [`FaultProxy`]:
/// `unreach` cuts the proxy, `reach` heals it, and `corrupt` is the backend's
/// own way of writing an undecodable record (a raw command or row, on a
/// connection that does not go through the proxy).
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency_conformance::containers::HarnessError> {
/// use idempotency_conformance::containers::{redis, FaultProxy, ProxyFaults};
/// let server = redis().await?;
/// let proxy = FaultProxy::start(server.url()).await?;
/// let faults = ProxyFaults::new(proxy, move |key| {
///     let server = server.clone();
///     async move {
///         let raw_key = format!("my-prefix:{}", key.encode());
///         server.command(&["SET", &raw_key, "not a record"]).await
///             .map(drop).map_err(|e| e.to_string())
///     }
/// });
/// // … connect the repository under test to faults.proxy().url() …
/// # Ok(())
/// # }
/// ```
pub struct ProxyFaults {
    proxy: FaultProxy,
    corrupt: Corrupt,
}

impl std::fmt::Debug for ProxyFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyFaults")
            .field("proxy", &self.proxy)
            .finish_non_exhaustive()
    }
}

impl ProxyFaults {
    /// Faults through `proxy`, corrupting records with `corrupt`.
    pub fn new<F, Fut>(proxy: FaultProxy, corrupt: F) -> ProxyFaults
    where
        F: Fn(idempotency_core::RecordKey) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
    {
        ProxyFaults {
            proxy,
            corrupt: Box::new(move |key| Box::pin(corrupt(key))),
        }
    }

    /// The proxy (connect the repository under test to its URL).
    pub fn proxy(&self) -> &FaultProxy {
        &self.proxy
    }
}

#[async_trait::async_trait]
impl crate::StoreFaults for ProxyFaults {
    async fn corrupt(&self, key: &idempotency_core::RecordKey) -> Result<(), String> {
        (self.corrupt)(key.clone()).await
    }

    async fn unreach(&self) -> Result<(), String> {
        self.proxy.cut();
        Ok(())
    }

    async fn reach(&self) -> Result<(), String> {
        self.proxy.heal();
        Ok(())
    }
}
