// File coordination in one process: decisions rank 0 publishes as its
// Checkpointer opens and loads, what a waiter learns when rank 0 goes
// without publishing, the records of earlier jobs and job ids used again.
// See coordination_test_util.h.
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

// as Checkpointer::Open does; null (and a test failure) if it failed.
std::unique_ptr<Coordinator> OpenedCoordinator(std::shared_ptr<StorageBackend> backend, int rank,
                                               const std::string& job, const std::string& scope,
                                               WaitMode mode = WaitMode::kFileLock) {
  auto c = NewFileCoordinator(std::move(backend), MakeRank(rank, job), mode);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  Status opened = (*c)->Opened(scope, milliseconds(2000));
  EXPECT_TRUE(opened.ok()) << opened;
  return opened.ok() ? std::move(*c) : nullptr;
}

// File lock: rank 0 takes the save lock and says so as its Checkpointer
// opens (Opened), so a rank waiting for its first decision (which step to
// load) learns at once that rank 0 went without publishing it (died, or
// closed the Checkpointer), and a waiting save that it never began. A
// decision published before it went is still read. A waiter of another
// Checkpointer (scope), or in the manifest mode, learns nothing from the
// lock and waits to its deadline.
TEST(FileCoordinatorTest, RankZeroGoneBeforeItsFirstDecisionEndsTheWaitAtOnce) {
  TempDir tmp;
  const std::string job = NewJobId();
  auto open = [&](int rank, const std::string& scope, WaitMode mode) {
    return OpenedCoordinator(NewPosixBackend(tmp.Sub("store")).value(), rank, job, scope, mode);
  };
  auto rank0 = open(0, "test", WaitMode::kFileLock);
  auto rank1 = open(1, "test", WaitMode::kFileLock);
  auto other = open(1, "other", WaitMode::kFileLock);  // another Checkpointer of the job
  auto manifest = open(1, "test", WaitMode::kManifest);
  ASSERT_TRUE(rank0 && rank1 && other && manifest);
  auto waited = [](Coordinator& c, const std::string& name) {
    return c.WaitFor(name, milliseconds(150)).status().code();
  };
  EXPECT_EQ(waited(*rank1, "test-load-1"), Code::kDeadlineExceeded) << "rank 0 is alive";
  CKPTIO_ASSERT_OK(rank0->Publish("test-load-1", "step 7"));
  rank0.reset();  // gone: the lock goes with it
  auto published = rank1->WaitFor("test-load-1", milliseconds(5000));
  ASSERT_TRUE(published.ok()) << "published before rank 0 went: " << published.status();
  EXPECT_EQ(*published, "step 7");

  const auto t0 = Clock::now();
  auto gone = rank1->WaitFor("test-load-2", milliseconds(5000));
  EXPECT_LT(Clock::now() - t0, milliseconds(1000)) << "waited for the deadline";
  EXPECT_EQ(gone.status().code(), Code::kAborted) << gone.status();
  EXPECT_EQ(gone.status().cause(), Cause::kWriterDied) << gone.status();
  EXPECT_NE(gone.status().message().find("writer died before publishing its decision "
                                         "\"test-load-2\""),
            std::string::npos)
      << gone.status();
  auto save = rank1->PollSaved(1, "test.1");
  EXPECT_EQ(save.status().code(), Code::kAborted) << save.status();
  EXPECT_NE(save.status().message().find("before its first save"), std::string::npos)
      << save.status();
  EXPECT_EQ(waited(*other, "other-load-1"), Code::kDeadlineExceeded);
  EXPECT_EQ(waited(*manifest, "test-load-2"), Code::kDeadlineExceeded);
}

// Runs `first` once, just before the first IsLocked; fails every IsLocked
// with `failure` while it is set.
class LockTests : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<bool> IsLocked(std::string_view key) override {
    if (first) std::exchange(first, nullptr)();
    if (!failure.ok()) return failure;
    return ForwardingBackend::IsLocked(key);
  }
  std::function<void()> first;
  Status failure;
};

