//! The options this crate reads from a connection URL's query string.

use std::time::Duration;

use idempotency_core::{parse_duration, Error};

use crate::plan::ReservePlan;

/// A `postgres://` URL split into the part sqlx understands and ours.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct UrlOptions {
    /// The URL without this crate's options, for sqlx.
    pub(crate) sqlx_url: String,
    pub(crate) schema: Option<String>,
    pub(crate) table: Option<String>,
    pub(crate) migrate: Option<bool>,
    pub(crate) max_connections: Option<u32>,
    pub(crate) acquire_timeout: Option<Duration>,
    pub(crate) operation_timeout: Option<Duration>,
    pub(crate) lock_timeout: Option<Duration>,
    pub(crate) held_connections: Option<usize>,
    pub(crate) reserve_plan: Option<ReservePlan>,
    pub(crate) coalesce_above: Option<usize>,
}

impl UrlOptions {
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        // Never echo the URL: it may hold a password.
        let mut parsed = url::Url::parse(url).map_err(|e| {
            Error::config(format!("invalid PostgreSQL URL ({e}); expected postgres://user:password@host:port/database"))
        })?;
        match parsed.scheme() {
            "postgres" | "postgresql" => {}
            other => {
                return Err(Error::config(format!(
                "unsupported URL scheme {other:?} for PostgreSQL; use postgres:// or postgresql://"
            )))
            }
        }
        let mut options = UrlOptions::default();
        let mut rest = Vec::new();
        for (name, value) in parsed.query_pairs() {
            let value = value.into_owned();
            match name.as_ref() {
                "schema" => options.schema = Some(value),
                "table" => options.table = Some(value),
                "migrate" => options.migrate = Some(parse_bool("migrate", &value)?),
                "max_connections" => {
                    options.max_connections = Some(
                        value
                            .parse::<u32>()
                            .ok()
                            .filter(|n| *n > 0)
                            .ok_or_else(|| {
                                invalid("max_connections", &value, "a positive integer")
                            })?,
                    );
                }
                "acquire_timeout" => {
                    options.acquire_timeout = Some(positive_duration("acquire_timeout", &value)?);
                }
                "operation_timeout" => {
                    options.operation_timeout =
                        Some(positive_duration("operation_timeout", &value)?);
                }
                "lock_timeout" => {
                    options.lock_timeout = Some(positive_duration("lock_timeout", &value)?);
                }
                "held_connections" => {
                    options.held_connections = Some(value.parse::<usize>().map_err(|_| {
                        invalid("held_connections", &value, "a non-negative integer")
                    })?);
                }
                "reserve_plan" => options.reserve_plan = Some(value.parse()?),
                "coalesce_above" => {
                    options.coalesce_above = Some(value.parse::<usize>().map_err(|_| {
                        invalid("coalesce_above", &value, "a non-negative integer")
                    })?);
                }
                other if is_sqlx_option(other) => {
                    if matches!(other, "sslmode" | "ssl-mode") {
                        check_tls_available(&value)?;
                    }
                    rest.push((name.into_owned(), value));
                }
                other => {
                    return Err(Error::config(format!(
                        "unknown PostgreSQL URL option {other:?}; this crate reads {OWN_OPTIONS}, \
                         and passes on {SQLX_OPTIONS}"
                    )))
                }
            }
        }
        if rest.is_empty() {
            parsed.set_query(None);
        } else {
            parsed.query_pairs_mut().clear().extend_pairs(rest);
        }
        options.sqlx_url = parsed.into();
        Ok(options)
    }
}

/// This crate's own URL options, for messages.
const OWN_OPTIONS: &str = "schema, table, migrate, max_connections, acquire_timeout, \
     operation_timeout, lock_timeout, held_connections, reserve_plan, coalesce_above";

/// The connection options sqlx reads, for messages.
const SQLX_OPTIONS: &str = "sslmode, sslrootcert, sslcert, sslkey, host, hostaddr, port, \
     dbname, user, password, application_name, options, options[NAME], statement-cache-capacity";

/// Whether sqlx reads `name` (sqlx ignores the others with a log line only, so
/// a typo such as `sslmod=require` would silently connect without TLS).
fn is_sqlx_option(name: &str) -> bool {
    matches!(
        name,
        "sslmode"
            | "ssl-mode"
            | "sslrootcert"
            | "ssl-root-cert"
            | "ssl-ca"
            | "sslcert"
            | "ssl-cert"
            | "sslkey"
            | "ssl-key"
            | "statement-cache-capacity"
            | "host"
            | "hostaddr"
            | "port"
            | "dbname"
            | "user"
            | "password"
            | "application_name"
            | "options"
    ) || (name.starts_with("options[") && name.ends_with(']'))
}

