//! Mapping SDK errors to the core's [`Error`].

use aws_credential_types::provider::error::CredentialsError;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_smithy_runtime_api::client::endpoint::error::ResolveEndpointError;
use idempotency_core::Error;

use crate::item::Item;

/// The backend's name in errors, metrics and [`idempotency_core::Capabilities`].
pub(crate) const BACKEND: &str = "dynamodb";

/// Where an error happened, to name it precisely.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx<'a> {
    /// The table.
    pub(crate) table: &'a str,
    /// The partition key attribute.
    pub(crate) partition_key: &'a str,
    /// The DynamoDB operation (`PutItem`, …).
    pub(crate) operation: &'static str,
}

/// An operation error that may be a failed condition carrying the old item
/// (`ReturnValuesOnConditionCheckFailure = ALL_OLD`).
pub(crate) trait ConditionalError: Sized {
    fn is_conditional_check_failed(&self) -> bool;
    fn into_old_item(self) -> Option<Item>;
}

macro_rules! conditional_error {
    ($($ty:ident),*) => {$(
        impl ConditionalError for $ty {
            fn is_conditional_check_failed(&self) -> bool {
                matches!(self, $ty::ConditionalCheckFailedException(_))
            }
            fn into_old_item(self) -> Option<Item> {
                match self {
                    $ty::ConditionalCheckFailedException(e) => e.item,
                    _ => None,
                }
            }
        }
    )*};
}

conditional_error!(PutItemError, UpdateItemError, DeleteItemError);

/// The outcome of a failed conditional write.
#[derive(Debug)]
pub(crate) enum WriteFailure {
    /// The condition did not hold; the item as it was, if one was stored.
    Condition(Option<Item>),
    /// Anything else.
    Error(Error),
}

/// Splits a conditional write's error into a failed condition or an error.
pub(crate) fn classify<E>(err: SdkError<E, HttpResponse>, ctx: Ctx<'_>) -> WriteFailure
where
    E: ConditionalError + ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match err {
        SdkError::ServiceError(service) if service.err().is_conditional_check_failed() => {
            WriteFailure::Condition(service.into_err().into_old_item())
        }
        other => WriteFailure::Error(map_sdk_error(other, ctx)),
    }
}

/// Error codes DynamoDB answers when it is overloaded or briefly failing: a retry
/// later may succeed.
const RETRYABLE_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "InternalServerError",
    "InternalFailure",
    "ServiceUnavailable",
    "TransactionConflictException",
    "ReplicatedWriteConflictException",
];

/// Error codes of missing or invalid credentials.
const CREDENTIAL_CODES: &[&str] = &[
    "UnrecognizedClientException",
    "AccessDeniedException",
    "InvalidSignatureException",
    "MissingAuthenticationToken",
    "MissingAuthenticationTokenException",
    "IncompleteSignature",
    "IncompleteSignatureException",
    "InvalidClientTokenId",
    "ExpiredTokenException",
];

