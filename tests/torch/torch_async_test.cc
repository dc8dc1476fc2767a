// Checkpointer::SaveAsync: the call returns once the state is staged, the
// commit happens in the background with every invariant, errors surface on
// the future and on the next call, the destructor waits.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "ckptio/ckptio.h"
#include "ckptio/posix_backend.h"
#include "ckptio/torch.h"
#include "cuda_test_util.h"
#include "memory_of_this_thread.h"
#include "test_util.h"

namespace ckptio {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

// A POSIX backend whose object writes wait at a gate until it opens, and
// which can fail every new object.
class GateBackend : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  void Close() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> l(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void FailNewObjects(bool fail) { fail_ = fail; }
  // Appends to objects whose key contains `marker` fail (disk full midway).
  void FailAppendsTo(std::string marker) { fail_appends_to_ = std::move(marker); }

  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return open_; });
    }
    if (fail_ && key.find("step-") == 0)
      return Status(Code::kResourceExhausted, "injected: no space left on device");
    auto w = ForwardingBackend::NewObject(key, mode);
    if (!w.ok() || fail_appends_to_.empty() || key.find(fail_appends_to_) == std::string_view::npos)
      return w;
    struct Failing : ObjectWriter {
      std::unique_ptr<ObjectWriter> inner;
      Status Append(const void*, size_t) override {
        return Status(Code::kResourceExhausted, "injected: no space left on device");
      }
      Status Commit() override { return inner->Commit(); }
    };
    auto failing = std::make_unique<Failing>();
    failing->inner = std::move(*w);
    return std::unique_ptr<ObjectWriter>(std::move(failing));
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  std::atomic<bool> fail_{false};
  std::string fail_appends_to_;
};

class AsyncSaveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto posix = NewPosixBackend(dir_.Sub("store"));
    ASSERT_TRUE(posix.ok()) << posix.status();
    gate_ = std::make_shared<GateBackend>(std::shared_ptr<StorageBackend>(std::move(*posix)));
  }

  std::unique_ptr<Checkpointer> Open(CheckpointerOptions o = {}) {
    o.backend = gate_;
    auto c = Checkpointer::Open(dir_.Sub("store"), RankInfo{}, std::move(o));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Rank r of a job of `world` ranks, on `store`.
  static std::unique_ptr<Checkpointer> RankOf(int r, int world, const std::string& job,
                                              const std::string& store, CheckpointerOptions o) {
    RankInfo rank;
    rank.world_size = rank.local_world_size = world;
    rank.rank = rank.local_rank = r;
    rank.job_id = job;
    auto c = Checkpointer::Open(store, rank, std::move(o));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  static std::unique_ptr<Checkpointer> RankOfTwo(int r, const std::string& job,
                                                 const std::string& store, CheckpointerOptions o) {
    return RankOf(r, 2, job, store, std::move(o));
  }

  // Ranks 0 and 1 of a job of two, as two Checkpointers of this process
  // over the manifest signal (rank 0 through `rank0_backend` when given).
  std::pair<std::unique_ptr<Checkpointer>, std::unique_ptr<Checkpointer>> TwoRanks(
      const std::string& job, bool stripe, std::shared_ptr<StorageBackend> rank0_backend = {}) {
    CheckpointerOptions o;
    o.timeout = 20s;
    o.stripe = stripe;
    auto c1 = RankOfTwo(1, job, dir_.Sub("store"), o);
    o.backend = std::move(rank0_backend);
    auto c0 = RankOfTwo(0, job, dir_.Sub("store"), o);
    if (!c0 || !c1) return {nullptr, nullptr};
    return {std::move(c0), std::move(c1)};
  }

  static bool Ready(const std::future<Status>& f) {
    return f.wait_for(0s) == std::future_status::ready;
  }

  TempDir dir_;
  std::shared_ptr<GateBackend> gate_;
};

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

void Train(Net& net, torch::optim::Optimizer& opt, int steps, uint64_t seed) {
  torch::manual_seed(seed);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    net.forward(torch::randn({16, 64})).pow(2).mean().backward();
    opt.step();
  }
}

