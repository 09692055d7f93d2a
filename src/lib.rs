//! **idempotency-rs**: exactly-once effects for at-least-once consumers.
//!
//! Brokers (Kafka, SQS, RabbitMQ) and HTTP clients redeliver. Wrap a handler in an
//! [`IdempotencyManager`]: the first delivery of a key runs it; every duplicate
//! gets the stored outcome, or a clear "in progress", without running it again —
//! also when many consumers race on one key and when a consumer crashes half way
//! (leases, takeover, fencing tokens).
//!
//! This crate is the facade: it re-exports [`idempotency_core`] and picks a
//! store at runtime from a URL with [`connect`], so switching from the embedded
//! in-memory store to SQLite, Redis, PostgreSQL, MySQL/MariaDB or DynamoDB is configuration,
//! not code.
//!
//! # Example
//!
//! ```
//! use idempotency::{Config, HandlerError, IdempotencyManager, Outcome};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! // `memory:` here; `sqlite://…`, `redis://…`, `postgres://…`, `mysql://…` or `dynamodb://…`
//! // with their features.
//! // From IDEMPOTENCY_STORE_URL; unset or empty: `memory:`.
//! let url = idempotency::store_url_from_env();
//! # let url = "memory:";
//! let store = idempotency::connect(&url).await?;
//! let payments = IdempotencyManager::new(store, Config::default())?.scoped("payments")?;
//!
//! let charge = || async { Ok::<_, HandlerError<String>>("receipt-42".to_owned()) };
//! let first = payments.execute("ProcessPayment:evt-1", &(), charge).await?;
//! let redelivered = payments.execute("ProcessPayment:evt-1", &(), charge).await?;
//! assert!(matches!(first, Outcome::Executed(_)));
//! assert!(matches!(redelivered, Outcome::Cached(ref r) if r == "receipt-42"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Cargo features
//!
//! | feature | store | URL schemes |
//! |---|---|---|
//! | (always) | in-memory, per process | `memory:` |
//! | `sqlite` | SQLite, one durable file, no server | `sqlite://path/to/file.db` |
//! | `redis` | Redis ≥ 7 (or Valkey) | `redis://`, `valkey://`; Unix sockets `unix:///path`, `redis+unix://`, `valkey+unix://` |
//! | `redis-tls` | Redis over TLS | `rediss://`, `valkeys://` |
//! | `redis-cluster` | Redis Cluster | `redis+cluster://h1:p1,h2:p2`, `valkey+cluster://…`; with `redis-tls` also `rediss+cluster://…`, `valkeys+cluster://…` |
//! | `postgres` | PostgreSQL | `postgres://`, `postgresql://` |
//! | `postgres-tls` | PostgreSQL over TLS | `postgres://…?sslmode=require` (`verify-ca`, `verify-full`) |
//! | `mysql` | MySQL 5.7+/8, MariaDB 10.5+ | `mysql://`, `mariadb://` |
//! | `mysql-tls` | MySQL or MariaDB over TLS | `mysql://…?ssl-mode=required` (`verify_ca`, `verify_identity`) |
//! | `dynamodb` | DynamoDB | `dynamodb://TABLE?region=…&endpoint=…` |
//! | `full` | `sqlite`, `redis`, `postgres`, `mysql`, `dynamodb` | |
//! | `full-tls` | `full` with `redis-tls`, `redis-cluster`, `postgres-tls`, `mysql-tls` | |
//!
//! A URL whose backend is compiled out returns [`Error::Config`] naming the
//! feature to enable.
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::sync::Arc;

#[doc = include_str!("../docs/guide.md")]
pub mod guide {}

#[doc(inline)]
pub use idempotency_core::*;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[doc(inline)]
pub use idempotency_redis as redis;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[doc(inline)]
pub use idempotency_postgres as postgres;

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
#[doc(inline)]
pub use idempotency_sqlite as sqlite;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
#[doc(inline)]
pub use idempotency_mysql as mysql;

#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
#[doc(inline)]
pub use idempotency_dynamodb as dynamodb;

/// Broker consumers (Kafka, SQS, RabbitMQ): acknowledgement tied to the
/// recorded outcome.
#[cfg(any(feature = "kafka", feature = "sqs", feature = "rabbitmq"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "kafka", feature = "sqs", feature = "rabbitmq"))))]
#[doc(inline)]
pub use idempotency_consumers as consumers;

