// Power loss during a real LibTorch save: a module, an Adam optimizer and a
// loose tensor, saved as step 2 on top of a committed step 1 through a
// PowerLossFs cutting the power at every system call k (and right after the
// save returned), in both modes (drop, garble). Afterwards a fresh
// Checkpointer's Load() must restore exactly step 1 or step 2, bit for bit,
// module, optimizer and tensor alike; a save that returned OK must be step 2.
#include <type_traits>

#include "ckptio/ckptio.h"
#include "ckptio/posix_backend.h"
#include "ckptio/power_loss_fs.h"
#include "ckptio/torch.h"
#include "test_util.h"
#include "torch/state_key.h"

namespace ckptio {
namespace {

using testing::TempDir;

// Everything a step holds, as bytes, to compare loads exactly.
struct Snapshot {
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> optimizer;
  torch::Tensor extra;
};

// Adam's per-parameter state, in parameter order (its archive cannot be
// compared as bytes: LibTorch keys the state by tensor address).
std::vector<torch::Tensor> AdamState(torch::optim::Adam& adam) {
  using Key = std::decay_t<decltype(adam.state())>::key_type;
  std::vector<torch::Tensor> out;
  for (const auto& p : adam.param_groups().at(0).params()) {
    auto it = adam.state().find(internal::StateKey<Key>(p.unsafeGetTensorImpl()));
    if (it == adam.state().end()) continue;  // never stepped
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    out.push_back(torch::tensor(s.step()));
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
  }
  EXPECT_EQ(out.size(), 3 * adam.state().size()) << "every parameter's state found by its key";
  return out;
}

bool SameTensors(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

struct Trainer {
  Trainer()
      : seeded((torch::manual_seed(0), true)),
        model(torch::nn::Linear(12, 24), torch::nn::ReLU(), torch::nn::Linear(24, 3)),
        adam(model->parameters()),
        extra(torch::zeros({50})),
        state{{"model", model}, {"optim", adam}, {"extra", extra}} {}
  void Step(int64_t seed) {
    torch::manual_seed(seed);
    adam.zero_grad();
    model->forward(torch::randn({8, 12})).sum().backward();
    adam.step();
    extra = torch::randn({50});
  }
  Snapshot Take() {
    Snapshot s;
    for (const auto& p : model->parameters()) s.params.push_back(p.detach().clone());
    s.optimizer = AdamState(adam);
    s.extra = extra.clone();
    return s;
  }
  // Empty if equal, else what differs.
  std::string Diff(const Snapshot& s) {
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i)
      if (!torch::equal(params[i], s.params[i])) return "parameter " + std::to_string(i);
    if (s.optimizer.empty() || !SameTensors(AdamState(adam), s.optimizer))
      return "the optimizer state";
    if (!torch::equal(extra, s.extra)) return "the loose tensor";
    return "";
  }
  bool seeded;  // first: every Trainer starts from the same weights
  torch::nn::Sequential model;
  torch::optim::Adam adam;
  torch::Tensor extra;
  State state;
};

// Saves step 1 (plainly) into `root`, then step 2 through `fs`. Returns
// whether step 2's save reported success.
bool SaveTwoSteps(const std::string& root, std::shared_ptr<PowerLossFs> fs) {
  Trainer t;
  t.Step(1);
  {
    auto ckpt = Checkpointer::Open(root, RankInfo{});
    EXPECT_TRUE(ckpt.ok()) << ckpt.status();
    EXPECT_TRUE((*ckpt)->Save(1, t.state).ok());
  }
  t.Step(2);
  PosixBackendOptions po;
  po.fs = std::move(fs);
  auto posix = NewPosixBackend(root, po);
  EXPECT_TRUE(posix.ok());
  CheckpointerOptions o;
  o.backend = std::shared_ptr<StorageBackend>(std::move(*posix));
  auto ckpt = Checkpointer::Open(root, RankInfo{}, o);
  if (!ckpt.ok()) return false;  // the cut hit opening the store
  return (*ckpt)->Save(2, t.state).ok();
}

TEST(TorchPowerLoss, LoadRestoresExactlyTheOldOrTheNewStep) {
  TempDir dir;
  // The two steps' contents, and how many system calls saving step 2 makes.
  Snapshot want[3];
  int64_t calls = 0;
  {
    Trainer t;
    t.Step(1);
    want[1] = t.Take();
    t.Step(2);
    want[2] = t.Take();
    auto fs = std::make_shared<PowerLossFs>(dir.Sub("count.scratch"), -1);
    ASSERT_TRUE(SaveTwoSteps(dir.Sub("count"), fs));
    calls = fs->ops();
  }
  ASSERT_GT(calls, 20);
  int cases = 0, old_step = 0, new_step = 0;
  for (PowerLossMode mode : {PowerLossMode::kDrop, PowerLossMode::kGarble}) {
    const char* name = mode == PowerLossMode::kDrop ? "drop" : "garble";
    for (int64_t k = 0; k <= calls; ++k) {
      const std::string what = std::string("power cut (") + name + ") at call " +
                               std::to_string(k) + " of " + std::to_string(calls);
      SCOPED_TRACE(what);
      const std::string root = dir.Sub(std::string(name) + "-" + std::to_string(k));
      auto fs = std::make_shared<PowerLossFs>(root + ".scratch", k);
      const bool saved = SaveTwoSteps(root, fs);
      auto report = fs->Apply(mode, static_cast<uint64_t>(k));
      ASSERT_TRUE(report.ok()) << report.status();

      Trainer fresh;  // a restarted process
      auto ckpt = Checkpointer::Open(root, RankInfo{});
      ASSERT_TRUE(ckpt.ok()) << ckpt.status();
      auto loaded = (*ckpt)->Load(fresh.state);
      ASSERT_TRUE(loaded.ok() && loaded->step.has_value()) << loaded.status();
      const int64_t step = (*loaded->step);
      ASSERT_TRUE(step == 1 || step == 2) << step;
      EXPECT_EQ(fresh.Diff(want[step]), "") << "step " << step << " did not load bit-exactly";
      EXPECT_TRUE(loaded->skipped.empty())
          << "a torn step was committed: " << loaded->skipped.front().second;
      if (saved) {
        EXPECT_EQ(step, 2) << "a save that returned OK was lost";
      }
      (step == 2 ? new_step : old_step)++;
      ++cases;
      if (HasFailure()) return;
    }
  }
  std::cout << "torch power loss: " << cases << " power cuts (" << calls
            << " system calls of a module + Adam + tensor save, + 1 after success, x 2 modes); "
            << old_step << " loaded step 1 and " << new_step
            << " step 2, bit-exact every time; every save that returned OK survived\n";
  EXPECT_GT(old_step, 0);
  EXPECT_GT(new_step, 0);
}

}  // namespace
}  // namespace ckptio
