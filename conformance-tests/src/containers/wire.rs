//! A TCP proxy in front of a PostgreSQL, Redis or MySQL server that counts what
//! clients send: PostgreSQL protocol messages by type, Redis commands, or MySQL
//! commands by command byte. It is how the
//! backends' tests prove their round trips and statements, and how the benchmark
//! counts round trips of the library and of the raw client alike (server-side
//! counters such as Redis `INFO commandstats` also count the commands scripts run
//! inside the server, which are not round trips).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::error::HarnessError;

/// Counts by kind: PostgreSQL frontend messages by type byte (`'B'` Bind, `'E'`
/// Execute, `'P'` Parse, `'Q'` simple Query, `'S'` Sync, …), Redis commands
/// under `'*'`, or MySQL commands by command byte (`'\u{3}'` `COM_QUERY`,
/// `'\u{16}'` `COM_STMT_PREPARE`, `'\u{17}'` `COM_STMT_EXECUTE`, …; a
/// `COM_PING` under [`PING`]). A PostgreSQL `Sync` with nothing before it since the previous
/// one is a ping (how a pool checks a connection, sqlx on every return to the
/// pool) and is counted under [`PING`] instead of `'S'`.
pub type MessageCounts = BTreeMap<char, u64>;

/// The kind under which lone PostgreSQL `Sync`s (pings) are counted; no
/// frontend message has this type byte.
pub const PING: char = '~';

/// The protocol a [`WireCounter`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Postgres,
    Resp,
    MySql,
}

/// MySQL commands the server does not answer (no round trip).
const MYSQL_UNANSWERED: [char; 2] = ['\u{1}', '\u{19}']; // COM_QUIT, COM_STMT_CLOSE
/// MySQL's `COM_PING`.
const MYSQL_PING: u8 = 0x0e;

/// A counting proxy to one server. Connect through [`url`](Self::url); what a
/// client sends is counted, then forwarded unchanged. The proxy stops accepting
/// when dropped (open connections end with their clients).
///
/// Round trips: a PostgreSQL client waits for the server only after `Sync`
/// (extended protocol) or a simple `Query`, so those two are counted, pings
/// apart (see [`MessageCounts`]); a Redis command is one request and one reply.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency_conformance::containers::HarnessError> {
/// use idempotency_conformance::containers::WireCounter;
/// let server = idempotency_conformance::containers::postgres().await?;
/// let counter = WireCounter::postgres(server.url()).await?;
/// let before = counter.snapshot();
/// // … connect a client to counter.url() and run statements …
/// println!("round trips: {}", counter.round_trips_since(&before));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct WireCounter {
    protocol: Protocol,
    counts: Counts,
    url: String,
    accept: JoinHandle<()>,
}

impl WireCounter {
    /// Starts a proxy on 127.0.0.1 (a free port) to the PostgreSQL server of
    /// `url` (`postgres://…`). The proxied URL keeps user, password, database and
    /// options, and adds `sslmode=disable` so messages can be read.
    ///
    /// # Errors
    /// [`HarnessError::Operation`] for a URL that does not parse or a port that
    /// cannot be bound.
    pub async fn postgres(url: &str) -> Result<Self, HarnessError> {
        Self::start(url, Protocol::Postgres, 5432).await
    }

    /// Starts a proxy on 127.0.0.1 (a free port) to the Redis server of `url`
    /// (`redis://…`; not TLS, not cluster). The proxied URL keeps credentials and
    /// database.
    ///
    /// # Errors
    /// As [`postgres`](Self::postgres).
    pub async fn redis(url: &str) -> Result<Self, HarnessError> {
        Self::start(url, Protocol::Resp, 6379).await
    }

    /// Starts a proxy on 127.0.0.1 (a free port) to the MySQL or MariaDB
    /// server of `url` (`mysql://…`). The proxied URL keeps credentials,
    /// database and options, and adds `ssl-mode=disabled` so packets can be
    /// read.
    ///
    /// # Errors
    /// As [`postgres`](Self::postgres).
    pub async fn mysql(url: &str) -> Result<Self, HarnessError> {
        Self::start(url, Protocol::MySql, 3306).await
    }

    async fn start(url: &str, protocol: Protocol, default_port: u16) -> Result<Self, HarnessError> {
        let parsed =
            url::Url::parse(url).map_err(|e| HarnessError::operation("parse the server URL", e))?;
        let host = parsed.host_str().unwrap_or("localhost").to_owned();
        let port = parsed.port().unwrap_or(default_port);
        let (listener, _, mut via) =
            super::fault_proxy::listen_for(&parsed, "the counting proxy").await?;
        let query: Vec<(String, String)> = parsed
            .query_pairs()
            .filter(|(k, _)| k != "sslmode" && k != "ssl-mode")
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let plain = match protocol {
            Protocol::Postgres => Some(("sslmode", "disable")),
            Protocol::MySql => Some(("ssl-mode", "disabled")),
            Protocol::Resp => None,
        };
        if let Some((name, value)) = plain {
            via.query_pairs_mut()
                .clear()
                .extend_pairs(query)
                .append_pair(name, value);
        }
        let counts = Counts::default();
        let accept = tokio::spawn(accept_loop(
            listener,
            (host, port),
            protocol,
            counts.clone(),
        ));
        Ok(WireCounter {
            protocol,
            counts,
            url: via.to_string(),
            accept,
        })
    }

