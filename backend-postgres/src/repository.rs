//! [`PgRepository`] and its builder.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use idempotency_core::{
    async_trait, Capabilities, Error, OwnerToken, Record, RecordKey, Repository, Reservation,
    ReserveRequest, Status, Timestamp,
};
use sqlx::{PgConnection, PgPool};

use crate::coalesce::{Batch, Coalescer, CompleteCall, Entry, ReserveCall, Waiting};
use crate::error::{map_sqlx, BACKEND};
use crate::held::{Held, Lent};
use crate::names::{On, Statements};
use crate::ops;
use crate::plan::{First, Planner};
use crate::transaction::PgTransactionRepository;

mod builder;

pub use builder::PgRepositoryBuilder;

/// The environment variables [`PgRepository::from_env`] reads, in order.
pub const ENV_URL_VARS: [&str; 2] = ["IDEMPOTENCY_POSTGRES_URL", "DATABASE_URL"];

/// The default bound on each of this crate's operations, as Redis's response
/// timeout and the manager's `store_timeout`.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// An idempotency [`Repository`] in a PostgreSQL table, on a sqlx [`PgPool`].
///
/// Cheap to clone (the pool and the rendered statements are shared). See the
/// [crate documentation](crate) for the schema, the statements each operation
/// runs and the purge advice.
#[derive(Clone)]
pub struct PgRepository {
    pool: PgPool,
    /// The connections kept between operations (see `held`).
    held: Arc<Held>,
    sql: Arc<Statements>,
    /// The client-side bound on each operation on the pool.
    operation_timeout: Duration,
    /// The bound on operations on a caller's connection (in a transaction):
    /// only an explicitly configured `operation_timeout`. A timer that drops a
    /// statement still waiting on the server would leave the caller's
    /// connection busy behind the row lock it waits for.
    transaction_timeout: Option<Duration>,
    /// Set once the table was found at a schema version this crate may work
    /// on (see [`PgRepository::ensure_schema`]); shared by clones.
    schema_current: Arc<AtomicBool>,
    /// Which statement a single reservation sends first; shared by clones.
    planner: Arc<Planner>,
    /// The slots and queues of coalesced reservations and completions;
    /// shared by clones.
    coalescer: Arc<Coalescer>,
}

impl fmt::Debug for PgRepository {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgRepository")
            .field("table", &self.sql.qualified)
            .field("pool_size", &self.pool.size())
            .field("held_connections", &self.held.limit())
            .field("operation_timeout", &self.operation_timeout)
            .field("lock_timeout", &self.sql.lock_timeout)
            .field("reserve_plan", &self.planner)
            .field("coalesce_above", &self.coalescer.limit())
            .finish_non_exhaustive()
    }
}

impl PgRepository {
    /// A builder: schema, table, pool size and timeouts.
    pub fn builder() -> PgRepositoryBuilder {
        PgRepositoryBuilder::default()
    }

    /// Connects to `url` (`postgres://` or `postgresql://`) with the default
    /// schema (`public`) and table (`idempotency_records`), or those named by the
    /// URL's `schema=` and `table=` options. Does not migrate unless the URL says
    /// `migrate=true`; see [`PgRepository::migrate`].
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL or name, [`Error::Unavailable`] when no
    /// connection can be opened within the acquire timeout (5 s by default).
    pub async fn from_url(url: &str) -> Result<Self, Error> {
        PgRepository::builder().connect(url).await
    }

    /// Connects to the URL in `IDEMPOTENCY_POSTGRES_URL`, else `DATABASE_URL`,
    /// like [`PgRepository::from_url`].
    ///
    /// # Errors
    /// [`Error::Config`] when neither variable is set, else as
    /// [`PgRepository::from_url`].
    pub async fn from_env() -> Result<Self, Error> {
        let url = ENV_URL_VARS
            .iter()
            .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
            .ok_or_else(|| {
                Error::config(format!(
                    "no PostgreSQL URL: set {} or {}",
                    ENV_URL_VARS[0], ENV_URL_VARS[1]
                ))
            })?;
        PgRepository::from_url(&url).await
    }

