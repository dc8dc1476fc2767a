#!/usr/bin/env bash
# Shared set-up of tools/demo.sh and tools/test.sh: installs the Debian
# packages that are missing (apt-get, as root or through sudo), then
# configures and builds ckptio into ./build. Idempotent: when nothing is
# missing and nothing changed, it only asks ninja, which does nothing.
set -euo pipefail

CKPTIO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${CKPTIO_BUILD_DIR:-$CKPTIO_ROOT/build}
export CKPTIO_ROOT BUILD_DIR

PACKAGES=(
  cmake ninja-build g++ ccache pkg-config
  libboost-filesystem-dev libboost-dev   # Boost.Filesystem (tests)
  libxxhash-dev nlohmann-json3-dev libcli11-dev libfmt-dev
  libgtest-dev libgmock-dev
  libtorch-dev libgloo-dev               # LibTorch 1.13 with c10d (TCPStore, Gloo)
  python3-torch                          # interop checks: stock torch.load of exports
  python3-dev pybind11-dev python3-pytest # the Python package and its tests
  openmpi-bin libopenmpi-dev             # the DDP demo also runs under mpirun
  clang libclang-rt-14-dev               # libFuzzer targets (tools/fuzz.sh)
  libnfs-dev                             # the nfs:// backend (user-space NFSv3/v4)
  nfs-ganesha nfs-ganesha-vfs rpcbind nfs-common  # a real NFS server for its tests
  libcurl4-openssl-dev                   # the s3:// backend (HTTP, SigV4 signing)
  ceph-mon ceph-osd radosgw ceph-common curl  # a real S3 server for its tests (tools/rgw-server.sh)
  strace                                 # counts what the CLI reads (cli_test)
)

# tools/gpu-check.sh builds against a pip wheel's LibTorch instead.
if [ -n "${CKPTIO_NO_DEBIAN_TORCH:-}" ]; then
  PACKAGES=("${PACKAGES[@]/libtorch-dev/}")
  PACKAGES=("${PACKAGES[@]/python3-torch/}")
fi

missing=()
# CKPTIO_NO_APT: the dependencies come from elsewhere (the packages that
# tools/gpu-check.sh unpacks for a machine that cannot fetch any).
[ -n "${CKPTIO_NO_APT:-}" ] && PACKAGES=()
for p in "${PACKAGES[@]}"; do
  [ -n "$p" ] || continue
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing missing Debian packages: ${missing[*]}"
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
    sudo=sudo
  fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# ccache persists between runs; these settings let it serve precompiled headers.
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# Paths relative to the checkout, so a fresh clone elsewhere (CI) hits the cache.
export CCACHE_BASEDIR=$CKPTIO_ROOT CCACHE_NOHASHDIR=true
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}

# build_tree DIR [CMAKE_ARGS...]: configure (once, and afresh when the
# arguments differ from the last ones, kept in the tree: an argument dropped
# leaves no setting behind in the cache) and build a tree.
build_tree() {
  local dir=$1
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S "$CKPTIO_ROOT" -B "$dir" -G Ninja "$@" >/dev/null || return
    printf '%s' "$*" >"$dir/.ckptio-cmake-args"
  elif [ "$(cat "$dir/.ckptio-cmake-args" 2>/dev/null)" != "$*" ]; then
    cmake --fresh -S "$CKPTIO_ROOT" -B "$dir" -G Ninja "$@" >/dev/null || return
    printf '%s' "$*" >"$dir/.ckptio-cmake-args"
  fi
  echo "setup: building into $dir"
  # shellcheck disable=SC2086
  cmake --build "$dir" ${CKPTIO_BUILD_TARGETS:+--target $CKPTIO_BUILD_TARGETS} -- -j"$(nproc)"
}

# (CKPTIO_SETUP_BUILD=0: the packages and settings only; the caller builds.)
if [ "${CKPTIO_SETUP_BUILD:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  build_tree "$BUILD_DIR" ${CKPTIO_CMAKE_ARGS:-}
fi
