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

// A SAX pass that finds the first key repeated within one object. (A parse
// callback could do it too, but nlohmann's callback parser rescans the
// parent object at every object's end: quadratic in a 10,000-tensor header.)
class DuplicateKeyFinder : public nlohmann::json_sax<json> {
 public:
  std::string duplicate;

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& k) override {
    if (!keys_.back().insert(k).second) {
      duplicate = k;
      return false;  // stop: the first one is enough
    }
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  std::vector<std::set<std::string>> keys_;
};

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
  json obj;
  try {
    obj = json::parse(bytes.begin(), bytes.end());
  } catch (const json::exception& e) {
    return error(std::string("is not valid JSON (torn or corrupt): ") + e.what());
  }
  DuplicateKeyFinder finder;
  json::sax_parse(bytes.begin(), bytes.end(), &finder);
  if (!finder.duplicate.empty())
    return error("member \"" + Printable(finder.duplicate) + "\" appears twice");
  return obj;
}

}  // namespace ckptio
