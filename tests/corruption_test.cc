// Random single-bit flips, zeroed ranges and truncations in every kind of
// file of a checkpoint: every one must be detected by the reading API (which
// must then hand out no bytes of the damaged range).
#include <sys/stat.h>
#include <unistd.h>

#include <random>
#include <stdexcept>

#include "ckptio/ckptio.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::FlipBit;
using testing::RandomBytes;
using testing::TempDir;

constexpr uint64_t kChunk = 4096;

class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = dir_.Sub("store");
    CKPTIO_ASSERT_OK_AND_ASSIGN(store_, OpenStore(root_));
    WriterOptions o;
    o.chunk_size = kChunk;
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter(o));
    objects_ = {{"big.bin", RandomBytes(16 * kChunk + 77, 1)},
                {"exact.bin", RandomBytes(kChunk, 2)},
                {"small.bin", RandomBytes(100, 3)}};
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(1));
    for (const auto& [name, bytes] : objects_)
      CKPTIO_ASSERT_OK(p->PutObject(name, bytes.data(), bytes.size()));
    CKPTIO_ASSERT_OK(p->Commit().status());
  }

  std::string Path(const std::string& name) const { return root_ + "/step-000000000001/" + name; }

  TempDir dir_;
  std::string root_;
  std::unique_ptr<Store> store_;
  std::vector<std::pair<std::string, std::string>> objects_;
  std::mt19937_64 rng_{20261130};
};

TEST_F(CorruptionTest, EveryBitFlipInObjectDataIsDetected) {
  constexpr int kFlips = 600;
  int detected_by_verify = 0, detected_by_range_read = 0, clean_elsewhere = 0;
  for (int i = 0; i < kFlips; ++i) {
    const auto& [name, bytes] = objects_[rng_() % objects_.size()];
    uint64_t offset = rng_() % bytes.size();
    int bit = static_cast<int>(rng_() % 8);
    FlipBit(Path(name), offset, bit);
    {
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
      Status v = r->Verify();
      if (v.code() == Code::kDataLoss && v.message().find(name) != std::string::npos)
        ++detected_by_verify;
      // A small read that covers the flipped byte fails and yields zeros.
      uint64_t lo = offset >= 3 ? offset - 3 : 0;
      size_t len = static_cast<size_t>(std::min<uint64_t>(7, bytes.size() - lo));
      std::string buf(len, 'z');
      Status s = r->Read(name, lo, buf.data(), len);
      if (s.code() == Code::kDataLoss && buf == std::string(len, '\0')) {
        ++detected_by_range_read;
        std::string chunk_lo = "bytes [" + std::to_string(offset / kChunk * kChunk) + ", ";
        EXPECT_NE(s.message().find(chunk_lo), std::string::npos) << s;
        EXPECT_NE(s.message().find("step 1"), std::string::npos) << s;
        EXPECT_NE(s.message().find(root_), std::string::npos) << s;
      }
      // A read in another chunk is unaffected: verification is per chunk.
      if (bytes.size() > kChunk) {
        uint64_t other = (offset / kChunk + 1) % (bytes.size() / kChunk) * kChunk;
        std::string ok_buf(16, '\0');
        if (r->Read(name, other, ok_buf.data(), 16).ok() && ok_buf == bytes.substr(other, 16))
          ++clean_elsewhere;
      }
    }
    FlipBit(Path(name), offset, bit);  // undo
  }
  std::cout << "corruption: " << detected_by_verify << "/" << kFlips
            << " object bit flips detected by Verify, " << detected_by_range_read << "/" << kFlips
            << " by a range read\n";
  EXPECT_EQ(detected_by_verify, kFlips);
  EXPECT_EQ(detected_by_range_read, kFlips);
  EXPECT_GT(clean_elsewhere, kFlips / 4);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
  CKPTIO_EXPECT_OK(r->Verify());
}

TEST_F(CorruptionTest, EveryBitFlipInTheManifestIsDetected) {
  const std::string path = Path("MANIFEST.json");
  const uint64_t size = testing::ReadFile(path).size();
  constexpr int kFlips = 400;
  int detected = 0;
  for (int i = 0; i < kFlips; ++i) {
    uint64_t offset = rng_() % size;
    int bit = static_cast<int>(rng_() % 8);
    FlipBit(path, offset, bit);
    auto r = store_->OpenStep(1);
    if (!r.ok() && r.status().code() == Code::kDataLoss &&
        r.status().message().find("MANIFEST.json") != std::string::npos)
      ++detected;
    else
      ADD_FAILURE() << "flip at " << offset << " bit " << bit << ": " << r.status();
    // LATEST pins the manifest's hash too.
    EXPECT_FALSE(store_->OpenLatest().ok());
    FlipBit(path, offset, bit);
  }
  std::cout << "corruption: " << detected << "/" << kFlips << " manifest bit flips detected\n";
  EXPECT_EQ(detected, kFlips);
  CKPTIO_EXPECT_OK(store_->OpenLatest().status());
}

