//! Shared plumbing of the checks: a per-check context and assertion macros.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Capabilities, Config, Error, Fingerprint, IdempotencyManager, JsonCodec, ManualClock,
    OwnerToken, Record, RecordKey, Reservation, ReserveRequest, SharedRepository, Status,
    Timestamp,
};

use crate::CheckFailure;

/// The lease every check's reservations get unless it says otherwise.
pub(crate) const LEASE: Duration = Duration::from_secs(30);
/// The expiry every check's reservations get unless it says otherwise.
pub(crate) const TTL: Duration = Duration::from_secs(3600);

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::CheckFailure {
                message: format!("{} [{}:{}]", format!($($fmt)+), file!(), line!()),
            });
        }
    };
}

macro_rules! ensure_eq {
    ($left:expr, $right:expr) => {
        ensure_eq!($left, $right, "")
    };
    ($left:expr, $right:expr, $($fmt:tt)+) => {
        match (&$left, &$right) {
            (left, right) => {
                if left != right {
                    return Err($crate::CheckFailure {
                        message: format!(
                            "`{}` is {:?}, expected {:?}. {} [{}:{}]",
                            stringify!($left), left, right, format!($($fmt)+), file!(), line!()
                        ),
                    });
                }
            }
        }
    };
}

pub(crate) use {ensure, ensure_eq};

impl From<Error> for CheckFailure {
    fn from(e: Error) -> Self {
        CheckFailure {
            message: format!("unexpected error from the repository: {e} ({e:?})"),
        }
    }
}

pub(crate) fn failure(message: impl Into<String>) -> CheckFailure {
    CheckFailure {
        message: message.into(),
    }
}

/// One check's world: the repository, a random namespace, and a manual clock
/// starting at the wall-clock time (so servers that evict by their own clock,
/// like Redis `PX`, never evict before the logical expiry).
pub(crate) struct Ctx {
    pub(crate) repo: SharedRepository,
    pub(crate) clock: ManualClock,
    pub(crate) ns: String,
    pub(crate) caps: Capabilities,
}

impl Ctx {
    pub(crate) fn new(repo: SharedRepository) -> Self {
        let caps = repo.capabilities();
        Ctx {
            repo,
            clock: ManualClock::starting_now(),
            ns: random_namespace(),
            caps,
        }
    }

    pub(crate) fn now(&self) -> Timestamp {
        self.clock.now()
    }

    pub(crate) fn advance(&self, d: Duration) {
        self.clock.advance(d);
    }

    pub(crate) fn key(&self, id: &str) -> RecordKey {
        self.key_in(&self.ns, id)
    }

    pub(crate) fn key_in(&self, ns: &str, id: &str) -> RecordKey {
        // Checks only use non-empty ids and short namespaces.
        RecordKey::new(ns, id, self.caps.max_id_bytes)
            .unwrap_or_else(|e| panic!("conformance suite bug: invalid key ({ns:?}, {id:?}): {e}"))
    }