/// Maps any SDK error: throttling, 5xx, dispatch failures → [`Error::Unavailable`];
/// timeouts → [`Error::Timeout`]; missing table, validation and credential errors
/// → [`Error::Config`] naming the table; the rest → [`Error::Backend`].
pub(crate) fn map_sdk_error<E>(err: SdkError<E, HttpResponse>, ctx: Ctx<'_>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let detail = DisplayErrorContext(&err).to_string();
    let Ctx {
        table,
        partition_key,
        operation,
    } = ctx;
    match &err {
        SdkError::TimeoutError(_) => Error::Timeout {
            backend: BACKEND,
            operation,
        },
        SdkError::DispatchFailure(d) if d.is_timeout() => Error::Timeout {
            backend: BACKEND,
            operation,
        },
        SdkError::DispatchFailure(d) if d.is_user() => Error::config(format!(
            "DynamoDB {operation} on table `{table}` could not be sent: {detail}"
        )),
        SdkError::DispatchFailure(d) if d.is_other() => {
            match d.as_connector_error().and_then(|c| cause_before_sending(c)) {
                Some(Cause::Config(what)) => Error::config(format!(
                    "DynamoDB {operation} on table `{table}` could not be sent ({what}): {detail}"
                )),
                Some(Cause::Timeout) => Error::Timeout {
                    backend: BACKEND,
                    operation,
                },
                None => unavailable(
                    format!("{operation} on table `{table}` failed: {detail}"),
                    err,
                ),
            }
        }
        SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => unavailable(
            format!("{operation} on table `{table}` failed: {detail}"),
            err,
        ),
        SdkError::ConstructionFailure(_) => Error::config(format!(
            "DynamoDB {operation} on table `{table}` could not be built \
             (region, endpoint or credentials missing?): {detail}"
        )),
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or_default();
            let message = service.err().message().unwrap_or_default().to_owned();
            let http_status = service.raw().status().as_u16();
            // 408 and 429 say "later" whoever sends them (a proxy, a gateway).
            if RETRYABLE_CODES.contains(&code)
                || http_status >= 500
                || matches!(http_status, 408 | 429)
            {
                unavailable(
                    format!(
                        "{operation} on table `{table}`: {code} (HTTP {http_status}) {message}"
                    ),
                    err,
                )
            } else if code == "ResourceNotFoundException" {
                Error::config(format!(
                    "DynamoDB table `{table}` does not exist or is not ACTIVE ({operation}: {message}); \
                     create it with `DynamoDbRepository::create_table`, `?create_table=true` in the \
                     URL, or infrastructure as code (partition key `{partition_key}` of type String)"
                ))
            } else if code == "ValidationException" && is_item_too_large(&message) {
                Error::TooLarge {
                    what: "item",
                    size: crate::item::ITEM_LIMIT_BYTES + 1,
                    max: crate::item::ITEM_LIMIT_BYTES,
                }
            } else if code == "ValidationException" {
                Error::config(format!(
                    "DynamoDB rejected {operation} on table `{table}`: {message} (the table must have \
                     the String partition key `{partition_key}` and no sort key)"
                ))
            } else if code.is_empty() {
                Error::config(format!(
                    "DynamoDB {operation} on table `{table}`: the endpoint answered HTTP \
                     {http_status} without a DynamoDB error code; is it a DynamoDB endpoint? \
                     ({message})"
                ))
            } else if CREDENTIAL_CODES.contains(&code) {
                Error::config(format!(
                    "DynamoDB refused the credentials for {operation} on table `{table}`: {code} {message}"
                ))
            } else {
                Error::Backend {
                    backend: BACKEND,
                    message: format!(
                        "{operation} on table `{table}`: {code} (HTTP {http_status}) {message}"
                    ),
                    source: Some(Box::new(err)),
                }
            }
        }
        _ => Error::Backend {
            backend: BACKEND,
            message: format!("{operation} on table `{table}`: {detail}"),
            source: Some(Box::new(err)),
        },
    }
}

/// DynamoDB's (and emulators') words for an item over the 400 KB limit: "Item
/// size has exceeded the maximum allowed size", "Item size to update has
/// exceeded the maximum allowed size".
fn is_item_too_large(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("item size") && m.contains("exceeded")
}

