//! Abandoned batches: a `poll_once` dropped mid-batch, or a handler panic
//! caught by a caller who keeps polling: the batch is read again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_consumers::kafka::rdkafka::message::OwnedMessage;
use idempotency_core::{ExecutionContext, HandlerError, MemoryRepository};

use crate::support::{counting, drive, key_of, unique, Broker, Effects};
use crate::{consumer, LIMIT};

/// `poll_once` dropped while its batch's handlers run (a caller's timeout or
/// `select!`): nothing is committed, and librdkafka's position is past the
/// batch. The next `poll_once` on the same consumer seeks back to the
/// batch's first message (its in-flight mark) and answers it before it
/// commits past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_poll_once_leaves_its_batch_to_be_read_again() {
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    for key in ["k-1", "k-2", "k-3"] {
        broker.produce(&topic, 0, Some(key), "p", None).await;
    }
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let consumer = consumer(&broker, &store, &group, &topic);
    let effects = Effects::default();
    let slow = |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
        let key = key_of(&message);
        effects.call(&key);
        let effects = effects.clone();
        async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            effects.apply(&key);
            Ok::<u32, HandlerError<String>>(1)
        }
    };
    // Wait until the first batch is in the handlers, then give up on it.
    let deadline = Instant::now() + LIMIT;
    while effects.calls("k-1") == 0 {
        let _ = tokio::time::timeout(Duration::from_millis(1500), consumer.poll_once(&slow)).await;
        assert!(Instant::now() < deadline, "never collected");
    }
    broker.produce(&topic, 0, Some("k-4"), "p", None).await;
    let tp = (topic.clone(), 0);
    drive(&consumer, counting(&effects), LIMIT, |c, _| {
        c.get(&tp) == Some(&4)
    })
    .await;
    assert_eq!(broker.committed(&group, &topic, 1).await, [Some(4)]);
    let applied = effects.applied();
    assert_eq!(
        (applied.get("k-1"), applied.get("k-2"), applied.get("k-3")),
        (Some(&1), Some(&1), Some(&1)),
        "offsets committed past k-1..k-3, whose handlers never completed: {applied:?}"
    );
}

/// A handler panic leaves the batch uncommitted; a consumer that goes on
/// polling after it (the panic caught around `poll_once`, or `run` spawned
/// on an `Arc` and restarted) first seeks back to the batch's first message,
/// so the message whose handler panicked (its key released) runs again
/// before its offset is committed past.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_handler_panicked_is_read_again() {
    use futures::FutureExt;
    let broker = Broker::start();
    let topic = broker.topic(1).await;
    for key in ["boom", "k-2"] {
        broker.produce(&topic, 0, Some(key), "p", None).await;
    }
    let store = Arc::new(MemoryRepository::new());
    let group = unique("group");
    let consumer = consumer(&broker, &store, &group, &topic);
    let effects = Effects::default();
    let handler = |message: Arc<OwnedMessage>, _ctx: ExecutionContext| {
        let key = key_of(&message);
        let call = effects.call(&key);
        assert!(!(key == "boom" && call == 1), "a bug in the handler");
        effects.apply(&key);
        std::future::ready(Ok::<u32, HandlerError<String>>(1))
    };
    let deadline = Instant::now() + LIMIT;
    loop {
        let polled = std::panic::AssertUnwindSafe(consumer.poll_once(&handler))
            .catch_unwind()
            .await;
        if polled.is_err() {
            break;
        }
        assert!(Instant::now() < deadline, "never panicked");
    }
    broker.produce(&topic, 0, Some("k-3"), "p", None).await;
    let tp = (topic.clone(), 0);
    drive(&consumer, &handler, LIMIT, |c, _| c.get(&tp) == Some(&3)).await;
    assert_eq!(
        effects.applied().get("boom"),
        Some(&1),
        "committed past `boom`, which never ran to completion: {:?}",
        effects.applied()
    );
}
