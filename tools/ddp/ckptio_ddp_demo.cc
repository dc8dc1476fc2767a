// ckptio-ddp-demo: a data-parallel trainer on CPU that checkpoints through
// ckptio. Run it with ckptio-launch (or torchrun / mpirun):
//
//   ckptio-launch -n 4 -- ckptio-ddp-demo --store ./demo-store --steps 60 --every 10
//
// Rendezvous through a c10d TCPStore at MASTER_ADDR:MASTER_PORT; gradients
// are all-reduced with ProcessGroupGloo. The data of step s on rank r is a
// pure function of (s, r), every op is deterministic on one thread, and the
// optimizer state is checkpointed, so a run that is killed and resumed ends
// with exactly the parameters of one that never stopped: the demo prints
// their XXH3-128 so anyone can compare.
//
// --kill-rank0-during-save=STEP SIGKILLs rank 0 in the middle of writing
// STEP's checkpoint (as it starts its first object), whatever the backend.
// --rank-store R=URI makes rank R reach the store through another URI, e.g.
// ranks reading the folder an NFS server exports while rank 0 writes over
// nfs://.
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "ckptio/backends.h"
#include "ckptio/torch.h"
#include "common/seconds_option.h"

namespace {

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(32, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 1));
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// The batch of `step` for `rank`: deterministic, different per rank.
std::pair<torch::Tensor, torch::Tensor> Batch(int64_t step, int rank) {
  torch::manual_seed(1000003 * step + rank);
  torch::Tensor x = torch::randn({64, 32});
  torch::Tensor y = (x.narrow(1, 0, 8).sum(1, true) * 0.5).sin() + 0.1 * x.narrow(1, 8, 1);
  return {x, y};
}

std::string ParamHash(const torch::nn::Module& m) {
  ckptio::Hasher h;
  for (const auto& p : m.named_parameters()) {
    torch::Tensor t = p.value().detach().contiguous();
    h.Update(p.key().data(), p.key().size());
    h.Update(t.data_ptr(), t.nbytes());
  }
  return h.Digest().Hex();
}

// One write(2) per line: lines of several ranks sharing a pipe never interleave.
void Say(int fd, const std::string& line) {
  std::string s = line + "\n";
  (void)!::write(fd, s.data(), s.size());
}

// An object writer that SIGKILLs the process in its first Append, after
// passing the bytes on: the object is left half-written in its temp file.
class KillingWriter : public ckptio::ObjectWriter {
 public:
  KillingWriter(std::unique_ptr<ckptio::ObjectWriter> inner, std::string key)
      : inner_(std::move(inner)), key_(std::move(key)) {}
  ckptio::Status Append(const void* data, size_t size) override {
    ckptio::Status s = inner_->Append(data, size);
    Die();
    return s;
  }
  ckptio::Status Commit() override {
    Die();
    return inner_->Commit();
  }

 private:
  void Die() {
    Say(2, "rank 0: --kill-rank0-during-save: SIGKILL while writing " + key_ +
               " (the step's first object is already committed)");
    ::raise(SIGKILL);
  }
  std::unique_ptr<ckptio::ObjectWriter> inner_;
  std::string key_;
};

// For --kill-rank0-during-save: a backend that lets the first object whose
// key contains `marker` (the step's folder) commit, then SIGKILLs the
// process in the middle of the second, so the step is left torn: one
// committed object, one temp file, no manifest.
class KillingBackend : public ckptio::StorageBackend {
 public:
  KillingBackend(std::unique_ptr<ckptio::StorageBackend> inner, std::string marker)
      : inner_(std::move(inner)), marker_(std::move(marker)) {}
  std::string Uri() const override { return inner_->Uri(); }
  ckptio::Result<std::unique_ptr<ckptio::ObjectWriter>> NewObject(std::string_view key,
                                                                  ckptio::WriteMode mode) override {
    auto w = inner_->NewObject(key, mode);
    if (!w.ok() || key.find(marker_) == std::string_view::npos || ++objects_ < 2) return w;
    return std::unique_ptr<ckptio::ObjectWriter>(
        std::make_unique<KillingWriter>(std::move(*w), std::string(key)));
  }
  ckptio::Result<std::unique_ptr<ckptio::ObjectReader>> OpenObject(std::string_view key) override {
    return inner_->OpenObject(key);
  }
  ckptio::Result<ckptio::ObjectInfo> Stat(std::string_view key) override {
    return inner_->Stat(key);
  }
  ckptio::Result<std::vector<std::string>> List(std::string_view prefix) override {
    return inner_->List(prefix);
  }
  ckptio::Status Delete(std::string_view key) override { return inner_->Delete(key); }
  ckptio::Result<bool> IsLocked(std::string_view key) override { return inner_->IsLocked(key); }
  bool LocksAreLeases() const override { return inner_->LocksAreLeases(); }
  ckptio::Result<size_t> AbortUnfinishedWrites() override { return inner_->AbortUnfinishedWrites(); }
  ckptio::Result<std::unique_ptr<ckptio::BackendLock>> TryLock(std::string_view key,
                                                               ckptio::LockMode mode) override {
    return inner_->TryLock(key, mode);
  }

 private:
  std::unique_ptr<ckptio::StorageBackend> inner_;
  std::string marker_;
  int objects_ = 0;
};