// Rank 0 publishes its decision and goes between a waiter's read of the
// decision (absent) and its test of the lock (free): the waiter reads the
// decision again before calling rank 0 dead, and gets it.
TEST(FileCoordinatorTest, ADecisionPublishedJustBeforeRankZeroWentIsStillRead) {
  TempDir tmp;
  const std::string job = NewJobId();
  auto locks = std::make_shared<LockTests>(NewPosixBackend(tmp.Sub("store")).value());
  auto rank0 = OpenedCoordinator(NewPosixBackend(tmp.Sub("store")).value(), 0, job, "test");
  auto rank1 = OpenedCoordinator(locks, 1, job, "test");
  ASSERT_TRUE(rank0 && rank1);
  locks->first = [&] {
    CKPTIO_EXPECT_OK(rank0->Publish("test-load-1", "step 3"));
    rank0.reset();
  };
  auto got = rank1->WaitFor("test-load-1", milliseconds(5000));
  EXPECT_FALSE(rank0) << "the waiter never tested the lock";
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "step 3");
}

// The waiter's check on rank 0 only ever shortens a wait: a test of the
// lock that fails (an NFS server that refuses LOCKT for a while) is no
// answer, and the wait goes on until rank 0 publishes.
TEST(FileCoordinatorTest, AFailingCheckOnRankZeroNeverFailsTheWaitForADecision) {
  TempDir tmp;
  const std::string job = NewJobId();
  auto locks = std::make_shared<LockTests>(NewPosixBackend(tmp.Sub("store")).value());
  locks->failure = Status(Code::kPermissionDenied, "injected: LOCKT refused");
  auto rank0 = OpenedCoordinator(NewPosixBackend(tmp.Sub("store")).value(), 0, job, "test");
  auto rank1 = OpenedCoordinator(locks, 1, job, "test");
  ASSERT_TRUE(rank0 && rank1);
  std::thread publisher([&] {
    std::this_thread::sleep_for(milliseconds(400));
    CKPTIO_EXPECT_OK(rank0->Publish("test-load-1", "step 4"));
  });
  auto got = rank1->WaitFor("test-load-1", milliseconds(5000));
  publisher.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "step 4");
}

// Rank 0 closes a Checkpointer whose last save failed and opens the next on
// the same store: the new Checkpointer's first record (its "open" record
// with the file lock, its first save's in manifest mode) replaces the old
// one's outcome, and carries it on, so a rank of the old Checkpointer that
// reads only now still gets rank 0's error (not its own deadline).
TEST(FileCoordinatorTest, TheNextCheckpointersFirstRecordCarriesTheLastOutcome) {
  for (WaitMode mode : {WaitMode::kFileLock, WaitMode::kManifest}) {
    SCOPED_TRACE(WaitModeName(mode));
    TempDir tmp;
    const std::string job = NewJobId();
    auto open = [&](int rank, const std::string& scope) {
      return OpenedCoordinator(NewPosixBackend(tmp.Sub("store")).value(), rank, job, scope, mode);
    };
    auto first0 = open(0, "one"), first1 = open(1, "one");
    ASSERT_TRUE(first0 && first1);
    CKPTIO_ASSERT_OK(first0->BeginSave(1, "one.1", milliseconds(2000)));
    CKPTIO_ASSERT_OK(first0->EndSave(1, "one.1", Status(Code::kResourceExhausted, "disk full")));
    first0.reset();
    auto second0 = open(0, "two");
    ASSERT_TRUE(second0);
    CKPTIO_ASSERT_OK(second0->BeginSave(2, "two.1", milliseconds(2000)));
    auto polled = first1->PollSaved(1, "one.1");
    EXPECT_EQ(polled.status().code(), Code::kResourceExhausted) << polled.status();
    EXPECT_NE(polled.status().message().find("disk full"), std::string::npos) << polled.status();
  }
}

