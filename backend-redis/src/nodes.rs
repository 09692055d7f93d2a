//! Batches on Redis Cluster: one pipeline per primary, on a connection of our
//! own to that primary.
//!
//! A record key hashes whole (the namespace escapes braces, and an id with a
//! brace gets an empty hash tag, see
//! [`RedisRepository::redis_key`](crate::RedisRepository::redis_key)), so the
//! keys of a batch fall on about as many slots as there are keys: a pipeline
//! per slot would be a command per key. A pipeline may carry commands for
//! many slots as long as one node serves them all — each command names one
//! key, so there is never a cross-slot command — and the keys of a batch are
//! grouped by the primary that serves their slot, from the cluster's slot table
//! (`CLUSTER SLOTS`, read when first needed and again after any sign that it
//! changed).
//!
//! The pipelines do not go through the `redis` crate's cluster client: when
//! one command of a pipeline is redirected, it re-sends the *whole* pipeline,
//! which would run the others again (a completion applied twice answers
//! `LeaseLost` for a write that committed). They go on a reconnecting
//! connection to each primary instead, opened like the cluster's own (same
//! credentials, TLS and timeouts), where a command the node does not serve now
//! comes back as its own reply — `MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`,
//! `LOADING`, `READONLY`: not executed — and that key alone goes again as a
//! single command. A failure of a node's pipeline as a whole is every one of
//! its keys' error, as ambiguous as a lost reply, and the table is read again.
//!
//! Single commands take the same connections ([`Nodes::send`]) and follow
//! `MOVED` and `ASK` themselves: the cluster client sends `ASKING` and the
//! command as two requests on a connection every task shares, so under load
//! another request can take the flag between them (the command then comes
//! back `MOVED` to the node that answered `ASK`, and finally fails `ASK`), and
//! right after a slot moved its slot refresh has been seen to stall every
//! request until the response timeout (redis 1.8;
//! `batches_run_once_while_their_slot_moves` in `tests/redis.rs`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;

use futures::future::{BoxFuture, FutureExt, Shared};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, ErrorKind, RedisError, Value};

mod slots;

pub(crate) use slots::{asked_at, by_primary, is_not_served, slot_of, SlotTable};
use slots::{node_failed, redirected_to};

/// The most `MOVED` and `ASK` redirections one command follows (a slot can
/// move while a command chases it).
const REDIRECTS: usize = 5;

/// A new connection to the node at `url`.
async fn open(url: url::Url, config: ConnectionManagerConfig) -> Option<ConnectionManager> {
    let client = redis::Client::open(url.as_str()).ok()?;
    ConnectionManager::new_with_config(client, config)
        .await
        .ok()
}

/// The slot table and our connections to the primaries, for keyed commands
/// and batches.
pub(crate) struct Nodes {
    /// The first node's URL: credentials, TLS and database, with the host and
    /// port replaced per primary.
    template: url::Url,
    config: ConnectionManagerConfig,
    /// The table, and how many times it was forgotten: a read that began
    /// before the latest forget does not keep its table.
    table: RwLock<(Option<Arc<SlotTable>>, u64)>,
    /// Until when not to ask for the table again after it could not be read
    /// or used (commands go through the cluster client meanwhile, and
    /// batches key by key).
    unreadable_until: Mutex<Option<Instant>>,
    /// The read of the table under way, if any (see [`Nodes::table_or_read`]).
    reading: Mutex<Option<Reading>>,
    /// Shared with the tasks that open them.
    links: Arc<Mutex<Links>>,
}

/// How long a table that could not be read or used is not asked for again.
const UNREADABLE_FOR: Duration = Duration::from_secs(5);

/// How long, at least, a primary whose connection could not be opened is not
/// tried again (longer when the failed attempt took longer): meanwhile its
/// commands go through the cluster client, and its keys in a batch one by
/// one, without a connection attempt each.
const LINK_RETRY_AFTER: Duration = Duration::from_secs(1);

/// An attempt to open a connection, shared by every operation waiting for it.
type Opening = Shared<BoxFuture<'static, Option<ConnectionManager>>>;

