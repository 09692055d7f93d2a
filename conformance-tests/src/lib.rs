//! The conformance suite (under construction).

#[cfg(feature = "containers")]
pub mod containers;
