#include "strict_json.h"

#include <algorithm>
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

// Builds the document from SAX events, refusing a key repeated within one
// object: one pass, and the check is a lookup in the object being built.
// (nlohmann's own parse keeps the last value silently, and its callback
// parser rescans the parent object at every object's end: quadratic in a
// 10,000-tensor header.)
class StrictBuilder : public nlohmann::json_sax<json> {
 public:
  explicit StrictBuilder(json& root) : root_(root) {}

  std::string duplicate;  // set when the parse stopped at a repeated key
  std::string error;      // set on a syntax error

  bool null() override { return Put(nullptr); }
  bool boolean(bool v) override { return Put(v); }
  bool number_integer(number_integer_t v) override { return Put(v); }
  bool number_unsigned(number_unsigned_t v) override { return Put(v); }
  bool number_float(number_float_t v, const string_t&) override { return Put(v); }
  bool string(string_t& v) override { return Put(std::move(v)); }
  bool binary(binary_t& v) override { return Put(json::binary(std::move(v))); }
  bool start_object(std::size_t) override {
    Put(json::object());
    stack_.push_back(last_);
    return true;
  }
  bool key(string_t& k) override {
    // try_emplace leaves `k` alone when the key is there already.
    auto [it, added] = stack_.back()->get_ref<json::object_t&>().try_emplace(std::move(k));
    if (!added) {
      duplicate = k;
      return false;  // stop: the first one is enough
    }
    slot_ = &it->second;
    return true;
  }
  bool end_object() override {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    Put(json::array());
    stack_.push_back(last_);
    return true;
  }
  bool end_array() override {
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = e.what();
    return false;
  }

 private:
  // Places a value where the document expects the next one (last_ points
  // at it). Always true: the SAX callbacks' "go on".
  template <typename V>
  bool Put(V&& v) {
    if (stack_.empty()) {
      root_ = json(std::forward<V>(v));
      last_ = &root_;
    } else if (json& parent = *stack_.back(); parent.is_array()) {
      parent.push_back(json(std::forward<V>(v)));
      last_ = &parent.back();
    } else {
      *slot_ = json(std::forward<V>(v));
      last_ = slot_;
    }
    return true;
  }

  json& root_;                // the document
  std::vector<json*> stack_;  // the open objects and arrays, innermost last
  json* slot_ = nullptr;      // the member of the innermost object named by the last key
  json* last_ = nullptr;      // the value Put placed last
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
  json root;
  StrictBuilder builder(root);
  if (!json::sax_parse(bytes.begin(), bytes.end(), &builder)) {
    if (!builder.duplicate.empty())
      return error("member \"" + Printable(builder.duplicate) + "\" appears twice");
    // nlohmann quotes the bytes it choked on: raw, maybe not UTF-8.
    return error("is not valid JSON (torn or corrupt): " + Printable(builder.error));
  }
  return root;
}

}  // namespace ckptio
