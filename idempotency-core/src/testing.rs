//! Test doubles for users, backend authors and this crate's own tests.
//!
//! [`FaultyRepository`] wraps any repository and injects the failures a real
//! store produces: an outage (refused before anything is applied), a lost reply
//! (applied, then the caller sees a timeout — the ambiguous case), a reply that
//! never comes, and delays. Faults are queued per operation and consumed in
//! order, so a test says exactly which call fails and how:
//!
//! ```
//! use std::sync::Arc;
//! use idempotency_core::testing::{Fault, FaultyRepository, Operation};
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build()?.block_on(async {
//! let store = Arc::new(FaultyRepository::new(MemoryRepository::new()));
//! // The first `complete` is applied, but its reply is lost on the wire.
//! store.inject(Operation::Complete, Fault::LoseReply, 1);
//! let manager = IdempotencyManager::new(store.clone(), Config::default())?;
//! let outcome = manager
//!     .execute("order-1", &(), || async { Ok::<_, HandlerError<String>>(7) })
//!     .await?;
//! // The manager retried with the same owner token and recognised its own write.
//! assert!(matches!(outcome, Outcome::Executed(7)));
//! assert_eq!(store.calls(Operation::Complete), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use crate::error::Error;
use crate::key::{OwnerToken, RecordKey};
use crate::record::Record;
use crate::repository::{
    Capabilities, OwnedReserveRequest, Repository, Reservation, ReserveRequest,
};
use crate::time::{Clock, Timestamp};

/// A repository operation, to aim a [`Fault`] at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// [`Repository::reserve`].
    Reserve,
    /// [`Repository::complete`].
    Complete,
    /// [`Repository::fail`].
    Fail,
    /// [`Repository::release`].
    Release,
    /// [`Repository::extend`].
    Extend,
    /// [`Repository::get`].
    Get,
    /// [`Repository::delete`].
    Delete,
    /// [`Repository::purge_expired`].
    PurgeExpired,
    /// [`Repository::reserve_many`], as one call: a fault aimed at it hits the
    /// whole batch (each request then gets the same error); the requests
    /// themselves go to the inner store's `reserve_many`.
    ReserveMany,
    /// [`Repository::complete_many`], as one call (like
    /// [`Operation::ReserveMany`]).
    CompleteMany,
}

impl Operation {
    /// Every operation.
    pub const ALL: [Operation; 10] = [
        Operation::Reserve,
        Operation::Complete,
        Operation::Fail,
        Operation::Release,
        Operation::Extend,
        Operation::Get,
        Operation::Delete,
        Operation::PurgeExpired,
        Operation::ReserveMany,
        Operation::CompleteMany,
    ];

    /// The operation's name (`reserve`, `complete`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            Operation::Reserve => "reserve",
            Operation::Complete => "complete",
            Operation::Fail => "fail",
            Operation::Release => "release",
            Operation::Extend => "extend",
            Operation::Get => "get",
            Operation::Delete => "delete",
            Operation::PurgeExpired => "purge_expired",
            Operation::ReserveMany => "reserve_many",
            Operation::CompleteMany => "complete_many",
        }
    }
}

/// What happens to one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Refused before reaching the store: [`Error::Unavailable`], nothing applied.
    Unavailable,
    /// Refused with a non-retryable [`Error::Backend`] (a store that says no:
    /// out of memory, a permission), nothing applied.
    Refuse,
    /// Applied by the store, then the reply is lost: [`Error::Timeout`]. The
    /// ambiguous case a retry with the same owner token must resolve.
    LoseReply,
    /// Applied by the store, then the reply cannot be read: a non-retryable
    /// [`Error::Backend`] (a reply the client fails to decode after the
    /// write).
    GarbleReply,
    /// Never answers and applies nothing (a black-holed request). Only a
    /// timeout around the call ends it.
    Hang,
    /// Applied, then the reply never comes.
    ApplyThenHang,
    /// Applied after this delay (of Tokio time, so paused-time tests stay
    /// instant).
    Delay(Duration),
    /// The client re-sent the request after a connection reset (as the Redis
    /// cluster client and the AWS SDK do): applied twice, and the caller gets
    /// the second answer — e.g. `LeaseLost` for a `complete` that the first
    /// send applied.
    Resend,
    /// The repository panics instead of answering, applying nothing (a bug in
    /// a custom backend): the manager must not lose the other work in flight.
    Panic,
    /// A `reserve` held on its way, never answered: it reaches the store
    /// only when the test calls [`FaultyRepository::deliver_held`], as a
    /// request that lands after its caller gave up (and after the cleanup
    /// that followed). Other operations: as [`Fault::Hang`].
    HoldOnTheWay,
}

