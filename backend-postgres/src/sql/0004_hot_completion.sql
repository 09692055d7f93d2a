-- idempotency-postgres migration 4: the completing update is HOT, and the
-- reservation function runs fewer statements.
--
-- - `purge_after`: where `purge_expired` starts looking for a record, the one
--   indexed instant. It is the expiry the record was reserved with, and never
--   later than `expires_at`: `complete` and `fail` lower it to their expiry
--   when that is earlier (`LEAST`), `extend` only ever raises `expires_at`. A
--   completion's expiry (its time plus the TTL) is later than the
--   reservation's, so the usual completion leaves every indexed column as it
--   was, and PostgreSQL can write the new version on the same page without
--   new index entries (a HOT update: less WAL, nothing for vacuum to clean in
--   the indexes). `expires_at` stays the truth: every statement decides on it
--   and `purge_expired` deletes only rows with `expires_at <= now`; since
--   `purge_after <= expires_at`, its index finds every such row (plus the few
--   completed after their reservation's expiry would have passed: about the
--   records still being handled, skipped by the same filter).
-- - The index on `expires_at` is replaced by the one on `purge_after`: an
--   index on a column the completion changes makes every completion a new
--   entry in every index.
-- - `fillfactor = 85`: new pages keep room for the completed versions of the
--   rows they hold.
-- - The reservation function answers a duplicate or a re-sent reserve with one
--   query (the read and the decision together) and a fresh key with one
--   `INSERT … RETURNING`; its results and signature are unchanged.
--
-- The backfill rewrites every row once, in the one transaction every
-- migration here runs in, and `ADD COLUMN` locks the table against every
-- operation until it commits: on a large table, migrate at a quiet time.
-- Processes of the previous version keep working against the migrated table:
-- their completions leave `purge_after` as it was (a completion that shortens
-- the expiry is then purged when the reservation's expiry has passed too), and
-- their purge, without the index on `expires_at`, scans the table.

-- First, so that the rows the backfill rewrites land on pages with room.
ALTER TABLE {table} SET (fillfactor = 85);
-- The default, 0, is what a writer that does not know the column stores (a
-- reservation function of the previous version still running when this
-- commits): never later than any expiry, so such a row is found by every
-- purge and deleted once it has expired.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS purge_after bigint NOT NULL DEFAULT 0;
UPDATE {table} SET purge_after = expires_at;
CREATE INDEX IF NOT EXISTS {purge_index} ON {table} (purge_after);
-- An index lives in its table's schema: name it there, never by search path.
DROP INDEX IF EXISTS {schema}.{expires_index};

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
    -- this call already holds (a re-sent reserve: acquired), or one it may not
    -- take over (a duplicate: not acquired), is answered by this one read, as
    -- of this statement's snapshot. Anything else goes on below.
    RETURN QUERY
        SELECT t.status = 'processing' AND t.owner = p_owner, t.status, t.owner, t.attempt,
            t.fingerprint, t.result, t.error, t.retryable, t.lease_until, t.expires_at,
            t.created_at, t.updated_at
        FROM {table} AS t
        WHERE t.namespace = p_namespace AND t.id = p_id AND t.expires_at > p_now
          AND ((t.status = 'processing' AND t.owner = p_owner)
               OR (t.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL
                   AND t.fingerprint <> p_fingerprint)
               OR NOT ((t.status = 'processing' AND t.lease_until <= p_lease_cutoff)
                       OR (t.status = 'failed' AND p_retry_failed AND t.retryable)));
    IF FOUND THEN
        RETURN;
    END IF;

    LOOP
        -- Fresh key: the insert is the whole reservation. A conflicting row that
        -- another transaction is still inserting makes this wait for its outcome.
        RETURN QUERY
            INSERT INTO {table} AS t
                (namespace, id, status, owner, attempt, fingerprint, result, error, retryable,
                 lease_until, expires_at, created_at, updated_at, purge_after)
            VALUES
                (p_namespace, p_id, 'processing', p_owner, 1, p_fingerprint, NULL, NULL, false,
                 p_lease_until, p_expires_at, p_now, p_now, p_expires_at)
            ON CONFLICT (namespace, id) DO NOTHING
            RETURNING true, t.status, t.owner, t.attempt, t.fingerprint, t.result, t.error,
                t.retryable, t.lease_until, t.expires_at, t.created_at, t.updated_at;
        IF FOUND THEN
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
            created_at = p_now, updated_at = p_now, purge_after = p_expires_at
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
            updated_at = p_now, purge_after = p_expires_at
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
