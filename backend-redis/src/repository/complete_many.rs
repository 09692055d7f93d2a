//! A batch's completions on a standalone server: the `complete_many` script over
//! up to [`KEYS_PER_CALL`] keys at a time, every call in one pipeline.
//!
//! One script call per hundred completions instead of one `EVALSHA finish`
//! each saves the client a command to encode, send and parse per key (the
//! server's work per key is the same). Each key is decided as `finish`
//! decides it alone, and answered alone: one key's lost lease or foreign
//! value never touches another's answer.

use std::sync::atomic::Ordering;

use idempotency_core::{Completion, Error, RecordKey, Repository, Timestamp};
use redis::aio::ConnectionManager;
use redis::{Cmd, RedisResult, Value};

use super::commands::{fill, key_len, owned_reply, replies_missing, unexpected, KeyArg};
use super::finish::Ready;
use super::{Conn, RedisRepository};
use crate::codec::ts_bytes;
use crate::error::{is_cross_slot, is_noscript, map_redis_error};

/// The most keys one `complete_many` call carries.
pub(crate) const KEYS_PER_CALL: usize = 100;

/// The most bytes of results one call carries; a larger result goes in a
/// call of its own. A script holds the server's single thread while it runs,
/// so it must not copy many large values at once.
pub(crate) const VALUE_BYTES_PER_CALL: usize = 256 * 1024;

