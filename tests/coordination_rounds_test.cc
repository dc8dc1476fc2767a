// Coordination across real processes, every wait mode: rounds of saves in
// which no waiter sees a step before it is committed, and rank 0's failure
// reaching every waiter promptly. See coordination_test_util.h.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckptio/posix_backend.h"
#include "coordination_test_util.h"

namespace ckptio::coordination_testing {
namespace {

// ---------------------------------------------------------------- a. rounds

// 20 saves; ranks 1 and 2 WaitSaved, rank 3 polls PollSaved. Right after
// each wait returns the step opens and verifies, LATEST is at or past it,
// and the wait did not return before rank 0 began to commit.
TEST_P(CoordinationTest, WaitersNeverSeeAStepBeforeItIsCommitted) {
  constexpr int kRounds = 20;
  constexpr int64_t kFirst = 100;
  constexpr int kPoller = 3;
  RankGroup ranks(kWorld);
  ranks.Start(0, [&](RankLink& me) {
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions());
    if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
    me.Say("ready");
    for (int i = 0; i < kRounds; ++i) {
      const int64_t step = kFirst + i;
      auto go = me.Hear(milliseconds(10000));
      if (!go || *go != "go " + std::to_string(step))
        return Fail(0, kExitPipe, "expected go " + std::to_string(step));
      int64_t commit_ns = 0;
      s = SaveStep(**writer, *ctx.coord, step, &commit_ns);
      if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
      me.Say("done " + std::to_string(step) + " " + std::to_string(commit_ns));
    }
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started(0));

  for (int rank = 1; rank < kWorld; ++rank) {
    ranks.Start(rank, [&, rank](RankLink& me) {
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job_, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      for (int i = 0; i < kRounds; ++i) {
        const int64_t step = kFirst + i;
        const std::string at = "step " + std::to_string(step) + ": ";
        int64_t pending_polls = 0;
        if (rank == kPoller) {
          // Rank 0 has not been told to save this step yet: it is pending.
          auto first = ctx.coord->PollSaved(step, AttemptOf(step));
          if (!first.ok()) return Fail(rank, kExitWaitError, at + first.status().ToString());
          if (*first) return Fail(rank, kExitPollEarly, at + "committed before rank 0 saved it");
          ++pending_polls;
          me.Say("ready " + std::to_string(step));
          const auto deadline = Clock::now() + milliseconds(10000);
          while (true) {
            auto polled = ctx.coord->PollSaved(step, AttemptOf(step));
            if (!polled.ok()) return Fail(rank, kExitWaitError, at + polled.status().ToString());
            if (*polled) break;
            ++pending_polls;
            if (Clock::now() > deadline)
              return Fail(rank, kExitWaitError, at + "still pending after 10 s of polling");
            std::this_thread::sleep_for(milliseconds(1));
          }
        } else {
          me.Say("ready " + std::to_string(step));
          s = ctx.coord->WaitSaved(step, AttemptOf(step), milliseconds(10000));
          if (!s.ok()) return Fail(rank, kExitWaitError, at + s.ToString());
        }
        const int64_t ret_ns = NowNs();
        // The step must be there, whole, at once.
        s = VerifyStep(*ctx.store, step);
        if (!s.ok())
          return Fail(rank, s.code() == Code::kDataLoss ? kExitBadData : kExitEarlyRead,
                      at + "wait said committed, then: " + s.ToString());
        auto latest = ctx.store->ReadLatest();
        if (!latest.ok() || !latest->has_value() || (*latest)->step < step)
          return Fail(rank, kExitLatestBehind,
                      at + "LATEST behind after the wait: " +
                          (latest.ok() ? (latest->has_value() ? std::to_string((*latest)->step)
                                                              : std::string("none"))
                                       : latest.status().ToString()));
        me.Say("ret " + std::to_string(step) + " " + std::to_string(ret_ns) + " " +
               std::to_string(pending_polls));
      }
      return kExitOk;
    });
    ASSERT_TRUE(ranks.started(rank));
  }

  auto ready = ranks.Next(0, milliseconds(10000));
  ASSERT_EQ(ready, std::optional<std::string>("ready")) << "rank 0 did not open its writer";
  int early = 0;
  int64_t poller_pending = 0;
  int poller_rounds_with_pending = 0;
  for (int i = 0; i < kRounds; ++i) {
    const int64_t step = kFirst + i;
    SCOPED_TRACE("step " + std::to_string(step));
    for (int rank = 1; rank < kWorld; ++rank) {
      auto line = ranks.Next(rank, milliseconds(10000));
      ASSERT_EQ(line, std::optional<std::string>("ready " + std::to_string(step)))
          << "rank " << rank << " (exit " << ranks.ExitCode(rank, milliseconds(0)) << ")";
    }
    ranks.Tell(0, "go " + std::to_string(step));
    auto done = ranks.Next(0, milliseconds(10000));
    ASSERT_TRUE(done.has_value()) << "rank 0 did not save (exit "
                                  << ranks.ExitCode(0, milliseconds(1000)) << ")";
    auto d = Split(*done);
    ASSERT_EQ(d.size(), 3u) << *done;
    ASSERT_EQ(d[1], std::to_string(step)) << *done;
    const int64_t commit_ns = std::stoll(d[2]);
    for (int rank = 1; rank < kWorld; ++rank) {
      auto line = ranks.Next(rank, milliseconds(10000));
      ASSERT_TRUE(line.has_value()) << "rank " << rank << " did not return (exit "
                                    << ranks.ExitCode(rank, milliseconds(1000)) << ")";
      auto w = Split(*line);
      ASSERT_EQ(w.size(), 4u) << *line;
      ASSERT_EQ(w[1], std::to_string(step)) << *line;
      const int64_t ret_ns = std::stoll(w[2]);
      if (ret_ns < commit_ns) {
        ++early;
        ADD_FAILURE() << "rank " << rank << " returned from its wait for step " << step << " "
                      << (commit_ns - ret_ns) / 1000 << " us before rank 0 began to commit it";
      }
      if (rank == kPoller) {
        poller_pending += std::stoll(w[3]);
        poller_rounds_with_pending += std::stoll(w[3]) >= 2;
      }
    }
  }
  for (int rank = 0; rank < kWorld; ++rank)
    EXPECT_EQ(ranks.ExitCode(rank, milliseconds(10000)), kExitOk) << "rank " << rank;
  EXPECT_EQ(early, 0);
  // The poller saw at least one pending poll per round by construction, and
  // should see the save in flight (pending after "go") in most rounds.
  EXPECT_GE(poller_pending, kRounds);

  Store store(std::shared_ptr<StorageBackend>(NewPosixBackend(path_).value()));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest, store.ReadLatest());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, kFirst + kRounds - 1);
  std::printf(
      "coordination: %s: %d rounds x %d waiters (2 WaitSaved, 1 PollSaved), %d early "
      "reads, poller saw %lld pending polls (%d rounds pending after go)\n",
      mode_name().c_str(), kRounds, kWorld - 1, early, static_cast<long long>(poller_pending),
      poller_rounds_with_pending);
}

