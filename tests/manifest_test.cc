// Tests for the manifest, LATEST and writer-record formats (manifest.h), the
// key and URI rules (backend.h) and the XXH3-128 wrapper (hash.h).
//
// Hostile inputs are built from a valid serialised file, edited as JSON and
// then re-sealed with a correct self-checksum (Reseal below, which follows the
// format documented in manifest.h), so each case reaches the check it targets
// instead of stopping at the checksum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// Inline xxHash so the test needs no xxhash library at link time (the library
// itself also inlines it, so it exports no XXH symbols).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "ckptio/backend.h"
#include "ckptio/hash.h"
#include "ckptio/manifest.h"
#include "ckptio/status.h"
#include "strict_json.h"

namespace ckptio {

// gtest printers, found by argument-dependent lookup. Internal linkage so
// they cannot clash with another test file.
[[maybe_unused]] static void PrintTo(const Hash128& h, std::ostream* os) { *os << h.Hex(); }
[[maybe_unused]] static void PrintTo(Code code, std::ostream* os) { *os << CodeName(code); }

namespace {

using json = nlohmann::json;

constexpr Code kDL = Code::kDataLoss;
constexpr std::string_view kWhere = "store-x/step-000000000001/MANIFEST.json";

// ---------------------------------------------------------------------------
// Helpers

// Fails unless `st` is an error with `code` whose message contains every
// piece (empty pieces are ignored).
::testing::AssertionResult IsError(const Status& st, Code code,
                                   std::initializer_list<std::string_view> pieces) {
  if (st.ok()) return ::testing::AssertionFailure() << "expected " << CodeName(code) << ", got OK";
  if (st.code() != code)
    return ::testing::AssertionFailure()
           << "expected " << CodeName(code) << ", got " << st.ToString();
  for (std::string_view p : pieces) {
    if (!p.empty() && st.message().find(p) == std::string::npos)
      return ::testing::AssertionFailure() << "message lacks \"" << p << "\": " << st.ToString();
  }
  return ::testing::AssertionSuccess();
}

// Re-seals a manifest/LATEST JSON object: drops "checksum", hashes the
// canonical dump of the rest and stores the hex digest (manifest.h).
std::string Reseal(json obj) {
  obj.erase("checksum");
  const std::string digest = HashBytes(obj.dump()).Hex();
  obj["checksum"] = digest;
  return obj.dump();
}

// The valid file, re-serialised compactly (first byte '{', keys sorted, so
// "checksum" is the first member).
std::string Compact(const std::string& valid) { return Reseal(json::parse(valid)); }

// `s` with `text` inserted right after the first occurrence of `anchor`.
std::string InsertAfter(const std::string& s, std::string_view anchor, std::string_view text) {
  size_t pos = s.find(anchor);
  if (pos == std::string::npos) {
    ADD_FAILURE() << "test bug: anchor " << anchor << " not found in " << s;
    return s;
  }
  pos += anchor.size();
  return s.substr(0, pos) + std::string(text) + s.substr(pos);
}

// `valid` with one hex digit of its self-checksum changed.
std::string FlipChecksumDigit(const std::string& valid) {
  const std::string sum = json::parse(valid).at("checksum").get<std::string>();
  std::string flipped = sum;
  flipped[7] = flipped[7] == '0' ? '1' : '0';
  const size_t pos = valid.find(sum);
  if (pos == std::string::npos) {
    ADD_FAILURE() << "test bug: checksum not found";
    return valid;
  }
  return valid.substr(0, pos) + flipped + valid.substr(pos + sum.size());
}

Hash128 RandomHash(std::mt19937_64& rng) {
  Hash128 h;
  h.high = rng();
  h.low = rng();
  return h;
}

ObjectEntry MakeEntry(std::string name, uint64_t size, uint64_t chunk_size, std::mt19937_64& rng) {
  ObjectEntry e;
  e.name = std::move(name);
  e.size = size;
  e.chunk_size = chunk_size;
  e.hash = RandomHash(rng);
  const uint64_t n = ObjectEntry::ChunkCount(size, chunk_size);
  for (uint64_t i = 0; i < n; ++i) e.chunks.push_back(RandomHash(rng));
  return e;
}

// Three objects: 3 chunks of 4 MiB (the last short), 5 chunks of 4 KiB, and
// an empty object with no chunks.
Manifest MakeManifest() {
  std::mt19937_64 rng(20240611);
  Manifest m;
  m.step = 1200;
  m.generation = 3;
  m.world_size = 8;
  m.saving_rank = 0;
  m.created_unix_ms = 1700000000123;
  m.writer = "node-01.cluster:4242";
  m.objects.push_back(MakeEntry("model.safetensors", (10u << 20) + 123, 4u << 20, rng));
  m.objects.push_back(MakeEntry("optim.pt", 5 * 4096, 4096, rng));
  m.objects.push_back(MakeEntry("rng_state-0.bin", 0, kDefaultChunkBytes, rng));
  m.metadata = {
      {"note", "Grüße aus Zürich — 日本語 🚀"},
      {"empty", ""},
      {"escapes", "tab\tquote\"backslash\\newline\nctrl\x01"},
      {"ключ", "значение"},
  };
  return m;
}

// A 16 x 8 F32 tensor at `offset` of MakeManifest()'s model.safetensors.
TensorEntry FcWeight(std::string device, uint64_t offset) {
  TensorEntry t;
  t.name = "fc.weight";
  t.object = "model.safetensors";
  t.dtype = "F32";
  t.shape = {16, 8};
  t.device = std::move(device);
  t.offset = offset;
  t.length = 16 * 8 * 4;
  return t;
}

const std::string& ValidManifestBytes() {
  static const std::string* bytes = new std::string(SerializeManifest(MakeManifest()));
  return *bytes;
}

Latest MakeLatest() {
  std::mt19937_64 rng(7);
  Latest l;
  l.step = 1200;
  l.generation = 3;
  l.manifest_hash = RandomHash(rng);
  return l;
}

const std::string& ValidLatestBytes() {
  static const std::string* bytes = new std::string(SerializeLatest(MakeLatest()));
  return *bytes;
}

void ExpectManifestsEqual(const Manifest& want, const Manifest& got) {
  EXPECT_EQ(got.format_version, want.format_version);
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.generation, want.generation);
  EXPECT_EQ(got.world_size, want.world_size);
  EXPECT_EQ(got.saving_rank, want.saving_rank);
  EXPECT_EQ(got.created_unix_ms, want.created_unix_ms);
  EXPECT_EQ(got.writer, want.writer);
  ASSERT_EQ(got.objects.size(), want.objects.size());
  for (size_t i = 0; i < want.objects.size(); ++i) {
    SCOPED_TRACE("object " + want.objects[i].name);
    EXPECT_EQ(got.objects[i].name, want.objects[i].name);
    EXPECT_EQ(got.objects[i].size, want.objects[i].size);
    EXPECT_EQ(got.objects[i].chunk_size, want.objects[i].chunk_size);
    EXPECT_EQ(got.objects[i].hash, want.objects[i].hash);
    EXPECT_EQ(got.objects[i].chunks, want.objects[i].chunks);
  }
  EXPECT_EQ(got.metadata, want.metadata);
}

// ---------------------------------------------------------------------------
// Round trips

TEST(ChunkCountTest, CountsPartialChunks) {
  EXPECT_EQ(ObjectEntry::ChunkCount(0, 4096), 0u);
  EXPECT_EQ(ObjectEntry::ChunkCount(1, 4096), 1u);
  EXPECT_EQ(ObjectEntry::ChunkCount(4096, 4096), 1u);
  EXPECT_EQ(ObjectEntry::ChunkCount(4097, 4096), 2u);
  EXPECT_EQ(ObjectEntry::ChunkCount((10u << 20) + 123, 4u << 20), 3u);
  EXPECT_EQ(ObjectEntry::ChunkCount(kMaxObjectBytes, kMinChunkBytes), uint64_t{1} << 36);
}

TEST(ManifestRoundTripTest, EveryFieldSurvives) {
  const Manifest m = MakeManifest();
  ASSERT_EQ(m.objects[0].chunks.size(), 3u);
  ASSERT_EQ(m.objects[1].chunks.size(), 5u);
  ASSERT_EQ(m.objects[2].chunks.size(), 0u);

  const std::string bytes = SerializeManifest(m);
  auto parsed = ParseManifest(bytes, kWhere);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectManifestsEqual(m, *parsed);

  // Deterministic: the parsed manifest serialises to the same bytes.
  EXPECT_EQ(SerializeManifest(*parsed), bytes);

  ASSERT_NE(parsed->Find("optim.pt"), nullptr);
  EXPECT_EQ(parsed->Find("optim.pt")->size, 5u * 4096);
  EXPECT_EQ(parsed->Find("model.safetensors")->chunks, m.objects[0].chunks);
  EXPECT_EQ(parsed->Find("rng_state-0.bin")->size, 0u);
  EXPECT_EQ(parsed->Find("absent.bin"), nullptr);
  EXPECT_EQ(parsed->Find("optim"), nullptr);
  EXPECT_EQ(parsed->TotalBytes(), (10u << 20) + 123 + 5u * 4096);
}

TEST(ManifestRoundTripTest, CheckedSerializationWritesTheSameBytesOrRefuses) {
  Manifest m = MakeManifest();
  m.tensors.push_back(FcWeight("cuda:0", 4096));
  auto checked = SerializeCheckedManifest(m, kWhere);
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_EQ(*checked, SerializeManifest(m));
  // What the reader would reject, the writer refuses: a tensor past the
  // end of its object, a shape that does not match the length.
  Manifest outside = m;
  outside.tensors[0].offset = outside.Find(outside.tensors[0].object)->size;
  ASSERT_FALSE(ParseManifest(SerializeManifest(outside), kWhere).ok());
  auto refused = SerializeCheckedManifest(outside, kWhere);
  EXPECT_EQ(refused.status().code(), Code::kDataLoss);
  EXPECT_NE(refused.status().message().find("tensors[0]"), std::string::npos) << refused.status();
  Manifest reshaped = m;
  reshaped.tensors[0].shape.push_back(3);
  ASSERT_FALSE(ParseManifest(SerializeManifest(reshaped), kWhere).ok());
  EXPECT_FALSE(SerializeCheckedManifest(reshaped, kWhere).ok());
}

TEST(ManifestRoundTripTest, EmptyManifestAndExtremeValues) {
  Manifest empty;
  empty.generation = 1;
  auto a = ParseManifest(SerializeManifest(empty), kWhere);
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectManifestsEqual(empty, *a);
  EXPECT_EQ(a->TotalBytes(), 0u);

  Manifest big = MakeManifest();
  big.step = kMaxStep;
  big.generation = std::numeric_limits<int64_t>::max();
  big.world_size = 1 << 24;
  big.saving_rank = (1 << 24) - 1;
  big.created_unix_ms = std::numeric_limits<int64_t>::max();
  big.writer = std::string(512, 'w');
  auto b = ParseManifest(SerializeManifest(big), kWhere);
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectManifestsEqual(big, *b);
}

// The writer produces the canonical text itself (no JSON tree): for strings
// that need escaping, non-ASCII and even invalid UTF-8, the seal must still
// be nlohmann's dump of what a reader parses, or every such manifest would
// read as corrupt.
TEST(ManifestRoundTripTest, TextWriterMatchesTheCanonicalDumpForAnyString) {
  Manifest m = MakeManifest();
  const std::vector<std::string> names = {"plain.weight",  "quote\"d",         "back\\slash",
                                          "new\nline",     "tab\tand\x01\x1f", "del\x7f",
                                          "slash/is/fine", "ü日本🚀",           "{\"json\":[1,2]}"};
  uint64_t offset = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    TensorEntry t;
    t.name = names[i];
    t.object = "model.safetensors";
    t.dtype = i % 2 ? "BF16" : "I64";
    t.shape = {static_cast<int64_t>(i), 2};
    t.device = i % 3 ? "cpu" : "cuda:7";
    t.offset = offset;
    t.length = i * 2 * DtypeSize(t.dtype);
    offset += t.length;
    m.tensors.push_back(t);
  }
  m.metadata["k\x7f\"\\"] = "v\xc3\xa9\n";
  const std::string bytes = SerializeManifest(m);
  auto parsed = ParseManifest(bytes, kWhere);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectManifestsEqual(m, *parsed);
  json j = json::parse(bytes);
  const std::string sum = j.at("checksum").get<std::string>();
  j.erase("checksum");
  EXPECT_EQ(HashBytes(j.dump()).Hex(), sum);
  // For humans: one line per member (12 with the checksum), metadata entry,
  // object and tensor.
  EXPECT_EQ(std::count(bytes.begin(), bytes.end(), '\n'),
            12 + static_cast<long>(m.metadata.size() + m.objects.size() + m.tensors.size()));

