#!/usr/bin/env bash
# Set up, run and test ptc-sandbox on one Linux machine.
#
#   deploy/local.sh serve   set everything up, then run the service in the foreground (without
#                           PTC_API_KEYS: with PTC_AUTH=disabled, on loopback only; without PTC_EGRESS_ALLOW:
#                           tools and callbacks may reach the demo tool server http://127.0.0.1:8765 only)
#   deploy/local.sh test    set everything up, then run ruff, mypy --strict and the whole test suite (args passed
#                           on to pytest: `deploy/local.sh test tests/unit` runs the unit tests only)
#   deploy/local.sh setup   only set up: Python venv, Docker engine, gVisor, sandbox images (minimal, data, node)
#   deploy/local.sh engine  only the Docker engine and gVisor steps
#   deploy/local.sh haproxy   only HAProxy for the tests (installed, never started as a service)
#   deploy/local.sh postgres  only PostgreSQL for the tests (started, role and database made); prints its URL
#   deploy/local.sh register-runsc CONFIG   only write runsc into the daemon.json CONFIG (engine untouched)
#   deploy/local.sh bench   set everything up, then run the benchmark (bench/; args passed on)
#   deploy/local.sh bench --replicas 1|2   the same through HAProxy with 1 or 2 replicas on PostgreSQL
#                           (bench/replicas.py; args passed on)
#   deploy/local.sh replicas [up|down|env]   two replicas on a shared PostgreSQL behind HAProxy at 127.0.0.1:8080, in
#                           containers (docker-compose.yml, profile "replicas"; docs/operations.md, Deployment:
#                           replicas). `up` (the default) sets up the engine, writes $PTC_REPLICAS_DIR/replicas.env
#                           once, builds the images that are missing (store and balancer:
#                           deploy/replicas/build-images.sh) and the service image, starts the store, then the
#                           rest, and waits until the balancer and both replicas are ready. `down` stops and
#                           removes the containers (the store's data and the work dirs stay in PTC_REPLICAS_DIR).
#                           `env` only writes the env file (once) and prints its path.
#
# Set-up is idempotent and skips what is already there:
#   - a venv in .venv (Python >= 3.11) with the project installed (editable);
#   - a Docker engine: when none answers, Debian's docker.io is installed (root)
#     and dockerd started without any bridge network (--bridge=none
#     --iptables=false --ip-forward=false); sandboxes never need one;
#   - gVisor: Debian's runsc, registered with the engine as runtime "runsc" in
#     daemon.json (flags below) before dockerd starts; an engine already running
#     without it (or with it but without --oci-seccomp) gets SIGHUP (a reload: no restart, its containers
#     keep running); an engine that already has it so is left alone. Missing runsc fails under CI=true;
#   - kernel.pid_max raised to 4194304 when lower (gVisor's threads count there: docs/operations.md);
#   - the sandbox image (sandbox_image/build.sh; offline base when no registry) and the data image on it
#     (numpy, pandas, matplotlib: sandbox_image/build.sh --data, wheels downloaded on the host once), and the node
#     image (Debian's nodejs and esbuild, for JavaScript and TypeScript: sandbox_image/build.sh --node); `serve`
#     offers the three (PTC_IMAGES default, data and node, data with 1 GiB of memory) unless PTC_IMAGES is set;
#   - for the tests only: Debian's haproxy (the replicas' tests run their own balancer), Debian's PostgreSQL (a cluster started with pg_ctlcluster, no systemd; a role and a
#     database ptc_test; `test` exports PTC_TEST_STORE_URL for the store tests), Debian's docker-compose when no
#     `docker compose` works, Debian's
#     prometheus (a real Prometheus scrapes the service in a test), Debian's chromium
#     (a headless browser renders /docs and /redoc with the network off in a test), and Debian's openssl (the
#     egress tests make a certificate); under CI=true a test whose prerequisite is missing fails;
# Env: PTC_REPLICAS_DIR (replicas: env file, work dirs r1 and r2, the store's data; default /var/lib/ptc-sandbox),
#      PTC_SERVICE_IMAGE (replicas: the service image's tag, default ptc-sandbox:latest),
#      PTC_TEST_STORE_URL (a PostgreSQL for the tests; default: the local cluster's ptc_test database),
#      PTC_SANDBOX_IMAGE (image tag), PTC_DATA_IMAGE (data image tag), PTC_NODE_IMAGE (node image tag), PYTHON (interpreter for the venv),
#      PTC_DOCKERD_LOG (default /var/log/ptc-dockerd.log),
#      PTC_DOCKER_DAEMON_JSON (default /etc/docker/daemon.json),
#      PTC_DOCKERD_PIDFILE (default /var/run/docker.pid: the dockerd that gets SIGHUP).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { printf 'local.sh: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else log "needs root: $*"; exit 1; fi; }

