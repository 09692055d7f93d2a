//! Prefetch, broken connections, shutdown, set-up and configuration errors.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefetch_count_bounds_concurrent_handlers() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    for i in 0..12 {
        broker
            .publish(&queue, Some(&format!("order-{i}")), "work")
            .await;
    }
    let log = Log::default();
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let consumer = consumer(manager(), &queue, &log)
        .prefetch(3)
        .build()
        .unwrap();
    let connection = connect(&broker.url).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = {
        let (now, most) = (now.clone(), most.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    &connection,
                    move |_message, _ctx| {
                        let (now, most) = (now.clone(), most.clone());
                        async move {
                            let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(running, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(60)).await;
                            now.fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, HandlerError<String>>(())
                        }
                    },
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
        })
    };
    let seen = answers(&log, 12).await;
    drop(stop);
    tokio::time::timeout(PATIENCE, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(seen
        .iter()
        .all(|s| s.disposition == Disposition::Ack(Answer::Executed)));
    let most = most.load(Ordering::SeqCst);
    assert!(
        (2..=3).contains(&most),
        "at most the prefetch count at once: {most}"
    );
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_before_the_ack_redelivers_to_another_consumer_as_a_duplicate() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-5"), "charge 50").await;
    let repo: SharedRepository = Arc::new(MemoryRepository::new());
    let effects = Arc::new(AtomicUsize::new(0));
    let proxy = FaultProxy::start(&broker.url)
        .await
        .expect("a proxy to the broker");

    // Consumer A: its handler applies the effect, then waits while the
    // connection is cut, so its ack can never reach the broker.
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let log_a = Log::default();
    let consumer_a = consumer(
        manager_on(repo.clone(), Duration::from_secs(10)),
        &queue,
        &log_a,
    );
    let connection_a = connect(proxy.url()).await;
    let task_a = {
        let (started, release, effects) = (started.clone(), release.clone(), effects.clone());
        let consumer_a = consumer_a.build().unwrap();
        tokio::spawn(async move {
            consumer_a
                .run(
                    &connection_a,
                    move |message, _ctx| {
                        let (started, release, effects) =
                            (started.clone(), release.clone(), effects.clone());
                        async move {
                            effects.fetch_add(1, Ordering::SeqCst);
                            started.notify_one();
                            release.notified().await;
                            // The same result type as B's handler (it is replayed to B).
                            Ok::<_, HandlerError<String>>(message.body.len())
                        }
                    },
                    std::future::pending::<()>(),
                )
                .await
        })
    };
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .unwrap();
    proxy.reset();
    release.notify_one();
    let ended = tokio::time::timeout(PATIENCE, task_a)
        .await
        .unwrap()
        .unwrap();
    let error = ended.expect_err("a consumer whose connection died stops with an error");
    eprintln!("consumer A stopped: {error}");
    assert!(error.is_retryable(), "{error}");
    assert_eq!(log_a.lock().len(), 1, "A answered before it failed to ack");

    // Consumer B on a sound connection gets the message back.
    let log_b = Log::default();
    let runs_b = Arc::new(AtomicUsize::new(0));
    let consumer_b = consumer(manager_on(repo, Duration::from_secs(10)), &queue, &log_b);
    let running_b = spawn(consumer_b.build().unwrap(), &broker.url, runs_b.clone()).await;
    let seen = answers(&log_b, 1).await;
    running_b.stop().await.unwrap();
    assert!(seen[0].redelivered, "{seen:?}");
    assert_eq!(seen[0].disposition, Disposition::Ack(Answer::Duplicate));
    assert_eq!(runs_b.load(Ordering::SeqCst), 0);
    assert_eq!(effects.load(Ordering::SeqCst), 1, "one effect overall");
    assert_eq!(broker.ready(&queue).await, 0);
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_consumer_whose_connection_dies_stops_with_a_retryable_error() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let proxy = FaultProxy::start(&broker.url)
        .await
        .expect("a proxy to the broker");
    let log = Log::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let running = spawn(consumer, proxy.url(), runs).await;
    // Consuming: a message goes through.
    broker.publish(&queue, Some("order-8"), "charge 80").await;
    answers(&log, 1).await;

    proxy.reset();
    let ended = tokio::time::timeout(PATIENCE, running.task)
        .await
        .expect("a dead connection ends the run")
        .unwrap();
    let error = ended.expect_err("a consumer whose connection died stops with an error");
    assert!(error.is_retryable(), "{error}");
    assert!(!matches!(error, RabbitError::Cancelled { .. }), "{error}");
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_poll_under_way_finish_and_ack() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    broker.publish(&queue, Some("order-6"), "charge 60").await;
    let log = Log::default();
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let consumer = consumer(manager(), &queue, &log).build().unwrap();
    let connection = connect(&broker.url).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let mut task = {
        let (started, release) = (started.clone(), release.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    &connection,
                    move |_message, _ctx| {
                        let (started, release) = (started.clone(), release.clone());
                        async move {
                            started.notify_one();
                            release.notified().await;
                            Ok::<_, HandlerError<String>>(())
                        }
                    },
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
        })
    };
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .unwrap();
    drop(stop);
    // A negative check: the run must not end while its poll's handler is
    // held (50 ms is ample for a run that ignored the poll to return).
    let early = tokio::time::timeout(Duration::from_millis(50), &mut task).await;
    assert!(early.is_err(), "shutdown waits for the poll");
    release.notify_one();
    tokio::time::timeout(PATIENCE, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        log.lock()[0].disposition,
        Disposition::Ack(Answer::Executed)
    );
    assert_eq!(
        broker.ready(&queue).await,
        0,
        "acked before returning, not requeued"
    );
    broker.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_exchange_or_queue_refuses_to_start() {
    let broker = Broker::start().await;
    let (queue, _) = broker.queue(false).await;
    let log = Log::default();
    let connection = connect(&broker.url).await;
    let handler = |_message, _ctx| async { Ok::<_, HandlerError<String>>(()) };

    let no_dlx = consumer(manager(), &queue, &log)
        .dead_letter_exchange(containers::unique_namespace("missing"))
        .build()
        .unwrap();
    let error = no_dlx
        .run(&connection, handler, std::future::pending::<()>())
        .await
        .unwrap_err();
    assert!(matches!(error, RabbitError::Setup { .. }), "{error}");
    assert!(!error.is_retryable());

    let no_queue = consumer(manager(), &containers::unique_namespace("missing"), &log)
        .build()
        .unwrap();
    let error = no_queue
        .run(&connection, handler, std::future::pending::<()>())
        .await
        .unwrap_err();
    assert!(matches!(error, RabbitError::Setup { .. }), "{error}");
    broker.delete(&queue).await;
}

