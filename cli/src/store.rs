//! Connecting as the command needs, and hints that name this tool's
//! commands.
//!
//! The tool never changes a store by connecting: SQL stores are connected
//! with `migrate=false` (`migrate` migrates through the admin operations),
//! and a SQLite file is never created except by `migrate`: a read-only
//! command opens it with `mode=ro`, and any other command first checks that
//! it exists.

use std::path::PathBuf;

use idempotency::{redact_url, StoreKind};

use crate::exit::Failure;

/// What a command does to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Reads or checks only (`get`, `list`, `stats`, `doctor`).
    Read,
    /// Changes records (`evict`, `purge`).
    Write,
    /// Creates what the store needs (`migrate`).
    Migrate,
}

/// The URL to connect to `url` with, for a command of `access`.
///
/// # Errors
/// A permanent failure when the URL names a SQLite file that does not exist
/// and the command is not `migrate`.
pub(crate) fn connect_url(url: &str, access: Access) -> Result<String, Failure> {
    let kind = StoreKind::from_url(url).ok();
    let mut url = url.to_owned();
    if matches!(
        kind,
        Some(StoreKind::Sqlite | StoreKind::Postgres | StoreKind::MySql)
    ) && !has_option(&url, "migrate")
    {
        url = with_option(&url, "migrate=false");
    }
    if kind != Some(StoreKind::Sqlite) || access == Access::Migrate {
        return Ok(url);
    }
    if let Some(file) = sqlite_file(&url) {
        if !file.exists() {
            return Err(Failure::permanent(format!(
                "no SQLite database at {} (nothing was created): check the path, or create \
                 the database with {}",
                file.display(),
                command(&url_without(&url, "migrate"), "migrate")
            )));
        }
    }
    if access == Access::Read && !has_option(&url, "mode") {
        url = with_option(&url, "mode=ro");
    }
    Ok(url)
}

/// A failure to connect, explained for the command: a SQLite file opened
/// read-only that is not in WAL mode (every database the library migrated
/// is) cannot be read without changing it, so it was never set up.
pub(crate) fn connect_failure(url: &str, access: Access, failure: Failure) -> Failure {
    let read_only_sqlite = access == Access::Read
        && StoreKind::from_url(url).ok() == Some(StoreKind::Sqlite)
        && failure.message.contains("read-only");
    match (read_only_sqlite, sqlite_file(url)) {
        (true, Some(file)) => Failure::permanent(format!(
            "cannot read the SQLite database at {} without changing it: it is not in WAL mode,              as every database idempotency migrated is, so it was never set up for              idempotency (or another program created it). Set it up with {}",
            file.display(),
            command(url, "migrate")
        )),
        _ => failure,
    }
}

/// The file a `sqlite:` URL names; `None` for an in-memory database.
fn sqlite_file(url: &str) -> Option<PathBuf> {
    let rest = url.strip_prefix("sqlite:")?;
    let path = rest.split('?').next().unwrap_or(rest);
    let path = path.strip_prefix("//").unwrap_or(path);
    let memory = path.is_empty() || path == ":memory:" || option(url, "mode") == Some("memory");
    (!memory).then(|| PathBuf::from(path))
}

fn query(url: &str) -> &str {
    url.split_once('?').map_or("", |(_, q)| q)
}

