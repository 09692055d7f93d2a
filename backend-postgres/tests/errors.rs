//! PostgreSQL's error table: each misconfiguration or failure, against the
//! harness's server, comes back as the error variant (and so the retry class)
//! the guide's table says, with a message naming what to fix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use idempotency_conformance::containers::FaultProxy;
use idempotency_conformance::error_table::{
    assert_error_table, closed_port, foreign_service, reserve_once, url_with, ErrorRow, Expected,
};
use idempotency_core::Error;
use idempotency_postgres::PgRepository;

/// The rows a URL alone decides.
async fn connection_rows(server: &str) -> Vec<ErrorRow> {
    let mut rows = vec![
        ErrorRow::new(
            "unknown URL option (`?tabel=idem`)",
            idempotency_postgres::connect(&url_with::query(server, "tabel=idem")).await,
            Expected::Config,
            &["tabel"],
        ),
        ErrorRow::new(
            "zero timeout (`?operation_timeout=0s`)",
            idempotency_postgres::connect(&url_with::query(server, "operation_timeout=0s")).await,
            Expected::Config,
            &["operation_timeout"],
        ),
        wrong_password_row(server).await,
        ErrorRow::new(
            "startup setting the server does not know (`?options[no_such_setting]=1`)",
            idempotency_postgres::connect(&url_with::query(server, "options[no_such_setting]=1"))
                .await,
            Expected::Config,
            &["no_such_setting", "options"],
        ),
        ErrorRow::new(
            "startup setting with a value the server refuses (`?options[statement_timeout]=soon`)",
            idempotency_postgres::connect(&url_with::query(
                server,
                "options[statement_timeout]=soon",
            ))
            .await,
            Expected::Config,
            &["statement_timeout", "options"],
        ),
        ErrorRow::new(
            "database that does not exist",
            idempotency_postgres::connect(&url_with::path(server, "no_such_db")).await,
            Expected::Config,
            &["database", "does not exist"],
        ),
    ];
    if !cfg!(feature = "tls") {
        rows.push(ErrorRow::new(
            "`sslmode=require` without the `tls` feature",
            idempotency_postgres::connect(&url_with::query(server, "sslmode=require")).await,
            Expected::Config,
            &["sslmode=require", "`tls`"],
        ));
    } else {
        // The harness's server has no TLS (and, were it given one, its
        // certificate would not be signed by a root this client trusts):
        // either way no retry helps. (A server given by
        // IDEMPOTENCY_TEST_POSTGRES_URL with a publicly trusted certificate
        // would connect, and fail this row.)
        rows.push(ErrorRow::new(
            "`sslmode=verify-full` against a server without a trusted TLS certificate",
            idempotency_postgres::connect(&url_with::query(server, "sslmode=verify-full")).await,
            Expected::Config,
            &["TLS"],
        ));
    }
    rows
}

/// A wrong password is a configuration error. A server that accepts it does
/// not check passwords (`trust` in its `pg_hba.conf`, as a server given by
/// `IDEMPOTENCY_TEST_POSTGRES_URL` may be): the row still fails, and says so.
async fn wrong_password_row(server: &str) -> ErrorRow {
    let got = idempotency_postgres::connect(&url_with::password(server, "not-the-password")).await;
    let cause = if got.is_ok() {
        "wrong password (accepted: this server does not check passwords, e.g. `trust` in \
         pg_hba.conf; the row needs one that does, as the harness's container)"
    } else {
        "wrong password"
    };
    ErrorRow::new(cause, got, Expected::Config, &["password"])
}

/// A closed port is refused at once, not after the acquire timeout.
async fn refused_row(server: &str) -> ErrorRow {
    let mut url = url::Url::parse(server).unwrap();
    url.set_port(Some(closed_port())).unwrap();
    let started = Instant::now();
    let got =
        idempotency_postgres::connect(&url_with::query(url.as_str(), "acquire_timeout=60s")).await;
    let waited = started.elapsed();
    let cause = if waited < Duration::from_secs(30) {
        "closed port".to_owned()
    } else {
        format!("closed port (waited {waited:?}: the acquire timeout, not the refusal)")
    };
    ErrorRow::new(cause, got, Expected::Unavailable, &["refused"])
}

/// Another service (HTTP) at the URL's port.
async fn foreign_row(server: &str) -> ErrorRow {
    let mut url = url::Url::parse(server).unwrap();
    url.set_port(Some(foreign_service().await.unwrap()))
        .unwrap();
    ErrorRow::new(
        "another service at that port",
        idempotency_postgres::connect(url.as_str()).await,
        Expected::Unavailable,
        &["connect"],
    )
}