    /// Uses an existing pool (its own settings — size, TLS, acquire timeout —
    /// are kept) with the default schema and table and the default
    /// [`operation_timeout`](PgRepositoryBuilder::operation_timeout). Use
    /// [`PgRepositoryBuilder::build_with_pool`] to choose them.
    pub fn from_pool(pool: PgPool) -> Self {
        let builder = PgRepositoryBuilder::default();
        let sql = Statements::defaults(builder.effective_lock_timeout());
        builder.assemble(pool, sql, false)
    }

    /// Creates or upgrades the schema, the table, its index and the reservation
    /// function. Idempotent, and safe when several processes start at once: the
    /// migrations run in one transaction under an advisory lock, so exactly one
    /// process applies each version and the others wait, then find it applied.
    ///
    /// Needs the privilege to create tables (and the schema, if missing). Run it
    /// at deployment or start-up; [`connect`](crate::connect) runs it unless the
    /// URL says `migrate=false`.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the server cannot be reached,
    /// [`Error::Config`] for a refused DDL statement (missing privilege).
    pub async fn migrate(&self) -> Result<(), Error> {
        crate::migrate::run(&self.pool, &self.sql).await?;
        self.schema_current.store(true, Ordering::Release);
        Ok(())
    }

    /// Before the first reservation of this repository (and its clones), on
    /// `conn`: refuses, with [`Error::Config`], a table lacking a column this
    /// version's statements write — a handler must not run when its
    /// completion would fail on the older schema. One catalog query until the
    /// table is found complete, nothing afterwards. A missing table is left to
    /// the reservation's own statement, which reports it.
    pub(crate) async fn ensure_schema(&self, conn: &mut PgConnection) -> Result<(), Error> {
        if self.schema_current.load(Ordering::Acquire) {
            return Ok(());
        }
        if let Some(missing) = crate::migrate::missing_columns(conn, &self.sql).await? {
            crate::migrate::require_columns(&missing, &self.sql)?;
            self.schema_current.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// `reserve` on a caller's connection, after
    /// [`ensure_schema`](Self::ensure_schema): always the reservation function.
    /// A caller's transaction may run at `REPEATABLE READ`, where a plain
    /// `INSERT … ON CONFLICT DO NOTHING` meeting a row version newer than the
    /// snapshot fails (40001) while the function answers the record as the
    /// snapshot shows it.
    pub(crate) async fn reserve_in_transaction(
        &self,
        conn: &mut PgConnection,
        request: &ReserveRequest<'_>,
    ) -> Result<Reservation, Error> {
        self.ensure_schema(conn).await?;
        ops::reserve(&self.sql, conn, request, First::Function, On::Caller).await
    }

    /// `reserve` on one of the repository's connections (autocommit, READ
    /// COMMITTED), after [`ensure_schema`](Self::ensure_schema), starting as
    /// the reserve plan says.
    async fn reserve_planned(
        &self,
        conn: &mut PgConnection,
        request: &ReserveRequest<'_>,
    ) -> Result<Reservation, Error> {
        self.ensure_schema(conn).await?;
        let first = self.planner.first();
        let answer = ops::reserve(&self.sql, conn, request, first, On::Own).await;
        if let Ok(reservation) = &answer {
            self.planner.observe(reservation);
        }
        answer
    }

    /// A reservation on its own statement.
    async fn reserve_alone(&self, request: &ReserveRequest<'_>) -> Result<Reservation, Error> {
        self.run("reserve", async |c| self.reserve_planned(c, request).await)
            .await
    }

    /// A completion on its own statement.
    async fn complete_alone(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.run("complete", async |c| {
            let status = Status::Completed;
            ops::finish(
                &self.sql,
                On::Own,
                c,
                key,
                owner,
                status,
                result,
                false,
                expires_at,
                now,
            )
            .await
        })
        .await
    }

    /// The answer of a call waiting to be coalesced, within the operation
    /// timeout. A statement that carried it and ended without answering (its
    /// task was cancelled: the runtime shut down) may have applied it.
    async fn coalesced<T>(
        &self,
        operation: &'static str,
        answer: tokio::sync::oneshot::Receiver<Result<T, Error>>,
    ) -> Result<T, Error> {
        self.timed(operation, async {
            answer.await.unwrap_or_else(|_| {
                Err(Error::Unavailable {
                    backend: BACKEND,
                    message: format!(
                        "{operation}: the coalesced statement carrying it ended without an \
                         answer; it may have been applied"
                    ),
                    source: None,
                })
            })
        })
        .await
    }

    /// Starts a task of the repository's own on a coalescing slot just
    /// taken, which sends the waiting calls until none wait. The slot goes
    /// with the task: given back (or handed on) when it ends, and given back
    /// with every waiting call answered at once when it cannot run (no
    /// runtime, or the runtime shutting down cancels it, before its first
    /// poll or mid-way). No caller's future holds a slot.
    fn send_waiting(&self) {
        let sender = Sender {
            repo: self.clone(),
            finished: false,
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                while let Some(batch) = sender.repo.coalescer.next_batch() {
                    sender.repo.send_batch(batch).await;
                }
                sender.finish();
            });
        }
    }

