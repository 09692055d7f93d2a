//! Copies of one process made by a real `fork` (a prefork server, a worker
//! pool) draw different owner tokens, so two copies delivering the same key
//! to one store run its handler once between them.
//!
//! A harness of its own (libtest-mimic, one thread): `fork` copies only the
//! calling thread, so the fork happens while this process has no other
//! thread (no runtime, no pool), before each copy starts its own.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fork::{fork, waitpid, Fork};
use idempotency_core::{
    Config, Error, ExecuteError, HandlerError, IdempotencyManager, Outcome, OwnerToken,
};
use libtest_mimic::{Arguments, Failed, Trial};

const KEYS: [&str; 3] = ["order-1", "order-2", "order-3"];
const TOKENS_PER_COPY: usize = 64;

fn main() {
    let mut args = Arguments::from_args();
    // Every trial on this thread: a fork must happen with no other thread.
    args.test_threads = Some(1);
    let trials = vec![
        Trial::test(
            "forked_copies_draw_different_owner_tokens",
            forked_copies_draw_different_owner_tokens,
        ),
        Trial::test(
            "forked_copies_delivering_one_key_run_its_handler_once",
            forked_copies_delivering_one_key_run_its_handler_once,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// Forks after the parent drew random values (seeding any generator the
/// process keeps); runs `copy` in both copies, the child's exit code telling
/// its result; returns once the child has exited.
fn in_both_copies(copy: impl Fn(bool) -> Result<(), String>) -> Result<(), Failed> {
    for _ in 0..4 {
        let _ = OwnerToken::random();
    }
    match fork().map_err(|e| format!("fork: {e}"))? {
        Fork::Child => {
            let code = match copy(true) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("child: {e}");
                    1
                }
            };
            std::process::exit(code);
        }
        Fork::Parent(child) => {
            let parent = copy(false);
            let status = waitpid(child).map_err(|e| format!("waitpid: {e}"))?;
            parent?;
            if status != 0 {
                return Err(format!("the child copy failed (wait status {status})").into());
            }
            Ok(())
        }
    }
}

fn forked_copies_draw_different_owner_tokens() -> Result<(), Failed> {
    let dir = scratch("tokens");
    in_both_copies(|child| {
        let tokens: Vec<String> = (0..TOKENS_PER_COPY)
            .map(|_| OwnerToken::random().to_string())
            .collect();
        let name = if child { "child" } else { "parent" };
        std::fs::write(dir.join(name), tokens.join("\n")).map_err(|e| e.to_string())
    })?;
    let read = |name: &str| -> HashSet<String> {
        std::fs::read_to_string(dir.join(name))
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    };
    let (parent, child) = (read("parent"), read("child"));
    assert_eq!(parent.len(), TOKENS_PER_COPY);
    assert_eq!(child.len(), TOKENS_PER_COPY);
    let shared: Vec<_> = parent.intersection(&child).collect();
    if !shared.is_empty() {
        return Err(format!("the copies drew {} equal owner tokens", shared.len()).into());
    }
    Ok(())
}

fn forked_copies_delivering_one_key_run_its_handler_once() -> Result<(), Failed> {
    let dir = scratch("deliveries");
    let db = common::fresh_path("fork");
    // The parent creates and migrates the file before forking, then lets its
    // pool (and the pool's threads) go.
    runtime().block_on(async {
        let repo = common::repository_at(&db, "").await;
        repo.pool().close().await;
    });
    let effects = dir.join("effects");
    in_both_copies(|child| {
        deliver_every_key(&db, &effects, if child { "child" } else { "parent" })
    })?;
    let mut runs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in std::fs::read_to_string(&effects)
        .unwrap_or_default()
        .lines()
    {
        let (copy, key) = line.split_once(' ').unwrap();
        runs.entry(key.to_owned())
            .or_default()
            .push(copy.to_owned());
    }
    for key in KEYS {
        match runs.get(key).map(Vec::as_slice) {
            Some([_]) => {}
            other => return Err(format!("{key}: handler runs {other:?}, expected one").into()),
        }
    }
    Ok(())
}

/// One copy: delivers every key to the shared file at once.
fn deliver_every_key(db: &Path, effects: &Path, copy: &str) -> Result<(), String> {
    runtime().block_on(async {
        let repo = common::repository_at(db, "").await;
        let manager = IdempotencyManager::new(Arc::new(repo), Config::default())
            .map_err(|e| e.to_string())?;
        let [a, b, c] = KEYS;
        let outcomes = tokio::join!(
            deliver(&manager, a, effects, copy),
            deliver(&manager, b, effects, copy),
            deliver(&manager, c, effects, copy),
        );
        for (key, outcome) in KEYS.iter().zip([outcomes.0, outcomes.1, outcomes.2]) {
            match outcome {
                // Ran here; or the other copy holds the key, or finished it.
                Ok(Outcome::Executed(_) | Outcome::Cached(_))
                | Err(ExecuteError::Idempotency(Error::InProgress { .. })) => {}
                other => return Err(format!("{key}: unexpected answer {other:?}")),
            }
        }
        Ok(())
    })
}

/// One delivery of `key`: the handler appends its effect, then holds the key
/// for half a second, so that the other copy's delivery of the key arrives
/// while it is held (a real wait: the two copies are separate processes, and
/// the race between them is the subject).
async fn deliver(
    manager: &IdempotencyManager,
    key: &str,
    effects: &Path,
    copy: &str,
) -> Result<Outcome<String>, ExecuteError<String>> {
    manager
        .execute(key, &key, || async move {
            let effect = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(effects)
                .and_then(|mut file| file.write_all(format!("{copy} {key}\n").as_bytes()));
            effect.map_err(|e| HandlerError::permanent(e.to_string()))?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            Ok::<_, HandlerError<String>>(copy.to_owned())
        })
        .await
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A new directory for one trial's files.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("idempotency-fork")
        .join(format!("{name}-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}
