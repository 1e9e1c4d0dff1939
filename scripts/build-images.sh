#!/usr/bin/env bash
# Build the images docker-compose.yml runs.
#
#   scripts/build-images.sh                 # from the usual registries: docker compose build
#   scripts/build-images.sh --gpu           # the same with the GPU override (CUDA PyTorch and SGLang bases)
#   scripts/build-images.sh --offline       # no container registry: the CPU stack from Debian's packages and a
#                                           # wheelhouse made with pip on this machine
#
# --offline needs root (debootstrap, installed with apt-get where it is missing), apt-get, Debian's archive (the
# mirror of this machine's apt sources that serves bookworm, or DEBIAN_MIRROR; its security archive found the same
# way, or DEBIAN_SECURITY_MIRROR), and python3 with pip and the package index pip uses here (any Python: the wheels
# are chosen for the images' CPython 3.11). Debian's packages come from bookworm with its stable and security
# updates (bookworm-updates, bookworm-security), through an apt state of the script's own (build/apt-bookworm),
# whatever this machine runs or has installed. It builds
#   grpo-offline/debian:bookworm      debootstrap's minimal bookworm with Python 3.11 and redis-server, then
#                                     upgraded from bookworm-updates and bookworm-security, imported: the base of
#                                     the project's image (PYTHON_IMAGE, TORCH_IMAGE); its labels name the suites
#                                     (grpo-offline.debian-suites) and the time of the upgrade
#   grpo-offline/redis:<version>      that base running Debian's redis-server (REDIS_IMAGE)
#   grpo-offline/prometheus:<version> that base with bookworm's newest prometheus package (PROMETHEUS_IMAGE)
#                                     (both labelled with the package's Debian version: grpo-offline.debian-version)
#   docker/wheels/                    a wheel of every Python package the image installs, pinned by
#                                     docker/constraints.txt (torch: the CPU build), installed with PIP_OFFLINE=1
# then writes those settings into the env file (.env, made from .env.example if missing; --env-file FILE for
# another), so that `docker compose up` uses them, and builds the project's image. Each step is skipped when its
# result is already there and up to date: the base is made again when Debian has published updates of any of its
# packages since it was made (or it was made without them), Prometheus's packages downloaded again when the archive
# has newer ones, and --rebuild-base makes the base again anyway. Where the archive does not answer, what is here
# is used as it is. Grafana is not in Debian's archive: its profile needs its image from a registry (or `docker
# load`).
#
# Exits 2, saying what is missing in one line, where it cannot build.
set -Eeuo pipefail
self=$(realpath "${BASH_SOURCE[0]}")
caller=$PWD
cd "$(dirname "$self")/.."
source scripts/lib/debian.sh

say() { echo "build-images: $*" >&2; }
die() { say "$*"; exit 2; }
# A step that fails unforeseen says where, instead of ending the script without a word.
trap 'status=$?; say "line $LINENO failed (exit $status)"; exit $status' ERR

offline=0 gpu=0 rebuild_base=0 env_file=.env
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) offline=1 ;;
    --gpu) gpu=1 ;;
    --rebuild-base) rebuild_base=1 ;;
    --env-file) env_file=$(cd "$caller" && realpath -m "${2:?--env-file needs a file}"); shift ;;
    -h|--help) sed -n '2,/^set -Eeuo/p' "$self" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done

command -v docker >/dev/null || die "no docker command: install Docker (or Debian's docker.io) first"
docker compose version >/dev/null 2>&1 || die "no Docker Compose v2 (\`docker compose\`): install the compose plugin"
docker info >/dev/null 2>&1 || die "the Docker engine does not answer (is dockerd running, may this user use it?)"
[ -f "$env_file" ] || { cp .env.example "$env_file"; say "made $env_file from .env.example"; }

files=(-f docker-compose.yml)
[ $gpu = 0 ] || files+=(-f docker-compose.gpu.yml)

if [ $offline = 0 ]; then
  exec docker compose --env-file "$env_file" "${files[@]}" build
fi
[ $gpu = 0 ] || die "--offline builds the CPU stack only: the GPU images' bases (CUDA PyTorch, SGLang) come from a registry or \`docker load\`"

# --- Debian's package lists ---------------------------------------------------------------------------------
# In an apt state of this script's own (build/apt-bookworm): bookworm with its stable and security updates, never
# this machine's installed packages. The base and Prometheus's packages are checked against them; where the archive
# does not answer, what was built here before is used as it is, and only what is missing fails.
SUITES="bookworm bookworm-updates bookworm-security"
work=build/offline
mkdir -p "$work"
archive=1
debian_update bookworm > "$work/apt-update.log" 2>&1 \
  || { archive=0; say "Debian's archive does not answer (its log: $work/apt-update.log): nothing is checked for updates"; }

# --- the base image: Debian bookworm from its archive, with its updates -----------------------------------------
BASE=grpo-offline/debian:bookworm
SUITES_LABEL=grpo-offline.debian-suites

