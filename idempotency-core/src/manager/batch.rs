//! Batches: a broker's poll of many messages, reserved in one round trip.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use super::{ExecuteError, HandlerError, IdempotencyManager, Outcome};
use crate::codec::Codec;
use crate::decision::{fingerprints_conflict, DuplicateDecision};
use crate::engine::completions::Completions;
use crate::engine::guard::ExecutionGuard;
use crate::engine::lease::{ExecutionContext, Lease};
use crate::engine::reserve::{BatchReserved, Reserved};
use crate::error::Error;
use crate::key::{Fingerprint, OwnerToken, RecordKey};
use crate::metrics::Counter;

/// One item of a batch on its way: its index in the input, key, fingerprint.
type Item = (usize, RecordKey, Option<Fingerprint>);

/// One answer per item, by input index.
type Answers<T, E> = Vec<(usize, Result<Outcome<T>, ExecuteError<E>>)>;

impl<C: Codec + Clone> IdempotencyManager<C> {
    /// Runs `handler` once per key for a batch of deliveries (a Kafka poll, an
    /// SQS receive, a Lambda event), with the same guarantees as
    /// [`execute_with_context`](Self::execute_with_context) for each item, and
    /// returns one answer per item, in input order.
    ///
    /// - The keys are reserved `concurrency` at a time, each group with one
    ///   [`Repository::reserve_many`](crate::Repository::reserve_many) call (one
    ///   round trip on stores that pipeline or take arrays); duplicates answered
    ///   by the local answer cache ([`Config::answer_cache`](crate::Config))
    ///   cost nothing. Every key a group acquired starts its handler at once, so
    ///   no reserved key waits for a slot while its lease runs.
    /// - The handlers of a group run concurrently on the caller's task; each
    ///   records its own outcome (a store's failure for one item never touches
    ///   another's record).
    /// - A key that appears more than once in the batch runs once: later
    ///   occurrences are answered after the first one finished, as a
    ///   redelivery would be (`Cached`, `Duplicate`, `PayloadMismatch`, … or,
    ///   if the first one released the key after a failure, a new run). When
    ///   the first one ran with an outcome the store does not hold
    ///   (`Unprotected` under fail-open, or `Unrecorded`), the later ones are
    ///   answered `Duplicate` (`PayloadMismatch` for another payload) without
    ///   asking the store, which would let them run again.
    /// - `handler` gets the item's index in `items` and its
    ///   [`ExecutionContext`].
    /// - A handler panic is handled as in `execute` (its record released by
    ///   default); it continues in the caller once every other item of its
    ///   group has finished and recorded its outcome.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
    /// let charges = AtomicU32::new(0);
    /// // A poll with a redelivered message (`m-1` twice).
    /// let poll = [("m-1", 10), ("m-2", 20), ("m-1", 10)];
    /// let answers = manager
    ///     .execute_batch(&poll, 64, |i, _ctx| {
    ///         charges.fetch_add(1, Ordering::SeqCst);
    ///         let amount = poll[i].1;
    ///         async move { Ok::<_, HandlerError<String>>(amount * 2) }
    ///     })
    ///     .await;
    /// assert!(matches!(answers[0], Ok(Outcome::Executed(20))));
    /// assert!(matches!(answers[1], Ok(Outcome::Executed(40))));
    /// assert!(matches!(answers[2], Ok(Outcome::Cached(20))));
    /// assert_eq!(charges.load(Ordering::SeqCst), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Cancel safety
    /// As [`execute`](Self::execute), item by item: dropping the returned
    /// future releases the keys whose handlers had not started, applies
    /// [`Config::on_cancel`](crate::Config::on_cancel) to those running, and
    /// records the outcomes of those that returned.
    pub async fn execute_batch<K, P, T, E, F, Fut>(
        &self,
        items: &[(K, P)],
        concurrency: usize,
        handler: F,
    ) -> Vec<Result<Outcome<T>, ExecuteError<E>>>
    where
        K: AsRef<str>,
        P: Serialize,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(usize, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let span = tracing::debug_span!(BATCH_SPAN, items = items.len());
        let mut answers: Vec<Option<Result<Outcome<T>, ExecuteError<E>>>> =
            std::iter::repeat_with(|| None).take(items.len()).collect();
        let mut waves = Vec::new();
        for (index, (key, payload)) in items.iter().enumerate() {
            match self.prepare(key.as_ref(), payload) {
                Ok((key, fingerprint)) => waves.push((index, key, fingerprint)),
                Err(e) => answers[index] = Some(Err(e.into())),
            }
        }
        let run = async {
            let mut unheld = Unheld::default();
            for wave in in_waves(waves) {
                let wave = unheld.answer_later(self, wave, &mut answers);
                for group in wave.chunks(concurrency.max(1)) {
                    let keys: HashMap<usize, &Item> = group.iter().map(|i| (i.0, i)).collect();
                    for (index, answer) in self.run_group(group.to_vec(), &handler).await {
                        if let Some(item) = keys.get(&index) {
                            unheld.note(item, &answer);
                        }
                        answers[index] = Some(answer);
                    }
                }
            }
        };
        run.instrument(span).await;
        answers
            .into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| {
                    Err(Error::Backend {
                        backend: self.engine.caps.backend,
                        message: "a batch item was left unanswered".into(),
                        source: None,
                    }
                    .into())
                })
            })
            .collect()
    }

    /// One group of distinct keys: local answers, one reservation call, then
    /// every acquired key's handler at once.
    async fn run_group<T, E, F, Fut>(&self, group: Vec<Item>, handler: &F) -> Answers<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Fn(usize, ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let engine = &*self.engine;
        let mut answers = Vec::with_capacity(group.len());
        let mut indexes = Vec::with_capacity(group.len());
        let mut leases = Vec::with_capacity(group.len());
        for (index, key, fingerprint) in group {
            match engine.cached_answer(&key, fingerprint.as_ref()) {
                Some(decision) => {
                    engine.metrics.count(Counter::DuplicatesBlocked);
                    answers.push((index, self.answer_duplicate(&key, decision)));
                }
                None => {
                    indexes.push(index);
                    leases.push((Arc::new(Lease::new(key, OwnerToken::random())), fingerprint));
                }
            }
        }
        if leases.is_empty() {
            return answers;
        }
        // Guards first: a batch dropped while reserving releases what its
        // requests may have created.
        let guards: Vec<_> = leases
            .iter()
            .map(|(lease, _)| ExecutionGuard::new(self.engine.clone(), lease.clone()))
            .collect();
        let reserved = engine.reserve_batch(&leases).await;
        let mut first_panic = None;
        // Keys the reservation answered as duplicates end here, without a
        // future of their own (a poll of redeliveries is mostly these); the
        // rest run below.
        let mut running = Vec::with_capacity(reserved.len());
        let items = indexes.into_iter().zip(leases).zip(guards).zip(reserved);
        for (((index, (lease, fingerprint)), guard), answer) in items {
            let BatchReserved::Done(Ok(Reserved::Duplicate {
                decision,
                unsettled,
            })) = answer
            else {
                running.push((index, lease, fingerprint, guard, answer));
                continue;
            };
            // A panic (decoding the stored result) waits for the other items,
            // as one in a running item's future does.
            let answered = std::panic::catch_unwind(AssertUnwindSafe(|| {
                self.answer_reserved_duplicate(guard, decision, unsettled)
            }));
            match answered {
                Ok(answer) => answers.push((index, answer)),
                Err(panic) => {
                    first_panic.get_or_insert(panic);
                }
            }
        }
        let participants = Completions::participants(running.len());
        let runs = running.into_iter().zip(participants).map(
            |((index, lease, fingerprint, guard, answer), mut participant)| async move {
                // A panic (the handler's, or a repository's while the
                // reservation is retried) stays with its item until every
                // other item has finished: unwinding through the others
                // would drop running handlers and leave their keys held
                // for nothing.
                let answer = async {
                    let reserved = match answer {
                        BatchReserved::Done(reserved) => reserved,
                        BatchReserved::Again(earlier) => {
                            engine.reserve_after(&lease, fingerprint, earlier).await
                        }
                    };
                    let run = |ctx| handler(index, ctx);
                    let batch = Some(&mut participant);
                    self.after_reserve(guard, reserved, fingerprint, run, batch)
                        .await
                };
                (index, AssertUnwindSafe(answer).catch_unwind().await)
            },
        );
        for (index, answer) in futures::future::join_all(runs).await {
            match answer {
                Ok(answer) => answers.push((index, answer)),
                Err(panic) => {
                    first_panic.get_or_insert(panic);
                }
            }
        }
        if let Some(panic) = first_panic {
            std::panic::resume_unwind(panic);
        }
        answers
    }
}

