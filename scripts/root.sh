#!/usr/bin/env bash
# Debian roots made with debootstrap, for building and testing remat against another
# suite's packages (scripts/test_libtorch2.sh: sid's LibTorch 2.x). Needs root.
#
#   root.sh make NAME SUITE COMPONENTS PACKAGE...   make or update the root, print its path
#   root.sh run NAME [--bind DIR:PATH]... -- COMMAND...   run COMMAND inside it
#
# COMPONENTS is comma-separated (main,contrib,non-free). Roots live in the project's cache
# folder, ${REMAT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/remat}/roots/NAME, outside the
# clone so that every clone and CI run on one machine reuses them. `make` is idempotent:
# a root whose debootstrap finished is kept (a different suite or component list redoes
# it), a half-made one is removed and made again, and only packages not yet recorded as
# installed send it to apt. The mirror is the one this machine's apt uses for Debian
# (else Debian's own); REMAT_DEBIAN_MIRROR overrides it.
set -euo pipefail

cache=${REMAT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/remat}
usage() {
  sed -n '5,6p' "$0" >&2
  exit 2
}

debian_mirror() {
  if [ -n "${REMAT_DEBIAN_MIRROR:-}" ]; then
    echo "$REMAT_DEBIAN_MIRROR"
    return
  fi
  local uri
  uri=$(apt-get indextargets --format '$(REPO_URI)' 'Label: Debian' 2>/dev/null | head -n 1)
  echo "${uri:-http://deb.debian.org/debian/}"
}

# Runs a command in the root with /proc, /sys, /dev and the --bind directories mounted,
# in a mount namespace of its own: the mounts are seen by no other process, and vanish
# with it however it ends, so runs may overlap and a root never keeps a mount.
in_root() {
  local root=$1
  shift
  unshare --mount --propagation private bash "$0" _mounted "$root" "${binds[@]/#/--bind=}" -- "$@"
}

mounted() {
  local root=$1 target
  shift
  # Mounts that other processes hold in the root are copied into this namespace: drop them.
  findmnt -rn -o TARGET | awk -v r="$root" 'index($0, r "/") == 1' | sort -r |
    while read -r target; do umount -l "$target"; done
  # The root a mount point of its own, as / is: `ip netns` remounts / (--make-rslave).
  mount --bind "$root" "$root"
  mount -t proc proc "$root/proc"
  mount -t sysfs sys "$root/sys"
  mount --rbind /dev "$root/dev"
  while [ "$1" != -- ]; do
    local bind=${1#--bind=}
    shift
    mkdir -p "$root${bind#*:}"
    mount --bind "${bind%%:*}" "$root${bind#*:}"
  done
  shift
  exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}

make_root() {
  [ $# -ge 3 ] || usage
  local name=$1 suite=$2 components=$3
  shift 3
  local root=$cache/roots/$name
  local base="$suite $components"
  mkdir -p "$cache/roots"
  exec 9>"$root.lock"
  flock 9

  if [ "$(cat "$root/.remat-base" 2>/dev/null)" != "$base" ]; then
    if [ -e "$root" ]; then
      echo "root: $root is half-made or of another suite; making it again" >&2
      rm -rf --one-file-system "$root"
    fi
    local mirror
    mirror=$(debian_mirror)
    echo "root: debootstrap $suite ($components) into $root" >&2
    # minbase: dpkg, apt and the essential packages; everything else comes from the list.
    debootstrap --variant=minbase --components="$components" "$suite" "$root" "$mirror" >&2
    # A registry's index can be older than apt's freshness check allows while its
    # signatures still hold; recommends would double what gets installed.
    cat >"$root/etc/apt/apt.conf.d/90remat" <<'CONF'
Acquire::Check-Valid-Until "false";
APT::Install-Recommends "false";
CONF
    rm -f "$root/.remat-packages"
    echo "$base" >"$root/.remat-base"
  fi

  local missing=() p
  for p in "$@"; do
    grep -qxF "$p" "$root/.remat-packages" 2>/dev/null || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "root: installing ${missing[*]} into $root" >&2
    binds=()
    in_root "$root" sh -c 'export DEBIAN_FRONTEND=noninteractive
      dpkg --configure -a && apt-get update -q && apt-get install -y -q "$@" && apt-get clean' \
      sh "${missing[@]}" >&2
    printf '%s\n' "${missing[@]}" >>"$root/.remat-packages"
  fi
  echo "$root"
}

run_root() {
  [ $# -ge 1 ] || usage
  local root=$cache/roots/$1
  shift
  binds=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --bind) binds+=("$2"); shift 2 ;;
      --) shift; break ;;
      *) usage ;;
    esac
  done
  [ $# -gt 0 ] || usage
  [ -e "$root/.remat-base" ] || { echo "root: no root at $root (root.sh make first)" >&2; exit 1; }
  # Shared: runs may overlap one another, never a `make` of the same root.
  exec 9>"$root.lock"
  flock -s 9
  in_root "$root" "$@"
}

[ "$(id -u)" -eq 0 ] || { echo "root: needs root (debootstrap, chroot, mount)" >&2; exit 1; }
case "${1:-}" in
  make) shift; make_root "$@" ;;
  run) shift; run_root "$@" ;;
  _mounted) shift; mounted "$@" ;;
  *) usage ;;
esac