/// A read of the slot table, by a task of its own, shared by every operation
/// waiting for it.
type Reading = Shared<BoxFuture<'static, Option<Arc<SlotTable>>>>;

/// Our connections to the primaries, by address.
type Links = HashMap<(String, u16), Link>;

/// Our connection to one primary.
enum Link {
    /// Being opened, by a task of its own: an operation that gives up waiting
    /// does not abort it, and its outcome is recorded whoever waits.
    Opening(Opening),
    Open(ConnectionManager),
    /// Could not be opened; not tried again before this instant.
    Failed(Instant),
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nodes").finish_non_exhaustive()
    }
}

impl Nodes {
    /// Connections opened like `template`'s (a node URL of the cluster), with
    /// `config`'s timeouts and retries. `None` for a URL that cannot be read.
    pub(crate) fn new(template: &str, config: ConnectionManagerConfig) -> Option<Self> {
        Some(Nodes {
            template: url::Url::parse(template).ok()?,
            config,
            table: RwLock::default(),
            unreadable_until: Mutex::default(),
            reading: Mutex::default(),
            links: Arc::default(),
        })
    }

    /// The table as known, or as `read` reads it now, in a task of its own,
    /// once for all the operations that find it missing meanwhile: they wait
    /// for that read (each within its own timeout; one that gives up does not
    /// abort it) and take its table, or, when it failed, go without one for
    /// [`UNREADABLE_FOR`]. `None` within that time of a failed read.
    pub(crate) async fn table_or_read<F>(
        self: &Arc<Self>,
        read: impl FnOnce(Arc<Self>) -> F,
    ) -> Option<Arc<SlotTable>>
    where
        F: Future<Output = Option<SlotTable>> + Send + 'static,
    {
        if let Some(table) = self.known_table() {
            return Some(table);
        }
        if !self.may_read() {
            return None;
        }
        let reading = {
            let mut reading = self.lock_reading();
            match &*reading {
                Some(under_way) => under_way.clone(),
                None => {
                    // A read may have ended since the first look.
                    if let Some(table) = self.known_table() {
                        return Some(table);
                    }
                    if !self.may_read() {
                        return None;
                    }
                    let started = self.spawn_read(read(Arc::clone(self)), self.forgotten());
                    *reading = Some(started.clone());
                    started
                }
            }
        };
        reading.await
    }

    /// Runs `read` in a task that keeps its table, or marks the table
    /// unreadable, and then ends the read under way.
    fn spawn_read<F>(self: &Arc<Self>, read: F, forgotten: u64) -> Reading
    where
        F: Future<Output = Option<SlotTable>> + Send + 'static,
    {
        let nodes = Arc::clone(self);
        let task = tokio::spawn(async move {
            let table = match read.await {
                Some(table) => Some(nodes.remember_read(table, forgotten)),
                None => {
                    // Unreadable (an outage) or unusable (unknown endpoints):
                    // without a table for a while, not asking on every operation.
                    nodes.unreadable();
                    None
                }
            };
            *nodes.lock_reading() = None;
            table
        });
        let nodes = Arc::clone(self);
        async move {
            task.await.unwrap_or_else(|_| {
                // The task panicked before it could end the read.
                *nodes.lock_reading() = None;
                None
            })
        }
        .boxed()
        .shared()
    }

    fn lock_reading(&self) -> std::sync::MutexGuard<'_, Option<Reading>> {
        // Nothing panics while holding it.
        self.reading.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The table as last read, if any.
    pub(crate) fn known_table(&self) -> Option<Arc<SlotTable>> {
        self.table
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// Whether the table may be asked for now (not within [`UNREADABLE_FOR`]
    /// of a failure to read or use it).
    pub(crate) fn may_read(&self) -> bool {
        let until = *self
            .unreadable_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        until.is_none_or(|until| Instant::now() >= until)
    }

    /// Records that the table could not be read or used.
    pub(crate) fn unreadable(&self) {
        *self
            .unreadable_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + UNREADABLE_FOR);
    }

    /// How many times the table was forgotten so far.
    fn forgotten(&self) -> u64 {
        self.table.read().unwrap_or_else(|e| e.into_inner()).1
    }