  // Invalid UTF-8 is replaced (U+FFFD) in what is written and sealed, so the
  // file still verifies; the writer's callers validate strings first.
  Manifest bad = MakeManifest();
  bad.writer = "host\xff:1";
  auto read = ParseManifest(SerializeManifest(bad), kWhere);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->writer, "host\xef\xbf\xbd:1");
}

// The writer and the reader run the same content checks: whatever a reader
// would reject, SerializeCheckedManifest refuses, with the reader's message.
TEST(ManifestRoundTripTest, CheckedSerializationRefusesExactlyWhatReadersReject) {
  Manifest base = MakeManifest();
  base.tensors = {FcWeight("cpu", 64), FcWeight("cpu", 64)};
  base.tensors[1].name = "fc.bias";
  ASSERT_TRUE(SerializeCheckedManifest(base, kWhere).ok());
  struct Case {
    std::string name;
    std::function<void(Manifest&)> edit;
    std::string field, what;
  };
  const std::vector<Case> cases = {
      {"StepAboveMax", [](Manifest& m) { m.step = kMaxStep + 1; }, "'step'", "outside"},
      {"GenerationZero", [](Manifest& m) { m.generation = 0; }, "'generation'", "outside"},
      {"RankOutsideWorld", [](Manifest& m) { m.saving_rank = m.world_size; }, "'saving_rank'",
       "outside"},
      {"NegativeTime", [](Manifest& m) { m.created_unix_ms = -1; }, "'created_unix_ms'", "outside"},
      {"LongWriter", [](Manifest& m) { m.writer.assign(513, 'w'); }, "'writer'", "longer than"},
      {"ObjectNameWithSlash", [](Manifest& m) { m.objects[1].name = "a/b"; }, "'objects[1].name'",
       "'/' is not allowed"},
      {"UnsortedObjects", [](Manifest& m) { std::swap(m.objects[0], m.objects[1]); },
       "'objects[1].name'", "not sorted"},
      {"DuplicateObject", [](Manifest& m) { m.objects[1] = m.objects[0]; }, "'objects[1].name'",
       "duplicate object name"},
      {"ObjectTooLarge", [](Manifest& m) { m.objects[2].size = kMaxObjectBytes + 1; },
       "'objects[2].size'", "outside"},
      {"ChunkSizeZero", [](Manifest& m) { m.objects[2].chunk_size = 0; }, "'objects[2].chunk_size'",
       "outside"},
      {"MissingChunk", [](Manifest& m) { m.objects[0].chunks.pop_back(); }, "'objects[0].chunks'",
       "imply 3"},
      {"TensorInMissingObject", [](Manifest& m) { m.tensors[1].object = "gone.bin"; },
       "'tensors[1].object'", "names no object"},
      {"EmptyTensorName", [](Manifest& m) { m.tensors[0].name.clear(); }, "'tensors[0].name'",
       "empty"},
      {"UnknownDtype", [](Manifest& m) { m.tensors[0].dtype = "F8"; }, "'tensors[0].dtype'",
       "unknown dtype"},
      {"NegativeDim",
       [](Manifest& m) {
         m.tensors[0].shape = {-1, -128};
       },
       "'tensors[0].shape'", "non-negative"},
      {"TooManyDims", [](Manifest& m) { m.tensors[0].shape.assign(33, 1); }, "'tensors[0].shape'",
       "at most 32"},
      {"TooManyElements",
       [](Manifest& m) {
         m.tensors[0].shape = {int64_t{1} << 30, int64_t{1} << 30};
       },
       "'tensors[0].shape'", "too many elements"},
      {"ElementsWrapAround",  // 2^32 * 2^32 wraps to 0 in 64 bits, as length 0 would match
       [](Manifest& m) {
         m.tensors[0].shape = {int64_t{1} << 32, int64_t{1} << 32};
         m.tensors[0].length = 0;
       },
       "'tensors[0].shape'", "too many elements"},
      {"ZeroSizeWithHugeStrides",  // 0 elements, but strides of 2^96
       [](Manifest& m) {
         m.tensors[0].shape = {0, int64_t{1} << 48, int64_t{1} << 48};
         m.tensors[0].length = 0;
       },
       "'tensors[0].shape'", "too many elements"},
      {"PastTheObject", [](Manifest& m) { m.tensors[0].offset = m.objects[0].size - 8; },
       "'tensors[0].length'", "outside"},
      {"LengthNotShape", [](Manifest& m) { m.tensors[0].length += 4; }, "'tensors[0].length'",
       "dtype and shape need"},
      {"TensorTwice", [](Manifest& m) { m.tensors[1].name = m.tensors[0].name; },
       "'tensors[1].name'", "appears twice"},
      {"MetadataNotUtf8", [](Manifest& m) { m.metadata["bin"] = "\xff"; }, "'metadata.bin'",
       "UTF-8"},
      // Written, "\xff" and "\xfe" would both become U+FFFD: one name twice.
      {"TensorNameNotUtf8", [](Manifest& m) { m.tensors[1].name = "fc.\xfe"; }, "'tensors[1].name'",
       "not valid UTF-8"},
      {"DeviceNotUtf8", [](Manifest& m) { m.tensors[0].device = "cuda:\xff"; },
       "'tensors[0].device'", "not valid UTF-8"},
      {"MetadataKeyTooLong",
       [](Manifest& m) { m.metadata[std::string(kMaxMetadataKeyBytes + 1, 'k')] = "v"; },
       "'metadata.kkk", "1-256 bytes"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Manifest m = base;
    c.edit(m);
    auto refused = SerializeCheckedManifest(m, kWhere);
    ASSERT_FALSE(refused.ok());
    EXPECT_TRUE(IsError(refused.status(), kDL, {kWhere, c.field, c.what}));
    // Written unchecked, the same manifest is rejected on reading with the
    // same message (invalid UTF-8 cannot be written: it would be replaced).
    if (c.name.find("NotUtf8") != std::string::npos) continue;
    auto read = ParseManifest(SerializeManifest(m), kWhere);
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().ToString(), refused.status().ToString());
  }
}

TEST(ManifestRoundTripTest, SealFollowsDocumentedFormat) {
  // manifest.h: "checksum" is the XXH3-128 hex of nlohmann::json::dump() of
  // the object without that member. The hostile tests rely on this.
  json j = json::parse(ValidManifestBytes());
  ASSERT_TRUE(j.contains("checksum"));
  const std::string sum = j["checksum"].get<std::string>();
  j.erase("checksum");
  EXPECT_EQ(HashBytes(j.dump()).Hex(), sum);

  auto resealed = ParseManifest(Reseal(json::parse(ValidManifestBytes())), kWhere);
  ASSERT_TRUE(resealed.ok()) << resealed.status();
  ExpectManifestsEqual(MakeManifest(), *resealed);
}

