//! Deliveries held for a retry: each is requeued (`basic.nack` with
//! `requeue=true`) once its delay has passed, never before.

use std::time::Duration;

use lapin::options::BasicNackOptions;
use lapin::Acker;
use tokio::time::Instant;

use super::{settled, RabbitError};

/// The deliveries waiting for their retry time.
#[derive(Debug, Default)]
pub(crate) struct Held {
    waiting: Vec<(Instant, u64, Acker)>,
}

impl Held {
    /// Holds `acker`'s delivery until `due`.
    pub(crate) fn push(&mut self, due: Instant, delivery_tag: u64, acker: Acker) {
        self.waiting.push((due, delivery_tag, acker));
    }

    /// How many deliveries are held.
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// The earliest retry time, if any delivery is held.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.waiting.iter().map(|(due, _, _)| *due).min()
    }

    /// Requeues every delivery whose time has come. On a failure the channel
    /// is gone: the broker requeues every delivery it still held for it, so the
    /// rest are forgotten and the error returned.
    pub(crate) async fn release_due(&mut self, limit: Duration) -> Result<(), RabbitError> {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(at, _, _)| *at <= now);
        self.waiting = later;
        for (_, tag, acker) in due {
            let requeue = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            let result = settled(limit, "basic.nack (requeue)", acker.nack(requeue)).await;
            if let Err(e) = result {
                tracing::warn!(delivery_tag = tag, error = %e, "requeueing a held delivery failed; the broker requeues it when the channel closes");
                self.waiting.clear();
                return Err(e);
            }
            tracing::debug!(delivery_tag = tag, "held delivery requeued");
        }
        Ok(())
    }
}

/// Sleeps until `due`, or forever when there is nothing to wait for.
pub(crate) async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}
