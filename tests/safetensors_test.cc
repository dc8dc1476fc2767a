// The strict safetensors header reader: what it accepts, every way it
// refuses, and the manifest/header cross-check that commits, Verify and loads run.
#include "ckptio/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "ckptio/ckptio.h"
#include "safetensors_text.h"
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
      // No elements, but LibTorch's strides would be 2^96: refused.
      {"zero size, huge strides", with("shape", {0ull, 1ull << 48, 1ull << 48}),
       "too many elements"},
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

// A manifest holding one object, "m.safetensors", of `file`, and `entries`
// (offsets from the start of the file).
Manifest OneObject(const std::string& file, std::vector<TensorEntry> entries) {
  Manifest m;
  ObjectEntry o;
  o.name = "m.safetensors";
  o.size = file.size();
  m.objects.push_back(o);
  for (auto& e : entries) e.object = o.name;
  m.tensors = std::move(entries);
  return m;
}

TensorEntry Entry(std::string name, std::string dtype, std::vector<int64_t> shape, uint64_t offset,
                  uint64_t length) {
  TensorEntry e;
  e.name = std::move(name);
  e.dtype = std::move(dtype);
  e.shape = std::move(shape);
  e.offset = offset;
  e.length = length;
  return e;
}

// The header ckptio writes is recognised by its bytes (no parse); any other
// spelling of the same header is parsed and accepted; and a header that
// matches the entries byte for byte is still refused when the entries break
// the layout, with the parser's precise error.
TEST(Safetensors, TheCkptioHeaderIsRecognisedAndNothingElseSkipsTheParser) {
  // ckptio's order: larger elements first, then names; an empty tensor
  // shares the offset of the next ("z" before "a").
  std::vector<TensorEntry> entries = {Entry("w", "F64", {1}, 0, 8), Entry("z", "F64", {0, 4}, 8, 0),
                                      Entry("a", "F32", {2}, 8, 8), Entry("b", "U8", {3}, 16, 3)};
  auto file_of = [](const std::vector<TensorEntry>& es, uint64_t data_bytes,
                    std::vector<TensorEntry>* absolute) {
    std::vector<const TensorEntry*> order;
    for (const auto& e : es) order.push_back(&e);
    auto text = SafetensorsHeaderText(order, 0);
    EXPECT_TRUE(text.ok()) << text.status();
    const std::string file = File(*text, std::string(data_bytes, 'x'));
    *absolute = es;
    for (auto& e : *absolute) e.offset += file.size() - data_bytes;
    return file;
  };
  std::vector<TensorEntry> at;
  const std::string file = file_of(entries, 19, &at);
  Manifest m = OneObject(file, at);
  const uint64_t head = file.size() - 19;
  EXPECT_TRUE(
      IsCkptioSafetensorsHeader(m, "m.safetensors", std::string_view(file).substr(0, head)));
  CKPTIO_EXPECT_OK(CheckSafetensorsObject(m, "m.safetensors", file));
  // The manifest lists them in any order: still recognised.
  std::reverse(m.tensors.begin(), m.tensors.end());
  EXPECT_TRUE(
      IsCkptioSafetensorsHeader(m, "m.safetensors", std::string_view(file).substr(0, head)));

  // The same header as another writer spells it (members reordered, spaces):
  // not recognised, parsed, accepted.
  auto parsed = Parse(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  json other = json::object();
  for (const auto& t : parsed->tensors)
    other[t.name] = {{"shape", t.shape},
                     {"dtype", t.dtype},
                     {"data_offsets",
                      {t.offset - parsed->data_start, t.offset - parsed->data_start + t.length}}};
  const std::string spelled = File(other.dump(1), std::string(19, 'x'));
  std::vector<TensorEntry> moved = at;
  for (auto& e : moved) e.offset += spelled.size() - file.size();
  Manifest m2 = OneObject(spelled, moved);
  EXPECT_FALSE(
      IsCkptioSafetensorsHeader(m2, "m.safetensors", spelled.substr(0, spelled.size() - 19)));
  CKPTIO_EXPECT_OK(CheckSafetensorsObject(m2, "m.safetensors", spelled));

  // Entries with a hole between "a" and "b", and a header that is exactly
  // their canonical text.
  std::vector<TensorEntry> holed = entries;
  holed[3].offset = 20;
  const std::string with_hole = file_of(holed, 23, &at);
  Manifest m3 = OneObject(with_hole, at);
  EXPECT_FALSE(
      IsCkptioSafetensorsHeader(m3, "m.safetensors", with_hole.substr(0, with_hole.size() - 23)));
  Status s = CheckSafetensorsObject(m3, "m.safetensors", with_hole);
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  EXPECT_NE(s.message().find("a hole"), std::string::npos) << s;

  // A tensor named like the header's metadata: its canonical text names
  // "__metadata__" twice.
  std::vector<TensorEntry> named = entries;
  named[3].name = "__metadata__";
  const std::string twice = file_of(named, 19, &at);
  Manifest m4 = OneObject(twice, at);
  EXPECT_FALSE(IsCkptioSafetensorsHeader(m4, "m.safetensors", twice.substr(0, twice.size() - 19)));
  s = CheckSafetensorsObject(m4, "m.safetensors", twice);
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  EXPECT_NE(s.message().find("appears twice"), std::string::npos) << s;
}

// Commits one safetensors object as `step`, with the manifest entries given.
Status CommitWith(Store& store, int64_t step, const std::string& file,
                  std::vector<TensorEntry> entries) {
  CKPTIO_ASSIGN_OR_RETURN(auto w, store.OpenWriter({}));
  CKPTIO_ASSIGN_OR_RETURN(auto p, w->Begin(step));
  CKPTIO_RETURN_IF_ERROR(p->PutObject("m.safetensors", file.data(), file.size()));
  for (auto& e : entries) p->AddTensor(std::move(e));
  return p->Commit().status();
}

// Entries that disagree with the object's own header: Commit refuses them
// (every load would reject the step, yet retention would count it as
// good), and a manifest changed behind ckptio's back fails Verify.
TEST(Safetensors, CommitAndVerifyCheckTheManifestAgainstTheHeader) {
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
  CKPTIO_ASSERT_OK(CommitWith(**store, 1, file, {entry("t", {2, 3})}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto one, (*store)->OpenStep(1));
  CKPTIO_EXPECT_OK(one->Verify());

  const std::string two =
      File(json{{"t", {{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {0, 24}}}},
                {"v", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {24, 25}}}}}
               .dump(),
           std::string(25, 'x'));
  auto of_two = entry("t", {2, 3});
  of_two.offset = two.size() - 25;
  auto in_junk = entry("t", {1});  // not a safetensors file at all
  in_junk.offset = 0;
  in_junk.length = 4;
  struct Mismatch {
    std::string file;
    TensorEntry entry;
    std::string message;
  };
  const std::vector<Mismatch> cases = {
      {file, entry("t", {3, 2}), "[3,2] at bytes"},
      {file, entry("u", {2, 3}), "lists tensor \"u\" but the safetensors header does not"},
      {two, of_two, "the safetensors header has 2 tensors, the manifest lists 1"},
      {"not safetensors", in_junk, "object m.safetensors"},
  };
  int64_t step = 2;
  for (const Mismatch& c : cases) {
    Status s = CommitWith(**store, step, c.file, {c.entry});
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << c.message << ": " << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
    EXPECT_NE(s.message().find("the checkpoint is inconsistent"), std::string::npos) << s;
    EXPECT_EQ((*store)->OpenStep(step).status().code(), Code::kNotFound) << "step " << step;
    ++step;
  }

  // The first case's entry, written into step 1's manifest by hand.
  Manifest m = one->manifest();
  m.tensors[0].shape = {3, 2};
  testing::WriteFile(dir.Sub("s") + "/step-000000000001/MANIFEST.json", SerializeManifest(m));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto changed, (*store)->OpenStep(1));
  Status s = changed->Verify();
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  EXPECT_NE(s.message().find("[3,2] at bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("in the safetensors header"), std::string::npos) << s;
}

// A rank's striped tensor object that is gone or resized by the commit
// (cleared or rewritten after the writer took its receipt) fails the
// commit as DATA_LOSS naming it: the writer reads every tensor object's
// header back before the manifest.
TEST(Safetensors, ATensorObjectGoneOrResizedBeforeTheManifestFailsTheCommit) {
  testing::TempDir dir;
  auto store = OpenStore(dir.Sub("s"));
  ASSERT_TRUE(store.ok());
  const std::string file =
      File(json{{"t", {{"dtype", "U8"}, {"shape", {3}}, {"data_offsets", {0, 3}}}}}.dump(), "abc");
  TensorEntry t;
  t.name = "t";
  t.object = "m.part-1.safetensors";
  t.dtype = "U8";
  t.shape = {3};
  t.device = "cpu";
  t.offset = file.size() - 3;
  t.length = 3;
  enum Change { kNone, kGone, kResized };
  for (Change change : {kNone, kGone, kResized}) {
    const int64_t step = 1 + change;
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, (*store)->OpenWriter({}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(step));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto stripe, (*store)->BeginStripe(step, 1));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto os, stripe->AddObject(t.object));
    CKPTIO_ASSERT_OK(os->Write(file.data(), file.size()));
    CKPTIO_ASSERT_OK(os->Close());
    stripe->AddTensor(t);
    CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt r, stripe->Finish());
    CKPTIO_ASSERT_OK(pending->AddStripe(r));
    const std::string path = dir.Sub("s") + "/" + StepDirName(step) + "/" + t.object;
    if (change == kGone) {
      ASSERT_EQ(::unlink(path.c_str()), 0) << path;
    } else if (change == kResized) {
      ASSERT_EQ(::truncate(path.c_str(), file.size() + 1), 0) << path;
    }
    auto info = pending->Commit();
    if (change == kNone) {
      CKPTIO_EXPECT_OK(info.status());
      continue;
    }
    EXPECT_EQ(info.status().code(), Code::kDataLoss) << info.status();
    const std::string said = change == kGone
                                 ? "m.part-1.safetensors is not in"
                                 : "holds " + std::to_string(file.size() + 1) + " bytes, not the " +
                                       std::to_string(file.size()) + " written";
    EXPECT_NE(info.status().message().find(said), std::string::npos) << info.status();
    pending.reset();
    EXPECT_EQ((*store)->OpenStep(step).status().code(), Code::kNotFound) << step;
  }
}

}  // namespace
}  // namespace ckptio
