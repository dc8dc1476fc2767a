#!/usr/bin/env bash
# The CUDA checks (issues 3 and 6), for a machine with an NVIDIA GPU:
#
#   tools/gpu-check.sh --fetch-deps   # here, on Debian 12: .gpu-deps/*.deb for a machine
#                                     # that cannot fetch packages (carry .gpu-deps there)
#   tools/gpu-check.sh [--rehearse] [--full-build] [--torch-root] [--out DIR] [DEVICE]
#
# DEVICE defaults to cuda:0; PYTHON=... picks the python3 whose torch to use.
# --rehearse: on a machine without CUDA, everything but the CUDA cases.
# --full-build: also build the whole project against this LibTorch, last.
# --torch-root: use LibTorch's headers and libraries without its CMake
#   config (CKPTIO_TORCH_ROOT); also the fallback when the config fails
#   (a CUDA wheel's config wants a matching CUDA toolkit).
# --out DIR: a copy of the output (gpu-check.log) and gpu-bench.json there
#   (the device tool's $OUT).
#
# 1. Builds ckptio into ./build-gpu against the LibTorch inside the CUDA
#    build of PyTorch that python3 imports (the pip wheel ships LibTorch's
#    headers, libraries and CMake config: torch.utils.cmake_prefix_path).
#    The other build dependencies are Debian 12's packages: where .gpu-deps/
#    holds them they are unpacked into build-gpu/deps (nothing installed,
#    no root, no network; no pkg-config needed; cmake, ninja and a C++
#    compiler must be there); otherwise tools/setup.sh installs what is
#    missing with apt-get, Debian's own LibTorch excepted.
# 2. Runs the LibTorch tests twice: every test with the GPU hidden
#    (CUDA_VISIBLE_DEVICES=, as in CI, where map_location "auto" is the CPU),
#    then the CUDA tests with it, CKPTIO_REQUIRE_CUDA=1 making a LibTorch
#    that cannot see the GPU fail them instead of skipping: a round trip
#    onto cuda:0, map_location auto / a function / a missing GPU, SaveAsync
#    of device tensors through pinned staging (state captured at the call).
# 3. Runs `ckptio-bench --gpu DEVICE`: SaveAsync stall for device tensors
#    against a device-to-pinned copy of the same bytes, synchronous save, and
#    a verified load onto the device (staged through a reused pinned buffer)
#    against torch::load onto the device, in seconds and GiB/s.
# 4. With --full-build: every target (reported, not fatal;
#    build-gpu/full-build.log). The DDP demo needs Gloo's headers, which the
#    carried packages leave out: Debian's would not match the wheel's Gloo.
# Output: the test summaries and the benchmark table; build-gpu/gpu-bench.json.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DEPS_DEBS="$ROOT/.gpu-deps"
# Debian 12 (bookworm) names: every build dependency but LibTorch, with the
# shared libraries the development packages link to.
DEPS_PACKAGES="libboost1.74-dev libboost-filesystem1.74-dev libboost-filesystem1.74.0
  libboost-system1.74-dev libboost-system1.74.0 nlohmann-json3-dev libcli11-dev libfmt-dev
  libfmt9 libxxhash-dev libxxhash0 libgtest-dev libgmock-dev libnfs-dev libnfs13"

die() {
  echo "gpu-check: $*" >&2
  exit 2
}

if [ "${1:-}" = --fetch-deps ]; then
  command -v apt-get >/dev/null || die "--fetch-deps needs apt-get (run it on Debian 12)"
  rm -rf "$DEPS_DEBS" && mkdir -p "$DEPS_DEBS"
  # shellcheck disable=SC2086
  (cd "$DEPS_DEBS" && apt-get download $DEPS_PACKAGES >/dev/null 2>download.log) ||
    { cat "$DEPS_DEBS/download.log" >&2; die "apt-get download failed (run apt-get update?)"; }
  rm -f "$DEPS_DEBS/download.log"
  echo "gpu-check: $(find "$DEPS_DEBS" -name '*.deb' | wc -l) packages," \
    "$(du -sh "$DEPS_DEBS" | cut -f1) in $DEPS_DEBS; on the GPU machine, with .gpu-deps there:"
  echo "  tools/gpu-check.sh [DEVICE]"
  exit 0
fi
rehearse="" full_build="" torch_root_only="" out="" DEVICE=cuda:0
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) rehearse=1 ;;
    --full-build) full_build=1 ;;
    --torch-root) torch_root_only=1 ;;
    --out)
      out=${2:?--out needs a folder}
      shift
      ;;
    -*) die "unknown option $1 (see the top of $0)" ;;
    *) DEVICE=$1 ;;
  esac
  shift
done
if [ -n "$out" ]; then
  mkdir -p "$out"
  exec > >(tee "$out/gpu-check.log") 2>&1
  tee_pid=$!
  # At exit: end tee's input and let it write the last lines.
  trap 'exec >&- 2>&-; wait "$tee_pid" 2>/dev/null || true' EXIT
fi

prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
  die "$PY cannot import torch (pip install torch, a CUDA build)"
