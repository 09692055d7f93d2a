//! Redis Cluster: keyed commands and batches routed to the primary serving
//! their slot, on our connections to the primaries (see `crate::nodes`).

#[cfg(feature = "cluster")]
use std::sync::Arc;

#[cfg(feature = "cluster")]
use idempotency_core::{Error, RecordKey};
#[cfg(feature = "cluster")]
use redis::aio::ConnectionManager;
use redis::RedisError;

#[cfg(feature = "cluster")]
use super::commands::{fill, unexpected};
use super::RedisRepository;

impl RedisRepository {
    /// Whether a pipelined command came back refused by a node that does not
    /// serve its key's slot now (it was not executed); the slot table is then
    /// read again. Never on a standalone server.
    pub(super) fn not_served(&self, err: &RedisError) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(nodes) = &self.nodes {
            if crate::nodes::is_not_served(err) {
                // `ASK`: the slot is moving, and the table still says
                // where it lives.
                if crate::nodes::asked_at(err).is_none() {
                    nodes.forget(None);
                }
                return true;
            }
        }
        let _ = err;
        false
    }

    /// The cluster slot of `key`'s record.
    #[cfg(feature = "cluster")]
    pub(super) fn slot(key: &RecordKey) -> u16 {
        crate::nodes::slot_of(Self::redis_key(key).as_bytes())
    }

    /// The cluster's slot table: as last read, else read now (`CLUSTER
    /// SLOTS`, from a primary we hold a connection to, else through the
    /// cluster client); `None` when it cannot be read or used.
    #[cfg(feature = "cluster")]
    pub(super) async fn slot_table(
        &self,
        nodes: &Arc<crate::nodes::Nodes>,
    ) -> Option<Arc<crate::nodes::SlotTable>> {
        nodes
            .table_or_read(|nodes| {
                let conn = self.conn.clone();
                async move {
                    match nodes.read_table().await {
                        Some(table) => Some(table),
                        None => {
                            let mut cmd = redis::cmd("CLUSTER");
                            cmd.arg("SLOTS");
                            match conn.query(&cmd).await {
                                Ok(reply) => crate::nodes::SlotTable::parse(&reply),
                                Err(_) => None,
                            }
                        }
                    }
                }
            })
            .await
    }

    /// A batch on a cluster: the keys grouped by the primary serving their
    /// slot, one pipeline per primary on our connection to it (see `nodes`);
    /// a key alone on its primary, or every key when the slot table or a
    /// primary cannot be reached, one by one as single commands.
    /// Answers in the batch's order.
    #[cfg(feature = "cluster")]
    pub(super) async fn per_primary<'k, T, R, B, BF, S, SF>(
        &self,
        items: Vec<T>,
        key: impl Fn(&T) -> &'k RecordKey,
        batch: B,
        single: S,
    ) -> Vec<Result<R, Error>>
    where
        B: Fn(ConnectionManager, Vec<T>) -> BF,
        BF: std::future::Future<Output = Vec<Result<R, Error>>>,
        S: Fn(T) -> SF,
        SF: std::future::Future<Output = Result<R, Error>>,
    {
        use crate::nodes::by_primary;
        let one_by_one = |items: Vec<T>| futures::future::join_all(items.into_iter().map(&single));
        let Some(nodes) = self.nodes.as_ref() else {
            return one_by_one(items).await;
        };
        let Some(table) = self.slot_table(nodes).await else {
            return one_by_one(items).await;
        };
        let count = items.len();
        let slot = |item: &T| Self::slot(key(item));
        let (batch, one_by_one, table) = (&batch, &one_by_one, &*table);
        let sent =
            by_primary(items, table, slot)
                .into_iter()
                .map(|(primary, at, group)| async move {
                    let address = primary.and_then(|p| table.address(p));
                    let link = match address {
                        Some(address) if group.len() > 1 => nodes.link(address).await,
                        _ => None,
                    };
                    let answers = match link {
                        Some(link) => {
                            let answers = batch(link, group).await;
                            if answers
                                .iter()
                                .any(|a| matches!(a, Err(e) if e.is_store_outage()))
                            {
                                // The node failed as a whole: perhaps no longer a
                                // primary. Read the table and reconnect next time.
                                nodes.forget(address);
                            }
                            answers
                        }
                        None => one_by_one(group).await,
                    };
                    (at, answers)
                });
        let mut answers: Vec<Option<Result<R, Error>>> = (0..count).map(|_| None).collect();
        for (at, group) in futures::future::join_all(sent).await {
            for (i, answer) in at.into_iter().zip(group) {
                answers[i] = Some(answer);
            }
        }
        fill(answers, |_| {
            Err(unexpected("batch", "fewer answers than keys"))
        })
    }
}