/// The URL schemes of the Redis backend, exactly those
/// `idempotency_redis::connect` parses (`idempotency_redis::URL_SCHEMES`; a
/// test keeps the two equal). Listed here so that a URL is recognised — and a
/// disabled feature named — also when the backend is compiled out.
pub const REDIS_SCHEMES: &[&str] = &[
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

/// The store a URL names, by scheme. Always compiled, whatever the features, so
/// an unknown or disabled scheme is reported precisely.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreKind {
    /// `memory:` — [`MemoryRepository`].
    Memory,
    /// The schemes of [`REDIS_SCHEMES`]: `redis://`, `rediss://`,
    /// `redis+cluster://`, `unix://`, their `valkey` spellings, ….
    Redis,
    /// `postgres://`, `postgresql://`.
    Postgres,
    /// `dynamodb://`.
    DynamoDb,
    /// `sqlite:` (`sqlite://path`).
    Sqlite,
    /// `mysql://`, `mariadb://`.
    MySql,
}

impl StoreKind {
    /// The kind of store `url` names.
    ///
    /// ```
    /// use idempotency::StoreKind;
    /// assert_eq!(StoreKind::from_url("memory:")?, StoreKind::Memory);
    /// assert_eq!(StoreKind::from_url("rediss://cache:6380/0")?, StoreKind::Redis);
    /// assert_eq!(StoreKind::from_url("unix:///run/redis.sock")?, StoreKind::Redis);
    /// assert_eq!(StoreKind::from_url("postgresql://db/app")?, StoreKind::Postgres);
    /// assert_eq!(StoreKind::from_url("dynamodb://idempotency?region=eu-west-1")?, StoreKind::DynamoDb);
    /// assert_eq!(StoreKind::from_url("sqlite://data/idempotency.db")?, StoreKind::Sqlite);
    /// assert_eq!(StoreKind::from_url("mariadb://db/app")?, StoreKind::MySql);
    /// assert!(StoreKind::from_url("mongodb://x").is_err());
    /// assert!(StoreKind::from_url("no scheme").is_err());
    /// # Ok::<(), idempotency::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Config`] for a URL without a scheme or with an unknown one.
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let scheme = url
            .split_once(':')
            .map(|(s, _)| s.to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Error::config(format!("store URL {url:?} has no scheme")))?;
        match scheme.as_str() {
            "memory" | "mem" => Ok(StoreKind::Memory),
            s if REDIS_SCHEMES.contains(&s) => Ok(StoreKind::Redis),
            "postgres" | "postgresql" => Ok(StoreKind::Postgres),
            "dynamodb" => Ok(StoreKind::DynamoDb),
            "sqlite" => Ok(StoreKind::Sqlite),
            "mysql" | "mariadb" => Ok(StoreKind::MySql),
            other => Err(Error::config(format!(
                "unknown store scheme {other:?}: use memory:, redis://, rediss://, \
                 redis+cluster://, unix:// (or another Redis scheme: {}), postgres://, \
                 postgresql://, mysql://, mariadb://, dynamodb:// or sqlite://",
                REDIS_SCHEMES.join(", ")
            ))),
        }
    }

    /// The Cargo feature of this crate that compiles the backend in.
    pub fn feature(self) -> Option<&'static str> {
        match self {
            StoreKind::Memory => None,
            StoreKind::Redis => Some("redis"),
            StoreKind::Postgres => Some("postgres"),
            StoreKind::DynamoDb => Some("dynamodb"),
            StoreKind::Sqlite => Some("sqlite"),
            StoreKind::MySql => Some("mysql"),
        }
    }
}

/// The environment variable [`store_url_from_env`] reads.
pub const STORE_URL_ENV: &str = "IDEMPOTENCY_STORE_URL";

/// The store URL from `IDEMPOTENCY_STORE_URL`, trimmed; `memory:` when it is
/// unset or empty (`IDEMPOTENCY_STORE_URL= cargo run …` means "the default",
/// not "no store").
///
/// ```
/// # std::env::remove_var(idempotency::STORE_URL_ENV);
/// assert_eq!(idempotency::store_url_from_env(), "memory:");
/// ```
pub fn store_url_from_env() -> String {
    std::env::var(STORE_URL_ENV)
        .ok()
        .map(|url| url.trim().to_owned())
        .filter(|url| !url.is_empty())
        .unwrap_or_else(|| "memory:".to_owned())
}

