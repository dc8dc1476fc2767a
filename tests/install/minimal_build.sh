#!/usr/bin/env bash
# Configures and builds ckptio's core alone (CKPTIO_WITH_TORCH, _WITH_NFS,
# _WITH_S3, _BUILD_TOOLS and _BUILD_TESTS off) with LibTorch, libnfs, libcurl, Boost, fmt,
# CLI11 and GoogleTest made unfindable: the core needs only a compiler,
# xxHash and nlohmann-json. Usage: minimal_build.sh SOURCE_DIR BUILD_DIR [CMAKE]
set -euo pipefail
src=$1 build=$2 cmake=${3:-cmake}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
"$cmake" -S "$src" -B "$build" -G Ninja "${launcher[@]}" \
  -DCKPTIO_WITH_TORCH=OFF -DCKPTIO_WITH_NFS=OFF -DCKPTIO_WITH_S3=OFF -DCKPTIO_BUILD_TOOLS=OFF \
  -DCKPTIO_BUILD_TESTS=OFF \
  -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON -DCMAKE_DISABLE_FIND_PACKAGE_Boost=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_CURL=ON >/dev/null
"$cmake" --build "$build" >/dev/null
for lib in libckptio_core.so libckptio_posix.so libckptio_backends.so; do
  [ -e "$build/lib/$lib" ] || { echo "minimal build made no $lib" >&2; exit 1; }
done
for absent in libckptio_torch.so libckptio_nfs.so libckptio_s3.so; do
  [ ! -e "$build/lib/$absent" ] || { echo "minimal build made $absent" >&2; exit 1; }
done
echo "minimal core build: ckptio_core, ckptio_posix, ckptio_backends without LibTorch, libnfs, libcurl, Boost, fmt, CLI11, GoogleTest"