fn option<'a>(url: &'a str, name: &str) -> Option<&'a str> {
    query(url)
        .rsplit('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

fn has_option(url: &str, name: &str) -> bool {
    option(url, name).is_some()
}

fn with_option(url: &str, pair: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{pair}")
}

/// `url` without the option `name` (the tool's own `migrate=false`).
fn url_without(url: &str, name: &str) -> String {
    let Some((head, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| pair.split('=').next() != Some(name))
        .collect();
    if kept.is_empty() {
        head.to_owned()
    } else {
        format!("{head}?{}", kept.join("&"))
    }
}

/// The tool's command `args` against `url`, to paste: with the URL when it
/// carries no secret, else with a pointer to the URL the user gave.
pub(crate) fn command(url: &str, args: &str) -> String {
    if redact_url(url) == url {
        format!("`idempotency --url '{url}' {args}`")
    } else {
        format!("`idempotency {args}` (with the same --url or IDEMPOTENCY_STORE_URL)")
    }
}

/// `message` with every hint that names a Rust API (the library's errors
/// and checks are written for applications) replaced by this tool's command.
pub(crate) fn tool_hints(message: &str, url: &str) -> String {
    let migrate = command(url, "migrate");
    let purge = command(url, "purge");
    let file = sqlite_file(url).map_or_else(|| "FILE".to_owned(), |f| f.display().to_string());
    let replacements = [
        (
            "create the table with SqliteRepository::migrate() (or connect without migrate=false)",
            format!("create the table with {migrate}"),
        ),
        (
            "run MySqlRepository::migrate() (or connect without migrate=false)",
            format!("run {migrate}"),
        ),
        (
            "run its migrations first (PgRepository::migrate(), `idempotency migrate`, or \
             connect without migrate=false)",
            format!("run its migrations first ({migrate})"),
        ),
        ("run PgRepository::migrate()", format!("run {migrate}")),
        (
            "run migrate() as a role",
            format!("run {migrate} as a role"),
        ),
        ("CREATE for migrate()", format!("CREATE for {migrate}")),
        (
            "run `idempotency migrate` (or the repository's migrate())",
            format!("run {migrate}"),
        ),
        (
            "schedule purge_expired (or `idempotency purge`) to run periodically",
            format!("schedule {purge} to run periodically (cron, a systemd timer)"),
        ),
        (
            "keep a periodic purge_expired (or `idempotency purge`) scheduled",
            format!("keep a periodic {purge} scheduled"),
        ),
        (
            "connect through SqliteRepository::connect (it sets WAL), or run PRAGMA \
             journal_mode=WAL once",
            format!("run `sqlite3 '{file}' 'PRAGMA journal_mode=WAL'` once"),
        ),
    ];
    replacements
        .iter()
        .fold(message.to_owned(), |text, (from, to)| {
            text.replace(from, to)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_commands_open_sqlite_read_only_and_never_create_it() {
        let dir = std::env::temp_dir();
        let existing = dir.join(format!("idempotency-cli-{}.db", std::process::id()));
        std::fs::write(&existing, b"").unwrap_or_default();
        let url = format!("sqlite://{}", existing.display());
        assert_eq!(
            connect_url(&url, Access::Read).ok(),
            Some(format!("{url}?migrate=false&mode=ro"))
        );
        assert_eq!(
            connect_url(&url, Access::Write).ok(),
            Some(format!("{url}?migrate=false"))
        );
        let _ = std::fs::remove_file(&existing);
        let missing = connect_url(&url, Access::Read).err();
        let hint = missing.map(|f| f.message).unwrap_or_default();
        assert!(
            hint.contains(&format!("`idempotency --url '{url}' migrate`")),
            "{hint}"
        );
        assert!(connect_url(&url, Access::Migrate).is_ok());
        assert!(connect_url("sqlite::memory:", Access::Read).is_ok());
    }

    #[test]
    fn hints_name_the_tools_commands_and_no_password() {
        let url = "postgres://app:pw@db/shop";
        let text = tool_hints(
            "x (run PgRepository::migrate()) y; run `idempotency migrate` (or the repository's \
             migrate())",
            url,
        );
        assert!(!text.contains("::") && !text.contains("()"), "{text}");
        assert!(!text.contains("pw"), "{text}");
        assert!(text.contains("`idempotency migrate`"), "{text}");
        let sqlite = tool_hints(
            "no such table; create the table with SqliteRepository::migrate() (or connect \
             without migrate=false)",
            "sqlite://a.db",
        );
        assert!(
            sqlite.ends_with("create the table with `idempotency --url 'sqlite://a.db' migrate`"),
            "{sqlite}"
        );
    }
}
