//! A store that answers a reservation `InProgress` itself: the key is held by
//! a holder it cannot show (PostgreSQL: a transaction not yet committed, whose
//! row the reservation waited for until its lock bound). The manager decides
//! it as a live `Processing` record — at once under fail-fast, polling under
//! the wait policy, for that key alone in a batch — never as an outage: not
//! retried, never run unprotected under fail-open.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_core::testing::TokioClock;
use idempotency_core::{
    async_trait, Capabilities, Config, Error, ExecuteError, HandlerError, IdempotencyManager,
    InProgressPolicy, JsonCodec, MemoryRepository, OutagePolicy, Outcome, OwnerToken, Record,
    RecordKey, Repository, Reservation, ReserveRequest, Timestamp,
};

/// How long the store says it waited for the holder.
const WAITED: Duration = Duration::from_millis(250);

/// A memory store where the ids in `held` are held by a transaction it
/// cannot read: their reservations are answered `InProgress`.
#[derive(Debug, Default)]
struct HeldElsewhere {
    inner: MemoryRepository,
    held: Mutex<HashSet<String>>,
    /// Ids whose first reservation is applied but commits late: its reply is
    /// lost, and the next reservation waits on its row (`InProgress`).
    late: Mutex<HashSet<String>>,
    /// Held ids that commit while the next `InProgress` is on its way.
    committing: Mutex<HashSet<String>>,
    reserves: AtomicUsize,
}

impl HeldElsewhere {
    fn hold(&self, id: &str) {
        self.held.lock().unwrap().insert(id.to_owned());
    }

    /// The holder commits: its completed record appears, the lock goes.
    async fn commit(&self, key: &RecordKey, now: Timestamp, result: &[u8]) {
        let owner = OwnerToken::random();
        let ttl = Duration::from_secs(3600);
        let request = ReserveRequest::new(key, owner, now, Duration::from_secs(30), ttl);
        assert!(matches!(
            self.inner.reserve(request).await.unwrap(),
            Reservation::Acquired { .. }
        ));
        self.inner
            .complete(key, owner, Some(result), now + ttl, now)
            .await
            .unwrap();
        self.held.lock().unwrap().remove(key.id());
    }
}

#[async_trait]
impl Repository for HeldElsewhere {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities().with_max_lock_wait(Some(WAITED))
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        self.reserves.fetch_add(1, Ordering::SeqCst);
        let id = request.key.id().to_owned();
        if self.late.lock().unwrap().remove(&id) {
            self.inner.reserve(request).await?;
            self.hold(&id);
            self.committing.lock().unwrap().insert(id);
            return Err(Error::Timeout {
                backend: "memory",
                operation: "reserve",
            });
        }
        if self.held.lock().unwrap().contains(&id) {
            if self.committing.lock().unwrap().remove(&id) {
                self.held.lock().unwrap().remove(&id);
            }
            return Err(Error::InProgress {
                key: request.key.clone(),
                retry_after: WAITED,
            });
        }
        self.inner.reserve(request).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner
            .complete(key, owner, result, expires_at, now)
            .await
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
        self.inner
            .fail(key, owner, error, retryable, expires_at, now)
            .await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner.release(key, owner, now).await
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner
            .extend(key, owner, lease_until, expires_at, now)
            .await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        self.inner.get(key, now).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        self.inner.delete(key).await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        self.inner.purge_expired(now, limit).await
    }
}

fn manager(
    store: &Arc<HeldElsewhere>,
    in_progress: InProgressPolicy,
    clock: &TokioClock,
) -> IdempotencyManager {
    let config = Config {
        on_store_outage: OutagePolicy::FailOpen,
        in_progress,
        ..Config::default()
    };
    let repo: Arc<dyn Repository> = store.clone();
    IdempotencyManager::with_parts(repo, config, Arc::new(clock.clone()), JsonCodec).unwrap()
}

type Answer = Result<Outcome<String>, ExecuteError<String>>;

async fn deliver(m: &IdempotencyManager, id: &str, runs: &AtomicUsize) -> Answer {
    m.execute(id, &id, || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, HandlerError<String>>(format!("{id} ran"))
    })
    .await
}

fn in_progress(answer: &Answer) -> bool {
    matches!(
        answer,
        Err(ExecuteError::Idempotency(Error::InProgress { .. }))
    )
}

