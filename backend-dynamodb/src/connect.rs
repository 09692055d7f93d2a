//! Building a repository from a URL or the environment, and creating its table.

use std::time::Duration;

use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_dynamodb::client::Waiters;
use aws_sdk_dynamodb::config::{Credentials, SharedHttpClient};
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    TimeToLiveSpecification, TimeToLiveStatus,
};
use idempotency_core::Error;
use url::Url;

use crate::error::{map_sdk_error, BACKEND};
use crate::item::AttributeNames;
use crate::repository::DynamoDbRepository;

/// How long [`DynamoDbRepository::create_table`] waits for the table to become
/// `ACTIVE`.
const TABLE_ACTIVE_MAX_WAIT: Duration = Duration::from_secs(120);

/// The connect timeout the SDK uses by default (behavior version 2024-03-28+).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(3100);

/// The default bound on each operation, retries included, where neither the
/// URL (`timeout=`) nor the client sets one: as Redis's response timeout and
/// the manager's `store_timeout`.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// The region used with an endpoint override when none is configured.
const EMULATOR_REGION: &str = "us-east-1";

/// Connects to the DynamoDB table a `dynamodb://` URL names.
///
/// ```text
/// dynamodb://TABLE?region=eu-west-1
/// dynamodb://TABLE?region=us-east-1&endpoint=http://127.0.0.1:8000&create_table=true
/// ```
///
/// | query option | meaning | default |
/// |---|---|---|
/// | `region` | AWS region | the default chain (`AWS_REGION`, profile, IMDS); with `endpoint`: `AWS_REGION`/`AWS_DEFAULT_REGION`, else `us-east-1` |
/// | `endpoint` | endpoint override, e.g. a local emulator (`http://…` works without the `tls` feature) | AWS's regional endpoint (or `AWS_ENDPOINT_URL_DYNAMODB`) |
/// | `credentials` | `default` (the SDK's default chain), `dummy` (static dummy keys, for emulators), `auto` | `auto`: `dummy` when `endpoint` is set and no `AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, web identity or container credentials are configured in the environment, else `default` |
/// | `create_table` | `true`: create the table (on-demand, TTL on) if missing, see [`DynamoDbRepository::create_table`] | `false` |
/// | `partition_key` | the partition key attribute | `pk` |
/// | `ttl_attribute` | the TTL attribute | `ttl` |
/// | `timeout` | per-operation timeout, retries included (`500ms`, `5s`; zero is refused) | `5s` ([`DEFAULT_OPERATION_TIMEOUT`]) |
///
/// Credentials otherwise come from the SDK's default chain (environment,
/// profile, web identity, ECS, IMDS).
///
/// # Errors
/// [`Error::Config`] for a malformed URL, an unknown option, a missing region,
/// an `https` endpoint without the `tls` feature, or a plain-HTTP endpoint
/// where another service listens (it closes connections without an HTTP
/// answer, or answers something else); errors of
/// [`DynamoDbRepository::create_table`] with `create_table=true`.
pub async fn connect(url: &str) -> Result<DynamoDbRepository, Error> {
    DynamoDbRepository::from_url(url).await
}

/// Refuses a plain-HTTP endpoint where another service listens: one that
/// closes the connection without answering an HTTP request (Redis does), or
/// answers something that is not HTTP (a database's greeting). Its requests
/// would fail as outages, retryable, for ever. An endpoint that cannot be
/// reached now is left to the operations (an outage, not a misconfiguration);
/// an `https` endpoint is not probed (its TLS handshake would fail the same
/// way and is reported by the SDK).
async fn refuse_another_service(endpoint: &str) -> Result<(), Error> {
    let Ok(parsed) = Url::parse(endpoint) else {
        return Ok(());
    };
    let (Some(host), Some(port), "http") = (
        parsed.host_str(),
        parsed.port_or_known_default(),
        parsed.scheme(),
    ) else {
        return Ok(());
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let hello = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let speaks_http = |reply: &[u8]| reply.starts_with(b"HTTP/");
    match idempotency_core::probe::foreign_service(
        host,
        port,
        hello.as_bytes(),
        CONNECT_TIMEOUT,
        speaks_http,
    )
    .await
    {
        Some(seen) => Err(Error::config(format!(
            "the DynamoDB endpoint {endpoint} accepts connections but is not an HTTP server \
             ({seen}): another service listens there; check the endpoint's port"
        ))),
        None => Ok(()),
    }
}

/// Credentials for a URL connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CredentialsMode {
    Auto,
    Default,
    Dummy,
}

