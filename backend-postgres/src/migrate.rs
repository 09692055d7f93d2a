//! Embedded migrations, applied under an advisory lock.

use idempotency_core::Error;
use sqlx::{Executor, PgConnection, PgPool, Row};

use crate::error::map_sqlx;
use crate::names::Statements;

/// One embedded migration.
struct Migration {
    version: i32,
    description: &'static str,
    sql: &'static str,
}

/// Every migration, in order. Never edit an applied one: append a new version.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "records table, expires_at index, reserve function",
        sql: include_str!("sql/0001_records.sql"),
    },
    Migration {
        version: 2,
        description: "reserve answers duplicates of live records without a row lock",
        sql: include_str!("sql/0002_read_only_duplicates.sql"),
    },
    Migration {
        version: 3,
        description: "retryable failures, re-sent reserves, fingerprint kept on takeover",
        sql: include_str!("sql/0003_contract_v2.sql"),
    },
    Migration {
        version: 4,
        description: "completions are HOT: purge_after index instead of expires_at; leaner reserve",
        sql: include_str!("sql/0004_hot_completion.sql"),
    },
];

/// The migration that added `purge_after` and its index (in place of the
/// index on `expires_at`).
const PURGE_AFTER: i32 = 4;

/// The indexed column through which purges find the expired rows of a table
/// at version `at` (never later than `expires_at`).
pub(crate) fn purge_column(at: i32) -> &'static str {
    if at >= PURGE_AFTER {
        "purge_after"
    } else {
        "expires_at"
    }
}

/// The advisory lock every `migrate()` of this crate takes (two `int4` keys:
/// "idem" and "pg  " in ASCII). One lock for all schemas and tables: migrations
/// are rare, and serialising them also covers `CREATE SCHEMA` races between
/// tables.
const LOCK_CLASS: i32 = 0x6964_656d;
const LOCK_OBJECT: i32 = 0x7067_2020;

/// The newest migration version this crate knows.
pub(crate) fn latest_version() -> i32 {
    MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0)
}

fn render(sql: &str, names: &Statements) -> String {
    names
        .placeholders()
        .iter()
        .fold(sql.to_owned(), |acc, (placeholder, value)| {
            acc.replace(placeholder, value)
        })
}

/// Applies the pending migrations in one transaction, holding a transaction-level
/// advisory lock so that processes starting together apply them once.
pub(crate) async fn run(pool: &PgPool, names: &Statements) -> Result<(), Error> {
    let map = |e| map_sqlx(e, "migrate", None, &names.qualified);
    let mut tx = pool.begin().await.map_err(map)?;
    apply(&mut tx, names).await?;
    tx.commit().await.map_err(map)
}

async fn apply(conn: &mut PgConnection, names: &Statements) -> Result<(), Error> {
    let map = |e| map_sqlx(e, "migrate", None, &names.qualified);
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(LOCK_CLASS)
        .bind(LOCK_OBJECT)
        .execute(&mut *conn)
        .await
        .map_err(map)?;

    // `CREATE SCHEMA IF NOT EXISTS` needs the CREATE privilege on the database even
    // when the schema exists, so only create a missing one.
    let schema_exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
    )
    .bind(names.schema.as_str())
    .fetch_one(&mut *conn)
    .await
    .map_err(map)?;
    if !schema_exists {
        simple(
            conn,
            format!("CREATE SCHEMA {}", names.quoted_schema()),
            names,
        )
        .await?;
    }

    let migrations_table = &names.migrations;
    simple(
        conn,
        format!(
            "CREATE TABLE IF NOT EXISTS {migrations_table} (\
             version integer PRIMARY KEY, \
             description text NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT now())"
        ),
        names,
    )
    .await?;

    let select = format!("SELECT COALESCE(MAX(version), 0) AS v FROM {migrations_table}");
    let applied: i32 = sqlx::query(&select)
        .persistent(false)
        .fetch_one(&mut *conn)
        .await
        .map_err(map)?
        .try_get("v")
        .map_err(map)?;

    if applied > latest_version() {
        tracing::warn!(
            applied,
            known = latest_version(),
            table = %names.qualified,
            "the idempotency table was migrated by a newer version of idempotency-postgres"
        );
    }
    let insert = format!("INSERT INTO {migrations_table} (version, description) VALUES ($1, $2)");
    for migration in MIGRATIONS.iter().filter(|m| m.version > applied) {
        tracing::info!(version = migration.version, table = %names.qualified, "applying idempotency migration");
        simple(conn, render(migration.sql, names), names).await?;
        sqlx::query(&insert)
            .persistent(false)
            .bind(migration.version)
            .bind(migration.description)
            .execute(&mut *conn)
            .await
            .map_err(map)?;
    }
    Ok(())
}

