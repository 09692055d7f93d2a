//! The rabbitmq consumer (being written).
