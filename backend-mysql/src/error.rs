//! Mapping sqlx's MySQL/MariaDB errors onto the core [`Error`].

use idempotency_core::{Error, RecordKey};
use sqlx::mysql::MySqlDatabaseError;

pub(crate) const BACKEND: &str = "mysql";

/// Server error numbers this crate tells apart (the same in MySQL and
/// MariaDB unless noted).
pub(crate) mod code {
    pub(crate) const DUP_ENTRY: u16 = 1062;
    pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
    pub(crate) const LOCK_DEADLOCK: u16 = 1213;
    pub(super) const CON_COUNT: u16 = 1040;
    /// Also Galera's "WSREP has not yet prepared node for application use".
    pub(super) const UNKNOWN_COM_ERROR: u16 = 1047;
    pub(super) const ABORTING_CONNECTION: u16 = 1152;
    pub(super) const NET_READ_ERROR: u16 = 1158;
    pub(super) const NET_ERROR_ON_WRITE: u16 = 1160;
    pub(super) const NEW_ABORTING_CONNECTION: u16 = 1184;
    /// A user's `max_user_connections`.
    pub(super) const TOO_MANY_USER_CONNECTIONS: u16 = 1203;
    /// A user's hourly limits (`MAX_QUERIES_PER_HOUR`, …).
    pub(super) const USER_LIMIT_REACHED: u16 = 1226;
    /// MySQL's `super_read_only`/`read_only` as reported by some versions.
    pub(super) const READ_ONLY_MODE: u16 = 1836;
    /// MySQL's `offline_mode`.
    pub(super) const SERVER_OFFLINE_MODE: u16 = 3032;
    pub(super) const DBACCESS_DENIED: u16 = 1044;
    pub(super) const ACCESS_DENIED: u16 = 1045;
    pub(super) const BAD_DB: u16 = 1049;
    pub(super) const SERVER_SHUTDOWN: u16 = 1053;
    pub(super) const TABLEACCESS_DENIED: u16 = 1142;
    pub(super) const NO_SUCH_TABLE: u16 = 1146;
    pub(super) const NET_PACKET_TOO_LARGE: u16 = 1153;
    pub(super) const NET_READ_INTERRUPTED: u16 = 1159;
    pub(super) const NET_WRITE_INTERRUPTED: u16 = 1161;
    pub(super) const OPTION_PREVENTS_STATEMENT: u16 = 1290;
    pub(super) const CANT_EXECUTE_IN_READ_ONLY_TRANSACTION: u16 = 1792;
    pub(super) const CONNECTION_KILLED: u16 = 1927;
    /// A statement interrupted (`KILL QUERY`, a server shutting down).
    pub(super) const QUERY_INTERRUPTED: u16 = 1317;
    /// MariaDB 11.6+ snapshot isolation: the row changed since the read.
    pub(super) const CHECKREAD: u16 = 1020;
    /// MySQL 8.0.24+ closing a connection idle past `wait_timeout`.
    pub(super) const CLIENT_INTERACTION_TIMEOUT: u16 = 4031;
    /// MariaDB's `max_statement_time`.
    pub(super) const STATEMENT_TIMEOUT: u16 = 1969;
    /// MySQL's `max_execution_time`.
    pub(super) const QUERY_TIMEOUT: u16 = 3024;
    /// A cached prepared statement the server wants prepared again (table
    /// metadata changed, as during another instance's migration): not run.
    pub(super) const NEED_REPREPARE: u16 = 1615;
    // The server out of a resource for now (nothing applied; it frees, or an
    // operator frees it): disk, a full tablespace, memory, locks, prepared
    // statements.
    pub(super) const DISK_FULL: u16 = 1021;
    pub(super) const OUT_OF_MEMORY: u16 = 1037;
    pub(super) const OUT_OF_SORT_MEMORY: u16 = 1038;
    pub(super) const OUT_OF_RESOURCES: u16 = 1041;
    pub(super) const TABLE_FULL: u16 = 1114;
    pub(super) const LOCK_TABLE_FULL: u16 = 1206;
    pub(super) const MAX_PREPARED_STATEMENTS: u16 = 1461;
    /// Group Replication refused to certify the transaction (a conflict with
    /// another primary): rolled back.
    pub(super) const ROLLBACK_DURING_COMMIT: u16 = 3101;
}

