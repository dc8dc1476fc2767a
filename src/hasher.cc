// Hasher: XXH3-128 over a stream, the hash of every object a save writes
// (kept apart from hash.cc so that ckptio-bench-save-unhashed can stand a
// Hasher that does no work in for it: tools/bench/null_hasher.cc).
#include "ckptio/hash.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t's definition
#include <xxhash.h>

#include "xxh3_dispatch.h"

namespace ckptio {

struct Hasher::State {
  XXH3_state_t xxh;  // used only through internal::Xxh3()
};

Hasher::Hasher() : state_(std::make_unique<State>()) { Reset(); }
Hasher::~Hasher() = default;
Hasher::Hasher(Hasher&&) noexcept = default;
Hasher& Hasher::operator=(Hasher&&) noexcept = default;

void Hasher::Update(const void* data, size_t size) {
  internal::Xxh3().update(&state_->xxh, data, size);
}

Hash128 Hasher::Digest() const { return internal::Xxh3().digest(&state_->xxh); }

void Hasher::Reset() { internal::Xxh3().reset(&state_->xxh); }

}  // namespace ckptio
