#!/usr/bin/env bash
# Client instructions per Redis operation, library vs raw, with callgrind.
#
# Runs bench/examples/client_cost.rs under `valgrind --tool=callgrind` with N and
# 2N operations for each variant and scenario and prints (I(2N) - I(N)) / N: the
# instructions the client process spends per operation (the server is another
# process and is not counted). Deterministic for a given binary, unlike
# wall-clock ratios on a shared machine. Note that under valgrind SHA-256 runs
# in software (valgrind hides the SHA extensions), so the library's fingerprint
# counts ~3,500 instructions more than it costs natively.
#
# Usage: bench/client-cost.sh [REDIS_URL] [N]
#        (default: $IDEMPOTENCY_BENCH_REDIS_URL or redis://127.0.0.1:6379, N=1000)
set -euo pipefail

URL="${1:-${IDEMPOTENCY_BENCH_REDIS_URL:-redis://127.0.0.1:6379}}"
N="${2:-1000}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }

cd "$ROOT"
cargo build --release -q -p idempotency-bench --example client_cost
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/client_cost"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

instructions() {
    valgrind --tool=callgrind --callgrind-out-file="$OUT/cg" "$BIN" "$URL" "$1" "$2" "$3" 2>&1 \
        | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}

printf '%-10s %-8s %14s\n' scenario variant "instr/op"
for scenario in fresh duplicate; do
    for variant in library raw; do
        one="$(instructions "$variant" "$scenario" "$N")"
        two="$(instructions "$variant" "$scenario" "$((2 * N))")"
        printf '%-10s %-8s %14d\n' "$scenario" "$variant" "$(( (two - one) / N ))"
    done
done
