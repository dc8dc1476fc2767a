// File coordination in one process: deadlines, rank 0's save lock in the
// file-lock mode (held from its first save, only tested by waiters, taken
// again when lost) and what its records say of a save. See
// coordination_test_util.h.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
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

// ---------------------------------------------------------------- deadlines, the save lock

// A deadline far away ("wait for ever") saturates instead of overflowing
// into the past, which made such waits fail at once.
TEST(DeadlineAfterTest, SaturatesInsteadOfOverflowing) {
  EXPECT_EQ(DeadlineAfter(milliseconds::max()), Clock::time_point::max());
  const auto now = Clock::now();
  EXPECT_GT(DeadlineAfter(std::chrono::hours(24 * 365 * 100)), now);
  const auto soon = DeadlineAfter(milliseconds(500));
  EXPECT_GE(soon, now + milliseconds(500));
  EXPECT_LT(soon, now + milliseconds(5000));
  const auto past = DeadlineAfter(milliseconds(-5));
  EXPECT_LE(past, Clock::now());
}

// Rank 0 takes the save lock, then cannot write its save record: BeginSave
// fails, and the next BeginSave of this process must not wait for the lock
// it holds itself.
TEST(FileCoordinatorTest, ABeginSaveAfterAFailedOneDoesNotWaitForTheSaveLock) {
  TempDir tmp;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(tmp.Sub("store")));
  std::shared_ptr<StorageBackend> shared(std::move(backend));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto coord,
                              NewFileCoordinator(shared, MakeRank(0, "j"), WaitMode::kFileLock));
  // .coord as a file: the record under it cannot be written.
  const std::string in_the_way = tmp.Sub("store") + "/.coord";
  ::mkdir(tmp.Sub("store").c_str(), 0755);
  ASSERT_TRUE(std::ofstream(in_the_way) << "in the way");
  Status failed = coord->BeginSave(1, AttemptOf(1), milliseconds(2000));
  ASSERT_FALSE(failed.ok()) << "the save record was written under a file";
  ASSERT_EQ(::unlink(in_the_way.c_str()), 0);
  const auto t0 = Clock::now();
  CKPTIO_EXPECT_OK(coord->BeginSave(1, AttemptOf(1), milliseconds(2000)));
  EXPECT_LT(Clock::now() - t0, milliseconds(1000)) << "waited for its own save lock";
  CKPTIO_EXPECT_OK(coord->EndSave(1, AttemptOf(1), OkStatus()));
}

// A published record may carry a stripe receipt, as large as a manifest: a
// waiter takes one over 64 KiB; Publish refuses one over the limit, and a
// waiter that finds one fails at once instead of polling to its deadline.
TEST(FileCoordinatorTest, RecordsAsLargeAsAManifestPassAndLargerFailAtOnce) {
  TempDir tmp;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(tmp.Sub("store")));
  std::shared_ptr<StorageBackend> shared(std::move(backend));
  for (WaitMode mode : {WaitMode::kManifest, WaitMode::kFileLock}) {
    SCOPED_TRACE(WaitModeName(mode));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto coord, NewFileCoordinator(shared, MakeRank(1, "j"), mode));
    const std::string big(200 << 10, 'r');
    CKPTIO_ASSERT_OK(coord->Publish("receipt-1", big));
    auto got = coord->WaitFor("receipt-1", milliseconds(500));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, big);

    Status refused = coord->Publish("huge", std::string(kMaxManifestBytes, 'x'));
    EXPECT_EQ(refused.code(), Code::kResourceExhausted) << refused;
    EXPECT_NE(refused.message().find("limit"), std::string::npos) << refused;
  }
  // A record over the limit (written by something else): the waiter fails
  // at once, naming the limit.
  {
    std::ofstream out(tmp.Sub("store") + "/.coord/decision-huge", std::ios::binary);
    out << std::string(kMaxManifestBytes + 1, 'x');
    ASSERT_TRUE(out.good());
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto coord,
                              NewFileCoordinator(shared, MakeRank(1, "j"), WaitMode::kManifest));
  const auto t0 = Clock::now();
  auto huge = coord->WaitFor("huge", milliseconds(10000));
  EXPECT_EQ(huge.status().code(), Code::kResourceExhausted) << huge.status();
  EXPECT_LT(Clock::now() - t0, milliseconds(5000)) << "the waiter polled for an oversized record";
}

