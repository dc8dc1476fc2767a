// What the files of torch_state_test share: the LibTorch adapter on one
// rank, with a small network (Linear, BatchNorm, Linear) trained a few
// steps so that Adam has moments and BatchNorm has stats.
//
// The files: torch_state_round_trip_test.cc (every dtype, modules,
// optimizers, names, memory, map_location), torch_state_load_test.cc
// (all-or-nothing loads, optimizers that do not fit, fallback past damaged
// steps), torch_state_open_test.cc (Checkpointer options and two ranks in
// one process, c10d stores, one-liners, CUDA).
#ifndef CKPTIO_TESTS_TORCH_TORCH_STATE_TEST_UTIL_H_
#define CKPTIO_TESTS_TORCH_TORCH_STATE_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/ckptio.h"
#include "ckptio/torch.h"
#include "test_util.h"

namespace ckptio::torch_state_testing {

using ::ckptio::testing::TempDir;

// A single process (no ranks).
inline RankInfo Single() { return RankInfo{}; }

inline std::unique_ptr<Checkpointer> OpenCkpt(const std::string& uri, CheckpointerOptions o = {}) {
  auto c = Checkpointer::Open(uri, Single(), std::move(o));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

inline bool BitEqual(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.to(torch::kCPU).contiguous(), cb = b.to(torch::kCPU).contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

// A few optimizer steps so that Adam has moments and BatchNorm has stats.
inline void Train(Net& net, torch::optim::Optimizer& opt, int steps, uint64_t seed) {
  torch::manual_seed(seed);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    auto loss = net.forward(torch::randn({32, 8})).pow(2).mean();
    loss.backward();
    opt.step();
  }
}

inline std::vector<torch::Tensor> Snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.value().detach().clone());
  for (const auto& b : m.named_buffers()) out.push_back(b.value().detach().clone());
  return out;
}

inline bool SameAs(const torch::nn::Module& m, const std::vector<torch::Tensor>& snap) {
  auto now = Snapshot(m);
  if (now.size() != snap.size()) return false;
  for (size_t i = 0; i < now.size(); ++i)
    if (!BitEqual(now[i], snap[i])) return false;
  return true;
}

}  // namespace ckptio::torch_state_testing

#endif  // CKPTIO_TESTS_TORCH_TORCH_STATE_TEST_UTIL_H_
