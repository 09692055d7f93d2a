//! The owner-checked writes: `complete` and `fail` (the finish script),
//! `release` and `extend`, each answering `LeaseLost` when the lease is no
//! longer the caller's; and a batch's completions as `EVALSHA finish` per
//! key, pipelined.

use idempotency_core::{Completion, Error, OwnerToken, RecordKey, Repository, Status, Timestamp};
use redis::Value;

use super::commands::{fill, owned_reply, px, replies_missing, script_cmd, unexpected, Answers};
use super::RedisRepository;
use crate::codec::{self, ts_bytes};
use crate::error::{is_noscript, map_redis_error};

impl RedisRepository {
    /// `complete` (`status` Completed) or `fail` (Failed, remembering
    /// `retryable`).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn finish(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        status: Status,
        value: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let operation = if status == Status::Completed {
            "complete"
        } else {
            "fail"
        };
        let args = self.finish_args(owner, status, value, retryable, expires_at, now)?;
        let reply = self
            .eval(&self.scripts.finish, key, &args.slices(value), operation)
            .await?;
        owned_reply(reply, key, operation)
    }

    /// The finish script's arguments but the value (checked against the
    /// size limit).
    fn finish_args(
        &self,
        owner: OwnerToken,
        status: Status,
        value: Option<&[u8]>,
        retryable: bool,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<FinishArgs, Error> {
        let what = if status == Status::Completed {
            "result"
        } else {
            "error"
        };
        self.check_size(what, value)?;
        let mut flags = 0;
        if value.is_some() {
            flags |= if status == Status::Completed {
                codec::FLAG_RESULT
            } else {
                codec::FLAG_ERROR
            };
        }
        if retryable && status == Status::Failed {
            flags |= codec::FLAG_RETRYABLE;
        }
        Ok(FinishArgs {
            owner: owner.to_bytes(),
            now: ts_bytes(now),
            expires: ts_bytes(expires_at),
            px: itoa::Buffer::new()
                .format(px(now, expires_at))
                .as_bytes()
                .to_vec(),
            code: [status.code()],
            flags: itoa::Buffer::new().format(flags).as_bytes().to_vec(),
        })
    }

    /// Each completion's `finish` arguments, by index in `writes`, and an
    /// answer already for each refused before anything is sent (a result
    /// over the size limit); `None` for the others. When every one was
    /// refused, their answers.
    pub(super) fn completion_args(
        &self,
        writes: &[Completion<'_>],
        now: Timestamp,
    ) -> Result<(Answers<()>, Vec<Ready>), Completed> {
        let mut answers = Vec::with_capacity(writes.len());
        let mut ready = Vec::with_capacity(writes.len());
        for (i, w) in writes.iter().enumerate() {
            let completed = Status::Completed;
            match self.finish_args(w.owner, completed, w.result, false, w.expires_at, now) {
                Ok(args) => {
                    ready.push((i, args));
                    answers.push(None);
                }
                Err(e) => answers.push(Some(Err(e))),
            }
        }
        if ready.is_empty() {
            return Err(fill(answers, |_| Err(unexpected("complete", "no answer"))));
        }
        Ok((answers, ready))
    }

    /// Every completion's `EVALSHA finish` in one pipeline: to one primary of
    /// a cluster (whose keys hash to many slots, so no script may take them
    /// all), or to a standalone server for the keys `complete_many` did not
    /// complete or cannot take (see `complete_many.rs`); a script the server
    /// lost is reloaded through the single path.
    pub(super) async fn complete_pipelined(
        &self,
        mut conn: impl redis::aio::ConnectionLike + Send,
        writes: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        let (mut answers, ready) = match self.completion_args(&writes, now) {
            Ok(args) => args,
            Err(answered) => return answered,
        };
        let mut pipe = redis::Pipeline::with_capacity(ready.len());
        pipe.ignore_errors();
        let sha = self.scripts.finish.sha.as_bytes();
        for (i, args) in &ready {
            let w = &writes[*i];
            pipe.add_command(script_cmd("EVALSHA", sha, w.key, &args.slices(w.result)));
        }
        let sent = ready.len();
        let replies = match pipe
            .query_async::<Vec<redis::RedisResult<Value>>>(&mut conn)
            .await
        {
            Ok(replies) if replies.len() == sent => replies,
            Ok(_) => return fill(answers, |_| Err(replies_missing("complete"))),
            Err(e) => {
                return fill(answers, |i| {
                    Err(map_redis_error(e.clone(), Some(writes[i].key), "complete"))
                })
            }
        };
        let mut replies = replies.into_iter();
        let mut again = Vec::new();
        for (i, answer) in answers.iter_mut().enumerate() {
            if answer.is_some() {
                continue;
            }
            *answer = match replies.next() {
                Some(Ok(reply)) => Some(owned_reply(reply, writes[i].key, "complete")),
                Some(Err(e)) if is_noscript(&e) || self.not_served(&e) => {
                    again.push(i);
                    None
                }
                Some(Err(e)) => Some(Err(map_redis_error(e, Some(writes[i].key), "complete"))),
                None => None,
            };
        }
        let resent = again.iter().map(|&i| {
            let w = writes[i];
            self.complete(w.key, w.owner, w.result, w.expires_at, now)
        });
        let mut resent = futures::future::join_all(resent).await.into_iter();
        fill(answers, |_| {
            resent
                .next()
                .unwrap_or_else(|| Err(unexpected("complete", "fewer replies than writes")))
        })
    }

    /// [`Repository::release`]: the release script, owner-checked.
    pub(super) async fn release_lease(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        now: Timestamp,
    ) -> Result<(), Error> {
        let reply = self
            .eval(
                &self.scripts.release,
                key,
                &[&owner.to_bytes(), &ts_bytes(now)],
                "release",
            )
            .await?;
        owned_reply(reply, key, "release")
    }

    /// [`Repository::extend`]: the extend script, owner-checked.
    pub(super) async fn extend_lease(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        lease_until: Timestamp,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Error> {
        let mut px_digits = itoa::Buffer::new();
        let px = px_digits.format(px(now, expires_at)).as_bytes();
        let reply = self
            .eval(
                &self.scripts.extend,
                key,
                &[
                    &owner.to_bytes(),
                    &ts_bytes(now),
                    &ts_bytes(lease_until),
                    &ts_bytes(expires_at),
                    px,
                ],
                "extend",
            )
            .await?;
        owned_reply(reply, key, "extend")
    }
}

/// A completion on its way: its index in the batch and its `finish` arguments.
pub(super) type Ready = (usize, FinishArgs);

/// One answer per completion of a batch, in order.
type Completed = Vec<Result<(), Error>>;

/// The finish script's arguments, owned (the value is the caller's).
pub(super) struct FinishArgs {
    pub(super) owner: [u8; 16],
    pub(super) now: [u8; 8],
    pub(super) expires: [u8; 8],
    pub(super) px: Vec<u8>,
    pub(super) code: [u8; 1],
    pub(super) flags: Vec<u8>,
}

impl FinishArgs {
    /// The script's arguments in order, `value` last.
    pub(super) fn slices<'a>(&'a self, value: Option<&'a [u8]>) -> [&'a [u8]; 7] {
        [
            &self.owner,
            &self.now,
            &self.expires,
            &self.px,
            &self.code,
            &self.flags,
            value.unwrap_or_default(),
        ]
    }
}