// A save of a step below the one LATEST names (after a load fell back past
// a damaged newer step) does not move LATEST, and its manifest shows before
// the commit is final (the folder's fsync can still fail, and rank 0 then
// removes it): a waiter takes it as committed only once rank 0's record
// says so, or rank 0 is past that save.
TEST(FileCoordinatorTest, AStepBelowLatestIsCommittedOnlyOnceRankZeroSaysSo) {
  for (WaitMode mode : {WaitMode::kManifest, WaitMode::kFileLock}) {
    SCOPED_TRACE(WaitModeName(mode));
    TempDir tmp;
    const std::string job = NewJobId();
    RankCtx r0, r1;
    CKPTIO_ASSERT_OK(OpenRank(tmp.Sub("store"), 0, job, mode, &r0));
    CKPTIO_ASSERT_OK(OpenRank(tmp.Sub("store"), 1, job, mode, &r1));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, r0.store->OpenWriter(RankZeroWriterOptions()));
    // As a Checkpointer names its saves: "<scope>.<k>", k counting up.
    auto Attempt = [](int64_t step) { return "j.c1." + std::to_string(step); };
    // Rank 0's save up to the commit; EndSave is the caller's.
    auto commit = [&](int64_t step) -> Status {
      CKPTIO_RETURN_IF_ERROR(r0.coord->BeginSave(step, Attempt(step), milliseconds(2000)));
      CKPTIO_ASSIGN_OR_RETURN(auto pending, writer->Begin(step));
      CKPTIO_RETURN_IF_ERROR(pending->PutObject("data.bin", "x", 1));
      CKPTIO_RETURN_IF_ERROR(pending->SetMetadata(kSaveAttemptKey, Attempt(step)));
      return pending->Commit().status();
    };
    CKPTIO_ASSERT_OK(commit(200));
    CKPTIO_ASSERT_OK(r0.coord->EndSave(200, Attempt(200), OkStatus()));

    CKPTIO_ASSERT_OK(commit(150));
    auto early = r1.coord->PollSaved(150, Attempt(150));
    ASSERT_TRUE(early.ok()) << early.status();
    EXPECT_FALSE(*early) << "a step below LATEST counted before rank 0 said it committed";
    CKPTIO_ASSERT_OK(r0.coord->EndSave(150, Attempt(150), OkStatus()));
    CKPTIO_EXPECT_OK(r1.coord->WaitSaved(150, Attempt(150), milliseconds(2000)));

    // Rank 0's commit failed after the manifest showed (and was undone).
    CKPTIO_ASSERT_OK(commit(160));
    CKPTIO_ASSERT_OK(r0.coord->EndSave(160, Attempt(160),
                                       Status(Code::kDataLoss, "fsync of the step folder failed")));
    Status failed = r1.coord->WaitSaved(160, Attempt(160), milliseconds(2000));
    EXPECT_EQ(failed.code(), Code::kDataLoss) << failed;

    // Two saves behind: rank 0 is past step 150, which stays committed.
    for (int64_t step : {170, 180}) {
      CKPTIO_ASSERT_OK(commit(step));
      CKPTIO_ASSERT_OK(r0.coord->EndSave(step, Attempt(step), OkStatus()));
    }
    CKPTIO_EXPECT_OK(r1.coord->WaitSaved(150, Attempt(150), milliseconds(2000)));

    // The record is another Checkpointer's (a second one on this store, or
    // the next one of the job): it says nothing of this save, and the
    // manifest decides as for any committed step.
    CKPTIO_ASSERT_OK(r0.coord->BeginSave(300, "j.c2.1", milliseconds(2000)));
    CKPTIO_ASSERT_OK(r0.coord->EndSave(300, "j.c2.1", OkStatus()));
    CKPTIO_EXPECT_OK(r1.coord->WaitSaved(170, Attempt(170), milliseconds(2000)));
  }
}

// Counts a waiter's tries and tests of locks.
class CountingLocks : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    ++tries;
    return ForwardingBackend::TryLock(key, mode);
  }
  Result<bool> IsLocked(std::string_view key) override {
    ++tests;
    return ForwardingBackend::IsLocked(key);
  }
  std::atomic<int> tries{0}, tests{0};
};

