// File-based coordination across real processes (invariants 5 and 6): W=4
// ranks, each a forked process with its own backend, Store and Coordinator.
// Rank 0 saves; ranks 1..3 wait. No waiter may see a step before it is
// committed; every wait ends (rank 0's failure, its death, or the deadline).
//
// Children are made with fork() (this test binary starts no threads before
// forking), talk to the parent through pipes, one line per message, and
// always leave with _exit(). Timestamps are CLOCK_MONOTONIC nanoseconds,
// which every process on the machine shares. Child exit codes are listed
// below (kExit*); each failing child prints its reason to stderr.
#include "ckptio/coordination.h"

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ckptio/ckptio.h"
#include "ckptio/posix_backend.h"
#include "ckptio/rank.h"
#include "process.h"
#include "test_util.h"

namespace ckptio {
namespace {

using ::ckptio::testing::Child;
using ::ckptio::testing::NowNs;
using ::ckptio::testing::Pipe;
using ::ckptio::testing::RandomBytes;
using ::ckptio::testing::ReadLine;
using ::ckptio::testing::TempDir;
using ::ckptio::testing::WriteLine;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kWorld = 4;

// Child exit codes.
constexpr int kExitOk = 0;
constexpr int kExitSetup = 10;         // backend, store, writer or coordinator did not open
constexpr int kExitPipe = 11;          // the parent's message did not come or was wrong
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
constexpr int kExitException = ::ckptio::testing::kChildException;
constexpr int kExitNotKilled = 99;  // a child that should have been killed ran out of sleep

// ---------------------------------------------------------------- plumbing

// Words of a line.
std::vector<std::string> Split(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

// "ret <code> <t_ns> <message...>" as waiters report a wait's outcome.
struct WaitReport {
  Code code = Code::kInternal;
  int64_t t_ns = 0;
  std::string message;
};
std::string FormatWait(const Status& s, int64_t t_ns) {
  std::string msg = s.message();
  for (char& c : msg)
    if (c == '\n') c = ' ';
  return "ret " + std::to_string(static_cast<int>(s.code())) + " " + std::to_string(t_ns) + " " +
         msg;
}
std::optional<WaitReport> ParseWait(const std::optional<std::string>& line) {
  if (!line || line->rfind("ret ", 0) != 0) return std::nullopt;
  std::istringstream in(line->substr(4));
  int code = 0;
  WaitReport r;
  if (!(in >> code >> r.t_ns)) return std::nullopt;
  r.code = static_cast<Code>(code);
  std::getline(in, r.message);
  if (!r.message.empty() && r.message.front() == ' ') r.message.erase(0, 1);
  return r;
}

using ::ckptio::testing::NewJobId;

RankInfo MakeRank(int rank, const std::string& job) {
  return ::ckptio::testing::TestRank(rank, kWorld, job);
}

// The bytes of object data.bin of `step`: they name the step.
std::string StepData(int64_t step) {
  return "step=" + std::to_string(step) + ";" +
         RandomBytes(4000 + static_cast<size_t>(step % 7) * 100, static_cast<uint64_t>(step));
}

// What one rank process holds: its own backend, Store and Coordinator.
struct RankCtx {
  std::shared_ptr<StorageBackend> backend;
  std::unique_ptr<Store> store;
  std::unique_ptr<Coordinator> coord;
};

Status OpenRank(const std::string& path, int rank, const std::string& job, WaitMode mode,
                RankCtx* ctx) {
  CKPTIO_ASSIGN_OR_RETURN(auto backend, NewPosixBackend(path));
  ctx->backend = std::shared_ptr<StorageBackend>(std::move(backend));
  ctx->store = std::make_unique<Store>(ctx->backend);
  CKPTIO_ASSIGN_OR_RETURN(ctx->coord, NewFileCoordinator(ctx->backend, MakeRank(rank, job), mode));
  return OkStatus();
}

int Fail(int rank, int code, const std::string& why) {
  std::fprintf(stderr, "[rank %d pid %d] exit %d: %s\n", rank, static_cast<int>(::getpid()), code,
               why.c_str());
  std::fflush(stderr);
  return code;
}

// Opens `step`, checks every byte against the manifest and that data.bin
// names the step. NotFound and other open errors come back as they are;
// DataLoss for content that is not the step's.
Status VerifyStep(Store& store, int64_t step) {
  CKPTIO_ASSIGN_OR_RETURN(auto reader, store.OpenStep(step));
  if (reader->step() != step)
    return Status(Code::kDataLoss, "OpenStep(" + std::to_string(step) + ") gave step " +
                                       std::to_string(reader->step()));
  CKPTIO_RETURN_IF_ERROR(reader->Verify());
  CKPTIO_ASSIGN_OR_RETURN(std::string data, reader->ReadAll("data.bin"));
  if (data != StepData(step))
    return Status(Code::kDataLoss, "data.bin of step " + std::to_string(step) +
                                       " does not hold that step's bytes (starts \"" +
                                       data.substr(0, 16) + "\")");
  return OkStatus();
}

// The attempt each test save is known by (the Checkpointer counts its saves).
std::string AttemptOf(int64_t step) { return "test.s" + std::to_string(step); }

// Rank 0's part of one save: BeginSave, stream data.bin in pieces, a small
// second object, Commit, EndSave. *commit_start_ns is set just before
// Commit() is called: no waiter may return before it.
Status SaveStep(StoreWriter& writer, Coordinator& coord, int64_t step, int64_t* commit_start_ns) {
  CKPTIO_RETURN_IF_ERROR(coord.BeginSave(step, AttemptOf(step), milliseconds(5000)));
  Status outcome = [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(auto pending, writer.Begin(step));
    const std::string data = StepData(step);
    {
      CKPTIO_ASSIGN_OR_RETURN(auto stream, pending->AddObject("data.bin"));
      const size_t piece = data.size() / 4 + 1;
      for (size_t off = 0; off < data.size(); off += piece) {
        CKPTIO_RETURN_IF_ERROR(
            stream->Write(data.data() + off, std::min(piece, data.size() - off)));
        std::this_thread::sleep_for(milliseconds(1));
      }
      CKPTIO_RETURN_IF_ERROR(stream->Close());
    }
    const std::string meta = "step " + std::to_string(step);
    CKPTIO_RETURN_IF_ERROR(pending->PutObject("meta.txt", meta.data(), meta.size()));
    CKPTIO_RETURN_IF_ERROR(pending->SetMetadata(kSaveAttemptKey, AttemptOf(step)));
    if (commit_start_ns) *commit_start_ns = NowNs();
    CKPTIO_ASSIGN_OR_RETURN(auto info, pending->Commit());
    if (info.step != step) return Status(Code::kInternal, "committed the wrong step");
    return OkStatus();
  }();
  Status ended = coord.EndSave(step, AttemptOf(step), outcome);
  return outcome.ok() ? ended : outcome;
}

WriterOptions RankZeroWriterOptions(milliseconds lock_wait = milliseconds(0)) {
  WriterOptions o;
  o.lock_wait = lock_wait;
  o.world_size = kWorld;
  o.saving_rank = 0;
  return o;
}

// Leaves a .coord/save record naming `step` as "saving", written by rank 0
// of another launch (job id "old-job") that never ended its save. In lock
// mode its save lock is released when the coordinator is destroyed.
void LeaveStaleSaveRecord(const std::string& path, WaitMode mode, int64_t step) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(path));
  std::shared_ptr<StorageBackend> shared(std::move(backend));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto coord, NewFileCoordinator(shared, MakeRank(0, "old-job"), mode));
  CKPTIO_ASSERT_OK(coord->BeginSave(step, AttemptOf(step), milliseconds(2000)));
  coord.reset();
  struct stat st;
  ASSERT_EQ(::stat((path + "/.coord/save").c_str(), &st), 0) << "no stale record was written";
}

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

