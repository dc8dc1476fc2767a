// The Checkpointer across real processes, every wait mode: rank 0 SIGKILLed
// in the middle of a save, at a fixed point (mid-object) and at random
// points, then a relaunch that loads the same step on every rank. See
// torch_ranks_test_util.h.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "torch_ranks_test_util.h"

namespace ckptio::torch_ranks_testing {
namespace {

// ---------------------------------------------------------------- c. SIGKILL

// A backend that passes on the first 4 MiB of an object whose key holds
// `needle` (more than the POSIX backend buffers: they reach the temp file),
// then calls `said` and never returns (until the process is killed): a
// SIGKILL then lands in the middle of that object, whatever the load.
class StallsMidObject : public testing::ForwardingBackend {
 public:
  StallsMidObject(std::shared_ptr<StorageBackend> inner, std::string needle,
                  std::function<void()> said)
      : ForwardingBackend(std::move(inner)), needle_(std::move(needle)), said_(std::move(said)) {}
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    auto w = ForwardingBackend::NewObject(key, mode);
    if (!w.ok() || key.find(needle_) == std::string_view::npos) return w;
    struct Stalling : ObjectWriter {
      std::unique_ptr<ObjectWriter> inner;
      StallsMidObject* owner;
      size_t appended = 0;
      Status Append(const void* data, size_t size) override {
        constexpr size_t kStallAt = 4u << 20;
        if (appended >= kStallAt || appended + size < kStallAt || owner->stalled_.exchange(true)) {
          appended += size;
          return inner->Append(data, size);
        }
        Status s = inner->Append(data, kStallAt - appended);
        if (!s.ok()) return s;
        owner->said_();
        for (;;) std::this_thread::sleep_for(milliseconds(1000));
      }
      Status Commit() override { return inner->Commit(); }
    };
    auto stalling = std::make_unique<Stalling>();
    stalling->inner = std::move(*w);
    stalling->owner = this;
    return std::unique_ptr<ObjectWriter>(std::move(stalling));
  }

 private:
  std::string needle_;
  std::function<void()> said_;
  std::atomic<bool> stalled_{false};
};

// A temp object of tensors.safetensors in step `step`'s directory, with
// bytes in it: rank 0 is in the middle of writing the big tensor.
bool BigObjectBeingWritten(const std::string& path, int64_t step) {
  char dir[32];
  std::snprintf(dir, sizeof dir, "/step-%012lld", static_cast<long long>(step));
  const std::string d = path + dir;
  DIR* h = ::opendir(d.c_str());
  if (!h) return false;
  bool found = false;
  const std::string prefix = std::string(kTempMarker) + "tensors.safetensors";
  while (struct dirent* e = ::readdir(h)) {
    if (std::string(e->d_name).rfind(prefix, 0) != 0) continue;
    struct stat st;
    if (::stat((d + "/" + e->d_name).c_str(), &st) == 0 && st.st_size > 0) found = true;
  }
  ::closedir(h);
  return found;
}

// Rank 0 commits step 1, then is SIGKILLed while writing step 2's 64 MiB
// tensor (its backend stalls there, so the kill lands mid-object however
// loaded the machine). The waiters' Save(2) never returns OK: "writer died"
// within 1 s of the kill with the file lock, DeadlineExceeded naming the
// step at the 4 s deadline otherwise. A relaunch (new job id, new
// processes) loads the last committed step on every rank.
TEST_P(TorchRanksTest, RankZeroKilledMidSaveThenRestartLoadsTheSameStep) {
  constexpr milliseconds kWaitTimeout(4000);
  constexpr int64_t kBigFloats = int64_t{16} << 20;  // 64 MiB
  // kStore: an agent serves the TCPStore (as torchrun's does), so that it
  // outlives rank 0.
  const Launch launch = NewLaunch(/*agent_serves=*/true);
  Ranks ranks(launch, [&](RankEnv& me) -> int {
    Trainee t(kInitSeed);
    std::shared_ptr<StorageBackend> backend;
    if (me.rank == 0) {  // stalls in step 2's big object, for the kill
      auto posix = OpenBackendForTest(launch.path);
      if (!posix) return Fail(me.rank, kExitSetup, "no backend");
      backend = std::make_shared<StallsMidObject>(posix, "step-000000000002/tensors.safetensors",
                                                  [&me] { me.Say("mid"); });
    }
    auto ckpt = me.Open(kWaitTimeout, /*stripe=*/false, backend);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    t.Train(1);
    Status s = (*ckpt)->Save(1, state);
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, "step 1: " + s.ToString());
    me.Say("trained1 " + t.hash());
    t.Train(2);
    if (me.rank == 0) {
      torch::Tensor big = torch::full({kBigFloats}, 0.5f);
      State big_state = t.state();
      big_state.items.emplace_back("big", big);
      me.Say("ready");
      if (me.Hear(milliseconds(20000)) != std::optional<std::string>("go"))
        return Fail(0, kExitPipe, "no go");
      me.Say("saving2 " + std::to_string(NowNs()));
      s = (*ckpt)->Save(2, big_state);
      me.Say("saved2 " + OneLine(s.ToString()));
      return SleepUntilKilled(60);
    }
    me.Say("waiting " + std::to_string(NowNs()));
    s = (*ckpt)->Save(2, state);
    me.Say(FormatReport(s, NowNs()));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());

  std::string h1;
  for (int r = 0; r < kWorld; ++r) {
    auto t1 = ranks.Await(r, "trained1", milliseconds(20000));
    ASSERT_TRUE(t1.has_value() && t1->size() == 1u)
        << "rank " << r << " exit " << ranks.child(r).ExitCode(milliseconds(2000));
    if (r == 0) h1 = (*t1)[0];
    EXPECT_EQ((*t1)[0], h1) << "rank " << r << " trained differently (setup)";
  }
  ASSERT_TRUE(ranks.Await(0, "ready", milliseconds(20000)).has_value())
      << "rank 0 exit " << ranks.child(0).ExitCode(milliseconds(2000));
  std::vector<int64_t> wait_start(kWorld, 0);
  for (int r = 1; r < kWorld; ++r) {
    auto w = ranks.Await(r, "waiting", milliseconds(20000));
    ASSERT_TRUE(w.has_value() && w->size() == 1u) << "rank " << r;
    wait_start[r] = std::stoll((*w)[0]);
  }
  std::this_thread::sleep_for(milliseconds(100));  // the waiters are inside Save(2)
  ranks.Tell(0, "go");
  ASSERT_TRUE(ranks.Await(0, "saving2", milliseconds(10000)).has_value());
  const bool mid = ranks.Await(0, "mid", milliseconds(20000)).has_value();
  const bool seen = BigObjectBeingWritten(launch.path, 2);
  const int64_t kill_ns = NowNs();
  ASSERT_EQ(::kill(ranks.child(0).pid(), SIGKILL), 0);
  EXPECT_TRUE(mid) << "rank 0 never began step 2's big object (killed it anyway)";
  EXPECT_TRUE(seen) << "no temp object of step 2's big tensor with bytes in it at the kill";
  EXPECT_EQ(ranks.child(0).ExitCode(milliseconds(5000)), 128 + SIGKILL)
      << "rank 0 was not killed mid-save (it exited by itself)";

  // Did step 2 commit after all? (It cannot have, if the kill landed mid-object.)
  bool committed2 = false;
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(launch.path));
    committed2 = store->OpenStep(2).ok();
  }
  EXPECT_FALSE(committed2) << "step 2 committed although rank 0 was killed while writing it";

  int64_t slowest_ms = 0;
  for (int r = 1; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    auto rep = ParseReport(ranks.AwaitLine(r, "ret", kWaitTimeout + milliseconds(6000)));
    ASSERT_TRUE(rep.has_value()) << "no report from the waiter";
    if (committed2) continue;  // nothing more to demand of the waiters (reported above)
    EXPECT_NE(rep->code, Code::kOk) << "Save(2) returned OK for a step that never committed";
    EXPECT_NE(rep->message.find("step 2"), std::string::npos) << rep->message;
    slowest_ms =
        std::max(slowest_ms, ExpectKilledRankZerosWaiter(mode(), *rep, "writer died", kill_ns,
                                                         wait_start[r], kWaitTimeout));
  }
  auto codes = ranks.ExitCodes(milliseconds(10000));
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(codes[r], kExitOk) << "rank " << r;
  if (HasFailure()) return;

  // The relaunch: a new job id, new processes (and a new TCPStore, served by rank 0).
  const int64_t expect_step = committed2 ? 2 : 1;
  const Launch relaunch = NewLaunch();
  Ranks ranks2(relaunch, LoadAndSay);
  ASSERT_TRUE(ranks2.started());
  std::vector<std::string> loaded(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    auto ld = ranks2.Await(r, "loaded", milliseconds(30000));
    ASSERT_TRUE(ld.has_value()) << "relaunched rank " << r << " exit "
                                << ranks2.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 4u) << Join(*ld);
    loaded[r] = Join(*ld);
    EXPECT_EQ((*ld)[0], std::to_string(expect_step)) << "relaunched rank " << r;
    EXPECT_EQ((*ld)[1], "-") << "relaunched rank " << r
                             << " skipped steps (a killed save is torn, not corrupt)";
    if (expect_step == 1) {
      EXPECT_EQ((*ld)[3], h1) << "relaunched rank " << r;
    }
  }
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(loaded[r], loaded[0]) << "relaunched rank " << r;
  EXPECT_ALL_RANKS_EXIT_OK(ranks2, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: rank 0 SIGKILLed writing step 2 (64 MiB); %d waiters got %s (slowest "
      "%lld ms %s), none OK; relaunch: all %d ranks loaded step %lld, identical params\n",
      mode_name().c_str(), kWorld - 1,
      mode() == WaitMode::kFileLock ? "ABORTED writer died" : "DEADLINE_EXCEEDED",
      static_cast<long long>(slowest_ms),
      mode() == WaitMode::kFileLock ? "after the kill" : "after starting to wait", kWorld,
      static_cast<long long>(expect_step));
}

