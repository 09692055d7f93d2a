//! The operator operations a store may offer (`Repository::admin`): listing
//! and counting see exactly the live records, filtered as asked, and reading
//! them changes no record. A store without them (`admin()` is `None`), or one
//! that refuses them for its deployment (a Redis Cluster: `Config`), passes.

use std::time::Duration;

use idempotency_core::admin::{ListFilter, Listing};
use idempotency_core::{
    Error, OwnerToken, Record, RecordKey, ReserveRequest, SharedRepository, Status, Timestamp,
};

use crate::support::{ensure, ensure_eq, failure, random_namespace, Ctx, LEASE, TTL};
use crate::CheckResult;

/// The consumers' clock skew the listing check judges stuck leases with.
const SKEW: Duration = Duration::from_secs(2);

/// A filter of the records under `prefix`, stuck leases judged with [`SKEW`].
fn under(prefix: &str) -> ListFilter {
    ListFilter {
        namespace_prefix: Some(prefix.to_owned()),
        clock_skew: SKEW,
        ..ListFilter::default()
    }
}

/// The (namespace, id) pairs of a listing, sorted.
fn listed(listing: &Listing) -> Vec<(String, String)> {
    let mut keys: Vec<(String, String)> = listing
        .records
        .iter()
        .map(|l| (l.namespace.clone(), l.id.clone()))
        .collect();
    keys.sort();
    keys
}

/// The (namespace, id) pairs of `keys`, sorted.
fn pairs(keys: &[&RecordKey]) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = keys
        .iter()
        .map(|k| (k.namespace().to_owned(), k.id().to_owned()))
        .collect();
    pairs.sort();
    pairs
}

