//! A repository that records every call's invocation and answer, with the
//! caller's arguments, on one logical clock shared by every process of a
//! run; and the check of the recorded history against the contract.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idempotency_core::{
    async_trait, Capabilities, Completion, Error, OwnedReserveRequest, OwnerToken, Record,
    RecordKey, Repository, Reservation, ReserveRequest, SharedRepository, Status, Timestamp,
};

use crate::linearizable::{check, Operation, Verdict};
use crate::store_model::{Answer, Call, StoreModel};

/// The most search steps spent on one key's history before it is reported
/// unknown.
const BUDGET_PER_KEY: u64 = 200_000;

#[derive(Debug)]
struct Entry {
    key: RecordKey,
    call: Call,
    at: u64,
    answer: Option<(u64, Answer)>,
    /// Answered `InProgress`: nothing applied, nothing seen.
    dropped: bool,
}

#[derive(Debug, Default)]
struct Log {
    clock: u64,
    entries: Vec<Entry>,
}

/// The history of a run, shared by its recorders.
#[derive(Debug, Clone, Default)]
pub struct History(Arc<Mutex<Log>>);

impl History {
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `call` on `key`, runs it, records its answer.
    async fn around<T>(
        &self,
        key: &RecordKey,
        call: Call,
        op: impl std::future::Future<Output = Result<T, Error>>,
        ok: impl FnOnce(&T) -> Answer,
    ) -> Result<T, Error> {
        let id = self.invoke(key, call);
        let r = op.await;
        self.respond(id, &r, ok);
        r
    }

    fn invoke(&self, key: &RecordKey, call: Call) -> usize {
        let mut log = self.log();
        log.clock += 1;
        let at = log.clock;
        log.entries.push(Entry {
            key: key.clone(),
            call,
            at,
            answer: None,
            dropped: false,
        });
        log.entries.len() - 1
    }

    /// Records the answer of call `id`; an ambiguous error (`Unavailable`,
    /// `Timeout`: applied or not) leaves it pending, `InProgress` (nothing
    /// applied) drops it.
    fn respond<T>(&self, id: usize, result: &Result<T, Error>, ok: impl FnOnce(&T) -> Answer) {
        let answer = match result {
            Ok(v) => ok(v),
            Err(Error::Unavailable { .. } | Error::Timeout { .. }) => return,
            Err(Error::LeaseLost { .. }) => Answer::LeaseLost,
            Err(Error::InProgress { .. }) => {
                if let Some(e) = self.log().entries.get_mut(id) {
                    e.dropped = true;
                }
                return;
            }
            Err(e) => Answer::Error(e.to_string()),
        };
        let mut log = self.log();
        log.clock += 1;
        let at = log.clock;
        if let Some(e) = log.entries.get_mut(id) {
            e.answer = Some((at, answer));
        }
    }

    /// Checks every key's history (as recorded so far: calls still running
    /// are pending) against the contract.
    pub fn check(&self) -> Linearizability {
        let begun = Instant::now();
        let mut keys: HashMap<RecordKey, Vec<Operation<Call, Answer>>> = HashMap::new();
        for e in self.log().entries.iter().filter(|e| !e.dropped) {
            keys.entry(e.key.clone()).or_default().push(Operation {
                call: e.at,
                answer: e.answer.clone(),
                input: e.call.clone(),
            });
        }
        let mut result = Linearizability::default();
        for (key, ops) in &keys {
            result.operations += ops.len();
            result.keys += 1;
            let strict = StoreModel::default();
            let resent = StoreModel {
                resent_writes: true,
            };
            match check(&strict, None, ops, BUDGET_PER_KEY) {
                Verdict::Linearizable => {}
                Verdict::NotLinearizable => match check(&resent, None, ops, BUDGET_PER_KEY) {
                    Verdict::Linearizable => result.resent.push(render(key, ops)),
                    Verdict::NotLinearizable => result.violations.push(render(key, ops)),
                    Verdict::Unknown => result.unknown.push(format!("{key:?}")),
                },
                Verdict::Unknown => result.unknown.push(format!("{key:?}")),
            }
        }
        result.took = begun.elapsed();
        result
    }
}

