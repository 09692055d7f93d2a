//! The kafka consumer (being written).
