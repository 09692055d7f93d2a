//! Counting the HTTP requests the SDK sends.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;

/// An SDK interceptor counting the HTTP requests sent to DynamoDB, per operation
/// (`PutItem`, `UpdateItem`, …). Every attempt counts, retries included.
///
/// Install it with
/// [`DynamoDbRepository::with_request_counter`](crate::DynamoDbRepository::with_request_counter)
/// (or on your own client config with
/// `aws_sdk_dynamodb::config::Builder::interceptor`); clones share their counts.
///
/// ```
/// use idempotency_dynamodb::RequestCounter;
///
/// let counter = RequestCounter::new();
/// assert_eq!(counter.total(), 0);
/// assert_eq!(counter.get("PutItem"), 0);
/// assert!(counter.snapshot().is_empty());
/// ```
#[derive(Debug, Clone, Default)]
pub struct RequestCounter {
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl RequestCounter {
    /// A counter at zero.
    pub fn new() -> Self {
        RequestCounter::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<String, u64>) -> T) -> T {
        let mut guard = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut guard)
    }

    /// Requests sent so far, all operations together.
    pub fn total(&self) -> u64 {
        self.with(|m| m.values().sum())
    }

    /// Requests sent so far for one operation (`"PutItem"`, `"GetItem"`, …).
    pub fn get(&self, operation: &str) -> u64 {
        self.with(|m| m.get(operation).copied().unwrap_or(0))
    }

    /// The counts per operation.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.with(|m| m.clone())
    }

    /// Sets every count back to zero.
    pub fn reset(&self) {
        self.with(BTreeMap::clear);
    }

    /// The counts per operation since the last call, and resets them.
    pub fn take(&self) -> BTreeMap<String, u64> {
        self.with(std::mem::take)
    }

    fn record(&self, operation: &str) {
        self.with(|m| match m.get_mut(operation) {
            Some(n) => *n += 1,
            None => {
                m.insert(operation.to_owned(), 1);
            }
        });
    }
}

impl Intercept for RequestCounter {
    fn name(&self) -> &'static str {
        "idempotency_dynamodb::RequestCounter"
    }

    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let operation = cfg.load::<Metadata>().map_or("unknown", Metadata::name);
        self.record(operation);
        Ok(())
    }
}
