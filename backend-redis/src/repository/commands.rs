//! What every operation sends and reads: a record key as a command argument,
//! a command or a script sent where its key lives, and the common shapes of
//! the replies.

use std::io::Write as _;

use idempotency_core::{escape_namespace, Error, Record, RecordKey, Timestamp};
use redis::{Cmd, RedisError, RedisWrite, ToRedisArgs, Value};

use super::RedisRepository;
use crate::codec;
use crate::error::{is_noscript, map_redis_error, BACKEND};
use crate::scripts::LuaScript;

/// A physical TTL never exceeds this (about 146 million years), so
/// `now + PX` cannot overflow on the server.
const MAX_PX: u64 = 1 << 62;

impl RedisRepository {
    /// The Redis key a record is stored under: [`RecordKey::encode`], prefixed
    /// with `{}` when the id contains a `{`.
    ///
    /// Redis Cluster hashes only the part of a key between its first `{` and
    /// the first `}` after it, when that part is not empty (a *hash tag*). The
    /// namespace escapes its braces, but the id is verbatim, so an id such as
    /// `/orders/{id}` (an HTTP route template) would put every key of the
    /// route on one slot. An empty hash tag at the start makes Redis hash the
    /// whole key instead. The prefix keeps the encoding injective: an encoded
    /// key never starts with `{` (the namespace escapes it), so a key starting
    /// with `{}` is always a prefixed one, and the rest is the injective
    /// [`RecordKey::encode`]. Keys of ids without `{` are unchanged.
    ///
    /// ```
    /// use idempotency_core::RecordKey;
    /// use idempotency_redis::RedisRepository;
    ///
    /// let key = RecordKey::new("idempotency:payments", "order-42", 1024)?;
    /// // The namespace's `:` is escaped; the id follows the first `:`.
    /// assert_eq!(RedisRepository::redis_key(&key), "idempotency%3Apayments:order-42");
    /// let key = RecordKey::new("idempotency:payments", "/orders/{id}", 1024)?;
    /// assert_eq!(RedisRepository::redis_key(&key), "{}idempotency%3Apayments:/orders/{id}");
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn redis_key(key: &RecordKey) -> String {
        let encoded = key.encode();
        if needs_empty_hash_tag(key) {
            format!("{EMPTY_HASH_TAG}{encoded}")
        } else {
            encoded
        }
    }

    /// `cmd`, naming `key` when it names one. On a cluster reached by URL, a
    /// keyed command goes on our connection to the primary serving the key's
    /// slot and follows `MOVED` and `ASK` there (see `Nodes::send`): the
    /// cluster client's own redirections are unreliable while a slot moves
    /// under load (its `ASKING` and the command can be split by another
    /// request, and its slot refresh has been seen to stall every request
    /// until its timeout). Otherwise, or when the table or the primary cannot
    /// be reached, the command goes on the connection. (An `ASK` the cluster
    /// client gives up with is not followed here: its earlier attempts may
    /// have run the command.)
    pub(super) async fn send(
        &self,
        cmd: &Cmd,
        key: Option<&RecordKey>,
    ) -> Result<Value, RedisError> {
        #[cfg(feature = "cluster")]
        if let (Some(nodes), Some(key)) = (self.nodes.as_ref(), key) {
            if let Some(table) = self.slot_table(nodes).await {
                if let Some(reply) = nodes.send(&table, Self::slot(key), cmd).await {
                    return reply;
                }
            }
        }
        let _ = key;
        self.conn.query(cmd).await
    }

    pub(super) async fn query(
        &self,
        cmd: &Cmd,
        key: &RecordKey,
        operation: &'static str,
    ) -> Result<Value, Error> {
        self.send(cmd, Some(key))
            .await
            .map_err(|e| map_redis_error(e, Some(key), operation))
    }

    /// `EVALSHA`; after `NOSCRIPT`, `EVAL` with the source (which also caches it).
    pub(super) async fn eval(
        &self,
        script: &LuaScript,
        key: &RecordKey,
        args: &[&[u8]],
        operation: &'static str,
    ) -> Result<Value, Error> {
        let build = |verb: &str, body: &[u8]| script_cmd(verb, body, key, args);
        match self
            .send(&build("EVALSHA", script.sha.as_bytes()), Some(key))
            .await
        {
            Ok(v) => Ok(v),
            Err(e) if is_noscript(&e) => {
                tracing::debug!(
                    script = script.name,
                    "NOSCRIPT: reloading the script with EVAL"
                );
                self.query(&build("EVAL", script.source.as_bytes()), key, operation)
                    .await
            }
            Err(e) => Err(map_redis_error(e, Some(key), operation)),
        }
    }