std::vector<torch::Tensor> Snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

bool SameAs(torch::nn::Module& m, const std::vector<torch::Tensor>& snap) {
  auto now = m.parameters();
  if (now.size() != snap.size()) return false;
  for (size_t i = 0; i < now.size(); ++i)
    if (!torch::equal(now[i], snap[i])) return false;
  return true;
}

TEST_F(AsyncSaveTest, ReturnsBeforeTheCommitAndSavesTheStateAsItWasAtTheCall) {
  Net net;
  torch::optim::Adam adam(net.parameters(), torch::optim::AdamOptions(1e-2));
  Train(net, adam, 3, 1);
  torch::Tensor loose = torch::randn({1000});
  const torch::Tensor loose_then = loose.clone();
  State state{{"model", net}, {"optim", adam}, {"loose", loose}};
  state.SetInt("epoch", 4);
  auto ckpt = Open();
  const auto snap = Snapshot(net);

  gate_->Close();  // nothing can be written yet
  auto saved = ckpt->SaveAsync(10, state);
  EXPECT_FALSE(Ready(saved)) << "SaveAsync waited for the write";
  // Training goes on at once: weights, optimizer moments and tensors change.
  Train(net, adam, 2, 2);
  loose.fill_(7);
  EXPECT_FALSE(ckpt->store().OpenStep(10).ok()) << "visible before its commit";
  gate_->Open();
  CKPTIO_ASSERT_OK(saved.get());

  // Step 10 holds the state at the call, Adam moments included: one more
  // identical step from it matches a run that never changed.
  Net fresh;
  torch::optim::Adam fresh_adam(fresh.parameters(), torch::optim::AdamOptions(1e-2));
  torch::Tensor loose_back;
  State into{{"model", fresh}, {"optim", fresh_adam}, {"loose", loose_back}};
  auto got = ckpt->Load(into);
  ASSERT_TRUE(got.ok() && got->has_value()) << got.status();
  EXPECT_EQ((*got)->step, 10);
  EXPECT_TRUE(SameAs(fresh, snap));
  EXPECT_TRUE(torch::equal(loose_back, loose_then));
  EXPECT_EQ(into.GetInt("epoch"), 4);

  Net reference;
  torch::optim::Adam reference_adam(reference.parameters(), torch::optim::AdamOptions(1e-2));
  torch::Tensor unused;
  State ref_state{{"model", reference}, {"optim", reference_adam}, {"loose", unused}};
  ASSERT_TRUE(ckpt->Load(ref_state).ok());
  Train(fresh, fresh_adam, 1, 9);
  Train(reference, reference_adam, 1, 9);
  EXPECT_TRUE(SameAs(fresh, Snapshot(reference)));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, ckpt->store().OpenStep(10));
  CKPTIO_EXPECT_OK(reader->Verify());
}

// A write error inside LibTorch's optimizer archive (streamed to storage)
// is a failed save, not an abort: the zip writer must never see a short
// count, or its destructor throws and ends the process.
TEST_F(AsyncSaveTest, ADiskFullWhileArchivingAnOptimizerIsAFailedSave) {
  Net net;
  torch::optim::Adam adam(net.parameters());
  Train(net, adam, 1, 3);
  State state{{"model", net}, {"optim", adam}};
  auto ckpt = Open();
  gate_->FailAppendsTo("optim");
  Status s = ckpt->Save(1, state);
  EXPECT_EQ(s.code(), Code::kResourceExhausted) << s;
  EXPECT_FALSE(ckpt->store().OpenStep(1).ok());
  gate_->FailAppendsTo("");
  CKPTIO_EXPECT_OK(ckpt->Save(2, state));
}