# why_rebuild_base: why the base must be made (again), or nothing where the one here will do.
why_rebuild_base() {
  [ $rebuild_base = 0 ] || { echo "--rebuild-base"; return; }
  docker image inspect "$BASE" >/dev/null 2>&1 || { echo "there is none here"; return; }
  [ "$(docker image inspect -f "{{ index .Config.Labels \"$SUITES_LABEL\" }}" "$BASE")" = "$SUITES" ] \
    || { echo "the one here was made without Debian's updates"; return; }
  [ $archive = 1 ] || return 0
  docker run --rm --network none --entrypoint cat "$BASE" /var/lib/dpkg/status > "$work/base-status" \
    || { echo "the one here has no dpkg status"; return; }
  local newer
  newer=$(debian_upgradable bookworm "$work/base-status" 2> "$work/base-check.log" | wc -l) \
    || { say "could not check $BASE for updates (its log: $work/base-check.log): it is kept"; return 0; }
  [ "$newer" = 0 ] || echo "Debian has updated $newer of its packages since it was made"
}

# upgrade_rootfs ROOTFS: Debian's stable and security updates installed by the rootfs's own apt, from the sources the
# image keeps (bookworm, bookworm-updates, bookworm-security of the archives it was made from). Services stay
# stopped (policy-rc.d), and /proc is mounted in a mount and PID namespace of the upgrade's own: it goes, and
# anything the upgrade started is killed, when the upgrade ends, however it ends.
upgrade_rootfs() {
  debian_sources bookworm > "$1/etc/apt/sources.list"
  printf '#!/bin/sh\n# no service starts while the image is made\nexit 101\n' > "$1/usr/sbin/policy-rc.d"
  chmod +x "$1/usr/sbin/policy-rc.d"
  env -u APT_CONFIG DEBIAN_FRONTEND=noninteractive \
    unshare --mount --pid --fork --mount-proc="$(realpath "$1")/proc" chroot "$1" \
    sh -c 'apt-get -q update && apt-get -q -y -o Dpkg::Options::=--force-confold dist-upgrade' > "$work/upgrade.log" 2>&1
  rm -f "$1/usr/sbin/policy-rc.d"
}

why=$(why_rebuild_base)
if [ -n "$why" ]; then
  [ "$(id -u)" = 0 ] || die "--offline makes its base image with debootstrap, which needs root"
  say "making $BASE: $why"
  if ! command -v debootstrap >/dev/null; then
    command -v apt-get >/dev/null || die "--offline needs debootstrap, and there is no apt-get to install it with"
    say "installing debootstrap (Debian's package)"
    apt_install debootstrap "$work/apt.log" || die "could not install debootstrap (its log: $work/apt.log)"
  fi
  keyring=()
  [ ! -f /usr/share/keyrings/debian-archive-keyring.gpg ] || keyring=(--keyring /usr/share/keyrings/debian-archive-keyring.gpg)
  rootfs="$work/rootfs"
  # A debootstrap killed midway can leave /proc or /sys mounted in it: never removed through a mount.
  ! grep -q " $(realpath -m "$rootfs")/" /proc/mounts \
    || die "something is still mounted under $rootfs (an interrupted debootstrap?): unmount it first"
  rm -rf "$rootfs"
  mirror=$(debian_mirror)
  say "debootstrap bookworm from $mirror (about a minute)"
  debootstrap --variant=minbase "${keyring[@]}" --include=python3,python3-venv,ca-certificates,redis-server,wget \
    bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
    || { tail -3 "$work/debootstrap.log" >&2; die "debootstrap failed (its log: $work/debootstrap.log)"; }
  say "installing Debian's updates from bookworm-updates and bookworm-security ($(debian_security_mirror))"
  upgrade_rootfs "$rootfs" || { tail -3 "$work/upgrade.log" >&2; die "the upgrade failed (its log: $work/upgrade.log)"; }
  # What an image does not need: the package lists and downloaded packages, documentation.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
         "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
  # The data directories the Redis and Prometheus images start their volumes from, owned by their users.
  mkdir -p "$rootfs/data" "$rootfs/prometheus"
  chroot "$rootfs" chown redis:redis /data
  chroot "$rootfs" chown nobody:nogroup /prometheus
  # The labels say what it carries (the Redis and Prometheus images inherit them): the suites, and when.
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL $SUITES_LABEL=\"$SUITES\" grpo-offline.debian-upgraded=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
  say "imported $BASE"
fi

# --- Redis and Prometheus from Debian's packages ----------------------------------------------------------------
# The tags name the packages' versions (7.0.15, 2.42.0), as the official images' tags do; a label the Debian
# version, its revision included (5:7.0.15-1~deb12u10).
redis_deb=$(docker run --rm --network none "$BASE" dpkg-query -W -f='${Version}' redis-server) \
  || die "$BASE has no redis-server (--rebuild-base makes it again)"
redis_version=${redis_deb#*:}
redis_version=${redis_version%%-*}
prom_dir="$work/prometheus"
# Bookworm's package whatever this machine runs, with the JavaScript and fonts its web pages load: the newest of
# bookworm and its updates, downloaded again when the archive has newer ones than those here.
prom_debs=(prometheus fonts-glyphicons-halflings libjs-bootstrap4 libjs-d3 libjs-eonasdan-bootstrap-datetimepicker
           libjs-jquery libjs-jquery-hotkeys libjs-moment libjs-moment-timezone libjs-mustache libjs-popper.js
           libjs-rickshaw)
have_debs=$(cd "$prom_dir" 2>/dev/null && ls -- *.deb 2>/dev/null | sort || true)
newest_debs=$have_debs
if [ $archive = 1 ]; then
  # The files apt would download (its --print-uris: URI, file name, size, hash), nothing downloaded.
  newest_debs=$(debian_apt bookworm download --print-uris "${prom_debs[@]}" 2>/dev/null | awk '{ print $2 }' | sort) \
    || newest_debs=""
fi
if [ ! -x "$prom_dir/usr/bin/prometheus" ] || [ -z "$have_debs" ] || [ "$newest_debs" != "$have_debs" ]; then
  rm -rf "$prom_dir"
  debian_download bookworm "$prom_dir" "${prom_debs[@]}" > "$work/prometheus.log" 2>&1 \
    || { tail -3 "$work/prometheus.log" >&2; die "could not download Debian's prometheus package (its log: $work/prometheus.log)"; }
  for deb in "$prom_dir"/*.deb; do dpkg -x "$deb" "$prom_dir"; done
  # The pages load moment-timezone's one bundled file; its source data is 200 MB the image does without.
  rm -rf "$prom_dir/usr/share/javascript/moment-timezone/data"
fi
prom_deb=$(basename "$prom_dir"/prometheus_*.deb | cut -d_ -f2)
prom_version=${prom_deb%%+*}
REDIS=grpo-offline/redis:$redis_version
PROMETHEUS=grpo-offline/prometheus:$prom_version
BASE_IMAGE=$BASE PROMETHEUS_DIR=$(cd "$prom_dir" && pwd) DOCKERFILES=$(pwd)/docker/offline REDIS_IMAGE=$REDIS \
  PROMETHEUS_IMAGE=$PROMETHEUS REDIS_DEBIAN_VERSION=$redis_deb PROMETHEUS_DEBIAN_VERSION=$prom_deb \
  docker compose -f docker/offline/images.yml build --quiet \
  || die "building $REDIS and $PROMETHEUS failed"
say "built $REDIS and $PROMETHEUS"

# --- the wheelhouse ----------------------------------------------------------------------------------------------
# Wheels for the images' Python (bookworm's CPython 3.11, glibc 2.36) whatever Python and libc this machine has:
# pip asks for those tags, and for wheels only (nothing is built against this machine's libraries).
command -v python3 >/dev/null || die "--offline makes the wheelhouse with pip: no python3 here"
extras=$(sed -n 's/^ARG EXTRAS="\(.*\)"$/\1/p' docker/Dockerfile)
wheels=docker/wheels
want=$(cat pyproject.toml docker/constraints.txt docker/requirements.py | sha256sum | cut -d' ' -f1)-$extras
if [ "$(cat "$wheels/.made-for" 2>/dev/null)" != "$want" ]; then
  python3 docker/requirements.py requirements pyproject.toml $extras > "$work/requirements.txt"
  index=()
  torch_index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
  if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$torch_index/" 2>/dev/null; then
    index=(--extra-index-url "$torch_index")
  else
    say "PyTorch's CPU index ($torch_index) does not answer: torch comes from pip's own index and links"
  fi
  platforms=(--platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
  for minor in $(seq 5 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  find "$wheels" -name '*.whl' -delete
  say "making the wheelhouse in $wheels"
  # async-timeout by name: redis-py needs it on Python < 3.11.3 (bookworm's is 3.11.2), which pip's markers,
  # read for this machine's Python, may leave out; setuptools: what the project's own install builds with.
  python3 -m pip download --quiet --disable-pip-version-check "${index[@]}" --dest "$wheels" --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 "${platforms[@]}" \
    -r "$work/requirements.txt" -c docker/constraints.txt async-timeout setuptools > "$work/pip-download.log" 2>&1 \
    || { grep -v '^WARNING' "$work/pip-download.log" | tail -5 >&2; die "pip could not make the wheelhouse (its log: $work/pip-download.log)"; }
  echo "$want" > "$wheels/.made-for"
fi

# --- the env file, then the project's image ---------------------------------------------------------------------
set_env() {
  # KEY=VALUE in the env file: the line replaced where it is there, appended where not.
  if grep -q "^$1=" "$env_file"; then
    sed -i "s|^$1=.*|$1=$2|" "$env_file"
  else
    printf '%s=%s\n' "$1" "$2" >> "$env_file"
  fi
}
set_env PYTHON_IMAGE "$BASE"
set_env TORCH_IMAGE "$BASE"
set_env PIP_OFFLINE 1
set_env REDIS_IMAGE "$REDIS"
set_env PROMETHEUS_IMAGE "$PROMETHEUS"
say "wrote PYTHON_IMAGE, TORCH_IMAGE, PIP_OFFLINE, REDIS_IMAGE, PROMETHEUS_IMAGE into $env_file"
docker compose --env-file "$env_file" -f docker-compose.yml build
say "done: docker compose up -d --scale actor=2"