    /// Keeps a table just read until something says it changed, and drops
    /// our connections to nodes it does not name as primaries — unless the
    /// table was forgotten since the read began (`forgotten` is the count
    /// then): a node said it changed after the read began. The operations
    /// that waited for the read still use it once, and follow the
    /// redirections it earns them.
    fn remember_read(&self, table: SlotTable, forgotten: u64) -> Arc<SlotTable> {
        let table = Arc::new(table);
        {
            let mut known = self.table.write().unwrap_or_else(|e| e.into_inner());
            if known.1 != forgotten {
                return table;
            }
            known.0 = Some(Arc::clone(&table));
        }
        self.lock_links().retain(|address, link| {
            !matches!(link, Link::Open(_)) || table.primaries.contains(address)
        });
        table
    }

    /// Forgets the table (a node refused a key it no longer serves, or failed
    /// as a whole), and the connection to a node that failed (opened again on
    /// next use; one that could not be opened stays failed until its retry).
    pub(crate) fn forget(&self, failed: Option<&(String, u16)>) {
        self.forget_table();
        if let Some(address) = failed {
            let mut links = self.lock_links();
            if let Some(Link::Open(_)) = links.get(address) {
                links.remove(address);
            }
        }
    }

    fn forget_table(&self) {
        let mut known = self.table.write().unwrap_or_else(|e| e.into_inner());
        known.0 = None;
        known.1 += 1;
    }

    /// Our connection to the primary at `address`, opened on first use by a
    /// task of its own, once for all the operations that need it meanwhile;
    /// `None` when it cannot be opened (the table is then read again), and
    /// without an attempt until its retry (see [`LINK_RETRY_AFTER`]). A batch's
    /// keys then go one by one, and a single command through the cluster
    /// client.
    pub(crate) async fn link(
        self: &Arc<Self>,
        address: &(String, u16),
    ) -> Option<ConnectionManager> {
        let opening = {
            let mut links = self.lock_links();
            match links.get(address) {
                Some(Link::Open(open)) => return Some(open.clone()),
                Some(Link::Failed(retry)) if Instant::now() < *retry => return None,
                Some(Link::Opening(opening)) => opening.clone(),
                Some(Link::Failed(_)) | None => {
                    let now = Instant::now();
                    links.retain(|_, link| !matches!(link, Link::Failed(retry) if *retry <= now));
                    let opening = self.spawn_open(address);
                    links.insert(address.clone(), Link::Opening(opening.clone()));
                    opening
                }
            }
        };
        opening.await
    }

    /// Opens a connection to `address` in a task of its own, which records
    /// the outcome in the links (a failure also forgets the table: perhaps
    /// the node is no longer a primary).
    fn spawn_open(self: &Arc<Self>, address: &(String, u16)) -> Opening {
        let url = self.url_of(address);
        let config = self.config.clone();
        let nodes = Arc::clone(self);
        let at = address.clone();
        let task = tokio::spawn(async move {
            let began = Instant::now();
            let opened = match url {
                Some(url) => open(url, config).await,
                None => None,
            };
            nodes.opened(at, opened.clone(), began);
            opened
        });
        let nodes = Arc::clone(self);
        let at = address.clone();
        async move {
            task.await.unwrap_or_else(|_| {
                // The task panicked, or its runtime shut down, before it
                // recorded the outcome.
                nodes.opened(at, None, Instant::now());
                None
            })
        }
        .boxed()
        .shared()
    }

    /// Records the outcome of an attempt to open a connection to `address`
    /// that began at `began`.
    fn opened(&self, address: (String, u16), opened: Option<ConnectionManager>, began: Instant) {
        let link = match opened {
            Some(open) => Link::Open(open),
            None => {
                self.forget_table();
                Link::Failed(Instant::now() + LINK_RETRY_AFTER.max(began.elapsed()))
            }
        };
        self.lock_links().insert(address, link);
    }

    /// The template's URL with `address`'s host and port.
    fn url_of(&self, address: &(String, u16)) -> Option<url::Url> {
        let mut url = self.template.clone();
        let host = if address.0.contains(':') {
            format!("[{}]", address.0)
        } else {
            address.0.clone()
        };
        url.set_host(Some(&host)).ok()?;
        url.set_port(Some(address.1)).ok()?;
        Some(url)
    }

