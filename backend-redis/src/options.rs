//! Connection URLs and their options.

use std::time::Duration;

use idempotency_core::{parse_duration, Error};

use crate::BatchReads;

/// The largest value Redis accepts in one argument (`proto-max-bulk-len`'s
/// default, also the largest string value), less room for the record header.
pub const REDIS_HARD_MAX_RESULT_BYTES: usize = 512 * 1024 * 1024 - 1024;

/// The default [`RedisOptions::max_result_bytes`]: 16 MiB. Larger values are
/// possible up to [`REDIS_HARD_MAX_RESULT_BYTES`], but a Redis value of many
/// megabytes blocks the server's single thread while it is copied.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 16 * 1024 * 1024;

/// The default bound on each connection attempt (`connect_timeout=`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The default bound on each command (`response_timeout=`), as the other
/// backends' operation timeout and the manager's `store_timeout`.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Every URL scheme [`RedisRepository::connect`](crate::RedisRepository::connect)
/// accepts (matched case-insensitively): standalone `redis`, `valkey`, over a
/// Unix socket `unix`, `redis+unix`, `valkey+unix`; with TLS (feature `tls`)
/// `rediss`, `valkeys`; Redis Cluster (feature `cluster`) `redis+cluster`,
/// `valkey+cluster`, and with TLS `rediss+cluster`, `valkeys+cluster`. A
/// scheme whose feature is off is still recognised, and refused with a
/// configuration error naming the feature.
///
/// ```
/// assert!(idempotency_redis::URL_SCHEMES.contains(&"valkey+unix"));
/// assert!(!idempotency_redis::URL_SCHEMES.contains(&"redis-cluster"));
/// ```
pub const URL_SCHEMES: &[&str] = &[
    "redis",
    "valkey",
    "unix",
    "redis+unix",
    "valkey+unix",
    "rediss",
    "valkeys",
    "redis+cluster",
    "valkey+cluster",
    "rediss+cluster",
    "valkeys+cluster",
];

/// How [`reserve`](idempotency_core::Repository::reserve) talks to Redis. Both
/// take one round trip for a new key and for a duplicate; they differ in server
/// CPU (see the crate docs' measurements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReserveStrategy {
    /// `SET key record NX PX ttl GET` (Redis ≥ 7.0): reserves, or returns the
    /// stored record, in one native command. Only when the stored record is
    /// logically expired or may be taken over does a second round trip run the
    /// reserve script. On a server that rejects the command (Redis < 7.0) the
    /// repository switches to [`ReserveStrategy::Script`] by itself.
    #[default]
    SetNxGet,
    /// The reserve script (`EVALSHA`) for every reservation: one round trip in
    /// every case, takeovers included.
    Script,
}

impl ReserveStrategy {
    /// The name used in URLs: `set-nx-get` or `script`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ReserveStrategy::SetNxGet => "set-nx-get",
            ReserveStrategy::Script => "script",
        }
    }

    /// Parses [`ReserveStrategy::as_str`]'s output.
    ///
    /// ```
    /// use idempotency_redis::ReserveStrategy;
    /// assert_eq!(ReserveStrategy::parse("script"), Some(ReserveStrategy::Script));
    /// assert_eq!(ReserveStrategy::parse(ReserveStrategy::SetNxGet.as_str()), Some(ReserveStrategy::SetNxGet));
    /// assert_eq!(ReserveStrategy::parse("lua"), None);
    /// ```
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "set-nx-get" => Some(ReserveStrategy::SetNxGet),
            "script" => Some(ReserveStrategy::Script),
            _ => None,
        }
    }
}

