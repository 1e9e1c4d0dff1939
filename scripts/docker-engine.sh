#!/usr/bin/env bash
# A Docker engine with Compose v2, where none runs: for the compose test (tests/compose), and for trying the stack on
# a Debian machine without Docker.
#
#   scripts/docker-engine.sh        prints "running" when an engine answers already; else installs Debian's docker.io
#                                   (when dockerd is missing), starts dockerd in the background and prints
#                                   "started PID" (stop it with `kill PID`; its log: build/docker-engine/dockerd.log)
#
# Compose v2: where `docker compose` is missing, Debian trixie's docker-compose package (Compose 2.26; bookworm has
# only v1; the newest of trixie, trixie-updates and trixie-security) is downloaded with an apt state of its own (the
# system's apt state, installed packages included, is neither read nor touched) and its plugin copied to
# /usr/local/lib/docker/cli-plugins/.
#
# Needs root and a kernel with cgroups. Exits 2 saying why in one line where no engine can be had.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/lib/debian.sh

say() { echo "docker-engine: $*" >&2; }
started=""  # the PID of an engine this script started: stopped again if the script fails after starting it
die() {
  say "$*"
  [ -z "$started" ] || kill "$started" 2>/dev/null || true
  exit 2
}
work=build/docker-engine
mkdir -p "$work"
PATH="$PATH:/usr/sbin:/sbin"  # where Debian puts dockerd, which a user's PATH may lack

install_engine() {
  command -v apt-get >/dev/null || die "no dockerd, and no apt-get to install Debian's docker.io with"
  say "installing Debian's docker.io"
  apt_install docker.io "$work/apt.log" \
    || { tail -3 "$work/apt.log" >&2; die "could not install docker.io (its log: $work/apt.log)"; }
}

wait_for_engine() {
  local _
  for _ in $(seq $(($1 * 2))); do
    docker info >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  return 1
}

start_engine() {
  # In the background, in a session of its own (it outlives this script), its PID for whoever stops it: printed
  # when it answers, and written at once to $GRPO_DOCKERD_PIDFILE when set (so that a caller who stops waiting for
  # this script still knows what to stop).
  setsid dockerd > "$work/dockerd.log" 2>&1 < /dev/null &
  local pid=$!
  [ -z "${GRPO_DOCKERD_PIDFILE:-}" ] || echo "$pid" > "$GRPO_DOCKERD_PIDFILE"
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
  local debs="$work/compose"
  say "installing Compose v2 from Debian trixie's docker-compose package"
  rm -rf "$debs"
  debian_download trixie "$debs" docker-compose > "$work/compose.log" 2>&1 \
    || { tail -3 "$work/compose.log" >&2; die "could not download trixie's docker-compose (its log: $work/compose.log)"; }
  dpkg -x "$debs"/docker-compose_*.deb "$debs/x"
  mkdir -p /usr/local/lib/docker/cli-plugins
  # A copy, not a link: some Docker clients ignore a plugin that is a symbolic link.
  cp "$debs/x/usr/libexec/docker/cli-plugins/docker-compose" /usr/local/lib/docker/cli-plugins/docker-compose
}

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  state=running
else
  [ "$(id -u)" = 0 ] || die "no Docker engine answers, and starting one needs root"
  [ -d /sys/fs/cgroup ] && [ -n "$(ls /sys/fs/cgroup)" ] || die "no cgroups on this kernel: a Docker engine cannot run"
  command -v dockerd >/dev/null || install_engine
  # Where systemd runs, docker.io's service is (or was just) started by it: that engine is the machine's, not this
  # script's to start or stop.
  if [ -d /run/systemd/system ] && wait_for_engine 10; then
    state=running
  else
    state=$(start_engine)
    started=${state#started }
  fi
fi
if ! docker compose version >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || die "no Docker Compose v2 (\`docker compose\`), and installing it needs root"
  install_compose
  docker compose version >/dev/null 2>&1 || die "the Compose plugin does not run: $(docker compose version 2>&1 | head -1)"
fi
echo "$state"
