//! The repository trait every store implements.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::Error;
use crate::key::{Fingerprint, OwnerToken, RecordKey};
use crate::record::Record;
use crate::time::Timestamp;

/// A repository shared between tasks and managers.
pub type SharedRepository = Arc<dyn Repository>;

/// One of the owner-checked writes of the contract (`complete`, `fail`,
/// `extend`, `release`), as data: for stores that apply all four with one
/// conditional statement ("the live `Processing` record this owner holds"),
/// such as the SQL backends.
///
/// ```
/// use idempotency_core::{OwnedWrite, Timestamp};
/// let done = OwnedWrite::complete(Some(b"receipt"), Timestamp::from_millis(60_000));
/// assert_eq!(done.operation(), "complete");
/// assert_eq!(done.columns(), (Some(&b"receipt"[..]), None));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnedWrite<'a> {
    /// `Processing → Completed` or `Failed`, with the value kept.
    Finish {
        /// `Completed` or `Failed`.
        status: crate::record::Status,
        /// The result (completed) or the stored error (failed).
        value: Option<&'a [u8]>,
        /// Whether a failure may be retried (`retry_failed` takes it over).
        retryable: bool,
        /// The record's new expiry.
        expires_at: Timestamp,
    },
    /// The lease and the expiry raised (neither moves back).
    Extend {
        /// The new end of the lease.
        lease_until: Timestamp,
        /// The expiry to move to, if later than the stored one.
        expires_at: Timestamp,
    },
    /// The record is removed.
    Release,
}

impl<'a> OwnedWrite<'a> {
    /// [`Repository::complete`] as data.
    pub fn complete(result: Option<&'a [u8]>, expires_at: Timestamp) -> Self {
        OwnedWrite::Finish {
            status: crate::record::Status::Completed,
            value: result,
            retryable: false,
            expires_at,
        }
    }

    /// [`Repository::fail`] as data.
    pub fn fail(error: Option<&'a [u8]>, retryable: bool, expires_at: Timestamp) -> Self {
        OwnedWrite::Finish {
            status: crate::record::Status::Failed,
            value: error,
            retryable,
            expires_at,
        }
    }

    /// The trait method's name, for errors and metrics.
    pub fn operation(&self) -> &'static str {
        match self {
            OwnedWrite::Finish {
                status: crate::record::Status::Completed,
                ..
            } => "complete",
            OwnedWrite::Finish { .. } => "fail",
            OwnedWrite::Extend { .. } => "extend",
            OwnedWrite::Release => "release",
        }
    }

    /// A finish's `(result, error)` columns: the value goes to the one its
    /// status names. `(None, None)` for the other writes.
    pub fn columns(&self) -> (Option<&'a [u8]>, Option<&'a [u8]>) {
        match *self {
            OwnedWrite::Finish {
                status: crate::record::Status::Completed,
                value,
                ..
            } => (value, None),
            OwnedWrite::Finish { value, .. } => (None, value),
            _ => (None, None),
        }
    }
}

/// What a backend can and cannot do; the manager adapts to it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The backend's name (`memory`, `redis`, `postgres`, `dynamodb`, …), used in
    /// metrics labels and errors.
    pub backend: &'static str,
    /// The largest result (or stored error) the store can hold, in bytes; `None`
    /// when only memory limits it. The manager completes without caching a larger
    /// result instead of failing.
    pub max_result_bytes: Option<usize>,
    /// The longest id the store indexes, in bytes; longer ids are digested by
    /// [`RecordKey::new`]. At least 71 (the digest form's length).
    pub max_id_bytes: usize,
    /// Whether the store removes expired records by itself (Redis key TTLs,
    /// DynamoDB TTL). When `false`, run [`Repository::purge_expired`] periodically.
    pub native_expiry: bool,
    /// The longest a `reserve` may wait on the server for another holder's
    /// lock before it answers [`Error::InProgress`] (PostgreSQL's
    /// `lock_timeout`); `None` for a store whose reservations never wait on
    /// one. A manager refuses a `store_timeout` that is not at least twice
    /// this: its own timer would fire first, and a key held by a live
    /// transaction would look like an outage (retried, then run under
    /// fail-open beside the holder).
    pub max_lock_wait: Option<Duration>,
}

