//! The cluster's slots: the slot a key hashes to, the primary serving each
//! slot (the slot table, from `CLUSTER SLOTS`), and the refusals that mean a
//! node does not serve a slot now.

use std::collections::HashMap;

use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

/// The number of hash slots of a Redis Cluster.
const SLOTS: u16 = 16384;

/// The slot of a Redis key: CRC16 (XMODEM) of its hash tag — the part between
/// its first `{` and the next `}`, when not empty — or of the whole key.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let tag = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(key)) % SLOTS
}

/// Whether the node refused a command without executing it because it does
/// not serve the command's slot now (or cannot yet): the key may go again on
/// its own, to the node that does.
pub(crate) fn is_not_served(err: &RedisError) -> bool {
    matches!(
        err.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
        )
    )
}

/// Where a `MOVED` or `ASK` reply sends its command (not executed), and
/// whether the slot moved there (`MOVED`) rather than is moving (`ASK`: the
/// key is no longer, or not yet, on the node asked). `None` for other errors.
pub(crate) fn redirected_to(err: &RedisError) -> Option<((String, u16), bool)> {
    let moved = match err.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => true,
        ErrorKind::Server(ServerErrorKind::Ask) => false,
        _ => return None,
    };
    let (node, _slot) = err.redirect_node()?;
    let (host, port) = node.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(((host.to_owned(), port.parse().ok()?), moved))
}

/// The node an `ASK` reply names.
pub(crate) fn asked_at(err: &RedisError) -> Option<(String, u16)> {
    redirected_to(err).and_then(|(address, moved)| (!moved).then_some(address))
}

/// Whether the node may have failed (no answer, or the connection broke):
/// its connection is dropped and the table read again.
pub(super) fn node_failed(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
}

/// Which primary serves each slot, as `CLUSTER SLOTS` last said.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct SlotTable {
    /// `(first slot, last slot, primary)`, sorted by first slot.
    ranges: Vec<(u16, u16, usize)>,
    /// Each primary's host and port.
    pub(super) primaries: Vec<(String, u16)>,
}

impl SlotTable {
    /// Parses a `CLUSTER SLOTS` reply: per range, its first and last slot and
    /// its primary's `[host, port, …]`. `None` for a reply of another shape or
    /// a primary without a usable host (empty or `?`: an unknown endpoint).
    pub(crate) fn parse(reply: &Value) -> Option<Self> {
        let Value::Array(entries) = reply else {
            return None;
        };
        let mut table = SlotTable::default();
        let mut known: HashMap<(String, u16), usize> = HashMap::new();
        for entry in entries {
            let Value::Array(fields) = entry else {
                return None;
            };
            let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return None;
            };
            let host = match primary.first() {
                Some(Value::BulkString(host)) => String::from_utf8(host.clone()).ok()?,
                Some(Value::SimpleString(host)) => host.clone(),
                _ => return None,
            };
            if host.is_empty() || host == "?" {
                return None;
            }
            let Some(Value::Int(port)) = primary.get(1) else {
                return None;
            };
            let address = (host, u16::try_from(*port).ok()?);
            let next = table.primaries.len();
            let node = *known.entry(address.clone()).or_insert_with(|| {
                table.primaries.push(address);
                next
            });
            let (first, last) = (u16::try_from(*first).ok()?, u16::try_from(*last).ok()?);
            table.ranges.push((first, last, node));
        }
        table.ranges.sort_unstable();
        Some(table)
    }

    /// The primary serving `slot`, if the table knows one.
    pub(crate) fn primary(&self, slot: u16) -> Option<usize> {
        let at = self.ranges.partition_point(|&(first, _, _)| first <= slot);
        let (first, last, node) = *self.ranges.get(at.checked_sub(1)?)?;
        (first..=last).contains(&slot).then_some(node)
    }

    /// A primary's host and port.
    pub(crate) fn address(&self, primary: usize) -> Option<&(String, u16)> {
        self.primaries.get(primary)
    }
}