/// The linearizability check of one run.
#[derive(Debug, Clone, Default)]
pub struct Linearizability {
    /// Operations checked (pending ones included).
    pub operations: usize,
    /// Keys (independent histories) checked.
    pub keys: usize,
    /// Each non-linearizable key's history, rendered for reading.
    pub violations: Vec<String>,
    /// Keys whose search ran out of budget.
    pub unknown: Vec<String>,
    /// Keys linearizable only when an applied owner-checked write may
    /// answer `LeaseLost` (a store client re-sent it; see
    /// [`StoreModel::resent_writes`]), rendered: reported, not a failure.
    pub resent: Vec<String>,
    /// How long the check took.
    pub took: Duration,
}

impl Linearizability {
    /// `yes`, `NO`, `unknown` (some key out of budget, none violated), or
    /// `yes, N keys with a re-sent write answered LeaseLost`.
    pub fn verdict(&self) -> String {
        match (self.violations.is_empty(), self.unknown.is_empty()) {
            (false, _) => "NO".to_owned(),
            (true, false) => "unknown".to_owned(),
            (true, true) if self.resent.is_empty() => "yes".to_owned(),
            (true, true) => format!(
                "yes, {} key(s) with a re-sent write answered LeaseLost",
                self.resent.len()
            ),
        }
    }

    /// Adds another run's check.
    pub fn absorb(&mut self, other: &Linearizability) {
        self.operations += other.operations;
        self.keys += other.keys;
        self.violations.extend(other.violations.iter().cloned());
        self.unknown.extend(other.unknown.iter().cloned());
        self.resent.extend(other.resent.iter().cloned());
        self.took += other.took;
    }
}

fn render(key: &RecordKey, ops: &[Operation<Call, Answer>]) -> String {
    let mut out = format!("non-linearizable history of {key:?} (call, answer on one clock):\n");
    let mut sorted: Vec<_> = ops.iter().collect();
    sorted.sort_by_key(|o| o.call);
    for op in sorted {
        let answer = op
            .answer
            .as_ref()
            .map_or("pending".to_owned(), |(at, a)| format!("@{at} {a:?}"));
        let _ = writeln!(out, "  @{} {:?}\n      -> {answer}", op.call, op.input);
    }
    out
}

/// A repository that records every call into a [`History`].
#[derive(Debug)]
pub struct Recorder {
    inner: SharedRepository,
    history: History,
}

impl Recorder {
    /// `inner`, recording into `history`.
    pub fn wrap(inner: SharedRepository, history: History) -> SharedRepository {
        Arc::new(Recorder { inner, history })
    }

    fn finish(
        key: &RecordKey,
        owner: OwnerToken,
        status: Status,
        value: Option<&[u8]>,
        (retryable, expires_at, now): (bool, Timestamp, Timestamp),
    ) -> (RecordKey, Call) {
        let call = Call::Finish {
            owner,
            status,
            value: value.map(<[u8]>::to_vec),
            retryable,
            expires_at,
            now,
        };
        (key.clone(), call)
    }
}

fn unit(_: &()) -> Answer {
    Answer::Done
}

fn reserved(r: &Reservation) -> Answer {
    Answer::Reserved(r.clone())
}

#[async_trait]
impl Repository for Recorder {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn reserve(&self, request: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let (key, call) = (
            request.key,
            Call::Reserve(OwnedReserveRequest::from(&request)),
        );
        let op = self.inner.reserve(request);
        self.history.around(key, call, op, reserved).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let (k, call) = Recorder::finish(
            key,
            owner,
            Status::Completed,
            result,
            (false, expires_at, now),
        );
        let op = self.inner.complete(key, owner, result, expires_at, now);
        self.history.around(&k, call, op, unit).await
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
        let (k, call) = Recorder::finish(
            key,
            owner,
            Status::Failed,
            error,
            (retryable, expires_at, now),
        );
        let op = self
            .inner
            .fail(key, owner, error, retryable, expires_at, now);
        self.history.around(&k, call, op, unit).await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        let op = self.inner.release(key, owner, now);
        self.history
            .around(key, Call::Release { owner, now }, op, unit)
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
        let call = Call::Extend {
            owner,
            lease_until,
            expires_at,
            now,
        };
        let op = self.inner.extend(key, owner, lease_until, expires_at, now);
        self.history.around(key, call, op, unit).await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        let op = self.inner.get(key, now);
        let got = |v: &Option<Record>| Answer::Got(v.clone());
        self.history.around(key, Call::Get { now }, op, got).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        let op = self.inner.delete(key);
        let deleted = |v: &bool| Answer::Deleted(*v);
        self.history.around(key, Call::Delete, op, deleted).await
    }

