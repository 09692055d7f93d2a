//! RabbitMQ consumer tests (being written).
