//! The operator operations ([`Admin`]) of the DynamoDB store: listing and
//! sampled counts by paginated `Scan` (strongly consistent pages, never a
//! table-wide lock), the table and its TTL as migrations, and a check of the
//! table's settings.

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{
    AttributeValue, BillingMode, KeyType, TableStatus, TimeToLiveStatus,
};
use idempotency_core::admin::{Admin, Check, DoctorOptions, ListFilter, Listing, Stats};
use idempotency_core::{Error, Record, RecordKey, Timestamp};

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use aws_sdk_dynamodb::config::interceptors::BeforeDeserializationInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::error::BoxError;
use idempotency_core::{Clock, SystemClock};

use crate::error::map_sdk_error;
use crate::item::{item_to_record, Item};
use crate::DynamoDbRepository;

/// Items asked per `Scan` page.
const PAGE: i32 = 500;
/// Items `stats` looks at before it reports a sample instead of all.
const STATS_SAMPLE: usize = 10_000;

/// Keeps the `Date` header of the answer to one call: the server's clock,
/// to the second.
#[derive(Debug, Clone, Default)]
struct DateHeader(Arc<Mutex<Option<String>>>);

impl DateHeader {
    fn get(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Intercept for DateHeader {
    fn name(&self) -> &'static str {
        "idempotency_dynamodb::DateHeader"
    }

    fn read_before_deserialization(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if let Some(date) = context.response().headers().get("date") {
            *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(date.to_owned());
        }
        Ok(())
    }
}

/// What `DescribeTable` and `DescribeTimeToLive` say, `None` for a missing table.
struct Described {
    status: Option<TableStatus>,
    key_ok: bool,
    key_schema: String,
    billing: Option<BillingMode>,
    ttl_status: Option<TimeToLiveStatus>,
    ttl_attribute: Option<String>,
}

impl DynamoDbRepository {
    /// Pages through the table and hands each record to `visit` until it
    /// returns false or the table ends; whether the scan ended.
    async fn scan(
        &self,
        mut visit: impl FnMut(RecordKey, Record) -> bool + Send,
    ) -> Result<bool, Error> {
        let mut start: Option<Item> = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&*self.table)
                .consistent_read(true)
                .limit(PAGE)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| map_sdk_error(e, self.ctx("Scan")))?;
            for item in page.items() {
                let Some(AttributeValue::S(pk)) = item.get(&self.names.partition_key) else {
                    continue;
                };
                let Ok(key) = RecordKey::decode(pk, usize::MAX) else {
                    continue;
                };
                let record = item_to_record(&self.names, &key, item)?;
                if !visit(key, record) {
                    return Ok(false);
                }
            }
            match page.last_evaluated_key() {
                Some(last) if !last.is_empty() => start = Some(last.clone()),
                _ => return Ok(true),
            }
        }
    }

    async fn describe(&self) -> Result<Option<Described>, Error> {
        let table = match self
            .client
            .describe_table()
            .table_name(&*self.table)
            .send()
            .await
        {
            Ok(out) => out,
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_resource_not_found_exception()) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(map_sdk_error(e, self.ctx("DescribeTable"))),
        };
        let table = table.table();
        let schema = table.map(|t| t.key_schema()).unwrap_or_default();
        let pk = &self.names.partition_key;
        let ttl = self
            .client
            .describe_time_to_live()
            .table_name(&*self.table)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, self.ctx("DescribeTimeToLive")))?;
        let ttl = ttl.time_to_live_description();
        Ok(Some(Described {
            status: table.and_then(|t| t.table_status()).cloned(),
            key_ok: schema.len() == 1
                && schema[0].attribute_name() == pk
                && schema[0].key_type() == &KeyType::Hash,
            key_schema: schema
                .iter()
                .map(|k| format!("{} ({})", k.attribute_name(), k.key_type().as_str()))
                .collect::<Vec<_>>()
                .join(", "),
            billing: table
                .and_then(|t| t.billing_mode_summary())
                .and_then(|b| b.billing_mode())
                .cloned(),
            ttl_status: ttl.and_then(|d| d.time_to_live_status()).cloned(),
            ttl_attribute: ttl.and_then(|d| d.attribute_name()).map(str::to_owned),
        }))
    }

    /// The clock offset from the `Date` header of a `DescribeTable` answer.
    /// The header has whole seconds: the server's clock is somewhere in that
    /// second, and the offset is the distance from this machine's clock to
    /// that second (zero inside it).
    async fn clock_check(&self, options: &DoctorOptions) -> Result<Check, Error> {
        let date = DateHeader::default();
        let before = SystemClock.now();
        self.client
            .describe_table()
            .table_name(&*self.table)
            .customize()
            .interceptor(date.clone())
            .send()
            .await
            .map_err(|e| map_sdk_error(e, self.ctx("DescribeTable")))?;
        let after = SystemClock.now();
        let Some(second) = date
            .get()
            .and_then(|d| httpdate::parse_http_date(&d).ok())
            .map(Timestamp::from_system_time)
        else {
            return Ok(Check::warn(
                "clock offset",
                "the endpoint's answers carry no Date header: the offset is unknown",
                "check the clocks of the consumers' machines (NTP/chrony)",
            ));
        };
        let mid = Timestamp::from_millis(before.as_millis() / 2 + after.as_millis() / 2);
        let server = Timestamp::from_millis(
            mid.as_millis()
                .clamp(second.as_millis(), second.as_millis() + 999),
        );
        let mut check = Check::clock_offset(server, before, after, options.clock_skew);
        check
            .detail
            .push_str(" (from the Date header: whole seconds)");
        Ok(check)
    }

    fn ttl_enabled(&self, d: &Described) -> bool {
        matches!(
            d.ttl_status,
            Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
        ) && d.ttl_attribute.as_deref() == Some(self.names.ttl.as_str())
    }

    fn table_checks(&self, d: &Described) -> Vec<Check> {
        let t = &self.table;
        let mut checks = vec![match &d.status {
            Some(TableStatus::Active) => Check::pass("table status", format!("`{t}` is ACTIVE")),
            other => Check::warn(
                "table status",
                format!(
                    "`{t}` is {}: calls may fail until it is ACTIVE",
                    other.as_ref().map_or("unknown", |s| s.as_str())
                ),
                "wait for the table to become ACTIVE",
            ),
        }];
        checks.push(if d.key_ok {
            Check::pass(
                "key schema",
                format!("single String partition key `{}`", self.names.partition_key),
            )
        } else {
            Check::fail(
                "key schema",
                format!("[{}]: every call fails", d.key_schema),
                format!(
                    "use a table whose only key is the String partition key `{}` (or set \
                     ?partition_key= to the table's)",
                    self.names.partition_key
                ),
            )
        });
        checks.push(match &d.billing {
            Some(BillingMode::Provisioned) => Check::warn(
                "billing mode",
                "PROVISIONED: a burst beyond the capacity is throttled, and throttled \
                 reservations fail (retryable) until capacity returns",
                "PAY_PER_REQUEST, or auto scaling with headroom for redelivery bursts",
            ),
            _ => Check::pass("billing mode", "on demand (PAY_PER_REQUEST)"),
        });
        checks.push(if self.ttl_enabled(d) {
            Check::pass("TTL", format!("enabled on `{}`", self.names.ttl))
        } else {
            let found = match (&d.ttl_status, &d.ttl_attribute) {
                (Some(s), Some(a)) => format!("{} on `{a}`", s.as_str()),
                (Some(s), None) => s.as_str().to_owned(),
                _ => "DISABLED".to_owned(),
            };
            Check::fail(
                "TTL",
                format!(
                    "{found}: expired records are never removed (reads treat them as absent), \
                     so the table grows without bound"
                ),
                format!(
                    "enable TTL on `{}` (`idempotency migrate`, or UpdateTimeToLive)",
                    self.names.ttl
                ),
            )
        });
        checks
    }
}

