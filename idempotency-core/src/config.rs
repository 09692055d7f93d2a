//! Configuration of the manager, with the defaults of the contract (§4).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// What happens to the record when the handler fails (a per-call
/// [`FailureKind`](crate::FailureKind) overrides it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// Delete the record so a redelivery runs the handler again (default).
    #[default]
    Release,
    /// Store `Failed`: duplicates get the stored error until the TTL.
    Store,
    /// Store `Failed`, and let the next delivery take it over and run again.
    StoreAndRetry,
}

/// What a duplicate gets while another attempt holds a live lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum InProgressPolicy {
    /// Return [`Error::InProgress`] at once (default): the broker redelivers later,
    /// HTTP answers 409.
    #[default]
    FailFast,
    /// Poll the store until the holder finishes or `timeout` passes, then answer
    /// as a duplicate (or run, if the holder released the key or its lease ran out).
    Wait {
        /// How long to wait at most.
        #[serde(with = "duration")]
        timeout: Duration,
        /// How often to look.
        #[serde(with = "duration")]
        poll_interval: Duration,
    },
}

/// What happens when the store is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutagePolicy {
    /// Return the store's error; the handler does not run (default).
    #[default]
    FailClosed,
    /// Run the handler without protection; counted in
    /// `idempotency_fail_open` and logged.
    FailOpen,
}

/// What happens to the record when the caller drops the `execute` future while
/// the handler runs (an HTTP client disconnects, an outer timeout fires).
///
/// The handler may already have applied its effect when it is dropped, so the
/// default never makes the key re-runnable at once. To let the handler finish
/// and record its outcome although the caller left, use
/// [`IdempotencyManager::execute_detached`](crate::IdempotencyManager::execute_detached).
/// Whatever the policy, a drop before the handler started releases the record
/// (no effect can have happened), and a drop after it finished records its
/// outcome in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelPolicy {
    /// The record keeps its lease until it ends (default): duplicates get
    /// `InProgress` meanwhile, and a delivery after the lease takes over.
    #[default]
    KeepLease,
    /// Release the record at once so a redelivery runs the handler again. Only
    /// for handlers with no effect before they return (opt-in).
    Release,
}

/// Manager configuration. Every field has the default of the contract (§4), so a config
/// file only names what it changes.
///
/// Durations deserialize from integers (seconds) or strings with a unit
/// (`"250ms"`, `"30s"`, `"5m"`, `"1h"`).
///
/// ```
/// use idempotency_core::{Config, FailurePolicy};
/// use std::time::Duration;
///
/// let config: Config = serde_json::from_str(r#"{
///     "key_prefix": "payments",
///     "ttl": "2h",
///     "processing_timeout": 60,
///     "failure_policy": "store"
/// }"#)?;
/// assert_eq!(config.ttl, Duration::from_secs(7200));
/// assert_eq!(config.processing_timeout, Duration::from_secs(60));
/// assert_eq!(config.failure_policy, FailurePolicy::Store);
/// assert!(config.cache_results); // a default
/// config.validate()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The namespace prefix of every key (default `idempotency`).
    pub key_prefix: String,
    /// How long a finished record is kept, i.e. the de-duplication window
    /// (default 3600 s).
    #[serde(with = "duration")]
    pub ttl: Duration,
    /// The lease of a `Processing` record: after it (plus `clock_skew`) another
    /// consumer may take over (default 300 s).
    #[serde(with = "duration")]
    pub processing_timeout: Duration,
    /// Whether handler results are stored and replayed to duplicates (default on).
    pub cache_results: bool,
    /// The largest serialized result cached (default 1 MiB); larger results
    /// complete the record without a cached result.
    pub max_result_size_bytes: usize,
    /// Whether payloads are fingerprinted to detect key reuse (default on).
    pub validate_payload: bool,
    /// What a handler error does to the record.
    pub failure_policy: FailurePolicy,
    /// What a duplicate gets while another attempt runs.
    pub in_progress: InProgressPolicy,
    /// What happens when the store is unreachable.
    pub on_store_outage: OutagePolicy,
    /// Tolerated clock drift between consumers; delays takeovers (default 0).
    #[serde(with = "duration")]
    pub clock_skew: Duration,
    /// When set, the lease is extended by `processing_timeout` at this interval
    /// while the handler runs (and while its outcome is being recorded), so long
    /// handlers are not taken over; the record's expiry moves with the lease.
    /// An extension is also tried sooner whenever less of the lease is left
    /// than one attempt's time box (half the interval, at most
    /// `store_timeout`), and a failed one again at the next tick, or with
    /// backoff in the lease's last stretch, cut to half of the lease that is
    /// left (down to the shortest backoff, 20 ms) (default off).
    #[serde(with = "option_duration")]
    pub lease_extension_interval: Option<Duration>,
    /// The longest the manager waits for one store call before treating it as
    /// [`Error::Timeout`] — an ambiguous failure: the call may have been applied
    /// (default 5 s). Backends have their own timeouts too; this one also bounds
    /// a custom backend whose reply never comes.
    #[serde(with = "duration")]
    pub store_timeout: Duration,
    /// What a dropped `execute` future does to the record (default: keep the
    /// lease until it ends).
    pub on_cancel: CancelPolicy,
    /// A bounded in-process cache of completed answers in front of the store
    /// (default off): see [`AnswerCacheConfig`].
    pub answer_cache: Option<AnswerCacheConfig>,
}