impl Capabilities {
    /// Capabilities of a backend named `backend` with no result limit, 1024-byte
    /// ids and no native expiry; adjust with the `with_*` methods.
    pub fn new(backend: &'static str) -> Self {
        Capabilities {
            backend,
            max_result_bytes: None,
            max_id_bytes: 1024,
            native_expiry: false,
            max_lock_wait: None,
        }
    }

    /// Sets [`Capabilities::max_lock_wait`].
    pub fn with_max_lock_wait(mut self, wait: Option<Duration>) -> Self {
        self.max_lock_wait = wait;
        self
    }

    /// Sets [`Capabilities::max_result_bytes`].
    pub fn with_max_result_bytes(mut self, max: Option<usize>) -> Self {
        self.max_result_bytes = max;
        self
    }

    /// Sets [`Capabilities::max_id_bytes`].
    pub fn with_max_id_bytes(mut self, max: usize) -> Self {
        self.max_id_bytes = max;
        self
    }

    /// Sets [`Capabilities::native_expiry`].
    pub fn with_native_expiry(mut self, native: bool) -> Self {
        self.native_expiry = native;
        self
    }
    /// [`Error::InvalidKey`] when `key`'s id is longer than
    /// [`max_id_bytes`](Self::max_id_bytes): a store checks before it sends,
    /// never truncates. Keys built with
    /// [`RecordKey::new`]`(.., max_id_bytes)` always pass (longer ids are
    /// digested).
    ///
    /// ```
    /// use idempotency_core::{Capabilities, Error, RecordKey};
    /// let caps = Capabilities::new("mine").with_max_id_bytes(80);
    /// assert!(caps.check_id(&RecordKey::new("ns", "order-1", 80)?).is_ok());
    /// let long = RecordKey::new("ns", &"x".repeat(100), 4096)?;
    /// assert!(matches!(caps.check_id(&long), Err(Error::InvalidKey { .. })));
    /// # Ok::<(), Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidKey`], saying how to build keys that fit.
    pub fn check_id(&self, key: &RecordKey) -> Result<(), Error> {
        if key.id().len() <= self.max_id_bytes {
            return Ok(());
        }
        Err(Error::InvalidKey {
            reason: format!(
                "the id is {} bytes long; the {} backend stores ids of at most {} bytes (build \
                 keys with RecordKey::new(.., capabilities().max_id_bytes) to digest longer ids)",
                key.id().len(),
                self.backend,
                self.max_id_bytes
            ),
        })
    }

    /// [`Error::TooLarge`] when `value` (a result or a stored error: `what`)
    /// is larger than [`max_result_bytes`](Self::max_result_bytes).
    ///
    /// ```
    /// use idempotency_core::{Capabilities, Error};
    /// let caps = Capabilities::new("mine").with_max_result_bytes(Some(4));
    /// assert!(caps.check_value("result", Some(b"1234")).is_ok());
    /// assert!(matches!(
    ///     caps.check_value("result", Some(b"12345")),
    ///     Err(Error::TooLarge { size: 5, max: 4, .. })
    /// ));
    /// assert!(Capabilities::new("unlimited").check_value("error", Some(&[0; 1 << 20])).is_ok());
    /// ```
    ///
    /// # Errors
    /// [`Error::TooLarge`].
    pub fn check_value(&self, what: &'static str, value: Option<&[u8]>) -> Result<(), Error> {
        match (self.max_result_bytes, value) {
            (Some(max), Some(v)) if v.len() > max => Err(Error::TooLarge {
                what,
                size: v.len(),
                max,
            }),
            _ => Ok(()),
        }
    }
}

/// The arguments of [`Repository::reserve`].
#[derive(Debug, Clone)]
pub struct ReserveRequest<'a> {
    /// The record's key.
    pub key: &'a RecordKey,
    /// The fencing token of the reserving attempt.
    pub owner: OwnerToken,
    /// The payload's fingerprint, when payload validation is on.
    pub fingerprint: Option<Fingerprint>,
    /// The caller's current instant.
    pub now: Timestamp,
    /// The lease of the new `Processing` record.
    pub lease_until: Timestamp,
    /// The expiry of the new `Processing` record.
    pub expires_at: Timestamp,
    /// Whether a `Failed` record may be taken over.
    pub retry_failed: bool,
    /// Tolerated clock skew between consumers: a lease is taken over only when
    /// `lease_until + clock_skew <= now`.
    pub clock_skew: Duration,
}

