// The Checkpointer across real processes, every wait mode: non-blocking
// saves' tickets, loads that wait for a slow rank 0's decision, and rank 0
// SIGKILLed before it made one. See torch_ranks_test_util.h.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "torch_ranks_test_util.h"

namespace ckptio::torch_ranks_testing {
namespace {

// ---------------------------------------------------------------- d. waiting ranks save async

// The waiting ranks' SaveAsync returns while rank 0 has not begun to save
// (it saves only once every waiter's call returned, and its future was seen
// pending); the future is never ready before rank 0 began; it holds OK once
// committed, and the step is then theirs bit-for-bit.
TEST_P(TorchRanksTest, WaitingRanksSaveAsyncReturnsAtOnceAndResolvesAtTheCommit) {
  constexpr int64_t kStep = 1;
  const Launch launch = NewLaunch();
  Ranks ranks(launch, [&](RankEnv& me) -> int {
    Trainee t(kInitSeed);
    auto ckpt = me.Open(kTimeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    t.Train(kStep);
    me.Say("ready");
    if (me.Hear(milliseconds(20000)) != std::optional<std::string>("go"))
      return Fail(me.rank, kExitPipe, "no go");
    if (me.rank == 0) {
      if (me.Hear(milliseconds(30000)) != std::optional<std::string>("save"))
        return Fail(0, kExitPipe, "no save");
      me.Say("saving " + std::to_string(NowNs()));
      Status s = (*ckpt)->SaveAsync(kStep, state).get();
      if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
      return kExitOk;
    }
    auto ready = [](const std::future<Status>& f) {
      return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    };
    const int64_t t0 = NowNs();
    std::future<Status> saved = (*ckpt)->SaveAsync(kStep, state);
    const int64_t t1 = NowNs();
    const bool first = ready(saved);
    me.Say("returned " + std::to_string((t1 - t0) / 1000) + " " + std::to_string(first));
    std::this_thread::sleep_for(milliseconds(100));
    const bool second = ready(saved);
    const int64_t t_second = NowNs();
    Status s = saved.get();
    const int64_t t_wait = NowNs();
    me.Say("polled " + std::to_string(second) + " " + std::to_string(t_second));
    me.Say(FormatReport(s, t_wait));
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    s = CheckStepIsMine(launch.path, kStep, *t.model);
    if (!s.ok()) return Fail(me.rank, kExitBadStep, "after Wait: " + s.ToString());
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  for (int r = 0; r < kWorld; ++r)
    ASSERT_TRUE(ranks.Await(r, "ready", milliseconds(20000)).has_value())
        << "rank " << r << " exit " << ranks.child(r).ExitCode(milliseconds(2000));
  for (int r = 0; r < kWorld; ++r) ranks.Tell(r, "go");
  // Rank 0 waits for "save": a waiter whose SaveAsync blocked until rank 0's
  // save would never say "returned".
  int64_t max_return_us = 0;
  for (int r = 1; r < kWorld; ++r) {
    auto p = ranks.Await(r, "returned", milliseconds(20000));
    ASSERT_TRUE(p.has_value() && p->size() == 2u)
        << "rank " << r << "'s SaveAsync did not return before rank 0 saved; exit "
        << ranks.child(r).ExitCode(milliseconds(2000));
    max_return_us = std::max<int64_t>(max_return_us, std::stoll((*p)[0]));
    EXPECT_EQ((*p)[1], "0") << "rank " << r << ": future ready before rank 0 began to save";
  }
  ranks.Tell(0, "save");
  auto saving = ranks.Await(0, "saving", milliseconds(10000));
  ASSERT_TRUE(saving.has_value() && saving->size() == 1u);
  const int64_t save_ns = std::stoll((*saving)[0]);
  for (int r = 1; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    auto p = ranks.Await(r, "polled", milliseconds(20000));
    ASSERT_TRUE(p.has_value() && p->size() == 2u) << ranks.child(r).ExitCode(milliseconds(2000));
    if ((*p)[0] == "1") {
      EXPECT_GE(std::stoll((*p)[1]), save_ns) << "future ready before rank 0 saved";
    }
    auto rep = ParseReport(ranks.AwaitLine(r, "ret", milliseconds(20000)));
    ASSERT_TRUE(rep.has_value());
    EXPECT_EQ(rep->code, Code::kOk) << rep->message;
    EXPECT_GE(rep->t_ns, save_ns) << "the future resolved before rank 0 began to save";
  }
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: SaveAsync returned in <= %lld us on %d waiters, before rank 0 began "
      "to save; the future pending until then, OK after the commit, step verified bit-for-bit\n",
      mode_name().c_str(), static_cast<long long>(max_return_us), kWorld - 1);
}

// ---------------------------------------------------------------- e. slow rank 0

// Rank 0 sleeps 500 ms before Load: the others' Load waits for its
// decision and loads the same step.
TEST_P(TorchRanksTest, LoadWaitsForASlowRankZerosDecision) {
  constexpr int64_t kSteps = 2;
  const Launch launch = NewLaunch();
  Ranks ranks(launch, [&](RankEnv& me) -> int {
    Trainee t(kInitSeed);
    auto ckpt = me.Open(kTimeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    for (int64_t step = 1; step <= kSteps; ++step) {
      t.Train(step);
      Status s = (*ckpt)->Save(step, state);
      if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    }
    me.Say("trained " + t.hash());
    if (me.Hear(milliseconds(20000)) != std::optional<std::string>("go"))
      return Fail(me.rank, kExitPipe, "no go");
    if (me.rank == 0) {
      std::this_thread::sleep_for(milliseconds(500));
      me.Say("loading " + std::to_string(NowNs()));
    }
    const int64_t t0 = NowNs();
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    auto got = (*ckpt)->Load(into);
    const int64_t t1 = NowNs();
    if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
    if (!got->step.has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    me.Say(FormatLoaded(*got, fresh.hash()));
    me.Say("took " + std::to_string(t0) + " " + std::to_string(t1));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  std::string trained;
  for (int r = 0; r < kWorld; ++r) {
    auto tr = ranks.Await(r, "trained", milliseconds(20000));
    ASSERT_TRUE(tr.has_value() && tr->size() == 1u)
        << "rank " << r << " exit " << ranks.child(r).ExitCode(milliseconds(2000));
    if (r == 0) trained = (*tr)[0];
    EXPECT_EQ((*tr)[0], trained) << "rank " << r << " trained differently (setup)";
  }
  for (int r = 0; r < kWorld; ++r) ranks.Tell(r, "go");
  auto loading = ranks.Await(0, "loading", milliseconds(10000));
  ASSERT_TRUE(loading.has_value() && loading->size() == 1u);
  const int64_t rank0_ns = std::stoll((*loading)[0]);
  std::vector<std::string> loaded(kWorld);
  int64_t min_wait_ms = -1;
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    auto ld = ranks.Await(r, "loaded", milliseconds(20000));
    ASSERT_TRUE(ld.has_value()) << ranks.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 4u) << Join(*ld);
    loaded[r] = Join(*ld);
    EXPECT_EQ((*ld)[0], std::to_string(kSteps));
    EXPECT_EQ((*ld)[3], trained);
    auto took = ranks.Await(r, "took", milliseconds(1000));
    ASSERT_TRUE(took.has_value() && took->size() == 2u);
    if (r == 0) continue;
    EXPECT_GE(std::stoll((*took)[1]), rank0_ns) << "loaded before rank 0 began to decide";
    const int64_t waited_ms = (std::stoll((*took)[1]) - std::stoll((*took)[0])) / 1000000;
    if (min_wait_ms < 0 || waited_ms < min_wait_ms) min_wait_ms = waited_ms;
  }
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(loaded[r], loaded[0]) << "rank " << r;
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: rank 0 slept 500 ms before Load; %d ranks waited >= %lld ms for its "
      "decision; all loaded step %lld, identical params\n",
      mode_name().c_str(), kWorld - 1, static_cast<long long>(min_wait_ms),
      static_cast<long long>(kSteps));
}

// A job restarts from step 1, and rank 0 is SIGKILLed after its Open,
// before it decides which step to load, while the others wait in Load for
// that decision. File lock: rank 0 holds the save lock from its Open on, so
// they return ABORTED "writer died" within 1 s of the kill; the other modes
// wait to the deadline. Either way none loads anything, and a relaunch
// loads step 1 on every rank.
TEST_P(TorchRanksTest, RankZeroKilledBeforeItsLoadDecisionAtStartUp) {
  constexpr milliseconds kWaitTimeout(4000);
  std::string h1;
  {
    Ranks first(NewLaunch(), [&](RankEnv& me) -> int {
      Trainee t(kInitSeed);
      auto ckpt = me.Open(kTimeout);
      if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
      State state = t.state();
      t.Train(1);
      Status s = (*ckpt)->Save(1, state);
      if (!s.ok()) return Fail(me.rank, kExitSaveFailed, "step 1: " + s.ToString());
      me.Say("trained1 " + t.hash());
      return kExitOk;
    });
    ASSERT_TRUE(first.started());
    auto t1 = first.Await(0, "trained1", milliseconds(20000));
    ASSERT_TRUE(t1.has_value() && t1->size() == 1u);
    h1 = (*t1)[0];
    EXPECT_ALL_RANKS_EXIT_OK(first, milliseconds(30000));
    if (HasFailure()) return;
  }

  // kStore: an agent serves the TCPStore, so that it outlives rank 0.
  Ranks ranks(NewLaunch(/*agent_serves=*/true), [&](RankEnv& me) -> int {
    auto ckpt = me.Open(kWaitTimeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    if (me.rank == 0) {
      me.Say("opened");
      return SleepUntilKilled(60);
    }
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    me.Say("waiting " + std::to_string(NowNs()));
    auto got = (*ckpt)->Load(into);
    me.Say(FormatReport(got.ok() && !got->step.has_value()
                            ? Status(Code::kNotFound, "loaded nothing")
                            : got.status(),
                        NowNs()));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  ASSERT_TRUE(ranks.Await(0, "opened", milliseconds(20000)).has_value())
      << "rank 0 exit " << ranks.child(0).ExitCode(milliseconds(2000));
  std::vector<int64_t> wait_start(kWorld, 0);
  for (int r = 1; r < kWorld; ++r) {
    auto w = ranks.Await(r, "waiting", milliseconds(20000));
    ASSERT_TRUE(w.has_value() && w->size() == 1u) << "rank " << r;
    wait_start[r] = std::stoll((*w)[0]);
  }
  std::this_thread::sleep_for(milliseconds(100));  // the waiters are inside Load
  const int64_t kill_ns = NowNs();
  ASSERT_EQ(::kill(ranks.child(0).pid(), SIGKILL), 0);
  EXPECT_EQ(ranks.child(0).ExitCode(milliseconds(5000)), 128 + SIGKILL);
  int64_t slowest_ms = 0;
  for (int r = 1; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    auto rep = ParseReport(ranks.AwaitLine(r, "ret", kWaitTimeout + milliseconds(6000)));
    ASSERT_TRUE(rep.has_value()) << "no report from the waiter";
    slowest_ms = std::max(slowest_ms,
                          ExpectKilledRankZerosWaiter(mode(), *rep, "writer died before publishing",
                                                      kill_ns, wait_start[r], kWaitTimeout));
    if (rep->code == Code::kDeadlineExceeded) {  // names whom it waited for, and for what
      EXPECT_NE(rep->message.find("rank 0 did not say which step to load"), std::string::npos)
          << rep->message;
    }
  }
  auto codes = ranks.ExitCodes(milliseconds(10000));
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(codes[r], kExitOk) << "rank " << r;
  if (HasFailure()) return;

  Ranks again(NewLaunch(), LoadAndSay);
  ASSERT_TRUE(again.started());
  for (int r = 0; r < kWorld; ++r) {
    auto ld = again.Await(r, "loaded", milliseconds(30000));
    ASSERT_TRUE(ld.has_value()) << "relaunched rank " << r << " exit "
                                << again.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 4u) << Join(*ld);
    EXPECT_EQ((*ld)[0], "1") << "relaunched rank " << r;
    EXPECT_EQ((*ld)[3], h1) << "relaunched rank " << r << ": not step 1's parameters";
  }
  EXPECT_ALL_RANKS_EXIT_OK(again, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: rank 0 SIGKILLed at start-up before its load decision; %d waiters got "
      "%s (slowest %lld ms %s); relaunch: all %d ranks loaded step 1, identical params\n",
      mode_name().c_str(), kWorld - 1,
      mode() == WaitMode::kFileLock ? "ABORTED writer died" : "DEADLINE_EXCEEDED",
      static_cast<long long>(slowest_ms),
      mode() == WaitMode::kFileLock ? "after the kill" : "after starting to wait", kWorld);
}

}  // namespace
}  // namespace ckptio::torch_ranks_testing