/// The keys of this batch whose handler ran with an outcome the store does
/// not hold (run unprotected under fail-open, or a completion that was never
/// recorded), with the fingerprint of that run: a later occurrence of one in
/// the batch is answered here, since the store would let it run again.
#[derive(Default)]
struct Unheld(HashMap<RecordKey, Option<Fingerprint>>);

impl Unheld {
    fn note<T, E>(
        &mut self,
        (_, key, fingerprint): &Item,
        answer: &Result<Outcome<T>, ExecuteError<E>>,
    ) {
        if let Ok(Outcome::Unprotected(_) | Outcome::Unrecorded { .. }) = answer {
            self.0.insert(key.clone(), *fingerprint);
        }
    }

    /// Answers the items of `wave` whose key ran unheld earlier in the batch
    /// (`Duplicate`, or `PayloadMismatch` for another payload); the rest go on.
    fn answer_later<C, T, E>(
        &self,
        manager: &IdempotencyManager<C>,
        wave: Vec<Item>,
        answers: &mut [Option<Result<Outcome<T>, ExecuteError<E>>>],
    ) -> Vec<Item>
    where
        C: Codec + Clone,
        T: DeserializeOwned,
    {
        if self.0.is_empty() {
            return wave;
        }
        let mut rest = Vec::with_capacity(wave.len());
        for item in wave {
            let Some(ran) = self.0.get(&item.1) else {
                rest.push(item);
                continue;
            };
            let decision = if fingerprints_conflict(ran.as_ref(), item.2.as_ref()) {
                DuplicateDecision::PayloadMismatch
            } else {
                DuplicateDecision::Duplicate
            };
            manager.engine.metrics.count(Counter::DuplicatesBlocked);
            answers[item.0] = Some(manager.answer_duplicate(&item.1, decision));
        }
        rest
    }
}