/// Options of a [`RedisRepository`](crate::RedisRepository), settable in the URL's
/// query string (`?reserve=script&response_timeout=2s`) or given to
/// [`RedisRepository::connect_with`](crate::RedisRepository::connect_with).
///
/// ```
/// use std::time::Duration;
/// use idempotency_redis::{RedisOptions, ReserveStrategy};
///
/// let mut options = RedisOptions::default();
/// options.response_timeout = Duration::from_secs(1);
/// options.reserve_strategy = ReserveStrategy::Script;
/// assert_eq!(options.max_result_bytes, idempotency_redis::DEFAULT_MAX_RESULT_BYTES);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisOptions {
    /// `reserve=set-nx-get|script` (default `set-nx-get`).
    pub reserve_strategy: ReserveStrategy,
    /// `batch_reads=adaptive|never|always`: whether a batch's reservations
    /// read their records first (default `adaptive`; see [`BatchReads`]).
    pub batch_reads: BatchReads,
    /// `max_result_bytes=N`: the largest result or stored error accepted
    /// (default [`DEFAULT_MAX_RESULT_BYTES`], at most
    /// [`REDIS_HARD_MAX_RESULT_BYTES`]); larger ones get
    /// [`Error::TooLarge`], and the manager completes without caching them.
    pub max_result_bytes: usize,
    /// `connect_timeout=2s`: each connection attempt (default 2 s).
    pub connect_timeout: Duration,
    /// `response_timeout=5s`: each command on each connection, after which
    /// it fails with [`Error::Timeout`] (default 5 s). On a cluster one
    /// operation may take more than one (a `CLUSTER SLOTS` read, a redirected
    /// command sent again); the manager's `store_timeout` bounds the whole.
    pub response_timeout: Duration,
    /// `reconnect_retries=N`: extra connection attempts per reconnection, with
    /// exponential back-off from 100 ms up to 2 s (default 0). Calls waiting for
    /// a reconnection fail with [`Error::Unavailable`] once it fails, and the next
    /// call starts a new one — so during an outage each call costs at most one
    /// connection attempt (bounded by `connect_timeout`) plus the retries set
    /// here, and fails fast instead of queueing behind back-offs.
    pub reconnect_retries: usize,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            reserve_strategy: ReserveStrategy::default(),
            batch_reads: BatchReads::default(),
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            reconnect_retries: 0,
        }
    }
}

/// What a URL points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// One server: the URL for `redis::Client::open`, options removed.
    Standalone(String),
    /// Cluster seed nodes, one `redis://` / `rediss://` URL each.
    Cluster(Vec<String>),
}

/// Parses a connection URL over the default options.
#[cfg(test)]
pub(crate) fn parse_url(url: &str) -> Result<(Target, RedisOptions), Error> {
    parse_url_with(url, RedisOptions::default())
}