// ---------------------------------------------------------------- a. rounds

// 20 saves; ranks 1 and 2 WaitSaved, rank 3 polls PollSaved. Right after
// each wait returns the step opens and verifies, LATEST is at or past it,
// and the wait did not return before rank 0 began to commit.
TEST_P(CoordinationTest, WaitersNeverSeeAStepBeforeItIsCommitted) {
  constexpr int kRounds = 20;
  constexpr int64_t kFirst = 100;
  constexpr int kPoller = 3;
  Pipe to0;
  std::vector<std::unique_ptr<Pipe>> from(kWorld);
  for (auto& p : from) p = std::make_unique<Pipe>();
  ASSERT_TRUE(to0.ok());
  for (auto& p : from) ASSERT_TRUE(p->ok());

  std::vector<Child> children;
  children.push_back(Child::Start([&] {
    const int out = from[0]->write_fd();
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions());
    if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
    WriteLine(out, "ready");
    for (int i = 0; i < kRounds; ++i) {
      const int64_t step = kFirst + i;
      auto go = ReadLine(to0.read_fd(), milliseconds(10000));
      if (!go || *go != "go " + std::to_string(step))
        return Fail(0, kExitPipe, "expected go " + std::to_string(step));
      int64_t commit_ns = 0;
      s = SaveStep(**writer, *ctx.coord, step, &commit_ns);
      if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
      WriteLine(out, "done " + std::to_string(step) + " " + std::to_string(commit_ns));
    }
    return kExitOk;
  }));
  ASSERT_TRUE(children.back().started());

  for (int rank = 1; rank < kWorld; ++rank) {
    children.push_back(Child::Start([&, rank] {
      const int out = from[rank]->write_fd();
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
          WriteLine(out, "ready " + std::to_string(step));
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
          WriteLine(out, "ready " + std::to_string(step));
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
        WriteLine(out, "ret " + std::to_string(step) + " " + std::to_string(ret_ns) + " " +
                           std::to_string(pending_polls));
      }
      return kExitOk;
    }));
    ASSERT_TRUE(children.back().started());
  }
  to0.CloseRead();
  for (auto& p : from) p->CloseWrite();

  auto ready = ReadLine(from[0]->read_fd(), milliseconds(10000));
  ASSERT_EQ(ready, std::optional<std::string>("ready")) << "rank 0 did not open its writer";
  int early = 0;
  int64_t poller_pending = 0;
  int poller_rounds_with_pending = 0;
  for (int i = 0; i < kRounds; ++i) {
    const int64_t step = kFirst + i;
    SCOPED_TRACE("step " + std::to_string(step));
    for (int rank = 1; rank < kWorld; ++rank) {
      auto line = ReadLine(from[rank]->read_fd(), milliseconds(10000));
      ASSERT_EQ(line, std::optional<std::string>("ready " + std::to_string(step)))
          << "rank " << rank << " (exit " << children[rank].ExitCode(milliseconds(0)) << ")";
    }
    WriteLine(to0.write_fd(), "go " + std::to_string(step));
    auto done = ReadLine(from[0]->read_fd(), milliseconds(10000));
    ASSERT_TRUE(done.has_value()) << "rank 0 did not save (exit "
                                  << children[0].ExitCode(milliseconds(1000)) << ")";
    auto d = Split(*done);
    ASSERT_EQ(d.size(), 3u) << *done;
    ASSERT_EQ(d[1], std::to_string(step)) << *done;
    const int64_t commit_ns = std::stoll(d[2]);
    for (int rank = 1; rank < kWorld; ++rank) {
      auto line = ReadLine(from[rank]->read_fd(), milliseconds(10000));
      ASSERT_TRUE(line.has_value()) << "rank " << rank << " did not return (exit "
                                    << children[rank].ExitCode(milliseconds(1000)) << ")";
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
    EXPECT_EQ(children[rank].ExitCode(milliseconds(10000)), kExitOk) << "rank " << rank;
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
  Pipe to0;
  std::vector<std::unique_ptr<Pipe>> from(kWorld);
  for (auto& p : from) p = std::make_unique<Pipe>();
  ASSERT_TRUE(to0.ok());

  std::vector<Child> children;
  children.push_back(Child::Start([&] {
    const int out = from[0]->write_fd();
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions());
    if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
    s = SaveStep(**writer, *ctx.coord, kGood, nullptr);
    if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
    WriteLine(out, "ready");
    if (ReadLine(to0.read_fd(), milliseconds(10000)) != std::optional<std::string>("go"))
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
    WriteLine(out, "failed " + std::to_string(fail_ns));
    return kExitOk;
  }));
  ASSERT_TRUE(children.back().started());
  to0.CloseRead();
  from[0]->CloseWrite();
  ASSERT_EQ(ReadLine(from[0]->read_fd(), milliseconds(10000)), std::optional<std::string>("ready"))
      << "rank 0 exit " << children[0].ExitCode(milliseconds(1000));

  for (int rank = 1; rank < kWorld; ++rank) {
    children.push_back(Child::Start([&, rank] {
      const int out = from[rank]->write_fd();
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job_, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      WriteLine(out, "waiting");
      s = ctx.coord->WaitSaved(kStep, AttemptOf(kStep), kDeadline);
      const int64_t ret_ns = NowNs();
      WriteLine(out, FormatWait(s, ret_ns));
      if (s.ok()) return Fail(rank, kExitWrongOutcome, "WaitSaved succeeded for a failed save");
      auto visible = ctx.store->OpenStep(kStep);
      if (visible.status().code() != Code::kNotFound)
        return Fail(rank, kExitStepVisible, "failed step: " + visible.status().ToString());
      s = VerifyStep(*ctx.store, kGood);
      if (!s.ok()) return Fail(rank, kExitPrevStepBad, s.ToString());
      return kExitOk;
    }));
    ASSERT_TRUE(children.back().started());
  }
  for (int rank = 1; rank < kWorld; ++rank) from[rank]->CloseWrite();
  for (int rank = 1; rank < kWorld; ++rank)
    ASSERT_EQ(ReadLine(from[rank]->read_fd(), milliseconds(10000)),
              std::optional<std::string>("waiting"))
        << "rank " << rank;
  std::this_thread::sleep_for(milliseconds(50));
  WriteLine(to0.write_fd(), "go");
  auto failed = ReadLine(from[0]->read_fd(), milliseconds(10000));
  ASSERT_TRUE(failed.has_value()) << "rank 0 exit " << children[0].ExitCode(milliseconds(1000));
  auto f = Split(*failed);
  ASSERT_EQ(f.size(), 2u) << *failed;
  const int64_t fail_ns = std::stoll(f[1]);

  int64_t slowest_ms = 0;
  for (int rank = 1; rank < kWorld; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    auto r = ParseWait(ReadLine(from[rank]->read_fd(), milliseconds(12000)));
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
    EXPECT_EQ(children[rank].ExitCode(milliseconds(10000)), kExitOk) << "rank " << rank;
  std::printf(
      "coordination: %s: rank 0 failed step %lld (RESOURCE_EXHAUSTED), %d waiters got it "
      "within %lld ms\n",
      mode_name().c_str(), static_cast<long long>(kStep), kWorld - 1,
      static_cast<long long>(slowest_ms));
}

// ---------------------------------------------------------------- c. death

void CoordinationTest::KillRankZeroThenRestart(bool mid_save) {
  constexpr int64_t kPrev = 10;
  constexpr int64_t kStep = 11;
  constexpr milliseconds kWaitTimeout(4000);
  std::vector<std::unique_ptr<Pipe>> from(kWorld);
  for (auto& p : from) p = std::make_unique<Pipe>();

  // Phase 1: rank 0 commits kPrev, starts kStep (mid_save) and is
  // SIGKILLed mid-object, or before it begins kStep.
  Child rank0 = Child::Start([&] {
    const int out = from[0]->write_fd();
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions());
    if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
    s = SaveStep(**writer, *ctx.coord, kPrev, nullptr);
    if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
    if (!mid_save) {
      WriteLine(out, "saving");
      for (int i = 0; i < 60; ++i) std::this_thread::sleep_for(milliseconds(1000));
      return kExitNotKilled;
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
    WriteLine(out, "saving");
    for (int i = 0; i < 60; ++i) std::this_thread::sleep_for(milliseconds(1000));
    return kExitNotKilled;
  });
  ASSERT_TRUE(rank0.started());
  from[0]->CloseWrite();
  ASSERT_EQ(ReadLine(from[0]->read_fd(), milliseconds(10000)), std::optional<std::string>("saving"))
      << "rank 0 exit " << rank0.ExitCode(milliseconds(1000));

  std::vector<Child> waiters;
  for (int rank = 1; rank < kWorld; ++rank) {
    waiters.push_back(Child::Start([&, rank] {
      const int out = from[rank]->write_fd();
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job_, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      s = VerifyStep(*ctx.store, kPrev);
      if (!s.ok()) return Fail(rank, kExitPrevStepBad, "before the wait: " + s.ToString());
      WriteLine(out, "waiting " + std::to_string(NowNs()));
      s = ctx.coord->WaitSaved(kStep, AttemptOf(kStep), kWaitTimeout);
      const int64_t ret_ns = NowNs();
      WriteLine(out, FormatWait(s, ret_ns));
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
    }));
    ASSERT_TRUE(waiters.back().started());
  }
  for (int rank = 1; rank < kWorld; ++rank) from[rank]->CloseWrite();
  std::vector<int64_t> wait_start(kWorld, 0);
  for (int rank = 1; rank < kWorld; ++rank) {
    auto line = ReadLine(from[rank]->read_fd(), milliseconds(10000));
    ASSERT_TRUE(line.has_value()) << "rank " << rank << " exit "
                                  << waiters[rank - 1].ExitCode(milliseconds(1000));
    auto w = Split(*line);
    ASSERT_EQ(w.size(), 2u) << *line;
    wait_start[rank] = std::stoll(w[1]);
  }
  std::this_thread::sleep_for(milliseconds(200));  // all are inside WaitSaved now
  const int64_t kill_ns = NowNs();
  ASSERT_EQ(::kill(rank0.pid(), SIGKILL), 0);
  EXPECT_EQ(rank0.ExitCode(milliseconds(5000)), 128 + SIGKILL);

  int64_t slowest_ms = 0;
  for (int rank = 1; rank < kWorld; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    auto r = ParseWait(ReadLine(from[rank]->read_fd(), milliseconds(8000)));
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
    EXPECT_EQ(waiters[rank - 1].ExitCode(milliseconds(10000)), kExitOk) << "rank " << rank;

  {  // The previous checkpoint is intact; the killed one is not visible.
    Store store(std::shared_ptr<StorageBackend>(NewPosixBackend(path_).value()));
    CKPTIO_EXPECT_OK(VerifyStep(store, kPrev));
    EXPECT_EQ(store.OpenStep(kStep).status().code(), Code::kNotFound);
  }

  // Phase 2: the relaunch (a new job id). New waiters first, then a new
  // rank 0 that takes the writer lock the kernel released and saves kStep.
  const std::string job2 = NewJobId();
  std::vector<std::unique_ptr<Pipe>> from2(kWorld);
  for (auto& p : from2) p = std::make_unique<Pipe>();
  std::vector<Child> relaunch;
  for (int rank = 1; rank < kWorld; ++rank) {
    relaunch.push_back(Child::Start([&, rank] {
      const int out = from2[rank]->write_fd();
      RankCtx ctx;
      Status s = OpenRank(path_, rank, job2, mode(), &ctx);
      if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
      WriteLine(out, "waiting");
      s = ctx.coord->WaitSaved(kStep, AttemptOf(kStep), milliseconds(10000));
      WriteLine(out, FormatWait(s, NowNs()));
      if (!s.ok()) return Fail(rank, kExitWaitError, "after the relaunch: " + s.ToString());
      s = VerifyStep(*ctx.store, kStep);
      if (!s.ok())
        return Fail(rank, s.code() == Code::kDataLoss ? kExitBadData : kExitEarlyRead,
                    s.ToString());
      s = VerifyStep(*ctx.store, kPrev);
      if (!s.ok()) return Fail(rank, kExitPrevStepBad, s.ToString());
      return kExitOk;
    }));
    ASSERT_TRUE(relaunch.back().started());
  }
  for (int rank = 1; rank < kWorld; ++rank) {
    from2[rank]->CloseWrite();
    ASSERT_EQ(ReadLine(from2[rank]->read_fd(), milliseconds(10000)),
              std::optional<std::string>("waiting"))
        << "relaunched rank " << rank;
  }
  std::this_thread::sleep_for(milliseconds(100));
  Child rank0b = Child::Start([&] {
    const int out = from2[0]->write_fd();
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job2, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    auto writer = ctx.store->OpenWriter(RankZeroWriterOptions(milliseconds(2000)));
    if (!writer.ok()) return Fail(0, kExitSetup, "relaunch: " + writer.status().ToString());
    s = SaveStep(**writer, *ctx.coord, kStep, nullptr);
    if (!s.ok()) return Fail(0, kExitSaveFailed, "relaunch: " + s.ToString());
    WriteLine(out, "done");
    return kExitOk;
  });
  ASSERT_TRUE(rank0b.started());
  from2[0]->CloseWrite();
  EXPECT_EQ(ReadLine(from2[0]->read_fd(), milliseconds(10000)), std::optional<std::string>("done"));
  EXPECT_EQ(rank0b.ExitCode(milliseconds(10000)), kExitOk);
  for (int rank = 1; rank < kWorld; ++rank) {
    auto r = ParseWait(ReadLine(from2[rank]->read_fd(), milliseconds(10000)));
    ASSERT_TRUE(r.has_value()) << "relaunched rank " << rank << " did not report";
    EXPECT_EQ(r->code, Code::kOk) << "relaunched rank " << rank << ": " << r->message;
    EXPECT_EQ(relaunch[rank - 1].ExitCode(milliseconds(10000)), kExitOk) << "rank " << rank;
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

TEST_P(CoordinationTest, RankZeroKilledMidSaveThenRestart) { KillRankZeroThenRestart(true); }

// File lock: rank 0 holds the save lock between saves too, so its death
// there is noticed as fast (manifest: the deadline, as mid-save).
TEST_P(CoordinationTest, RankZeroKilledBetweenSavesThenRestart) { KillRankZeroThenRestart(false); }

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

    Pipe to0;
    std::vector<std::unique_ptr<Pipe>> from(kWorld);
    for (auto& p : from) p = std::make_unique<Pipe>();
    std::vector<Child> children;
    children.push_back(Child::Start([&] {
      const int out = from[0]->write_fd();
      RankCtx ctx;
      Status s = OpenRank(path_, 0, job_, mode(), &ctx);
      if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
      auto writer = ctx.store->OpenWriter(RankZeroWriterOptions(milliseconds(2000)));
      if (!writer.ok()) return Fail(0, kExitSetup, writer.status().ToString());
      WriteLine(out, "ready");
      if (ReadLine(to0.read_fd(), milliseconds(10000)) != std::optional<std::string>("go"))
        return Fail(0, kExitPipe, "no go");
      std::this_thread::sleep_for(milliseconds(300));
      int64_t commit_ns = 0;
      s = SaveStep(**writer, *ctx.coord, step, &commit_ns);
      if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
      WriteLine(out, "commit " + std::to_string(commit_ns));
      return kExitOk;
    }));
    ASSERT_TRUE(children.back().started());
    to0.CloseRead();
    from[0]->CloseWrite();
    ASSERT_EQ(ReadLine(from[0]->read_fd(), milliseconds(10000)),
              std::optional<std::string>("ready"))
        << "rank 0 exit " << children[0].ExitCode(milliseconds(1000));

    for (int rank = 1; rank < kWorld; ++rank) {
      children.push_back(Child::Start([&, rank] {
        const int out = from[rank]->write_fd();
        RankCtx ctx;
        Status s = OpenRank(path_, rank, job_, mode(), &ctx);
        if (!s.ok()) return Fail(rank, kExitSetup, s.ToString());
        WriteLine(out, "waiting");
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
        WriteLine(out, FormatWait(s, ret_ns));
        if (!s.ok()) return Fail(rank, kExitWaitError, s.ToString());
        if (!verified.ok())
          return Fail(rank, verified.code() == Code::kDataLoss ? kExitBadData : kExitEarlyRead,
                      "wait said committed, then: " + verified.ToString());
        return kExitOk;
      }));
      ASSERT_TRUE(children.back().started());
    }
    for (int rank = 1; rank < kWorld; ++rank) from[rank]->CloseWrite();
    for (int rank = 1; rank < kWorld; ++rank)
      ASSERT_EQ(ReadLine(from[rank]->read_fd(), milliseconds(10000)),
                std::optional<std::string>("waiting"))
          << "rank " << rank;
    std::this_thread::sleep_for(milliseconds(20));  // inside their waits
    WriteLine(to0.write_fd(), "go");
    auto commit = ReadLine(from[0]->read_fd(), milliseconds(10000));
    ASSERT_TRUE(commit.has_value()) << "rank 0 exit " << children[0].ExitCode(milliseconds(1000));
    auto c = Split(*commit);
    ASSERT_EQ(c.size(), 2u) << *commit;
    const int64_t commit_ns = std::stoll(c[1]);
    for (int rank = 1; rank < kWorld; ++rank) {
      auto r = ParseWait(ReadLine(from[rank]->read_fd(), milliseconds(12000)));
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
      EXPECT_EQ(children[rank].ExitCode(milliseconds(10000)), kExitOk) << "rank " << rank;
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
  std::vector<std::unique_ptr<Pipe>> from(kWorld);
  for (auto& p : from) p = std::make_unique<Pipe>();
  std::vector<Child> waiters;
  for (int rank = 1; rank < kWorld; ++rank) {
    waiters.push_back(Child::Start([&, rank] {
      const int out = from[rank]->write_fd();
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
      WriteLine(out, "timedout");
      auto got = ctx.coord->WaitFor("load-1", milliseconds(10000));
      if (!got.ok()) return Fail(rank, kExitWaitError, got.status().ToString());
      WriteLine(out, "got " + *got);
      return *got == "step=7" ? kExitOk : Fail(rank, kExitWrongOutcome, "payload " + *got);
    }));
    ASSERT_TRUE(waiters.back().started());
  }
  for (int rank = 1; rank < kWorld; ++rank) from[rank]->CloseWrite();
  for (int rank = 1; rank < kWorld; ++rank)
    ASSERT_EQ(ReadLine(from[rank]->read_fd(), milliseconds(10000)),
              std::optional<std::string>("timedout"))
        << "rank " << rank << " exit " << waiters[rank - 1].ExitCode(milliseconds(1000));

  Child rank0 = Child::Start([&] {
    RankCtx ctx;
    Status s = OpenRank(path_, 0, job_, mode(), &ctx);
    if (!s.ok()) return Fail(0, kExitSetup, s.ToString());
    s = ctx.coord->Publish("load-1", "step=7");
    return s.ok() ? kExitOk : Fail(0, kExitSaveFailed, s.ToString());
  });
  ASSERT_TRUE(rank0.started());
  EXPECT_EQ(rank0.ExitCode(milliseconds(10000)), kExitOk);
  for (int rank = 1; rank < kWorld; ++rank) {
    EXPECT_EQ(ReadLine(from[rank]->read_fd(), milliseconds(10000)),
              std::optional<std::string>("got step=7"))
        << "rank " << rank;
    EXPECT_EQ(waiters[rank - 1].ExitCode(milliseconds(10000)), kExitOk) << "rank " << rank;
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

INSTANTIATE_TEST_SUITE_P(Modes, CoordinationTest,
                         ::testing::Values(WaitMode::kManifest, WaitMode::kFileLock),
                         [](const ::testing::TestParamInfo<WaitMode>& param_info) {
                           return param_info.param == WaitMode::kManifest ? std::string("Manifest")
                                                                          : std::string("FileLock");
                         });

// ---------------------------------------------------------------- f. setup errors

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
// the same store: the new Checkpointer's "open" record replaces the old
// one's outcome, and carries it on, so a rank of the old Checkpointer that
// reads only now still gets rank 0's error (not its own deadline).
TEST(FileCoordinatorTest, TheNextCheckpointersOpenRecordCarriesTheLastOutcome) {
  TempDir tmp;
  const std::string job = NewJobId();
  auto open = [&](int rank, const std::string& scope) {
    return OpenedCoordinator(NewPosixBackend(tmp.Sub("store")).value(), rank, job, scope);
  };
  auto first0 = open(0, "one"), first1 = open(1, "one");
  ASSERT_TRUE(first0 && first1);
  CKPTIO_ASSERT_OK(first0->BeginSave(1, "one.1", milliseconds(2000)));
  CKPTIO_ASSERT_OK(first0->EndSave(1, "one.1", Status(Code::kResourceExhausted, "disk full")));
  first0.reset();
  auto second0 = open(0, "two");
  ASSERT_TRUE(second0);
  auto polled = first1->PollSaved(1, "one.1");
  EXPECT_EQ(polled.status().code(), Code::kResourceExhausted) << polled.status();
  EXPECT_NE(polled.status().message().find("disk full"), std::string::npos) << polled.status();
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
}  // namespace ckptio
