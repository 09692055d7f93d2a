//! Readable traces: a path the checker found, as numbered steps.

use std::fmt::Write as _;

use idempotency_core::{Record, Status};
use stateright::Path;

use crate::model::{Action, IdempotencyModel};
use crate::state::{Answer, Consumer, Op, Phase, Request, State};

/// One action in words.
pub fn describe(action: &Action) -> String {
    match action {
        Action::Tick => "time advances one tick".to_owned(),
        Action::Delay(r) => format!("{} is DELAYED (may land ticks later)", request(r)),
        Action::Deliver(i) => format!("c{i} is delivered the key and reserves it"),
        Action::RoundTrip(r) => format!("the store applies {} and replies", request(r)),
        Action::ReplyLate(r) => format!("the store applies {}; its reply is LATE", request(r)),
        Action::RequestLost(r) => format!("{} is LOST on its way", request(r)),
        Action::Receives(r) => format!("c{} receives {}", r.to, answer(&r.answer)),
        Action::ReplyLost(r) => {
            format!("the late reply {} to c{} is LOST", answer(&r.answer), r.to)
        }
        Action::GivesUp(i) => format!("c{i} gives up waiting for its call (time box)"),
        Action::KeeperGivesUp(i) => format!("c{i}'s lease keeper gives up on its extension"),
        Action::Effect(i) => format!("c{i}'s handler applies its EFFECT and returns"),
        Action::HandlerFails(i) => format!("c{i}'s handler fails (or stops: lease lost)"),
        Action::Extends(i) => format!("c{i}'s lease keeper extends the lease"),
        Action::Crashes(i) => format!("c{i} CRASHES"),
        Action::Drops(i) => format!("c{i}'s caller drops the execution"),
    }
}

fn request(r: &Request) -> String {
    let op = match r.op {
        Op::Reserve => "reserve".to_owned(),
        Op::Complete => "complete".to_owned(),
        Op::Fail { retryable } => format!("fail(retryable={retryable})"),
        Op::Release => "release".to_owned(),
        Op::Extend => "extend".to_owned(),
        Op::Get => "get".to_owned(),
    };
    format!(
        "{op} from c{} as {} (its clock {}s, call {})",
        r.from,
        owner(r.owner.as_u128()),
        r.now,
        r.call
    )
}

fn answer(a: &Answer) -> String {
    match a {
        Answer::Acquired(n) => format!("Acquired(attempt {n})"),
        Answer::Existing(r, _) => format!("Existing({})", record(&r.0)),
        Answer::Ok => "Ok".to_owned(),
        Answer::LeaseLost => "LeaseLost".to_owned(),
        Answer::Got(r) => match r {
            Some(r) => format!("Got({})", record(&r.0)),
            None => "Got(none)".to_owned(),
        },
    }
}

fn owner(token: u128) -> String {
    let n = token.saturating_sub(1);
    format!("c{}#{}", n / 16, n % 16 + 1)
}

fn secs(t: idempotency_core::Timestamp) -> u64 {
    t.as_millis() / crate::config::TICK_MS
}

fn record(r: &Record) -> String {
    let status = match r.status {
        Status::Processing => "Processing",
        Status::Completed => "Completed",
        Status::Failed => "Failed",
    };
    format!(
        "{status} by {} attempt {} lease<{}s expires {}s",
        owner(r.owner.as_u128()),
        r.attempt,
        secs(r.lease_until),
        secs(r.expires_at)
    )
}

fn consumer(i: usize, c: &Consumer, local: u8) -> String {
    let phase = match &c.phase {
        Phase::Idle => "idle".to_owned(),
        Phase::Reserving { tries, .. } => format!("reserving (re-sends {tries})"),
        Phase::Running => format!("running (lease<{}s)", c.deadline),
        Phase::Recording {
            write,
            checking,
            background,
            ..
        } => format!(
            "recording {write:?}{}{}",
            if *checking { " (checking)" } else { "" },
            if *background { " in background" } else { "" }
        ),
        Phase::Done => "done".to_owned(),
        Phase::Crashed => "crashed".to_owned(),
    };
    let answer = c
        .answer
        .map(|a| format!(", answered {a:?}"))
        .unwrap_or_default();
    format!(
        "c{i}@{local}s {}: {phase}{answer}",
        owner(c.owner.as_u128())
    )
}

/// The state in one line.
pub fn summary(model: &IdempotencyModel, s: &State) -> String {
    let store = s.record.as_ref().map_or_else(|| "none".to_owned(), record);
    let consumers: Vec<String> = s
        .consumers
        .iter()
        .enumerate()
        .map(|(i, c)| consumer(i, c, model.local(s, i as u8)))
        .collect();
    format!(
        "t={}s store: {store} | {} | in flight: {} requests, {} replies",
        s.now,
        consumers.join(" | "),
        s.requests.len(),
        s.replies.len()
    )
}

/// A path as numbered steps, each with the state it leads to, up to its
/// `last` state.
pub fn format_path(model: &IdempotencyModel, path: &Path<State, Action>, last: usize) -> String {
    let mut out = String::new();
    let steps = path.clone().into_vec();
    for (n, (state, action)) in steps.iter().enumerate().take(last) {
        if n == 0 {
            let _ = writeln!(out, "  0. start: {}", summary(model, state));
        }
        if let Some(action) = action {
            let next = steps.get(n + 1).map(|(s, _)| s);
            let _ = writeln!(out, "{:>3}. {}", n + 1, describe(action));
            if let Some(next) = next {
                let _ = writeln!(out, "       → {}", summary(model, next));
            }
        }
    }
    out
}
