//! MySQL's error table: each misconfiguration or failure, against the
//! harness's MariaDB, comes back as the error variant (and so the retry class)
//! the guide's table says, with a message naming what to fix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use idempotency_conformance::containers::FaultProxy;
use idempotency_conformance::error_table::{
    assert_error_table, foreign_service, ErrorRow, Expected,
};
use idempotency_core::{
    Clock, Error, OwnerToken, RecordKey, Repository, ReserveRequest, SystemClock,
};
use idempotency_mysql::{sqlx, MySqlRepository};

fn with_password(url: &str, password: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_password(Some(password)).unwrap();
    url.into()
}

fn with_database(url: &str, database: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_path(database);
    url.into()
}

fn with_query(url: &str, query: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{query}")
}

fn with_port(url: &str, port: u16) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_port(Some(port)).unwrap();
    url.into()
}

fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

async fn reserve(repo: &MySqlRepository, id: &str) -> Result<(), Error> {
    let key = RecordKey::new("errors", id, 1024).unwrap();
    let now = SystemClock.now();
    repo.reserve(ReserveRequest {
        key: &key,
        owner: OwnerToken::random(),
        fingerprint: None,
        now,
        lease_until: now + Duration::from_secs(60),
        expires_at: now + Duration::from_secs(120),
        retry_failed: false,
        clock_skew: Duration::ZERO,
    })
    .await
    .map(drop)
}

/// The rows a URL alone decides.
async fn connection_rows(server: &str) -> Vec<ErrorRow> {
    let mut rows = vec![
        ErrorRow::new(
            "unknown URL option (`?tabel=idem`)",
            idempotency_mysql::connect(&with_query(server, "tabel=idem")).await,
            Expected::Config,
            &["tabel"],
        ),
        ErrorRow::new(
            "zero timeout (`?operation_timeout=0s`)",
            idempotency_mysql::connect(&with_query(server, "operation_timeout=0s")).await,
            Expected::Config,
            &["operation_timeout"],
        ),
        ErrorRow::new(
            "wrong password",
            idempotency_mysql::connect(&with_password(server, "not-the-password")).await,
            Expected::Config,
            &["password"],
        ),
        ErrorRow::new(
            "database that does not exist",
            idempotency_mysql::connect(&with_database(server, "no_such_db")).await,
            Expected::Config,
            &["database", "does not exist"],
        ),
        ErrorRow::new(
            "table name that is not an identifier",
            idempotency_mysql::connect(&with_query(server, "table=x%60%3B%20DROP")).await,
            Expected::Config,
            &["table name"],
        ),
    ];
    if !cfg!(feature = "tls") {
        rows.push(ErrorRow::new(
            "`ssl-mode=required` without the `tls` feature",
            idempotency_mysql::connect(&with_query(server, "ssl-mode=required")).await,
            Expected::Config,
            &["ssl-mode=required", "`tls`"],
        ));
    }
    rows
}

/// A closed port is refused at once, not after the acquire timeout.
async fn refused_row(server: &str) -> ErrorRow {
    let url = with_query(&with_port(server, closed_port()), "acquire_timeout=60s");
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
    let url = with_query(
        &with_port(server, foreign_service().await.unwrap()),
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
    let repo =
        idempotency_mysql::connect(&with_query(server, &format!("table={table}&migrate=false")))
            .await
            .unwrap();
    ErrorRow::new(
        "table never migrated (`migrate=false`)",
        reserve(&repo, "x").await,
        Expected::Config,
        &[&table, "migrate()"],
    )
}

/// A user who may read and write but not create tables.
async fn privilege_row(server: &str) -> ErrorRow {
    let admin = common::repository("idem_errors_admin", "").await;
    let user = common::unique_table("errors_user");
    for statement in [
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON *.* TO '{user}'@'%'"),
    ] {
        sqlx::query(&statement).execute(admin.pool()).await.unwrap();
    }
    let mut url = url::Url::parse(server).unwrap();
    url.set_username(&user).unwrap();
    url.set_password(Some("pw")).unwrap();
    let table = common::unique_table("errors_table");
    let got =
        idempotency_mysql::connect(&with_query(url.as_str(), &format!("table={table}"))).await;
    sqlx::query(&format!("DROP USER '{user}'@'%'"))
        .execute(admin.pool())
        .await
        .unwrap();
    ErrorRow::new(
        "user without the privilege to migrate",
        got,
        Expected::Config,
        &["privilege"],
    )
}

/// A server that stops answering: each call fails after the default operation
/// timeout, however long the outage lasts.
async fn black_hole_row(server: &str) -> ErrorRow {
    let proxy = FaultProxy::start(server).await.expect("a fault proxy");
    let repo = idempotency_mysql::connect(&with_query(
        proxy.url(),
        &format!("table={}", common::unique_table("black_hole")),
    ))
    .await
    .unwrap();
    reserve(&repo, "warm").await.unwrap();
    proxy.cut();
    let started = Instant::now();
    let got = reserve(&repo, "cut").await;
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
    rows.push(black_hole_row(&server).await);
    assert_error_table("mysql", &rows);
}
