//! Model-based check: random sequences of operations — several owners, keys and
//! instants, with the clock stepping onto lease and expiry boundaries — run
//! against the repository and against a reference model of the contract written
//! out independently here, compared answer by answer. A mismatch is shrunk by
//! proptest to a minimal sequence and reported with its seed.
//!
//! `purge_expired` is left out: it acts on the whole store, so a sequence whose
//! clock runs ahead of the wall clock would purge records that checks running
//! beside it still hold live; `check_purge_expired` checks it on its own.
//!
//! A fixed set of seeds runs by default. `IDEMPOTENCY_CONFORMANCE_MODEL_CASES`
//! raises the number of sequences; `IDEMPOTENCY_CONFORMANCE_MODEL_SEED` replays
//! one seed (as printed by a failure).

use std::time::Duration;

use idempotency_core::{
    Fingerprint, OwnerToken, Record, RecordKey, Repository, Reservation, ReserveRequest,
    SharedRepository, Status, Timestamp,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use crate::support::random_namespace;
use crate::{CheckFailure, CheckResult};

const KEYS: usize = 2;
const OWNERS: usize = 3;
const LEASE: u64 = 30_000;
const TTL: u64 = 60_000;
/// Sequences run when no variable says otherwise.
const DEFAULT_CASES: u32 = 128;
const MAX_OPS: usize = 40;

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Op {
    Reserve {
        key: usize,
        owner: usize,
        fingerprint: Option<u8>,
        retry_failed: bool,
        skew: u64,
    },
    Complete {
        key: usize,
        owner: usize,
        result: Option<Vec<u8>>,
    },
    Fail {
        key: usize,
        owner: usize,
        error: Option<Vec<u8>>,
        retryable: bool,
    },
    Release {
        key: usize,
        owner: usize,
    },
    Extend {
        key: usize,
        owner: usize,
        lease: u64,
        skew: u64,
    },
    Get {
        key: usize,
    },
    Advance(u64),
}

fn bytes() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        Just(Some(Vec::new())),
        Just(Some(b"r".to_vec())),
        Just(Some(vec![0, 255, 0])),
    ]
}

/// Skewed towards the first key and owner, so that one owner's operations on
/// one record follow each other often (a re-sent reserve, an extension then a
/// takeover), while the others still interleave.
fn op() -> impl Strategy<Value = Op> {
    let key = prop_oneof![3 => Just(0usize), 1 => Just(1usize)];
    let owner = prop_oneof![3 => Just(0usize), 2 => Just(1usize), 1 => Just(2usize)];
    prop_oneof![
        4 => (key.clone(), owner.clone(), prop::option::of(0u8..2), any::<bool>(), prop_oneof![Just(0u64), Just(1_000)])
            .prop_map(|(key, owner, fingerprint, retry_failed, skew)| Op::Reserve { key, owner, fingerprint, retry_failed, skew }),
        2 => (key.clone(), owner.clone(), bytes()).prop_map(|(key, owner, result)| Op::Complete { key, owner, result }),
        2 => (key.clone(), owner.clone(), bytes(), any::<bool>())
            .prop_map(|(key, owner, error, retryable)| Op::Fail { key, owner, error, retryable }),
        1 => (key.clone(), owner.clone()).prop_map(|(key, owner)| Op::Release { key, owner }),
        2 => (key.clone(), owner.clone(), prop_oneof![Just(1_000u64), Just(LEASE), Just(3 * TTL)], prop_oneof![Just(0u64), Just(1_000)])
            .prop_map(|(key, owner, lease, skew)| Op::Extend { key, owner, lease, skew }),
        2 => key.prop_map(|key| Op::Get { key }),
        3 => prop_oneof![
            Just(1u64), Just(999), Just(1_000), Just(LEASE - 1), Just(LEASE), Just(LEASE + 1),
            Just(TTL - LEASE), Just(TTL),
        ]
        .prop_map(Op::Advance),
    ]
}

/// The contract's rules, written out on their own (not the core's decision
/// functions), over what the store should hold.
#[derive(Debug, Default)]
struct Model {
    records: [Option<Record>; KEYS],
}

impl Model {
    fn live(&self, key: usize, now: Timestamp) -> Option<&Record> {
        self.records[key].as_ref().filter(|r| r.expires_at > now)
    }

