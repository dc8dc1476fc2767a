// Checkpointer::SaveAsync with two ranks in one process: a save rank 0
// abandons, striped saves (a missing, failing or oversized stripe, ranks
// with different states, abandoned steps), and CUDA tensors staged through
// pinned memory. See torch_async_test_util.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "torch_async_test_util.h"

namespace ckptio::torch_async_testing {
namespace {

class LosesTheSaveLock : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    auto lock = ForwardingBackend::TryLock(key, mode);
    if (!lock.ok() || key != ".save-lock") return lock;
    real_ = std::move(*lock);
    struct StandIn : BackendLock {};
    return std::unique_ptr<BackendLock>(std::make_unique<StandIn>());
  }
  Result<bool> IsLocked(std::string_view key) override {
    if (key == ".save-lock" && lost_) return false;
    return ForwardingBackend::IsLocked(key);
  }
  void Lose() {
    real_.reset();
    lost_ = true;
  }

 private:
  std::unique_ptr<BackendLock> real_;
  std::atomic<bool> lost_{false};
};

// Rank 0 gives up on a save before it begins (here: its save lock was lost
// to another holder, who keeps it past rank 0's timeout). The other rank
// gets rank 0's error at once, not after its own, much longer deadline;
// plain and striped.
TEST_F(AsyncSaveTest, ASaveRankZeroAbandonsReachesTheOtherRankAtOnce) {
  for (bool stripe : {false, true}) {
    SCOPED_TRACE(stripe ? "striped" : "plain");
    const std::string store = dir_.Sub(stripe ? "striped" : "plain");
    auto losing = std::make_shared<LosesTheSaveLock>(NewPosixBackend(store).value());
    auto open = [&](int r, std::chrono::milliseconds timeout) {
      CheckpointerOptions o;
      o.wait = WaitOn::FileLock();
      o.timeout = timeout;
      o.stripe = stripe;
      if (r == 0) o.backend = losing;
      return RankOfTwo(r, "abandon-test", store, o);
    };
    auto c0 = open(0, 300ms), c1 = open(1, 20s);
    ASSERT_TRUE(c0 && c1);
    losing->Lose();
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, NewPosixBackend(store));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto held, other->TryLock(".save-lock", LockMode::kExclusive));
    Net net;
    State state{{"model", net}};
    Status s1;
    auto t0 = std::chrono::steady_clock::now();
    std::thread rank1([&] { s1 = c1->Save(1, state); });
    Status s0 = c0->Save(1, state);
    rank1.join();
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_FALSE(s0.ok()) << "rank 0 took a lock that is held";
    EXPECT_EQ(s1.code(), s0.code()) << s1;
    EXPECT_LT(took, 10s) << "rank 1 waited for its own deadline";
  }
}

// A rank that waits in the background for rank 0's commit (SaveAsync) has
// nothing to finish: closing its Checkpointer ends that wait at once, its
// future saying so, instead of holding the close up to the deadline (a
// trainer that gives up on Ctrl-C exits promptly). Rank 0 never saves here.
TEST_F(AsyncSaveTest, ClosingAWaitingRanksCheckpointerEndsItsBackgroundWait) {
  Net net;
  State state{{"model", net}};
  auto [c0, c1, waiting] = RankOneWaiting("close-test", state);
  ASSERT_TRUE(c0 && c1);
  EXPECT_EQ(waiting.wait_for(200ms), std::future_status::timeout) << "rank 0 never committed";
  const auto t0 = std::chrono::steady_clock::now();
  c1.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "the close waited for the deadline";
  ASSERT_EQ(waiting.wait_for(0s), std::future_status::ready);
  Status s = waiting.get();
  EXPECT_EQ(s.code(), Code::kAborted) << s;
  EXPECT_NE(s.message().find("closed while waiting for rank 0 to commit step 1"), std::string::npos)
      << s;
}

