// MANIFEST.json and LATEST: sealed JSON, strict parsing.
#include "ckptio/manifest.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "ckptio/backend.h"
#include "strict_json.h"
#include "text.h"

namespace ckptio {

using json = nlohmann::json;

namespace {

constexpr std::string_view kChecksumKey = "checksum";

// Our files nest three levels deep; anything deeper is hostile (and would
// make nlohmann's recursive dump() overflow the stack).
constexpr int kMaxJsonDepth = 8;

std::string Seal(json obj) {
  // Strings were validated as UTF-8 by the callers; `replace` keeps a bug
  // there from becoming an exception.
  constexpr auto kReplace = json::error_handler_t::replace;
  obj.erase(std::string(kChecksumKey));
  std::string body = obj.dump(-1, ' ', false, kReplace);
  obj[std::string(kChecksumKey)] = HashBytes(body).Hex();
  return obj.dump(1, ' ', false, kReplace) + "\n";
}

// Reads members of one JSON object, remembering which were consumed so that
// unknown members can be reported. Every error names the field's path.
class Fields {
 public:
  Fields(const json& obj, std::string path, std::string_view where)
      : obj_(obj), path_(std::move(path)), where_(where) {}

  Status Error(std::string_view field, std::string_view what) const {
    return Status(Code::kDataLoss,
                  std::string(where_) + ": field '" + Join(field) + "': " + std::string(what));
  }

  Result<const json*> Get(std::string_view name) {
    seen_.insert(std::string(name));
    auto it = obj_.find(std::string(name));
    if (it == obj_.end()) return Error(name, "missing");
    return &*it;
  }

  Result<int64_t> Int(std::string_view name, int64_t lo, int64_t hi) {
    CKPTIO_ASSIGN_OR_RETURN(const json* v, Get(name));
    if (!v->is_number_integer()) return Error(name, "expected an integer");
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
      return Error(name, "out of range");
    int64_t x = v->get<int64_t>();
    if (x < lo || x > hi)
      return Error(name, "value " + std::to_string(x) + " is outside [" + std::to_string(lo) +
                             ", " + std::to_string(hi) + "]");
    return x;
  }

  Result<uint64_t> Uint(std::string_view name, uint64_t lo, uint64_t hi) {
    CKPTIO_ASSIGN_OR_RETURN(const json* v, Get(name));
    if (!v->is_number_unsigned()) return Error(name, "expected an unsigned integer");
    uint64_t x = v->get<uint64_t>();
    if (x < lo || x > hi)
      return Error(name, "value " + std::to_string(x) + " is outside [" + std::to_string(lo) +
                             ", " + std::to_string(hi) + "]");
    return x;
  }

  Result<std::string> Str(std::string_view name, size_t max_bytes) {
    CKPTIO_ASSIGN_OR_RETURN(const json* v, Get(name));
    if (!v->is_string()) return Error(name, "expected a string");
    const auto& s = v->get_ref<const std::string&>();
    if (s.size() > max_bytes)
      return Error(name, "longer than " + std::to_string(max_bytes) + " bytes");
    return s;
  }

  Result<Hash128> Hash(std::string_view name) {
    CKPTIO_ASSIGN_OR_RETURN(std::string s, Str(name, 64));
    auto h = Hash128::FromHex(s);
    if (!h) return Error(name, "expected 32 hex digits (an XXH3-128)");
    return *h;
  }

  // Unknown members are errors: a reader must not silently ignore fields a
  // newer writer relied on.
  Status NoOthers() const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (!seen_.count(it.key())) return Error(it.key(), "unknown field");
    }
    return OkStatus();
  }

  std::string Join(std::string_view field) const {
    return path_.empty() ? Printable(field) : path_ + "." + Printable(field);
  }

 private:
  const json& obj_;
  std::string path_;
  std::string_view where_;
  std::set<std::string> seen_;
};