#[derive(Debug)]
struct Planned {
    operation: Operation,
    fault: Fault,
    remaining: usize,
}

/// A repository that forwards to `inner`, except for the faults injected.
///
/// Faults aimed at an operation are consumed first-in first-out, one per call;
/// [`FaultyRepository::set_unavailable`] refuses every call while set. Calls are
/// counted per operation, faulty ones included.
pub struct FaultyRepository<R> {
    inner: R,
    plan: Mutex<Vec<Planned>>,
    unavailable: AtomicBool,
    calls: [AtomicUsize; Operation::ALL.len()],
    /// Reservations held by [`Fault::HoldOnTheWay`].
    held: Mutex<Vec<OwnedReserveRequest>>,
}

impl<R: fmt::Debug> fmt::Debug for FaultyRepository<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyRepository")
            .field("inner", &self.inner)
            .field("plan", &*self.plan.lock())
            .field("unavailable", &self.unavailable.load(Ordering::Relaxed))
            .finish()
    }
}

impl<R> FaultyRepository<R> {
    /// Wraps `inner` with no fault planned.
    pub fn new(inner: R) -> Self {
        FaultyRepository {
            inner,
            plan: Mutex::new(Vec::new()),
            unavailable: AtomicBool::new(false),
            calls: Default::default(),
            held: Mutex::new(Vec::new()),
        }
    }

    /// The wrapped repository (to inspect the store behind the faults).
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// Applies `fault` to the next `times` calls of `operation` (after the faults
    /// already planned for it).
    pub fn inject(&self, operation: Operation, fault: Fault, times: usize) -> &Self {
        if times > 0 {
            self.plan.lock().push(Planned {
                operation,
                fault,
                remaining: times,
            });
        }
        self
    }

    /// Refuses every call with [`Error::Unavailable`] while `down` (a store
    /// outage), whatever is planned.
    pub fn set_unavailable(&self, down: bool) -> &Self {
        self.unavailable.store(down, Ordering::SeqCst);
        self
    }

    /// Forgets every planned fault and brings the store back.
    pub fn heal(&self) -> &Self {
        self.plan.lock().clear();
        self.set_unavailable(false)
    }

    /// How many calls of `operation` were made (faulty ones included).
    pub fn calls(&self, operation: Operation) -> usize {
        self.calls[operation as usize].load(Ordering::SeqCst)
    }

    /// Delivers the reservations [`Fault::HoldOnTheWay`] held, in the order
    /// they were sent, to the store behind the faults; their answers.
    pub async fn deliver_held(&self) -> Vec<Result<Reservation, Error>>
    where
        R: Repository,
    {
        let held = std::mem::take(&mut *self.held.lock());
        let mut answers = Vec::with_capacity(held.len());
        for h in &held {
            answers.push(self.inner.reserve(h.request()).await);
        }
        answers
    }

    fn next_fault(&self, operation: Operation) -> Option<Fault> {
        self.calls[operation as usize].fetch_add(1, Ordering::SeqCst);
        if self.unavailable.load(Ordering::SeqCst) {
            return Some(Fault::Unavailable);
        }
        let mut plan = self.plan.lock();
        let i = plan.iter().position(|p| p.operation == operation)?;
        let fault = plan[i].fault;
        plan[i].remaining -= 1;
        if plan[i].remaining == 0 {
            plan.remove(i);
        }
        Some(fault)
    }