/// A [`ReserveRequest`] that owns its key: for a store that keeps requests
/// past the call that made them (queued to be coalesced into one statement),
/// or a test that holds one on its way.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{OwnedReserveRequest, OwnerToken, RecordKey, ReserveRequest, Timestamp};
///
/// let now = Timestamp::from_millis(1_000);
/// let (kept, lease_until) = {
///     let key = RecordKey::new("payments", "order-1", 1024)?;
///     let request = ReserveRequest::new(&key, OwnerToken::random(), now, Duration::from_secs(30), Duration::from_secs(60));
///     (OwnedReserveRequest::from(&request), request.lease_until)
/// }; // the key the request borrowed is gone; the kept request has its own
/// assert_eq!(kept.request().key.id(), "order-1");
/// assert_eq!(kept.key().namespace(), "payments");
/// assert_eq!(kept.request().lease_until, lease_until);
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct OwnedReserveRequest {
    key: RecordKey,
    owner: OwnerToken,
    fingerprint: Option<Fingerprint>,
    now: Timestamp,
    lease_until: Timestamp,
    expires_at: Timestamp,
    retry_failed: bool,
    clock_skew: Duration,
}

impl OwnedReserveRequest {
    /// The record's key.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// The request, borrowing the key kept here.
    pub fn request(&self) -> ReserveRequest<'_> {
        ReserveRequest {
            key: &self.key,
            owner: self.owner,
            fingerprint: self.fingerprint,
            now: self.now,
            lease_until: self.lease_until,
            expires_at: self.expires_at,
            retry_failed: self.retry_failed,
            clock_skew: self.clock_skew,
        }
    }
}

impl From<&ReserveRequest<'_>> for OwnedReserveRequest {
    fn from(r: &ReserveRequest<'_>) -> Self {
        OwnedReserveRequest {
            key: r.key.clone(),
            owner: r.owner,
            fingerprint: r.fingerprint,
            now: r.now,
            lease_until: r.lease_until,
            expires_at: r.expires_at,
            retry_failed: r.retry_failed,
            clock_skew: r.clock_skew,
        }
    }
}

impl<'a> ReserveRequest<'a> {
    /// A first reservation of `key` for `owner` at `now`: the lease ends
    /// `lease` after `now` and the record expires `ttl` after it; no
    /// fingerprint, a `Failed` record not taken over, no clock skew. Other
    /// requests start from it with struct update syntax. Keep `ttl >= lease`
    /// (a `Processing` record never expires before its lease ends).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_core::{Clock, Fingerprint, OwnerToken, RecordKey, ReserveRequest, SystemClock};
    ///
    /// let key = RecordKey::new("orders", "order-1", 1024)?;
    /// let now = SystemClock.now();
    /// let lease = Duration::from_secs(30);
    /// let plain = ReserveRequest::new(&key, OwnerToken::random(), now, lease, Duration::from_secs(3600));
    /// assert_eq!(plain.lease_until, now + lease);
    /// let retrying = ReserveRequest {
    ///     fingerprint: Some(Fingerprint::of_bytes(b"payload")),
    ///     retry_failed: true,
    ///     ..plain
    /// };
    /// assert!(retrying.retry_failed);
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn new(
        key: &'a RecordKey,
        owner: OwnerToken,
        now: Timestamp,
        lease: Duration,
        ttl: Duration,
    ) -> Self {
        ReserveRequest {
            key,
            owner,
            fingerprint: None,
            now,
            lease_until: now + lease,
            expires_at: now + ttl,
            retry_failed: false,
            clock_skew: Duration::ZERO,
        }
    }

    /// The instant a lease must have ended by to be taken over:
    /// `now - clock_skew` (a lease is stale when `lease_until <= lease_cutoff()`),
    /// as [`decision::skew_cutoff`](crate::decision::skew_cutoff) computes it.
    pub fn lease_cutoff(&self) -> Timestamp {
        crate::decision::skew_cutoff(self.now, self.clock_skew)
    }
}

