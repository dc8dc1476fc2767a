#include "ckptio/safetensors.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "ckptio/store.h"
#include "safetensors_text.h"
#include "strict_json.h"
#include "text.h"

namespace ckptio {
namespace {

// Every dtype of the safetensors format, with its element size.
size_t AnyDtypeSize(std::string_view dtype) {
  static const std::pair<std::string_view, size_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  for (const auto& [name, size] : kSizes)
    if (name == dtype) return size;
  return 0;
}

void AppendShape(std::string& out, const std::vector<int64_t>& shape) {
  out += '[';
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(shape[i]);
  }
  out += ']';
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s;
  AppendShape(s, shape);
  return s;
}

constexpr std::string_view kHeaderOpen = R"({"__metadata__":{"format":"pt"})";

// ,"<name>":{"data_offsets":[b,e],"dtype":"F32","shape":[...]} for `t`.
Status AppendHeaderEntry(std::string& out, const TensorEntry& t, uint64_t data_start) {
  out += ',';
  if (std::all_of(t.name.begin(), t.name.end(),
                  [](char c) { return c >= 0x20 && c < 0x7f && c != '"' && c != '\\'; })) {
    out += '"';
    out += t.name;
    out += '"';
  } else {
    try {
      out += nlohmann::json(t.name).dump();  // escaped; throws on invalid UTF-8
    } catch (const nlohmann::json::exception&) {
      return Status(Code::kInvalidArgument,
                    "tensor name \"" + Printable(t.name) + "\" is not valid UTF-8");
    }
  }
  const uint64_t begin = t.offset - data_start;
  // Appended piece by piece: no temporaries (10,000 tensors, at every load).
  out += R"(:{"data_offsets":[)";
  out += std::to_string(begin);
  out += ',';
  out += std::to_string(begin + t.length);
  out += R"(],"dtype":")";
  out += t.dtype;
  out += R"(","shape":)";
  AppendShape(out, t.shape);
  out += '}';
  return OkStatus();
}

// The closing brace and the padding that make the data section start
// 8-aligned, for a header text of `size` bytes so far.
std::string HeaderClose(size_t size) { return "}" + std::string((8 - (size + 1) % 8) % 8, ' '); }

}  // namespace

Result<std::string> SafetensorsHeaderText(const std::vector<const TensorEntry*>& tensors,
                                          uint64_t data_start) {
  std::string text(kHeaderOpen);
  text.reserve(text.size() + tensors.size() * 80);
  for (const TensorEntry* t : tensors)
    CKPTIO_RETURN_IF_ERROR(AppendHeaderEntry(text, *t, data_start));
  text += HeaderClose(text.size());
  return text;
}

