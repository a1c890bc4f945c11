#!/usr/bin/env bash
# Build the replicas' store and balancer images from Debian's packages, without a container registry
# (docker-compose.yml, profile "replicas"; docs/operations.md, Deployment: replicas).
#
#   deploy/replicas/build-images.sh [--force]
#
# Each image is a Debian bookworm root filesystem made with mmdebstrap (minbase, no recommends, no docs) and
# `docker import`ed with its entrypoint, user and environment set by --change: no `docker build`, so no network
# inside a build. Needs root (mmdebstrap) and Debian's package mirror; installs mmdebstrap when missing.
#   PTC_POSTGRES_IMAGE  (default ptc-sandbox-postgres:bookworm): postgresql-15, deploy/replicas/postgres-entrypoint.sh
#                       as entrypoint (the official postgres image's environment: POSTGRES_PASSWORD, ...)
#   PTC_HAPROXY_IMAGE   (default ptc-sandbox-haproxy:bookworm): haproxy (2.6), runs as the user haproxy
# An image whose tag exists is skipped (--force: rebuilt). From nothing, both at once: about 70 s on 2 idle
# cores (downloading and unpacking packages; measured up to 4 minutes on a machine busy with other builds);
# with both tags present, about a second. With a registry, PTC_POSTGRES_IMAGE=postgres:15 and PTC_HAPROXY_IMAGE=haproxy:2.6 work unchanged
# (docker-compose.yml passes the same environment and command); this script then builds nothing for a tag
# that is already pulled.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
force=""
if [ "${1:-}" = --force ]; then force=1; fi
postgres_image=${PTC_POSTGRES_IMAGE:-ptc-sandbox-postgres:bookworm}
haproxy_image=${PTC_HAPROXY_IMAGE:-ptc-sandbox-haproxy:bookworm}
log() { printf 'build-images.sh: %s\n' "$*" >&2; }

have() { [ -z "$force" ] && docker image inspect "$1" >/dev/null 2>&1; }

need_mmdebstrap() {
  command -v mmdebstrap >/dev/null && return
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
}

# rootfs TAR PACKAGES [mmdebstrap options...]: a minimal bookworm with PACKAGES, without docs, man pages, apt lists.
rootfs() {
  local tar=$1 packages=$2; shift 2
  mmdebstrap --quiet --variant=minbase --include="$packages" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$@" bookworm "$tar"
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

build_postgres() {
  # No cluster from the package's postinst: the entrypoint makes one in the data volume on the first start.
  rootfs "$tmp/postgres.tar" postgresql-15 \
    --essential-hook='mkdir -p "$1/etc/postgresql-common/createcluster.d" && echo "create_main_cluster = false" >"$1/etc/postgresql-common/createcluster.d/ptc.conf"' \
    --customize-hook="copy-in $here/postgres-entrypoint.sh /usr/local/bin" \
    --customize-hook='chmod 755 "$1/usr/local/bin/postgres-entrypoint.sh"'
  docker import \
    --change 'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PGDATA=/var/lib/postgresql/data LANG=C.UTF-8' \
    --change 'ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]' \
    --change 'CMD ["postgres"]' \
    "$tmp/postgres.tar" "$postgres_image" >/dev/null
}

build_haproxy() {
  rootfs "$tmp/haproxy.tar" haproxy --customize-hook='mkdir -p "$1/usr/local/etc/haproxy"'
  docker import \
    --change 'USER haproxy' \
    --change 'CMD ["haproxy", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]' \
    "$tmp/haproxy.tar" "$haproxy_image" >/dev/null
}

# Both root filesystems are made at once (mostly waiting on downloads and dpkg): about a minute from nothing.
pids=()
for which in postgres haproxy; do
  if [ "$which" = postgres ]; then tag=$postgres_image; else tag=$haproxy_image; fi
  if have "$tag"; then log "$tag exists"; continue; fi
  need_mmdebstrap
  log "making $tag from Debian's packages"
  "build_$which" &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
if [ "$status" != 0 ]; then log "an image failed to build"; exit "$status"; fi

docker run --rm --network none --entrypoint postgres "$postgres_image" --version >/dev/null
docker run --rm --network none "$haproxy_image" haproxy -v >/dev/null
echo "$postgres_image $haproxy_image"