apt_install() {
  log "installing $* from Debian's packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pick_python() {
  for candidate in "${PYTHON:-}" /usr/bin/python3 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$candidate"; return
    fi
  done
  apt_install python3 python3-venv
  echo /usr/bin/python3
}

setup_venv() {
  local extras=$1
  if [ ! -x .venv/bin/python ]; then
    local py; py=$(pick_python)
    log "creating .venv with $py"
    "$py" -m venv .venv
  fi
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".$extras"
  if [ "$extras" = "[test]" ] && ! .venv/bin/python -c 'import bfcl_eval' 2>/dev/null; then
    # BFCL v4 data for the tests; its full dependency set is huge and not needed.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps bfcl-eval==2026.3.23
  fi
  if [ "$extras" = "[test]" ]; then
    # The Python client (a second distribution: httpx and pydantic only), tested against the service and type-checked.
    .venv/bin/python -m pip install -q --disable-pip-version-check -e clients/python
  fi
}

# gVisor's flags on these machines (measured on these machines): without --network=none runsc refuses to start in the
# root network namespace; without --host-uds=open a script cannot connect to the broker's bind-mounted socket;
# without --oci-seccomp runsc ignores the sandboxes' seccomp profile (service/sandbox/seccomp.py) and the service
# refuses to start gVisor sandboxes.
RUNSC_ARGS=(--network=none --host-uds=open --oci-seccomp)
daemon_json=${PTC_DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
dockerd_pidfile=${PTC_DOCKERD_PIDFILE:-/var/run/docker.pid}

# Registered with the flags above (an older registration without --oci-seccomp is replaced).
runsc_registered() {
  docker info --format '{{json .Runtimes.runsc}}' 2>/dev/null | grep -q -- '"--oci-seccomp"'
}

install_runsc() {
  if command -v runsc >/dev/null; then return; fi
  apt_install runsc || { log "could not install runsc (gVisor)"; return 1; }
}

# register_runsc CONFIG: write runsc into the daemon.json CONFIG; prints changed or unchanged.
register_runsc() {
  as_root python3 "$root/deploy/register_runtime.py" "$1" runsc "$(command -v runsc)" "${RUNSC_ARGS[@]}"
}

# For a running engine that lacks runsc (or has it without --oci-seccomp): register it and reload dockerd with
# SIGHUP (never a restart).
setup_runsc() {
  if runsc_registered; then return; fi
  if install_runsc; then
    register_runsc "$daemon_json" >/dev/null  # changed or not, the running engine has not read it yet
    local pid; pid=$(cat "$dockerd_pidfile" 2>/dev/null || true)
    if [ -z "$pid" ] && [ "$(pidof dockerd | wc -w)" = 1 ]; then pid=$(pidof dockerd); fi
    if [ -n "$pid" ]; then
      log "reloading dockerd ($pid) with SIGHUP so that it reads runsc from $daemon_json"
      as_root kill -HUP "$pid"
      for _ in $(seq 20); do if runsc_registered; then return; fi; sleep 0.5; done
    fi
  fi
  if runsc_registered; then return; fi
  if [ "${CI:-}" = true ]; then log "the engine has no runsc runtime (gVisor) with --oci-seccomp; CI needs it"; exit 1; fi
  log "warning: the engine has no runsc runtime with --oci-seccomp (see $daemon_json): the gVisor tests will fail or skip"
}

setup_engine() {
  if docker info >/dev/null 2>&1; then setup_runsc; return; fi
  if ! command -v dockerd >/dev/null; then apt_install docker.io; fi
  if docker info >/dev/null 2>&1; then setup_runsc; return; fi
  # Not running yet: register runsc first, so that dockerd starts with it.
  if install_runsc; then register_runsc "$daemon_json" >/dev/null; fi
  local dlog=${PTC_DOCKERD_LOG:-/var/log/ptc-dockerd.log}
  log "starting dockerd (no bridge network); log in $dlog"
  local config=""
  if [ -f "$daemon_json" ]; then config="--config-file '$daemon_json'"; fi
  as_root sh -c "nohup dockerd --bridge=none --iptables=false --ip-forward=false $config >>'$dlog' 2>&1 &"
  for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then setup_runsc; return; fi
    sleep 1
  done
  log "dockerd did not come up in 60 s; last lines of $dlog:"; tail -n 20 "$dlog" >&2 || true
  exit 1
}

setup_prometheus() {
  if command -v prometheus >/dev/null; then return; fi
  # The package's postinst starts a daemon on :9090 unless policy-rc.d forbids it: the tests start their own.
  local policy=/usr/sbin/policy-rc.d added=""
  if [ ! -e "$policy" ]; then
    as_root sh -c "printf '#!/bin/sh\nexit 101\n' >'$policy' && chmod 755 '$policy'"
    added=1
  fi
  local status=0
  apt_install --no-install-recommends prometheus || status=$?
  if [ -n "$added" ]; then as_root rm -f "$policy"; fi
  return "$status"
}

# HAProxy for the replicas' tests (tests/integration/replicas.py runs its own, in the foreground with a generated
# config): the package's postinst would start a daemon through invoke-rc.d unless policy-rc.d forbids it.
setup_haproxy() {
  if command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ]; then return; fi
  local policy=/usr/sbin/policy-rc.d added=""
  if [ ! -e "$policy" ]; then
    as_root sh -c "printf '#!/bin/sh\nexit 101\n' >'$policy' && chmod 755 '$policy'"
    added=1
  fi
  local status=0
  apt_install --no-install-recommends haproxy || status=$?
  if [ -n "$added" ]; then as_root rm -f "$policy"; fi
  if [ "$status" != 0 ] && [ "${CI:-}" = true ]; then log "could not install haproxy; CI needs it for the replicas' tests"; exit 1; fi
  if [ "$status" != 0 ]; then log "warning: no haproxy: the replicas' tests will skip"; fi
}

