# Sourced by scripts/build-images.sh and scripts/docker-engine.sh: Debian's archive, as this machine reaches it.
# Needs python3 (the mirror check) and apt-get; only apt_install changes the system (it installs a package).

# apt_install PACKAGE LOG: install a package of this machine's own distribution (its package lists refreshed only
# when the install fails without), apt's output in LOG.
apt_install() {
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$1" \
    || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$1"; }; } \
    > "$2" 2>&1
}

# debian_mirror: DEBIAN_MIRROR when set; else the first archive of this machine's apt sources (deb822 .sources
# first, then one-line .list files) that serves Debian bookworm (its Release file says Origin: Debian; Docker's
# or another vendor's repository under a /debian path does not); else Debian's own.
debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then
    echo "$DEBIAN_MIRROR"
    return
  fi
  local uri
  for uri in $( { awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' /etc/apt/sources.list.d/*.sources 2>/dev/null
                  awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; break } }' \
                      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null; } | awk '!seen[$0]++'); do
    if python3 - "${uri%/}/dists/bookworm/Release" <<'PY' 2>/dev/null; then
import sys, urllib.request
head = urllib.request.urlopen(sys.argv[1], timeout=10).read(4096).decode("utf-8", "replace")
sys.exit(0 if "\nOrigin: Debian\n" in "\n" + head else 1)
PY
      echo "${uri%/}"
      return
    fi
  done
  echo "http://deb.debian.org/debian"
}

# debian_download SUITE DEST PACKAGE...: the packages' .deb files of Debian SUITE (bookworm, trixie) into DEST, with
# an apt state of its own under build/apt-SUITE (absolute paths: apt reads relative ones under /etc/apt).
debian_download() {
  local suite=$1 dest=$2
  shift 2
  local apt keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  apt="$(pwd)/build/apt-$suite"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/sources.list.d" "$dest"
  echo "deb [signed-by=$keyring] $(debian_mirror) $suite main" > "$apt/sources.list"
  local opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=$apt/sources.list.d"
              -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
  apt-get -q "${opts[@]}" update && (cd "$dest" && apt-get "${opts[@]}" download "$@")
}
