// libFuzzer target: the safetensors header reader, on a whole file. Anything
// it accepts must index the data section exactly: tensors in order, each
// where its dtype and shape say, no overlap, no hole, nothing after.
#include <cstdlib>
#include <string_view>

#include "ckptio/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view file(reinterpret_cast<const char*>(data), size);
  auto h = ckptio::ParseSafetensorsHeader(file, size, "fuzz.safetensors");
  if (!h.ok()) {
    if (h.status().message().empty()) std::abort();  // every error says something
    return 0;
  }
  uint64_t pos = h->data_start;
  for (const auto& t : h->tensors) {
    if (t.offset != pos || t.length > size - pos) std::abort();
    uint64_t count = 1;
    for (int64_t d : t.shape) count *= static_cast<uint64_t>(d);
    if (t.length % (count == 0 ? 1 : count) != 0 || (count == 0) != (t.length == 0)) std::abort();
    pos += t.length;
  }
  if (pos != size) std::abort();
  return 0;
}