// A rank's next call that must first wait for its background wait for rank
// 0's commit (SaveAsync) ends with the caller's WaitInterrupt (Ctrl-C in
// Python) within the interrupt's polling, not at the deadline, and ends the
// background wait too, its future saying so; the rank's saves after that
// wait again as they should.
TEST_F(AsyncSaveTest, AnInterruptedCallEndsAWaitingRanksBackgroundWait) {
  Net net;
  State state{{"model", net}};
  auto [c0, c1, waiting] = RankOneWaiting("interrupt-test", state);
  ASSERT_TRUE(c0 && c1);
  EXPECT_EQ(waiting.wait_for(200ms), std::future_status::timeout)
      << "the background wait ended, though rank 0 never saves";
  const auto t0 = std::chrono::steady_clock::now();
  Status s;
  {
    WaitInterrupt interrupt([&]() -> Status {
      return std::chrono::steady_clock::now() - t0 > 300ms
                 ? Status(Code::kAborted, "interrupted by the test")
                 : OkStatus();
    });
    s = c1->Save(2, state);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 5s) << "the interrupted call waited for rank 0's deadline";
  EXPECT_EQ(s.code(), Code::kAborted) << s;
  EXPECT_EQ(s.message(), "interrupted by the test");
  ASSERT_EQ(waiting.wait_for(0s), std::future_status::ready);
  Status background = waiting.get();
  EXPECT_EQ(background.code(), Code::kAborted) << background;
  EXPECT_NE(background.message().find("interrupted while waiting for rank 0 to commit step 1"),
            std::string::npos)
      << background;
  // Not a closed Checkpointer: the next background wait waits.
  std::future<Status> next = c1->SaveAsync(3, state);
  EXPECT_EQ(next.wait_for(500ms), std::future_status::timeout)
      << "the next wait ended at once: " << next.get();
}

// A rank whose background wait for rank 0's commit ran out of its own time
// before rank 0 committed: its next call looks once more and goes on (here a
// Load, which the ranks then make together), instead of returning the stale
// error while rank 0 loads alone.
TEST_F(AsyncSaveTest, AWaitThatTimedOutBeforeALateCommitDoesNotSplitTheNextLoad) {
  for (WaitOn wait : {WaitOn::Manifest(), WaitOn::FileLock()}) {
    const std::string store = dir_.Sub(std::string(WaitModeName(wait.mode())));
    CheckpointerOptions o;
    o.wait = wait;
    o.timeout = 20s;
    auto c0 = RankOfTwo(0, "late-commit-test", store, o);
    o.timeout = 2s;
    auto c1 = RankOfTwo(1, "late-commit-test", store, o);
    ASSERT_TRUE(c0 && c1);
    Net net;
    State state{{"model", net}};
    Status waited = c1->SaveAsync(1, state).get();
    EXPECT_EQ(waited.code(), Code::kDeadlineExceeded) << waited;
    CKPTIO_ASSERT_OK(c0->Save(1, state));  // committed after rank 1 stopped waiting
    Net net0, net1;
    State state0{{"model", net0}}, state1{{"model", net1}};
    Result<LoadResult> loaded1 = Status(Code::kInternal, "not loaded");
    std::thread rank1([&] { loaded1 = c1->Load(state1); });
    auto loaded0 = c0->Load(state0);
    rank1.join();
    ASSERT_TRUE(loaded0.ok()) << loaded0.status();
    ASSERT_TRUE(loaded1.ok()) << "rank 1 left rank 0 to load alone: " << loaded1.status();
    EXPECT_EQ(loaded1->step, loaded0->step);
  }
}

// A striped save whose rank 2 never saves: rank 0's error names rank 2 and
// the save's timeout, even though rank 1's part came late and left the wait
// for rank 2 only what remained of the deadline.
TEST_F(AsyncSaveTest, AMissingStripeIsReportedWithTheSavesTimeout) {
  auto open = [&](int r) {
    CheckpointerOptions o;
    o.timeout = 4000ms;
    o.stripe = true;
    return RankOf(r, 3, "stripe-missing-test", dir_.Sub("store"), o);
  };
  auto c0 = open(0), c1 = open(1);
  ASSERT_TRUE(c0 && c1);
  Net net;
  State state{{"model", net}};
  Status s1;
  std::thread rank1([&] {
    std::this_thread::sleep_for(2000ms);  // late, but in time
    s1 = c1->Save(1, state);
  });
  Status s0 = c0->Save(1, state);
  rank1.join();
  EXPECT_EQ(s0.code(), Code::kDeadlineExceeded) << s0;
  EXPECT_NE(s0.message().find("rank 2's stripe"), std::string::npos) << s0;
  EXPECT_NE(s0.message().find("within 4000 ms"), std::string::npos) << s0;
  EXPECT_FALSE(s1.ok()) << "rank 1 saw a save commit without rank 2's part";
}

