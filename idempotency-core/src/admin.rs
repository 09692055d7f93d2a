//! What an operator needs from a store beyond the [`Repository`](crate::Repository)
//! contract: listing records, counting them, creating what the store needs,
//! and checking the store's settings. Optional: a store offers it through
//! [`Repository::admin`](crate::Repository::admin); the `idempotency`
//! command-line tool uses it, and says so where a store has none.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! use idempotency_core::admin::ListFilter;
//! use idempotency_core::{Clock, MemoryRepository, Repository, SystemClock};
//!
//! let store = MemoryRepository::new();
//! let admin = store.admin().expect("the memory store lists its records");
//! let listing = admin.list(&ListFilter::default(), SystemClock.now()).await?;
//! assert!(listing.records.is_empty() && !listing.truncated);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

use crate::decision;
use crate::error::Error;
use crate::key::RecordKey;
use crate::record::{Record, Status};
use crate::time::Timestamp;

/// Which records [`Admin::list`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListFilter {
    /// Only namespaces starting with this (the manager's `key_prefix`, or a
    /// scope under it).
    pub namespace_prefix: Option<String>,
    /// Only records in this status.
    pub status: Option<Status>,
    /// Only stuck records: `Processing` with the lease ended for every
    /// consumer (a consumer that stopped without recording an outcome; the
    /// next delivery takes over), by [`decision::stuck`] under
    /// [`clock_skew`](Self::clock_skew).
    pub stuck: bool,
    /// The consumers' [`Config::clock_skew`](crate::Config::clock_skew): a
    /// lease counts as ended only this long after `lease_until` on the
    /// caller's clock, as consumers take over (default
    /// [`default_clock_skew`]).
    pub clock_skew: Duration,
    /// At most this many records.
    pub limit: usize,
}

impl Default for ListFilter {
    fn default() -> Self {
        ListFilter {
            namespace_prefix: None,
            status: None,
            stuck: false,
            clock_skew: default_clock_skew(),
            limit: 100,
        }
    }
}

impl ListFilter {
    /// Whether a live record under `namespace` passes the filter at `now`.
    pub fn admits(&self, namespace: &str, record: &Record, now: Timestamp) -> bool {
        !record.is_expired(now)
            && self
                .namespace_prefix
                .as_deref()
                .is_none_or(|p| namespace.starts_with(p))
            && self.status.is_none_or(|s| record.status == s)
            && (!self.stuck || decision::stuck(record, now, self.clock_skew))
    }

    /// The instant a stuck record's lease ended by, for a store that filters
    /// in a query: `status = 'processing' AND lease_until <= stuck_cutoff(now)`
    /// is [`admits`](Self::admits)' stuck rule.
    pub fn stuck_cutoff(&self, now: Timestamp) -> Timestamp {
        decision::skew_cutoff(now, self.clock_skew)
    }
}

/// The `clock_skew` operator operations assume when not told the consumers'
/// own: the library's default ([`Config::clock_skew`](crate::Config::clock_skew))
/// or 400 ms, whichever is larger.
///
/// Conservative on purpose: a larger skew calls a lease stuck, and lets a
/// purge remove a record, only later, which costs an operator a moment; a
/// smaller one than the consumers' lets an operator release a lease a
/// consumer still holds, and its handler run twice. Pass the consumers'
/// value when they set one.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::admin::default_clock_skew;
/// assert!(default_clock_skew() >= Duration::from_millis(400));
/// assert!(default_clock_skew() >= idempotency_core::Config::default().clock_skew);
/// ```
pub fn default_clock_skew() -> Duration {
    crate::Config::default()
        .clock_skew
        .max(Duration::from_millis(400))
}

/// One record of a [`Listing`], with its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The key's namespace.
    pub namespace: String,
    /// The key's id, as stored (long ids are digests).
    pub id: String,
    /// The record.
    pub record: Record,
}

/// What [`Admin::list`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Listing {
    /// The records, in the store's order.
    pub records: Vec<Listed>,
    /// Whether the limit cut the listing short (more records match).
    pub truncated: bool,
}