Result<uint64_t> SafetensorsHeaderSize(std::string_view first8, uint64_t file_size,
                                       std::string_view where) {
  auto error = [&](const std::string& what) {
    return Status(Code::kDataLoss, std::string(where) + ": " + what);
  };
  if (first8.size() < 8 || file_size < 8)
    return error("is " + std::to_string(file_size) +
                 " bytes, too short for a safetensors header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(first8[i]);
  if (n > kMaxSafetensorsHeader)
    return error("header length " + std::to_string(n) + " is over the format's limit of " +
                 std::to_string(kMaxSafetensorsHeader) + " bytes");
  if (n > file_size - 8)
    return error("header length " + std::to_string(n) + " runs past the end of the " +
                 std::to_string(file_size) + "-byte file (truncated?)");
  return 8 + n;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view file, uint64_t file_size,
                                                 std::string_view where) {
  auto error = [&](const std::string& what) {
    return Status(Code::kDataLoss, std::string(where) + ": " + what);
  };
  CKPTIO_ASSIGN_OR_RETURN(uint64_t header_size, SafetensorsHeaderSize(file, file_size, where));
  if (file.size() < header_size)
    return Status(Code::kInvalidArgument, std::string(where) + ": " + std::to_string(header_size) +
                                              " header bytes needed, " +
                                              std::to_string(file.size()) + " given");
  std::string_view text = file.substr(8, header_size - 8);
  if (text.empty() || text.front() != '{') return error("header does not start with '{'");
  CKPTIO_ASSIGN_OR_RETURN(JsonTape tape, ParseStrictJson(text, 3, std::string(where) + " header"));
  if (!tape[0].is_object()) return error("header is not a JSON object");
  if (tape[0].count > kMaxTensors + 1)
    return error("header lists more than " + std::to_string(kMaxTensors) + " tensors");

  SafetensorsHeader h;
  h.data_start = header_size;
  h.tensors.reserve(tape[0].count);
  const uint64_t data_size = file_size - header_size;
  for (uint32_t i = JsonTape::first(0); i < tape[0].end; i = tape[i].end) {
    const std::string_view name = tape.key(i);
    const JsonValue& v = tape[i];
    const std::string at = "tensor \"" + Printable(name) + "\"";
    if (name == "__metadata__") {
      if (!v.is_object()) return error("__metadata__ is not an object");
      for (uint32_t m = JsonTape::first(i); m < v.end; m = tape[m].end) {
        if (!tape[m].is_string())
          return error("__metadata__ \"" + Printable(tape.key(m)) + "\" is not a string");
        h.metadata[std::string(tape.key(m))] = tape.str(m);
      }
      continue;
    }
    if (!v.is_object()) return error(at + " is not an object");
    uint32_t dtype = v.end, shape = v.end, offsets = v.end;
    for (uint32_t m = JsonTape::first(i); m < v.end; m = tape[m].end) {
      const std::string_view key = tape.key(m);
      if (key == "dtype")
        dtype = m;
      else if (key == "shape")
        shape = m;
      else if (key == "data_offsets")
        offsets = m;
      else
        return error(at + " has unknown member \"" + Printable(key) + "\"");
    }
    if (dtype == v.end || !tape[dtype].is_string()) return error(at + ": dtype missing");
    if (shape == v.end || !tape[shape].is_array()) return error(at + ": shape missing");
    if (offsets == v.end || !tape[offsets].is_array() || tape[offsets].count != 2 ||
        !tape[offsets + 1].is_unsigned() || !tape[offsets + 2].is_unsigned())
      return error(at + ": data_offsets must be two non-negative integers");
    TensorEntry e;
    e.name = name;
    e.object = std::string(where);
    e.dtype = tape.str(dtype);
    const size_t elem = AnyDtypeSize(e.dtype);
    if (elem == 0) return error(at + ": unknown dtype \"" + Printable(e.dtype) + "\"");
    if (tape[shape].count > kMaxTensorRank)
      return error(at + ": shape has more than " + std::to_string(kMaxTensorRank) + " sizes");
    uint64_t count = 1, span = 1;  // span: the product of the nonzero sizes
    for (uint32_t d = JsonTape::first(shape); d < tape[shape].end; d = tape[d].end) {
      if (!tape[d].is_unsigned()) return error(at + ": shape sizes must be non-negative integers");
      const uint64_t dim = tape[d].unsigned_integer;
      if (dim > static_cast<uint64_t>(INT64_MAX))
        return error(at + ": shape size " + std::to_string(dim) + " is not a tensor size");
      // Before multiplying: a product past the data section (or 2^64) is refused.
      if (dim != 0 && count > data_size / dim) return error(at + ": shape is larger than the file");
      // A zero-size tensor's strides are the product of the others: bounded.
      if (dim != 0 && span > kMaxObjectBytes / dim)
        return error(at + ": shape has too many elements");
      count *= dim;
      span *= std::max<uint64_t>(dim, 1);
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    // data_offsets holds two numbers, so they follow it in the tape.
    const uint64_t begin = tape[offsets + 1].unsigned_integer;
    const uint64_t end = tape[offsets + 2].unsigned_integer;
    if (begin > end || end > data_size)
      return error(at + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                   "] are outside the " + std::to_string(data_size) + "-byte data section");
    if (end - begin != count * elem)
      return error(at + ": data_offsets span " + std::to_string(end - begin) + " bytes but " +
                   e.dtype + " " + ShapeText(e.shape) + " needs " + std::to_string(count * elem));
    e.offset = header_size + begin;
    e.length = end - begin;
    h.tensors.push_back(std::move(e));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.offset, a.length, a.name) < std::tie(b.offset, b.length, b.name);
  });
  uint64_t pos = header_size;
  for (const TensorEntry& e : h.tensors) {
    if (e.offset != pos)
      return error("tensor \"" + Printable(e.name) + "\" starts at data offset " +
                   std::to_string(e.offset - header_size) + ", expected " +
                   std::to_string(pos - header_size) +
                   (e.offset < pos ? " (tensors overlap)" : " (a hole in the data section)"));
    pos += e.length;
  }
  if (pos != file_size)
    return error("the data section has " + std::to_string(file_size - pos) +
                 " bytes no tensor indexes");
  return h;
}