    /// Runs one command for the operator operations.
    pub(crate) async fn command(&self, cmd: &Cmd, operation: &'static str) -> Result<Value, Error> {
        self.send(cmd, None)
            .await
            .map_err(|e| map_redis_error(e, None, operation))
    }

    /// Whether this repository talks to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.conn.kind() == "cluster"
    }

    pub(super) fn decode(key: &RecordKey, bytes: Vec<u8>) -> Result<Record, Error> {
        codec::decode_owned(bytes).map_err(|reason| Error::corrupt(key, reason))
    }

    pub(super) fn check_size(&self, what: &'static str, value: Option<&[u8]>) -> Result<(), Error> {
        match value {
            Some(v) if v.len() > self.max_result_bytes => Err(Error::TooLarge {
                what,
                size: v.len(),
                max: self.max_result_bytes,
            }),
            _ => Ok(()),
        }
    }
}

/// Answers by index in a batch, `None` until known.
pub(super) type Answers<T> = Vec<Option<Result<T, Error>>>;

/// Every answer, the missing ones (`None`) from `rest`, by index.
pub(super) fn fill<T>(
    answers: Vec<Option<Result<T, Error>>>,
    mut rest: impl FnMut(usize) -> Result<T, Error>,
) -> Vec<Result<T, Error>> {
    answers
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.unwrap_or_else(|| rest(i)))
        .collect()
}

/// `EVAL`/`EVALSHA` of `body` over one key.
pub(super) fn script_cmd(verb: &str, body: &[u8], key: &RecordKey, args: &[&[u8]]) -> Cmd {
    let data =
        verb.len() + body.len() + key_len(key) + args.iter().map(|a| a.len()).sum::<usize>() + 1;
    let mut cmd = Cmd::with_capacity(args.len() + 4, data);
    cmd.arg(verb).arg(body).arg(1).arg(KeyArg(key));
    for a in args {
        cmd.arg(*a);
    }
    cmd
}

/// `PX` for a record expiring at `expires_at`, seen at `now`: at least 1 ms.
pub(super) fn px(now: Timestamp, expires_at: Timestamp) -> u64 {
    expires_at
        .as_millis()
        .saturating_sub(now.as_millis())
        .clamp(1, MAX_PX)
}

/// Prepended to the Redis key of an id containing `{`: an empty hash tag, so
/// that Redis Cluster hashes the whole key (see [`RedisRepository::redis_key`]).
const EMPTY_HASH_TAG: &str = "{}";

/// Whether the id could form a hash tag: the namespace never holds a brace, so
/// only the id's first `{` can open one.
fn needs_empty_hash_tag(key: &RecordKey) -> bool {
    key.id().as_bytes().contains(&b'{')
}

/// A record key as a command argument, written straight into the command's
/// buffer: the same bytes as [`RedisRepository::redis_key`], without building
/// a `String` per call.
pub(super) struct KeyArg<'a>(pub(super) &'a RecordKey);

impl ToRedisArgs for KeyArg<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let namespace = escape_namespace(self.0.namespace());
        let tag: &[u8] = if needs_empty_hash_tag(self.0) {
            EMPTY_HASH_TAG.as_bytes()
        } else {
            b""
        };
        let mut arg = out.writer_for_next_arg();
        // The writer appends to the command's `Vec`: it cannot fail.
        for part in [tag, namespace.as_bytes(), b":", self.0.id().as_bytes()] {
            let _ = arg.write_all(part);
        }
    }
}

/// Room for a key's encoding: the namespace may grow when escaped, and the
/// command grows past this if it does.
pub(super) fn key_len(key: &RecordKey) -> usize {
    EMPTY_HASH_TAG.len() + key.namespace().len() + 1 + key.id().len()
}

/// A pipeline answered with fewer replies than commands: some may have run,
/// as ambiguous as a lost reply (an outage, so that the manager re-sends with
/// the same owner token).
pub(super) fn replies_missing(operation: &str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        message: format!("{operation}: a pipeline answered with replies missing"),
        source: None,
    }
}

pub(super) fn unexpected(operation: &str, what: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("{operation}: the server answered {what}"),
        source: None,
    }
}