TEST_F(AsyncSaveTest, AnErrorSurfacesOnTheFutureAndOnceOnTheNextCall) {
  Net net;
  State state{{"model", net}};
  auto ckpt = Open();
  gate_->FailNewObjects(true);
  auto failed = ckpt->SaveAsync(1, state);
  Status s = failed.get();
  EXPECT_EQ(s.code(), Code::kResourceExhausted) << s;
  gate_->FailNewObjects(false);
  // The next call reports it instead of doing its own work...
  Status next = ckpt->Save(2, state);
  EXPECT_EQ(next.code(), Code::kResourceExhausted) << next;
  EXPECT_NE(next.message().find("asynchronous save of step 1 failed"), std::string::npos) << next;
  EXPECT_FALSE(ckpt->store().OpenStep(2).ok());
  // ...once: the call after that works, and the failed step left nothing.
  CKPTIO_ASSERT_OK(ckpt->Save(2, state));
  CKPTIO_ASSERT_OK(ckpt->SaveAsync(3, state).get());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, ckpt->store().ListSteps());
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].step, 2);
  EXPECT_EQ(steps[1].step, 3);
}

TEST_F(AsyncSaveTest, TheNextCallAndTheDestructorWaitForTheSaveInFlight) {
  Net net;
  State state{{"model", net}};
  auto ckpt = Open();
  gate_->Close();
  auto first = ckpt->SaveAsync(1, state);
  std::thread opener([&] {
    std::this_thread::sleep_for(200ms);
    gate_->Open();
  });
  // A second SaveAsync waits for the first (they share the staging memory).
  auto second = ckpt->SaveAsync(2, state);
  EXPECT_TRUE(Ready(first)) << "the second call returned before the first save ended";
  CKPTIO_EXPECT_OK(first.get());
  CKPTIO_EXPECT_OK(second.get());
  opener.join();
  gate_->Close();
  auto third = ckpt->SaveAsync(3, state);
  std::thread opener2([&] {
    std::this_thread::sleep_for(200ms);
    gate_->Open();
  });
  ckpt.reset();  // waits for step 3
  EXPECT_TRUE(Ready(third)) << "the destructor returned before the save ended";
  opener2.join();
  CKPTIO_EXPECT_OK(third.get());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(dir_.Sub("store")));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest, store->OpenLatest());
  EXPECT_EQ(latest->step(), 3);
  CKPTIO_EXPECT_OK(latest->Verify());
}

TEST_F(AsyncSaveTest, AStateOverTheStagingLimitIsSavedSynchronously) {
  Net net;  // 64*128 + 128 + 128*8 + 8 floats: ~37 KiB
  State state{{"model", net}};
  CheckpointerOptions o;
  o.max_staging_bytes = 16 << 10;
  auto ckpt = Open(o);
  auto saved = ckpt->SaveAsync(1, state);
  EXPECT_TRUE(Ready(saved)) << "over the limit, the call itself saves";
  CKPTIO_EXPECT_OK(saved.get());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, ckpt->store().OpenStep(1));
  CKPTIO_EXPECT_OK(reader->Verify());
}

