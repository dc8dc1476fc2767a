// The Checkpointer across real processes, every wait mode: rounds of saves
// in which each waiting rank sees only committed steps, and loads (also
// past a corrupt step) that agree on every rank. See
// torch_ranks_test_util.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "torch_ranks_test_util.h"

namespace ckptio::torch_ranks_testing {
namespace {

// ---------------------------------------------------------------- a. rounds

// 20 rounds: every rank trains one step on the same batch and calls Save.
// Each waiting rank, the moment Save returns, opens the step through a fresh
// store, verifies it and finds its own parameters in it bit-for-bit: it never
// saw a torn, uncommitted or previous step. Then all ranks Load into fresh
// models: the same step, the same parameters and Adam state on every rank.
// The c10d store holds no key of those saves and that load afterwards.
TEST_P(TorchRanksTest, EveryRankSeesOnlyCommittedStepsAndLoadsTheSame) {
  constexpr int kRounds = 20;
  const Launch launch = NewLaunch();
  Ranks ranks(launch, [&](RankEnv& me) -> int {
    Trainee t(kInitSeed);
    auto ckpt = me.Open(kTimeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    Result<int64_t> keys_before = -1;  // kStore, rank 0: the c10d store's keys before any save
    if (me.c10d) keys_before = me.KeysAtBarrier("opened");
    if (!keys_before.ok()) return Fail(me.rank, kExitSetup, keys_before.status().ToString());
    State state = t.state();
    for (int64_t step = 1; step <= kRounds; ++step) {
      t.Train(step);
      Status s = (*ckpt)->Save(step, state);
      if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
      if (me.rank != 0) {
        s = CheckStepIsMine(launch.path, step, *t.model);
        if (!s.ok()) return Fail(me.rank, kExitBadStep, "right after Save: " + s.ToString());
      }
    }
    me.Say("trained " + t.hash());
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    auto got = (*ckpt)->Load(into);
    if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
    if (!got->step.has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    me.Say(FormatLoaded(*got, fresh.hash()));
    // One more identical step from the loaded state: Adam's moments came back too.
    t.Train(kRounds + 1);
    fresh.Train(kRounds + 1);
    me.Say("next " + t.hash() + " " + fresh.hash());
    if (me.c10d) {
      auto keys = me.KeysAtBarrier("loaded");
      if (!keys.ok()) return Fail(me.rank, kExitSetup, keys.status().ToString());
      if (me.rank == 0) me.Say("records " + std::to_string(*keys - *keys_before));
    }
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());

  std::vector<std::string> loaded(kWorld), trained(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    auto tr = ranks.Await(r, "trained", milliseconds(60000));
    ASSERT_TRUE(tr.has_value()) << "rank " << r << " exit "
                                << ranks.child(r).ExitCode(milliseconds(2000));
    trained[r] = Join(*tr);
    auto ld = ranks.Await(r, "loaded", milliseconds(20000));
    ASSERT_TRUE(ld.has_value()) << "rank " << r << " exit "
                                << ranks.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 4u) << Join(*ld);
    loaded[r] = Join(*ld);
    EXPECT_EQ((*ld)[0], std::to_string(kRounds)) << "rank " << r;
    EXPECT_EQ((*ld)[1], "-") << "rank " << r << " skipped steps";
    EXPECT_EQ((*ld)[3], trained[r]) << "rank " << r << " loaded other parameters than it trained";
    auto next = ranks.Await(r, "next", milliseconds(10000));
    ASSERT_TRUE(next.has_value() && next->size() == 2u) << "rank " << r;
    EXPECT_EQ((*next)[0], (*next)[1]) << "rank " << r << ": a step after the load diverged";
  }
  for (int r = 1; r < kWorld; ++r) {
    EXPECT_EQ(trained[r], trained[0]) << "rank " << r << " trained differently (setup)";
    EXPECT_EQ(loaded[r], loaded[0]) << "rank " << r << " loaded something else than rank 0";
  }
  if (launch.mode == WaitMode::kStore) {
    auto records = ranks.Await(0, "records", milliseconds(30000));
    ASSERT_TRUE(records && records->size() == 1u);
    EXPECT_EQ((*records)[0], "0") << "c10d keys of the saves or the load were left behind";
  }
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: %d rounds x %d ranks ok (each waiter verified every step bit-for-bit "
      "right after Save); all loaded step %d, identical params + Adam state\n",
      mode_name().c_str(), kRounds, kWorld, kRounds);
}

// ---------------------------------------------------------------- b. fallback

// Rank 0 flips a bit of the newest step's model.safetensors before the
// Load: every rank falls back to the previous step, and says so alike.
TEST_P(TorchRanksTest, EveryRankFallsBackPastACorruptStepAlike) {
  constexpr int64_t kSteps = 3;
  const Launch launch = NewLaunch();
  Ranks ranks(launch, [&](RankEnv& me) -> int {
    Trainee t(kInitSeed);
    auto ckpt = me.Open(kTimeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    for (int64_t step = 1; step <= kSteps; ++step) {
      t.Train(step);
      Status s = (*ckpt)->Save(step, state);
      if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
      me.Say("trained" + std::to_string(step) + " " + t.hash());
    }
    if (me.rank == 0) {
      char dir[32];
      std::snprintf(dir, sizeof dir, "step-%012lld", static_cast<long long>(kSteps));
      const std::string file = launch.path + "/" + dir + "/model.safetensors";
      int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) return Fail(0, kExitCorrupt, "open " + file + ": " + std::strerror(errno));
      struct stat st;
      unsigned char c = 0;
      const off_t at = ::fstat(fd, &st) == 0 ? st.st_size - 3 : -1;  // inside the last tensor
      bool ok = at > 0 && ::pread(fd, &c, 1, at) == 1;
      c ^= 0x10;
      ok = ok && ::pwrite(fd, &c, 1, at) == 1 && ::fsync(fd) == 0;
      ::close(fd);
      if (!ok) return Fail(0, kExitCorrupt, "could not flip a bit of " + file);
    }
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    auto got = (*ckpt)->Load(into);
    if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
    if (!got->step.has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    for (const auto& [step, why] : got->skipped)
      if (why.find("model.safetensors") == std::string::npos)
        return Fail(me.rank, kExitLoadFailed,
                    "the skip reason does not name the corrupt object: " + why);
    me.Say(FormatLoaded(*got, fresh.hash()));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());

  std::vector<std::string> loaded(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    auto ld = ranks.Await(r, "loaded", milliseconds(30000));
    ASSERT_TRUE(ld.has_value()) << "rank " << r << " exit "
                                << ranks.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 4u) << Join(*ld);
    loaded[r] = Join(*ld);
    auto t2 = ranks.Await(r, "trained2", milliseconds(1000));
    ASSERT_TRUE(t2.has_value() && t2->size() == 1u) << "rank " << r;
    EXPECT_EQ((*ld)[0], std::to_string(kSteps - 1)) << "rank " << r;
    EXPECT_EQ((*ld)[1], std::to_string(kSteps)) << "rank " << r << ": skipped steps";
    EXPECT_EQ((*ld)[3], (*t2)[0]) << "rank " << r << ": not step " << kSteps - 1 << "'s parameters";
  }
  for (int r = 1; r < kWorld; ++r)
    EXPECT_EQ(loaded[r], loaded[0]) << "rank " << r << " decided otherwise than rank 0";
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: step %lld corrupted by rank 0; all %d ranks loaded step %lld, "
      "skipped=[%lld] with the same reason, identical params\n",
      mode_name().c_str(), static_cast<long long>(kSteps), kWorld,
      static_cast<long long>(kSteps - 1), static_cast<long long>(kSteps));
}

// The TEST_Ps of every torch_ranks_*_test.cc file, once per wait mode.
INSTANTIATE_TEST_SUITE_P(Modes, TorchRanksTest,
                         ::testing::Values(WaitMode::kManifest, WaitMode::kFileLock,
                                           WaitMode::kStore),
                         [](const ::testing::TestParamInfo<WaitMode>& param_info) {
                           switch (param_info.param) {
                             case WaitMode::kManifest:
                               return std::string("Manifest");
                             case WaitMode::kFileLock:
                               return std::string("FileLock");
                             case WaitMode::kStore:
                               return std::string("C10dStore");
                           }
                           return std::string("Unknown");
                         });

}  // namespace
}  // namespace ckptio::torch_ranks_testing
