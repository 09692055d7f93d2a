//! The whole conformance suite against the harness's Redis server, once per
//! reserve strategy, and once with every batch reading first; the batch checks
//! also with both at once (reads first, then the reserve script for the keys
//! they leave open: a Redis 6 server's batches). (The same suite against a
//! Redis Cluster runs in `tests/redis.rs`.)

#![allow(clippy::expect_used)]

use std::sync::Arc;

use idempotency_conformance::containers;
use idempotency_core::SharedRepository;
use idempotency_redis::{BatchReads, RedisRepository, ReserveStrategy};

async fn connect(strategy: ReserveStrategy) -> SharedRepository {
    let server = containers::redis()
        .await
        .expect("a Redis server from the harness (see docs/testing.md)");
    let repo = RedisRepository::connect(server.url())
        .await
        .expect("connect to the harness's Redis server")
        .with_reserve_strategy(strategy);
    Arc::new(repo)
}

/// The default: `SET … NX PX … GET`, the reserve script only for takeovers.
async fn repository() -> SharedRepository {
    connect(ReserveStrategy::SetNxGet).await
}

idempotency_conformance::conformance_tests!(repository);

/// Every reservation through the reserve script.
mod script_strategy {
    use super::*;

    async fn repository() -> SharedRepository {
        connect(ReserveStrategy::Script).await
    }

    idempotency_conformance::conformance_tests!(repository);
}

/// Every batch's reservations read their records first (`MGET`), the writes
/// only for the keys the records leave open.
mod read_first_batches {
    use super::*;

    async fn repository() -> SharedRepository {
        let server = containers::redis()
            .await
            .expect("a Redis server from the harness (see docs/testing.md)");
        let repo = RedisRepository::connect(&format!("{}?batch_reads=always", server.url()))
            .await
            .expect("connect to the harness's Redis server");
        Arc::new(repo)
    }

    idempotency_conformance::conformance_tests!(repository);
}

/// Batches reading first, with the reserve script for the keys the reads
/// leave open (a Redis 6 server, which has no `SET … GET`, under the
/// adaptive plan's reads): the batch checks, since single operations never
/// read first.
mod read_first_with_the_script {
    use super::*;

    async fn check(name: &str) {
        let repo = RedisRepository::connect(
            containers::redis()
                .await
                .expect("a Redis server from the harness (see docs/testing.md)")
                .url(),
        )
        .await
        .expect("connect to the harness's Redis server")
        .with_reserve_strategy(ReserveStrategy::Script)
        .with_batch_reads(BatchReads::Always);
        let check = idempotency_conformance::check_named(name).expect("a check of the suite");
        if let Err(failure) = idempotency_conformance::run_check(check, Arc::new(repo)).await {
            panic!("conformance check `{name}` failed: {failure}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reserve_many_follows_reserve() {
        check("check_reserve_many_follows_reserve").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reserve_many_races_single_reserves() {
        check("check_reserve_many_races_single_reserves").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn complete_many_races_takeovers() {
        check("check_complete_many_races_takeovers").await;
    }
}

/// The errors clause, through a proxy the test can cut: corrupt values under
/// our keys, and a server that stops answering.
mod store_faults {
    use super::*;
    use idempotency_conformance::containers::{FaultProxy, ProxyFaults};
    use idempotency_conformance::SharedFaults;

    async fn repository_and_faults() -> (SharedRepository, SharedFaults) {
        let server = containers::redis()
            .await
            .expect("a Redis server from the harness (see docs/testing.md)");
        let proxy = FaultProxy::start(server.url())
            .await
            .expect("a fault proxy");
        let repo = RedisRepository::connect(&format!(
            "{}?response_timeout=1s&connect_timeout=1s",
            proxy.url()
        ))
        .await
        .expect("connect through the fault proxy");
        let faults = ProxyFaults::new(proxy, move |key| {
            let server = server.clone();
            async move {
                let redis_key = RedisRepository::redis_key(&key);
                server
                    .command(&["SET", &redis_key, "\u{1}not a record"])
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        });
        (Arc::new(repo), Arc::new(faults))
    }

    idempotency_conformance::store_fault_tests!(repository_and_faults);
}