/// A bounded in-process cache of completed answers (contract §4, "local
/// answers").
///
/// A `Completed` record never changes until it expires, so a duplicate of a
/// key this process recently saw completed (its own execution, or a store
/// answer) is answered in-process, with no round trip: the same decision the
/// store's record would give (cached result, `Duplicate`, or a payload
/// mismatch). `Processing` and `Failed` records are never cached.
///
/// - An entry is never served at or after its record's `expires_at` minus
///   [`Config::clock_skew`] (judged on the manager's clock).
/// - An entry is served for at most [`max_staleness`](Self::max_staleness)
///   after it was read from (or written to) the store: that bounds how long a
///   record an operator deleted (`idempotency evict`) is still answered by this
///   process. Within that bound, a deleted key's duplicates get the old
///   answer instead of running the handler again.
/// - The cache holds at most [`max_bytes`](Self::max_bytes) of keys and results;
///   the least valuable entries (moka's TinyLFU) are evicted first.
/// - Every clone and scope of a manager shares one cache; the PostgreSQL
///   transactional manager does not use it (its duplicates are read inside
///   the caller's transaction).
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{AnswerCacheConfig, Config};
/// let config = Config {
///     answer_cache: Some(AnswerCacheConfig {
///         max_bytes: 16 << 20,
///         max_staleness: Duration::from_secs(5),
///     }),
///     ..Config::default()
/// };
/// config.validate()?;
/// # Ok::<(), idempotency_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnswerCacheConfig {
    /// The most bytes of keys and cached results kept (default 64 MiB).
    pub max_bytes: u64,
    /// The longest an answer is served from the cache after the store gave it
    /// (default 10 s).
    #[serde(with = "duration")]
    pub max_staleness: Duration,
}

impl Default for AnswerCacheConfig {
    fn default() -> Self {
        AnswerCacheConfig {
            max_bytes: 64 << 20,
            max_staleness: Duration::from_secs(10),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            key_prefix: "idempotency".to_owned(),
            ttl: Duration::from_secs(3600),
            processing_timeout: Duration::from_secs(300),
            cache_results: true,
            max_result_size_bytes: 1024 * 1024,
            validate_payload: true,
            failure_policy: FailurePolicy::Release,
            in_progress: InProgressPolicy::FailFast,
            on_store_outage: OutagePolicy::FailClosed,
            clock_skew: Duration::ZERO,
            lease_extension_interval: None,
            store_timeout: Duration::from_secs(5),
            on_cancel: CancelPolicy::KeepLease,
            answer_cache: None,
        }
    }
}