// Rank 0's Opened (with the store's writer lock held) deletes the decision
// records of earlier jobs, which relaunches would otherwise pile up, and
// keeps its own job's; no other rank deletes anything.
TEST(FileCoordinatorTest, RankZerosOpenedSweepsEarlierJobsDecisions) {
  TempDir tmp;
  auto backend = [&]() -> std::shared_ptr<StorageBackend> {
    return NewPosixBackend(tmp.Sub("store")).value();
  };
  const std::string old_job = NewJobId(), job = NewJobId();
  auto earlier = OpenedCoordinator(backend(), 0, job, "first");  // this job's first Checkpointer
  ASSERT_TRUE(earlier);
  CKPTIO_ASSERT_OK(earlier->Publish("first-load-1", "kept"));
  earlier.reset();
  for (int rank : {0, 1}) {  // another job's, never Opened
    CKPTIO_ASSERT_OK_AND_ASSIGN(
        auto old, NewFileCoordinator(backend(), MakeRank(rank, old_job), WaitMode::kFileLock));
    CKPTIO_ASSERT_OK(old->Publish(rank == 0 ? "old-load-1" : "stripe-old.1-1", "left behind"));
  }
  auto list = [&] {
    auto keys = backend()->List(".coord/");
    EXPECT_TRUE(keys.ok()) << keys.status();
    return keys.ok() ? *keys : std::vector<std::string>();
  };
  auto rank1 = OpenedCoordinator(backend(), 1, job, "second");
  ASSERT_TRUE(rank1);
  EXPECT_EQ(list().size(), 4u) << "a rank other than 0 deleted records";
  auto rank0 = OpenedCoordinator(backend(), 0, job, "second");
  ASSERT_TRUE(rank0);
  EXPECT_EQ(list(), (std::vector<std::string>{".coord/decision-first-load-1", ".coord/save"}));
}

// A job id used again by hand (CKPTIO_JOB_ID, ckptio-launch --job-id): the
// ranks of the new launch would take the earlier launch's records for their
// own (its load decision, its commits). Rank 0 refuses it as its
// Checkpointer opens, whether the earlier launch's rank 0 left its save
// record (another process's) or a load decision of the Checkpointer now
// opening; other ranks, other jobs and this process's own next
// Checkpointer are let through.
TEST(FileCoordinatorTest, RankZeroRefusesAJobIdThatAnEarlierLaunchUsed) {
  TempDir tmp;
  auto backend = [&]() -> std::shared_ptr<StorageBackend> {
    return NewPosixBackend(tmp.Sub("store")).value();
  };
  auto opened = [&](int rank, const std::string& job, const std::string& scope, WaitMode mode) {
    auto c = NewFileCoordinator(backend(), MakeRank(rank, job), mode);
    return c.ok() ? (*c)->Opened(scope, milliseconds(2000)) : c.status();
  };
  auto expect_refused = [](const Status& s, const std::string& evidence) {
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s;
    for (const std::string& part :
         {std::string("was used before"), evidence, std::string("export CKPTIO_JOB_ID=")})
      EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in: " << s;
  };
  // The earlier launch: its rank 0, another process (forked after this one
  // wrote a record: it must not pass for this process), opens and saves.
  CKPTIO_ASSERT_OK(opened(0, NewJobId(), "zero", WaitMode::kFileLock));
  const std::string job = NewJobId();
  Child earlier = Child::Start([&] {
    auto c = NewFileCoordinator(backend(), MakeRank(0, job), WaitMode::kFileLock);
    if (!c.ok() || !(*c)->Opened("one", milliseconds(2000)).ok()) return kExitSetup;
    if (!(*c)->BeginSave(1, "one.1", milliseconds(2000)).ok()) return kExitSetup;
    return (*c)->EndSave(1, "one.1", OkStatus()).ok() ? kExitOk : kExitSetup;
  });
  ASSERT_EQ(earlier.ExitCode(milliseconds(10000)), kExitOk);
  for (WaitMode mode : {WaitMode::kFileLock, WaitMode::kManifest})
    expect_refused(opened(0, job, "one", mode), "from another process");
  CKPTIO_EXPECT_OK(opened(1, job, "one", WaitMode::kFileLock));
  CKPTIO_EXPECT_OK(opened(0, NewJobId(), "one", WaitMode::kFileLock));  // replaces the record

  // Its save record is gone; a load decision of the Checkpointer now
  // opening still gives the job id away. This process's next Checkpointer
  // of the same job passes.
  const std::string again = NewJobId();
  CKPTIO_ASSERT_OK_AND_ASSIGN(
      auto first, NewFileCoordinator(backend(), MakeRank(0, again), WaitMode::kManifest));
  CKPTIO_ASSERT_OK(first->Opened("one", milliseconds(2000)));
  CKPTIO_ASSERT_OK(first->Publish("one-load-1", "step 1"));
  for (WaitMode mode : {WaitMode::kFileLock, WaitMode::kManifest})
    CKPTIO_EXPECT_OK(opened(0, again, "two", mode));
  for (WaitMode mode : {WaitMode::kFileLock, WaitMode::kManifest})
    expect_refused(opened(0, again, "one", mode), ".coord/decision-one-load-1 is a load decision");
  std::printf(
      "coordination: a job id used before on the store refused by rank 0 as it opens "
      "(FAILED_PRECONDITION), in both file modes, from the earlier launch's save record "
      "(another process's) or a load decision of the Checkpointer opening\n");
}

