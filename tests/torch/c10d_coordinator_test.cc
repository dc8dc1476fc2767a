// The c10d-store coordinator's records in one process (a c10d HashStore,
// one coordinator per rank): each rank other than 0 reads a save's outcome
// or a load decision once, and the last of them deletes it, so a long job
// leaves nothing per save or load in the trainer's store.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "test_util.h"
#include "torch/c10d_store.h"

namespace ckptio {
namespace {

using std::chrono::milliseconds;

class C10dCoordinatorTest : public ::testing::TestWithParam<int> {
 protected:
  // One coordinator for each rank of a job of GetParam() ranks.
  void SetUp() override {
    store_ = c10::make_intrusive<c10d::HashStore>();
    const std::string job = testing::NewJobId();
    for (int r = 0; r < world(); ++r) {
      auto c = NewC10dCoordinator(store_, testing::TestRank(r, world(), job));
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      ranks_.push_back(std::move(*c));
    }
  }
  int world() const { return GetParam(); }
  int64_t keys() { return store_->getNumKeys(); }

  c10::intrusive_ptr<c10d::HashStore> store_;
  std::vector<std::unique_ptr<Coordinator>> ranks_;
};

// Every reader gets the outcome, the key stays until the last one read it,
// and a rank that polls again afterwards gets the same answer (without the
// store: the key is gone).
TEST_P(C10dCoordinatorTest, TheLastRankToReadASavesOutcomeDeletesIt) {
  const Status failed(Code::kDataLoss, "disk on fire");
  for (const Status& outcome : {OkStatus(), failed}) {
    SCOPED_TRACE(outcome.ToString());
    const std::string attempt = outcome.ok() ? "s.1" : "s.2";
    ASSERT_TRUE(ranks_[0]->EndSave(7, attempt, outcome).ok());
    for (int r = 1; r < world(); ++r) {
      EXPECT_GT(keys(), 0) << "deleted before rank " << r << " read it";
      auto got = ranks_[r]->PollSaved(7, attempt);
      ASSERT_EQ(got.status().code(), outcome.code()) << got.status().ToString();
      if (outcome.ok()) {
        EXPECT_TRUE(*got);
      }
    }
    EXPECT_EQ(keys(), 0) << "the outcome (or its count of readers) was left in the store";
    for (int r = 1; r < world(); ++r) {
      auto again = ranks_[r]->PollSaved(7, attempt);
      ASSERT_EQ(again.status().code(), outcome.code()) << "rank " << r << " polling again";
      if (outcome.ok()) {
        EXPECT_TRUE(*again) << "rank " << r << " polling again";
      }
    }
    EXPECT_EQ(keys(), 0);
  }
}

// A rank reading its own outcome again does not count twice: the key stays
// for the others.
TEST_P(C10dCoordinatorTest, ARankPollingTwiceCountsOnce) {
  ASSERT_TRUE(ranks_[0]->EndSave(3, "s.1", OkStatus()).ok());
  for (int i = 0; i < world(); ++i) ASSERT_TRUE(*ranks_[1]->PollSaved(3, "s.1"));
  for (int r = 2; r < world(); ++r) {
    auto got = ranks_[r]->PollSaved(3, "s.1");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got) << "rank " << r << " found the outcome gone";
  }
  EXPECT_EQ(keys(), 0);
}

TEST_P(C10dCoordinatorTest, TheLastRankToReadALoadDecisionDeletesIt) {
  ASSERT_TRUE(ranks_[0]->Publish("s-load-1", "{\"step\": 4}").ok());
  for (int r = 1; r < world(); ++r) {
    EXPECT_GT(keys(), 0) << "deleted before rank " << r << " read it";
    auto got = ranks_[r]->WaitFor("s-load-1", milliseconds(1000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, "{\"step\": 4}");
    ranks_[r]->Consumed("s-load-1");
  }
  EXPECT_EQ(keys(), 0) << "the decision (or its count of readers) was left in the store";
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, C10dCoordinatorTest, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "Ranks" + std::to_string(p.param);
                         });

}  // namespace
}  // namespace ckptio