    /// One coalesced statement (a lone call: its own), and each call's
    /// answer.
    async fn send_batch(&self, batch: Batch) {
        match batch {
            Batch::Reserve(calls) => {
                let shared = if calls.len() > 1 || self.coalescer.over_arrays() {
                    Some(self.reserve_coalesced(&calls).await)
                } else {
                    None
                };
                settle(self, calls, shared).await;
            }
            Batch::Complete(calls) => {
                let shared = if calls.len() > 1 || self.coalescer.over_arrays() {
                    Some(self.complete_coalesced(&calls).await)
                } else {
                    None
                };
                settle(self, calls, shared).await;
            }
        }
    }

    /// Coalesced reservations (keys distinct), as a batch's.
    async fn reserve_coalesced(
        &self,
        calls: &[Waiting<ReserveCall, Reservation>],
    ) -> Vec<Result<Reservation, Error>> {
        let requests: Vec<_> = calls.iter().map(|w| w.call.request()).collect();
        self.reserve_over_arrays(&requests, |i| !calls[i].gone())
            .await
    }

    /// Coalesced completions, as a batch's, each with its own instant.
    async fn complete_coalesced(
        &self,
        calls: &[Waiting<CompleteCall, ()>],
    ) -> Vec<Result<(), Error>> {
        let writes: Vec<_> = calls.iter().map(|w| w.call.completion()).collect();
        self.complete_over_arrays(&writes, |i| calls[i].call.now)
            .await
    }

