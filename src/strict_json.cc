#include "strict_json.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "text.h"

namespace ckptio {
namespace {

using json = nlohmann::json;

// The deepest nesting of arrays and objects in `text`, outside strings.
int JsonDepth(std::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

}  // namespace

Result<json> ParseStrictJson(std::string_view bytes, int max_depth, std::string_view where) {
  auto error = [&](const std::string& what) {
    return Status(Code::kDataLoss, std::string(where) + ": " + what);
  };
  if (bytes.find('\0') != std::string_view::npos)
    return error("contains a NUL byte at offset " + std::to_string(bytes.find('\0')) +
                 " (torn or corrupt)");
  if (JsonDepth(bytes) > max_depth)
    return error("nests deeper than " + std::to_string(max_depth) + " levels");
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      keys.pop_back();
    } else if (event == json::parse_event_t::key) {
      if (!keys.back().insert(parsed.get<std::string>()).second && duplicate.empty())
        duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json obj;
  try {
    obj = json::parse(bytes.begin(), bytes.end(), callback);
  } catch (const json::exception& e) {
    return error(std::string("is not valid JSON (torn or corrupt): ") + e.what());
  }
  if (!duplicate.empty()) return error("member \"" + Printable(duplicate) + "\" appears twice");
  return obj;
}

}  // namespace ckptio
