//! placeholder
pub use idempotency_core::*;
