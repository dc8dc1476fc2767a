// The manifest, LATEST and writer-record formats (manifest.h) round trip
// every field, and checked serialisation refuses exactly what readers
// reject. See manifest_test_util.h.
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "manifest_test_util.h"

namespace ckptio::manifest_testing {
namespace {

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

// A tensor named twice in one object is refused wherever the two entries
// are (the check skips its set only while entries come in sorted order);
// the same name in two objects is not a repeat.
TEST(ManifestRoundTripTest, ATensorNamedTwiceInOneObjectIsRefusedWhereverItIs) {
  Manifest m = MakeManifest();
  m.tensors.clear();
  for (const char* object : {"model.safetensors", "optim.pt"})
    for (int i = 0; i < 10; ++i) {
      TensorEntry t = FcWeight("cpu", static_cast<uint64_t>(i) * 512);
      t.object = object;
      t.name = "w" + std::to_string(i);
      m.tensors.push_back(t);
    }
  ASSERT_TRUE(SerializeCheckedManifest(m, kWhere).ok());
  for (auto [first, second] : {std::pair{0, 9}, {9, 0}, {3, 4}, {12, 19}, {0, 19}, {5, 15}}) {
    Manifest bad = m;
    bad.tensors[first].name = bad.tensors[second].name = "fc.bias";
    auto read = ParseManifest(SerializeManifest(bad), kWhere);
    const bool same_object = bad.tensors[first].object == bad.tensors[second].object;
    EXPECT_EQ(read.ok(), !same_object) << first << ", " << second;
    if (same_object) {
      EXPECT_TRUE(IsError(
          read.status(), kDL,
          {"'tensors[" + std::to_string(std::max(first, second)) + "].name'", "appears twice"}))
          << read.status();
    }
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

// The seal covers the document, not its spelling: a file as the writer
// spells it is hashed as it stands, any other spelling (indented, members
// reordered) is re-serialised first. Damage is caught either way.
TEST(ManifestRoundTripTest, AnySpellingOfASealedManifestIsAcceptedAndDamageInAnyIsCaught) {
  const json j = json::parse(ValidManifestBytes());
  json without = j;
  without.erase("checksum");
  const std::string canonical = without.dump();
  // checksum last: not the writer's spelling even without whitespace.
  const std::string last = canonical.substr(0, canonical.size() - 1) + ",\"checksum\":\"" +
                           j["checksum"].get<std::string>() + "\"}";
  for (const std::string& spelled : {ValidManifestBytes(), j.dump(), j.dump(2), j.dump(0), last}) {
    auto m = ParseManifest(spelled, kWhere);
    ASSERT_TRUE(m.ok()) << m.status() << "\n" << spelled;
    ExpectManifestsEqual(MakeManifest(), *m);
    // One digit of the step changed (5 -> 6 in every spelling).
    std::string damaged = spelled;
    const size_t at = damaged.find("\"step\":");
    ASSERT_NE(at, std::string::npos);
    const size_t digit = damaged.find_first_of("0123456789", at);
    damaged[digit] = damaged[digit] == '9' ? '8' : static_cast<char>(damaged[digit] + 1);
    EXPECT_TRUE(IsError(ParseManifest(damaged, kWhere).status(), Code::kDataLoss,
                        {kWhere, "self-checksum mismatch"}))
        << damaged;
  }
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

}  // namespace
}  // namespace ckptio::manifest_testing
