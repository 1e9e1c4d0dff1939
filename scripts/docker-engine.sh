#!/usr/bin/env bash
# A Docker engine with Compose v2, where none runs: for the compose test (tests/compose), and for trying the stack on
# a Debian machine without Docker.
#
#   scripts/docker-engine.sh        prints "running" when an engine answers already; else installs Debian's docker.io
#                                   (when dockerd is missing), starts dockerd in the background and prints
#                                   "started PID" (stop it with `kill PID`; its log: build/docker-engine/dockerd.log)
#
# Compose v2: where `docker compose` is missing, Debian trixie's docker-compose package (Compose 2.26; bookworm has
# only v1) is downloaded with an apt state of its own (the system's apt state is not touched) and its plugin copied
# to /usr/local/lib/docker/cli-plugins/.
#
# Needs root and a kernel with cgroups. Exits 2 saying why in one line where no engine can be had.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/lib/debian-mirror.sh

say() { echo "docker-engine: $*" >&2; }
started=""  # the PID of an engine this script started: stopped again if the script fails after starting it
die() {
  say "$*"
  [ -z "$started" ] || kill "$started" 2>/dev/null || true
  exit 2
}
work=build/docker-engine
mkdir -p "$work"

install_engine() {
  command -v apt-get >/dev/null || die "no dockerd, and no apt-get to install Debian's docker.io with"
  say "installing Debian's docker.io"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io \
    || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io; }; } \
    > "$work/apt.log" 2>&1 || { tail -3 "$work/apt.log" >&2; die "could not install docker.io (its log: $work/apt.log)"; }
}

start_engine() {
  # In the background, in a session of its own (it outlives this script), its PID for whoever stops it.
  setsid dockerd > "$work/dockerd.log" 2>&1 < /dev/null &
  local pid=$!
  for _ in $(seq 120); do
    if docker info >/dev/null 2>&1; then
      echo "started $pid"
      return
    fi
    kill -0 "$pid" 2>/dev/null || { tail -3 "$work/dockerd.log" >&2; die "dockerd exited (its log: $work/dockerd.log)"; }
    sleep 0.5
  done
  kill "$pid"
  die "dockerd did not answer within 60 s (its log: $work/dockerd.log)"
}

install_compose() {
  # An apt state of its own, by absolute paths (apt reads relative ones under /etc/apt).
  local apt keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  apt="$(pwd)/$work/trixie"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/sources.list.d"
  echo "deb [signed-by=$keyring] $(debian_mirror) trixie main" > "$apt/sources.list"
  local opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=$apt/sources.list.d"
              -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
  say "installing Compose v2 from Debian trixie's docker-compose package"
  { apt-get -q "${opts[@]}" update && (cd "$apt" && apt-get "${opts[@]}" download docker-compose); } > "$work/compose.log" 2>&1 \
    || { tail -3 "$work/compose.log" >&2; die "could not download trixie's docker-compose (its log: $work/compose.log)"; }
  rm -rf "$apt/x" && dpkg -x "$apt"/docker-compose_*.deb "$apt/x"
  mkdir -p /usr/local/lib/docker/cli-plugins
  # A copy, not a link: some Docker clients ignore a plugin that is a symbolic link.
  cp "$apt/x/usr/libexec/docker/cli-plugins/docker-compose" /usr/local/lib/docker/cli-plugins/docker-compose
}

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  state=running
else
  [ "$(id -u)" = 0 ] || die "no Docker engine answers, and starting one needs root"
  [ -d /sys/fs/cgroup ] && [ -n "$(ls /sys/fs/cgroup)" ] || die "no cgroups on this kernel: a Docker engine cannot run"
  command -v dockerd >/dev/null || install_engine
  state=$(start_engine)
  started=${state#started }
fi
if ! docker compose version >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || die "no Docker Compose v2 (\`docker compose\`), and installing it needs root"
  install_compose
  docker compose version >/dev/null 2>&1 || die "the Compose plugin does not run: $(docker compose version 2>&1 | head -1)"
fi
echo "$state"
