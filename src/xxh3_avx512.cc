// The AVX-512 XXH3 kernel (compiled with -mavx512f on x86-64; see src/CMakeLists.txt).
#define CKPTIO_XXH3_KERNEL kXxh3Avx512
#define CKPTIO_XXH3_NAME "avx512"
#define XXH_VECTOR XXH_AVX512
#include "xxh3_kernel.inc"
