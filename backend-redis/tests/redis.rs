//! Backend-specific tests beyond the conformance suite.
//!
//! - On the harness's shared server: foreign values under our keys, physical TTLs
//!   against logical expiry, binary values.
//! - On dedicated harness containers (`RedisServer::dedicated`): counting
//!   commands (`INFO commandstats` is server-wide), `SCRIPT FLUSH`, stopping and
//!   restarting the server.
//! - On the harness's three-master Redis Cluster (feature `cluster`) and its
//!   TLS server (feature `tls`), both containers of the Redis image.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_conformance::containers::{self, RedisServer};
#[cfg(feature = "cluster")]
use idempotency_conformance::containers::{RedisClusterServer, RedisReply};
#[cfg(feature = "cluster")]
use idempotency_core::ExecuteError;
use idempotency_core::{
    Completion, Config, Error, HandlerError, IdempotencyManager, ManualClock, Outcome, OwnerToken,
    RecordKey, Repository, Reservation, ReserveRequest, SharedRepository, Status,
};
use idempotency_redis::redis;
use idempotency_redis::{BatchReads, RedisRepository, ReserveStrategy};

mod sharding_proxy;

const TTL: Duration = Duration::from_secs(3600);
const LEASE: Duration = Duration::from_secs(30);

/// The most executions `outage_and_recovery`'s load runs.
const LOAD_BOUND: u32 = 200_000;

async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// `INFO commandstats` as command → calls, without the test's own INFO/CONFIG.
async fn command_calls(admin: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_")?.split_once(':'))
        .filter(|(name, _)| !name.starts_with("info") && !name.starts_with("config"))
        .map(|(name, rest)| {
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            (name.to_owned(), calls)
        })
        .collect()
}

async fn reset_stats(admin: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(admin)
        .await
        .unwrap();
}

/// Runs `op` between two resets and returns the commands the server executed:
/// top-level commands and, listed separately by Redis too, those run inside a
/// script.
async fn commands_of<F: std::future::Future<Output = ()>>(
    admin: &mut redis::aio::MultiplexedConnection,
    op: F,
) -> BTreeMap<String, u64> {
    reset_stats(admin).await;
    op.await;
    command_calls(admin).await
}

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

fn request<'a>(key: &'a RecordKey, owner: OwnerToken, clock: &ManualClock) -> ReserveRequest<'a> {
    let now = clock.now();
    ReserveRequest {
        retry_failed: true,
        ..ReserveRequest::new(key, owner, now, LEASE, TTL)
    }
}

/// A reservation of each key by its owner.
fn requests_of<'a>(
    keys: &'a [RecordKey],
    owners: &[OwnerToken],
    clock: &ManualClock,
) -> Vec<ReserveRequest<'a>> {
    keys.iter()
        .zip(owners)
        .map(|(k, o)| request(k, *o, clock))
        .collect()
}

fn key(id: &str) -> RecordKey {
    RecordKey::new(format!("dedicated-{:x}", rand::random::<u32>()), id, 256).unwrap()
}

/// The support table of the crate docs, command by command. Redis lists the
/// commands a script runs under their own names, so each `evalsha` brings its
/// inner `get` and `set`/`del`; the round trips are the top-level commands
/// (`set` with `NX … GET`, `get`, `del`, `evalsha`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_per_operation() {
    let server = dedicated().await;
    let mut admin = admin(server.url()).await;
    let repo = RedisRepository::connect(server.url()).await.unwrap();
    assert_eq!(repo.effective_strategy(), ReserveStrategy::SetNxGet);
    let clock = ManualClock::starting_now();
    let now = clock.now();

    // Manager level: N fresh executions and N duplicates.
    let manager = IdempotencyManager::new(Arc::new(repo.clone()), Config::default())
        .unwrap()
        .with_clock(Arc::new(clock.clone()));
    const N: u64 = 25;
    let fresh = commands_of(&mut admin, async {
        for i in 0..N {
            let out = manager
                .execute(&format!("fresh-{i}"), &i, || async {
                    Ok::<_, HandlerError<String>>(i)
                })
                .await
                .unwrap();
            assert!(matches!(out, Outcome::Executed(_)));
        }
    })
    .await;
    // Per fresh execution: SET NX PX GET (reserve) + EVALSHA (complete, which
    // runs GET + SET inside).
    assert_eq!(
        fresh,
        counts(&[("set", 2 * N), ("evalsha", N), ("get", N)]),
        "fresh executions"
    );
    let top_level_fresh = fresh["set"] - fresh["get"] + fresh["evalsha"];
    assert_eq!(top_level_fresh, 2 * N, "2 round trips per fresh execution");

    let duplicates = commands_of(&mut admin, async {
        for i in 0..N {
            let out = manager
                .execute(&format!("fresh-{i}"), &i, || async {
                    Ok::<_, HandlerError<String>>(0)
                })
                .await
                .unwrap();
            assert!(matches!(out, Outcome::Cached(v) if v == i));
        }
    })
    .await;
    // Per duplicate: one SET NX PX GET, which returns the stored record.
    assert_eq!(duplicates, counts(&[("set", N)]), "1 command per duplicate");

    // Repository level, operation by operation.
    let k = key("ops");
    let owner = OwnerToken::random();
    let got = commands_of(&mut admin, async {
        assert_eq!(
            repo.reserve(request(&k, owner, &clock)).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
    })
    .await;
    assert_eq!(got, counts(&[("set", 1)]), "reserve (new)");
    // The owner's reserve re-sent (its reply was lost): answered from the
    // record `SET … NX … GET` returns, nothing else.
    let got = commands_of(&mut admin, async {
        assert_eq!(
            repo.reserve(request(&k, owner, &clock)).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
    })
    .await;
    assert_eq!(got, counts(&[("set", 1)]), "reserve (re-sent by the owner)");
    for (what, expires) in [("keeps", now + TTL), ("raises", now + TTL * 2)] {
        let got = commands_of(&mut admin, async {
            repo.extend(&k, owner, now + LEASE * 2, expires, now)
                .await
                .unwrap();
        })
        .await;
        assert_eq!(
            got,
            counts(&[("evalsha", 1), ("get", 1), ("set", 1)]),
            "extend ({what} the expiry)"
        );
    }
    let got = commands_of(&mut admin, async {
        assert!(repo.get(&k, now).await.unwrap().is_some());
    })
    .await;
    assert_eq!(got, counts(&[("get", 1)]), "get");
    let got = commands_of(&mut admin, async {
        repo.fail(&k, owner, Some(b"boom"), true, now + TTL, now)
            .await
            .unwrap();
    })
    .await;
    assert_eq!(
        got,
        counts(&[("evalsha", 1), ("get", 1), ("set", 1)]),
        "fail"
    );
    // Takeover of the failed record: SET NX GET sees it, the reserve script takes over.
    let taker = OwnerToken::random();
    let got = commands_of(&mut admin, async {
        assert_eq!(
            repo.reserve(request(&k, taker, &clock)).await.unwrap(),
            Reservation::Acquired { attempt: 2 }
        );
    })
    .await;
    assert_eq!(
        got,
        counts(&[("set", 2), ("evalsha", 1), ("get", 1)]),
        "reserve (takeover)"
    );
    let got = commands_of(&mut admin, async {
        repo.release(&k, taker, now).await.unwrap();
    })
    .await;
    assert_eq!(
        got,
        counts(&[("evalsha", 1), ("get", 1), ("del", 1)]),
        "release"
    );
    let got = commands_of(&mut admin, async {
        assert!(!repo.delete(&k).await.unwrap());
    })
    .await;
    assert_eq!(got, counts(&[("del", 1)]), "delete");
    let got = commands_of(&mut admin, async {
        let lost = repo.complete(&k, owner, None, now + TTL, now).await;
        assert!(matches!(lost, Err(Error::LeaseLost { .. })), "{lost:?}");
    })
    .await;
    assert_eq!(
        got,
        counts(&[("evalsha", 1), ("get", 1)]),
        "complete (lease lost)"
    );
    let got = commands_of(&mut admin, async {
        assert_eq!(repo.purge_expired(now, 100).await.unwrap(), 0);
    })
    .await;
    assert_eq!(got, counts(&[]), "purge_expired");

    // The script strategy: one EVALSHA per reserve, whatever the outcome.
    let script = repo.clone().with_reserve_strategy(ReserveStrategy::Script);
    let k = key("script");
    let got = commands_of(&mut admin, async {
        script
            .reserve(request(&k, OwnerToken::random(), &clock))
            .await
            .unwrap();
        script
            .reserve(request(&k, OwnerToken::random(), &clock))
            .await
            .unwrap();
    })
    .await;
    assert_eq!(
        got,
        counts(&[("evalsha", 2), ("get", 2), ("set", 1)]),
        "script reserve: new + duplicate"
    );
    let k = key("script-resent");
    let owner = OwnerToken::random();
    script.reserve(request(&k, owner, &clock)).await.unwrap();
    let got = commands_of(&mut admin, async {
        assert_eq!(
            script.reserve(request(&k, owner, &clock)).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
    })
    .await;
    assert_eq!(
        got,
        counts(&[("evalsha", 1), ("get", 1)]),
        "script reserve: re-sent by the owner, no write"
    );
}

/// After `SCRIPT FLUSH` (or a restart) every operation reloads its script with
/// one `EVAL` and goes on; the next call is back to `EVALSHA`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_reloads_transparently() {
    let server = dedicated().await;
    let mut admin = admin(server.url()).await;
    for strategy in [ReserveStrategy::SetNxGet, ReserveStrategy::Script] {
        let repo = RedisRepository::connect(server.url())
            .await
            .unwrap()
            .with_reserve_strategy(strategy);
        let clock = ManualClock::starting_now();
        let now = clock.now();
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        let k = key("flush");
        let owner = OwnerToken::random();
        let got = commands_of(&mut admin, async {
            assert_eq!(
                repo.reserve(request(&k, owner, &clock)).await.unwrap(),
                Reservation::Acquired { attempt: 1 }
            );
            repo.extend(&k, owner, now + LEASE * 2, now + TTL * 2, now)
                .await
                .unwrap();
            repo.complete(&k, owner, Some(b"\0ok\xff"), now + TTL, now)
                .await
                .unwrap();
        })
        .await;
        let reloads = got.get("eval").copied().unwrap_or(0);
        let expected_reloads = if strategy == ReserveStrategy::Script {
            3
        } else {
            2
        };
        assert_eq!(
            reloads, expected_reloads,
            "{strategy:?}: one EVAL per flushed script: {got:?}"
        );
        let rec = repo.get(&k, now).await.unwrap().unwrap();
        assert_eq!(rec.status, Status::Completed);
        assert_eq!(rec.result.as_deref(), Some(&b"\0ok\xff"[..]));
        // Cached again: the same calls use EVALSHA only.
        let k2 = key("after-flush");
        let owner2 = OwnerToken::random();
        let got = commands_of(&mut admin, async {
            repo.reserve(request(&k2, owner2, &clock)).await.unwrap();
            repo.extend(&k2, owner2, now + LEASE * 2, now + TTL * 2, now)
                .await
                .unwrap();
            repo.complete(&k2, owner2, None, now + TTL, now)
                .await
                .unwrap();
        })
        .await;
        assert!(
            !got.contains_key("eval"),
            "{strategy:?}: reloaded twice: {got:?}"
        );
        // Release and fail go through the reload path too.
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        let k3 = key("flush-release");
        let owner3 = OwnerToken::random();
        repo.reserve(request(&k3, owner3, &clock)).await.unwrap();
        repo.release(&k3, owner3, now).await.unwrap();
        let k4 = key("flush-fail");
        let owner4 = OwnerToken::random();
        repo.reserve(request(&k4, owner4, &clock)).await.unwrap();
        repo.fail(&k4, owner4, None, false, now + TTL, now)
            .await
            .unwrap();
        assert_eq!(
            repo.get(&k4, now).await.unwrap().unwrap().status,
            Status::Failed
        );
    }
}

async fn dedicated() -> containers::Dedicated<RedisServer> {
    RedisServer::dedicated()
        .await
        .expect("a dedicated Redis container from the harness (see docs/testing.md)")
}

fn is_outage(e: &Error) -> bool {
    matches!(e, Error::Unavailable { .. } | Error::Timeout { .. })
}

/// Writes the server refuses for now — `OOM` at `maxmemory` under
/// `noeviction`, `NOREPLICAS` below `min-replicas-to-write` — are retryable
/// outages, single and batched, scripts included: a completion refused that
/// way is retried with the same owner token, never given up as a permanent
/// error (which would leave the record `Processing` for a takeover to run the
/// handler again). Once the server accepts writes, the same calls go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_refused_for_now_are_retryable_outages() {
    let server = dedicated().await;
    let mut admin = admin(server.url()).await;
    let repo = RedisRepository::connect(server.url()).await.unwrap();
    let clock = ManualClock::starting_now();
    let now = clock.now();
    let held: Vec<RecordKey> = (0..3).map(|i| key(&format!("held-{i}"))).collect();
    let owner = OwnerToken::random();
    for k in &held {
        repo.reserve(request(k, owner, &clock)).await.unwrap();
    }
    let refusals = [("maxmemory", "1", "0"), ("min-replicas-to-write", "1", "0")];
    for (setting, refusing, accepting) in refusals {
        let set = |value: &'static str| {
            redis::cmd("CONFIG")
                .arg("SET")
                .arg(setting)
                .arg(value)
                .to_owned()
        };
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("noeviction")
            .query_async(&mut admin)
            .await
            .unwrap();
        let _: () = set(refusing).query_async(&mut admin).await.unwrap();
        let fresh = key("fresh");
        let single = [
            repo.reserve(request(&fresh, OwnerToken::random(), &clock))
                .await
                .map(drop),
            repo.complete(&held[0], owner, Some(b"r"), now + TTL, now)
                .await,
            repo.extend(&held[0], owner, now + LEASE, now + TTL, now)
                .await,
        ];
        let fresh_keys = [key("a"), key("b")];
        let batched = repo
            .reserve_many(requests_of(&fresh_keys, &[OwnerToken::random(); 2], &clock))
            .await
            .into_iter()
            .map(|a| a.map(drop));
        let writes: Vec<Completion<'_>> = held[1..]
            .iter()
            .map(|k| Completion {
                key: k,
                owner,
                result: None,
                expires_at: now + TTL,
            })
            .collect();
        let completed = repo.complete_many(writes.clone(), now).await;
        for answer in single.into_iter().chain(batched).chain(completed) {
            let e = answer.expect_err(&format!("{setting} {refusing}: refused"));
            assert!(
                matches!(e, Error::Unavailable { .. }) && e.is_retryable(),
                "{setting} {refusing}: {e:?}"
            );
        }
        let _: () = set(accepting).query_async(&mut admin).await.unwrap();
        assert!(repo
            .reserve(request(&fresh, OwnerToken::random(), &clock))
            .await
            .is_ok());
        if setting == "min-replicas-to-write" {
            repo.complete(&held[0], owner, Some(b"r"), now + TTL, now)
                .await
                .unwrap();
            for answer in repo.complete_many(writes, now).await {
                answer.unwrap();
            }
        }
    }
    for k in &held {
        assert_eq!(
            repo.get(k, now).await.unwrap().unwrap().status,
            Status::Completed
        );
    }
}