impl RedisRepository {
    /// [`Repository::complete_many`]: the script, or pipelined `finish`
    /// per key, where the connection allows.
    pub(super) async fn complete_batch(
        &self,
        completions: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        match &self.conn {
            Conn::Standalone(conn) if completions.len() > 1 => {
                if self.multi_key_scripts.load(Ordering::Relaxed) {
                    self.complete_scripted(conn.clone(), completions, now).await
                } else {
                    self.complete_pipelined(conn.clone(), completions, now)
                        .await
                }
            }
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) if completions.len() > 1 && self.nodes.is_some() => {
                let batch = |link, group| self.complete_pipelined(link, group, now);
                self.per_primary(
                    completions,
                    |c| c.key,
                    batch,
                    |c| self.complete(c.key, c.owner, c.result, c.expires_at, now),
                )
                .await
            }
            _ => {
                let each = completions
                    .into_iter()
                    .map(|c| self.complete(c.key, c.owner, c.result, c.expires_at, now));
                futures::future::join_all(each).await
            }
        }
    }

    /// Every completion through `complete_many` calls, pipelined: one round
    /// trip. A call the server's script cache lost (`NOSCRIPT`) is sent again
    /// with its source.
    ///
    /// Only the script's "completed" is final. A key it answered otherwise (a
    /// lease lost, a value that is not a record: rare) is completed again on
    /// its own with `finish`, whose answer stands, so that a proxy routing the
    /// whole call to the shard of its first key (as twemproxy and Envoy do)
    /// never turns another shard's completion into a lost lease. So are the
    /// keys of a call the server refused as a whole for anything but an
    /// outage: `CROSSSLOT` (keys of different slots; not run), or a proxy's
    /// refusal in its own words. A `CROSSSLOT`, or a key completed alone that
    /// the script did not complete, makes every later batch complete key by
    /// key.
    pub(super) async fn complete_scripted(
        &self,
        conn: ConnectionManager,
        writes: Vec<Completion<'_>>,
        now: Timestamp,
    ) -> Vec<Result<(), Error>> {
        let (mut answers, ready) = match self.completion_args(&writes, now) {
            Ok(args) => args,
            Err(answered) => return answered,
        };
        let calls = calls(&ready, |i| writes[i].result.map_or(0, <[u8]>::len));
        let replies = match self.send_calls(conn.clone(), &calls, &writes, now).await {
            Ok(replies) => replies,
            Err(e) => return fill(answers, |i| Err(pipeline_error(e.as_ref(), writes[i].key))),
        };
        // Keys to complete on their own with `finish`, whose answer stands.
        let mut alone = Vec::new();
        for (reply, call) in replies.iter().zip(&calls) {
            let keys = call.iter().map(|(i, _)| *i);
            match reply {
                Err(e) if is_cross_slot(e) => {
                    self.stop_multi_key_scripts("refuses scripts over keys of different slots");
                    alone.extend(keys);
                }
                // Refused as a whole, not for an outage (which the engine
                // retries): each key on its own says what holds for it.
                Err(e) if !map_redis_error(e.clone(), None, "complete").is_store_outage() => {
                    alone.extend(keys);
                }
                _ => {
                    for (n, (i, _)) in call.iter().enumerate() {
                        match call_answer(reply, n, call.len(), writes[*i].key) {
                            Err(Error::LeaseLost { .. } | Error::Corrupt { .. }) => alone.push(*i),
                            answer => answers[*i] = Some(answer),
                        }
                    }
                }
            }
        }
        if !alone.is_empty() {
            let again = alone.iter().map(|&i| writes[i]).collect();
            let answered = self.complete_pipelined(conn, again, now).await;
            for (i, answer) in alone.into_iter().zip(answered) {
                if answer.is_ok() {
                    self.stop_multi_key_scripts(
                        "completes keys one by one that its scripts did not",
                    );
                }
                answers[i] = Some(answer);
            }
        }
        fill(answers, |_| {
            Err(unexpected("complete", "fewer answers than writes"))
        })
    }

    /// Batches complete key by key from now on: the server (a proxy in front
    /// of shards) `why`.
    fn stop_multi_key_scripts(&self, why: &str) {
        if self
            .multi_key_scripts
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                "the Redis server {why} (a proxy in front of shards?); completing batches key \
                 by key from now on"
            );
        }
    }

    /// Every call in one pipeline, and again with the script's source each
    /// one the server answered `NOSCRIPT`: one reply per call, or the
    /// pipeline's error (`None`: replies missing).
    async fn send_calls(
        &self,
        mut conn: ConnectionManager,
        calls: &[&[Ready]],
        writes: &[Completion<'_>],
        now: Timestamp,
    ) -> Result<Vec<RedisResult<Value>>, Option<redis::RedisError>> {
        let stamp = ts_bytes(now);
        let script = &self.scripts.complete_many;
        let cmd = |verb: &str, body: &str, call: &[Ready]| {
            complete_many_cmd(verb, body.as_bytes(), &stamp, call, writes)
        };
        let mut pipe = redis::Pipeline::with_capacity(calls.len());
        pipe.ignore_errors();
        for call in calls {
            pipe.add_command(cmd("EVALSHA", &script.sha, call));
        }
        let replies = match pipe.query_async::<Vec<RedisResult<Value>>>(&mut conn).await {
            Ok(replies) if replies.len() == calls.len() => replies,
            Ok(_) => return Err(None),
            Err(e) => return Err(Some(e)),
        };
        let replies = replies.into_iter().zip(calls).map(|(reply, call)| {
            let mut conn = conn.clone();
            let cmd = &cmd;
            async move {
                match reply {
                    Err(e) if is_noscript(&e) => {
                        tracing::debug!(
                            script = script.name,
                            "NOSCRIPT: reloading the script with EVAL"
                        );
                        cmd("EVAL", &script.source, call)
                            .query_async(&mut conn)
                            .await
                    }
                    reply => reply,
                }
            }
        });
        Ok(futures::future::join_all(replies).await)
    }
}

/// The error of a whole pipeline, for `key`: the connection's, or replies
/// missing.
fn pipeline_error(e: Option<&redis::RedisError>, key: &RecordKey) -> Error {
    match e {
        Some(e) => map_redis_error(e.clone(), Some(key), "complete"),
        None => replies_missing("complete"),
    }
}

/// The answer for the `n`th of a call's `len` keys, `key`, from the call's
/// reply.
fn call_answer(
    reply: &RedisResult<Value>,
    n: usize,
    len: usize,
    key: &RecordKey,
) -> Result<(), Error> {
    match reply {
        Ok(Value::Array(items)) if items.len() == len => key_answer(&items[n], key),
        Ok(_) => Err(unexpected("complete", "not one answer per key")),
        Err(e) => Err(map_redis_error(e.clone(), Some(key), "complete")),
    }
}

/// The writes split into calls of at most [`KEYS_PER_CALL`] keys and
/// [`VALUE_BYTES_PER_CALL`] bytes of results (a larger result alone), in
/// order.
fn calls(writes: &[Ready], value_len: impl Fn(usize) -> usize) -> Vec<&[Ready]> {
    let mut calls = Vec::with_capacity(writes.len() / KEYS_PER_CALL + 1);
    let (mut start, mut bytes) = (0, 0);
    for (n, (i, _)) in writes.iter().enumerate() {
        let len = value_len(*i);
        let full = n - start == KEYS_PER_CALL || bytes + len > VALUE_BYTES_PER_CALL;
        if n > start && full {
            calls.push(&writes[start..n]);
            (start, bytes) = (n, 0);
        }
        bytes += len;
    }
    if start < writes.len() {
        calls.push(&writes[start..]);
    }
    calls
}