// Fails reads of LATEST and of published records with UNAVAILABLE (as an
// NFS backend does for timeout_ms after a call got no answer) while
// `failures` lasts; -1: for ever.

// A WaitInterrupt (the Python package's Ctrl-C) ends every wait of its
// thread at its first failure, with that status, long before the deadline:
// a rank waiting for a decision or a commit, and a second writer waiting
// for the store's writer lock. It is asked between polls, is not asked
// again once it failed, and nests: the outer one is back when the inner
// goes.
TEST(FileCoordinatorTest, AWaitInterruptEndsEveryWaitWithItsStatus) {
  TempDir tmp;
  const std::string job = NewJobId();
  auto store = [&] { return NewPosixBackend(tmp.Sub("store")).value(); };
  auto rank0 = OpenedCoordinator(store(), 0, job, "test");  // alive, never publishes
  ASSERT_TRUE(rank0);
  EXPECT_TRUE(WaitInterrupt::Check().ok()) << "no interrupt on this thread";

  int calls = 0;
  auto stop_at_fifth = [&] {
    return ++calls < 5 ? OkStatus() : Status(Code::kAborted, "interrupted by the test");
  };
  auto ended = [&](const char* what, const std::function<Status()>& wait) {
    calls = 0;
    WaitInterrupt interrupt(stop_at_fifth);
    const auto t0 = Clock::now();
    Status s = wait();
    EXPECT_LT(Clock::now() - t0, milliseconds(2000)) << what << ": waited on";
    EXPECT_EQ(s.code(), Code::kAborted) << what << ": " << s;
    EXPECT_EQ(s.message(), "interrupted by the test") << what;
    EXPECT_EQ(calls, 5) << what << ": asked after it failed, or not between polls";
    EXPECT_EQ(WaitInterrupt::Check().message(), "interrupted by the test") << "sticky";
    EXPECT_EQ(calls, 5);
  };
  for (WaitMode mode : {WaitMode::kFileLock, WaitMode::kManifest}) {
    SCOPED_TRACE(std::string(WaitModeName(mode)));
    auto rank1 = OpenedCoordinator(store(), 1, job, "test", mode);
    ASSERT_TRUE(rank1);
    ended("a decision",
          [&] { return rank1->WaitFor("test-load-1", milliseconds(30000)).status(); });
    ended("a commit", [&] { return rank1->WaitSaved(3, "test.3", milliseconds(30000)); });
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, Store(store()).OpenWriter(WriterOptions{}));
  WriterOptions patient;
  patient.lock_wait = milliseconds(30000);
  ended("the writer lock", [&] { return Store(store()).OpenWriter(patient).status(); });

  WaitInterrupt outer([] { return Status(Code::kAborted, "outer"); });
  {
    WaitInterrupt inner([] { return OkStatus(); });
    EXPECT_TRUE(WaitInterrupt::Check().ok()) << "the innermost is asked";
  }
  EXPECT_EQ(WaitInterrupt::Check().message(), "outer");
}

}  // namespace
}  // namespace ckptio::coordination_testing