/// The server dies mid-run: calls fail with a typed, retryable error (no panic,
/// no hang); once it is back, the same repository works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outage_and_recovery() {
    let server = dedicated().await;
    let repo = Arc::new(
        RedisRepository::connect(&format!(
            "{}?connect_timeout=500ms&response_timeout=2s",
            server.url()
        ))
        .await
        .unwrap(),
    );
    let clock = ManualClock::starting_now();
    // A short lease: an execution caught by the stop between its handler and
    // its completion retries the completion until shortly before the lease
    // ends (the contract's recording bound), and the default lease is 300 s.
    let config = Config {
        processing_timeout: Duration::from_secs(10),
        ttl: Duration::from_secs(60),
        store_timeout: Duration::from_secs(2),
        ..Config::default()
    };
    let manager = Arc::new(
        IdempotencyManager::new(repo.clone() as SharedRepository, config)
            .unwrap()
            .with_clock(Arc::new(clock.clone())),
    );

    // A load of executions running while the server is killed: bounded, and
    // it ends once 20 executions met the outage.
    let executed = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let load = {
        let manager = manager.clone();
        let executed = executed.clone();
        tokio::spawn(async move {
            let (mut ok, mut outages) = (0u32, 0u32);
            for i in 0..LOAD_BOUND {
                match manager
                    .execute(&format!("load-{i}"), &i, || async {
                        Ok::<_, HandlerError<String>>(i)
                    })
                    .await
                {
                    Ok(_) => {
                        ok += 1;
                        executed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => {
                        let e = e
                            .as_idempotency()
                            .expect("a store error, not a handler error");
                        assert!(
                            is_outage(e),
                            "an outage must be Unavailable/Timeout, got {e:?}"
                        );
                        outages += 1;
                        // Enough to show the class of every failure; each one
                        // waits out the connect timeout and the retries.
                        if outages == 20 {
                            break;
                        }
                    }
                }
                if i % 50 == 49 {
                    tokio::task::yield_now().await;
                }
            }
            (ok, outages)
        })
    };
    // Stopped once the load is under way (not after a fixed sleep, which a
    // fast machine outran: all the load done before the stop).
    let deadline = Instant::now() + Duration::from_secs(10);
    while executed.load(std::sync::atomic::Ordering::Relaxed) < 20 && Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    server.stop().await.expect("stop the container");
    let (ok, outages) = load.await.expect("no panic in the load task");
    println!("executions during the stop: {ok} ok, {outages} Unavailable/Timeout");
    assert!(ok + outages <= LOAD_BOUND);
    assert!(outages > 0, "the server stopped while the load ran");

    // While the server is down, every operation answers a typed error, quickly.
    let k = key("outage");
    let owner = OwnerToken::random();
    let now = clock.now();
    let started = Instant::now();
    let r = repo.reserve(request(&k, owner, &clock)).await;
    assert!(
        matches!(&r, Err(e) if is_outage(e)),
        "reserve during the outage: {r:?}"
    );
    let r = repo.complete(&k, owner, None, now + TTL, now).await;
    assert!(
        matches!(&r, Err(e) if is_outage(e)),
        "complete during the outage: {r:?}"
    );
    let r = repo.get(&k, now).await;
    assert!(
        matches!(&r, Err(e) if is_outage(e)),
        "get during the outage: {r:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "outage errors took {:?}",
        started.elapsed()
    );
    let e = manager
        .execute("during-outage", &(), || async {
            Ok::<_, HandlerError<String>>(1)
        })
        .await
        .unwrap_err();
    assert!(
        e.as_idempotency().is_some_and(is_outage),
        "fail-closed execute: {e:?}"
    );

    // Back up (empty: no persistence): the same repository recovers by itself.
    server.start().await.expect("start the container again");
    let deadline = Instant::now() + Duration::from_secs(30);
    let acquired = loop {
        match repo.reserve(request(&k, owner, &clock)).await {
            Ok(r) => break r,
            Err(e) if is_outage(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the repository did not recover: {e:?}"),
        }
    };
    assert_eq!(acquired, Reservation::Acquired { attempt: 1 });
    repo.complete(&k, owner, Some(b"after"), now + TTL, now)
        .await
        .unwrap();
    let out = manager
        .execute("after-outage", &(), || async {
            Ok::<_, HandlerError<String>>(7)
        })
        .await
        .unwrap();
    assert!(matches!(out, Outcome::Executed(7)));
}

/// Connecting to a closed port is `Unavailable`, not a hang or a panic.
#[tokio::test]
async fn connect_to_a_closed_port_is_unavailable() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let started = Instant::now();
    let r = RedisRepository::connect(&format!(
        "redis://127.0.0.1:{port}?connect_timeout=500ms&reconnect_retries=1"
    ))
    .await;
    assert!(
        matches!(
            r,
            Err(Error::Unavailable {
                backend: "redis",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// The harness's three-master Redis Cluster (shared by the tests of this
/// binary) and its `redis+cluster://` URL.
#[cfg(feature = "cluster")]
async fn cluster() -> (RedisClusterServer, String) {
    let cluster = containers::redis_cluster()
        .await
        .expect("a Redis Cluster from the harness (see docs/testing.md)");
    let url = cluster.cluster_url();
    (cluster, url)
}

/// The index of the master that holds `key`: each node is asked `EXISTS`
/// directly (the others answer `MOVED`).
#[cfg(feature = "cluster")]
async fn holder(cluster: &RedisClusterServer, key: &RecordKey) -> usize {
    let name = RedisRepository::redis_key(key);
    let mut holders = Vec::new();
    for (i, node) in cluster.nodes().iter().enumerate() {
        if node.command(&["EXISTS", &name]).await.unwrap() == RedisReply::Integer(1) {
            holders.push(i);
        }
    }
    assert_eq!(
        holders.len(),
        1,
        "{name} on exactly one master: {holders:?}"
    );
    holders[0]
}

/// A repository on the cluster, reserving with `strategy`.
#[cfg(feature = "cluster")]
async fn cluster_repo(url: &str, strategy: ReserveStrategy) -> RedisRepository {
    RedisRepository::connect(url)
        .await
        .unwrap()
        .with_reserve_strategy(strategy)
}

/// The masters holding `keys`.
#[cfg(feature = "cluster")]
async fn masters_of(
    cluster: &RedisClusterServer,
    keys: &[RecordKey],
) -> std::collections::BTreeSet<usize> {
    let mut masters = std::collections::BTreeSet::new();
    for k in keys {
        masters.insert(holder(cluster, k).await);
    }
    masters
}

/// `SCRIPT FLUSH` on every node of the cluster.
#[cfg(feature = "cluster")]
async fn flush_scripts_everywhere(cluster: &RedisClusterServer) {
    for node in cluster.nodes() {
        let mut admin = admin(node.url()).await;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
    }
}

/// A standalone URL to a server that refuses scripts over keys of different
/// slots (a proxy in front of shards; here a master of the harness's cluster):
/// a batch's `complete_many` call comes back `CROSSSLOT`, unrun, and the
/// completions go key by key, this batch and the next; every record is
/// completed once, by its owner.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_completions_fall_back_where_keys_may_not_share_a_script() {
    let (cluster, url) = cluster().await;
    let placed = cluster_repo(&url, ReserveStrategy::SetNxGet).await;
    let clock = ManualClock::starting_now();
    let now = clock.now();
    let keys: Vec<RecordKey> = (0..60).map(|i| key(&format!("crossslot-{i}"))).collect();
    let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    for answer in placed
        .reserve_many(requests_of(&keys, &owners, &clock))
        .await
    {
        assert_eq!(answer.unwrap(), Reservation::Acquired { attempt: 1 });
    }
    // The keys the first key's master holds, each in a slot of its own.
    let master = holder(&cluster, &keys[0]).await;
    let mut mine = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if holder(&cluster, k).await == master {
            mine.push(i);
        }
    }
    assert!(mine.len() >= 6, "{} keys on master {master}", mine.len());
    let direct = RedisRepository::connect(cluster.nodes()[master].url())
        .await
        .unwrap();
    let refusals = redirects(&cluster, master, "CROSSSLOT").await;
    let half = mine.len() / 2;
    for round in [&mine[..half], &mine[half..]] {
        let writes: Vec<Completion<'_>> = round
            .iter()
            .map(|&i| Completion {
                key: &keys[i],
                owner: owners[i],
                result: Some(keys[i].id().as_bytes()),
                expires_at: now + TTL,
            })
            .collect();
        let answers = direct.complete_many(writes, now).await;
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    }
    // One refusal: the second batch no longer tried the script.
    assert_eq!(redirects(&cluster, master, "CROSSSLOT").await - refusals, 1);
    for &i in &mine {
        let r = placed.get(&keys[i], now).await.unwrap().unwrap();
        assert_eq!((r.owner, r.status), (owners[i], Status::Completed));
        assert_eq!(r.result.as_deref(), Some(keys[i].id().as_bytes()));
    }
    for k in &keys {
        placed.delete(k).await.unwrap();
    }
}

/// The whole conformance suite, both strategies, against the harness's
/// three-master Redis Cluster; then the cluster-specific facts: records spread
/// over the masters, and a `SCRIPT FLUSH` on every node is survived.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_conformance() {
    let (cluster, url) = cluster().await;
    for (strategy, reads) in CLUSTER_PLANS {
        let repo = cluster_repo(&url, strategy).await.with_batch_reads(reads);
        let report = idempotency_conformance::run_all(Arc::new(repo)).await;
        println!(
            "cluster, {strategy:?}, {reads:?}: {} checks passed",
            report.passed()
        );
        report.assert_all_passed();
    }

    let repo = RedisRepository::connect(&url).await.unwrap();
    let clock = ManualClock::starting_now();
    let now = clock.now();
    let keys: Vec<RecordKey> = (0..30).map(|i| key(&format!("spread-{i}"))).collect();
    for k in &keys {
        let owner = OwnerToken::random();
        repo.reserve(request(k, owner, &clock)).await.unwrap();
        repo.complete(k, owner, Some(b"v"), now + TTL, now)
            .await
            .unwrap();
    }
    let masters = masters_of(&cluster, &keys).await;
    assert!(
        masters.len() >= 2,
        "records of one namespace stay on one master"
    );
    flush_scripts_everywhere(&cluster).await;
    for k in &keys {
        let owner = OwnerToken::random();
        let taken = repo
            .reserve(ReserveRequest {
                retry_failed: true,
                ..request(k, owner, &clock)
            })
            .await
            .unwrap();
        assert!(matches!(taken, Reservation::Existing(ref r) if r.status == Status::Completed));
        assert!(repo.delete(k).await.unwrap());
        assert_eq!(
            repo.reserve(request(k, owner, &clock)).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
        repo.fail(k, owner, None, true, now + TTL, now)
            .await
            .unwrap();
        assert_eq!(
            repo.reserve(request(k, OwnerToken::random(), &clock))
                .await
                .unwrap(),
            Reservation::Acquired { attempt: 2 }
        );
    }
}

/// The ways a cluster's batches are sent that its tests go through: each
/// reserve strategy writing first, and reads first (a pipeline of `GET`s per
/// primary).
#[cfg(feature = "cluster")]
const CLUSTER_PLANS: [(ReserveStrategy, BatchReads); 3] = [
    (ReserveStrategy::SetNxGet, BatchReads::Never),
    (ReserveStrategy::Script, BatchReads::Never),
    (ReserveStrategy::SetNxGet, BatchReads::Always),
];

/// Batches on the cluster answer exactly as the single operations would:
/// fresh keys, duplicates, a batch re-sent by its owners, completions (half of
/// them refused), and — after `SCRIPT FLUSH` on every node — takeovers and
/// completions that meet `NOSCRIPT` in the pipelines and go through the single
/// path.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_batches_answer_as_single_operations() {
    let (cluster, url) = cluster().await;
    for (strategy, reads) in CLUSTER_PLANS {
        let repo = cluster_repo(&url, strategy).await.with_batch_reads(reads);
        // In the messages below.
        let strategy = (strategy, reads);
        let clock = ManualClock::starting_now();
        let keys: Vec<RecordKey> = (0..60).map(|i| key(&format!("batch-{i}"))).collect();
        let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
        let requests = |owners: &[OwnerToken]| requests_of(&keys, owners, &clock);
        let fresh = repo.reserve_many(requests(&owners)).await;
        assert!(
            fresh
                .iter()
                .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))),
            "{strategy:?}: {fresh:?}"
        );
        let masters = masters_of(&cluster, &keys).await;
        assert_eq!(
            masters.len(),
            cluster.nodes().len(),
            "the batch spans every master"
        );

        let others: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
        let duplicates = repo.reserve_many(requests(&others)).await;
        for (answer, owner) in duplicates.iter().zip(&owners) {
            assert!(
                matches!(answer, Ok(Reservation::Existing(r)) if r.owner == *owner),
                "{strategy:?}: {answer:?}"
            );
        }
        let resent = repo.reserve_many(requests(&owners)).await;
        assert!(resent
            .iter()
            .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))));

        let now = clock.now();
        let writes = |owners: &[OwnerToken], now: idempotency_core::Timestamp| {
            keys.iter()
                .zip(owners)
                .map(|(key, owner)| Completion {
                    key,
                    owner: *owner,
                    result: Some(b"done"),
                    expires_at: now + TTL,
                })
                .collect::<Vec<_>>()
        };
        // Half the keys completed by their owners, the other half attempted by
        // strangers (refused, each on its own).
        let mut mixed = owners.clone();
        for o in mixed.iter_mut().skip(keys.len() / 2) {
            *o = OwnerToken::random();
        }
        let done = repo.complete_many(writes(&mixed, now), now).await;
        for (i, answer) in done.iter().enumerate() {
            assert_eq!(
                answer.is_ok(),
                i < keys.len() / 2,
                "{strategy:?} {i}: {answer:?}"
            );
        }
        for (i, k) in keys.iter().enumerate() {
            let record = repo.get(k, now).await.unwrap().unwrap();
            let expected = if i < keys.len() / 2 {
                Status::Completed
            } else {
                Status::Processing
            };
            assert_eq!(record.status, expected, "{strategy:?} {i}");
        }

        // Scripts flushed everywhere; the leases run out: the takeovers and
        // their completions meet NOSCRIPT in the pipelines and still happen once.
        flush_scripts_everywhere(&cluster).await;
        clock.advance(LEASE + Duration::from_secs(1));
        let takers: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
        let taken = repo.reserve_many(requests(&takers)).await;
        for (i, answer) in taken.iter().enumerate() {
            if i < keys.len() / 2 {
                assert!(
                    matches!(answer, Ok(Reservation::Existing(r)) if r.status == Status::Completed),
                    "{strategy:?} {i}: {answer:?}"
                );
            } else {
                assert!(
                    matches!(answer, Ok(Reservation::Acquired { attempt: 2 })),
                    "{strategy:?} {i}: {answer:?}"
                );
            }
        }
        let now = clock.now();
        let done = repo.complete_many(writes(&takers, now), now).await;
        for (i, answer) in done.iter().enumerate() {
            assert_eq!(
                answer.is_ok(),
                i >= keys.len() / 2,
                "{strategy:?} {i}: {answer:?}"
            );
        }
        for k in &keys {
            let record = repo.get(k, now).await.unwrap().unwrap();
            assert_eq!(record.status, Status::Completed);
            assert!(repo.delete(k).await.unwrap());
        }
    }
}

