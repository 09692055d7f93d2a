//! Mapping sqlx's SQLite errors onto the core [`Error`].

use idempotency_core::{Error, RecordKey};

pub(crate) const BACKEND: &str = "sqlite";

/// SQLite's primary result codes this crate tells apart
/// (<https://www.sqlite.org/rescode.html>).
mod code {
    pub(super) const ERROR: i64 = 1;
    pub(super) const BUSY: i64 = 5;
    pub(super) const LOCKED: i64 = 6;
    pub(super) const NOMEM: i64 = 7;
    pub(super) const READONLY: i64 = 8;
    pub(super) const IOERR: i64 = 10;
    pub(super) const CORRUPT: i64 = 11;
    pub(super) const FULL: i64 = 13;
    pub(super) const CANTOPEN: i64 = 14;
    pub(super) const PROTOCOL: i64 = 15;
    pub(super) const NOTADB: i64 = 26;
}

/// Maps a sqlx error of `operation` (on `key`, when there is one).
///
/// - the database locked by another connection or process beyond the busy
///   timeout (`SQLITE_BUSY`, `SQLITE_LOCKED`), or a race in the WAL's locking
///   protocol (`SQLITE_PROTOCOL`) → [`Error::Timeout`]: retryable, and the
///   statement did not apply;
/// - I/O errors, a full disk, a file that cannot be opened, memory exhausted
///   (`SQLITE_NOMEM`, e.g. past a `hard_heap_limit`), a closed or exhausted
///   pool → [`Error::Unavailable`]: retryable;
/// - a read-only file, a missing table (run the migrations), bad connection
///   options → [`Error::Config`] saying what to fix;
/// - undecodable columns → [`Error::Corrupt`] naming the key;
/// - a damaged database file and anything else → [`Error::Backend`].
pub(crate) fn map_sqlx(
    err: sqlx::Error,
    operation: &'static str,
    key: Option<&RecordKey>,
) -> Error {
    use sqlx::Error as E;
    match err {
        E::Io(_) | E::PoolClosed | E::WorkerCrashed => unavailable(operation, err),
        E::PoolTimedOut => Error::Unavailable {
            backend: BACKEND,
            message: format!(
                "{operation}: no connection within the pool's acquire timeout (every connection \
                 busy, or the database locked)"
            ),
            source: Some(Box::new(err)),
        },
        E::Configuration(_) => Error::config(format!("SQLite connection options: {err}")),
        E::ColumnDecode { .. }
        | E::Decode(_)
        | E::ColumnNotFound(_)
        | E::ColumnIndexOutOfBounds { .. } => Error::Corrupt {
            key: key.cloned(),
            reason: format!("{operation}: {err}"),
        },
        E::Database(ref db) => {
            let extended: i64 = db.code().and_then(|c| c.parse().ok()).unwrap_or(0);
            let message = db.message().to_owned();
            match extended & 0xff {
                code::BUSY | code::LOCKED | code::PROTOCOL => Error::Timeout {
                    backend: BACKEND,
                    operation,
                },
                code::IOERR | code::FULL | code::CANTOPEN | code::NOMEM => {
                    unavailable(operation, err)
                }
                code::READONLY => Error::config(format!(
                    "{operation}: the SQLite database is read-only ({message}); the store writes \
                     on every reservation"
                )),
                code::ERROR if message.contains("no such table") => Error::config(format!(
                    "{operation}: {message}; create the table with SqliteRepository::migrate() (or \
                     connect without migrate=false)"
                )),
                code::CORRUPT | code::NOTADB => Error::Backend {
                    backend: BACKEND,
                    message: format!("{operation}: the database file is damaged: {message}"),
                    source: Some(Box::new(err)),
                },
                _ => Error::backend(BACKEND, err),
            }
        }
        other => Error::backend(BACKEND, other),
    }
}

/// Maps an error opening the database at `url`: a file that cannot be opened
/// (a missing directory, no permission, a directory where the file should
/// be) is [`Error::Config`]: no retry opens it, and an application that
/// retries a misspelled path for ever never says what is wrong. Anything
/// else as [`map_sqlx`].
pub(crate) fn map_open(err: sqlx::Error, url: &str) -> Error {
    let cannot_open = match &err {
        sqlx::Error::Database(db) => {
            db.code().and_then(|c| c.parse::<i64>().ok()).unwrap_or(0) & 0xff == code::CANTOPEN
        }
        sqlx::Error::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::NotFound
                | std::io::ErrorKind::PermissionDenied
                | std::io::ErrorKind::IsADirectory
                | std::io::ErrorKind::NotADirectory
        ),
        _ => false,
    };
    if cannot_open {
        return Error::config(format!(
            "cannot open the SQLite database of {url:?}: {err}; check that the path's directory \
             exists and that this process may create and write files there"
        ));
    }
    map_sqlx(err, "connect", None)
}

fn unavailable(operation: &'static str, err: sqlx::Error) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        message: format!("{operation}: {err}"),
        source: Some(Box::new(err)),
    }
}
