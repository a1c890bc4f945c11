#!/usr/bin/env bash
# Build the sandbox image.
#
#   sandbox_image/build.sh [--base auto|registry|offline] [--tag NAME:TAG]
#
#   registry  FROM python:3.12-slim (needs a reachable registry)
#   offline   FROM a Debian bookworm root filesystem made here with mmdebstrap
#             and `docker import`ed as ptc-sandbox-base:bookworm (needs only
#             Debian's package mirror; installs mmdebstrap when missing)
#   auto      (default) registry when python:3.12-slim is present or can be
#             pulled within 60 s, offline otherwise
#
# Env: PTC_SANDBOX_IMAGE (default tag, ptc-sandbox-runtime:latest).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
base_mode=auto
tag=${PTC_SANDBOX_IMAGE:-ptc-sandbox-runtime:latest}
registry_base=python:3.12-slim
offline_base=ptc-sandbox-base:bookworm

while [ $# -gt 0 ]; do
  case "$1" in
    --base) base_mode=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

build_offline_base() {
  if docker image inspect "$offline_base" >/dev/null 2>&1; then return; fi
  command -v mmdebstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  echo "build.sh: making a bookworm root filesystem with mmdebstrap (about 30 s)" >&2
  mmdebstrap --quiet --variant=minbase --include=python3 bookworm "$tmp/rootfs.tar"
  docker import "$tmp/rootfs.tar" "$offline_base" >/dev/null
}

case "$base_mode" in
  registry) base=$registry_base ;;
  offline) build_offline_base; base=$offline_base ;;
  auto)
    if docker image inspect "$registry_base" >/dev/null 2>&1 || timeout 60 docker pull -q "$registry_base" >/dev/null 2>&1; then
      base=$registry_base
    else
      build_offline_base; base=$offline_base
    fi ;;
  *) echo "build.sh: --base must be auto, registry or offline" >&2; exit 2 ;;
esac

echo "build.sh: building $tag from $base" >&2
# The legacy builder needs no buildx plugin; its deprecation banner is shown only if the build fails.
if ! out=$(DOCKER_BUILDKIT=0 docker build --quiet --network none --build-arg "BASE_IMAGE=$base" -t "$tag" "$here" 2>&1); then
  echo "$out" >&2; exit 1
fi
docker run --rm --network none --entrypoint python3 "$tag" -c 'import ptc_runtime.stubs' 
echo "$tag"