TEST(LatestRoundTripTest, EveryFieldSurvives) {
  const Latest l = MakeLatest();
  const std::string bytes = SerializeLatest(l);
  EXPECT_LE(bytes.size(), kMaxLatestBytes);
  auto parsed = ParseLatest(bytes, "store-x/LATEST");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->step, l.step);
  EXPECT_EQ(parsed->generation, l.generation);
  EXPECT_EQ(parsed->manifest_hash, l.manifest_hash);
  EXPECT_EQ(SerializeLatest(*parsed), bytes);

  Latest edge;
  edge.step = kMaxStep;
  edge.generation = std::numeric_limits<int64_t>::max();
  edge.manifest_hash = HashBytes(ValidManifestBytes());
  auto e = ParseLatest(SerializeLatest(edge), "LATEST");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->step, edge.step);
  EXPECT_EQ(e->generation, edge.generation);
  EXPECT_EQ(e->manifest_hash, edge.manifest_hash);
}

TEST(WriterRecordRoundTripTest, EveryFieldSurvives) {
  WriterRecord w;
  w.generation = 17;
  w.host = "gpu-node-07.cluster.example";
  w.pid = 123456;
  w.started_unix_ms = 1700000000999;
  const std::string bytes = SerializeWriterRecord(w);
  auto parsed = ParseWriterRecord(bytes, "store-x/.writer");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->generation, w.generation);
  EXPECT_EQ(parsed->host, w.host);
  EXPECT_EQ(parsed->pid, w.pid);
  EXPECT_EQ(parsed->started_unix_ms, w.started_unix_ms);
  EXPECT_EQ(SerializeWriterRecord(*parsed), bytes);

  w.host = "hôte-ünïcode";
  auto u = ParseWriterRecord(SerializeWriterRecord(w), "store-x/.writer");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->host, w.host);
}

TEST(WriterRecordHostileTest, RejectsMalformedRecords) {
  const std::string valid = SerializeWriterRecord(WriterRecord{5, "h", 42, 1});
  auto edit = [&](const std::function<void(json&)>& fn) {
    json j = json::parse(valid);
    fn(j);
    return Reseal(j);
  };
  const std::string where = "store-x/.writer";
  EXPECT_TRUE(IsError(ParseWriterRecord(edit([](json& j) { j.erase("host"); }), where).status(),
                      kDL, {where, "field 'host': missing"}));
  EXPECT_TRUE(IsError(ParseWriterRecord(edit([](json& j) { j["pid"] = -1; }), where).status(), kDL,
                      {where, "field 'pid'", "outside"}));
  EXPECT_TRUE(IsError(ParseWriterRecord(edit([](json& j) { j["generation"] = 0; }), where).status(),
                      kDL, {where, "field 'generation'", "outside"}));
  EXPECT_TRUE(IsError(ParseWriterRecord(edit([](json& j) { j["x"] = 1; }), where).status(), kDL,
                      {where, "field 'x': unknown field"}));
  EXPECT_TRUE(IsError(
      ParseWriterRecord(edit([](json& j) { j["format"] = "ckptio-latest"; }), where).status(), kDL,
      {where, "field 'format'", "ckptio-writer"}));
  EXPECT_TRUE(IsError(ParseWriterRecord(FlipChecksumDigit(valid), where).status(), kDL,
                      {where, "checksum"}));
}

TEST(FormatConfusionTest, OneKindOfFileIsNotAcceptedAsAnother) {
  EXPECT_TRUE(IsError(ParseManifest(ValidLatestBytes(), kWhere).status(), kDL,
                      {kWhere, "field 'format'", "ckptio-manifest"}));
  EXPECT_TRUE(IsError(ParseLatest(SerializeManifest(Manifest{}), "LATEST").status(), kDL,
                      {"LATEST", "field 'format'", "ckptio-latest"}));
  const std::string writer = SerializeWriterRecord(WriterRecord{5, "h", 42, 1});
  EXPECT_TRUE(IsError(ParseLatest(writer, "LATEST").status(), kDL, {"field 'format'"}));
  EXPECT_TRUE(IsError(ParseManifest(writer, kWhere).status(), kDL, {"field 'format'"}));
}

// ---------------------------------------------------------------------------
// Hostile manifests

struct HostileCase {
  std::string name;  // gtest name: [A-Za-z0-9_]
  // Exactly one of these is set. `edit` changes the parsed valid file, which
  // is then re-sealed; `raw` builds the bytes from the valid file directly.
  std::function<void(json&)> edit;
  std::function<std::string(const std::string&)> raw;
  Code code = kDL;
  std::string field;  // e.g. "field 'step'"; "" when the file as a whole is bad
  std::string what;   // the problem, e.g. "outside"
};

[[maybe_unused]] void PrintTo(const HostileCase& c, std::ostream* os) { *os << c.name; }

HostileCase J(std::string name, std::function<void(json&)> edit, Code code, std::string field,
              std::string what) {
  HostileCase c;
  c.name = std::move(name);
  c.edit = std::move(edit);
  c.code = code;
  c.field = std::move(field);
  c.what = std::move(what);
  return c;
}

HostileCase R(std::string name, std::function<std::string(const std::string&)> raw, Code code,
              std::string field, std::string what) {
  HostileCase c;
  c.name = std::move(name);
  c.raw = std::move(raw);
  c.code = code;
  c.field = std::move(field);
  c.what = std::move(what);
  return c;
}

// An edit applied WITHOUT re-sealing (for checksum cases).
std::function<std::string(const std::string&)> Unsealed(std::function<void(json&)> edit) {
  return [edit](const std::string& valid) {
    json j = json::parse(valid);
    edit(j);
    return j.dump();
  };
}

std::string Build(const HostileCase& c, const std::string& valid) {
  if (c.edit) {
    json j = json::parse(valid);
    c.edit(j);
    return Reseal(std::move(j));
  }
  return c.raw(valid);
}

