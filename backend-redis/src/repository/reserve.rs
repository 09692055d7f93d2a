//! One key's reservation: `SET … NX PX … GET` ([`ReserveStrategy::SetNxGet`])
//! decides most requests in one command; the reserve script decides the rest
//! (a takeover, an expired record), and every request under
//! [`ReserveStrategy::Script`] or on a server without `SET … GET`.

use std::sync::atomic::Ordering;

use idempotency_core::decision::{reserve_transition, reserved_record, ReserveTransition};
use idempotency_core::{Error, Record, Reservation, ReserveRequest};
use redis::{Cmd, Value};

use super::commands::{key_len, px, script_cmd, unexpected, KeyArg};
use super::RedisRepository;
use crate::codec::{self, ts_bytes};
use crate::error::{is_syntax_error, map_redis_error};
use crate::options::ReserveStrategy;

impl RedisRepository {
    /// The strategy `reserve` uses now: the configured one, or
    /// [`ReserveStrategy::Script`] once the server rejected `SET … NX … GET`.
    pub fn effective_strategy(&self) -> ReserveStrategy {
        if self.strategy == ReserveStrategy::SetNxGet
            && self.set_nx_get_supported.load(Ordering::Relaxed)
        {
            ReserveStrategy::SetNxGet
        } else {
            ReserveStrategy::Script
        }
    }

    /// [`Repository::reserve`](idempotency_core::Repository::reserve):
    /// `SET … NX PX … GET` while the strategy is [`ReserveStrategy::SetNxGet`]
    /// and the server takes it, and the reserve script for what that leaves
    /// open.
    pub(super) async fn reserve_one(&self, req: ReserveRequest<'_>) -> Result<Reservation, Error> {
        // A reservation carries no result: the record is its fixed part only.
        let fresh = codec::head(&reserved_record(None, &req, 1));
        let fresh = fresh.as_bytes();
        let px = px(req.now, req.expires_at);
        if self.effective_strategy() == ReserveStrategy::SetNxGet {
            match self
                .send(&set_nx_get_cmd(&req, fresh, px), Some(req.key))
                .await
            {
                Ok(reply) => {
                    if let Some(answer) = Self::set_nx_get_reservation(&req, reply)? {
                        return Ok(answer);
                    }
                }
                Err(e) if is_syntax_error(&e) => {
                    tracing::warn!(
                        "the Redis server rejects `SET … NX … GET` (Redis < 7.0); \
                         reserving with the script from now on"
                    );
                    self.set_nx_get_supported.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(map_redis_error(e, Some(req.key), "reserve")),
            }
        }
        self.reserve_with_script(&req, fresh, px).await
    }

    async fn reserve_with_script(
        &self,
        req: &ReserveRequest<'_>,
        fresh: &[u8],
        px: u64,
    ) -> Result<Reservation, Error> {
        let mut px_digits = itoa::Buffer::new();
        let px = px_digits.format(px).as_bytes();
        let now = ts_bytes(req.now);
        let cutoff = ts_bytes(req.lease_cutoff());
        let retry: &[u8] = if req.retry_failed { b"1" } else { b"0" };
        let reply = self
            .eval(
                &self.scripts.reserve,
                req.key,
                &[fresh, &now, &cutoff, retry, px],
                "reserve",
            )
            .await?;
        Self::script_reservation(req, reply)
    }

    /// `EVALSHA reserve` for `req`, to pipeline.
    pub(super) fn reserve_script_cmd(
        &self,
        req: &ReserveRequest<'_>,
        fresh: &[u8],
        px: u64,
    ) -> Cmd {
        let mut px_digits = itoa::Buffer::new();
        let px = px_digits.format(px).as_bytes();
        let now = ts_bytes(req.now);
        let cutoff = ts_bytes(req.lease_cutoff());
        let retry: &[u8] = if req.retry_failed { b"1" } else { b"0" };
        let sha = self.scripts.reserve.sha.as_bytes();
        script_cmd("EVALSHA", sha, req.key, &[fresh, &now, &cutoff, retry, px])
    }

    /// The reservation the reserve script answered.
    pub(super) fn script_reservation(
        req: &ReserveRequest<'_>,
        reply: Value,
    ) -> Result<Reservation, Error> {
        match reply {
            Value::Array(mut items) => match items.as_slice() {
                [Value::Int(1), Value::Int(attempt)] => u32::try_from(*attempt)
                    .map(|attempt| Reservation::Acquired { attempt })
                    .map_err(|_| unexpected("reserve", "an attempt out of range")),
                [Value::Int(0), Value::BulkString(_)] => match items.pop() {
                    Some(Value::BulkString(bytes)) => {
                        Ok(Reservation::Existing(Self::decode(req.key, bytes)?))
                    }
                    _ => Err(unexpected("reserve", "an unexpected array")),
                },
                _ => Err(unexpected("reserve", "an unexpected array")),
            },
            _ => Err(unexpected("reserve", "a reply that is not an array")),
        }
    }

    /// What `SET … NX PX … GET` answered for `req`: the reservation, or
    /// `None` when the script must decide (the record expired or is open to
    /// takeover, and may have changed since).
    pub(super) fn set_nx_get_reservation(
        req: &ReserveRequest<'_>,
        reply: Value,
    ) -> Result<Option<Reservation>, Error> {
        let record = match reply {
            Value::Nil => return Ok(Some(Reservation::Acquired { attempt: 1 })),
            Value::BulkString(bytes) => Self::decode(req.key, bytes)?,
            _ => return Err(unexpected("reserve", "an unexpected reply to SET")),
        };
        Ok(Self::decided(req, record))
    }

    /// What the stored `record` answers for `req` with nothing written, or
    /// `None` when a write must decide (the record expired or is open to a
    /// takeover, and may have changed since).
    pub(super) fn decided(req: &ReserveRequest<'_>, record: Record) -> Option<Reservation> {
        match reserve_transition(Some(&record), req) {
            ReserveTransition::Existing => Some(Reservation::Existing(record)),
            // Our own live reservation (a re-sent reserve): nothing needs
            // writing.
            ReserveTransition::AlreadyHeld { attempt } => Some(Reservation::Acquired { attempt }),
            ReserveTransition::Create | ReserveTransition::Takeover { .. } => None,
        }
    }
}

/// `SET key fresh NX PX px GET`: creates the reservation if there is no
/// record, and returns the record there was.
pub(super) fn set_nx_get_cmd(req: &ReserveRequest<'_>, fresh: &[u8], px: u64) -> Cmd {
    let mut cmd = Cmd::with_capacity(7, key_len(req.key) + fresh.len() + 32);
    cmd.arg("SET")
        .arg(KeyArg(req.key))
        .arg(fresh)
        .arg("NX")
        .arg("PX")
        .arg(px)
        .arg("GET");
    cmd
}