// Rank 0's backend for a death inside a striped save: its publishing of the
// go-ahead waits at a gate, and Die() drops its exclusive save lock, as the
// kernel does when the process holding it dies.
class DyingBeforeTheGoAhead : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    auto lock = ForwardingBackend::TryLock(key, mode);
    if (!lock.ok() || key != ".save-lock" || mode != LockMode::kExclusive) return lock;
    std::lock_guard<std::mutex> l(mu_);
    save_lock_ = std::move(*lock);
    struct StandIn : BackendLock {  // releases the real one, unless Die() did
      DyingBeforeTheGoAhead* owner;
      explicit StandIn(DyingBeforeTheGoAhead* o) : owner(o) {}
      ~StandIn() override { owner->Die(); }
    };
    return std::unique_ptr<BackendLock>(std::make_unique<StandIn>(this));
  }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    if (key.find("decision-stripe-go-") != std::string_view::npos) {
      std::unique_lock<std::mutex> l(mu_);
      at_gate_ = true;
      cv_.notify_all();
      cv_.wait(l, [&] { return open_; });
    }
    return ForwardingBackend::NewObject(key, mode);
  }
  bool WaitAtGate(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, timeout, [&] { return at_gate_; });
  }
  void Die() {
    std::lock_guard<std::mutex> l(mu_);
    save_lock_.reset();
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<BackendLock> save_lock_;
  bool at_gate_ = false, open_ = false;
};

// File-lock mode, striped: rank 0 dies after taking the save (lock held,
// record "saving") but before its go-ahead. The other rank, waiting for the
// go-ahead, says so within a second, not at its deadline.
TEST_F(AsyncSaveTest, AStripedRankLearnsOfRankZerosDeathBeforeTheGoAhead) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto posix, NewPosixBackend(dir_.Sub("store")));
  auto dying = std::make_shared<DyingBeforeTheGoAhead>(std::move(posix));
  CheckpointerOptions o;
  o.wait = WaitOn::FileLock();
  o.timeout = 8s;
  o.stripe = true;
  auto c1 = RankOfTwo(1, "stripe-death-test", dir_.Sub("store"), o);
  o.backend = dying;
  auto c0 = RankOfTwo(0, "stripe-death-test", dir_.Sub("store"), o);
  ASSERT_TRUE(c0 && c1);
  Net net;
  State state{{"model", net}};
  Status s0, s1;
  std::thread rank0([&] { s0 = c0->Save(1, state); });
  if (!dying->WaitAtGate(5s)) {
    dying->Open();
    rank0.join();
    FAIL() << "rank 0 never published its go-ahead: " << s0;
  }
  std::thread rank1([&] { s1 = c1->Save(1, state); });
  std::this_thread::sleep_for(200ms);
  dying->Die();
  const auto died = std::chrono::steady_clock::now();
  rank1.join();
  const auto took = std::chrono::steady_clock::now() - died;
  dying->Open();  // the "dead" rank 0 goes on, and finds rank 1's error for its part
  rank0.join();
  EXPECT_EQ(s1.code(), Code::kAborted) << s1;
  EXPECT_NE(s1.message().find("writer died before committing step 1"), std::string::npos) << s1;
  EXPECT_LT(took, 3s) << "rank 1 waited for its deadline: " << s1;
  EXPECT_FALSE(s0.ok());
}

