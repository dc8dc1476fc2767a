#!/usr/bin/env bash
# The CUDA checks (issues 3 and 6), for a machine with an NVIDIA GPU:
#
#   tools/gpu-check.sh [DEVICE]          # default cuda:0; PYTHON=... to pick python3
#
# 1. Builds ckptio into ./build-gpu against the LibTorch inside the CUDA
#    build of PyTorch that python3 imports (the pip wheel ships LibTorch's
#    headers, libraries and CMake config: torch.utils.cmake_prefix_path),
#    installing the Debian build dependencies it lacks (tools/setup.sh without
#    Debian's own LibTorch). That is also the check that the source builds
#    against current LibTorch 2.x.
# 2. Runs the LibTorch tests, whose CUDA cases skip on machines without a GPU
#    (a round trip onto cuda:0; SaveAsync of device tensors through pinned
#    staging, state captured at the call).
# 3. Runs `ckptio-bench --gpu DEVICE`: SaveAsync stall for device tensors
#    against a device-to-pinned copy of the same bytes, synchronous save, and
#    a verified load onto the device (staged through a reused pinned buffer)
#    against torch::load onto the device, in seconds and GiB/s.
# Output: the test summaries and the benchmark table; build-gpu/gpu-bench.json.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DEVICE=${1:-cuda:0}

prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
  { echo "gpu-check: $PY cannot import torch (pip install torch, a CUDA build)" >&2; exit 2; }
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  { echo "gpu-check: $PY's torch sees no CUDA device (CPU-only wheel, or no driver)" >&2; exit 2; }
abi=$("$PY" -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')
if [ "$abi" != 1 ]; then
  echo "gpu-check: this torch wheel uses the pre-C++11 ABI; Debian's C++ libraries (gtest, fmt," >&2
  echo "  boost) use the C++11 ABI and cannot be mixed with it. Use a wheel built with the" >&2
  echo "  C++11 ABI (torch >= 2.7 on PyPI) or a cxx11-ABI LibTorch zip via PYTHON=..." >&2
  exit 2
fi
echo "gpu-check: torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
echo "gpu-check: LibTorch from $prefix"

export CKPTIO_NO_DEBIAN_TORCH=1 CKPTIO_BUILD_DIR="$ROOT/build-gpu"
export CKPTIO_CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$prefix -DCMAKE_BUILD_TYPE=Release"
# What the checks need first; then everything, reported but not fatal.
CKPTIO_BUILD_TARGETS="torch_state_test torch_async_test ckptio-bench" "$ROOT/tools/setup.sh"
full_build=ok
"$ROOT/tools/setup.sh" >"$ROOT/build-gpu/full-build.log" 2>&1 || full_build=failed
echo "gpu-check: full build against this LibTorch: $full_build (build-gpu/full-build.log)"

bin="$ROOT/build-gpu/bin"
status=0
for t in torch_state_test torch_async_test; do
  echo "gpu-check: $t"
  "$bin/$t" --gtest_brief=1 || status=1
done
echo "gpu-check: ckptio-bench --gpu $DEVICE"
"$bin/ckptio-bench" --gpu "$DEVICE" --dir "$ROOT/build-gpu/gpu-bench-data" --size 1024 \
  --repeat 3 --json "$ROOT/build-gpu/gpu-bench.json" || status=1
exit $status
