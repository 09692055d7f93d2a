//! How records, listings, counts and checks are shown: JSON for scripts,
//! aligned tables for people (colour only on a terminal).

use std::io::IsTerminal;
use std::time::Duration;

use comfy_table::{presets, Cell, Color, ColumnConstraint, ContentArrangement, Table};
use idempotency::admin::{Check, Listed, Stats, Verdict};
use idempotency::decision::{lease_ended, stuck};
use idempotency::{Clock, Record, Status, SystemClock, Timestamp};
use serde_json::{json, Value};

use crate::{http_view, keys};

/// How much of a result or stored error a table shows.
const PREVIEW_BYTES: usize = 2048;

/// The instant records are shown at, and the consumers' clock skew that
/// says whether a lease has ended for all of them (`decision::lease_ended`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct At {
    /// This machine's clock.
    pub(crate) now: Timestamp,
    /// The consumers' clock skew (`--clock-skew`).
    pub(crate) skew: Duration,
}

impl At {
    /// The system clock's now, judged with `skew`.
    pub(crate) fn now(skew: Duration) -> At {
        At {
            now: SystemClock.now(),
            skew,
        }
    }

    /// Whether `r` is stuck: processing, its lease over for every consumer.
    fn stuck(self, r: &Record) -> bool {
        stuck(r, self.now, self.skew)
    }
}

/// A processing record's lease for a person, as the stuck rule sees it:
/// "lease runs in 4s", "lease ended 1s ago, within the clock skew (2s)",
/// "lease ended 3s ago".
pub(crate) fn lease_text(r: &Record, at: At) -> String {
    let when = relative(r.lease_until, at.now);
    if r.lease_until > at.now {
        format!("lease runs {when}")
    } else if !lease_ended(r.lease_until, at.now, at.skew) {
        format!(
            "lease ended {when}, within the clock skew ({}): a consumer whose clock is behind \
             may still hold it",
            humantime::format_duration(at.skew)
        )
    } else {
        format!("lease ended {when}")
    }
}

/// `t` as an RFC 3339 instant, to the millisecond.
pub(crate) fn instant(t: Timestamp) -> String {
    humantime::format_rfc3339_millis(t.to_system_time()).to_string()
}

/// `t` relative to `now`: "in 4m 12s" or "3s ago", to the second.
pub(crate) fn relative(t: Timestamp, now: Timestamp) -> String {
    let (ms, future) = match t.as_millis().checked_sub(now.as_millis()) {
        Some(ms) => (ms, true),
        None => (now.as_millis() - t.as_millis(), false),
    };
    let rounded = Duration::from_secs(ms.div_ceil(1000));
    let text = humantime::format_duration(rounded).to_string();
    match (future, ms) {
        (_, 0) => "now".to_owned(),
        (true, _) => format!("in {text}"),
        (false, _) => format!("{text} ago"),
    }
}

/// A stored value as JSON: itself when it is JSON, a string when it is
/// UTF-8, else base64-free hex of its first bytes (with its size).
fn value(bytes: &[u8], limit: Option<usize>) -> Value {
    if let Ok(parsed) = serde_json::from_slice::<Value>(bytes) {
        return parsed;
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => Value::String(truncate(text, limit)),
        Err(_) => {
            let shown = &bytes[..bytes.len().min(limit.unwrap_or(64).min(64))];
            json!({
                "binary_bytes": bytes.len(),
                "hex_prefix": shown.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            })
        }
    }
}

fn truncate(text: &str, limit: Option<usize>) -> String {
    match limit {
        Some(limit) if text.len() > limit => {
            let mut end = limit;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}… ({} bytes)", &text[..end], text.len())
        }
        _ => text.to_owned(),
    }
}