/// Which client connection (`ip:port`) sent each command naming one of
/// `keys`, as each node's `MONITOR` saw them, until `expected` such commands
/// arrived (or 10 s passed): `(node, client, command)`.
#[cfg(feature = "cluster")]
async fn monitored(
    cluster: &RedisClusterServer,
    keys: &[String],
    expected: usize,
    run: impl std::future::Future<Output = ()>,
) -> Vec<(usize, String, String)> {
    use futures::StreamExt;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut watchers = Vec::new();
    for (i, node) in cluster.nodes().iter().enumerate() {
        let monitor = redis::Client::open(node.url())
            .unwrap()
            .get_async_monitor()
            .await
            .unwrap();
        let tx = tx.clone();
        watchers.push(tokio::spawn(async move {
            let mut lines = monitor.into_on_message::<String>();
            while let Some(line) = lines.next().await {
                if tx.send((i, line)).is_err() {
                    return;
                }
            }
        }));
    }
    run.await;
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen.len() < expected {
        let Ok(Some((node, line))) = tokio::time::timeout_at(deadline, rx.recv()).await else {
            break;
        };
        // `1700000000.123456 [0 172.18.0.1:51234] "SET" "key" …`
        let Some(client) = line.split('[').nth(1).and_then(|r| r.split(']').next()) else {
            continue;
        };
        let client = client.split(' ').nth(1).unwrap_or_default().to_owned();
        if client == "lua" || !keys.iter().any(|k| line.contains(&format!("\"{k}\""))) {
            continue;
        }
        let command = line
            .split('"')
            .nth(1)
            .unwrap_or_default()
            .to_ascii_uppercase();
        seen.push((node, client, command));
    }
    for w in watchers {
        w.abort();
    }
    seen
}