// Parses `bytes` as one JSON object, strictly, then checks and strips the
// self-checksum.
Result<json> ParseSealed(std::string_view bytes, std::string_view where, size_t max_bytes) {
  auto error = [&](const std::string& what) {
    return Status(Code::kDataLoss, std::string(where) + ": " + what);
  };
  if (bytes.size() > max_bytes)
    return error("is " + std::to_string(bytes.size()) + " bytes, over the " +
                 std::to_string(max_bytes) + "-byte limit");
  if (bytes.empty()) return error("is empty (torn write?)");
  CKPTIO_ASSIGN_OR_RETURN(json obj, ParseStrictJson(bytes, kMaxJsonDepth, where));
  if (!obj.is_object()) return error("expected a JSON object");
  auto it = obj.find(std::string(kChecksumKey));
  if (it == obj.end() || !it->is_string())
    return error("field 'checksum' is missing or not a string");
  // Compared as text: the writer emits lowercase hex, so any other spelling
  // (even one naming the same value) is damage.
  const std::string expected = it->get<std::string>();
  if (!Hash128::FromHex(expected)) return error("field 'checksum' is not 32 hex digits");
  obj.erase(it);
  const std::string actual = HashBytes(obj.dump()).Hex();
  if (actual != expected)
    return error("self-checksum mismatch (expected \"" + Printable(expected) + "\", computed " +
                 actual + "): the file is corrupt");
  return obj;
}

Status CheckFormat(Fields& f, std::string_view expected_format, int supported_version,
                   std::string_view where) {
  CKPTIO_ASSIGN_OR_RETURN(std::string format, f.Str("format", 64));
  if (format != expected_format)
    return f.Error("format", "expected \"" + std::string(expected_format) + "\", found \"" +
                                 Printable(format) + "\"");
  CKPTIO_ASSIGN_OR_RETURN(int64_t version, f.Int("version", 1, INT32_MAX));
  if (version > supported_version)
    return Status(Code::kFailedPrecondition,
                  std::string(where) + ": format version " + std::to_string(version) +
                      " was written by a newer ckptio; this build reads up to " +
                      std::to_string(supported_version) + ": upgrade ckptio");
  return OkStatus();
}

// The "tensors" member: each entry well-formed and inside its object.
Status ParseTensors(Fields& f, Manifest& m, std::string_view where) {
  CKPTIO_ASSIGN_OR_RETURN(const json* tensors, f.Get("tensors"));
  if (!tensors->is_array()) return f.Error("tensors", "expected an array");
  if (tensors->size() > kMaxTensors)
    return f.Error("tensors", "more than " + std::to_string(kMaxTensors) + " tensors");
  std::set<std::pair<std::string, std::string>> seen;
  m.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    const json& t = (*tensors)[i];
    std::string path = "tensors[" + std::to_string(i) + "]";
    if (!t.is_object()) return f.Error(path, "expected an object");
    Fields tf(t, path, where);
    TensorEntry e;
    CKPTIO_ASSIGN_OR_RETURN(e.name, tf.Str("name", 1024));
    if (e.name.empty()) return tf.Error("name", "empty");
    CKPTIO_ASSIGN_OR_RETURN(e.object, tf.Str("object", kMaxKeyComponent + 1));
    const ObjectEntry* obj = m.Find(e.object);
    if (!obj) return tf.Error("object", "names no object of this checkpoint");
    CKPTIO_ASSIGN_OR_RETURN(e.dtype, tf.Str("dtype", 8));
    const size_t elem = DtypeSize(e.dtype);
    if (elem == 0) return tf.Error("dtype", "unknown dtype \"" + Printable(e.dtype) + "\"");
    CKPTIO_ASSIGN_OR_RETURN(const json* shape, tf.Get("shape"));
    if (!shape->is_array() || shape->size() > kMaxTensorRank)
      return tf.Error("shape", "expected an array of at most 32 sizes");
    uint64_t count = 1;
    for (const json& d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > kMaxObjectBytes)
        return tf.Error("shape", "sizes must be non-negative integers");
      uint64_t dim = d.get<uint64_t>();
      count = dim == 0 || count == 0 ? 0 : count * dim;
      if (count > kMaxObjectBytes) return tf.Error("shape", "too many elements");
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    CKPTIO_ASSIGN_OR_RETURN(e.device, tf.Str("device", 64));
    CKPTIO_ASSIGN_OR_RETURN(e.offset, tf.Uint("offset", 0, obj->size));
    CKPTIO_ASSIGN_OR_RETURN(e.length, tf.Uint("length", 0, obj->size - e.offset));
    if (e.length != count * elem)
      return tf.Error("length", "is " + std::to_string(e.length) + " but dtype and shape need " +
                                    std::to_string(count * elem));
    CKPTIO_RETURN_IF_ERROR(tf.NoOthers());
    if (!seen.emplace(e.object, e.name).second)
      return tf.Error("name", "tensor \"" + Printable(e.name) + "\" appears twice in " + e.object);
    m.tensors.push_back(std::move(e));
  }
  return OkStatus();
}

}  // namespace

