//! The facade picks stores by URL and names the missing feature.

use idempotency::{connect, Error, StoreKind};

#[tokio::test]
async fn memory_urls_connect() {
    for url in ["memory:", "memory://", "MEMORY:"] {
        let store = connect(url).await.unwrap();
        assert_eq!(store.capabilities().backend, "memory");
    }
}

#[tokio::test]
async fn memory_urls_with_options_are_refused() {
    for url in [
        "memory:?shards=4",
        "memory:/tmp/x",
        "mem://host/db",
        "memory:x",
    ] {
        match connect(url).await {
            Err(e @ Error::Config { .. }) => assert!(!e.is_retryable()),
            other => panic!("{url}: expected a configuration error, got {other:?}"),
        }
    }
}

/// SQLite URLs whose connections would not share one database, or whose file
/// cannot be opened, are configuration errors (never retryable outages).
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_urls_that_cannot_work_are_configuration_errors() {
    let missing_dir = std::env::temp_dir()
        .join(format!("no-such-dir-{:016x}", std::process::id()))
        .join("idempotency.db");
    let not_a_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml/idempotency.db");
    for url in [
        "sqlite://".to_owned(),
        "sqlite://?synchronous=normal".to_owned(),
        "sqlite::memory:?cache=private".to_owned(),
        format!("sqlite://{}", missing_dir.display()),
        format!("sqlite://{not_a_dir}"),
    ] {
        match connect(&url).await {
            Err(e @ Error::Config { .. }) => assert!(!e.is_retryable()),
            other => panic!("{url}: expected a configuration error, got {other:?}"),
        }
    }
    // In memory, shared by the pool's connections: works.
    let store = connect("sqlite::memory:").await.unwrap();
    assert_eq!(store.capabilities().backend, "sqlite");
}

#[tokio::test]
async fn disabled_backends_name_their_feature() {
    let cases = [
        ("redis://127.0.0.1:1", "redis", cfg!(feature = "redis")),
        ("rediss://127.0.0.1:1", "redis", cfg!(feature = "redis")),
        (
            "postgres://u@127.0.0.1:1/db",
            "postgres",
            cfg!(feature = "postgres"),
        ),
        (
            "postgresql://u@127.0.0.1:1/db",
            "postgres",
            cfg!(feature = "postgres"),
        ),
        (
            "dynamodb://t?region=us-east-1",
            "dynamodb",
            cfg!(feature = "dynamodb"),
        ),
        (
            "sqlite://idempotency.db",
            "sqlite",
            cfg!(feature = "sqlite"),
        ),
        ("mysql://u@127.0.0.1:1/db", "mysql", cfg!(feature = "mysql")),
        (
            "mariadb://u@127.0.0.1:1/db",
            "mysql",
            cfg!(feature = "mysql"),
        ),
    ];
    for (url, feature, enabled) in cases {
        if enabled {
            continue;
        }
        match connect(url).await {
            Err(Error::Config { message }) => {
                assert!(
                    message.contains(&format!("feature {feature:?}")),
                    "{message}"
                )
            }
            other => panic!("{url}: expected a configuration error, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn unknown_schemes_are_configuration_errors() {
    for url in ["mongodb://x", "", "nocolon", ":x"] {
        assert!(
            matches!(connect(url).await, Err(Error::Config { .. })),
            "{url}"
        );
    }
    assert_eq!(
        StoreKind::from_url("redis+cluster://a:1,b:2").unwrap(),
        StoreKind::Redis
    );
}