    /// Reservations of distinct keys over arrays, starting as the reserve
    /// plan says: the plan's first statement for all of them (the plain
    /// insert, the plain read, or the function), then the function for the
    /// keys it left, on one connection (`ops::reserve_planned_many`). Each
    /// answer feeds the planner, as a single reservation's does.
    ///
    /// Request `i` is sent only if `wanted(i)` still holds once the
    /// connection is there: as on the lone path, a caller that gave up while
    /// the statement waited for its turn gets no reservation nobody would
    /// run (its cleanup may already have found nothing to release). It is
    /// answered `Timeout`, and nothing of it was applied.
    async fn reserve_over_arrays(
        &self,
        requests: &[ReserveRequest<'_>],
        wanted: impl Fn(usize) -> bool + Sync,
    ) -> Vec<Result<Reservation, Error>> {
        let mut answers: Vec<_> = requests.iter().map(|_| Err(not_sent("reserve"))).collect();
        if !(0..requests.len()).any(&wanted) {
            // Nobody waits: no turn taken for nothing.
            return answers;
        }
        let batch = self.lend("reserve", async |c| {
            let sent: Vec<usize> = (0..requests.len()).filter(|&i| wanted(i)).collect();
            if sent.is_empty() {
                return Vec::new();
            }
            if let Err(e) = self.ensure_schema(c).await {
                return sent.iter().map(|&i| (i, Err(e.for_another()))).collect();
            }
            let first = self.planner.first();
            let decided = if sent.len() == requests.len() {
                ops::reserve_planned_many(&self.sql, c, requests, first).await
            } else {
                let still: Vec<_> = sent.iter().map(|&i| requests[i].clone()).collect();
                ops::reserve_planned_many(&self.sql, c, &still, first).await
            };
            for reservation in decided.iter().flatten() {
                self.planner.observe(reservation);
            }
            sent.into_iter().zip(decided).collect()
        });
        match self.timed("reserve", batch).await {
            Ok(sent) => {
                for (i, answer) in sent {
                    answers[i] = answer;
                }
            }
            Err(e) => answers.fill_with(|| Err(e.for_another())),
        }
        answers
    }

    /// Completions in one owner-checked `UPDATE` over arrays, write `i` at
    /// instant `now(i)`.
    async fn complete_over_arrays(
        &self,
        writes: &[idempotency_core::Completion<'_>],
        now: impl Fn(usize) -> Timestamp + Send + Sync,
    ) -> Vec<Result<(), Error>> {
        let batch = self.lend("complete", async |c| {
            ops::complete_many(&self.sql, c, writes, &now).await
        });
        match self.timed("complete", batch).await {
            Ok(answers) => answers,
            Err(e) => writes.iter().map(|_| Err(e.for_another())).collect(),
        }
    }

    /// The pool, e.g. to run business statements beside the repository.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.sql.schema
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// The repository's operations on `conn` — typically an open transaction
    /// (`&mut tx` coerces) — so they commit or roll back with the caller's other
    /// writes. See [`PgTransactionRepository`].
    pub fn in_transaction<'a>(&'a self, conn: &'a mut PgConnection) -> PgTransactionRepository<'a> {
        PgTransactionRepository::new(self, conn)
    }

    /// The SQL of each operation, e.g. to review or `EXPLAIN` it.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let repo = idempotency_postgres::PgRepository::builder()
    ///     .connect_lazy("postgres://app@127.0.0.1/app")?;
    /// assert!(repo.statements().reserve().contains("idempotency_records_reserve"));
    /// # Ok::<(), idempotency_core::Error>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn statements(&self) -> &Statements {
        &self.sql
    }

    /// Runs `fut`, on a caller's connection, under an explicitly configured
    /// operation timeout only.
    pub(crate) async fn timed_in_transaction<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        match self.transaction_timeout {
            None => fut.await,
            Some(_) => self.timed(operation, fut).await,
        }
    }

    /// Runs `fut` under the operation timeout.
    pub(crate) async fn timed<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        tokio::time::timeout(self.operation_timeout, fut)
            .await
            .unwrap_or(Err(Error::Timeout {
                backend: BACKEND,
                operation,
            }))
    }

    /// Runs `op` on a lent connection (see [`held_connections`](PgRepositoryBuilder::held_connections))
    /// under the operation timeout.
    async fn run<T>(
        &self,
        operation: &'static str,
        op: impl AsyncFnOnce(&mut PgConnection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        self.timed(operation, async { self.lend(operation, op).await? })
            .await
    }

    /// Runs `op` on a lent connection, which is kept for the next operation
    /// when `op` got the server's answer, and goes back to the pool otherwise
    /// (also when this future is dropped before `op` ends).
    async fn lend<R: Answered>(
        &self,
        operation: &'static str,
        op: impl AsyncFnOnce(&mut PgConnection) -> R,
    ) -> Result<R, Error> {
        let mut conn = self.connection(operation).await?;
        let answer = op(conn.connection()?).await;
        conn.settle(answer.answered());
        Ok(answer)
    }

    /// A connection lent by the repository, for `operation`.
    pub(crate) async fn connection(&self, operation: &'static str) -> Result<Lent, Error> {
        self.held
            .lend()
            .await
            .map_err(|e| map_sqlx(e, operation, None, &self.sql.qualified))
    }
}

/// Whether an operation's answer came from the server, so that its connection
/// is in a known state.
trait Answered {
    fn answered(&self) -> bool;
}

impl<T> Answered for Result<T, Error> {
    fn answered(&self) -> bool {
        !matches!(self, Err(e) if e.is_store_outage())
    }
}

impl<T> Answered for Vec<Result<T, Error>> {
    fn answered(&self) -> bool {
        self.iter().all(Answered::answered)
    }
}