impl Config {
    /// Checks the values against each other.
    ///
    /// # Errors
    /// [`Error::Config`] when the TTL, processing timeout or store timeout is
    /// zero, the TTL is shorter than `processing_timeout + clock_skew` (a record
    /// must never expire before its lease ends, or a duplicate would run the
    /// handler again beside the first), or the lease extension interval is not
    /// shorter than the processing timeout.
    pub fn validate(&self) -> Result<(), Error> {
        self.check_bounds()?;
        if self.ttl.is_zero() || self.processing_timeout.is_zero() {
            return Err(Error::config("ttl and processing_timeout must be positive"));
        }
        if self.store_timeout.is_zero() {
            return Err(Error::config("store_timeout must be positive"));
        }
        if self.store_timeout >= self.processing_timeout {
            return Err(Error::config(format!(
                "store_timeout ({:?}) must be shorter than processing_timeout ({:?}): a store \
                 call that may outlast the lease cannot record an outcome within it",
                self.store_timeout, self.processing_timeout
            )));
        }
        if self.key_prefix.is_empty() || self.key_prefix.len() > crate::MAX_NAMESPACE_BYTES {
            return Err(Error::config(format!(
                "key_prefix must be 1 to {} bytes long (it is {})",
                crate::MAX_NAMESPACE_BYTES,
                self.key_prefix.len()
            )));
        }
        let lease_span = self.processing_timeout.saturating_add(self.clock_skew);
        if self.ttl < lease_span {
            return Err(Error::config(format!(
                "ttl ({:?}) must be at least processing_timeout + clock_skew ({:?}): the \
                 record would expire while its lease is live, and a duplicate would run \
                 the handler again",
                self.ttl, lease_span
            )));
        }
        if let Some(i) = self.lease_extension_interval {
            if i.is_zero() || i >= self.processing_timeout {
                return Err(Error::config(
                    "lease_extension_interval must be positive and shorter than processing_timeout",
                ));
            }
        }
        if let Some(cache) = self.answer_cache {
            if cache.max_bytes == 0 || cache.max_staleness.is_zero() {
                return Err(Error::config(
                    "answer_cache.max_bytes and answer_cache.max_staleness must be positive \
                     (for no cache, leave answer_cache unset)",
                ));
            }
        }
        if let InProgressPolicy::Wait {
            poll_interval,
            timeout,
        } = self.in_progress
        {
            if poll_interval.is_zero() || timeout.is_zero() {
                return Err(Error::config(
                    "in_progress.timeout and in_progress.poll_interval must be positive \
                     (for no wait, use the fail_fast policy)",
                ));
            }
        }
        Ok(())
    }

    /// Every duration of the configuration with its name.
    fn durations(&self) -> impl Iterator<Item = (&'static str, Duration)> {
        let wait = match self.in_progress {
            InProgressPolicy::Wait {
                poll_interval,
                timeout,
            } => [
                Some(("in_progress.poll_interval", poll_interval)),
                Some(("in_progress.timeout", timeout)),
            ],
            InProgressPolicy::FailFast => [None, None],
        };
        [
            Some(("ttl", self.ttl)),
            Some(("processing_timeout", self.processing_timeout)),
            Some(("clock_skew", self.clock_skew)),
            Some(("store_timeout", self.store_timeout)),
            self.lease_extension_interval
                .map(|d| ("lease_extension_interval", d)),
            self.answer_cache
                .map(|c| ("answer_cache.max_staleness", c.max_staleness)),
        ]
        .into_iter()
        .chain(wait)
        .flatten()
    }

    /// Refuses a duration past [`MAX_DURATION`]: added to an instant, it
    /// would overflow the clock (a panic in `Instant + Duration`) or a
    /// store's column.
    fn check_bounds(&self) -> Result<(), Error> {
        match self.durations().find(|(_, d)| *d > MAX_DURATION) {
            Some((name, d)) => Err(Error::config(format!(
                "{name} ({d:?}) is longer than the longest duration the library accepts \
                 ({} days): added to an instant it would overflow a clock or a store's column",
                MAX_DURATION.as_secs() / 86_400
            ))),
            None => Ok(()),
        }
    }
}

/// The longest duration a [`Config`] accepts, for every one of its durations
/// (TTL, timeouts, skew, intervals): 100 years of 365 days. Every instant the
/// library computes from a configured duration then fits the clocks it adds
/// them to (`Instant`, milliseconds since the epoch in a store's 64-bit
/// column) with room to spare.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{Config, InProgressPolicy, MAX_DURATION};
/// let config = Config {
///     in_progress: InProgressPolicy::Wait {
///         poll_interval: Duration::from_millis(50),
///         timeout: Duration::MAX,
///     },
///     ..Config::default()
/// };
/// assert!(config.validate().is_err());
/// assert!(MAX_DURATION >= Duration::from_secs(100 * 365 * 86_400));
/// ```
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 86_400);