/// A batch on the cluster goes as one pipeline per master, on a connection of
/// the repository's own to that master — not through the cluster client,
/// which re-sends a whole pipeline when one command is redirected — and the
/// single operations use the same connection: each master's `MONITOR` sees
/// every reservation of the batch and every single one come from one
/// connection.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_batches_are_one_pipeline_per_master() {
    let (cluster, url) = cluster().await;
    let repo = RedisRepository::connect(&url).await.unwrap();
    let clock = ManualClock::starting_now();
    let singles: Vec<RecordKey> = (0..30).map(|i| key(&format!("single-{i}"))).collect();
    let batch: Vec<RecordKey> = (0..60).map(|i| key(&format!("batch-{i}"))).collect();
    let names = |keys: &[RecordKey]| {
        keys.iter()
            .map(RedisRepository::redis_key)
            .collect::<Vec<_>>()
    };

    let single_clients = monitored(&cluster, &names(&singles), singles.len(), async {
        for k in &singles {
            repo.reserve(request(k, OwnerToken::random(), &clock))
                .await
                .unwrap();
        }
    })
    .await;
    let batch_clients = monitored(&cluster, &names(&batch), batch.len(), async {
        let requests = batch
            .iter()
            .map(|k| request(k, OwnerToken::random(), &clock))
            .collect();
        let answers = repo.reserve_many(requests).await;
        assert!(answers
            .iter()
            .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))));
    })
    .await;
    assert_eq!(batch_clients.len(), batch.len(), "{batch_clients:?}");
    assert!(batch_clients.iter().all(|(_, _, command)| command == "SET"));
    for node in 0..cluster.nodes().len() {
        let of = |seen: &[(usize, String, String)]| {
            seen.iter()
                .filter(|(n, _, _)| *n == node)
                .map(|(_, client, _)| client.clone())
                .collect::<std::collections::BTreeSet<_>>()
        };
        let (single, batched) = (of(&single_clients), of(&batch_clients));
        assert_eq!(
            batched.len(),
            1,
            "node {node}: one connection for the batch: {batched:?}"
        );
        assert_eq!(
            single, batched,
            "node {node}: single commands on the same connection of the repository's own"
        );
    }
    for k in singles.iter().chain(&batch) {
        repo.delete(k).await.unwrap();
    }
}

/// Ids with braces — HTTP route templates such as `/orders/{id}` — must not
/// form a Redis Cluster hash tag, or every key of a route lands on one slot.
/// Checked against the real cluster's hashing (`CLUSTER KEYSLOT`), with the
/// former encoding (`RecordKey::encode`) as the control, and by storing records
/// through a cluster connection: they land on every master, and each is found
/// again.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brace_ids_spread_over_the_cluster() {
    let (cluster, url) = cluster().await;
    let node = &cluster.nodes()[0];
    let keyslot = |name: String| async move {
        match node.command(&["CLUSTER", "KEYSLOT", &name]).await.unwrap() {
            RedisReply::Integer(slot) => slot,
            other => panic!("CLUSTER KEYSLOT {name}: {other:?}"),
        }
    };
    let namespace = containers::unique_namespace("routes");
    let ids: Vec<String> = (0..200)
        .map(|i| format!("POST /orders/{{id}}/items/{{item}}#{i}"))
        .collect();
    let keys: Vec<RecordKey> = ids
        .iter()
        .map(|id| RecordKey::new(namespace.clone(), id, 256).unwrap())
        .collect();
    let mut former = std::collections::BTreeSet::new();
    let mut now_slots = std::collections::BTreeMap::<i64, Vec<String>>::new();
    for k in &keys {
        former.insert(keyslot(k.encode()).await);
        let redis_key = RedisRepository::redis_key(k);
        now_slots
            .entry(keyslot(redis_key.clone()).await)
            .or_default()
            .push(redis_key);
    }
    // Keys sharing a slot, for the failure message.
    let shared: Vec<_> = now_slots
        .iter()
        .filter(|(_, k)| k.len() > 1)
        .take(5)
        .collect();
    assert_eq!(
        former.len(),
        1,
        "the control: `{{id}}` is the hash tag of every key of the route"
    );
    // CRC16 is linear, not a random hash: keys differing only in a numeric
    // suffix share slots more often than chance would have it, and how often
    // depends on the (random) namespace — 200 such keys fell on 110 to 200
    // distinct slots over 3,000 namespaces (184 in one CI run). A hash tag
    // would put all of them on one.
    assert!(
        now_slots.len() >= 100,
        "200 keys of one route on only {} slots; shared: {shared:?}",
        now_slots.len()
    );
    // `{}` + key hashes like the whole key: Redis's slot is the CRC16 of all
    // of its bytes, as for a key without a (non-empty) hash tag.
    for k in keys.iter().take(20) {
        let name = RedisRepository::redis_key(k);
        assert!(name.starts_with("{}"), "{name}");
        assert_eq!(
            keyslot(name.clone()).await,
            i64::from(crc16_slot(name.as_bytes())),
            "{name}"
        );
    }

    // Through the repository: stored on every master, and found again.
    let repo = RedisRepository::connect(&url).await.unwrap();
    let clock = ManualClock::starting_now();
    let now = clock.now();
    let mut masters = std::collections::BTreeSet::new();
    for k in keys.iter().take(30) {
        let owner = OwnerToken::random();
        assert_eq!(
            repo.reserve(request(k, owner, &clock)).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
        repo.complete(k, owner, Some(k.id().as_bytes()), now + TTL, now)
            .await
            .unwrap();
        masters.insert(holder(&cluster, k).await);
    }
    assert_eq!(masters.len(), cluster.nodes().len(), "{masters:?}");
    for k in keys.iter().take(30) {
        let r = repo.get(k, now).await.unwrap().unwrap();
        assert_eq!(r.result.as_deref(), Some(k.id().as_bytes()));
        assert!(repo.delete(k).await.unwrap());
    }
}

/// Node `index`'s cluster id (`CLUSTER MYID`).
#[cfg(feature = "cluster")]
async fn node_id(cluster: &RedisClusterServer, index: usize) -> String {
    match cluster.nodes()[index]
        .command(&["CLUSTER", "MYID"])
        .await
        .unwrap()
    {
        RedisReply::Bulk(Some(id)) => String::from_utf8(id).unwrap(),
        other => panic!("CLUSTER MYID: {other:?}"),
    }
}

/// How many replies of `kind` (`MOVED`, `ASK`, `CROSSSLOT`) node `index` has
/// sent since it started (`INFO errorstats`).
#[cfg(feature = "cluster")]
async fn redirects(cluster: &RedisClusterServer, index: usize, kind: &str) -> u64 {
    let info = match cluster.nodes()[index]
        .command(&["INFO", "errorstats"])
        .await
        .unwrap()
    {
        RedisReply::Bulk(Some(text)) => String::from_utf8(text).unwrap(),
        other => panic!("INFO errorstats: {other:?}"),
    };
    let prefix = format!("errorstat_{kind}:count=");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |count| count.trim().parse().unwrap())
}

/// One slot moving from master `from` to master `to` the way `redis-cli
/// --cluster reshard` moves it: `IMPORTING` on the target, `MIGRATING` on the
/// source, its keys moved with `MIGRATE` (each move atomic), then `SETSLOT …
/// NODE` on every master.
#[cfg(feature = "cluster")]
struct SlotMove<'c> {
    cluster: &'c RedisClusterServer,
    slot: String,
    from: usize,
    to: usize,
}

#[cfg(feature = "cluster")]
impl SlotMove<'_> {
    async fn on(&self, node: usize, args: &[&str]) -> RedisReply {
        let command = self.cluster.nodes()[node].command(args);
        let reply = tokio::time::timeout(Duration::from_secs(10), command)
            .await
            .unwrap_or_else(|_| panic!("{args:?}: no answer in 10 s"))
            .unwrap();
        assert!(
            !matches!(reply, RedisReply::Error(_)),
            "{args:?}: {reply:?}"
        );
        reply
    }

    /// Marks the slot importing on the target and migrating on the source:
    /// from now on the source answers `ASK` for the slot's keys it lacks.
    async fn begin(&self) {
        let (from, to) = (
            node_id(self.cluster, self.from).await,
            node_id(self.cluster, self.to).await,
        );
        self.on(
            self.to,
            &["CLUSTER", "SETSLOT", &self.slot, "IMPORTING", &from],
        )
        .await;
        self.on(
            self.from,
            &["CLUSTER", "SETSLOT", &self.slot, "MIGRATING", &to],
        )
        .await;
    }

    /// Moves up to `count` of the keys still on the source; answers how many.
    async fn move_keys(&self, count: usize) -> usize {
        let args = ["CLUSTER", "GETKEYSINSLOT", &self.slot, &count.to_string()];
        let RedisReply::Array(Some(keys)) = self.on(self.from, &args).await else {
            panic!("CLUSTER GETKEYSINSLOT: not an array");
        };
        let keys: Vec<String> = keys
            .into_iter()
            .map(|k| match k {
                RedisReply::Bulk(Some(k)) => String::from_utf8(k).unwrap(),
                other => panic!("CLUSTER GETKEYSINSLOT: {other:?}"),
            })
            .collect();
        self.move_named(&keys).await;
        keys.len()
    }

    /// Moves `keys` (Redis keys on the source) to the target in one `MIGRATE`.
    async fn move_named(&self, keys: &[String]) {
        if keys.is_empty() {
            return;
        }
        let target = &self.cluster.nodes()[self.to];
        let port = target.port().to_string();
        let mut args = vec!["MIGRATE", target.host(), &port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().map(String::as_str));
        let reply = self.on(self.from, &args).await;
        assert_eq!(reply, RedisReply::Status("OK".into()), "MIGRATE");
    }

    /// Moves the keys left and gives the slot to the target on every master.
    async fn finish(&self) {
        while self.move_keys(100).await > 0 {}
        let to = node_id(self.cluster, self.to).await;
        let others = (0..self.cluster.nodes().len()).filter(|&n| n != self.to && n != self.from);
        for node in [self.to, self.from].into_iter().chain(others) {
            self.on(node, &["CLUSTER", "SETSLOT", &self.slot, "NODE", &to])
                .await;
        }
    }
}

/// `id`'s slot in `manager`'s namespace.
#[cfg(feature = "cluster")]
fn slot_of_id(manager: &IdempotencyManager, id: &str) -> u16 {
    crc16_slot(RedisRepository::redis_key(&manager.record_key(id).unwrap()).as_bytes())
}

/// Counts handler runs per id, across managers.
#[cfg(feature = "cluster")]
#[derive(Default)]
struct Runs(std::sync::Mutex<BTreeMap<String, u32>>);

#[cfg(feature = "cluster")]
impl Runs {
    fn run(&self, id: &str) {
        *self.0.lock().unwrap().entry(id.to_owned()).or_default() += 1;
    }