/// Parses a connection URL — `redis://`, `rediss://`, `redis+cluster://`,
/// `rediss+cluster://`, `valkey://`, `valkeys://`, `redis+unix://`, `unix://` —
/// over `base` options: the query string overrides them.
pub(crate) fn parse_url_with(
    url: &str,
    base: RedisOptions,
) -> Result<(Target, RedisOptions), Error> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| Error::config(format!("not a Redis URL (no scheme): {}", redact(url))))?;
    let scheme = scheme.to_ascii_lowercase();
    let (rest, fragment) = match rest.split_once('#') {
        Some((r, f)) => (r, format!("#{f}")),
        None => (rest, String::new()),
    };
    let (without_query, query) = match rest.split_once('?') {
        Some((a, q)) => (a, Some(q)),
        None => (rest, None),
    };
    let (options, passthrough) = parse_query(query.unwrap_or(""), base)?;
    let suffix = if passthrough.is_empty() {
        fragment
    } else {
        format!("?{passthrough}{fragment}")
    };
    match scheme.as_str() {
        "redis" | "valkey" | "redis+unix" | "valkey+unix" | "unix" => Ok((
            Target::Standalone(format!("{scheme}://{without_query}{suffix}")),
            options,
        )),
        "rediss" | "valkeys" => {
            require_tls(&scheme)?;
            Ok((
                Target::Standalone(format!("{scheme}://{without_query}{suffix}")),
                options,
            ))
        }
        "redis+cluster" | "rediss+cluster" | "valkey+cluster" | "valkeys+cluster" => {
            let tls = scheme.starts_with("rediss") || scheme.starts_with("valkeys");
            if tls {
                require_tls(&scheme)?;
            }
            let nodes = cluster_nodes(without_query, tls, &suffix)?;
            Ok((Target::Cluster(nodes), options))
        }
        other => Err(Error::config(format!(
            "unsupported URL scheme `{other}://` for the Redis backend (use one of {})",
            URL_SCHEMES
                .iter()
                .map(|s| format!("{s}://"))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn require_tls(scheme: &str) -> Result<(), Error> {
    if cfg!(feature = "tls") {
        Ok(())
    } else {
        Err(Error::config(format!(
            "`{scheme}://` needs TLS: enable the `tls` feature of idempotency-redis \
             (`redis-tls` of the idempotency crate)"
        )))
    }
}

/// `[user:pass@]host1:port1,host2:port2[/0]` → one URL per node.
fn cluster_nodes(authority_and_path: &str, tls: bool, suffix: &str) -> Result<Vec<String>, Error> {
    let (authority, path) = match authority_and_path.split_once('/') {
        Some((a, p)) => (a, p),
        None => (authority_and_path, ""),
    };
    if !(path.is_empty() || path == "0") {
        return Err(Error::config(
            "Redis Cluster has only database 0; remove the path from the cluster URL",
        ));
    }
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let scheme = if tls { "rediss" } else { "redis" };
    let nodes: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| match userinfo {
            Some(u) => format!("{scheme}://{u}@{h}{suffix}"),
            None => format!("{scheme}://{h}{suffix}"),
        })
        .collect();
    if nodes.is_empty() {
        return Err(Error::config(
            "a Redis Cluster URL needs at least one host:port",
        ));
    }
    Ok(nodes)
}

/// Splits our options from the ones the `redis` crate reads (`protocol`).
fn parse_query(query: &str, mut options: RedisOptions) -> Result<(RedisOptions, String), Error> {
    let mut passthrough = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let bad = |what: &str| {
            Error::config(format!(
                "invalid Redis URL option `{name}={value}`: expected {what}"
            ))
        };
        match name {
            "reserve" => {
                options.reserve_strategy =
                    ReserveStrategy::parse(value).ok_or_else(|| bad("`set-nx-get` or `script`"))?;
            }
            "batch_reads" => {
                let what = "`adaptive`, `never` or `always`";
                options.batch_reads = BatchReads::parse(value).ok_or_else(|| bad(what))?;
            }
            "max_result_bytes" => {
                let n: usize = value.parse().map_err(|_| bad("a number of bytes"))?;
                if n > REDIS_HARD_MAX_RESULT_BYTES {
                    return Err(bad(&format!("at most {REDIS_HARD_MAX_RESULT_BYTES}")));
                }
                options.max_result_bytes = n;
            }
            "connect_timeout" => {
                options.connect_timeout = parse_duration(value)
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| bad("a positive duration such as `2s`"))?;
            }
            "response_timeout" => {
                options.response_timeout = parse_duration(value)
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| bad("a positive duration such as `500ms`"))?;
            }
            "reconnect_retries" => {
                options.reconnect_retries = value.parse().map_err(|_| bad("a number"))?;
            }
            "protocol" => passthrough.push(pair),
            _ => {
                return Err(Error::config(format!(
                    "unknown Redis URL option `{name}` (known: reserve, batch_reads, \
                     max_result_bytes, connect_timeout, response_timeout, reconnect_retries, protocol)"
                )))
            }
        }
    }
    Ok((options, passthrough.join("&")))
}

