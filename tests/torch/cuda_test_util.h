// The CUDA tests: skipped with a clear message without a GPU, except under
// tools/gpu-check.sh, which sets CKPTIO_REQUIRE_CUDA=1 so that a build whose
// LibTorch cannot see the GPU fails instead of passing by skipping.
#ifndef CKPTIO_TESTS_TORCH_CUDA_TEST_UTIL_H_
#define CKPTIO_TESTS_TORCH_CUDA_TEST_UTIL_H_

#include <cstdlib>

#define CKPTIO_REQUIRE_CUDA()                                                                  \
  do {                                                                                         \
    if (!torch::cuda::is_available()) {                                                        \
      if (std::getenv("CKPTIO_REQUIRE_CUDA") != nullptr)                                       \
        FAIL() << "CKPTIO_REQUIRE_CUDA is set, but LibTorch sees no CUDA device";              \
      GTEST_SKIP() << "no CUDA device on this machine: tools/gpu-check.sh runs this on a GPU " \
                      "machine";                                                               \
    }                                                                                          \
  } while (0)

#endif  // CKPTIO_TESTS_TORCH_CUDA_TEST_UTIL_H_