/// `sslmode` values that need TLS refuse to connect without it, every time:
/// a configuration error, not an outage to retry.
fn check_tls_available(mode: &str) -> Result<(), Error> {
    let needs_tls = matches!(
        mode.to_ascii_lowercase().as_str(),
        "require" | "verify-ca" | "verify-full"
    );
    if needs_tls && !cfg!(feature = "tls") {
        return Err(Error::config(format!(
            "sslmode={mode} needs TLS, which this build lacks: enable the `tls` feature of \
             idempotency-postgres (`postgres-tls` of idempotency), or use sslmode=prefer/disable"
        )));
    }
    Ok(())
}

fn positive_duration(name: &str, value: &str) -> Result<Duration, Error> {
    parse_duration(value)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| invalid(name, value, "a positive duration such as 5s or 500ms"))
}

fn parse_bool(name: &str, value: &str) -> Result<bool, Error> {
    idempotency_core::parse_bool(value).ok_or_else(|| invalid(name, value, "true or false"))
}

fn invalid(name: &str, value: &str, expected: &str) -> Error {
    Error::config(format!(
        "invalid URL option {name}={value:?}: expected {expected}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_own_options_and_keeps_the_rest() {
        let o = UrlOptions::parse(
            "postgresql://u:p@h:5/db?schema=idem&sslmode=disable&table=recs&migrate=false&max_connections=3&acquire_timeout=2s&operation_timeout=500ms&lock_timeout=40ms&held_connections=0&reserve_plan=read-first&coalesce_above=0",
        )
        .unwrap();
        assert_eq!(o.sqlx_url, "postgresql://u:p@h:5/db?sslmode=disable");
        assert_eq!(o.schema.as_deref(), Some("idem"));
        assert_eq!(o.table.as_deref(), Some("recs"));
        assert_eq!(o.migrate, Some(false));
        assert_eq!(o.max_connections, Some(3));
        assert_eq!(o.acquire_timeout, Some(Duration::from_secs(2)));
        assert_eq!(o.operation_timeout, Some(Duration::from_millis(500)));
        assert_eq!(o.lock_timeout, Some(Duration::from_millis(40)));
        assert_eq!(o.held_connections, Some(0));
        assert_eq!(o.reserve_plan, Some(ReservePlan::ReadFirst));
        assert_eq!(o.coalesce_above, Some(0));

        let o = UrlOptions::parse("postgres://localhost/db?table=x").unwrap();
        assert_eq!(o.sqlx_url, "postgres://localhost/db");
        assert_eq!(o.migrate, None);
    }

    #[test]
    fn rejects_bad_urls_without_echoing_secrets() {
        for url in ["redis://localhost", "mysql://u:secret@h/db", "not a url"] {
            match UrlOptions::parse(url) {
                Err(Error::Config { message }) => assert!(!message.contains("secret"), "{message}"),
                other => panic!("{url}: {other:?}"),
            }
        }
        assert!(UrlOptions::parse("postgres://h/db?migrate=maybe").is_err());
        assert!(UrlOptions::parse("postgres://h/db?max_connections=0").is_err());
        assert!(UrlOptions::parse("postgres://h/db?held_connections=-1").is_err());
        assert!(UrlOptions::parse("postgres://h/db?coalesce_above=some").is_err());
    }

    #[test]
    fn rejects_unknown_options_and_zero_timeouts() {
        for (url, named) in [
            ("postgres://h/db?tabel=idem", "tabel"),
            ("postgres://h/db?sslmod=require", "sslmod"),
            ("postgres://h/db?connect_timeout=5", "connect_timeout"),
            ("postgres://h/db?operation_timeout=0s", "operation_timeout"),
            ("postgres://h/db?acquire_timeout=0ms", "acquire_timeout"),
            ("postgres://h/db?lock_timeout=0s", "lock_timeout"),
            ("postgres://h/db?reserve_plan=guess", "read-first"),
        ] {
            match UrlOptions::parse(url) {
                Err(Error::Config { message }) => assert!(message.contains(named), "{message}"),
                other => panic!("{url}: {other:?}"),
            }
        }
        let o = UrlOptions::parse(
            "postgres://h/db?application_name=a&options[search_path]=x&statement-cache-capacity=9",
        )
        .unwrap();
        assert!(o.sqlx_url.contains("application_name=a"), "{}", o.sqlx_url);
    }

    #[test]
    fn sslmode_needing_tls_is_refused_without_the_feature() {
        for mode in ["require", "verify-ca", "verify-full", "REQUIRE"] {
            let r = UrlOptions::parse(&format!("postgres://h/db?sslmode={mode}"));
            if cfg!(feature = "tls") {
                assert!(r.is_ok(), "{mode}: {r:?}");
            } else {
                match r {
                    Err(Error::Config { message }) => {
                        assert!(message.contains("`tls`"), "{message}")
                    }
                    other => panic!("{mode}: {other:?}"),
                }
            }
        }
        for mode in ["disable", "prefer", "allow"] {
            assert!(UrlOptions::parse(&format!("postgres://h/db?sslmode={mode}")).is_ok());
        }
    }
}
