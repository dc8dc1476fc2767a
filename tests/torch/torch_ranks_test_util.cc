#include "torch_ranks_test_util.h"

#include <cstdio>
#include <cstring>
#include <thread>

#include "ckptio/backends.h"
#include "common/loopback.h"
#include "tcp_store_test_util.h"
#include "torch/tensors.h"

namespace ckptio::torch_ranks_testing {

using ::ckptio::testing::RankLink;

RankInfo MakeRank(int rank, const std::string& job) {
  return ::ckptio::testing::TestRank(rank, kWorld, job);
}

uint64_t Fnv(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
std::string Hex(uint64_t h) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}
std::string TextHash(const std::string& s) {
  return Hex(Fnv(1469598103934665603ull, s.data(), s.size()));
}

bool BitEqual(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.detach().to(torch::kCPU).contiguous(), cb = b.detach().to(torch::kCPU).contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

std::string ParamHash(const torch::nn::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : m.named_parameters()) {
    h = Fnv(h, p.key().data(), p.key().size());
    auto t = p.value().detach().to(torch::kCPU).contiguous();
    for (int64_t d : t.sizes()) h = Fnv(h, &d, sizeof d);
    h = Fnv(h, t.data_ptr(), t.nbytes());
  }
  return Hex(h);
}

Trainee::Trainee(uint64_t seed) {
  torch::manual_seed(seed);
  model = torch::nn::Linear(16, 8);
  adam = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
}

void Trainee::Train(int64_t step) {
  torch::manual_seed(kDataSeed + static_cast<uint64_t>(step));
  auto x = torch::randn({32, 16});
  adam->zero_grad();
  auto loss = model->forward(x).pow(2).mean();
  loss.backward();
  adam->step();
}

Status CheckStepIsMine(const std::string& path, int64_t step, torch::nn::Module& model) {
  const std::string at = "step " + std::to_string(step) + ": ";
  CKPTIO_ASSIGN_OR_RETURN(auto store, OpenStore(path));
  CKPTIO_ASSIGN_OR_RETURN(auto reader, store->OpenStep(step));
  if (reader->step() != step)
    return Status(Code::kDataLoss, at + "OpenStep gave step " + std::to_string(reader->step()));
  CKPTIO_RETURN_IF_ERROR(reader->Verify());
  auto params = model.named_parameters();
  size_t matched = 0;
  for (const TensorEntry& e : reader->manifest().tensors) {
    if (e.object != "model.safetensors") continue;
    torch::Tensor* mine = params.find(e.name);
    if (!mine) return Status(Code::kDataLoss, at + "unexpected tensor " + e.name);
    CKPTIO_ASSIGN_OR_RETURN(torch::Tensor saved, ReadTensor(*reader, e, torch::kCPU));
    if (!BitEqual(saved, *mine))
      return Status(Code::kDataLoss, at + "tensor " + e.name + " differs from this rank's");
    ++matched;
  }
  if (matched != params.size())
    return Status(Code::kDataLoss, at + std::to_string(matched) + " of " +
                                       std::to_string(params.size()) + " parameters stored");
  return OkStatus();
}

std::shared_ptr<StorageBackend> OpenBackendForTest(const std::string& path) {
  auto b = BuiltinBackends().Open(path);
  return b.ok() ? std::shared_ptr<StorageBackend>(std::move(*b)) : nullptr;
}

Result<std::unique_ptr<Checkpointer>> RankEnv::Open(milliseconds timeout, bool stripe,
                                                    std::shared_ptr<StorageBackend> backend) const {
  CheckpointerOptions o;
  o.wait = launch->mode == WaitMode::kStore      ? WaitOn::C10dStore(c10d)
           : launch->mode == WaitMode::kFileLock ? WaitOn::FileLock()
                                                 : WaitOn::Manifest();
  o.timeout = timeout;
  o.stripe = stripe;
  o.backend = std::move(backend);
  return Checkpointer::Open(launch->path, MakeRank(rank, launch->job), o);
}

Result<int64_t> RankEnv::KeysAtBarrier(const std::string& name) {
  const std::string arrived = "torch-ranks-test/arrived/" + name;
  const std::string counted = "torch-ranks-test/counted/" + name;
  try {
    c10d->add(arrived, 1);
    barrier_keys_ += 2;
    if (rank != 0) {
      // Adds nothing to the store before rank 0 counted (which, under the
      // sanitizers, can be long after this rank came).
      c10d->wait({counted}, milliseconds(60000));
      return -1;
    }
    const auto deadline = Clock::now() + milliseconds(60000);
    while (c10d->add(arrived, 0) < kWorld) {
      if (Clock::now() > deadline)
        return Status(Code::kDeadlineExceeded, "not every rank came to barrier " + name);
      std::this_thread::sleep_for(milliseconds(5));
    }
    const int64_t keys = c10d->getNumKeys() - (barrier_keys_ - 1);  // `counted` is not there yet
    c10d->set(counted, std::vector<uint8_t>{1});
    return keys;
  } catch (const std::exception& e) {
    return Status(Code::kUnavailable, std::string("TCPStore: ") + e.what());
  }
}

namespace {
constexpr char kDoneKey[] = "torch-ranks-test/done";
}  // namespace

Ranks::Ranks(const Launch& launch, const Body& body) : launch_(launch) {
  if (launch_.mode == WaitMode::kStore && launch_.agent_serves) StartAgent();
  group_.StartAll([&](RankLink& link) { return RunRank(link, body); });
}

void Ranks::StartAgent() {
  agent_pipe_ = std::make_unique<testing::Pipe>();
  const int port = launch_.port;
  agent_.emplace(testing::Child::Start([&, port] {
    torch::set_num_threads(1);
    auto store = testing::ConnectTcpStore(static_cast<uint16_t>(port), /*server=*/true);
    testing::WriteLine(agent_pipe_->write_fd(), "up");
    for (int i = 0; i < 120; ++i) std::this_thread::sleep_for(milliseconds(1000));
    return kExitNotKilled;
  }));
  agent_pipe_->CloseWrite();
  if (testing::ReadLine(agent_pipe_->read_fd(), milliseconds(20000)) !=
      std::optional<std::string>("up"))
    agent_failed_ = true;
}

int Ranks::RunRank(const RankLink& link, const Body& body) {
  const int r = link.rank();
  torch::set_num_threads(1);
  RankEnv env;
  env.rank = r;
  env.launch = &launch_;
  env.link = &link;
  const bool serves = launch_.mode == WaitMode::kStore && r == 0 && !launch_.agent_serves;
  if (launch_.mode == WaitMode::kStore) {
    try {
      env.c10d = testing::ConnectTcpStore(static_cast<uint16_t>(launch_.port), serves);
    } catch (const std::exception& e) {
      return Fail(r, kExitSetup, std::string("TCPStore: ") + e.what());
    }
  }
  int code = body(env);
  if (env.c10d && !launch_.agent_serves) {
    // Rank 0 serves the store: it stays until every other rank is done with it.
    try {
      if (r != 0) {
        env.c10d->add(kDoneKey, 1);
      } else {
        const auto deadline = Clock::now() + milliseconds(20000);
        while (env.c10d->add(kDoneKey, 0) < kWorld - 1 && Clock::now() < deadline)
          std::this_thread::sleep_for(milliseconds(5));
      }
    } catch (const std::exception&) {
    }
  }
  return code;
}

std::string FormatLoaded(const LoadResult& r, const std::string& params) {
  std::string skipped, reasons;
  for (const auto& [step, why] : r.skipped) {
    skipped += (skipped.empty() ? "" : ",") + std::to_string(step);
    reasons += why + "\n";
  }
  return "loaded " + std::to_string(r.step.value_or(-1)) + " " + (skipped.empty() ? "-" : skipped) +
         " " + TextHash(reasons) + " " + params;
}

Launch TorchRanksTest::NewLaunch(bool agent_serves) {
  Launch l;
  l.path = tmp_.Sub("store");
  l.job = NewJobId();
  l.mode = GetParam();
  if (l.mode == WaitMode::kStore) l.port = ckptio::FreePort();
  l.agent_serves = agent_serves;
  return l;
}

int64_t ExpectKilledRankZerosWaiter(WaitMode mode, const StatusReport& rep, const std::string& died,
                                    int64_t kill_ns, int64_t wait_ns, milliseconds timeout) {
  if (mode == WaitMode::kFileLock) {
    EXPECT_EQ(rep.code, Code::kAborted) << rep.message;
    EXPECT_NE(rep.message.find(died), std::string::npos) << rep.message;
    EXPECT_GE(rep.t_ns, kill_ns) << "called the writer dead while it was alive";
    const int64_t after_ms = (rep.t_ns - kill_ns) / 1000000;
    EXPECT_LT(after_ms, 1000) << "the death should be noticed within 1 s of the kill";
    return after_ms;
  }
  EXPECT_EQ(rep.code, Code::kDeadlineExceeded) << rep.message;
  const int64_t waited_ms = (rep.t_ns - wait_ns) / 1000000;
  EXPECT_GE(waited_ms, timeout.count() - 100) << "gave up before the deadline";
  EXPECT_LT(waited_ms, timeout.count() + 1500) << "ran far past the deadline";
  return waited_ms;
}

int LoadAndSay(RankEnv& me) {
  auto ckpt = me.Open(kTimeout);
  if (!ckpt.ok()) return Fail(me.rank, kExitSetup, "relaunch: " + ckpt.status().ToString());
  Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
  State into = fresh.state();
  auto got = (*ckpt)->Load(into);
  if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
  if (!got->step.has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
  me.Say(FormatLoaded(*got, fresh.hash()));
  return kExitOk;
}

}  // namespace ckptio::torch_ranks_testing
