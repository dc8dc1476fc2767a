// What the files of torch_async_test share: Checkpointer::SaveAsync over a
// POSIX backend whose object writes wait at a gate
// (GateBackend), a small network to save, and ranks of a job as
// Checkpointers of this one process.
//
// The files: torch_async_save_test.cc (the call returns once the state is
// staged, the commit happens in the background with every invariant, errors
// surface on the future and on the next call, the destructor waits, the
// staging limit), torch_async_ranks_test.cc (two ranks: abandoned and
// striped saves; CUDA staging).
#ifndef CKPTIO_TESTS_TORCH_TORCH_ASYNC_TEST_UTIL_H_
#define CKPTIO_TESTS_TORCH_TORCH_ASYNC_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptio/ckptio.h"
#include "ckptio/posix_backend.h"
#include "ckptio/torch.h"
#include "test_util.h"

namespace ckptio::torch_async_testing {

using namespace std::chrono_literals;
using ::ckptio::testing::TempDir;

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

  // Ranks 0 and 1 of `job` over the file lock (timeout 30 s), rank 1 waiting
  // in the background (SaveAsync of `state` as step 1) for a commit rank 0
  // never makes. Null Checkpointers (and a test failure) if they did not open.
  struct WaitingRank {
    std::unique_ptr<Checkpointer> c0, c1;
    std::future<Status> waiting;
  };
  WaitingRank RankOneWaiting(const std::string& job, const State& state) {
    CheckpointerOptions o;
    o.wait = WaitOn::FileLock();
    o.timeout = 30s;
    WaitingRank w{
        RankOfTwo(0, job, dir_.Sub("store"), o), RankOfTwo(1, job, dir_.Sub("store"), o), {}};
    if (w.c0 && w.c1) w.waiting = w.c1->SaveAsync(1, state);
    return w;
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

inline void Train(Net& net, torch::optim::Optimizer& opt, int steps, uint64_t seed) {
  torch::manual_seed(seed);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    net.forward(torch::randn({16, 64})).pow(2).mean().backward();
    opt.step();
  }
}

inline std::vector<torch::Tensor> Snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

inline bool SameAs(torch::nn::Module& m, const std::vector<torch::Tensor>& snap) {
  auto now = m.parameters();
  if (now.size() != snap.size()) return false;
  for (size_t i = 0; i < now.size(); ++i)
    if (!torch::equal(now[i], snap[i])) return false;
  return true;
}

}  // namespace ckptio::torch_async_testing

#endif  // CKPTIO_TESTS_TORCH_TORCH_ASYNC_TEST_UTIL_H_