std::vector<HostileCase> ManifestCases() {
  std::vector<HostileCase> v;
  auto cut = [](std::function<size_t(const std::string&)> at) {
    return [at](const std::string& s) { return s.substr(0, at(s)); };
  };
  const std::string o0 = "field 'objects[0].";
  const std::string kNextVersion = "format version " + std::to_string(kManifestFormatVersion + 1);

  // --- The file as a whole.
  v.push_back(R(
      "Empty", [](const std::string&) { return std::string(); }, kDL, "", "empty"));
  v.push_back(R("TruncatedToOneByte", cut([](const std::string&) { return 1; }), kDL, "",
                "not valid JSON"));
  v.push_back(
      R("TruncatedAt17", cut([](const std::string&) { return 17; }), kDL, "", "not valid JSON"));
  v.push_back(R("TruncatedInsideChecksum",
                cut([](const std::string& s) { return s.find("checksum") + 20; }), kDL, "",
                "not valid JSON"));
  v.push_back(R("TruncatedAtHalf", cut([](const std::string& s) { return s.size() / 2; }), kDL, "",
                "not valid JSON"));
  v.push_back(R("TruncatedBeforeClosingBrace",
                cut([](const std::string& s) { return s.rfind('}'); }), kDL, "", "not valid JSON"));
  v.push_back(R(
      "NotJson", [](const std::string&) { return std::string("hello, world"); }, kDL, "",
      "not valid JSON"));
  v.push_back(R(
      "BinaryGarbage", [](const std::string&) { return std::string("\x00\xff\xfe\x01", 4); }, kDL,
      "", "NUL byte"));
  v.push_back(R(
      "TrailingGarbage", [](const std::string& s) { return s + "x"; }, kDL, "", "not valid JSON"));
  v.push_back(R(
      "TwoManifestsConcatenated", [](const std::string& s) { return s + s; }, kDL, "",
      "not valid JSON"));
  v.push_back(R(
      "InvalidUtf8InString", [](const std::string& s) { return InsertAfter(s, "node-01", "\xff"); },
      kDL, "", "not valid JSON"));
  v.push_back(R(
      "TopLevelArray", [](const std::string& s) { return "[" + s + "]"; }, kDL, "",
      "expected a JSON object"));
  v.push_back(R(
      "TopLevelString", [](const std::string&) { return std::string("\"x\""); }, kDL, "",
      "expected a JSON object"));
  v.push_back(R(
      "TopLevelNull", [](const std::string&) { return std::string("null"); }, kDL, "",
      "expected a JSON object"));
  v.push_back(R(
      "LargerThanMaxManifestBytes",
      [](const std::string& s) {
        // Still valid JSON: only the size limit can reject it.
        return s + std::string(kMaxManifestBytes + 1 - s.size(), ' ');
      },
      kDL, "", std::to_string(kMaxManifestBytes) + "-byte limit"));

  // --- The self-checksum.
  v.push_back(R("MissingChecksum", Unsealed([](json& j) { j.erase("checksum"); }), kDL,
                "'checksum'", "missing"));
  v.push_back(R("ChecksumNotString", Unsealed([](json& j) { j["checksum"] = 5; }), kDL,
                "'checksum'", "not a string"));
  v.push_back(R("ChecksumTooShort", Unsealed([](json& j) { j["checksum"] = std::string(31, '0'); }),
                kDL, "'checksum'", "32 hex digits"));
  v.push_back(R("ChecksumNotHex", Unsealed([](json& j) { j["checksum"] = std::string(32, 'x'); }),
                kDL, "'checksum'", "32 hex digits"));
  v.push_back(R("ChecksumOneDigitFlipped", FlipChecksumDigit, kDL, "", "self-checksum mismatch"));
  v.push_back(R("ContentChangedWithoutReseal", Unsealed([](json& j) { j["step"] = 1201; }), kDL, "",
                "self-checksum mismatch"));

  // --- Duplicate JSON keys. The duplicate comes first, so the last value
  // (the real one) wins and the self-checksum is valid.
  v.push_back(R(
      "DuplicateTopLevelKey",
      [](const std::string& s) { return InsertAfter(Compact(s), "{", "\"step\":5,"); }, kDL,
      "member \"step\"", "appears twice"));
  v.push_back(R(
      "DuplicateChecksumKey",
      [](const std::string& s) {
        return InsertAfter(Compact(s), "{", "\"checksum\":\"00000000000000000000000000000000\",");
      },
      kDL, "member \"checksum\"", "appears twice"));
  v.push_back(R(
      "DuplicateKeyInsideObject",
      [](const std::string& s) { return InsertAfter(Compact(s), "\"objects\":[{", "\"size\":1,"); },
      kDL, "member \"size\"", "appears twice"));
  v.push_back(R(
      "DuplicateKeyInsideMetadata",
      [](const std::string& s) {
        return InsertAfter(Compact(s), "\"metadata\":{", "\"note\":\"shadowed\",");
      },
      kDL, "member \"note\"", "appears twice"));

  // --- Format and version.
  v.push_back(J(
      "MissingFormat", [](json& j) { j.erase("format"); }, kDL, "field 'format'", "missing"));
  v.push_back(J(
      "WrongFormat", [](json& j) { j["format"] = "ckptio-manifest-v2"; }, kDL, "field 'format'",
      "expected \"ckptio-manifest\""));
  v.push_back(J(
      "FormatNotString", [](json& j) { j["format"] = 1; }, kDL, "field 'format'",
      "expected a string"));
  v.push_back(J(
      "MissingVersion", [](json& j) { j.erase("version"); }, kDL, "field 'version'", "missing"));
  v.push_back(J(
      "VersionAsString", [](json& j) { j["version"] = "1"; }, kDL, "field 'version'",
      "expected an integer"));
  v.push_back(J(
      "VersionZero", [](json& j) { j["version"] = 0; }, kDL, "field 'version'", "outside"));
  v.push_back(J(
      "FutureVersion", [](json& j) { j["version"] = kManifestFormatVersion + 1; },
      Code::kFailedPrecondition, kNextVersion, "newer"));
  // A newer writer may add members; the version, not the new member, must
  // decide the error.
  v.push_back(J(
      "FutureVersionWithNewField",
      [](json& j) {
        j["version"] = kManifestFormatVersion + 1;
        j["shards"] = json::array();
      },
      Code::kFailedPrecondition, kNextVersion, "newer"));

  // --- Top-level scalar fields.
  for (const char* f : {"step", "generation", "world_size", "saving_rank", "created_unix_ms",
                        "writer", "objects", "metadata"}) {
    std::string key = f;
    std::string id = "Missing_" + key;
    v.push_back(J(
        id, [key](json& j) { j.erase(key); }, kDL, "field '" + key + "'", "missing"));
  }
  v.push_back(J(
      "StepAsString", [](json& j) { j["step"] = "1200"; }, kDL, "field 'step'",
      "expected an integer"));
  v.push_back(J(
      "StepAsFloat", [](json& j) { j["step"] = 1200.0; }, kDL, "field 'step'",
      "expected an integer"));
  v.push_back(J(
      "StepNull", [](json& j) { j["step"] = nullptr; }, kDL, "field 'step'",
      "expected an integer"));
  v.push_back(J(
      "StepNegative", [](json& j) { j["step"] = -1; }, kDL, "field 'step'", "value -1 is outside"));
  v.push_back(J(
      "StepAboveMax", [](json& j) { j["step"] = kMaxStep + 1; }, kDL, "field 'step'", "outside"));
  v.push_back(J(
      "StepBeyondInt64", [](json& j) { j["step"] = std::numeric_limits<uint64_t>::max(); }, kDL,
      "field 'step'", "out of range"));
  v.push_back(J(
      "GenerationZero", [](json& j) { j["generation"] = 0; }, kDL, "field 'generation'",
      "outside"));
  v.push_back(J(
      "WorldSizeZero", [](json& j) { j["world_size"] = 0; }, kDL, "field 'world_size'", "outside"));
  v.push_back(J(
      "SavingRankEqualsWorldSize",
      [](json& j) {
        j["world_size"] = 4;
        j["saving_rank"] = 4;
      },
      kDL, "field 'saving_rank'", "value 4 is outside [0, 3]"));
  v.push_back(J(
      "SavingRankNegative", [](json& j) { j["saving_rank"] = -1; }, kDL, "field 'saving_rank'",
      "outside"));
  v.push_back(J(
      "CreatedNegative", [](json& j) { j["created_unix_ms"] = -5; }, kDL, "field 'created_unix_ms'",
      "outside"));
  v.push_back(J(
      "WriterNotString", [](json& j) { j["writer"] = 42; }, kDL, "field 'writer'",
      "expected a string"));
  v.push_back(J(
      "WriterTooLong", [](json& j) { j["writer"] = std::string(513, 'w'); }, kDL, "field 'writer'",
      "longer than 512 bytes"));
  v.push_back(J(
      "UnknownTopLevelField", [](json& j) { j["extra"] = 1; }, kDL, "field 'extra'",
      "unknown field"));

  // --- The objects array.
  v.push_back(J(
      "ObjectsNotArray", [](json& j) { j["objects"] = json::object(); }, kDL, "field 'objects'",
      "expected an array"));
  v.push_back(J(
      "ObjectsNull", [](json& j) { j["objects"] = nullptr; }, kDL, "field 'objects'",
      "expected an array"));
  v.push_back(J(
      "TooManyObjects",
      [](json& j) {
        // The count is checked before any entry: nulls are enough.
        j["objects"] = json::array();
        for (size_t i = 0; i <= kMaxObjects; ++i) j["objects"].push_back(nullptr);
      },
      kDL, "field 'objects'", "more than " + std::to_string(kMaxObjects)));
  v.push_back(J(
      "ObjectEntryNotObject", [](json& j) { j["objects"][0] = "model.safetensors"; }, kDL,
      "field 'objects[0]'", "expected an object"));
  for (const char* f : {"name", "size", "chunk_size", "xxh3_128", "chunks"}) {
    std::string key = f;
    v.push_back(J(
        "MissingObject_" + key, [key](json& j) { j["objects"][0].erase(key); }, kDL, o0 + key + "'",
        "missing"));
  }
  v.push_back(J(
      "UnknownObjectField", [](json& j) { j["objects"][1]["color"] = "red"; }, kDL,
      "field 'objects[1].color'", "unknown field"));
  v.push_back(J(
      "SizeNegative", [](json& j) { j["objects"][0]["size"] = -1; }, kDL, o0 + "size'",
      "expected an unsigned integer"));
  v.push_back(J(
      "SizeFloat", [](json& j) { j["objects"][0]["size"] = 1.5; }, kDL, o0 + "size'",
      "expected an unsigned integer"));
  v.push_back(J(
      "SizeAsString", [](json& j) { j["objects"][0]["size"] = "10485883"; }, kDL, o0 + "size'",
      "expected an unsigned integer"));
  v.push_back(J(
      "SizeTwoPow60", [](json& j) { j["objects"][0]["size"] = uint64_t{1} << 60; }, kDL,
      o0 + "size'", "outside"));
  v.push_back(J(
      "SizeJustOverMax", [](json& j) { j["objects"][0]["size"] = kMaxObjectBytes + 1; }, kDL,
      o0 + "size'", "outside"));
  // 2^48 bytes in 4 KiB chunks would be 2^36 chunk hashes: the count must be
  // checked before anything is allocated.
  v.push_back(J(
      "SizeAtMaxWithFewChunks",
      [](json& j) {
        j["objects"][0]["size"] = kMaxObjectBytes;
        j["objects"][0]["chunk_size"] = kMinChunkBytes;
      },
      kDL, o0 + "chunks'", "imply " + std::to_string(uint64_t{1} << 36)));
  v.push_back(J(
      "ChunkSizeZero", [](json& j) { j["objects"][0]["chunk_size"] = 0; }, kDL, o0 + "chunk_size'",
      "value 0 is outside"));
  v.push_back(J(
      "ChunkSizeOne", [](json& j) { j["objects"][0]["chunk_size"] = 1; }, kDL, o0 + "chunk_size'",
      "value 1 is outside"));
  v.push_back(J(
      "ChunkSizeBelowMin", [](json& j) { j["objects"][0]["chunk_size"] = kMinChunkBytes - 1; }, kDL,
      o0 + "chunk_size'", "outside"));
  v.push_back(J(
      "ChunkSizeOver64MiB", [](json& j) { j["objects"][0]["chunk_size"] = kMaxChunkBytes + 1; },
      kDL, o0 + "chunk_size'", "outside"));
  v.push_back(J(
      "ChunkSizeNegative", [](json& j) { j["objects"][0]["chunk_size"] = -4096; }, kDL,
      o0 + "chunk_size'", "expected an unsigned integer"));
  v.push_back(J(
      "ChunksNotArray", [](json& j) { j["objects"][0]["chunks"] = "abc"; }, kDL, o0 + "chunks'",
      "expected an array"));
  v.push_back(J(
      "ChunkCountTooFewForSize",
      [](json& j) {
        j["objects"][0]["size"] = j["objects"][0]["size"].get<uint64_t>() + (4u << 20);
      },
      kDL, o0 + "chunks'", "has 3 entries; size and chunk_size imply 4"));
  v.push_back(J(
      "ChunkCountTooMany",
      [](json& j) { j["objects"][1]["chunks"].push_back(std::string(32, 'a')); }, kDL,
      "field 'objects[1].chunks'", "has 6 entries; size and chunk_size imply 5"));
  v.push_back(J(
      "EmptyObjectWithAChunk",
      [](json& j) { j["objects"][2]["chunks"].push_back(std::string(32, 'a')); }, kDL,
      "field 'objects[2].chunks'", "imply 0"));
  v.push_back(J(
      "ChunkSizeChangedCountNot", [](json& j) { j["objects"][1]["chunk_size"] = 8192; }, kDL,
      "field 'objects[1].chunks'", "imply 3"));
  v.push_back(J(
      "HashNotHex", [](json& j) { j["objects"][0]["xxh3_128"] = std::string(32, 'g'); }, kDL,
      o0 + "xxh3_128'", "32 hex digits"));
  v.push_back(J(
      "HashTooShort", [](json& j) { j["objects"][0]["xxh3_128"] = std::string(31, 'a'); }, kDL,
      o0 + "xxh3_128'", "32 hex digits"));
  v.push_back(J(
      "HashTooLong", [](json& j) { j["objects"][0]["xxh3_128"] = std::string(33, 'a'); }, kDL,
      o0 + "xxh3_128'", "32 hex digits"));
  v.push_back(J(
      "HashWithHexPrefix",
      [](json& j) { j["objects"][0]["xxh3_128"] = "0x" + std::string(30, 'a'); }, kDL,
      o0 + "xxh3_128'", "32 hex digits"));
  v.push_back(J(
      "HashNotString", [](json& j) { j["objects"][0]["xxh3_128"] = 12345; }, kDL, o0 + "xxh3_128'",
      "expected a string"));
  v.push_back(J(
      "ChunkHashNotHex", [](json& j) { j["objects"][0]["chunks"][1] = std::string(32, 'z'); }, kDL,
      o0 + "chunks[1]'", "32 hex digits"));
  v.push_back(J(
      "ChunkHashNotString", [](json& j) { j["objects"][0]["chunks"][0] = 7; }, kDL,
      o0 + "chunks[0]'", "32 hex digits"));

  // --- Object names.
  auto bad_name = [&](std::string id, std::string name, std::string what) {
    v.push_back(J(
        "Name_" + id, [name](json& j) { j["objects"][0]["name"] = name; }, kDL, o0 + "name'",
        std::move(what)));
  };
  const std::string kFlat = "'/' is not allowed";
  const std::string kReserved = "starting with '.' are reserved";
  const std::string kChars = "only [A-Za-z0-9._-]";
  bad_name("DotDotSlash", "../x", kFlat);
  bad_name("DeepTraversal", "a/../../b", kFlat);
  bad_name("Absolute", "/etc/passwd", kFlat);
  bad_name("Nested", "a/b", kFlat);
  bad_name("TrailingSlash", "a/", kFlat);
  bad_name("Dot", ".", kReserved);
  bad_name("DotDot", "..", kReserved);
  bad_name("Hidden", ".hidden", kReserved);
  bad_name("TempMarker", std::string(kTempMarker) + "x", kReserved);
  bad_name("Manifest", "MANIFEST.json", "reserved for the manifest");
  bad_name("Nul", std::string("a\0b", 3), kChars);
  bad_name("Newline", "line\nbreak", kChars);
  bad_name("Backslash", "a\\b", kChars);
  bad_name("Space", "a b", kChars);
  bad_name("NonAscii", "modèle.pt", kChars);
  bad_name("Empty", "", "empty");
  bad_name("Bytes201", std::string(201, 'a'), "longer than 200 bytes");
  bad_name("Bytes300", std::string(300, 'a'), "longer than");
  v.push_back(J(
      "NameNotString", [](json& j) { j["objects"][0]["name"] = 5; }, kDL, o0 + "name'",
      "expected a string"));
  v.push_back(J(
      "DuplicateObjectNames", [](json& j) { j["objects"][1] = j["objects"][0]; }, kDL,
      "field 'objects[1].name'", "duplicate object name"));
  v.push_back(J(
      "UnsortedObjects", [](json& j) { std::swap(j["objects"][0], j["objects"][1]); }, kDL,
      "field 'objects[1].name'", "not sorted"));

  // --- User metadata.
  v.push_back(J(
      "MetadataNotObject",
      [](json& j) {
        j["metadata"] = json::array({"a", "b"});
      },
      kDL, "field 'metadata'", "expected an object"));
  v.push_back(J(
      "TooManyMetadataEntries",
      [](json& j) {
        json meta = json::object();
        for (size_t i = 0; i <= kMaxMetadataEntries; ++i) meta["k" + std::to_string(i)] = "v";
        j["metadata"] = std::move(meta);
      },
      kDL, "field 'metadata'", "more than " + std::to_string(kMaxMetadataEntries)));
  v.push_back(J(
      "MetadataValueNumber", [](json& j) { j["metadata"]["answer"] = 42; }, kDL,
      "field 'metadata.answer'", "expected a string"));
  v.push_back(J(
      "MetadataValueNull", [](json& j) { j["metadata"]["answer"] = nullptr; }, kDL,
      "field 'metadata.answer'", "expected a string"));
  v.push_back(J(
      "MetadataValueObject",
      [](json& j) {
        j["metadata"]["answer"] = json::object({{"a", "b"}});
      },
      kDL, "field 'metadata.answer'", "expected a string"));
  v.push_back(J(
      "MetadataValueTooLarge",
      [](json& j) { j["metadata"]["big"] = std::string(kMaxMetadataValueBytes + 1, 'x'); }, kDL,
      "field 'metadata.big'", "over " + std::to_string(kMaxMetadataValueBytes)));
  v.push_back(J(
      "MetadataKeyEmpty", [](json& j) { j["metadata"][""] = "v"; }, kDL, "field 'metadata.'",
      "must be 1-256 bytes"));
  v.push_back(J(
      "MetadataKeyTooLong",
      [](json& j) { j["metadata"][std::string(kMaxMetadataKeyBytes + 1, 'k')] = "v"; }, kDL,
      "field 'metadata.kkkk", "must be 1-256 bytes"));
  return v;
}

