//! One workload per backend: the library and the raw client, side by side.

use async_trait::async_trait;
use idempotency_core::{ExecuteError, HandlerError, IdempotencyManager, Outcome};
use serde::{Deserialize, Serialize};

use crate::{BoxError, Scenario, Variant};

pub mod memory;

#[cfg(feature = "dynamodb")]
pub mod dynamodb;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// Which connections an operation goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The direct connections of the timed rounds.
    Timed,
    /// The connections through the round-trip counter (untimed pass).
    Counted,
}

/// A backend under test: the library's manager and the raw client over the same
/// server.
#[async_trait]
pub trait Workload: Send + Sync + 'static {
    /// `memory`, `sqlite`, `redis`, `postgres`, `mysql` or `dynamodb`.
    fn backend(&self) -> &'static str;

    /// What it runs against (server version, pool size …), for the report.
    fn describe(&self) -> String;

    /// The library's manager over the lane's connections.
    fn manager(&self, lane: Lane) -> &IdempotencyManager;

    /// Completes keys `0..ops` of `ns` through the library (untimed), so that
    /// operations on them are duplicates.
    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError>;

    /// Lets the server finish the background work that writes so far started
    /// (PostgreSQL: `VACUUM ANALYZE` of the workload's table), so that it lands
    /// on no measured round — as `bench/pg-limit.sh` does before each pgbench
    /// run. Called after every [`populate`](Workload::populate).
    async fn settle(&self) -> Result<(), BoxError> {
        Ok(())
    }

    /// One operation on key `i` of `ns`. Fails if the server's answer is not the
    /// scenario's (a duplicate where a first delivery was expected, …).
    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        lane: Lane,
    ) -> Result<(), BoxError>;

    /// Round trips sent through [`Lane::Counted`] so far (`None`: no server).
    async fn round_trips(&self) -> Result<Option<u64>, BoxError> {
        Ok(None)
    }

    /// Commands the server executed so far, by its own counter, if it has one.
    async fn server_commands(&self) -> Result<Option<u64>, BoxError> {
        Ok(None)
    }

    /// Removes what the workload created on the server (tables, functions).
    async fn cleanup(&self) -> Result<(), BoxError> {
        Ok(())
    }
}

/// The message a benchmark operation handles.
#[derive(Debug, Serialize)]
pub struct Payment {
    /// Its number.
    pub id: usize,
    /// Cents.
    pub amount: u64,
}

/// What the trivial handler returns (and the store caches).
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Receipt {
    /// The payment's number.
    pub id: usize,
    /// Always `true`.
    pub ok: bool,
}

/// The serialised [`Receipt`] of the raw baselines: the same bytes the library
/// stores for `id`.
pub fn receipt_bytes(id: usize) -> Vec<u8> {
    serde_json::to_vec(&Receipt { id, ok: true }).unwrap_or_default()
}

/// The record id of key `i` in round namespace `ns` (one allocation: a
/// consumer's message id costs about that; `format!` grows its buffer twice).
pub fn key_id(ns: &str, i: usize) -> String {
    use std::fmt::Write as _;
    let mut id = String::with_capacity(ns.len() + 21);
    let _ = write!(id, "{ns}-{i}");
    id
}

/// The trivial handler the library wraps (and the memory baseline calls).
pub async fn handler(id: usize) -> Result<Receipt, HandlerError<std::convert::Infallible>> {
    Ok(Receipt { id, ok: true })
}

/// One execution through the library, checked against the scenario.
pub async fn execute(
    manager: &IdempotencyManager,
    scenario: Scenario,
    ns: &str,
    i: usize,
) -> Result<(), BoxError> {
    let payment = Payment {
        id: i,
        amount: 4_200,
    };
    let outcome = manager
        .execute(&key_id(ns, i), &payment, || handler(i))
        .await
        .map_err(|e| match e {
            ExecuteError::Idempotency(e) => BoxError::from(e),
            ExecuteError::Handler(never) => match never {},
        })?;
    match (scenario, outcome) {
        (Scenario::Fresh, Outcome::Executed(r))
        | (Scenario::Duplicate | Scenario::Cached, Outcome::Cached(r))
            if r.id == i =>
        {
            Ok(())
        }
        (scenario, outcome) => Err(format!(
            "{scenario} execution of key {i} answered {outcome:?}, not the scenario's outcome"
        )
        .into()),
    }
}

/// Completes keys `0..ops` of `ns` through `manager`, `concurrency` at a time
/// (bounded: a burst of tens of thousands of calls on one connection would
/// measure client-side timeouts, not the store).
pub async fn populate(
    manager: &IdempotencyManager,
    ns: &str,
    ops: usize,
    concurrency: usize,
) -> Result<(), BoxError> {
    use futures::stream::{self, StreamExt, TryStreamExt};
    stream::iter(0..ops)
        .map(|i| execute(manager, Scenario::Fresh, ns, i))
        .buffer_unordered(concurrency.max(1))
        .try_collect::<()>()
        .await
}

/// How many keys the cached scenario redelivers, round robin: duplicates of
/// recent messages, as a cache holds them (a round of a million distinct keys,
/// each redelivered once, would measure the cache's misses).
pub const HOT_KEYS: usize = 10_000;