/// Splits prepared items into waves of distinct keys: the n-th occurrence of
/// a key goes to wave n, in input order within each wave. Occurrences are
/// counted on borrowed keys; a batch without a repeated key (the usual poll)
/// is one wave, moved as it is.
fn in_waves(items: Vec<Item>) -> Vec<Vec<Item>> {
    let occurrences: Vec<usize> = {
        let mut seen: HashMap<&RecordKey, usize> = HashMap::with_capacity(items.len());
        items
            .iter()
            .map(|item| {
                let count = seen.entry(&item.1).or_insert(0);
                *count += 1;
                *count - 1
            })
            .collect()
    };
    let waves = match occurrences.iter().max() {
        None => return Vec::new(),
        Some(0) => return vec![items],
        Some(last) => last + 1,
    };
    let mut split: Vec<Vec<Item>> = std::iter::repeat_with(Vec::new).take(waves).collect();
    for (item, occurrence) in items.into_iter().zip(occurrences) {
        split[occurrence].push(item);
    }
    split
}

/// The name of the span around each batch.
const BATCH_SPAN: &str = "idempotency.execute_batch";

#[cfg(test)]
mod tests {
    use super::*;

    fn items(ids: &[&str]) -> Vec<Item> {
        ids.iter()
            .enumerate()
            .map(|(i, id)| (i, RecordKey::new("ns", *id, 1024).unwrap(), None))
            .collect()
    }

    fn indexes(waves: &[Vec<Item>]) -> Vec<Vec<usize>> {
        waves
            .iter()
            .map(|w| w.iter().map(|i| i.0).collect())
            .collect()
    }

    #[test]
    fn the_nth_occurrence_of_a_key_goes_to_wave_n_in_input_order() {
        let waves = in_waves(items(&["a", "b", "a", "c", "a", "b"]));
        assert_eq!(indexes(&waves), [vec![0, 1, 3], vec![2, 5], vec![4]]);
    }

    #[test]
    fn distinct_keys_are_one_wave_and_no_items_none() {
        assert_eq!(indexes(&in_waves(items(&["a", "b", "c"]))), [vec![0, 1, 2]]);
        assert!(in_waves(Vec::new()).is_empty());
    }
}
