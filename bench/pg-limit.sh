#!/usr/bin/env bash
# PostgreSQL's own limit beside the library, on one native PostgreSQL server
# (no container, no proxy), fsync on and then off: pgbench with the simplest
# equivalent SQL, pgbench with the library's own SQL, and the library (the
# bench binary: the manager over PgRepository, and raw sqlx), interleaved
# round by round, all reached the same way (TCP on 127.0.0.1).
#
#   bash bench/pg-limit.sh [--clients N] [--seconds S] [--rounds R]
#
# Needs PostgreSQL's server binaries (Debian's postgresql-15: initdb, pg_ctl,
# pgbench) and a `postgres` user to run them as; it installs nothing. The
# equivalent SQL, per execution:
#   fresh:     INSERT … ON CONFLICT DO NOTHING RETURNING, then the owner-checked
#              UPDATE to completed (two statements, like the library), whose
#              expiry is later than the reservation's, as the library's is;
#   duplicate: one SELECT of the record by key (what any design must read).
# "library" runs the reservation function; "plain" the statement the adaptive
# reserve plan sends alone once fresh keys (the INSERT) or duplicates (the
# deciding SELECT) dominate. The bench runs twice per round: with the default
# coalescing (the default, coalesce_above=2) and without (0).
# The table is the library's own (migrated), so indexes are alike.
set -euo pipefail

CLIENTS=16
SECONDS_PER=10
ROUNDS=2
while [ $# -gt 0 ]; do
    case "$1" in
        --clients) CLIENTS=$2; shift 2 ;;
        --seconds) SECONDS_PER=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done

PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
if [ -z "$PGBIN" ] || [ ! -x "$PGBIN/initdb" ] || ! command -v pgbench >/dev/null; then
    echo "pg-limit: needs PostgreSQL's server binaries and pgbench (Debian: postgresql-15)" >&2
    exit 1
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

echo "building the bench and the CLI (release)…"
(cd "$ROOT" && cargo build -q --release -p idempotency-bench -p idempotency-cli)
BENCH=$TARGET/release/idempotency-bench
CLI=$TARGET/release/idempotency

