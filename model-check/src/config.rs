//! What the model explores: how many consumers, their clocks, the lease and
//! TTL, and the budgets of faults, crashes and dropped calls that keep the
//! state space finite.

use std::time::Duration;

use idempotency_core::{
    AnswerCacheConfig, CancelPolicy, Config, Error, FailurePolicy, RecordKey, Timestamp,
};

/// One tick of the model's clocks: a second.
pub const TICK_MS: u64 = 1_000;

/// The instant of `tick`.
pub fn at(tick: u8) -> Timestamp {
    Timestamp::from_millis(u64::from(tick) * TICK_MS)
}

/// `ticks` as a duration.
pub fn ticks(ticks: u8) -> Duration {
    Duration::from_millis(u64::from(ticks) * TICK_MS)
}

/// A decision deliberately broken, to show the checker catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Broken {
    /// The store takes a lease over without the skew allowance: the reserve
    /// request it decides on carries `clock_skew = 0`.
    TakeoverWithoutSkew,
    /// The store applies a `complete` to any live `Processing` record,
    /// whoever holds it (the owner check left out).
    OwnerUncheckedComplete,
    /// Consumers wait for a lost call for ever (no store time box): shows
    /// the liveness properties catch a delivery left unanswered.
    NoTimeBox,
}

/// The model's parameters. Durations are in ticks ([`TICK_MS`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// Each consumer's clock offset from true time, in ticks; the length is
    /// the number of consumers. Within the allowance when no two differ by
    /// more than `clock_skew`.
    pub clock_offsets: Vec<u8>,
    /// Deliveries of the key each consumer gets (the first, plus
    /// redeliveries of a delivery it did not acknowledge).
    pub deliveries: u8,
    /// `processing_timeout`, in ticks.
    pub processing_timeout: u8,
    /// `clock_skew` (the allowance), in ticks.
    pub clock_skew: u8,
    /// `ttl`, in ticks (at least `processing_timeout + clock_skew`).
    pub ttl: u8,
    /// True time stops here.
    pub max_time: u8,
    /// Lost requests, lost replies and calls given up while their request
    /// is still on its way (delayed), in all.
    pub faults: u8,
    /// Consumer crashes, in all.
    pub crashes: u8,
    /// Callers dropping an execution (at any phase), in all.
    pub drops: u8,
    /// Lease extension on (the keeper extends beside the handler).
    pub extension: bool,
    /// Handlers may fail (else they always succeed).
    pub handler_failures: bool,
    /// The failure policy.
    pub failure_policy: FailurePolicy,
    /// What a dropped execution does while its handler runs.
    pub on_cancel: CancelPolicy,
    /// The local answer cache on, with this staleness bound in ticks.
    pub answer_cache: Option<u8>,
    /// A decision deliberately broken.
    pub broken: Option<Broken>,
}

impl Default for ModelConfig {
    /// Two consumers whose clocks differ by the one-tick allowance (the
    /// boundary, still within it), a one-tick lease, one fault, one crash,
    /// no drops.
    fn default() -> Self {
        ModelConfig {
            clock_offsets: vec![0, 1],
            deliveries: 2,
            processing_timeout: 1,
            clock_skew: 1,
            ttl: 3,
            max_time: 4,
            faults: 1,
            crashes: 1,
            drops: 0,
            extension: false,
            handler_failures: false,
            failure_policy: FailurePolicy::Release,
            on_cancel: CancelPolicy::KeepLease,
            answer_cache: None,
            broken: None,
        }
    }
}

impl ModelConfig {
    /// The number of consumers.
    pub fn consumers(&self) -> usize {
        self.clock_offsets.len()
    }

    /// The largest difference between two consumers' clocks, in ticks.
    pub fn clock_spread(&self) -> u8 {
        let max = self.clock_offsets.iter().copied().max().unwrap_or(0);
        let min = self.clock_offsets.iter().copied().min().unwrap_or(0);
        max - min
    }

    /// The library's own configuration for these parameters, validated by it.
    ///
    /// # Errors
    /// [`Error::Config`] when the library refuses it (a TTL shorter than the
    /// lease plus the skew, …).
    pub fn core_config(&self) -> Result<Config, Error> {
        let config = Config {
            key_prefix: "model".to_owned(),
            ttl: ticks(self.ttl),
            processing_timeout: ticks(self.processing_timeout),
            clock_skew: ticks(self.clock_skew),
            store_timeout: Duration::from_millis(TICK_MS / 2),
            lease_extension_interval: self.extension.then(|| ticks(self.processing_timeout) / 2),
            failure_policy: self.failure_policy,
            on_cancel: self.on_cancel,
            cache_results: true,
            validate_payload: false,
            answer_cache: self.answer_cache.map(|staleness| AnswerCacheConfig {
                max_staleness: ticks(staleness),
                ..AnswerCacheConfig::default()
            }),
            ..Config::default()
        };
        config.validate()?;
        Ok(config)
    }

    /// The one key every consumer is delivered.
    ///
    /// # Errors
    /// Never for this constant key.
    pub fn key() -> Result<RecordKey, Error> {
        RecordKey::new("model", "key", 256)
    }
}