    fn reserve(&mut self, key: usize, req: &ReserveRequest<'_>, skew: u64) -> Reservation {
        let now = req.now;
        let fresh =
            |attempt: u32, created_at: Timestamp, fingerprint: Option<Fingerprint>| Record {
                status: Status::Processing,
                owner: req.owner,
                attempt,
                fingerprint,
                result: None,
                error: None,
                retryable: false,
                lease_until: req.lease_until,
                expires_at: req.expires_at,
                created_at,
                updated_at: now,
            };
        let Some(r) = self.live(key, now).cloned() else {
            self.records[key] = Some(fresh(1, now, req.fingerprint));
            return Reservation::Acquired { attempt: 1 };
        };
        if r.status == Status::Processing && r.owner == req.owner {
            return Reservation::Acquired { attempt: r.attempt };
        }
        let conflict = matches!((r.fingerprint, req.fingerprint), (Some(a), Some(b)) if a != b);
        let stale =
            r.status == Status::Processing && r.lease_until.as_millis() + skew <= now.as_millis();
        let retry = r.status == Status::Failed && req.retry_failed && r.retryable;
        if conflict || !(stale || retry) {
            return Reservation::Existing(r);
        }
        let attempt = r.attempt.saturating_add(1);
        self.records[key] = Some(fresh(
            attempt,
            r.created_at,
            req.fingerprint.or(r.fingerprint),
        ));
        Reservation::Acquired { attempt }
    }

    /// Applies `f` to the live `Processing` record `owner` holds; whether it did.
    fn owned(
        &mut self,
        key: usize,
        owner: OwnerToken,
        now: Timestamp,
        f: impl FnOnce(&mut Option<Record>),
    ) -> bool {
        let held = self
            .live(key, now)
            .is_some_and(|r| r.status == Status::Processing && r.owner == owner);
        if held {
            f(&mut self.records[key]);
        }
        held
    }
}

