//! The layer's own answers: what each says, in the words of its dialect
//! (HTTP requests and headers, gRPC calls and metadata), and which problem a
//! manager error becomes.

use http::{Method, StatusCode};
use idempotency_core::Error;

use crate::grpc::Dialect;
use crate::in_progress;
use crate::key::KeyError;
use crate::layer::Settings;
use crate::problem::{Problem, ProblemKind};

/// The nouns an answer uses.
struct Words {
    /// What the client sent: a request, a call.
    request: &'static str,
    /// What the server answered: a response, an answer.
    response: &'static str,
    /// What the fingerprint reads: the request body, the request message.
    body: &'static str,
    /// Where the retry hint is.
    hint: &'static str,
}

fn words(dialect: Dialect) -> Words {
    match dialect {
        Dialect::Http => Words {
            request: "request",
            response: "response",
            body: "request body",
            hint: "Retry-After",
        },
        Dialect::Grpc => Words {
            request: "call",
            response: "answer",
            body: "request message",
            hint: "grpc-retry-pushback-ms",
        },
    }
}

/// The route requires a key and the request has none.
pub(crate) fn missing_key(settings: &Settings, method: &Method, route: &str) -> Problem {
    let header = &settings.header;
    let detail = match settings.dialect {
        Dialect::Http => {
            format!("{method} {route} requires an {header} header with a unique key per request")
        }
        Dialect::Grpc => {
            format!("{route} requires `{header}` metadata with a unique key per call")
        }
    };
    Problem::new(ProblemKind::MissingKey, detail)
}

/// The key is malformed or refused.
pub(crate) fn invalid_key(settings: &Settings, error: &KeyError) -> Problem {
    let detail = match (settings.dialect, error) {
        (Dialect::Grpc, KeyError::Repeated) => format!(
            "the `{}` metadata entry appears more than once",
            settings.header
        ),
        _ => error.to_string(),
    };
    Problem::new(ProblemKind::InvalidKey, detail)
}

/// The body read for the fingerprint is over the limit.
pub(crate) fn body_too_large(settings: &Settings) -> Problem {
    let w = words(settings.dialect);
    let detail = format!(
        "a {} with an idempotency key may carry a {} of at most {} bytes",
        w.request, w.body, settings.max_request_body
    );
    Problem::new(ProblemKind::BodyTooLarge, detail)
}

/// The body read for the fingerprint failed.
pub(crate) fn unreadable_body(settings: &Settings) -> Problem {
    let w = words(settings.dialect);
    let detail = format!(
        "reading the {} failed before its end; send the {} again",
        w.body, w.request
    );
    Problem::new(ProblemKind::UnreadableBody, detail)
}

/// The request ran, but the layer has no response to give.
pub(crate) fn no_response(settings: &Settings) -> Problem {
    let w = words(settings.dialect);
    let detail = format!("the {} ran but produced no {}", w.request, w.response);
    Problem::new(ProblemKind::StoreError, detail)
}

/// The answer to a retry whose first response was not kept; `outcome` names
/// it in the dialect (`status 201`, `grpc-status 0`) when known.
pub(crate) fn not_retained(dialect: Dialect, outcome: Option<(StatusCode, String)>) -> Problem {
    let w = words(dialect);
    let processed = match &outcome {
        Some((_, outcome)) => format!("a {} with this key was processed ({outcome})", w.request),
        None => format!("a {} with this key was processed", w.request),
    };
    let why = match outcome {
        Some(_) => " (too large, too slow or broken while read)",
        None => "",
    };
    let detail = format!(
        "{processed}, but its {} was not kept{why} and cannot be replayed; send a new {} with a \
         new key",
        w.response, w.request
    );
    let problem = Problem::new(ProblemKind::ResponseNotRetained, detail);
    match outcome {
        Some((status, _)) => problem.with_original_status(status),
        None => problem,
    }
}

/// The problem a manager error answers; an in-progress key is looked up to
/// estimate when its holder is done.
pub(crate) async fn problem_for(
    settings: &Settings,
    route: &str,
    id: &str,
    error: Error,
) -> Problem {
    let w = words(settings.dialect);
    match error {
        Error::InProgress { retry_after, .. } => {
            let after = in_progress::retry_hint(settings, id, retry_after).await;
            let detail = format!(
                "a {} with this key is being processed; retry after the time in {}",
                w.request, w.hint
            );
            Problem::new(ProblemKind::InProgress, detail).with_retry_after(after)
        }
        Error::PayloadMismatch { .. } => Problem::new(
            ProblemKind::KeyReused,
            format!(
                "this key was used before with a different {}; use a new key for a new {}",
                w.request, w.request
            ),
        ),
        // The layer never stores a failure (every failure releases the key):
        // something else sharing the manager's namespace stored this one.
        Error::PreviouslyFailed { .. } => {
            tracing::warn!(route = %route, "a failure stored under this key by another writer");
            Problem::new(
                ProblemKind::StoreError,
                "an earlier attempt with this key failed and its failure is stored; it is not \
                 run again: use a new key",
            )
        }
        e @ (Error::Codec { .. } | Error::Corrupt { .. }) => {
            tracing::error!(route = %route, error = %e, "a stored response could not be read back");
            Problem::new(
                ProblemKind::StoredResponseUnreadable,
                format!(
                    "the stored {} to this key could not be read back",
                    w.response
                ),
            )
        }
        e if e.is_store_outage() => {
            tracing::error!(route = %route, error = %e, "idempotency store unavailable (fail-closed)");
            Problem::new(
                ProblemKind::StoreUnavailable,
                format!(
                    "the idempotency store is unavailable; the {} was not processed",
                    w.request
                ),
            )
            .with_retry_after(settings.outage_retry_after)
        }
        // Includes `InvalidKey`: the layer validated the key, so only the
        // manager's namespace (configuration) can be at fault.
        e => {
            tracing::error!(route = %route, error = %e, "idempotency store error");
            Problem::new(
                ProblemKind::StoreError,
                format!(
                    "the idempotency store failed; the {} was not processed",
                    w.request
                ),
            )
        }
    }
}
