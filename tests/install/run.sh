#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds
# and runs a tiny consumer project that finds it with find_package(ckptio).
set -euo pipefail
build=$1 consumer_src=$2 cmake=${3:-cmake}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null
"$cmake" -S "$consumer_src" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
"$cmake" --build "$tmp/build" >/dev/null
"$tmp/build/consumer" "$tmp/store"
