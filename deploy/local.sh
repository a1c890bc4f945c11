#!/usr/bin/env bash
# Set up, run and test ptc-sandbox on one Linux machine.
#
#   deploy/local.sh serve   set everything up, then run the service in the foreground (without
#                           PTC_API_KEYS: with PTC_AUTH=disabled, on loopback only)
#   deploy/local.sh test    set everything up, then run ruff, mypy --strict and the whole test suite
#   deploy/local.sh setup   only set up: Python venv, Docker engine, sandbox image
#   deploy/local.sh bench   set everything up, then run the benchmark (bench/; args passed on)
#
# Set-up is idempotent and skips what is already there:
#   - a venv in .venv (Python >= 3.11) with the project installed (editable);
#   - a Docker engine: when none answers, Debian's docker.io is installed (root)
#     and dockerd started without any bridge network (--bridge=none
#     --iptables=false --ip-forward=false); sandboxes never need one;
#   - the sandbox image (sandbox_image/build.sh; offline base when no registry);
#   - for the tests only: Debian's prometheus (a real Prometheus scrapes the service in a test).
# Env: PTC_SANDBOX_IMAGE (image tag), PYTHON (interpreter for the venv),
#      PTC_DOCKERD_LOG (default /var/log/ptc-dockerd.log).
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
}

setup_engine() {
  if docker info >/dev/null 2>&1; then return; fi
  if ! command -v dockerd >/dev/null; then apt_install docker.io; fi
  if docker info >/dev/null 2>&1; then return; fi
  local dlog=${PTC_DOCKERD_LOG:-/var/log/ptc-dockerd.log}
  log "starting dockerd (no bridge network); log in $dlog"
  as_root sh -c "nohup dockerd --bridge=none --iptables=false --ip-forward=false >>'$dlog' 2>&1 &"
  for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then return; fi
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

setup() {
  setup_venv "${1:-}"
  setup_engine
  sandbox_image/build.sh >/dev/null
  if [ "${1:-}" = "[test]" ]; then setup_prometheus; fi
}

case "${1:-}" in
  setup) setup "[test]" ;;
  serve)
    setup ""
    if [ -z "${PTC_AUTH:-}${PTC_API_KEYS:-}${PTC_API_KEYS_FILE:-}" ]; then
      # Development default: no keys configured, so say so explicitly (the service refuses it off loopback).
      log "no PTC_API_KEYS: serving with PTC_AUTH=disabled (development only; see README, Authentication)"
      export PTC_AUTH=disabled
    fi
    exec .venv/bin/ptc-sandbox serve ;;
  test)
    setup "[test]"
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
    .venv/bin/pytest -q -p no:cacheprovider "${@:2}" ;;
  bench)
    setup "[test]"
    .venv/bin/python -m bench "${@:2}" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