/// Answers of the calls sent, each with its call's index.
impl<T> Answered for Vec<(usize, Result<T, Error>)> {
    fn answered(&self) -> bool {
        self.iter().all(|(_, answer)| answer.answered())
    }
}

/// The answer of a call not sent because its caller gave up: nothing of it
/// was applied.
fn not_sent(operation: &'static str) -> Error {
    Error::Timeout {
        backend: BACKEND,
        operation,
    }
}

/// The slot of a task sending waiting calls (see
/// [`PgRepository::send_waiting`]).
struct Sender {
    repo: PgRepository,
    /// Whether the task ran until no call waited; else it was cancelled or
    /// never ran.
    finished: bool,
}

impl Sender {
    /// No call waits any more: the slot is given back (or handed on).
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        if !self.finished {
            self.repo.coalescer.abandon();
        } else if self.repo.coalescer.leave() {
            self.repo.send_waiting();
        }
    }
}

/// Gives each coalesced call its answer: the shared statement's, when it is
/// the call's own; else (a lone call, or one the shared statement refused as
/// a whole) the answer of a statement of its own, each as soon as it has it.
///
/// A shared statement's definite error that is not a call's own — a key of
/// another call locked past the batch's `lock_timeout`, any other server
/// error (`Backend`: nothing was applied) — sends the call again alone. Its
/// own answers (`LeaseLost`, a key or a result the table cannot hold, a
/// corrupt record) and outages (maybe applied, as for a single statement)
/// stand.
async fn settle<C: Alone>(
    repo: &PgRepository,
    calls: Vec<Waiting<C, C::Answer>>,
    shared: Option<Vec<Result<C::Answer, Error>>>,
) {
    let mut again = Vec::new();
    match shared {
        Some(answers) => {
            for (waiting, answer) in calls.into_iter().zip(answers) {
                match answer {
                    Err(Error::Backend { .. }) => again.push(waiting),
                    answer => waiting.answer(answer),
                }
            }
        }
        None => again = calls,
    }
    // A caller that gave up meanwhile is not sent again. All at once, each
    // on a connection of its own (their number bounded by the repository's
    // turns, `held_connections`): one at a time, a key still locked would
    // hold the others behind it. Each on a task of its own, which the sender
    // waits for only so long (`DETACH_AFTER`): a statement waiting on a row
    // lock finishes there, and the sender goes on with the next waiting
    // calls instead of holding its slot, and them, until it ends.
    let each: Vec<_> = again
        .into_iter()
        .filter(|w| !w.gone())
        .map(|waiting| {
            let repo = repo.clone();
            tokio::spawn(async move {
                let wanted = || !waiting.gone();
                let answer = waiting.call.alone(&repo, &wanted).await;
                waiting.answer(answer);
            })
        })
        .collect();
    if each.is_empty() {
        return;
    }
    let all = futures::future::join_all(each);
    let _detached = tokio::time::timeout(repo.coalescer.detach_after(), all).await;
}

/// Whether the caller of a coalesced call still waits for its answer.
type Wanted<'a> = &'a (dyn Fn() -> bool + Sync);

/// A coalesced call sent on a statement of its own.
trait Alone: Sync + Send + 'static {
    type Answer: Send + 'static;
    fn alone<'a>(
        &'a self,
        repo: &'a PgRepository,
        wanted: Wanted<'a>,
    ) -> BoxFuture<'a, Result<Self::Answer, Error>>;
}

impl Alone for ReserveCall {
    type Answer = Reservation;
    /// Not sent when its caller gave up while it waited for a connection:
    /// as on the single path, a reservation nobody will run is not made (a
    /// caller's cleanup may already have found nothing to release).
    fn alone<'a>(
        &'a self,
        repo: &'a PgRepository,
        wanted: Wanted<'a>,
    ) -> BoxFuture<'a, Result<Reservation, Error>> {
        Box::pin(async move {
            let request = self.request();
            // `None`: not sent; the connection, unused, is kept.
            let sent = repo
                .run("reserve", async |c| {
                    if !wanted() {
                        return Ok(None);
                    }
                    repo.reserve_planned(c, &request).await.map(Some)
                })
                .await;
            sent.and_then(|answer| answer.ok_or_else(|| not_sent("reserve")))
        })
    }
}

