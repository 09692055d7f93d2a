//! The in-memory store: the library against the handler called directly, so the
//! difference is the manager's own cost per execution.

use std::sync::Arc;

use async_trait::async_trait;
use idempotency_core::{IdempotencyManager, MemoryRepository};

use super::{config, execute, handler, key_id, populate, Lane, Workload};
use crate::{BoxError, Scenario, Variant};

/// The manager over a [`MemoryRepository`]; the raw variant awaits the handler.
#[derive(Debug)]
pub struct MemoryWorkload {
    manager: IdempotencyManager,
}

impl MemoryWorkload {
    /// A manager over a new, empty store.
    ///
    /// # Errors
    /// Only if the bench's configuration were invalid.
    pub fn new() -> Result<Self, BoxError> {
        let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config())?;
        Ok(MemoryWorkload { manager })
    }
}

#[async_trait]
impl Workload for MemoryWorkload {
    fn backend(&self) -> &'static str {
        "memory"
    }

    fn manager(&self, _lane: Lane) -> &IdempotencyManager {
        &self.manager
    }

    fn describe(&self) -> String {
        "MemoryRepository (sharded, in process); raw = the key's id built and the no-op handler awaited directly"
            .to_owned()
    }

    async fn populate(&self, ns: &str, ops: usize) -> Result<(), BoxError> {
        populate(&self.manager, ns, ops, 1).await
    }

    async fn op(
        &self,
        variant: Variant,
        scenario: Scenario,
        ns: &str,
        i: usize,
        _lane: Lane,
    ) -> Result<(), BoxError> {
        match variant {
            Variant::Library => execute(&self.manager, scenario, ns, i).await,
            Variant::Raw => {
                // The message id a consumer has in hand, built as the
                // library's variant builds it: not the manager's overhead.
                std::hint::black_box(key_id(ns, i));
                let receipt = std::hint::black_box(handler(std::hint::black_box(i)).await);
                match receipt {
                    Ok(r) if r.id == i => Ok(()),
                    _ => Err("the handler answered another receipt".into()),
                }
            }
        }
    }
}