# Compose for the deployment tests: the plugin (`docker compose`) when it works, else Debian's docker-compose.
setup_compose() {
  if docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; then return; fi
  apt_install --no-install-recommends docker-compose
}

# PostgreSQL for the store tests (tests/pgstore.py): Debian's package, its cluster started with pg_ctlcluster (these
# machines have no systemd), a role ptc_test that may create databases (each test makes its own) and a database
# ptc_test. Idempotent: an installed, running cluster and an existing role are left as they are. Missing
# PostgreSQL fails under CI=true (the store tests need it), else warns (those tests then skip).
PG_TEST_PASSWORD=ptc-test-pw-4f2a  # a local test role on loopback only; never a production credential
pg_test_url=""
as_postgres() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sudo -u postgres sh -c "$*"; fi; }
setup_postgres() {
  if [ -n "${PTC_TEST_STORE_URL:-}" ]; then pg_test_url=$PTC_TEST_STORE_URL; return; fi
  if ! command -v pg_lsclusters >/dev/null || [ -z "$(pg_lsclusters -h 2>/dev/null)" ]; then
    # The package's postinst would start the cluster through invoke-rc.d (no systemd here): policy-rc.d forbids
    # it, and pg_ctlcluster starts it below.
    local policy=/usr/sbin/policy-rc.d added=""
    if [ ! -e "$policy" ]; then
      as_root sh -c "printf '#!/bin/sh\nexit 101\n' >'$policy' && chmod 755 '$policy'"
      added=1
    fi
    apt_install --no-install-recommends postgresql || true
    if [ -n "$added" ]; then as_root rm -f "$policy"; fi
  fi
  local line version cluster port status
  line=$(pg_lsclusters -h 2>/dev/null | head -n 1 || true)
  if [ -z "$line" ]; then
    version=$(ls /usr/lib/postgresql 2>/dev/null | sort -n | tail -n 1)
    if [ -n "$version" ]; then as_root pg_createcluster "$version" main >/dev/null; fi
    line=$(pg_lsclusters -h 2>/dev/null | head -n 1 || true)
  fi
  if [ -z "$line" ]; then
    if [ "${CI:-}" = true ]; then log "no PostgreSQL cluster could be made; CI needs it for the store tests"; exit 1; fi
    log "warning: no PostgreSQL: the PostgreSQL store tests will skip"; return
  fi
  read -r version cluster port status _ <<<"$line"
  if [ "$status" != online ]; then
    log "starting PostgreSQL $version/$cluster on port $port (pg_ctlcluster)"
    as_root pg_ctlcluster "$version" "$cluster" start
  fi
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p "$port" && break; sleep 1; done
  as_postgres "psql -p $port -qtAc \"SELECT 1 FROM pg_roles WHERE rolname = 'ptc_test'\" | grep -q 1 ||
    psql -p $port -qc \"CREATE ROLE ptc_test LOGIN CREATEDB PASSWORD '$PG_TEST_PASSWORD'\""
  as_postgres "psql -p $port -qtAc \"SELECT 1 FROM pg_database WHERE datname = 'ptc_test'\" | grep -q 1 ||
    createdb -p $port -O ptc_test ptc_test"
  pg_test_url="postgresql://ptc_test:$PG_TEST_PASSWORD@127.0.0.1:$port/ptc_test"
}