    /// Not recorded: it acts on keys it does not name (the runs never call
    /// it; the model has a per-key rule for it).
    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<usize, Error> {
        self.inner.purge_expired(now, limit).await
    }

    fn admin(&self) -> Option<&dyn idempotency_core::admin::Admin> {
        self.inner.admin()
    }

    async fn reserve_many(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let ids: Vec<usize> = requests
            .iter()
            .map(|r| {
                self.history
                    .invoke(r.key, Call::Reserve(OwnedReserveRequest::from(r)))
            })
            .collect();
        let answers = self.inner.reserve_many(requests).await;
        for (id, r) in ids.into_iter().zip(&answers) {
            self.history.respond(id, r, reserved);
        }
        answers
    }

    async fn complete_many(
        &self,
        completions: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        let ids: Vec<usize> = completions
            .iter()
            .map(|c| {
                let (k, call) = Recorder::finish(
                    c.key,
                    c.owner,
                    Status::Completed,
                    c.result,
                    (false, c.expires_at, now),
                );
                self.history.invoke(&k, call)
            })
            .collect();
        let answers = self.inner.complete_many(completions, now).await;
        for (id, r) in ids.into_iter().zip(&answers) {
            self.history.respond(id, r, unit);
        }
        answers
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use idempotency_core::MemoryRepository;

    use super::*;

    #[tokio::test]
    async fn a_recorded_memory_history_is_linearizable_and_counted() {
        let history = History::default();
        let repo = Recorder::wrap(Arc::new(MemoryRepository::new()), history.clone());
        let key = RecordKey::new("ns", "k", 1024).unwrap();
        let now = Timestamp::from_millis(1_000);
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        let lease = Duration::from_secs(1);
        let ttl = Duration::from_secs(60);
        repo.reserve(ReserveRequest::new(&key, a, now, lease, ttl))
            .await
            .unwrap();
        repo.reserve(ReserveRequest::new(&key, b, now, lease, ttl))
            .await
            .unwrap();
        let later = now + Duration::from_secs(2);
        repo.reserve(ReserveRequest::new(&key, b, later, lease, ttl))
            .await
            .unwrap();
        assert!(repo
            .complete(&key, a, None, later + ttl, later)
            .await
            .is_err());
        repo.complete(&key, b, Some(b"x"), later + ttl, later)
            .await
            .unwrap();
        repo.get(&key, later).await.unwrap();
        repo.delete(&key).await.unwrap();
        let checked = history.check();
        assert_eq!((checked.operations, checked.keys), (7, 1));
        assert_eq!(checked.verdict(), "yes", "{:?}", checked.violations);
    }

    #[tokio::test]
    async fn a_store_that_lets_two_owners_hold_a_key_is_caught() {
        let history = History::default();
        // Two stores under one recorder's history: each grants the key.
        let one = Recorder::wrap(Arc::new(MemoryRepository::new()), history.clone());
        let two = Recorder::wrap(Arc::new(MemoryRepository::new()), history.clone());
        let key = RecordKey::new("ns", "k", 1024).unwrap();
        let now = Timestamp::from_millis(1_000);
        let (lease, ttl) = (Duration::from_secs(10), Duration::from_secs(60));
        for repo in [&one, &two] {
            repo.reserve(ReserveRequest::new(
                &key,
                OwnerToken::random(),
                now,
                lease,
                ttl,
            ))
            .await
            .unwrap();
        }
        let checked = history.check();
        assert_eq!(checked.verdict(), "NO");
        assert!(checked.violations[0].contains("Acquired"), "{checked:?}");
    }
}
