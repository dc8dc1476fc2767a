// Hostile manifests and LATEST files: each rejected with a precise error
// naming the file and the field. Built from a valid file, edited as JSON
// and re-sealed (manifest_test_util.h), so each case reaches the check it
// targets instead of stopping at the checksum.
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/backend.h"
#include "manifest_test_util.h"
#include "strict_json.h"
#include "text.h"

namespace ckptio::manifest_testing {
namespace {

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

// The strict parser is ckptio's own (one pass that also refuses repeated
// keys): on random documents it must agree with nlohmann's parse exactly,
// and on every truncation of them accept and refuse alike.
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
    EXPECT_EQ(TapeToJson(*strict), json::parse(text)) << text;
    EXPECT_EQ(TapeToJson(*strict).dump(), original.dump()) << text;
    for (size_t cut = 0; cut < text.size(); cut += 1 + text.size() / 16) {
      const std::string part = text.substr(0, cut);
      const bool accepted = json::accept(part);
      auto r = ParseStrictJson(part, 8, "doc");
      EXPECT_EQ(r.ok(), accepted) << "cut at " << cut << " of " << text;
      if (r.ok()) {
        EXPECT_EQ(TapeToJson(*r), json::parse(part));
      }
    }
  }
  // A key repeated at any depth is refused; the same key in siblings is not.
  EXPECT_TRUE(IsError(ParseStrictJson(R"({"a":[{"x":1,"y":{"x":2},"x":3}]})", 8, "doc").status(),
                      kDL, {"doc", "member \"x\" appears twice"}));
  EXPECT_TRUE(ParseStrictJson(R"({"a":[{"x":1},{"x":2}],"x":{"x":3}})", 8, "doc").ok());
  // The empty name too (found by fuzz_json: once reported as invalid JSON
  // with no reason).
  EXPECT_TRUE(IsError(ParseStrictJson(R"({"":1,"b":2,"":3})", 8, "doc").status(), kDL,
                      {"doc", "member \"\" appears twice"}));
  // Large objects (metadata) are checked by a set past 16 members: a repeat
  // of an early member found late, and of a late one, both refused.
  auto object_of = [](int n, const std::string& extra) {
    std::string text = "{";
    for (int i = 0; i < n; ++i)
      text += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":" + std::to_string(i);
    return text + extra + "}";
  };
  for (int n : {15, 16, 17, 40}) {
    auto ok = ParseStrictJson(object_of(n, ""), 8, "doc");
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(TapeToJson(*ok).size(), static_cast<size_t>(n));
    for (int repeat : {0, n / 2, n - 1})
      EXPECT_TRUE(
          IsError(ParseStrictJson(object_of(n, ",\"k" + std::to_string(repeat) + "\":0"), 8, "doc")
                      .status(),
                  kDL, {"doc", "member \"k" + std::to_string(repeat) + "\" appears twice"}))
          << n << " members, k" << repeat << " again";
  }
  // Nesting: at the limit accepted, one past it refused.
  EXPECT_TRUE(ParseStrictJson("[[[1]]]", 3, "doc").ok());
  EXPECT_TRUE(IsError(ParseStrictJson("[[[[1]]]]", 3, "doc").status(), kDL,
                      {"doc", "nests deeper than 3 levels"}));
}

// Whether the strict parser and nlohmann accept `text` alike and, where both
// do, read the same document; texts the strict parser refuses for its own
// rules (a repeated key, nesting past 8, a NUL byte) are not compared.
::testing::AssertionResult AgreesWithNlohmann(const std::string& text) {
  auto strict = ParseStrictJson(text, 8, "doc");
  if (!strict.ok()) {
    const std::string why = strict.status().message();
    if (why.find("appears twice") != std::string::npos ||
        why.find("nests deeper") != std::string::npos || text.find('\0') != std::string::npos)
      return ::testing::AssertionSuccess();
    if (why.find("is not valid JSON (torn or corrupt): ") == std::string::npos ||
        why.find(" at byte ") == std::string::npos)
      return ::testing::AssertionFailure() << "message without what and where: " << why;
  }
  if (strict.ok() != json::accept(text))
    return ::testing::AssertionFailure()
           << "strict " << (strict.ok() ? "accepts" : "refuses") << " what nlohmann "
           << (strict.ok() ? "refuses" : "accepts") << ": " << Printable(text)
           << (strict.ok() ? "" : " (" + strict.status().message() + ")");
  if (strict.ok() && TapeToJson(*strict) != json::parse(text))
    return ::testing::AssertionFailure()
           << "read differently: " << TapeToJson(*strict).dump() << " vs "
           << json::parse(text).dump() << " from " << Printable(text);
  return ::testing::AssertionSuccess();
}

