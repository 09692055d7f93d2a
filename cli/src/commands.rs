//! The commands on records: `get`, `list`, `evict` (one record, or every
//! record a filter matches), `purge`.

use std::time::Duration;

use idempotency::admin::{Admin, ListFilter};
use idempotency::decision::{skew_cutoff, stuck};
use idempotency::{Clock, Error, Record, RecordKey, SharedRepository, Status, SystemClock};
use serde_json::json;

use crate::exit::{within, Failure, NOTHING_MATCHED, PERMANENT, RETRYABLE};
use crate::keys::{self, shown, KeyArgs};
use crate::{progress, view};

/// How a command talks to the store and prints.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx {
    /// The bound of one call on one record or batch.
    pub(crate) limit: Duration,
    /// The bound of a call over the whole store (none unless `--timeout`).
    pub(crate) whole: Option<Duration>,
    /// The consumers' clock skew.
    pub(crate) skew: Duration,
    /// `--format json`.
    pub(crate) json: bool,
}

/// A key that names no live record: the output (JSON or a sentence), and
/// the exit status [`NOTHING_MATCHED`].
fn nothing_matched(key: &RecordKey, json: bool, what: &str) -> Failure {
    let shown = shown(key);
    let out = if json {
        json!({"found": false, "removed": false, "key": shown, "namespace": key.namespace(), "id": key.id()})
            .to_string()
    } else {
        format!("no live record for {shown} (never reserved, expired, or removed): {what}")
    };
    crate::emit(&out);
    Failure::new(format!("no live record for {shown}"), NOTHING_MATCHED)
}

pub(crate) async fn get(
    store: &SharedRepository,
    args: &KeyArgs,
    ctx: Ctx,
) -> Result<String, Failure> {
    let key = args.record_key(keys::max_id_bytes(store))?;
    let at = view::At::now(ctx.skew);
    let Some(record) = within(ctx.limit, store.get(&key, at.now)).await? else {
        return Err(nothing_matched(&key, ctx.json, "nothing to show"));
    };
    Ok(if ctx.json {
        let mut value = view::record_json(key.namespace(), key.id(), &record, at);
        value["found"] = json!(true);
        value.to_string()
    } else {
        view::record_table(key.namespace(), key.id(), &record, at)
    })
}

pub(crate) async fn list(
    admin: &dyn Admin,
    filter: &ListFilter,
    ctx: Ctx,
) -> Result<String, Failure> {
    let at = view::At::now(filter.clock_skew);
    let listing = within(ctx.whole, admin.list(filter, at.now)).await?;
    if ctx.json {
        let records: Vec<_> = listing
            .records
            .iter()
            .map(|l| view::record_json(&l.namespace, &l.id, &l.record, at))
            .collect();
        return Ok(json!({"records": records, "truncated": listing.truncated}).to_string());
    }
    let mut out = view::listing_table(&listing.records, at);
    out.push_str(&format!("\n{} record(s)", listing.records.len()));
    if listing.truncated {
        out.push_str(&format!(
            "; more match (raise --limit above {})",
            filter.limit
        ));
    }
    Ok(out)
}

/// What `evict` may remove.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Evicting {
    /// Only stuck records.
    pub(crate) only_if_stuck: bool,
    /// Live `processing` records too.
    pub(crate) force: bool,
}

/// Why a record read for eviction is left in place, if it is.
fn refusal(key: &RecordKey, record: &Record, rules: Evicting, at: view::At) -> Option<String> {
    let processing = record.status == Status::Processing;
    let is_stuck = stuck(record, at.now, at.skew);
    if rules.only_if_stuck && !is_stuck {
        let why = match processing {
            true => format!("its {}", view::lease_text(record, at)),
            false => format!("{} records are never stuck", record.status),
        };
        return Some(format!(
            "{} is {} and not stuck ({why}): left in place (--only-if-stuck)",
            shown(key),
            record.status
        ));
    }
    if processing && !is_stuck && !rules.force {
        return Some(format!(
            "{} is processing and not stuck: its {}. Its handler may still be running, and \
             removing the record lets the next delivery run the handler again. Add --force to \
             remove it anyway",
            shown(key),
            view::lease_text(record, at)
        ));
    }
    None
}

pub(crate) async fn evict(
    store: &SharedRepository,
    args: &KeyArgs,
    rules: Evicting,
    ctx: Ctx,
) -> Result<String, Failure> {
    let key = args.record_key(keys::max_id_bytes(store))?;
    let at = view::At::now(ctx.skew);
    let Some(record) = within(ctx.limit, store.get(&key, at.now)).await? else {
        return Err(nothing_matched(&key, ctx.json, "nothing to remove"));
    };
    if let Some(refused) = refusal(&key, &record, rules, at) {
        return Err(Failure::new(refused, PERMANENT));
    }
    let removed = remove(store, &key, &record, at.now, ctx.limit).await?;
    Ok(if ctx.json {
        json!({"removed": removed, "key": shown(&key), "was": view::record_json(key.namespace(), key.id(), &record, at)})
            .to_string()
    } else if removed {
        format!(
            "removed {} ({}); the next delivery of this key runs its handler",
            shown(&key),
            record.status
        )
    } else {
        format!("{} was already gone", shown(&key))
    })
}