#[async_trait]
impl Admin for DynamoDbRepository {
    /// Paginated `Scan`, in the table's order.
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error> {
        let mut listing = Listing::default();
        self.scan(|key, record| listing.offer(filter, &key, record, now))
            .await?;
        Ok(listing)
    }

    /// Counts from up to 10,000 items; labelled as a sample when there are
    /// more (a full `Scan` reads, and bills, the whole table).
    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error> {
        let mut stats = Stats::default();
        let mut seen = 0usize;
        let complete = self
            .scan(|key, record| {
                stats.count(key.namespace(), &record, now, clock_skew);
                seen += 1;
                seen < STATS_SAMPLE
            })
            .await?;
        if !complete {
            stats.sampled = Some(seen as u64);
        }
        Ok(stats)
    }

    /// The table (on demand, the partition key) and its TTL.
    async fn migrate(&self, dry_run: bool) -> Result<Vec<String>, Error> {
        let mut steps = Vec::new();
        match self.describe().await? {
            None => {
                steps.push(format!(
                    "create table `{}` (String partition key `{}`, on demand)",
                    self.table, self.names.partition_key
                ));
                steps.push(format!("enable TTL on `{}`", self.names.ttl));
            }
            Some(d) if !self.ttl_enabled(&d) => {
                steps.push(format!("enable TTL on `{}`", self.names.ttl));
            }
            Some(_) => {}
        }
        if !dry_run && !steps.is_empty() {
            self.create_table().await?;
        }
        Ok(steps)
    }

    async fn doctor(&self, options: &DoctorOptions) -> Result<Vec<Check>, Error> {
        Ok(match self.describe().await? {
            None => vec![Check::fail(
                "table",
                format!("`{}` does not exist: every call fails", self.table),
                "run `idempotency migrate` (or create it with infrastructure as code)",
            )],
            Some(d) => {
                let mut checks = self.table_checks(&d);
                checks.push(self.clock_check(options).await?);
                checks
            }
        })
    }
}
