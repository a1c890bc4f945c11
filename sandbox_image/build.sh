#!/usr/bin/env bash
# Build the sandbox image, and optionally an image with Python packages on top of it.
#
#   sandbox_image/build.sh [--base auto|registry|offline] [--tag NAME:TAG]
#   sandbox_image/build.sh --data
#   sandbox_image/build.sh --node
#   sandbox_image/build.sh --requirements REQS.txt --tag NAME:TAG [--preload "mod1,mod2"]
#
#   registry  FROM python:3.12-slim (needs a reachable registry)
#   offline   FROM a Debian bookworm root filesystem made here with mmdebstrap
#             and `docker import`ed as ptc-sandbox-base:bookworm (needs only
#             Debian's package mirror; installs mmdebstrap when missing)
#   auto      (default) registry when python:3.12-slim is present or can be
#             pulled within 60 s, offline otherwise
#
# The minimal image (stdlib only) is always built first (tag: PTC_SANDBOX_IMAGE, default
# ptc-sandbox-runtime:latest; --tag without --requirements). With --requirements, the packages of that
# file (pip's format; pin versions) are installed on top of it into the image --tag names: their wheels
# are downloaded on the host (pip download, for the minimal image's Python; cached in
# ${XDG_CACHE_HOME:-~/.cache}/ptc-sandbox/wheels) and installed offline in the build (--network none).
# --preload: modules the resident interpreter imports before it forks each script (env PTC_PRELOAD and
# label io.ptc-sandbox.preload). --data = --requirements sandbox_image/requirements-data.txt
# --preload numpy,pandas,matplotlib,matplotlib.pyplot --tag ${PTC_DATA_IMAGE:-ptc-sandbox-data:latest}.
# --node: the image for JavaScript and TypeScript scripts (tag PTC_NODE_IMAGE, default ptc-sandbox-node:latest): the
# same runtime on a bookworm root filesystem made with mmdebstrap that also holds Debian's nodejs and esbuild (the
# TypeScript transpiler), built offline like the offline base (PTC_NODE_BASE, default ptc-sandbox-base-node:bookworm).
# Prints the tag of the last image built.
# Env: PTC_SANDBOX_IMAGE (minimal image's tag), PTC_DATA_IMAGE (--data's tag), PTC_OFFLINE_BASE (the offline
#      base's tag, default ptc-sandbox-base:bookworm), PIP (host pip command,
#      default: .venv/bin/python -m pip when present, else python3 -m pip).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
base_mode=auto
runtime_tag=${PTC_SANDBOX_IMAGE:-ptc-sandbox-runtime:latest}
tag=""
requirements=""
preload=""
registry_base=python:3.12-slim
offline_base=${PTC_OFFLINE_BASE:-ptc-sandbox-base:bookworm}
data_preload=numpy,pandas,matplotlib,matplotlib.pyplot
node=""
node_tag=${PTC_NODE_IMAGE:-ptc-sandbox-node:latest}
node_base=${PTC_NODE_BASE:-ptc-sandbox-base-node:bookworm}

while [ $# -gt 0 ]; do
  case "$1" in
    --base) base_mode=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --requirements) requirements=$2; shift 2 ;;
    --preload) preload=$2; shift 2 ;;
    --data)
      requirements=$here/requirements-data.txt
      preload=$data_preload
      tag=${PTC_DATA_IMAGE:-ptc-sandbox-data:latest}
      shift ;;
    --node) node=1; shift ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$requirements" ]; then
  if [ -n "$tag" ]; then runtime_tag=$tag; fi
  if [ -n "$preload" ]; then echo "build.sh: --preload needs --requirements" >&2; exit 2; fi
elif [ -z "$tag" ]; then
  echo "build.sh: --requirements needs --tag (the packages image's name)" >&2; exit 2
elif [ "$tag" = "$runtime_tag" ]; then
  echo "build.sh: --tag must differ from the minimal image's tag ($runtime_tag)" >&2; exit 2
fi
if [ -n "$preload" ] && ! [[ $preload =~ ^[A-Za-z_][A-Za-z0-9_.]*(,[A-Za-z_][A-Za-z0-9_.]*)*$ ]]; then
  echo "build.sh: --preload must be module names separated by commas" >&2; exit 2