    fn of(&self, id: &str) -> u32 {
        self.0.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

/// `manager.execute_batch` over `batch` (one group), whose first handler
/// runs `step` while the others wait (at most 30 s) for it to finish: every
/// reservation of the batch comes before `step`, every completion after.
#[cfg(feature = "cluster")]
async fn batch_around(
    manager: &IdempotencyManager,
    batch: &[(String, u32)],
    runs: &Runs,
    step: impl std::future::Future<Output = ()>,
) -> Vec<Result<Outcome<String>, ExecuteError<String>>> {
    let (done, done_rx) = tokio::sync::watch::channel(false);
    let step = std::sync::Mutex::new(Some(step));
    manager
        .execute_batch(batch, 64, |i, _| {
            runs.run(&batch[i].0);
            let value = value_of(&batch[i].0);
            let step = if i == 0 {
                step.lock().unwrap().take()
            } else {
                None
            };
            let (done, mut done_rx) = (&done, done_rx.clone());
            async move {
                match step {
                    Some(step) => {
                        step.await;
                        done.send_replace(true);
                    }
                    None => {
                        let wait = done_rx.wait_for(|done| *done);
                        tokio::time::timeout(Duration::from_secs(30), wait)
                            .await
                            .expect("the first handler's step finished")
                            .unwrap();
                    }
                }
                Ok::<_, HandlerError<String>>(value)
            }
        })
        .await
}

/// `manager.execute_batch` over a `batch` of duplicates: every answer is the
/// stored value (`label` names the case in a failure).
#[cfg(feature = "cluster")]
async fn duplicates_of(
    manager: &IdempotencyManager,
    batch: &[(String, u32)],
    runs: &Runs,
    label: &str,
) {
    let answers = manager
        .execute_batch(batch, 64, |i, _| {
            runs.run(&batch[i].0);
            std::future::ready(Ok::<_, HandlerError<String>>(value_of(&batch[i].0)))
        })
        .await;
    for ((id, _), answer) in batch.iter().zip(&answers) {
        let value = value_of(id);
        assert_eq!(
            answered(answer),
            Some(("cached", value.as_str())),
            "{label} {id}: {answer:?}"
        );
    }
}

/// The value a handler returns for `id`.
#[cfg(feature = "cluster")]
fn value_of(id: &str) -> String {
    format!("charged {id}")
}

/// A batch answer as `("executed" | "cached", value)`; `None` for anything else.
#[cfg(feature = "cluster")]
fn answered(answer: &Result<Outcome<String>, ExecuteError<String>>) -> Option<(&str, &str)> {
    match answer {
        Ok(Outcome::Executed(v)) => Some(("executed", v)),
        Ok(Outcome::Cached(v)) => Some(("cached", v)),
        _ => None,
    }
}

/// A slot moves to another master while batches hold its keys, and each key's
/// handler still runs once, by whichever manager reserved it:
///
/// 1. between a batch's reservations and its completions (the slot moves
///    inside a handler): the completions meet `MOVED` in the pipeline to the
///    old master and reach the new one as single commands;
/// 2. a manager whose slot table predates the move answers duplicates through
///    the same redirect;
/// 3. the slot starts moving back (`MIGRATING`/`IMPORTING`) inside a
///    handler, and the keys the batch holds move with it: their completions
///    meet `ASK` and follow it (`ASKING` and the command on one connection);
/// 4. while the slot is half moved back (some keys on each master, more
///    moving mid-batch), two managers race over the same batch of new and old
///    keys: the source answers `ASK` for the keys it lacks, and each new key
///    runs once between the two;
/// 5. afterwards every key is a duplicate on both, each record on one master,
///    and a single execution through a slot table read before step 3 follows
///    `MOVED` to the slot's master.
///
/// On a cluster of the test's own (the shared one must not see slots move);
/// `INFO errorstats` shows that the redirects were met.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_run_once_while_their_slot_moves() {
    let cluster = RedisClusterServer::dedicated()
        .await
        .expect("a Redis Cluster of the test's own (Docker; see docs/testing.md)");
    let url = cluster.cluster_url();
    for strategy in [ReserveStrategy::SetNxGet, ReserveStrategy::Script] {
        // A short lease bounds how long a completion that cannot be
        // recorded is retried (the default is 300 s).
        let config = Config {
            key_prefix: containers::unique_namespace("moving"),
            processing_timeout: Duration::from_secs(30),
            ..Config::default()
        };
        let manager = |repo: RedisRepository| {
            IdempotencyManager::new(Arc::new(repo) as SharedRepository, config.clone()).unwrap()
        };
        let ours = manager(cluster_repo(&url, strategy).await);
        let rival = manager(cluster_repo(&url, strategy).await);
        let runs = Runs::default();
        let spread: Vec<String> = (0..24).map(|i| format!("spread-{i}")).collect();
        let slot = slot_of_id(&ours, &spread[0]);
        let in_slot: Vec<String> = (0..)
            .map(|i| format!("s-{i}"))
            .filter(|id| slot_of_id(&ours, id) == slot)
            .take(60)
            .collect();
        let held = in_slot[48..].to_vec();
        let in_slot = &in_slot[..48];
        let items = |ids: &[&[String]]| -> Vec<(String, u32)> {
            ids.iter()
                .flat_map(|ids| ids.iter())
                .map(|id| (id.clone(), 1))
                .collect()
        };
        let run = |items: &[(String, u32)], i: usize| {
            runs.run(&items[i].0);
            Ok::<_, HandlerError<String>>(value_of(&items[i].0))
        };

        // The rival's slot table is read here, before anything moves.
        let warm = items(&[&spread]);
        let answers = rival
            .execute_batch(&warm, 64, |i, _| std::future::ready(run(&warm, i)))
            .await;
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, Ok(Outcome::Executed(_)))),
            "{answers:?}"
        );
        let home = holder(&cluster, &ours.record_key(&spread[0]).unwrap()).await;
        let away = (home + 1) % cluster.nodes().len();
        let there = SlotMove {
            cluster: &cluster,
            slot: slot.to_string(),
            from: home,
            to: away,
        };
        let back = SlotMove {
            cluster: &cluster,
            slot: slot.to_string(),
            from: away,
            to: home,
        };

        // 1. The slot moves between the reservations and the completions.
        let batch = items(&[&in_slot[..24], &spread]);
        let moved_before = redirects(&cluster, home, "MOVED").await;
        let step = async {
            there.begin().await;
            there.finish().await;
        };
        let answers = batch_around(&ours, &batch, &runs, step).await;
        for ((id, _), answer) in batch.iter().zip(&answers) {
            let how = if id.starts_with("s-") {
                "executed"
            } else {
                "cached"
            };
            let value = value_of(id);
            assert_eq!(
                answered(answer),
                Some((how, value.as_str())),
                "{strategy:?} {id}: {answer:?}"
            );
        }
        assert!(redirects(&cluster, home, "MOVED").await > moved_before);
        for id in &in_slot[..24] {
            assert_eq!(
                holder(&cluster, &ours.record_key(id).unwrap()).await,
                away,
                "{id}"
            );
        }

        // 2. Duplicates through a slot table that predates the move.
        duplicates_of(&rival, &batch, &runs, &format!("{strategy:?} stale")).await;

        // A third manager reads the slot table now, and uses it in step 5.
        let late = manager(cluster_repo(&url, strategy).await);
        let answer = late
            .execute(&spread[0], &1, || std::future::ready(run(&warm, 0)))
            .await;
        assert_eq!(
            answered(&answer),
            Some(("cached", value_of(&spread[0]).as_str()))
        );

        // 3. The slot starts moving back while a batch holds new keys on the
        // source; those keys move before their completions, which meet `ASK`.
        let asked_before = redirects(&cluster, away, "ASK").await;
        let batch = items(&[&held]);
        let names: Vec<String> = held
            .iter()
            .map(|id| RedisRepository::redis_key(&ours.record_key(id).unwrap()))
            .collect();
        let step = async {
            back.begin().await;
            back.move_named(&names).await;
        };
        let answers = batch_around(&ours, &batch, &runs, step).await;
        for ((id, _), answer) in batch.iter().zip(&answers) {
            let value = value_of(id);
            assert_eq!(
                answered(answer),
                Some(("executed", value.as_str())),
                "{strategy:?} {id}: {answer:?}"
            );
        }
        assert!(redirects(&cluster, away, "ASK").await > asked_before);

        // 4. Half moved back; two managers race over new and old keys while
        // more keys move.
        assert_eq!(back.move_keys(12).await, 12);
        let asked_before = redirects(&cluster, away, "ASK").await;
        let batch = items(&[in_slot, &held, &spread]);
        let first_new = &in_slot[24];
        let racing = || {
            let (back, batch, runs) = (&back, &batch, &runs);
            move |i: usize, _| {
                runs.run(&batch[i].0);
                let id = batch[i].0.clone();
                async move {
                    // Whichever manager acquired it moves more keys.
                    if id == *first_new {
                        back.move_keys(6).await;
                    }
                    Ok::<_, HandlerError<String>>(value_of(&id))
                }
            }
        };
        let (a, b) = tokio::join!(
            ours.execute_batch(&batch, 64, racing()),
            rival.execute_batch(&batch, 64, racing())
        );
        back.finish().await;
        assert!(redirects(&cluster, away, "ASK").await > asked_before);
        for (((id, _), a), b) in batch.iter().zip(&a).zip(&b) {
            let value = value_of(id);
            let executed = [a, b]
                .into_iter()
                .filter(|x| answered(x) == Some(("executed", value.as_str())))
                .count();
            let new = in_slot[24..].contains(id);
            assert_eq!(
                executed,
                usize::from(new),
                "{strategy:?} {id}: {a:?} / {b:?}"
            );
            for answer in [a, b] {
                let fine = match answer {
                    Err(ExecuteError::Idempotency(Error::InProgress { .. })) => new,
                    other => answered(other).is_some_and(|(_, v)| v == value),
                };
                assert!(fine, "{strategy:?} {id}: {answer:?}");
            }
        }

        // 5. Everything is a duplicate, each record on one master; a single
        // execution through the table read in step 2 follows `MOVED`.
        for manager in [&ours, &rival] {
            duplicates_of(manager, &batch, &runs, &format!("{strategy:?} after")).await;
        }
        let moved_before = redirects(&cluster, away, "MOVED").await;
        let answer = late
            .execute(&in_slot[0], &1, || std::future::ready(run(&warm, 0)))
            .await;
        assert_eq!(
            answered(&answer),
            Some(("cached", value_of(&in_slot[0]).as_str()))
        );
        assert!(redirects(&cluster, away, "MOVED").await > moved_before);
        for id in in_slot.iter().chain(&held).chain(&spread) {
            assert_eq!(
                runs.of(id),
                1,
                "{strategy:?}: {id} ran {} times",
                runs.of(id)
            );
            let at = holder(&cluster, &ours.record_key(id).unwrap()).await;
            if !spread.contains(id) {
                assert_eq!(at, home, "{id}");
            }
        }
    }
}

/// Redis Cluster's slot of `bytes` hashed whole: CRC16/XMODEM mod 16384 (the
/// cluster specification's reference function, written out here so the test
/// does not take the client's word for it).
#[cfg(feature = "cluster")]
fn crc16_slot(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

#[cfg(not(feature = "cluster"))]
#[test]
fn cluster_urls_need_the_feature() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(RedisRepository::connect(
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
    ));
    match r {
        Err(Error::Config { message }) => assert!(message.contains("`cluster`"), "{message}"),
        other => panic!("{other:?}"),
    }
}

async fn shared() -> RedisServer {
    containers::redis()
        .await
        .expect("a Redis server from the harness (see docs/testing.md)")
}