// File-lock mode: rank 0 holds the save lock from its Checkpointer's first
// save until the Checkpointer goes. A waiter never takes it (POSIX locks
// are not fair: many waiters taking it in turn could keep rank 0 from it);
// it tests it, and only once rank 0's record is of its Checkpointer. Then a
// free lock means rank 0 is gone, whether inside a save or between two; a
// waiter of another Checkpointer learns nothing from it.
TEST(FileCoordinatorTest, RankZeroHoldsTheSaveLockFromItsFirstSaveAndWaitersOnlyTestIt) {
  TempDir tmp;
  const std::string job = NewJobId();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto b0, NewPosixBackend(tmp.Sub("store")));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto b1, NewPosixBackend(tmp.Sub("store")));
  auto counting = std::make_shared<CountingLocks>(std::move(b1));
  CKPTIO_ASSERT_OK_AND_ASSIGN(
      auto rank0, NewFileCoordinator(std::move(b0), MakeRank(0, job), WaitMode::kFileLock));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto rank1,
                              NewFileCoordinator(counting, MakeRank(1, job), WaitMode::kFileLock));
  auto pending = [&](int64_t step, const std::string& attempt) {
    auto polled = rank1->PollSaved(step, attempt);
    ASSERT_TRUE(polled.ok()) << attempt << ": " << polled.status();
    EXPECT_FALSE(*polled) << attempt;
  };
  for (int i = 0; i < 20; ++i) pending(1, AttemptOf(1));
  EXPECT_EQ(counting->tests.load(), 0) << "tested the lock before rank 0's first record";

  CKPTIO_ASSERT_OK(rank0->BeginSave(1, AttemptOf(1), milliseconds(2000)));
  pending(1, AttemptOf(1));
  EXPECT_GT(counting->tests.load(), 0) << "the waiter does not check on rank 0 inside a save";
  CKPTIO_ASSERT_OK(rank0->EndSave(1, AttemptOf(1), Status(Code::kInternal, "disk full")));
  EXPECT_EQ(rank1->PollSaved(1, AttemptOf(1)).status().code(), Code::kInternal);
  const int tests = counting->tests.load();
  pending(2, AttemptOf(2));  // between saves: rank 0 still holds the lock
  EXPECT_GT(counting->tests.load(), tests) << "the waiter does not check on rank 0 between saves";
  pending(2, "other.s2");  // another Checkpointer's waiter

  rank0.reset();  // gone between saves: the lock goes with it
  auto gone = rank1->PollSaved(2, AttemptOf(2));
  EXPECT_EQ(gone.status().code(), Code::kAborted) << gone.status();
  EXPECT_EQ(gone.status().cause(), Cause::kWriterDied) << gone.status();
  EXPECT_NE(gone.status().message().find("writer died before committing step 2"), std::string::npos)
      << gone.status();
  EXPECT_NE(gone.status().message().find("before it began this save"), std::string::npos)
      << gone.status();
  pending(2, "other.s2");  // rank 0 of that Checkpointer has not saved yet
  EXPECT_EQ(counting->tries.load(), 0) << "a waiter took a lock";
}

// A save rank 0 abandons before it began (a SaveAsync whose staging
// failed, a first BeginSave that could not take the lock) still records
// its failure, without the save lock. That record says nothing of rank
// 0's life: the next save's waiter waits, and does not call rank 0 dead.
TEST(FileCoordinatorTest, ARecordWrittenWithoutTheSaveLockSaysNothingOfRankZerosLife) {
  TempDir tmp;
  const std::string job = NewJobId();
  CKPTIO_ASSERT_OK_AND_ASSIGN(
      auto rank0, NewFileCoordinator(NewPosixBackend(tmp.Sub("store")).value(), MakeRank(0, job),
                                     WaitMode::kFileLock));
  CKPTIO_ASSERT_OK_AND_ASSIGN(
      auto rank1, NewFileCoordinator(NewPosixBackend(tmp.Sub("store")).value(), MakeRank(1, job),
                                     WaitMode::kFileLock));
  CKPTIO_ASSERT_OK(
      rank0->EndSave(1, AttemptOf(1), Status(Code::kResourceExhausted, "no staging memory")));
  EXPECT_EQ(rank1->PollSaved(1, AttemptOf(1)).status().code(), Code::kResourceExhausted);
  for (int i = 0; i < 3; ++i) {
    auto polled = rank1->PollSaved(2, AttemptOf(2));
    ASSERT_TRUE(polled.ok()) << "rank 0 is alive: " << polled.status();
    EXPECT_FALSE(*polled);
  }
  CKPTIO_ASSERT_OK(rank0->BeginSave(2, AttemptOf(2), milliseconds(2000)));
  auto polled = rank1->PollSaved(2, AttemptOf(2));
  ASSERT_TRUE(polled.ok()) << polled.status();
  EXPECT_FALSE(*polled);
}

