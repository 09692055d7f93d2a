//! The one error type of the harness.

use std::fmt;
use std::time::Duration;

use super::docker::Kind;

/// Why the harness could not hand out a server.
///
/// The messages are written for the person who runs the tests: each one says
/// how to give the tests a server (a Docker engine, baked images, or the URL of
/// an existing server). Tests are expected to `.expect()` the result, so a
/// missing server fails the test loudly instead of skipping it; `Debug` prints
/// the same text as `Display`, so those instructions are what `.expect()` shows.
#[derive(Clone, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// Neither a reachable Docker engine nor the environment variable naming an
    /// existing server.
    #[error("{}", docker_unavailable_message(kind, reason))]
    DockerUnavailable {
        /// `redis`, `postgres` or `dynamodb`.
        kind: &'static str,
        /// What went wrong talking to Docker.
        reason: String,
    },

    /// The image is neither present locally nor pullable.
    #[error("{}", image_unavailable_message(kind, image, reason))]
    ImageUnavailable {
        /// `redis`, `postgres` or `dynamodb`.
        kind: &'static str,
        /// The image that was asked for.
        image: String,
        /// The pull error.
        reason: String,
    },

    /// Docker refused or failed to run the container.
    #[error("starting a {kind} container from `{image}` failed: {reason}")]
    Container {
        /// `redis`, `postgres` or `dynamodb`.
        kind: &'static str,
        /// The image.
        image: String,
        /// Docker's error.
        reason: String,
    },

    /// The server did not answer its client before the deadline.
    #[error(
        "the {kind} server at {target} did not answer within {}s; last error: {last_error}",
        waited.as_secs()
    )]
    NotReady {
        /// `redis`, `postgres` or `dynamodb`.
        kind: &'static str,
        /// Address or URL that was probed.
        target: String,
        /// How long the harness waited.
        waited: Duration,
        /// The last probe failure.
        last_error: String,
    },

    /// An environment variable naming a server is malformed or its server is unusable.
    #[error("{variable}={value}: {reason}")]
    External {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },

    /// An operation on a running server or container failed (creating a schema,
    /// stopping or starting a dedicated container, a raw command).
    #[error("{operation}: {reason}")]
    Operation {
        /// What was attempted.
        operation: String,
        /// Why it failed.
        reason: String,
    },
}

impl fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl HarnessError {
    pub(crate) fn docker_unavailable(kind: Kind, reason: impl Into<String>) -> Self {
        HarnessError::DockerUnavailable {
            kind: kind.name(),
            reason: reason.into(),
        }
    }

    pub(crate) fn operation(operation: impl Into<String>, reason: impl ToString) -> Self {
        HarnessError::Operation {
            operation: operation.into(),
            reason: reason.to_string(),
        }
    }
}

fn kind_named(name: &str) -> Kind {
    match name {
        "postgres" => Kind::Postgres,
        "dynamodb" => Kind::DynamoDb,
        "mariadb" => Kind::MariaDb,
        "sqs" => Kind::Sqs,
        "rabbitmq" => Kind::RabbitMq,
        _ => Kind::Redis,
    }
}

fn docker_unavailable_message(kind: &str, reason: &str) -> String {
    let kind = kind_named(kind);
    format!(
        "no {name} server for the tests: Docker is not reachable ({reason}) and {variable} is not set.\n\
         Give the tests a server in one of these ways:\n\
         \x20 - run a Docker engine: the harness starts `{image}` with testcontainers (no registry? \
         `scripts/bake-images.sh` bakes `{baked}` from Debian packages and \
         `{image_variable}={baked}` selects it; `scripts/test.sh` does both);\n\
         \x20 - or point the tests at a running server: {variable}={example}",
        name = kind.name(),
        variable = kind.external_variable(),
        image = kind.image(),
        baked = kind.baked_image(),
        image_variable = kind.image_variable(),
        example = kind.external_example(),
    )
}

fn image_unavailable_message(kind: &str, image: &str, reason: &str) -> String {
    let kind = kind_named(kind);
    format!(
        "cannot start a {name} container: image `{image}` is not present locally and could not be \
         pulled ({reason}).\n\
         Without registry access, bake it from Debian packages with `scripts/bake-images.sh` and \
         set {image_variable}={baked} (`scripts/test.sh` does both); or set {variable} to use a \
         running server instead.",
        name = kind.name(),
        baked = kind.baked_image(),
        image_variable = kind.image_variable(),
        variable = kind.external_variable(),
    )
}
