//! DynamoDB-specific behaviour against a DynamoDB-compatible server: requests
//! per operation, the item format, expired-but-present items, size limits,
//! attribute names, table setup and error mapping.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, TimeToLiveStatus};
use idempotency_core::{
    Config, Error, HandlerError, IdempotencyManager, ManualClock, OwnerToken, RecordKey,
    Repository, Reservation, ReserveRequest, Status, Timestamp, MAX_NAMESPACE_BYTES,
};
use idempotency_dynamodb::{AttributeNames, DynamoDbRepository, RequestCounter};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

fn namespace() -> String {
    format!("test-{:016x}", rand::random::<u64>())
}

fn key(ns: &str, id: &str) -> RecordKey {
    RecordKey::new(ns, id, 511).unwrap()
}

fn request(key: &RecordKey, owner: OwnerToken, now: Timestamp) -> ReserveRequest<'_> {
    ReserveRequest::new(key, owner, now, LEASE, TTL)
}

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

/// The item as physically stored (live or expired), bypassing the repository.
async fn raw_item(
    repo: &DynamoDbRepository,
    key: &RecordKey,
) -> Option<HashMap<String, AttributeValue>> {
    repo.client()
        .get_item()
        .table_name(repo.table_name())
        .key(
            repo.attribute_names().partition_key.clone(),
            AttributeValue::S(key.encode()),
        )
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
}

async fn drop_table(repo: &DynamoDbRepository) {
    let _ = repo
        .client()
        .delete_table()
        .table_name(repo.table_name())
        .send()
        .await;
}