// In a striped save rank 0 waits for every rank's part. A rank that gives
// up first (its wait for rank 0's go-ahead timed out; or, at its next save,
// the previous one's error) sends an error in place of its part, so rank 0
// fails at once instead of at its own deadline.
TEST_F(AsyncSaveTest, AStripedRankThatGivesUpSendsAnErrorForItsPart) {
  auto open = [&](int r, std::chrono::milliseconds timeout) {
    CheckpointerOptions o;
    o.timeout = timeout;
    o.stripe = true;
    return RankOfTwo(r, "stripe-give-up-test", dir_.Sub("store"), o);
  };
  auto c1 = open(1, 300ms), c0 = open(0, 20s);
  ASSERT_TRUE(c0 && c1);
  Net net;
  State state{{"model", net}};
  EXPECT_EQ(c1->SaveAsync(1, state).get().code(), Code::kDeadlineExceeded);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(c0->Save(1, state).code(), Code::kDeadlineExceeded) << "rank 1's error";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "rank 0 waited for its own deadline";
  // Rank 1's next save returns that error (once) without saving: its part
  // of save 2 is that error too.
  EXPECT_EQ(c1->Save(2, state).code(), Code::kDeadlineExceeded);
  t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(c0->Save(2, state).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "rank 0 waited for its own deadline";
}

TEST_F(AsyncSaveTest, StripedSaveAsyncAcrossTwoRanksOfOneProcess) {
  // Both ranks stage their part and return; their background threads stripe
  // and commit; a change made right after the calls is not in the step.
  auto ranks = TwoRanks("striped-async-test", /*stripe=*/true);
  auto& c0 = ranks.first;
  auto& c1 = ranks.second;
  ASSERT_TRUE(c0 && c1);
  Net net;  // both "ranks" save the same module, as DDP replicas would
  State state{{"model", net}};
  const auto snap = Snapshot(net);
  auto f1 = c1->SaveAsync(3, state);
  auto f0 = c0->SaveAsync(3, state);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net.parameters()) p.zero_();
  }
  CKPTIO_ASSERT_OK(f0.get());
  CKPTIO_ASSERT_OK(f1.get());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, c0->store().OpenStep(3));
  CKPTIO_EXPECT_OK(reader->Verify());
  EXPECT_NE(reader->manifest().Find("model.part-1.safetensors"), nullptr) << "rank 1 wrote no part";
  EXPECT_EQ(reader->manifest().metadata.count("ckptio.part.model.part-1.safetensors"), 1u);
  // Every rank loads (rank 0 decides, rank 1 waits for its decision).
  Net back0, back1;
  Status loaded0;
  std::thread rank0([&] {
    State into{{"model", back0}};
    auto got = c0->Load(into);
    loaded0 = got.status();
  });
  State into1{{"model", back1}};
  auto got1 = c1->Load(into1);
  rank0.join();
  CKPTIO_ASSERT_OK(loaded0);
  ASSERT_TRUE(got1.ok()) << got1.status();
  EXPECT_TRUE(SameAs(back0, snap));
  EXPECT_TRUE(SameAs(back1, snap));
  // The next striped save retracts its own records and the load's decision.
  auto g1 = c1->SaveAsync(5, state);
  auto g0 = c0->SaveAsync(5, state);
  CKPTIO_ASSERT_OK(g0.get());
  CKPTIO_ASSERT_OK(g1.get());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto records, c0->store().backend().List(".coord/"));
  EXPECT_EQ(records, std::vector<std::string>{".coord/save"});
}

TEST_F(AsyncSaveTest, AStripedSaveWhosePartFailsLeavesNothingAndARetryWorks) {
  // Rank 0 cannot write its part; rank 1 writes its own. Rank 0 still takes
  // rank 1's receipt before it gives up, so the step is abandoned whole:
  // nothing is left in it and the same step saves at once after.
  auto ranks = TwoRanks("striped-failure-test", /*stripe=*/true, gate_);
  auto& c0 = ranks.first;
  auto& c1 = ranks.second;
  ASSERT_TRUE(c0 && c1);
  Net net;
  State state{{"model", net}};
  gate_->FailNewObjects(true);
  auto f1 = c1->SaveAsync(5, state);
  auto f0 = c0->SaveAsync(5, state);
  EXPECT_EQ(f0.get().code(), Code::kResourceExhausted);
  EXPECT_FALSE(f1.get().ok()) << "rank 1 reported a step rank 0 could not commit";
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto keys, c1->store().backend().List("step-000000000005/"));
  EXPECT_TRUE(keys.empty()) << "left in the abandoned step: " << keys.front();
  // Rank 1's receipt came (rank 0 failed, not rank 1): the save's records
  // are retracted all the same.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto records, c0->store().backend().List(".coord/"));
  EXPECT_EQ(records, std::vector<std::string>{".coord/save"});
  gate_->FailNewObjects(false);
  // The next calls report the failure once (SaveAsync's contract); then the
  // same step saves.
  EXPECT_FALSE(c0->Save(6, state).ok());
  EXPECT_FALSE(c1->Save(6, state).ok());
  f1 = c1->SaveAsync(5, state);
  f0 = c0->SaveAsync(5, state);
  CKPTIO_EXPECT_OK(f0.get());
  CKPTIO_EXPECT_OK(f1.get());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, c0->store().OpenStep(5));
  CKPTIO_EXPECT_OK(reader->Verify());
}