impl Listing {
    /// Adds `record` under `key` if `filter` admits it at `now`; `false` once
    /// the listing is full (a further admitted record sets `truncated`): stop
    /// scanning then.
    pub fn offer(
        &mut self,
        filter: &ListFilter,
        key: &RecordKey,
        record: Record,
        now: Timestamp,
    ) -> bool {
        if !filter.admits(key.namespace(), &record, now) {
            return true;
        }
        if self.records.len() >= filter.limit {
            self.truncated = true;
            return false;
        }
        self.records.push(Listed {
            namespace: key.namespace().to_owned(),
            id: key.id().to_owned(),
            record,
        });
        true
    }

    /// The listing of `rows` a query fetched with `LIMIT limit + 1` (the
    /// extra row says the listing is truncated): `key_of` reads a row's
    /// namespace and id columns, `decode` its record.
    ///
    /// # Errors
    /// The first error of either (an undecodable row is `Corrupt`, naming
    /// its key).
    pub fn from_rows<T>(
        rows: &[T],
        limit: usize,
        key_of: impl Fn(&T) -> Result<(Vec<u8>, Vec<u8>), Error>,
        decode: impl Fn(&T, &RecordKey) -> Result<Record, Error>,
    ) -> Result<Listing, Error> {
        let mut records = Vec::with_capacity(rows.len().min(limit));
        for row in rows.iter().take(limit) {
            let (namespace, id) = key_of(row)?;
            let namespace = String::from_utf8_lossy(&namespace).into_owned();
            let id = String::from_utf8_lossy(&id).into_owned();
            let key = RecordKey::new(namespace.as_str(), id.as_str(), usize::MAX)?;
            records.push(Listed {
                record: decode(row, &key)?,
                namespace,
                id,
            });
        }
        Ok(Listing {
            records,
            truncated: rows.len() > limit,
        })
    }
}

/// Live records of one namespace by status.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct NamespaceCounts {
    /// The namespace.
    pub namespace: String,
    /// `Processing` records (leases live or ended).
    pub processing: u64,
    /// Of those, stuck ([`decision::stuck`]: the lease ended for every
    /// consumer): until the next delivery takes over.
    pub stuck: u64,
    /// `Completed` records.
    pub completed: u64,
    /// `Failed` records.
    pub failed: u64,
}

/// What [`Admin::stats`] counted.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Stats {
    /// Counts per namespace, by namespace.
    pub namespaces: Vec<NamespaceCounts>,
    /// Expired records not yet removed (purge them), where the store keeps
    /// them.
    pub expired: u64,
    /// `Some(n)`: the counts come from a sample of `n` records, not all of
    /// them (where counting everything would load the server).
    pub sampled: Option<u64>,
}

impl Stats {
    /// Adds `record` of `namespace` to the counts at `now`, stuck by
    /// [`decision::stuck`] under the consumers' `clock_skew`.
    pub fn count(
        &mut self,
        namespace: &str,
        record: &Record,
        now: Timestamp,
        clock_skew: Duration,
    ) {
        if record.is_expired(now) {
            self.expired += 1;
            return;
        }
        let stuck = decision::stuck(record, now, clock_skew);
        self.add(namespace, record.status, stuck, 1);
    }

    /// Adds `n` live records of `namespace` in `status` (`stuck`: processing
    /// with the lease ended by [`decision::skew_cutoff`]`(now, clock_skew)`),
    /// as a `GROUP BY` returns them.
    pub fn add(&mut self, namespace: &str, status: Status, stuck: bool, n: u64) {
        let at = match self
            .namespaces
            .binary_search_by(|c| c.namespace.as_str().cmp(namespace))
        {
            Ok(at) => at,
            Err(at) => {
                let counts = NamespaceCounts {
                    namespace: namespace.to_owned(),
                    ..NamespaceCounts::default()
                };
                self.namespaces.insert(at, counts);
                at
            }
        };
        let counts = &mut self.namespaces[at];
        match status {
            Status::Processing => {
                counts.processing += n;
                counts.stuck += if stuck { n } else { 0 };
            }
            Status::Completed => counts.completed += n,
            Status::Failed => counts.failed += n,
        }
    }
}

