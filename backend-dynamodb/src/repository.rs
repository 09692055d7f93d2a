//! [`DynamoDbRepository`]: the `Repository` operations as conditional writes.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValuesOnConditionCheckFailure};
use aws_sdk_dynamodb::Client;
use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{
    Capabilities, Error, OwnerToken, Record, RecordKey, Repository, Reservation, ReserveRequest,
    Status, Timestamp,
};

use crate::counter::RequestCounter;
use crate::error::{classify, map_sdk_error, Ctx, WriteFailure, BACKEND};
use crate::item::{
    bytes, item_to_record, num, owner, record_to_item, status, ts, ttl, AttributeNames, Item,
    MAX_ID_BYTES, MAX_PARTITION_KEY_BYTES,
};

/// How many conditional writes one `reserve` makes at most before it gives up
/// on a key that keeps changing under it (each round reads the item it lost to,
/// so under ordinary contention the second write already settles it).
const MAX_RESERVE_ROUNDS: usize = 4;

/// An idempotency store on a DynamoDB table: one item per record, every
/// operation one conditional request.
///
/// See the [crate documentation](crate) for the item format, the requests each
/// operation makes and the table's setup.
///
/// Build one from a URL ([`connect`](crate::connect),
/// [`DynamoDbRepository::from_url`]), from the environment
/// ([`DynamoDbRepository::from_env`]), or from your own SDK configuration or client
/// ([`DynamoDbRepository::from_sdk_config`], [`DynamoDbRepository::from_client`]).
/// Clones share the client.
#[derive(Debug, Clone)]
pub struct DynamoDbRepository {
    pub(crate) client: Client,
    pub(crate) table: Arc<str>,
    pub(crate) names: Arc<AttributeNames>,
}

impl DynamoDbRepository {
    /// A repository on `table` using an existing client (its region, endpoint,
    /// credentials, retry and timeout settings are kept). What the client
    /// lacks, this crate supplies: an HTTP client (HTTPS with the `tls`
    /// feature, plain HTTP without) when none is configured, and the default
    /// operation timeout ([`DEFAULT_OPERATION_TIMEOUT`](crate::DEFAULT_OPERATION_TIMEOUT),
    /// retries included) when the client sets none — a timeout explicitly
    /// disabled on the client stays disabled.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), idempotency_core::Error> {
    /// let sdk_config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
    /// let client = aws_sdk_dynamodb::Client::new(&sdk_config);
    /// let repo = idempotency_dynamodb::DynamoDbRepository::from_client(client, "idempotency");
    /// # Ok(()) }
    /// ```
    pub fn from_client(client: Client, table: impl Into<String>) -> Self {
        DynamoDbRepository {
            client: crate::connect::with_defaults(client),
            table: Arc::from(table.into()),
            names: Arc::new(AttributeNames::default()),
        }
    }

    /// A repository on `table` with a client built from an `aws_config` SDK
    /// configuration.
    pub fn from_sdk_config(config: &aws_config::SdkConfig, table: impl Into<String>) -> Self {
        DynamoDbRepository::from_client(Client::new(config), table)
    }

    /// Stores records under other attribute names (e.g. to match an existing
    /// table's partition key or TTL attribute).
    ///
    /// # Errors
    /// [`Error::Config`] when a name is empty, longer than 255 bytes, or used
    /// twice.
    pub fn with_attribute_names(mut self, names: AttributeNames) -> Result<Self, Error> {
        names.validate()?;
        self.names = Arc::new(names);
        Ok(self)
    }

    /// Installs `counter` as an interceptor on this repository's client (a copy
    /// of the client; other users of the original client are not counted).
    pub fn with_request_counter(mut self, counter: &RequestCounter) -> Self {
        let config = self
            .client
            .config()
            .to_builder()
            .interceptor(counter.clone())
            .build();
        self.client = Client::from_conf(config);
        self
    }

    /// The SDK client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The table's name.
    pub fn table_name(&self) -> &str {
        &self.table
    }

    /// The attribute names records are stored under.
    pub fn attribute_names(&self) -> &AttributeNames {
        &self.names
    }

