#include "manifest_test_util.h"

#include <utility>

namespace ckptio::manifest_testing {

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

std::string Reseal(json obj) {
  obj.erase("checksum");
  const std::string digest = HashBytes(obj.dump()).Hex();
  obj["checksum"] = digest;
  return obj.dump();
}

std::string Compact(const std::string& valid) { return Reseal(json::parse(valid)); }

std::string InsertAfter(const std::string& s, std::string_view anchor, std::string_view text) {
  size_t pos = s.find(anchor);
  if (pos == std::string::npos) {
    ADD_FAILURE() << "test bug: anchor " << anchor << " not found in " << s;
    return s;
  }
  pos += anchor.size();
  return s.substr(0, pos) + std::string(text) + s.substr(pos);
}

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

}  // namespace ckptio::manifest_testing