# The openssl command for the egress tests' certificate (tests/unit/test_egress.py).
setup_openssl() {
  if command -v openssl >/dev/null; then return; fi
  apt_install --no-install-recommends openssl
}

# The TypeScript compiler the declarations' tests type-check with (tests/unit/toolkit/test_ts_stubs.py: PTC_TEST_TSC),
# from the npm registry into the user's cache (Debian's nodejs and npm when the host has no npm).
typescript_dir=${XDG_CACHE_HOME:-$HOME/.cache}/ptc-sandbox/typescript-5.9.3
setup_typescript() {
  if [ -x "$typescript_dir/node_modules/.bin/tsc" ]; then return; fi
  command -v npm >/dev/null || apt_install --no-install-recommends nodejs npm
  mkdir -p "$typescript_dir"
  npm install --silent --no-audit --no-fund --prefix "$typescript_dir" typescript@5.9.3 >/dev/null
}

# A headless browser for the API documents' test (tests/integration/test_docs_ui.py).
setup_chromium() {
  if command -v chromium >/dev/null; then return; fi
  apt_install --no-install-recommends chromium
}

# gVisor's sandboxes each may hold up to 24 * pids + 64 host tasks (service/sandbox/docker.py): a pid_max of
# 32768 (a common default) would let ten fork bombs exhaust the host's pids. Raised only, never lowered.
setup_pid_max() {
  local want=4194304 have
  have=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo "$want")
  if [ "$have" -lt "$want" ]; then
    as_root sh -c "echo $want >/proc/sys/kernel/pid_max" || log "warning: could not raise kernel.pid_max ($have)"
  fi
}

setup() {
  setup_venv "${1:-}"
  setup_engine
  setup_pid_max
  sandbox_image/build.sh --data >/dev/null  # the minimal image, then the data image on it (cached: seconds)
  sandbox_image/build.sh --node >/dev/null  # the JavaScript and TypeScript image (Debian's nodejs, esbuild)
  if [ "${1:-}" = "[test]" ]; then setup_prometheus; setup_compose; setup_chromium; setup_openssl; setup_haproxy; setup_postgres; setup_typescript; fi
}

