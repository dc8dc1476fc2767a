// The bench's verdicts on its own timings (tools/bench/bench_stats.h): a
// run whose warm load is slower than its cold twin, or whose two identical
// saves disagree beyond their noise, is broken; noise alone is not.
#include "bench/bench_stats.h"

#include <gtest/gtest.h>

namespace {

using ckptio::bench::SanityFailures;
using ckptio::bench::Summarize;

TEST(BenchStatsTest, ASummaryHasMinMedianMaxAndFlagsAWideSpread) {
  auto s = Summarize({0.30, 0.10, 0.20});
  EXPECT_DOUBLE_EQ(s.min, 0.10);
  EXPECT_DOUBLE_EQ(s.median, 0.20);
  EXPECT_DOUBLE_EQ(s.max, 0.30);
  EXPECT_DOUBLE_EQ(s.spread, 1.0);
  EXPECT_TRUE(s.noisy);
  auto tight = Summarize({1.00, 1.05, 0.98});
  EXPECT_FALSE(tight.noisy);
  auto one = Summarize({0.5});
  EXPECT_DOUBLE_EQ(one.spread, 0);
  EXPECT_FALSE(one.noisy);
}

TEST(BenchStatsTest, AWarmLoadSlowerThanItsColdTwinBreaksTheRun) {
  // The run issue 27 reported: 1 GiB, ckptio_load 0.296 s warm, 0.084 s cold.
  auto failures = SanityFailures({{"ckptio_load", {0.296, 0.30, 0.29}},
                                  {"ckptio_load_cold", {0.084, 0.09, 0.08}},
                                  {"raw_read", {0.07, 0.08, 0.07}},
                                  {"raw_read_cold", {0.30, 0.31, 0.33}}});
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("ckptio_load (warm"), std::string::npos) << failures[0];
  EXPECT_NE(failures[0].find("ckptio_load_cold"), std::string::npos) << failures[0];
}

TEST(BenchStatsTest, AWarmLoadWithinTheNoiseOfItsColdTwinIsNotBroken) {
  EXPECT_TRUE(SanityFailures({{"torch_load", {0.105}}, {"torch_load_cold", {0.100}}}).empty());
  EXPECT_FALSE(SanityFailures({{"torch_load", {0.115}}, {"torch_load_cold", {0.100}}}).empty());
  // A run seen at 256 MiB: torch::load of 10,000 tensors is CPU work, warm
  // or cold, and its runs spread over 44 %: the warm median above the
  // cold one is noise.
  EXPECT_TRUE(SanityFailures({{"torch_load", {0.618, 0.758, 0.776}},
                              {"torch_load_cold", {0.534, 0.581, 0.789}}})
                  .empty());
}

TEST(BenchStatsTest, IdenticalSavesApartBeyondTheirNoiseBreakTheRun) {
  // Issue 27's run: ckptio_save 1.371 s against ckptio_save_hashed 0.484 s.
  auto failures = SanityFailures(
      {{"ckptio_save", {1.37, 1.40, 1.35}}, {"ckptio_save_hashed", {0.484, 0.49, 0.48}}});
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("do the same work"), std::string::npos) << failures[0];
  // Spread out as much, but with best runs that agree: noise, not a fault.
  EXPECT_TRUE(SanityFailures(
                  {{"ckptio_save", {0.40, 1.37, 2.10}}, {"ckptio_save_hashed", {0.35, 0.48, 1.80}}})
                  .empty());
  EXPECT_TRUE(SanityFailures({{"ckptio_save", {0.40, 0.41}}, {"ckptio_save_hashed", {0.45, 0.44}}})
                  .empty());
}

TEST(BenchStatsTest, IdenticalSavesAreComparedByTheirBestRuns) {
  // A run on the EPYC guest's disk (01e1ffd), whose saves come either fast or
  // about three times slower: medians 0.310 and 0.663 s, bests 0.202 and 0.185.
  EXPECT_TRUE(SanityFailures({{"ckptio_save", {0.310, 0.202, 0.342}},
                              {"ckptio_save_hashed", {0.663, 0.682, 0.185}}})
                  .empty());
  // The same medians, but one contender never fast: a cost it pays every time.
  auto failures = SanityFailures(
      {{"ckptio_save", {0.310, 0.202, 0.342}}, {"ckptio_save_hashed", {0.663, 0.682, 0.300}}});
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("best runs differ by 49 %"), std::string::npos) << failures[0];
}

TEST(BenchStatsTest, ContendersThatDidNotRunAreNotChecked) {
  EXPECT_TRUE(SanityFailures({{"ckptio_load", {9.0}}}).empty());
  EXPECT_TRUE(SanityFailures({{"ckptio_load", {9.0}}, {"ckptio_load_cold", {}}}).empty());
}

}  // namespace
