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