if [ -z "$rehearse" ]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    die "$PY's torch sees no CUDA device (CPU-only wheel, or no driver); --rehearse runs the rest"
fi
abi=$("$PY" -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')
if [ "$abi" != 1 ]; then
  echo "gpu-check: this torch wheel uses the pre-C++11 ABI; Debian's C++ libraries (gtest, fmt," >&2
  echo "  boost) use the C++11 ABI and cannot be mixed with it. Use a wheel built with the" >&2
  echo "  C++11 ABI (torch >= 2.7 on PyPI) or a cxx11-ABI LibTorch zip via PYTHON=..." >&2
  exit 2
fi
echo "gpu-check: torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
echo "gpu-check: LibTorch from $prefix"
cmake_extra=""
# The wheel's CMake config looks for the CUDA toolkit (nvcc) that matches it.
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$nvcc" ]; then
  echo "gpu-check: $("$nvcc" --version | tail -1) ($nvcc)"
  cmake_extra="-DCUDAToolkit_ROOT=$(dirname "$(dirname "$nvcc")")"
elif [ -z "$rehearse" ]; then
  echo "gpu-check: warning: no nvcc on PATH or in /usr/local/cuda: LibTorch's CMake config may" \
    "not find CUDA" >&2
fi

BUILD="$ROOT/build-gpu"
mkdir -p "$BUILD"
cmake_prefix="$prefix"
if compgen -G "$DEPS_DEBS/*.deb" >/dev/null; then
  for tool in cmake ninja c++; do
    command -v $tool >/dev/null || die "no $tool on this machine (the carried packages hold" \
      "libraries only; bring $tool, e.g. pip install cmake ninja)"
  done
  # The carried packages, unpacked once (again when the set changes).
  deps="$BUILD/deps"
  stamp=$(cd "$DEPS_DEBS" && ls -- *.deb | sort | cksum)
  if [ "$(cat "$deps/.unpacked" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$deps" && mkdir -p "$deps"
    for deb in "$DEPS_DEBS"/*.deb; do
      if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$deb" "$deps"
      else  # a .deb is an ar archive; bookworm's payloads are xz
        ar p "$deb" data.tar.xz | tar -xJ -C "$deps"
      fi
    done
    echo "$stamp" >"$deps/.unpacked"
  fi
  echo "gpu-check: build dependencies from $DEPS_DEBS (unpacked in $deps), not apt-get"
  libdir="$deps/usr/lib/x86_64-linux-gnu"
  # Both forms, in case the compiler reports no multiarch directory.
  cmake_prefix="$cmake_prefix;$deps/usr;$libdir"
  cmake_extra="$cmake_extra -DCMAKE_LIBRARY_PATH=$libdir"
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CKPTIO_NO_APT=1
fi

# LibTorch's root for CKPTIO_TORCH_ROOT: the wheel's torch/ folder, or /usr
# for Debian's package (whose headers are not in the Python package).
torch_root=""
for d in "$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" /usr; do
  [ -e "$d/include/torch/csrc/api/include/torch/torch.h" ] && torch_root=$d && break
done

export CKPTIO_NO_DEBIAN_TORCH=1 CKPTIO_BUILD_DIR="$BUILD"
# (The Python package and s3:// are not among the GPU checks: they need pybind11, libcurl.)
export CKPTIO_CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$cmake_prefix $cmake_extra -DCMAKE_BUILD_TYPE=Release \
  -DCKPTIO_WITH_PYTHON=OFF -DCKPTIO_WITH_S3=OFF"
build_checks() {
  CKPTIO_BUILD_TARGETS="torch_state_test torch_async_test ckptio-bench" "$ROOT/tools/setup.sh"
}
without_config() {
  [ -n "$torch_root" ] || die "no LibTorch headers next to $PY's torch, nor in /usr"
  rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles" "$BUILD/build.ninja"
  CKPTIO_CMAKE_ARGS="$CKPTIO_CMAKE_ARGS -DCKPTIO_TORCH_ROOT=$torch_root" build_checks
}
if [ -n "$torch_root_only" ]; then
  without_config
elif ! build_checks; then
  [ ! -f "$BUILD/build.ninja" ] || die "the build failed (above)"
  echo "gpu-check: configuring failed (above); if LibTorch's CMake config was the cause," \
    "this builds again without it, from $torch_root's headers and libraries"
  without_config
fi

bin="$BUILD/bin"
status=0
for t in torch_state_test torch_async_test; do
  echo "gpu-check: $t, GPU hidden"
  CUDA_VISIBLE_DEVICES="" "$bin/$t" --gtest_brief=1 || status=1
  if [ -z "$rehearse" ]; then
    echo "gpu-check: $t, the CUDA tests"
    CKPTIO_REQUIRE_CUDA=1 "$bin/$t" --gtest_brief=1 --gtest_filter='*Cuda*' || status=1
  fi
done
if [ -z "$rehearse" ]; then
  echo "gpu-check: ckptio-bench --gpu $DEVICE"
  "$bin/ckptio-bench" --gpu "$DEVICE" --dir "$BUILD/gpu-bench-data" --size 1024 \
    --repeat 3 --json "$BUILD/gpu-bench.json" || status=1
else
  echo "gpu-check: rehearsal: ckptio-bench, CPU only, 64 MiB"
  "$bin/ckptio-bench" --dir "$BUILD/gpu-bench-data" --size 64 --repeat 1 \
    --json "$BUILD/gpu-bench.json" || status=1
fi
rm -rf "$BUILD/gpu-bench-data"
[ -z "$out" ] || cp "$BUILD/gpu-bench.json" "$out/" 2>/dev/null || true
if [ -n "$full_build" ]; then
  # Every target, carrying on past failures, so the log names all of them.
  if cmake --build "$BUILD" -- -k 0 >"$BUILD/full-build.log" 2>&1; then
    echo "gpu-check: full build against this LibTorch: ok"
  else
    echo "gpu-check: full build against this LibTorch failed (build-gpu/full-build.log):"
    grep '^FAILED: ' "$BUILD/full-build.log" | sed 's/^/  /' || true
  fi
fi
echo "gpu-check: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
