// File coordination in one process: a storage that does not answer for a
// moment, records at and over their size limits, Retract, and the setups
// NewFileCoordinator refuses. See coordination_test_util.h.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ckptio/posix_backend.h"
#include "coordination_test_util.h"

namespace ckptio::coordination_testing {
namespace {

class FlakyReads : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    if ((key == kLatestKey || key.rfind(".coord/decision-", 0) == 0) && failures != 0) {
      if (failures > 0) --failures;
      ++failed;
      return Status(Code::kUnavailable, "injected: the server did not answer");
    }
    return ForwardingBackend::OpenObject(key);
  }
  int failures = 0, failed = 0;
};

// The storage not answering for a moment is no outcome of rank 0's save:
// waiters poll past it to the commit (or the published record), and only a
// failure that lasts to the deadline ends the wait with that failure. An
// error that is not transient still ends it at once.
TEST(FileCoordinatorTest, WaitsPollPastAStorageThatDoesNotAnswerForAMoment) {
  for (WaitMode mode : {WaitMode::kManifest, WaitMode::kFileLock}) {
    SCOPED_TRACE(WaitModeName(mode));
    TempDir tmp;
    const std::string job = NewJobId();
    RankCtx r0;
    CKPTIO_ASSERT_OK(OpenRank(tmp.Sub("store"), 0, job, mode, &r0));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto posix, NewPosixBackend(tmp.Sub("store")));
    auto flaky = std::make_shared<FlakyReads>(std::shared_ptr<StorageBackend>(std::move(posix)));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto r1, NewFileCoordinator(flaky, MakeRank(1, job), mode));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, r0.store->OpenWriter(RankZeroWriterOptions()));
    const std::string attempt = AttemptOf(1);
    CKPTIO_ASSERT_OK(r0.coord->BeginSave(1, attempt, milliseconds(2000)));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, writer->Begin(1));
    CKPTIO_ASSERT_OK(pending->PutObject("data.bin", "x", 1));
    CKPTIO_ASSERT_OK(pending->SetMetadata(kSaveAttemptKey, attempt));
    CKPTIO_ASSERT_OK(pending->Commit().status());
    CKPTIO_ASSERT_OK(r0.coord->EndSave(1, attempt, OkStatus()));
    CKPTIO_ASSERT_OK(r0.coord->Publish("decision-1", "step 1"));

    flaky->failures = 3;
    CKPTIO_EXPECT_OK(r1->WaitSaved(1, attempt, milliseconds(5000)));
    EXPECT_EQ(flaky->failed, 3);
    flaky->failures = 3;
    auto got = r1->WaitFor("decision-1", milliseconds(5000));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, "step 1");

    // Rank 0's own failure is final, whatever its code: not polled past.
    CKPTIO_ASSERT_OK(r0.coord->BeginSave(2, AttemptOf(2), milliseconds(2000)));
    CKPTIO_ASSERT_OK(r0.coord->EndSave(
        2, AttemptOf(2), Status(Code::kUnavailable, "the NFS server did not answer")));
    const auto failing = Clock::now();
    Status failed = r1->WaitSaved(2, AttemptOf(2), milliseconds(5000));
    EXPECT_EQ(failed.code(), Code::kUnavailable) << failed;
    EXPECT_NE(failed.message().find("did not answer"), std::string::npos) << failed;
    EXPECT_LT(Clock::now() - failing, milliseconds(2000)) << "rank 0's failure was polled past";

    flaky->failures = -1;
    const auto t0 = Clock::now();
    Status down = r1->WaitSaved(1, attempt, milliseconds(300));
    EXPECT_EQ(down.code(), Code::kUnavailable) << down;
    EXPECT_NE(down.message().find("still failing at the deadline"), std::string::npos) << down;
    EXPECT_GE(Clock::now() - t0, milliseconds(300)) << "gave up before the deadline";
    auto down_for = r1->WaitFor("decision-1", milliseconds(300));
    EXPECT_EQ(down_for.status().code(), Code::kUnavailable) << down_for.status();
    flaky->failures = 0;
  }
}

