//! The consumers' metrics, recorded through the `metrics` facade like the
//! core's (see `idempotency_core::metrics`).

use crate::disposition::Disposition;

/// Messages answered, by `broker`, `disposition` (`ack`, `retry`, `reject`)
/// and `reason` (the answer or the reason: `executed`, `duplicate`,
/// `in_progress`, `store_unavailable`, `handler_failed`, …).
pub const MESSAGES: &str = "idempotency_consumer_messages_total";
/// Messages the broker marked as delivered before, by `broker`.
pub const REDELIVERED: &str = "idempotency_consumer_redelivered_total";

/// Counts one message's disposition.
pub(crate) fn observe(broker: &'static str, disposition: &Disposition, redelivered: bool) {
    let kind = match disposition {
        Disposition::Ack(_) => "ack",
        Disposition::Retry { .. } => "retry",
        Disposition::Reject { .. } => "reject",
    };
    metrics::counter!(MESSAGES, "broker" => broker, "disposition" => kind, "reason" => disposition.label())
        .increment(1);
    if redelivered {
        metrics::counter!(REDELIVERED, "broker" => broker).increment(1);
    }
    tracing::debug!(broker, disposition = kind, reason = disposition.label(), redelivered, "message answered");
}
