// The store's names (ckptio/layout.h): each one parses back, temp names are
// valid keys and unique, and the sweep rule takes only what the core writes.
#include "ckptio/layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>

#include "ckptio/backend.h"
#include "ckptio/manifest.h"

namespace ckptio {
namespace {

TEST(Layout, StepDirNamesParseBackAndNothingElseDoes) {
  for (int64_t step : {int64_t{0}, int64_t{1}, int64_t{1200}, int64_t{999999999999}}) {
    const std::string dir = StepDirName(step);
    EXPECT_EQ(dir.size(), 17u) << dir;
    EXPECT_EQ(ParseStepDirName(dir), step) << dir;
  }
  EXPECT_EQ(StepDirName(1200), "step-000000001200");
  for (const char* bad : {"step-1200", "step-00000000120a", "step-0000000012000",
                          "Step-000000001200", "", "step-", "step--00000001200"})
    EXPECT_EQ(ParseStepDirName(bad), -1) << bad;
}

TEST(Layout, KeysOfAStep) {
  EXPECT_EQ(ManifestKey(7), "step-000000000007/MANIFEST.json");
  EXPECT_EQ(ObjectKey(7, "model.safetensors"), "step-000000000007/model.safetensors");
  EXPECT_EQ(DecisionKey("abc-load-1"), ".coord/decision-abc-load-1");
  EXPECT_TRUE(ValidateKey(ManifestKey(kMaxStep)).ok());
  EXPECT_TRUE(ValidateKey(DecisionKey("abc-load-1")).ok());
  EXPECT_TRUE(ValidateKey(kSaveRecordKey).ok());
}

TEST(Layout, StripePartsKeepTheSafetensorsEnding) {
  EXPECT_EQ(StripePartName("model.safetensors", 2), "model.part-2.safetensors");
  EXPECT_EQ(StripePartName("blob", 3), "blob.part-3.safetensors");
  // ".safetensors" alone is a name, not an ending.
  EXPECT_EQ(StripePartName(".safetensors", 1), ".safetensors.part-1.safetensors");
}

TEST(Layout, TempNamesAreUniqueValidKeysMarkedAsTemp) {
  std::set<std::string> seen;
  const std::string long_base(300, 'x');
  for (int i = 0; i < 1000; ++i) {
    const std::string name = TempObjectName(i % 2 ? "MANIFEST.json" : long_base);
    EXPECT_TRUE(ValidateKey(name).ok()) << name;
    EXPECT_TRUE(IsTempObjectName(name)) << name;
    EXPECT_TRUE(seen.insert(name).second) << "repeated: " << name;
  }
  EXPECT_FALSE(IsTempObjectName("MANIFEST.json"));
  EXPECT_FALSE(IsTempObjectName("ckptio-tmp.x"));
}

TEST(Layout, OnlyTempObjectsWhereTheCoreWritesAreSwept) {
  const std::string tmp = TempObjectName("LATEST");
  EXPECT_TRUE(IsSweepableTempKey(tmp));
  EXPECT_TRUE(IsSweepableTempKey("step-000000000001/" + tmp));
  EXPECT_TRUE(IsSweepableTempKey(".coord/" + tmp));
  EXPECT_FALSE(IsSweepableTempKey("LATEST"));
  EXPECT_FALSE(IsSweepableTempKey("step-000000000001/model.safetensors"));
  EXPECT_FALSE(IsSweepableTempKey("user/" + tmp));                      // not ours
  EXPECT_FALSE(IsSweepableTempKey("step-000000000001/deeper/" + tmp));  // too deep
  // A writer's objects folder (where locks are leases), and nothing else.
  EXPECT_TRUE(IsSweepableTempKey("step-000000000001/w12-0123456789abcdef/" + tmp));
  EXPECT_FALSE(IsSweepableTempKey("step-000000000001/w12-0123456789abcdeg/" + tmp));
  EXPECT_FALSE(IsSweepableTempKey(".coord/w12-0123456789abcdef/" + tmp));
  EXPECT_FALSE(IsSweepableTempKey("step-000000000001/w12-0123456789abcdef/x/" + tmp));
}

TEST(Layout, ObjectsFolderNamesGiveTheirGeneration) {
  EXPECT_EQ(ObjectsFolderGeneration("w12-0123456789abcdef"), 12);
  EXPECT_EQ(ObjectsFolderGeneration("w999999999999999999-0123456789abcdef"), 999999999999999999);
  for (const char* bad :
       {"", "w", "w-0123456789abcdef", "x12-0123456789abcdef", "w1a-0123456789abcdef",
        "w12-0123456789abcde", "w12-0123456789abcdef0", "w12-0123456789ABCDEF",
        "w9223372036854775808-0123456789abcdef", "w12345678901234567890-0123456789abcdef"})
    EXPECT_EQ(ObjectsFolderGeneration(bad), -1) << bad;
}

TEST(Layout, ObjectsFolderNamesRoundTrip) {
  for (int64_t g : {int64_t{0}, int64_t{1}, int64_t{12}, int64_t{999999999999999999},
                    int64_t{1000000000000000000}, INT64_MAX})
    for (uint64_t id : {uint64_t{0}, uint64_t{0x0123456789abcdef}, UINT64_MAX}) {
      const std::string name = ObjectsFolderName(g, id);
      EXPECT_EQ(name.size(), 2 + std::to_string(g).size() + 16) << name;
      EXPECT_EQ(ObjectsFolderGeneration(name), g) << name;
      EXPECT_TRUE(IsSweepableTempKey("step-000000000001/" + name + "/" + TempObjectName("x")))
          << name;
    }
}

TEST(Layout, StoreKeysTellAStoreFromItsParent) {
  for (const std::string& key :
       {std::string(kLatestKey), std::string(kLockKey), std::string(kWriterKey),
        std::string(kSaveLockKey), std::string(kSaveRecordKey), DecisionKey("x"), ManifestKey(3)})
    EXPECT_TRUE(IsStoreKey(key)) << key;
  for (const char* key : {"run42/LATEST", "notes.txt", ".coordination", "steps"})
    EXPECT_FALSE(IsStoreKey(key)) << key;
}

}  // namespace
}  // namespace ckptio
