#!/usr/bin/env bash
# Runs every test of the workspace with the test binaries side by side: builds
# them once, then runs them (and the doc tests, and the standalone
# examples/custom-backend crate's tests) as parallel jobs, the longest first.
# Called by scripts/test.sh; usable alone (after the test servers' images
# exist, see docs/testing.md).
#
# Each binary still runs its own tests with libtest, sharing one server per
# kind per binary as the harness does; jobs only overlap binaries, whose
# tests mostly wait on servers and clocks rather than on the two cores.
#
# Environment:
#   CARGO_TARGET_DIR        build directory (as scripts/test.sh sets it)
#   IDEMPOTENCY_TEST_JOBS   binaries run at once (default 4)
#   IDEMPOTENCY_TEST_LOG    the combined output is appended here (required)
#
# Prints a line per job as it ends, the output of every failed job, and exits
# non-zero when any job failed or any build failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
: "${CARGO_TARGET_DIR:?set CARGO_TARGET_DIR}"
: "${IDEMPOTENCY_TEST_LOG:?set IDEMPOTENCY_TEST_LOG}"
JOBS="${IDEMPOTENCY_TEST_JOBS:-4}"
LOG="$IDEMPOTENCY_TEST_LOG"
WORK="$CARGO_TARGET_DIR/test-run"
# Seconds each job took last time, to start the longest first; a fresh build
# directory starts from the times committed beside this script.
DURATIONS="$CARGO_TARGET_DIR/test-durations.tsv"
SEED_DURATIONS="$ROOT/scripts/test-durations.tsv"
CUSTOM_TARGET="$CARGO_TARGET_DIR/custom-backend"
rm -rf "$WORK"
mkdir -p "$WORK/logs"
if [ ! -s "$DURATIONS" ] && [ -f "$SEED_DURATIONS" ]; then
    cp "$SEED_DURATIONS" "$DURATIONS"
fi
touch "$DURATIONS"

command -v jq >/dev/null || { echo "run-tests.sh needs jq (apt-get install jq)" >&2; exit 1; }

say() { printf '==> %s\n' "$*" | tee -a "$LOG" >&2; }

# Threads for the tests of one binary: libtest's default (the cores) unless the
# binary's tests mostly wait on servers, where more run at once.
threads_for() {
    case "$1" in
        idempotency-postgres/test/conformance | idempotency-redis/test/conformance) echo 4 ;;
        *) echo "" ;;
    esac
}

# Jobs that run alone, one after another, after the others: the reliability
# scenarios measure every call against the contract's time bounds under
# injected faults, and a machine loaded by other test binaries starves their
# stores' connections (calls that time out only because the cores are busy,
# recordings that miss their lease); the catalogue of broken backends has
# checks that count as far as a time budget allows (65,536 takeovers to see an
# attempt counter wrap), which a loaded machine does not reach.
exclusive() {
    case "$1" in
        idempotency-reliability/test/scenarios | idempotency-conformance/test/broken) return 0 ;;
        *) return 1 ;;
    esac
}

# Lists `key<TAB>executable<TAB>directory` of every test binary a
# `cargo test --no-run` (given its arguments) builds, and of the consumers'
# examples (each exits non-zero unless every order was charged once).
build_binaries() {
    local out="$1"
    shift
    # A package id is `path+file:///dir#name@version`, or `…/name#version`
    # when the directory is named after the package.
    cargo test "$@" --no-run --message-format=json-render-diagnostics \
        | jq -r 'def package: (.package_id | capture("#(?<n>[^@]+)@").n)
                              // (.package_id | capture("/(?<n>[^/#]+)#").n);
                 select(.reason == "compiler-artifact" and .executable != null
                        and (.profile.test or (.target.kind[0] == "example" and package == "idempotency-consumers")))
                 | [package + "/" + .target.kind[0] + "/" + .target.name,
                    .executable,
                    (.manifest_path | sub("/Cargo.toml$"; ""))]
                 | @tsv' >"$out"
}

status=0
say "building the test binaries (cargo test --workspace --all-features --no-run)"
if ! build_binaries "$WORK/workspace.tsv" --workspace --all-features 2>"$WORK/build.log"; then
    say "building the workspace's tests failed:"
    grep -E -A 12 '^error' "$WORK/build.log" | head -n 80 | sed 's/^/    /'
    status=1