/// The exclusive upper bound of the byte strings starting with `prefix`, for
/// a range scan (`key >= prefix AND key < upper`); `None` when there is none
/// (an empty prefix, or one of `0xff` bytes only).
///
/// ```
/// use idempotency_core::admin::prefix_upper_bound;
/// assert_eq!(prefix_upper_bound(b"idem"), Some(b"iden".to_vec()));
/// assert_eq!(prefix_upper_bound(b"a\xff"), Some(b"b".to_vec()));
/// assert_eq!(prefix_upper_bound(b""), None);
/// ```
pub fn prefix_upper_bound(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut upper = prefix.to_vec();
    while let Some(last) = upper.pop() {
        if last < 0xff {
            upper.push(last + 1);
            return Some(upper);
        }
    }
    None
}

/// The outcome of one [`Check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// As the library needs it.
    Pass,
    /// Works, with a risk the detail names.
    Warn,
    /// The library's guarantees do not hold: fix it.
    Fail,
}

/// One setting of a store, checked by [`Admin::doctor`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked (`maxmemory-policy`, `schema version`, …).
    pub name: String,
    /// The verdict.
    pub verdict: Verdict,
    /// What was found, and what it means for idempotency.
    pub detail: String,
    /// How to fix it, when it is not a pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    /// A passed check.
    pub fn pass(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Check {
            name: name.into(),
            verdict: Verdict::Pass,
            detail: detail.into(),
            fix: None,
        }
    }

    /// A warning, with its fix.
    pub fn warn(
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Check {
            name: name.into(),
            verdict: Verdict::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    /// A failure, with its fix.
    pub fn fail(
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Check {
            name: name.into(),
            verdict: Verdict::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    /// A store's schema at version `at` against the `latest` this library
    /// knows (0: never migrated).
    pub fn schema_version(at: u64, latest: u64) -> Check {
        let name = "schema version";
        match at {
            0 => Check::fail(
                name,
                "never migrated: the table the store needs does not exist, so every \
                 operation fails",
                "run `idempotency migrate` (or the repository's migrate())",
            ),
            at if at < latest => Check::fail(
                name,
                format!("at version {at}, this library needs {latest}"),
                "run `idempotency migrate` (or the repository's migrate())",
            ),
            at if at > latest => Check::fail(
                name,
                format!("at version {at}, newer than this library's {latest}"),
                "upgrade the library (or the tool) to the version that migrated the store",
            ),
            at => Check::pass(name, format!("at version {at}, the latest")),
        }
    }

    /// Expired records not yet removed, in a store without native expiry.
    pub fn purge_backlog(expired: u64) -> Check {
        if expired == 0 {
            Check::pass(
                "purge",
                "no expired records waiting; there is no native expiry, so keep a periodic \
                 purge_expired (or `idempotency purge`) scheduled",
            )
        } else {
            Check::warn(
                "purge",
                format!("{expired} expired record(s) not removed: there is no native expiry"),
                "schedule purge_expired (or `idempotency purge`) to run periodically",
            )
        }
    }

    /// The offset between this machine's clock and the server's, against
    /// the `clock_skew` the managers allow. `server` was read between
    /// `before` and `after` (this machine's clock); the offset is measured
    /// from the middle, and the round trip bounds its error.
    pub fn clock_offset(
        server: Timestamp,
        before: Timestamp,
        after: Timestamp,
        clock_skew: Duration,
    ) -> Check {
        let mid = before.as_millis() / 2 + after.as_millis() / 2;
        let (ahead, offset) = match server.as_millis().checked_sub(mid) {
            Some(d) => ("ahead of", d),
            None => ("behind", mid - server.as_millis()),
        };
        let rtt = after.as_millis().saturating_sub(before.as_millis());
        let detail = format!(
            "the server's clock is {offset} ms {ahead} this machine's (± {} ms); \
             clock_skew allows {} ms",
            rtt / 2 + 1,
            clock_skew.as_millis()
        );
        let skew = u64::try_from(clock_skew.as_millis()).unwrap_or(u64::MAX);
        if offset <= skew / 2 {
            Check::pass("clock offset", detail)
        } else if offset <= skew {
            Check::warn(
                "clock offset",
                detail,
                "synchronise the clocks (NTP/chrony); the offset uses up most of clock_skew",
            )
        } else {
            Check::fail(
                "clock offset",
                format!(
                    "{detail}: a consumer on this machine may take over a lease that has not \
                     ended on another's clock, and run a handler twice"
                ),
                "synchronise the clocks (NTP/chrony), or raise the managers' clock_skew above \
                 the offset",
            )
        }
    }
}

/// What [`Admin::doctor`] checks against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoctorOptions {
    /// The `clock_skew` of the managers using the store.
    pub clock_skew: Duration,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        DoctorOptions {
            clock_skew: default_clock_skew(),
        }
    }
}

/// Operator operations a store may offer ([`Repository::admin`](crate::Repository::admin)).
///
/// Listing and counting must never block the server (a cursor, an indexed
/// query, a paginated scan, a sample), and say when they sampled.
#[async_trait]
pub trait Admin: Send + Sync {
    /// Records that pass `filter` at `now`, up to its limit: stuck ones by
    /// [`ListFilter::admits`]' rule (in a query, `lease_until <=`
    /// [`ListFilter::stuck_cutoff`], never `<= now`).
    async fn list(&self, filter: &ListFilter, now: Timestamp) -> Result<Listing, Error>;

    /// Live records by namespace and status at `now`, stuck ones apart by
    /// [`decision::stuck`] under the consumers' `clock_skew` (in a query,
    /// `lease_until <=` [`decision::skew_cutoff`]`(now, clock_skew)`), and
    /// expired ones.
    async fn stats(&self, now: Timestamp, clock_skew: Duration) -> Result<Stats, Error>;

    /// Creates or upgrades what the store needs (tables, functions, TTL
    /// settings); idempotent. With `dry_run`, changes nothing. Returns the
    /// steps, done or to do; empty when everything is in place.
    async fn migrate(&self, dry_run: bool) -> Result<Vec<String>, Error>;

    /// Checks the store's settings the library relies on.
    async fn doctor(&self, options: &DoctorOptions) -> Result<Vec<Check>, Error>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::OwnerToken;

    fn processing(lease_until: u64) -> Record {
        Record {
            status: Status::Processing,
            owner: OwnerToken::from_u128(1),
            attempt: 1,
            fingerprint: None,
            result: None,
            error: None,
            retryable: false,
            lease_until: Timestamp::from_millis(lease_until),
            expires_at: Timestamp::from_millis(60_000),
            created_at: Timestamp::EPOCH,
            updated_at: Timestamp::EPOCH,
        }
    }

    /// Issue #42's scenario: a lease of 3 s, a skew of 2 s, the operator at
    /// 3.3 s. The lease ended on the operator's clock, not for every
    /// consumer: neither listed nor counted as stuck; 2 s after it, both.
    #[test]
    fn stuck_records_are_judged_with_the_consumers_skew() {
        let stuck = ListFilter {
            stuck: true,
            clock_skew: Duration::from_secs(2),
            ..ListFilter::default()
        };
        let record = processing(3_000);
        let at = Timestamp::from_millis;
        assert!(!stuck.admits("ns", &record, at(3_300)));
        assert!(!stuck.admits("ns", &record, at(4_999)));
        assert!(stuck.admits("ns", &record, at(5_000)));
        assert_eq!(stuck.stuck_cutoff(at(5_000)), at(3_000));
        let counted = |now| {
            let mut stats = Stats::default();
            stats.count("ns", &record, at(now), Duration::from_secs(2));
            (stats.namespaces[0].processing, stats.namespaces[0].stuck)
        };
        assert_eq!(counted(3_300), (1, 0));
        assert_eq!(counted(5_000), (1, 1));
        assert_eq!(ListFilter::default().clock_skew, default_clock_skew());
        assert_eq!(DoctorOptions::default().clock_skew, default_clock_skew());
    }

    #[test]
    fn clock_offsets_are_judged_against_the_skew() {
        let t = |ms| Timestamp::from_millis(ms);
        let skew = Duration::from_millis(400);
        let v = |server| Check::clock_offset(t(server), t(10_000), t(10_010), skew).verdict;
        assert_eq!(v(10_005), Verdict::Pass);
        assert_eq!(v(10_300), Verdict::Warn);
        assert_eq!(v(9_700), Verdict::Warn);
        assert_eq!(v(11_000), Verdict::Fail);
        assert_eq!(v(9_000), Verdict::Fail);
    }
}