    /// A request with the default lease and TTL, no fingerprint, no retry.
    pub(crate) fn req<'a>(&self, key: &'a RecordKey, owner: OwnerToken) -> ReserveRequest<'a> {
        let now = self.now();
        ReserveRequest::new(key, owner, now, LEASE, TTL)
    }

    pub(crate) async fn reserve(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<Reservation, CheckFailure> {
        Ok(self.repo.reserve(self.req(key, owner)).await?)
    }

    /// A reservation sent again while the store answers `InProgress`: its
    /// wait on a racer's lock ran out (PostgreSQL's `lock_timeout`, under a
    /// loaded server), nothing was applied, and the contract's answer to it
    /// is "ask again", as the manager does. The race's outcome is what the
    /// next answer says. Bounded: a store that answers `InProgress` for ever
    /// fails the check with that error.
    pub(crate) async fn reserve_answered(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<Reservation, Error> {
        let mut tries = 0;
        loop {
            match self.repo.reserve(self.req(key, owner)).await {
                Err(Error::InProgress { .. }) if tries < 20 => tries += 1,
                answer => return answer,
            }
        }
    }

    /// Reserves a fresh key and insists on `Acquired { attempt: 1 }`.
    pub(crate) async fn acquire(&self, key: &RecordKey) -> Result<OwnerToken, CheckFailure> {
        let owner = OwnerToken::random();
        match self.reserve(key, owner).await? {
            Reservation::Acquired { attempt: 1 } => Ok(owner),
            other => Err(failure(format!(
                "reserving fresh key {key} returned {other:?}, expected Acquired {{ attempt: 1 }}"
            ))),
        }
    }

    /// Takes over a key whose lease ran out, under a new owner, and insists
    /// on `Acquired`.
    pub(crate) async fn acquire_over(&self, key: &RecordKey) -> Result<OwnerToken, CheckFailure> {
        let owner = OwnerToken::random();
        match self.reserve(key, owner).await? {
            Reservation::Acquired { attempt } if attempt > 1 => Ok(owner),
            other => Err(failure(format!(
                "taking over {key} returned {other:?}, expected Acquired {{ attempt > 1 }}"
            ))),
        }
    }

    /// A key that went through `Processing → Completed` with `result`.
    pub(crate) async fn completed(
        &self,
        id: &str,
        result: Option<&[u8]>,
    ) -> Result<(RecordKey, OwnerToken), CheckFailure> {
        let key = self.key(id);
        let owner = self.acquire(&key).await?;
        self.repo
            .complete(&key, owner, result, self.now() + TTL, self.now())
            .await?;
        Ok((key, owner))
    }

    /// A key that went through `Processing → Failed` with `error`.
    pub(crate) async fn failed(
        &self,
        id: &str,
        error: Option<&[u8]>,
    ) -> Result<(RecordKey, OwnerToken), CheckFailure> {
        let key = self.key(id);
        let owner = self.acquire(&key).await?;
        self.repo
            .fail(&key, owner, error, true, self.now() + TTL, self.now())
            .await?;
        Ok((key, owner))
    }

    /// Reserves each key (each must be fresh) and checks that every record is
    /// its own: keys that must be distinct are.
    pub(crate) async fn assert_distinct(&self, keys: &[RecordKey]) -> Result<(), CheckFailure> {
        let mut owners = Vec::with_capacity(keys.len());
        for key in keys {
            let owner = OwnerToken::random();
            match self.reserve(key, owner).await? {
                Reservation::Acquired { attempt: 1 } => owners.push(owner),
                other => {
                    return Err(failure(format!(
                        "{key:?} collided with an earlier, different key: {other:?}"
                    )))
                }
            }
        }
        for (key, owner) in keys.iter().zip(owners) {
            let r = self.record(key).await?;
            ensure_eq!(r.owner, owner, "the record of {key:?}");
        }
        Ok(())
    }

    /// The live record, which must exist.
    pub(crate) async fn record(&self, key: &RecordKey) -> Result<Record, CheckFailure> {
        self.repo
            .get(key, self.now())
            .await?
            .ok_or_else(|| failure(format!("no live record at {key}")))
    }

    pub(crate) async fn status(&self, key: &RecordKey) -> Result<Option<Status>, CheckFailure> {
        Ok(self.repo.get(key, self.now()).await?.map(|r| r.status))
    }

    /// A manager over this context's repository, namespace and clock.
    pub(crate) fn manager(&self, config: Config) -> Result<IdempotencyManager, CheckFailure> {
        let config = Config {
            key_prefix: self.ns.clone(),
            ..config
        };
        Ok(IdempotencyManager::with_parts(
            self.repo.clone(),
            config,
            Arc::new(self.clock.clone()),
            JsonCodec,
        )?)
    }
}

/// `Existing(record)` or a failure naming what came instead.
pub(crate) fn existing(r: Reservation, what: &str) -> Result<Record, CheckFailure> {
    match r {
        Reservation::Existing(rec) => Ok(rec),
        other => Err(failure(format!("{what}: expected Existing, got {other:?}"))),
    }
}

/// Ok when `r` is `Err(LeaseLost)`.
pub(crate) fn lease_lost(r: Result<(), Error>, what: &str) -> Result<(), CheckFailure> {
    match r {
        Err(Error::LeaseLost { .. }) => Ok(()),
        Ok(()) => Err(failure(format!("{what}: succeeded, expected LeaseLost"))),
        Err(e) => Err(failure(format!(
            "{what}: returned {e:?}, expected LeaseLost"
        ))),
    }
}

pub(crate) fn fp(byte: u8) -> Option<Fingerprint> {
    Some(Fingerprint::from_bytes([byte; 32]))
}

/// A namespace no other check (or run) uses.
pub fn random_namespace() -> String {
    format!("conformance-{:016x}", rand::random::<u64>())
}

/// An execution held inside its handler until [`Held::finish`].
pub(crate) struct Held {
    task: tokio::task::JoinHandle<
        Result<idempotency_core::Outcome<i32>, idempotency_core::ExecuteError<String>>,
    >,
    release: tokio::sync::oneshot::Sender<()>,
}

impl Held {
    /// Starts `m.execute(key)` with a handler returning `value`, and returns once
    /// the handler is running (the key is `Processing`).
    pub(crate) async fn start(
        m: &IdempotencyManager,
        key: &str,
        value: i32,
    ) -> Result<Held, CheckFailure> {
        let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
        let (release, release_rx) = tokio::sync::oneshot::channel::<()>();
        let (m, key) = (m.clone(), key.to_owned());
        let task = tokio::spawn(async move {
            m.execute(&key, &(), || async move {
                let _ = entered_tx.send(());
                let _ = release_rx.await;
                Ok::<_, idempotency_core::HandlerError<String>>(value)
            })
            .await
        });
        entered_rx
            .await
            .map_err(|_| failure("the held handler never started"))?;
        Ok(Held { task, release })
    }

    /// Lets the handler return and waits for the execution's outcome.
    pub(crate) async fn finish(self) -> Result<idempotency_core::Outcome<i32>, CheckFailure> {
        let _ = self.release.send(());
        self.task
            .await
            .map_err(|e| failure(format!("held execution panicked: {e}")))?
            .map_err(|e| failure(format!("held execution failed: {e}")))
    }
}