/// The version the table is at (0: never migrated).
pub(crate) async fn version(pool: &PgPool, names: &Statements) -> Result<i32, Error> {
    let map = |e| map_sqlx(e, "migrate", None, &names.qualified);
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&names.migrations)
        .fetch_one(pool)
        .await
        .map_err(map)?;
    if !exists {
        return Ok(0);
    }
    sqlx::query_scalar(&format!(
        "SELECT COALESCE(MAX(version), 0) FROM {}",
        names.migrations
    ))
    .persistent(false)
    .fetch_one(pool)
    .await
    .map_err(map)
}

/// The columns this version's statements write that earlier migrations did
/// not create (migration 3's `retryable`, migration 4's `purge_after`).
pub(crate) const NEWER_COLUMNS: [&str; 2] = ["retryable", "purge_after"];

/// Which of [`NEWER_COLUMNS`] the table lacks, on `conn`; `None` when the
/// table does not exist (its statements then report that, naming
/// `migrate()`). Reads only the catalogs, which every role may.
pub(crate) async fn missing_columns(
    conn: &mut PgConnection,
    names: &Statements,
) -> Result<Option<Vec<String>>, Error> {
    let (exists, missing): (bool, Vec<String>) = sqlx::query_as(
        "SELECT c.oid IS NOT NULL, ARRAY(SELECT n FROM unnest($2::text[]) n \
         WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a \
             WHERE a.attrelid = c.oid AND a.attname = n AND NOT a.attisdropped)) \
         FROM (SELECT to_regclass($1)::oid AS oid) c",
    )
    .bind(&names.qualified)
    .bind(&NEWER_COLUMNS[..])
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx(e, "reserve", None, &names.qualified))?;
    Ok(exists.then_some(missing))
}

/// Whether this crate may start work on a table lacking `missing` columns:
/// not when it lacks any, where a reservation could succeed and the completion
/// after the handler fail on a column the table does not have (the handler
/// would run again once the lease ended). The columns are checked, not the
/// recorded version, so a table made by hand or by another migration tool is
/// judged alike; a table migrated by a newer version has them all.
pub(crate) fn require_columns(missing: &[String], names: &Statements) -> Result<(), Error> {
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::config(format!(
        "the idempotency table {} lacks the column(s) {} that this version of \
         idempotency-postgres writes: run its migrations first (PgRepository::migrate(), \
         `idempotency migrate`, or connect without migrate=false); nothing was reserved",
        names.qualified,
        missing.join(", ")
    )))
}

/// The migrations the table has not had yet, described (`version N: …`).
pub(crate) async fn pending(pool: &PgPool, names: &Statements) -> Result<Vec<String>, Error> {
    let at = version(pool, names).await?;
    Ok(MIGRATIONS
        .iter()
        .filter(|m| m.version > at)
        .map(|m| format!("version {}: {}", m.version, m.description))
        .collect())
}

/// Runs `sql` (possibly several statements) with the simple query protocol.
async fn simple(conn: &mut PgConnection, sql: String, names: &Statements) -> Result<(), Error> {
    conn.execute(sql.as_str())
        .await
        .map(drop)
        .map_err(|e| map_sqlx(e, "migrate", None, &names.qualified))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_starts_only_on_a_table_with_every_column() {
        let names = Statements::new("s", "t").unwrap();
        assert!(require_columns(&[], &names).is_ok());
        let err = require_columns(&["purge_after".to_owned()], &names).unwrap_err();
        assert!(
            matches!(&err, Error::Config { message }
                if message.contains("\"s\".\"t\"") && message.contains("purge_after")),
            "{err:?}"
        );
    }

    #[test]
    fn every_newer_column_is_created_by_a_migration() {
        let names = Statements::new("s", "t").unwrap();
        for column in NEWER_COLUMNS {
            let added = format!("ADD COLUMN IF NOT EXISTS {column} ");
            assert!(
                MIGRATIONS
                    .iter()
                    .any(|m| render(m.sql, &names).contains(&added)),
                "{column}"
            );
        }
    }

    #[test]
    fn renders_every_placeholder() {
        let names = Statements::new("s", "t").unwrap();
        for m in MIGRATIONS {
            let sql = render(m.sql, &names);
            for (placeholder, _) in names.placeholders() {
                assert!(
                    !sql.contains(placeholder),
                    "{placeholder} left in migration {}",
                    m.version
                );
            }
            assert!(sql.contains("\"s\".\"t\""));
            assert!(sql.contains("\"s\".\"t_reserve\""));
        }
        // An index is named in its table's schema, never found on the search
        // path (where another schema's table of the same name may have one).
        let hot = MIGRATIONS
            .iter()
            .find(|m| m.version == 4)
            .map(|m| render(m.sql, &names));
        assert!(
            hot.is_some_and(|sql| sql.contains("DROP INDEX IF EXISTS \"s\".\"t_expires_at_idx\""))
        );
        let versions: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
        assert!(versions.windows(2).all(|w| w[0] < w[1]));
    }
}
