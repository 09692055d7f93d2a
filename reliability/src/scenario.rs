//! The scenarios: which fault, and the configuration it runs under.

use std::fmt;
use std::time::Duration;

use idempotency_core::Config;

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
    /// Callers give up at random points (before, during and after the
    /// handler's effect); executions are detached, so the handler finishes.
    CallerGivesUp,
    /// Handlers take 1.5 leases; lease extension keeps them.
    SlowHandlerExtended,
    /// Half of the consumers' clocks run ahead by half the skew allowance.
    ClockAhead,
    /// Latency, a black hole, resets and lost replies in turn.
    Mixed,
    /// The server's processes are frozen (`docker pause`) for a second.
    ServerPause,
    /// The server is stopped and started again (PostgreSQL: durable).
    ServerRestart,
}

impl Scenario {
    /// Every scenario, in report order.
    pub const ALL: [Scenario; 11] = [
        Scenario::Baseline,
        Scenario::Latency,
        Scenario::BlackHole,
        Scenario::Resets,
        Scenario::LostReplies,
        Scenario::CallerGivesUp,
        Scenario::SlowHandlerExtended,
        Scenario::ClockAhead,
        Scenario::Mixed,
        Scenario::ServerPause,
        Scenario::ServerRestart,
    ];

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

    /// The most effects per key the contract allows in this scenario: one in
    /// each of these (a store that loses data, a lease that ends without
    /// extension, a clock beyond the skew allowance and fail-open are not
    /// among them: there the contract states no such bound).
    pub fn effects_bound(self) -> usize {
        1
    }

    /// Whether the fault acts on the server itself (needs a container of the
    /// run's own).
    pub fn needs_own_server(self) -> bool {
        matches!(self, Scenario::ServerPause | Scenario::ServerRestart)
    }

    /// The lease: short, so takeovers and waits for abandoned leases happen
    /// within a run; longer than a restart of the server, so a restart is an
    /// outage shorter than the lease (the contract's condition for exactly
    /// once).
    pub fn lease(self) -> Duration {
        match self {
            Scenario::ServerRestart => Duration::from_secs(20),
            _ => Duration::from_secs(3),
        }
    }

    /// How long the fault schedule lasts (each fault window is one second,
    /// after 50 ms): the deliveries are spread over it, so the faults meet
    /// traffic.
    pub fn span(self) -> Duration {
        match self {
            Scenario::Mixed => Duration::from_millis(4_300),
            Scenario::ServerRestart => Duration::from_millis(5_000),
            Scenario::ServerPause => Duration::from_millis(1_300),
            s if s.needs_network() => Duration::from_millis(1_300),
            _ => Duration::from_millis(500),
        }
    }

    /// How many of the plan's `keys` to deliver: slow handlers get one key
    /// per consumer, so the run lasts about one handler's time.
    pub fn keys(self, keys: usize, consumers: usize) -> usize {
        match self {
            Scenario::SlowHandlerExtended => keys.min(consumers),
            _ => keys,
        }
    }

    /// How long the handler takes.
    pub fn handler_time(self) -> Duration {
        match self {
            Scenario::SlowHandlerExtended => self.lease() * 3 / 2,
            _ => Duration::from_millis(10),
        }
    }

    /// The manager's configuration.
    pub fn config(self, key_prefix: &str) -> Config {
        let mut config = Config {
            key_prefix: key_prefix.to_owned(),
            ttl: Duration::from_secs(120),
            processing_timeout: self.lease(),
            store_timeout: Duration::from_millis(700),
            clock_skew: Duration::from_millis(400),
            ..Config::default()
        };
        if self == Scenario::SlowHandlerExtended {
            config.lease_extension_interval = Some(self.lease() / 4);
        }
        config
    }

    /// How far ahead consumer `index`'s clock runs.
    pub fn clock_offset(self, index: usize) -> Duration {
        match self {
            Scenario::ClockAhead if index % 2 == 1 => Duration::from_millis(200),
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
            Scenario::ClockAhead => "clock ahead (within skew)",
            Scenario::Mixed => "mixed",
            Scenario::ServerPause => "server paused",
            Scenario::ServerRestart => "server restarted",
        };
        f.write_str(name)
    }
}
