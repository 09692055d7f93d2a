//! Shared helpers of the integration tests. The server comes from the harness
//! of `idempotency-conformance` (a container, or `IDEMPOTENCY_TEST_POSTGRES_URL`);
//! without one the tests fail with the harness's instructions.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idempotency_postgres::{PgRepository, PgRepositoryBuilder, ReservePlan};

/// The URL of the PostgreSQL server under test.
pub(crate) async fn server_url() -> String {
    match idempotency_conformance::containers::postgres().await {
        Ok(server) => server.url().to_owned(),
        Err(e) => panic!("no PostgreSQL server for the tests: {e}"),
    }
}

/// A random suffix for tables and databases.
pub(crate) fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

/// A migrated repository on a fresh small pool, on `table`.
pub(crate) async fn repository(table: &str) -> PgRepository {
    repository_with(table, ReservePlan::default()).await
}

/// [`repository`] with the given reserve plan.
pub(crate) async fn repository_with(table: &str, plan: ReservePlan) -> PgRepository {
    build(PgRepository::builder().table(table).reserve_plan(plan)).await
}

/// [`repository`] with `plan`, every single reservation and completion
/// through the statements over arrays that coalesced calls share.
pub(crate) async fn repository_over_arrays(table: &str, plan: ReservePlan) -> PgRepository {
    let builder = PgRepository::builder().table(table).reserve_plan(plan);
    build(builder.single_calls_over_arrays()).await
}

/// [`repository`] without coalescing: each call on a connection of its own,
/// for tests of how connections are kept.
pub(crate) async fn repository_not_coalescing(table: &str) -> PgRepository {
    build(PgRepository::builder().table(table).coalesce_above(0)).await
}

/// A migrated repository from `builder` (its table and settings) on a
/// fresh small pool.
pub(crate) async fn repository_from(builder: PgRepositoryBuilder) -> PgRepository {
    build(builder).await
}

/// Connects `builder` on a fresh small pool and migrates.
async fn build(builder: PgRepositoryBuilder) -> PgRepository {
    let repo = builder
        .max_connections(5)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&server_url().await)
        .await
        .expect("connect to the test server");
    repo.migrate().await.expect("migrate");
    repo
}

/// Drops a table a test made for itself (in the default schema), with its
/// bookkeeping table and reservation function.
pub(crate) async fn drop_table(repo: &PgRepository, table: &str) {
    let _ = sqlx::raw_sql(&format!(
        "DROP TABLE IF EXISTS \"{table}\"; DROP TABLE IF EXISTS \"{table}_migrations\"; \
         DROP FUNCTION IF EXISTS \"{table}_reserve\""
    ))
    .execute(repo.pool())
    .await;
}

/// A connection to the server under test for the test's own statements, and
/// a database created for the test on it: its name and URL.
pub(crate) async fn fresh_database(prefix: &str) -> (sqlx::PgPool, String, String) {
    let url = server_url().await;
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let db = unique(prefix);
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&admin)
        .await
        .unwrap();
    let mut db_url = url::Url::parse(&url).unwrap();
    db_url.set_path(&format!("/{db}"));
    (admin, db, db_url.to_string())
}
