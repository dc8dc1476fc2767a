// XXH3-128 built for several x86-64 instruction sets, the best one this CPU
// runs chosen once per process (what xxHash's own xxh_x86dispatch does; the
// Debian package ships its header but not its source). Every kernel gives
// the same hashes; AVX2 and AVX-512 hash a buffer in cache about 1.6x and
// 2x as fast as the SSE2 baseline a plain x86-64 build gets.
#ifndef CKPTIO_SRC_XXH3_DISPATCH_H_
#define CKPTIO_SRC_XXH3_DISPATCH_H_

#include <cstddef>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/hash.h"

namespace ckptio::internal {

struct Xxh3Kernel {
  const char* name;  // "sse2", "avx2", "avx512", or "generic" off x86-64
  Hash128 (*hash)(const void* data, size_t size);
  // On an XXH3_state_t (64-byte aligned), as XXH3_128bits_reset/_update/_digest.
  void (*reset)(void* state);
  void (*update)(void* state, const void* data, size_t size);
  Hash128 (*digest)(const void* state);
};

// The fastest kernel this CPU runs.
CKPTIO_EXPORT_PRIVATE const Xxh3Kernel& Xxh3();
// Every kernel this build has that this CPU runs, baseline first.
CKPTIO_EXPORT_PRIVATE std::vector<const Xxh3Kernel*> Xxh3Kernels();

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_XXH3_DISPATCH_H_
