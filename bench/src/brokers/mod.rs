//! Broker benchmarks: messages per second end to end through a broker with
//! the consumer of `idempotency-consumers` (over a store) against the same
//! consumer loop without it.
//!
//! - **library**: the crate's consumer (`KafkaConsumer::poll_once`,
//!   `SqsConsumer::poll_once`, `RabbitConsumer::run`) over an [`IdempotencyManager`] with the
//!   bench's [`config`](crate::workloads::config) on the in-memory store or
//!   Redis, around a trivial handler;
//! - **raw**: the same client, the same receive (a batch of up to 100 from
//!   Kafka; receives of up to 10 from SQS), the same trivial handler called
//!   for every message, the same commit (a synchronous offset commit on a
//!   blocking thread), delete (`DeleteMessageBatch`) or acks (`basic.ack`
//!   per delivery), with no store.
//!
//! Each round puts new messages on the broker first (untimed; for the
//! `duplicate` scenario their keys are completed in the store first, so every
//! message is answered from its record), then times consuming exactly those
//! messages. Rounds alternate library and raw A B B A … as the store
//! benchmark's driver does, and every round checks what happened (every
//! message acknowledged once, the handler run for each fresh message and for
//! no duplicate), so a broken setup fails instead of reporting speed.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{IdempotencyManager, MemoryRepository, SharedRepository};
use indicatif::ProgressBar;

use crate::driver::{round_namespace, round_order};
use crate::stats::Samples;
use crate::{BoxError, Scenario, Variant};

mod report;
mod runner;
pub use report::{compare, BrokerComparison, BrokerMeasurement, BrokerReport};
pub use runner::run_all;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "sqs")]
pub mod sqs;

/// Messages per poll a consumer asks for (Kafka's batch size; SQS's
/// receives take at most 10, see [`sqs`](self)).
pub const BATCH: usize = 100;

/// SQS poll loops per variant by default: 10 receives of 10 = a batch of 100.
pub const SQS_POLLERS: usize = 10;

/// Brokers compiled into this binary.
pub fn compiled_brokers() -> Vec<String> {
    let mut all = Vec::new();
    if cfg!(feature = "kafka") {
        all.push("kafka");
    }
    if cfg!(feature = "sqs") {
        all.push("sqs");
    }
    if cfg!(feature = "rabbitmq") {
        all.push("rabbitmq");
    }
    all.into_iter().map(str::to_owned).collect()
}

/// Stores the consumers can run over in this binary.
pub fn compiled_stores() -> Vec<String> {
    let mut all = vec!["memory"];
    if cfg!(feature = "redis") {
        all.push("redis");
    }
    all.into_iter().map(str::to_owned).collect()
}

/// The store `name` (`memory`, or `redis` at `redis_url`) and a description.
///
/// # Errors
/// An unknown store, or Redis unreachable.
pub async fn store(
    name: &str,
    redis_url: Option<&str>,
) -> Result<(SharedRepository, String), BoxError> {
    let _ = redis_url;
    match name {
        "memory" => Ok((
            Arc::new(MemoryRepository::new()),
            "MemoryRepository (in process)".to_owned(),
        )),
        #[cfg(feature = "redis")]
        "redis" => {
            let url = redis_url.ok_or("the redis store needs a URL")?;
            let repo = idempotency_redis::connect(url).await?;
            Ok((Arc::new(repo), format!("Redis at {url}")))
        }
        other => Err(format!("store {other:?} is not compiled in").into()),
    }
}

/// The manager the consumers (and the duplicate scenario's preparation) use.
///
/// # Errors
/// Only if the bench's configuration were invalid.
pub fn manager(repo: SharedRepository) -> Result<IdempotencyManager, BoxError> {
    Ok(IdempotencyManager::new(repo, crate::workloads::config())?)
}

