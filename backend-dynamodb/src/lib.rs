//! The DynamoDB backend of **idempotency-rs**: every decision is one conditional
//! request, expiry is DynamoDB's native TTL.
//!
//! ```no_run
//! use std::sync::Arc;
//! use idempotency_core::{Config, HandlerError, IdempotencyManager, Outcome};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! // Region, endpoint and credentials as the AWS SDK finds them, or in the URL.
//! let repo = idempotency_dynamodb::connect("dynamodb://idempotency?region=eu-west-1").await?;
//! let payments = IdempotencyManager::new(Arc::new(repo), Config::default())?.scoped("payments")?;
//!
//! let outcome = payments
//!     .execute("ProcessPayment:evt-42", &serde_json::json!({"amount": 10}), || async {
//!         // ... charge the card ...
//!         Ok::<_, HandlerError<String>>("receipt-1".to_owned())
//!     })
//!     .await?;
//! assert!(matches!(outcome, Outcome::Executed(_) | Outcome::Cached(_)));
//! # Ok(()) }
//! ```
//!
//! Build a repository from a URL ([`connect`], options listed there), from the
//! environment ([`DynamoDbRepository::from_env`]), or from your own SDK setup
//! ([`DynamoDbRepository::from_sdk_config`], [`DynamoDbRepository::from_client`]),
//! which needs no network until the first operation. A client built from the
//! SDK's own `Config::builder()` has no HTTP client (this crate turns the
//! SDK's default one off); `from_client` supplies one, and the default
//! operation timeout, so the repository below sends its first request (the
//! credentials then come from the client's provider):
//!
//! ```
//! use idempotency_core::Repository;
//! use idempotency_dynamodb::{AttributeNames, DynamoDbRepository};
//!
//! let config = aws_sdk_dynamodb::Config::builder()
//!     .behavior_version_latest()
//!     .region(aws_sdk_dynamodb::config::Region::new("eu-west-1"))
//!     .build();
//! let repo = DynamoDbRepository::from_client(aws_sdk_dynamodb::Client::from_conf(config), "idempotency")
//!     .with_attribute_names(AttributeNames::default().with_partition_key("id"))?;
//! let caps = repo.capabilities();
//! assert_eq!(caps.backend, "dynamodb");
//! assert_eq!(caps.max_id_bytes, 511);
//! assert!(caps.native_expiry);
//! assert!(caps.max_result_bytes.is_some_and(|max| max > 390_000));
//! # Ok::<(), idempotency_core::Error>(())
//! ```
//!
//! # What it guarantees, and what each operation costs
//!
//! One item per record, under the partition key [`RecordKey::encode`](idempotency_core::RecordKey::encode) — an
//! injective encoding of (namespace, id), so every record is its own partition
//! (never one hot partition per namespace). DynamoDB applies a conditional write
//! to one item atomically, so under any number of racing consumers exactly one
//! wins each reservation and takeover, and an owner's `complete`/`fail`/
//! `release`/`extend` applies only while it holds the record (fencing).
//!
//! | operation | requests | how |
//! |---|---|---|
//! | `reserve`, fresh or expired key | 1 | `PutItem` if `attribute_not_exists(pk) OR expires_at <= :now` |
//! | `reserve`, duplicate | 1 | that `PutItem`'s failed condition returns the stored record (`ReturnValuesOnConditionCheckFailure = ALL_OLD`) |
//! | `reserve` re-sent by its owner (the SDK retried it after a lost reply) | 1 | the same failed `PutItem` returns our own live record: answered `Acquired`, nothing written |
//! | `reserve`, takeover (stale lease, or a retryable `Failed` with `retry_failed`) | 2 | + `UpdateItem` if owner, attempt and status are still those read, the record is live and (`Processing`) its lease is stale; the stored fingerprint is kept when the request has none; a lost race returns the winner's record the same way |
//! | `complete`, `fail` | 1 | `UpdateItem` if `owner = :owner AND status = processing AND expires_at > :now`, else `LeaseLost`; `fail` stores `retryable` |
//! | `extend`, expiry already later than asked (the usual case: TTL longer than the lease) | 1 | `UpdateItem` of the lease under that condition `AND expires_at >= :new_exp` |
//! | `extend`, expiry to raise | 2 | the first one's failed condition returns the item; still ours: `UpdateItem` of lease, `expires_at` and `ttl` under the condition `AND expires_at < :new_exp` (expiry and TTL never go down) |
//! | `release` | 1 | `DeleteItem` with the same condition |
//! | `get` | 1 | `GetItem`, strongly consistent |
//! | `delete` | 1 | `DeleteItem` if `attribute_exists(pk)` |
//! | `purge_expired` | 0 | DynamoDB TTL deletes expired items |
//! | `reserve_many`, `complete_many` (an `execute_batch` group) | 1 per key | each key's `reserve` or `complete`, sent concurrently: `BatchWriteItem` cannot carry a condition, and `TransactWriteItems` would make one refused key fail the whole group (and costs two write units per item). A group of *n* costs *n* requests and their capacity — *n* write units for fresh keys, the failed `PutItem` of a duplicate consumes a write unit too — and takes as long as its slowest request |
//!
//! A server that returns no item with a failed condition (an emulator without
//! `ReturnValuesOnConditionCheckFailure`) costs one strongly consistent
//! `GetItem` more where the table counts on that item (a duplicate `reserve`,
//! an `extend` that must raise the expiry); the answers are the same.
//!
//! Through [`IdempotencyManager`](idempotency_core::IdempotencyManager): a first
//! delivery is **2 requests** (reserve + complete), a duplicate **1**. A test
//! counts them with [`RequestCounter`], an SDK interceptor you can install too.
//! Note that a duplicate's failed conditional `PutItem` is billed as a write.
//!
//! **Instants are the caller's.** Every condition compares against the `now` the
//! manager passes, never the server's clock. A record whose `expires_at <= now`
//! is absent to every operation while it is still stored. The TTL attribute is
//! `expires_at` in seconds rounded up, and DynamoDB deletes by its own clock,
//! never before that instant (usually well after it), so it never deletes a
//! record before its logical expiry — unless a consumer's clock runs behind
//! DynamoDB's, and then at most by that difference early (keep clocks in sync,
//! as `clock_skew` assumes).
//!
//! **Retries and errors.** The SDK retries throttling and transient errors (its
//! standard retry mode, 3 attempts). What is left maps to the core's errors:
//! conditional failures to the outcomes above; throttling
//! (`ProvisionedThroughputExceeded`, `Throttling`, `RequestLimitExceeded`),
//! `InternalServerError`, other 5xx, connection and I/O failures to the retryable
//! [`Error::Unavailable`](idempotency_core::Error::Unavailable), timeouts to
//! [`Error::Timeout`](idempotency_core::Error::Timeout); a missing table,
//! `ValidationException` (wrong key schema …; except an item over DynamoDB's
//! size limit, which is the non-retryable
//! [`Error::TooLarge`](idempotency_core::Error::TooLarge), so the manager
//! completes without caching the result) and refused credentials to
//! [`Error::Config`](idempotency_core::Error::Config) naming the table and key
//! attribute; an item that does not parse to
//! [`Error::Corrupt`](idempotency_core::Error::Corrupt) naming the key.
//!
//! # Limits
//!
//! | | |
//! |---|---|
//! | item | 400,000 bytes, attribute names included (DynamoDB's "400 KB", read decimally: safe on DynamoDB and emulators alike) |
//! | result or stored error | [`DynamoDbRepository::max_result_bytes`], the item limit minus the largest rest of the record — about 397,500 bytes with the default names; the manager completes without caching a larger result, the repository refuses it with `TooLarge` |
//! | id | 511 bytes kept verbatim (`Capabilities::max_id_bytes`); longer ids are digested by the manager. With the 512-byte namespace maximum, every key fits the 2,048-byte partition key limit; a longer key is refused with `InvalidKey` before any request |
//! | ids and namespaces | any UTF-8, NUL and control characters included |
//!
//! # The item
//!
//! | attribute (default name) | type | content |
//! |---|---|---|
//! | `pk` | S | [`RecordKey::encode`](idempotency_core::RecordKey::encode) |
//! | `status` | S | `processing`, `completed`, `failed` |
//! | `owner` | S | the fencing token, 32 hex digits |
//! | `attempt` | N | 1, +1 per takeover |
//! | `fingerprint` | S | 64 hex digits, absent when none |
//! | `result`, `error` | B | the bytes; `NULL` for an empty value (some DynamoDB versions refuse empty binaries); absent when none |
//! | `lease_until`, `expires_at`, `created_at`, `updated_at` | N | Unix milliseconds |
//! | `ttl` | N | `expires_at` in Unix seconds, rounded up |
//! | `retryable` | BOOL | on `failed` records: whether a retrying delivery may take it over (a failed item written before this attribute existed counts as retryable, as it was) |
//!
//! Every name can be changed with [`AttributeNames`].
//!
//! # Caveats
//!
//! - **Global tables** replicate with last-writer-wins between regions: the
//!   single-winner guarantee holds among consumers writing to the same region.
//! - **Emulators**: `amazon/dynamodb-local` is faithful. moto's stock server does
//!   not make conditional writes atomic under concurrent requests (see below).
//! - **TLS**: the default feature `tls` brings rustls with the `ring` provider
//!   (the AWS SDK's default aws-lc stack is never compiled). Without it, only
//!   plain `http://` endpoints (local emulators) can be used.
//!
//! # Cargo features
//!
//! | feature | default | |
//! |---|---|---|
//! | `tls` | yes | HTTPS for real AWS endpoints (rustls + ring, platform roots) |
//!
#![doc = include_str!("../docs/table-setup.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod connect;
mod counter;
mod error;
mod item;
mod repository;

pub use connect::{connect, DEFAULT_OPERATION_TIMEOUT};
pub use counter::RequestCounter;
pub use item::AttributeNames;
pub use repository::DynamoDbRepository;

/// The AWS SDK this backend is built on, for building clients and requests of
/// the same version.
pub use aws_sdk_dynamodb;
