//! The local answer cache: duplicates of recently completed keys answered
//! in-process, with no round trip (see [`AnswerCacheConfig`]).
//!
//! A `Completed` record never changes until it expires, so its answer to a
//! duplicate (the cached result, `Duplicate`, or a payload mismatch) is the
//! same every time. Only completed records enter the cache: an answer that
//! may still change (`Processing`, `Failed`) always comes from the store.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::config::AnswerCacheConfig;
use crate::decision::{answer_serve_until, cached_answer, DuplicateDecision};
use crate::key::{Fingerprint, RecordKey};
use crate::metrics::Counter;
use crate::record::{Record, Status};
use crate::time::Timestamp;

use super::Engine;

/// What a duplicate of a completed key needs.
#[derive(Debug)]
struct Answer {
    fingerprint: Option<Fingerprint>,
    result: Option<Box<[u8]>>,
    /// Served before this instant only: the earlier of the record's expiry
    /// less the skew allowance and the staleness bound.
    serve_until: Timestamp,
}

/// Bytes an entry is counted for beyond its key and result (the entry, its
/// `Arc`, moka's bookkeeping).
const ENTRY_OVERHEAD: usize = 128;

/// A bounded cache of completed answers, shared by every clone and scope of a
/// manager.
pub(crate) struct Answers {
    cache: moka::sync::Cache<RecordKey, Arc<Answer>>,
    max_staleness: Duration,
    clock_skew: Duration,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answers")
            .field("entries", &self.cache.entry_count())
            .field("max_staleness", &self.max_staleness)
            .finish()
    }
}

/// How the local answer cache has done so far (see
/// [`IdempotencyManager::answer_cache_stats`](crate::IdempotencyManager::answer_cache_stats)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AnswerCacheStats {
    /// Deliveries answered from the cache, without a round trip.
    pub hits: u64,
    /// Deliveries that went to the store (first deliveries included).
    pub misses: u64,
    /// Entries held now (approximate: moka applies evictions lazily).
    pub entries: u64,
    /// Bytes of keys and results held now, by the cache's own weighing
    /// (approximate, like `entries`).
    pub bytes: u64,
}

impl AnswerCacheStats {
    /// `hits / (hits + misses)`; 0 before any lookup.
    pub fn hit_ratio(&self) -> f64 {
        let lookups = self.hits + self.misses;
        if lookups == 0 {
            0.0
        } else {
            self.hits as f64 / lookups as f64
        }
    }
}

