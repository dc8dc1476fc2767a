// 1000+ random single-bit flips, zeroed ranges and truncations spread over
// every kind of file of a LibTorch checkpoint (module tensors, optimizer
// archive, loose tensors, manifest, LATEST): every one is detected,
// Load() falls back to the previous good step with the caller's state
// identical to that step, and `ckptio verify` exits 1 naming the damage.
#include <random>

#include "ckptio/ckptio.h"
#include "ckptio/torch.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::TempDir;

struct Files {
  std::string root;
  std::string Step(int64_t step, const std::string& name) const {
    return root + "/" + StepDirName(step) + "/" + name;
  }
};

TEST(TorchCorruption, EveryDamageIsDetectedAndLoadFallsBack) {
  TempDir dir;
  Files f{dir.Sub("store")};
  torch::manual_seed(11);
  torch::nn::Sequential model(torch::nn::Linear(12, 24), torch::nn::ReLU(),
                              torch::nn::Linear(24, 3));
  torch::optim::Adam adam(model->parameters());
  torch::Tensor extra = torch::randn({50});
  auto step_once = [&] {
    adam.zero_grad();
    model->forward(torch::randn({8, 12})).sum().backward();
    adam.step();
  };
  State state{{"model", model}, {"optim", adam}, {"extra", extra}};
  auto ckpt = Checkpointer::Open(f.root, RankInfo{});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  step_once();
  CKPTIO_ASSERT_OK((*ckpt)->Save(1, state));
  std::vector<torch::Tensor> step1, step2;
  for (const auto& p : model->parameters()) step1.push_back(p.detach().clone());
  step_once();
  extra = torch::randn({50});
  CKPTIO_ASSERT_OK((*ckpt)->Save(2, state));
  for (const auto& p : model->parameters()) step2.push_back(p.detach().clone());

  const std::vector<std::string> targets = {
      f.Step(2, "model.safetensors"), f.Step(2, "optim.optim.pt"), f.Step(2, "tensors.safetensors"),
      f.Step(2, "MANIFEST.json"), f.root + "/LATEST"};
  std::map<std::string, std::string> originals;
  for (const auto& t : targets) originals[t] = testing::ReadFile(t);

  std::mt19937_64 rng(20261130);
  constexpr int kCases = 1200;
  std::map<std::string, int> per_file;
  int detected = 0, fell_back = 0, cli_checked = 0;
  const char* bin = std::getenv("CKPTIO_BIN_DIR");
  for (int i = 0; i < kCases; ++i) {
    const std::string& file = targets[rng() % targets.size()];
    const std::string& good = originals[file];
    std::string bad = good;
    switch (rng() % 3) {
      case 0:  // single-bit flip
        bad[rng() % bad.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1: {  // zeroed range that changes something
        size_t lo = rng() % bad.size(), len = 1 + rng() % 64;
        for (size_t j = lo; j < std::min(bad.size(), lo + len); ++j) bad[j] = '\0';
        if (bad == good) bad[lo] = static_cast<char>(bad[lo] ^ 0x5a);
        break;
      }
      default:  // truncation (of a JSON file: into the value, not just its final
                // newline, which the seal does not cover; see docs/FORMAT.md)
        bad.resize(rng() % (bad.size() - (bad.back() == '\n' ? 1 : 0)));
    }
    testing::WriteFile(file, bad);
    per_file[file.substr(file.rfind('/') + 1)]++;

    // Detected: the step (or LATEST) does not verify.
    auto store = OpenStore(f.root);
    auto latest = (*store)->OpenLatest();
    Status v = latest.ok() ? (*latest)->Verify() : latest.status();
    if (!v.ok()) ++detected;

    // Load falls back to step 1 and the model holds exactly step 1 (a
    // damaged LATEST leaves step 2 the newest good one: it loads step 2).
    const bool latest_file = file == f.root + "/LATEST";
    const int64_t want_step = latest_file ? 2 : 1;
    const auto& want = latest_file ? step2 : step1;
    torch::manual_seed(99);
    torch::nn::Sequential fresh(torch::nn::Linear(12, 24), torch::nn::ReLU(),
                                torch::nn::Linear(24, 3));
    torch::optim::Adam fresh_adam(fresh->parameters());
    torch::Tensor fresh_extra;
    State into{{"model", fresh}, {"optim", fresh_adam}, {"extra", fresh_extra}};
    ::testing::internal::CaptureStderr();
    auto got = (*ckpt)->Load(into);
    ::testing::internal::GetCapturedStderr();
    bool ok = got.ok() && got->step.has_value() && (*got->step) == want_step;
    if (ok) {
      auto params = fresh->parameters();
      for (size_t j = 0; j < params.size(); ++j) ok = ok && torch::equal(params[j], want[j]);
    }
    if (ok)
      ++fell_back;
    else
      ADD_FAILURE() << "case " << i << " (" << file << "): load did not give step " << want_step
                    << ": " << (got.ok() ? "" : got.status().ToString());

    // Every 40th case, the real CLI too.
    if (bin && i % 40 == 0) {
      std::string cmd = std::string(bin) + "/ckptio verify " + f.root + " --all >/dev/null 2>&1";
      int rc = std::system(cmd.c_str());
      EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 1) << "ckptio verify after case " << i;
      ++cli_checked;
    }
    testing::WriteFile(file, good);
    if (::testing::Test::HasFailure()) break;
  }
  std::string spread;
  for (const auto& [name, n] : per_file) spread += " " + name + "=" + std::to_string(n);
  std::cout << "torch corruption: " << detected << "/" << kCases
            << " flips, zeroed ranges and truncations detected (" << spread.substr(1) << "); "
            << fell_back << "/" << kCases
            << " loads gave the newest good step bit-exactly (step 1; step 2 when only LATEST "
               "was hit); "
            << cli_checked << " `ckptio verify` runs exited 1\n";
  EXPECT_EQ(detected, kCases);
  EXPECT_EQ(fell_back, kCases);
}

}  // namespace
}  // namespace ckptio
