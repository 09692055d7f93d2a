-- Records of idempotency-rs (contract §2). Keys are VARBINARY: compared byte
-- for byte (no collation, no PAD SPACE: 'a', 'A' and 'a ' are three keys).
-- Timestamps are milliseconds since the epoch, written by the clients' clocks.
-- `{table}` is the configured table name, quoted by the crate.
CREATE TABLE IF NOT EXISTS {table} (
    namespace   VARBINARY(512)  NOT NULL,
    id          VARBINARY(1024) NOT NULL,
    status      VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    owner       VARBINARY(16)   NOT NULL,
    attempt     INT UNSIGNED    NOT NULL,
    fingerprint VARBINARY(64)   NULL,
    result      LONGBLOB        NULL,
    error       LONGBLOB        NULL,
    retryable   TINYINT(1)      NOT NULL DEFAULT 0,
    lease_until BIGINT          NOT NULL,
    expires_at  BIGINT          NOT NULL,
    created_at  BIGINT          NOT NULL,
    updated_at  BIGINT          NOT NULL,
    PRIMARY KEY (namespace, id),
    KEY expires_at (expires_at)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC
