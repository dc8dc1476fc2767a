// What the files of torch_ranks_test share. The Checkpointer across real
// processes (invariants 5 and 6): W=4 ranks, each a forked process
// (tests/lib/ranks.h) with its own Checkpointer (rank 0 holds the writer
// lock), a torch::nn::Linear and an Adam optimizer initialised alike, for
// every wait mode (manifest, file lock, c10d TCPStore).
//
// The parent process never calls into LibTorch: torch starts thread pools,
// and a fork after that can deadlock. All torch work happens in the children,
// which first set torch::set_num_threads(1) (that also makes every rank's
// training bit-identical). Children talk to the parent through pipes, one
// line per message, and always leave with _exit(); each failing child prints
// its reason to stderr. In kStore mode rank 0 serves the TCPStore on a port
// the parent picked, except where rank 0 is SIGKILLed: there a separate
// "agent" process serves it (as torchrun's agent does), so that the store
// outlives rank 0.
//
// The files: torch_ranks_save_test.cc (every rank sees only committed steps,
// loads and falls back alike), torch_ranks_kill_test.cc (rank 0 SIGKILLed
// mid-save, at a fixed and at random points, then a relaunch),
// torch_ranks_load_test.cc (non-blocking tickets, waiting for rank 0's load
// decision, rank 0 killed before it), torch_ranks_striped_test.cc (striped
// saves, a striping rank killed, rank 0 interrupted waiting for a stripe);
// and c10d_coordinator_test.cc, in one process (the c10d store mode's
// records deleted by their last reader; it uses none of this file).
#ifndef CKPTIO_TESTS_TORCH_TORCH_RANKS_TEST_UTIL_H_
#define CKPTIO_TESTS_TORCH_TORCH_RANKS_TEST_UTIL_H_

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "ckptio/ckptio.h"
#include "ckptio/torch.h"
#include "ranks.h"
#include "test_util.h"

namespace ckptio::torch_ranks_testing {

using ::ckptio::testing::Fail;
using ::ckptio::testing::FormatReport;
using ::ckptio::testing::Join;
using ::ckptio::testing::NewJobId;
using ::ckptio::testing::NowNs;
using ::ckptio::testing::OneLine;
using ::ckptio::testing::ParseReport;
using ::ckptio::testing::SleepUntilKilled;
using ::ckptio::testing::StatusReport;
using ::ckptio::testing::TempDir;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kWorld = 4;
constexpr uint64_t kInitSeed = 7;        // every rank's model starts from this seed
constexpr uint64_t kDataSeed = 1000;     // + the step: each step's batch, the same on every rank
constexpr uint64_t kFreshSeed = 50000;   // + the rank: models loaded into (all different)
constexpr milliseconds kTimeout(15000);  // the Checkpointer's deadline where no test needs less

// Child exit codes (and kExitOk, kExitSetup, kExitPipe, kExitException,
// kExitNotKilled of ranks.h).
using ::ckptio::testing::kExitException;
using ::ckptio::testing::kExitNotKilled;
using ::ckptio::testing::kExitOk;
using ::ckptio::testing::kExitPipe;
using ::ckptio::testing::kExitSetup;
constexpr int kExitSaveFailed = 20;  // Save (or a ticket) failed where it had to succeed
constexpr int kExitBadStep = 21;     // right after Save returned, the step did not verify or match
constexpr int kExitLoadFailed = 22;  // Load failed or found nothing
constexpr int kExitPoll = 23;        // a ticket's Poll misbehaved
constexpr int kExitCorrupt = 24;     // rank 0 could not corrupt the step on purpose

// Rank `rank` of kWorld ranks in job `job`.
RankInfo MakeRank(int rank, const std::string& job);

// FNV-1a, and its value as 16 hex digits.
uint64_t Fnv(uint64_t h, const void* data, size_t n);
std::string Hex(uint64_t h);
std::string TextHash(const std::string& s);

// ---------------------------------------------------------------- torch side (children only)

bool BitEqual(const torch::Tensor& a, const torch::Tensor& b);

// A hash of every parameter's name, shape and bytes, in order.
std::string ParamHash(const torch::nn::Module& m);

// One rank's training state: the same on every rank for the same seed.
struct Trainee {
  explicit Trainee(uint64_t seed);
  Trainee(const Trainee&) = delete;
  Trainee& operator=(const Trainee&) = delete;

  // One optimizer step on step `step`'s batch (identical on every rank).
  void Train(int64_t step);
  State state() { return State{{"model", model}, {"optim", *adam}}; }
  std::string hash() const { return ParamHash(*model); }

