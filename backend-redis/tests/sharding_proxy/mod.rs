//! A proxy in front of two shards that routes each command by its first key,
//! as twemproxy and Envoy's Redis proxy do: a script goes to the shard of its
//! first key whatever its other keys are (or, with [`Scripts::OneKeyOnly`],
//! a script over more than one key is refused in the proxy's own words), and
//! commands without a key go to every shard (the first one's reply is
//! answered). The shards are two
//! databases of one real server, so a script sees only its first key's
//! shard. Commands run one at a time per client connection, in order, so
//! pipelines are answered in order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency_redis::redis::{self, aio::MultiplexedConnection, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does with a script over more than one key.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Scripts {
    /// Sends it to the shard of its first key.
    FirstKey,
    /// Refuses it (`ERR …`), without `CROSSSLOT`.
    OneKeyOnly,
}

/// An error reply: its code and detail.
type Refusal = (String, String);

/// The running proxy; it stops when dropped.
pub(crate) struct ShardingProxy {
    url: String,
    shards: Vec<MultiplexedConnection>,
    multi_key_scripts: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for ShardingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl ShardingProxy {
    /// A proxy on 127.0.0.1 in front of databases 1 and 2 of the server at
    /// `server_url`, treating scripts over many keys as `scripts` says.
    pub(crate) async fn start(server_url: &str, scripts: Scripts) -> Self {
        let client = redis::Client::open(server_url).unwrap();
        let mut shards = Vec::new();
        for db in [1, 2] {
            let mut shard = client.get_multiplexed_async_connection().await.unwrap();
            let () = redis::cmd("SELECT")
                .arg(db)
                .query_async(&mut shard)
                .await
                .unwrap();
            shards.push(shard);
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let multi_key_scripts = Arc::new(AtomicUsize::new(0));
        let (conns, counter) = (shards.clone(), multi_key_scripts.clone());
        let accept = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve(socket, conns.clone(), counter.clone(), scripts));
            }
        });
        ShardingProxy {
            url,
            shards,
            multi_key_scripts,
            accept,
        }
    }

    /// The URL clients connect to.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Scripts over more than one key the proxy has met so far.
    pub(crate) fn multi_key_scripts(&self) -> usize {
        self.multi_key_scripts.load(Ordering::SeqCst)
    }

    /// The shard a key is routed to.
    pub(crate) fn shard_of(key: &[u8]) -> usize {
        let hash = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
        usize::from(hash % 2 == 1)
    }

    /// Whether `key` is stored on shard `shard`.
    pub(crate) async fn holds(&self, shard: usize, key: &str) -> bool {
        let n: i64 = redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut self.shards[shard].clone())
            .await
            .unwrap();
        n == 1
    }
}

async fn serve(
    socket: TcpStream,
    shards: Vec<MultiplexedConnection>,
    counter: Arc<AtomicUsize>,
    scripts: Scripts,
) {
    let (read, mut write) = socket.into_split();
    let mut read = BufReader::new(read);
    while let Some(args) = read_request(&mut read).await {
        let reply = route(&args, &shards, &counter, scripts).await;
        let mut out = Vec::new();
        match reply {
            Ok(value) => encode(&value, &mut out),
            Err((code, detail)) => error_line(Some(&code), Some(&detail), &mut out),
        }
        if write.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// One request (an array of bulk strings), or `None` at the end.
async fn read_request<R: tokio::io::AsyncRead + Unpin>(
    read: &mut BufReader<R>,
) -> Option<Vec<Vec<u8>>> {
    let mut line = String::new();
    if read.read_line(&mut line).await.ok()? == 0 {
        return None;
    }
    let n: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        read.read_line(&mut line).await.ok()?;
        let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut arg = vec![0; len + 2];
        read.read_exact(&mut arg).await.ok()?;
        arg.truncate(len);
        args.push(arg);
    }
    Some(args)
}

/// The command on the shard of its first key, or on every shard.
async fn route(
    args: &[Vec<u8>],
    shards: &[MultiplexedConnection],
    counter: &AtomicUsize,
    scripts: Scripts,
) -> Result<Value, Refusal> {
    let name = String::from_utf8_lossy(&args[0]).to_ascii_uppercase();
    let key = match name.as_str() {
        "EVAL" | "EVALSHA" => {
            let keys: usize = String::from_utf8_lossy(&args[2]).parse().unwrap_or(0);
            if keys > 1 {
                counter.fetch_add(1, Ordering::SeqCst);
                if let Scripts::OneKeyOnly = scripts {
                    let detail = "this proxy runs scripts over one key only".to_owned();
                    return Err(("ERR".to_owned(), detail));
                }
            }
            (keys > 0).then(|| &args[3])
        }
        "SET" | "GET" | "DEL" | "EXISTS" | "PTTL" => args.get(1),
        _ => None,
    };
    let mut cmd = redis::Cmd::new();
    for arg in args {
        cmd.arg(arg.as_slice());
    }
    let reply = match key {
        Some(key) => {
            let mut shard = shards[ShardingProxy::shard_of(key)].clone();
            cmd.query_async(&mut shard).await
        }
        None => {
            let mut first = None;
            for shard in shards {
                let reply = cmd.query_async(&mut shard.clone()).await;
                first.get_or_insert(reply);
            }
            first.unwrap_or(Ok(Value::Nil))
        }
    };
    reply.map_err(|e| {
        let code = e.code().unwrap_or("ERR").to_owned();
        (code, e.detail().unwrap_or_default().to_owned())
    })
}

fn error_line(code: Option<&str>, detail: Option<&str>, out: &mut Vec<u8>) {
    let line = format!("-{} {}\r\n", code.unwrap_or("ERR"), detail.unwrap_or(""));
    out.extend_from_slice(line.as_bytes());
}

/// `value` in RESP2.
fn encode(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Nil => out.extend_from_slice(b"$-1\r\n"),
        Value::Int(n) => out.extend_from_slice(format!(":{n}\r\n").as_bytes()),
        Value::BulkString(bytes) => {
            out.extend_from_slice(format!("${}\r\n", bytes.len()).as_bytes());
            out.extend_from_slice(bytes);
            out.extend_from_slice(b"\r\n");
        }
        Value::Array(items) => {
            out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
            for item in items {
                encode(item, out);
            }
        }
        Value::SimpleString(s) => out.extend_from_slice(format!("+{s}\r\n").as_bytes()),
        Value::Okay => out.extend_from_slice(b"+OK\r\n"),
        Value::ServerError(e) => error_line(Some(e.code()), e.details(), out),
        other => panic!("the sharding proxy cannot encode {other:?}"),
    }
}