# The replicas' env file: written once (mode 0600), then it is the deployment's configuration (edit it, or
# remove it to start over with new secrets). Ports and ids may be chosen when it is first written
# (PTC_LB_PORT, PTC_REPLICA1_PORT, PTC_REPLICA2_PORT, PTC_PG_PORT, PTC_REPLICA1_ID, PTC_REPLICA2_ID,
# COMPOSE_PROJECT_NAME); API keys: PTC_API_KEYS (name:sha256hex,...) when set then, else PTC_AUTH=disabled
# (loopback only, as `serve`); egress: PTC_EGRESS_ALLOW when set then, else the demo tool server only (as `serve`).
# Each replica gets half of this host (both drive the one engine).
replicas_dir=${PTC_REPLICAS_DIR:-/var/lib/ptc-sandbox}
# The README's demo tool server (python -m tests.toolserver --port 8765): the one loopback destination `serve` and
# `replicas` allow when PTC_EGRESS_ALLOW is not set (the service's default allows none; docs/operations.md, Egress).
demo_tools=http://127.0.0.1:8765
replicas_env=$replicas_dir/replicas.env
write_replicas_env() {
  if [ -f "$replicas_env" ]; then return; fi
  local mem_mb cpus half_cpus slots pg_port pg_password auth
  mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
  cpus=$(nproc)
  half_cpus=$(awk -v c="$cpus" 'BEGIN {h = c / 2; if (h < 0.5) h = 0.5; print h}')
  slots=$(( cpus > 1 ? cpus : 1 ))  # one service's default is 2 x CPUs: half of it each
  pg_port=${PTC_PG_PORT:-5433}
  pg_password=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
  if [ -n "${PTC_API_KEYS:-}" ]; then auth="PTC_API_KEYS=$PTC_API_KEYS"; else auth="PTC_AUTH=disabled"; fi
  as_root mkdir -p "$replicas_dir"
  as_root sh -c "umask 077 && cat >'$replicas_env'" <<ENV
# Written once by deploy/local.sh replicas (docker-compose.yml, profile "replicas"); keep it secret (mode 0600).
COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-ptc-replicas}
PTC_SERVICE_IMAGE=${PTC_SERVICE_IMAGE:-ptc-sandbox:latest}
PTC_SANDBOX_IMAGE=${PTC_SANDBOX_IMAGE:-ptc-sandbox-runtime:latest}
PTC_DOCKER_GID=$(stat -c %g /var/run/docker.sock)
PTC_HOST=127.0.0.1
PTC_LB_PORT=${PTC_LB_PORT:-8080}
PTC_PORT=${PTC_REPLICA1_PORT:-8081}
PTC_INSTANCE_ID=${PTC_REPLICA1_ID:-r1}
PTC_WORK_DIR=$replicas_dir/r1
PTC_REPLICA2_PORT=${PTC_REPLICA2_PORT:-8082}
PTC_REPLICA2_INSTANCE_ID=${PTC_REPLICA2_ID:-r2}
PTC_REPLICA2_WORK_DIR=$replicas_dir/r2
PTC_PG_PORT=$pg_port
PTC_PG_DATA=$replicas_dir/postgres
PTC_PG_PASSWORD=$pg_password
PTC_STORE_URL=postgresql://ptc:$pg_password@127.0.0.1:$pg_port/ptc
PTC_INTERNAL_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
PTC_CALLBACK_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
PTC_TRUSTED_PROXIES=127.0.0.1
PTC_HOST_MEMORY_MB=$(( mem_mb / 2 ))
PTC_HOST_CPUS=$half_cpus
PTC_MAX_CONCURRENT_SANDBOXES=$slots
PTC_EGRESS_ALLOW=${PTC_EGRESS_ALLOW-$demo_tools}
$auth
ENV
  log "wrote $replicas_env (mode 0600: the store's password and the internal secret)"
}

replicas_compose() {
  local compose=(docker compose)
  if ! docker compose version >/dev/null 2>&1; then compose=(docker-compose); fi
  "${compose[@]}" --env-file "$replicas_env" -f "$root/docker-compose.yml" --profile replicas "$@"
}

# url_ok URL: true when URL answers 200 within 2 s.
url_ok() { [ "$(curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" 2>/dev/null)" = 200 ]; }

replicas() {
  local action=${1:-up} build=""
  if [ "${2:-}" = --build ]; then build=1; elif [ -n "${2:-}" ]; then action=bad; fi
  case "$action" in
    down)
      if [ ! -f "$replicas_env" ]; then log "no $replicas_env: nothing to stop"; return; fi
      set -a; . "$replicas_env"; set +a
      replicas_compose down --timeout 20
      return ;;
    env) write_replicas_env; echo "$replicas_env"; return ;;
    up) ;;
    *) log "usage: deploy/local.sh replicas [up [--build]|down|env]"; exit 2 ;;
  esac
  setup_venv ""
  setup_engine
  setup_pid_max
  setup_compose
  write_replicas_env
  # Exported too: Compose v1 fills `environment: [NAME]` entries from the shell, not from --env-file.
  set -a; . "$replicas_env"; set +a
  sandbox_image/build.sh >/dev/null  # the sandbox image (cached: seconds)
  deploy/replicas/build-images.sh >/dev/null  # the store's and balancer's (cached: a second)
  local base=ptc-sandbox-base:bookworm
  if docker image inspect python:3.12-slim >/dev/null 2>&1; then base=python:3.12-slim; else sandbox_image/build.sh --base offline >/dev/null; fi
  # Built when missing or asked (--build): a new image id makes Compose recreate both replicas, which ends their
  # running jobs and sessions; a re-run without changes must leave a healthy replica alone.
  if [ -n "$build" ] || ! docker image inspect "$PTC_SERVICE_IMAGE" >/dev/null 2>&1; then
    log "building the service image $PTC_SERVICE_IMAGE (offline, on $base)"
    deploy/build-service-image.sh "$base" >/dev/null
  fi
  log "starting the store"
  replicas_compose up -d store
  local store_id health=""
  store_id=$(replicas_compose ps -q store)
  for _ in $(seq 60); do
    health=$(docker inspect --format '{{.State.Health.Status}}' "$store_id" 2>/dev/null || true)
    if [ "$health" = healthy ]; then break; fi
    sleep 1
  done
  if [ "$health" != healthy ]; then log "the store is not healthy after 60 s:"; docker logs --tail 20 "$store_id" >&2; exit 1; fi
  log "starting the replicas and the balancer"
  if docker compose version >/dev/null 2>&1; then replicas_compose up -d --wait; else replicas_compose up -d; fi
  local url
  for url in "http://127.0.0.1:$PTC_LB_PORT/readyz" "http://127.0.0.1:$PTC_PORT/readyz" "http://127.0.0.1:$PTC_REPLICA2_PORT/readyz"; do
    for _ in $(seq 120); do if url_ok "$url"; then break; fi; sleep 1; done
    if ! url_ok "$url"; then log "$url is not ready after 120 s"; replicas_compose ps >&2; exit 1; fi
  done
  log "ready: http://127.0.0.1:$PTC_LB_PORT (HAProxy over 127.0.0.1:$PTC_PORT and :$PTC_REPLICA2_PORT; settings in $replicas_env)"
}