/// `EVAL`/`EVALSHA complete_many` over `call`'s keys: ARGV = now, then owner,
/// expires_at, PX, flags and value per key.
fn complete_many_cmd(
    verb: &str,
    body: &[u8],
    now: &[u8],
    call: &[Ready],
    writes: &[Completion<'_>],
) -> Cmd {
    let values = |i: usize| writes[i].result.unwrap_or_default();
    let data = verb.len()
        + body.len()
        + now.len()
        + call
            .iter()
            .map(|(i, a)| key_len(writes[*i].key) + 40 + a.px.len() + values(*i).len())
            .sum::<usize>();
    let mut cmd = Cmd::with_capacity(3 + call.len() * 6 + 1, data);
    cmd.arg(verb).arg(body).arg(call.len());
    for (i, _) in call {
        cmd.arg(KeyArg(writes[*i].key));
    }
    cmd.arg(now);
    for (i, a) in call {
        cmd.arg(&a.owner[..])
            .arg(&a.expires[..])
            .arg(&a.px[..])
            .arg(&a.flags[..])
            .arg(values(*i));
    }
    cmd
}

/// One key's item of the script's answer: 1, 0 (the lease lost), or the
/// problem with a value that is not a record.
fn key_answer(item: &Value, key: &RecordKey) -> Result<(), Error> {
    match item {
        Value::BulkString(problem) => Err(Error::Corrupt {
            key: Some(key.clone()),
            reason: String::from_utf8_lossy(problem).into_owned(),
        }),
        Value::Int(n) => owned_reply(Value::Int(*n), key, "complete"),
        _ => Err(unexpected(
            "complete",
            "an answer that is neither 0, 1 nor a problem",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::finish::FinishArgs;
    use super::*;
    use idempotency_core::OwnerToken;

    fn args() -> FinishArgs {
        FinishArgs {
            owner: OwnerToken::random().to_bytes(),
            now: [0; 8],
            expires: [0; 8],
            px: b"1000".to_vec(),
            code: [b'C'],
            flags: b"2".to_vec(),
        }
    }

    fn sizes(writes: &[Ready], lens: &[usize]) -> Vec<usize> {
        calls(writes, |i| lens[i]).iter().map(|c| c.len()).collect()
    }

    #[test]
    fn calls_hold_at_most_their_keys_and_bytes_in_order() {
        let writes: Vec<Ready> = (0..250).map(|i| (i, args())).collect();
        assert_eq!(sizes(&writes, &[10; 250]), [100, 100, 50]);
        // A result over the bound travels alone; small ones fill up to it.
        let mut lens = vec![10; 250];
        lens[3] = VALUE_BYTES_PER_CALL + 1;
        lens[7] = VALUE_BYTES_PER_CALL / 2;
        lens[8] = VALUE_BYTES_PER_CALL / 2;
        assert_eq!(sizes(&writes, &lens), [3, 1, 4, 100, 100, 42]);
        let flat: Vec<usize> = calls(&writes, |i| lens[i])
            .iter()
            .flat_map(|call| call.iter().map(|(i, _)| *i))
            .collect();
        assert_eq!(flat, (0..250).collect::<Vec<_>>());
        assert!(sizes(&[], &[]).is_empty());
    }

    #[test]
    fn key_answers_are_the_single_scripts() {
        let key = RecordKey::new("ns", "k", 256).unwrap();
        assert!(key_answer(&Value::Int(1), &key).is_ok());
        assert!(matches!(
            key_answer(&Value::Int(0), &key),
            Err(Error::LeaseLost { .. })
        ));
        match key_answer(&Value::BulkString(b"unknown status".to_vec()), &key) {
            Err(Error::Corrupt {
                key: Some(k),
                reason,
            }) => {
                assert_eq!(k, key);
                assert_eq!(reason, "unknown status");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            key_answer(&Value::Nil, &key),
            Err(Error::Backend { .. })
        ));
    }
}
