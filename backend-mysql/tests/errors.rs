//! MySQL's error table: each misconfiguration or failure, against the
//! harness's MariaDB, comes back as the error variant (and so the retry class)
//! the guide's table says, with a message naming what to fix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use idempotency_conformance::containers::FaultProxy;
use idempotency_conformance::error_table::{
    assert_error_table, closed_port, foreign_service, reserve_once, url_with, ErrorRow, Expected,
};
use idempotency_mysql::{sqlx, MySqlRepository};

/// The rows a URL alone decides.
async fn connection_rows(server: &str) -> Vec<ErrorRow> {
    let mut rows = vec![
        ErrorRow::new(
            "unknown URL option (`?tabel=idem`)",
            idempotency_mysql::connect(&url_with::query(server, "tabel=idem")).await,
            Expected::Config,
            &["tabel"],
        ),
        ErrorRow::new(
            "zero timeout (`?operation_timeout=0s`)",
            idempotency_mysql::connect(&url_with::query(server, "operation_timeout=0s")).await,
            Expected::Config,
            &["operation_timeout"],
        ),
        ErrorRow::new(
            "wrong password",
            idempotency_mysql::connect(&url_with::password(server, "not-the-password")).await,
            Expected::Config,
            &["password"],
        ),
        ErrorRow::new(
            "database that does not exist",
            idempotency_mysql::connect(&url_with::path(server, "no_such_db")).await,
            Expected::Config,
            &["database", "does not exist"],
        ),
        ErrorRow::new(
            "table name that is not an identifier",
            idempotency_mysql::connect(&url_with::query(server, "table=x%60%3B%20DROP")).await,
            Expected::Config,
            &["table name"],
        ),
    ];
    if !cfg!(feature = "tls") {
        rows.push(ErrorRow::new(
            "`ssl-mode=required` without the `tls` feature",
            idempotency_mysql::connect(&url_with::query(server, "ssl-mode=required")).await,
            Expected::Config,
            &["ssl-mode=required", "`tls`"],
        ));
    } else {
        // The harness's server has no TLS, or (MariaDB 11.4 and later) one
        // with a certificate it signed itself, which this client does not
        // trust: either way no retry helps.
        rows.push(ErrorRow::new(
            "`ssl-mode=verify_ca` against a server without a trusted TLS certificate",
            idempotency_mysql::connect(&url_with::query(server, "ssl-mode=verify_ca")).await,
            Expected::Config,
            &["TLS"],
        ));
    }
    rows
}

/// A closed port is refused at once, not after the acquire timeout.
async fn refused_row(server: &str) -> ErrorRow {
    let url = url_with::query(
        &url_with::port(server, closed_port()),
        "acquire_timeout=60s",
    );
    let started = Instant::now();
    let got = idempotency_mysql::connect(&url).await;
    let waited = started.elapsed();
    let cause = if waited < Duration::from_secs(30) {
        "closed port".to_owned()
    } else {
        format!("closed port (waited {waited:?}: the acquire timeout, not the refusal)")
    };
    ErrorRow::new(cause, got, Expected::Unavailable, &["refused"])
}

/// Another service (HTTP, which waits for the client to speak first, while a
/// MySQL client waits for the server's greeting) at the URL's port.
async fn foreign_row(server: &str) -> ErrorRow {
    let url = url_with::query(
        &url_with::port(server, foreign_service().await.unwrap()),
        "acquire_timeout=1s",
    );
    ErrorRow::new(
        "another service at that port",
        idempotency_mysql::connect(&url).await,
        Expected::Unavailable,
        &["connect"],
    )
}

/// A table that was never migrated.
async fn unmigrated_row(server: &str) -> ErrorRow {
    let table = common::unique_table("never_migrated");
    let repo = idempotency_mysql::connect(&url_with::query(
        server,
        &format!("table={table}&migrate=false"),
    ))
    .await
    .unwrap();
    ErrorRow::new(
        "table never migrated (`migrate=false`)",
        reserve_once(&repo, "x").await,
        Expected::Config,
        &[&table, "migrate()"],
    )
}

/// A user who may read and write rows but not create tables (nor bypass
/// `read_only`): its name, and `server` as that user.
async fn create_writer(admin: &MySqlRepository, server: &str) -> (String, String) {
    let user = common::unique_table("errors_writer");
    for statement in [
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON *.* TO '{user}'@'%'"),
    ] {
        sqlx::query(&statement).execute(admin.pool()).await.unwrap();
    }
    let mut url = url::Url::parse(server).unwrap();
    url.set_username(&user).unwrap();
    url.set_password(Some("pw")).unwrap();
    (user, url.into())
}

/// Runs `statements` as plain text (no prepared statement: one of them may
/// lift a limit on those).
async fn run_all(admin: &MySqlRepository, statements: &[String]) {
    for statement in statements {
        sqlx::raw_sql(statement)
            .execute(admin.pool())
            .await
            .unwrap();
    }
}

/// A user who may read and write but not create tables.
async fn privilege_row(server: &str) -> ErrorRow {
    let admin = common::repository("idem_errors_admin", "").await;
    let (user, url) = create_writer(&admin, server).await;
    let table = common::unique_table("errors_table");
    let got = idempotency_mysql::connect(&url_with::query(&url, &format!("table={table}"))).await;
    run_all(&admin, &[format!("DROP USER '{user}'@'%'")]).await;
    ErrorRow::new(
        "user without the privilege to migrate",
        got,
        Expected::Config,
        &["privilege"],
    )
}