// ---------------------------------------------------------------- c2. random SIGKILLs

// A hash of a tensor's dtype, shape and bytes.
std::string TensorHash(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kCPU).contiguous();
  uint64_t h = 1469598103934665603ull;
  const int8_t dtype = static_cast<int8_t>(c.scalar_type());
  h = Fnv(h, &dtype, sizeof dtype);
  for (int64_t d : c.sizes()) h = Fnv(h, &d, sizeof d);
  return Hex(Fnv(h, c.data_ptr(), c.nbytes()));
}

// The "big" tensor of `step`: `floats` values, the same on every rank.
torch::Tensor BigTensor(int64_t floats, int64_t step) {
  return torch::arange(floats, torch::kFloat).mul_(1e-3f).add_(static_cast<float>(step));
}

// Sleeps until CLOCK_MONOTONIC reads `ns`.
void SleepUntilNs(int64_t ns) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(ns / 1000000000);
  ts.tv_nsec = static_cast<long>(ns % 1000000000);
  while (::clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

// rank 0's save record (<store>/.coord/save, file-lock mode) names `step`
// as "saving": it had taken the save lock and recorded the step when killed.
bool SaveRecordSays(const std::string& path, int64_t step, const std::string& state) {
  const std::string file = path + "/.coord/save";
  struct stat st;
  if (::stat(file.c_str(), &st) != 0) return false;
  auto record = ParseRecord(::ckptio::testing::ReadFile(file), "ckptio-save", file);
  return record.ok() && record->count("step") && record->at("step") == std::to_string(step) &&
         record->count("state") && record->at("state") == state;
}

// What the trials of one mode add up to.
struct KillTally {
  int trials = 0;
  int before_commit = 0;  // step 2 not committed
  int after_commit = 0;
  int before_record = 0;  // file lock: killed before rank 0 recorded step 2 as saving
  int64_t min_delay_ms = -1, max_delay_ms = -1;
  std::map<std::string, int> waiters;  // code name -> count
};

// One trial: rank 0 is SIGKILLed `delay` after it began Save(2), `delay`
// drawn from [0, 1.5 x its measured Save(1)]. Checks invariants 5 and 6 from
// the waiters' reports and from the store on disk, then restarts the job.
void RunRandomKillTrial(Launch launch, const Launch& relaunch_template, int trial,
                        std::chrono::milliseconds wait_timeout, KillTally* tally) {
  const WaitMode mode = launch.mode;
  std::mt19937_64 rng(0x5eed0000ull + 100u * static_cast<unsigned>(mode) +
                      static_cast<unsigned>(trial));
  const int64_t big_bytes =
      std::uniform_int_distribution<int64_t>(int64_t{1} << 20, int64_t{32} << 20)(rng);
  const int64_t big_floats = big_bytes / 4;

  Ranks ranks(launch, [&](RankEnv& me) -> int {
    Trainee t(kInitSeed);
    torch::Tensor big = BigTensor(big_floats, 1);
    auto ckpt = me.Open(wait_timeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    state.items.emplace_back("big", big);  // refers to the variable: reassigning it is seen
    t.Train(1);
    me.Say("ready1");
    if (me.Hear(milliseconds(20000)) != std::optional<std::string>("go1"))
      return Fail(me.rank, kExitPipe, "no go1");
    const int64_t t0 = NowNs();
    Status s = (*ckpt)->Save(1, state);
    const int64_t t1 = NowNs();
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, "step 1: " + s.ToString());
    me.Say("saved1 " + std::to_string(t1 - t0) + " " + t.hash() + " " + TensorHash(big));
    t.Train(2);
    big = BigTensor(big_floats, 2);
    me.Say("trained2 " + t.hash() + " " + TensorHash(big));
    if (me.rank == 0) {
      me.Say("ready2");
      if (me.Hear(milliseconds(20000)) != std::optional<std::string>("go2"))
        return Fail(0, kExitPipe, "no go2");
      me.Say("saving2 " + std::to_string(NowNs()));
      s = (*ckpt)->Save(2, state);
      me.Say("saved2 " + std::to_string(NowNs()) + " " + OneLine(s.ToString()));
      return SleepUntilKilled(60);
    }
    me.Say("waiting " + std::to_string(NowNs()));
    s = (*ckpt)->Save(2, state);
    const int64_t t_ret = NowNs();
    std::string verified = "-";
    if (s.ok()) {  // a waiter told OK must find step 2 whole, and its own
      Status v = CheckStepIsMine(launch.path, 2, *t.model);
      verified = v.ok() ? "ok" : OneLine(v.ToString());
    }
    me.Say(FormatReport(s, t_ret));
    me.Say("verify2 " + verified);
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());

  // Step 1, every rank at once.
  for (int r = 0; r < kWorld; ++r)
    ASSERT_TRUE(ranks.Await(r, "ready1", milliseconds(20000)).has_value())
        << "rank " << r << " exit " << ranks.child(r).ExitCode(milliseconds(2000));
  for (int r = 0; r < kWorld; ++r) ranks.Tell(r, "go1");
  std::vector<std::string> saved1(kWorld), trained2(kWorld);
  int64_t save1_ns = 0;
  for (int r = 0; r < kWorld; ++r) {
    auto s1 = ranks.Await(r, "saved1", milliseconds(20000));
    ASSERT_TRUE(s1.has_value() && s1->size() == 3u)
        << "rank " << r << ": Save(1) failed, exit " << ranks.child(r).ExitCode(milliseconds(2000));
    if (r == 0) save1_ns = std::stoll((*s1)[0]);
    saved1[r] = (*s1)[1] + " " + (*s1)[2];
    auto t2 = ranks.Await(r, "trained2", milliseconds(20000));
    ASSERT_TRUE(t2.has_value() && t2->size() == 2u) << "rank " << r;
    trained2[r] = Join(*t2);
    EXPECT_EQ(saved1[r], saved1[0]) << "rank " << r << " built another state (setup)";
    EXPECT_EQ(trained2[r], trained2[0]) << "rank " << r << " built another state (setup)";
  }
  if (::testing::Test::HasFailure()) return;

  // Step 2: the waiters are inside Save(2) before rank 0 starts it.
  ASSERT_TRUE(ranks.Await(0, "ready2", milliseconds(20000)).has_value());
  std::vector<int64_t> wait_start(kWorld, 0);
  for (int r = 1; r < kWorld; ++r) {
    auto w = ranks.Await(r, "waiting", milliseconds(20000));
    ASSERT_TRUE(w.has_value() && w->size() == 1u) << "rank " << r;
    wait_start[r] = std::stoll((*w)[0]);
  }
  std::this_thread::sleep_for(milliseconds(20));
  ranks.Tell(0, "go2");
  auto saving = ranks.Await(0, "saving2", milliseconds(10000));
  ASSERT_TRUE(saving.has_value() && saving->size() == 1u);
  const int64_t saving_ns = std::stoll((*saving)[0]);
  const int64_t max_delay_ns = save1_ns * 3 / 2;
  const int64_t delay_ns = std::uniform_int_distribution<int64_t>(0, max_delay_ns)(rng);
  SleepUntilNs(saving_ns + delay_ns);
  const int64_t kill_ns = NowNs();
  ASSERT_EQ(::kill(ranks.child(0).pid(), SIGKILL), 0);
  const int rank0_exit = ranks.child(0).ExitCode(milliseconds(5000));
  auto saved2 = ranks.AwaitLine(0, "saved2", milliseconds(500));  // only if it got that far
  EXPECT_EQ(rank0_exit, 128 + SIGKILL) << "rank 0 left by itself";
  if (saved2) {
    EXPECT_NE(saved2->find(" OK"), std::string::npos) << "rank 0's Save(2) failed: " << *saved2;
  }

  // The store on disk: step 1 verifies; step 2 is committed (and verifies) or not.
  bool committed2 = false;
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(launch.path));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store->ListSteps());
    bool listed1 = false, listed2 = false;
    for (const StepEntry& e : steps) {
      EXPECT_TRUE(e.step == 1 || e.step == 2) << "unexpected step " << e.step;
      if (e.step == 1) listed1 = e.state == StepState::kCommitted;
      if (e.step == 2) listed2 = e.state == StepState::kCommitted;
      EXPECT_TRUE(e.state == StepState::kCommitted || e.state == StepState::kTorn)
          << "step " << e.step << ": " << e.problem;
    }
    EXPECT_TRUE(listed1) << "step 1 is not listed as committed";
    auto r1 = store->OpenStep(1);
    EXPECT_TRUE(r1.ok()) << r1.status();
    if (r1.ok()) {
      CKPTIO_EXPECT_OK((*r1)->Verify());
    }
    auto r2 = store->OpenStep(2);
    committed2 = r2.ok();
    EXPECT_EQ(listed2, committed2) << "ListSteps and OpenStep disagree about step 2";
    if (committed2) {
      CKPTIO_EXPECT_OK((*r2)->Verify());
    } else {
      EXPECT_EQ(r2.status().code(), Code::kNotFound) << r2.status();
      EXPECT_FALSE(saved2.has_value()) << "rank 0 said step 2 saved, but it is not committed";
    }
  }
  const bool recorded_saving2 =
      mode == WaitMode::kFileLock && !committed2 && SaveRecordSays(launch.path, 2, "saving");
  const bool before_record = mode == WaitMode::kFileLock && !committed2 && !recorded_saving2;

  std::string outcomes;
  for (int r = 1; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    auto rep = ParseReport(ranks.AwaitLine(r, "ret", wait_timeout + milliseconds(6000)));
    ASSERT_TRUE(rep.has_value()) << "no report from the waiter, exit "
                                 << ranks.child(r).ExitCode(milliseconds(2000));
    auto verified = ranks.Await(r, "verify2", milliseconds(20000));
    ASSERT_TRUE(verified.has_value());
    tally->waiters[std::string(CodeName(rep->code))]++;
    outcomes += std::string(outcomes.empty() ? "" : ",") + std::string(CodeName(rep->code));
    const int64_t waited_ms = (rep->t_ns - wait_start[r]) / 1000000;
    const int64_t after_kill_ms = (rep->t_ns - kill_ns) / 1000000;
    if (rep->code == Code::kOk) {
      // (1) and (2): OK only for a committed step, which the waiter then verified.
      EXPECT_TRUE(committed2) << "Save(2) returned OK for a step that never committed";
      EXPECT_EQ(Join(*verified), "ok") << "told OK, but step 2 did not verify there";
      continue;
    }
    if (committed2) continue;  // a waiter may give up on a committed step (rank 0 died first)
    if (mode == WaitMode::kFileLock) {
      // Rank 0 holds the save lock from Save(1) on: killed before or after
      // it recorded step 2 as saving, its death is noticed at once.
      EXPECT_EQ(rep->code, Code::kAborted) << rep->message;
      EXPECT_NE(rep->message.find("writer died"), std::string::npos) << rep->message;
      EXPECT_NE(rep->message.find("step 2"), std::string::npos) << rep->message;
      EXPECT_GE(rep->t_ns, kill_ns) << "called the writer dead while it was alive";
      EXPECT_LT(after_kill_ms, 1000) << "the death should be noticed within 1 s of the kill";
    } else {
      EXPECT_TRUE(rep->code == Code::kDeadlineExceeded || rep->code == Code::kUnavailable)
          << rep->message;
      EXPECT_NE(rep->message.find("step 2"), std::string::npos) << rep->message;
      if (rep->code == Code::kDeadlineExceeded) {
        EXPECT_GE(waited_ms, wait_timeout.count() - 100) << "gave up before the deadline";
      }
    }
    EXPECT_LT(waited_ms, wait_timeout.count() + 1500) << "ran far past the deadline";
  }
  auto codes = ranks.ExitCodes(milliseconds(10000));
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(codes[r], kExitOk) << "rank " << r;
  if (::testing::Test::HasFailure()) return;

  // (4) The restart: new processes, a new job id; all load the same step.
  const int64_t expect_step = committed2 ? 2 : 1;
  Launch relaunch = relaunch_template;
  relaunch.path = launch.path;
  Ranks ranks2(relaunch, [&](RankEnv& me) -> int {
    auto ckpt = me.Open(kTimeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, "relaunch: " + ckpt.status().ToString());
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    torch::Tensor big = torch::zeros({1});
    State into = fresh.state();
    into.items.emplace_back("big", big);
    auto got = (*ckpt)->Load(into);
    if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
    if (!got->step.has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    me.Say(FormatLoaded(*got, fresh.hash()) + " " + TensorHash(big));
    return kExitOk;
  });
  ASSERT_TRUE(ranks2.started());
  const std::string& expect_state = committed2 ? trained2[0] : saved1[0];
  std::vector<std::string> loaded(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    auto ld = ranks2.Await(r, "loaded", milliseconds(30000));
    ASSERT_TRUE(ld.has_value()) << "relaunched rank " << r << " exit "
                                << ranks2.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 5u) << Join(*ld);
    loaded[r] = Join(*ld);
    EXPECT_EQ((*ld)[0], std::to_string(expect_step)) << "relaunched rank " << r;
    EXPECT_EQ((*ld)[1], "-") << "relaunched rank " << r << " skipped steps";
    EXPECT_EQ((*ld)[3] + " " + (*ld)[4], expect_state)
        << "relaunched rank " << r << ": not step " << expect_step << "'s parameters";
  }
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(loaded[r], loaded[0]) << "relaunched rank " << r;
  EXPECT_ALL_RANKS_EXIT_OK(ranks2, milliseconds(30000));
  if (::testing::Test::HasFailure()) return;

  const int64_t delay_ms = delay_ns / 1000000;
  tally->trials++;
  (committed2 ? tally->after_commit : tally->before_commit)++;
  if (before_record) tally->before_record++;
  if (tally->min_delay_ms < 0 || delay_ms < tally->min_delay_ms) tally->min_delay_ms = delay_ms;
  tally->max_delay_ms = std::max(tally->max_delay_ms, delay_ms);
  std::printf(
      "  trial %d: %.1f MiB, Save(1) %lld ms, killed %lld ms into Save(2) (of <= %lld)%s: step 2 "
      "%s; waiters %s; restart loaded step %lld\n",
      trial, static_cast<double>(big_floats * 4) / (1 << 20),
      static_cast<long long>(save1_ns / 1000000), static_cast<long long>(delay_ms),
      static_cast<long long>(max_delay_ns / 1000000), saved2 ? " (after it returned)" : "",
      committed2
          ? "committed"
          : (before_record ? "not committed (killed before its save record)" : "not committed"),
      outcomes.c_str(), static_cast<long long>(expect_step));
}