size_t DtypeSize(std::string_view dtype) {
  static const std::pair<std::string_view, size_t> kSizes[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  for (const auto& [name, size] : kSizes)
    if (name == dtype) return size;
  return 0;
}

Status ValidateObjectName(std::string_view name) {
  if (name.find('/') != std::string_view::npos)
    return Status(Code::kInvalidArgument, "invalid object name \"" + Printable(name) +
                                              "\": object names are flat, '/' is not allowed");
  if (!name.empty() && name.front() == '.')
    return Status(Code::kInvalidArgument, "invalid object name \"" + Printable(name) +
                                              "\": names starting with '.' are reserved");
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "manifest.json")  // also on case-insensitive file systems
    return Status(Code::kInvalidArgument,
                  "invalid object name \"MANIFEST.json\": reserved for the manifest");
  return ValidateKey(name);
}

const ObjectEntry* Manifest::Find(std::string_view name) const {
  auto it = std::lower_bound(objects.begin(), objects.end(), name,
                             [](const ObjectEntry& e, std::string_view n) { return e.name < n; });
  return it != objects.end() && it->name == name ? &*it : nullptr;
}

uint64_t Manifest::TotalBytes() const {
  uint64_t total = 0;
  for (const auto& o : objects) total += o.size;
  return total;
}