/// Parses `"250ms"`, `"30s"`, `"5m"`, `"1h"`, `"2d"` or a bare number of seconds.
///
/// ```
/// use idempotency_core::parse_duration;
/// use std::time::Duration;
/// assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
/// assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
/// assert_eq!(parse_duration("12"), Some(Duration::from_secs(12)));
/// assert_eq!(parse_duration("soon"), None);
/// ```
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let ms = match unit.trim() {
        "ms" => n,
        "" | "s" => n.checked_mul(1_000)?,
        "m" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// Parses a URL option's boolean: `true`/`1`/`yes`/`on` or
/// `false`/`0`/`no`/`off`, in any case.
///
/// ```
/// use idempotency_core::parse_bool;
/// assert_eq!(parse_bool("ON"), Some(true));
/// assert_eq!(parse_bool("0"), Some(false));
/// assert_eq!(parse_bool("maybe"), None);
/// ```
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A store URL fit to print: the password of its user information and the
/// values of query options that carry secrets (`password`, `secret`, `token`,
/// keys) replaced by `***`. Everything else is kept, so the URL still says
/// which store it names.
///
/// ```
/// use idempotency_core::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db/shop"), "postgres://app:***@db/shop");
/// assert_eq!(redact_url("redis://:pw@127.0.0.1:6379/0"), "redis://:***@127.0.0.1:6379/0");
/// assert_eq!(
///     redact_url("mysql://app@db/shop?password=x&table=t"),
///     "mysql://app@db/shop?password=***&table=t"
/// );
/// assert_eq!(redact_url("postgres://app:a/b@c@db/shop"), "postgres://app:***@db/shop");
/// assert_eq!(redact_url("postgres://app:se?cret@db/shop"), "postgres://app:***@db/shop");
/// assert_eq!(
///     redact_url("postgres://db/shop?user=a@b.c&password=x"),
///     "postgres://db/shop?user=a@b.c&password=***"
/// );
/// assert_eq!(redact_url("sqlite:///tmp/a.db"), "sqlite:///tmp/a.db");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return redact_query(url);
    };
    let mut out = format!("{scheme}://");
    let after = match split_userinfo(rest) {
        Some((userinfo, after)) => {
            match userinfo.split_once(':') {
                Some((user, _)) => {
                    out.push_str(user);
                    out.push_str(":***");
                }
                None => out.push_str(userinfo),
            }
            out.push('@');
            after
        }
        None => rest,
    };
    out.push_str(&redact_query(after));
    out
}

/// The user information of what follows a URL's `://` and the rest after
/// its `@`. It ends at the last `@` before the query; a password holding an
/// unescaped `/`, `@` or `?` is taken whole (`user:pa?ss@host`: what comes
/// before the first `?` has a `:` and no `/`, so it cannot be a host's path).
fn split_userinfo(rest: &str) -> Option<(&str, &str)> {
    let query = rest.find('?').unwrap_or(rest.len());
    if let Some(at) = rest[..query].rfind('@') {
        return Some((&rest[..at], &rest[at + 1..]));
    }
    let before = &rest[..query];
    if !before.contains(':') || before.contains('/') {
        return None;
    }
    let at = query + rest[query..].find('@')?;
    Some((&rest[..at], &rest[at + 1..]))
}

/// `head?query` with the values of secret query options replaced by `***`.
fn redact_query(url: &str) -> String {
    let Some((head, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_option(name) => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{head}?{}", pairs.join("&"))
}

fn is_secret_option(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["password", "passwd", "pass", "secret", "token", "key"]
        .iter()
        .any(|secret| name.contains(secret))
        && !matches!(name.as_str(), "partition_key")
}

fn format_duration(d: &Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum DurationRepr {
    Secs(u64),
    Text(String),
}

impl DurationRepr {
    fn into_duration<E: serde::de::Error>(self) -> Result<Duration, E> {
        match self {
            DurationRepr::Secs(s) => Ok(Duration::from_secs(s)),
            DurationRepr::Text(t) => parse_duration(&t).ok_or_else(|| {
                E::custom(format!(
                    "invalid duration {t:?}: use e.g. 250ms, 30s, 5m, 1h"
                ))
            }),
        }
    }
}

mod duration {
    use super::*;
    pub(super) fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(d))
    }
    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        DurationRepr::deserialize(d)?.into_duration()
    }
}

