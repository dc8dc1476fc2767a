// Coordination, every wait mode: waiters are answered only by this
// launch's and this attempt's records, never by a stale record of another
// launch, another job's decision, an earlier try or an overwritten outcome.
// See coordination_test_util.h.
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

// ---------------------------------------------------------------- d. race

// Waiters arrive before rank 0 took the save lock, with a stale "saving"
// record of the same step from another launch on disk: they must wait for
// the commit, not pass early and not call the writer dead.
TEST_P(CoordinationTest, WaitersArrivingBeforeTheSaveWaitForTheCommit) {
  constexpr int kIterations = 3;
  constexpr int64_t kFirst = 42;
  constexpr int kPoller = 3;
  int64_t min_margin_us = -1;
  for (int it = 0; it < kIterations; ++it) {
    const int64_t step = kFirst + it;
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(LeaveStaleSaveRecord(path_, mode(), step));

    RankGroup ranks(kWorld);
    ranks.Start(0, [&](RankLink& me) {
      RankCtx ctx;
      Status s = OpenRank(path_, 0, job_, mode(), &ctx);
      if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
      auto writer = ctx.store->OpenWriter(RankZeroWriterOptions(milliseconds(2000)));
      if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
      me.Say("ready");
      if (me.Hear(milliseconds(10000)) != std::optional<std::string>("go"))
        return Fail(0, kExitPipe, "no go");
      std::this_thread::sleep_for(milliseconds(300));
      int64_t commit_ns = 0;
      s = SaveStep(**writer, *ctx.coord, step, &commit_ns);
      if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
      me.Say("commit " + std::to_string(commit_ns));
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
        if (rank == kPoller) {
          const auto deadline = Clock::now() + milliseconds(10000);
          while (true) {
            auto polled = ctx.coord->PollSaved(step, AttemptOf(step));
            if (!polled.ok()) {
              s = polled.status();
              break;
            }
            if (*polled) {
              s = OkStatus();
              break;
            }
            if (Clock::now() > deadline) {
              s = Status(Code::kDeadlineExceeded, "still pending after 10 s of polling");
              break;
            }
            std::this_thread::sleep_for(milliseconds(1));
          }
        } else {
          s = ctx.coord->WaitSaved(step, AttemptOf(step), milliseconds(10000));
        }
        const int64_t ret_ns = NowNs();
        Status verified = s.ok() ? VerifyStep(*ctx.store, step) : OkStatus();
        me.Say(FormatReport(s, ret_ns));
        if (!s.ok()) return Fail(rank, kExitWaitError, s.ToString());
        if (!verified.ok())
          return Fail(rank, verified.code() == Code::kDataLoss ? kExitBadData : kExitEarlyRead,
                      "wait said committed, then: " + verified.ToString());
        return kExitOk;
      });
      ASSERT_TRUE(ranks.started(rank));
    }
    for (int rank = 1; rank < kWorld; ++rank)
      ASSERT_EQ(ranks.Next(rank, milliseconds(10000)), std::optional<std::string>("waiting"))
          << "rank " << rank;
    std::this_thread::sleep_for(milliseconds(20));  // inside their waits
    ranks.Tell(0, "go");
    auto commit = ranks.Next(0, milliseconds(10000));
    ASSERT_TRUE(commit.has_value()) << "rank 0 exit " << ranks.ExitCode(0, milliseconds(1000));
    auto c = Split(*commit);
    ASSERT_EQ(c.size(), 2u) << *commit;
    const int64_t commit_ns = std::stoll(c[1]);
    for (int rank = 1; rank < kWorld; ++rank) {
      auto r = ParseReport(ranks.Next(rank, milliseconds(12000)));
      ASSERT_TRUE(r.has_value()) << "rank " << rank << " did not report";
      EXPECT_EQ(r->code, Code::kOk) << "rank " << rank << ": " << r->message;
      EXPECT_EQ(r->message.find("writer died"), std::string::npos)
          << "rank " << rank << " took another launch's record for this one: " << r->message;
      EXPECT_GE(r->t_ns, commit_ns)
          << "rank " << rank << " returned " << (commit_ns - r->t_ns) / 1000
          << " us before rank 0 began to commit step " << step;
      const int64_t margin = (r->t_ns - commit_ns) / 1000;
      if (min_margin_us < 0 || margin < min_margin_us) min_margin_us = margin;
    }
    for (int rank = 0; rank < kWorld; ++rank)
      EXPECT_EQ(ranks.ExitCode(rank, milliseconds(10000)), kExitOk) << "rank " << rank;
    if (HasFailure()) return;
  }
  std::printf(
      "coordination: %s: %d races (waiters before the save lock, stale 'saving' record of "
      "job old-job), 0 early returns, first return %lld us after commit began\n",
      mode_name().c_str(), kIterations, static_cast<long long>(min_margin_us));
}