class ManifestHostileTest : public ::testing::TestWithParam<HostileCase> {};

TEST_P(ManifestHostileTest, RejectedWithPreciseError) {
  const HostileCase& c = GetParam();
  const std::string bytes = Build(c, ValidManifestBytes());
  auto r = ParseManifest(bytes, kWhere);
  ASSERT_FALSE(r.ok()) << c.name << " was accepted";
  EXPECT_TRUE(IsError(r.status(), c.code, {c.field, c.what}));
}

INSTANTIATE_TEST_SUITE_P(Cases, ManifestHostileTest, ::testing::ValuesIn(ManifestCases()),
                         [](const ::testing::TestParamInfo<HostileCase>& p) {
                           return p.param.name;
                         });

TEST(ManifestHostileWhereTest, EveryMessageNamesTheFile) {
  const std::vector<HostileCase> cases = ManifestCases();
  ASSERT_GE(cases.size(), 35u);
  for (const char* where :
       {"store-x/step-000000000001/MANIFEST.json", "nfs://filer/run42/step-000000000777/M"}) {
    for (const HostileCase& c : cases) {
      SCOPED_TRACE(c.name);
      auto r = ParseManifest(Build(c, ValidManifestBytes()), where);
      ASSERT_FALSE(r.ok());
      EXPECT_NE(r.status().message().find(where), std::string::npos) << r.status();
    }
  }
}

TEST(ManifestHostileWhereTest, MessagesHoldNoRawControlCharacters) {
  // Hostile names and keys (NUL, newline) must be escaped in messages, which
  // end up in logs and terminals.
  for (const HostileCase& c : ManifestCases()) {
    auto r = ParseManifest(Build(c, ValidManifestBytes()), kWhere);
    ASSERT_FALSE(r.ok()) << c.name;
    for (char ch : r.status().message()) {
      const auto u = static_cast<unsigned char>(ch);
      EXPECT_FALSE(u < 0x20 || u == 0x7f)
          << c.name << ": control byte " << int{u} << " in: " << r.status();
    }
  }
}

// The strict parser builds its document itself (one SAX pass that also
// refuses repeated keys): on random documents it must agree with nlohmann's
// parse exactly, and on every truncation of them accept and refuse alike.
TEST(StrictJsonTest, AgreesWithNlohmannOnRandomDocuments) {
  std::mt19937_64 rng(7);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  const std::vector<std::string> strings = {"",  "a",  "é日🚀", "q\"b\\s", "\n\t\x01",
                                            "k", "kk", "\x7f", "123",     "null"};
  std::function<json(int)> value = [&](int depth) -> json {
    switch (depth > 3 ? pick(6) : pick(8)) {
      case 0:
        return nullptr;
      case 1:
        return pick(2) == 1;
      case 2:
        return static_cast<int64_t>(rng()) >> pick(64);
      case 3:
        return rng();
      case 4:
        return static_cast<double>(static_cast<int64_t>(rng() >> 11)) / 1024.0;
      case 5:
        return strings[pick(static_cast<int>(strings.size()))] + std::to_string(pick(3));
      case 6: {
        json a = json::array();
        for (int i = pick(5); i > 0; --i) a.push_back(value(depth + 1));
        return a;
      }
      default: {
        json o = json::object();
        for (int i = pick(5); i > 0; --i)
          o[strings[pick(static_cast<int>(strings.size()))]] = value(depth + 1);
        return o;
      }
    }
  };
  for (int doc = 0; doc < 500; ++doc) {
    const json original = value(0);
    const std::string text = original.dump(pick(2) ? -1 : 1);
    auto strict = ParseStrictJson(text, 8, "doc");
    ASSERT_TRUE(strict.ok()) << text << ": " << strict.status();
    EXPECT_EQ(*strict, json::parse(text)) << text;
    EXPECT_EQ(strict->dump(), original.dump()) << text;
    for (size_t cut = 0; cut < text.size(); cut += 1 + text.size() / 16) {
      const std::string part = text.substr(0, cut);
      const bool accepted = json::accept(part);
      auto r = ParseStrictJson(part, 8, "doc");
      EXPECT_EQ(r.ok(), accepted) << "cut at " << cut << " of " << text;
      if (r.ok()) {
        EXPECT_EQ(*r, json::parse(part));
      }
    }
  }
  // A key repeated at any depth is refused; the same key in siblings is not.
  EXPECT_TRUE(IsError(ParseStrictJson(R"({"a":[{"x":1,"y":{"x":2},"x":3}]})", 8, "doc").status(),
                      kDL, {"doc", "member \"x\" appears twice"}));
  EXPECT_TRUE(ParseStrictJson(R"({"a":[{"x":1},{"x":2}],"x":{"x":3}})", 8, "doc").ok());
}

