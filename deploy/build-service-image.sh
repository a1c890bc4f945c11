#!/usr/bin/env bash
# Build the service image (tag ptc-sandbox:latest) on a machine whose builds cannot reach a
# package index: wheels are downloaded on the host into deploy/wheels, then installed offline.
#   deploy/build-service-image.sh [BASE_IMAGE]   (default: python:3.12-slim if present, else ptc-sandbox-base:bookworm)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
base=${1:-}
if [ -z "$base" ]; then
  if docker image inspect python:3.12-slim >/dev/null 2>&1; then base=python:3.12-slim; else base=ptc-sandbox-base:bookworm; fi
fi
py=$(docker run --rm --network none --entrypoint python3 "$base" -c 'import sys; print("%d%d" % sys.version_info[:2])')
.venv/bin/python -m pip download -q --disable-pip-version-check -d deploy/wheels pip
.venv/bin/python -m pip download -q --disable-pip-version-check -d deploy/wheels --only-binary=:all: \
  --python-version "$py" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any "$root"
.venv/bin/python -m pip wheel -q --disable-pip-version-check --no-deps -w deploy/wheels "$root"
DOCKER_BUILDKIT=0 docker build -q --network none --build-arg "BASE_IMAGE=$base" -t ptc-sandbox:latest . >/dev/null
echo ptc-sandbox:latest
