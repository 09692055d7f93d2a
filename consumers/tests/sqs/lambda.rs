//! Lambda's partial batch responses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_consumers::sqs::lambda::{handle_event, LambdaOptions, SqsEvent};
use idempotency_consumers::sqs::SqsMessage;
use idempotency_core::{ExecutionContext, HandlerError, MemoryRepository};

use super::support::*;

#[tokio::test]
async fn lambda_reports_every_message_not_acknowledged() {
    let repo = Arc::new(MemoryRepository::new());
    let manager = manager_on(&repo, config(Duration::from_secs(10), None));
    // order-9 is held by another attempt.
    let holder = manager_on(&repo, config(Duration::from_secs(10), None));
    let release = Arc::new(tokio::sync::Notify::new());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let held = tokio::spawn({
        let release = release.clone();
        async move {
            holder
                .execute("order-9", &"9", || async move {
                    let _ = started_tx.send(());
                    release.notified().await;
                    Ok::<_, HandlerError<String>>("9".to_owned())
                })
                .await
        }
    });
    started_rx.await.unwrap();

    let record = |id: &str, body: &str, key: Option<&str>| {
        let attributes = key.map_or_else(HashMap::new, |k| {
            HashMap::from([(
                KEY,
                serde_json::json!({"stringValue": k, "dataType": "String"}),
            )])
        });
        serde_json::json!({
            "messageId": id, "body": body, "messageAttributes": attributes,
            "attributes": {"ApproximateReceiveCount": "1"}, "eventSource": "aws:sqs",
        })
    };
    let event: SqsEvent = serde_json::from_value(serde_json::json!({"Records": [
        record("ok", "1", Some("order-1")),
        record("dup", "1", Some("order-1")),
        record("perm", "-1", Some("order-2")),
        record("flaky", "flaky", Some("order-3")),
        record("nokey", "4", None),
        record("held", "9", Some("order-9")),
    ]}))
    .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs.clone();
        move |message: SqsMessage, _ctx: ExecutionContext| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                match message.body.as_str() {
                    "-1" => Err(HandlerError::permanent("negative".to_owned())),
                    "flaky" => Err(HandlerError::transient("timeout".to_owned())),
                    _ => Ok(message.body),
                }
            }
        }
    };
    let response = handle_event(&manager, &LambdaOptions::default(), &event, handler).await;
    assert_eq!(
        serde_json::to_value(&response).unwrap(),
        serde_json::json!({"batchItemFailures": [
            {"itemIdentifier": "perm"},
            {"itemIdentifier": "flaky"},
            {"itemIdentifier": "nokey"},
            {"itemIdentifier": "held"},
        ]})
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "ok, perm, flaky; not dup, nokey, held"
    );
    release.notify_one();
    held.await.unwrap().unwrap();
}