    /// The URL to connect through.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The counts so far.
    pub fn snapshot(&self) -> MessageCounts {
        self.counts.snapshot()
    }

    /// The counts since `before` (a [`snapshot`](Self::snapshot)), without zeros.
    pub fn since(&self, before: &MessageCounts) -> MessageCounts {
        self.snapshot()
            .into_iter()
            .map(|(k, v)| (k, v - before.get(&k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect()
    }

    /// Round trips since `before` that carried statements: PostgreSQL `Sync`
    /// after extended-protocol messages plus simple `Query` messages, Redis
    /// flights of commands (commands the client sent with no reply in between:
    /// one for a single command, one for a whole pipeline; `*` counts the
    /// commands themselves), or MySQL commands the server answers. A pool's pings are left out: when sqlx sends them (after the
    /// caller has its answer, from a background task) depends on scheduling, so
    /// counting them made the figure depend on timing; [`pings_since`](Self::pings_since)
    /// counts them.
    pub fn round_trips_since(&self, before: &MessageCounts) -> u64 {
        let since = self.since(before);
        let count = |kind: char| since.get(&kind).copied().unwrap_or(0);
        match self.protocol {
            Protocol::Postgres => count('S') + count('Q'),
            Protocol::Resp => count(RESP_FLIGHT),
            Protocol::MySql => since
                .iter()
                .filter(|(k, _)| **k != PING && !MYSQL_UNANSWERED.contains(k))
                .map(|(_, v)| v)
                .sum(),
        }
    }

    /// PostgreSQL pings (lone `Sync`s) or MySQL `COM_PING`s since `before`;
    /// always 0 for Redis.
    pub fn pings_since(&self, before: &MessageCounts) -> u64 {
        self.since(before).get(&PING).copied().unwrap_or(0)
    }
}

impl Drop for WireCounter {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

#[derive(Clone, Default, Debug)]
struct Counts(Arc<Mutex<MessageCounts>>);

impl Counts {
    fn snapshot(&self) -> MessageCounts {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn add(&self, kind: u8) {
        self.add_kind(char::from(kind));
    }

    fn add_kind(&self, kind: char) {
        *self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(kind)
            .or_default() += 1;
    }
}

/// The count of Redis flights: commands sent after the server last replied
/// (see [`WireCounter::round_trips_since`]).
pub(crate) const RESP_FLIGHT: char = 'F';

/// Incremental parser of the client side of the protocol.
struct Parser {
    protocol: Protocol,
    started: bool,
    /// Whether a PostgreSQL message other than `Sync` came since the last one.
    pending: bool,
    buf: Vec<u8>,
    counts: Counts,
    /// Whether the server sent anything since the client's last command.
    replied: Arc<std::sync::atomic::AtomicBool>,
}

fn be_u32(bytes: &[u8]) -> usize {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[..4]);
    u32::from_be_bytes(word) as usize
}

/// The length of the line starting at `from` (up to `\r\n`) and the integer it
/// holds after its type byte.
fn resp_line(buf: &[u8], from: usize) -> Option<(usize, i64)> {
    let end = buf.get(from..)?.windows(2).position(|w| w == b"\r\n")?;
    let text = std::str::from_utf8(buf.get(from + 1..from + end)?).ok()?;
    Some((end + 2, text.parse().ok()?))
}

/// The length of one complete RESP command (`*N` followed by N bulk strings) at
/// the start of `buf`, or `None` if it has not fully arrived. Anything else
/// (inline commands, which redis-rs never sends) counts as one command per line.
fn resp_command_len(buf: &[u8]) -> Option<usize> {
    if buf.first() != Some(&b'*') {
        let end = buf.windows(2).position(|w| w == b"\r\n")?;
        return Some(end + 2);
    }
    let (mut at, items) = resp_line(buf, 0)?;
    for _ in 0..items.max(0) {
        match buf.get(at) {
            None => return None,
            Some(b'$') => {}
            Some(_) => return Some(at), // malformed: resynchronise here
        }
        let (line, len) = resp_line(buf, at)?;
        at += line + usize::try_from(len.max(0)).ok()? + 2;
        if buf.len() < at {
            return None;
        }
    }
    Some(at)
}

impl Parser {
    fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
        match self.protocol {
            Protocol::Resp => {
                while let Some(len) = resp_command_len(&self.buf) {
                    self.counts.add(b'*');
                    if self
                        .replied
                        .swap(false, std::sync::atomic::Ordering::SeqCst)
                    {
                        self.counts.add_kind(RESP_FLIGHT);
                    }
                    self.buf.drain(..len.max(1));
                }
                return;
            }
            Protocol::MySql => return self.feed_mysql(),
            Protocol::Postgres => {}
        }
        loop {
            if !self.started {
                // Untyped: SSLRequest / GSSENCRequest / StartupMessage.
                if self.buf.len() < 8 {
                    return;
                }
                let len = be_u32(&self.buf[0..4]).max(8);
                if self.buf.len() < len {
                    return;
                }
                self.started = be_u32(&self.buf[4..8]) == 196_608; // protocol 3.0
                self.buf.drain(..len);
            } else {
                if self.buf.len() < 5 {
                    return;
                }
                let len = be_u32(&self.buf[1..5]).max(4);
                if self.buf.len() < 1 + len {
                    return;
                }
                let kind = self.buf[0];
                if kind != b'S' {
                    self.pending = true;
                    self.counts.add(kind);
                } else if std::mem::take(&mut self.pending) {
                    self.counts.add(kind);
                } else {
                    self.counts.add_kind(PING);
                }
                self.buf.drain(..=len);
            }
        }
    }
}

impl Parser {
    /// MySQL packets: a 3-byte little-endian length, a sequence number, the
    /// payload. A command starts a new exchange at sequence 0 (the handshake
    /// response, continuation packets of a large statement and
    /// authentication packets have other numbers).
    fn feed_mysql(&mut self) {
        while self.buf.len() >= 4 {
            let len = usize::from(self.buf[0])
                | usize::from(self.buf[1]) << 8
                | usize::from(self.buf[2]) << 16;
            if self.buf.len() < 4 + len {
                return;
            }
            if self.buf[3] == 0 && len > 0 {
                match self.buf[4] {
                    MYSQL_PING => self.counts.add_kind(PING),
                    command => self.counts.add(command),
                }
            }
            self.buf.drain(..4 + len);
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: (String, u16),
    protocol: Protocol,
    counts: Counts,
) {
    while let Ok((client, _)) = listener.accept().await {
        let target = target.clone();
        let counts = counts.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect((target.0.as_str(), target.1)).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let replied = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let server_replied = replied.clone();
            let upstream = async move {
                let mut parser = Parser {
                    protocol,
                    started: false,
                    pending: false,
                    buf: Vec::new(),
                    counts,
                    replied,
                };
                let mut chunk = vec![0u8; 64 * 1024];
                loop {
                    let n = match cr.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    parser.feed(&chunk[..n]);
                    if sw.write_all(&chunk[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = sw.shutdown().await;
            };
            let downstream = async move {
                let mut chunk = vec![0u8; 64 * 1024];
                loop {
                    let n = match sr.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    server_replied.store(true, std::sync::atomic::Ordering::SeqCst);
                    if cw.write_all(&chunk[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = cw.shutdown().await;
            };
            tokio::join!(upstream, downstream);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parser_counts_typed_messages_split_across_reads() {
        let counts = Counts::default();
        let mut parser = Parser {
            protocol: Protocol::Postgres,
            started: false,
            pending: false,
            buf: Vec::new(),
            counts: counts.clone(),
            replied: Default::default(),
        };
        // StartupMessage: length 8, protocol 3.0.
        let mut wire = vec![0, 0, 0, 8, 0, 3, 0, 0];
        // Bind (empty body), Execute (4-byte body), Sync.
        wire.extend_from_slice(&[b'B', 0, 0, 0, 4]);
        wire.extend_from_slice(&[b'E', 0, 0, 0, 8, 1, 2, 3, 4]);
        wire.extend_from_slice(&[b'S', 0, 0, 0, 4]);
        // A ping: a Sync alone.
        wire.extend_from_slice(&[b'S', 0, 0, 0, 4]);
        for byte in &wire {
            parser.feed(std::slice::from_ref(byte));
        }
        let expected: MessageCounts = [('B', 1), ('E', 1), ('S', 1), (PING, 1)]
            .into_iter()
            .collect();
        assert_eq!(counts.snapshot(), expected);
    }

    #[test]
    fn resp_commands_are_counted_whole_across_reads() {
        let counts = Counts::default();
        let mut parser = Parser {
            protocol: Protocol::Resp,
            started: true,
            pending: false,
            buf: Vec::new(),
            counts: counts.clone(),
            replied: Default::default(),
        };
        // SET with a binary value holding \r\n, then GET, byte by byte.
        let mut wire = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n".to_vec();
        wire.extend_from_slice(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
        for (i, byte) in wire.iter().enumerate() {
            parser.feed(std::slice::from_ref(byte));
            if i == 25 {
                assert_eq!(counts.snapshot().get(&'*').copied().unwrap_or(0), 0);
            }
        }
        assert_eq!(counts.snapshot().get(&'*'), Some(&2));
        assert!(parser.buf.is_empty());
        assert_eq!(
            counts.snapshot().get(&RESP_FLIGHT),
            None,
            "no reply came before either: one flight, counted from the last reply"
        );
        // A reply, then a pipeline of three commands: one flight.
        parser
            .replied
            .store(true, std::sync::atomic::Ordering::SeqCst);
        parser.feed(&b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n".repeat(3));
        assert_eq!(counts.snapshot().get(&RESP_FLIGHT), Some(&1));
        assert_eq!(counts.snapshot().get(&'*'), Some(&5));
    }
}