    /// The largest result (or stored error) an item holds, in bytes (see
    /// [`Capabilities::max_result_bytes`]).
    pub fn max_result_bytes(&self) -> usize {
        self.names.max_value_bytes()
    }

    pub(crate) fn ctx(&self, operation: &'static str) -> Ctx<'_> {
        Ctx {
            table: &self.table,
            partition_key: &self.names.partition_key,
            operation,
        }
    }

    /// The partition key value of `key`: its injective encoding.
    fn pk(&self, key: &RecordKey) -> Result<AttributeValue, Error> {
        let encoded = key.encode();
        if encoded.len() > MAX_PARTITION_KEY_BYTES {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the key {key} encodes to {} bytes; DynamoDB partition keys hold at most \
                     {MAX_PARTITION_KEY_BYTES} (build keys with max_id_bytes <= {MAX_ID_BYTES}, \
                     the backend's Capabilities::max_id_bytes)",
                    encoded.len()
                ),
            });
        }
        Ok(AttributeValue::S(encoded))
    }

    fn key_map(&self, pk: AttributeValue) -> Item {
        HashMap::from([(self.names.partition_key.clone(), pk)])
    }

    fn parse(&self, key: &RecordKey, item: &Item) -> Result<Record, Error> {
        item_to_record(&self.names, key, item)
    }

    /// `PutItem` of a new `Processing` record if no live one is stored; on a
    /// failed condition, the stored item (returned by the same request).
    async fn put_new(
        &self,
        pk: &AttributeValue,
        req: &ReserveRequest<'_>,
    ) -> Result<Option<Option<Item>>, Error> {
        let record = reserved_record(None, req, 1);
        let mut e = Expr::new(&self.names);
        let cond = format!(
            "attribute_not_exists({pk}) OR {exp} <= {now}",
            pk = e.pk(),
            exp = e.expires_at(),
            now = e.value(":now", ts(req.now)),
        );
        let (names, values) = e.into_parts();
        let result = self
            .client
            .put_item()
            .table_name(&*self.table)
            .set_item(Some(record_to_item(&self.names, pk.clone(), &record)))
            .condition_expression(cond)
            .set_expression_attribute_names(names)
            .set_expression_attribute_values(values)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match result {
            Ok(_) => Ok(None),
            Err(err) => match classify(err, self.ctx("PutItem")) {
                WriteFailure::Condition(old) => Ok(Some(old)),
                WriteFailure::Error(e) => Err(e),
            },
        }
    }

    /// `UpdateItem` taking `prev` over, guarded by everything that made it
    /// eligible (owner, attempt, status, still live, lease stale); on a failed
    /// condition, the stored item if any.
    async fn take_over(
        &self,
        pk: &AttributeValue,
        req: &ReserveRequest<'_>,
        prev: &Record,
        attempt: u32,
    ) -> Result<Option<Option<Item>>, Error> {
        let mut e = Expr::new(&self.names);
        let (res, err_attr) = (e.result(), e.error());
        let mut set = format!(
            "{st} = {processing}, {ow} = {owner}, {at} = {attempt}, {lu} = {lease}, \
             {exp} = {expires}, {ttl} = {ttl_v}, {ua} = {now}",
            st = e.status(),
            processing = e.value(":processing", status(Status::Processing)),
            ow = e.owner(),
            owner = e.value(":owner", owner(req.owner)),
            at = e.attempt(),
            attempt = e.value(":attempt", num(u64::from(attempt))),
            lu = e.lease_until(),
            lease = e.value(":lease", ts(req.lease_until)),
            exp = e.expires_at(),
            expires = e.value(":expires", ts(req.expires_at)),
            ttl = e.ttl(),
            ttl_v = e.value(":ttl", ttl(req.expires_at)),
            ua = e.updated_at(),
            now = e.value(":now", ts(req.now)),
        );
        // The request's fingerprint, or else the stored one is kept: a consumer
        // without payload validation must not erase it.
        if let Some(f) = &req.fingerprint {
            set.push_str(&format!(
                ", {fp} = {v}",
                fp = e.fingerprint(),
                v = e.value(":fp", AttributeValue::S(f.to_string()))
            ));
        }
        // REMOVE first: emulators that check the item size clause by clause see
        // the old result/error go before anything is added.
        let rt = e.retryable();
        let remove = format!("REMOVE {res}, {err_attr}, {rt}");
        let mut cond = format!(
            "{ow} = {prev_owner} AND {at} = {prev_attempt} AND {st} = {prev_status} AND {exp} > {now}",
            ow = e.owner(),
            prev_owner = e.value(":prev_owner", owner(prev.owner)),
            at = e.attempt(),
            prev_attempt = e.value(":prev_attempt", num(u64::from(prev.attempt))),
            st = e.status(),
            prev_status = e.value(":prev_status", status(prev.status)),
            exp = e.expires_at(),
            now = e.value(":now", ts(req.now)),
        );
        if prev.status == Status::Processing {
            cond.push_str(&format!(
                " AND {lu} <= {cutoff}",
                lu = e.lease_until(),
                cutoff = e.value(":cutoff", ts(req.lease_cutoff())),
            ));
        }
        self.update_if(pk.clone(), e, format!("{remove} SET {set}"), cond)
            .await
    }

    /// One conditional `UpdateItem`: `None` when applied; on a failed
    /// condition, the stored item if any.
    async fn update_if(
        &self,
        pk: AttributeValue,
        e: Expr<'_>,
        update: String,
        condition: String,
    ) -> Result<Option<Option<Item>>, Error> {
        let (names, values) = e.into_parts();
        let result = self
            .client
            .update_item()
            .table_name(&*self.table)
            .set_key(Some(self.key_map(pk)))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_names(names)
            .set_expression_attribute_values(values)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match result {
            Ok(_) => Ok(None),
            Err(err) => match classify(err, self.ctx("UpdateItem")) {
                WriteFailure::Condition(old) => Ok(Some(old)),
                WriteFailure::Error(e) => Err(e),
            },
        }
    }

    /// A consistent read of the stored item (live or not).
    async fn read(&self, key: &RecordKey) -> Result<Option<Record>, Error> {
        let pk = self.pk(key)?;
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
            .set_key(Some(self.key_map(pk)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, self.ctx("GetItem")))?;
        out.item.map(|item| self.parse(key, &item)).transpose()
    }

    /// The fencing condition: a live `Processing` record held by `owner`.
    fn owned_condition(e: &mut Expr<'_>, owner_token: OwnerToken, now: Timestamp) -> String {
        format!(
            "{ow} = {owner} AND {st} = {processing} AND {exp} > {now}",
            ow = e.owner(),
            owner = e.value(":owner", owner(owner_token)),
            st = e.status(),
            processing = e.value(":processing", status(Status::Processing)),
            exp = e.expires_at(),
            now = e.value(":now", ts(now)),
        )
    }

    /// One owner-guarded `UpdateItem`; a failed condition is `LeaseLost`.
    async fn update_owned(
        &self,
        key: &RecordKey,
        e: Expr<'_>,
        update: String,
        condition: String,
    ) -> Result<(), Error> {
        let pk = self.pk(key)?;
        let (names, values) = e.into_parts();
        let result = self
            .client
            .update_item()
            .table_name(&*self.table)
            .set_key(Some(self.key_map(pk)))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_names(names)
            .set_expression_attribute_values(values)
            .send()
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(err) => match classify(err, self.ctx("UpdateItem")) {
                WriteFailure::Condition(_) => Err(Error::LeaseLost { key: key.clone() }),
                WriteFailure::Error(e) => Err(e),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn finish(
        &self,
        key: &RecordKey,
        owner_token: OwnerToken,
        new_status: Status,
        value: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let what = if new_status == Status::Completed {
            "result"
        } else {
            "error"
        };
        let max = self.max_result_bytes();
        if let Some(v) = value.filter(|v| v.len() > max) {
            return Err(Error::TooLarge {
                what,
                size: v.len(),
                max,
            });
        }
        let mut e = Expr::new(&self.names);
        let (slot, other) = if new_status == Status::Completed {
            (e.result(), e.error())
        } else {
            (e.error(), e.result())
        };
        let mut set = format!(
            "{st} = {new_status}, {exp} = {expires}, {ttl} = {ttl_v}, {ua} = {now}",
            st = e.status(),
            new_status = e.value(":status", status(new_status)),
            exp = e.expires_at(),
            expires = e.value(":expires", ts(expires_at)),
            ttl = e.ttl(),
            ttl_v = e.value(":ttl", ttl(expires_at)),
            ua = e.updated_at(),
            now = e.value(":now", ts(now)),
        );
        let mut remove = match value {
            Some(v) => {
                set.push_str(&format!(", {slot} = {v}", v = e.value(":value", bytes(v))));
                format!("REMOVE {other}")
            }
            None => format!("REMOVE {slot}, {other}"),
        };
        let rt = e.retryable();
        if new_status == Status::Failed {
            set.push_str(&format!(
                ", {rt} = {v}",
                v = e.value(":retryable", AttributeValue::Bool(retryable))
            ));
        } else {
            remove.push_str(&format!(", {rt}"));
        }
        let condition = Self::owned_condition(&mut e, owner_token, now);
        match self
            .update_owned(key, e, format!("{remove} SET {set}"), condition)
            .await
        {
            // The whole item is over DynamoDB's limit although the value fits
            // the declared maximum (the key and names took more than planned).
            Err(Error::TooLarge { size, max, .. }) => Err(Error::TooLarge { what, size, max }),
            other => other,
        }
    }

    /// `extend`: raises the lease and the expiry (with the TTL), each only
    /// when later than stored. DynamoDB cannot take a maximum in one update, so
    /// each request sets what the record last seen lacks, conditioned on the
    /// record still lacking exactly that: one request in the common case (a
    /// later lease, the stored expiry covering it), a second when the refusal
    /// shows otherwise (the expiry to raise too; a newer extension applied
    /// first). A record ours and already holding both is answered ok without
    /// a write.
    async fn extend_lease(
        &self,
        key: &RecordKey,
        owner_token: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let want = Extension {
            owner: owner_token,
            lease_until,
            expires_at,
            now,
        };
        // The common case first: the lease to raise, the expiry covering it.
        let mut lacks = (true, false);
        for _ in 0..MAX_EXTEND_ROUNDS {
            let Some(stored) = self.extend_once(key, &want, lacks).await? else {
                return Ok(());
            };
            if stored.status != Status::Processing
                || stored.owner != owner_token
                || stored.is_expired(now)
            {
                return Err(Error::LeaseLost { key: key.clone() });
            }
            lacks = (
                stored.lease_until < lease_until,
                stored.expires_at < expires_at,
            );
            // Ours, and already as long as asked: the SDK re-sent a request
            // that was applied (its reply lost), or a newer extension came
            // first.
            if lacks == (false, false) {
                return Ok(());
            }
        }
        // Ours every time, yet changed under every request: retrying is the
        // caller's call.
        Err(Error::Unavailable {
            backend: BACKEND,
            message: format!(
                "{key} changed during extend on table `{}`; retry",
                self.table
            ),
            source: None,
        })
    }

    /// One conditional `UpdateItem` of `extend` setting the lease and/or the
    /// expiry (`lacks`: what the record lacks, as the condition requires).
    /// `None` when applied; else the record the refusal returned, or, from a
    /// store that returns none on a failed condition (an emulator without
    /// `ReturnValuesOnConditionCheckFailure`), the record read (`LeaseLost`
    /// when there is none: the item is gone).
    async fn extend_once(
        &self,
        key: &RecordKey,
        want: &Extension,
        (raise_lease, raise_expiry): (bool, bool),
    ) -> Result<Option<Record>, Error> {
        let pk = self.pk(key)?;
        let mut e = Expr::new(&self.names);
        let mut condition = Self::owned_condition(&mut e, want.owner, want.now);
        let mut sets = vec![format!("{} = :now", e.updated_at())];
        let (lu, lease) = (e.lease_until(), e.value(":lease", ts(want.lease_until)));
        condition.push_str(&if raise_lease {
            sets.push(format!("{lu} = {lease}"));
            format!(" AND {lu} <= {lease}")
        } else {
            format!(" AND {lu} >= {lease}")
        });
        let (exp, new_exp) = (e.expires_at(), e.value(":new_exp", ts(want.expires_at)));
        condition.push_str(&if raise_expiry {
            let ttl_v = e.value(":ttl", ttl(want.expires_at));
            sets.push(format!("{exp} = {new_exp}, {} = {ttl_v}", e.ttl()));
            format!(" AND {exp} < {new_exp}")
        } else {
            format!(" AND {exp} >= {new_exp}")
        });
        let update = format!("SET {}", sets.join(", "));
        match self.update_if(pk, e, update, condition).await? {
            None => Ok(None),
            Some(Some(item)) => Ok(Some(self.parse(key, &item)?)),
            Some(None) => match self.read(key).await? {
                Some(record) => Ok(Some(record)),
                None => Err(Error::LeaseLost { key: key.clone() }),
            },
        }
    }
}

/// What one `extend` asks for.
struct Extension {
    owner: OwnerToken,
    lease_until: Timestamp,
    expires_at: Timestamp,
    now: Timestamp,
}

/// How many conditional writes one `extend` makes at most before asking the
/// caller to retry (each learns the record as it is).
const MAX_EXTEND_ROUNDS: usize = 3;

#[async_trait]
impl Repository for DynamoDbRepository {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(BACKEND)
            .with_max_result_bytes(Some(self.max_result_bytes()))
            .with_max_id_bytes(MAX_ID_BYTES)
            .with_native_expiry(true)
    }

    fn admin(&self) -> Option<&dyn idempotency_core::admin::Admin> {
        Some(self)
    }

    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        let pk = self.pk(req.key)?;
        // The record as last seen; `None` first, so the first request is the
        // conditional create (a fresh key: one request; a duplicate: the failed
        // condition returns the stored item, still one request).
        let mut current: Option<Record> = None;
        for _ in 0..MAX_RESERVE_ROUNDS {
            let lost_to = match reserve_transition(current.as_ref(), &req) {
                ReserveTransition::Create => match self.put_new(&pk, &req).await? {
                    None => return Ok(Reservation::Acquired { attempt: 1 }),
                    Some(Some(item)) => Some(item),
                    // A store that does not return the item on a failed
                    // condition: read it.
                    Some(None) => {
                        current = self.read(req.key).await?;
                        continue;
                    }
                },
                ReserveTransition::Takeover { attempt } => {
                    let Some(prev) = current.as_ref() else {
                        return Err(Error::corrupt(req.key, "takeover without a stored record"));
                    };
                    match self.take_over(&pk, &req, prev, attempt).await? {
                        None => return Ok(Reservation::Acquired { attempt }),
                        Some(item) => item,
                    }
                }
                // Our own record: a reserve re-sent after its reply was lost.
                ReserveTransition::AlreadyHeld { attempt } => {
                    return Ok(Reservation::Acquired { attempt })
                }
                ReserveTransition::Existing => {
                    return match current {
                        Some(record) => Ok(Reservation::Existing(record)),
                        None => Err(Error::corrupt(req.key, "no record to return")),
                    };
                }
            };
            current = lost_to.map(|item| self.parse(req.key, &item)).transpose()?;
        }
        // The key changed under every write. The record last seen decides
        // what needs no write: ours (the last write was applied and its reply
        // lost, the SDK's re-send refused by it), or another live holder's.
        // One that would need a write again: the caller retries.
        match reserve_transition(current.as_ref(), &req) {
            ReserveTransition::AlreadyHeld { attempt } => Ok(Reservation::Acquired { attempt }),
            ReserveTransition::Existing => match current {
                Some(record) => Ok(Reservation::Existing(record)),
                None => Err(Error::corrupt(req.key, "no record to return")),
            },
            ReserveTransition::Create | ReserveTransition::Takeover { .. } => Err(Error::Unavailable {
                backend: BACKEND,
                message: format!(
                    "{} changed under {MAX_RESERVE_ROUNDS} consecutive conditional writes on table `{}`; retry",
                    req.key, self.table
                ),
                source: None,
            }),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        result: Option<&[u8]>,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.finish(
            key,
            owner,
            Status::Completed,
            result,
            false,
            expires_at,
            now,
        )
        .await
    }

    async fn fail(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        error: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.finish(
            key,
            owner,
            Status::Failed,
            error,
            retryable,
            expires_at,
            now,
        )
        .await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        let pk = self.pk(key)?;
        let mut e = Expr::new(&self.names);
        let condition = Self::owned_condition(&mut e, owner, now);
        let (names, values) = e.into_parts();
        let result = self
            .client
            .delete_item()
            .table_name(&*self.table)
            .set_key(Some(self.key_map(pk)))
            .condition_expression(condition)
            .set_expression_attribute_names(names)
            .set_expression_attribute_values(values)
            .send()
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(err) => match classify(err, self.ctx("DeleteItem")) {
                WriteFailure::Condition(_) => Err(Error::LeaseLost { key: key.clone() }),
                WriteFailure::Error(e) => Err(e),
            },
        }
    }

    async fn extend(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.extend_lease(key, owner, lease_until, expires_at, now)
            .await
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, Error> {
        Ok(self.read(key).await?.filter(|r| !r.is_expired(now)))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, Error> {
        let pk = self.pk(key)?;
        let mut e = Expr::new(&self.names);
        let condition = format!("attribute_exists({})", e.pk());
        let (names, _) = e.into_parts();
        let result = self
            .client
            .delete_item()
            .table_name(&*self.table)
            .set_key(Some(self.key_map(pk)))
            .condition_expression(condition)
            .set_expression_attribute_names(names)
            .send()
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(err) => match classify(err, self.ctx("DeleteItem")) {
                WriteFailure::Condition(_) => Ok(false),
                WriteFailure::Error(e) => Err(e),
            },
        }
    }

    async fn purge_expired(&self, _now: Timestamp, _limit: usize) -> Result<usize, Error> {
        // DynamoDB's TTL deletes expired items (within days, at no cost); until
        // then every operation treats them as absent. Scanning the table here
        // would cost a read of every live item per call.
        Ok(0)
    }
}

