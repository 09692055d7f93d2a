-- idempotency-postgres migration 2: the reservation function answers duplicates
-- of live records with a plain read. Before, every duplicate locked its row
-- (SELECT … FOR UPDATE), which assigns a transaction id and writes WAL, so each
-- duplicate waited for a commit flush like a write. Same signature and results;
-- only the fast path before the locked one is new.

CREATE OR REPLACE FUNCTION {reserve_fn}(
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
    -- Duplicate fast path: a live record that this call may not take over is
    -- answered from a plain read: no row lock, no transaction id, no WAL, so no
    -- commit flush. The answer is the record as of this statement's snapshot,
    -- which is when this reserve takes effect. Anything else (absent, expired,
    -- or open to a takeover) goes through the locked path below, which decides
    -- again on the newest committed version.
    SELECT * INTO r FROM {table} AS t
    WHERE t.namespace = p_namespace AND t.id = p_id;
    IF FOUND AND r.expires_at > p_now
       AND ((r.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL
             AND r.fingerprint <> p_fingerprint)
            OR NOT ((r.status = 'processing' AND r.lease_until <= p_lease_cutoff)
                    OR (r.status = 'failed' AND p_retry_failed)))
    THEN
        RETURN QUERY SELECT false, r.status, r.owner, r.attempt, r.fingerprint, r.result,
            r.error, r.lease_until, r.expires_at, r.created_at, r.updated_at;
        RETURN;
    END IF;

    LOOP
        -- Fresh key: the insert is the whole reservation. A conflicting row that
        -- another transaction is still inserting makes this wait for its outcome.
        INSERT INTO {table} AS t
            (namespace, id, status, owner, attempt, fingerprint, result, error,
             lease_until, expires_at, created_at, updated_at)
        VALUES
            (p_namespace, p_id, 'processing', p_owner, 1, p_fingerprint, NULL, NULL,
             p_lease_until, p_expires_at, p_now, p_now)
        ON CONFLICT (namespace, id) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT true, 'processing'::text, p_owner, 1::bigint, p_fingerprint,
                NULL::bytea, NULL::bytea, p_lease_until, p_expires_at, p_now, p_now;
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
            fingerprint = p_fingerprint, result = NULL, error = NULL,
            lease_until = p_lease_until, expires_at = p_expires_at,
            created_at = p_now, updated_at = p_now
        WHERE t.namespace = p_namespace AND t.id = p_id;
        RETURN QUERY SELECT true, 'processing'::text, p_owner, 1::bigint, p_fingerprint,
            NULL::bytea, NULL::bytea, p_lease_until, p_expires_at, p_now, p_now;
        RETURN;
    END IF;

    IF NOT (r.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL
            AND r.fingerprint <> p_fingerprint)
       AND ((r.status = 'processing' AND r.lease_until <= p_lease_cutoff)
            OR (r.status = 'failed' AND p_retry_failed))
    THEN
        -- Takeover: new owner, next attempt, created_at kept.
        UPDATE {table} AS t SET
            status = 'processing', owner = p_owner,
            attempt = LEAST(r.attempt + 1, 4294967295),
            fingerprint = p_fingerprint, result = NULL, error = NULL,
            lease_until = p_lease_until, expires_at = p_expires_at,
            updated_at = p_now
        WHERE t.namespace = p_namespace AND t.id = p_id;
        RETURN QUERY SELECT true, 'processing'::text, p_owner, LEAST(r.attempt + 1, 4294967295),
            p_fingerprint, NULL::bytea, NULL::bytea, p_lease_until, p_expires_at,
            r.created_at, p_now;
        RETURN;
    END IF;

    -- Existing: returned unchanged, as read under the lock.
    RETURN QUERY SELECT false, r.status, r.owner, r.attempt, r.fingerprint, r.result,
        r.error, r.lease_until, r.expires_at, r.created_at, r.updated_at;
END;
$reserve$;