// A module of many small parameters, named p0, p1...; `sizes[i]` elements
// each (all of them `size` when `sizes` is empty).
struct Many : torch::nn::Module {
  Many(int n, std::vector<int64_t> sizes = {}) {
    for (int i = 0; i < n; ++i)
      register_parameter(
          "p" + std::to_string(i),
          torch::full({sizes.empty() ? 4 : sizes[static_cast<size_t>(i)]}, static_cast<float>(i)));
  }
};

// A receipt lists each tensor of the rank's part: with 2,000 tensors, rank
// 1's (about 1,000 of them) is well over 64 KiB. The file-based wait modes
// must still take it (not poll for it until the deadline).
TEST_F(AsyncSaveTest, AStripedSaveWithAReceiptOver64KiBCommits) {
  for (WaitMode mode : {WaitMode::kManifest, WaitMode::kFileLock}) {
    const std::string name = std::string(WaitModeName(mode));
    SCOPED_TRACE(name);
    const std::string store = dir_.Sub("big-receipt-" + name);
    CheckpointerOptions o;
    o.wait = mode == WaitMode::kFileLock ? WaitOn::FileLock() : WaitOn::Manifest();
    o.timeout = 5s;  // short: without the fix, rank 0 waits for the receipt until then
    o.stripe = true;
    auto c1 = RankOfTwo(1, "big-receipt-" + name, store, o);
    auto c0 = RankOfTwo(0, "big-receipt-" + name, store, o);
    ASSERT_TRUE(c0 && c1);
    Many net(2000);
    State state{{"model", net}};
    Status s1;
    std::thread rank1([&] { s1 = c1->Save(1, state); });
    Status s0 = c0->Save(1, state);
    rank1.join();
    CKPTIO_ASSERT_OK(s0);
    CKPTIO_ASSERT_OK(s1);
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, c0->store().OpenStep(1));
    CKPTIO_EXPECT_OK(reader->Verify());
    ASSERT_NE(reader->manifest().Find("model.part-1.safetensors"), nullptr);
    Many back(2000);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : back.parameters()) p.zero_();
    }
    State into{{"model", back}};
    LoadOptions lo;
    lo.step = 1;
    Status l0;
    std::thread load1([&] {
      Many back1(2000);
      State into1{{"model", back1}};
      l0 = c1->Load(into1, lo).status();
    });
    auto got = c0->Load(into, lo);
    load1.join();
    ASSERT_TRUE(got.ok()) << got.status();
    CKPTIO_EXPECT_OK(l0);
    EXPECT_TRUE(SameAs(back, Snapshot(net)));
  }
}

