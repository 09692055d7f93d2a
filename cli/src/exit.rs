//! Exit statuses and failures: one status per class of outcome, so a script
//! can tell a failure worth retrying from one that needs a person.

use std::future::Future;
use std::time::Duration;

use idempotency::Error;

/// The command did what was asked.
pub(crate) const OK: u8 = 0;
/// A permanent failure: the store refused the operation for good (a
/// misconfiguration: unknown URL scheme or option, wrong credentials, no
/// such SQLite file, a store never migrated), or the tool refused it (a
/// live record without `--force`, `--only-if-stuck` on a record that is not
/// stuck). Retrying the same command fails the same way.
pub(crate) const PERMANENT: u8 = 1;
/// Bad input: a flag or argument the tool cannot use (an unknown flag, a
/// malformed `--key`, a bad duration, missing `--url`). Also clap's own
/// status for usage errors.
pub(crate) const USAGE: u8 = 2;
/// `doctor` ran, and a check failed.
pub(crate) const DOCTOR_FAILED: u8 = 3;
/// The key or id matches no live record (`get`, `evict`), or a filter
/// matches none (`evict --all`).
pub(crate) const NOTHING_MATCHED: u8 = 4;
/// A retryable failure: the store is unreachable, busy or did not answer in
/// time (`--timeout`), or the record changed while it was being evicted.
/// The same command may succeed later (`EX_TEMPFAIL` of sysexits.h).
pub(crate) const RETRYABLE: u8 = 75;

/// The "EXIT CODES" section of the long help (`--help`), and of the README.
pub(crate) const EXIT_CODES_HELP: &str = "\
EXIT CODES:
  0   success
  1   permanent failure: the store refused for good (unknown URL scheme or
      option, wrong credentials, no such SQLite file, store not migrated), or
      the tool refused (a live record without --force, --only-if-stuck on a
      record that is not stuck); retrying the same command fails again
  2   bad input: unknown flag, malformed --key or duration, no --url
  3   doctor: a check failed (the report is still printed)
  4   nothing matched: no live record for the key or id (get, evict), or no
      record for the filter (evict --all)
  75  retryable: the store is unreachable, busy or timed out (--timeout), or
      the record changed while being evicted; the same command may succeed
      later";

/// A failed command: the message, and the exit status.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) message: String,
    pub(crate) code: u8,
}

impl Failure {
    pub(crate) fn new(message: impl Into<String>, code: u8) -> Self {
        Failure {
            message: message.into(),
            code,
        }
    }

    /// Bad input ([`USAGE`]).
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Failure::new(message, USAGE)
    }

    /// A permanent failure or refusal ([`PERMANENT`]).
    pub(crate) fn permanent(message: impl Into<String>) -> Self {
        Failure::new(message, PERMANENT)
    }
}

impl From<Error> for Failure {
    /// The store's error, with its class: retryable errors are
    /// [`RETRYABLE`], a malformed key is [`USAGE`], the rest [`PERMANENT`].
    fn from(e: Error) -> Self {
        if e.is_retryable() {
            return Failure::new(format!("{e} (retryable)"), RETRYABLE);
        }
        let code = match e {
            Error::InvalidKey { .. } => USAGE,
            _ => PERMANENT,
        };
        Failure::new(format!("{e} (not retryable)"), code)
    }
}

/// `call`, one call to the store, within `limit` (none: unbounded). A call
/// cut off may still have been applied: said so, as a retryable failure.
pub(crate) async fn within<T>(
    limit: impl Into<Option<Duration>>,
    call: impl Future<Output = Result<T, Error>>,
) -> Result<T, Failure> {
    let Some(limit) = limit.into() else {
        return Ok(call.await?);
    };
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => Ok(answer?),
        Err(_) => Err(Failure::new(
            format!(
                "the store did not answer within {} (--timeout); a change it was asked for may \
                 or may not have been applied (retryable)",
                humantime::format_duration(limit)
            ),
            RETRYABLE,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_classed_by_retryability() {
        let timeout = Failure::from(Error::Timeout {
            backend: "redis",
            operation: "get",
        });
        assert_eq!(timeout.code, RETRYABLE);
        let config = Failure::from(Error::config("unknown option"));
        assert_eq!(config.code, PERMANENT);
        let key = Failure::from(Error::InvalidKey {
            reason: "empty".into(),
        });
        assert_eq!(key.code, USAGE);
    }

    #[test]
    fn every_code_is_documented() {
        for code in [
            OK,
            PERMANENT,
            USAGE,
            DOCTOR_FAILED,
            NOTHING_MATCHED,
            RETRYABLE,
        ] {
            assert!(
                EXIT_CODES_HELP.contains(&format!("\n  {code} ")),
                "{code} in {EXIT_CODES_HELP}"
            );
        }
    }
}
