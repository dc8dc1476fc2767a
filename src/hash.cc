// Hash128, and XXH3-128 of a buffer at once (the streaming Hasher: hasher.cc).
#include "ckptio/hash.h"

#include <cstring>

#include "xxh3_dispatch.h"

namespace ckptio {

namespace {
int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

std::string Hash128::Hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[15 - i] = kDigits[(high >> (4 * i)) & 0xf];
    out[31 - i] = kDigits[(low >> (4 * i)) & 0xf];
  }
  return out;
}

std::optional<Hash128> Hash128::FromHex(std::string_view hex) {
  if (hex.size() != 32) return std::nullopt;
  Hash128 h;
  for (size_t i = 0; i < 32; ++i) {
    int d = HexDigit(hex[i]);
    if (d < 0) return std::nullopt;
    uint64_t& half = i < 16 ? h.high : h.low;
    half = (half << 4) | static_cast<uint64_t>(d);
  }
  return h;
}

Hash128 HashBytes(const void* data, size_t size) { return internal::Xxh3().hash(data, size); }

namespace internal {
extern const Xxh3Kernel kXxh3Baseline;
#if defined(__x86_64__)
extern const Xxh3Kernel kXxh3Avx2;
extern const Xxh3Kernel kXxh3Avx512;
#endif

std::vector<const Xxh3Kernel*> Xxh3Kernels() {
  std::vector<const Xxh3Kernel*> out = {&kXxh3Baseline};
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) out.push_back(&kXxh3Avx2);
  if (__builtin_cpu_supports("avx512f")) out.push_back(&kXxh3Avx512);
#endif
  return out;
}

const Xxh3Kernel& Xxh3() {
  static const Xxh3Kernel& best = *Xxh3Kernels().back();
  return best;
}
}  // namespace internal

}  // namespace ckptio