fn shared_key(id: &str) -> RecordKey {
    RecordKey::new(containers::unique_namespace("redis-backend"), id, 256).unwrap()
}

async fn pttl(admin: &mut redis::aio::MultiplexedConnection, k: &RecordKey) -> i64 {
    redis::cmd("PTTL")
        .arg(RedisRepository::redis_key(k))
        .query_async(admin)
        .await
        .unwrap()
}

/// Values someone else wrote under our keys are `Corrupt { key }` for every
/// operation, with both strategies, and never a panic; `delete` clears them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_values_are_corrupt() {
    let server = shared().await;
    let mut admin = admin(server.url()).await;
    let clock = ManualClock::starting_now();
    let now = clock.now();
    let mut header = vec![1u8, b'P'];
    header.resize(55, 0);
    let mut bad_version = header.clone();
    bad_version[0] = 2;
    let mut bad_status = header.clone();
    bad_status[1] = b'X';
    let mut truncated_fingerprint = header.clone();
    truncated_fingerprint[54] = 1;
    truncated_fingerprint.extend_from_slice(&[7; 10]);
    let strings: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"\0\xffnot a record".to_vec()),
        ("empty", Vec::new()),
        ("short", header[..40].to_vec()),
        ("bad-version", bad_version),
        ("bad-status", bad_status),
        ("truncated-fingerprint", truncated_fingerprint),
    ];
    for strategy in [ReserveStrategy::SetNxGet, ReserveStrategy::Script] {
        let repo = RedisRepository::connect(server.url())
            .await
            .unwrap()
            .with_reserve_strategy(strategy);
        let mut keys = Vec::new();
        for (id, value) in &strings {
            let k = shared_key(id);
            let _: () = redis::cmd("SET")
                .arg(RedisRepository::redis_key(&k))
                .arg(value.as_slice())
                .arg("EX")
                .arg(600)
                .query_async(&mut admin)
                .await
                .unwrap();
            keys.push(k);
        }
        let hash = shared_key("a-hash");
        let _: () = redis::cmd("HSET")
            .arg(RedisRepository::redis_key(&hash))
            .arg("status")
            .arg("processing")
            .query_async(&mut admin)
            .await
            .unwrap();
        keys.push(hash);
        for k in &keys {
            let owner = OwnerToken::random();
            let corrupt = |what: &str, r: Result<(), Error>| match r {
                Err(Error::Corrupt {
                    key: Some(ref got), ..
                }) if got == k => {}
                other => panic!(
                    "{strategy:?} {what} on {k}: expected Corrupt naming the key, got {other:?}"
                ),
            };
            corrupt(
                "reserve",
                repo.reserve(request(k, owner, &clock)).await.map(|_| ()),
            );
            corrupt("get", repo.get(k, now).await.map(|_| ()));
            corrupt(
                "complete",
                repo.complete(k, owner, Some(b"r"), now + TTL, now).await,
            );
            corrupt(
                "fail",
                repo.fail(k, owner, None, true, now + TTL, now).await,
            );
            corrupt("release", repo.release(k, owner, now).await);
            corrupt(
                "extend",
                repo.extend(k, owner, now + LEASE, now + TTL, now).await,
            );
            assert!(
                repo.delete(k).await.unwrap(),
                "delete removes the foreign value"
            );
            assert_eq!(
                repo.reserve(request(k, owner, &clock)).await.unwrap(),
                Reservation::Acquired { attempt: 1 }
            );
            assert!(repo.delete(k).await.unwrap());
        }
    }
}

/// `PX` follows `expires_at - now`; `complete` moves it, `extend` raises it
/// with the expiry and never lowers it; a record logically expired by the
/// caller's clock is absent although the server still holds it, and `reserve`
/// creates over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn physical_ttl_and_logical_expiry() {
    let server = shared().await;
    let mut admin = admin(server.url()).await;
    for strategy in [ReserveStrategy::SetNxGet, ReserveStrategy::Script] {
        let repo = RedisRepository::connect(server.url())
            .await
            .unwrap()
            .with_reserve_strategy(strategy);
        let clock = ManualClock::starting_now();
        let now = clock.now();
        let k = shared_key("ttl");
        let owner = OwnerToken::random();
        let req = ReserveRequest {
            expires_at: now + Duration::from_secs(100),
            ..request(&k, owner, &clock)
        };
        assert_eq!(
            repo.reserve(req).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
        let t = pttl(&mut admin, &k).await;
        assert!((90_000..=100_000).contains(&t), "PTTL after reserve: {t}");

        // The stored value is the documented format, under RecordKey::encode()
        // (the id has no `{`).
        assert_eq!(RedisRepository::redis_key(&k), k.encode());
        let raw: Vec<u8> = redis::cmd("GET")
            .arg(k.encode())
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!((raw[0], raw[1], raw.len()), (1, b'P', 55));

        // An earlier expiry: the TTL is kept.
        repo.extend(
            &k,
            owner,
            now + Duration::from_secs(60),
            now + Duration::from_secs(70),
            now,
        )
        .await
        .unwrap();
        let t = pttl(&mut admin, &k).await;
        assert!(
            (90_000..=100_000).contains(&t),
            "extend never lowers the TTL: {t}"
        );
        // A later one: the TTL follows it.
        repo.extend(
            &k,
            owner,
            now + Duration::from_secs(120),
            now + Duration::from_secs(150),
            now,
        )
        .await
        .unwrap();
        let t = pttl(&mut admin, &k).await;
        assert!(
            (140_000..=150_000).contains(&t),
            "extend raises the TTL with the expiry: {t}"
        );
        repo.complete(
            &k,
            owner,
            Some(b"\0\x01\xfe\xff"),
            now + Duration::from_secs(200),
            now,
        )
        .await
        .unwrap();
        let t = pttl(&mut admin, &k).await;
        assert!((190_000..=200_000).contains(&t), "PTTL after complete: {t}");

        // Logically expired at the caller's clock, physically still there.
        clock.advance(Duration::from_secs(200));
        let later = clock.now();
        assert_eq!(repo.get(&k, later).await.unwrap(), None);
        let exists: i64 = redis::cmd("EXISTS")
            .arg(k.encode())
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(exists, 1, "the server has not evicted it yet");
        let again = OwnerToken::random();
        assert_eq!(
            repo.reserve(request(&k, again, &clock)).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
        let rec = repo.get(&k, later).await.unwrap().unwrap();
        assert_eq!((rec.owner, rec.attempt, rec.created_at), (again, 1, later));
        let t = pttl(&mut admin, &k).await;
        assert!(
            (3_590_000..=3_600_000).contains(&t),
            "PTTL of the new record: {t}"
        );

        // A record whose expiry already passed still gets a positive PX (1 ms).
        let gone = shared_key("already-expired");
        let req = ReserveRequest {
            expires_at: later,
            ..request(&gone, OwnerToken::random(), &clock)
        };
        assert_eq!(
            repo.reserve(req).await.unwrap(),
            Reservation::Acquired { attempt: 1 }
        );
        assert_eq!(repo.get(&gone, later).await.unwrap(), None);
        assert!(repo.delete(&k).await.unwrap());
    }
}

/// `rediss://` against the harness's TLS Redis container with a throw-away CA:
/// verified with the CA through `from_client`; an
/// unknown CA is refused with an error, not a panic; `#insecure` (no
/// verification) is a configuration error unless the application enables
/// `redis/tls-rustls-insecure` itself.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections() {
    let tls = containers::RedisTlsServer::start().await.unwrap();
    let clock = ManualClock::starting_now();
    let now = clock.now();
    let client = redis::Client::build_with_tls(
        tls.tls_url(),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(tls.ca_pem().as_bytes().to_vec()),
        },
    )
    .unwrap();
    let repo = RedisRepository::from_client(client).await.unwrap();
    let k = key("tls");
    let owner = OwnerToken::random();
    assert_eq!(
        repo.reserve(request(&k, owner, &clock)).await.unwrap(),
        Reservation::Acquired { attempt: 1 }
    );
    repo.complete(&k, owner, Some(b"\0secret\xff"), now + TTL, now)
        .await
        .unwrap();
    let r = repo.get(&k, now).await.unwrap().unwrap();
    assert_eq!(r.result.as_deref(), Some(&b"\0secret\xff"[..]));

    let untrusted =
        RedisRepository::connect(&format!("{}?reconnect_retries=0", tls.tls_url())).await;
    println!("unknown CA: {:?}", untrusted.as_ref().err());
    assert!(
        matches!(&untrusted, Err(Error::Config { message }) if message.contains("UnknownIssuer")),
        "a certificate from an unknown CA is a configuration error"
    );

    let insecure = RedisRepository::connect(&format!("{}/#insecure", tls.tls_url())).await;
    assert!(
        matches!(insecure, Err(Error::Config { .. })),
        "{insecure:?}"
    );
}

/// A batch is one pipeline: one round trip for 100 fresh keys and one for
/// 100 duplicates, with either reservation strategy; after `SCRIPT FLUSH` and
/// for keys open to takeover, what the pipeline cannot decide goes through the
/// single path, and every answer is still `reserve`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_one_pipeline() {
    let server = dedicated().await;
    let counter = containers::WireCounter::redis(server.url()).await.unwrap();
    let mut admin = admin(server.url()).await;
    for strategy in [ReserveStrategy::SetNxGet, ReserveStrategy::Script] {
        let repo = RedisRepository::connect(counter.url())
            .await
            .unwrap()
            .with_reserve_strategy(strategy);
        repo.load_scripts().await.unwrap();
        let clock = ManualClock::starting_now();
        let keys: Vec<RecordKey> = (0..100).map(|i| key(&format!("batch-{i}"))).collect();
        let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
        let requests = |owners: &[OwnerToken]| requests_of(&keys, owners, &clock);
        let before = counter.snapshot();
        let fresh = repo.reserve_many(requests(&owners)).await;
        assert_eq!(counter.round_trips_since(&before), 1, "{strategy:?}: fresh");
        assert!(fresh
            .iter()
            .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))));
        let others: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
        let before = counter.snapshot();
        let duplicates = repo.reserve_many(requests(&others)).await;
        assert_eq!(
            counter.round_trips_since(&before),
            1,
            "{strategy:?}: duplicates"
        );
        for (answer, owner) in duplicates.iter().zip(&owners) {
            assert!(matches!(answer, Ok(Reservation::Existing(r)) if r.owner == *owner));
        }
        // Our own batch re-sent (a lost reply): ours.
        let resent = repo.reserve_many(requests(&owners)).await;
        assert!(resent
            .iter()
            .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))));
        // Leases run out; scripts flushed: the takeovers still happen, once.
        clock.advance(LEASE + Duration::from_secs(1));
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        let takeovers = repo.reserve_many(requests(&others)).await;
        assert!(
            takeovers
                .iter()
                .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 2 }))),
            "{strategy:?}: {takeovers:?}"
        );
        // Their completions, in one `complete_many` call. The scripts were
        // flushed: the first batch's call comes back NOSCRIPT and is sent
        // again with the script's source (which loads it); the second batch
        // is one round trip.
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        let writes = |range: std::ops::Range<usize>| {
            keys[range.clone()]
                .iter()
                .zip(&others[range])
                .map(|(key, owner)| Completion {
                    key,
                    owner: *owner,
                    result: Some(key.id().as_bytes()),
                    expires_at: clock.now() + LEASE,
                })
                .collect::<Vec<_>>()
        };
        let first = repo.complete_many(writes(0..50), clock.now()).await;
        assert!(first.iter().all(Result::is_ok), "{strategy:?}: {first:?}");
        let before = counter.snapshot();
        let mut second = Vec::new();
        let commands = commands_of(&mut admin, async {
            second = repo.complete_many(writes(50..100), clock.now()).await;
        })
        .await;
        assert_eq!(
            counter.round_trips_since(&before),
            1,
            "{strategy:?}: completions"
        );
        assert!(second.iter().all(Result::is_ok), "{strategy:?}: {second:?}");
        // One `complete_many` call for the 50 (each key's GET and SET inside).
        assert_eq!(
            commands,
            counts(&[("evalsha", 1), ("get", 50), ("set", 50)]),
            "{strategy:?}: completions"
        );
        // Written again by the same owners: each refused on its own.
        let again = repo.complete_many(writes(0..100), clock.now()).await;
        assert!(again
            .iter()
            .all(|a| matches!(a, Err(Error::LeaseLost { .. }))));
        for (k, o) in keys.iter().zip(&others) {
            let r = repo.get(k, clock.now()).await.unwrap().unwrap();
            assert_eq!((r.owner, r.status), (*o, Status::Completed));
            assert_eq!(r.result.as_deref(), Some(k.id().as_bytes()));
            repo.delete(k).await.unwrap();
        }
    }
}

