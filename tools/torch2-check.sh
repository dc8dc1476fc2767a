#!/usr/bin/env bash
# The LibTorch 2.x check ("the same source builds against Debian's LibTorch
# 1.13 and current LibTorch 2.x"), run on this Debian 12 machine:
#
#   tools/torch2-check.sh [CTEST_ARGS...]
#
# Builds the working tree inside a Debian 13 (trixie) chroot, whose
# libtorch-dev is LibTorch 2.6 (with GCC 14, and Python's torch 2.6 for the
# export interop test), and runs there the tests that touch LibTorch: ctest
# labels torch and python (the others do not depend on LibTorch's version,
# and tools/test.sh runs them in the normal build; the chroot has no NFS or
# S3 server, so the DDP demo over nfs:// and s3:// is not run and the Python
# S3 tests skip). It builds with -O1 and no debug information (about 40 %
# less compile time than -O2 -g), as a unity build (CKPTIO_UNITY_BUILD, a
# third less again), without the test programs that do not link LibTorch
# (CKPTIO_TORCH_TESTS_ONLY): what is checked here is that the source builds
# and behaves against LibTorch 2.x. The chroot is
# made once with debootstrap and kept, with its ccache and build tree, in
# $CKPTIO_TORCH2_ROOT (default /var/cache/ckptio/trixie); later runs only
# copy in what changed of the tree (tracked and untracked files) and
# rebuild that. Needs root and the Debian mirror
# ($CKPTIO_DEBIAN_MIRROR); exits 77 when it cannot run here.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHROOT=${CKPTIO_TORCH2_ROOT:-/var/cache/ckptio/trixie}
MIRROR=${CKPTIO_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES="cmake ninja-build g++ ccache pkg-config libboost-filesystem-dev libboost-dev
  libxxhash-dev nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libgmock-dev
  libtorch-dev libgloo-dev libnfs-dev libcurl4-openssl-dev python3-torch python3-dev pybind11-dev
  python3-pytest"

skip() {
  echo "torch2-check: skipped: $*"
  exit 77
}
[ "$(id -u)" = 0 ] || skip "needs root (debootstrap, chroot, bind mounts)"
if ! command -v debootstrap >/dev/null; then
  # (apt-get update only when the package lists are too old to find it)
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null 2>&1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; } \
      >/dev/null 2>&1 || skip "cannot install debootstrap"
fi
mkdir -p "$(dirname "$CHROOT")"
exec 9>"$CHROOT.lock"
flock 9 # one run at a time per chroot

MOUNTS=(proc sys dev dev/pts)
unmount_all() {
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    if mountpoint -q "$CHROOT/${MOUNTS[i]}"; then umount -l "$CHROOT/${MOUNTS[i]}"; fi
  done
  return 0
}
trap unmount_all EXIT

if [ ! -f "$CHROOT/.ckptio-base" ]; then
  echo "torch2-check: creating a Debian trixie chroot in $CHROOT (once)"
  unmount_all
  rm -rf --one-file-system "$CHROOT"
  debootstrap --variant=minbase trixie "$CHROOT" "$MIRROR" >"$CHROOT.log" 2>&1 ||
    { tail -5 "$CHROOT.log"; skip "debootstrap of trixie from $MIRROR failed ($CHROOT.log)"; }
  touch "$CHROOT/.ckptio-base"
fi
for m in "${MOUNTS[@]}"; do
  mountpoint -q "$CHROOT/$m" || mount --bind "/$m" "$CHROOT/$m"
done
in_chroot() { chroot "$CHROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  LANG=C.UTF-8 "$@"; }
if [ "$(cat "$CHROOT/.ckptio-packages" 2>/dev/null)" != "$PACKAGES" ]; then
  echo "torch2-check: installing the build dependencies in the chroot"
  cp /etc/resolv.conf "$CHROOT/etc/resolv.conf"
  in_chroot apt-get update -qq >/dev/null || skip "apt-get update in the chroot failed ($MIRROR)"
  # shellcheck disable=SC2086
  in_chroot env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    $PACKAGES >/dev/null ||
    { echo "torch2-check: apt-get install in the chroot failed (the mirror answered: a package" \
      "name changed?)"; exit 1; }
  echo "$PACKAGES" >"$CHROOT/.ckptio-packages"
fi
echo "torch2-check: LibTorch $(in_chroot dpkg-query -W -f='${Version}' libtorch-dev)," \
  "$(in_chroot g++ --version | head -1)"

# The tree, as it is now (what git would commit, plus untracked files),
# copied over the last run's: a file whose content changed gets a new
# modification time, the others keep theirs, so ninja rebuilds exactly what
# changed. (Keeping the source's times instead can leave an edit older than
# the objects an earlier, longer run built from the content before it.)
stage=$CHROOT/work/ckptio.new dest=$CHROOT/work/ckptio
rm -rf --one-file-system "$stage"
mkdir -p "$stage" "$dest"
(cd "$ROOT" && git -c safe.directory="$ROOT" ls-files -co --exclude-standard -z |
  tar --null -T - -cf -) |
  tar -C "$stage" -xf -
(cd "$stage" && find . -type f -print0) | while IFS= read -r -d '' f; do
  cmp -s "$stage/$f" "$dest/$f" && continue
  mkdir -p "$(dirname "$dest/$f")"
  cp --preserve=mode "$stage/$f" "$dest/$f"
done
(cd "$dest" && find . -type f -print0) | while IFS= read -r -d '' f; do
  [ -e "$stage/$f" ] || rm -f "$dest/$f"
done
rm -rf --one-file-system "$stage"

in_chroot env CCACHE_DIR=/root/.ccache CCACHE_BASEDIR=/work/ckptio CCACHE_NOHASHDIR=true \
  CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime bash -c '
  set -e
  # (The tree is configured afresh when these change.)
  args=(-DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG"
        -DCKPTIO_TEST_OPTIMIZE= -DCKPTIO_UNITY_BUILD=ON -DCKPTIO_TORCH_TESTS_ONLY=ON)
  if [ "$(cat /work/build/.ckptio-flags 2>/dev/null)" != "${args[*]}" ]; then
    cmake --fresh -S /work/ckptio -B /work/build -G Ninja "${args[@]}" >/dev/null
    echo "${args[*]}" >/work/build/.ckptio-flags
  fi
  echo "torch2-check: building into $0/work/build"
  cmake --build /work/build -- -j"$(nproc)" >/work/build.log 2>&1 ||
    { tail -40 /work/build.log; echo "torch2-check: the build failed"; exit 1; }
  grep -A3 "warning:" /work/build.log || true' "$CHROOT"
status=0
# (Two tests a core, as tools/test.sh runs them.)
in_chroot ctest --test-dir /work/build --output-on-failure -j"$(($(nproc) * 2))" --timeout 600 \
  -L 'torch|python' "$@" || status=$?
exit $status