    async fn run<T, F, Fut>(&self, operation: Operation, call: F) -> Result<T, Error>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let fault = self.next_fault(operation);
        self.apply(fault, operation, call).await
    }

    /// `call`, with `fault` (if any) applied to it.
    async fn apply<T, F, Fut>(
        &self,
        fault: Option<Fault>,
        operation: Operation,
        call: F,
    ) -> Result<T, Error>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let Some(fault) = fault else {
            return call().await;
        };
        match fault {
            Fault::Unavailable => Err(Error::Unavailable {
                backend: "faulty",
                message: format!("injected outage during {}", operation.as_str()),
                source: None,
            }),
            Fault::Refuse => Err(Error::Backend {
                backend: "faulty",
                message: format!("injected refusal of {}", operation.as_str()),
                source: None,
            }),
            Fault::LoseReply => {
                let _applied = call().await;
                Err(Error::Timeout {
                    backend: "faulty",
                    operation: operation.as_str(),
                })
            }
            Fault::GarbleReply => {
                let _applied = call().await;
                Err(Error::Backend {
                    backend: "faulty",
                    message: format!("injected unreadable reply to {}", operation.as_str()),
                    source: None,
                })
            }
            Fault::Hang | Fault::HoldOnTheWay => std::future::pending().await,
            Fault::ApplyThenHang => {
                let _applied = call().await;
                std::future::pending().await
            }
            Fault::Delay(d) => {
                tokio::time::sleep(d).await;
                call().await
            }
            Fault::Resend => {
                let _first = call().await;
                call().await
            }
            Fault::Panic => panic!("injected panic in {}", operation.as_str()),
        }
    }
}

#[async_trait]
impl<R: Repository> Repository for FaultyRepository<R> {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let fault = self.next_fault(Operation::Reserve);
        if let Some(Fault::HoldOnTheWay) = fault {
            self.held.lock().push(OwnedReserveRequest::from(&request));
            return std::future::pending().await;
        }
        let call = || self.inner.reserve(request.clone());
        self.apply(fault, Operation::Reserve, call).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let call = || self.inner.complete(key, owner, result, expires_at, now);
        self.run(Operation::Complete, call).await
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
        let call = || {
            self.inner
                .fail(key, owner, error, retryable, expires_at, now)
        };
        self.run(Operation::Fail, call).await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.run(Operation::Release, || self.inner.release(key, owner, now))
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
        let call = || self.inner.extend(key, owner, lease_until, expires_at, now);
        self.run(Operation::Extend, call).await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        self.run(Operation::Get, || self.inner.get(key, now)).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        self.run(Operation::Delete, || self.inner.delete(key)).await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        self.run(Operation::PurgeExpired, || {
            self.inner.purge_expired(now, limit)
        })
        .await
    }

    async fn reserve_many(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let count = requests.len();
        let call = || async { Ok(self.inner.reserve_many(requests.clone()).await) };
        match self.run(Operation::ReserveMany, call).await {
            Ok(answers) => answers,
            Err(e) => (0..count).map(|_| Err(e.for_another())).collect(),
        }
    }

    async fn complete_many(
        &self,
        completions: Vec<crate::repository::Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        let count = completions.len();
        let call = || async { Ok(self.inner.complete_many(completions.clone(), now).await) };
        match self.run(Operation::CompleteMany, call).await {
            Ok(answers) => answers,
            Err(e) => (0..count).map(|_| Err(e.for_another())).collect(),
        }
    }
}

/// A clock that follows Tokio's: `start` plus the Tokio time elapsed since the
/// clock was made. Under paused Tokio time (`#[tokio::test(start_paused = true)]`)
/// leases, expiry and the manager's timers then move together, with no sleeping.
#[derive(Debug, Clone)]
pub struct TokioClock {
    start: Timestamp,
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock reading `start` now.
    pub fn starting_at(start: Timestamp) -> Self {
        TokioClock {
            start,
            origin: tokio::time::Instant::now(),
        }
    }

    /// A clock reading the wall-clock time now.
    pub fn starting_now() -> Self {
        Self::starting_at(crate::time::SystemClock.now())
    }

    /// The current instant.
    pub fn now(&self) -> Timestamp {
        self.start + self.origin.elapsed()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        TokioClock::now(self)
    }
}
