#!/usr/bin/env bash
# The one test command: lints, test servers, every test of the workspace (unit,
# integration, doc tests, the standalone examples/custom-backend crate), and a
# final `N passed, M failed` line. Exits non-zero on any failure.
#
# Test servers (see docs/testing.md):
#   - IDEMPOTENCY_TEST_{REDIS_URL,POSTGRES_URL,DYNAMODB_ENDPOINT} set: those servers are used.
#   - else, with a Docker engine: the official images (or IDEMPOTENCY_TEST_*_IMAGE) when
#     present or pullable; when a registry is unreachable, images are baked from Debian
#     packages (scripts/bake-images.sh) and IDEMPOTENCY_TEST_*_IMAGE point at them.
#   - idempotency-http's client tests (requests, Stripe's SDK) always run in the baked
#     python-clients image (no official one): baked here when missing.
#
# Environment:
#   CARGO_TARGET_DIR          build directory, reused between runs
#                             (default: $HOME/.cache/idempotency-rs/target)
#   CARGO_INCREMENTAL         0 unless set (see below)
#   SKIP_LINT=1               skip `cargo fmt --check` and clippy
#   IDEMPOTENCY_TEST_IMAGES   auto (default) | official (never bake) | baked (always baked images)
#   IDEMPOTENCY_TEST_LOG      where the full output goes (default: $CARGO_TARGET_DIR/idempotency-test.log)
#   IDEMPOTENCY_TEST_JOBS     test binaries run at once (default 4; see scripts/run-tests.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idempotency-rs/target}"
# A whole-workspace build gains nothing from incremental compilation but its
# disk (about 14 GB for every test binary's crates); set it to 1 to keep it.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
mkdir -p "$CARGO_TARGET_DIR"
LOG="${IDEMPOTENCY_TEST_LOG:-$CARGO_TARGET_DIR/idempotency-test.log}"
: >"$LOG"
IMAGES_MODE="${IDEMPOTENCY_TEST_IMAGES:-auto}"
# Labels every container the harness starts in this run (see conformance-tests/src/containers).
export IDEMPOTENCY_TEST_RUN_ID="test-sh-$$-$(date +%s)"

say() { printf '==> %s\n' "$*" | tee -a "$LOG" >&2; }

DOCKER_OK=0
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    DOCKER_OK=1
fi

# Removes what is left of this run's containers: the harness's exit watchdogs
# normally do it within seconds of each test binary's exit.
sweep_containers() {
    [ "$DOCKER_OK" = 1 ] || return 0
    local filter="label=org.idempotency-rs.run=$IDEMPOTENCY_TEST_RUN_ID" ids="" i
    for i in $(seq 1 30); do
        ids="$(docker ps -aq --filter "$filter" 2>/dev/null || true)"
        [ -n "$ids" ] || return 0
        sleep 1
    done
    say "removing containers the watchdogs left behind: $(echo $ids)"
    # shellcheck disable=SC2086
    docker rm -fv $ids >/dev/null 2>&1 || true
}
trap sweep_containers EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- lints (fast failure) ---------------------------------------------------
if [ "${SKIP_LINT:-0}" != 1 ]; then
    say "cargo fmt --check"
    cargo fmt --all --check 2>&1 | tee -a "$LOG"
    if [ -f examples/custom-backend/Cargo.toml ]; then
        cargo fmt --manifest-path examples/custom-backend/Cargo.toml --check 2>&1 | tee -a "$LOG"
    fi
    say "cargo clippy --workspace --all-targets --all-features -- -D warnings"
    cargo clippy --workspace --all-targets --all-features -- -D warnings 2>&1 | tee -a "$LOG"
    say "cargo doc --workspace --all-features --no-deps (warnings are errors)"
    RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps --quiet 2>&1 | tee -a "$LOG"
fi

