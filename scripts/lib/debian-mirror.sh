# Sourced by scripts/build-images.sh and scripts/docker-engine.sh.
# debian_mirror: the Debian archive this machine's apt reads (one-line or deb822 sources), DEBIAN_MIRROR when set,
# else Debian's own.
debian_mirror() {
  local uri
  uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; exit } }' \
        | grep -m1 '/debian/\?$' || true)
  [ -n "$uri" ] || uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' | grep -m1 '/debian/\?$' || true)
  echo "${DEBIAN_MIRROR:-${uri:-http://deb.debian.org/debian}}"
}