/// Connects to the store `url` names and returns it as a shared repository.
///
/// - `memory:` — a fresh [`MemoryRepository`] (process-local).
/// - `redis://host:port/db`, `unix:///path`, `rediss://…` (`redis-tls`),
///   `redis+cluster://h1:p1,h2:p2` (`redis-cluster`), and the other
///   [`REDIS_SCHEMES`] — feature `redis`.
/// - `postgres://user:pass@host/db?schema=…&table=…&migrate=false` — feature
///   `postgres`; applies the embedded migrations unless `migrate=false`.
/// - `dynamodb://TABLE?region=…&endpoint=…` — feature `dynamodb`.
/// - `sqlite://path/to/file.db?synchronous=…&busy_timeout=…` — feature
///   `sqlite`; creates the file and applies the embedded migrations unless
///   `migrate=false`.
/// - `mysql://user:pass@host/db?table=…&migrate=false` (also `mariadb://`) —
///   feature `mysql`; applies the embedded migrations unless `migrate=false`.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let store = idempotency::connect("memory:").await?;
/// assert_eq!(store.capabilities().backend, "memory");
///
/// # #[cfg(not(feature = "dynamodb"))] {
/// let err = idempotency::connect("dynamodb://table").await.unwrap_err();
/// assert!(err.to_string().contains("feature \"dynamodb\""));
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`Error::Config`] for an unknown scheme or one whose feature is off (the
/// message names the feature), and the backend's own errors when connecting.
pub async fn connect(url: &str) -> Result<SharedRepository, Error> {
    match StoreKind::from_url(url)? {
        StoreKind::Memory => connect_memory(url),
        StoreKind::Redis => connect_redis(url).await,
        StoreKind::Postgres => connect_postgres(url).await,
        StoreKind::DynamoDb => connect_dynamodb(url).await,
        StoreKind::Sqlite => connect_sqlite(url).await,
        StoreKind::MySql => connect_mysql(url).await,
    }
}

/// `memory:` (also `memory://`, `mem:`): the in-memory store takes no
/// options, and a URL that gives some is refused rather than half-read.
fn connect_memory(url: &str) -> Result<SharedRepository, Error> {
    let rest = url.split_once(':').map_or("", |(_, rest)| rest);
    if !rest.is_empty() && rest != "//" {
        return Err(Error::config(format!(
            "the in-memory store takes no path or options (use memory:), not {url:?}"
        )));
    }
    Ok(Arc::new(MemoryRepository::new()))
}

#[cfg(not(all(
    feature = "redis",
    feature = "postgres",
    feature = "dynamodb",
    feature = "sqlite",
    feature = "mysql"
)))]
fn feature_off(kind: StoreKind, url: &str) -> Error {
    let scheme = url.split_once(':').map_or(url, |(s, _)| s);
    Error::config(format!(
        "the {scheme}: store needs the idempotency crate's Cargo feature {:?}; enable it with \
         `idempotency = {{ version = \"…\", features = [{:?}] }}`",
        kind.feature().unwrap_or_default(),
        kind.feature().unwrap_or_default(),
    ))
}

#[cfg(feature = "redis")]
async fn connect_redis(url: &str) -> Result<SharedRepository, Error> {
    Ok(Arc::new(idempotency_redis::connect(url).await?))
}

#[cfg(not(feature = "redis"))]
async fn connect_redis(url: &str) -> Result<SharedRepository, Error> {
    Err(feature_off(StoreKind::Redis, url))
}

#[cfg(feature = "postgres")]
async fn connect_postgres(url: &str) -> Result<SharedRepository, Error> {
    Ok(Arc::new(idempotency_postgres::connect(url).await?))
}

#[cfg(not(feature = "postgres"))]
async fn connect_postgres(url: &str) -> Result<SharedRepository, Error> {
    Err(feature_off(StoreKind::Postgres, url))
}

#[cfg(feature = "dynamodb")]
async fn connect_dynamodb(url: &str) -> Result<SharedRepository, Error> {
    Ok(Arc::new(idempotency_dynamodb::connect(url).await?))
}

#[cfg(not(feature = "dynamodb"))]
async fn connect_dynamodb(url: &str) -> Result<SharedRepository, Error> {
    Err(feature_off(StoreKind::DynamoDb, url))
}

