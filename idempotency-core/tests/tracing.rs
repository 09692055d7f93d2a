#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The execution span: its outcome is recorded when a subscriber listens, and
//! never written onto the caller's span when the execution span is filtered out.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use idempotency_core::{Config, HandlerError, IdempotencyManager, MemoryRepository, Outcome};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use tracing_core::span::Current;

/// Records every span's `outcome` field, by span name; `skip` names a span
/// to filter out.
#[derive(Default)]
struct Recorder {
    skip: Option<&'static str>,
    next: AtomicU64,
    names: Mutex<HashMap<u64, &'static Metadata<'static>>>,
    stack: Mutex<Vec<u64>>,
    outcomes: Arc<Mutex<Vec<(&'static str, String)>>>,
}

struct Outcomes<'a>(&'a mut Option<String>);

impl Visit for Outcomes<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "outcome" {
            *self.0 = Some(format!("{value:?}"));
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "outcome" {
            *self.0 = Some(value.to_owned());
        }
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        Some(metadata.name()) != self.skip
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        self.names.lock().unwrap().insert(id, span.metadata());
        Id::from_u64(id)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut outcome = None;
        values.record(&mut Outcomes(&mut outcome));
        if let Some(outcome) = outcome {
            let name = self.names.lock().unwrap()[&span.into_u64()].name();
            self.outcomes.lock().unwrap().push((name, outcome));
        }
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, _: &Event<'_>) {}

    fn enter(&self, span: &Id) {
        self.stack.lock().unwrap().push(span.into_u64());
    }

    fn exit(&self, _: &Id) {
        self.stack.lock().unwrap().pop();
    }

    fn current_span(&self) -> Current {
        match self.stack.lock().unwrap().last() {
            Some(&id) => Current::new(Id::from_u64(id), self.names.lock().unwrap()[&id]),
            None => Current::none(),
        }
    }
}

/// Runs a first delivery and a duplicate of one key inside a caller's span that
/// has an `outcome` field of its own; returns the outcomes recorded.
fn run(skip: Option<&'static str>) -> Vec<(&'static str, String)> {
    let recorder = Recorder {
        skip,
        ..Recorder::default()
    };
    let outcomes = recorder.outcomes.clone();
    tracing::subscriber::with_default(recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let manager =
            IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default()).unwrap();
        let caller = tracing::info_span!("caller", outcome = tracing::field::Empty);
        let _entered = caller.enter();
        for expected in ["executed", "cached"] {
            let outcome = runtime
                .block_on(
                    manager.execute("order-1", &1, || async { Ok::<_, HandlerError<String>>(7) }),
                )
                .unwrap();
            match (expected, outcome) {
                ("executed", Outcome::Executed(7)) | ("cached", Outcome::Cached(7)) => {}
                (_, other) => panic!("{expected}: {other:?}"),
            }
        }
    });
    let recorded = outcomes.lock().unwrap().clone();
    recorded
}

#[test]
fn outcomes_are_recorded_on_the_execution_span() {
    assert_eq!(
        run(None),
        [
            ("idempotency.execute", "executed".to_owned()),
            ("idempotency.execute", "cached".to_owned())
        ]
    );
}

#[test]
fn a_filtered_execution_span_leaves_the_callers_span_alone() {
    assert_eq!(run(Some("idempotency.execute")), []);
}