/// The whole record as JSON (values in full). `lease_ended`: the lease is
/// over for every consumer (ended at least the clock skew ago); `stuck`:
/// that, and processing.
///
/// `key` is the key as the tool prints it and reads it back (`--key`). A
/// record the HTTP layer wrote also has `http_request` (caller, method,
/// route, key) and `http_response` (status, headers, body) when its result
/// is a stored response.
pub(crate) fn record_json(namespace: &str, id: &str, r: &Record, at: At) -> Value {
    let now = at.now;
    let response = r.result.as_deref().and_then(http_view::response);
    json!({
        "key": keys::shown_parts(namespace, id),
        "namespace": namespace,
        "id": id,
        "status": r.status.as_str(),
        "owner": r.owner.to_string(),
        "attempt": r.attempt,
        "lease_until": instant(r.lease_until),
        "lease": relative(r.lease_until, now),
        "lease_ended": lease_ended(r.lease_until, now, at.skew),
        "stuck": at.stuck(r),
        "expires_at": instant(r.expires_at),
        "expires": relative(r.expires_at, now),
        "created_at": instant(r.created_at),
        "updated_at": instant(r.updated_at),
        "fingerprint": r.fingerprint.map(|f| f.to_string()),
        "result_bytes": r.result.as_ref().map(Vec::len),
        "result": r.result.as_deref().map(|b| value(b, None)),
        "error": r.error.as_deref().map(|b| value(b, None)),
        "retryable": r.retryable,
        "http_request": http_view::request_json(id),
        "http_response": response
            .as_ref()
            .map(|resp| http_view::response_json(resp, |b| value(b, None))),
    })
}

/// One record for a person: a two-column table.
pub(crate) fn record_table(namespace: &str, id: &str, r: &Record, at: At) -> String {
    let now = at.now;
    let mut table = table();
    let mut row = |k: &str, v: String| {
        table.add_row(vec![Cell::new(k), Cell::new(v)]);
    };
    row("key", keys::shown_parts(namespace, id));
    row("namespace", namespace.to_owned());
    row("id", id.to_owned());
    if let Some(request) = http_view::request_text(id) {
        row("http request", request);
    }
    row("status", status_text(r, at));
    row("owner", r.owner.to_string());
    row("attempt", r.attempt.to_string());
    row(
        "lease until",
        format!(
            "{} ({})",
            instant(r.lease_until),
            relative(r.lease_until, now)
        ),
    );
    row(
        "expires at",
        format!(
            "{} ({})",
            instant(r.expires_at),
            relative(r.expires_at, now)
        ),
    );
    row("created at", instant(r.created_at));
    row("updated at", instant(r.updated_at));
    if let Some(f) = r.fingerprint {
        row("fingerprint", f.to_string());
    }
    if let Some(result) = &r.result {
        row("result", format!("{} bytes", result.len()));
        match http_view::response(result) {
            Some(response) => {
                row("http response", http_view::head_text(&response));
                row(
                    "body",
                    response.body().map_or_else(
                        || "not retained (larger than the layer's cap)".to_owned(),
                        |body| format!("{} bytes\n{}", body.len(), preview(body)),
                    ),
                );
                if let Some(trailers) = http_view::trailers_text(&response) {
                    row("trailers", trailers);
                }
            }
            None => row("preview", preview(result)),
        }
    }
    if let Some(error) = &r.error {
        row("error", preview(error));
        row("retryable", r.retryable.to_string());
    }
    table.to_string()
}

fn preview(bytes: &[u8]) -> String {
    match value(bytes, Some(PREVIEW_BYTES)) {
        Value::String(s) => s,
        other => truncate(
            &serde_json::to_string_pretty(&other).unwrap_or_default(),
            Some(PREVIEW_BYTES),
        ),
    }
}

fn status_text(r: &Record, at: At) -> String {
    match r.status {
        Status::Processing if at.stuck(r) => "processing (lease ended: stuck)".to_owned(),
        Status::Processing if r.lease_until <= at.now => {
            "processing (lease ended within the clock skew: not stuck yet)".to_owned()
        }
        status => status.as_str().to_owned(),
    }
}

