// libFuzzer target: ckptio's strict JSON parser against nlohmann's. Both
// must accept and refuse alike (except where the strict parser refuses by
// its own rules: a repeated member name, nesting past the limit, a NUL
// byte) and read the same document where both accept.
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "strict_json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto strict = ckptio::ParseStrictJson(text, 8, "fuzz");
  if (!strict.ok()) {
    const std::string& why = strict.status().message();
    if (why.empty()) std::abort();  // every error says something
    if (why.find("appears twice") != std::string::npos ||
        why.find("nests deeper") != std::string::npos || text.find('\0') != std::string::npos)
      return 0;
  }
  if (strict.ok() != nlohmann::json::accept(text)) std::abort();
  if (strict.ok() && ckptio::TapeToJson(*strict) != nlohmann::json::parse(text)) std::abort();
  return 0;
}
