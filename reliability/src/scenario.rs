//! The scenarios: which fault, and the configuration it runs under.

use std::fmt;
use std::time::Duration;

use idempotency_core::Config;

/// The clock skew allowance of every scenario.
const SKEW: Duration = Duration::from_millis(400);

/// One kind of fault, injected while the consumers deliver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// No fault: the reference run.
    Baseline,
    /// 2 ms + up to 3 ms of jitter on every chunk, both ways.
    Latency,
    /// The store stops answering (requests read, nothing answered) for a
    /// second, then answers again.
    BlackHole,
    /// Every connection to the store is closed every 50 ms.
    Resets,
    /// One reply in five is lost after the store applied the request (the
    /// connection closes).
    LostReplies,
    /// Half the callers give up at random points (before, during and after
    /// the handler's effect); executions are detached, so the handler
    /// finishes.
    CallerGivesUp,
    /// Handlers take 1.5 leases; lease extension keeps them.
    SlowHandlerExtended,
    /// Handlers outlive the record's TTL (1.8 TTLs); lease extension moves the
    /// lease and the expiry with them.
    SlowerThanTtlExtended,
    /// Handlers outlive the lease and the TTL without extension: a duplicate
    /// takes the key over and runs again (the contract's stated limit).
    SlowerThanTtlUnextended,
    /// Half of the consumers' clocks run ahead by half the skew allowance.
    ClockAhead,
    /// Half of the consumers' clocks run ahead by more than a lease plus the
    /// skew allowance: they see live leases as stale (the stated limit).
    ClockBeyondSkew,
    /// Consumers crash at random points (before, during and after the
    /// handler's effect): the `execute` future is leaked, nothing cleans up.
    ConsumerCrash,
    /// Latency, a black hole, resets and lost replies in turn.
    Mixed,
    /// The server's processes are frozen (`docker pause`) for a second.
    ServerPause,
    /// The server is stopped and started again (PostgreSQL; Redis with an
    /// append-only file fsynced on every write): durable.
    ServerRestart,
    /// Redis without persistence is restarted: it forgets every record (the
    /// stated limit of a store that loses data).
    ServerRestartForgetful,
}

/// The most effects per key the contract promises in a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Exactly once.
    One,
    /// Once, plus each effect applied by a consumer that crashed before
    /// recording it (its lease then ends and the key is taken over).
    OnePlusCrashed,
    /// At most once per delivery, no promise per key: a handler that outlives
    /// its lease without extension, a clock beyond the skew allowance, a store
    /// that forgets its records.
    PerDelivery,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::One => "1",
            Bound::OnePlusCrashed => "1 + crashed after effect",
            Bound::PerDelivery => "1 per delivery",
        })
    }
}

impl Scenario {
    /// Every scenario, in report order.
    pub const ALL: [Scenario; 16] = [
        Scenario::Baseline,
        Scenario::Latency,
        Scenario::BlackHole,
        Scenario::Resets,
        Scenario::LostReplies,
        Scenario::CallerGivesUp,
        Scenario::SlowHandlerExtended,
        Scenario::SlowerThanTtlExtended,
        Scenario::SlowerThanTtlUnextended,
        Scenario::ClockAhead,
        Scenario::ClockBeyondSkew,
        Scenario::ConsumerCrash,
        Scenario::Mixed,
        Scenario::ServerPause,
        Scenario::ServerRestart,
        Scenario::ServerRestartForgetful,
    ];

    /// Whether consumers may take this scenario's deliveries in polls
    /// (`execute_batch`): not where callers give up or crash, which a batch
    /// consumer would do for its whole poll.
    pub fn batches(self) -> bool {
        !matches!(self, Scenario::CallerGivesUp | Scenario::ConsumerCrash)
    }

    /// Whether the fault acts on the network (needs a store behind a proxy).
    pub fn needs_network(self) -> bool {
        matches!(
            self,
            Scenario::Latency
                | Scenario::BlackHole
                | Scenario::Resets
                | Scenario::LostReplies
                | Scenario::Mixed
        )
    }

    /// The most effects per key the contract promises in this scenario.
    pub fn bound(self) -> Bound {
        match self {
            Scenario::SlowerThanTtlUnextended
            | Scenario::ClockBeyondSkew
            | Scenario::ServerRestartForgetful => Bound::PerDelivery,
            Scenario::ConsumerCrash => Bound::OnePlusCrashed,
            _ => Bound::One,
        }
    }

    /// Whether the store keeps every record it acknowledged through the
    /// fault: not a Redis without persistence that restarts (it forgets
    /// them), whose history of store calls cannot be linearizable (a record
    /// read after the restart is gone): its check is reported, not held
    /// against the run.
    pub fn store_keeps_records(self) -> bool {
        self != Scenario::ServerRestartForgetful
    }