// Verify hashes a mapped object's chunks on helper threads while the
// calling thread hashes the whole of it: with several chunks damaged, the
// one reported is still the lowest, whichever thread found it first, and
// an intact object reports progress over all of its bytes, once.
TEST_F(CorruptionTest, VerifyNamesTheLowestDamagedChunkOfMany) {
  const auto& [name, bytes] = objects_[0];  // big.bin: 17 chunks
  uint64_t reported = 0;
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
    CKPTIO_EXPECT_OK(r->VerifyObject(name, [&](uint64_t n) { reported += n; }));
  }
  EXPECT_EQ(reported, bytes.size());
  for (uint64_t lowest : {uint64_t{16}, uint64_t{9}, uint64_t{3}, uint64_t{0}}) {
    FlipBit(Path(name), lowest * kChunk + 5, 2);  // the later flips stay
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
    for (int i = 0; i < 5; ++i) {
      Status s = r->VerifyObject(name);
      EXPECT_EQ(s.code(), Code::kDataLoss);
      EXPECT_NE(s.message().find("(chunk " + std::to_string(lowest) + " of 17)"), std::string::npos)
          << s;
    }
  }
}

// A progress callback that throws (a caller ending the verify) ends it
// with that exception, the helper threads joined, not std::terminate.
TEST_F(CorruptionTest, AVerifyWhoseProgressThrowsEndsWithTheException) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
  EXPECT_THROW(
      (void)r->VerifyObject(objects_[0].first, [](uint64_t) { throw std::runtime_error("stop"); }),
      std::runtime_error);
  CKPTIO_EXPECT_OK(r->VerifyObject(objects_[0].first));
}

TEST_F(CorruptionTest, EveryBitFlipInLatestIsDetected) {
  const std::string path = root_ + "/LATEST";
  const uint64_t size = testing::ReadFile(path).size();
  int detected = 0;
  for (uint64_t offset = 0; offset < size; ++offset) {
    int bit = static_cast<int>(rng_() % 8);
    FlipBit(path, offset, bit);
    auto l = store_->ReadLatest();
    if (!l.ok() && l.status().code() == Code::kDataLoss)
      ++detected;
    else
      ADD_FAILURE() << "LATEST flip at " << offset << " bit " << bit;
    FlipBit(path, offset, bit);
  }
  std::cout << "corruption: " << detected << "/" << size << " LATEST bit flips detected\n";
  EXPECT_EQ(detected, static_cast<int>(size));
}

TEST_F(CorruptionTest, ZeroedRangesAndTruncationsAreDetected) {
  for (const auto& [name, bytes] : objects_) {
    const std::string path = Path(name);
    // Zero a range that actually changes bytes.
    uint64_t lo = bytes.size() / 3, len = std::min<uint64_t>(512, bytes.size() - lo);
    std::string damaged = bytes;
    std::fill(damaged.begin() + lo, damaged.begin() + lo + len, '\0');
    ASSERT_NE(damaged, bytes);
    testing::WriteFile(path, damaged);
    {
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
      EXPECT_EQ(r->VerifyObject(name).code(), Code::kDataLoss) << name;
      EXPECT_EQ(r->ReadAll(name).status().code(), Code::kDataLoss) << name;
    }
    for (uint64_t cut : {uint64_t{0}, bytes.size() / 2, bytes.size() - 1}) {
      testing::WriteFile(path, bytes.substr(0, cut));
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
      Status s = r->VerifyObject(name);
      EXPECT_EQ(s.code(), Code::kDataLoss) << name << " cut at " << cut;
      EXPECT_NE(s.message().find("torn"), std::string::npos) << s;
    }
    ::unlink(path.c_str());
    {
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
      EXPECT_EQ(r->VerifyObject(name).code(), Code::kDataLoss) << "missing object " << name;
    }
    testing::WriteFile(path, bytes);
  }
  // Truncated manifest and LATEST.
  for (const std::string& path : {Path("MANIFEST.json"), root_ + "/LATEST"}) {
    std::string good = testing::ReadFile(path);
    for (size_t cut : {size_t{0}, size_t{1}, good.size() / 2, good.size() - 2}) {
      testing::WriteFile(path, good.substr(0, cut));
      EXPECT_EQ(store_->OpenLatest().status().code(), Code::kDataLoss) << path << " cut " << cut;
    }
    testing::WriteFile(path, good);
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenLatest());
  CKPTIO_EXPECT_OK(r->Verify());
}

}  // namespace
}  // namespace ckptio