/// One write of [`Repository::complete_many`]: the arguments of
/// [`Repository::complete`] but the instant, which the batch shares.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// The record's key.
    pub key: &'a RecordKey,
    /// The fencing token of the completing owner.
    pub owner: OwnerToken,
    /// The cached result, if any.
    pub result: Option<&'a [u8]>,
    /// The completed record's expiry.
    pub expires_at: Timestamp,
}

/// The answer of [`Repository::reserve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// The caller now holds the key: a new record (`attempt == 1`) or a takeover
    /// (`attempt > 1`).
    Acquired {
        /// The attempt number now stored.
        attempt: u32,
    },
    /// A live record exists and could not be taken over; it is returned as read in
    /// the same atomic step.
    Existing(Record),
}

/// An idempotency store: the atomic operations of the contract
/// ([`contract`](crate::contract), section 3).
///
/// # Contract
///
/// - **Atomicity.** Each method is one atomic step on one record. Under any number
///   of concurrent callers on one key, exactly one `reserve` acquires a given
///   state: two callers never both get [`Reservation::Acquired`] for the same
///   record version.
/// - **Expiry from the caller's clock.** All instants are the caller's. A record
///   with `expires_at <= now` is absent to every operation, whether or not the
///   backend removed it physically. Operations without a `now` argument
///   ([`delete`](Repository::delete)) act on what is physically stored.
/// - **`reserve`** creates a `Processing` record (attempt 1) when none is live.
///   It *takes over* — new owner, `attempt + 1`, new lease and expiry, the
///   request's fingerprint or else the stored one, no result or error,
///   `retryable` cleared, `created_at` kept — a `Processing` record whose
///   `lease_until <= now - clock_skew`, or a `Failed` record that is `retryable`
///   when the request has `retry_failed`; never when the stored and requested
///   fingerprints are both present and differ. A live `Processing` record that
///   the request's owner already holds is answered `Acquired` with its attempt,
///   unchanged: a `reserve` re-sent after a lost reply is harmless. Otherwise it
///   returns the record unchanged as [`Reservation::Existing`]. A store where
///   a reservation can wait for another transaction's lock on the key (a
///   record not yet committed, which it cannot read) answers
///   [`Error::InProgress`] once its bound on that wait is reached, with
///   nothing applied: the key is held, the store reachable (not an outage).
/// - **Fencing.** [`complete`](Repository::complete), [`fail`](Repository::fail),
///   [`release`](Repository::release) and [`extend`](Repository::extend) apply
///   only to a live `Processing` record whose owner equals the given token; the
///   lease's end does not matter (the token, not the clock, decides). Otherwise
///   they return [`Error::LeaseLost`] and leave the record untouched.
/// - **Lease and expiry.** A `Processing` record never expires before its lease:
///   [`extend`](Repository::extend) raises `lease_until` and `expires_at` to at
///   least the given instants in the same atomic step (never lowers either: an
///   older extension applied late undoes nothing), and a backend with native
///   expiry (a key TTL, a TTL attribute) moves that with it.
/// - **Errors.** A store that cannot be reached yields [`Error::Unavailable`] or
///   [`Error::Timeout`] (retryable: the operation may or may not have been
///   applied); a stored value that does not parse yields [`Error::Corrupt`]
///   naming the key (never a panic); a result larger than
///   [`Capabilities::max_result_bytes`] yields [`Error::TooLarge`].
/// - **Bytes.** Results and errors are opaque bytes: any byte, including NUL and
///   non-UTF-8, round-trips; an empty result is distinct from no result. Ids and
///   namespaces are arbitrary UTF-8 (including `:`, `#`, `/`, control
///   characters); the backend's encoding of (namespace, id) is injective and
///   byte-exact (no case folding, trimming or normalization).
///
/// The conformance suite (`idempotency-conformance`) checks all of this.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{
///     MemoryRepository, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest,
///     Timestamp,
/// };
///
/// # tokio_test_block(async {
/// let repo = MemoryRepository::new();
/// let key = RecordKey::new("idempotency", "order-1", 256)?;
/// let now = Timestamp::from_millis(1_000);
/// let owner = OwnerToken::random();
/// let req = ReserveRequest {
///     key: &key,
///     owner,
///     fingerprint: None,
///     now,
///     lease_until: now + Duration::from_secs(30),
///     expires_at: now + Duration::from_secs(3600),
///     retry_failed: false,
///     clock_skew: Duration::ZERO,
/// };
/// assert_eq!(repo.reserve(req.clone()).await?, Reservation::Acquired { attempt: 1 });
/// repo.complete(&key, owner, Some(b"done"), now + Duration::from_secs(3600), now).await?;
/// match repo.reserve(ReserveRequest { owner: OwnerToken::random(), ..req }).await? {
///     Reservation::Existing(record) => assert_eq!(record.result.as_deref(), Some(&b"done"[..])),
///     other => panic!("unexpected {other:?}"),
/// }
/// # Ok::<(), idempotency_core::Error>(())
/// # })?;
/// # fn tokio_test_block<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
/// # }
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[async_trait]
pub trait Repository: Send + Sync + Debug + 'static {
    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Creates or takes over the record, or returns the live one (see the
    /// contract).
    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error>;

    /// `Processing → Completed` with an optional cached result, if `owner` holds
    /// the live record; sets `expires_at`.
    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error>;

    /// `Processing → Failed` with an optional stored error, if `owner` holds the
    /// live record; sets `expires_at` and remembers whether the failure is
    /// `retryable` (a later `reserve` with `retry_failed` may take over only a
    /// retryable failure).
    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error>;

    /// Deletes the `Processing` record if `owner` holds it (so a redelivery runs
    /// the handler again).
    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error>;

    /// Raises the lease of the `Processing` record `owner` holds to at least
    /// `lease_until` and its expiry to at least `expires_at`, with the
    /// backend's native TTL, in one atomic step; never lowers either, and
    /// answers ok when the record already holds both (the lease keeper gives
    /// up on a slow extension and sends the next: should the first be applied
    /// after it, the lease must not move back). The manager passes
    /// `expires_at = lease_until + clock_skew`, so the record outlives its lease.
    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error>;

    /// The live record at `key`, if any.
    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error>;

    /// Removes the record whatever its state; returns whether one was stored.
    async fn delete(&self, key: &RecordKey) -> Result<bool, Error>;

    /// Physically removes up to `limit` records expired at `now`; returns how many.
    /// Backends with native expiry may return `Ok(0)`.
    ///
    /// Exact at the instant it is given: callers keep the consumers' clock
    /// skew as a margin by passing
    /// [`decision::skew_cutoff`](crate::decision::skew_cutoff)`(now, clock_skew)`
    /// ([`RepositoryExt::purge_all_expired`] and the `idempotency purge`
    /// command do).
    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error>;

    /// The store's operator operations (listing, counting, migrations, a
    /// check of its settings), if it offers them; `None` by default.
    fn admin(&self) -> Option<&dyn crate::admin::Admin> {
        None
    }

    /// [`reserve`](Self::reserve) for several requests (distinct keys), one
    /// answer per request, in order. Each request is atomic on its own, with
    /// exactly `reserve`'s rules (including idempotence per owner token); the
    /// batch as a whole is not a transaction. An error for one request (or for
    /// all: a lost reply) is as ambiguous as `reserve`'s.
    ///
    /// The default sends every request through `reserve`, concurrently; a store
    /// that can answer many in one round trip (a Redis pipeline, one SQL
    /// statement over arrays) overrides it. The conformance suite checks
    /// overrides against `reserve`'s rules.
    async fn reserve_many(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        futures::future::join_all(requests.into_iter().map(|r| self.reserve(r))).await
    }

    /// [`complete`](Self::complete) for several records (distinct keys) at
    /// `now`, one answer per write, in order: each write atomic and
    /// owner-checked on its own (`LeaseLost` for one that is not the owner's
    /// live record), not a transaction over the batch; an error for one write
    /// (or for all: a lost reply) is as ambiguous as `complete`'s.
    ///
    /// The default sends every write through `complete`, concurrently; a store
    /// that can apply many in one round trip overrides it.
    async fn complete_many(
        &self,
        completions: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        let each = completions
            .into_iter()
            .map(|c| self.complete(c.key, c.owner, c.result, c.expires_at, now));
        futures::future::join_all(each).await
    }
}