/// Why a request failed before it was sent, when the error chain tells.
enum Cause {
    /// Misconfiguration: no credentials, no region, an invalid profile.
    Config(&'static str),
    /// The credentials provider timed out.
    Timeout,
}

/// Walks the error chain for the credential provider's and the endpoint
/// resolver's errors, which the SDK reports as dispatch failures.
fn cause_before_sending(err: &(dyn std::error::Error + 'static)) -> Option<Cause> {
    let mut current = Some(err);
    while let Some(e) = current {
        if let Some(c) = e.downcast_ref::<CredentialsError>() {
            return match c {
                CredentialsError::CredentialsNotLoaded(_) => {
                    Some(Cause::Config("no AWS credentials"))
                }
                CredentialsError::InvalidConfiguration(_) => {
                    Some(Cause::Config("invalid AWS credentials configuration"))
                }
                CredentialsError::ProviderTimedOut(_) => Some(Cause::Timeout),
                // The default chain ended at an instance metadata service that
                // refuses to issue a session token (IMDS disabled, or a hop
                // limit a container cannot reach): it will refuse every time.
                // (An unreachable IMDS is already `CredentialsNotLoaded`.)
                CredentialsError::ProviderError(_) if imds_refused_token(c) => Some(Cause::Config(
                    "no AWS credentials: none in the environment or profile, and the \
                     instance metadata service (IMDS) refused to issue any",
                )),
                // Other provider errors (an STS 503, an IMDS 500) may pass.
                _ => None,
            };
        }
        // The orchestrator's words when the SDK client has no HTTP client
        // (its `default-https-client` feature off and none configured); the
        // error has no type of its own.
        if e.to_string().contains("No HTTP client was available") {
            return Some(Cause::Config(
                "no HTTP client on the SDK client: configure one, or build the repository \
                 with DynamoDbRepository::from_client, which supplies one",
            ));
        }
        // The generated resolver's error type, and the runtime's.
        if e.is::<aws_smithy_http::endpoint::ResolveEndpointError>()
            || e.is::<ResolveEndpointError>()
        {
            return Some(Cause::Config(
                "no endpoint: region or endpoint missing or invalid",
            ));
        }
        current = e.source();
    }
    None
}

/// Whether `err`'s chain holds IMDS refusing a session token (not a failure
/// to reach it, which may pass).
fn imds_refused_token(err: &(dyn std::error::Error + 'static)) -> bool {
    use aws_config::imds::client::error::ImdsError;
    let mut current = Some(err);
    while let Some(e) = current {
        if let Some(ImdsError::FailedToLoadToken(token)) = e.downcast_ref::<ImdsError>() {
            return !token.is_dispatch_failure();
        }
        current = e.source();
    }
    false
}

fn unavailable<E>(message: String, err: SdkError<E, HttpResponse>) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    Error::Unavailable {
        backend: BACKEND,
        message,
        source: Some(Box::new(err)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn item_size_messages_are_recognised() {
        for m in [
            "Item size has exceeded the maximum allowed size",
            "Item size to update has exceeded the maximum allowed size",
        ] {
            assert!(super::is_item_too_large(m), "{m}");
        }
        assert!(!super::is_item_too_large(
            "One or more parameter values were invalid"
        ));
    }

    use aws_sdk_dynamodb::config::http::HttpResponse;
    use aws_sdk_dynamodb::error::ErrorMetadata;
    use aws_sdk_dynamodb::operation::get_item::GetItemError;
    use aws_smithy_types::body::SdkBody;

    const CTX: Ctx<'static> = Ctx {
        table: "orders",
        partition_key: "pk",
        operation: "GetItem",
    };

    fn service(code: &str, status: u16) -> Error {
        let meta = ErrorMetadata::builder().code(code).message("boom").build();
        let err = GetItemError::generic(meta);
        let raw = HttpResponse::new(
            aws_smithy_runtime_api::http::StatusCode::try_from(status).unwrap(),
            SdkBody::empty(),
        );
        map_sdk_error(SdkError::service_error(err, raw), CTX)
    }

    #[test]
    fn service_errors_map_by_code_and_status() {
        for code in RETRYABLE_CODES {
            assert!(
                matches!(service(code, 400), Error::Unavailable { .. }),
                "{code}"
            );
        }
        assert!(matches!(
            service("Whatever", 503),
            Error::Unavailable { .. }
        ));
        match service("ResourceNotFoundException", 400) {
            Error::Config { message } => assert!(message.contains("`orders`"), "{message}"),
            other => panic!("{other:?}"),
        }
        match service("ValidationException", 400) {
            Error::Config { message } => {
                assert!(
                    message.contains("`orders`") && message.contains("`pk`"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            service("UnrecognizedClientException", 400),
            Error::Config { .. }
        ));
        assert!(matches!(
            service("SomethingNew", 400),
            Error::Backend { .. }
        ));
        // A 4xx without a DynamoDB error code: not a DynamoDB endpoint; but a
        // 429 or 408 (a proxy's or gateway's "later") stays retryable.
        assert!(matches!(service("", 429), Error::Unavailable { .. }));
        assert!(matches!(service("", 408), Error::Unavailable { .. }));
        match service("", 404) {
            Error::Config { message } => {
                assert!(message.contains("DynamoDB endpoint"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn timeouts_and_dispatch_failures_are_retryable() {
        let timeout: SdkError<GetItemError, HttpResponse> =
            SdkError::timeout_error("operation timeout");
        assert!(matches!(
            map_sdk_error(timeout, CTX),
            Error::Timeout {
                operation: "GetItem",
                ..
            }
        ));
        let io = SdkError::<GetItemError, HttpResponse>::dispatch_failure(
            aws_sdk_dynamodb::error::ConnectorError::io("connection refused".into()),
        );
        let mapped = map_sdk_error(io, CTX);
        assert!(mapped.is_retryable(), "{mapped:?}");
    }
}
