// XXH3-128 checksums as ckptio records them.
//
// The hex form is xxHash's canonical one (high 64 bits first, lowercase), the
// same string `xxh128sum` prints, so any object can be checked by hand.
#ifndef CKPTIO_HASH_H_
#define CKPTIO_HASH_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "ckptio/export.h"

namespace ckptio {

struct CKPTIO_EXPORT Hash128 {
  uint64_t high = 0;
  uint64_t low = 0;

  bool operator==(const Hash128& o) const { return high == o.high && low == o.low; }
  bool operator!=(const Hash128& o) const { return !(*this == o); }

  // 32 lowercase hex digits.
  std::string Hex() const;
  // Parses exactly 32 hex digits (either case); nullopt otherwise.
  static std::optional<Hash128> FromHex(std::string_view hex);
};

// One-shot XXH3-128 of a buffer.
CKPTIO_EXPORT Hash128 HashBytes(const void* data, size_t size);
inline Hash128 HashBytes(std::string_view s) { return HashBytes(s.data(), s.size()); }

// Streaming XXH3-128. Not thread-safe; cheap to move.
class CKPTIO_EXPORT Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(Hasher&&) noexcept;
  Hasher& operator=(Hasher&&) noexcept;

  void Update(const void* data, size_t size);
  // The hash of everything passed to Update since construction or Reset().
  Hash128 Digest() const;
  void Reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ckptio

#endif  // CKPTIO_HASH_H_