// Rank 0's failure reaches the waiters however long its message: the save
// record keeps the first 4 KiB of it (a record over 64 KiB would be ignored
// by every waiter, which then waited for its deadline).
TEST(FileCoordinatorTest, AFailureWithAHugeMessageStillReachesTheWaiters) {
  TempDir tmp;
  const std::string job = NewJobId();
  RankCtx r0, r1;
  CKPTIO_ASSERT_OK(OpenRank(tmp.Sub("store"), 0, job, WaitMode::kManifest, &r0));
  CKPTIO_ASSERT_OK(OpenRank(tmp.Sub("store"), 1, job, WaitMode::kManifest, &r1));
  const std::string huge = "disk full: " + std::string(100 << 10, 'e');
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(1, AttemptOf(1), milliseconds(2000)));
  CKPTIO_ASSERT_OK(r0.coord->EndSave(1, AttemptOf(1), Status(Code::kResourceExhausted, huge)));
  const auto t0 = Clock::now();
  Status s = r1.coord->WaitSaved(1, AttemptOf(1), milliseconds(5000));
  EXPECT_LT(Clock::now() - t0, milliseconds(2000)) << "the waiter did not see rank 0's failure";
  EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.ToString().substr(0, 300);
  EXPECT_NE(s.message().find("disk full: eee"), std::string::npos);
  EXPECT_NE(s.message().find("more bytes in rank 0's log"), std::string::npos);
  // The next save's record carries it too (prev_message), and still fits.
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(2, AttemptOf(2), milliseconds(2000)));
  Status again = r1.coord->WaitSaved(1, AttemptOf(1), milliseconds(5000));
  EXPECT_EQ(again.code(), Code::kResourceExhausted) << again.ToString().substr(0, 300);
  // Two failures in a row (the record holds both messages) of control
  // characters, which the record escapes to 6 bytes each.
  const std::string controls(100 << 10, '\x01');
  CKPTIO_ASSERT_OK(r0.coord->EndSave(2, AttemptOf(2), Status(Code::kInternal, controls)));
  CKPTIO_ASSERT_OK(r0.coord->BeginSave(3, AttemptOf(3), milliseconds(2000)));
  CKPTIO_ASSERT_OK(r0.coord->EndSave(3, AttemptOf(3), Status(Code::kInternal, controls)));
  const auto t1 = Clock::now();
  Status third = r1.coord->WaitSaved(3, AttemptOf(3), milliseconds(3000));
  EXPECT_EQ(third.code(), Code::kInternal) << third.ToString().substr(0, 300);
  EXPECT_LT(Clock::now() - t1, milliseconds(2000)) << "the escaped record grew past the limit";
}

// Retract deletes a published record (and only it): a waiter no longer
// finds it, and retracting what is absent is not an error.
TEST(FileCoordinatorTest, RetractDeletesThePublishedRecordOnly) {
  TempDir tmp;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(tmp.Sub("store")));
  std::shared_ptr<StorageBackend> shared(std::move(backend));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto coord,
                              NewFileCoordinator(shared, MakeRank(0, "j"), WaitMode::kManifest));
  CKPTIO_ASSERT_OK(coord->Publish("stripe-go-a", "ok"));
  CKPTIO_ASSERT_OK(coord->Publish("stripe-a-1", "receipt"));
  CKPTIO_ASSERT_OK(coord->Retract("stripe-go-a"));
  EXPECT_EQ(coord->WaitFor("stripe-go-a", milliseconds(50)).status().code(),
            Code::kDeadlineExceeded);
  auto kept = coord->WaitFor("stripe-a-1", milliseconds(500));
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, "receipt");
  CKPTIO_EXPECT_OK(coord->Retract("stripe-go-a"));  // again: absent is fine
  CKPTIO_EXPECT_OK(coord->Retract("stripe-a-1"));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto left, shared->List(".coord/"));
  EXPECT_TRUE(left.empty()) << left.size() << " records left, first " << left.front();
  EXPECT_EQ(coord->Retract("../LATEST").code(), Code::kInvalidArgument);
}

TEST(NewFileCoordinatorTest, RefusesBadSetups) {
  TempDir tmp;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(tmp.Sub("store")));
  std::shared_ptr<StorageBackend> shared(std::move(backend));

  auto no_job = NewFileCoordinator(shared, MakeRank(1, ""), WaitMode::kFileLock);
  ASSERT_FALSE(no_job.ok()) << "several ranks without a job id";
  EXPECT_EQ(no_job.status().code(), Code::kInvalidArgument) << no_job.status();
  EXPECT_NE(no_job.status().message().find("CKPTIO_JOB_ID"), std::string::npos) << no_job.status();
  auto no_job_manifest = NewFileCoordinator(shared, MakeRank(0, ""), WaitMode::kManifest);
  EXPECT_EQ(no_job_manifest.status().code(), Code::kInvalidArgument) << no_job_manifest.status();

  // torchrun's static rendezvous: a relaunch repeats the job id, and its
  // waiters would take the earlier launch's records for its own.
  RankInfo reused = MakeRank(1, "master:10.0.0.7:29500:0");
  reused.job_id_reused = true;
  for (WaitMode m : {WaitMode::kManifest, WaitMode::kFileLock}) {
    auto refused = NewFileCoordinator(shared, reused, m);
    ASSERT_FALSE(refused.ok()) << "a job id a relaunch repeats";
    EXPECT_EQ(refused.status().code(), Code::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find("CKPTIO_JOB_ID"), std::string::npos);
  }

  auto store_mode = NewFileCoordinator(shared, MakeRank(0, "j"), WaitMode::kStore);
  ASSERT_FALSE(store_mode.ok());
  EXPECT_EQ(store_mode.status().code(), Code::kInvalidArgument) << store_mode.status();

  RankInfo bad = MakeRank(0, "j");
  bad.rank = 4;
  EXPECT_EQ(NewFileCoordinator(shared, bad, WaitMode::kManifest).status().code(),
            Code::kInvalidArgument);

  // A single process needs no job id.
  RankInfo single;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto one, NewFileCoordinator(shared, single, WaitMode::kFileLock));
  EXPECT_EQ(one->mode(), WaitMode::kFileLock);

  EXPECT_EQ(WaitModeName(WaitMode::kManifest), "manifest");
  EXPECT_EQ(WaitModeName(WaitMode::kFileLock), "file-lock");
  EXPECT_EQ(WaitModeName(WaitMode::kStore), "c10d-store");
  std::printf(
      "coordination: setup: no job id with 4 ranks and kStore refused (INVALID_ARGUMENT)\n");
}

}  // namespace
}  // namespace ckptio::coordination_testing