/// The URL without its password, for error messages.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let userinfo = &url[s + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standalone_urls() {
        let (t, o) = parse_url("redis://127.0.0.1:6379/2").unwrap();
        assert_eq!(t, Target::Standalone("redis://127.0.0.1:6379/2".into()));
        assert_eq!(o, RedisOptions::default());
        let (t, o) =
            parse_url("redis://:pw@h:1/0?reserve=script&protocol=resp3&response_timeout=250ms")
                .unwrap();
        assert_eq!(
            t,
            Target::Standalone("redis://:pw@h:1/0?protocol=resp3".into())
        );
        assert_eq!(o.reserve_strategy, ReserveStrategy::Script);
        assert_eq!(o.response_timeout, Duration::from_millis(250));
        let (_, o) = parse_url("redis://h:1?batch_reads=always").unwrap();
        assert_eq!(o.batch_reads, BatchReads::Always);
        assert!(parse_url("redis://h:1?batch_reads=often").is_err());
        let (t, o) = parse_url("redis://h:1?reserve=script#insecure").unwrap();
        assert_eq!(t, Target::Standalone("redis://h:1#insecure".into()));
        assert_eq!(o.reserve_strategy, ReserveStrategy::Script);
    }

    #[test]
    fn query_overrides_base_options() {
        let base = RedisOptions {
            reserve_strategy: ReserveStrategy::Script,
            reconnect_retries: 4,
            ..RedisOptions::default()
        };
        let (_, o) = parse_url_with("redis://h?reconnect_retries=1", base).unwrap();
        assert_eq!(
            (o.reserve_strategy, o.reconnect_retries),
            (ReserveStrategy::Script, 1)
        );
    }

    #[test]
    fn cluster_urls() {
        let (t, o) = parse_url("redis+cluster://u:p@a:1,b:2?max_result_bytes=2048").unwrap();
        assert_eq!(
            t,
            Target::Cluster(vec!["redis://u:p@a:1".into(), "redis://u:p@b:2".into()])
        );
        assert_eq!(o.max_result_bytes, 2048);
        assert!(matches!(
            parse_url("redis+cluster:///"),
            Err(Error::Config { .. })
        ));
        assert!(matches!(
            parse_url("redis+cluster://a:1/3"),
            Err(Error::Config { .. })
        ));
    }

    #[test]
    fn bad_urls_are_config_errors() {
        for url in [
            "127.0.0.1:6379",
            "http://h",
            "redis://h?reserve=maybe",
            "redis://h?nope=1",
            "redis://h?max_result_bytes=999999999999",
            "redis://h?connect_timeout=soon",
        ] {
            assert!(matches!(parse_url(url), Err(Error::Config { .. })), "{url}");
        }
    }

    #[test]
    fn tls_needs_the_feature() {
        let r = parse_url("rediss://h:6380");
        if cfg!(feature = "tls") {
            assert!(r.is_ok());
        } else {
            match r {
                Err(Error::Config { message }) => assert!(message.contains("`tls`"), "{message}"),
                other => panic!("{other:?}"),
            }
        }
    }

    /// Every scheme of [`URL_SCHEMES`] is parsed (or, with its feature off,
    /// refused naming the feature), in any case; nothing else is.
    #[test]
    fn url_schemes_are_exactly_the_parsed_ones() {
        for scheme in URL_SCHEMES {
            for spelled in [scheme.to_string(), scheme.to_ascii_uppercase()] {
                let url = if scheme.contains("unix") {
                    format!("{spelled}:///run/redis.sock")
                } else {
                    format!("{spelled}://127.0.0.1:6379")
                };
                match parse_url(&url) {
                    Ok((Target::Cluster(nodes), _)) => {
                        assert!(scheme.ends_with("+cluster"), "{url}: {nodes:?}")
                    }
                    Ok((Target::Standalone(_), _)) => {
                        assert!(!scheme.ends_with("+cluster"), "{url}")
                    }
                    Err(Error::Config { message }) => assert!(
                        message.contains("`tls`") && !cfg!(feature = "tls"),
                        "{url}: {message}"
                    ),
                    Err(other) => panic!("{url}: {other:?}"),
                }
            }
        }
        for scheme in [
            "redis-cluster",
            "rediss-cluster",
            "cluster",
            "valkey-cluster",
            "http",
            "tcp",
            "redis+tls",
            "memory",
        ] {
            match parse_url(&format!("{scheme}://127.0.0.1:6379")) {
                Err(Error::Config { message }) => {
                    assert!(message.contains("unsupported URL scheme"), "{message}");
                    assert!(message.contains("valkeys+cluster://"), "{message}");
                }
                other => panic!("{scheme}: {other:?}"),
            }
        }
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("redis://u:secret@h:1"), "redis://u:***@h:1");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
    }
}
