//! Kafka tests (being written).