/// Runs one sequence against `repo` and the model; the first disagreement.
async fn run_sequence(repo: &SharedRepository, ops: &[Op]) -> Result<(), String> {
    let ns = random_namespace();
    let keys: Vec<RecordKey> = (0..KEYS)
        .map(|i| {
            RecordKey::new(
                ns.as_str(),
                format!("k{i}"),
                repo.capabilities().max_id_bytes,
            )
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let owners: Vec<OwnerToken> = (0..OWNERS).map(|_| OwnerToken::random()).collect();
    let start = Timestamp::from_system_time(std::time::SystemTime::now());
    let mut now = start;
    let mut model = Model::default();
    for (step, op) in ops.iter().enumerate() {
        let offset = now.duration_since(start).as_millis();
        let at = |what: String| format!("step {step} ({op:?}) at t+{offset}ms: {what}");
        match op {
            Op::Advance(ms) => now = now + Duration::from_millis(*ms),
            Op::Reserve {
                key,
                owner,
                fingerprint,
                retry_failed,
                skew,
            } => {
                let req = ReserveRequest {
                    key: &keys[*key],
                    owner: owners[*owner],
                    fingerprint: fingerprint.map(|b| Fingerprint::from_bytes([b; 32])),
                    now,
                    lease_until: now + Duration::from_millis(LEASE),
                    expires_at: now + Duration::from_millis(TTL),
                    retry_failed: *retry_failed,
                    clock_skew: Duration::from_millis(*skew),
                };
                let want = model.reserve(*key, &req, *skew);
                let got = repo
                    .reserve(req)
                    .await
                    .map_err(|e| at(format!("reserve failed: {e}")))?;
                same_reservation(&got, &want).map_err(at)?;
            }
            Op::Complete { key, owner, result } => {
                let expires_at = now + Duration::from_millis(TTL);
                let want = model.owned(*key, owners[*owner], now, |r| {
                    if let Some(r) = r {
                        r.status = Status::Completed;
                        r.result = result.clone();
                        r.expires_at = expires_at;
                    }
                });
                let got = repo
                    .complete(
                        &keys[*key],
                        owners[*owner],
                        result.as_deref(),
                        expires_at,
                        now,
                    )
                    .await;
                same_fenced(got, want).map_err(at)?;
            }
            Op::Fail {
                key,
                owner,
                error,
                retryable,
            } => {
                let expires_at = now + Duration::from_millis(TTL);
                let want = model.owned(*key, owners[*owner], now, |r| {
                    if let Some(r) = r {
                        r.status = Status::Failed;
                        r.error = error.clone();
                        r.retryable = *retryable;
                        r.expires_at = expires_at;
                    }
                });
                let got = repo
                    .fail(
                        &keys[*key],
                        owners[*owner],
                        error.as_deref(),
                        *retryable,
                        expires_at,
                        now,
                    )
                    .await;
                same_fenced(got, want).map_err(at)?;
            }
            Op::Release { key, owner } => {
                let want = model.owned(*key, owners[*owner], now, |r| *r = None);
                let got = repo.release(&keys[*key], owners[*owner], now).await;
                same_fenced(got, want).map_err(at)?;
            }
            Op::Extend {
                key,
                owner,
                lease,
                skew,
            } => {
                let lease_until = now + Duration::from_millis(*lease);
                let expires_at = lease_until + Duration::from_millis(*skew);
                let want = model.owned(*key, owners[*owner], now, |r| {
                    if let Some(r) = r {
                        r.lease_until = r.lease_until.max(lease_until);
                        r.expires_at = r.expires_at.max(expires_at);
                    }
                });
                let got = repo
                    .extend(&keys[*key], owners[*owner], lease_until, expires_at, now)
                    .await;
                same_fenced(got, want).map_err(at)?;
            }
            Op::Get { key } => {
                let want = model.live(*key, now).cloned();
                let got = repo
                    .get(&keys[*key], now)
                    .await
                    .map_err(|e| at(format!("get failed: {e}")))?;
                match (&got, &want) {
                    (None, None) => {}
                    (Some(g), Some(w)) => same_record(g, w).map_err(at)?,
                    _ => {
                        return Err(at(format!(
                            "get answered {got:?}, the contract says {want:?}"
                        )))
                    }
                }
            }
        }
    }
    Ok(())
}

fn same_reservation(got: &Reservation, want: &Reservation) -> Result<(), String> {
    match (got, want) {
        (Reservation::Acquired { attempt: g }, Reservation::Acquired { attempt: w }) if g == w => {
            Ok(())
        }
        (Reservation::Existing(g), Reservation::Existing(w)) => same_record(g, w),
        _ => Err(format!(
            "reserve answered {got:?}, the contract says {want:?}"
        )),
    }
}

fn same_fenced(got: Result<(), idempotency_core::Error>, applied: bool) -> Result<(), String> {
    match (got, applied) {
        (Ok(()), true) | (Err(idempotency_core::Error::LeaseLost { .. }), false) => Ok(()),
        (got, applied) => Err(format!(
            "answered {got:?}, the contract says {}",
            if applied { "ok" } else { "LeaseLost" }
        )),
    }
}

/// Every field but `updated_at` (bookkeeping).
fn same_record(got: &Record, want: &Record) -> Result<(), String> {
    let strip = |r: &Record| Record {
        updated_at: Timestamp::from_millis(0),
        ..r.clone()
    };
    if strip(got) == strip(want) {
        Ok(())
    } else {
        Err(format!("the record is {got:?}, the contract says {want:?}"))
    }
}

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Random sequences of operations, against the repository and the model.
pub async fn check_model_based_sequences(repo: SharedRepository) -> CheckResult {
    let seeds: Vec<u64> = match env_number("IDEMPOTENCY_CONFORMANCE_MODEL_SEED") {
        Some(seed) => vec![seed],
        None => (1..=4).collect(),
    };
    let cases = env_number("IDEMPOTENCY_CONFORMANCE_MODEL_CASES")
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(DEFAULT_CASES)
        .div_ceil(u32::try_from(seeds.len()).unwrap_or(1))
        .max(1);
    let handle = tokio::runtime::Handle::current();
    let verdict = tokio::task::spawn_blocking(move || {
        for seed in seeds {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            let config = Config {
                cases,
                failure_persistence: None,
                max_shrink_iters: 256,
                ..Config::default()
            };
            let mut runner =
                TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
            let strategy = prop::collection::vec(op(), 1..MAX_OPS);
            let result = runner.run(&strategy, |ops| {
                handle
                    .block_on(run_sequence(&repo, &ops))
                    .map_err(TestCaseError::fail)
            });
            match result {
                Ok(()) => {}
                Err(TestError::Fail(reason, ops)) => {
                    return Err(format!(
                        "{reason}\nminimal sequence ({} steps): {ops:#?}\nreplay with IDEMPOTENCY_CONFORMANCE_MODEL_SEED={seed}",
                        ops.len()
                    ))
                }
                Err(TestError::Abort(reason)) => return Err(format!("aborted: {reason} (seed {seed})")),
            }
        }
        Ok(())
    })
    .await
    .map_err(|e| CheckFailure { message: format!("the model check panicked: {e}") })?;
    verdict.map_err(|message| CheckFailure { message })
}