int Fail(const ckptio::RankInfo& rank, const std::string& what, const ckptio::Status& s) {
  Say(2, "rank " + std::to_string(rank.rank) + ": " + what + ": " + s.ToString());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ckptio-ddp-demo: data-parallel MLP training with ckptio checkpoints"};
  std::string store_path = "./demo-store", wait = "file-lock";
  int64_t steps = 60, every = 10, kill_at = -1;
  int keep = 3;
  double timeout_s = 60;
  std::vector<std::string> rank_stores;
  app.add_option("--store", store_path, "checkpoint store (path, file:// or nfs:// URI)");
  app.add_option("--rank-store", rank_stores,
                 "R=URI: rank R opens the same store through URI (repeatable)");
  app.add_option("--steps", steps, "training steps in all")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--every", every, "checkpoint every K steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--keep", keep, "keep the newest N checkpoints")->check(CLI::Range(0, 1000000));
  app.add_option("--wait", wait, "how ranks learn of a commit: manifest, file-lock or store")
      ->check(CLI::IsMember({"manifest", "file-lock", "store"}));
  app.add_option("--timeout", timeout_s, "seconds any wait may take (at least 0.001)")
      ->check(ckptio::Seconds(0.001, 1e9));
  app.add_option("--kill-rank0-during-save", kill_at,
                 "SIGKILL rank 0 in the middle of writing this step's checkpoint");
  CLI11_PARSE(app, argc, argv);

  torch::set_num_threads(1);  // deterministic arithmetic
  auto rank_or = ckptio::RankInfo::FromEnv();
  if (!rank_or.ok()) {
    std::cerr << "ckptio-ddp-demo: " << rank_or.status() << "\n";
    return 2;
  }
  const ckptio::RankInfo rank = *rank_or;
  const char* master_addr = std::getenv("MASTER_ADDR");
  const char* master_port = std::getenv("MASTER_PORT");
  if (rank.world_size > 1 && (!master_addr || !master_port)) {
    std::cerr
        << "ckptio-ddp-demo: set MASTER_ADDR and MASTER_PORT for the rendezvous (ckptio-launch "
           "does; with mpirun pass -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29555)\n";
    return 2;
  }

  // Rendezvous and process group.
  c10::intrusive_ptr<c10d::Store> tcp;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  if (rank.world_size > 1) {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(std::atoi(master_port));
    opts.isServer = rank.rank == 0;
    opts.numWorkers = rank.world_size;
    opts.timeout = timeout;
    ckptio::UseClassicTcpStore(opts);  // LibTorch 2.x builds without libuv need this
    tcp = c10::make_intrusive<c10d::TCPStore>(master_addr, opts);
    auto pg_opts = c10d::ProcessGroupGloo::Options::create(timeout);
    pg_opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    pg = c10::make_intrusive<c10d::ProcessGroupGloo>(tcp, rank.rank, rank.world_size, pg_opts);
  }

  ckptio::CheckpointerOptions copt;
  copt.keep_last = keep;
  copt.timeout = timeout;
  if (wait == "manifest") {
    copt.wait = ckptio::WaitOn::Manifest();
  } else if (wait == "file-lock") {
    copt.wait = ckptio::WaitOn::FileLock();
  } else {
    if (!tcp) {
      std::cerr << "ckptio-ddp-demo: --wait store needs more than one rank\n";
      return 2;
    }
    copt.wait = ckptio::WaitOn::C10dStore(tcp);
  }
  for (const auto& rs : rank_stores) {
    const size_t eq = rs.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::cerr << "ckptio-ddp-demo: --rank-store wants R=URI, got \"" << rs << "\"\n";
      return 2;
    }
    if (std::atoi(rs.substr(0, eq).c_str()) == rank.rank) store_path = rs.substr(eq + 1);
  }
  if (rank.rank == 0 && kill_at >= 0) {
    auto backend = ckptio::BuiltinBackends().Open(store_path);
    if (!backend.ok()) return Fail(rank, "opening the store", backend.status());
    copt.backend =
        std::make_shared<KillingBackend>(std::move(*backend), ckptio::StepDirName(kill_at) + "/");
  }
  auto ckpt_or = ckptio::Checkpointer::Open(store_path, rank, copt);
  if (!ckpt_or.ok()) return Fail(rank, "opening the checkpointer", ckpt_or.status());
  auto& ckpt = **ckpt_or;

  torch::manual_seed(42);  // identical initial model on every rank
  Mlp model;
  torch::optim::SGD sgd(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  ckptio::State state{{"model", model}, {"optim", sgd}};

  // A store that is damaged or unreachable stops the job: it never restarts
  // from scratch over checkpoints it could not read.
  auto got = ckpt.Load(state);
  if (!got.ok()) return Fail(rank, "loading the newest checkpoint", got.status());
  const int64_t start = got->step ? got->next_step() : 1;  // steps count from 1 here
  if (rank.rank == 0) {
    if (got->step)
      std::cout << "resumed from step " << *got->step << " (loaded on every rank, verified)"
                << std::endl;
    else
      std::cout << "no checkpoint yet: starting at step 1" << std::endl;
  }

  for (int64_t step = start; step <= steps; ++step) {
    auto [x, y] = Batch(step, rank.rank);
    sgd.zero_grad();
    torch::Tensor loss = torch::mse_loss(model.forward(x), y);
    loss.backward();
    if (pg) {
      for (auto& p : model.parameters()) {
        std::vector<torch::Tensor> grads{p.grad()};
        pg->allreduce(grads)->wait();
        p.grad().div_(rank.world_size);
      }
    }
    sgd.step();
    if (step % every == 0 || step == steps) {
      state.SetInt("step", step);
      ckptio::Status s = ckpt.Save(step, state);
      if (!s.ok()) return Fail(rank, "checkpoint of step " + std::to_string(step), s);
      if (rank.rank == 0)
        std::cout << "step " << step << ": loss " << loss.item<float>() << ", checkpoint committed"
                  << std::endl;
    }
  }
  const std::string hash = ParamHash(model);
  if (rank.rank == 0) std::cout << "final parameter hash: " << hash << std::endl;
  if (pg) pg->barrier()->wait();  // no rank leaves while others still need the store
  return 0;
}