namespace {
json ManifestJson(const Manifest& m) {
  json objects = json::array();
  for (const auto& o : m.objects) {
    json chunks = json::array();
    for (const auto& c : o.chunks) chunks.push_back(c.Hex());
    objects.push_back({{"name", o.name},
                       {"size", o.size},
                       {"chunk_size", o.chunk_size},
                       {"xxh3_128", o.hash.Hex()},
                       {"chunks", std::move(chunks)}});
  }
  json tensors = json::array();
  for (const auto& t : m.tensors) {
    // Sizes as the parser sees them in text: unsigned when not negative.
    json shape = json::array();
    for (int64_t d : t.shape) shape.push_back(d < 0 ? json(d) : json(static_cast<uint64_t>(d)));
    tensors.push_back({{"name", t.name},
                       {"object", t.object},
                       {"dtype", t.dtype},
                       {"shape", std::move(shape)},
                       {"device", t.device},
                       {"offset", t.offset},
                       {"length", t.length}});
  }
  json obj = {{"format", "ckptio-manifest"},
              {"version", m.format_version},
              {"step", m.step},
              {"generation", m.generation},
              {"world_size", m.world_size},
              {"saving_rank", m.saving_rank},
              {"created_unix_ms", m.created_unix_ms},
              {"writer", m.writer},
              {"objects", std::move(objects)},
              {"tensors", std::move(tensors)},
              {"metadata", m.metadata}};
  return obj;
}

// A manifest from its JSON (without the checksum), checked as readers check it.
Result<Manifest> ManifestFromJson(const json& obj, std::string_view where) {
  Fields f(obj, "", where);
  CKPTIO_RETURN_IF_ERROR(CheckFormat(f, "ckptio-manifest", kManifestFormatVersion, where));
  Manifest m;
  m.format_version = kManifestFormatVersion;
  CKPTIO_ASSIGN_OR_RETURN(m.step, f.Int("step", 0, kMaxStep));
  CKPTIO_ASSIGN_OR_RETURN(m.generation, f.Int("generation", 1, INT64_MAX));
  CKPTIO_ASSIGN_OR_RETURN(m.world_size, f.Int("world_size", 1, 1 << 24));
  CKPTIO_ASSIGN_OR_RETURN(m.saving_rank, f.Int("saving_rank", 0, m.world_size - 1));
  CKPTIO_ASSIGN_OR_RETURN(m.created_unix_ms, f.Int("created_unix_ms", 0, INT64_MAX));
  CKPTIO_ASSIGN_OR_RETURN(m.writer, f.Str("writer", 512));

  CKPTIO_ASSIGN_OR_RETURN(const json* objects, f.Get("objects"));
  if (!objects->is_array()) return f.Error("objects", "expected an array");
  if (objects->size() > kMaxObjects)
    return f.Error("objects", "more than " + std::to_string(kMaxObjects) + " objects");
  m.objects.reserve(objects->size());
  for (size_t i = 0; i < objects->size(); ++i) {
    const json& o = (*objects)[i];
    std::string path = "objects[" + std::to_string(i) + "]";
    if (!o.is_object()) return f.Error(path, "expected an object");
    Fields of(o, path, where);
    ObjectEntry e;
    CKPTIO_ASSIGN_OR_RETURN(e.name, of.Str("name", kMaxKeyComponent + 1));
    Status name_ok = ValidateObjectName(e.name);
    if (!name_ok.ok()) return of.Error("name", name_ok.message());
    CKPTIO_ASSIGN_OR_RETURN(e.size, of.Uint("size", 0, kMaxObjectBytes));
    CKPTIO_ASSIGN_OR_RETURN(e.chunk_size, of.Uint("chunk_size", kMinChunkBytes, kMaxChunkBytes));
    CKPTIO_ASSIGN_OR_RETURN(e.hash, of.Hash("xxh3_128"));
    CKPTIO_ASSIGN_OR_RETURN(const json* chunks, of.Get("chunks"));
    if (!chunks->is_array()) return of.Error("chunks", "expected an array");
    uint64_t want = ObjectEntry::ChunkCount(e.size, e.chunk_size);
    if (chunks->size() != want)
      return of.Error("chunks", "has " + std::to_string(chunks->size()) +
                                    " entries; size and chunk_size imply " + std::to_string(want));
    e.chunks.reserve(chunks->size());
    for (size_t c = 0; c < chunks->size(); ++c) {
      const json& h = (*chunks)[c];
      auto parsed = h.is_string() ? Hash128::FromHex(h.get<std::string>()) : std::nullopt;
      if (!parsed)
        return of.Error("chunks[" + std::to_string(c) + "]",
                        "expected 32 hex digits (an XXH3-128)");
      e.chunks.push_back(*parsed);
    }
    CKPTIO_RETURN_IF_ERROR(of.NoOthers());
    if (!m.objects.empty() && m.objects.back().name >= e.name)
      return f.Error(path + ".name", m.objects.back().name == e.name
                                         ? "duplicate object name \"" + e.name + "\""
                                         : "objects are not sorted by name");
    m.objects.push_back(std::move(e));
  }

  CKPTIO_RETURN_IF_ERROR(ParseTensors(f, m, where));

  CKPTIO_ASSIGN_OR_RETURN(const json* meta, f.Get("metadata"));
  if (!meta->is_object()) return f.Error("metadata", "expected an object");
  if (meta->size() > kMaxMetadataEntries)
    return f.Error("metadata", "more than " + std::to_string(kMaxMetadataEntries) + " entries");
  for (auto it = meta->begin(); it != meta->end(); ++it) {
    Status ok = ValidateMetadata(it.key(), it->is_string() ? it->get<std::string>() : "");
    if (!ok.ok()) return f.Error("metadata." + it.key(), ok.message());
    if (!it->is_string()) return f.Error("metadata." + it.key(), "expected a string");
    m.metadata.emplace(it.key(), it->get<std::string>());
  }
  CKPTIO_RETURN_IF_ERROR(f.NoOthers());
  return m;
}
}  // namespace

std::string SerializeManifest(const Manifest& m) { return Seal(ManifestJson(m)); }

Result<std::string> SerializeCheckedManifest(const Manifest& m, std::string_view where) {
  json obj = ManifestJson(m);
  // The same checks ParseManifest makes, on the tree about to be written
  // (cheaper than writing the text and parsing it back).
  CKPTIO_RETURN_IF_ERROR(ManifestFromJson(obj, where).status());
  return Seal(std::move(obj));
}

Result<Manifest> ParseManifest(std::string_view bytes, std::string_view where) {
  CKPTIO_ASSIGN_OR_RETURN(json obj, ParseSealed(bytes, where, kMaxManifestBytes));
  return ManifestFromJson(obj, where);
}

