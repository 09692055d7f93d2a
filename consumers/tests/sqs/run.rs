//! `run` until shutdown, and FIFO keys.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::QueueAttributeName;
use idempotency_conformance::containers;
use idempotency_consumers::sqs::{KeySource, SqsConsumer, SqsMessage};
use idempotency_consumers::{Answer, Disposition};
use idempotency_core::{ExecutionContext, HandlerError, MemoryRepository};

use super::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_finishes_the_poll_under_way_when_shut_down() {
    let client = client().await;
    let url = queue(&client, "run", 30).await;
    let repo = Arc::new(MemoryRepository::new());
    let consumer = consumer(
        &client,
        &url,
        manager_on(&repo, config(Duration::from_secs(10), None)),
    )
    .await;
    for i in 0..3 {
        send(
            &client,
            &url,
            &format!("charge {i}"),
            Some(&format!("order-{i}")),
        )
        .await;
    }
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs.clone();
        move |message: SqsMessage, _ctx: ExecutionContext| {
            // Asked to stop from inside the first poll's handlers.
            let _ = stop.send(true);
            runs.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, HandlerError<String>>(message.body) }
        }
    };
    let shutdown = async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let stats = tokio::time::timeout(Duration::from_secs(20), consumer.run(shutdown, handler))
        .await
        .expect("run stops when told to");
    assert!(stats.polls >= 1);
    assert_eq!(stats.deleted, stats.messages, "{stats:?}");
    assert_eq!(u64::from(runs.load(Ordering::SeqCst)), stats.messages);
    let (visible, in_flight) = counts(&client, &url).await;
    assert_eq!(in_flight, 0, "every received message was settled");
    assert_eq!(visible + stats.messages, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_messages_are_keyed_by_their_deduplication_id() {
    let client = client().await;
    let server = containers::sqs().await.unwrap();
    let url = client
        .create_queue()
        .queue_name(format!("{}.fifo", server.unique_queue_name("fifo")))
        .attributes(QueueAttributeName::FifoQueue, "true")
        .attributes(QueueAttributeName::VisibilityTimeout, "30")
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_owned();
    let repo = Arc::new(MemoryRepository::new());
    let consumer = SqsConsumer::builder(
        client.clone(),
        manager_on(&repo, config(Duration::from_secs(10), None)),
        &url,
    )
    .key(KeySource::DeduplicationId)
    .wait_time(Duration::from_secs(1))
    .build()
    .await
    .unwrap();
    client
        .send_message()
        .queue_url(&url)
        .message_body("ship 1")
        .message_group_id("order-1")
        .message_deduplication_id("ship-order-1")
        .send()
        .await
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let report = poll_until_some(&consumer, counting(&runs), Duration::from_secs(10)).await;
    assert_eq!(report.messages[0].key.as_deref(), Some("ship-order-1"));
    assert_eq!(
        report.messages[0].disposition,
        Disposition::Ack(Answer::Executed)
    );
    assert_eq!(report.settled.deleted, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
