#include "strict_json.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

#include "text.h"

namespace ckptio {
namespace {

using json = nlohmann::json;
using Type = JsonValue::Type;

// Builds the tape from SAX events in one pass, refusing a key repeated
// within one object and nesting past the limit. (nlohmann's own parse keeps
// the last of a repeated key silently, and its callback parser rescans the
// parent object at every object's end: quadratic in a 10,000-tensor header.)
class TapeBuilder : public nlohmann::json_sax<json> {
 public:
  TapeBuilder(JsonTape& tape, int max_depth, const StreamedArray* streamed)
      : tape_(tape), max_depth_(max_depth), streamed_(streamed) {}

  std::string duplicate;  // set when the parse stopped at a repeated key
  std::string error;      // set on a syntax error
  bool too_deep = false;  // set when the parse stopped at nesting past max_depth

  bool null() override { return Add(Type::kNull), Scalar(); }
  bool boolean(bool v) override { return Add(Type::kBool).boolean = v, Scalar(); }
  bool number_integer(number_integer_t v) override { return Add(Type::kInt).integer = v, Scalar(); }
  bool number_unsigned(number_unsigned_t v) override {
    return Add(Type::kUint).unsigned_integer = v, Scalar();
  }
  bool number_float(number_float_t v, const string_t&) override {
    return Add(Type::kFloat).number = v, Scalar();
  }
  bool string(string_t& v) override {
    JsonValue& value = Add(Type::kString);
    value.str.pos = Text(v, &value.str.len);
    return Scalar();
  }
  bool binary(binary_t&) override { return false; }  // not produced by the text parser
  bool start_object(std::size_t) override { return Open(Type::kObject); }
  bool start_array(std::size_t) override { return Open(Type::kArray); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }
  bool key(string_t& k) override {
    Frame& f = open_.back();
    bool repeated = false;
    if (f.names) {
      repeated = !f.names->insert(k).second;
    } else {
      for (size_t m = f.first_member; m < members_.size() && !repeated; ++m)
        repeated = tape_.key(members_[m]) == k;
      if (!repeated && members_.size() - f.first_member >= kLinearKeys) {
        // A large object (metadata): a set from here on, not a scan per key.
        f.names = std::make_unique<std::unordered_set<std::string>>();
        for (size_t m = f.first_member; m < members_.size(); ++m)
          f.names->emplace(tape_.key(members_[m]));
        f.names->insert(k);
      }
    }
    if (repeated) {
      duplicate = k;
      return false;  // stop: the first one is enough
    }
    key_pos_ = Text(k, &key_len_);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = e.what();
    return false;
  }

 private:
  static constexpr size_t kLinearKeys = 16;

  struct Frame {
    uint32_t index;                                          // the container's place in the tape
    size_t first_member;                                     // where its members start in members_
    std::unique_ptr<std::unordered_set<std::string>> names;  // large objects only
  };

  // Appends `s` to the tape's text; returns where it starts.
  uint32_t Text(const std::string& s, uint32_t* len) {
    const auto pos = static_cast<uint32_t>(tape_.text.size());
    tape_.text += s;
    *len = static_cast<uint32_t>(s.size());
    return pos;
  }

  // Whether the innermost open container is the streamed array.
  bool InStreamed() const { return !open_.empty() && open_.back().index == streamed_index_; }

  // A streamed array's element `i` is whole: handed over, then dropped.
  void Streamed(uint32_t i) {
    streamed_->element(tape_, i, streamed_count_++);
    tape_.values.resize(i);
    tape_.text.resize(element_text_);
  }

  // After a number, string, bool or null.
  bool Scalar() {
    if (InStreamed()) Streamed(static_cast<uint32_t>(tape_.values.size() - 1));
    return true;
  }

  // Appends a value where the document expects the next one.
  JsonValue& Add(Type type) {
    if (InStreamed()) element_text_ = tape_.text.size();
    const auto index = static_cast<uint32_t>(tape_.values.size());
    JsonValue& v = tape_.values.emplace_back();
    v.type = type;
    v.end = index + 1;
    if (!open_.empty()) {
      JsonValue& parent = tape_.values[open_.back().index];
      ++parent.count;
      if (parent.is_object()) {
        v.key_pos = key_pos_;
        v.key_len = key_len_;
        members_.push_back(index);
      }
    }
    return v;
  }

