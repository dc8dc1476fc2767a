// Coordination across real processes, every wait mode: rank 0 SIGKILLed
// mid-save or between saves while the others wait, then a relaunch. See
// coordination_test_util.h.
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

// ---------------------------------------------------------------- c. death

void CoordinationTest::KillRankZeroThenRestart(bool mid_save) {
  constexpr int64_t kPrev = 10;
  constexpr int64_t kStep = 11;
  constexpr milliseconds kWaitTimeout(4000);
  RankGroup ranks(kWorld);

  // Phase 1: rank 0 commits kPrev, starts kStep (mid_save) and is
  // SIGKILLed mid-object, or before it begins kStep.
  ranks.Start(0, [&](RankLink& me) {
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions());
    if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
    s = SaveStep(**writer, *ctx.coord, kPrev, nullptr);
    if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
    if (!mid_save) {
      me.Say("saving");
      return SleepUntilKilled(60);
    }
    s = ctx.coord->BeginSave(kStep, AttemptOf(kStep), milliseconds(5000));
    if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
    auto pending = (*writer)->Begin(kStep);
    if (!pending.ok()) return Fail(0, kExitSaveFailed, pending.status().ToString());
    auto stream = (*pending)->AddObject("data.bin");
    if (!stream.ok()) return Fail(0, kExitSaveFailed, stream.status().ToString());
    const std::string data = StepData(kStep);
    s = (*stream)->Write(data.data(), data.size() / 2);
    if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
    me.Say("saving");
    return SleepUntilKilled(60);
  });
  ASSERT_TRUE(ranks.started(0));
  ASSERT_EQ(ranks.Next(0, milliseconds(10000)), std::optional<std::string>("saving"))
      << "rank 0 exit " << ranks.ExitCode(0, milliseconds(1000));

  for (int rank = 1; rank < kWorld; ++rank) {
    ranks.Start(rank, [&, rank](RankLink& me) {
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job_, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      s = VerifyStep(*ctx.store, kPrev);
      if (!s.ok()) return Fail(rank, kExitPrevStepBad, "before the wait: " + s.ToString());
      me.Say("waiting " + std::to_string(NowNs()));
      s = ctx.coord->WaitSaved(kStep, AttemptOf(kStep), kWaitTimeout);
      const int64_t ret_ns = NowNs();
      me.Say(FormatReport(s, ret_ns));
      if (s.ok()) return Fail(rank, kExitWrongOutcome, "WaitSaved succeeded for a dead save");
      auto visible = ctx.store->OpenStep(kStep);
      if (visible.status().code() != Code::kNotFound)
        return Fail(rank, kExitStepVisible, "killed step: " + visible.status().ToString());
      s = VerifyStep(*ctx.store, kPrev);
      if (!s.ok()) return Fail(rank, kExitPrevStepBad, "after the wait: " + s.ToString());
      auto latest = ctx.store->ReadLatest();
      if (!latest.ok() || !latest->has_value() || (*latest)->step != kPrev)
        return Fail(rank, kExitPrevStepBad, "LATEST does not name the previous step");
      return kExitOk;
    });
    ASSERT_TRUE(ranks.started(rank));
  }
  std::vector<int64_t> wait_start(kWorld, 0);
  for (int rank = 1; rank < kWorld; ++rank) {
    auto line = ranks.Next(rank, milliseconds(10000));
    ASSERT_TRUE(line.has_value()) << "rank " << rank << " exit "
                                  << ranks.ExitCode(rank, milliseconds(1000));
    auto w = Split(*line);
    ASSERT_EQ(w.size(), 2u) << *line;
    wait_start[rank] = std::stoll(w[1]);
  }
  std::this_thread::sleep_for(milliseconds(200));  // all are inside WaitSaved now
  const int64_t kill_ns = NowNs();
  ASSERT_EQ(::kill(ranks.child(0).pid(), SIGKILL), 0);
  EXPECT_EQ(ranks.ExitCode(0, milliseconds(5000)), 128 + SIGKILL);

  int64_t slowest_ms = 0;
  for (int rank = 1; rank < kWorld; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    auto r = ParseReport(ranks.Next(rank, milliseconds(8000)));
    ASSERT_TRUE(r.has_value()) << "no report";
    if (mode() == WaitMode::kFileLock) {
      EXPECT_EQ(r->code, Code::kAborted) << r->message;
      EXPECT_NE(r->message.find("writer died before committing step " + std::to_string(kStep)),
                std::string::npos)
          << r->message;
      if (!mid_save) {
        EXPECT_NE(r->message.find("before it began this save"), std::string::npos) << r->message;
      }
      const int64_t after_ms = (r->t_ns - kill_ns) / 1000000;
      slowest_ms = std::max(slowest_ms, after_ms);
      EXPECT_LT(after_ms, 1000) << "the death should be detected within 1 s of the kill";
      EXPECT_GE(r->t_ns, kill_ns) << "reported the writer dead while it was alive";
    } else {
      EXPECT_EQ(r->code, Code::kDeadlineExceeded) << r->message;
      EXPECT_NE(r->message.find("step " + std::to_string(kStep)), std::string::npos) << r->message;
      EXPECT_NE(r->message.find("manifest"), std::string::npos) << r->message;
      const int64_t waited_ms = (r->t_ns - wait_start[rank]) / 1000000;
      slowest_ms = std::max(slowest_ms, waited_ms);
      EXPECT_GE(waited_ms, kWaitTimeout.count() - 100) << "gave up before the deadline";
      EXPECT_LT(waited_ms, kWaitTimeout.count() + 1500) << "ran far past the deadline";
    }
  }
  for (int rank = 1; rank < kWorld; ++rank)
    EXPECT_EQ(ranks.ExitCode(rank, milliseconds(10000)), kExitOk) << "rank " << rank;

  {  // The previous checkpoint is intact; the killed one is not visible.
    Store store(std::shared_ptr<StorageBackend>(NewPosixBackend(path_).value()));
    CKPTIO_EXPECT_OK(VerifyStep(store, kPrev));
    EXPECT_EQ(store.OpenStep(kStep).status().code(), Code::kNotFound);
  }

  // Phase 2: the relaunch (a new job id). New waiters first, then a new
  // rank 0 that takes the writer lock the kernel released and saves kStep.
  const std::string job2 = NewJobId();
  RankGroup relaunch(kWorld);
  for (int rank = 1; rank < kWorld; ++rank) {
    relaunch.Start(rank, [&, rank](RankLink& me) {
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job2, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      me.Say("waiting");
      s = ctx.coord->WaitSaved(kStep, AttemptOf(kStep), milliseconds(10000));
      me.Say(FormatReport(s, NowNs()));
      if (!s.ok()) return Fail(rank, kExitWaitError, "after the relaunch: " + s.ToString());
      s = VerifyStep(*ctx.store, kStep);
      if (!s.ok())
        return Fail(rank, s.code() == Code::kDataLoss ? kExitBadData : kExitEarlyRead,
                    s.ToString());
      s = VerifyStep(*ctx.store, kPrev);
      if (!s.ok()) return Fail(rank, kExitPrevStepBad, s.ToString());
      return kExitOk;
    });
    ASSERT_TRUE(relaunch.started(rank));
  }
  for (int rank = 1; rank < kWorld; ++rank) {
    ASSERT_EQ(relaunch.Next(rank, milliseconds(10000)), std::optional<std::string>("waiting"))
        << "relaunched rank " << rank;
  }
  std::this_thread::sleep_for(milliseconds(100));
  relaunch.Start(0, [&](RankLink& me) {
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job2, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions(milliseconds(2000)));
    if (!writer.ok()) return Fail(0, kExitSetup, "relaunch: " + writer.status().ToString());
    s = SaveStep(**writer, *ctx.coord, kStep, nullptr);
    if (!s.ok()) return Fail(0, kExitSaveFailed, "relaunch: " + s.ToString());
    me.Say("done");
    return kExitOk;
  });
  ASSERT_TRUE(relaunch.started(0));
  EXPECT_EQ(relaunch.Next(0, milliseconds(10000)), std::optional<std::string>("done"));
  EXPECT_EQ(relaunch.ExitCode(0, milliseconds(10000)), kExitOk);
  for (int rank = 1; rank < kWorld; ++rank) {
    auto r = ParseReport(relaunch.Next(rank, milliseconds(10000)));
    ASSERT_TRUE(r.has_value()) << "relaunched rank " << rank << " did not report";
    EXPECT_EQ(r->code, Code::kOk) << "relaunched rank " << rank << ": " << r->message;
    EXPECT_EQ(relaunch.ExitCode(rank, milliseconds(10000)), kExitOk) << "rank " << rank;
  }
  Store store(std::shared_ptr<StorageBackend>(NewPosixBackend(path_).value()));
  CKPTIO_EXPECT_OK(VerifyStep(store, kPrev));
  CKPTIO_EXPECT_OK(VerifyStep(store, kStep));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest, store.ReadLatest());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, kStep);
  std::printf(
      "coordination: %s: rank 0 SIGKILLed %s step %lld; %d waiters returned %s "
      "(slowest %lld ms %s); relaunch committed step %lld, step %lld intact\n",
      mode_name().c_str(), mid_save ? "mid-save of" : "between saves, before",
      static_cast<long long>(kStep), kWorld - 1,
      mode() == WaitMode::kFileLock ? "ABORTED" : "DEADLINE_EXCEEDED",
      static_cast<long long>(slowest_ms),
      mode() == WaitMode::kFileLock ? "after the kill" : "after starting to wait",
      static_cast<long long>(kStep), static_cast<long long>(kPrev));
}

namespace {

TEST_P(CoordinationTest, RankZeroKilledMidSaveThenRestart) { KillRankZeroThenRestart(true); }

// File lock: rank 0 holds the save lock between saves too, so its death
// there is noticed as fast (manifest: the deadline, as mid-save).
TEST_P(CoordinationTest, RankZeroKilledBetweenSavesThenRestart) { KillRankZeroThenRestart(false); }

}  // namespace
}  // namespace ckptio::coordination_testing
