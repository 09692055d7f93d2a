//! Keeping a poll's messages invisible while their handlers run.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

use super::message::SqsMessage;
use super::settle::Settler;

/// How the visibility of in-flight messages is extended: every `every`, to
/// `extend_to` from then (the manager's `processing_timeout`, in step with
/// its lease keeper).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Heartbeat {
    pub(crate) every: Duration,
    pub(crate) extend_to: Duration,
}

/// Runs `work` while extending the visibility of `messages` (when there is
/// a heartbeat); the extensions stop once `work` is done, and one under way
/// is finished before this returns, so none lands after the poll is settled.
pub(crate) async fn keep_invisible<W: Future>(
    settler: &Settler<'_>,
    messages: &[SqsMessage],
    heartbeat: Option<Heartbeat>,
    work: W,
) -> W::Output {
    let Some(heartbeat) = heartbeat.filter(|_| !messages.is_empty()) else {
        return work.await;
    };
    let (stop, mut stopped) = watch::channel(false);
    let work = async move {
        let output = work.await;
        let _ = stop.send(true);
        output
    };
    let beats = async {
        let targets: Vec<(&SqsMessage, Duration)> =
            messages.iter().map(|m| (m, heartbeat.extend_to)).collect();
        loop {
            tokio::select! {
                biased;
                _ = stopped.changed() => break,
                () = tokio::time::sleep(heartbeat.every) => {}
            }
            let failed = settler.change_visibility(&targets, "heartbeat").await;
            tracing::debug!(
                messages = targets.len(),
                failed,
                extend_to = ?heartbeat.extend_to,
                "extended the visibility of in-flight messages"
            );
        }
    };
    let (output, ()) = tokio::join!(work, beats);
    output
}