    /// Whether the fault acts on the server itself (needs a container of the
    /// run's own).
    pub fn needs_own_server(self) -> bool {
        matches!(
            self,
            Scenario::ServerPause | Scenario::ServerRestart | Scenario::ServerRestartForgetful
        )
    }

    /// The lease: short, so takeovers and waits for abandoned leases happen
    /// within a run; longer than a restart of the server, so a restart is an
    /// outage shorter than the lease (the contract's condition for exactly
    /// once).
    ///
    /// Where no takeover is meant to happen, the lease is long (10 s): a store
    /// starved of CPU on a loaded machine must not turn a slow answer into a
    /// lapsed lease, which the contract does not cover.
    pub fn lease(self) -> Duration {
        match self {
            Scenario::ServerRestart | Scenario::ServerRestartForgetful => Duration::from_secs(20),
            // Long enough that an extension every second survives a starved
            // store (each call gets half an interval).
            Scenario::SlowerThanTtlExtended | Scenario::SlowerThanTtlUnextended => {
                Duration::from_secs(4)
            }
            Scenario::SlowHandlerExtended | Scenario::ConsumerCrash | Scenario::ClockBeyondSkew => {
                Duration::from_secs(3)
            }
            _ => Duration::from_secs(10),
        }
    }

    /// How long a record lives: long, except where the handler is to outlive
    /// it (the shortest TTL the configuration allows: lease + skew).
    pub fn ttl(self) -> Duration {
        match self {
            Scenario::SlowerThanTtlExtended | Scenario::SlowerThanTtlUnextended => {
                self.lease() + SKEW
            }
            _ => Duration::from_secs(120),
        }
    }

    /// How long the fault schedule lasts (each fault window is one second,
    /// after 50 ms): the deliveries are spread over it, so the faults meet
    /// traffic.
    pub fn span(self) -> Duration {
        match self {
            Scenario::Mixed => Duration::from_millis(4_300),
            Scenario::ServerRestart | Scenario::ServerRestartForgetful => {
                Duration::from_millis(5_000)
            }
            Scenario::ServerPause => Duration::from_millis(1_300),
            s if s.needs_network() => Duration::from_millis(1_300),
            _ => Duration::from_millis(500),
        }
    }

    /// How many of the plan's `keys` to deliver: slow handlers get one key
    /// per consumer, so the run lasts about one handler's time.
    pub fn keys(self, keys: usize, consumers: usize) -> usize {
        match self {
            Scenario::SlowHandlerExtended
            | Scenario::SlowerThanTtlExtended
            | Scenario::SlowerThanTtlUnextended => keys.min(consumers),
            _ => keys,
        }
    }

    /// How long the handler takes.
    pub fn handler_time(self) -> Duration {
        match self {
            Scenario::SlowHandlerExtended => self.lease() * 3 / 2,
            Scenario::SlowerThanTtlExtended | Scenario::SlowerThanTtlUnextended => {
                self.ttl() * 9 / 5
            }
            _ => Duration::from_millis(10),
        }
    }

    /// The manager's configuration.
    pub fn config(self, key_prefix: &str) -> Config {
        let mut config = Config {
            key_prefix: key_prefix.to_owned(),
            ttl: self.ttl(),
            processing_timeout: self.lease(),
            store_timeout: Duration::from_millis(700),
            clock_skew: SKEW,
            ..Config::default()
        };
        if matches!(
            self,
            Scenario::SlowHandlerExtended | Scenario::SlowerThanTtlExtended
        ) {
            config.lease_extension_interval = Some(self.lease() / 4);
        }
        config
    }

    /// How far ahead consumer `index`'s clock runs.
    pub fn clock_offset(self, index: usize) -> Duration {
        match self {
            Scenario::ClockAhead if index % 2 == 1 => SKEW / 2,
            Scenario::ClockBeyondSkew if index % 2 == 1 => self.lease() + SKEW * 2,
            _ => Duration::ZERO,
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Scenario::Baseline => "baseline",
            Scenario::Latency => "latency",
            Scenario::BlackHole => "black hole",
            Scenario::Resets => "resets",
            Scenario::LostReplies => "lost replies",
            Scenario::CallerGivesUp => "caller gives up",
            Scenario::SlowHandlerExtended => "slow handler, extended",
            Scenario::SlowerThanTtlExtended => "handler slower than TTL, extended",
            Scenario::SlowerThanTtlUnextended => "handler slower than TTL, no extension",
            Scenario::ClockAhead => "clock ahead (within skew)",
            Scenario::ClockBeyondSkew => "clock ahead (beyond skew)",
            Scenario::ConsumerCrash => "consumer crashes",
            Scenario::Mixed => "mixed",
            Scenario::ServerPause => "server paused",
            Scenario::ServerRestart => "server restarted (durable)",
            Scenario::ServerRestartForgetful => "server restarted (no persistence)",
        };
        f.write_str(name)
    }
}