// max_staging_bytes bounds the optimizers' archives too. Net's tensors
// take ~37 KiB of staging; Adam's archive for all of them ~75 KiB, for fc2
// alone ~9 KiB. Over the limit the call saves by itself (it blocks on the
// closed gate), optimizers included; with room, it returns while the gate
// is closed.
TEST_F(AsyncSaveTest, OptimizerArchivesCountTowardTheStagingLimit) {
  struct Case {
    const char* what;
    uint64_t limit;
    bool split;  // two Adams: fc2's (small, archived first), then fc1's
    bool fits;
  };
  for (const Case& c : {
           // The archive alone fits in 96 KiB; with the tensors it does not.
           Case{"one Adam, 96 KiB", 96 << 10, false, false},
           Case{"one Adam, 1 MiB", 1 << 20, false, true},
           // The first archive fits, the second does not.
           Case{"two Adams, 64 KiB", 64 << 10, true, false},
       }) {
    SCOPED_TRACE(c.what);
    Net net;
    torch::optim::Adam fc1_adam(net.fc1->parameters()), fc2_adam(net.fc2->parameters());
    torch::optim::Adam all_adam(net.parameters());
    auto train = [&](Net& n, std::vector<torch::optim::Optimizer*> opts, uint64_t seed) {
      torch::manual_seed(seed);
      for (auto* o : opts) o->zero_grad();
      n.forward(torch::randn({16, 64})).pow(2).mean().backward();
      for (auto* o : opts) o->step();
    };
    std::vector<torch::optim::Optimizer*> opts =
        c.split ? std::vector<torch::optim::Optimizer*>{&fc2_adam, &fc1_adam}
                : std::vector<torch::optim::Optimizer*>{&all_adam};
    train(net, opts, 7);
    State state{{"model", net}};
    for (size_t i = 0; i < opts.size(); ++i)
      state.items.emplace_back("optim" + std::to_string(i), *opts[i]);

    TempDir dir;
    auto gate = std::make_shared<GateBackend>(
        std::shared_ptr<StorageBackend>(NewPosixBackend(dir.Sub("store")).value()));
    CheckpointerOptions o;
    o.max_staging_bytes = c.limit;
    o.backend = gate;
    auto ckpt = Checkpointer::Open(dir.Sub("store"), RankInfo{}, o);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    gate->Close();
    std::thread opener([&] {
      std::this_thread::sleep_for(500ms);
      gate->Open();
    });
    auto saved = (*ckpt)->SaveAsync(1, state);
    EXPECT_EQ(Ready(saved), !c.fits) << (c.fits ? "the save did not run in the background"
                                                : "the call returned before its save ended");
    opener.join();
    CKPTIO_ASSERT_OK(saved.get());

    // Every optimizer came back whole: one more identical step agrees.
    Net fresh;
    torch::optim::Adam f1(fresh.fc1->parameters()), f2(fresh.fc2->parameters());
    torch::optim::Adam fall(fresh.parameters());
    std::vector<torch::optim::Optimizer*> fresh_opts =
        c.split ? std::vector<torch::optim::Optimizer*>{&f2, &f1}
                : std::vector<torch::optim::Optimizer*>{&fall};
    State into{{"model", fresh}};
    for (size_t i = 0; i < fresh_opts.size(); ++i)
      into.items.emplace_back("optim" + std::to_string(i), *fresh_opts[i]);
    auto got = (*ckpt)->Load(into);
    ASSERT_TRUE(got.ok() && got->has_value()) << (got.ok() ? "nothing" : got.status().ToString());
    train(net, opts, 8);
    train(fresh, fresh_opts, 8);
    EXPECT_TRUE(torch::equal(net.fc1->weight, fresh.fc1->weight)) << "fc1's Adam state differs";
    EXPECT_TRUE(torch::equal(net.fc2->weight, fresh.fc2->weight)) << "fc2's Adam state differs";
  }
}

// The tensors' staging buffer is kept from save to save, so it counts
// against the limit in a later save that stages no tensor: Net's ~37 KiB
// buffer and fc2's ~9 KiB Adam archive each fit in 40 KiB, together not.
TEST_F(AsyncSaveTest, TheKeptTensorBufferCountsWhenASaveStagesNoTensor) {
  Net net;
  torch::optim::Adam adam(net.fc2->parameters());
  Train(net, adam, 1, 7);
  CheckpointerOptions o;
  o.max_staging_bytes = 40 << 10;
  auto ckpt = Open(o);
  ASSERT_TRUE(ckpt);
  auto save_behind_gate = [&](int64_t step, const State& state) {
    gate_->Close();
    std::thread opener([&] {
      std::this_thread::sleep_for(500ms);
      gate_->Open();
    });
    auto saved = ckpt->SaveAsync(step, state);
    const bool returned_at_once = !Ready(saved);
    opener.join();
    CKPTIO_EXPECT_OK(saved.get());
    return returned_at_once;
  };
  EXPECT_TRUE(save_behind_gate(1, State{{"model", net}}))
      << "Net's tensors alone fit: the save should run in the background";
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(save_behind_gate(2, State{{"optim", adam}}))
      << "the archive does not fit beside the kept buffer: the call should save by itself";
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("bytes of tensor staging and at least"), std::string::npos) << warning;
  EXPECT_EQ(warning.find("needs 0 bytes"), std::string::npos) << warning;
}

