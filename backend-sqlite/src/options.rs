//! The options this crate reads from a `sqlite://` URL's query string; the
//! rest of the URL (the path, sqlx's own `mode`, `cache`, `immutable`, `vfs`)
//! goes to sqlx.

use std::time::Duration;

use idempotency_core::{parse_duration, Error};

/// How hard a commit waits for the disk (SQLite's `synchronous`, in WAL mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `FULL` (the default): a commit is on disk before it returns; a record
    /// survives a power loss as well as a crash of the process.
    #[default]
    Full,
    /// `NORMAL`: a commit survives a crash of the process, but the last
    /// commits before a power loss or an OS crash may be lost, and a key whose
    /// record is lost runs its handler again. Several times faster on a slow
    /// disk.
    Normal,
    /// `EXTRA`: `FULL`, and the directory is synced too.
    Extra,
}

/// A `sqlite://` URL split into the part sqlx understands and ours.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct UrlOptions {
    /// The URL without this crate's options, for sqlx.
    pub(crate) sqlx_url: String,
    pub(crate) migrate: Option<bool>,
    pub(crate) max_connections: Option<u32>,
    pub(crate) busy_timeout: Option<Duration>,
    pub(crate) durability: Option<Durability>,
}

const OWN_OPTIONS: &str = "migrate, max_connections, busy_timeout, synchronous";
const SQLX_OPTIONS: &str = "mode, cache, immutable, vfs";

impl UrlOptions {
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        let Some(rest) = url.strip_prefix("sqlite:") else {
            return Err(Error::config(format!(
                "unsupported URL {url:?} for SQLite; use sqlite://path/to/file.db"
            )));
        };
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut options = UrlOptions::default();
        let mut passed = Vec::new();
        for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
            let value = value.into_owned();
            match name.as_ref() {
                "migrate" => options.migrate = Some(parse_bool("migrate", &value)?),
                "max_connections" => {
                    let n = value.parse::<u32>().ok().filter(|n| *n > 0);
                    options.max_connections =
                        Some(n.ok_or_else(|| {
                            invalid("max_connections", &value, "a positive integer")
                        })?);
                }
                "busy_timeout" => {
                    let d = parse_duration(&value).filter(|d| !d.is_zero());
                    options.busy_timeout =
                        Some(d.ok_or_else(|| {
                            invalid("busy_timeout", &value, "a duration such as 5s")
                        })?);
                }
                "synchronous" => {
                    options.durability = Some(match value.to_ascii_lowercase().as_str() {
                        "full" => Durability::Full,
                        "normal" => Durability::Normal,
                        "extra" => Durability::Extra,
                        _ => return Err(invalid("synchronous", &value, "full, normal or extra")),
                    });
                }
                "mode" | "cache" | "immutable" | "vfs" => passed.push((name.into_owned(), value)),
                other => {
                    return Err(Error::config(format!(
                        "unknown SQLite URL option {other:?}; this crate reads {OWN_OPTIONS}, \
                         and passes on {SQLX_OPTIONS}"
                    )))
                }
            }
        }
        check_database(path, &passed)?;
        let mut sqlx_url = format!("sqlite:{path}");
        if !passed.is_empty() {
            let query = url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(passed)
                .finish();
            sqlx_url.push('?');
            sqlx_url.push_str(&query);
        }
        options.sqlx_url = sqlx_url;
        Ok(options)
    }
}

/// Refuses a URL whose connections would not share one database: an empty
/// path (SQLite opens a private temporary database for each connection) or
/// an in-memory database with a private cache (one per connection). The
/// pool's connections would each see their own records, and a duplicate on
/// another connection would run its handler again.
fn check_database(path: &str, passed: &[(String, String)]) -> Result<(), Error> {
    let file = path.strip_prefix("//").unwrap_or(path);
    if file.is_empty() {
        return Err(Error::config(
            "the SQLite URL names no file (sqlite://path/to/file.db): an empty path opens a \
             private temporary database for each connection, which would not see each other's \
             records; for a database in memory use sqlite::memory:",
        ));
    }
    let option = |name: &str| {
        passed
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let in_memory = file == ":memory:" || option("mode") == Some("memory");
    if in_memory && option("cache") == Some("private") {
        return Err(Error::config(
            "an in-memory SQLite database with cache=private is a different database for each \
             connection of the pool; leave cache unset (shared) or use a file",
        ));
    }
    Ok(())
}

fn invalid(name: &str, value: &str, expected: &str) -> Error {
    Error::config(format!(
        "invalid SQLite URL option {name}={value:?}; expected {expected}"
    ))
}

fn parse_bool(name: &str, value: &str) -> Result<bool, Error> {
    idempotency_core::parse_bool(value).ok_or_else(|| invalid(name, value, "true or false"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn own_options_are_taken_and_sqlx_options_passed_on() {
        let o = UrlOptions::parse(
            "sqlite://data/idem.db?mode=rwc&max_connections=2&busy_timeout=250ms&synchronous=NORMAL&migrate=false",
        )
        .unwrap();
        assert_eq!(o.sqlx_url, "sqlite://data/idem.db?mode=rwc");
        assert_eq!(o.max_connections, Some(2));
        assert_eq!(o.busy_timeout, Some(Duration::from_millis(250)));
        assert_eq!(o.durability, Some(Durability::Normal));
        assert_eq!(o.migrate, Some(false));
        assert_eq!(
            UrlOptions::parse("sqlite:idem.db").unwrap().sqlx_url,
            "sqlite:idem.db"
        );
        // In memory, shared between the pool's connections.
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://db?mode=memory",
        ] {
            UrlOptions::parse(url).unwrap();
        }
    }

    #[test]
    fn bad_options_are_configuration_errors_naming_them() {
        for (url, named) in [
            ("sqlite://a.db?max_connections=0", "max_connections"),
            ("sqlite://a.db?busy_timeout=soon", "busy_timeout"),
            ("sqlite://a.db?synchronous=off", "synchronous"),
            ("sqlite://a.db?migrate=maybe", "migrate"),
            ("sqlite://a.db?table=x", "\"table\""),
            ("postgres://h/db", "sqlite://"),
            ("sqlite://", "names no file"),
            ("sqlite:", "names no file"),
            ("sqlite://?mode=memory", "names no file"),
            ("sqlite://?synchronous=normal", "names no file"),
            ("sqlite::memory:?cache=private", "cache=private"),
            ("sqlite://db?mode=memory&cache=private", "cache=private"),
        ] {
            let e = UrlOptions::parse(url).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{url}: {e}");
            assert!(e.to_string().contains(named), "{url}: {e}");
        }
    }
}