#[test]
fn inconsistent_configurations_fail_to_build() {
    let log = Log::default();
    let cases: Vec<(&str, RabbitConsumerBuilder)> = vec![
        ("prefetch", consumer(manager(), "q", &log).prefetch(0)),
        (
            "concurrency",
            consumer(manager(), "q", &log).prefetch(2).concurrency(3),
        ),
        ("concurrency", consumer(manager(), "q", &log).concurrency(0)),
        ("queue name", consumer(manager(), "", &log)),
        (
            "min_retry_delay",
            consumer(manager(), "q", &log).min_retry_delay(Duration::ZERO),
        ),
        (
            "operation_timeout",
            consumer(manager(), "q", &log).operation_timeout(Duration::ZERO),
        ),
        (
            "min_retry_delay",
            consumer(manager(), "q", &log)
                .min_retry_delay(Duration::from_secs(2))
                .max_retry_hold(Duration::from_secs(1)),
        ),
        (
            "header",
            consumer(manager(), "q", &log).keys(KeySource::header("")),
        ),
        (
            "consumer_timeout",
            consumer(manager(), "q", &log).consumer_timeout(Duration::from_secs(5)),
        ),
        // 8 prefetched deliveries one at a time: the last waits 8 leases of
        // 10 s, plus one for the poll before, past a 60 s consumer_timeout.
        (
            "consumer_timeout",
            consumer(manager(), "q", &log)
                .concurrency(1)
                .max_retry_hold(Duration::from_secs(10))
                .consumer_timeout(Duration::from_secs(60)),
        ),
    ];
    for (needle, builder) in cases {
        let error = builder.build().unwrap_err();
        assert!(matches!(error, RabbitError::Config(_)));
        assert!(!error.is_retryable());
        assert!(
            error.to_string().contains(needle),
            "{needle:?} not in {error}"
        );
    }
    assert!(consumer(manager(), "q", &log).build().is_ok());
    // Eight at once: two leases (this poll and the one before) fit in 60 s.
    assert!(consumer(manager(), "q", &log)
        .max_retry_hold(Duration::from_secs(10))
        .consumer_timeout(Duration::from_secs(60))
        .build()
        .is_ok());
}