case "${1:-}" in
  setup) setup "[test]" ;;
  replicas) replicas "${2:-up}" ;;
  engine) setup_engine ;;
  postgres) setup_postgres; echo "$pg_test_url" ;;
  haproxy) setup_haproxy ;;
  register-runsc)
    [ -n "${2:-}" ] || { log "usage: deploy/local.sh register-runsc CONFIG"; exit 2; }
    install_runsc
    register_runsc "$2" ;;
  serve)
    setup ""
    if [ -z "${PTC_AUTH:-}${PTC_API_KEYS:-}${PTC_API_KEYS_FILE:-}" ]; then
      # Development default: no keys configured, so say so explicitly (the service refuses it off loopback).
      log "no PTC_API_KEYS: serving with PTC_AUTH=disabled (development only; see docs/operations.md, Authentication)"
      export PTC_AUTH=disabled
    fi
    if [ -z "${PTC_IMAGES:-}" ]; then
      # The images set-up built: a request chooses with "image": "data" (docs/sandbox.md, Images per request); a
      # JavaScript or TypeScript one gets node.
      export PTC_IMAGES="default=${PTC_SANDBOX_IMAGE:-ptc-sandbox-runtime:latest},data=${PTC_DATA_IMAGE:-ptc-sandbox-data:latest},node=${PTC_NODE_IMAGE:-ptc-sandbox-node:latest}"
      export PTC_IMAGE_DEFAULTS="${PTC_IMAGE_DEFAULTS:-{\"data\": {\"memory_mb\": 1024}}}"
      log "offering the images default, data and node (PTC_IMAGES=$PTC_IMAGES)"
    fi
    if [ -z "${PTC_EGRESS_ALLOW+set}" ]; then
      # The README's example calls the demo tool server; nothing else on this host is reachable (set
      # PTC_EGRESS_ALLOW to name your own endpoints, or to an empty value for none).
      export PTC_EGRESS_ALLOW=$demo_tools
      log "tool endpoints and callbacks may reach $demo_tools only (PTC_EGRESS_ALLOW)"
    fi
    exec .venv/bin/ptc-sandbox serve ;;
  test)
    setup "[test]"
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
    if [ -n "$pg_test_url" ]; then export PTC_TEST_STORE_URL=$pg_test_url; fi
    export PTC_TEST_TSC=${PTC_TEST_TSC:-$typescript_dir/node_modules/.bin/tsc}
    .venv/bin/pytest -q -p no:cacheprovider "${@:2}" ;;
  bench)
    setup "[test]"
    case " ${*:2} " in
      *" --replicas "* | *" --replicas="*)  # the replicas' cluster (bench/replicas.py): PostgreSQL and HAProxy as for the tests
        setup_postgres
        setup_haproxy
        export PTC_TEST_STORE_URL=$pg_test_url
        .venv/bin/python -m bench.replicas "${@:2}" ;;
      *) .venv/bin/python -m bench "${@:2}" ;;
    esac ;;
  *) sed -n "2,48p" "$0"; exit 2 ;;
esac