impl Alone for CompleteCall {
    type Answer = ();
    /// Sent whether or not its caller still waits: a completion is owner
    /// checked, and one its caller gave up on may still record the outcome.
    fn alone<'a>(
        &'a self,
        repo: &'a PgRepository,
        _wanted: Wanted<'a>,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let (key, owner, result) = (self.key(), self.owner(), self.result());
        Box::pin(repo.complete_alone(key, owner, result, self.expires_at(), self.now))
    }
}

#[async_trait]
impl Repository for PgRepository {
    fn capabilities(&self) -> Capabilities {
        // A reservation waits at most `lock_timeout` on another holder's row.
        ops::capabilities().with_max_lock_wait(Some(self.sql.lock_timeout))
    }

    fn admin(&self) -> Option<&dyn idempotency_core::admin::Admin> {
        Some(self)
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        match self.coalescer.enter_reserve(&request) {
            Entry::Alone => self.reserve_alone(&request).await,
            Entry::Queued { answer, send } => {
                if send {
                    self.send_waiting();
                }
                self.coalesced("reserve", answer).await
            }
        }
    }

    /// The batch over arrays, as coalesced reservations are sent: one
    /// statement (and one round trip) when the reserve plan's first
    /// statement decides every key (fresh keys inserting first, duplicates
    /// reading first), else a second one, the function, for the keys left.
    ///
    /// A statement refused as a whole — a key of it locked by another
    /// transaction past the batch's lock bound, or any other server error
    /// of the statement (`Backend`: nothing of it applied) — is not the
    /// answer of every key: each of its keys is sent again on a statement
    /// of its own, all at once, where a key another transaction holds is
    /// answered [`Error::InProgress`] and every other key its own answer.
    async fn reserve_many(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        if requests.len() < 2 {
            return futures::future::join_all(requests.into_iter().map(|r| self.reserve(r))).await;
        }
        let mut answers = self.reserve_over_arrays(&requests, |_| true).await;
        let refused: Vec<usize> = (0..answers.len())
            .filter(|&i| matches!(answers[i], Err(Error::Backend { .. })))
            .collect();
        let alone = refused.iter().map(|&i| self.reserve_alone(&requests[i]));
        for (i, answer) in refused.iter().zip(futures::future::join_all(alone).await) {
            answers[*i] = answer;
        }
        answers
    }

