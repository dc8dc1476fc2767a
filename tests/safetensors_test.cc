// The strict safetensors header reader: what it accepts, every way it
// refuses, and the manifest/header cross-check that Verify and loads run.
#include "ckptio/safetensors.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ckptio/ckptio.h"
#include "test_util.h"

namespace ckptio {
namespace {

using json = nlohmann::json;

// A safetensors file: the 8-byte length, `header` (padded to 8 bytes with
// spaces) and `data`.
std::string File(const std::string& header, const std::string& data, int64_t length = -1) {
  std::string text = header;
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t n = length < 0 ? text.size() : static_cast<uint64_t>(length);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + text + data;
}

Result<SafetensorsHeader> Parse(const std::string& file) {
  return ParseSafetensorsHeader(file, file.size(), "t.safetensors");
}

TEST(Safetensors, ParsesAValidFile) {
  json h = {{"__metadata__", {{"format", "pt"}}},
            {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
            {"a", {{"dtype", "U8"}, {"shape", {3, 1}}, {"data_offsets", {8, 11}}}},
            {"z", {{"dtype", "F64"}, {"shape", {0, 5}}, {"data_offsets", {11, 11}}}},
            {"e", {{"dtype", "F8_E4M3"}, {"shape", json::array()}, {"data_offsets", {11, 12}}}}};
  std::string file = File(h.dump(), std::string(12, 'x'));
  auto r = Parse(file);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t start = file.size() - 12;
  EXPECT_EQ(r->data_start, start);
  EXPECT_EQ(r->metadata.at("format"), "pt");
  ASSERT_EQ(r->tensors.size(), 4u);
  EXPECT_EQ(r->tensors[0].name, "b");
  EXPECT_EQ(r->tensors[0].offset, start);
  EXPECT_EQ(r->tensors[0].length, 8u);
  EXPECT_EQ(r->tensors[1].name, "a");
  EXPECT_EQ(r->tensors[1].shape, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(r->tensors[2].name, "z");  // zero-size, before the scalar at the same offset
  EXPECT_EQ(r->tensors[3].name, "e");
  EXPECT_TRUE(r->tensors[3].shape.empty());
  EXPECT_TRUE(Parse(File("{}", "")).ok()) << "an empty file of tensors is valid";
}

struct Bad {
  const char* name;
  std::string file;
  const char* message;  // a part of the error
};

std::string One(const json& spec, const std::string& data) {
  return File(json{{"t", spec}}.dump(), data);
}

TEST(Safetensors, RefusesEveryMalformedHeaderPrecisely) {
  const json ok_spec = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  auto with = [&](const char* key, json value) {
    json s = ok_spec;
    s[key] = std::move(value);
    return One(s, std::string(8, 'x'));
  };
  const std::vector<Bad> cases = {
      {"short", "abc", "too short"},
      {"huge length", File("{}", "", 200'000'000), "over the format's limit"},
      {"length past end", File("{}", "", 64), "past the end"},
      {"not an object start", File("[]", ""), "does not start with '{'"},
      {"not JSON", File("{\"t\":", ""), "not valid JSON"},
      {"duplicate", File(R"({"t":{},"t":{}})", ""), "appears twice"},
      {"deep", File(R"({"t":{"shape":[[[1]]]}})", ""), "nests deeper"},
      {"NUL", File(std::string("{\"t\0\":1}", 9), ""), "NUL"},
      {"tensor not object", File(R"({"t":1})", ""), "is not an object"},
      {"metadata not strings", File(R"({"__metadata__":{"a":1}})", ""), "is not a string"},
      {"unknown member", with("extra", 1), "unknown member"},
      {"unknown dtype", with("dtype", "F128"), "unknown dtype"},
      {"negative size", with("shape", {-2}), "non-negative"},
      {"fractional size", with("shape", {2.5}), "non-negative"},
      {"reversed offsets", with("data_offsets", {8, 0}), "outside"},
      {"offsets past data", with("data_offsets", {0, 16}), "outside"},
      {"three offsets", with("data_offsets", {0, 4, 8}), "two non-negative"},
      {"length mismatch", with("shape", {3}), "needs 12"},
      {"giant shape", with("shape", {1ull << 40, 1ull << 40}), "larger than the file"},
      // After a 0 the product stays 0, but no size may pass as a negative int64.
      {"size past int64 after a zero", with("shape", {0ull, 18446744073709551615ull}),
       "not a tensor size"},
      {"product wraps around", with("shape", {1ull << 32, 1ull << 32, 0ull}),
       "larger than the file"},
      {"hole", One({{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {4, 8}}}, "12345678"),
       "a hole"},
      {"trailing bytes", One({{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {0, 4}}}, "12345"),
       "no tensor indexes"},
      {"overlap",
       File(json{{"a", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {0, 4}}}},
                 {"b", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {2, 4}}}}}
                .dump(),
            "1234"),
       "overlap"},
  };
  for (const Bad& c : cases) {
    auto r = Parse(c.file);
    ASSERT_FALSE(r.ok()) << c.name << " was accepted";
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << c.name << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.message), std::string::npos)
        << c.name << ": " << r.status();
    EXPECT_NE(r.status().message().find("t.safetensors"), std::string::npos) << r.status();
  }
  std::cout << "safetensors: " << cases.size() << " malformed headers, each a precise error\n";
}

