//! The connections a [`PgRepository`](crate::PgRepository) keeps between its
//! own operations, so that an operation is one round trip.
//!
//! sqlx's pool pings every connection it gets back (its release check; no
//! option turns it off), which doubles the round trips of a one-statement
//! operation and adds about as much server CPU as the statement itself. The
//! repository therefore keeps the connections its operations ended cleanly on,
//! checked out of the pool, and lends them to its next operations:
//!
//! - **Clean end → kept.** An operation that got its answer puts the
//!   connection back here, with no ping: the server has answered every message
//!   sent on it (an unread tail, e.g. after `fetch_one`, is drained by sqlx on
//!   the next use, before anything else is read).
//! - **Anything else → back to the pool.** A cancelled operation (the caller
//!   gave up, a timer fired), an outage or a timeout hands its connection to
//!   sqlx's pool, whose release ping drains whatever is still on the wire in
//!   the background (or closes a broken connection) — never on the next
//!   operation's path, and never by dropping a healthy connection, which under
//!   load would turn each cancelled statement into a reconnect.
//! - **Bounded.** At most [`held_connections`](crate::PgRepositoryBuilder::held_connections)
//!   operations run at once (they wait their turn, up to the pool's acquire
//!   timeout); a connection unused for [`IDLE`] goes back to the pool (a task
//!   looks every [`IDLE`], so within twice that), every connection goes back
//!   once [`RECYCLE`] after it was taken, so the pool's lifetime checks and its
//!   other users get their turn, and all of them as soon as the pool is closed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Connection as _, PgConnection, PgPool, Postgres};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a kept connection may sit unused before it goes back to the pool.
pub(crate) const IDLE: Duration = Duration::from_secs(1);

/// How long after it was taken from the pool a connection goes back to it,
/// however busy (one release ping per connection per period).
pub(crate) const RECYCLE: Duration = Duration::from_secs(30);

/// The repository's kept connections and the turns of its operations.
pub(crate) struct Held {
    shared: Arc<Shared>,
}

struct Shared {
    /// The pool the connections come from and go back to.
    pool: PgPool,
    /// One permit per operation running on a lent connection.
    turns: Arc<Semaphore>,
    /// How many operations may run at once; 0: every operation takes its
    /// connection from the pool and gives it back (sqlx pings it).
    limit: usize,
    /// Kept connections, the most recently used last.
    idle: Mutex<VecDeque<Idle>>,
    /// How long an operation waits for its turn (the pool's acquire timeout).
    acquire_timeout: Duration,
    /// Whether a task is returning idle connections to the pool.
    sweeping: Mutex<bool>,
}

struct Idle {
    conn: PoolConnection<Postgres>,
    taken: Instant,
    since: Instant,
}

impl Held {
    /// Keeps up to `limit` connections of `pool` (0: none).
    pub(crate) fn new(pool: PgPool, limit: usize) -> Self {
        let acquire_timeout = pool.options().get_acquire_timeout();
        Held {
            shared: Arc::new(Shared {
                pool,
                turns: Arc::new(Semaphore::new(limit.max(1))),
                limit,
                idle: Mutex::new(VecDeque::new()),
                acquire_timeout,
                sweeping: Mutex::new(false),
            }),
        }
    }

    /// How many operations may run at once on kept connections.
    pub(crate) fn limit(&self) -> usize {
        self.shared.limit
    }

    /// A connection for one operation: a kept one, else one from the pool.
    ///
    /// # Errors
    /// `PoolTimedOut` when no turn or no pooled connection comes within the
    /// pool's acquire timeout; the pool's connect errors.
    pub(crate) async fn lend(&self) -> Result<Lent, sqlx::Error> {
        let pool = &self.shared.pool;
        if self.shared.limit == 0 || pool.is_closed() {
            // Closed: the pool refuses with `PoolClosed`; kept connections go
            // back to it, so that `close()` can finish.
            self.shared.release_all();
            let conn = pool.acquire().await?;
            return Ok(Lent::unkept(conn));
        }
        let turns = Arc::clone(&self.shared.turns);
        let permit = tokio::time::timeout(self.shared.acquire_timeout, turns.acquire_owned())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        // The last kept first; one unused for `IDLE` already (the sweeper
        // not yet by) goes back to the pool instead, whose ping replaces it
        // if the server ended it while idle (`idle_session_timeout`).
        let kept = lock(&self.shared.idle)
            .pop_back()
            .filter(|idle| idle.since.elapsed() < IDLE);
        let (conn, taken) = match kept {
            Some(idle) => (idle.conn, idle.taken),
            None => (pool.acquire().await?, Instant::now()),
        };
        Ok(Lent {
            conn: Some(conn),
            taken,
            clean: false,
            shared: Some(Arc::clone(&self.shared)),
            _turn: Some(permit),
        })
    }
}