    /// `cmd`, whose key is in `slot`, on our connection to the primary that
    /// `table` says serves the slot, following `MOVED` (the table is read
    /// again next time) and `ASK` (see [`Nodes::asking_on`]) to the node named,
    /// at most [`REDIRECTS`] times. A node that does not answer loses its
    /// connection and the table is read again. `None` when the command was
    /// executed nowhere, and goes through the cluster client instead (which
    /// waits out what a failover or a migration makes the nodes answer): the
    /// table names no primary for the slot (a table with a hole, read
    /// again after [`UNREADABLE_FOR`]), no connection to the node opens
    /// (the table is then read again, and that connection tried again after
    /// [`LINK_RETRY_AFTER`]), the redirections run out, or a node refuses the slot for now
    /// (`TRYAGAIN`, `CLUSTERDOWN`, `LOADING`, `READONLY`).
    pub(crate) async fn send(
        self: &Arc<Self>,
        table: &SlotTable,
        slot: u16,
        cmd: &Cmd,
    ) -> Option<Result<Value, RedisError>> {
        let Some(primary) = table.primary(slot).and_then(|p| table.address(p)) else {
            // A table with a hole (a cluster being set up, or a master down
            // with no replica promoted): the cluster client, and the table
            // read again after a while.
            self.forget(None);
            self.unreadable();
            return None;
        };
        let mut address = Cow::Borrowed(primary);
        let mut asking = false;
        for _ in 0..=REDIRECTS {
            let mut link = self.link(&address).await?;
            let reply = if asking {
                Self::asking_on(&mut link, cmd).await
            } else {
                cmd.query_async::<Value>(&mut link).await
            };
            let Err(err) = &reply else {
                return Some(reply);
            };
            if let Some((to, moved)) = redirected_to(err) {
                if moved {
                    self.forget(None);
                }
                (address, asking) = (Cow::Owned(to), !moved);
                continue;
            }
            if node_failed(err) {
                self.forget(Some(&address));
                return Some(reply);
            }
            if is_not_served(err) {
                self.forget(None);
                return None;
            }
            return Some(reply);
        }
        None
    }

    /// The slot table as the first primary we hold a connection to answers
    /// `CLUSTER SLOTS`; `None` when we hold none or none answers usably. The
    /// table is read here before the cluster client is asked, so that reading
    /// it does not wait on the cluster client's own slot refresh.
    pub(crate) async fn read_table(&self) -> Option<SlotTable> {
        let links: Vec<ConnectionManager> = self
            .lock_links()
            .values()
            .filter_map(|link| match link {
                Link::Open(open) => Some(open.clone()),
                Link::Opening(_) | Link::Failed(_) => None,
            })
            .collect();
        for mut link in links {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            if let Ok(reply) = cmd.query_async::<Value>(&mut link).await {
                if let Some(table) = SlotTable::parse(&reply) {
                    return Some(table);
                }
            }
        }
        None
    }

    /// `ASKING` and `cmd` as one pipeline on `link`: nothing can run between
    /// the two on that connection, so the node accepts the command for the
    /// slot it is importing. (The `redis` crate's cluster client sends them as
    /// two requests on a connection every task shares; under load another
    /// request takes the flag in between, the command comes back `MOVED` to
    /// the node that answered `ASK`, and once the client's retries are spent
    /// it fails with `ASK`.) The command's own reply, its error as the node
    /// gave it (a `MOVED` keeps its address).
    async fn asking_on(link: &mut ConnectionManager, cmd: &Cmd) -> Result<Value, RedisError> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("ASKING").ignore().add_command(cmd.clone());
        let mut replies = pipe
            .query_async::<Vec<redis::RedisResult<Value>>>(link)
            .await?;
        match (replies.pop(), replies.is_empty()) {
            (Some(reply), true) => reply,
            _ => Err(RedisError::from((
                ErrorKind::Client,
                "ASKING pipeline: not one reply for the command",
            ))),
        }
    }

    fn lock_links(&self) -> std::sync::MutexGuard<'_, Links> {
        // Nothing panics while holding it; the map stays consistent.
        self.links.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