// The ranks of a striped save must hold the same state: here rank 1's p1
// has another shape. Each rank's split names the same part objects, but
// rank 1's part holds a tensor rank 0 did not expect of it; rank 0 fails
// the save, naming the rank and the tensor, and commits nothing.
TEST_F(AsyncSaveTest, AStripedSaveOfRanksWithDifferentStatesFailsAndCommitsNothing) {
  CheckpointerOptions o;
  o.timeout = 20s;
  o.stripe = true;
  auto c1 = RankOfTwo(1, "differ-test", dir_.Sub("store"), o);
  auto c0 = RankOfTwo(0, "differ-test", dir_.Sub("store"), o);
  ASSERT_TRUE(c0 && c1);
  // Greedy split, largest first: rank 0 gets p0 and p3, rank 1 p1 and p2,
  // on both ranks.
  Many net0(4, {100, 90, 80, 70}), net1(4, {100, 95, 80, 70});
  State state0{{"model", net0}}, state1{{"model", net1}};
  Status s1;
  std::thread rank1([&] { s1 = c1->Save(1, state1); });
  Status s0 = c0->Save(1, state0);
  rank1.join();
  EXPECT_FALSE(s0.ok()) << "rank 0 committed a step whose parts disagree";
  EXPECT_NE(s0.message().find("ranks do not hold the same state"), std::string::npos) << s0;
  EXPECT_NE(s0.message().find("rank 1"), std::string::npos) << s0;
  EXPECT_NE(s0.message().find("p1"), std::string::npos) << s0;
  EXPECT_FALSE(s1.ok()) << "rank 1 reported a step rank 0 did not commit";
  EXPECT_EQ(c0->store().OpenStep(1).status().code(), Code::kNotFound);
  auto latest = c0->store().ReadLatest();
  EXPECT_TRUE(!latest.ok() || !latest->has_value()) << "LATEST names a step";
}

// A backend whose first published record (rank 1's receipt) fails to
// write: the rank has written its part, but rank 0 never learns of it.
class FailFirstRecord : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    if (key.find(".coord/decision-") != std::string_view::npos && !failed_.exchange(true))
      return Status(Code::kUnavailable, "injected: the receipt could not be written");
    return ForwardingBackend::NewObject(key, mode);
  }

 private:
  std::atomic<bool> failed_{false};
};

// Rank 1 wrote its part, but its receipt never reached rank 0 (it sent its
// error instead): rank 0 abandons the step and clears it whole, the part it
// never learnt of included; the step saves again at once.
TEST_F(AsyncSaveTest, AnAbandonedStripedStepLeavesNoOrphanedParts) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto posix, NewPosixBackend(dir_.Sub("store")));
  CheckpointerOptions o;
  o.timeout = 20s;
  o.stripe = true;
  o.backend = std::make_shared<FailFirstRecord>(std::shared_ptr<StorageBackend>(std::move(posix)));
  auto c1 = RankOfTwo(1, "orphan-test", dir_.Sub("store"), o);
  o.backend = nullptr;
  auto c0 = RankOfTwo(0, "orphan-test", dir_.Sub("store"), o);
  ASSERT_TRUE(c0 && c1);
  Net net;
  State state{{"model", net}};
  Status s1;
  std::thread rank1([&] { s1 = c1->Save(1, state); });
  Status s0 = c0->Save(1, state);
  rank1.join();
  EXPECT_NE(s0.message().find("injected"), std::string::npos) << "not rank 1's error: " << s0;
  EXPECT_FALSE(s1.ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto keys, c0->store().backend().List("step-000000000001/"));
  EXPECT_TRUE(keys.empty()) << "left in the abandoned step: " << keys.front();
  rank1 = std::thread([&] { s1 = c1->Save(1, state); });
  s0 = c0->Save(1, state);
  rank1.join();
  CKPTIO_EXPECT_OK(s0);
  CKPTIO_EXPECT_OK(s1);
}

TEST_F(AsyncSaveTest, CudaTensorsAreStagedThroughPinnedMemory) {
  CKPTIO_REQUIRE_CUDA();
  Net net;
  net.to(torch::Device("cuda:0"));
  State state{{"model", net}};
  auto ckpt = Open();
  const auto snap = Snapshot(net);
  gate_->Close();
  auto saved = ckpt->SaveAsync(1, state);
  EXPECT_FALSE(Ready(saved));
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net.parameters()) p.fill_(3);
  }
  gate_->Open();
  CKPTIO_ASSERT_OK(saved.get());
  Net back;
  back.to(torch::Device("cuda:0"));
  State into{{"model", back}};
  LoadOptions o;
  o.map_location = MapLocation::To("cuda:0");
  ASSERT_TRUE(ckpt->Load(into, o).ok());
  for (const auto& p : back.parameters()) EXPECT_TRUE(p.is_cuda());
  EXPECT_TRUE(SameAs(back, snap));
}

}  // namespace
}  // namespace ckptio::torch_async_testing
