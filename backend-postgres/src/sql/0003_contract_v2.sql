-- idempotency-postgres migration 3: the contract's second version.
--
-- - `retryable`: whether a failed record may be taken over by a retrying
--   delivery. Rows already `failed` before this migration were all open to such
--   a takeover (under `store_and_retry`), so they keep that: `true`.
-- - The reservation function answers a reserve re-sent by the owner that holds
--   the live record with `acquired` and its stored attempt, writing nothing (a
--   retry after a lost reply is not somebody else's reservation); takes a
--   failed record over only when it is retryable; and a takeover keeps the
--   stored fingerprint when the request carries none.
-- The function returns one more column, so it is dropped and created again
-- (callers select its columns by name, so the previous version's statements
-- keep working against it during a rolling upgrade).

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS retryable boolean NOT NULL DEFAULT false;
UPDATE {table} SET retryable = true WHERE status = 'failed' AND NOT retryable;

DROP FUNCTION IF EXISTS {reserve_fn}(bytea, bytea, bytea, bytea, bigint, bigint, bigint, bigint, boolean);

CREATE FUNCTION {reserve_fn}(
    p_namespace    bytea,
    p_id           bytea,
    p_owner        bytea,
    p_fingerprint  bytea,
    p_now          bigint,
    p_lease_cutoff bigint,
    p_lease_until  bigint,
    p_expires_at   bigint,
    p_retry_failed boolean
)
RETURNS TABLE (
    acquired    boolean,
    status      text,
    owner       bytea,
    attempt     bigint,
    fingerprint bytea,
    result      bytea,
    error       bytea,
    retryable   boolean,
    lease_until bigint,
    expires_at  bigint,
    created_at  bigint,
    updated_at  bigint
)
LANGUAGE plpgsql
AS $reserve$
#variable_conflict use_column
DECLARE
    r     {table}%ROWTYPE;
    tries integer := 0;
BEGIN
    -- Fast path without a row lock (no transaction id, no WAL): a live record
    -- this call already holds (a re-sent reserve), or one it may not take over
    -- (a duplicate), is answered from a plain read as of this statement's
    -- snapshot. Anything else goes through the locked path below.
    SELECT * INTO r FROM {table} AS t
    WHERE t.namespace = p_namespace AND t.id = p_id;
    IF FOUND AND r.expires_at > p_now THEN
        IF r.status = 'processing' AND r.owner = p_owner THEN
            RETURN QUERY SELECT true, r.status, r.owner, r.attempt, r.fingerprint, r.result,
                r.error, r.retryable, r.lease_until, r.expires_at, r.created_at, r.updated_at;
            RETURN;
        END IF;
        IF (r.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL
            AND r.fingerprint <> p_fingerprint)
           OR NOT ((r.status = 'processing' AND r.lease_until <= p_lease_cutoff)
                   OR (r.status = 'failed' AND p_retry_failed AND r.retryable))
        THEN
            RETURN QUERY SELECT false, r.status, r.owner, r.attempt, r.fingerprint, r.result,
                r.error, r.retryable, r.lease_until, r.expires_at, r.created_at, r.updated_at;
            RETURN;
        END IF;
    END IF;

    LOOP
        -- Fresh key: the insert is the whole reservation. A conflicting row that
        -- another transaction is still inserting makes this wait for its outcome.
        INSERT INTO {table} AS t
            (namespace, id, status, owner, attempt, fingerprint, result, error, retryable,
             lease_until, expires_at, created_at, updated_at)
        VALUES
            (p_namespace, p_id, 'processing', p_owner, 1, p_fingerprint, NULL, NULL, false,
             p_lease_until, p_expires_at, p_now, p_now)
        ON CONFLICT (namespace, id) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT true, 'processing'::text, p_owner, 1::bigint, p_fingerprint,
                NULL::bytea, NULL::bytea, false, p_lease_until, p_expires_at, p_now, p_now;
            RETURN;
        END IF;

        -- The key exists: lock its newest committed version and decide on it.
        SELECT * INTO r FROM {table} AS t
        WHERE t.namespace = p_namespace AND t.id = p_id
        FOR UPDATE;
        EXIT WHEN FOUND;

        -- Deleted between the two statements (release, delete, purge): start over.
        tries := tries + 1;
        IF tries >= 100 THEN
            RAISE EXCEPTION 'idempotency reserve: the record kept disappearing; retry'
                USING ERRCODE = 'serialization_failure';
        END IF;
    END LOOP;

    IF r.expires_at <= p_now THEN
        -- Logically absent: create afresh over the expired row.
        UPDATE {table} AS t SET
            status = 'processing', owner = p_owner, attempt = 1,
            fingerprint = p_fingerprint, result = NULL, error = NULL, retryable = false,
            lease_until = p_lease_until, expires_at = p_expires_at,
            created_at = p_now, updated_at = p_now
        WHERE t.namespace = p_namespace AND t.id = p_id;
        RETURN QUERY SELECT true, 'processing'::text, p_owner, 1::bigint, p_fingerprint,
            NULL::bytea, NULL::bytea, false, p_lease_until, p_expires_at, p_now, p_now;
        RETURN;
    END IF;

    IF r.status = 'processing' AND r.owner = p_owner THEN
        -- Ours already (a re-sent reserve): nothing to write.
        RETURN QUERY SELECT true, r.status, r.owner, r.attempt, r.fingerprint, r.result,
            r.error, r.retryable, r.lease_until, r.expires_at, r.created_at, r.updated_at;
        RETURN;
    END IF;

    IF NOT (r.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL
            AND r.fingerprint <> p_fingerprint)
       AND ((r.status = 'processing' AND r.lease_until <= p_lease_cutoff)
            OR (r.status = 'failed' AND p_retry_failed AND r.retryable))
    THEN
        -- Takeover: new owner, next attempt, created_at kept, the stored
        -- fingerprint kept when the request has none.
        UPDATE {table} AS t SET
            status = 'processing', owner = p_owner,
            attempt = LEAST(r.attempt + 1, 4294967295),
            fingerprint = COALESCE(p_fingerprint, r.fingerprint),
            result = NULL, error = NULL, retryable = false,
            lease_until = p_lease_until, expires_at = p_expires_at,
            updated_at = p_now
        WHERE t.namespace = p_namespace AND t.id = p_id;
        RETURN QUERY SELECT true, 'processing'::text, p_owner, LEAST(r.attempt + 1, 4294967295),
            COALESCE(p_fingerprint, r.fingerprint), NULL::bytea, NULL::bytea, false,
            p_lease_until, p_expires_at, r.created_at, p_now;
        RETURN;
    END IF;

    -- Existing: returned unchanged, as read under the lock.
    RETURN QUERY SELECT false, r.status, r.owner, r.attempt, r.fingerprint, r.result,
        r.error, r.retryable, r.lease_until, r.expires_at, r.created_at, r.updated_at;
END;
$reserve$;
