// The names in a store and the rules for them: step folders, keys, object
// names and metadata (backend.h, manifest.h), URIs and the backend
// registry, and the XXH3-128 wrapper (hash.h). See manifest_test_util.h.
#include <memory>
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
#include "manifest_test_util.h"

namespace ckptio::manifest_testing {
namespace {

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
}  // namespace ckptio::manifest_testing
