// What the files of coordination_test share. File-based coordination across
// real processes (invariants 5 and 6): W=4 ranks, each a forked process
// (tests/lib/ranks.h) with its own backend, Store and Coordinator. Rank 0
// saves; ranks 1..3 wait. No waiter may see a step before it is committed;
// every wait ends (rank 0's failure, its death, or the deadline).
//
// Children are forked while this test binary runs no other thread, talk to
// the parent through pipes, one line per message, and always leave with
// _exit(). Child exit codes are listed below and in ranks.h (kExit*); each
// failing child prints its reason to stderr.
//
// The files: coordination_rounds_test.cc (commits and failures reach every
// waiter), coordination_death_test.cc (rank 0 SIGKILLed, then a relaunch),
// coordination_attempts_test.cc (stale records, other jobs, earlier
// attempts), coordination_save_lock_test.cc (file-lock mode's save lock and
// records), coordination_decisions_test.cc (published decisions, job ids),
// coordination_storage_test.cc (a storage that does not answer, limits,
// setup errors).
#ifndef CKPTIO_TESTS_COORDINATION_TEST_UTIL_H_
#define CKPTIO_TESTS_COORDINATION_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "ckptio/ckptio.h"
#include "ckptio/coordination.h"
#include "ckptio/rank.h"
#include "ranks.h"
#include "test_util.h"

namespace ckptio::coordination_testing {

using ::ckptio::testing::Child;
using ::ckptio::testing::Fail;
using ::ckptio::testing::FormatReport;
using ::ckptio::testing::NewJobId;
using ::ckptio::testing::NowNs;
using ::ckptio::testing::ParseReport;
using ::ckptio::testing::RankGroup;
using ::ckptio::testing::RankLink;
using ::ckptio::testing::SleepUntilKilled;
using ::ckptio::testing::Split;
using ::ckptio::testing::TempDir;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kWorld = 4;

// Child exit codes (and kExitOk, kExitSetup, kExitPipe, kExitException,
// kExitNotKilled of ranks.h).
using ::ckptio::testing::kExitException;
using ::ckptio::testing::kExitNotKilled;
using ::ckptio::testing::kExitOk;
using ::ckptio::testing::kExitPipe;
using ::ckptio::testing::kExitSetup;
constexpr int kExitWaitError = 12;     // WaitSaved/PollSaved returned an unexpected error
constexpr int kExitEarlyRead = 13;     // OpenStep failed right after the wait said committed
constexpr int kExitBadData = 14;       // the step's bytes did not verify or match the step
constexpr int kExitLatestBehind = 15;  // LATEST below the step just waited for
constexpr int kExitPollEarly = 16;     // PollSaved said true before rank 0 was told to save
constexpr int kExitPollNeverFalse = 17;
constexpr int kExitWrongOutcome = 18;  // a wait succeeded where it had to fail, or vice versa
constexpr int kExitSaveFailed = 20;    // rank 0's save failed
constexpr int kExitPrevStepBad = 21;   // the previous committed step is not intact
constexpr int kExitStepVisible = 22;   // an uncommitted step is visible

// Rank `rank` of kWorld ranks in job `job`.
RankInfo MakeRank(int rank, const std::string& job);

// The bytes of object data.bin of `step`: they name the step.
std::string StepData(int64_t step);

// What one rank process holds: its own backend, Store and Coordinator.
struct RankCtx {
  std::shared_ptr<StorageBackend> backend;
  std::unique_ptr<Store> store;
  std::unique_ptr<Coordinator> coord;
};
Status OpenRank(const std::string& path, int rank, const std::string& job, WaitMode mode,
                RankCtx* ctx);

// Opens `step`, checks every byte against the manifest and that data.bin
// names the step. NotFound and other open errors come back as they are;
// DataLoss for content that is not the step's.
Status VerifyStep(Store& store, int64_t step);

// The attempt each test save is known by (the Checkpointer counts its saves).
std::string AttemptOf(int64_t step);

// Rank 0's part of one save: BeginSave, stream data.bin in pieces, a small
// second object, Commit, EndSave. *commit_start_ns is set just before
// Commit() is called: no waiter may return before it.
Status SaveStep(StoreWriter& writer, Coordinator& coord, int64_t step, int64_t* commit_start_ns);

WriterOptions RankZeroWriterOptions(milliseconds lock_wait = milliseconds(0));

// Leaves a .coord/save record naming `step` as "saving", written by rank 0
// of another launch (job id "old-job") that never ended its save. In lock
// mode its save lock is released when the coordinator is destroyed.
void LeaveStaleSaveRecord(const std::string& path, WaitMode mode, int64_t step);

// The multi-process scenarios, once per file wait mode (instantiated in
// coordination_rounds_test.cc for the TEST_Ps of every file).
class CoordinationTest : public ::testing::TestWithParam<WaitMode> {
 protected:
  void SetUp() override {
    path_ = tmp_.Sub("store");
    job_ = NewJobId();
  }
  WaitMode mode() const { return GetParam(); }
  std::string mode_name() const { return std::string(WaitModeName(GetParam())); }
  // Rank 0 commits a step, then is SIGKILLed while the other ranks wait for
  // the next, `mid_save` or before beginning it; a relaunch then saves it.
  void KillRankZeroThenRestart(bool mid_save);

  TempDir tmp_;
  std::string path_;
  std::string job_;
};

}  // namespace ckptio::coordination_testing

#endif  // CKPTIO_TESTS_COORDINATION_TEST_UTIL_H_