// ---------------------------------------------------------------- e. decisions

TEST_P(CoordinationTest, PublishAndWaitForIgnoreOtherJobs) {
  {  // Another launch's decision under the same name.
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(path_));
    std::shared_ptr<StorageBackend> shared(std::move(backend));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto old,
                                NewFileCoordinator(shared, MakeRank(0, "old-job"), mode()));
    CKPTIO_ASSERT_OK(old->Publish("load-1", "step=3"));
  }
  RankGroup ranks(kWorld);
  for (int rank = 1; rank < kWorld; ++rank) {
    ranks.Start(rank, [&, rank](RankLink& me) {
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job_, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      const auto t0 = Clock::now();
      auto stale = ctx.coord->WaitFor("load-1", milliseconds(300));
      const auto took = Clock::now() - t0;
      if (stale.ok())
        return Fail(rank, kExitWrongOutcome, "took another job's decision: " + *stale);
      if (stale.status().code() != Code::kDeadlineExceeded ||
          stale.status().message().find("load-1") == std::string::npos)
        return Fail(rank, kExitWaitError, stale.status().ToString());
      if (took < milliseconds(290)) return Fail(rank, kExitWaitError, "gave up early");
      me.Say("timedout");
      auto got = ctx.coord->WaitFor("load-1", milliseconds(10000));
      if (!got.ok()) return Fail(rank, kExitWaitError, got.status().ToString());
      me.Say("got " + *got);
      return *got == "step=7" ? kExitOk : Fail(rank, kExitWrongOutcome, "payload " + *got);
    });
    ASSERT_TRUE(ranks.started(rank));
  }
  for (int rank = 1; rank < kWorld; ++rank)
    ASSERT_EQ(ranks.Next(rank, milliseconds(10000)), std::optional<std::string>("timedout"))
        << "rank " << rank << " exit " << ranks.ExitCode(rank, milliseconds(1000));

  ranks.Start(0, [&](RankLink&) {
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    s = ctx.coord->Publish("load-1", "step=7");
    return s.ok() ? kExitOk : Fail(0, kExitSaveFailed, s.ToString());
  });
  ASSERT_TRUE(ranks.started(0));
  EXPECT_EQ(ranks.ExitCode(0, milliseconds(10000)), kExitOk);
  for (int rank = 1; rank < kWorld; ++rank) {
    EXPECT_EQ(ranks.Next(rank, milliseconds(10000)), std::optional<std::string>("got step=7"))
        << "rank " << rank;
    EXPECT_EQ(ranks.ExitCode(rank, milliseconds(10000)), kExitOk) << "rank " << rank;
  }
  std::printf(
      "coordination: %s: publish \"load-1\" reached %d waiters; another job's record "
      "ignored (DEADLINE_EXCEEDED)\n",
      mode_name().c_str(), kWorld - 1);
}

// Every rank returns what rank 0 returns, also when the step's name was
// used before: a retry after a failed try is not answered by the failure,
// and a step already in the store is not this save's commit. Rank 0 and a
// waiter in this process, each with its own backend.
TEST_P(CoordinationTest, AnAttemptIsAnsweredOnlyByItsOwnOutcome) {
  RankCtx r0, r1;
  CKPTIO_ASSERT_OK(OpenRank(path_, 0, job_, mode(), &r0));
  CKPTIO_ASSERT_OK(OpenRank(path_, 1, job_, mode(), &r1));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, r0.store->OpenWriter(RankZeroWriterOptions()));
  auto commit = [&](int64_t step, const std::string& attempt) -> Status {
    CKPTIO_RETURN_IF_ERROR(r0.coord->BeginSave(step, attempt, milliseconds(2000)));
    Status outcome = [&]() -> Status {
      CKPTIO_ASSIGN_OR_RETURN(auto pending, writer->Begin(step));
      CKPTIO_RETURN_IF_ERROR(pending->PutObject("data.bin", "x", 1));
      CKPTIO_RETURN_IF_ERROR(pending->SetMetadata(kSaveAttemptKey, attempt));
      return pending->Commit().status();
    }();
    CKPTIO_RETURN_IF_ERROR(r0.coord->EndSave(step, attempt, outcome));
    return outcome;
  };

  // Step 5, first try: rank 0 fails. The retry's waiter does not take that
  // failure for its own; it sees the retry's commit.
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(5, "job.c1.1", milliseconds(2000)));
  CKPTIO_ASSERT_OK(r0.coord->EndSave(5, "job.c1.1", Status(Code::kResourceExhausted, "full")));
  EXPECT_EQ(r1.coord->PollSaved(5, "job.c1.1").status().code(), Code::kResourceExhausted);
  auto before = r1.coord->PollSaved(5, "job.c1.2");
  ASSERT_TRUE(before.ok()) << "the retry was answered by the failed try: " << before.status();
  EXPECT_FALSE(*before);
  CKPTIO_ASSERT_OK(commit(5, "job.c1.2"));
  CKPTIO_EXPECT_OK(r1.coord->WaitSaved(5, "job.c1.2", milliseconds(2000)));

  // Step 5 again: it is in the store, but not this attempt's commit; rank
  // 0's refusal reaches the waiter.
  auto again = r1.coord->PollSaved(5, "job.c1.3");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(*again) << "a step saved earlier was taken for this save's commit";
  Status refused = commit(5, "job.c1.3");
  EXPECT_EQ(refused.code(), Code::kAlreadyExists) << refused;
  Status waited = r1.coord->WaitSaved(5, "job.c1.3", milliseconds(2000));
  EXPECT_EQ(waited.code(), refused.code()) << waited;
}

