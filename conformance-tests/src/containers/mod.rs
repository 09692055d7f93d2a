//! Real servers for backend tests (feature `containers`): one shared Redis,
//! PostgreSQL, DynamoDB-compatible, MariaDB and RabbitMQ server per test binary, started with
//! [testcontainers](https://docs.rs/testcontainers), or taken from environment
//! variables.
//!
//! ```no_run
//! # async fn demo() {
//! use idempotency_conformance::containers;
//!
//! let redis = containers::redis().await.expect("a Redis server for the tests");
//! let prefix = containers::unique_namespace("test"); // isolate this test's keys
//! println!("{} from {}", redis.url(), redis.origin());
//!
//! let postgres = containers::postgres().await.expect("a PostgreSQL server for the tests");
//! let schema = postgres.create_schema().await.expect("a schema of this test");
//! let url = postgres.url_with_schema(&schema);
//!
//! let dynamodb = containers::dynamodb().await.expect("a DynamoDB server for the tests");
//! let table = dynamodb.unique_table_name("idempotency");
//! # let _ = (prefix, url, table);
//! # }
//! ```
//!
//! # Where servers come from
//!
//! | kind | shared server | image variable (default) | existing server |
//! |---|---|---|---|
//! | Redis | [`redis()`] | `IDEMPOTENCY_TEST_REDIS_IMAGE` (`redis:7`) | `IDEMPOTENCY_TEST_REDIS_URL` |
//! | PostgreSQL | [`postgres()`] | `IDEMPOTENCY_TEST_POSTGRES_IMAGE` (`postgres:16`) | `IDEMPOTENCY_TEST_POSTGRES_URL` |
//! | DynamoDB | [`dynamodb()`] | `IDEMPOTENCY_TEST_DYNAMODB_IMAGE` (`amazon/dynamodb-local:latest`) | `IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT` |
//! | MariaDB (MySQL) | [`mariadb()`] | `IDEMPOTENCY_TEST_MARIADB_IMAGE` (`mariadb:11`) | `IDEMPOTENCY_TEST_MARIADB_URL` |
//! | Amazon SQS (moto) | [`sqs()`] | `IDEMPOTENCY_TEST_SQS_IMAGE` (`motoserver/moto:latest`; baked: `idempotency-test/dynamodb:bookworm`) | `IDEMPOTENCY_TEST_SQS_ENDPOINT` |
//! | RabbitMQ | [`rabbitmq()`] | `IDEMPOTENCY_TEST_RABBITMQ_IMAGE` (`rabbitmq:3`) | `IDEMPOTENCY_TEST_RABBITMQ_URL` |
//!
//! A three-master Redis Cluster comes from [`redis_cluster()`] (nodes on the
//! host network, bound to `127.0.0.1`), or from `IDEMPOTENCY_TEST_REDIS_CLUSTER_URLS`.
//!
//! - When the "existing server" variable is set, no container is started for
//!   that kind (CI service containers).
//! - Without the image variable, the official image is used when the Docker
//!   engine has it, else the locally baked `idempotency-test/<kind>:bookworm`
//!   when the engine has that (so plain `cargo test` works after
//!   `scripts/bake-images.sh`, with no variable), else the official image is
//!   pulled.
//! - Otherwise the image is started with testcontainers, published on
//!   `127.0.0.1` only. Readiness is checked with the real protocol (`PING`,
//!   `SELECT 1`, `ListTables`, MariaDB's handshake, an AMQP login), retried until `IDEMPOTENCY_TEST_READY_TIMEOUT_SECS`
//!   (default 60) — no log-line matching, so locally baked images
//!   (`scripts/bake-images.sh`) work exactly like the official ones.
//! - Without Docker and without the variable, every function returns a
//!   [`HarnessError`] explaining both ways to provide a server; tests
//!   `.expect()` it and fail — they never pass silently.
//!
//! One server per kind per test binary; tests keep apart through
//! [`unique_namespace`], [`PostgresServer::create_schema`] and
//! [`DynamoDbServer::unique_table_name`], [`SqsServer::unique_queue_name`],
//! [`RabbitMqServer::unique_queue_name`], never by flushing. Tests that stop a
//! server (outage tests) take a [`Dedicated`] container of their own, e.g.
//! [`RedisServer::dedicated`] or [`RabbitMqServer::dedicated_with_settings`]
//! (a broker with its own `consumer_timeout`), which keeps its port across
//! [`Dedicated::stop`] / [`Dedicated::start`].
//!
//! The harness drives Docker and its connections on a runtime of its own, so
//! its functions work from any `#[tokio::test]` (each has its own runtime).
//! Containers are removed when the test process ends, also after failures,
//! panics and kills: see `docs/testing.md`.

mod docker;
mod dynamodb;
mod error;
mod external;
mod fault_proxy;
mod mariadb;
mod postgres;
mod rabbitmq;
mod redis;
mod redis_cluster;
mod redis_tls;
mod sqs;
mod wire;

pub use docker::{Dedicated, Origin};
pub use dynamodb::{dynamodb, DynamoDbResponse, DynamoDbServer};
pub use error::HarnessError;
pub use fault_proxy::{FaultProxy, ProxyFaults};
pub use mariadb::{mariadb, MariaDbServer};
pub use postgres::{postgres, tokio_postgres, PostgresServer};
pub use rabbitmq::{rabbitmq, RabbitMqServer};
pub use redis::{redis, RedisReply, RedisServer};
pub use redis_cluster::{redis_cluster, DedicatedRedisCluster, RedisClusterServer};
pub use redis_tls::RedisTlsServer;
pub use sqs::{sqs, SqsServer};
pub use wire::{MessageCounts, WireCounter, PING};

/// A fresh, random name `<prefix>-<16 hex digits>` for a key prefix, table or
/// other per-test namespace. Characters outside `[A-Za-z0-9_.-]` in `prefix`
/// become `_`, so the result is a valid Redis key prefix and DynamoDB table name.
pub fn unique_namespace(prefix: &str) -> String {
    let prefix: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let prefix = if prefix.is_empty() { "t" } else { &prefix };
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

#[cfg(test)]
mod tests {
    use super::docker::Kind;
    use super::*;

    #[test]
    fn namespaces_are_unique_and_clean() {
        let a = unique_namespace("orders:v1");
        let b = unique_namespace("orders:v1");
        assert_ne!(a, b);
        assert!(a.starts_with("orders_v1-"));
        assert!(a
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')));
        assert!(unique_namespace("").starts_with("t-"));
    }

    #[test]
    fn missing_docker_error_says_how_to_provide_a_server() {
        let message =
            HarnessError::docker_unavailable(Kind::Postgres, "connection refused").to_string();
        for needle in [
            "IDEMPOTENCY_TEST_POSTGRES_URL=postgres://",
            "scripts/bake-images.sh",
            "IDEMPOTENCY_TEST_POSTGRES_IMAGE=idempotency-test/postgres:bookworm",
            "connection refused",
        ] {
            assert!(message.contains(needle), "{needle:?} missing in: {message}");
        }
    }
}