# --- test servers -------------------------------------------------------------
# kind  image-variable  official-image  external-variable ("-": none; such a kind
# only comes from a local image, else is baked)
KINDS=(
    "redis IDEMPOTENCY_TEST_REDIS_IMAGE redis:7 IDEMPOTENCY_TEST_REDIS_URL"
    "postgres IDEMPOTENCY_TEST_POSTGRES_IMAGE postgres:16 IDEMPOTENCY_TEST_POSTGRES_URL"
    "dynamodb IDEMPOTENCY_TEST_DYNAMODB_IMAGE amazon/dynamodb-local:latest IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT"
    "mariadb IDEMPOTENCY_TEST_MARIADB_IMAGE mariadb:11 IDEMPOTENCY_TEST_MARIADB_URL"
    "sqs IDEMPOTENCY_TEST_SQS_IMAGE motoserver/moto:latest IDEMPOTENCY_TEST_SQS_ENDPOINT"
    "rabbitmq IDEMPOTENCY_TEST_RABBITMQ_IMAGE rabbitmq:3 IDEMPOTENCY_TEST_RABBITMQ_URL"
    # HTTP clients for idempotency-http's tests (requests, urllib3, Stripe's SDK): no
    # official image has them, so the baked one is the default.
    "python-clients IDEMPOTENCY_TEST_PYTHON_CLIENTS_IMAGE - -"
)

bake() {
    local runner=()
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || { say "baking images needs root (debootstrap, chroot) and there is no sudo"; exit 1; }
        runner=(sudo --preserve-env=http_proxy,https_proxy,PIP_INDEX_URL,PIP_CERT,TMPDIR)
    fi
    say "baking test images from Debian packages (scripts/bake-images.sh $*)"
    "${runner[@]+"${runner[@]}"}" bash scripts/bake-images.sh "$@" 2>&1 | tee -a "$LOG"
}

if [ "$DOCKER_OK" = 1 ]; then
    registry_reachable=""  # unknown until the first pull
    need_bake=()
    for entry in "${KINDS[@]}"; do
        read -r kind image_var official external_var <<<"$entry"
        if [ "$external_var" != - ] && [ -n "${!external_var:-}" ]; then
            say "$kind: using $external_var=${!external_var}"
            continue
        fi
        if [ "$official" = - ]; then
            image="${!image_var:-$(bash scripts/bake-images.sh --print-env | sed -n "s/^$image_var=//p")}"
            if [ "$IMAGES_MODE" != baked ] && docker image inspect "$image" >/dev/null 2>&1; then
                say "$kind: image $image is present"
                export "$image_var=$image"
            elif [ "$IMAGES_MODE" = official ]; then
                say "$kind: $image is not available and IDEMPOTENCY_TEST_IMAGES=official: its tests will fail"
            else
                need_bake+=("$kind $image_var")
            fi
            continue
        fi
        image="${!image_var:-$official}"
        if [ "$IMAGES_MODE" = baked ]; then
            need_bake+=("$kind $image_var")
            continue
        fi
        if docker image inspect "$image" >/dev/null 2>&1; then
            say "$kind: image $image is present"
            continue
        fi
        if [ "$registry_reachable" != no ]; then
            say "$kind: pulling $image"
            if timeout 120 docker pull --quiet "$image" >>"$LOG" 2>&1; then
                registry_reachable=yes
                continue
            fi
            # Tell "no registry" from "no such image" with the first failure only.
            [ "$registry_reachable" = yes ] || registry_reachable=no
        fi
        if [ "$IMAGES_MODE" = official ]; then
            say "$kind: $image is not available and IDEMPOTENCY_TEST_IMAGES=official: its tests will fail"
            continue
        fi
        need_bake+=("$kind $image_var")
    done
    if [ "${#need_bake[@]}" -gt 0 ]; then
        # Only the images missing (SQS runs in the DynamoDB image).
        bake_kinds=()
        for entry in "${need_bake[@]}"; do
            read -r kind _ <<<"$entry"
            [ "$kind" = sqs ] && kind=dynamodb
            case " ${bake_kinds[*]-} " in *" $kind "*) ;; *) bake_kinds+=("$kind") ;; esac
        done
        bake "${bake_kinds[@]}"
        baked_env="$(bash scripts/bake-images.sh --print-env)"
        for entry in "${need_bake[@]}"; do
            read -r kind image_var <<<"$entry"
            value="$(printf '%s\n' "$baked_env" | sed -n "s/^$image_var=//p")"
            export "$image_var=$value"
            say "$kind: using baked image $value"
        done
    fi