  bool Open(Type type) {
    if (static_cast<int>(open_.size()) >= max_depth_) {
      too_deep = true;
      return false;
    }
    Add(type);
    const auto index = static_cast<uint32_t>(tape_.values.size() - 1);
    if (streamed_ && type == Type::kArray && open_.size() == 1 && tape_[0].is_object() &&
        tape_.key(index) == streamed_->member)
      streamed_index_ = index;
    open_.push_back({index, members_.size(), nullptr});
    return true;
  }

  bool Close() {
    const uint32_t index = open_.back().index;
    tape_.values[index].end = static_cast<uint32_t>(tape_.values.size());
    members_.resize(open_.back().first_member);
    open_.pop_back();
    if (InStreamed()) Streamed(index);
    return true;
  }

  JsonTape& tape_;
  const int max_depth_;
  const StreamedArray* const streamed_;
  uint32_t streamed_index_ = UINT32_MAX;  // the streamed array's place, once open
  size_t streamed_count_ = 0;             // its elements so far
  size_t element_text_ = 0;               // the text's size where its element began
  std::vector<Frame> open_;               // the open objects and arrays, innermost last
  std::vector<uint32_t> members_;         // the members so far of each open object, by frame
  uint32_t key_pos_ = 0, key_len_ = 0;    // the last key, for the value that follows
};

}  // namespace

Result<JsonTape> ParseStrictJson(std::string_view bytes, int max_depth, std::string_view where,
                                 const StreamedArray* streamed) {
  auto error = [&](const std::string& what) {
    return Status(Code::kDataLoss, std::string(where) + ": " + what);
  };
  if (const void* nul = std::memchr(bytes.data(), '\0', bytes.size()))
    return error("contains a NUL byte at offset " +
                 std::to_string(static_cast<const char*>(nul) - bytes.data()) +
                 " (torn or corrupt)");
  if (bytes.size() > UINT32_MAX) return error("is over 4 GiB");  // the tape's offsets
  JsonTape tape;
  if (!streamed) {
    // Reserved once, at most what the text can hold: every value but the
    // first follows a ',', '[' or '{' (a 10,000-tensor header is 90,000
    // values; grown by doubling, the tape touched twice the memory, and in
    // a fresh process every new page is a fault). At most 1M values (32 MB,
    // touched only as filled): a hostile text of commas in strings gets no
    // more.
    size_t values = 1;
    for (char c : bytes) values += c == ',' || c == '[' || c == '{';
    tape.values.reserve(std::min<size_t>(values, 1 << 20));
    tape.text.reserve(bytes.size());
  }
  TapeBuilder builder(tape, max_depth, streamed);
  if (!json::sax_parse(bytes.begin(), bytes.end(), &builder)) {
    if (builder.too_deep)
      return error("nests deeper than " + std::to_string(max_depth) + " levels");
    if (!builder.duplicate.empty())
      return error("member \"" + Printable(builder.duplicate) + "\" appears twice");
    // nlohmann quotes the bytes it choked on: raw, maybe not UTF-8.
    return error("is not valid JSON (torn or corrupt): " + Printable(builder.error));
  }
  return tape;
}

json TapeToJson(const JsonTape& tape, uint32_t i) {
  const JsonValue& v = tape[i];
  switch (v.type) {
    case Type::kNull:
      return nullptr;
    case Type::kBool:
      return v.boolean;
    case Type::kInt:
      return v.integer;
    case Type::kUint:
      return v.unsigned_integer;
    case Type::kFloat:
      return v.number;
    case Type::kString:
      return std::string(tape.str(i));
    case Type::kObject: {
      json out = json::object();
      for (uint32_t j = JsonTape::first(i); j < v.end; j = tape[j].end)
        out[std::string(tape.key(j))] = TapeToJson(tape, j);
      return out;
    }
    case Type::kArray: {
      json out = json::array();
      for (uint32_t j = JsonTape::first(i); j < v.end; j = tape[j].end)
        out.push_back(TapeToJson(tape, j));
      return out;
    }
  }
  return nullptr;
}

}  // namespace ckptio