bool IsCkptioSafetensorsHeader(const Manifest& manifest, const std::string& object,
                               std::string_view head) {
  const uint64_t data_start = head.size();
  const ObjectEntry* entry = manifest.Find(object);
  // ckptio's file order: by offset; at one offset (empty tensors before a
  // nonempty one) larger elements first, then by name. (The element size is
  // looked up once per tensor, not per comparison: 10,000 tensors.)
  struct Placed {
    uint64_t offset;
    size_t element;
    const TensorEntry* t;
  };
  std::vector<Placed> tensors;
  for (const TensorEntry& t : manifest.tensors) {
    if (t.object != object) continue;
    if (t.name == "__metadata__" || t.offset < data_start) return false;
    tensors.push_back({t.offset, DtypeSize(t.dtype), &t});
  }
  auto before = [](const Placed& a, const Placed& b) {
    if (a.offset != b.offset) return a.offset < b.offset;
    if (a.element != b.element) return a.element > b.element;
    return a.t->name < b.t->name;
  };
  if (!std::is_sorted(tensors.begin(), tensors.end(), before))
    std::sort(tensors.begin(), tensors.end(), before);
  uint64_t pos = data_start;  // no overlaps, no holes, no trailing bytes
  for (const Placed& p : tensors) {
    if (p.offset != pos) return false;
    pos += p.t->length;
  }
  if (!entry || pos != entry->size) return false;
  // Compared entry by entry, without building the whole text.
  std::string_view text = head.substr(8);
  if (text.substr(0, kHeaderOpen.size()) != kHeaderOpen) return false;
  size_t at = kHeaderOpen.size();
  std::string piece;
  for (const Placed& p : tensors) {
    piece.clear();
    if (!AppendHeaderEntry(piece, *p.t, data_start).ok() || text.substr(at, piece.size()) != piece)
      return false;
    at += piece.size();
  }
  return text.substr(at) == HeaderClose(at);
}

namespace {

// Reads the object's first bytes with `read(n)` (a view, valid until the
// next call), and checks its header against the manifest.
template <typename ReadFn>
Status CheckHeader(const Manifest& manifest, const std::string& object, ReadFn&& read) {
  const std::string where = "step " + std::to_string(manifest.step) + ", object " + object;
  const ObjectEntry* entry = manifest.Find(object);
  if (!entry) return Status(Code::kNotFound, where + ": no such object");
  if (entry->size < 8) return Status(Code::kDataLoss, where + ": too short for a safetensors file");
  uint64_t size = 0;
  {
    CKPTIO_ASSIGN_OR_RETURN(std::string_view first8, read(8));  // valid until the next read
    CKPTIO_ASSIGN_OR_RETURN(size, SafetensorsHeaderSize(first8, entry->size, where));
  }
  CKPTIO_ASSIGN_OR_RETURN(std::string_view head, read(size));
  if (IsCkptioSafetensorsHeader(manifest, object, head)) return OkStatus();
  CKPTIO_ASSIGN_OR_RETURN(SafetensorsHeader h, ParseSafetensorsHeader(head, entry->size, where));
  std::map<std::string, const TensorEntry*> in_header;
  for (const TensorEntry& t : h.tensors) in_header[t.name] = &t;
  size_t listed = 0;
  for (const TensorEntry& m : manifest.tensors) {
    if (m.object != object) continue;
    ++listed;
    auto it = in_header.find(m.name);
    if (it == in_header.end())
      return Status(Code::kDataLoss, where + ": the manifest lists tensor \"" + Printable(m.name) +
                                         "\" but the safetensors header does not");
    const TensorEntry& t = *it->second;
    if (t.dtype != m.dtype || t.shape != m.shape || t.offset != m.offset || t.length != m.length)
      return Status(Code::kDataLoss,
                    where + ": tensor \"" + Printable(m.name) + "\" is " + m.dtype + " " +
                        ShapeText(m.shape) + " at bytes [" + std::to_string(m.offset) + ", " +
                        std::to_string(m.offset + m.length) + ") in the manifest but " + t.dtype +
                        " " + ShapeText(t.shape) + " at [" + std::to_string(t.offset) + ", " +
                        std::to_string(t.offset + t.length) + ") in the safetensors header");
  }
  if (listed != h.tensors.size())
    return Status(Code::kDataLoss, where + ": the safetensors header has " +
                                       std::to_string(h.tensors.size()) +
                                       " tensors, the manifest lists " + std::to_string(listed));
  return OkStatus();
}
}  // namespace

Status CheckSafetensorsObject(CheckpointReader& reader, const std::string& object) {
  std::string head;
  return CheckHeader(reader.manifest(), object, [&](uint64_t n) -> Result<std::string_view> {
    head.resize(n);
    CKPTIO_RETURN_IF_ERROR(reader.Read(object, 0, head.data(), n));
    return std::string_view(head);
  });
}

Status CheckSafetensorsObject(const Manifest& manifest, const std::string& object,
                              std::string_view bytes) {
  return CheckHeader(manifest, object, [&](uint64_t n) -> Result<std::string_view> {
    if (n > bytes.size())
      return Status(Code::kDataLoss, "step " + std::to_string(manifest.step) + ", object " +
                                         object + ": shorter than the manifest records");
    return bytes.substr(0, n);
  });
}

}  // namespace ckptio