    /// One statement (and one round trip) for the whole batch: an `UPDATE`
    /// over arrays.
    async fn complete_many(
        &self,
        completions: Vec<idempotency_core::Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        if completions.len() < 2 {
            let each = completions
                .into_iter()
                .map(|c| self.complete(c.key, c.owner, c.result, c.expires_at, now));
            return futures::future::join_all(each).await;
        }
        // Statements of at most `MOST_BYTES` of results each (one over it
        // alone), all at once: a batch of large results never builds a bind
        // message near PostgreSQL's 1 GiB limit.
        let mut chunks: Vec<&[idempotency_core::Completion<'_>]> = Vec::new();
        let (mut start, mut bytes) = (0, 0usize);
        for (i, c) in completions.iter().enumerate() {
            let its = c.result.map_or(0, <[u8]>::len);
            if !crate::coalesce::joins(bytes, its, i == start) {
                chunks.push(&completions[start..i]);
                (start, bytes) = (i, 0);
            }
            bytes = bytes.saturating_add(its);
        }
        chunks.push(&completions[start..]);
        let sent = chunks
            .into_iter()
            .map(|chunk| self.complete_over_arrays(chunk, |_| now));
        futures::future::join_all(sent)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let call = || CompleteCall::new(key, owner, result, expires_at, now);
        match self.coalescer.enter_complete(call) {
            Entry::Alone => {
                self.complete_alone(key, owner, result, expires_at, now)
                    .await
            }
            Entry::Queued { answer, send } => {
                if send {
                    self.send_waiting();
                }
                self.coalesced("complete", answer).await
            }
        }
    }

    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.run("fail", async |c| {
            let status = Status::Failed;
            ops::finish(
                &self.sql,
                On::Own,
                c,
                key,
                owner,
                status,
                error,
                retryable,
                expires_at,
                now,
            )
            .await
        })
        .await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.run("release", async |c| {
            ops::release(&self.sql, On::Own, c, key, owner, now).await
        })
        .await
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.run("extend", async |c| {
            let (sql, on) = (&self.sql, On::Own);
            ops::extend(sql, on, c, key, owner, lease_until, expires_at, now).await
        })
        .await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        self.run("get", async |c| ops::get(&self.sql, c, key, now).await)
            .await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        self.run("delete", async |c| {
            ops::delete(&self.sql, On::Own, c, key).await
        })
        .await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        self.run("purge_expired", async |c| {
            ops::purge(&self.sql, c, now, limit).await
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::{DEFAULT_SCHEMA, DEFAULT_TABLE};

    #[test]
    fn defaults_are_valid_names() {
        assert!(Statements::new(DEFAULT_SCHEMA, DEFAULT_TABLE).is_ok());
    }

    /// A repository with one coalescing slot, taken for a sender not yet
    /// started, and a reservation waiting (no server: nothing is sent).
    fn a_slot_taken_and_a_call_waiting() -> (
        PgRepository,
        tokio::sync::oneshot::Receiver<Result<Reservation, Error>>,
    ) {
        let repo = PgRepository::builder()
            .coalesce_above(1)
            .connect_lazy("postgres://nobody@127.0.0.1:1/nothing")
            .unwrap();
        let key = RecordKey::new("ns", "k", 64).unwrap();
        let Entry::Queued { answer, send: true } = repo.coalescer.enter_reserve(&request(&key))
        else {
            panic!("the first call takes the free slot");
        };
        (repo, answer)
    }

    fn slot_is_free(repo: &PgRepository) -> bool {
        let key = RecordKey::new("ns", "other", 64).unwrap();
        let entry = repo.coalescer.enter_reserve(&request(&key));
        matches!(entry, Entry::Queued { send: true, .. })
    }

    fn request(key: &RecordKey) -> ReserveRequest<'_> {
        let now = Timestamp::from_millis(1);
        ReserveRequest {
            key,
            owner: OwnerToken::random(),
            fingerprint: None,
            now,
            lease_until: now,
            expires_at: now,
            retry_failed: false,
            clock_skew: Duration::ZERO,
        }
    }

    fn a_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    #[test]
    fn a_sender_the_runtime_cancels_before_it_runs_frees_its_slot() {
        let runtime = a_runtime();
        let (repo, mut waiting) = runtime.block_on(async { a_slot_taken_and_a_call_waiting() });
        // The sender is spawned, and the runtime shuts down before polling it.
        runtime.block_on(async { repo.send_waiting() });
        assert!(waiting.try_recv().is_err(), "not answered yet");
        drop(runtime);
        assert!(matches!(
            waiting.try_recv(),
            Ok(Err(Error::Unavailable { .. }))
        ));
        assert!(slot_is_free(&repo), "the slot was given back");
        a_runtime().block_on(async { drop(repo) });
    }

    #[test]
    fn without_a_runtime_waiting_calls_are_answered_and_the_slot_freed() {
        // The pool is made on a runtime, the sender is started outside it.
        let runtime = a_runtime();
        let (repo, mut waiting) = runtime.block_on(async { a_slot_taken_and_a_call_waiting() });
        repo.send_waiting();
        assert!(matches!(
            waiting.try_recv(),
            Ok(Err(Error::Unavailable { .. }))
        ));
        assert!(slot_is_free(&repo));
        runtime.block_on(async { drop(repo) });
    }

    #[tokio::test]
    async fn hostile_names_are_rejected_before_any_connection() {
        let lazy = PgRepository::builder()
            .table("x\"; DROP TABLE users; --")
            .connect_lazy("postgres://localhost/db");
        assert!(matches!(lazy, Err(Error::Config { .. })));
        let url = PgRepository::builder().connect_lazy("postgres://localhost/db?schema=a%20b");
        assert!(matches!(url, Err(Error::Config { .. })));
    }
}