macro_rules! forward_repository {
    ($ty:ty) => {
        #[async_trait]
        impl<R: Repository + ?Sized> Repository for $ty {
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
                (**self).reserve(request).await
            }
            async fn complete(
                &self,
                key: &RecordKey,
                owner: OwnerToken,
                result: Option<&[u8]>,
                expires_at: Timestamp,
                now: Timestamp,
            ) -> Result<(), Error> {
                (**self).complete(key, owner, result, expires_at, now).await
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
                (**self)
                    .fail(key, owner, error, retryable, expires_at, now)
                    .await
            }
            async fn release(
                &self,
                key: &RecordKey,
                owner: OwnerToken,
                now: Timestamp,
            ) -> Result<(), Error> {
                (**self).release(key, owner, now).await
            }
            async fn extend(
                &self,
                key: &RecordKey,
                owner: OwnerToken,
                lease_until: Timestamp,
                expires_at: Timestamp,
                now: Timestamp,
            ) -> Result<(), Error> {
                (**self)
                    .extend(key, owner, lease_until, expires_at, now)
                    .await
            }
            async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
                (**self).get(key, now).await
            }
            async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
                (**self).delete(key).await
            }
            async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
                (**self).purge_expired(now, limit).await
            }
            fn admin(&self) -> Option<&dyn crate::admin::Admin> {
                (**self).admin()
            }
            async fn reserve_many(
                &self,
                requests: Vec<ReserveRequest<'_>>,
            ) -> Vec<Result<Reservation, Error>> {
                (**self).reserve_many(requests).await
            }
            async fn complete_many(
                &self,
                completions: Vec<Completion<'_>>,
                now: Timestamp,
            ) -> Vec<Result<(), Error>> {
                (**self).complete_many(completions, now).await
            }
        }
    };
}