WORK=$(mktemp -d /tmp/pg-limit.XXXXXX)
chmod 755 "$WORK"
if [ "$(id -u)" = 0 ]; then chown postgres "$WORK"; fi
cleanup() {
    as_pg "$PGBIN/pg_ctl" -D "$WORK/data" stop -m immediate >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

OWNER="'\\x000102030405060708090a0b0c0d0e0f'"
NS="'\\x62656e6368'"
cat > "$WORK/fresh-simple.sql" <<EOF
\\set id random(1, 9000000000000000000)
INSERT INTO pglimit (namespace, id, status, owner, attempt, fingerprint, retryable, lease_until, expires_at, created_at, updated_at, purge_after) VALUES ($NS, int8send(:id), 'processing', $OWNER, 1, NULL, false, 2000000000000, 2000000600000, 1, 1, 2000000600000) ON CONFLICT DO NOTHING RETURNING attempt;
UPDATE pglimit SET status = 'completed', result = '\\x7b226f6b223a747275657d', expires_at = 2000000600002, updated_at = 2 WHERE namespace = $NS AND id = int8send(:id) AND owner = $OWNER AND status = 'processing';
EOF
cat > "$WORK/fresh-library.sql" <<EOF
\\set id random(1, 9000000000000000000)
SELECT * FROM pglimit_reserve($NS, int8send(:id), $OWNER, NULL, 1, 1, 2000000000000, 2000000600000, false);
UPDATE pglimit SET status = 'completed', result = '\\x7b226f6b223a747275657d', expires_at = 2000000600002, purge_after = LEAST(purge_after, 2000000600002), updated_at = 2 WHERE namespace = $NS AND id = int8send(:id) AND owner = $OWNER AND status = 'processing';
EOF
COLUMNS="t.status, t.owner, t.attempt, t.fingerprint, t.result, t.error, t.retryable, t.lease_until, t.expires_at, t.created_at, t.updated_at"
OTHER="'\\xffffffffffffffffffffffffffffffff'"
cat > "$WORK/fresh-plain.sql" <<EOF
\\set id random(1, 9000000000000000000)
INSERT INTO pglimit AS t (namespace, id, status, owner, attempt, fingerprint, result, error, retryable, lease_until, expires_at, created_at, updated_at, purge_after) VALUES ($NS, int8send(:id), 'processing', $OWNER, 1, NULL, NULL, NULL, false, 2000000000000, 2000000600000, 1, 1, 2000000600000) ON CONFLICT (namespace, id) DO NOTHING RETURNING true, $COLUMNS;
UPDATE pglimit SET status = 'completed', result = '\\x7b226f6b223a747275657d', expires_at = 2000000600002, purge_after = LEAST(purge_after, 2000000600002), updated_at = 2 WHERE namespace = $NS AND id = int8send(:id) AND owner = $OWNER AND status = 'processing';
EOF
cat > "$WORK/duplicate-plain.sql" <<EOF
\\set id random(1, 100000)
SELECT t.status = 'processing' AND t.owner = $OTHER, $COLUMNS FROM pglimit AS t WHERE t.namespace = $NS AND t.id = int8send(:id) AND t.expires_at > 1 AND ((t.status = 'processing' AND t.owner = $OTHER) OR (t.fingerprint IS NOT NULL AND NULL::bytea IS NOT NULL AND t.fingerprint <> NULL::bytea) OR NOT ((t.status = 'processing' AND t.lease_until <= 1) OR (t.status = 'failed' AND false AND t.retryable)));
EOF
cat > "$WORK/duplicate-simple.sql" <<EOF
\\set id random(1, 100000)
SELECT status, owner, attempt, fingerprint, result, error, retryable, lease_until, expires_at, created_at, updated_at FROM pglimit WHERE namespace = $NS AND id = int8send(:id);
EOF
cat > "$WORK/duplicate-library.sql" <<EOF
\\set id random(1, 100000)
SELECT * FROM pglimit_reserve($NS, int8send(:id), '\\xffffffffffffffffffffffffffffffff', NULL, 1, 1, 2000000000000, 2000000600000, false);
EOF
chmod 644 "$WORK"/*.sql

tps() { sed -n 's/^tps = \([0-9.]*\) .*/\1/p' | head -1 | cut -d. -f1; }
# Before every measured run: the background work the previous runs left
# (autovacuum of the rows they inserted, a checkpoint flushing their pages)
# done now, so that it lands on no run's clock. The bench does the same for its own
# table after populating each round's duplicates (Workload::settle).
settle() { psql -q "$1" -c "VACUUM ANALYZE pglimit" -c "CHECKPOINT" >/dev/null; }

for fsync in on off; do
    as_pg "$PGBIN/initdb" -D "$WORK/data" -U bench --auth=trust >/dev/null
    port=$((20000 + RANDOM % 20000))
    as_pg "$PGBIN/pg_ctl" -D "$WORK/data" -l "$WORK/log" -w start -o \
        "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$WORK \
         -c max_connections=300 -c fsync=$fsync -c shared_buffers=256MB" >/dev/null
    url="postgres://bench@127.0.0.1:$port/postgres"
    "$CLI" --url "$url?table=pglimit" migrate >/dev/null
    psql -q "$url" -c "INSERT INTO pglimit (namespace, id, status, owner, attempt, result, retryable, lease_until, expires_at, created_at, updated_at, purge_after) SELECT $NS, int8send(g), 'completed', $OWNER, 1, '\\x7b7d', false, 1, 4000000000000, 1, 1, 4000000000000 FROM generate_series(1, 100000) g" >/dev/null
    settings=$(psql -At "$url" -c "SELECT string_agg(name || '=' || setting, ', ' ORDER BY name) FROM pg_settings WHERE name IN ('fsync','synchronous_commit','full_page_writes','shared_buffers','wal_level','server_version')")
    echo
    echo "== fsync=$fsync: $settings; $CLIENTS clients, $SECONDS_PER s per pgbench run, $ROUNDS rounds"
    for round in $(seq 1 "$ROUNDS"); do
        for script in fresh-simple fresh-library fresh-plain duplicate-simple duplicate-library duplicate-plain; do
            settle "$url"
            t=$(pgbench -n -M prepared -c "$CLIENTS" -j 2 -T "$SECONDS_PER" -f "$WORK/$script.sql" "$url" 2>&1 | tps)
            echo "round $round  pgbench $script: $t executions/s"
        done
        for coalesce in 2 0; do
            out="$WORK/bench-$fsync-$round-$coalesce"
            settle "$url"
            "$BENCH" --backends postgres --postgres-url "$url?coalesce_above=$coalesce" \
                --postgres-pool 32 --scenarios fresh,duplicate --concurrency "$CLIENTS" \
                --rounds 4 --ops $((SECONDS_PER * 6000)) --out "$out" >/dev/null 2>&1
            grep -E '^\| postgres' "$out/results.md" |
                sed "s/^/round $round  bench, coalesce_above=$coalesce /" || true
        done
    done
    as_pg "$PGBIN/pg_ctl" -D "$WORK/data" stop -m fast >/dev/null
    rm -rf "$WORK/data" "$WORK/log"
done