impl Nodes {
    /// Keeps `table` as if just read.
    fn remember(&self, table: SlotTable) -> Arc<SlotTable> {
        self.remember_read(table, self.forgotten())
    }

    /// The addresses we hold an open connection to.
    fn open_links(&self) -> Vec<(String, u16)> {
        let links = self.lock_links();
        let open = links
            .iter()
            .filter(|(_, link)| matches!(link, Link::Open(_)));
        open.map(|(address, _)| address.clone()).collect()
    }

    /// Lets every connection that failed to open be tried again now.
    fn retry_failed_links(&self) {
        for link in self.lock_links().values_mut() {
            if let Link::Failed(_) = link {
                *link = Link::Failed(Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::slots::tests::{node, range};
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn table() -> SlotTable {
        let reply = Value::Array(vec![range(0, 16383, node("10.0.0.1", 7000))]);
        SlotTable::parse(&reply).unwrap()
    }

    fn nodes(template: &str, config: ConnectionManagerConfig) -> Arc<Nodes> {
        Arc::new(Nodes::new(template, config).unwrap())
    }

    /// Nodes of a cluster never reached (the table tests read no server).
    fn unreached() -> Arc<Nodes> {
        nodes("redis://127.0.0.1:7000", ConnectionManagerConfig::new())
    }

    /// How long a [`counted_read`] takes, on the tests' paused clock.
    const READ_TAKES: Duration = Duration::from_millis(50);

    /// Lets a read started and left by its caller run to its end: the paused
    /// clock jumps past [`READ_TAKES`] as soon as every task is idle.
    async fn past_a_read() {
        // Paused clock (these tests start paused): no real time passes.
        tokio::time::sleep(2 * READ_TAKES).await;
    }

    /// A read of the table that counts itself and takes [`READ_TAKES`].
    fn counted_read(
        reads: &Arc<AtomicUsize>,
        answer: Option<SlotTable>,
    ) -> impl FnOnce(Arc<Nodes>) -> BoxFuture<'static, Option<SlotTable>> {
        let reads = Arc::clone(reads);
        move |_| {
            // Counted when a read is started, not when it is polled.
            reads.fetch_add(1, Ordering::SeqCst);
            async move {
                // The read's own duration, on the paused clock.
                tokio::time::sleep(READ_TAKES).await;
                answer
            }
            .boxed()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn operations_that_miss_the_table_together_read_it_once() {
        let nodes = unreached();
        let reads = Arc::new(AtomicUsize::new(0));
        let read = || counted_read(&reads, Some(table()));
        let tables = futures::future::join_all((0..16).map(|_| nodes.table_or_read(read()))).await;
        assert!(tables.iter().all(Option::is_some));
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        // Known: not read again; forgotten: read again.
        nodes.table_or_read(read()).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        nodes.forget(None);
        nodes.table_or_read(read()).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 2);

        // An operation that gives up waiting leaves the read running: with
        // nobody waiting, it ends and keeps its table.
        nodes.forget(None);
        assert!(
            nodes.table_or_read(read()).now_or_never().is_none(),
            "still reading"
        );
        past_a_read().await;
        assert!(nodes.known_table().is_some());
        nodes.table_or_read(read()).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_table_that_cannot_be_read_is_not_asked_for_again_for_a_while() {
        let nodes = unreached();
        let reads = Arc::new(AtomicUsize::new(0));
        let fail = || counted_read(&reads, None);
        let tables = futures::future::join_all((0..16).map(|_| nodes.table_or_read(fail()))).await;
        assert!(tables.iter().all(Option::is_none));
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        assert!(nodes.table_or_read(fail()).await.is_none());
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_table_read_before_a_forget_is_not_kept() {
        let nodes = unreached();
        let reads = Arc::new(AtomicUsize::new(0));
        let read = || counted_read(&reads, Some(table()));
        assert!(
            nodes.table_or_read(read()).now_or_never().is_none(),
            "reading"
        );
        // A node says the slots moved while the read is under way.
        nodes.forget(None);
        past_a_read().await;
        assert!(nodes.known_table().is_none(), "the older table is not kept");
        nodes.table_or_read(read()).await.unwrap();
        assert!(nodes.known_table().is_some());
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn connections_to_nodes_no_longer_primaries_are_dropped() {
        let server = idempotency_conformance::containers::redis().await.unwrap();
        let url = url::Url::parse(server.url()).unwrap();
        let address = (url.host_str().unwrap().to_owned(), url.port().unwrap());
        let nodes = nodes(server.url(), ConnectionManagerConfig::new());
        assert!(nodes.link(&address).await.is_some(), "a real server");
        let named = |host: &str, port: u16| {
            let reply = Value::Array(vec![range(0, 16383, node(host, i64::from(port)))]);
            SlotTable::parse(&reply).unwrap()
        };
        nodes.remember(named(&address.0, address.1));
        assert_eq!(nodes.open_links(), vec![address.clone()]);
        nodes.remember(named("10.0.0.9", 7000));
        assert!(nodes.open_links().is_empty());
    }

    #[tokio::test]
    async fn a_table_with_a_hole_sends_its_slots_to_the_cluster_client_for_a_while() {
        let nodes = unreached();
        let reply = Value::Array(vec![range(0, 99, node("10.0.0.1", 7000))]);
        let table = nodes.remember(SlotTable::parse(&reply).unwrap());
        assert!(nodes.send(&table, 5000, &redis::cmd("GET")).await.is_none());
        assert!(nodes.known_table().is_none());
        assert!(!nodes.may_read(), "not read again at once");
    }

    /// A server that accepts connections and closes them at once, counting them.
    async fn closing_server() -> (u16, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let server = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(socket);
            }
        });
        (port, accepted, server)
    }

    #[tokio::test]
    async fn a_primary_that_cannot_be_reached_is_tried_once_per_retry_period() {
        let (port, accepted, server) = closing_server().await;
        // Database 1: the connection selects it first, which the server's
        // close makes fail.
        let template = format!("redis://127.0.0.1:{port}/1");
        let config = || {
            ConnectionManagerConfig::new()
                .set_number_of_retries(0)
                .set_connection_timeout(Some(Duration::from_secs(5)))
                .set_response_timeout(Some(Duration::from_secs(5)))
        };
        let address = ("127.0.0.1".to_owned(), port);

        // What one attempt to open costs the server, in connections.
        let once = nodes(&template, config());
        assert!(once.link(&address).await.is_none());
        let per_attempt = accepted.load(Ordering::SeqCst);
        assert!(per_attempt >= 1);

        let nodes = nodes(&template, config());
        nodes.remember(table());
        let links = futures::future::join_all((0..16).map(|_| nodes.link(&address))).await;
        assert!(links.iter().all(Option::is_none));
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2 * per_attempt,
            "one attempt for 16 callers"
        );
        assert!(
            nodes.known_table().is_none(),
            "a primary out of reach: read the table again"
        );
        // Within the retry period: not tried.
        assert!(nodes.link(&address).await.is_none());
        assert_eq!(accepted.load(Ordering::SeqCst), 2 * per_attempt);
        // After it: tried again.
        nodes.retry_failed_links();
        assert!(nodes.link(&address).await.is_none());
        assert_eq!(accepted.load(Ordering::SeqCst), 3 * per_attempt);

        // An operation that gives up waiting leaves the attempt running: with
        // nobody waiting, it ends and records its failure, so the next
        // operation does not try again.
        nodes.retry_failed_links();
        nodes.remember(table());
        assert!(
            nodes.link(&address).now_or_never().is_none(),
            "still opening"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while nodes.known_table().is_some() && Instant::now() < deadline {
            // Polls for the orphaned attempt's end: a real connection attempt
            // that nobody awaits (the point of the test), so real time, each
            // poll 1 ms, bounded by the 10 s deadline above.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(
            nodes.known_table().is_none(),
            "the attempt ended and forgot the table"
        );
        assert!(nodes.link(&address).await.is_none());
        assert_eq!(accepted.load(Ordering::SeqCst), 4 * per_attempt);
        server.abort();
    }
}