// Rank 0 goes on (a retry, the next save) before a slow waiter reads the
// record of its attempt: the next record carries the outcome, and a waiter
// two saves behind learns that its attempt ended without a commit, instead
// of waiting for the deadline.
TEST_P(CoordinationTest, AnOutcomeOverwrittenByTheNextSaveStillReachesTheWaiter) {
  RankCtx r0, r1;
  CKPTIO_ASSERT_OK(OpenRank(path_, 0, job_, mode(), &r0));
  CKPTIO_ASSERT_OK(OpenRank(path_, 1, job_, mode(), &r1));
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(5, "j.c1.1", milliseconds(2000)));
  CKPTIO_ASSERT_OK(r0.coord->EndSave(5, "j.c1.1", Status(Code::kResourceExhausted, "disk full")));
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(5, "j.c1.2", milliseconds(2000)));  // the retry
  Status first = r1.coord->WaitSaved(5, "j.c1.1", milliseconds(2000));
  EXPECT_EQ(first.code(), Code::kResourceExhausted) << first;
  EXPECT_NE(first.message().find("disk full"), std::string::npos) << first;
  CKPTIO_ASSERT_OK(r0.coord->EndSave(5, "j.c1.2", Status(Code::kUnavailable, "gone")));
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(6, "j.c1.3", milliseconds(2000)));
  const auto t0 = Clock::now();
  Status behind = r1.coord->WaitSaved(5, "j.c1.1", milliseconds(5000));
  EXPECT_EQ(behind.code(), Code::kAborted) << behind;
  EXPECT_LT(Clock::now() - t0, milliseconds(2000)) << "waited for the deadline";
  CKPTIO_ASSERT_OK(r0.coord->EndSave(6, "j.c1.3", OkStatus()));
}

// A waiter that looks only after retention removed its step: a clear
// error saying so, not a wait for the deadline.
TEST_P(CoordinationTest, AStepRetentionRemovedBeforeTheWaiterLookedIsReported) {
  RankCtx r0, r1;
  CKPTIO_ASSERT_OK(OpenRank(path_, 0, job_, mode(), &r0));
  CKPTIO_ASSERT_OK(OpenRank(path_, 1, job_, mode(), &r1));
  WriterOptions wo = RankZeroWriterOptions();
  wo.keep_last = 1;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, r0.store->OpenWriter(wo));
  for (int64_t step : {5, 6}) {
    const std::string attempt = "j.c1." + std::to_string(step);
    CKPTIO_ASSERT_OK(r0.coord->BeginSave(step, attempt, milliseconds(2000)));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, writer->Begin(step));
    CKPTIO_ASSERT_OK(pending->PutObject("data.bin", "x", 1));
    CKPTIO_ASSERT_OK(pending->SetMetadata(kSaveAttemptKey, attempt));
    CKPTIO_ASSERT_OK(pending->Commit().status());
    CKPTIO_ASSERT_OK(r0.coord->EndSave(step, attempt, OkStatus()));
  }
  // One save behind: the record's prev_* names step 5 as committed.
  const auto t0 = Clock::now();
  Status gone = r1.coord->WaitSaved(5, "j.c1.5", milliseconds(5000));
  EXPECT_EQ(gone.code(), Code::kNotFound) << gone;
  EXPECT_NE(gone.message().find("retention"), std::string::npos) << gone;
  // Two behind: rank 0 is at a later attempt.
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(7, "j.c1.7", milliseconds(2000)));
  Status later = r1.coord->WaitSaved(5, "j.c1.5", milliseconds(5000));
  EXPECT_EQ(later.code(), Code::kAborted) << later;
  EXPECT_LT(Clock::now() - t0, milliseconds(3000)) << "waited for the deadline";
  CKPTIO_ASSERT_OK(r0.coord->EndSave(7, "j.c1.7", OkStatus()));
}

}  // namespace
}  // namespace ckptio::coordination_testing
