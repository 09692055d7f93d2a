//! The sqs consumer (being written).
