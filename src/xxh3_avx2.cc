// The AVX2 XXH3 kernel (compiled with -mavx2 on x86-64; see src/CMakeLists.txt).
#define CKPTIO_XXH3_KERNEL kXxh3Avx2
#define CKPTIO_XXH3_NAME "avx2"
#define XXH_VECTOR XXH_AVX2
#include "xxh3_kernel.inc"
