#!/usr/bin/env bash
# Build the service image on a machine whose builds cannot reach a package index: wheels are downloaded on
# the host into deploy/wheels (for the base image's Python), then installed offline inside the build.
#
#   deploy/build-service-image.sh [--wheels-only] [BASE_IMAGE]
#
#   BASE_IMAGE     default: python:3.12-slim if present, else ptc-sandbox-base:bookworm (sandbox_image/build.sh)
#   --wheels-only  only fill deploy/wheels (then `docker compose build` with PTC_BASE_IMAGE=BASE_IMAGE works offline)
# Env: PTC_SERVICE_IMAGE (tag, default ptc-sandbox:latest). Prints the tag.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
wheels_only=""
if [ "${1:-}" = --wheels-only ]; then wheels_only=1; shift; fi
base=${1:-}
tag=${PTC_SERVICE_IMAGE:-ptc-sandbox:latest}
if [ -z "$base" ]; then
  if docker image inspect python:3.12-slim >/dev/null 2>&1; then base=python:3.12-slim; else base=ptc-sandbox-base:bookworm; fi
fi
py=$(docker run --rm --network none --entrypoint python3 "$base" -c 'import sys; print("%d%d" % sys.version_info[:2])')
.venv/bin/python -m pip download -q --disable-pip-version-check -d deploy/wheels pip
.venv/bin/python -m pip download -q --disable-pip-version-check -d deploy/wheels --only-binary=:all: \
  --python-version "$py" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any "$root"
rm -f deploy/wheels/ptc_sandbox-*.whl  # the project's own wheel: always this tree's
.venv/bin/python -m pip wheel -q --disable-pip-version-check --no-deps -w deploy/wheels "$root"
if [ -n "$wheels_only" ]; then echo deploy/wheels; exit 0; fi
DOCKER_BUILDKIT=0 docker build -q --network none --build-arg "BASE_IMAGE=$base" -t "$tag" . >/dev/null
echo "$tag"