// Rank 0 is SIGKILLed at a random point of Save(2) (before, during or after
// its commit; delays up to 1.5x its measured Save(1)), T times per mode, with
// a 1-32 MiB tensor in the state. Whatever the timing: no waiter returns OK
// for a step that is not committed (file lock: "writer died" within 1 s;
// otherwise the deadline); a waiter told OK
// finds the step whole; step 1 always verifies; a restart loads the same
// step (2 if committed, else 1) on every rank.
TEST_P(TorchRanksTest, RankZeroKilledAtRandomPointsNeverLetsAWaiterPassEarly) {
  const int trials = mode() == WaitMode::kFileLock ? 10 : 3;
  constexpr milliseconds kWaitTimeout(4000);  // also Save(1)'s, on a loaded machine
  KillTally tally;
  for (int trial = 0; trial < trials; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    Launch launch = NewLaunch(/*agent_serves=*/true);  // kStore: the store outlives rank 0
    launch.path = tmp_.Sub("store-" + std::to_string(trial));
    RunRandomKillTrial(launch, NewLaunch(), trial, kWaitTimeout, &tally);
    if (HasFailure()) return;
  }
  std::string waiters;
  for (const auto& [code, n] : tally.waiters)
    waiters += (waiters.empty() ? "" : ", ") + std::to_string(n) + " " + code;
  std::string before_record;
  if (mode() == WaitMode::kFileLock)
    before_record = " (" + std::to_string(tally.before_record) + " before rank 0's save record)";
  std::printf(
      "random kills (%s): %d trials, %d before commit%s, %d after; kill delays %lld-%lld ms; "
      "waiters: %s\n",
      mode_name().c_str(), tally.trials, tally.before_commit, before_record.c_str(),
      tally.after_commit, static_cast<long long>(tally.min_delay_ms),
      static_cast<long long>(tally.max_delay_ms), waiters.c_str());
}

}  // namespace
}  // namespace ckptio::torch_ranks_testing