// ---------------------------------------------------------------- b. failure

TEST_P(CoordinationTest, RankZeroFailureReachesEveryWaiterPromptly) {
  constexpr int64_t kGood = 4;
  constexpr int64_t kStep = 5;
  constexpr milliseconds kDeadline(10000);
  RankGroup ranks(kWorld);
  ranks.Start(0, [&](RankLink& me) {
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions());
    if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
    s = SaveStep(**writer, *ctx.coord, kGood, nullptr);
    if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
    me.Say("ready");
    if (me.Hear(milliseconds(10000)) != std::optional<std::string>("go"))
      return Fail(0, kExitPipe, "no go");
    s = ctx.coord->BeginSave(kStep, AttemptOf(kStep), milliseconds(5000));
    if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
    {
      auto pending = (*writer)->Begin(kStep);
      if (!pending.ok()) return Fail(0, kExitSaveFailed, pending.status().ToString());
      const std::string data = StepData(kStep);
      s = (*pending)->PutObject("data.bin", data.data(), data.size());
      if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
      std::this_thread::sleep_for(milliseconds(200));
      // "The disk filled up": abandon the checkpoint, report the failure.
    }
    const int64_t fail_ns = NowNs();
    s = ctx.coord->EndSave(kStep, AttemptOf(kStep), Status(Code::kResourceExhausted, "disk full"));
    if (!s.ok()) return Fail(0, kExitSaveFailed, "EndSave: " + s.ToString());
    me.Say("failed " + std::to_string(fail_ns));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started(0));
  ASSERT_EQ(ranks.Next(0, milliseconds(10000)), std::optional<std::string>("ready"))
      << "rank 0 exit " << ranks.ExitCode(0, milliseconds(1000));

  for (int rank = 1; rank < kWorld; ++rank) {
    ranks.Start(rank, [&, rank](RankLink& me) {
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job_, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      me.Say("waiting");
      s = ctx.coord->WaitSaved(kStep, AttemptOf(kStep), kDeadline);
      const int64_t ret_ns = NowNs();
      me.Say(FormatReport(s, ret_ns));
      if (s.ok()) return Fail(rank, kExitWrongOutcome, "WaitSaved succeeded for a failed save");
      auto visible = ctx.store->OpenStep(kStep);
      if (visible.status().code() != Code::kNotFound)
        return Fail(rank, kExitStepVisible, "failed step: " + visible.status().ToString());
      s = VerifyStep(*ctx.store, kGood);
      if (!s.ok()) return Fail(rank, kExitPrevStepBad, s.ToString());
      return kExitOk;
    });
    ASSERT_TRUE(ranks.started(rank));
  }
  for (int rank = 1; rank < kWorld; ++rank)
    ASSERT_EQ(ranks.Next(rank, milliseconds(10000)), std::optional<std::string>("waiting"))
        << "rank " << rank;
  std::this_thread::sleep_for(milliseconds(50));
  ranks.Tell(0, "go");
  auto failed = ranks.Next(0, milliseconds(10000));
  ASSERT_TRUE(failed.has_value()) << "rank 0 exit " << ranks.ExitCode(0, milliseconds(1000));
  auto f = Split(*failed);
  ASSERT_EQ(f.size(), 2u) << *failed;
  const int64_t fail_ns = std::stoll(f[1]);

  int64_t slowest_ms = 0;
  for (int rank = 1; rank < kWorld; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    auto r = ParseReport(ranks.Next(rank, milliseconds(12000)));
    ASSERT_TRUE(r.has_value()) << "no report";
    EXPECT_EQ(r->code, Code::kResourceExhausted) << r->message;
    EXPECT_NE(r->message.find("disk full"), std::string::npos) << r->message;
    EXPECT_NE(r->message.find("step " + std::to_string(kStep)), std::string::npos) << r->message;
    EXPECT_GE(r->t_ns, fail_ns) << "returned before rank 0 reported the failure";
    const int64_t after_ms = (r->t_ns - fail_ns) / 1000000;
    slowest_ms = std::max(slowest_ms, after_ms);
    EXPECT_LT(after_ms, 1000) << "the failure should arrive promptly, not near the deadline";
  }
  for (int rank = 0; rank < kWorld; ++rank)
    EXPECT_EQ(ranks.ExitCode(rank, milliseconds(10000)), kExitOk) << "rank " << rank;
  std::printf(
      "coordination: %s: rank 0 failed step %lld (RESOURCE_EXHAUSTED), %d waiters got it "
      "within %lld ms\n",
      mode_name().c_str(), static_cast<long long>(kStep), kWorld - 1,
      static_cast<long long>(slowest_ms));
}

// The TEST_Ps of every coordination_*_test.cc file, once per file wait mode.
INSTANTIATE_TEST_SUITE_P(Modes, CoordinationTest,
                         ::testing::Values(WaitMode::kManifest, WaitMode::kFileLock),
                         [](const ::testing::TestParamInfo<WaitMode>& param_info) {
                           return param_info.param == WaitMode::kManifest ? std::string("Manifest")
                                                                          : std::string("FileLock");
                         });

}  // namespace
}  // namespace ckptio::coordination_testing