/// The payload of message `i`: what both variants' handlers see and what the
/// library fingerprints.
pub fn payload(i: usize) -> String {
    format!(r#"{{"id":{i},"amount":4200}}"#)
}

/// The trivial handler both variants run: the payload's length.
pub fn handle(payload: &[u8]) -> usize {
    std::hint::black_box(payload).len()
}

/// Completes the keys `{ns}-0` … of `messages` messages through `manager`
/// (with their payloads, so the consumer's deliveries are duplicates, not
/// payload mismatches), in batches.
///
/// # Errors
/// A store failure, or an answer that is not an execution.
pub async fn complete_keys(
    manager: &IdempotencyManager,
    ns: &str,
    messages: usize,
) -> Result<(), BoxError> {
    let keys: Vec<(String, String)> = (0..messages)
        .map(|i| (crate::workloads::key_id(ns, i), payload(i)))
        .collect();
    for chunk in keys.chunks(BATCH) {
        let answers = manager
            .execute_batch(chunk, 16, |n, _ctx| {
                let len = handle(chunk[n].1.as_bytes());
                async move {
                    Ok::<_, idempotency_core::HandlerError<std::convert::Infallible>>(len)
                }
            })
            .await;
        for answer in answers {
            match answer {
                Ok(idempotency_core::Outcome::Executed(_)) => {}
                Ok(other) => return Err(format!("completing a key answered {other:?}").into()),
                Err(idempotency_core::ExecuteError::Idempotency(e)) => return Err(e.into()),
                Err(idempotency_core::ExecuteError::Handler(never)) => match never {},
            }
        }
    }
    Ok(())
}

/// What one timed round did.
#[derive(Debug, Default)]
pub struct Round {
    /// Distinct messages consumed (acknowledged, committed or deleted).
    pub messages: usize,
    /// Deliveries of a message already consumed in the round (SQS is at
    /// least once: a message may be received twice), consumed again.
    pub redelivered: usize,
    /// Wall-clock time of the round.
    pub elapsed: Duration,
    /// Duration of each poll that returned messages, in nanoseconds.
    pub polls: Vec<u64>,
}

impl Round {
    /// Fails unless `expected` distinct messages were consumed and the
    /// handler ran as the scenario says: through the library once per fresh
    /// message (redelivered or not) and never for a duplicate; in the raw
    /// loop once per delivery.
    ///
    /// # Errors
    /// The discrepancy.
    pub fn check(
        &self,
        variant: Variant,
        scenario: Scenario,
        expected: usize,
        handled: usize,
    ) -> Result<(), BoxError> {
        let want = match (variant, scenario) {
            (Variant::Library, s) if s.is_duplicate() => 0,
            (Variant::Library, _) => expected,
            (Variant::Raw, _) => expected + self.redelivered,
        };
        if self.messages != expected || handled != want {
            return Err(format!(
                "{variant} {scenario} round: {} messages consumed ({} redelivered) and {handled} \
                 handled, expected {expected} and {want}",
                self.messages, self.redelivered
            )
            .into());
        }
        Ok(())
    }
}

/// A broker benchmark: a library consumer and a raw one, each on its own
/// topic or queue of the same broker.
#[async_trait]
pub trait BrokerWorkload: Send + Sync {
    /// `kafka` or `sqs`.
    fn broker(&self) -> &'static str;

    /// `memory` or `redis`.
    fn store(&self) -> &str;

    /// What it runs against, for the report.
    fn describe(&self) -> String;

    /// Puts `messages` new messages with keys `{ns}-{i}` on `variant`'s topic
    /// or queue; for a duplicate scenario, completes their keys in the store
    /// first. Untimed.
    async fn prepare(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        messages: usize,
    ) -> Result<(), BoxError>;

    /// Consumes exactly the `messages` messages [`prepare`](Self::prepare)
    /// put there, timed, and checks the round ([`Round::check`]).
    async fn consume(
        &self,
        variant: Variant,
        scenario: Scenario,
        messages: usize,
    ) -> Result<Round, BoxError>;
}

/// How much to run per broker, store and scenario.
#[derive(Debug, Clone)]
pub struct BrokerPlan {
    /// Measured messages per variant (split over the rounds, each rounded up
    /// to whole polls of `poll`).
    pub messages: usize,
    /// Messages a poll takes at most: [`BATCH`] for Kafka, 10 for SQS.
    pub poll: usize,
    /// Measured rounds per variant, alternating A B B A ….
    pub rounds: usize,
    /// Messages of the unmeasured first round of each variant (the consumer
    /// group's join, connections, the store's first use).
    pub warmup: usize,
    /// Scenarios: `fresh` and/or `duplicate`.
    pub scenarios: Vec<Scenario>,
}

impl BrokerPlan {
    /// Messages per measured round.
    pub fn per_round(&self) -> usize {
        let per = self.messages.div_ceil(self.rounds.max(1)).max(1);
        let poll = self.poll.max(1);
        per.div_ceil(poll) * poll
    }

    /// Messages one run of this plan consumes (for the progress bar).
    pub fn total_messages(&self) -> u64 {
        let per_scenario = 2 * (self.per_round() * self.rounds.max(1) + self.warmup);
        (self.scenarios.len() * per_scenario) as u64
    }
}

async fn one_round(
    workload: &dyn BrokerWorkload,
    variant: Variant,
    scenario: Scenario,
    messages: usize,
) -> Result<Round, BoxError> {
    let label = format!("{}-{}", workload.broker(), workload.store());
    let ns = round_namespace(&label, scenario, variant);
    workload.prepare(variant, scenario, &ns, messages).await?;
    workload.consume(variant, scenario, messages).await
}

/// Runs `plan` on `workload`: per scenario, a warm-up round per variant,
/// then interleaved measured rounds.
///
/// # Errors
/// The first failed round.
pub async fn run(
    workload: &dyn BrokerWorkload,
    plan: &BrokerPlan,
    progress: &ProgressBar,
) -> Result<Vec<BrokerMeasurement>, BoxError> {
    let name = format!("{} over {}", workload.broker(), workload.store());
    let mut out = Vec::new();
    for &scenario in &plan.scenarios {
        if plan.warmup > 0 {
            progress.set_message(format!("{name} {scenario}: warm-up"));
            for variant in [Variant::Library, Variant::Raw] {
                one_round(workload, variant, scenario, plan.warmup).await?;
                progress.inc(plan.warmup as u64);
            }
        }
        let per_round = plan.per_round();
        let mut merged: [Vec<Round>; 2] = [Vec::new(), Vec::new()];
        for r in 0..plan.rounds.max(1) {
            progress.set_message(format!(
                "{name} {scenario}: round {}/{}",
                r + 1,
                plan.rounds.max(1)
            ));
            for variant in round_order(r) {
                let round = one_round(workload, variant, scenario, per_round).await?;
                progress.inc(round.messages as u64);
                merged[variant as usize].push(round);
            }
        }
        for variant in [Variant::Library, Variant::Raw] {
            let rounds = std::mem::take(&mut merged[variant as usize]);
            out.push(BrokerMeasurement::from_rounds(
                workload, scenario, variant, rounds,
            ));
        }
    }
    Ok(out)
}

impl BrokerMeasurement {
    fn from_rounds(
        workload: &dyn BrokerWorkload,
        scenario: Scenario,
        variant: Variant,
        rounds: Vec<Round>,
    ) -> Self {
        let rate = |messages: usize, elapsed: Duration| {
            let secs = elapsed.as_secs_f64();
            if secs > 0.0 {
                messages as f64 / secs
            } else {
                0.0
            }
        };
        let messages: usize = rounds.iter().map(|r| r.messages).sum();
        let redelivered = rounds.iter().map(|r| r.redelivered).sum();
        let elapsed: Duration = rounds.iter().map(|r| r.elapsed).sum();
        let round_rates = rounds.iter().map(|r| rate(r.messages, r.elapsed)).collect();
        let polls: Vec<u64> = rounds.into_iter().flat_map(|r| r.polls).collect();
        let count = polls.len();
        let mut samples = Samples::new(polls, elapsed);
        BrokerMeasurement {
            broker: workload.broker().to_owned(),
            store: workload.store().to_owned(),
            scenario,
            variant,
            messages,
            messages_per_sec: rate(messages, elapsed),
            round_messages_per_sec: round_rates,
            polls: count,
            redelivered,
            poll_p50_us: samples.quantile_us(0.50),
            poll_p99_us: samples.quantile_us(0.99),
        }
    }
}

/// Nanoseconds since `t`, saturated.
pub fn nanos_since(t: std::time::Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// How long a round may go without consuming a message before it fails
/// (bounded loops: a lost message fails the run instead of hanging it).
pub const STALL: Duration = Duration::from_secs(30);
