//! Mapping the `redis` crate's errors onto the core [`Error`].

use idempotency_core::{Error, RecordKey};
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// The backend's name, in capabilities and errors.
pub(crate) const BACKEND: &str = "redis";

/// The error code the scripts answer for a stored value they cannot read.
pub(crate) const CORRUPT_CODE: &str = "IDEMPOTENCY_CORRUPT";

/// Whether the error is `NOSCRIPT` (script cache empty: restart, `SCRIPT FLUSH`,
/// failover to a replica that never saw the script).
pub(crate) fn is_noscript(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) || err.code() == Some("NOSCRIPT")
}

/// Whether the server refused a command over keys of different hash slots
/// (`CROSSSLOT`: a cluster node, or a proxy in front of shards, reached by a
/// standalone URL). The command was not run.
pub(crate) fn is_cross_slot(err: &RedisError) -> bool {
    err.code() == Some("CROSSSLOT") || err.to_string().contains("hash to the same slot")
}

/// Whether the server rejected `SET … NX … GET` as a syntax error (Redis < 7.0).
pub(crate) fn is_syntax_error(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && err.detail().is_some_and(|d| d.contains("syntax error"))
}

/// Maps a client error of `operation` on `key`.
///
/// Connection trouble (I/O, refused, reset, dropped), server states that pass
/// (`LOADING`, `BUSY`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`
/// during a failover, redirections the cluster client or this crate gave up
/// on), writes the server refuses for now (`OOM` at `maxmemory` under
/// `noeviction`, `NOREPLICAS` below `min-replicas-to-write`, `MISCONF` after
/// a failed snapshot: nothing written, and the write goes through once memory,
/// replicas or the disk are back) →
/// [`Error::Unavailable`]; an I/O timeout → [`Error::Timeout`]; a value of the
/// wrong type or format under the key → [`Error::Corrupt`]; bad credentials or
/// an untrusted TLS certificate, a connection whose first reply is not Redis's
/// protocol (another service at that port) → [`Error::Config`]; anything else
/// → [`Error::Backend`].
pub(crate) fn map_redis_error(
    err: RedisError,
    key: Option<&RecordKey>,
    operation: &'static str,
) -> Error {
    if err.is_timeout() {
        return Error::Timeout {
            backend: BACKEND,
            operation,
        };
    }
    if let Some(problem) = idempotency_core::tls::misconfiguration(&err) {
        return Error::config(format!("redis TLS: {problem}"));
    }
    let code = err.code().map(str::to_owned);
    let unavailable = err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || matches!(
            err.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::Moved
                    | ServerErrorKind::Ask
            ) | ErrorKind::ClusterConnectionNotFound
        )
        || matches!(
            code.as_deref(),
            Some(
                "BUSY" | "LOADING" | "TRYAGAIN" | "CLUSTERDOWN" | "OOM" | "NOREPLICAS" | "MISCONF"
            )
        );
    if unavailable {
        return Error::unavailable(BACKEND, err);
    }
    match code.as_deref() {
        Some(CORRUPT_CODE) | Some("WRONGTYPE") => {
            let reason = match code.as_deref() {
                Some("WRONGTYPE") => "the key holds a value that is not a string".to_owned(),
                _ => err
                    .detail()
                    .map_or_else(|| "unreadable record".to_owned(), str::to_owned),
            };
            return Error::Corrupt {
                key: key.cloned(),
                reason,
            };
        }
        Some("NOAUTH" | "WRONGPASS" | "NOPERM") => {
            return Error::config(format!("redis refused the credentials or command: {err}"));
        }
        _ => {}
    }
    match err.kind() {
        ErrorKind::AuthenticationFailed => Error::config(format!(
            "redis refused the credentials; check the user and password in the URL ({err})"
        )),
        ErrorKind::InvalidClientConfig => Error::config(format!("redis: {err}")),
        // The first reply on a new connection is not RESP: another service
        // listens at that address, and always will.
        ErrorKind::Parse if operation == "connect" => Error::config(format!(
            "the URL's host and port answer, but not as a Redis server (its reply is not \
             Redis's protocol: {}); check the port",
            err.to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        )),
        _ => Error::backend(BACKEND, err),
    }
}