// A state that grows between saves gets a larger staging buffer; the old
// one is freed first, so staging never holds more than the limit: 24 then
// 32 MiB of tensors under a 40 MiB limit (both buffers at once: 56 MiB).
TEST_F(AsyncSaveTest, AGrowingStateNeverHoldsTwoStagingBuffers) {
  constexpr int64_t kMiB = 1 << 20;
  torch::Tensor small = torch::rand({24 * kMiB / 4}), large = torch::rand({32 * kMiB / 4});
  CheckpointerOptions o;
  o.max_staging_bytes = 40 * kMiB;
  auto ckpt = Open(o);
  ASSERT_TRUE(ckpt);
  auto memory = std::make_shared<testing::MemoryOfThisThread>(c10::DeviceType::CPU);
  {
    c10::DebugInfoGuard profiling(c10::DebugInfoKind::PROFILER_STATE, memory);
    auto first = ckpt->SaveAsync(1, State{{"t", small}});
    CKPTIO_ASSERT_OK(first.get());
    ASSERT_GE(memory->peak, 24 * kMiB) << "the staging buffer was not seen";
    auto second = ckpt->SaveAsync(2, State{{"t", large}});
    CKPTIO_ASSERT_OK(second.get());
  }
  EXPECT_GE(memory->peak, 32 * kMiB) << "the larger staging buffer was not seen";
  EXPECT_LE(memory->peak, static_cast<int64_t>(o.max_staging_bytes))
      << "the old and the new staging buffer were held at once";
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, ckpt->store().OpenStep(2));
  CKPTIO_EXPECT_OK(reader->Verify());
}

TEST_F(AsyncSaveTest, OtherRanksFutureResolvesAtTheCommit) {
  // Two ranks in one process over the manifest signal.
  auto ranks = TwoRanks("async-test", /*stripe=*/false);
  auto& c0 = ranks.first;
  auto& c1 = ranks.second;
  ASSERT_TRUE(c0 && c1);
  Net net;
  State state{{"model", net}};
  auto waiting = c1->SaveAsync(5, state);
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(Ready(waiting)) << "resolved before rank 0 saved";
  CKPTIO_ASSERT_OK(c0->SaveAsync(5, state).get());
  CKPTIO_EXPECT_OK(waiting.get());
}

// Every wait has a deadline, a non-blocking save's ticket too: with rank 0
// never saving, Poll turns from false to DeadlineExceeded once the timeout
// since SaveNonBlocking passed, naming the step, the mode and rank 0.
TEST_F(AsyncSaveTest, ANonBlockingTicketEndsAtTheDeadline) {
  CheckpointerOptions o;
  o.timeout = 1000ms;
  auto c1 = RankOfTwo(1, "ticket-deadline-test", dir_.Sub("store"), o);
  ASSERT_TRUE(c1);
  Net net;
  State state{{"model", net}};
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto ticket, c1->SaveNonBlocking(7, state));
  auto first = ticket.Poll();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(*first) << "committed without rank 0";
  std::this_thread::sleep_for(1200ms);
  auto late = ticket.Poll();
  ASSERT_FALSE(late.ok()) << "Poll still pending after the deadline";
  EXPECT_EQ(late.status().code(), Code::kDeadlineExceeded) << late.status();
  for (const char* word : {"step 7", "manifest", "rank 0"})
    EXPECT_NE(late.status().message().find(word), std::string::npos) << late.status();
  EXPECT_EQ(ticket.Wait().code(), Code::kDeadlineExceeded);

  // Wait on a fresh ticket gives up at the ticket's deadline (1 s after it
  // was made), not a new timeout from the Wait (1.9 s after).
  const auto t0 = std::chrono::steady_clock::now();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, c1->SaveNonBlocking(8, state));
  std::this_thread::sleep_for(900ms);
  EXPECT_EQ(other.Wait().code(), Code::kDeadlineExceeded);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1850ms) << "waited a whole new timeout";
}