else
    say "no reachable Docker engine: backend tests fail unless IDEMPOTENCY_TEST_REDIS_URL, \
IDEMPOTENCY_TEST_POSTGRES_URL, IDEMPOTENCY_TEST_DYNAMODB_ENDPOINT, IDEMPOTENCY_TEST_MARIADB_URL and IDEMPOTENCY_TEST_RABBITMQ_URL name servers; \
idempotency-http's client tests (requests, Stripe's SDK) need Docker and fail"
fi

# --- tests ---------------------------------------------------------------------
status=0
failed_runs=0
run_tests() {
    say "$*"
    local rc=0
    "$@" 2>&1 | tee -a "$LOG" || rc=$?
    if [ "$rc" != 0 ]; then
        status=1
        failed_runs=$((failed_runs + 1))
    fi
    return 0
}

START=$SECONDS
# Every test binary of the workspace, the doc tests and examples/custom-backend's
# tests, built once and run side by side (scripts/run-tests.sh).
IDEMPOTENCY_TEST_LOG="$LOG" run_tests bash scripts/run-tests.sh
# The README's quickstart command must stay true: it exits non-zero unless every
# event's side effect was applied exactly once.
say "cargo run --example quickstart"
if ! cargo run --quiet --example quickstart 2>&1 | tee -a "$LOG"; then
    status=1
    failed_runs=$((failed_runs + 1))
    say "the quickstart failed"
fi
# The trait crate and the suite must work as ordinary dependencies outside this
# workspace: package both and build them from the packages alone, every feature on.
say "cargo package -p idempotency-core -p idempotency-conformance (built from the packages)"
# cargo treats a registry crate of a given name and version as immutable: it reuses
# the copy it unpacked and the artifacts it built from it before. The packages are
# rebuilt at every run under the same version, so both are removed first, and the
# build goes to a target directory of its own (its dependencies stay cached there).
cargo_home="${CARGO_HOME:-$HOME/.cargo}"
package_target="${CARGO_TARGET_DIR:-target}/package-check"
rm -rf "$cargo_home"/registry/src/*/idempotency-core-[0-9]* \
    "$cargo_home"/registry/src/*/idempotency-conformance-[0-9]* \
    "$package_target"/debug/.fingerprint/idempotency* \
    "$package_target"/debug/deps/*idempotency_co*
if ! cargo package -p idempotency-core -p idempotency-conformance --allow-dirty --all-features \
    --target-dir "$package_target" 2>&1 | tee -a "$LOG"; then
    status=1
    failed_runs=$((failed_runs + 1))
    say "packaging failed: a file the crates need is outside them, or a dependency has no version"
fi
sweep_containers

read -r passed failed ignored < <(
    grep -E '^test result: ' "$LOG" | awk '{
        for (i = 1; i <= NF; i++) {
            if ($(i + 1) ~ /^passed;?$/) p += $i
            if ($(i + 1) ~ /^failed;?$/) f += $i
            if ($(i + 1) ~ /^ignored;?$/) g += $i
        }
    } END { printf "%d %d %d\n", p, f, g }'
)
if [ "$passed" = 0 ]; then
    # A run that executed no test is a broken run, never a green one.
    say "no test passed: the test runner ran nothing (see $LOG)"
    status=1
fi
if [ "$status" != 0 ] && [ "$failed" = 0 ]; then
    # cargo failed without a failing test: a build error or a crashed test binary.
    say "cargo test failed $failed_runs time(s) without a failing test (build error? see $LOG)"
    failed=$failed_runs
fi
say "tests took $((SECONDS - START)) s; $ignored ignored; full output in $LOG"
echo "$passed passed, $failed failed"
[ "$status" = 0 ] && [ "$failed" = 0 ]
