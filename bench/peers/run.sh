#!/usr/bin/env bash
# Peer comparison: AWS Lambda Powertools for Python (Redis idempotency) vs idempotency-rs.
#
# Sets up a pinned virtualenv, benchmarks Powertools against a Redis server,
# writes <target>/bench/peers.json, then prints a side-by-side table with our
# results (<target>/bench/results.json) and writes <target>/bench/peers.md.
# <target> is $CARGO_TARGET_DIR if set, else <workspace>/target.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bench/peers/run.sh [options]

  --redis-url URL       Redis to benchmark against
                        (default: $IDEMPOTENCY_BENCH_REDIS_URL or redis://127.0.0.1:6379)
  --keys N              distinct keys per scenario (default: 20000, same as idempotency-bench)
  --warmup N            warm-up keys before measuring (default: min(2000, keys/10), at least 100)
  --expiry-seconds S    Powertools record expiry, keys vanish afterwards (default: 120)
  --decorator NAME      idempotent (Lambda handler, default) | idempotent_function
  --processes LIST      process counts to run, each calling sequentially (default 1,2)
  --ours PATH           our results (default: <target>/bench/results.json)
  --out PATH            peer results JSON (default: <target>/bench/peers.json)
  --md PATH             Markdown table (default: <target>/bench/peers.md)
  --venv DIR            virtualenv (default: $PEERS_VENV or ~/.cache/idempotency-rs/peers-venv)
  --python BIN          interpreter used to create the venv (default: $PYTHON or python3)
  -h, --help            this help

Environment: IDEMPOTENCY_BENCH_REDIS_URL, PEERS_VENV, PYTHON, CARGO_TARGET_DIR.
EOF
}

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORKSPACE_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"

if [[ -n "${CARGO_TARGET_DIR:-}" ]]; then
    TARGET_DIR="$(mkdir -p "$CARGO_TARGET_DIR" && cd "$CARGO_TARGET_DIR" && pwd)"
else
    TARGET_DIR="$WORKSPACE_ROOT/target"
fi

REDIS_URL="${IDEMPOTENCY_BENCH_REDIS_URL:-redis://127.0.0.1:6379}"
KEYS=20000
WARMUP=""
EXPIRY=120
DECORATOR="idempotent"
PROCESSES="1,2"
OURS="$TARGET_DIR/bench/results.json"
OUT="$TARGET_DIR/bench/peers.json"
MD="$TARGET_DIR/bench/peers.md"
VENV="${PEERS_VENV:-$HOME/.cache/idempotency-rs/peers-venv}"
PYTHON_BIN="${PYTHON:-python3}"

need_arg() {
    if [[ $# -lt 2 || -z "$2" ]]; then
        echo "error: $1 needs a value" >&2
        usage >&2
        exit 2
    fi
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --redis-url) need_arg "$@"; REDIS_URL="$2"; shift 2 ;;
        --keys) need_arg "$@"; KEYS="$2"; shift 2 ;;
        --warmup) need_arg "$@"; WARMUP="$2"; shift 2 ;;
        --expiry-seconds) need_arg "$@"; EXPIRY="$2"; shift 2 ;;
        --decorator) need_arg "$@"; DECORATOR="$2"; shift 2 ;;
        --processes) need_arg "$@"; PROCESSES="$2"; shift 2 ;;
        --ours) need_arg "$@"; OURS="$2"; shift 2 ;;
        --out) need_arg "$@"; OUT="$2"; shift 2 ;;
        --md) need_arg "$@"; MD="$2"; shift 2 ;;
        --venv) need_arg "$@"; VENV="$2"; shift 2 ;;
        --python) need_arg "$@"; PYTHON_BIN="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if ! [[ "$KEYS" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: --keys must be a positive integer (got '$KEYS')" >&2
    exit 2
fi

REQUIREMENTS="$SCRIPT_DIR/requirements.txt"

# --- virtualenv (created once, reused; reinstalled when requirements.txt changes) ---
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "==> creating virtualenv $VENV" >&2
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON_BIN" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    echo "error: virtualenv $VENV is broken (interpreter moved?); delete it and rerun" >&2
    exit 1
fi

STAMP="$VENV/.idempotency-rs-peers-requirements.sha256"
REQ_HASH="$( (sha256sum "$REQUIREMENTS"; "$VENV/bin/python" -VV) | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$REQ_HASH" ]]; then
    echo "==> installing pinned requirements into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REQUIREMENTS"
    echo "$REQ_HASH" > "$STAMP"
else
    echo "==> reusing virtualenv $VENV (requirements unchanged)" >&2
fi

# --- peer benchmark ---
BENCH_ARGS=(--redis-url "$REDIS_URL" --keys "$KEYS" --expiry-seconds "$EXPIRY"
            --decorator "$DECORATOR" --processes "$PROCESSES" --out "$OUT")
if [[ -n "$WARMUP" ]]; then
    BENCH_ARGS+=(--warmup "$WARMUP")
fi
echo "==> benchmarking AWS Lambda Powertools (Python) idempotency, $KEYS keys" >&2
"$VENV/bin/python" "$SCRIPT_DIR/powertools_bench.py" "${BENCH_ARGS[@]}"

# --- comparison (stdlib only; prints the peer numbers even without ours) ---
echo >&2
if [[ ! -f "$OURS" ]]; then
    echo "note: our results not found at $OURS; showing the peer numbers only." >&2
    echo "hint: produce them with:" >&2
    echo "  cargo run --release -p idempotency-bench -- --backends redis --redis-url $REDIS_URL" >&2
    echo >&2
fi
"$VENV/bin/python" "$SCRIPT_DIR/compare.py" --peers "$OUT" --ours "$OURS" --out "$MD" \
    --redis-url "$REDIS_URL" --no-hint
