//! DynamoDB (or a compatible emulator): the library against the AWS SDK client
//! issuing the same requests — a conditional `PutItem` returning the stored item
//! on a failed condition (a duplicate ends there), and an owner-guarded
//! `UpdateItem` that completes.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use idempotency_core::{Clock, IdempotencyManager, OwnerToken, Status, SystemClock};
use idempotency_dynamodb::aws_sdk_dynamodb::primitives::Blob;
use idempotency_dynamodb::aws_sdk_dynamodb::types::{
    AttributeValue, ReturnValuesOnConditionCheckFailure,
};
use idempotency_dynamodb::{AttributeNames, DynamoDbRepository, RequestCounter};

use super::{config, execute, key_id, populate, receipt_bytes, Lane, Workload};
use crate::{BoxError, Scenario, Variant};

/// DynamoDB workload on a table of its own, library and raw on one SDK client
/// that counts its requests.
pub struct DynamoDbWorkload {
    manager: IdempotencyManager,
    repo: DynamoDbRepository,
    counter: RequestCounter,
    endpoint: String,
    ttl_ms: u64,
}

impl std::fmt::Debug for DynamoDbWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoDbWorkload")
            .field("table", &self.repo.table_name())
            .finish_non_exhaustive()
    }
}

fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

impl DynamoDbWorkload {
    /// Creates a table of its own at `endpoint` (an emulator, dummy credentials)
    /// in `region`.
    ///
    /// # Errors
    /// When the endpoint cannot be reached or the table not created.
    pub async fn connect(endpoint: &str, region: &str) -> Result<Self, BoxError> {
        let table = format!("bench-{:016x}", rand::random::<u64>());
        let url = format!(
            "dynamodb://{table}?region={region}&endpoint={endpoint}&credentials=dummy&create_table=true"
        );
        let counter = RequestCounter::new();
        let repo = DynamoDbRepository::from_url(&url)
            .await?
            .with_request_counter(&counter);
        let manager = IdempotencyManager::new(Arc::new(repo.clone()), config())?;
        Ok(DynamoDbWorkload {
            manager,
            repo,
            counter,
            endpoint: endpoint.to_owned(),
            ttl_ms: u64::try_from(config().ttl.as_millis()).unwrap_or(u64::MAX),
        })
    }

    fn names(&self) -> &AttributeNames {
        self.repo.attribute_names()
    }

    async fn raw(&self, scenario: Scenario, ns: &str, i: usize) -> Result<(), BoxError> {
        let names = self.names();
        let client = self.repo.client();
        let table = self.repo.table_name();
        let pk = s(format!("bench:{}", key_id(ns, i)));
        let now = SystemClock.now().as_millis();
        let expires = now + self.ttl_ms;
        let owner = s(OwnerToken::random().to_string());
        let item = HashMap::from([
            (names.partition_key.clone(), pk.clone()),
            (names.status.clone(), s(Status::Processing.as_str())),
            (names.owner.clone(), owner.clone()),
            (names.attempt.clone(), n(1)),
            (names.fingerprint.clone(), s("ab".repeat(32))),
            (names.lease_until.clone(), n(now + 300_000)),
            (names.expires_at.clone(), n(expires)),
            (names.created_at.clone(), n(now)),
            (names.updated_at.clone(), n(now)),
            (names.ttl.clone(), n(expires.div_ceil(1_000))),
        ]);
        let put = client
            .put_item()
            .table_name(table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(#pk) OR #exp <= :now")
            .expression_attribute_names("#pk", &names.partition_key)
            .expression_attribute_names("#exp", &names.expires_at)
            .expression_attribute_values(":now", n(now))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        let created = match put {
            Ok(_) => true,
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                false
            }
            Err(e) => return Err(e.into()),
        };
        match (scenario, created) {
            (Scenario::Duplicate, false) => Ok(()),
            (Scenario::Fresh, true) => {
                client
                    .update_item()
                    .table_name(table)
                    .key(&names.partition_key, pk)
                    .update_expression(
                        "REMOVE #err SET #st = :status, #exp = :expires, #ttl = :ttl, \
                         #ua = :now, #res = :value",
                    )
                    .condition_expression("#ow = :owner AND #st = :processing AND #exp > :now")
                    .expression_attribute_names("#err", &names.error)
                    .expression_attribute_names("#st", &names.status)
                    .expression_attribute_names("#exp", &names.expires_at)
                    .expression_attribute_names("#ttl", &names.ttl)
                    .expression_attribute_names("#ua", &names.updated_at)
                    .expression_attribute_names("#res", &names.result)
                    .expression_attribute_names("#ow", &names.owner)
                    .expression_attribute_values(":status", s(Status::Completed.as_str()))
                    .expression_attribute_values(":expires", n(expires))
                    .expression_attribute_values(":ttl", n(expires.div_ceil(1_000)))
                    .expression_attribute_values(":now", n(now))
                    .expression_attribute_values(
                        ":value",
                        AttributeValue::B(Blob::new(receipt_bytes(i))),
                    )
                    .expression_attribute_values(":owner", owner)
                    .expression_attribute_values(":processing", s(Status::Processing.as_str()))
                    .send()
                    .await?;
                Ok(())
            }
            (scenario, created) => {
                Err(format!("raw {scenario} PutItem of key {i} answered created={created}").into())
            }
        }
    }
}

#[async_trait]
impl Workload for DynamoDbWorkload {
    fn backend(&self) -> &'static str {
        "dynamodb"
    }

    fn manager(&self, _lane: Lane) -> &IdempotencyManager {
        &self.manager
    }

    fn describe(&self) -> String {
        format!(
            "DynamoDB API at {} — one SDK client (request-counting interceptor) shared by \
             library and raw",
            self.endpoint
        )
    }

    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        populate(&self.manager, ns, ops, 16).await
    }

    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        _lane: Lane,
    ) -> Result<(), BoxError> {
        match variant {
            Variant::Library => execute(&self.manager, scenario, ns, i).await,
            Variant::Raw => self.raw(scenario, ns, i).await,
        }
    }

    async fn round_trips(&self) -> Result<Option<u64>, BoxError> {
        Ok(Some(self.counter.total()))
    }

    async fn cleanup(&self) -> Result<(), BoxError> {
        self.repo
            .client()
            .delete_table()
            .table_name(self.repo.table_name())
            .send()
            .await?;
        Ok(())
    }
}