/// A table that was never migrated.
async fn unmigrated_row(server: &str) -> ErrorRow {
    let table = common::unique("never_migrated");
    let repo = idempotency_postgres::connect(&url_with::query(
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

/// A table an older version migrated (here back at migration 3's shape):
/// refused before the first reservation, nothing reserved.
async fn outdated_row(server: &str) -> ErrorRow {
    let table = common::unique("outdated");
    let admin = common::repository(&table).await;
    let shape_of_3 = format!(
        "DELETE FROM \"{table}_migrations\" WHERE version >= 4; \
         ALTER TABLE \"{table}\" DROP COLUMN purge_after"
    );
    sqlx::raw_sql(&shape_of_3)
        .execute(admin.pool())
        .await
        .unwrap();
    let repo = idempotency_postgres::connect(&url_with::query(
        server,
        &format!("table={table}&migrate=false"),
    ))
    .await
    .unwrap();
    let answer = reserve_once(&repo, "x").await;
    common::drop_table(&admin, &table).await;
    ErrorRow::new(
        "table an older version migrated (`migrate=false`)",
        answer,
        Expected::Config,
        &[&table, "purge_after", "migrate()"],
    )
}

/// A role without the privilege to create the schema.
async fn privilege_row(server: &str) -> ErrorRow {
    let admin = common::repository(&common::unique("errors_admin")).await;
    let role = common::unique("errors_role");
    sqlx::query(&format!("CREATE ROLE {role} LOGIN PASSWORD 'pw'"))
        .execute(admin.pool())
        .await
        .unwrap();
    let mut url = url::Url::parse(server).unwrap();
    url.set_username(&role).unwrap();
    url.set_password(Some("pw")).unwrap();
    let schema = common::unique("errors_schema");
    let repo = PgRepository::builder()
        .schema(&schema)
        .connect(url.as_str())
        .await
        .unwrap();
    let got = repo.migrate().await;
    repo.pool().close().await;
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(admin.pool())
        .await
        .unwrap();
    ErrorRow::new(
        "role without the privilege to migrate",
        got,
        Expected::Config,
        &["privilege"],
    )
}

/// A server that stops answering: each call fails after the default operation
/// timeout, however long the outage lasts.
async fn black_hole_row(server: &str) -> ErrorRow {
    let proxy = FaultProxy::start(server).await.expect("a fault proxy");
    let repo = idempotency_postgres::connect(&url_with::query(
        proxy.url(),
        &format!("table={}&migrate=true", common::unique("black_hole")),
    ))
    .await
    .unwrap();
    reserve_once(&repo, "warm").await.unwrap();
    proxy.cut();
    let started = Instant::now();
    let got = reserve_once(&repo, "cut").await;
    let waited = started.elapsed();
    proxy.heal();
    let bound = idempotency_postgres::DEFAULT_OPERATION_TIMEOUT + Duration::from_secs(5);
    let cause = if waited <= bound {
        "server stops answering (default operation timeout)".to_owned()
    } else {
        format!("server stops answering: the call waited {waited:?}, over {bound:?}")
    };
    ErrorRow::new(cause, got, Expected::Timeout, &["postgres"])
}

#[tokio::test]
async fn every_cause_has_its_error_and_message() {
    let server = common::server_url().await;
    let mut rows = connection_rows(&server).await;
    rows.push(refused_row(&server).await);
    rows.push(foreign_row(&server).await);
    rows.push(unmigrated_row(&server).await);
    rows.push(outdated_row(&server).await);
    rows.push(privilege_row(&server).await);
    rows.push(black_hole_row(&server).await);
    assert_error_table("postgres", &rows);
}

#[tokio::test]
async fn builders_refuse_zero_timeouts() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://h/db")
        .unwrap();
    for builder in [
        PgRepository::builder().operation_timeout(Duration::ZERO),
        PgRepository::builder().acquire_timeout(Duration::ZERO),
    ] {
        match builder.build_with_pool(pool.clone()) {
            Err(Error::Config { message }) => assert!(message.contains("timeout"), "{message}"),
            other => panic!("{other:?}"),
        }
    }
}

/// A server that ends idle sessions (`idle_session_timeout`, PostgreSQL 14+)
/// closes connections the repository holds or pools with `FATAL 57P05`.
/// - With a timeout under a second, a connection used within that second can
///   be ended: the operation that reads the `57P05` gets a retryable outage
///   (the statement never ran), never a definite `Backend` error, which would
///   end a completion as unrecorded; and the pool recovers within a few
///   operations.
/// - With a longer one, a connection idle that long is pinged before it is
///   handed out and replaced: no operation fails at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_the_server_ended_while_idle_is_retryable() {
    for (timeout, ends_quietly) in [("300ms", false), ("1500ms", true)] {
        let (admin, db, db_url) = common::fresh_database("idem_idle").await;
        sqlx::query(&format!(
            "ALTER DATABASE {db} SET idle_session_timeout = '{timeout}'"
        ))
        .execute(&admin)
        .await
        .unwrap();
        let repo = PgRepository::builder()
            .max_connections(2)
            .connect(&db_url)
            .await
            .unwrap();
        repo.migrate().await.unwrap();
        reserve_once(&repo, "warm").await.unwrap();
        sessions_ended(&admin, &db).await;
        let mut failed = 0;
        loop {
            match reserve_once(&repo, &format!("after-{failed}")).await {
                Ok(()) => break,
                Err(e) => assert!(e.is_retryable(), "{timeout}: {e:?}"),
            }
            failed += 1;
            assert!(failed <= 3, "{timeout}: the pool does not recover");
        }
        if ends_quietly {
            assert_eq!(failed, 0, "{timeout}: an idle connection is pinged first");
        }
        repo.pool().close().await;
        let _ = sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .execute(&admin)
            .await;
    }
}

/// Waits until the server ended every session of `db` (polled, bounded).
async fn sessions_ended(admin: &sqlx::PgPool, db: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (left,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM pg_stat_activity WHERE datname = $1")
                .bind(db)
                .fetch_one(admin)
                .await
                .unwrap();
        if left == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "sessions of {db} still open");
        // A real wait: the server's own idle timer ends the sessions, which
        // no test clock can drive; polled, bounded by the deadline above.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