/// The placeholders of one request's expressions: only those used are sent
/// (DynamoDB rejects unused names and values).
struct Expr<'a> {
    names_cfg: &'a AttributeNames,
    names: HashMap<String, String>,
    values: HashMap<String, AttributeValue>,
}

impl<'a> Expr<'a> {
    fn new(names_cfg: &'a AttributeNames) -> Self {
        Expr {
            names_cfg,
            names: HashMap::new(),
            values: HashMap::new(),
        }
    }

    fn name(&mut self, placeholder: &'static str, attribute: &str) -> &'static str {
        self.names
            .entry(placeholder.to_owned())
            .or_insert_with(|| attribute.to_owned());
        placeholder
    }

    fn value(&mut self, placeholder: &'static str, value: AttributeValue) -> &'static str {
        self.values.insert(placeholder.to_owned(), value);
        placeholder
    }

    fn pk(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#pk", &n.partition_key)
    }
    fn status(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#st", &n.status)
    }
    fn owner(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#ow", &n.owner)
    }
    fn attempt(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#at", &n.attempt)
    }
    fn fingerprint(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#fp", &n.fingerprint)
    }
    fn result(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#res", &n.result)
    }
    fn error(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#err", &n.error)
    }
    fn lease_until(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#lu", &n.lease_until)
    }
    fn expires_at(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#exp", &n.expires_at)
    }
    fn updated_at(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#ua", &n.updated_at)
    }
    fn ttl(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#ttl", &n.ttl)
    }
    fn retryable(&mut self) -> &'static str {
        let n = self.names_cfg;
        self.name("#rt", &n.retryable)
    }

    /// The name and value maps, `None` when empty (DynamoDB rejects empty maps).
    #[allow(clippy::type_complexity)]
    fn into_parts(
        self,
    ) -> (
        Option<HashMap<String, String>>,
        Option<HashMap<String, AttributeValue>>,
    ) {
        (
            (!self.names.is_empty()).then_some(self.names),
            (!self.values.is_empty()).then_some(self.values),
        )
    }
}