#[tokio::test(start_paused = true)]
async fn fail_fast_answers_in_progress_once_without_retrying() {
    let (store, clock) = (
        Arc::new(HeldElsewhere::default()),
        TokioClock::starting_now(),
    );
    store.hold("k");
    let m = manager(&store, InProgressPolicy::FailFast, &clock);
    let runs = AtomicUsize::new(0);
    let answer = deliver(&m, "k", &runs).await;
    assert!(in_progress(&answer), "{answer:?}");
    match answer {
        Err(ExecuteError::Idempotency(Error::InProgress { retry_after, .. })) => {
            assert!(retry_after <= WAITED, "{retry_after:?}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "run beside the holder");
    assert_eq!(
        store.reserves.load(Ordering::SeqCst),
        1,
        "retried as an outage"
    );
}

#[tokio::test(start_paused = true)]
async fn the_wait_policy_polls_until_the_holder_commits_or_the_wait_ends() {
    let (store, clock) = (
        Arc::new(HeldElsewhere::default()),
        TokioClock::starting_now(),
    );
    store.hold("k");
    store.hold("j");
    let wait = InProgressPolicy::Wait {
        timeout: Duration::from_secs(2),
        poll_interval: Duration::from_millis(50),
    };
    let m = manager(&store, wait, &clock);
    let runs = Arc::new(AtomicUsize::new(0));

    // The holder of `j` outlasts the wait: in progress at its end.
    let answer = deliver(&m, "j", &runs).await;
    assert!(in_progress(&answer), "{answer:?}");
    assert!(store.reserves.load(Ordering::SeqCst) > 2, "it polled");

    // The holder of `k` commits while the duplicate waits: its result.
    let waiter = {
        let (m, runs) = (m.clone(), runs.clone());
        tokio::spawn(async move { deliver(&m, "k", &runs).await })
    };
    // Paused Tokio time: the waiter polls meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let key = m.record_key("k").unwrap();
    store.commit(&key, clock.now(), b"\"k committed\"").await;
    let answer = waiter.await.unwrap();
    assert!(
        matches!(&answer, Ok(Outcome::Cached(v)) if v == "k committed"),
        "{answer:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "run beside the holder");
}

#[tokio::test(start_paused = true)]
async fn a_batch_answers_the_held_key_alone() {
    let (store, clock) = (
        Arc::new(HeldElsewhere::default()),
        TokioClock::starting_now(),
    );
    store.hold("k");
    let m = manager(&store, InProgressPolicy::FailFast, &clock);
    let items = [("k", 1), ("m", 2), ("n", 3)];
    let runs = AtomicUsize::new(0);
    let answers = m
        .execute_batch(&items, 8, |i, _ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, HandlerError<String>>(format!("{} ran", items[i].0)) }
        })
        .await;
    assert!(in_progress(&answers[0]), "{answers:?}");
    assert!(
        matches!(&answers[1], Ok(Outcome::Executed(v)) if v == "m ran"),
        "{answers:?}"
    );
    assert!(
        matches!(&answers[2], Ok(Outcome::Executed(v)) if v == "n ran"),
        "{answers:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A reservation whose first attempt was applied but whose reply was lost,
/// and whose transaction commits late: the re-sent reservation (same owner)
/// waits on our own uncommitted row and is answered `InProgress`. That is no
/// other holder: asked once more, the store answers `Acquired`, and the
/// delivery runs instead of answering "in progress" against itself.
#[tokio::test(start_paused = true)]
async fn in_progress_while_our_own_attempt_may_be_on_its_way_is_asked_again() {
    let (store, clock) = (
        Arc::new(HeldElsewhere::default()),
        TokioClock::starting_now(),
    );
    store.late.lock().unwrap().insert("k".to_owned());
    let m = manager(&store, InProgressPolicy::FailFast, &clock);
    let runs = AtomicUsize::new(0);
    let answer = deliver(&m, "k", &runs).await;
    assert!(
        matches!(&answer, Ok(Outcome::Executed(v)) if v == "k ran"),
        "{answer:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(store.reserves.load(Ordering::SeqCst), 3);
}

/// A manager whose own timer would outlast the store's lock wait would call
/// a key held by a live transaction an outage: refused when it is built.
#[test]
fn a_store_timeout_the_lock_wait_could_outlast_is_refused() {
    let store: Arc<dyn Repository> = Arc::new(HeldElsewhere::default());
    for (store_timeout, ok) in [
        (WAITED / 2, false),
        (WAITED, false),
        (WAITED * 2 - Duration::from_millis(1), false),
        (WAITED * 2, true),
    ] {
        let config = Config {
            store_timeout,
            ..Config::default()
        };
        let built = IdempotencyManager::new(store.clone(), config);
        match (built, ok) {
            (Ok(_), true) => {}
            (Err(Error::Config { message }), false) => {
                assert!(message.contains("lock wait"), "{message}")
            }
            (other, _) => panic!("store_timeout {store_timeout:?}: {other:?}"),
        }
    }
}