fi
cat "$WORK/build.log" >>"$LOG"
if [ -f examples/custom-backend/Cargo.toml ]; then
    say "building examples/custom-backend's tests"
    if ! build_binaries "$WORK/custom.tsv" --manifest-path examples/custom-backend/Cargo.toml \
        --target-dir "$CUSTOM_TARGET" 2>>"$LOG"; then
        say "building examples/custom-backend's tests failed (see $LOG)"
        status=1
    fi
fi

# The job list: key, then the command (run from the directory given).
: >"$WORK/jobs.tsv"
cat "$WORK"/workspace.tsv "$WORK"/custom.tsv 2>/dev/null | sort -u -k1,1 | while IFS=$'\t' read -r key exe dir; do
    printf '%s\t%s\t%s\n' "$key" "$dir" "$exe" >>"$WORK/jobs.tsv"
done
printf '%s\t%s\t%s\n' "doc-tests" "$ROOT" "cargo test --workspace --all-features --doc" >>"$WORK/jobs.tsv"
if [ -f examples/custom-backend/Cargo.toml ]; then
    printf '%s\t%s\t%s\n' "custom-backend/doc-tests" "$ROOT" \
        "cargo test --manifest-path examples/custom-backend/Cargo.toml --target-dir $CUSTOM_TARGET --doc" >>"$WORK/jobs.tsv"
fi

# Longest first (by last run's time; unknown jobs count as long).
awk -F'\t' 'FILENAME == ARGV[1] { t[$1] = $2; next } { print (($1 in t) ? t[$1] : 600) "\t" $0 }' \
    "$DURATIONS" "$WORK/jobs.tsv" | sort -t$'\t' -k1,1nr | cut -f2- >"$WORK/order.tsv"
if [ ! -s "$WORK/order.tsv" ]; then
    say "no test job to run: the build listed no test binary"
    exit 1
fi

run_job() {
    local key="$1" dir="$2" cmd="$3" safe threads started rc
    safe="${key//\//__}"
    threads="$(threads_for "$key")"
    started=$SECONDS
    (
        cd "$dir" || exit 1
        if [ -n "$threads" ]; then export RUST_TEST_THREADS="$threads"; fi
        # shellcheck disable=SC2086
        exec $cmd </dev/null
    ) >"$WORK/logs/$safe.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$key" "$rc" "$((SECONDS - started))" >"$WORK/logs/$safe.status"
}

say "running $(wc -l <"$WORK/order.tsv") test jobs, $JOBS at a time (then the ones that run alone)"
running=0
while IFS=$'\t' read -r key dir cmd; do
    exclusive "$key" && continue
    if [ "$running" -ge "$JOBS" ]; then
        wait -n
        running=$((running - 1))
    fi
    run_job "$key" "$dir" "$cmd" &
    running=$((running + 1))
done <"$WORK/order.tsv"
wait
while IFS=$'\t' read -r key dir cmd; do
    if exclusive "$key"; then
        run_job "$key" "$dir" "$cmd"
    fi
done <"$WORK/order.tsv"

# Report, record the durations, and append every log to the combined one.
: >"$WORK/durations.tsv"
while IFS=$'\t' read -r key _ _; do
    safe="${key//\//__}"
    IFS=$'\t' read -r _ rc secs <"$WORK/logs/$safe.status"
    printf '%s\t%s\n' "$key" "$secs" >>"$WORK/durations.tsv"
    {
        printf '\n==> %s (exit %s, %s s)\n' "$key" "$rc" "$secs"
        cat "$WORK/logs/$safe.log"
    } >>"$LOG"
    summary="$(grep -E '^test result: ' "$WORK/logs/$safe.log" | tail -n 1 | sed 's/; finished.*//')"
    if [ "$rc" = 0 ]; then
        printf 'ok    %4s s  %s  %s\n' "$secs" "$key" "$summary"
    else
        status=1
        printf 'FAIL  %4s s  %s  %s\n' "$secs" "$key" "$summary"
        # The failures, without backtraces and the panics a suite provokes.
        grep -E -A 6 -- '^---- |panicked at|^error' "$WORK/logs/$safe.log" |
            grep -v -E -e '\(expected by the conformance suite\)|^ *[0-9]+: |^ +at |^stack backtrace:' \
                -e '^note: Some details|^--$|^$|panicked at conformance-tests/src/checks.rs:1958' |
            head -n 60 | sed 's/^/    /'
    fi
done <"$WORK/order.tsv"
mv "$WORK/durations.tsv" "$DURATIONS"
exit "$status"