/// A server that refuses writes (`read_only`, as a replica or a primary
/// demoted in a failover), to a user without `SUPER` (which `read_only`
/// exempts). This test binary has the server to itself, and this is its only
/// test, so the global setting disturbs no other test.
async fn read_only_row(server: &str) -> ErrorRow {
    let table = common::unique_table("read_only");
    let admin = common::repository(&table, "").await;
    let (user, url) = create_writer(&admin, server).await;
    let writer = idempotency_mysql::connect(&url_with::query(
        &url,
        &format!("table={table}&migrate=false"),
    ))
    .await
    .unwrap();
    run_all(&admin, &["SET GLOBAL read_only = ON".to_owned()]).await;
    let got = reserve_once(&writer, "refused").await;
    run_all(
        &admin,
        &[
            "SET GLOBAL read_only = OFF".to_owned(),
            format!("DROP USER '{user}'@'%'"),
        ],
    )
    .await;
    ErrorRow::new(
        "server refuses writes (`read_only`)",
        got,
        Expected::Unavailable,
        &["read-only"],
    )
}

/// A server out of a resource for now — here prepared statements, at its
/// `max_prepared_stmt_count` — refuses the statement without running it: a
/// retryable outage (a completion refused that way is retried, not given up),
/// whatever the resource (disk, memory, locks).
async fn out_of_statements_row(server: &str) -> ErrorRow {
    let table = common::unique_table("out_of_statements");
    let admin = common::repository(&table, "").await;
    let limit: (String, String) =
        sqlx::query_as("SHOW GLOBAL VARIABLES LIKE 'max_prepared_stmt_count'")
            .fetch_one(admin.pool())
            .await
            .unwrap();
    run_all(
        &admin,
        &["SET GLOBAL max_prepared_stmt_count = 0".to_owned()],
    )
    .await;
    // A repository of its own: its connections have prepared nothing yet.
    let fresh = idempotency_mysql::connect(&url_with::query(
        server,
        &format!("table={table}&migrate=false"),
    ))
    .await;
    let got = match fresh {
        Ok(repo) => reserve_once(&repo, "refused").await,
        Err(e) => Err(e),
    };
    run_all(
        &admin,
        &[format!("SET GLOBAL max_prepared_stmt_count = {}", limit.1)],
    )
    .await;
    ErrorRow::new(
        "server out of a resource (`max_prepared_stmt_count` reached)",
        got,
        Expected::Unavailable,
        &["max_prepared_stmt_count"],
    )
}

/// A user at its `max_user_connections`: the server refuses another
/// connection for now (it frees when one closes), a retryable outage.
async fn user_connection_limit_row(server: &str) -> ErrorRow {
    let admin = common::repository("idem_errors_admin", "").await;
    let (user, url) = create_writer(&admin, server).await;
    run_all(
        &admin,
        &[format!(
            "ALTER USER '{user}'@'%' WITH MAX_USER_CONNECTIONS 1"
        )],
    )
    .await;
    let held = <sqlx::MySqlConnection as sqlx::Connection>::connect(&url)
        .await
        .unwrap();
    let table = common::unique_table("errors_limit");
    let got = idempotency_mysql::connect(&url_with::query(
        &url,
        &format!("table={table}&migrate=false"),
    ))
    .await;
    drop(held);
    run_all(&admin, &[format!("DROP USER '{user}'@'%'")]).await;
    ErrorRow::new(
        "user at its `max_user_connections`",
        got,
        Expected::Unavailable,
        &["max_user_connections"],
    )
}

/// A server that stops answering: each call fails after the default operation
/// timeout, however long the outage lasts.
async fn black_hole_row(server: &str) -> ErrorRow {
    let proxy = FaultProxy::start(server).await.expect("a fault proxy");
    let repo = idempotency_mysql::connect(&url_with::query(
        proxy.url(),
        &format!("table={}", common::unique_table("black_hole")),
    ))
    .await
    .unwrap();
    reserve_once(&repo, "warm").await.unwrap();
    proxy.cut();
    let started = Instant::now();
    let got = reserve_once(&repo, "cut").await;
    let waited = started.elapsed();
    proxy.heal();
    let bound = idempotency_mysql::DEFAULT_OPERATION_TIMEOUT + Duration::from_secs(5);
    let cause = if waited <= bound {
        "server stops answering (default operation timeout)".to_owned()
    } else {
        format!("server stops answering: the call waited {waited:?}, over {bound:?}")
    };
    ErrorRow::new(cause, got, Expected::Timeout, &["mysql"])
}

#[tokio::test]
async fn every_cause_has_its_error_and_message() {
    let server = common::server_url().await;
    let mut rows = connection_rows(&server).await;
    rows.push(refused_row(&server).await);
    rows.push(foreign_row(&server).await);
    rows.push(unmigrated_row(&server).await);
    rows.push(privilege_row(&server).await);
    rows.push(user_connection_limit_row(&server).await);
    rows.push(read_only_row(&server).await);
    rows.push(out_of_statements_row(&server).await);
    rows.push(black_hole_row(&server).await);
    assert_error_table("mysql", &rows);
}
