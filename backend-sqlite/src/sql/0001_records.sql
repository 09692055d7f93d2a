-- Records of idempotency-rs (contract §2). Keys are BLOBs: compared byte for
-- byte, never by a collation. Timestamps are milliseconds since the epoch.
CREATE TABLE IF NOT EXISTS idempotency_records (
    namespace   BLOB    NOT NULL,
    id          BLOB    NOT NULL,
    status      TEXT    NOT NULL,
    owner       BLOB    NOT NULL,
    attempt     INTEGER NOT NULL,
    fingerprint BLOB,
    result      BLOB,
    error       BLOB,
    retryable   INTEGER NOT NULL DEFAULT 0,
    lease_until INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (namespace, id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
