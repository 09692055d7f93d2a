//! Migrations, names and URL options.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use idempotency_core::{
    Error, OwnerToken, RecordKey, Repository, Reservation, ReserveRequest, Timestamp,
};
use idempotency_postgres::PgRepository;

fn request(key: &RecordKey) -> ReserveRequest<'_> {
    let now = Timestamp::from_millis(1_000_000);
    ReserveRequest::new(
        key,
        OwnerToken::random(),
        now,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

async fn admin() -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&common::server_url().await)
        .await
        .unwrap()
}

/// The statements that take a migrated table back to migration 3's shape
/// (its index on `expires_at` and fillfactor aside).
fn back_to_migration_3(schema: &str) -> [String; 2] {
    [
        format!("DELETE FROM \"{schema}\".records_migrations WHERE version >= 4"),
        format!("ALTER TABLE \"{schema}\".records DROP COLUMN purge_after"),
    ]
}

/// Runs `statements` in order, each on its own.
async fn execute_all(pool: &sqlx::PgPool, statements: impl IntoIterator<Item = String>) {
    for statement in statements {
        sqlx::query(&statement).execute(pool).await.unwrap();
    }
}

async fn drop_schema(schema: &str) {
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&admin().await)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrate_applies_once() {
    let schema = common::unique("idem_mig");
    let url = common::server_url().await;
    // Eight "processes" (own pools) start at once on a database without the schema.
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (schema, url) = (schema.clone(), url.clone());
            tokio::spawn(async move {
                let repo = PgRepository::builder()
                    .schema(schema)
                    .table("records")
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .unwrap();
                repo.migrate().await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let pool = admin().await;
    let versions: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT version FROM \"{schema}\".\"records_migrations\" ORDER BY version"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4]);

    // Idempotent: again, and the table works.
    let repo = PgRepository::builder()
        .schema(schema.as_str())
        .table("records")
        .connect(&url)
        .await
        .unwrap();
    repo.migrate().await.unwrap();
    repo.migrate().await.unwrap();
    let key = RecordKey::new("ns", "k", 1024).unwrap();
    assert_eq!(
        repo.reserve(request(&key)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    drop_schema(&schema).await;
}

#[tokio::test]
async fn operations_before_migrate_name_the_table_and_migrate() {
    let repo = PgRepository::builder()
        .table(common::unique("idem_unmigrated"))
        .connect(&common::server_url().await)
        .await
        .unwrap();
    let key = RecordKey::new("ns", "k", 1024).unwrap();
    match repo.reserve(request(&key)).await {
        Err(Error::Config { message }) => {
            assert!(message.contains(repo.table()), "{message}");
            assert!(message.contains("migrate()"), "{message}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    assert!(matches!(
        repo.get(&key, Timestamp::from_millis(1)).await,
        Err(Error::Config { .. })
    ));
}

#[tokio::test]
async fn hostile_names_are_rejected_not_executed() {
    let url = common::server_url().await;
    let pool = admin().await;
    let victim = common::unique("idem_victim");
    sqlx::query(&format!("CREATE TABLE {victim} (x int)"))
        .execute(&pool)
        .await
        .unwrap();
    let hostile = [
        format!("x\"; DROP TABLE {victim}; --"),
        format!("x; DROP TABLE {victim}"),
        "records\"".to_owned(),
        "a.b".to_owned(),
        "1abc".to_owned(),
        "with space".to_owned(),
        "nul\0byte".to_owned(),
        "é".to_owned(),
        String::new(),
        "t".repeat(64),
    ];
    for name in &hostile {
        for builder in [
            PgRepository::builder().table(name.as_str()),
            PgRepository::builder().schema(name.as_str()),
        ] {
            match builder.clone().connect(&url).await {
                Err(Error::Config { .. }) => {}
                other => panic!("{name:?} was accepted: {other:?}"),
            }
            assert!(matches!(
                builder.clone().connect_lazy(&url),
                Err(Error::Config { .. })
            ));
            let pool = sqlx::postgres::PgPoolOptions::new()
                .connect_lazy(&url)
                .unwrap();
            assert!(matches!(
                builder.build_with_pool(pool),
                Err(Error::Config { .. })
            ));
        }
        // Through the URL, percent-encoded.
        let encoded: String = url::form_urlencoded::byte_serialize(name.as_bytes()).collect();
        let sep = if url.contains('?') { '&' } else { '?' };
        for option in ["table", "schema"] {
            match idempotency_postgres::connect(&format!("{url}{sep}{option}={encoded}")).await {
                Err(Error::Config { .. }) => {}
                other => panic!("{option}={name:?} was accepted: {other:?}"),
            }
        }
    }
    let still_there: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&victim)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(still_there);
    sqlx::query(&format!("DROP TABLE {victim}"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn connect_honours_url_options() {
    let url = common::server_url().await;
    let sep = if url.contains('?') { '&' } else { '?' };
    let schema = common::unique("Idem_Url");

    // migrate=false: nothing is created.
    let repo = idempotency_postgres::connect(&format!(
        "{url}{sep}schema={schema}&table=MixedCase&migrate=false&max_connections=2&acquire_timeout=3s&application_name=idem-test"
    ))
    .await
    .unwrap();
    assert_eq!(
        (repo.schema(), repo.table()),
        (schema.as_str(), "MixedCase")
    );
    let key = RecordKey::new("ns", "k", 1024).unwrap();
    assert!(matches!(
        repo.reserve(request(&key)).await,
        Err(Error::Config { .. })
    ));
    let app: String = sqlx::query_scalar("SELECT current_setting('application_name')")
        .fetch_one(repo.pool())
        .await
        .unwrap();
    assert_eq!(app, "idem-test");

    // Default: connect migrates (mixed-case names are quoted, so kept as given).
    let postgresql = url.replacen("postgres://", "postgresql://", 1);
    let repo =
        idempotency_postgres::connect(&format!("{postgresql}{sep}schema={schema}&table=MixedCase"))
            .await
            .unwrap();
    assert_eq!(
        repo.reserve(request(&key)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = 'MixedCase')",
    )
    .bind(&schema)
    .fetch_one(repo.pool())
    .await
    .unwrap();
    assert!(exists);

    // from_url with migrate=true migrates too; from_pool never does.
    let repo2 = PgRepository::from_url(&format!(
        "{url}{sep}schema={schema}&table=other&migrate=true"
    ))
    .await
    .unwrap();
    assert!(repo2.reserve(request(&key)).await.is_ok());
    let from_pool = PgRepository::from_pool(repo2.pool().clone());
    assert_eq!(
        (from_pool.schema(), from_pool.table()),
        ("public", "idempotency_records")
    );
    drop_schema(&schema).await;

    // Wrong scheme.
    assert!(matches!(
        idempotency_postgres::connect("mysql://localhost/db").await,
        Err(Error::Config { .. })
    ));
}

#[tokio::test]
async fn unreachable_server_is_unavailable() {
    // A port nobody listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let started = std::time::Instant::now();
    let err = PgRepository::builder()
        .acquire_timeout(Duration::from_millis(500))
        .connect(&format!("postgres://nobody@127.0.0.1:{port}/db"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.is_retryable());
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// A repository on table `records` of a schema of its own (named after
/// `prefix`), migrated to the latest version.
async fn migrated_in_own_schema(prefix: &str) -> (String, PgRepository) {
    let schema = common::unique(prefix);
    let repo = unmigrated_on(&schema).await;
    repo.migrate().await.unwrap();
    (schema, repo)
}

/// A repository on table `records` of `schema` that does not migrate (the
/// builder's default).
async fn unmigrated_on(schema: &str) -> PgRepository {
    PgRepository::builder()
        .schema(schema)
        .table("records")
        .connect(&common::server_url().await)
        .await
        .unwrap()
}

/// Migration 3 over a table at migration 2: the `retryable` column is added,
/// failed rows written before it stay open to a retrying takeover (as they
/// were), and the new reservation function answers a re-sent reserve as ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_3_upgrades_a_table_at_migration_2() {
    let (schema, repo) = migrated_in_own_schema("idem_mig3").await;
    // Back to the shape of migration 2, with a failed row written then.
    let pool = admin().await;
    execute_all(
        &pool,
        back_to_migration_3(&schema).into_iter().chain([
            format!("DELETE FROM \"{schema}\".records_migrations WHERE version = 3"),
            format!("ALTER TABLE \"{schema}\".records DROP COLUMN retryable"),
            format!(
                "INSERT INTO \"{schema}\".records (namespace, id, status, owner, attempt, \
             fingerprint, result, error, lease_until, expires_at, created_at, updated_at) \
             VALUES ('ns', 'old-failure', 'failed', '\\x000102030405060708090a0b0c0d0e0f', 1, \
             NULL, NULL, 'e', 1000000, 9000000, 1000000, 1000000)"
            ),
        ]),
    )
    .await;
    repo.migrate().await.unwrap();
    let versions: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT version FROM \"{schema}\".records_migrations ORDER BY version"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4]);
    let key = RecordKey::new("ns", "old-failure", 256).unwrap();
    let now = Timestamp::from_millis(1_000_000);
    let old = repo.get(&key, now).await.unwrap().unwrap();
    assert!(
        old.retryable,
        "a failure from before the upgrade stays retryable"
    );
    let retry = ReserveRequest {
        retry_failed: true,
        ..request(&key)
    };
    let owner = retry.owner;
    assert_eq!(
        repo.reserve(retry.clone()).await.unwrap(),
        Reservation::Acquired { attempt: 2 }
    );
    // Re-sent by the same owner: ours, nothing written.
    let before = repo.get(&key, now).await.unwrap().unwrap();
    assert_eq!(
        repo.reserve(ReserveRequest { owner, ..retry })
            .await
            .unwrap(),
        Reservation::Acquired { attempt: 2 }
    );
    assert_eq!(repo.get(&key, now).await.unwrap().unwrap(), before);
    drop_schema(&schema).await;
}

/// Migration 4 over a table at migration 3: `purge_after` is filled in from
/// each row's expiry, its index replaces the one on `expires_at`, the table's
/// fillfactor leaves room for HOT completions, and rows written before the
/// upgrade are read, purged and reserved as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_4_upgrades_a_table_at_migration_3() {
    let (schema, repo) = migrated_in_own_schema("idem_mig4").await;
    // Back to the shape of migration 3, with a live and an expired row.
    let pool = admin().await;
    let row = |id: &str, expires: i64| {
        format!(
            "INSERT INTO \"{schema}\".records (namespace, id, status, owner, attempt, \
             fingerprint, result, error, retryable, lease_until, expires_at, created_at, \
             updated_at) VALUES ('ns', '{id}', 'completed', \
             '\\x000102030405060708090a0b0c0d0e0f', 1, NULL, 'done', NULL, false, 1000000, \
             {expires}, 1000000, 1000000)"
        )
    };
    execute_all(
        &pool,
        back_to_migration_3(&schema).into_iter().chain([
            format!("ALTER TABLE \"{schema}\".records RESET (fillfactor)"),
            format!("CREATE INDEX records_expires_at_idx ON \"{schema}\".records (expires_at)"),
            row("live", 9_000_000),
            row("expired", 1_500_000),
        ]),
    )
    .await;
    repo.migrate().await.unwrap();
    let filled: Vec<(Vec<u8>, i64, i64)> = sqlx::query_as(&format!(
        "SELECT id, purge_after, expires_at FROM \"{schema}\".records ORDER BY id"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        filled,
        vec![
            (b"expired".to_vec(), 1_500_000, 1_500_000),
            (b"live".to_vec(), 9_000_000, 9_000_000)
        ]
    );
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND tablename = 'records' \
         ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(indexes, vec!["records_pkey", "records_purge_idx"]);
    let options: Option<Vec<String>> = sqlx::query_scalar(
        "SELECT reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = 'records'",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(options, Some(vec!["fillfactor=85".to_owned()]));

    // A writer of the previous version, which does not know `purge_after`
    // (a reservation function still running when the migration committed):
    // the default lets it insert, and its expired row is purged.
    sqlx::query(&row("old-writer", 1_600_000))
        .execute(&pool)
        .await
        .unwrap();

    let now = Timestamp::from_millis(2_000_000);
    assert_eq!(repo.purge_expired(now, 100).await.unwrap(), 2);
    let live = RecordKey::new("ns", "live", 256).unwrap();
    assert_eq!(
        repo.get(&live, now)
            .await
            .unwrap()
            .unwrap()
            .result
            .as_deref(),
        Some(&b"done"[..])
    );
    let fresh = RecordKey::new("ns", "fresh", 256).unwrap();
    assert_eq!(
        repo.reserve(request(&fresh)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    drop_schema(&schema).await;
}

/// A process of this version on a table that the migrations left behind (here
/// at version 3, then without the migrations' bookkeeping) reserves nothing — a handler must not run when its
/// completion would then fail on the older schema — on any reservation path,
/// until the table is migrated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_reserved_on_a_table_behind_this_version() {
    let (schema, _) = migrated_in_own_schema("idem_behind").await;
    let pool = admin().await;
    execute_all(&pool, back_to_migration_3(&schema)).await;
    // A process that does not migrate.
    let repo = unmigrated_on(&schema).await;
    let (key, other) = (
        RecordKey::new("ns", "behind", 256).unwrap(),
        RecordKey::new("ns", "behind-too", 256).unwrap(),
    );
    let behind = |result: Result<Reservation, Error>| match result {
        Err(Error::Config { message }) => {
            assert!(message.contains("purge_after"), "{message}");
            assert!(message.contains("migrate"), "{message}");
        }
        other => panic!("reserved on a table behind: {other:?}"),
    };
    behind(repo.reserve(request(&key)).await);
    for answer in repo
        .reserve_many(vec![request(&key), request(&other)])
        .await
    {
        behind(answer);
    }
    let mut tx = repo.pool().begin().await.unwrap();
    behind(repo.in_transaction(&mut tx).reserve(request(&key)).await);
    tx.rollback().await.unwrap();
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".records"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    // Without the migrations' bookkeeping (a table made by hand or by another
    // tool from an older release's SQL): judged by its columns all the same.
    let bookkeeping =
        |from: &str, to: &str| format!("ALTER TABLE \"{schema}\".{from} RENAME TO {to}");
    execute_all(&pool, [bookkeeping("records_migrations", "hidden")]).await;
    behind(unmigrated_on(&schema).await.reserve(request(&key)).await);
    execute_all(&pool, [bookkeeping("hidden", "records_migrations")]).await;

    repo.migrate().await.unwrap();
    assert_eq!(
        repo.reserve(request(&key)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    drop_schema(&schema).await;
}
