//! Shared helpers of the integration tests. The server comes from the harness
//! of `idempotency-conformance` (a MariaDB container, or
//! `IDEMPOTENCY_TEST_MARIADB_URL`); without one the tests fail with the
//! harness's instructions.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use idempotency_mysql::MySqlRepository;

/// The server under test.
pub(crate) async fn server() -> idempotency_conformance::containers::MariaDbServer {
    match idempotency_conformance::containers::mariadb().await {
        Ok(server) => server,
        Err(e) => panic!("no MariaDB server for the tests: {e}"),
    }
}

/// The URL of the server under test.
pub(crate) async fn server_url() -> String {
    server().await.url().to_owned()
}

/// A random table name of this test.
pub(crate) fn unique_table(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

/// A migrated repository on `table`, with query `options` added to the URL.
pub(crate) async fn repository(table: &str, options: &str) -> MySqlRepository {
    let url = server()
        .await
        .url_with(&format!("table={table}&max_connections=8{options}"));
    MySqlRepository::connect(&url)
        .await
        .expect("connect to the test server")
}