/// The longest time to live given to the cache's entries (100 years): a
/// longer `max_staleness` bounds nothing more, since entries are served only
/// until their record expires.
const MOST_STALENESS: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl Answers {
    pub(crate) fn new(config: AnswerCacheConfig, clock_skew: Duration) -> Self {
        let cache = moka::sync::Cache::builder()
            .max_capacity(config.max_bytes)
            .weigher(|key: &RecordKey, answer: &Arc<Answer>| {
                let result = answer.result.as_ref().map_or(0, |r| r.len());
                let bytes = key.id().len() + key.namespace().len() + result + ENTRY_OVERHEAD;
                u32::try_from(bytes).unwrap_or(u32::MAX)
            })
            // Frees memory on moka's own clock; whether an entry may be
            // served is judged on the manager's clock (`serve_until`). (moka
            // refuses a time to live over 1000 years with a panic; no record
            // lives a tenth of that.)
            .time_to_live(config.max_staleness.min(MOST_STALENESS))
            .build();
        Answers {
            cache,
            max_staleness: config.max_staleness,
            clock_skew,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The answer to a duplicate of `key` at `now`, if one is cached and
    /// still servable.
    fn lookup(
        &self,
        key: &RecordKey,
        fingerprint: Option<&Fingerprint>,
        now: Timestamp,
    ) -> Option<DuplicateDecision> {
        let answer = self.cache.get(key)?;
        let decision = cached_answer(
            answer.fingerprint.as_ref(),
            answer.result.as_deref(),
            answer.serve_until,
            fingerprint,
            now,
        );
        if decision.is_none() {
            self.cache.invalidate(key);
        }
        decision
    }

    /// Keeps a completed record's answer, read from (or written to) the store
    /// at `read_at` or later.
    fn insert(
        &self,
        key: &RecordKey,
        fingerprint: Option<Fingerprint>,
        result: Option<Box<[u8]>>,
        expires_at: Timestamp,
        read_at: Timestamp,
    ) {
        let Some(serve_until) =
            answer_serve_until(expires_at, read_at, self.clock_skew, self.max_staleness)
        else {
            return;
        };
        let answer = Answer {
            fingerprint,
            result,
            serve_until,
        };
        self.cache.insert(key.clone(), Arc::new(answer));
    }

    fn stats(&self) -> AnswerCacheStats {
        AnswerCacheStats {
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            entries: self.cache.entry_count(),
            bytes: self.cache.weighted_size(),
        }
    }
}

impl Engine {
    /// A duplicate's answer from the local cache, counted as a hit or a miss;
    /// `None` without a cache.
    pub(crate) fn cached_answer(
        &self,
        key: &RecordKey,
        fingerprint: Option<&Fingerprint>,
    ) -> Option<DuplicateDecision> {
        let answers = self.answers.as_ref()?;
        let decision = answers.lookup(key, fingerprint, self.now());
        let (counter, count) = match decision {
            Some(_) => (Counter::AnswerCacheHits, &answers.hits),
            None => (Counter::AnswerCacheMisses, &answers.misses),
        };
        count.fetch_add(1, Relaxed);
        self.metrics.count(counter);
        decision
    }

    /// Keeps the answer of a record the store returned to a duplicate, when
    /// it is completed (read at `read_at` or later).
    pub(crate) fn remember_record(&self, key: &RecordKey, record: &Record, read_at: Timestamp) {
        if let (Some(answers), Status::Completed) = (&self.answers, record.status) {
            let result = record.result.as_deref().map(Box::from);
            answers.insert(key, record.fingerprint, result, record.expires_at, read_at);
        }
    }

    /// Keeps the answer of this process's own completion, written at
    /// `written_at` or later, whose record expires at `expires_at` (the
    /// earliest expiry its completion attempts asked for).
    pub(crate) fn remember_completion(
        &self,
        key: &RecordKey,
        fingerprint: Option<Fingerprint>,
        result: Option<Vec<u8>>,
        written_at: Timestamp,
        expires_at: Timestamp,
    ) {
        if let Some(answers) = &self.answers {
            let result = result.map(Vec::into_boxed_slice);
            answers.insert(key, fingerprint, result, expires_at, written_at);
        }
    }

    /// The cache's counters, when there is one.
    pub(crate) fn answer_cache_stats(&self) -> Option<AnswerCacheStats> {
        self.answers.as_ref().map(Answers::stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: usize) -> RecordKey {
        RecordKey::new("ns", format!("key-{i}"), 512).unwrap()
    }

    #[test]
    fn holds_at_most_its_bytes() {
        let config = AnswerCacheConfig {
            max_bytes: 64 * 1024,
            max_staleness: Duration::from_secs(60),
        };
        let answers = Answers::new(config, Duration::ZERO);
        let now = Timestamp::from_millis(1_000_000);
        let expires = now + Duration::from_secs(3600);
        for i in 0..2_000 {
            let result = Some(vec![7u8; 1024].into_boxed_slice());
            answers.insert(&key(i), None, result, expires, now);
        }
        answers.cache.run_pending_tasks();
        let stats = answers.stats();
        assert!(stats.bytes <= config.max_bytes, "{stats:?}");
        assert!(stats.entries > 0 && stats.entries < 2_000, "{stats:?}");
    }

    #[test]
    fn an_unbounded_staleness_builds_and_serves_until_expiry() {
        let config = AnswerCacheConfig {
            max_staleness: Duration::MAX,
            ..AnswerCacheConfig::default()
        };
        let answers = Answers::new(config, Duration::ZERO);
        let now = Timestamp::from_millis(1_000_000);
        answers.insert(&key(1), None, None, now + Duration::from_secs(60), now);
        assert!(answers
            .lookup(&key(1), None, now + Duration::from_secs(59))
            .is_some());
        assert!(answers
            .lookup(&key(1), None, now + Duration::from_secs(60))
            .is_none());
    }

    #[test]
    fn an_answer_already_past_its_bounds_is_not_kept() {
        let answers = Answers::new(AnswerCacheConfig::default(), Duration::from_secs(5));
        let now = Timestamp::from_millis(1_000_000);
        // Expires within the skew allowance: never servable.
        answers.insert(&key(1), None, None, now + Duration::from_secs(5), now);
        assert!(answers.lookup(&key(1), None, now).is_none());
        answers.insert(&key(2), None, None, now + Duration::from_secs(6), now);
        assert_eq!(
            answers.lookup(&key(2), None, now),
            Some(DuplicateDecision::Duplicate)
        );
        assert!(answers
            .lookup(&key(2), None, now + Duration::from_secs(1))
            .is_none());
    }
}