TEST(ManifestDuplicateKeyTest, CaughtEvenWithAValidChecksum) {
  // The duplicate-key text must carry a checksum that matches what nlohmann
  // keeps (the last value); otherwise the dup test would prove nothing.
  const std::string dup =
      InsertAfter(Compact(ValidManifestBytes()), "\"objects\":[{", "\"size\":1,");
  json lenient = json::parse(dup);  // no duplicate detection
  const std::string sum = lenient.at("checksum").get<std::string>();
  lenient.erase("checksum");
  ASSERT_EQ(HashBytes(lenient.dump()).Hex(), sum);
  ASSERT_EQ(lenient["objects"][0]["size"].get<uint64_t>(), MakeManifest().objects[0].size);

  EXPECT_TRUE(IsError(ParseManifest(dup, kWhere).status(), kDL,
                      {kWhere, "member \"size\"", "appears twice"}));
  // Same keys in sibling objects are not duplicates.
  EXPECT_TRUE(ParseManifest(Compact(ValidManifestBytes()), kWhere).ok());
}

TEST(ManifestLimitsTest, ValuesAtTheLimitsAreAccepted) {
  // The limits are inclusive: exactly-at-the-limit values parse.
  json j = json::parse(ValidManifestBytes());
  j["objects"][1]["name"] = std::string(kMaxKeyComponent, 'n');
  j["objects"][1]["chunk_size"] = kMaxChunkBytes;
  j["objects"][1]["size"] = kMaxChunkBytes;
  j["objects"][1]["chunks"] = json::array({std::string(32, 'f')});
  j["objects"][2]["chunk_size"] = kMinChunkBytes;
  j["metadata"][std::string(kMaxMetadataKeyBytes, 'k')] = std::string(kMaxMetadataValueBytes, 'v');
  auto r = ParseManifest(Reseal(j), kWhere);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->objects[1].name, std::string(kMaxKeyComponent, 'n'));
  EXPECT_EQ(r->objects[1].chunk_size, kMaxChunkBytes);
}

// nlohmann's lexer treats a NUL byte as the end of input, so a complete
// manifest followed by "\0" and anything at all (a zero-filled tail, junk)
// would parse as if the tail were not there; ParseSealed rejects NUL bytes.
TEST(ManifestStrictnessTest, BytesAfterANulAreRejected) {
  const std::string tail("\0\0\0garbage", 10);
  EXPECT_TRUE(IsError(ParseManifest(ValidManifestBytes() + tail, kWhere).status(), kDL, {kWhere}));
  EXPECT_TRUE(IsError(ParseLatest(ValidLatestBytes() + tail, "LATEST").status(), kDL, {"LATEST"}));
}

// A manifest nested a million levels deep is 2 MB, far below
// kMaxManifestBytes. The parse is iterative, but ParseSealed re-serialises the
// object with json::dump() to check the checksum, and dump() recurses once per
// level, so without a depth bound this overflows the stack (SIGSEGV). It runs
// in a child process, so a crash fails this test only.
TEST(ManifestHostileDeathTest, DeepNestingIsDataLossNotACrash) {
  constexpr size_t kDepth = 1000000;
  std::string deep = "{\"checksum\":\"" + std::string(32, '0') + "\",\"x\":";
  deep += std::string(kDepth, '[') + std::string(kDepth, ']') + "}";
  ASSERT_LT(deep.size(), kMaxManifestBytes);
  EXPECT_EXIT(
      {
        auto r = ParseManifest(deep, kWhere);
        std::_Exit(!r.ok() && r.status().code() == Code::kDataLoss ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

// ---------------------------------------------------------------------------
// Hostile LATEST

std::vector<HostileCase> LatestCases() {
  std::vector<HostileCase> v;
  v.push_back(R(
      "Empty", [](const std::string&) { return std::string(); }, kDL, "", "empty"));
  v.push_back(R(
      "Truncated", [](const std::string& s) { return s.substr(0, s.size() / 2); }, kDL, "",
      "not valid JSON"));
  v.push_back(R(
      "TruncatedBeforeClosingBrace", [](const std::string& s) { return s.substr(0, s.rfind('}')); },
      kDL, "", "not valid JSON"));
  v.push_back(R(
      "TopLevelArray", [](const std::string& s) { return "[" + s + "]"; }, kDL, "",
      "expected a JSON object"));
  v.push_back(R(
      "LargerThanMaxLatestBytes",
      [](const std::string& s) { return s + std::string(kMaxLatestBytes + 1 - s.size(), ' '); },
      kDL, "", std::to_string(kMaxLatestBytes) + "-byte limit"));
  v.push_back(R("ChecksumOneDigitFlipped", FlipChecksumDigit, kDL, "", "self-checksum mismatch"));
  v.push_back(R("StepChangedWithoutReseal", Unsealed([](json& j) { j["step"] = 1201; }), kDL, "",
                "self-checksum mismatch"));
  v.push_back(R("MissingChecksum", Unsealed([](json& j) { j.erase("checksum"); }), kDL,
                "'checksum'", "missing"));
  v.push_back(R(
      "DuplicateStep",
      [](const std::string& s) { return InsertAfter(Compact(s), "{", "\"step\":1,"); }, kDL,
      "member \"step\"", "appears twice"));
  v.push_back(J(
      "WrongFormat", [](json& j) { j["format"] = "ckptio-manifest"; }, kDL, "field 'format'",
      "expected \"ckptio-latest\""));
  v.push_back(J(
      "FutureVersion", [](json& j) { j["version"] = kLatestFormatVersion + 1; },
      Code::kFailedPrecondition, "format version " + std::to_string(kLatestFormatVersion + 1),
      "newer"));
  v.push_back(J(
      "MissingStep", [](json& j) { j.erase("step"); }, kDL, "field 'step'", "missing"));
  v.push_back(J(
      "StepAsString", [](json& j) { j["step"] = "1200"; }, kDL, "field 'step'",
      "expected an integer"));
  v.push_back(J(
      "StepNegative", [](json& j) { j["step"] = -1; }, kDL, "field 'step'", "outside"));
  v.push_back(J(
      "StepAboveMax", [](json& j) { j["step"] = kMaxStep + 1; }, kDL, "field 'step'", "outside"));
  v.push_back(J(
      "GenerationZero", [](json& j) { j["generation"] = 0; }, kDL, "field 'generation'",
      "outside"));
  v.push_back(J(
      "MissingManifestHash", [](json& j) { j.erase("manifest_xxh3_128"); }, kDL,
      "field 'manifest_xxh3_128'", "missing"));
  v.push_back(J(
      "ManifestHashNotHex", [](json& j) { j["manifest_xxh3_128"] = std::string(32, 'q'); }, kDL,
      "field 'manifest_xxh3_128'", "32 hex digits"));
  v.push_back(J(
      "ManifestHashTooShort", [](json& j) { j["manifest_xxh3_128"] = std::string(31, 'a'); }, kDL,
      "field 'manifest_xxh3_128'", "32 hex digits"));
  v.push_back(J(
      "UnknownField", [](json& j) { j["objects"] = json::array(); }, kDL, "field 'objects'",
      "unknown field"));
  return v;
}

class LatestHostileTest : public ::testing::TestWithParam<HostileCase> {};

TEST_P(LatestHostileTest, RejectedWithPreciseError) {
  const HostileCase& c = GetParam();
  const std::string where = "store-x/LATEST";
  auto r = ParseLatest(Build(c, ValidLatestBytes()), where);
  ASSERT_FALSE(r.ok()) << c.name << " was accepted";
  EXPECT_TRUE(IsError(r.status(), c.code, {where, c.field, c.what}));
}

INSTANTIATE_TEST_SUITE_P(Cases, LatestHostileTest, ::testing::ValuesIn(LatestCases()),
                         [](const ::testing::TestParamInfo<HostileCase>& p) {
                           return p.param.name;
                         });

TEST(LatestLimitTest, ExactlyMaxLatestBytesIsAccepted) {
  const std::string& s = ValidLatestBytes();
  ASSERT_LT(s.size(), kMaxLatestBytes);
  auto r = ParseLatest(s + std::string(kMaxLatestBytes - s.size(), ' '), "LATEST");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, MakeLatest().step);
}

// ---------------------------------------------------------------------------
// Step directory names

TEST(StepDirNameTest, FormatsTwelveDigits) {
  EXPECT_EQ(StepDirName(0), "step-000000000000");
  EXPECT_EQ(StepDirName(1), "step-000000000001");
  EXPECT_EQ(StepDirName(1200), "step-000000001200");
  EXPECT_EQ(StepDirName(kMaxStep), "step-999999999999");
}

TEST(StepDirNameTest, ParsesWhatItFormats) {
  for (int64_t step : {int64_t{0}, int64_t{1}, int64_t{1200}, int64_t{123456789012}, kMaxStep}) {
    EXPECT_EQ(ParseStepDirName(StepDirName(step)), step) << step;
  }
  EXPECT_EQ(ParseStepDirName("step-000000001200"), 1200);
}

TEST(StepDirNameTest, RejectsEverythingElse) {
  for (std::string_view bad : {
           "",
           "step-",
           "step-00000000001",    // 11 digits
           "step-0000000000001",  // 13 digits
           "step-00000000000a",   // non-digit
           "step-0000000000-1",   // sign inside
           "step--00000000001",   // negative
           "step-+00000000001",   // plus sign
           "step- 00000000001",   // space
           "Step-000000000001",   // case
           "STEP-000000000001",
           "step_000000000001",  // wrong separator
           "stepx000000000001",
           "xtep-000000000001",
           "steps-00000000001",
           " step-000000000001",  // leading space
           "step-000000000001 ",  // trailing space
           "step-000000000001/",  // trailing slash
           "step-000000001200.ckptio-tmp.x",
           "000000000001",
       }) {
    EXPECT_EQ(ParseStepDirName(bad), -1) << "\"" << bad << "\"";
  }
  EXPECT_EQ(ParseStepDirName(std::string_view("step-00000000000\0", 17)), -1);
}

// ---------------------------------------------------------------------------
// Keys and object names

TEST(ValidateKeyTest, AcceptsLegalKeys) {
  const std::string c200(kMaxKeyComponent, 'c');
  // Five 200-byte components, four slashes and one 19-byte component: 1024.
  const std::string k1024 =
      c200 + "/" + c200 + "/" + c200 + "/" + c200 + "/" + c200 + "/" + std::string(19, 'x');
  ASSERT_EQ(k1024.size(), kMaxKeyLength);
  for (const std::string& key :
       {std::string("a"), std::string("MANIFEST.json"), std::string("step-000000000001/x.pt"),
        std::string("a/b/c"), std::string("A-Z_a-z.0-9"), std::string(".lock"),
        std::string(kTempMarker) + "host.1.abc", std::string("...") /* not "." or ".." */,
        std::string("a/.b/c"), c200, k1024}) {
    EXPECT_TRUE(ValidateKey(key).ok()) << key << ": " << ValidateKey(key);
  }
}

TEST(ValidateKeyTest, RejectsIllegalKeysNamingTheOffence) {
  const Code kIA = Code::kInvalidArgument;
  const std::string c200(kMaxKeyComponent, 'c');
  const std::string k1025 =
      c200 + "/" + c200 + "/" + c200 + "/" + c200 + "/" + c200 + "/" + std::string(20, 'x');
  ASSERT_EQ(k1025.size(), kMaxKeyLength + 1);
  struct Bad {
    std::string key;
    std::string what;
  };
  for (const Bad& b : std::vector<Bad>{
           {"", "empty"},
           {"/abs", "absolute"},
           {"/", "absolute"},
           {"a/", "empty path component"},
           {"a//b", "empty path component"},
           {".", "'.' and '..'"},
           {"..", "'.' and '..'"},
           {"../x", "'.' and '..'"},
           {"a/./b", "'.' and '..'"},
           {"a/..", "'.' and '..'"},
           {c200 + "c", "longer than 200 bytes"},
           {"a/" + c200 + "c", "longer than 200 bytes"},
           {k1025, "longer than 1024 bytes"},
           {"a b", "only [A-Za-z0-9._-]"},
           {std::string("a\0b", 3), "only [A-Za-z0-9._-]"},
           {"a\nb", "only [A-Za-z0-9._-]"},
           {"a\\b", "only [A-Za-z0-9._-]"},
           {"a:b", "only [A-Za-z0-9._-]"},
           {"a*b", "only [A-Za-z0-9._-]"},
           {"é", "only [A-Za-z0-9._-]"},
           {"\xff", "only [A-Za-z0-9._-]"},
       }) {
    EXPECT_TRUE(IsError(ValidateKey(b.key), kIA, {b.what})) << "key of " << b.key.size() << " B";
  }
}

TEST(ValidateObjectNameTest, AcceptsFlatNames) {
  for (const std::string& name :
       {std::string("model.safetensors"), std::string("optim.pt"), std::string("a"),
        std::string("rank-0_state.bin"), std::string("MANIFEST.json.bak"),
        std::string(kMaxKeyComponent, 'n')}) {
    EXPECT_TRUE(ValidateObjectName(name).ok()) << name << ": " << ValidateObjectName(name);
  }
}

TEST(ValidateObjectNameTest, RejectsNamesThatAreNotFlatOrAreReserved) {
  const Code kIA = Code::kInvalidArgument;
  EXPECT_TRUE(IsError(ValidateObjectName("a/b"), kIA, {"'/' is not allowed"}));
  EXPECT_TRUE(IsError(ValidateObjectName("../x"), kIA, {"'/' is not allowed"}));
  EXPECT_TRUE(IsError(ValidateObjectName("/etc/passwd"), kIA, {"'/' is not allowed"}));
  EXPECT_TRUE(IsError(ValidateObjectName(".hidden"), kIA, {"reserved"}));
  EXPECT_TRUE(IsError(ValidateObjectName("."), kIA, {"reserved"}));
  EXPECT_TRUE(IsError(ValidateObjectName(".."), kIA, {"reserved"}));
  EXPECT_TRUE(IsError(ValidateObjectName(std::string(kTempMarker) + "x"), kIA, {"reserved"}));
  EXPECT_TRUE(IsError(ValidateObjectName("MANIFEST.json"), kIA, {"reserved for the manifest"}));
  EXPECT_TRUE(IsError(ValidateObjectName(""), kIA, {"empty"}));
  EXPECT_TRUE(IsError(ValidateObjectName(std::string(kMaxKeyComponent + 1, 'n')), kIA,
                      {"longer than 200"}));
  EXPECT_TRUE(IsError(ValidateObjectName(std::string("a\0b", 3)), kIA, {"a\\x00b"}));
  EXPECT_TRUE(IsError(ValidateObjectName("a\nb"), kIA, {"a\\nb"}));
}

TEST(ValidateMetadataTest, EnforcesLimitsAndUtf8) {
  const Code kIA = Code::kInvalidArgument;
  EXPECT_TRUE(ValidateMetadata("k", "").ok());
  EXPECT_TRUE(ValidateMetadata("ключ", "日本語 🚀").ok());
  EXPECT_TRUE(ValidateMetadata(std::string(kMaxMetadataKeyBytes, 'k'),
                               std::string(kMaxMetadataValueBytes, 'v'))
                  .ok());
  EXPECT_TRUE(IsError(ValidateMetadata("", "v"), kIA, {"1-256 bytes"}));
  EXPECT_TRUE(IsError(ValidateMetadata(std::string(kMaxMetadataKeyBytes + 1, 'k'), "v"), kIA,
                      {"1-256 bytes"}));
  EXPECT_TRUE(
      IsError(ValidateMetadata("k", std::string(kMaxMetadataValueBytes + 1, 'v')), kIA, {"over"}));
  EXPECT_TRUE(IsError(ValidateMetadata("k", "\xff\xfe"), kIA, {"UTF-8"}));
  EXPECT_TRUE(IsError(ValidateMetadata("\xc3", "v"), kIA, {"UTF-8"}));
}

// ---------------------------------------------------------------------------
// URIs and the backend registry

TEST(UriTest, FileUri) {
  auto u = Uri::Parse("file:///abs/p");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, "file");
  EXPECT_EQ(u->authority, "");
  EXPECT_EQ(u->path, "/abs/p");
  EXPECT_TRUE(u->params.empty());
}

TEST(UriTest, PlainAbsolutePathIsFile) {
  auto u = Uri::Parse("/abs/p");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, "file");
  EXPECT_EQ(u->authority, "");
  EXPECT_EQ(u->path, "/abs/p");
  EXPECT_TRUE(u->params.empty());
}

TEST(UriTest, PlainRelativePathIsFile) {
  auto u = Uri::Parse("relative/p");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, "file");
  EXPECT_EQ(u->path, "relative/p");
}

