// libFuzzer target: URIs, keys, prefixes, object names, step directory names.
// A name that validates must be safe: relative, no '..' or '.', no NUL.
#include <cstdlib>
#include <string_view>

#include "ckptio/backend.h"
#include "ckptio/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto uri = ckptio::Uri::Parse(text); uri.ok()) {
    if (uri->scheme.empty()) std::abort();
  }
  if (ckptio::ValidateKey(text).ok()) {
    if (text.empty() || text.front() == '/' || text.find('\0') != std::string_view::npos ||
        text.find("//") != std::string_view::npos || text == "." || text == ".." ||
        text.substr(0, 3) == "../" || text.find("/../") != std::string_view::npos ||
        text.find("/./") != std::string_view::npos || text.size() > ckptio::kMaxKeyLength)
      std::abort();
  }
  (void)ckptio::ValidatePrefix(text);
  if (ckptio::ValidateObjectName(text).ok() && text.find('/') != std::string_view::npos)
    std::abort();
  int64_t step = ckptio::ParseStepDirName(text);
  if (step >= 0 && ckptio::StepDirName(step) != text) std::abort();
  return 0;
}
