//! Records must outlive every delivery of their message: a message the broker
//! still holds (or replays from its retention, or a dead-letter queue) after
//! its record expired runs its handler again. This module judges a broker's
//! retention against the records' `ttl`, for `idempotency doctor` and the
//! consumers' own start-up checks.

use std::time::Duration;

use idempotency_core::admin::Check;

/// The check's name in `doctor`'s report.
pub const CHECK: &str = "broker retention";

/// Judges `retention` (how long the broker keeps `source`'s messages; `None`:
/// forever) against the records' `ttl`: a pass when every message is gone
/// before its record, a warning otherwise.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::admin::Verdict;
/// use idempotency_consumers::retention::judge;
///
/// let day = Duration::from_secs(86_400);
/// assert_eq!(judge("sqs queue orders", day, Some(4 * day)).verdict, Verdict::Warn);
/// assert_eq!(judge("kafka topic orders", 8 * day, Some(7 * day)).verdict, Verdict::Pass);
/// assert_eq!(judge("kafka topic audit", 8 * day, None).verdict, Verdict::Warn);
/// ```
pub fn judge(source: &str, ttl: Duration, retention: Option<Duration>) -> Check {
    let kept = retention.map_or_else(|| "forever".to_owned(), |r| format!("for {}", human(r)));
    match retention {
        Some(retention) if retention <= ttl => Check::pass(
            CHECK,
            format!(
                "{source} keeps messages {kept}; records live {}: every message is gone \
                 before its record",
                human(ttl)
            ),
        ),
        _ => Check::warn(
            CHECK,
            format!(
                "{source} keeps messages {kept}, records live {}: a message delivered or \
                 replayed after its record expired runs its handler again",
                human(ttl)
            ),
            "keep records longer than the broker keeps messages (raise Config::ttl above the \
             retention), or shorten the retention",
        ),
    }
}

/// `1d 2h`, `45m`, `300ms`: the largest two units.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs == 0 {
        return format!("{}ms", d.as_millis());
    }
    let units = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let mut parts = Vec::new();
    let mut rest = secs;
    for (size, unit) in units {
        if rest >= size && parts.len() < 2 {
            parts.push(format!("{}{unit}", rest / size));
            rest %= size;
        } else if !parts.is_empty() {
            break;
        }
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human(Duration::from_secs(4 * 86_400)), "4d");
        assert_eq!(human(Duration::from_secs(86_400 + 7_200 + 5)), "1d 2h");
        assert_eq!(human(Duration::from_secs(3_600)), "1h");
        assert_eq!(human(Duration::from_secs(90)), "1m 30s");
        assert_eq!(human(Duration::from_millis(300)), "300ms");
    }

    #[test]
    fn a_retention_equal_to_the_ttl_passes() {
        let hour = Duration::from_secs(3_600);
        assert_eq!(
            judge("q", hour, Some(hour)).verdict,
            idempotency_core::admin::Verdict::Pass
        );
    }
}
