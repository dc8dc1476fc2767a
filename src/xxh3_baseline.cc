// The XXH3 kernel every build has: the compiler's baseline (SSE2 on x86-64).
#define CKPTIO_XXH3_KERNEL kXxh3Baseline
#if defined(__x86_64__)
#define CKPTIO_XXH3_NAME "sse2"
#else
#define CKPTIO_XXH3_NAME "generic"
#endif
#include "xxh3_kernel.inc"