forward_repository!(Arc<R>);
forward_repository!(Box<R>);

/// Conveniences over any [`Repository`], implemented for all of them (so wrappers
/// never have to forward them).
#[async_trait]
pub trait RepositoryExt: Repository {
    /// Removes the records expired for every consumer at `now`: calls
    /// [`Repository::purge_expired`] at
    /// [`decision::skew_cutoff`](crate::decision::skew_cutoff)`(now, clock_skew)`
    /// in batches of `batch` until a batch comes back short; returns the
    /// total removed.
    ///
    /// Pass the consumers' `clock_skew`: a record that expired on this clock
    /// less than that ago may still be live on a consumer's clock that runs
    /// behind, which would otherwise find it gone and run its handler again.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// use std::time::Duration;
    /// use idempotency_core::{
    ///     MemoryRepository, OwnerToken, RecordKey, Repository, RepositoryExt, ReserveRequest,
    ///     Timestamp,
    /// };
    ///
    /// let store = MemoryRepository::new();
    /// let key = RecordKey::new("orders", "order-1", 1024)?;
    /// let t = Timestamp::from_millis(1_000_000);
    /// let lease = Duration::from_secs(1);
    /// store.reserve(ReserveRequest::new(&key, OwnerToken::random(), t, lease, lease)).await?;
    /// let skew = Duration::from_secs(2);
    /// // Expired 0.3 s ago on this clock: kept, within the skew.
    /// let expired_at = t + lease;
    /// let soon = expired_at + Duration::from_millis(300);
    /// assert_eq!(store.purge_all_expired(soon, skew, 100).await?, 0);
    /// assert_eq!(store.purge_all_expired(expired_at + skew, skew, 100).await?, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    async fn purge_all_expired(
        &self,
        now: Timestamp,
        clock_skew: Duration,
        batch: usize,
    ) -> Result<usize, Error> {
        let batch = batch.max(1);
        let before = crate::decision::skew_cutoff(now, clock_skew);
        let mut total = 0;
        loop {
            let n = self.purge_expired(before, batch).await?;
            total += n;
            if n < batch {
                return Ok(total);
            }
        }
    }

    /// Whether a live record exists at `key`.
    async fn exists(&self, key: &RecordKey, now: Timestamp) -> Result<bool, Error> {
        Ok(self.get(key, now).await?.is_some())
    }
}

impl<R: Repository + ?Sized> RepositoryExt for R {}