/// A listing for a person.
pub(crate) fn listing_table(records: &[Listed], at: At) -> String {
    let now = at.now;
    let mut table = table();
    table.set_header(vec![
        "key (namespace:id, as --key takes it)",
        "status",
        "attempt",
        "lease",
        "expires",
        "result",
    ]);
    for l in records {
        let r = &l.record;
        table.add_row(vec![
            Cell::new(keys::shown_parts(&l.namespace, &l.id)),
            status_cell(r, at),
            Cell::new(r.attempt),
            Cell::new(relative(r.lease_until, now)),
            Cell::new(relative(r.expires_at, now)),
            Cell::new(
                r.result
                    .as_ref()
                    .map_or("–".to_owned(), |v| format!("{} B", v.len())),
            ),
        ]);
    }
    // A key is copied whole: its column is never wrapped.
    if let Some(column) = table.column_mut(0) {
        column.set_constraint(ColumnConstraint::ContentWidth);
    }
    table.to_string()
}

fn status_cell(r: &Record, at: At) -> Cell {
    let cell = Cell::new(status_text(r, at));
    match r.status {
        Status::Processing if at.stuck(r) => colour(cell, Color::Yellow),
        Status::Failed => colour(cell, Color::Red),
        _ => cell,
    }
}

/// Counts for a person; `skew` is the clock skew stuck leases were judged with.
pub(crate) fn stats_table(stats: &Stats, skew: Duration) -> String {
    let mut table = table();
    table.set_header(vec![
        "namespace",
        "processing",
        "of which stuck",
        "completed",
        "failed",
    ]);
    for c in &stats.namespaces {
        table.add_row(vec![
            Cell::new(&c.namespace),
            Cell::new(c.processing),
            Cell::new(c.stuck),
            Cell::new(c.completed),
            Cell::new(c.failed),
        ]);
    }
    let mut out = table.to_string();
    out.push_str(&format!(
        "\nstuck: processing, the lease ended at least {} (--clock-skew) ago",
        humantime::format_duration(skew)
    ));
    out.push_str(&format!("\nexpired, not yet purged: {}", stats.expired));
    if let Some(n) = stats.sampled {
        out.push_str(&format!(
            "\nsampled: counts from {n} records, not all of them"
        ));
    }
    out
}

/// Checks for a person.
pub(crate) fn checks_table(checks: &[Check]) -> String {
    let mut table = table();
    table.set_header(vec!["check", "verdict", "detail", "fix"]);
    for c in checks {
        let verdict = match c.verdict {
            Verdict::Pass => colour(Cell::new("pass"), Color::Green),
            Verdict::Warn => colour(Cell::new("warn"), Color::Yellow),
            Verdict::Fail => colour(Cell::new("FAIL"), Color::Red),
        };
        table.add_row(vec![
            Cell::new(&c.name),
            verdict,
            Cell::new(&c.detail),
            Cell::new(c.fix.as_deref().unwrap_or("")),
        ]);
    }
    table.to_string()
}

fn colour(cell: Cell, colour: Color) -> Cell {
    if std::io::stdout().is_terminal() {
        cell.fg(colour)
    } else {
        cell
    }
}

fn table() -> Table {
    let mut table = Table::new();
    table
        .load_preset(presets::UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic);
    if !std::io::stdout().is_terminal() {
        table.force_no_tty();
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_times_read_naturally() {
        let now = Timestamp::from_millis(1_000_000);
        assert_eq!(
            relative(Timestamp::from_millis(1_252_000), now),
            "in 4m 12s"
        );
        assert_eq!(relative(Timestamp::from_millis(997_000), now), "3s ago");
        assert_eq!(relative(now, now), "now");
    }

    #[test]
    fn values_are_shown_as_json_text_or_hex() {
        assert_eq!(value(br#"{"a":1}"#, None), json!({"a": 1}));
        assert_eq!(value(b"receipt-7", None), json!("receipt-7"));
        assert_eq!(
            value(&[0xff, 0x00], None),
            json!({"binary_bytes": 2, "hex_prefix": "ff00"})
        );
        assert_eq!(
            value("é".repeat(10).as_bytes(), Some(3)),
            json!("é… (20 bytes)")
        );
    }
}
