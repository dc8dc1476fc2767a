// Strict JSON parsing shared by the manifest and safetensors readers
// (internal): one document, no NUL bytes, bounded nesting, no repeated
// member names (nlohmann would silently keep the last).
//
// The document comes back as a tape: its values in document order, each
// container followed by its contents, and every key and string in one
// buffer. A 10,000-tensor manifest or header parses into it in under half
// the time of a nlohmann tree (a map node and a string per member there).
#ifndef CKPTIO_SRC_STRICT_JSON_H_
#define CKPTIO_SRC_STRICT_JSON_H_

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio {

struct JsonValue {
  // nlohmann's number kinds: kUint for integers >= 0, kInt for negative
  // ones, kFloat for everything else.
  enum class Type : uint8_t { kNull, kBool, kInt, kUint, kFloat, kString, kObject, kArray };
  Type type = Type::kNull;
  // The index just past this value and everything inside it, which is the
  // next member or element of its container.
  uint32_t end = 0;
  uint32_t count = 0;                 // objects and arrays: how many members or elements
  uint32_t key_pos = 0, key_len = 0;  // an object member's name, in JsonTape::text
  union {
    struct {
      uint32_t pos, len;
    } str;  // kString: the value, in JsonTape::text
    bool boolean;
    int64_t integer;
    uint64_t unsigned_integer;
    double number;
  };

  JsonValue() : unsigned_integer(0) {}
  bool is_object() const { return type == Type::kObject; }
  bool is_array() const { return type == Type::kArray; }
  bool is_string() const { return type == Type::kString; }
  bool is_unsigned() const { return type == Type::kUint; }
  bool is_integer() const { return type == Type::kUint || type == Type::kInt; }
};

struct JsonTape {
  std::vector<JsonValue> values;  // values[0] is the document
  std::string text;               // every key and string value, back to back

  const JsonValue& operator[](uint32_t i) const { return values[i]; }
  std::string_view key(uint32_t i) const {
    return std::string_view(text).substr(values[i].key_pos, values[i].key_len);
  }
  std::string_view str(uint32_t i) const {
    return std::string_view(text).substr(values[i].str.pos, values[i].str.len);
  }
  // The members or elements of container `i`, in order:
  // for (uint32_t j = tape.first(i); j < tape[i].end; j = tape[j].end).
  static uint32_t first(uint32_t i) { return i + 1; }
};

// The elements of one array, a member of the document (an object), handed
// over one by one as the parse ends each, then dropped from the tape: a
// 10,000-tensor manifest's entries never all sit in it (5 MB of tape, each
// page of it a fault in a fresh process). The array stays in the tape with
// its count and no elements.
struct StreamedArray {
  std::string_view member;
  // Element `index` of the array: tape[i] and what it holds, valid during
  // the call only.
  std::function<void(const JsonTape& tape, uint32_t i, size_t index)> element;
};

// Errors are kDataLoss, "<where>: <what is wrong>".
CKPTIO_EXPORT_PRIVATE Result<JsonTape> ParseStrictJson(std::string_view bytes, int max_depth,
                                                       std::string_view where,
                                                       const StreamedArray* streamed = nullptr);

// values[i] (and what it holds) as a nlohmann tree: for the rare reader that
// needs one (re-serialising a manifest whose bytes are not canonical).
CKPTIO_EXPORT_PRIVATE nlohmann::json TapeToJson(const JsonTape& tape, uint32_t i = 0);

}  // namespace ckptio

#endif  // CKPTIO_SRC_STRICT_JSON_H_