#[tokio::test]
async fn requests_per_operation() {
    let counter = RequestCounter::new();
    let repo = common::repository().await.with_request_counter(&counter);
    let ns = namespace();
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    counter.reset();

    // Fresh key: one conditional PutItem.
    let k = key(&ns, "fresh");
    let owner = OwnerToken::random();
    assert_eq!(
        repo.reserve(request(&k, owner, now)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    assert_eq!(counter.take(), counts(&[("PutItem", 1)]));

    // Duplicate: the failed condition returns the record; still one request.
    match repo
        .reserve(request(&k, OwnerToken::random(), now))
        .await
        .unwrap()
    {
        Reservation::Existing(r) => assert_eq!((r.owner, r.status), (owner, Status::Processing)),
        other => panic!("{other:?}"),
    }
    assert_eq!(counter.take(), counts(&[("PutItem", 1)]));

    repo.extend(&k, owner, now + LEASE * 2, now + LEASE * 2, now)
        .await
        .unwrap();
    assert_eq!(counter.take(), counts(&[("UpdateItem", 1)]));
    repo.complete(&k, owner, Some(b"r"), now + TTL, now)
        .await
        .unwrap();
    assert_eq!(counter.take(), counts(&[("UpdateItem", 1)]));
    assert!(matches!(
        repo.complete(&k, owner, None, now + TTL, now).await,
        Err(Error::LeaseLost { .. })
    ));
    assert_eq!(counter.take(), counts(&[("UpdateItem", 1)]));
    assert!(repo.get(&k, now).await.unwrap().is_some());
    assert_eq!(counter.take(), counts(&[("GetItem", 1)]));
    assert!(repo.delete(&k).await.unwrap());
    assert!(!repo.delete(&k).await.unwrap());
    assert_eq!(counter.take(), counts(&[("DeleteItem", 2)]));

    // Takeover of a stale lease: the failed PutItem, then the guarded UpdateItem.
    let k = key(&ns, "takeover");
    repo.reserve(request(&k, OwnerToken::random(), now))
        .await
        .unwrap();
    counter.reset();
    let later = now + LEASE;
    let taker = OwnerToken::random();
    assert_eq!(
        repo.reserve(request(&k, taker, later)).await.unwrap(),
        Reservation::Acquired { attempt: 2 }
    );
    assert_eq!(counter.take(), counts(&[("PutItem", 1), ("UpdateItem", 1)]));
    repo.fail(&k, taker, Some(b"e"), false, later + TTL, later)
        .await
        .unwrap();
    assert_eq!(counter.take(), counts(&[("UpdateItem", 1)]));

    let k = key(&ns, "release");
    let owner = OwnerToken::random();
    repo.reserve(request(&k, owner, now)).await.unwrap();
    counter.reset();
    repo.release(&k, owner, now).await.unwrap();
    assert_eq!(counter.take(), counts(&[("DeleteItem", 1)]));
    assert_eq!(repo.purge_expired(now, 100).await.unwrap(), 0);
    assert_eq!(
        counter.total(),
        0,
        "purge_expired sends nothing (native TTL)"
    );
}

#[tokio::test]
async fn manager_fresh_execution_is_two_requests_and_duplicate_one() {
    let counter = RequestCounter::new();
    let repo = common::repository().await.with_request_counter(&counter);
    let manager = IdempotencyManager::new(Arc::new(repo), Config::default())
        .unwrap()
        .scoped(&namespace())
        .unwrap();
    counter.reset();
    let first = manager
        .execute("order-1", &"payload", || async {
            Ok::<_, HandlerError<String>>("receipt".to_owned())
        })
        .await
        .unwrap();
    assert!(
        matches!(first, idempotency_core::Outcome::Executed(_)),
        "{first:?}"
    );
    assert_eq!(counter.take(), counts(&[("PutItem", 1), ("UpdateItem", 1)]));
    for _ in 0..3 {
        let again = manager
            .execute("order-1", &"payload", || async {
                Ok::<_, HandlerError<String>>("never".to_owned())
            })
            .await
            .unwrap();
        assert!(
            matches!(&again, idempotency_core::Outcome::Cached(r) if r == "receipt"),
            "{again:?}"
        );
        assert_eq!(counter.take(), counts(&[("PutItem", 1)]));
    }
}

#[tokio::test]
async fn expired_but_present_items_are_absent_to_every_operation() {
    let repo = common::repository().await;
    let ns = namespace();
    let clock = ManualClock::starting_now();
    let now = clock.now();
    let k = key(&ns, "expires");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        expires_at: now + Duration::from_secs(5),
        ..request(&k, owner, now)
    };
    repo.reserve(req).await.unwrap();
    repo.complete(&k, owner, Some(b"old"), now + Duration::from_secs(5), now)
        .await
        .unwrap();
    // Logically gone five seconds later; physically still there (DynamoDB's TTL
    // deletes within days, and only once the server's clock passes it).
    clock.advance(Duration::from_secs(5));
    let now = clock.now();
    let item = raw_item(&repo, &k).await.expect("the item is still stored");
    let expected_ttl = now.as_secs_ceil().to_string();
    assert_eq!(item.get("ttl"), Some(&AttributeValue::N(expected_ttl)));
    assert_eq!(repo.get(&k, now).await.unwrap(), None);
    for result in [
        repo.complete(&k, owner, None, now + TTL, now).await,
        repo.fail(&k, owner, None, false, now + TTL, now).await,
        repo.extend(&k, owner, now + LEASE, now + LEASE, now).await,
        repo.release(&k, owner, now).await,
    ] {
        assert!(matches!(result, Err(Error::LeaseLost { .. })), "{result:?}");
    }
    // A Processing record past expiry is not taken over but replaced: attempt 1.
    let fresh = OwnerToken::random();
    assert_eq!(
        repo.reserve(request(&k, fresh, now)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    let r = repo.get(&k, now).await.unwrap().unwrap();
    assert_eq!(
        (r.owner, r.attempt, r.result, r.created_at),
        (fresh, 1, None, now)
    );
    // `delete` acts on what is stored, expired or not.
    clock.advance(TTL);
    assert!(repo.delete(&k).await.unwrap());
}

#[tokio::test]
async fn item_format_and_ttl() {
    let repo = common::repository().await;
    let ns = namespace();
    let now = Timestamp::from_millis(1_700_000_000_123);
    let k = key(&ns, "a\0b\u{1}:c#d/{e}%f\n🦀");
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        fingerprint: Some(idempotency_core::Fingerprint::of_bytes(b"payload")),
        expires_at: Timestamp::from_millis(1_700_000_000_001),
        ..request(&k, owner, now - Duration::from_secs(1))
    };
    repo.reserve(req).await.unwrap();
    let item = raw_item(&repo, &k).await.unwrap();
    assert_eq!(item.get("pk"), Some(&AttributeValue::S(k.encode())));
    assert_eq!(
        item.get("status"),
        Some(&AttributeValue::S("processing".into()))
    );
    assert_eq!(
        item.get("owner"),
        Some(&AttributeValue::S(owner.to_string()))
    );
    assert_eq!(item.get("attempt"), Some(&AttributeValue::N("1".into())));
    // Rounded up: never physically removed before the logical expiry.
    assert_eq!(
        item.get("ttl"),
        Some(&AttributeValue::N("1700000001".into()))
    );
    assert!(!item.contains_key("result") && !item.contains_key("error"));

    // Empty results: stored as NULL, read back as Some(empty) — not None.
    for (i, value) in [Some(&b""[..]), None, Some(&b"\0\xff\x00"[..])]
        .into_iter()
        .enumerate()
    {
        let id = format!("v{i}");
        let k = key(&ns, &id);
        let o = OwnerToken::random();
        let now = Timestamp::from_system_time(std::time::SystemTime::now());
        repo.reserve(request(&k, o, now)).await.unwrap();
        repo.complete(&k, o, value, now + TTL, now).await.unwrap();
        let r = repo.get(&k, now).await.unwrap().unwrap();
        assert_eq!(r.result.as_deref(), value, "{id}");
        let item = raw_item(&repo, &k).await.unwrap();
        match value {
            Some([]) => assert_eq!(item.get("result"), Some(&AttributeValue::Null(true))),
            None => assert_eq!(item.get("result"), None),
            Some(_) => assert!(matches!(item.get("result"), Some(AttributeValue::B(_)))),
        }
        // The same for stored errors.
        let k = key(&ns, &format!("e{i}"));
        let o = OwnerToken::random();
        repo.reserve(request(&k, o, now)).await.unwrap();
        repo.fail(&k, o, value, false, now + TTL, now)
            .await
            .unwrap();
        assert_eq!(
            repo.get(&k, now).await.unwrap().unwrap().error.as_deref(),
            value
        );
    }

    // The table has TTL on `ttl`.
    let ttl = repo
        .client()
        .describe_time_to_live()
        .table_name(repo.table_name())
        .send()
        .await
        .unwrap();
    let d = ttl.time_to_live_description().unwrap();
    assert_eq!(d.attribute_name(), Some("ttl"));
    assert!(matches!(
        d.time_to_live_status(),
        Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
    ));
}

#[tokio::test]
async fn largest_item_fits_and_larger_results_are_refused() {
    let repo = common::repository().await;
    let max = repo.max_result_bytes();
    assert_eq!(repo.capabilities().max_result_bytes, Some(max));
    assert_eq!(repo.capabilities().max_id_bytes, 511);
    // The longest partition key: a namespace whose every byte is escaped (3×;
    // a random pattern of `:` and `%` keeps it unique) and an id of max_id_bytes.
    let bits = rand::random::<u64>();
    let mut ns: String = (0..64)
        .map(|i| if bits >> i & 1 == 1 { ':' } else { '%' })
        .collect();
    ns.push_str(&":".repeat(MAX_NAMESPACE_BYTES - 64));
    assert_eq!(ns.len(), MAX_NAMESPACE_BYTES);
    let id = "i".repeat(repo.capabilities().max_id_bytes);
    let k = RecordKey::new(&ns, &id, 511).unwrap();
    assert!(!k.is_digested());
    assert_eq!(k.encode().len(), 2048);
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    let owner = OwnerToken::random();
    let req = ReserveRequest {
        fingerprint: Some(idempotency_core::Fingerprint::of_bytes(b"p")),
        ..request(&k, owner, now)
    };
    repo.reserve(req).await.unwrap();
    let too_big = vec![0xAB; max + 1];
    assert!(matches!(
        repo.complete(&k, owner, Some(&too_big), now + TTL, now).await,
        Err(Error::TooLarge { size, max: m, .. }) if size == max + 1 && m == max
    ));
    assert!(matches!(
        repo.fail(&k, owner, Some(&too_big), false, now + TTL, now)
            .await,
        Err(Error::TooLarge { .. })
    ));
    let biggest = vec![0xCD; max];
    repo.fail(&k, owner, Some(&biggest), true, now + TTL, now)
        .await
        .unwrap();
    let r = repo.get(&k, now).await.unwrap().unwrap();
    assert_eq!(r.error.as_deref().map(<[u8]>::len), Some(max));
    // A takeover of the largest item (REMOVE of the error, SET of the rest).
    let taker = OwnerToken::random();
    let req = ReserveRequest {
        retry_failed: true,
        fingerprint: Some(idempotency_core::Fingerprint::of_bytes(b"p")),
        ..request(&k, taker, now)
    };
    assert_eq!(
        repo.reserve(req).await.unwrap(),
        Reservation::Acquired { attempt: 2 }
    );
    repo.complete(&k, taker, Some(&biggest), now + TTL, now)
        .await
        .unwrap();
    let r = repo.get(&k, now).await.unwrap().unwrap();
    assert_eq!(r.result.as_deref().map(<[u8]>::len), Some(max));
    assert!(r.error.is_none());

    // A key longer than a partition key holds is refused before any request.
    let long = RecordKey::new("ns", "x".repeat(3000), 4096).unwrap();
    assert!(matches!(
        repo.reserve(request(&long, owner, now)).await,
        Err(Error::InvalidKey { .. })
    ));
}

#[tokio::test]
async fn manager_skips_caching_results_over_the_item_limit() {
    let repo = common::repository().await;
    let max = repo.max_result_bytes();
    let manager = IdempotencyManager::new(
        Arc::new(repo),
        Config {
            max_result_size_bytes: usize::MAX,
            ..Config::default()
        },
    )
    .unwrap()
    .scoped(&namespace())
    .unwrap();
    // Serialized as a JSON string: max + 2 bytes.
    let big = "b".repeat(max);
    let first = manager
        .execute("big", &(), || async {
            Ok::<_, HandlerError<String>>(big.clone())
        })
        .await
        .unwrap();
    assert!(matches!(&first, idempotency_core::Outcome::Executed(v) if v.len() == max));
    let again = manager
        .execute("big", &(), || async {
            Ok::<_, HandlerError<String>>(String::new())
        })
        .await
        .unwrap();
    assert!(
        matches!(again, idempotency_core::Outcome::Duplicate),
        "{again:?}"
    );
    // Just under the limit is cached.
    let fits = "f".repeat(max - 2);
    manager
        .execute("fits", &(), || async {
            Ok::<_, HandlerError<String>>(fits.clone())
        })
        .await
        .unwrap();
    let again = manager
        .execute("fits", &(), || async {
            Ok::<_, HandlerError<String>>(String::new())
        })
        .await
        .unwrap();
    assert!(matches!(&again, idempotency_core::Outcome::Cached(v) if v.len() == max - 2));
}

#[tokio::test]
async fn corrupt_items_are_reported_with_their_key() {
    let repo = common::repository().await;
    let k = key(&namespace(), "corrupt");
    repo.client()
        .put_item()
        .table_name(repo.table_name())
        .item("pk", AttributeValue::S(k.encode()))
        .item("status", AttributeValue::S("exploded".into()))
        .item("expires_at", AttributeValue::N(u64::MAX.to_string()))
        .send()
        .await
        .unwrap();
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    match repo.get(&k, now).await {
        Err(Error::Corrupt {
            key: Some(got),
            reason,
        }) => {
            assert_eq!(got, k);
            assert!(reason.contains("exploded"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        repo.reserve(request(&k, OwnerToken::random(), now)).await,
        Err(Error::Corrupt { key: Some(_), .. })
    ));
    assert!(repo.delete(&k).await.unwrap());
}

/// An owner stored in another text than the one the repository writes (upper
/// case) is a corrupt item, not the same owner: the manager would compare the
/// parsed tokens (equal: "still ours") while every conditional write compares
/// the text (unequal: "lease lost").
#[tokio::test]
async fn an_owner_in_another_text_is_corrupt_not_the_same_owner() {
    let repo = common::repository().await;
    let k = key(&namespace(), "upper-owner");
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    let owner = OwnerToken::from_u128(u128::MAX - 1);
    repo.reserve(request(&k, owner, now)).await.unwrap();
    let upper = format!("{:032X}", owner.as_u128());
    repo.client()
        .update_item()
        .table_name(repo.table_name())
        .key("pk", AttributeValue::S(k.encode()))
        .update_expression("SET #o = :o")
        .expression_attribute_names("#o", "owner")
        .expression_attribute_values(":o", AttributeValue::S(upper))
        .send()
        .await
        .unwrap();
    assert!(matches!(
        repo.get(&k, now).await,
        Err(Error::Corrupt { key: Some(got), .. }) if got == k
    ));
    assert!(matches!(
        repo.reserve(request(&k, owner, now)).await,
        Err(Error::Corrupt { key: Some(_), .. })
    ));
    assert!(repo.delete(&k).await.unwrap());
}

#[tokio::test]
async fn custom_attribute_names_and_table_creation() {
    let table = common::unique_table("idem-custom").await;
    let url = format!(
        "{}&partition_key=id&ttl_attribute=expires",
        common::url(&table).await
    );
    let repo = idempotency_dynamodb::connect(&url).await.unwrap();
    assert_eq!(repo.attribute_names().partition_key, "id");
    // Creating again is a no-op.
    repo.create_table().await.unwrap();
    let mut names = AttributeNames::default()
        .with_partition_key("id")
        .with_ttl("expires");
    names.status = "st".into();
    let repo = repo.with_attribute_names(names).unwrap();
    let k = key(&namespace(), "custom");
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    let owner = OwnerToken::random();
    repo.reserve(request(&k, owner, now)).await.unwrap();
    repo.complete(&k, owner, Some(b"x"), now + TTL, now)
        .await
        .unwrap();
    let item = raw_item(&repo, &k).await.unwrap();
    assert_eq!(item.get("st"), Some(&AttributeValue::S("completed".into())));
    assert!(item.contains_key("expires") && !item.contains_key("pk") && !item.contains_key("ttl"));
    let ttl = repo
        .client()
        .describe_time_to_live()
        .table_name(&table)
        .send()
        .await
        .unwrap();
    assert_eq!(
        ttl.time_to_live_description()
            .and_then(|d| d.attribute_name()),
        Some("expires")
    );

    // The same table with the default names: a clear configuration error.
    let wrong = common::url(&table).await;
    match idempotency_dynamodb::connect(&wrong).await {
        Err(Error::Config { message }) => {
            assert!(
                message.contains(&table) && message.contains("`pk`"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    let default_names = DynamoDbRepository::from_client(repo.client().clone(), table.clone());
    match default_names.get(&k, now).await {
        Err(Error::Config { message }) => assert!(message.contains(&table), "{message}"),
        other => panic!("{other:?}"),
    }
    drop_table(&repo).await;
}

#[tokio::test]
async fn missing_table_is_a_configuration_error() {
    let base = common::repository().await;
    let table = common::unique_table("idem-missing").await;
    let repo = DynamoDbRepository::from_client(base.client().clone(), table.clone());
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    match repo
        .reserve(request(&key("ns", "x"), OwnerToken::random(), now))
        .await
    {
        Err(Error::Config { message }) => {
            assert!(
                message.contains(&table) && message.contains("create_table"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn unreachable_endpoint_is_retryable() {
    // Nothing listens on port 1: connection refused.
    let repo = idempotency_dynamodb::connect(
        "dynamodb://idempotency?region=us-east-1&endpoint=http://127.0.0.1:1&timeout=5s",
    )
    .await
    .unwrap();
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    let err = repo
        .reserve(request(&key("ns", "x"), OwnerToken::random(), now))
        .await
        .unwrap_err();
    assert!(err.is_retryable() && err.is_store_outage(), "{err:?}");
}

#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn https_needs_the_tls_feature() {
    match idempotency_dynamodb::connect("dynamodb://idempotency?region=eu-west-1").await {
        Err(Error::Config { message }) => assert!(message.contains("`tls`"), "{message}"),
        other => panic!("{other:?}"),
    }
}

/// Makes the error a credentials provider fails with.
type MakeCredentialsError = fn() -> aws_credential_types::provider::error::CredentialsError;

/// Credentials that never load.
#[derive(Debug)]
struct NoCredentials(MakeCredentialsError);

impl aws_credential_types::provider::ProvideCredentials for NoCredentials {
    fn provide_credentials<'a>(
        &'a self,
    ) -> aws_credential_types::provider::future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        aws_credential_types::provider::future::ProvideCredentials::ready(Err((self.0)()))
    }
}

#[tokio::test]
async fn misconfigured_clients_are_configuration_errors() {
    use aws_credential_types::provider::error::CredentialsError;
    let endpoint = common::endpoint().await;
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    let reserve = |config: aws_sdk_dynamodb::Config| async move {
        let repo =
            DynamoDbRepository::from_client(aws_sdk_dynamodb::Client::from_conf(config), "a_table");
        repo.reserve(request(&key("ns", "x"), OwnerToken::random(), now))
            .await
            .unwrap_err()
    };
    let builder = || {
        aws_sdk_dynamodb::Config::builder()
            .behavior_version_latest()
            .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
            .endpoint_url(&endpoint)
    };
    let cases: [(MakeCredentialsError, &str); 4] = [
        (
            || CredentialsError::not_loaded("nothing configured"),
            "config",
        ),
        (
            || CredentialsError::invalid_configuration("bad profile"),
            "config",
        ),
        (
            || CredentialsError::provider_timed_out(Duration::from_secs(5)),
            "timeout",
        ),
        (
            || CredentialsError::provider_error("STS answered 503"),
            "unavailable",
        ),
    ];
    for (make, want) in cases {
        let e = reserve(builder().credentials_provider(NoCredentials(make)).build()).await;
        let got = match &e {
            Error::Config { message } if message.contains("`a_table`") => "config",
            Error::Timeout { .. } => "timeout",
            Error::Unavailable { .. } => "unavailable",
            _ => "other",
        };
        assert_eq!(got, want, "{e:?}");
    }
    // No region: endpoint resolution fails.
    let no_region = aws_sdk_dynamodb::Config::builder()
        .behavior_version_latest()
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "a", "b", None, None, "test",
        ))
        .build();
    let e = reserve(no_region).await;
    assert!(matches!(e, Error::Config { .. }), "{e:?}");
}

#[tokio::test]
async fn outage_is_retryable_and_recovers() {
    use idempotency_conformance::containers::DynamoDbServer;
    let dedicated = DynamoDbServer::dedicated()
        .await
        .unwrap_or_else(|e| panic!("a dedicated DynamoDB-compatible server: {e}"));
    let url = format!(
        "{}&timeout=10s",
        common::url_on(dedicated.server(), "outage")
    );
    let repo = idempotency_dynamodb::connect(&url).await.unwrap();
    let ns = namespace();
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    repo.reserve(request(&key(&ns, "before"), OwnerToken::random(), now))
        .await
        .unwrap();
    dedicated.stop().await.unwrap();
    let err = repo
        .reserve(request(&key(&ns, "during"), OwnerToken::random(), now))
        .await
        .unwrap_err();
    assert!(err.is_store_outage(), "{err:?}");
    dedicated.start().await.unwrap();
    // The emulators keep data in memory: the table is gone after the restart.
    repo.create_table().await.unwrap();
    assert_eq!(
        repo.reserve(request(&key(&ns, "after"), OwnerToken::random(), now))
            .await
            .unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    dedicated.remove().await.unwrap();
}

/// Contract v2 on DynamoDB: a re-sent reserve is ours (one request, no write),
/// `extend` raises the expiry and the TTL attribute with the lease (never
/// lowers them), `fail` stores whether it is retryable and only a retryable
/// failure is taken over, and a takeover keeps the stored fingerprint.
#[tokio::test]
async fn contract_v2_items() {
    let counter = RequestCounter::new();
    let repo = common::repository().await.with_request_counter(&counter);
    let ns = namespace();
    let now = Timestamp::from_system_time(std::time::SystemTime::now());

    // A re-sent reserve: Acquired with the stored attempt, nothing written.
    let k = key(&ns, "resent");
    let owner = OwnerToken::random();
    repo.reserve(request(&k, owner, now)).await.unwrap();
    let before = raw_item(&repo, &k).await.unwrap();
    counter.reset();
    let later = now + Duration::from_secs(1);
    assert_eq!(
        repo.reserve(request(&k, owner, later)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    assert_eq!(counter.take(), counts(&[("PutItem", 1)]));
    assert_eq!(raw_item(&repo, &k).await.unwrap(), before, "no write");

    // Extend past the expiry: expiry and TTL follow (two requests); an earlier
    // lease and expiry lower nothing (one request).
    counter.reset();
    let until = now + TTL * 3;
    repo.extend(&k, owner, until, until, now).await.unwrap();
    assert_eq!(counter.take(), counts(&[("UpdateItem", 2)]));
    let r = repo.get(&k, now + TTL * 2).await.unwrap().unwrap();
    counter.reset();
    assert_eq!((r.lease_until, r.expires_at), (until, until));
    let item = raw_item(&repo, &k).await.unwrap();
    let ttl_secs = until.as_millis().div_ceil(1000).to_string();
    assert_eq!(item.get("ttl"), Some(&AttributeValue::N(ttl_secs.clone())));
    let short = now + LEASE;
    counter.reset();
    repo.extend(&k, owner, short, short, now).await.unwrap();
    assert_eq!(counter.take(), counts(&[("UpdateItem", 1)]));
    let r = repo.get(&k, now).await.unwrap().unwrap();
    assert_eq!(
        (r.lease_until, r.expires_at),
        (until, until),
        "lease and expiry kept"
    );
    let item = raw_item(&repo, &k).await.unwrap();
    assert_eq!(item.get("ttl"), Some(&AttributeValue::N(ttl_secs)));
    // An earlier lease with a later expiry: the expiry and TTL rise, the lease
    // stays (two requests: the first refusal shows what the record lacks).
    let further = until + TTL;
    counter.reset();
    repo.extend(&k, owner, short, further, now).await.unwrap();
    assert_eq!(counter.take(), counts(&[("UpdateItem", 2)]));
    let r = repo.get(&k, now).await.unwrap().unwrap();
    assert_eq!((r.lease_until, r.expires_at), (until, further));
    let item = raw_item(&repo, &k).await.unwrap();
    let further_secs = further.as_millis().div_ceil(1000).to_string();
    assert_eq!(item.get("ttl"), Some(&AttributeValue::N(further_secs)));
    assert!(matches!(
        repo.extend(&k, OwnerToken::random(), until, until, now)
            .await,
        Err(Error::LeaseLost { .. })
    ));

    // Retryable failures: stored, and only they are taken over.
    for retryable in [false, true] {
        let k = key(&ns, &format!("failed-{retryable}"));
        let owner = OwnerToken::random();
        let req = ReserveRequest {
            fingerprint: Some(idempotency_core::Fingerprint::of_bytes(b"p")),
            ..request(&k, owner, now)
        };
        repo.reserve(req).await.unwrap();
        repo.fail(&k, owner, Some(b"e"), retryable, now + TTL, now)
            .await
            .unwrap();
        let item = raw_item(&repo, &k).await.unwrap();
        assert_eq!(
            item.get("retryable"),
            Some(&AttributeValue::Bool(retryable))
        );
        assert_eq!(
            repo.get(&k, now).await.unwrap().unwrap().retryable,
            retryable
        );
        let retry = ReserveRequest {
            retry_failed: true,
            ..request(&k, OwnerToken::random(), now)
        };
        let taken = repo.reserve(retry).await.unwrap();
        let r = repo.get(&k, now).await.unwrap().unwrap();
        if retryable {
            assert_eq!(taken, Reservation::Acquired { attempt: 2 });
            // Taken over without a fingerprint: the stored one is kept, the
            // flag and the error cleared.
            assert_eq!(
                r.fingerprint,
                Some(idempotency_core::Fingerprint::of_bytes(b"p"))
            );
            assert!(!r.retryable && r.error.is_none());
            assert!(!raw_item(&repo, &k).await.unwrap().contains_key("retryable"));
        } else {
            assert!(matches!(taken, Reservation::Existing(_)), "{taken:?}");
            assert_eq!(r.status, Status::Failed);
        }
    }

    // Items written before the attribute existed: failed ones stay retryable.
    let k = key(&ns, "legacy");
    let owner = OwnerToken::random();
    repo.reserve(request(&k, owner, now)).await.unwrap();
    repo.fail(&k, owner, None, true, now + TTL, now)
        .await
        .unwrap();
    repo.client()
        .update_item()
        .table_name(repo.table_name())
        .key("pk", AttributeValue::S(k.encode()))
        .update_expression("REMOVE retryable")
        .send()
        .await
        .unwrap();
    assert!(repo.get(&k, now).await.unwrap().unwrap().retryable);
}

/// Loses the reply of the first request raising a record's expiry (the
/// second `UpdateItem` of an `extend` whose TTL must grow) after DynamoDB
/// applied it: the reply becomes a 500, which the SDK re-sends.
#[derive(Debug, Default, Clone)]
struct LoseRaiseReply {
    armed: Arc<std::sync::atomic::AtomicBool>,
    lost: Arc<std::sync::atomic::AtomicUsize>,
}

impl aws_sdk_dynamodb::config::Intercept for LoseRaiseReply {
    fn name(&self) -> &'static str {
        "LoseRaiseReply"
    }

    fn read_before_transmit(
        &self,
        context: &aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &aws_sdk_dynamodb::config::RuntimeComponents,
        _cfg: &mut aws_sdk_dynamodb::config::ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        use std::sync::atomic::Ordering;
        let body = context.request().body().bytes().unwrap_or_default();
        let raises = body.windows(4).any(|w| w == b":ttl");
        if raises && self.lost.load(Ordering::SeqCst) == 0 {
            self.armed.store(true, Ordering::SeqCst);
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut aws_sdk_dynamodb::config::interceptors::BeforeDeserializationInterceptorContextMut<'_>,
        _runtime_components: &aws_sdk_dynamodb::config::RuntimeComponents,
        _cfg: &mut aws_sdk_dynamodb::config::ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        use std::sync::atomic::Ordering;
        if self.armed.swap(false, Ordering::SeqCst) {
            assert_eq!(context.response().status().as_u16(), 200, "applied");
            self.lost.fetch_add(1, Ordering::SeqCst);
            let response = context.response_mut();
            *response.status_mut() = 500u16.try_into()?;
            *response.body_mut() = aws_smithy_types::body::SdkBody::from(
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"reply lost"}"#,
            );
        }
        Ok(())
    }
}

/// An `extend` whose raise was applied but whose reply was lost: the SDK's
/// re-send fails its own condition (the expiry is no longer below the new
/// one), yet the record is ours and already as the extension leaves it, so
/// the extension succeeded — not an error that would let the lease lapse.
#[tokio::test]
async fn an_extension_applied_with_its_reply_lost_succeeds() {
    let lossy = LoseRaiseReply::default();
    let repo = common::repository_through(lossy.clone()).await;
    an_extension_raising_the_expiry(&repo, || {
        assert_eq!(lossy.lost.load(std::sync::atomic::Ordering::SeqCst), 1);
    })
    .await;
}

/// From a store that returns no item with a refused condition, an `extend`
/// that must also raise the expiry (its first request refused) reads the
/// record instead of calling a lease it holds lost; a record that is not ours
/// is still refused.
#[tokio::test]
async fn an_extension_refused_without_the_item_reads_it() {
    let strip = common::StripRefusedItem::default();
    let repo = common::repository_through(strip.clone()).await;
    // An expiry beyond the stored one: the first request (the lease alone) is
    // refused, and the refusal carries no item.
    an_extension_raising_the_expiry(&repo, || {
        assert!(strip.stripped.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    })
    .await;
}

/// Reserves a key and extends it past its expiry (the lease, then the expiry
/// and TTL: two requests), `faulted` checking the interceptor did its part;
/// the record then holds what was asked. Someone else's record, and a
/// missing one, are still refused: only our own is a success.
async fn an_extension_raising_the_expiry(repo: &DynamoDbRepository, faulted: impl FnOnce()) {
    let ns = namespace();
    let now = Timestamp::from_system_time(std::time::SystemTime::now());
    let k = key(&ns, "raised");
    let owner = OwnerToken::random();
    repo.reserve(request(&k, owner, now)).await.unwrap();

    let later = now + Duration::from_secs(10);
    let (lease, expiry) = (later + LEASE, later + 2 * TTL);
    repo.extend(&k, owner, lease, expiry, later).await.unwrap();
    faulted();
    let stored = repo.get(&k, later).await.unwrap().unwrap();
    assert_eq!(
        (stored.owner, stored.lease_until, stored.expires_at),
        (owner, lease, expiry)
    );

    let other = key(&ns, "other");
    repo.reserve(request(&other, OwnerToken::random(), now))
        .await
        .unwrap();
    assert!(matches!(
        repo.extend(&other, owner, lease, expiry, later).await,
        Err(Error::LeaseLost { .. })
    ));
    let gone = key(&ns, "gone");
    assert!(matches!(
        repo.extend(&gone, owner, lease, expiry, later).await,
        Err(Error::LeaseLost { .. })
    ));
}