/// The answer of an owner-checked script: 1 applied, 0 lease lost.
pub(super) fn owned_reply(
    reply: Value,
    key: &RecordKey,
    operation: &'static str,
) -> Result<(), Error> {
    match reply {
        Value::Int(1) => Ok(()),
        Value::Int(0) => Err(Error::LeaseLost { key: key.clone() }),
        _ => Err(unexpected(operation, "neither 0 nor 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_ID_BYTES;

    #[test]
    fn px_is_positive_and_bounded() {
        let t = Timestamp::from_millis;
        assert_eq!(px(t(1_000), t(4_000)), 3000);
        assert_eq!(px(t(5_000), t(4_000)), 1);
        assert_eq!(px(t(5_000), t(5_000)), 1);
        assert_eq!(px(t(0), Timestamp::MAX), MAX_PX);
    }

    #[test]
    fn key_argument_is_the_redis_key() {
        for (ns, id) in [
            ("idempotency", "order-42"),
            ("a:b", "c:d"),
            ("{tag}%", "{42}"),
            ("ns\n\u{85}é", "🦀"),
            ("routes", "/orders/{id}/items/{item}"),
            ("routes", "{"),
            ("routes", "}{}"),
        ] {
            let key = RecordKey::new(ns, id, MAX_ID_BYTES).unwrap();
            let mut cmd = Cmd::with_capacity(1, key_len(&key));
            cmd.arg(KeyArg(&key));
            let args: Vec<_> = cmd
                .args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(bytes) => bytes.to_vec(),
                    _ => Vec::new(),
                })
                .collect();
            assert_eq!(args, [RedisRepository::redis_key(&key).into_bytes()]);
        }
    }

    /// Every (namespace, id) over an alphabet of the characters that matter
    /// (braces, the separator, the escape character and what an escape
    /// produces), up to 3 characters each: distinct keys get distinct Redis
    /// keys; ids without `{` keep [`RecordKey::encode`], the others get `{}`
    /// in front; and only those start with `{`.
    #[test]
    fn redis_keys_are_injective() {
        const ALPHABET: [char; 7] = ['{', '}', ':', '%', '7', 'B', 'a'];
        fn strings(max: usize) -> Vec<String> {
            let mut all = vec![String::new()];
            let mut last = vec![String::new()];
            for _ in 0..max {
                last = last
                    .iter()
                    .flat_map(|s| ALPHABET.iter().map(move |c| format!("{s}{c}")))
                    .collect();
                all.extend(last.iter().cloned());
            }
            all
        }
        let parts = strings(3);
        let mut seen = std::collections::HashMap::with_capacity(parts.len() * parts.len());
        for ns in &parts {
            for id in parts.iter().filter(|id| !id.is_empty()) {
                let key = RecordKey::new(ns.as_str(), id, MAX_ID_BYTES).unwrap();
                let redis_key = RedisRepository::redis_key(&key);
                if id.contains('{') {
                    assert_eq!(redis_key, format!("{{}}{}", key.encode()));
                } else {
                    assert_eq!(redis_key, key.encode());
                    assert!(!redis_key.starts_with('{'), "{redis_key}");
                }
                if let Some(previous) = seen.insert(redis_key.clone(), (ns, id)) {
                    panic!("{previous:?} and {:?} both map to {redis_key:?}", (ns, id));
                }
            }
        }
    }

    /// With the client's slot function: the keys of one route template spread
    /// over the slots, where [`RecordKey::encode`] alone puts them on one; a
    /// namespace with braces never formed a tag.
    #[cfg(feature = "cluster")]
    #[test]
    fn brace_ids_spread_over_slots() {
        use redis::cluster_routing::Slot;
        use std::collections::HashSet;
        for template in ["/orders/{id}", "{tenant}:{order}", "x{y}z", "{"] {
            let keys: Vec<RecordKey> = (0..1000)
                .map(|i| RecordKey::new("api", format!("{template}-{i}"), MAX_ID_BYTES).unwrap())
                .collect();
            let slots: HashSet<Slot> = keys
                .iter()
                .map(|k| Slot::for_key(RedisRepository::redis_key(k)))
                .collect();
            // 1000 keys over 16384 slots: about 970 distinct ones expected.
            assert!(slots.len() > 900, "{template}: {} slots", slots.len());
            let former: HashSet<Slot> = keys.iter().map(|k| Slot::for_key(k.encode())).collect();
            if template != "{" {
                assert_eq!(former.len(), 1, "{template}: the former encoding");
            }
        }
        let keys: HashSet<Slot> = (0..1000)
            .map(|i| {
                let key = RecordKey::new("{tenant}", format!("order-{i}"), MAX_ID_BYTES).unwrap();
                Slot::for_key(RedisRepository::redis_key(&key))
            })
            .collect();
        assert!(keys.len() > 900, "{} slots", keys.len());
    }
}