// The byte-level corners of JSON: escapes and surrogates, UTF-8's
// forbidden forms, numbers at the integer limits and past a double's, the
// BOM, whitespace, and what may follow a document.
TEST(StrictJsonTest, AgreesWithNlohmannOnTheCorners) {
  const std::vector<std::string> texts = {"",
                                          " ",
                                          "{}",
                                          "[]",
                                          " [ ] ",
                                          "\t{\r\n}\n",
                                          "\v[]",
                                          "\f[]",
                                          "[1]x",
                                          "[1] [2]",
                                          "[1]]",
                                          "{\"a\":1,}",
                                          "[1,]",
                                          "[,1]",
                                          "{\"a\" 1}",
                                          "{a:1}",
                                          "{'a':1}",
                                          "{\"a\":1 \"b\":2}",
                                          "tru",
                                          "true",
                                          "truex",
                                          "[true,false,null]",
                                          "[nul]",
                                          "[True]",
                                          "[NaN]",
                                          "[Infinity]",
                                          "[-Infinity]",
                                          "[0]",
                                          "[-0]",
                                          "[00]",
                                          "[01]",
                                          "[-]",
                                          "[-01]",
                                          "[+1]",
                                          "[.5]",
                                          "[5.]",
                                          "[1.5e]",
                                          "[1e+]",
                                          "[1E-2]",
                                          "[1e5]",
                                          "[-0.0]",
                                          "[0e0]",
                                          "[1.0e+400]",
                                          "[1e400]",
                                          "[-1e400]",
                                          "[1e-400]",
                                          "[2.2250738585072011e-308]",
                                          "[4.9e-324]",
                                          "[18446744073709551615]",
                                          "[18446744073709551616]",
                                          "[99999999999999999999999]",
                                          "[9223372036854775807]",
                                          "[9223372036854775808]",
                                          "[-9223372036854775808]",
                                          "[-9223372036854775809]",
                                          "[-18446744073709551616]",
                                          "[1.7976931348623157e308]",
                                          "[1.7976931348623159e308]",
                                          std::string("[1") + std::string(400, '0') + "]",
                                          "[\"\\u0041\\u00e9\\u65e5\\ud83d\\ude80\"]",
                                          "[\"\\u0000\"]",
                                          "[\"\\ud83d\"]",
                                          "[\"\\ud83dx\"]",
                                          "[\"\\ud83d\\u0041\"]",
                                          "[\"\\ude80\"]",
                                          "[\"\\ud83d\\ud83d\"]",
                                          "[\"\\u12\"]",
                                          "[\"\\u12g4\"]",
                                          "[\"\\uABCD\"]",
                                          "[\"\\x41\"]",
                                          "[\"\\a\"]",
                                          "[\"\\/\\b\\f\\n\\r\\t\\\"\\\\\"]",
                                          "[\"\\\"]",
                                          "[\"abc]",
                                          "[\"\t\"]",
                                          "[\"\x1f\"]",
                                          "[\"\x7f\"]",
                                          "[\"\xc3\xa9\"]",
                                          "[\"\xc3\"]",
                                          "[\"\xc0\x80\"]",
                                          "[\"\xc1\xbf\"]",
                                          "[\"\xe0\x80\x80\"]",
                                          "[\"\xe0\xa0\x80\"]",
                                          "[\"\xed\xa0\x80\"]",
                                          "[\"\xed\x9f\xbf\"]",
                                          "[\"\xef\xbf\xbf\"]",
                                          "[\"\xf0\x8f\xbf\xbf\"]",
                                          "[\"\xf0\x90\x80\x80\"]",
                                          "[\"\xf4\x8f\xbf\xbf\"]",
                                          "[\"\xf4\x90\x80\x80\"]",
                                          "[\"\xf5\x80\x80\x80\"]",
                                          "[\"\xff\"]",
                                          "[\"\x80\"]",
                                          "[\"\xe2\x82\"]",
                                          "\xef\xbb\xbf[1]",
                                          "\xef\xbb[1]",
                                          "\xef\xbb\xbf",
                                          " \xef\xbb\xbf[1]",
                                          "[\xef\xbb\xbf"
                                          "1]",
                                          "{\"\xc3\xa9\":1,\"\\u00e9x\":2}",
                                          "{\"\":{\"\":[]}}",
                                          "\"s\"",
                                          "7",
                                          "-7",
                                          "null"};
  for (const std::string& text : texts) EXPECT_TRUE(AgreesWithNlohmann(text));
}

// Random documents with bytes changed, inserted or removed: accepted and
// refused alike, and read alike where accepted.
TEST(StrictJsonTest, AgreesWithNlohmannOnDamagedDocuments) {
  std::mt19937_64 rng(11);
  const std::string alphabet =
      "{}[]\",:\\/ \t\n0123456789-+.eEtrufalsn\x01\x1f\x7f\x80\xbf\xc3\xe0"
      "\xed\xf0\xf4\xff";
  const json base =
      json::parse(R"({"format":"x","n":[0,-1,18446744073709551615,1.5e-3],)"
                  R"("s":"a\u00e9\ud83d\ude80\n\"","o":{"k":[true,false,null],"e":{}}})");
  const std::string text = base.dump();
  int accepted = 0;
  for (int round = 0; round < 20000; ++round) {
    std::string damaged = text;
    for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0; --edits) {
      const size_t at = rng() % (damaged.size() + 1);
      const char c = alphabet[rng() % alphabet.size()];
      switch (rng() % 3) {
        case 0:
          if (at < damaged.size()) damaged[at] = c;
          break;
        case 1:
          damaged.insert(at, 1, c);
          break;
        default:
          if (at < damaged.size()) damaged.erase(at, 1);
      }
    }
    ASSERT_TRUE(AgreesWithNlohmann(damaged)) << "round " << round;
    accepted += json::accept(damaged);
  }
  // The damage left some documents valid (digits, spaces): both sides of
  // the comparison were exercised.
  EXPECT_GT(accepted, 500);
  EXPECT_LT(accepted, 19000);
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
// Tensor entries: converted one by one as the parse reaches them (the
// document's tape never holds them all), in the writer's spelling; any
// other spelling is parsed whole. Both must judge alike and in the same
// order: what the file is, then its objects, then its tensors.