/// The server's error number of a database error, if it is one.
pub(crate) fn number(err: &sqlx::Error) -> Option<u16> {
    match err {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Whether `err` (as [`map_sqlx`] made it) is InnoDB's deadlock error: the
/// statement or transaction was rolled back whole, and may simply be run
/// again.
pub(crate) fn deadlocked(err: &Error) -> bool {
    let Error::Unavailable {
        source: Some(source),
        ..
    } = err
    else {
        return false;
    };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(number)
        .is_some_and(|n| n == code::LOCK_DEADLOCK)
}

/// Maps a sqlx error of `operation` (on `key`, when there is one).
///
/// - a TLS failure no retry fixes (a server without TLS under
///   `ssl-mode=required`, a certificate not trusted) → [`Error::Config`];
/// - connection problems (I/O, protocol errors of a connection cut
///   mid-handshake, a closed or exhausted pool, too many connections, also
///   the user's own `max_user_connections` or hourly limits, a server shutting
///   down, in `offline_mode` or a Galera node not yet ready, a killed or
///   aborted connection or statement, a network read or write error, a
///   connection the server closed as idle) and deadlocks and snapshot
///   conflicts (retryable by definition) → [`Error::Unavailable`];
/// - a server that refuses writes (`read_only`: e.g. a replica after a
///   failover) → [`Error::Unavailable`], saying so;
/// - a lock wait or statement timeout → [`Error::Timeout`];
/// - a missing table → [`Error::Config`] naming it and `migrate()`; refused
///   credentials, an unknown database, a missing privilege → [`Error::Config`]
///   saying what to fix;
/// - a statement over the server's `max_allowed_packet` → [`Error::Config`]
///   naming the setting (values are capped below the packet size read at
///   connect, so this means the server's setting was lowered since; a
///   completion or failure carrying a value reads the size again and answers
///   [`Error::TooLarge`] instead, so that the manager records the outcome
///   without the value);
/// - undecodable columns → [`Error::Corrupt`] naming the key;
/// - anything else → [`Error::Backend`].
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
                "{operation}: MySQL TLS: {problem} (check ssl-mode, ssl-ca and the server's \
                 certificate)"
            ),
        };
    }
    match err {
        E::Io(_) | E::Tls(_) | E::Protocol(_) | E::PoolClosed | E::WorkerCrashed => {
            unavailable(operation, err)
        }
        E::PoolTimedOut => Error::Unavailable {
            backend: BACKEND,
            message: format!(
                "{operation}: no connection within the pool's acquire timeout (server down or \
                 pool exhausted)"
            ),
            source: Some(Box::new(err)),
        },
        E::Configuration(_) => Error::config(format!("MySQL connection options: {err}")),
        E::ColumnDecode { .. }
        | E::Decode(_)
        | E::ColumnNotFound(_)
        | E::ColumnIndexOutOfBounds { .. } => Error::Corrupt {
            key: key.cloned(),
            reason: format!("{operation}: {err}"),
        },
        E::Database(_) => map_server(err, operation, table),
        other => Error::backend(BACKEND, other),
    }
}

fn map_server(err: sqlx::Error, operation: &'static str, table: &str) -> Error {
    use code::*;
    let Some(n) = number(&err) else {
        return Error::backend(BACKEND, err);
    };
    match n {
        CON_COUNT
        | TOO_MANY_USER_CONNECTIONS
        | USER_LIMIT_REACHED
        | SERVER_OFFLINE_MODE
        | UNKNOWN_COM_ERROR
        | SERVER_SHUTDOWN
        | CONNECTION_KILLED
        | ABORTING_CONNECTION
        | NEW_ABORTING_CONNECTION
        | NET_READ_ERROR
        | NET_ERROR_ON_WRITE
        | NET_READ_INTERRUPTED
        | NET_WRITE_INTERRUPTED
        | LOCK_DEADLOCK
        | QUERY_INTERRUPTED
        | CHECKREAD
        | CLIENT_INTERACTION_TIMEOUT
        | NEED_REPREPARE
        | DISK_FULL
        | OUT_OF_MEMORY
        | OUT_OF_SORT_MEMORY
        | OUT_OF_RESOURCES
        | TABLE_FULL
        | LOCK_TABLE_FULL
        | MAX_PREPARED_STATEMENTS
        | ROLLBACK_DURING_COMMIT => unavailable(operation, err),
        OPTION_PREVENTS_STATEMENT | CANT_EXECUTE_IN_READ_ONLY_TRANSACTION | READ_ONLY_MODE => {
            Error::Unavailable {
                backend: BACKEND,
                message: format!(
                    "{operation}: the server refuses writes (read-only: a replica, or a primary \
                     during a failover): {err}"
                ),
                source: Some(Box::new(err)),
            }
        }
        LOCK_WAIT_TIMEOUT | STATEMENT_TIMEOUT | QUERY_TIMEOUT => Error::Timeout {
            backend: BACKEND,
            operation,
        },
        NO_SUCH_TABLE => Error::config(format!(
            "{operation}: the idempotency table {table} does not exist; run \
             MySqlRepository::migrate() (or connect without migrate=false) ({err})"
        )),
        ACCESS_DENIED => Error::config(format!(
            "{operation}: the server refused the credentials; check the user and password in \
             the URL ({err})"
        )),
        BAD_DB => Error::config(format!(
            "{operation}: the database in the URL does not exist; create it or fix the URL's \
             path ({err})"
        )),
        DBACCESS_DENIED | TABLEACCESS_DENIED => Error::config(format!(
            "{operation}: the user lacks a privilege on {table} (grant SELECT, INSERT, UPDATE, \
             DELETE, and CREATE for migrate()) ({err})"
        )),
        NET_PACKET_TOO_LARGE => Error::config(format!(
            "{operation}: a statement exceeded the server's max_allowed_packet; raise it on the \
             server, or lower the manager's max_result_bytes ({err})"
        )),
        _ => Error::backend(BACKEND, err),
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

pub(crate) fn unavailable(operation: &'static str, err: sqlx::Error) -> Error {
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
    fn io_pool_and_protocol_errors_are_outages() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(map_sqlx(io, "reserve", None, "t").is_store_outage());
        assert!(map_sqlx(sqlx::Error::PoolTimedOut, "get", None, "t").is_store_outage());
        assert!(map_sqlx(sqlx::Error::PoolClosed, "get", None, "t").is_store_outage());
        let cut = sqlx::Error::Protocol("unexpected end of handshake".into());
        assert!(map_sqlx(cut, "reserve", None, "t").is_store_outage());
    }

    #[test]
    fn decode_errors_name_the_key() {
        let key = RecordKey::new("ns", "id", 64).unwrap_or_else(|e| panic!("{e}"));
        let err = sqlx::Error::ColumnNotFound("owner".into());
        assert!(matches!(
            map_sqlx(err, "get", Some(&key), "t"),
            Error::Corrupt { key: Some(k), .. } if k == key
        ));
    }
}
