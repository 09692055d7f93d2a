#!/usr/bin/env bash
# Bakes the test-server images locally, from Debian packages, for machines that
# have a Docker engine but no reachable image registry.
#
#   scripts/bake-images.sh            # bake what is missing or outdated
#   scripts/bake-images.sh --print-env  # only print the IDEMPOTENCY_TEST_*_IMAGE lines
#   scripts/bake-images.sh --force    # rebuild even when up to date
#   scripts/bake-images.sh [--force] KIND...  # only these images, e.g. `python-clients`
#                                     # (the root then holds only their packages: faster)
#
# Produces (TAG = the Debian suite, `bookworm` by default) six images that
# share one layer — a debootstrapped root holding all five servers and the
# clients, imported once — each with its own command, user and port:
#   idempotency-test/redis:TAG     redis-server on 6379  (drop-in for `redis`)
#   idempotency-test/postgres:TAG  PostgreSQL on 5432    (drop-in for `postgres`: same env vars)
#   idempotency-test/dynamodb:TAG  moto's DynamoDB API on 8000 (drop-in for `amazon/dynamodb-local`)
#   idempotency-test/mariadb:TAG   MariaDB on 3306       (drop-in for `mariadb`: same env vars)
#   idempotency-test/rabbitmq:TAG  RabbitMQ (AMQP 0-9-1) on 5672, guest/guest from anywhere
#                                  (drop-in for `rabbitmq:3`)
#   idempotency-test/python-clients:TAG  HTTP client libraries nobody on this project wrote,
#                                  for idempotency-http's tests: Debian's python3,
#                                  python3-requests (with its urllib3) and the Stripe
#                                  Python SDK (pip, pinned) in /opt/clients (entrypoint:
#                                  its python3; no server, no port)
#
# The packages come from the mirror the host's apt already uses (asked from
# `apt-get indextargets`, so sources.list, deb822 .sources files and proxies are
# honoured); nothing here names a mirror. Every image carries the label
# org.idempotency-rs.recipe=<hash of this script + suite>; an image with the
# current hash is never rebuilt. The temporary root and its /proc mount are
# removed on every exit path, including Ctrl-C and SIGTERM.
#
# Environment:
#   IDEMPOTENCY_BAKE_PREFIX   image name prefix            (default: idempotency-test)
#   IDEMPOTENCY_BAKE_SUITE    Debian suite to bootstrap    (default: the host's codename, else bookworm)
#   IDEMPOTENCY_BAKE_MOTO     pip requirement for moto     (default: moto[server])
#   IDEMPOTENCY_BAKE_STRIPE   pip requirement for the Stripe SDK (default: stripe==16.1.0)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST
#                             pip's index; unset, the host's pip configuration
#                             (`pip config get global.index-url`, …) is used when it has one
#   TMPDIR                    where the temporary root goes (default: /var/tmp)
set -euo pipefail

readonly SCRIPT_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
readonly PREFIX="${IDEMPOTENCY_BAKE_PREFIX:-idempotency-test}"
readonly MOTO_REQUIREMENT="${IDEMPOTENCY_BAKE_MOTO:-moto[server]}"
readonly STRIPE_REQUIREMENT="${IDEMPOTENCY_BAKE_STRIPE:-stripe==16.1.0}"
readonly LABEL_KEY="org.idempotency-rs.recipe"

host_codename() {
    local id="" codename=""
    if [ -r /etc/os-release ]; then
        id="$(. /etc/os-release && echo "${ID:-}")"
        codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    fi
    if [ "$id" = debian ] && [ -n "$codename" ]; then echo "$codename"; else echo bookworm; fi
}
readonly SUITE="${IDEMPOTENCY_BAKE_SUITE:-$(host_codename)}"
readonly TAG="$SUITE"
readonly RECIPE="$({ cat "$SCRIPT_PATH"; echo "suite=$SUITE moto=$MOTO_REQUIREMENT stripe=$STRIPE_REQUIREMENT"; } | sha256sum | cut -c1-16)"

