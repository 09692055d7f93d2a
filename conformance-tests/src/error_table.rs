//! A backend's error table: for each cause (a misconfiguration, a failure of
//! the server), the error variant it must come back as and the words its
//! message must carry so that a reader knows what to fix.
//!
//! Each backend's tests build the rows against a real server and hand them to
//! [`assert_error_table`], which checks every row (all mismatches are reported
//! together) and prints the table, as it appears in the guide.
//!
//! ```
//! use idempotency_conformance::error_table::{assert_error_table, ErrorRow, Expected};
//! use idempotency_core::Error;
//!
//! let rows = vec![ErrorRow::new(
//!     "a zero timeout",
//!     Err::<(), _>(Error::config("timeout must be positive")),
//!     Expected::Config,
//!     &["timeout"],
//! )];
//! assert_error_table("example", &rows);
//! ```

use std::fmt;

use idempotency_core::Error;

/// The variant (and so the retry class) a row expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// [`Error::Config`]: permanent, fix the configuration (not retryable).
    Config,
    /// [`Error::Unavailable`]: the store could not be reached (retryable).
    Unavailable,
    /// [`Error::Timeout`]: no answer in time, maybe applied (retryable).
    Timeout,
    /// [`Error::Unavailable`] or [`Error::Timeout`]: which one depends on
    /// where the outage caught the call.
    Outage,
    /// [`Error::Corrupt`]: a stored value this backend cannot read.
    Corrupt,
    /// [`Error::Backend`]: the server refused the request (not retryable).
    Backend,
}

impl Expected {
    fn matches(self, err: &Error) -> bool {
        match self {
            Expected::Config => matches!(err, Error::Config { .. }),
            Expected::Unavailable => matches!(err, Error::Unavailable { .. }),
            Expected::Timeout => matches!(err, Error::Timeout { .. }),
            Expected::Outage => err.is_store_outage(),
            Expected::Corrupt => matches!(err, Error::Corrupt { .. }),
            Expected::Backend => matches!(err, Error::Backend { .. }),
        }
    }

    /// Whether errors of this class are retryable.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Expected::Unavailable | Expected::Timeout | Expected::Outage
        )
    }
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Expected::Config => "Config",
            Expected::Unavailable => "Unavailable",
            Expected::Timeout => "Timeout",
            Expected::Outage => "Unavailable or Timeout",
            Expected::Corrupt => "Corrupt",
            Expected::Backend => "Backend",
        })
    }
}

/// One cause, what it produced, and what it must produce.
#[derive(Debug)]
pub struct ErrorRow {
    /// What went wrong, in a user's words.
    pub cause: String,
    /// What the backend returned.
    pub got: Result<(), Error>,
    /// The variant it must be.
    pub expected: Expected,
    /// Words the message must contain (compared ignoring ASCII case).
    pub mentions: Vec<String>,
}

impl ErrorRow {
    /// A row; `got` is any result, of which only the error matters.
    pub fn new<T>(
        cause: impl Into<String>,
        got: Result<T, Error>,
        expected: Expected,
        mentions: &[&str],
    ) -> ErrorRow {
        ErrorRow {
            cause: cause.into(),
            got: got.map(drop),
            expected,
            mentions: mentions.iter().map(|m| (*m).to_owned()).collect(),
        }
    }

    /// What is wrong with this row, if anything.
    fn problem(&self) -> Option<String> {
        let err = match &self.got {
            Ok(()) => return Some("succeeded".to_owned()),
            Err(e) => e,
        };
        if !self.expected.matches(err) {
            return Some(format!("expected {}, got {err:?}", self.expected));
        }
        if err.is_retryable() != self.expected.retryable() {
            return Some(format!("wrong retry class: {err:?}"));
        }
        let message = err.to_string().to_ascii_lowercase();
        let missing: Vec<&str> = self
            .mentions
            .iter()
            .map(String::as_str)
            .filter(|m| !message.contains(&m.to_ascii_lowercase()))
            .collect();
        (!missing.is_empty()).then(|| format!("the message {err} does not mention {missing:?}"))
    }
}