Status ValidateMetadata(std::string_view key, std::string_view value) {
  if (key.empty() || key.size() > kMaxMetadataKeyBytes)
    return Status(Code::kInvalidArgument, "metadata key \"" + Printable(key) + "\" must be 1-" +
                                              std::to_string(kMaxMetadataKeyBytes) + " bytes");
  if (value.size() > kMaxMetadataValueBytes)
    return Status(Code::kInvalidArgument, "metadata value of \"" + Printable(key) + "\" is over " +
                                              std::to_string(kMaxMetadataValueBytes) + " bytes");
  try {
    (void)json(std::string(key)).dump();
    (void)json(std::string(value)).dump();
  } catch (const json::exception&) {
    return Status(Code::kInvalidArgument,
                  "metadata \"" + Printable(key) +
                      "\" is not valid UTF-8; encode binary values (e.g. base64)");
  }
  return OkStatus();
}

std::string SerializeLatest(const Latest& l) {
  return Seal({{"format", "ckptio-latest"},
               {"version", kLatestFormatVersion},
               {"step", l.step},
               {"generation", l.generation},
               {"manifest_xxh3_128", l.manifest_hash.Hex()}});
}

Result<Latest> ParseLatest(std::string_view bytes, std::string_view where) {
  CKPTIO_ASSIGN_OR_RETURN(json obj, ParseSealed(bytes, where, kMaxLatestBytes));
  Fields f(obj, "", where);
  CKPTIO_RETURN_IF_ERROR(CheckFormat(f, "ckptio-latest", kLatestFormatVersion, where));
  Latest l;
  CKPTIO_ASSIGN_OR_RETURN(l.step, f.Int("step", 0, kMaxStep));
  CKPTIO_ASSIGN_OR_RETURN(l.generation, f.Int("generation", 1, INT64_MAX));
  CKPTIO_ASSIGN_OR_RETURN(l.manifest_hash, f.Hash("manifest_xxh3_128"));
  CKPTIO_RETURN_IF_ERROR(f.NoOthers());
  return l;
}

std::string SerializeWriterRecord(const WriterRecord& w) {
  return Seal({{"format", "ckptio-writer"},
               {"version", 1},
               {"generation", w.generation},
               {"host", w.host},
               {"pid", w.pid},
               {"started_unix_ms", w.started_unix_ms}});
}

Result<WriterRecord> ParseWriterRecord(std::string_view bytes, std::string_view where) {
  CKPTIO_ASSIGN_OR_RETURN(json obj, ParseSealed(bytes, where, kMaxLatestBytes));
  Fields f(obj, "", where);
  CKPTIO_RETURN_IF_ERROR(CheckFormat(f, "ckptio-writer", 1, where));
  WriterRecord w;
  CKPTIO_ASSIGN_OR_RETURN(w.generation, f.Int("generation", 1, INT64_MAX));
  CKPTIO_ASSIGN_OR_RETURN(w.host, f.Str("host", 256));
  CKPTIO_ASSIGN_OR_RETURN(w.pid, f.Int("pid", 0, INT64_MAX));
  CKPTIO_ASSIGN_OR_RETURN(w.started_unix_ms, f.Int("started_unix_ms", 0, INT64_MAX));
  CKPTIO_RETURN_IF_ERROR(f.NoOthers());
  return w;
}

std::string SerializeRecord(std::string_view format,
                            const std::map<std::string, std::string>& fields) {
  json obj = {{"format", format}, {"version", 1}, {"fields", fields}};
  return Seal(std::move(obj));
}

Result<std::map<std::string, std::string>> ParseRecord(std::string_view bytes,
                                                       std::string_view format,
                                                       std::string_view where) {
  CKPTIO_ASSIGN_OR_RETURN(json obj, ParseSealed(bytes, where, 64 << 10));
  Fields f(obj, "", where);
  CKPTIO_RETURN_IF_ERROR(CheckFormat(f, format, 1, where));
  CKPTIO_ASSIGN_OR_RETURN(const json* fields, f.Get("fields"));
  if (!fields->is_object()) return f.Error("fields", "expected an object");
  std::map<std::string, std::string> out;
  for (auto it = fields->begin(); it != fields->end(); ++it) {
    if (!it->is_string()) return f.Error("fields." + it.key(), "expected a string");
    out.emplace(it.key(), it->get<std::string>());
  }
  CKPTIO_RETURN_IF_ERROR(f.NoOthers());
  return out;
}

std::string StepDirName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%012lld", static_cast<long long>(step));
  return buf;
}

int64_t ParseStepDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() != kPrefix.size() + 12 || name.substr(0, kPrefix.size()) != kPrefix) return -1;
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

}  // namespace ckptio