// A checkpoint with one safetensors object and the manifest entries given.
std::unique_ptr<CheckpointReader> Checkpoint(Store& store, int64_t step, const std::string& file,
                                             std::vector<TensorEntry> entries) {
  auto w = store.OpenWriter({});
  EXPECT_TRUE(w.ok()) << w.status();
  auto p = (*w)->Begin(step);
  EXPECT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE((*p)->PutObject("m.safetensors", file.data(), file.size()).ok());
  for (auto& e : entries) (*p)->AddTensor(std::move(e));
  EXPECT_TRUE((*p)->Commit().ok());
  auto r = store.OpenStep(step);
  EXPECT_TRUE(r.ok()) << r.status();
  return std::move(*r);
}

TEST(Safetensors, VerifyChecksTheManifestAgainstTheHeader) {
  testing::TempDir dir;
  auto store = OpenStore(dir.Sub("s"));
  ASSERT_TRUE(store.ok());
  const std::string file =
      One({{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {0, 24}}}, std::string(24, 'x'));
  const uint64_t start = file.size() - 24;
  auto entry = [&](std::string name, std::vector<int64_t> shape) {
    TensorEntry e;
    e.name = std::move(name);
    e.object = "m.safetensors";
    e.dtype = "F32";
    e.shape = std::move(shape);
    e.device = "cpu";
    e.offset = start;
    e.length = 24;
    return e;
  };
  EXPECT_TRUE(Checkpoint(**store, 1, file, {entry("t", {2, 3})})->Verify().ok());

  Status s = Checkpoint(**store, 2, file, {entry("t", {3, 2})})->Verify();
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  EXPECT_NE(s.message().find("[3,2] at bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("in the safetensors header"), std::string::npos) << s;

  s = Checkpoint(**store, 3, file, {entry("u", {2, 3})})->Verify();
  EXPECT_NE(s.message().find("lists tensor \"u\" but the safetensors header does not"),
            std::string::npos)
      << s;

  const std::string two =
      File(json{{"t", {{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {0, 24}}}},
                {"v", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {24, 25}}}}}
               .dump(),
           std::string(25, 'x'));
  auto e = entry("t", {2, 3});
  e.offset = two.size() - 25;
  s = Checkpoint(**store, 4, two, {e})->Verify();
  EXPECT_NE(s.message().find("the safetensors header has 2 tensors, the manifest lists 1"),
            std::string::npos)
      << s;

  // Not a safetensors file at all, yet the manifest lists a tensor in it.
  auto bad = entry("t", {1});
  bad.offset = 0;
  bad.length = 4;
  s = Checkpoint(**store, 5, "not safetensors", {bad})->Verify();
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  EXPECT_NE(s.message().find("step 5, object m.safetensors"), std::string::npos) << s;
}

}  // namespace
}  // namespace ckptio