/// Checks every row and prints the table (`cargo test -- --nocapture` shows
/// it).
///
/// # Panics
/// When a row succeeded, came back as another variant or retry class, or its
/// message lacks a word it must mention; every such row is listed.
pub fn assert_error_table(backend: &str, rows: &[ErrorRow]) {
    println!("| {backend}: cause | error | message |\n|---|---|---|");
    let mut problems = Vec::new();
    for row in rows {
        let shown = match &row.got {
            Ok(()) => "(succeeded)".to_owned(),
            Err(e) => e.to_string().replace('|', "\\|").replace('\n', " "),
        };
        println!("| {} | {} | {shown} |", row.cause, row.expected);
        if let Some(problem) = row.problem() {
            problems.push(format!("- {}: {problem}", row.cause));
        }
    }
    assert!(
        problems.is_empty(),
        "{backend}: rows of the error table that do not hold:\n{}",
        problems.join("\n")
    );
}

/// Reserves the key `id` of namespace `errors` (lease 60 s, TTL 120 s) and
/// drops the answer: the call an error row makes to see how a store fails.
pub async fn reserve_once<R: idempotency_core::Repository + ?Sized>(
    repo: &R,
    id: &str,
) -> Result<(), Error> {
    use idempotency_core::{Clock, OwnerToken, RecordKey, ReserveRequest, SystemClock};
    use std::time::Duration;
    let key = RecordKey::new("errors", id, 256)?;
    let now = SystemClock.now();
    repo.reserve(ReserveRequest {
        key: &key,
        owner: OwnerToken::random(),
        fingerprint: None,
        now,
        lease_until: now + Duration::from_secs(60),
        expires_at: now + Duration::from_secs(120),
        retry_failed: false,
        clock_skew: Duration::ZERO,
    })
    .await
    .map(drop)
}

/// A local port nobody listens on (bound, then released).
///
/// # Panics
/// When no local port can be bound.
#[allow(clippy::expect_used)]
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
    listener.local_addr().expect("its address").port()
}

/// Variations of a server URL for the rows that a URL alone decides.
#[cfg(feature = "containers")]
pub mod url_with {
    /// `url` changed by `change`; `url` itself when it does not parse.
    fn edit(url: &str, change: impl FnOnce(&mut url::Url)) -> String {
        match url::Url::parse(url) {
            Ok(mut parsed) => {
                change(&mut parsed);
                parsed.into()
            }
            Err(_) => url.to_owned(),
        }
    }

    /// `url` with its password replaced.
    pub fn password(url: &str, password: &str) -> String {
        edit(url, |u| {
            let _ = u.set_password(Some(password));
        })
    }

    /// `url` with its path (the database) replaced.
    pub fn path(url: &str, path: &str) -> String {
        edit(url, |u| u.set_path(path))
    }

    /// `url` with its port replaced.
    pub fn port(url: &str, port: u16) -> String {
        edit(url, |u| {
            let _ = u.set_port(Some(port));
        })
    }

    /// `url` with `query` appended to its query string.
    pub fn query(url: &str, query: &str) -> String {
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}{query}")
    }
}

/// A local server at `127.0.0.1` that answers every connection as an HTTP
/// server would (`400 Bad Request`): a URL pointing at the wrong service.
/// Returns its port; it serves at most 64 connections, then stops.
///
/// # Errors
/// When no local port can be bound.
#[cfg(feature = "containers")]
pub async fn foreign_service() -> std::io::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        for _ in 0..64 {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = socket.read(&mut buf).await;
                let _ = socket
                    .write_all(
                        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    )
                    .await;
            });
        }
    });
    Ok(port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_of_the_wrong_class_or_wording_is_reported() {
        let wrong_class = ErrorRow::new(
            "x",
            Err::<(), _>(Error::config("bad")),
            Expected::Outage,
            &[],
        );
        assert!(wrong_class.problem().is_some());
        let silent = ErrorRow::new(
            "y",
            Err::<(), _>(Error::config("bad")),
            Expected::Config,
            &["password"],
        );
        assert!(silent.problem().is_some_and(|p| p.contains("password")));
        let ok = ErrorRow::new("z", Ok(()), Expected::Config, &[]);
        assert_eq!(ok.problem().as_deref(), Some("succeeded"));
        let fine = ErrorRow::new(
            "w",
            Err::<(), _>(Error::config("wrong PASSWORD")),
            Expected::Config,
            &["password"],
        );
        assert_eq!(fine.problem(), None);
    }
}