TEST(UriTest, NfsUriWithQuery) {
  auto u = Uri::Parse("nfs://server/export/p?version=3&port=2049");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, "nfs");
  EXPECT_EQ(u->authority, "server");
  EXPECT_EQ(u->path, "/export/p");
  const std::map<std::string, std::string> want = {{"version", "3"}, {"port", "2049"}};
  EXPECT_EQ(u->params, want);
}

TEST(UriTest, SchemeIsLowercased) {
  auto u = Uri::Parse("FILE:///x");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, "file");
  EXPECT_EQ(u->path, "/x");
  auto n = Uri::Parse("NfS://Server/x");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->scheme, "nfs");
  EXPECT_EQ(n->authority, "Server");  // only the scheme is case-folded
}

TEST(UriTest, RejectsMalformedUris) {
  const Code kIA = Code::kInvalidArgument;
  EXPECT_TRUE(
      IsError(Uri::Parse("nfs://s/p?version=3&version=4").status(), kIA, {"'version'", "twice"}));
  EXPECT_TRUE(IsError(Uri::Parse("://x").status(), kIA, {"://x", "scheme"}));
  EXPECT_TRUE(IsError(Uri::Parse("").status(), kIA, {"empty"}));
  EXPECT_TRUE(IsError(Uri::Parse(std::string_view("file:///a\0b", 11)).status(), kIA, {"NUL"}));
  EXPECT_TRUE(IsError(Uri::Parse("my scheme://x").status(), kIA, {"scheme"}));
  EXPECT_TRUE(IsError(Uri::Parse("nfs://s/p?=3").status(), kIA, {"no name"}));
}

// "<scheme>:/..." without the "//" is not a plain path: taken as one,
// "nfs:/filer/export" would write to the local directory ./nfs:/filer/export.
// It is refused, saying what to write, except RFC 8089's file:/abs, which is
// the path /abs. A ':' not followed by '/' stays part of a plain path.
TEST(UriTest, SchemeWithoutDoubleSlashIsNotAPlainPath) {
  const Code kIA = Code::kInvalidArgument;
  EXPECT_TRUE(IsError(Uri::Parse("nfs:/filer/export").status(), kIA,
                      {"nfs:/filer/export", "//", "nfs://filer/export", "./nfs:/filer/export"}));
  EXPECT_TRUE(IsError(Uri::Parse("NFS:/filer/export").status(), kIA, {"nfs://filer/export"}));
  EXPECT_TRUE(IsError(Uri::Parse("s3:/bucket").status(), kIA, {"s3://bucket"}));
  EXPECT_TRUE(IsError(Uri::Parse("my+fs.v2:/x").status(), kIA, {"my+fs.v2://x"}));
  EXPECT_TRUE(IsError(Uri::Parse("nfs:/").status(), kIA, {"//"}));

  for (const char* text : {"file:/ckpt/run", "FILE:/ckpt/run"}) {
    auto f = Uri::Parse(text);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->scheme, "file");
    EXPECT_EQ(f->authority, "");
    EXPECT_EQ(f->path, "/ckpt/run");
    EXPECT_TRUE(f->params.empty());
  }

  // Colons elsewhere are plain path characters.
  for (const char* text :
       {"run:1/x", "run:1", "./nfs:/filer/export", "a/nfs:/x", "nfs:filer", "/ckpt/step:5"}) {
    auto u = Uri::Parse(text);
    ASSERT_TRUE(u.ok()) << text << ": " << u.status();
    EXPECT_EQ(u->scheme, "file") << text;
    EXPECT_EQ(u->path, text);
  }
}

