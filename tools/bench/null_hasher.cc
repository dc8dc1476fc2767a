// src/hasher.cc for ckptio-bench-save-unhashed only: the streaming Hasher,
// through which ObjectStream::Write hashes every byte saved, does no work
// and digests to zero, so a save measured with it costs what a save would
// without checksums. The rest of the core is the real one (HashBytes is
// XXH3: the manifest's own checksum and LATEST stay valid), so what this
// program writes fails verification on its objects' data, and only there.
// Never linked into anything but that benchmark program.
#include "ckptio/hash.h"

namespace ckptio {

struct Hasher::State {};

Hasher::Hasher() = default;
Hasher::~Hasher() = default;
Hasher::Hasher(Hasher&&) noexcept = default;
Hasher& Hasher::operator=(Hasher&&) noexcept = default;

void Hasher::Update(const void*, size_t) {}

Hash128 Hasher::Digest() const { return Hash128{}; }

void Hasher::Reset() {}

}  // namespace ckptio