impl Shared {
    /// Keeps `conn` for the next operation, and makes sure a task returns it
    /// to the pool if nothing uses it for [`IDLE`].
    fn keep(self: &Arc<Self>, conn: PoolConnection<Postgres>, taken: Instant) {
        if self.pool.is_closed() {
            drop(conn);
            self.release_all();
            return;
        }
        let now = Instant::now();
        lock(&self.idle).push_back(Idle {
            conn,
            taken,
            since: now,
        });
        let mut sweeping = lock(&self.sweeping);
        if !*sweeping {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                *sweeping = true;
                runtime.spawn(sweep(Arc::downgrade(self)));
            }
        }
    }

    /// Hands every kept connection back to the pool.
    fn release_all(&self) {
        let all = std::mem::take(&mut *lock(&self.idle));
        drop(all);
    }

    /// Hands the connections unused for [`IDLE`] (all of them once the pool
    /// is closed) back to the pool; whether any are left to watch.
    fn sweep_once(&self) -> bool {
        let closed = self.pool.is_closed();
        let mut sweeping = lock(&self.sweeping);
        let mut idle = lock(&self.idle);
        let mut stale = Vec::new();
        while idle
            .front()
            .is_some_and(|i| closed || i.since.elapsed() >= IDLE)
        {
            stale.extend(idle.pop_front());
        }
        // Decided under both locks: a `keep` after this sees `false` and starts
        // a new task; one before it left a connection counted here.
        *sweeping = !idle.is_empty();
        let more = *sweeping;
        drop(idle);
        drop(sweeping);
        // Dropped: sqlx's pool takes them back (and pings them) in the background.
        drop(stale);
        more
    }
}

/// The task returning idle connections to the pool; it ends when none is
/// kept or the repository is gone.
async fn sweep(shared: Weak<Shared>) {
    // Dropped with the task — also when its runtime shuts down mid-sleep — so
    // that the next `keep` starts a new one rather than trusting a dead task.
    let _ended = SweepEnded(shared.clone());
    loop {
        // The sweeper's period (real time: idleness is measured in real time).
        tokio::time::sleep(IDLE).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if !shared.sweep_once() {
            return;
        }
    }
}

struct SweepEnded(Weak<Shared>);

impl Drop for SweepEnded {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            *lock(&shared.sweeping) = false;
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let idle = std::mem::take(self.idle.get_mut().unwrap_or_else(|e| e.into_inner()));
        if tokio::runtime::Handle::try_current().is_ok() {
            // Back to the pool, in the background.
            drop(idle);
        } else {
            // sqlx returns a connection to its pool on a task, which needs a
            // runtime: outside one, close them instead. `detach` lowers the
            // pool's count, but then spawns a task when the pool keeps a
            // minimum of connections; `leak` does not (that pool is one
            // connection short for good: the repository was dropped outside
            // any runtime).
            let keeps_minimum = self.pool.options().get_min_connections() > 0;
            for kept in idle {
                drop(if keeps_minimum {
                    kept.conn.leak()
                } else {
                    kept.conn.detach()
                });
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing here panics while holding a lock; if something did, the data
    // (a list of connections, a flag) is still consistent.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connection lent to one operation. Dropped without
/// [`settle`](Lent::settle) marking it clean, it goes back to sqlx's pool.
pub(crate) struct Lent {
    conn: Option<PoolConnection<Postgres>>,
    taken: Instant,
    clean: bool,
    shared: Option<Arc<Shared>>,
    /// Released after the connection is kept, so the next operation finds it.
    _turn: Option<OwnedSemaphorePermit>,
}

impl Lent {
    fn unkept(conn: PoolConnection<Postgres>) -> Self {
        Lent {
            conn: Some(conn),
            taken: Instant::now(),
            clean: false,
            shared: None,
            _turn: None,
        }
    }

    /// Records how the operation ended: `answered` when the server answered
    /// it (a result, or the server's own refusal), and the connection can be
    /// kept; otherwise (an outage, a timeout) it goes back to the pool, which
    /// checks it.
    pub(crate) fn settle(&mut self, answered: bool) {
        self.clean = answered;
    }

    /// The connection, for the operation's statements.
    ///
    /// # Errors
    /// Never in practice: the connection leaves only when this is dropped.
    pub(crate) fn connection(&mut self) -> Result<&mut PgConnection, idempotency_core::Error> {
        self.conn
            .as_deref_mut()
            .ok_or_else(|| idempotency_core::Error::Unavailable {
                backend: crate::error::BACKEND,
                message: "a lent connection was already given back".into(),
                source: None,
            })
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let (Some(conn), Some(shared)) = (self.conn.take(), self.shared.as_ref()) else {
            return;
        };
        // A connection still inside a transaction (a dropped `Transaction`
        // whose `ROLLBACK` is only queued) is never kept: it goes back to
        // sqlx's pool, whose release ping sends the queued `ROLLBACK` first.
        if self.clean && self.taken.elapsed() < RECYCLE && !conn.is_in_transaction() {
            shared.keep(conn, self.taken);
        }
        // Otherwise `conn` drops here: sqlx's pool takes it back, pings it in
        // the background (draining a cancelled statement), and closes it if
        // broken or past its lifetime.
    }
}