// A backend that does nothing; the registry tests only need its identity.
class NullBackend : public StorageBackend {
 public:
  explicit NullBackend(std::string uri) : uri_(std::move(uri)) {}
  std::string Uri() const override { return uri_; }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view, WriteMode) override {
    return Nope();
  }
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view) override { return Nope(); }
  Result<ObjectInfo> Stat(std::string_view) override { return Nope(); }
  Result<std::vector<std::string>> List(std::string_view) override { return Nope(); }
  Status Delete(std::string_view) override { return Nope(); }

 private:
  static Status Nope() { return Status(Code::kUnimplemented, "null backend"); }
  std::string uri_;
};

// Registers "file" and "mem" factories that record the URI they were given.
struct TestRegistry {
  BackendRegistry registry;
  std::shared_ptr<std::vector<ckptio::Uri>> seen = std::make_shared<std::vector<ckptio::Uri>>();

  TestRegistry() {
    for (const char* scheme : {"file", "mem"}) {
      std::string name = scheme;
      Status st = registry.Register(
          name,
          [log = seen, name](const ckptio::Uri& uri) -> Result<std::unique_ptr<StorageBackend>> {
            log->push_back(uri);
            return std::unique_ptr<StorageBackend>(
                std::make_unique<NullBackend>(name + "://" + uri.authority + uri.path));
          });
      EXPECT_TRUE(st.ok()) << st;
    }
  }
};

TEST(BackendRegistryTest, OpensByScheme) {
  TestRegistry t;
  EXPECT_EQ(t.registry.Schemes(), (std::vector<std::string>{"file", "mem"}));

  auto mem = t.registry.Open("mem://bucket/run42?x=1");
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_EQ((*mem)->Uri(), "mem://bucket/run42");
  ASSERT_EQ(t.seen->size(), 1u);
  EXPECT_EQ(t.seen->back().scheme, "mem");
  EXPECT_EQ(t.seen->back().authority, "bucket");
  EXPECT_EQ(t.seen->back().path, "/run42");
  EXPECT_EQ(t.seen->back().params.at("x"), "1");

  auto plain = t.registry.Open("/ckpt/run42");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->Uri(), "file:///ckpt/run42");

  auto upper = t.registry.Open("MEM://b/p");
  ASSERT_TRUE(upper.ok()) << upper.status();
  EXPECT_EQ((*upper)->Uri(), "mem://b/p");

  // The default TryLock says the backend cannot lock, naming it.
  auto lock = (*upper)->TryLock(".lock");
  EXPECT_TRUE(IsError(lock.status(), Code::kUnimplemented, {"mem://b/p"}));
}

TEST(BackendRegistryTest, UnknownSchemeListsKnownOnes) {
  auto count = [](const std::string& s, std::string_view what) {
    size_t n = 0;
    for (size_t pos = s.find(what); pos != std::string::npos; pos = s.find(what, pos + 1)) ++n;
    return n;
  };
  TestRegistry t;
  auto r = t.registry.Open("s3://bucket/x");
  EXPECT_TRUE(IsError(r.status(), Code::kInvalidArgument, {"s3", "file://", "mem://"}));
  EXPECT_TRUE(t.seen->empty());

  // With nothing registered neither name is listed (the message may still
  // mention file:// as the meaning of a plain path, so compare counts).
  BackendRegistry empty;
  auto none = empty.Open("s3://bucket/x");
  EXPECT_TRUE(IsError(none.status(), Code::kInvalidArgument, {"s3"}));
  EXPECT_EQ(count(none.status().message(), "mem://"), 0u) << none.status();
  EXPECT_GT(count(r.status().message(), "file://"), count(none.status().message(), "file://"))
      << r.status() << "\nvs\n"
      << none.status();
}

TEST(BackendRegistryTest, MalformedUriIsInvalidArgument) {
  TestRegistry t;
  EXPECT_TRUE(IsError(t.registry.Open("://x").status(), Code::kInvalidArgument, {}));
  EXPECT_TRUE(
      IsError(t.registry.Open("mem://b/p?a=1&a=2").status(), Code::kInvalidArgument, {"twice"}));
  EXPECT_TRUE(t.seen->empty());
}

TEST(BackendRegistryTest, RegisterValidatesScheme) {
  BackendRegistry r;
  auto factory = [](const ckptio::Uri&) -> Result<std::unique_ptr<StorageBackend>> {
    return Status(Code::kUnavailable, "factory failed");
  };
  EXPECT_TRUE(r.Register("mem", factory).ok());
  EXPECT_TRUE(IsError(r.Register("mem", factory), Code::kAlreadyExists, {"mem"}));
  EXPECT_TRUE(IsError(r.Register("Mem", factory), Code::kInvalidArgument, {}));
  EXPECT_TRUE(IsError(r.Register("", factory), Code::kInvalidArgument, {}));
  EXPECT_TRUE(IsError(r.Register("my scheme", factory), Code::kInvalidArgument, {}));
  EXPECT_TRUE(IsError(r.Register("a/b", factory), Code::kInvalidArgument, {}));
  EXPECT_EQ(r.Schemes(), std::vector<std::string>{"mem"});
  // A factory's error comes back unchanged.
  EXPECT_TRUE(IsError(r.Open("mem://x/y").status(), Code::kUnavailable, {"factory failed"}));
}

// ---------------------------------------------------------------------------
// Hash128 and Hasher

TEST(Hash128Test, HexIsHighThenLowLowercase) {
  EXPECT_EQ((Hash128{0x0123456789abcdefULL, 0xfedcba9876543210ULL}).Hex(),
            "0123456789abcdeffedcba9876543210");
  EXPECT_EQ((Hash128{1, 2}).Hex(), "00000000000000010000000000000002");
  EXPECT_EQ(Hash128{}.Hex(), std::string(32, '0'));
  EXPECT_EQ((Hash128{~0ULL, ~0ULL}).Hex(), std::string(32, 'f'));
}

TEST(Hash128Test, FromHexRoundTripsAndAcceptsEitherCase) {
  std::mt19937_64 rng(99);
  for (int i = 0; i < 100; ++i) {
    const Hash128 h = RandomHash(rng);
    auto back = Hash128::FromHex(h.Hex());
    ASSERT_TRUE(back.has_value()) << h.Hex();
    EXPECT_EQ(*back, h);
  }
  auto upper = Hash128::FromHex("0123456789ABCDEFFEDCBA9876543210");
  ASSERT_TRUE(upper.has_value());
  EXPECT_EQ(*upper, (Hash128{0x0123456789abcdefULL, 0xfedcba9876543210ULL}));
}

TEST(Hash128Test, FromHexRejectsMalformed) {
  const std::string ok = "0123456789abcdef0123456789abcdef";
  ASSERT_TRUE(Hash128::FromHex(ok).has_value());
  EXPECT_FALSE(Hash128::FromHex(ok.substr(0, 31)).has_value());
  EXPECT_FALSE(Hash128::FromHex(ok + "0").has_value());
  EXPECT_FALSE(Hash128::FromHex("").has_value());
  EXPECT_FALSE(Hash128::FromHex("0x" + ok.substr(2)).has_value());
  EXPECT_FALSE(Hash128::FromHex(" " + ok.substr(1)).has_value());
  EXPECT_FALSE(Hash128::FromHex(ok.substr(1) + "g").has_value());
  EXPECT_FALSE(Hash128::FromHex(ok.substr(1) + "-").has_value());
  EXPECT_FALSE(
      Hash128::FromHex(std::string(ok.substr(0, 16)) + std::string(1, '\0') + ok.substr(17))
          .has_value());
}

TEST(Hash128Test, HashBytesIsXxh3_128WithCanonicalHex) {
  for (const std::string& input : {std::string(), std::string("a"), std::string(1000, 'x')}) {
    const XXH128_hash_t want = XXH3_128bits(input.data(), input.size());
    const Hash128 got = HashBytes(input);
    EXPECT_EQ(got.high, want.high64);
    EXPECT_EQ(got.low, want.low64);

    // xxHash's canonical form (what xxh128sum prints) is big-endian high64
    // then low64.
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, want);
    std::string hex;
    static constexpr char kDigits[] = "0123456789abcdef";
    for (unsigned char b : canon.digest) {
      hex += kDigits[b >> 4];
      hex += kDigits[b & 0xf];
    }
    EXPECT_EQ(got.Hex(), hex);
  }
  // Published XXH3-128 test vectors (seed 0).
  EXPECT_EQ(HashBytes("").Hex(), "99aa06d3014798d86001c324468d497f");
  EXPECT_EQ(HashBytes("a").Hex(), "a96faf705af16834e6c632b61e964e1f");
  EXPECT_EQ(HashBytes(nullptr, 0), HashBytes(""));
}

TEST(HasherTest, StreamingInPiecesEqualsOneShot) {
  std::mt19937_64 rng(5);
  std::string data(100000, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  const Hash128 want = HashBytes(data);

  for (size_t piece :
       {size_t{1}, size_t{7}, size_t{64}, size_t{240}, size_t{1000}, size_t{65536}, data.size()}) {
    Hasher h;
    for (size_t off = 0; off < data.size(); off += piece)
      h.Update(data.data() + off, std::min(piece, data.size() - off));
    EXPECT_EQ(h.Digest(), want) << "piece " << piece;
  }

  // Irregular pieces, empty updates, Digest() does not disturb the state.
  Hasher h;
  size_t off = 0;
  for (size_t piece : {size_t{0}, size_t{3}, size_t{250}, size_t{0}, size_t{1021}, size_t{5000}}) {
    h.Update(data.data() + off, piece);
    off += piece;
    (void)h.Digest();
  }
  h.Update(data.data() + off, data.size() - off);
  EXPECT_EQ(h.Digest(), want);
  EXPECT_EQ(h.Digest(), want);

  // Move keeps the state; Reset starts over.
  Hasher moved = std::move(h);
  EXPECT_EQ(moved.Digest(), want);
  moved.Reset();
  EXPECT_EQ(moved.Digest(), HashBytes(""));
  moved.Update("a", 1);
  EXPECT_EQ(moved.Digest(), HashBytes("a"));
}

}  // namespace
}  // namespace ckptio
