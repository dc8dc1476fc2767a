#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds
# and runs a tiny consumer project that finds it with find_package(ckptio).
# Usage: run.sh BUILD_DIR CONSUMER_SRC [CMAKE [CMAKE_ARGS...]]: the extra
# arguments go to the consumer's configure (e.g. -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON,
# to prove it needs no LibTorch).
set -euo pipefail
build=$1 consumer_src=$2 cmake=${3:-cmake}
shift $(($# < 3 ? $# : 3))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null
"$cmake" -S "$consumer_src" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  "${launcher[@]}" "$@" >/dev/null
"$cmake" --build "$tmp/build" >/dev/null
"$tmp/build/consumer" "$tmp/store"