/// Splits `items` into groups by the primary serving each one's slot, keeping
/// each item's index in the batch. Items of slots the table does not know
/// are groups of their own, without a primary.
pub(crate) fn by_primary<T>(
    items: Vec<T>,
    table: &SlotTable,
    slot: impl Fn(&T) -> u16,
) -> Vec<(Option<usize>, Vec<usize>, Vec<T>)> {
    let mut groups: Vec<(Option<usize>, Vec<usize>, Vec<T>)> = Vec::new();
    let mut of_primary: HashMap<usize, usize> = HashMap::new();
    for (i, item) in items.into_iter().enumerate() {
        let primary = table.primary(slot(&item));
        let group = match primary {
            Some(p) => *of_primary.entry(p).or_insert_with(|| {
                groups.push((primary, Vec::new(), Vec::new()));
                groups.len() - 1
            }),
            None => {
                groups.push((None, Vec::new(), Vec::new()));
                groups.len() - 1
            }
        };
        groups[group].1.push(i);
        groups[group].2.push(item);
    }
    groups
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use redis::cluster_routing::{Route, SlotAddr};

    pub(crate) fn node(host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    pub(crate) fn range(first: i64, last: i64, primary: Value) -> Value {
        Value::Array(vec![Value::Int(first), Value::Int(last), primary])
    }

    #[test]
    fn slots_map_to_their_primaries() {
        let reply = Value::Array(vec![
            range(10923, 16383, node("10.0.0.3", 6379)),
            range(100, 5460, node("10.0.0.1", 6379)),
            range(5461, 10922, node("10.0.0.2", 6379)),
            range(0, 99, node("10.0.0.1", 6379)),
        ]);
        let table = SlotTable::parse(&reply).expect("a CLUSTER SLOTS reply");
        let (a, b, c) = (table.primary(0), table.primary(5461), table.primary(16383));
        assert_eq!(
            table.address(a.unwrap()).unwrap(),
            &("10.0.0.1".to_owned(), 6379)
        );
        assert_eq!(
            table.address(b.unwrap()).unwrap(),
            &("10.0.0.2".to_owned(), 6379)
        );
        assert_eq!(
            table.address(c.unwrap()).unwrap(),
            &("10.0.0.3".to_owned(), 6379)
        );
        assert_eq!(table.primary(5460), a);
        assert_eq!(table.primary(10922), b);
        assert_eq!(table.primary(99), a, "two ranges of one primary");
        assert_eq!(table.primary(100), a);
        assert_eq!(table.primary(16384), None);
        let partial = SlotTable::parse(&Value::Array(vec![range(0, 99, node("h", 1))])).unwrap();
        assert_eq!(
            partial.primary(100),
            None,
            "an uncovered slot has no primary"
        );
    }

    #[test]
    fn other_replies_are_not_tables() {
        for reply in [
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(1)])]),
            Value::Array(vec![range(-1, 5, node("h", 1))]),
            Value::Array(vec![range(0, 5, node("h", 70000))]),
            Value::Array(vec![range(0, 5, Value::Array(vec![Value::Int(1)]))]),
            Value::Array(vec![range(0, 5, node("", 6379))]),
            Value::Array(vec![range(0, 5, node("?", 6379))]),
        ] {
            assert!(SlotTable::parse(&reply).is_none(), "{reply:?}");
        }
    }

    #[test]
    fn groups_follow_primaries_and_keep_indices() {
        let reply = Value::Array(vec![
            range(0, 8191, node("a", 1)),
            range(8192, 16000, node("b", 1)),
        ]);
        let table = SlotTable::parse(&reply).unwrap();
        let slots = [1_u16, 9000, 2, 16383, 8191, 16001];
        let groups = by_primary(slots.to_vec(), &table, |s| *s);
        assert_eq!(
            groups,
            vec![
                (Some(0), vec![0, 2, 4], vec![1, 2, 8191]),
                (Some(1), vec![1], vec![9000]),
                (None, vec![3], vec![16383]),
                (None, vec![5], vec![16001]),
            ]
        );
    }

    #[test]
    fn slots_are_the_clusters() {
        // The cluster specification's example, and hash tags.
        assert_eq!(slot_of(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(slot_of(b"foo{{bar}}zap"), slot_of(b"{bar"));
        // The client's own hashing agrees, hash tags and empty tags included.
        for key in [
            "{user1000}.following",
            "x",
            "",
            "foo{}{bar}",
            "foo{bar}{zap}",
            "{}idempotency%3Apayments:/orders/{id}",
            "idempotency%3Apayments:order-42",
        ] {
            let theirs = Route::with_key(key, SlotAddr::Master);
            assert_eq!(
                Route::new(slot_of(key.as_bytes()), SlotAddr::Master),
                theirs,
                "{key}"
            );
        }
    }

    #[test]
    fn refusals_that_executed_nothing() {
        let moved = RedisError::from((
            ErrorKind::Server(ServerErrorKind::Moved),
            "MOVED",
            "3999 127.0.0.1:6381".to_owned(),
        ));
        assert!(is_not_served(&moved));
        let other = RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "ERR"));
        assert!(!is_not_served(&other));
    }

    fn redirect(kind: ServerErrorKind, detail: &str) -> RedisError {
        RedisError::from((ErrorKind::Server(kind), "redirect", detail.to_owned()))
    }

    #[test]
    fn redirections_name_the_node_and_whether_the_slot_moved() {
        let at = |host: &str, port| (host.to_owned(), port);
        let moved = redirect(ServerErrorKind::Moved, "3999 127.0.0.1:6381");
        assert_eq!(redirected_to(&moved), Some((at("127.0.0.1", 6381), true)));
        assert_eq!(asked_at(&moved), None);
        let asked = redirect(ServerErrorKind::Ask, "3999 10.0.0.7:7002");
        assert_eq!(redirected_to(&asked), Some((at("10.0.0.7", 7002), false)));
        assert_eq!(asked_at(&asked), Some(at("10.0.0.7", 7002)));
        // IPv6 endpoints are announced without brackets; host names as given.
        let v6 = redirect(ServerErrorKind::Ask, "12 ::1:7000");
        assert_eq!(asked_at(&v6), Some(at("::1", 7000)));
        let named = redirect(ServerErrorKind::Moved, "12 redis-2.internal:6379");
        assert_eq!(
            redirected_to(&named),
            Some((at("redis-2.internal", 6379), true))
        );
        for unusable in [
            redirect(ServerErrorKind::Moved, "12"),
            redirect(ServerErrorKind::Ask, "12 no-port"),
            redirect(ServerErrorKind::TryAgain, "12 127.0.0.1:6381"),
            RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "ERR")),
        ] {
            assert_eq!(redirected_to(&unusable), None, "{unusable:?}");
        }
    }
}