  torch::nn::Linear model{nullptr};
  std::unique_ptr<torch::optim::Adam> adam;
};

// Opens committed `step` through a fresh Store, verifies every byte, and
// checks that the manifest's model.safetensors tensors are bit-for-bit the
// caller's parameters (so the step read is the one just trained, whole).
Status CheckStepIsMine(const std::string& path, int64_t step, torch::nn::Module& model);

// A POSIX backend on `path` (the children build their own).
std::shared_ptr<StorageBackend> OpenBackendForTest(const std::string& path);

// "loaded <step> <skipped steps, comma-separated or -> <reasons hash> <params hash>"
std::string FormatLoaded(const LoadResult& r, const std::string& params);

// ---------------------------------------------------------------- launching ranks

// One launch of a job: every rank of it shares the store, the job id and
// (kStore) the TCPStore port.
struct Launch {
  std::string path;
  std::string job;
  WaitMode mode = WaitMode::kManifest;
  int port = -1;              // kStore
  bool agent_serves = false;  // kStore: a separate process serves the TCPStore, not rank 0
};

// What a rank's body gets.
struct RankEnv {
  int rank = 0;
  const Launch* launch = nullptr;
  const testing::RankLink* link = nullptr;  // lines to and from the parent
  c10::intrusive_ptr<c10d::Store> c10d;     // kStore

  void Say(const std::string& line) const { link->Say(line); }
  std::optional<std::string> Hear(milliseconds timeout) const { return link->Hear(timeout); }

  Result<std::unique_ptr<Checkpointer>> Open(milliseconds timeout, bool stripe = false,
                                             std::shared_ptr<StorageBackend> backend = {}) const;

  // kStore: a barrier of every rank through the c10d store, called with the
  // same `name` on every rank. Rank 0 gets the store's number of keys once
  // every rank arrived, less the keys these barriers added; the others -1.
  Result<int64_t> KeysAtBarrier(const std::string& name);

 private:
  int64_t barrier_keys_ = 0;  // the keys KeysAtBarrier added (two a barrier)
};

// The kWorld ranks of one launch (plus the TCPStore agent when asked), all
// started by the constructor, and the parent's side of their pipes: see
// RankGroup for Tell, Await, AwaitLine and ExitCodes.
class Ranks {
 public:
  using Body = std::function<int(RankEnv&)>;

  Ranks(const Launch& launch, const Body& body);

  bool started() const { return group_.all_started() && !agent_failed_; }
  testing::Child& child(int r) { return group_.child(r); }
  void Tell(int r, const std::string& line) { group_.Tell(r, line); }
  std::optional<std::vector<std::string>> Await(int r, const std::string& key,
                                                milliseconds timeout) {
    return group_.Await(r, key, timeout);
  }
  std::optional<std::string> AwaitLine(int r, const std::string& key, milliseconds timeout) {
    return group_.AwaitLine(r, key, timeout);
  }
  std::vector<int> ExitCodes(milliseconds timeout) { return group_.ExitCodes(timeout); }

 private:
  void StartAgent();
  // In the rank's process.
  int RunRank(const testing::RankLink& link, const Body& body);

  Launch launch_;
  std::unique_ptr<testing::Pipe> agent_pipe_;
  std::optional<testing::Child> agent_;
  bool agent_failed_ = false;
  testing::RankGroup group_{kWorld};  // last: its ranks go before the agent
};

// The multi-process scenarios, once per wait mode (instantiated in
// torch_ranks_save_test.cc for the TEST_Ps of every file).
class TorchRanksTest : public ::testing::TestWithParam<WaitMode> {
 protected:
  Launch NewLaunch(bool agent_serves = false);
  WaitMode mode() const { return GetParam(); }
  std::string mode_name() const { return std::string(WaitModeName(GetParam())); }

  TempDir tmp_;
};

#define EXPECT_ALL_RANKS_EXIT_OK(ranks, timeout)                          \
  do {                                                                    \
    auto codes_ = (ranks).ExitCodes(timeout);                             \
    for (int r_ = 0; r_ < kWorld; ++r_)                                   \
      EXPECT_EQ(codes_[r_], kExitOk) << "rank " << r_ << " (see stderr)"; \
  } while (0)

// A waiter's report of a save or decision rank 0 never committed, rank 0
// SIGKILLed at kill_ns: with the file lock ABORTED saying `died` within 1 s
// of the kill (never before it), otherwise DeadlineExceeded at the deadline
// `timeout` after the waiter began at wait_ns. Returns the ms it took after
// the kill (file lock) or after it began to wait.
int64_t ExpectKilledRankZerosWaiter(WaitMode mode, const StatusReport& rep, const std::string& died,
                                    int64_t kill_ns, int64_t wait_ns, milliseconds timeout);

// A relaunched rank: loads the newest step into a model of its own seed and
// says "loaded" (FormatLoaded).
int LoadAndSay(RankEnv& me);

}  // namespace ckptio::torch_ranks_testing

#endif  // CKPTIO_TESTS_TORCH_TORCH_RANKS_TEST_UTIL_H_
