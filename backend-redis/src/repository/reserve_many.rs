//! A batch's reservations (`reserve_many`): one pipeline on a standalone
//! server, one per primary on a cluster (see `cluster`), reading the records
//! first when the recent reservations were mostly duplicates (see
//! `read_first`).

use std::sync::atomic::Ordering;

use idempotency_core::decision::reserved_record;
use idempotency_core::{Error, Repository, Reservation, ReserveRequest};
use redis::Value;

use super::commands::{fill, px, replies_missing, unexpected};
use super::reserve::set_nx_get_cmd;
use super::{read_first, BatchReads, Conn, RedisRepository};
use crate::codec;
use crate::error::{is_noscript, is_syntax_error, map_redis_error};
use crate::options::ReserveStrategy;

impl RedisRepository {
    /// [`Repository::reserve_many`]: pipelined where the connection allows.
    pub(super) async fn reserve_batch(
        &self,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        match &self.conn {
            Conn::Standalone(conn) if requests.len() > 1 => {
                self.reserve_pipelined(conn.clone(), requests).await
            }
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) if requests.len() > 1 && self.nodes.is_some() => {
                let batch = |link, group| self.reserve_pipelined(link, group);
                self.per_primary(requests, |r| r.key, batch, |r| self.reserve(r))
                    .await
            }
            _ => futures::future::join_all(requests.into_iter().map(|r| self.reserve(r))).await,
        }
    }

    /// A batch's reservations in one round trip (two when they read first
    /// and a record leaves a key open; see [`BatchReads`]); under the
    /// adaptive plan every answer counts into the recent share of fresh keys.
    async fn reserve_pipelined(
        &self,
        mut conn: impl redis::aio::ConnectionLike + Send,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let reads =
            self.batch_reads.now(&self.fresh_share) && !self.reads_refused.load(Ordering::Relaxed);
        let answers = if reads {
            match self.read_first(&mut conn, &requests).await {
                Ok(decided) => self.write_open(conn, requests, decided).await,
                Err(e) if e.is_store_outage() => {
                    requests.iter().map(|_| Err(e.for_another())).collect()
                }
                Err(e) => {
                    // Nothing was written: this batch writes instead.
                    tracing::warn!(error = %e, "the Redis server refused a batch's read; batches write first from now on");
                    self.reads_refused.store(true, Ordering::Relaxed);
                    self.write_pipelined(conn, requests).await
                }
            }
        } else {
            self.write_pipelined(conn, requests).await
        };
        if self.batch_reads == BatchReads::Adaptive {
            for answer in answers.iter().flatten() {
                self.fresh_share.observe(answer);
            }
        }
        answers
    }

    /// The requests the reads left open (`None` in `decided`) through
    /// [`Self::write_pipelined`]; every answer in order.
    async fn write_open(
        &self,
        conn: impl redis::aio::ConnectionLike + Send,
        requests: Vec<ReserveRequest<'_>>,
        decided: read_first::Decided,
    ) -> Vec<Result<Reservation, Error>> {
        let open: Vec<_> = requests
            .into_iter()
            .zip(&decided)
            .filter(|(_, answer)| answer.is_none())
            .map(|(req, _)| req)
            .collect();
        let mut written = if open.is_empty() {
            Vec::new()
        } else {
            self.write_pipelined(conn, open).await
        }
        .into_iter();
        fill(decided, |_| {
            written
                .next()
                .unwrap_or_else(|| Err(unexpected("reserve", "fewer answers than requests")))
        })
    }

    /// Every request's first command in one pipeline; what it cannot decide
    /// (a takeover, an expired record, a script the server lost, a server
    /// without `SET … GET`) goes through [`Repository::reserve`], concurrently.
    async fn write_pipelined(
        &self,
        mut conn: impl redis::aio::ConnectionLike + Send,
        requests: Vec<ReserveRequest<'_>>,
    ) -> Vec<Result<Reservation, Error>> {
        let set_nx_get = self.effective_strategy() == ReserveStrategy::SetNxGet;
        let mut pipe = redis::Pipeline::with_capacity(requests.len());
        pipe.ignore_errors();
        for req in &requests {
            let fresh = codec::head(&reserved_record(None, req, 1));
            let px = px(req.now, req.expires_at);
            pipe.add_command(if set_nx_get {
                set_nx_get_cmd(req, fresh.as_bytes(), px)
            } else {
                self.reserve_script_cmd(req, fresh.as_bytes(), px)
            });
        }
        let sent = pipe.query_async::<Vec<redis::RedisResult<Value>>>(&mut conn);
        let replies = match sent.await {
            Ok(replies) if replies.len() == requests.len() => replies,
            Ok(_) => {
                // Some commands may have been applied: as ambiguous as a lost
                // reply, so that the manager re-sends with the same token.
                return requests
                    .iter()
                    .map(|_| Err(replies_missing("reserve")))
                    .collect();
            }
            Err(e) => {
                return requests
                    .iter()
                    .map(|r| Err(map_redis_error(e.clone(), Some(r.key), "reserve")))
                    .collect()
            }
        };
        let mut answers: Vec<Option<Result<Reservation, Error>>> =
            Vec::with_capacity(replies.len());
        for (req, reply) in requests.iter().zip(replies) {
            answers.push(match reply {
                Ok(reply) if set_nx_get => Self::set_nx_get_reservation(req, reply).transpose(),
                Ok(reply) => Some(Self::script_reservation(req, reply)),
                Err(e) if is_noscript(&e) || is_syntax_error(&e) || self.not_served(&e) => None,
                Err(e) => Some(Err(map_redis_error(e, Some(req.key), "reserve"))),
            });
        }
        let again = requests
            .into_iter()
            .zip(&answers)
            .filter(|(_, answer)| answer.is_none())
            .map(|(req, _)| self.reserve(req));
        let mut again = futures::future::join_all(again).await.into_iter();
        fill(answers, |_| {
            again
                .next()
                .unwrap_or_else(|| Err(unexpected("reserve", "fewer answers than requests")))
        })
    }
}