readonly REDIS_IMAGE="$PREFIX/redis:$TAG"
readonly POSTGRES_IMAGE="$PREFIX/postgres:$TAG"
readonly DYNAMODB_IMAGE="$PREFIX/dynamodb:$TAG"
readonly MARIADB_IMAGE="$PREFIX/mariadb:$TAG"
readonly RABBITMQ_IMAGE="$PREFIX/rabbitmq:$TAG"
readonly PYTHON_CLIENTS_IMAGE="$PREFIX/python-clients:$TAG"
readonly ALL_KINDS=(redis postgres dynamodb mariadb rabbitmq python-clients)

log() { printf '[bake %3ds] %s\n' "$SECONDS" "$*" >&2; }
die() { printf '[bake] error: %s\n' "$*" >&2; exit 1; }

print_env() {
    echo "IDEMPOTENCY_TEST_REDIS_IMAGE=$REDIS_IMAGE"
    echo "IDEMPOTENCY_TEST_POSTGRES_IMAGE=$POSTGRES_IMAGE"
    echo "IDEMPOTENCY_TEST_DYNAMODB_IMAGE=$DYNAMODB_IMAGE"
    echo "IDEMPOTENCY_TEST_MARIADB_IMAGE=$MARIADB_IMAGE"
    # SQS: the same moto image, started with moto's threaded server by the harness.
    echo "IDEMPOTENCY_TEST_SQS_IMAGE=$DYNAMODB_IMAGE"
    echo "IDEMPOTENCY_TEST_RABBITMQ_IMAGE=$RABBITMQ_IMAGE"
    echo "IDEMPOTENCY_TEST_PYTHON_CLIENTS_IMAGE=$PYTHON_CLIENTS_IMAGE"
}

image_of() {
    case "$1" in
        redis) echo "$REDIS_IMAGE" ;;
        postgres) echo "$POSTGRES_IMAGE" ;;
        dynamodb) echo "$DYNAMODB_IMAGE" ;;
        mariadb) echo "$MARIADB_IMAGE" ;;
        rabbitmq) echo "$RABBITMQ_IMAGE" ;;
        python-clients) echo "$PYTHON_CLIENTS_IMAGE" ;;
        *) return 1 ;;
    esac
}

FORCE=0
KINDS=()
for arg in "$@"; do
    case "$arg" in
        --print-env) print_env; exit 0 ;;
        --force) FORCE=1 ;;
        -h | --help) sed -n '2,41p' "$SCRIPT_PATH"; exit 0 ;;
        -*) die "unknown argument: $arg (try --help)" ;;
        *)
            image_of "$arg" >/dev/null || die "unknown image kind: $arg (one of: ${ALL_KINDS[*]})"
            KINDS+=("$arg")
            ;;
    esac
