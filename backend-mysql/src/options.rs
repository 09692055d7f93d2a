//! The options this crate reads from a `mysql://` URL's query string; the
//! rest goes to sqlx.

use std::time::Duration;

use idempotency_core::{parse_bool, parse_duration, Error};

/// A `mysql://` (or `mariadb://`) URL split into the part sqlx understands and
/// ours.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct UrlOptions {
    /// The URL without this crate's options, for sqlx (scheme `mysql`).
    pub(crate) sqlx_url: String,
    pub(crate) table: Option<String>,
    pub(crate) migrate: Option<bool>,
    pub(crate) max_connections: Option<u32>,
    pub(crate) acquire_timeout: Option<Duration>,
    pub(crate) operation_timeout: Option<Duration>,
}

/// This crate's own URL options, for messages.
const OWN_OPTIONS: &str = "table, migrate, max_connections, acquire_timeout, operation_timeout";

/// The connection options sqlx reads, for messages.
const SQLX_OPTIONS: &str = "ssl-mode, ssl-ca, ssl-cert, ssl-key, socket, charset, collation, \
     statement-cache-capacity, timezone, enable-cleartext-plugin";

impl UrlOptions {
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        // Never echo the URL: it may hold a password.
        let mut parsed = url::Url::parse(url).map_err(|e| {
            Error::config(format!(
                "invalid MySQL URL ({e}); expected mysql://user:password@host:port/database"
            ))
        })?;
        match parsed.scheme() {
            "mysql" => {}
            "mariadb" => {
                // sqlx reads the URL by its parts; the scheme only picks the driver.
                let rest = &url["mariadb".len()..];
                parsed = url::Url::parse(&format!("mysql{rest}"))
                    .map_err(|e| Error::config(format!("invalid MySQL URL ({e})")))?;
            }
            other => {
                return Err(Error::config(format!(
                    "unsupported URL scheme {other:?} for MySQL; use mysql:// or mariadb://"
                )))
            }
        }
        if parsed.path().trim_start_matches('/').is_empty() {
            return Err(Error::config(
                "the MySQL URL names no database; add it as the path (mysql://host/database)",
            ));
        }
        let mut options = UrlOptions::default();
        let mut rest = Vec::new();
        for (name, value) in parsed.query_pairs() {
            let value = value.into_owned();
            match name.as_ref() {
                "table" => options.table = Some(value),
                "migrate" => {
                    options.migrate = Some(
                        parse_bool(&value)
                            .ok_or_else(|| invalid("migrate", &value, "true or false"))?,
                    );
                }
                "max_connections" => {
                    let n = value.parse::<u32>().ok().filter(|n| *n > 0);
                    options.max_connections =
                        Some(n.ok_or_else(|| {
                            invalid("max_connections", &value, "a positive integer")
                        })?);
                }
                "acquire_timeout" => {
                    options.acquire_timeout = Some(positive_duration("acquire_timeout", &value)?);
                }
                "operation_timeout" => {
                    options.operation_timeout =
                        Some(positive_duration("operation_timeout", &value)?);
                }
                other if is_sqlx_option(other) => {
                    if other == "ssl-mode" {
                        check_tls_available(&value)?;
                    }
                    rest.push((name.into_owned(), value));
                }
                other => {
                    return Err(Error::config(format!(
                        "unknown MySQL URL option {other:?}; this crate reads {OWN_OPTIONS}, and \
                         passes on {SQLX_OPTIONS}"
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

/// Whether sqlx reads `name` (it ignores the others with a log line only, so a
/// typo such as `ssl_mode=required` would silently connect without TLS).
fn is_sqlx_option(name: &str) -> bool {
    matches!(
        name,
        "ssl-mode"
            | "ssl-ca"
            | "ssl-cert"
            | "ssl-key"
            | "socket"
            | "charset"
            | "collation"
            | "statement-cache-capacity"
            | "timezone"
            | "enable-cleartext-plugin"
    )
}

/// `ssl-mode` values that need TLS refuse to connect without it, every time: a
/// configuration error, not an outage to retry.
fn check_tls_available(mode: &str) -> Result<(), Error> {
    let needs_tls = matches!(
        mode.to_ascii_lowercase().as_str(),
        "required" | "verify_ca" | "verify_identity"
    );
    if needs_tls && !cfg!(feature = "tls") {
        return Err(Error::config(format!(
            "ssl-mode={mode} needs TLS, which this build lacks: enable the `tls` feature of \
             idempotency-mysql (`mysql-tls` of idempotency), or use ssl-mode=preferred/disabled"
        )));
    }
    Ok(())
}

fn positive_duration(name: &str, value: &str) -> Result<Duration, Error> {
    parse_duration(value)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| invalid(name, value, "a positive duration such as 5s or 500ms"))
}

fn invalid(name: &str, value: &str, expected: &str) -> Error {
    Error::config(format!(
        "invalid MySQL URL option {name}={value:?}: expected {expected}"
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn strips_own_options_and_keeps_the_rest() {
        let o = UrlOptions::parse(
            "mariadb://u:p@h:5/db?table=recs&ssl-mode=disabled&migrate=false&max_connections=3&acquire_timeout=2s&operation_timeout=500ms",
        )
        .unwrap();
        assert_eq!(o.sqlx_url, "mysql://u:p@h:5/db?ssl-mode=disabled");
        assert_eq!(o.table.as_deref(), Some("recs"));
        assert_eq!(o.migrate, Some(false));
        assert_eq!(o.max_connections, Some(3));
        assert_eq!(o.acquire_timeout, Some(Duration::from_secs(2)));
        assert_eq!(o.operation_timeout, Some(Duration::from_millis(500)));
        let o = UrlOptions::parse("mysql://localhost/db?table=x").unwrap();
        assert_eq!(o.sqlx_url, "mysql://localhost/db");
        assert_eq!(o.migrate, None);
    }

    #[test]
    fn rejects_bad_urls_and_options_without_echoing_secrets() {
        for (url, named) in [
            ("postgres://u:secret@h/db", "scheme"),
            ("mysql://u:secret@h", "no database"),
            ("mysql://u:secret@h/db?tabel=x", "tabel"),
            ("mysql://u:secret@h/db?ssl_mode=required", "ssl_mode"),
            ("mysql://u:secret@h/db?migrate=maybe", "migrate"),
            ("mysql://u:secret@h/db?max_connections=0", "max_connections"),
            (
                "mysql://u:secret@h/db?operation_timeout=0s",
                "operation_timeout",
            ),
            ("not a url", "invalid MySQL URL"),
        ] {
            match UrlOptions::parse(url) {
                Err(Error::Config { message }) => {
                    assert!(message.contains(named), "{url}: {message}");
                    assert!(!message.contains("secret"), "{message}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn ssl_modes_needing_tls_are_refused_without_the_feature() {
        for mode in ["required", "verify_ca", "VERIFY_IDENTITY"] {
            let r = UrlOptions::parse(&format!("mysql://h/db?ssl-mode={mode}"));
            assert_eq!(r.is_ok(), cfg!(feature = "tls"), "{mode}: {r:?}");
        }
        for mode in ["disabled", "preferred"] {
            assert!(UrlOptions::parse(&format!("mysql://h/db?ssl-mode={mode}")).is_ok());
        }
    }
}
