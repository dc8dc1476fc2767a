// Hasher: XXH3-128 over a stream, the hash of every object a save writes
// (kept apart from hash.cc so that ckptio-bench-save-unhashed can stand a
// Hasher that does no work in for it: tools/bench/null_hasher.cc).
#include "ckptio/hash.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ckptio {

struct Hasher::State {
  XXH3_state_t xxh;
};

Hasher::Hasher() : state_(std::make_unique<State>()) { Reset(); }
Hasher::~Hasher() = default;
Hasher::Hasher(Hasher&&) noexcept = default;
Hasher& Hasher::operator=(Hasher&&) noexcept = default;

void Hasher::Update(const void* data, size_t size) {
  XXH3_128bits_update(&state_->xxh, data, size);
}

Hash128 Hasher::Digest() const {
  const XXH128_hash_t h = XXH3_128bits_digest(&state_->xxh);
  return Hash128{h.high64, h.low64};
}

void Hasher::Reset() { XXH3_128bits_reset(&state_->xxh); }

}  // namespace ckptio