// Two Checkpointers of one job on one store, one after the other: the
// second's load is decided by its own rank 0, never answered by the first's
// decision (both would be "load 1" if decisions were not scoped).
TEST_F(AsyncSaveTest, ASecondCheckpointerOfTheJobNeverReadsTheFirstsDecisions) {
  auto first = TwoRanks("scope-test", /*stripe=*/false);
  ASSERT_TRUE(first.first && first.second);
  Net net;
  State state{{"model", net}};
  auto both = [&](Checkpointer& c0, Checkpointer& c1, auto&& fn) {
    Status s0;
    std::thread rank0([&] { s0 = fn(c0); });
    Status s1 = fn(c1);
    rank0.join();
    CKPTIO_EXPECT_OK(s0);
    CKPTIO_EXPECT_OK(s1);
  };
  auto save = [&](int64_t step) {
    return [&state, step](Checkpointer& c) { return c.Save(step, state); };
  };
  auto load = [&](Checkpointer& c) -> Status {
    Net back;  // one per rank: the two load at once
    State into{{"model", back}};
    auto got = c.Load(into);
    if (!got.ok()) return got.status();
    return *got && (*got)->step == 20 ? OkStatus() : Status(Code::kInternal, "loaded another step");
  };
  both(*first.first, *first.second, save(10));
  both(*first.first, *first.second, [&](Checkpointer& c) -> Status {
    Net back;
    State into{{"model", back}};
    return c.Load(into).status();  // decides step 10
  });
  both(*first.first, *first.second, save(20));
  first = {nullptr, nullptr};  // rank 0's writer lock goes with it
  auto second = TwoRanks("scope-test", /*stripe=*/false);
  ASSERT_TRUE(second.first && second.second);
  // Rank 1 asks first; rank 0 decides 200 ms later: step 20, not the
  // first Checkpointer's 10.
  Status s1;
  std::thread rank1([&] { s1 = load(*second.second); });
  std::this_thread::sleep_for(200ms);
  CKPTIO_EXPECT_OK(load(*second.first));
  rank1.join();
  CKPTIO_EXPECT_OK(s1);
}

// The Checkpointers are counted per store: one that only rank 0 opens on
// another store (a "best model" copy) leaves the ranks' names for the next
// Checkpointer of this store in step.
TEST_F(AsyncSaveTest, ACheckpointerOnlyRankZeroOpensElsewhereShiftsNoNames) {
  CheckpointerOptions o;
  o.timeout = 3s;
  auto open = [&](int r, const std::string& store) {
    return RankOfTwo(r, "channel-test", store, o);
  };
  auto best = open(0, dir_.Sub("best-model"));  // rank 0 only
  ASSERT_TRUE(best);
  auto c1 = open(1, dir_.Sub("store")), c0 = open(0, dir_.Sub("store"));
  ASSERT_TRUE(c0 && c1);
  Net net;
  State state{{"model", net}};
  Status s1;
  std::thread rank1([&] { s1 = c1->Save(4, state); });
  CKPTIO_EXPECT_OK(c0->Save(4, state));
  rank1.join();
  EXPECT_TRUE(s1.ok()) << "the ranks named the save differently: " << s1;
}

// Rank 0's backend after it lost its save lock to another holder (an NFS
// lease that ran out, and a process that took the lock since): Lose() lets
// the real lock go; from then on rank 0 finds its lock free, and TryLock
// fails while the other holds it.
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
      o.wait = WaitMode::kFileLock;
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
  o.wait = WaitMode::kFileLock;
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
  for (auto* c : {c0.get(), c1.get()})  // every rank makes the same calls
    EXPECT_EQ(c->SaveNonBlocking(4, state).status().code(), Code::kInvalidArgument)
        << "SaveNonBlocking cannot stripe";
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
    o.wait = mode;
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
}  // namespace ckptio