/// Messages per batch in the batch scenarios.
pub const BATCH: usize = 100;

/// A workload for the scenarios that are not one raw command against one
/// execution: [`Scenario::Cached`] (the library with the local answer cache
/// against the raw client reading the record, over [`HOT_KEYS`] keys round
/// robin) and the batch scenarios (one `execute_batch` of [`BATCH`] messages
/// against the same messages through `execute`, one after another, as a
/// consumer task handles its poll).
pub struct Derived {
    inner: std::sync::Arc<dyn Workload>,
    /// The managers of the scenario, per lane.
    timed: IdempotencyManager,
    counted: IdempotencyManager,
}

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Derived")
            .field("backend", &self.inner.backend())
            .finish()
    }
}

impl Derived {
    /// `inner`'s stores behind managers configured for `scenario`: with the
    /// default answer cache for [`Scenario::Cached`], the bench's configuration
    /// otherwise.
    ///
    /// # Errors
    /// Only if the bench's configuration were invalid.
    pub fn new(inner: std::sync::Arc<dyn Workload>, scenario: Scenario) -> Result<Self, BoxError> {
        let config = match scenario {
            Scenario::Cached => idempotency_core::Config {
                answer_cache: Some(idempotency_core::AnswerCacheConfig::default()),
                ..config()
            },
            _ => config(),
        };
        let over = |lane| {
            let repo = inner.manager(lane).repository().clone();
            IdempotencyManager::new(repo, config.clone())
        };
        let (timed, counted) = (over(Lane::Timed)?, over(Lane::Counted)?);
        Ok(Derived {
            inner,
            timed,
            counted,
        })
    }
}

#[async_trait]
impl Workload for Derived {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn manager(&self, lane: Lane) -> &IdempotencyManager {
        match lane {
            Lane::Timed => &self.timed,
            Lane::Counted => &self.counted,
        }
    }

    /// Completes the keys the scenario redelivers through its own manager
    /// (the cached scenario's answers are its own completions).
    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        if self.timed.config().answer_cache.is_some() {
            let hot = ops.min(HOT_KEYS);
            populate(&self.timed, ns, hot, 1).await?;
            // The counted lane's manager has a cache of its own: it reads each
            // answer once, as a consumer does the first duplicate it sees.
            for i in 0..hot {
                execute(&self.counted, Scenario::Cached, ns, i).await?;
            }
            return Ok(());
        }
        populate(&self.timed, ns, ops * BATCH, 16).await
    }

    async fn settle(&self) -> Result<(), BoxError> {
        self.inner.settle().await
    }

    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        lane: Lane,
    ) -> Result<(), BoxError> {
        let manager = self.manager(lane);
        match (scenario, variant) {
            (Scenario::Cached, Variant::Library) => {
                execute(manager, scenario, ns, i % HOT_KEYS).await
            }
            (Scenario::Cached, Variant::Raw) => {
                let i = i % HOT_KEYS;
                self.inner
                    .op(variant, Scenario::Duplicate, ns, i, lane)
                    .await
            }
            (_, Variant::Library) => {
                execute_batch(manager, scenario, ns, i * BATCH..(i + 1) * BATCH).await
            }
            (_, Variant::Raw) => {
                let single = match scenario {
                    Scenario::BatchFresh => Scenario::Fresh,
                    _ => Scenario::Duplicate,
                };
                for k in i * BATCH..(i + 1) * BATCH {
                    execute(manager, single, ns, k).await?;
                }
                Ok(())
            }
        }
    }

    async fn round_trips(&self) -> Result<Option<u64>, BoxError> {
        self.inner.round_trips().await
    }

    async fn server_commands(&self) -> Result<Option<u64>, BoxError> {
        self.inner.server_commands().await
    }
}

/// One `execute_batch` over keys `keys` of `ns`, every answer checked against
/// the scenario.
pub async fn execute_batch(
    manager: &IdempotencyManager,
    scenario: Scenario,
    ns: &str,
    keys: std::ops::Range<usize>,
) -> Result<(), BoxError> {
    let items: Vec<(String, Payment)> = keys
        .clone()
        .map(|i| {
            (
                key_id(ns, i),
                Payment {
                    id: i,
                    amount: 4_200,
                },
            )
        })
        .collect();
    let answers = manager
        .execute_batch(&items, items.len(), |n, _ctx| handler(items[n].1.id))
        .await;
    for (answer, i) in answers.into_iter().zip(keys) {
        let outcome = answer.map_err(|e| match e {
            ExecuteError::Idempotency(e) => BoxError::from(e),
            ExecuteError::Handler(never) => match never {},
        })?;
        match (scenario, outcome) {
            (Scenario::BatchFresh, Outcome::Executed(r))
            | (Scenario::BatchDuplicate, Outcome::Cached(r))
                if r.id == i => {}
            (scenario, outcome) => {
                return Err(format!(
                "{scenario} execution of key {i} answered {outcome:?}, not the scenario's outcome"
            )
                .into())
            }
        }
    }
    Ok(())
}

/// The bench's manager configuration: the defaults (payload validation and
/// result caching on), under the `bench` prefix.
pub fn config() -> idempotency_core::Config {
    idempotency_core::Config {
        key_prefix: "bench".to_owned(),
        ..idempotency_core::Config::default()
    }
}
