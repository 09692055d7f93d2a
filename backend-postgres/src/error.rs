//! Mapping sqlx errors onto the core [`Error`].

use idempotency_core::{Error, RecordKey};

pub(crate) const BACKEND: &str = "postgres";

/// Maps a sqlx error of `operation` (on `key`, when there is one).
///
/// - a TLS failure no retry fixes (a server without TLS under
///   `sslmode=require`, a certificate not trusted) → [`Error::Config`];
/// - connection problems (I/O, protocol errors of a connection cut during the
///   handshake, closed or exhausted pool, SQLSTATE class 08,
///   `57P01`/`57P02`/`57P03` shutdowns, class 53 insufficient resources) and
///   serialization failures / deadlocks (`40001`, `40P01`, retryable by
///   definition) → [`Error::Unavailable`], and so is a server that refuses
///   writes (`25006`: a standby, or a primary demoted in a failover);
/// - `statement_timeout` (`57014`) and `lock_timeout` (`55P03`) → [`Error::Timeout`];
/// - a missing schema, table, column or function (`3F000`, `42P01`, `42703`,
///   `42883`) →
///   [`Error::Config`] naming the table and `migrate()`;
/// - refused credentials (class `28`), a missing database (`3D000`), a missing
///   privilege (`42501`) → [`Error::Config`] saying what to fix;
/// - undecodable columns → [`Error::Corrupt`] naming the key;
/// - anything else → [`Error::Backend`].
///
/// A unique violation (`23505`) cannot arise from this crate's statements: the
/// only insert is `INSERT … ON CONFLICT DO NOTHING` inside the reservation
/// function, whose conflicts become the `Existing` outcome; migrations are
/// serialised by an advisory lock. Should one arrive anyway, it is a
/// [`Error::Backend`].
pub(crate) fn map_sqlx(
    err: sqlx::Error,
    operation: &'static str,
    key: Option<&RecordKey>,
    table: &str,
) -> Error {
    use sqlx::Error as E;
    if let Some(problem) = tls_misconfiguration(&err) {
        return Error::Config {
            message: format!(
                "{operation}: PostgreSQL TLS: {problem} (check sslmode, sslrootcert and the server's \
                 certificate)"
            ),
        };
    }
    match err {
        E::Io(_) | E::Tls(_) | E::PoolClosed | E::WorkerCrashed => unavailable(operation, err),
        // A peer that accepts the TCP connection and closes it mid-handshake
        // (a proxy or load balancer in front of a server that is down or
        // starting, e.g. Docker's port proxy) surfaces as a protocol error such as
        // "unexpected response from SSLRequest": the server is unreachable.
        E::Protocol(_) => unavailable(operation, err),
        E::PoolTimedOut => Error::Unavailable {
            backend: BACKEND,
            message: format!(
                "{operation}: no connection within the pool's acquire timeout (server down or pool exhausted)"
            ),
            source: Some(Box::new(err)),
        },
        E::Configuration(_) => Error::Config {
            message: format!("PostgreSQL connection options: {err}"),
        },
        E::ColumnDecode { .. } | E::Decode(_) | E::ColumnNotFound(_) | E::ColumnIndexOutOfBounds { .. } => {
            Error::Corrupt {
                key: key.cloned(),
                reason: format!("{operation}: {err}"),
            }
        }
        E::Database(ref db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                c if c.starts_with("08") || c.starts_with("53") => unavailable(operation, err),
                // Class 57P: the server ended the session (shutdown, crash,
                // not yet accepting, database dropped, `idle_session_timeout`);
                // 25P03: `idle_in_transaction_session_timeout` did.
                c if c.starts_with("57P") => unavailable(operation, err),
                "25P03" | "40001" | "40P01" => unavailable(operation, err),
                // A read-only transaction: a standby (or a primary demoted in a
                // failover) that the URL still points at.
                "25006" => unavailable(operation, err),
                "57014" | "55P03" => Error::Timeout {
                    backend: BACKEND,
                    operation,
                },
                c if c.starts_with("28") => Error::Config {
                    message: format!(
                        "{operation}: PostgreSQL refused the credentials; check the user and \
                         password in the URL ({err})"
                    ),
                },
                // A startup option of the URL's `options` the server does not
                // know (42704) or whose value it refuses (22023), both FATAL
                // at connect; 42704 is also an object the schema lacks.
                "42704" | "22023" => Error::Config {
                    message: format!(
                        "{operation}: PostgreSQL refused a setting (check the URL's `options`) \
                         or does not know an object of the schema (run PgRepository::migrate()) \
                         ({err})"
                    ),
                },
                "3D000" => Error::Config {
                    message: format!(
                        "{operation}: the database in the URL does not exist; create it or fix \
                         the URL's path ({err})"
                    ),
                },
                "42501" => Error::Config {
                    message: format!(
                        "{operation}: the PostgreSQL role lacks a privilege on {table} (grant it, \
                         or run migrate() as a role that may create it) ({err})"
                    ),
                },
                "3F000" | "42P01" | "42883" | "42703" => Error::Config {
                    message: format!(
                        "{operation}: the idempotency table {table} (or its schema, a column or the \
                         reserve function) does not exist or is outdated; run PgRepository::migrate() ({err})"
                    ),
                },
                _ => Error::backend(BACKEND, err),
            }
        }
        other => Error::backend(BACKEND, other),
    }
}