fi

# debian_base TAG PACKAGES: a bookworm root filesystem with PACKAGES (comma-separated), imported as TAG (kept).
debian_base() {
  local name=$1 packages=$2
  if docker image inspect "$name" >/dev/null 2>&1; then return; fi
  command -v mmdebstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  echo "build.sh: making a bookworm root filesystem with $packages (mmdebstrap, about 30 s)" >&2
  mmdebstrap --quiet --variant=minbase --include="$packages" bookworm "$tmp/rootfs.tar"
  docker import "$tmp/rootfs.tar" "$name" >/dev/null
}

build_offline_base() { debian_base "$offline_base" python3; }

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

# docker_build TAG CONTEXT [ARGS...]: the legacy builder (no buildx plugin needed; its deprecation banner is shown
# only if the build fails), without network.
docker_build() {
  local name=$1 context=$2 out; shift 2
  if ! out=$(DOCKER_BUILDKIT=0 docker build --quiet --network none "$@" -t "$name" "$context" 2>&1); then
    echo "$out" >&2; exit 1
  fi
}

if [ -n "$node" ]; then
  [ -z "$requirements" ] || { echo "build.sh: --node builds an image of its own (no --requirements)" >&2; exit 2; }
  debian_base "$node_base" python3,nodejs,esbuild
  echo "build.sh: building $node_tag from $node_base" >&2
  docker_build "$node_tag" "$here" --build-arg "BASE_IMAGE=$node_base" --build-arg LANGUAGES=python,javascript,typescript \
    --build-arg SPARE_LANGUAGE=javascript
  docker run --rm --network none --entrypoint sh "$node_tag" -c 'node --version && esbuild --version' >/dev/null
  echo "$node_tag"
  exit 0
fi

echo "build.sh: building $runtime_tag from $base" >&2
docker_build "$runtime_tag" "$here" --build-arg "BASE_IMAGE=$base"
docker run --rm --network none --entrypoint python3 "$runtime_tag" -c 'import ptc_runtime.stubs'
if [ -z "$requirements" ]; then echo "$runtime_tag"; exit 0; fi

# The packages image: wheels for the minimal image's own Python, downloaded on the host once per requirements file.
[ -f "$requirements" ] || { echo "build.sh: no requirements file $requirements" >&2; exit 2; }
if [ -n "${PIP:-}" ]; then read -r -a pip <<<"$PIP"
elif [ -x "$here/../.venv/bin/python" ]; then pip=("$here/../.venv/bin/python" -m pip)
else pip=(python3 -m pip); fi
pyver=$(docker run --rm --network none --entrypoint python3 "$runtime_tag" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
digest=$(cat "$requirements" | sha256sum | cut -c1-16)
wheels=${XDG_CACHE_HOME:-$HOME/.cache}/ptc-sandbox/wheels/cp${pyver/./}-$digest
if [ ! -f "$wheels/.complete" ]; then
  echo "build.sh: downloading wheels of $requirements for CPython $pyver (manylinux x86_64) into $wheels" >&2
  mkdir -p "$wheels"
  if ! out=$("${pip[@]}" download --quiet --disable-pip-version-check --only-binary=:all: --python-version "$pyver" \
      --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 -d "$wheels" -r "$requirements" pip 2>&1); then
    echo "$out" >&2; echo "build.sh: wheel download failed (wheels only: --only-binary=:all:)" >&2; exit 1
  fi
  touch "$wheels/.complete"  # all of them: later builds need no index
fi
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
cp "$here/Dockerfile.packages" "$context/Dockerfile"
cp "$requirements" "$context/requirements.txt"
mkdir "$context/wheels"
cp -l "$wheels"/*.whl "$context/wheels/" 2>/dev/null || cp "$wheels"/*.whl "$context/wheels/"
touch -d @0 "$context/wheels"/*.whl  # the build cache compares content, but keep the context stable anyway
echo "build.sh: building $tag from $runtime_tag with $requirements (preload: ${preload:-none})" >&2
docker_build "$tag" "$context" --build-arg "RUNTIME_IMAGE=$runtime_tag" --build-arg "PRELOAD=$preload"
echo "$tag"