#[cfg(feature = "sqlite")]
async fn connect_sqlite(url: &str) -> Result<SharedRepository, Error> {
    Ok(Arc::new(idempotency_sqlite::connect(url).await?))
}

#[cfg(not(feature = "sqlite"))]
async fn connect_sqlite(url: &str) -> Result<SharedRepository, Error> {
    Err(feature_off(StoreKind::Sqlite, url))
}

#[cfg(feature = "mysql")]
async fn connect_mysql(url: &str) -> Result<SharedRepository, Error> {
    Ok(Arc::new(idempotency_mysql::connect(url).await?))
}

#[cfg(not(feature = "mysql"))]
async fn connect_mysql(url: &str) -> Result<SharedRepository, Error> {
    Err(feature_off(StoreKind::MySql, url))
}

#[cfg(test)]
mod tests {
    /// The backend refuses a URL requiring TLS it lacks, naming this crate's
    /// feature and never the URL (it may hold a password).
    #[cfg(all(feature = "postgres", not(feature = "postgres-tls")))]
    #[tokio::test]
    async fn postgres_urls_requiring_tls_name_the_feature_when_it_is_off() {
        let url = "postgres://u:secret@h/db?sslmode=verify-full&table=t";
        match super::connect(url).await {
            Err(super::Error::Config { message }) => assert!(
                message.contains("`postgres-tls`") && !message.contains("secret"),
                "{message}"
            ),
            other => panic!("{other:?}"),
        }
    }

    use super::*;

    /// Every Redis scheme, one by one and in any case, is a Redis URL.
    #[test]
    fn redis_schemes_are_redis() {
        for (scheme, url) in [
            ("redis", "redis://127.0.0.1:6379/0"),
            ("valkey", "valkey://127.0.0.1:6379"),
            ("unix", "unix:///run/redis.sock"),
            ("redis+unix", "redis+unix:///run/redis.sock"),
            ("valkey+unix", "valkey+unix:///run/valkey.sock"),
            ("rediss", "rediss://cache:6380"),
            ("valkeys", "valkeys://cache:6380"),
            ("redis+cluster", "redis+cluster://h1:7000,h2:7001"),
            ("valkey+cluster", "valkey+cluster://h1:7000,h2:7001"),
            ("rediss+cluster", "rediss+cluster://h1:7000,h2:7001"),
            ("valkeys+cluster", "valkeys+cluster://h1:7000,h2:7001"),
        ] {
            assert!(REDIS_SCHEMES.contains(&scheme), "{scheme} is listed");
            assert!(url.starts_with(&format!("{scheme}://")));
            assert_eq!(StoreKind::from_url(url).unwrap(), StoreKind::Redis, "{url}");
            let shouted = url.replacen(scheme, &scheme.to_ascii_uppercase(), 1);
            assert_eq!(
                StoreKind::from_url(&shouted).unwrap(),
                StoreKind::Redis,
                "{shouted}"
            );
        }
        assert_eq!(
            REDIS_SCHEMES.len(),
            11,
            "every listed scheme is tested above"
        );
    }

    /// Schemes the backend does not parse are not Redis URLs here either.
    #[test]
    fn other_redis_like_schemes_are_rejected() {
        for url in [
            "redis-cluster://h1:7000,h2:7001",
            "rediss-cluster://h1:7000",
            "valkey-cluster://h1:7000",
            "redis+tls://h:6380",
            "cluster://h1:7000",
        ] {
            match StoreKind::from_url(url) {
                Err(Error::Config { message }) => {
                    assert!(message.contains("unknown store scheme"), "{message}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    /// The facade's list is the backend's, so that neither accepts a URL the
    /// other refuses.
    #[cfg(feature = "redis")]
    #[test]
    fn redis_schemes_are_the_backends() {
        let mut ours = REDIS_SCHEMES.to_vec();
        let mut backend = idempotency_redis::URL_SCHEMES.to_vec();
        ours.sort_unstable();
        backend.sort_unstable();
        assert_eq!(ours, backend);
    }

    /// Without the backend, each Redis scheme names the feature to enable.
    #[cfg(not(feature = "redis"))]
    #[test]
    fn redis_schemes_name_the_feature() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for scheme in REDIS_SCHEMES {
            let url = format!("{scheme}://127.0.0.1:6379");
            match rt.block_on(connect(&url)) {
                Err(Error::Config { message }) => {
                    assert!(message.contains("feature \"redis\""), "{url}: {message}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }
}