/// A TLS failure that no retry fixes (`idempotency_core::tls`): sqlx's own
/// `Tls` errors (a server without TLS when the URL requires it, a root
/// certificate that cannot be parsed), unless one carries a cut connection,
/// and a handshake rustls refused. A certificate file that cannot be read is
/// an I/O error: an outage.
fn tls_misconfiguration(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Tls(e) => idempotency_core::tls::library_error(&**e),
        _ => idempotency_core::tls::misconfiguration(err),
    }
}

fn unavailable(operation: &'static str, err: sqlx::Error) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        message: format!("{operation}: {err}"),
        source: Some(Box::new(err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlx_tls_errors_are_configuration_unless_a_connection_was_cut() {
        let without = sqlx::Error::Tls("server does not support TLS".into());
        assert!(matches!(
            map_sqlx(without, "connect", None, "t"),
            Error::Config { message } if message.contains("does not support TLS")
        ));
        // As native-tls reports a connection reset mid-handshake.
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let cut = sqlx::Error::Tls(Box::new(reset));
        assert!(map_sqlx(cut, "connect", None, "t").is_store_outage());
    }

    #[cfg(feature = "tls")]
    #[test]
    fn an_untrusted_certificate_is_a_configuration_error() {
        // How sqlx reports a handshake rustls refused: an I/O error carrying
        // it.
        let untrusted = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        ));
        assert!(matches!(
            map_sqlx(untrusted, "connect", None, "t"),
            Error::Config { message } if message.contains("UnknownIssuer")
        ));
    }

    #[test]
    fn io_and_pool_errors_are_outages() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(map_sqlx(io, "reserve", None, "t").is_store_outage());
        assert!(map_sqlx(sqlx::Error::PoolTimedOut, "get", None, "t").is_store_outage());
        assert!(map_sqlx(sqlx::Error::PoolClosed, "get", None, "t").is_store_outage());
        // What a connection cut during the handshake by a proxy looks like.
        let cut = sqlx::Error::Protocol("unexpected response from SSLRequest: 0x00".into());
        assert!(map_sqlx(cut, "reserve", None, "t").is_store_outage());
    }

    #[test]
    fn decode_errors_name_the_key() {
        let key = RecordKey::new("ns", "id", 64).unwrap();
        let err = sqlx::Error::ColumnNotFound("owner".into());
        assert!(matches!(
            map_sqlx(err, "get", Some(&key), "t"),
            Error::Corrupt { key: Some(k), .. } if k == key
        ));
    }
}