// Rank 0's save lock, as an NFS server forgets it (rank 0 cut off for
// longer than its lease): Lose() lets the real lock go while rank 0 still
// holds its handle.
class LosableLocks : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    auto lock = ForwardingBackend::TryLock(key, mode);
    if (!lock.ok()) return lock;
    ++taken;
    real_ = std::move(*lock);
    return std::unique_ptr<BackendLock>(std::make_unique<Handle>(this));
  }
  void Lose() { real_.reset(); }
  int taken = 0;

 private:
  struct Handle : BackendLock {
    LosableLocks* owner;
    explicit Handle(LosableLocks* o) : owner(o) {}
    ~Handle() override { owner->Lose(); }
  };
  std::unique_ptr<BackendLock> real_;
};

// A save lock rank 0 lost between saves is taken again at its next save:
// until then rank 0 looks dead (it could not reach the storage for a
// lease), from then on alive again.
TEST(FileCoordinatorTest, ALostSaveLockIsTakenAgainAtTheNextSave) {
  TempDir tmp;
  const std::string job = NewJobId();
  auto losable = std::make_shared<LosableLocks>(NewPosixBackend(tmp.Sub("store")).value());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto rank0,
                              NewFileCoordinator(losable, MakeRank(0, job), WaitMode::kFileLock));
  CKPTIO_ASSERT_OK_AND_ASSIGN(
      auto rank1, NewFileCoordinator(NewPosixBackend(tmp.Sub("store")).value(), MakeRank(1, job),
                                     WaitMode::kFileLock));
  CKPTIO_ASSERT_OK(rank0->BeginSave(1, AttemptOf(1), milliseconds(2000)));
  CKPTIO_ASSERT_OK(rank0->EndSave(1, AttemptOf(1), Status(Code::kInternal, "disk full")));
  CKPTIO_ASSERT_OK(rank0->BeginSave(2, AttemptOf(2), milliseconds(2000)));
  EXPECT_EQ(losable->taken, 1) << "a lock still held was taken again";
  CKPTIO_ASSERT_OK(rank0->EndSave(2, AttemptOf(2), Status(Code::kInternal, "disk full")));
  losable->Lose();
  EXPECT_EQ(rank1->PollSaved(3, AttemptOf(3)).status().code(), Code::kAborted);
  CKPTIO_ASSERT_OK(rank0->BeginSave(3, AttemptOf(3), milliseconds(2000)));
  EXPECT_EQ(losable->taken, 2) << "the lost lock was not taken again";
  auto polled = rank1->PollSaved(3, AttemptOf(3));
  ASSERT_TRUE(polled.ok()) << "rank 0 has its lock again: " << polled.status();
  EXPECT_FALSE(*polled);
}

// Runs `then` once, right after the first IsLocked that finds a lock free.
class OnFirstFreeLock : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<bool> IsLocked(std::string_view key) override {
    auto r = ForwardingBackend::IsLocked(key);
    if (r.ok() && !*r && then) std::exchange(then, nullptr)();
    return r;
  }
  std::function<void()> then;
};

// Rank 0 takes its lost save lock again and begins a save just after a
// waiter found the lock free: the record the waiter reads next is of a
// live rank 0, and it must not be taken for rank 0's last word.
TEST(FileCoordinatorTest, ASaveLockTakenAgainWhileAWaiterLooksIsNoDeath) {
  TempDir tmp;
  const std::string job = NewJobId();
  auto losable = std::make_shared<LosableLocks>(NewPosixBackend(tmp.Sub("store")).value());
  auto looking = std::make_shared<OnFirstFreeLock>(NewPosixBackend(tmp.Sub("store")).value());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto rank0,
                              NewFileCoordinator(losable, MakeRank(0, job), WaitMode::kFileLock));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto rank1,
                              NewFileCoordinator(looking, MakeRank(1, job), WaitMode::kFileLock));
  CKPTIO_ASSERT_OK(rank0->BeginSave(1, AttemptOf(1), milliseconds(2000)));
  CKPTIO_ASSERT_OK(rank0->EndSave(1, AttemptOf(1), Status(Code::kInternal, "disk full")));
  losable->Lose();
  looking->then = [&] { CKPTIO_EXPECT_OK(rank0->BeginSave(2, AttemptOf(2), milliseconds(2000))); };
  auto polled = rank1->PollSaved(2, AttemptOf(2));
  EXPECT_EQ(losable->taken, 2) << "rank 0 did not take its lock again while the waiter looked";
  ASSERT_TRUE(polled.ok()) << "rank 0 is alive and saving: " << polled.status();
  EXPECT_FALSE(*polled);
}

// A file coordinator of `job` on `backend`, told its Checkpointer's scope

}  // namespace
}  // namespace ckptio::coordination_testing