/// The parsed `dynamodb://` URL.
#[derive(Debug, Clone, PartialEq)]
struct UrlOptions {
    table: String,
    region: Option<String>,
    endpoint: Option<String>,
    credentials: CredentialsMode,
    create_table: bool,
    names: AttributeNames,
    timeout: Option<Duration>,
}

fn parse_url(raw: &str) -> Result<UrlOptions, Error> {
    let bad = |why: String| Error::config(format!("invalid DynamoDB URL {raw:?}: {why}"));
    let url = Url::parse(raw).map_err(|e| bad(e.to_string()))?;
    if url.scheme() != "dynamodb" {
        return Err(bad(format!(
            "the scheme is `{}`, expected `dynamodb`",
            url.scheme()
        )));
    }
    let table = url.host_str().unwrap_or_default().to_owned();
    validate_table_name(&table).map_err(bad)?;
    if !matches!(url.path(), "" | "/") {
        return Err(bad(
            "the table goes in the host part: dynamodb://TABLE?region=…".into(),
        ));
    }
    if !url.username().is_empty() || url.password().is_some() || url.port().is_some() {
        return Err(bad(
            "no user, password or port: dynamodb://TABLE?region=…".into()
        ));
    }
    let mut opts = UrlOptions {
        table,
        region: None,
        endpoint: None,
        credentials: CredentialsMode::Auto,
        create_table: false,
        names: AttributeNames::default(),
        timeout: None,
    };
    for (k, v) in url.query_pairs() {
        match &*k {
            "region" if !v.is_empty() => opts.region = Some(v.into_owned()),
            "endpoint" => {
                let endpoint = Url::parse(&v).map_err(|e| bad(format!("endpoint {v:?}: {e}")))?;
                if !matches!(endpoint.scheme(), "http" | "https") {
                    return Err(bad(format!("endpoint {v:?} is not http:// or https://")));
                }
                opts.endpoint = Some(v.into_owned());
            }
            "credentials" => {
                opts.credentials = match &*v {
                    "auto" => CredentialsMode::Auto,
                    "default" => CredentialsMode::Default,
                    "dummy" => CredentialsMode::Dummy,
                    other => {
                        return Err(bad(format!(
                            "credentials={other}: expected `auto`, `default` or `dummy`"
                        )))
                    }
                }
            }
            "create_table" => {
                opts.create_table = match &*v {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    other => {
                        return Err(bad(format!("create_table={other}: expected true or false")))
                    }
                }
            }
            "partition_key" => opts.names.partition_key = v.into_owned(),
            "ttl_attribute" => opts.names.ttl = v.into_owned(),
            "timeout" => {
                opts.timeout = Some(
                    idempotency_core::parse_duration(&v)
                        .filter(|d| !d.is_zero())
                        .ok_or_else(|| bad(format!("timeout={v}: expected e.g. 500ms or 5s")))?,
                );
            }
            other => {
                return Err(bad(format!(
                    "unknown option `{other}` (known: region, endpoint, credentials, create_table, \
                     partition_key, ttl_attribute, timeout)"
                )))
            }
        }
    }
    opts.names.validate()?;
    Ok(opts)
}

/// DynamoDB table names: 3 to 255 characters of `A-Z a-z 0-9 _ - .`.
fn validate_table_name(table: &str) -> Result<(), String> {
    let ok_chars = table
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if (3..=255).contains(&table.len()) && ok_chars {
        Ok(())
    } else {
        Err(format!(
            "table name {table:?} is not 3 to 255 characters of A-Z, a-z, 0-9, `_`, `-`, `.`"
        ))
    }
}

/// `client` with what this crate needs and it lacks: an HTTP client (without
/// one, every request fails with "No HTTP client was available"), and the
/// default operation timeout unless the client sets or disables one.
pub(crate) fn with_defaults(client: aws_sdk_dynamodb::Client) -> aws_sdk_dynamodb::Client {
    let config = client.config();
    let own = config
        .timeout_config()
        .cloned()
        .unwrap_or_else(|| TimeoutConfig::builder().build());
    // What the client set (or explicitly disabled) wins over the defaults.
    let timeouts = own
        .to_builder()
        .take_unset_from(
            TimeoutConfig::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .operation_timeout(DEFAULT_OPERATION_TIMEOUT),
        )
        .build();
    if config.http_client().is_some() && timeouts == own {
        return client;
    }
    let mut builder = config.to_builder().timeout_config(timeouts);
    if config.http_client().is_none() {
        builder = builder.http_client(http_client());
    }
    aws_sdk_dynamodb::Client::from_conf(builder.build())
}

