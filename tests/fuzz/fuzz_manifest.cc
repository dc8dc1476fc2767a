// libFuzzer target: the manifest parser. Anything it accepts must serialise
// and parse back to the same manifest (no crash, leak or hang on any input).
#include <cstdlib>
#include <string_view>

#include "ckptio/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto m = ckptio::ParseManifest(bytes, "fuzz/MANIFEST.json");
  if (!m.ok()) {
    if (m.status().message().empty()) std::abort();  // every error says something
    return 0;
  }
  std::string again = ckptio::SerializeManifest(*m);
  auto m2 = ckptio::ParseManifest(again, "fuzz/reserialised");
  if (!m2.ok() || ckptio::SerializeManifest(*m2) != again) std::abort();
  return 0;
}