Manifest WithTensors() {
  Manifest m = MakeManifest();
  for (int i = 0; i < 3; ++i) {
    TensorEntry t = FcWeight("cuda:" + std::to_string(i), 512 * i);
    t.name = "fc" + std::to_string(i) + ".weight";
    m.tensors.push_back(std::move(t));
  }
  return m;
}

// The file with `edit` applied and re-sealed: as the writer spells it
// (streamed), and indented (parsed whole).
std::vector<std::string> Spellings(const std::function<void(json&)>& edit) {
  json j = json::parse(SerializeManifest(WithTensors()));
  edit(j);
  const std::string sealed = Reseal(std::move(j));
  return {sealed, json::parse(sealed).dump(2)};
}

TEST(ManifestTensorEntriesTest, EverySpellingGivesTheSameEntriesAndDamageIsCaught) {
  for (const std::string& bytes : Spellings([](json&) {})) {
    auto m = ParseManifest(bytes, kWhere);
    ASSERT_TRUE(m.ok()) << m.status() << "\n" << bytes;
    ExpectManifestsEqual(WithTensors(), *m);
    // One digit of the last tensor's offset changed: the seal covers it.
    std::string damaged = bytes;
    const size_t at = damaged.find("1024", damaged.find("fc2.weight") - 100);
    ASSERT_NE(at, std::string::npos) << bytes;
    damaged[at] = '2';
    EXPECT_TRUE(
        IsError(ParseManifest(damaged, kWhere).status(), kDL, {kWhere, "self-checksum mismatch"}))
        << damaged;
  }
}

TEST(ManifestTensorEntriesTest, TheFirstBadEntryIsNamedInEverySpelling) {
  struct Case {
    const char* name;
    std::function<void(json&)> edit;
    Code code;
    std::string field, what;
  };
  const std::vector<Case> cases = {
      {"NotAnObject", [](json& j) { j["tensors"][1] = "fc1.weight"; }, kDL, "'tensors[1]'",
       "expected an object"},
      {"MissingDtype", [](json& j) { j["tensors"][0].erase("dtype"); }, kDL, "'tensors[0].dtype'",
       "missing"},
      {"UnknownField",
       [](json& j) {
         j["tensors"][2]["stride"] = json::array({8, 1});
       },
       kDL, "'tensors[2].stride'", "unknown field"},
      {"ShapeNotAnArray", [](json& j) { j["tensors"][1]["shape"] = "16x8"; }, kDL,
       "'tensors[1].shape'", "expected an array"},
      {"NegativeOffset", [](json& j) { j["tensors"][2]["offset"] = -512; }, kDL,
       "'tensors[2].offset'", "expected an unsigned integer"},
      {"FirstOfTwo",
       [](json& j) {
         j["tensors"][2].erase("name");
         j["tensors"][1]["device"] = 7;
       },
       kDL, "'tensors[1].device'", "expected a string"},
      {"NotAnArray",
       [](json& j) {
         j["tensors"] = {{"fc0.weight", 1}};
       },
       kDL, "'tensors'", "expected an array"},
      {"NewerVersionFirst",
       [](json& j) {
         j["version"] = kManifestFormatVersion + 1;
         j["tensors"][0] = 1;
       },
       Code::kFailedPrecondition, "format version", "newer"},
      {"ObjectsFirst",
       [](json& j) {
         j["objects"][0]["size"] = "big";
         j["tensors"][0] = 1;
       },
       kDL, "'objects[0].size'", "expected an unsigned integer"},
      {"ContentAfterForm",  // a well-formed entry naming no object, after a malformed one
       [](json& j) {
         j["tensors"][0]["object"] = "gone.bin";
         j["tensors"][2]["length"] = "512";
       },
       kDL, "'tensors[2].length'", "expected an unsigned integer"},
  };
  for (const Case& c : cases)
    for (const std::string& bytes : Spellings(c.edit)) {
      SCOPED_TRACE(std::string(c.name) + "\n" + bytes);
      auto m = ParseManifest(bytes, kWhere);
      ASSERT_FALSE(m.ok());
      EXPECT_TRUE(IsError(m.status(), c.code, {kWhere, c.field, c.what}));
    }
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

}  // namespace
}  // namespace ckptio::manifest_testing