/// The HTTP client: rustls with `ring` with the `tls` feature, plain HTTP
/// without it.
fn http_client() -> SharedHttpClient {
    #[cfg(feature = "tls")]
    {
        use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
        aws_smithy_http_client::Builder::new()
            .tls_provider(Provider::Rustls(CryptoMode::Ring))
            .build_https()
    }
    #[cfg(not(feature = "tls"))]
    {
        aws_smithy_http_client::Builder::new().build_http()
    }
}

/// Whether credentials are configured in the environment for the default chain.
fn env_has_credentials() -> bool {
    [
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

fn env_region() -> Option<String> {
    ["AWS_REGION", "AWS_DEFAULT_REGION"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
}

impl DynamoDbRepository {
    /// Connects as [`connect`] describes.
    ///
    /// # Errors
    /// As [`connect`].
    pub async fn from_url(url: &str) -> Result<Self, Error> {
        let opts = parse_url(url)?;
        let endpoint_is_https = opts
            .endpoint
            .as_deref()
            .is_none_or(|e| e.starts_with("https:"));
        if endpoint_is_https && !cfg!(feature = "tls") {
            return Err(Error::config(format!(
                "DynamoDB URL {url:?} needs HTTPS: enable the `tls` feature of idempotency-dynamodb \
                 (plain http:// endpoints such as local emulators work without it)"
            )));
        }
        let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http_client());
        let region = match (&opts.region, &opts.endpoint) {
            (Some(r), _) => Some(r.clone()),
            (None, Some(_)) => Some(env_region().unwrap_or_else(|| EMULATOR_REGION.to_owned())),
            (None, None) => None,
        };
        if let Some(region) = region {
            loader = loader.region(Region::new(region));
        }
        if let Some(endpoint) = &opts.endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        let dummy = match opts.credentials {
            CredentialsMode::Dummy => true,
            CredentialsMode::Default => false,
            CredentialsMode::Auto => opts.endpoint.is_some() && !env_has_credentials(),
        };
        if dummy {
            loader = loader.credentials_provider(Credentials::new(
                "dummy",
                "dummy",
                None,
                None,
                "idempotency-dynamodb-dummy",
            ));
        }
        if let Some(timeout) = opts.timeout {
            loader = loader.timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(CONNECT_TIMEOUT)
                    .operation_timeout(timeout)
                    .build(),
            );
        }
        let sdk_config = loader.load().await;
        if sdk_config.region().is_none() {
            return Err(Error::config(format!(
                "no AWS region for DynamoDB URL {url:?}: add `?region=…` or set AWS_REGION"
            )));
        }
        if let Some(endpoint) = &opts.endpoint {
            refuse_another_service(endpoint).await?;
        }
        let repo = DynamoDbRepository::from_sdk_config(&sdk_config, opts.table)
            .with_attribute_names(opts.names)?;
        if opts.create_table {
            repo.create_table().await?;
        }
        Ok(repo)
    }

    /// A repository on `table` configured from the environment by the SDK's
    /// default chain: region (`AWS_REGION`, profile, IMDS), credentials
    /// (environment, profile, web identity, ECS, IMDS) and endpoint
    /// (`AWS_ENDPOINT_URL_DYNAMODB`, `AWS_ENDPOINT_URL`), with this crate's HTTP
    /// client (HTTPS with the `tls` feature, plain HTTP without).
    ///
    /// # Errors
    /// [`Error::Config`] when no region is configured.
    pub async fn from_env(table: impl Into<String>) -> Result<Self, Error> {
        let sdk_config = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http_client())
            .load()
            .await;
        if sdk_config.region().is_none() {
            return Err(Error::config(
                "no AWS region configured for DynamoDB: set AWS_REGION (or a profile's region)",
            ));
        }
        Ok(DynamoDbRepository::from_sdk_config(&sdk_config, table))
    }

    /// Creates the table if it does not exist — partition key
    /// [`AttributeNames::partition_key`] (String), no sort key, on-demand billing —
    /// waits until it is `ACTIVE`, and enables TTL on [`AttributeNames::ttl`].
    ///
    /// Meant for development and tests; in production create the table with
    /// infrastructure as code (see the crate docs). Safe to call concurrently and
    /// repeatedly.
    ///
    /// # Errors
    /// [`Error::Config`] when the table exists with another key schema or TTL
    /// attribute, or the credentials may not create tables; store errors as for
    /// any operation.
    pub async fn create_table(&self) -> Result<(), Error> {
        let pk = &self.names.partition_key;
        let build_err = |e: aws_sdk_dynamodb::error::BuildError| {
            Error::config(format!("CreateTable request for `{}`: {e}", self.table))
        };
        let created = self
            .client
            .create_table()
            .table_name(&*self.table)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(pk)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(build_err)?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(pk)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(build_err)?,
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        if let Err(err) = created {
            // ResourceInUseException: it exists or is being created.
            if !err
                .as_service_error()
                .is_some_and(|e| e.is_resource_in_use_exception())
            {
                return Err(map_sdk_error(err, self.ctx("CreateTable")));
            }
        }
        let table = self
            .client
            .wait_until_table_exists()
            .table_name(&*self.table)
            .wait(TABLE_ACTIVE_MAX_WAIT)
            .await
            .map_err(|e| {
                use aws_smithy_runtime_api::client::waiters::error::WaiterError;
                match e {
                    WaiterError::OperationFailed(failed) => {
                        map_sdk_error(failed.into_error(), self.ctx("DescribeTable"))
                    }
                    other => Error::Unavailable {
                        backend: BACKEND,
                        message: format!(
                            "table `{}` did not become ACTIVE: {}",
                            self.table,
                            DisplayErrorContext(&other)
                        ),
                        source: Some(Box::new(other)),
                    },
                }
            })?
            .into_result()
            .map_err(|e| map_sdk_error(e, self.ctx("DescribeTable")))?;
        let schema = table.table().map(|t| t.key_schema()).unwrap_or_default();
        let schema_ok = schema.len() == 1
            && schema[0].attribute_name() == pk
            && schema[0].key_type() == &KeyType::Hash;
        if !schema_ok {
            let found: Vec<String> = schema
                .iter()
                .map(|k| format!("{} ({})", k.attribute_name(), k.key_type().as_str()))
                .collect();
            return Err(Error::config(format!(
                "DynamoDB table `{}` has the key schema [{}]; this backend needs the single \
                 String partition key `{pk}` and no sort key",
                self.table,
                found.join(", ")
            )));
        }
        self.ensure_ttl().await
    }

    /// Enables TTL on the TTL attribute unless it is already.
    async fn ensure_ttl(&self) -> Result<(), Error> {
        let wanted = &self.names.ttl;
        for _ in 0..2 {
            let described = self
                .client
                .describe_time_to_live()
                .table_name(&*self.table)
                .send()
                .await
                .map_err(|e| map_sdk_error(e, self.ctx("DescribeTimeToLive")))?;
            let desc = described.time_to_live_description();
            let status = desc.and_then(|d| d.time_to_live_status());
            let attribute = desc.and_then(|d| d.attribute_name());
            match status {
                Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling) => {
                    return match attribute {
                        Some(a) if a != wanted => Err(Error::config(format!(
                            "DynamoDB table `{}` has TTL on `{a}`, not on `{wanted}`: set \
                             AttributeNames::ttl (or ?ttl_attribute=) to `{a}`",
                            self.table
                        ))),
                        _ => Ok(()),
                    };
                }
                Some(TimeToLiveStatus::Disabling) => {
                    return Err(Error::config(format!(
                        "TTL of DynamoDB table `{}` is being disabled; enable it on `{wanted}` later",
                        self.table
                    )));
                }
                _ => {}
            }
            let spec = TimeToLiveSpecification::builder()
                .enabled(true)
                .attribute_name(wanted)
                .build()
                .map_err(|e| Error::config(format!("UpdateTimeToLive request: {e}")))?;
            let updated = self
                .client
                .update_time_to_live()
                .table_name(&*self.table)
                .time_to_live_specification(spec)
                .send()
                .await;
            match updated {
                Ok(_) => return Ok(()),
                // A concurrent caller enabled it first ("TimeToLive is already
                // enabled"): describe again.
                Err(err)
                    if err.as_service_error().is_some_and(|e| {
                        aws_sdk_dynamodb::error::ProvideErrorMetadata::code(e)
                            == Some("ValidationException")
                    }) => {}
                Err(err) => return Err(map_sdk_error(err, self.ctx("UpdateTimeToLive"))),
            }
        }
        Err(Error::config(format!(
            "could not enable TTL on `{wanted}` of DynamoDB table `{}`",
            self.table
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let o = parse_url(
            "dynamodb://My_Table.v1-2?region=eu-west-1&endpoint=http://127.0.0.1:8000&create_table=true\
             &credentials=dummy&partition_key=id&ttl_attribute=expires&timeout=2s",
        )
        .unwrap();
        assert_eq!(o.table, "My_Table.v1-2");
        assert_eq!(o.region.as_deref(), Some("eu-west-1"));
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:8000"));
        assert!(o.create_table);
        assert_eq!(o.credentials, CredentialsMode::Dummy);
        assert_eq!(o.names.partition_key, "id");
        assert_eq!(o.names.ttl, "expires");
        assert_eq!(o.timeout, Some(Duration::from_secs(2)));

        let o = parse_url("dynamodb://idempotency").unwrap();
        assert_eq!((o.region, o.endpoint, o.create_table), (None, None, false));
        assert_eq!(o.credentials, CredentialsMode::Auto);
        assert_eq!(o.names, AttributeNames::default());
    }

    #[tokio::test]
    async fn clients_get_an_http_client_and_a_timeout_they_lack() {
        use aws_sdk_dynamodb::types::AttributeValue;
        let config = aws_sdk_dynamodb::Config::builder()
            .behavior_version_latest()
            .region(Region::new("eu-west-1"))
            .credentials_provider(Credentials::new("a", "b", None, None, "test"))
            .build();
        let bare = aws_sdk_dynamodb::Client::from_conf(config);
        // As the SDK builds it: no HTTP client, every request fails.
        let err = bare
            .get_item()
            .table_name("t")
            .key("pk", AttributeValue::S("x".into()))
            .send()
            .await
            .unwrap_err();
        let ctx = crate::error::Ctx {
            table: "t",
            partition_key: "pk",
            operation: "GetItem",
        };
        match map_sdk_error(err, ctx) {
            Error::Config { message } => assert!(message.contains("HTTP client"), "{message}"),
            other => panic!("{other:?}"),
        }
        // Through the repository: supplied, with the default operation timeout.
        let repo = DynamoDbRepository::from_client(bare, "t");
        let config = repo.client().config();
        assert!(config.http_client().is_some());
        let timeouts = config.timeout_config().unwrap();
        assert_eq!(
            timeouts.operation_timeout(),
            Some(DEFAULT_OPERATION_TIMEOUT)
        );

        // A client's own timeout, or its explicit "none", is kept.
        for own in [
            TimeoutConfig::builder()
                .operation_timeout(Duration::from_secs(42))
                .build(),
            TimeoutConfig::disabled(),
        ] {
            let config = aws_sdk_dynamodb::Config::builder()
                .behavior_version_latest()
                .region(Region::new("eu-west-1"))
                .timeout_config(own.clone())
                .build();
            let repo =
                DynamoDbRepository::from_client(aws_sdk_dynamodb::Client::from_conf(config), "t");
            let kept = repo
                .client()
                .config()
                .timeout_config()
                .unwrap()
                .operation_timeout();
            assert_eq!(kept, own.operation_timeout());
        }
    }

    #[test]
    fn rejects_bad_urls() {
        for bad in [
            "redis://table",
            "dynamodb://",
            "dynamodb://ab",
            "dynamodb://bad%20name",
            "dynamodb://table/extra",
            "dynamodb://user@table",
            "dynamodb://table:8000",
            "dynamodb://table?colour=blue",
            "dynamodb://table?create_table=maybe",
            "dynamodb://table?credentials=root",
            "dynamodb://table?endpoint=ftp://x",
            "dynamodb://table?timeout=soon",
            "dynamodb://table?timeout=0s",
            "dynamodb://table?partition_key=ttl",
            "dynamodb://table?partition_key=",
        ] {
            match parse_url(bad) {
                Err(Error::Config { message }) => {
                    assert!(message.contains("DynamoDB"), "{message}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