mod option_duration {
    use super::*;
    pub(super) fn serialize<S: serde::Serializer>(
        d: &Option<Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&format_duration(d)),
            None => s.serialize_none(),
        }
    }
    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Option::<DurationRepr>::deserialize(d)?
            .map(DurationRepr::into_duration)
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_spec() {
        let c = Config::default();
        assert_eq!(c.key_prefix, "idempotency");
        assert_eq!(c.ttl, Duration::from_secs(3600));
        assert_eq!(c.processing_timeout, Duration::from_secs(300));
        assert!(c.cache_results);
        assert_eq!(c.max_result_size_bytes, 1 << 20);
        assert_eq!(c.failure_policy, FailurePolicy::Release);
        assert_eq!(c.in_progress, InProgressPolicy::FailFast);
        assert_eq!(c.on_store_outage, OutagePolicy::FailClosed);
        assert_eq!(c.on_cancel, CancelPolicy::KeepLease);
        assert_eq!(c.store_timeout, Duration::from_secs(5));
        c.validate().unwrap();
    }

    #[test]
    fn every_duration_past_the_bound_is_refused_by_name() {
        let wait = |poll_interval, timeout| InProgressPolicy::Wait {
            poll_interval,
            timeout,
        };
        type Setter = Box<dyn Fn(&mut Config)>;
        let cases: Vec<(&str, Setter)> = vec![
            ("ttl", Box::new(|c| c.ttl = Duration::MAX)),
            (
                "processing_timeout",
                Box::new(|c| c.processing_timeout = Duration::MAX),
            ),
            ("clock_skew", Box::new(|c| c.clock_skew = Duration::MAX)),
            (
                "store_timeout",
                Box::new(|c| c.store_timeout = Duration::MAX),
            ),
            (
                "lease_extension_interval",
                Box::new(|c| c.lease_extension_interval = Some(Duration::MAX)),
            ),
            (
                "answer_cache.max_staleness",
                Box::new(|c| {
                    c.answer_cache = Some(AnswerCacheConfig {
                        max_staleness: Duration::MAX,
                        ..AnswerCacheConfig::default()
                    })
                }),
            ),
            (
                "in_progress.timeout",
                Box::new(move |c| c.in_progress = wait(Duration::from_millis(50), Duration::MAX)),
            ),
            (
                "in_progress.poll_interval",
                Box::new(move |c| c.in_progress = wait(Duration::MAX, Duration::from_secs(1))),
            ),
        ];
        for (name, set) in cases {
            let mut c = Config::default();
            set(&mut c);
            let err = c.validate().unwrap_err();
            assert!(matches!(err, Error::Config { .. }), "{name}: {err}");
            assert!(err.to_string().contains(name), "{name}: {err}");
            assert!(!err.is_retryable());
        }
        // One millisecond past the bound is refused; the bound itself is not.
        let at = |d| Config {
            ttl: d,
            ..Config::default()
        };
        assert!(at(MAX_DURATION).validate().is_ok());
        assert!(at(MAX_DURATION + Duration::from_millis(1))
            .validate()
            .is_err());
    }

    #[test]
    fn round_trips_through_json() {
        let c = Config {
            in_progress: InProgressPolicy::Wait {
                timeout: Duration::from_secs(5),
                poll_interval: Duration::from_millis(50),
            },
            lease_extension_interval: Some(Duration::from_secs(60)),
            answer_cache: Some(AnswerCacheConfig {
                max_bytes: 1 << 20,
                max_staleness: Duration::from_millis(1500),
            }),
            ..Config::default()
        };
        let json = serde_json::to_string(&c).unwrap();
        let back: Config = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
        let empty: Config = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, Config::default());
    }

    #[test]
    fn rejects_bad_values() {
        assert!(serde_json::from_str::<Config>(r#"{"ttl": "soon"}"#).is_err());
        assert!(serde_json::from_str::<Config>(r#"{"tll": 5}"#).is_err());
        let short_ttl = Config {
            ttl: Duration::from_secs(10),
            ..Config::default()
        };
        assert!(matches!(short_ttl.validate(), Err(Error::Config { .. })));
        let bad_extension = Config {
            lease_extension_interval: Some(Duration::from_secs(300)),
            ..Config::default()
        };
        assert!(bad_extension.validate().is_err());
        // The TTL must cover the lease plus the skew allowance.
        let skewed = Config {
            ttl: Duration::from_secs(300),
            clock_skew: Duration::from_secs(1),
            ..Config::default()
        };
        assert!(matches!(skewed.validate(), Err(Error::Config { .. })));
        Config {
            ttl: Duration::from_secs(301),
            ..skewed
        }
        .validate()
        .unwrap();
        let no_timeout = Config {
            store_timeout: Duration::ZERO,
            ..Config::default()
        };
        assert!(no_timeout.validate().is_err());
        let no_staleness = Config {
            answer_cache: Some(AnswerCacheConfig {
                max_staleness: Duration::ZERO,
                ..AnswerCacheConfig::default()
            }),
            ..Config::default()
        };
        assert!(no_staleness.validate().is_err());
        let partial: Config =
            serde_json::from_str(r#"{"answer_cache": {"max_staleness": "2s"}}"#).unwrap();
        assert_eq!(
            partial.answer_cache,
            Some(AnswerCacheConfig {
                max_staleness: Duration::from_secs(2),
                ..AnswerCacheConfig::default()
            })
        );
    }
}