/// Records in every status, a lease that ended exactly the clock skew ago
/// (stuck), one that ended within the skew (not stuck: a consumer whose clock
/// is behind may still hold it), completed and failed records whose old
/// lease ended long ago (not stuck: only `Processing` records are), ids and
/// namespaces holding `:` (listed whole), one expired exactly now, one in a namespace
/// under the check's and one outside it: `admin().list` under the check's
/// namespace lists exactly the live records there and below (each as `get`
/// reads it), filtered by status, by stuck lease (`lease_until <= now -
/// clock_skew`, with the filter's skew, not a fixed one), cut at its limit and
/// saying so only when more match; `admin().stats` (unless it says it
/// sampled) counts them per namespace and status, stuck leases apart under
/// the skew it is given; and none of this changes a record.
pub async fn check_admin_lists_and_counts(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo.clone());
    let Some(admin) = repo.admin() else {
        return Ok(());
    };
    let t = cx.now();
    let written = t - Duration::from_secs(10);
    let child_ns = format!("{}:scope", cx.ns);
    let outside_ns = random_namespace();
    // Written in the past of `t` with this lease and expiry.
    let put = |key: RecordKey, lease_until: Timestamp, expires_at: Timestamp| {
        let cx = &cx;
        async move {
            let owner = OwnerToken::random();
            let req = ReserveRequest {
                now: written,
                lease_until,
                expires_at,
                ..cx.req(&key, owner)
            };
            cx.repo.reserve(req).await?;
            Ok::<_, Error>((key, owner))
        }
    };
    let (live, _) = put(cx.key("live"), t + LEASE, t + TTL).await?;
    let (stuck, _) = put(cx.key("stuck"), t - SKEW, t + TTL).await?;
    // Ended on the caller's clock, not on every consumer's.
    let ending = t - SKEW + Duration::from_millis(1);
    let (ending, _) = put(cx.key("ending"), ending, t + TTL).await?;
    let (gone, _) = put(cx.key("gone"), t - Duration::from_secs(5), t).await?;
    // Finished records whose old lease ended long ago: not stuck (only a
    // `Processing` record is). Ids holding `:` are listed whole.
    let ended = t - Duration::from_secs(5);
    let (done, owner) = put(cx.key("done:1"), ended, t + TTL).await?;
    cx.repo
        .complete(&done, owner, Some(b"r"), t + TTL, written)
        .await?;
    let (failed, owner) = put(cx.key("failed:a:b"), ended, t + TTL).await?;
    cx.repo
        .fail(&failed, owner, Some(b"e"), true, t + TTL, written)
        .await?;
    let (child, owner) = put(cx.key_in(&child_ns, "child:"), ended, t + TTL).await?;
    cx.repo
        .complete(&child, owner, None, t + TTL, written)
        .await?;
    let (outside, _) = put(cx.key_in(&outside_ns, "outside"), t + LEASE, t + TTL).await?;
    let mut before: Vec<(&RecordKey, Option<Record>)> = Vec::new();
    for key in [
        &live, &stuck, &ending, &gone, &done, &failed, &child, &outside,
    ] {
        before.push((key, cx.repo.get(key, t).await?));
    }

    let all = match admin.list(&under(&cx.ns), t).await {
        Ok(listing) => listing,
        // Not offered for this deployment of the store.
        Err(Error::Config { .. } | Error::Unsupported { .. }) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let everything = [&live, &stuck, &ending, &done, &failed, &child];
    ensure_eq!(
        listed(&all),
        pairs(&everything),
        "the live records under {:?} (not {gone}, expired, nor {outside})",
        cx.ns
    );
    ensure!(!all.truncated, "nothing more matches: {all:?}");
    for l in &all.records {
        let key = cx.key_in(&l.namespace, &l.id);
        let read = cx.repo.get(&key, t).await?;
        ensure_eq!(
            Some(&l.record),
            read.as_ref(),
            "{key}: listed as get reads it"
        );
    }
    for (filter, want, what) in [
        (
            ListFilter {
                status: Some(Status::Completed),
                ..under(&cx.ns)
            },
            vec![&done, &child],
            "completed",
        ),
        (
            ListFilter {
                status: Some(Status::Processing),
                ..under(&cx.ns)
            },
            vec![&live, &stuck, &ending],
            "processing",
        ),
        (
            ListFilter {
                status: Some(Status::Failed),
                ..under(&cx.ns)
            },
            vec![&failed],
            "failed",
        ),
        (
            ListFilter {
                stuck: true,
                ..under(&cx.ns)
            },
            vec![&stuck],
            "stuck (a lease that ended exactly the clock skew ago; not one that ended within it)",
        ),
        (
            ListFilter {
                stuck: true,
                clock_skew: Duration::ZERO,
                ..under(&cx.ns)
            },
            vec![&stuck, &ending],
            "stuck without a clock skew (every lease that ended)",
        ),
        (under(&child_ns), vec![&child], "under the longer prefix"),
        (
            ListFilter {
                limit: everything.len(),
                ..under(&cx.ns)
            },
            everything.to_vec(),
            "as many as the limit",
        ),
    ] {
        let listing = admin.list(&filter, t).await?;
        ensure_eq!(listed(&listing), pairs(&want), "{what}");
        ensure!(!listing.truncated, "{what}: nothing more matches");
    }
    let cut = admin
        .list(
            &ListFilter {
                limit: 2,
                ..under(&cx.ns)
            },
            t,
        )
        .await?;
    ensure_eq!(cut.records.len(), 2, "the limit: {cut:?}");
    ensure!(cut.truncated, "cut at the limit, it says so: {cut:?}");
    let all_pairs = pairs(&everything);
    ensure!(
        listed(&cut).iter().all(|p| all_pairs.contains(p)),
        "the limit keeps to the filter: {cut:?}"
    );

    for (skew, stuck_count) in [(SKEW, 1), (Duration::ZERO, 2)] {
        let stats = admin.stats(t, skew).await?;
        if stats.sampled.is_some() {
            continue;
        }
        let counts = |ns: &str| {
            stats
                .namespaces
                .iter()
                .find(|c| c.namespace == ns)
                .map(|c| (c.processing, c.stuck, c.completed, c.failed))
                .ok_or_else(|| failure(format!("stats count nothing under {ns:?}: {stats:?}")))
        };
        ensure_eq!(
            counts(&cx.ns)?,
            (3, stuck_count, 1, 1),
            "(processing, stuck, completed, failed) live under the check's namespace, stuck \
             leases judged with a clock skew of {skew:?}"
        );
        ensure_eq!(
            counts(&child_ns)?,
            (0, 0, 1, 0),
            "under the child namespace"
        );
    }

    for (key, was) in before {
        ensure_eq!(cx.repo.get(key, t).await?, was, "{key}: reading changed it");
    }
    Ok(())
}

/// `admin().list`'s namespace prefix is literal text: a prefix holding the
/// characters of SQL `LIKE` (`_`, `%`) and of glob patterns (`*`, `?`, `[…]`)
/// lists the records under exactly that prefix, not under sibling namespaces
/// those characters would match as a pattern.
pub async fn check_admin_list_prefix_is_literal(repo: SharedRepository) -> CheckResult {
    let cx = Ctx::new(repo.clone());
    let Some(admin) = repo.admin() else {
        return Ok(());
    };
    let prefix = format!("{}:a_b%c*d?e[f]g", cx.ns);
    let like_sibling = format!("{}:aXbYYc*d?e[f]g", cx.ns);
    let glob_sibling = format!("{}:a_b%cZZdQefg", cx.ns);
    let mut keys = Vec::new();
    for ns in [&prefix, &like_sibling, &glob_sibling] {
        let key = cx.key_in(ns, "k");
        cx.acquire(&key).await?;
        keys.push(key);
    }
    let listing = match admin.list(&under(&prefix), cx.now()).await {
        Ok(listing) => listing,
        Err(Error::Config { .. } | Error::Unsupported { .. }) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    ensure_eq!(
        listed(&listing),
        pairs(&[&keys[0]]),
        "only the namespace {prefix:?}, not the siblings its characters match as a pattern"
    );
    Ok(())
}