/// Every record `filter` lists, evicted one by one under `rules`, with
/// progress: removed, left in place (refused or changed), already gone.
pub(crate) async fn evict_all(
    store: &SharedRepository,
    admin: &dyn Admin,
    filter: &ListFilter,
    rules: Evicting,
    ctx: Ctx,
) -> Result<String, Failure> {
    let at = view::At::now(ctx.skew);
    let listing = within(ctx.whole, admin.list(filter, at.now)).await?;
    if listing.records.is_empty() {
        let out = match ctx.json {
            true => json!({"matched": 0, "removed": 0, "left": [], "gone": 0}).to_string(),
            false => "no record matches the filter: nothing to remove".to_owned(),
        };
        crate::emit(&out);
        return Err(Failure::new(
            "no record matches the filter",
            NOTHING_MATCHED,
        ));
    }
    let max = keys::max_id_bytes(store);
    let bar = progress::bounded(
        listing.records.len() as u64,
        "evicting",
        progress::visible(ctx.json),
    );
    let (mut removed, mut gone, mut left) = (0u64, 0u64, Vec::new());
    for listed in &listing.records {
        let key = RecordKey::from_stored(listed.namespace.as_str(), &listed.id, max)?;
        let now = SystemClock.now();
        let at = view::At { now, ..at };
        // Read again: the listing may be old by now.
        match within(ctx.limit, store.get(&key, now)).await? {
            None => gone += 1,
            Some(record) => match refusal(&key, &record, rules, at) {
                Some(why) => left.push(json!({"key": shown(&key), "why": why})),
                None => match remove(store, &key, &record, now, ctx.limit).await {
                    Ok(true) => removed += 1,
                    Ok(false) => gone += 1,
                    Err(f) if f.code == RETRYABLE && f.message.contains("changed since") => {
                        left.push(json!({"key": shown(&key), "why": f.message}));
                    }
                    Err(f) => return Err(f),
                },
            },
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let matched = listing.records.len();
    Ok(if ctx.json {
        json!({"matched": matched, "removed": removed, "left": left, "gone": gone, "truncated": listing.truncated})
            .to_string()
    } else {
        let mut out = format!(
            "{matched} matched: removed {removed}, left {} in place, {gone} already gone",
            left.len()
        );
        for l in &left {
            out.push_str(&format!("\n  {}", l["why"].as_str().unwrap_or_default()));
        }
        if listing.truncated {
            out.push_str(&format!(
                "\nmore match: run again, or raise --limit above {}",
                filter.limit
            ));
        }
        out
    })
}

/// Removes the record read as `record`, and only that one. A `processing`
/// record goes through `release` with its owner's token: if it was taken
/// over or finished since it was read, the token no longer holds it and
/// nothing is removed (a plain delete would remove the new consumer's live
/// reservation, and its handler would run again). Other records do not
/// change hands, so a plain delete is exact.
async fn remove(
    store: &SharedRepository,
    key: &RecordKey,
    record: &Record,
    now: idempotency::Timestamp,
    limit: Duration,
) -> Result<bool, Failure> {
    if record.status != Status::Processing {
        return within(limit, store.delete(key)).await;
    }
    let released = within(limit, async {
        match store.release(key, record.owner, now).await {
            Err(Error::LeaseLost { .. }) => Ok(false),
            answer => answer.map(|()| true),
        }
    })
    .await?;
    match released {
        true => Ok(true),
        false => Err(Failure::new(
            format!(
                "{} changed since it was read (taken over, finished or removed): left in \
                 place; read it again",
                shown(key)
            ),
            RETRYABLE,
        )),
    }
}

/// What `purge` removes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Purging {
    /// At most this many records (none: all).
    pub(crate) most: Option<usize>,
    /// Records per call to the store.
    pub(crate) batch: usize,
}

pub(crate) async fn purge(
    store: &SharedRepository,
    Purging { most, batch }: Purging,
    ctx: Ctx,
) -> Result<String, Failure> {
    let batch = batch.max(1);
    let most = most.unwrap_or(usize::MAX);
    // Expired for every consumer: a consumer whose clock is behind this one's
    // (by up to the skew) still reads a record expired more recently.
    let before = skew_cutoff(SystemClock.now(), ctx.skew);
    let bar = progress::counting("purging expired records", progress::visible(ctx.json));
    let mut total = 0;
    loop {
        let want = batch.min(most - total);
        if want == 0 {
            break;
        }
        let n = within(ctx.limit, store.purge_expired(before, want)).await?;
        total += n;
        bar.set_position(total as u64);
        if n < want {
            break;
        }
    }
    bar.finish_and_clear();
    let native = store.capabilities().native_expiry;
    Ok(if ctx.json {
        json!({
            "purged": total,
            "native_expiry": native,
            "expired_before": view::instant(before),
        })
        .to_string()
    } else if native && total == 0 {
        "purged 0 records (this store removes expired records itself)".to_owned()
    } else {
        format!(
            "purged {total} record(s) expired by {} (now less --clock-skew {})",
            view::instant(before),
            humantime::format_duration(ctx.skew)
        )
    })
}
