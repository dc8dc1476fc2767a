// libFuzzer target: LATEST, the writer record and coordination records.
#include <cstdlib>
#include <string_view>

#include "ckptio/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (auto l = ckptio::ParseLatest(bytes, "fuzz/LATEST"); l.ok()) {
    auto back = ckptio::ParseLatest(ckptio::SerializeLatest(*l), "again");
    if (!back.ok() || back->step != l->step || back->manifest_hash != l->manifest_hash)
      std::abort();
  }
  if (auto w = ckptio::ParseWriterRecord(bytes, "fuzz/.writer"); w.ok()) {
    auto back = ckptio::ParseWriterRecord(ckptio::SerializeWriterRecord(*w), "again");
    if (!back.ok() || back->generation != w->generation) std::abort();
  }
  if (auto r = ckptio::ParseRecord(bytes, "ckptio-save", "fuzz/.coord/save"); r.ok()) {
    auto back =
        ckptio::ParseRecord(ckptio::SerializeRecord("ckptio-save", *r), "ckptio-save", "again");
    if (!back.ok() || *back != *r) std::abort();
  }
  return 0;
}