done
if [ "${#KINDS[@]}" = 0 ]; then KINDS=("${ALL_KINDS[@]}"); fi
readonly KINDS
# wants KIND: whether this run bakes that image.
wants() { case " ${KINDS[*]} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

command -v docker >/dev/null || die "the docker CLI is required"
docker info >/dev/null 2>&1 || die "cannot reach the Docker engine (is it running, may this user use it?)"

image_recipe() { docker image inspect --format "{{ index .Config.Labels \"$LABEL_KEY\" }}" "$1" 2>/dev/null || true; }
is_current() { [ "$FORCE" = 0 ] && [ "$(image_recipe "$1")" = "$RECIPE" ]; }

IMAGES=()
for kind in "${KINDS[@]}"; do IMAGES+=("$(image_of "$kind")"); done
all_current=1
for image in "${IMAGES[@]}"; do is_current "$image" || all_current=0; done
if [ "$all_current" = 1 ]; then
    log "images are up to date (recipe $RECIPE): ${IMAGES[*]}"
    exit 0
fi

START_SECONDS=$SECONDS
WORK=""
ROOTFS=""
CHILD=""

# Runs a long step in its own process group and waits for it interruptibly, so
# that a signal reaches the trap at once and the trap can stop the whole step.
run() {
    setsid "$@" &
    CHILD=$!
    local status=0
    wait "$CHILD" || status=$?
    CHILD=""
    return "$status"
}

# Unmounts everything below the temporary root (deepest first), then deletes it.
# Never deletes while something is still mounted there.
cleanup() {
    local status=$?
    trap - EXIT INT TERM HUP
    if [ -n "$CHILD" ]; then
        kill -TERM -- "-$CHILD" 2>/dev/null || true
        wait "$CHILD" 2>/dev/null || true
    fi
    if [ -n "$ROOTFS" ] && [ -d "$ROOTFS" ]; then
        local mounts
        mounts="$(awk -v root="$ROOTFS" '$2 == root || index($2, root "/") == 1 { print $2 }' /proc/self/mounts | sort -r)"
        if [ -n "$mounts" ]; then
            while IFS= read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done <<<"$mounts"
        fi
    fi
    if [ -n "$WORK" ] && [ -d "$WORK" ]; then
        if awk -v root="$WORK" 'index($2, root "/") == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
            log "warning: something is still mounted below $WORK; not deleting it"
        else
            rm -rf --one-file-system "$WORK"
            log "removed $WORK"
        fi
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Mirror URIs of the host's apt configuration for a given release, as apt itself sees them.
repo_uri_for() {
    apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 'Identifier: Packages' 2>/dev/null |
        awk -v want="$1" '$1 == want { print $2; exit }'
}

# A setting of the host's pip configuration (`index-url`, …) from its global or
# install section, empty when pip or the setting is missing.
host_pip_config() {
    local pip section
    for pip in pip3 pip; do
        command -v "$pip" >/dev/null || continue
        for section in global install; do
            "$pip" config get "$section.$1" 2>/dev/null && return 0
        done
        return 0
    done
}

# Users, data directories and configuration of the servers baked in this run.
prepare_servers() {
    if wants postgres; then
        local pg_bin
        pg_bin="$(cd "$ROOTFS" && ls -d usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
        [ -n "$pg_bin" ] || die "no PostgreSQL server binaries found in the root"
        ln -sfn "/$pg_bin" "$ROOTFS/usr/local/lib/postgresql-bin"
        mkdir -p "$ROOTFS/var/lib/postgresql/data" "$ROOTFS/run/postgresql"
        in_root chown postgres:postgres /var/lib/postgresql/data /run/postgresql
        chmod 700 "$ROOTFS/var/lib/postgresql/data"
        chmod 2775 "$ROOTFS/run/postgresql"
    fi
    if wants dynamodb; then
        in_root useradd --system --home-dir /nonexistent --shell /usr/sbin/nologin dynamodb
    fi
    if wants redis; then
        mkdir -p "$ROOTFS/data"
        in_root chown redis:redis /data
    fi
    if wants mariadb; then
        # Like PostgreSQL's, MariaDB's data directory is initialised at first start
        # (the package's post-install may have made one with socket-only root access).
        rm -rf "$ROOTFS/var/lib/mysql"
        mkdir -p "$ROOTFS/var/lib/mysql" "$ROOTFS/run/mysqld"
        in_root chown mysql:mysql /var/lib/mysql /run/mysqld
    fi
    if wants rabbitmq; then
        # RabbitMQ's node state is made at first start (the package never started it).
        rm -rf "$ROOTFS/var/lib/rabbitmq/mnesia" "$ROOTFS/var/lib/rabbitmq/.erlang.cookie"
        mkdir -p "$ROOTFS/var/lib/rabbitmq" "$ROOTFS/var/log/rabbitmq" "$ROOTFS/etc/rabbitmq"
        in_root chown rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq
        printf '%s\n' 'loopback_users = none' 'listeners.tcp.default = 5672' >"$ROOTFS/etc/rabbitmq/rabbitmq.conf"
    fi
}

bake_root() {
    [ "$(id -u)" = 0 ] || die "baking runs debootstrap and chroot: run this script as root"
    command -v apt-get >/dev/null || die "apt-get is required (the packages come from the host's apt sources)"
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >/dev/null
    fi

    local mirror security updates
    mirror="$(repo_uri_for "$SUITE")"
    [ -n "$mirror" ] || die "no apt source of the host serves suite '$SUITE' (checked with apt-get indextargets; run apt-get update?)"
    security="$(repo_uri_for "$SUITE-security")"
    updates="$(repo_uri_for "$SUITE-updates")"
    log "suite $SUITE from $mirror${security:+ (+ $security $SUITE-security)}"

    # Proxy settings of the host's apt, for debootstrap (wget), apt in the chroot and pip.
    local APT_HTTP_PROXY="" APT_HTTPS_PROXY=""
    eval "$(apt-config shell APT_HTTP_PROXY Acquire::http::Proxy APT_HTTPS_PROXY Acquire::https::Proxy)"
    if [ -n "$APT_HTTP_PROXY" ] && [ -z "${http_proxy:-}" ]; then export http_proxy="$APT_HTTP_PROXY"; fi
    if [ -n "$APT_HTTPS_PROXY" ] && [ -z "${https_proxy:-}" ]; then export https_proxy="$APT_HTTPS_PROXY"; fi

    WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/idempotency-bake.XXXXXX")"
    ROOTFS="$WORK/rootfs"
    mkdir -p "$ROOTFS"

    log "debootstrap (minbase) into $ROOTFS"
    # First stage only unpacks; dpkg may then skip fsync in the second stage.
    run debootstrap --foreign --variant=minbase --arch="$(dpkg --print-architecture)" \
        "$SUITE" "$ROOTFS" "$mirror" >"$WORK/debootstrap.log" 2>&1 ||
        { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap (first stage) failed"; }
    mkdir -p "$ROOTFS/etc/dpkg/dpkg.cfg.d"
    cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/idempotency-bake" <<'EOF'
force-unsafe-io
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
EOF
    run chroot "$ROOTFS" /debootstrap/debootstrap --second-stage >>"$WORK/debootstrap.log" 2>&1 ||
        { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap (second stage) failed"; }

    mount -t proc proc "$ROOTFS/proc"
    cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
    printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
    chmod 755 "$ROOTFS/usr/sbin/policy-rc.d"
    {
        echo "deb $mirror $SUITE main"
        if [ -n "$updates" ]; then echo "deb $updates $SUITE-updates main"; fi
        if [ -n "$security" ]; then echo "deb $security $SUITE-security main"; fi
    } >"$ROOTFS/etc/apt/sources.list"
    {
        if [ -n "${http_proxy:-}" ]; then echo "Acquire::http::Proxy \"$http_proxy\";"; fi
        if [ -n "${https_proxy:-}" ]; then echo "Acquire::https::Proxy \"$https_proxy\";"; fi
        echo 'APT::Install-Recommends "false";'
        echo 'Acquire::Languages "none";'
    } >"$ROOTFS/etc/apt/apt.conf.d/90idempotency-bake"
    # The images initialise their own data directory at first start, like the official one.
    mkdir -p "$ROOTFS/etc/postgresql-common"
    echo "create_main_cluster = false" >"$ROOTFS/etc/postgresql-common/createcluster.conf"

    # The host's TLS trust (e.g. a company proxy's CA) is lent to apt and pip for the
    # bake only; it does not stay in the image.
    local host_ca="" ca
    for ca in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
        if [ -n "$ca" ] && [ -f "$ca" ]; then host_ca="$ca"; break; fi
    done
    local pip_env=()
    if [ -n "$host_ca" ]; then
        cp "$host_ca" "$ROOTFS/tmp/idempotency-bake-ca.pem"
        pip_env+=(PIP_CERT=/tmp/idempotency-bake-ca.pem)
        echo 'Acquire::https::CaInfo "/tmp/idempotency-bake-ca.pem";' >>"$ROOTFS/etc/apt/apt.conf.d/90idempotency-bake"
    fi
    local var setting value
    for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_DEFAULT_TIMEOUT; do
        value="${!var:-}"
        if [ -z "$value" ]; then
            # PIP_INDEX_URL -> index-url, as `pip config` names it.
            setting="$(echo "${var#PIP_}" | tr 'A-Z_' 'a-z-')"
            value="$(host_pip_config "$setting")"
        fi
        if [ -n "$value" ]; then pip_env+=("$var=$value"); fi
    done

    in_root() { run chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 \
        ${http_proxy:+http_proxy="$http_proxy"} ${https_proxy:+https_proxy="$https_proxy"} "$@"; }
    # pip_install VENV REQUIREMENT...
    pip_install() {
        local venv="$1"
        shift
        in_root /usr/bin/env "${pip_env[@]+"${pip_env[@]}"}" "$venv/bin/pip" install --quiet --no-cache-dir \
            --disable-pip-version-check "$@" >>"$WORK/pip.log" 2>&1 || { tail -n 30 "$WORK/pip.log" >&2; die "pip install $* failed"; }
    }

    local packages=()
    wants redis && packages+=(redis-server)
    wants postgres && packages+=(postgresql)
    wants mariadb && packages+=(mariadb-server)
    wants rabbitmq && packages+=(rabbitmq-server)
    if wants dynamodb || wants python-clients; then packages+=(python3-venv); fi
    wants python-clients && packages+=(python3-requests)
    log "apt-get install ${packages[*]}"
    in_root apt-get update -qq >"$WORK/apt.log" 2>&1 || { tail -n 30 "$WORK/apt.log" >&2; die "apt-get update failed"; }
    in_root apt-get install -y -qq "${packages[@]}" >>"$WORK/apt.log" 2>&1 ||
        { tail -n 30 "$WORK/apt.log" >&2; die "apt-get install failed"; }

    if wants dynamodb; then
        log "python venv with $MOTO_REQUIREMENT"
        in_root python3 -m venv /opt/moto
        pip_install /opt/moto "$MOTO_REQUIREMENT"
    fi
    if wants python-clients; then
        # Debian's requests and urllib3 (system site packages); only the SDK,
        # and what it needs beyond Debian's packages, from PyPI.
        log "python venv with Debian's python3-requests and $STRIPE_REQUIREMENT"
        in_root python3 -m venv --system-site-packages /opt/clients
        pip_install /opt/clients "$STRIPE_REQUIREMENT"
        in_root /opt/clients/bin/python3 -c 'import requests, stripe, sys; sys.exit(not requests.__file__.startswith("/usr/lib/python3/dist-packages/"))' ||
            die "the Stripe SDK did not take Debian's python3-requests"
    fi

    install_entrypoints "$ROOTFS"
    prepare_servers
    in_root apt-get clean
    umount "$ROOTFS/proc"
    rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/log/*.log \
        "$ROOTFS"/root/.cache "$ROOTFS"/tmp/* "$ROOTFS/debootstrap" \
        "$ROOTFS/etc/apt/apt.conf.d/90idempotency-bake"
    : >"$ROOTFS/etc/resolv.conf"
    echo 'APT::Install-Recommends "false";' >"$ROOTFS/etc/apt/apt.conf.d/90no-recommends"

}

root_tar() { tar --numeric-owner -C "$ROOTFS" -c .; }

# The root is imported once; each image is then that same layer with its own
# configuration (command, user, port, environment). Importing the root three
# times would make Docker unpack and discard 700 MB twice, so the images are
# made with `docker load` of a tar holding only an image config and a manifest:
# Docker skips layers it already has. Should an engine refuse that (e.g. one
# with the containerd image store), each image is imported on its own instead.
LAYER=""
ARCH=""
import_root() {
    log "importing the root"
    local id
    id="$(root_tar | docker import --change "LABEL $LABEL_KEY=$RECIPE" -)"
    LAYER="$(docker image inspect --format '{{index .RootFS.Layers 0}}' "$id")"
    ARCH="$(docker image inspect --format '{{.Architecture}}' "$id")"
    ROOT_IMAGE_ID="$id"
}

# make_image NAME USER WORKDIR PORT|"" ENTRYPOINT-JSON CMD-JSON|null [ENV=VALUE...]
make_image() {
    local name="$1" user="$2" workdir="$3" port="$4" entrypoint="$5" cmd="$6"
    shift 6
    local envs=("$@")
    case " $* " in
        *" PATH="*) ;;
        *) envs=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$@") ;;
    esac
    local env_json="" ports_json="" e now dir
    if [ -n "$port" ]; then ports_json="\"$port/tcp\":{}"; fi
    for e in "${envs[@]}"; do env_json+="${env_json:+,}\"$e\""; done
    now="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    dir="$WORK/image-${name//[^a-z0-9]/-}"
    mkdir -p "$dir"
    printf '{"architecture":"%s","os":"linux","created":"%s","config":{"User":"%s","WorkingDir":"%s","ExposedPorts":{%s},"Env":[%s],"Entrypoint":%s,"Cmd":%s,"Labels":{"%s":"%s"}},"rootfs":{"type":"layers","diff_ids":["%s"]},"history":[{"created":"%s","created_by":"scripts/bake-images.sh"}]}' \
        "$ARCH" "$now" "$user" "$workdir" "$ports_json" "$env_json" "$entrypoint" "$cmd" "$LABEL_KEY" "$RECIPE" "$LAYER" "$now" \
        >"$dir/config.json"
    printf '[{"Config":"config.json","RepoTags":["%s"],"Layers":["root.tar"]}]' "$name" >"$dir/manifest.json"
    if tar -C "$dir" -c manifest.json config.json | docker load >/dev/null 2>"$dir/load.log"; then
        log "tagged $name"
        return 0
    fi
    log "docker load refused a config-only image ($(head -c 200 "$dir/load.log")); importing $name"
    local changes=(--change "LABEL $LABEL_KEY=$RECIPE" --change "USER $user" --change "WORKDIR $workdir"
        --change "ENTRYPOINT $entrypoint")
    if [ -n "$port" ]; then changes+=(--change "EXPOSE $port"); fi
    if [ "$cmd" != null ]; then changes+=(--change "CMD $cmd"); fi
    for e in "${envs[@]}"; do changes+=(--change "ENV $e"); done
    root_tar | docker import "${changes[@]}" - "$name" >/dev/null
}

install_entrypoints() {
    local root="$1"
    mkdir -p "$root/usr/local/bin" "$root/usr/local/lib"

    # Same conventions as the official redis image: bare options go to redis-server,
    # and protected mode is off (clients reach the server through Docker's port mapping).
    cat >"$root/usr/local/bin/idem-redis-entrypoint" <<'EOF'
#!/bin/sh
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
    set -- redis-server "$@"
fi
if [ "$1" = redis-server ]; then
    shift
    if [ "${1%.conf}" != "${1:-}" ] && [ -n "${1:-}" ]; then
        conf="$1"; shift
        set -- redis-server "$conf" --protected-mode no "$@"
    else
        set -- redis-server --protected-mode no "$@"
    fi
fi
exec "$@"
EOF

    # Same environment as the official postgres image: POSTGRES_PASSWORD,
    # POSTGRES_USER, POSTGRES_DB, POSTGRES_HOST_AUTH_METHOD, PGDATA; extra
    # arguments (e.g. `-c fsync=off`) go to the server.
    cat >"$root/usr/local/bin/idem-postgres-entrypoint" <<'EOF'
#!/bin/sh
set -eu
if [ "${1#-}" != "$1" ]; then
    set -- postgres "$@"
fi
if [ "$1" = postgres ]; then
    shift
    : "${PGDATA:=/var/lib/postgresql/data}"
    if [ ! -s "$PGDATA/PG_VERSION" ]; then
        user="${POSTGRES_USER:-postgres}"
        password="${POSTGRES_PASSWORD:-}"
        method="${POSTGRES_HOST_AUTH_METHOD:-}"
        if [ -z "$method" ]; then
            if [ -z "$password" ]; then
                echo "error: database is uninitialized and POSTGRES_PASSWORD is not set;" >&2
                echo "       set POSTGRES_PASSWORD, or POSTGRES_HOST_AUTH_METHOD=trust" >&2
                exit 1
            fi
            method=scram-sha-256
        fi
        mkdir -p "$PGDATA"
        chmod 700 "$PGDATA"
        if [ -n "$password" ]; then
            pwfile="$(mktemp)"
            printf '%s\n' "$password" >"$pwfile"
            initdb -D "$PGDATA" --username="$user" --pwfile="$pwfile" --encoding=UTF8 \
                --locale=C.UTF-8 --auth-local=trust --auth-host="$method" --no-sync >/dev/null
            rm -f "$pwfile"
        else
            initdb -D "$PGDATA" --username="$user" --encoding=UTF8 \
                --locale=C.UTF-8 --auth-local=trust --auth-host="$method" --no-sync >/dev/null
        fi
        printf 'host all all all %s\n' "$method" >>"$PGDATA/pg_hba.conf"
        printf "listen_addresses = '*'\n" >>"$PGDATA/postgresql.conf"
        db="${POSTGRES_DB:-$user}"
        if [ "$db" != postgres ]; then
            echo "CREATE DATABASE \"$db\";" | postgres --single -D "$PGDATA" -j postgres >/dev/null
        fi
        echo "PostgreSQL init process complete; ready for start up."
    fi
    # `docker stop` sends SIGTERM (an import cannot set STOPSIGNAL); turn it into
    # SIGINT, PostgreSQL's fast shutdown, like the official image's STOPSIGNAL.
    postgres "$@" &
    pid=$!
    trap 'kill -INT "$pid" 2>/dev/null || true' TERM INT
    status=0
    while :; do
        wait "$pid" && status=0 || status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    exit "$status"
fi
exec "$@"
EOF

    # Same environment as the official mariadb image: MARIADB_ROOT_PASSWORD (or
    # MYSQL_ROOT_PASSWORD), MARIADB_ALLOW_EMPTY_ROOT_PASSWORD, MARIADB_DATABASE
    # (or MYSQL_DATABASE); extra arguments (e.g. `--innodb-flush-log-at-trx-commit=0`)
    # go to the server. Root may connect from anywhere, as in the official image.
    cat >"$root/usr/local/bin/idem-mariadb-entrypoint" <<'EOF'
#!/bin/sh
set -eu
if [ "${1#-}" != "$1" ]; then
    set -- mariadbd "$@"
fi
if [ "$1" = mariadbd ] || [ "$1" = mysqld ]; then
    shift
    datadir=/var/lib/mysql
    if [ ! -d "$datadir/mysql" ]; then
        password="${MARIADB_ROOT_PASSWORD:-${MYSQL_ROOT_PASSWORD:-}}"
        database="${MARIADB_DATABASE:-${MYSQL_DATABASE:-}}"
        if [ -z "$password" ] && [ -z "${MARIADB_ALLOW_EMPTY_ROOT_PASSWORD:-}" ]; then
            echo "error: database is uninitialized and MARIADB_ROOT_PASSWORD is not set;" >&2
            echo "       set MARIADB_ROOT_PASSWORD, or MARIADB_ALLOW_EMPTY_ROOT_PASSWORD=1" >&2
            exit 1
        fi
        mariadb-install-db --datadir="$datadir" --auth-root-authentication-method=normal \
            --skip-test-db --skip-name-resolve >/dev/null
        # SQL string literal: backslashes and quotes escaped.
        literal="$(printf '%s' "$password" | sed -e 's/\\/\\\\/g' -e "s/'/\\\\'/g")"
        {
            # Only root@localhost and root@% remain (the install also makes
            # password-less root@127.0.0.1, ::1 and the host name, which would
            # match before root@%).
            echo "DELETE FROM mysql.global_priv WHERE user = '' OR (user = 'root' AND host <> 'localhost');"
            echo "FLUSH PRIVILEGES;"
            echo "ALTER USER 'root'@'localhost' IDENTIFIED BY '$literal';"
            echo "CREATE USER 'root'@'%' IDENTIFIED BY '$literal';"
            echo "GRANT ALL ON *.* TO 'root'@'%' WITH GRANT OPTION;"
            if [ -n "$database" ]; then echo "CREATE DATABASE IF NOT EXISTS \`$database\`;"; fi
        } | mariadbd --bootstrap --datadir="$datadir" --skip-networking --log-error=/dev/null
        echo "MariaDB init process complete; ready for start up."
    fi
    exec mariadbd --datadir="$datadir" --bind-address=0.0.0.0 --skip-name-resolve "$@"
fi
exec "$@"
EOF

    # moto's server on 0.0.0.0:8000 (like amazon/dynamodb-local), one request at a time:
    # serialising requests gives conditional writes the per-item atomicity DynamoDB
    # guarantees; moto's threaded server alone could interleave a check and its write.
    cat >"$root/usr/local/bin/idem-dynamodb-server" <<'EOF'
#!/opt/moto/bin/python
import os
import signal
import sys
import threading

from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)


def main() -> None:
    host = os.environ.get("MOTO_HOST", "0.0.0.0")
    port = int(os.environ.get("MOTO_PORT", "8000"))
    os.environ["MOTO_PORT"] = str(port)
    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def serialised(environ, start_response):
        with lock:
            return list(app(environ, start_response))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    print(f"moto DynamoDB endpoint listening on {host}:{port}", flush=True)
    run_simple(host, port, serialised, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
EOF
    # Like the official rabbitmq image: the broker in the foreground, logging to
    # stdout, guest/guest allowed from outside localhost (rabbitmq.conf). The node
    # is rabbit@localhost, so it starts whatever host name the container gets.
    cat >"$root/usr/local/bin/idem-rabbitmq-entrypoint" <<'EOF'
#!/bin/sh
set -eu
if [ "${1#-}" != "$1" ]; then
    set -- rabbitmq-server "$@"
fi
if [ "$1" = rabbitmq-server ]; then
    shift
    export HOME=/var/lib/rabbitmq
    export RABBITMQ_NODENAME="${RABBITMQ_NODENAME:-rabbit@localhost}"
    export RABBITMQ_LOGS="${RABBITMQ_LOGS:--}"
    exec /usr/lib/rabbitmq/bin/rabbitmq-server "$@"
fi
exec "$@"
EOF
    chmod 755 "$root/usr/local/bin/idem-redis-entrypoint" \
        "$root/usr/local/bin/idem-postgres-entrypoint" "$root/usr/local/bin/idem-dynamodb-server" \
        "$root/usr/local/bin/idem-mariadb-entrypoint" "$root/usr/local/bin/idem-rabbitmq-entrypoint"
}

old_ids=()
for image in "${IMAGES[@]}"; do
    id="$(docker image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
    if [ -n "$id" ]; then old_ids+=("$id"); fi
done

bake_root

ROOT_IMAGE_ID=""
import_root

wants redis && make_image "$REDIS_IMAGE" redis /data 6379 \
    '["/usr/local/bin/idem-redis-entrypoint"]' '["redis-server"]'

wants postgres && make_image "$POSTGRES_IMAGE" postgres /var/lib/postgresql 5432 \
    '["/usr/local/bin/idem-postgres-entrypoint"]' '["postgres"]' \
    PATH=/usr/local/lib/postgresql-bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data

wants dynamodb && make_image "$DYNAMODB_IMAGE" dynamodb /tmp 8000 \
    '["/usr/local/bin/idem-dynamodb-server"]' null

wants mariadb && make_image "$MARIADB_IMAGE" mysql /var/lib/mysql 3306 \
    '["/usr/local/bin/idem-mariadb-entrypoint"]' '["mariadbd"]'

wants rabbitmq && make_image "$RABBITMQ_IMAGE" rabbitmq /var/lib/rabbitmq 5672 \
    '["/usr/local/bin/idem-rabbitmq-entrypoint"]' '["rabbitmq-server"]' \
    HOME=/var/lib/rabbitmq

# `docker run -i IMAGE - ARGS < script.py` runs a script with the clients.
wants python-clients && make_image "$PYTHON_CLIENTS_IMAGE" nobody /tmp "" \
    '["/opt/clients/bin/python3"]' '["--version"]' \
    PATH=/opt/clients/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

# The bare import (its layer lives on in the images), and images replaced
# by this run; ignore those still used by a container.
for id in "$ROOT_IMAGE_ID" "${old_ids[@]+"${old_ids[@]}"}"; do
    docker image rm "$id" >/dev/null 2>&1 || true
done

log "done in $((SECONDS - START_SECONDS)) s (recipe $RECIPE)"
print_env >&2
