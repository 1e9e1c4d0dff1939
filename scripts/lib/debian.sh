# Sourced by scripts/build-images.sh and scripts/docker-engine.sh (from the repository's root): Debian's archive, as
# this machine reaches it. Needs python3 (the mirror check) and apt-get; only apt_install changes the system (it
# installs a package). The apt states of its own live under build/ of the directory it was sourced from.
debian_apt_root="$(pwd)/build"

# apt_install PACKAGE LOG: install a package of this machine's own distribution (its package lists refreshed only
# when the install fails without), apt's output in LOG.
apt_install() {
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$1" \
    || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$1"; }; } \
    > "$2" 2>&1
}

# host_archive_uris: the archive URIs of this machine's apt sources, deb822 .sources first, then one-line .list
# files, each once.
host_archive_uris() {
  { awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' /etc/apt/sources.list.d/*.sources 2>/dev/null
    awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; break } }' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null; } | awk '!seen[$0]++'
}

# debian_archive_among SUITE URI...: the first URI that serves Debian's SUITE (its Release file says Origin: Debian:
# Docker's or another vendor's repository under a /debian path does not), without its trailing slash; fails where
# none does.
debian_archive_among() {
  local suite=$1 uri
  shift
  for uri in "$@"; do
    if python3 - "${uri%/}/dists/$suite/Release" <<'PY' 2>/dev/null; then
import sys, urllib.request
head = urllib.request.urlopen(sys.argv[1], timeout=10).read(4096).decode("utf-8", "replace")
sys.exit(0 if "\nOrigin: Debian\n" in "\n" + head else 1)
PY
      echo "${uri%/}"
      return 0
    fi
  done
  return 1
}

# debian_mirror: DEBIAN_MIRROR when set; else the first archive of this machine's apt sources that serves bookworm;
# else Debian's own.
debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then
    echo "${DEBIAN_MIRROR%/}"
    return
  fi
  # shellcheck disable=SC2046  # unquoted: one URI a word
  debian_archive_among bookworm $(host_archive_uris) || echo "http://deb.debian.org/debian"
}

# debian_security_mirror: Debian's security archive, found the same way: DEBIAN_SECURITY_MIRROR when set; else the
# first archive of this machine's apt sources that serves bookworm-security; else Debian's own.
debian_security_mirror() {
  if [ -n "${DEBIAN_SECURITY_MIRROR:-}" ]; then
    echo "${DEBIAN_SECURITY_MIRROR%/}"
    return
  fi
  # shellcheck disable=SC2046
  debian_archive_among bookworm-security $(host_archive_uris) || echo "http://deb.debian.org/debian-security"
}

# debian_sources SUITE: the apt sources of a Debian stable SUITE (bookworm, trixie) with its stable and security
# updates, one-line format: SUITE and SUITE-updates from debian_mirror, SUITE-security from debian_security_mirror.
debian_sources() {
  local main security
  main=$(debian_mirror)
  security=$(debian_security_mirror)
  printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
    "$main" "$1" "$main" "$1" "$security" "$1"
}

# debian_apt SUITE ARG...: apt-get with the apt state of its own that debian_update made for SUITE under
# build/apt-SUITE (absolute paths: apt reads relative ones under /etc/apt): its own sources, lists, cache,
# preferences and an empty dpkg status. Never this machine's status: with it apt keeps wanting an installed version
# (say one from a security update) that these sources may not carry, and fails to download it; with none, every
# package is the newest of SUITE and its updates, whatever this machine has installed.
debian_apt() {
  local apt="$debian_apt_root/apt-$1"
  shift
  apt-get -o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=$apt/sources.list.d" \
    -o "Dir::Etc::preferences=$apt/preferences" -o "Dir::Etc::preferencesparts=$apt/preferences.d" \
    -o "Dir::State=$apt" -o "Dir::State::Lists=$apt/lists" -o "Dir::State::status=$apt/status" \
    -o "Dir::Cache=$apt/cache" "$@"
}

# debian_update SUITE: that apt state made (or remade), and its package lists fetched.
debian_update() {
  local apt="$debian_apt_root/apt-$1" keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/sources.list.d" "$apt/preferences.d"
  : > "$apt/status"
  debian_sources "$1" | sed "s|^deb |deb [signed-by=$keyring] |" > "$apt/sources.list"
  debian_apt "$1" -q update
}

# debian_download SUITE DEST PACKAGE...: the newest .deb files of the packages in SUITE and its updates into DEST.
debian_download() {
  local suite=$1 dest=$2
  shift 2
  mkdir -p "$dest"
  debian_update "$suite" && (cd "$dest" && debian_apt "$suite" download "$@")
}

# debian_upgradable SUITE STATUS: after debian_update, the packages of a dpkg status file (an image's
# /var/lib/dpkg/status) that SUITE's updates have newer versions of, a line each: NAME INSTALLED NEWEST.
debian_upgradable() {
  debian_apt "$1" -s -o "Dir::State::status=$2" dist-upgrade \
    | sed -n 's/^Inst \([^ ]*\) \[\([^]]*\)\] (\([^ ]*\) .*/\1 \2 \3/p'
}