/// A batch's completions on a standalone server are `complete_many` calls of
/// at most 100 keys, a large result in a call of its own, all in one round
/// trip, and one more for the keys the script did not complete, each sent
/// again on its own; each key is answered as `complete` would answer it
/// alone, whatever its neighbours are: a lease held by another owner or never
/// taken, a value that is not a record (its key named), a result too large
/// for the repository, a record completed; and nothing but the completed
/// records changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_completions_answer_each_key_alone() {
    let server = dedicated().await;
    let counter = containers::WireCounter::redis(server.url()).await.unwrap();
    let mut admin = admin(server.url()).await;
    let repo = RedisRepository::connect(counter.url())
        .await
        .unwrap()
        .with_max_result_bytes(1 << 20);
    let clock = ManualClock::starting_now();
    let now = clock.now();
    const N: usize = 250;
    let keys: Vec<RecordKey> = (0..N).map(|i| shared_key(&format!("many-{i}"))).collect();
    let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    // Every key reserved but the never-reserved ones and the foreign values.
    let never = |i: usize| i % 50 == 7;
    let foreign = |i: usize| i % 50 == 11 || i % 50 == 12;
    let reserved: Vec<usize> = (0..N).filter(|&i| !never(i) && !foreign(i)).collect();
    let requests: Vec<ReserveRequest<'_>> = reserved
        .iter()
        .map(|&i| request(&keys[i], owners[i], &clock))
        .collect();
    for answer in repo.reserve_many(requests).await {
        assert_eq!(answer.unwrap(), Reservation::Acquired { attempt: 1 });
    }
    for i in (0..N).filter(|&i| foreign(i)) {
        let mut cmd = redis::cmd(if i % 2 == 0 { "HSET" } else { "SET" });
        cmd.arg(RedisRepository::redis_key(&keys[i]));
        if i % 2 == 0 {
            cmd.arg("status");
        }
        let _: () = cmd
            .arg("not a record")
            .query_async(&mut admin)
            .await
            .unwrap();
    }
    let stranger = |i: usize| i % 50 == 3;
    let too_large = 2 << 20;
    let large = |i: usize| i % 100 == 20;
    let results: Vec<Vec<u8>> = (0..N)
        .map(|i| match i {
            5 => vec![b'x'; too_large],
            _ if large(i) => vec![i as u8; 300 * 1024],
            _ => format!("result-{i}").into_bytes(),
        })
        .collect();
    let writes: Vec<Completion<'_>> = (0..N)
        .map(|i| Completion {
            key: &keys[i],
            owner: if stranger(i) {
                OwnerToken::random()
            } else {
                owners[i]
            },
            result: Some(results[i].as_slice()),
            expires_at: now + TTL,
        })
        .collect();
    let before = counter.snapshot();
    let mut answers = Vec::new();
    let commands = commands_of(&mut admin, async {
        answers = repo.complete_many(writes, now).await;
    })
    .await;
    // One pipeline, then the resends in another. The first carries about a
    // megabyte: a loaded server may answer its first calls before the proxy
    // has forwarded the rest, which the counter sees as a second flight.
    let flights = counter.round_trips_since(&before);
    assert!((2..=4).contains(&flights), "{flights} flights");
    // 249 keys sent (key 5's result is refused first) in calls of 19, 1, 99,
    // 1, 99, 1 and 29 keys (keys 20, 120 and 220 alone: their results are
    // over 256 KiB); then the 20 keys not completed, one `finish` each.
    let not_completed = (0..N).filter(|&i| never(i) || stranger(i) || foreign(i));
    assert_eq!(not_completed.count(), 20);
    assert_eq!(commands.get("evalsha"), Some(&(7 + 20)), "{commands:?}");
    assert_eq!(answers.len(), N);
    let completed = |i: usize| !never(i) && !foreign(i) && !stranger(i) && i != 5;
    for (i, answer) in answers.into_iter().enumerate() {
        let k = &keys[i];
        match answer {
            Ok(()) => assert!(completed(i), "key {i} completed"),
            Err(Error::LeaseLost { key }) => {
                assert!(never(i) || stranger(i), "key {i} lost");
                assert_eq!(&key, k);
            }
            Err(Error::Corrupt {
                key: Some(key),
                reason,
            }) => {
                assert!(foreign(i), "key {i} corrupt");
                assert_eq!(&key, k);
                let expected = if i % 2 == 0 {
                    "the key holds a value that is not a string"
                } else {
                    "unsupported record format"
                };
                assert_eq!(reason, expected, "key {i}");
            }
            Err(Error::TooLarge { .. }) => assert_eq!(i, 5),
            Err(e) => panic!("key {i}: {e:?}"),
        }
        let stored = repo.get(k, now).await;
        if foreign(i) {
            assert!(matches!(stored, Err(Error::Corrupt { .. })), "key {i}");
        } else if never(i) {
            assert_eq!(stored.unwrap(), None, "key {i}");
        } else {
            let r = stored.unwrap().unwrap();
            assert_eq!(r.owner, owners[i], "key {i}");
            if completed(i) {
                assert_eq!(r.status, Status::Completed, "key {i}");
                assert_eq!(r.result.as_deref(), Some(results[i].as_slice()), "key {i}");
                assert_eq!(r.expires_at, now + TTL, "key {i}");
            } else {
                assert_eq!(r.status, Status::Processing, "key {i}");
            }
        }
        let _ = repo.delete(k).await;
    }
    // Lost leases and foreign values say nothing against the script: the
    // next batch is one `complete_many` call again.
    let next: Vec<RecordKey> = (0..10).map(|i| shared_key(&format!("next-{i}"))).collect();
    let next_owners: Vec<OwnerToken> = next.iter().map(|_| OwnerToken::random()).collect();
    for answer in repo
        .reserve_many(requests_of(&next, &next_owners, &clock))
        .await
    {
        assert_eq!(answer.unwrap(), Reservation::Acquired { attempt: 1 });
    }
    let writes: Vec<Completion<'_>> = next
        .iter()
        .zip(&next_owners)
        .map(|(key, owner)| Completion {
            key,
            owner: *owner,
            result: None,
            expires_at: now + TTL,
        })
        .collect();
    let mut answers = Vec::new();
    let commands = commands_of(&mut admin, async {
        answers = repo.complete_many(writes, now).await;
    })
    .await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert_eq!(commands.get("evalsha"), Some(&1), "{commands:?}");
}

/// Behind a proxy in front of shards, a batch's `complete_many` call cannot
/// see every key. One that routes a script to the shard of its first key
/// without looking at the others (twemproxy, Envoy's Redis proxy) gets the
/// other shards' keys answered as lost leases; one that refuses scripts over
/// many keys in its own words (not `CROSSSLOT`) gets the call refused. Either
/// way each key the script did not complete is completed again on its own,
/// which the proxy routes to its shard, and every later batch completes key
/// by key: every answer is `Ok` and every record is completed once, by its
/// owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_completions_survive_a_proxy_in_front_of_shards() {
    use sharding_proxy::{Scripts, ShardingProxy};
    let server = shared().await;
    for scripts in [Scripts::FirstKey, Scripts::OneKeyOnly] {
        proxied_batches(&ShardingProxy::start(server.url(), scripts).await).await;
    }
}

/// Two batches of 40 keys spread over both shards through `proxy`, reserved
/// and completed: the first tries one script over its keys, the second none.
async fn proxied_batches(proxy: &sharding_proxy::ShardingProxy) {
    let repo = RedisRepository::connect(proxy.url()).await.unwrap();
    let clock = ManualClock::starting_now();
    let now = clock.now();
    for round in 0..2 {
        let keys: Vec<RecordKey> = (0..40)
            .map(|i| shared_key(&format!("proxied-{round}-{i}")))
            .collect();
        let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
        for answer in repo.reserve_many(requests_of(&keys, &owners, &clock)).await {
            assert_eq!(answer.unwrap(), Reservation::Acquired { attempt: 1 });
        }
        let mut shards = std::collections::BTreeSet::new();
        for k in &keys {
            let name = RedisRepository::redis_key(k);
            let shard = sharding_proxy::ShardingProxy::shard_of(name.as_bytes());
            assert!(proxy.holds(shard, &name).await, "{name} on shard {shard}");
            shards.insert(shard);
        }
        assert_eq!(shards.len(), 2, "the keys spread over both shards");
        let writes: Vec<Completion<'_>> = keys
            .iter()
            .zip(&owners)
            .map(|(key, owner)| Completion {
                key,
                owner: *owner,
                result: Some(key.id().as_bytes()),
                expires_at: now + TTL,
            })
            .collect();
        let scripts_before = proxy.multi_key_scripts();
        let answers = repo.complete_many(writes, now).await;
        assert!(
            answers.iter().all(Result::is_ok),
            "round {round}: {answers:?}"
        );
        // The first batch tried one script over its keys; the second none.
        let expected = usize::from(round == 0);
        assert_eq!(proxy.multi_key_scripts() - scripts_before, expected);
        for (k, owner) in keys.iter().zip(&owners) {
            let r = repo.get(k, now).await.unwrap().unwrap();
            assert_eq!((r.owner, r.status), (*owner, Status::Completed), "{k}");
            assert_eq!(r.result.as_deref(), Some(k.id().as_bytes()));
            assert!(repo.delete(k).await.unwrap());
        }
    }
}

