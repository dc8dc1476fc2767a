// XXH3-128 as ckptio records it: every kernel this CPU runs (SSE2, AVX2,
// AVX-512; src/xxh3_dispatch.h) gives xxHash's hashes, at once and streamed
// in pieces of any size, so a checkpoint verifies whichever CPU wrote it.
#include "ckptio/hash.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "xxh3_dispatch.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t, for the kernels' own streaming
#include <xxhash.h>

namespace {

using ckptio::Hash128;
using ckptio::HashBytes;
using ckptio::Hasher;
using ckptio::internal::Xxh3Kernel;
using ckptio::internal::Xxh3Kernels;

TEST(HashTest, KnownValuesMatchXxh128sum) {
  // `printf '' | xxh128sum` and `printf 'abc' | xxh128sum`.
  EXPECT_EQ(HashBytes("", 0).Hex(), "99aa06d3014798d86001c324468d497f");
  EXPECT_EQ(HashBytes("abc", 3).Hex(), "06b05ab6733a618578af5f94892f3950");
}

TEST(HashTest, EveryKernelThisCpuRunsGivesTheSameHashesAtOnceAndStreamed) {
  const std::vector<const Xxh3Kernel*> kernels = Xxh3Kernels();
  ASSERT_FALSE(kernels.empty());
  std::cout << "kernels on this CPU:";
  for (const auto* k : kernels) std::cout << " " << k->name;
  std::cout << " (in use: " << ckptio::internal::Xxh3().name << ")\n";
  std::mt19937_64 rng(42);
  std::string data(3 << 20, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  // Sizes across XXH3's code paths: 0-16, 17-128, 129-240, long inputs,
  // one stripe, one block (1 KiB) and more, off by one either way.
  const size_t sizes[] = {
      0,   1,   3,    4,    8,    9,    16,    17,    128,     129,           240,        241,
      255, 256, 1023, 1024, 1025, 4096, 65535, 65537, 1 << 20, (1 << 20) + 7, data.size()};
  for (size_t size : sizes) {
    const Hash128 want = kernels.front()->hash(data.data(), size);
    EXPECT_EQ(HashBytes(data.data(), size), want) << "size " << size;
    for (const Xxh3Kernel* k : kernels) {
      EXPECT_EQ(k->hash(data.data(), size), want) << k->name << ", size " << size;
      // Streamed in random pieces through the kernel's own state.
      XXH3_state_t state;
      k->reset(&state);
      std::uniform_int_distribution<size_t> piece(0, 5000);
      for (size_t at = 0; at < size;) {
        const size_t n = std::min(size - at, piece(rng));
        k->update(&state, data.data() + at, n);
        at += n;
      }
      EXPECT_EQ(k->digest(&state), want) << k->name << " streamed, size " << size;
    }
    Hasher streamed;  // the kernel in use, through the public class
    streamed.Update(data.data(), size / 3);
    streamed.Update(data.data() + size / 3, size - size / 3);
    EXPECT_EQ(streamed.Digest(), want) << "Hasher, size " << size;
  }
}

}  // namespace