/// The states a batch meets, prepared under `prefix` on `repo`: the key ids
/// and, for each, the owner that reserves it in the batch. Fresh keys,
/// completed records (duplicates), our own live reservation (a re-sent
/// reserve), another owner's live one, a stale one (a takeover), a completed
/// record still stored but logically expired when the batch comes (see
/// [`batch_requests`]), a retryable failure (taken over), a foreign value
/// (corrupt) and a hash (the wrong type).
async fn batch_states(
    repo: &RedisRepository,
    admin: &mut redis::aio::MultiplexedConnection,
    clock: &ManualClock,
    prefix: &str,
) -> (Vec<RecordKey>, Vec<OwnerToken>) {
    let ns = containers::unique_namespace(prefix);
    let k = |id: &str| RecordKey::new(ns.clone(), id, 256).unwrap();
    let now = clock.now();
    let (mut keys, mut owners) = (Vec::new(), Vec::new());
    let mut add = |key: RecordKey, owner: OwnerToken| {
        keys.push(key);
        owners.push(owner);
    };
    add(k("fresh"), OwnerToken::random());
    let completed = k("completed");
    let first = reserved(repo, &completed, clock).await;
    repo.complete(&completed, first, Some(b"r"), now + TTL, now)
        .await
        .unwrap();
    add(completed, OwnerToken::random());
    let ours = k("ours");
    let owner = reserved(repo, &ours, clock).await;
    add(ours, owner);
    let theirs = k("theirs");
    reserved(repo, &theirs, clock).await;
    add(theirs, OwnerToken::random());
    let stale = k("stale");
    repo.reserve(ReserveRequest {
        lease_until: now,
        ..request(&stale, OwnerToken::random(), clock)
    })
    .await
    .unwrap();
    add(stale, OwnerToken::random());
    let expired = k("expired");
    let owner = reserved(repo, &expired, clock).await;
    repo.complete(&expired, owner, Some(b"old"), now + TTL, now)
        .await
        .unwrap();
    add(expired, OwnerToken::random());
    let failed = k("failed");
    let owner = reserved(repo, &failed, clock).await;
    repo.fail(&failed, owner, None, true, now + TTL, now)
        .await
        .unwrap();
    add(failed, OwnerToken::random());
    let foreign = k("foreign");
    let _: () = redis::cmd("SET")
        .arg(RedisRepository::redis_key(&foreign))
        .arg(b"\0\xffnot a record".as_slice())
        .arg("EX")
        .arg(600)
        .query_async(admin)
        .await
        .unwrap();
    add(foreign, OwnerToken::random());
    let hash = k("hash");
    let _: () = redis::cmd("HSET")
        .arg(RedisRepository::redis_key(&hash))
        .arg("status")
        .arg("processing")
        .query_async(admin)
        .await
        .unwrap();
    add(hash, OwnerToken::random());
    (keys, owners)
}

/// `key` reserved by a new owner, returned.
async fn reserved(repo: &RedisRepository, key: &RecordKey, clock: &ManualClock) -> OwnerToken {
    let owner = OwnerToken::random();
    repo.reserve(request(key, owner, clock)).await.unwrap();
    owner
}

/// Where [`batch_states`] puts the record that expires before its batch.
const EXPIRED: usize = 5;

/// The batch over [`batch_states`]' keys: each request at the clock's time
/// but the one for [`EXPIRED`], which comes after that record's expiry (the
/// server still holds it: its TTL is an hour).
fn batch_requests<'a>(
    keys: &'a [RecordKey],
    owners: &[OwnerToken],
    clock: &ManualClock,
) -> Vec<ReserveRequest<'a>> {
    let mut requests = requests_of(keys, owners, clock);
    let later = clock.now() + TTL + Duration::from_secs(1);
    requests[EXPIRED] = ReserveRequest {
        now: later,
        lease_until: later + LEASE,
        expires_at: later + TTL,
        ..requests[EXPIRED].clone()
    };
    requests
}

/// What an answer says, without the record's instants.
fn shape(answer: &Result<Reservation, Error>) -> String {
    match answer {
        Ok(Reservation::Acquired { attempt }) => format!("acquired {attempt}"),
        Ok(Reservation::Existing(r)) => {
            format!("existing {:?} {:?} {}", r.status, r.result, r.attempt)
        }
        Err(Error::Corrupt { key: Some(k), .. }) => format!("corrupt {}", k.id()),
        Err(e) => format!("error retryable={}", e.is_retryable()),
    }
}

/// A batch that reads first answers every state exactly as one that writes
/// first, with one `MGET` and `SET … NX … GET` only for the keys the records
/// leave open; a batch of duplicates is one `MGET`, one round trip. Under the
/// adaptive default a batch reads first once the recent batches were mostly
/// duplicates, and writes first again once they are mostly fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_read_first_answer_as_the_writes_do() {
    let server = dedicated().await;
    let counter = containers::WireCounter::redis(server.url()).await.unwrap();
    let mut admin = admin(server.url()).await;
    let connect = |reads: BatchReads| {
        let url = counter.url().to_owned();
        async move {
            let repo = RedisRepository::connect(&url)
                .await
                .unwrap()
                .with_batch_reads(reads);
            repo.load_scripts().await.unwrap();
            repo
        }
    };
    let (reads, writes) = (
        connect(BatchReads::Always).await,
        connect(BatchReads::Never).await,
    );
    let clock = ManualClock::starting_now();
    let (read_keys, read_owners) = batch_states(&reads, &mut admin, &clock, "read-first").await;
    let (write_keys, write_owners) = batch_states(&writes, &mut admin, &clock, "write-first").await;
    let mut by_reads = Vec::new();
    let commands = commands_of(&mut admin, async {
        by_reads = reads
            .reserve_many(batch_requests(&read_keys, &read_owners, &clock))
            .await;
    })
    .await;
    let by_writes = writes
        .reserve_many(batch_requests(&write_keys, &write_owners, &clock))
        .await;
    let shapes =
        |answers: &[Result<Reservation, Error>]| answers.iter().map(shape).collect::<Vec<_>>();
    assert_eq!(shapes(&by_reads), shapes(&by_writes));
    assert_eq!(
        shapes(&by_reads),
        [
            "acquired 1",
            "existing Completed Some([114]) 1",
            "acquired 1",
            "existing Processing None 1",
            "acquired 2",
            "acquired 1",
            "acquired 2",
            "corrupt foreign",
            "corrupt hash",
        ]
    );
    // One read, and writes only for the five keys it left open: a pipeline
    // of `SET … NX … GET` (fresh, stale, expired, failed, hash), then for the
    // stale, expired and failed keys the single path (`SET … NX … GET`
    // again, then the reserve script with its `GET` and `SET`). Nothing for
    // the completed, ours, theirs and foreign keys.
    assert_eq!(
        commands,
        counts(&[("mget", 1), ("set", 11), ("evalsha", 3), ("get", 3)])
    );

    // A batch of duplicates: one `MGET`, one round trip, nothing written.
    let keys: Vec<RecordKey> = (0..100).map(|i| key(&format!("dup-{i}"))).collect();
    let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let fresh = writes
        .reserve_many(requests_of(&keys, &owners, &clock))
        .await;
    let acquired =
        |a: &Result<Reservation, Error>| matches!(a, Ok(Reservation::Acquired { attempt: 1 }));
    assert!(fresh.iter().all(acquired));
    let others: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let before = counter.snapshot();
    let mut duplicates = Vec::new();
    let commands = commands_of(&mut admin, async {
        duplicates = reads
            .reserve_many(requests_of(&keys, &others, &clock))
            .await;
    })
    .await;
    assert_eq!(counter.round_trips_since(&before), 1);
    assert_eq!(commands, counts(&[("mget", 1)]));
    for (answer, owner) in duplicates.iter().zip(&owners) {
        assert!(matches!(answer, Ok(Reservation::Existing(r)) if r.owner == *owner));
    }

    // Adaptive: writes first to begin with; reads first after a batch of
    // duplicates; writes first again after fresh batches.
    let adaptive = connect(BatchReads::Adaptive).await;
    let commands = commands_of(&mut admin, reserve_all(&adaptive, &keys, &others, &clock)).await;
    assert_eq!(
        commands,
        counts(&[("set", 100)]),
        "writes first to begin with"
    );
    let commands = commands_of(&mut admin, reserve_all(&adaptive, &keys, &others, &clock)).await;
    assert_eq!(
        commands,
        counts(&[("mget", 1)]),
        "reads first after duplicates"
    );
    for round in 0..2 {
        let fresh: Vec<RecordKey> = (0..100)
            .map(|i| key(&format!("fresh-{round}-{i}")))
            .collect();
        let owners: Vec<OwnerToken> = fresh.iter().map(|_| OwnerToken::random()).collect();
        reserve_all(&adaptive, &fresh, &owners, &clock).await;
    }
    let commands = commands_of(&mut admin, reserve_all(&adaptive, &keys, &others, &clock)).await;
    assert_eq!(
        commands,
        counts(&[("set", 100)]),
        "writes first after fresh batches"
    );
}

/// One `reserve_many` of `keys` by `owners`, every answer an answer.
async fn reserve_all(
    repo: &RedisRepository,
    keys: &[RecordKey],
    owners: &[OwnerToken],
    clock: &ManualClock,
) {
    let answers = repo.reserve_many(requests_of(keys, owners, clock)).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
}

/// A server that refuses a batch's read for anything but an outage (here an
/// ACL without `MGET`) gets that batch's writes instead, with the answers
/// the writes give, and every later batch writes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_read_falls_back_to_the_writes_for_good() {
    let server = dedicated().await;
    let mut admin = admin(server.url()).await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "no-mget", "on", ">secret", "~*", "&*", "+@all", "-mget",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = server
        .url()
        .replacen("redis://", "redis://no-mget:secret@", 1);
    let repo = RedisRepository::connect(&format!("{url}?batch_reads=always"))
        .await
        .unwrap();
    let clock = ManualClock::starting_now();
    let keys: Vec<RecordKey> = (0..3).map(|i| key(&format!("refused-{i}"))).collect();
    let owners: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let mut fresh = Vec::new();
    let commands = commands_of(&mut admin, async {
        fresh = repo.reserve_many(requests_of(&keys, &owners, &clock)).await;
    })
    .await;
    assert!(
        fresh
            .iter()
            .all(|a| matches!(a, Ok(Reservation::Acquired { attempt: 1 }))),
        "{fresh:?}"
    );
    assert_eq!(commands.get("set"), Some(&3), "{commands:?}");
    let others: Vec<OwnerToken> = keys.iter().map(|_| OwnerToken::random()).collect();
    let mut duplicates = Vec::new();
    let commands = commands_of(&mut admin, async {
        duplicates = repo.reserve_many(requests_of(&keys, &others, &clock)).await;
    })
    .await;
    for (answer, owner) in duplicates.iter().zip(&owners) {
        assert!(matches!(answer, Ok(Reservation::Existing(r)) if r.owner == *owner));
    }
    assert_eq!(commands, counts(&[("set", 3)]), "no read tried again");
}
