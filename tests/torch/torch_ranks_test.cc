// The Checkpointer across real processes (invariants 5 and 6): W=4 ranks,
// each a forked process with its own Checkpointer (rank 0 holds the writer
// lock), a torch::nn::Linear and an Adam optimizer initialised alike, for
// every wait mode (manifest, file lock, c10d TCPStore).
//
// The parent process never calls into LibTorch: torch starts thread pools,
// and a fork after that can deadlock. All torch work happens in the children,
// which first set torch::set_num_threads(1) (that also makes every rank's
// training bit-identical). Children talk to the parent through pipes, one
// line per message, and always leave with _exit(); each failing child prints
// its reason to stderr. Timestamps are CLOCK_MONOTONIC nanoseconds, shared by
// every process on the machine. In kStore mode rank 0 serves the TCPStore on a
// port the parent picked, except in the SIGKILL test, where a separate "agent"
// process serves it (as torchrun's agent does), so that the store outlives
// rank 0.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "ckptio/backends.h"
#include "ckptio/ckptio.h"
#include "ckptio/torch.h"
#include "process.h"
#include "tcp_store_test_util.h"
#include "test_util.h"

namespace ckptio {
namespace {

using ::ckptio::testing::Child;
using ::ckptio::testing::NowNs;
using ::ckptio::testing::Pipe;
using ::ckptio::testing::ReadLine;
using ::ckptio::testing::TempDir;
using ::ckptio::testing::WriteLine;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kWorld = 4;
constexpr uint64_t kInitSeed = 7;        // every rank's model starts from this seed
constexpr uint64_t kDataSeed = 1000;     // + the step: each step's batch, the same on every rank
constexpr uint64_t kFreshSeed = 50000;   // + the rank: models loaded into (all different)
constexpr milliseconds kTimeout(15000);  // the Checkpointer's deadline where no test needs less

// Child exit codes.
constexpr int kExitOk = 0;
constexpr int kExitException = ::ckptio::testing::kChildException;
constexpr int kExitSetup = 10;       // TCPStore or Checkpointer did not open
constexpr int kExitPipe = 11;        // the parent's message did not come or was wrong
constexpr int kExitSaveFailed = 20;  // Save (or a ticket) failed where it had to succeed
constexpr int kExitBadStep = 21;     // right after Save returned, the step did not verify or match
constexpr int kExitLoadFailed = 22;  // Load failed or found nothing
constexpr int kExitPoll = 23;        // a ticket's Poll misbehaved
constexpr int kExitCorrupt = 24;     // rank 0 could not corrupt the step on purpose
constexpr int kExitNotKilled = 99;   // a child that should have been killed ran out of sleep

// ---------------------------------------------------------------- plumbing

// Words of a line.
std::vector<std::string> Split(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

using ::ckptio::testing::NewJobId;

RankInfo MakeRank(int rank, const std::string& job) {
  return ::ckptio::testing::TestRank(rank, kWorld, job);
}

// A TCP port free right now on 127.0.0.1 (bound to port 0, then released).
int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = -1;
  if (::bind(fd, reinterpret_cast<struct sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<struct sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

int Fail(int rank, int code, const std::string& why) {
  std::fprintf(stderr, "[rank %d pid %d] exit %d: %s\n", rank, static_cast<int>(::getpid()), code,
               why.c_str());
  std::fflush(stderr);
  return code;
}

std::string OneLine(std::string s) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

// "ret <code> <t_ns> <message...>": the outcome of a Save, as a waiter reports it.
struct SaveReport {
  Code code = Code::kInternal;
  int64_t t_ns = 0;
  std::string message;
};
std::string FormatRet(const Status& s, int64_t t_ns) {
  return "ret " + std::to_string(static_cast<int>(s.code())) + " " + std::to_string(t_ns) + " " +
         OneLine(s.message());
}
std::optional<SaveReport> ParseRet(const std::optional<std::string>& line) {
  if (!line || line->rfind("ret ", 0) != 0) return std::nullopt;
  std::istringstream in(line->substr(4));
  int code = 0;
  SaveReport r;
  if (!(in >> code >> r.t_ns)) return std::nullopt;
  r.code = static_cast<Code>(code);
  std::getline(in, r.message);
  if (!r.message.empty() && r.message.front() == ' ') r.message.erase(0, 1);
  return r;
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

// ---------------------------------------------------------------- torch side (children only)

bool BitEqual(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.detach().to(torch::kCPU).contiguous(), cb = b.detach().to(torch::kCPU).contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

// A hash of every parameter's name, shape and bytes, in order.
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

// One rank's training state: the same on every rank for the same seed.
struct Trainee {
  explicit Trainee(uint64_t seed) {
    torch::manual_seed(seed);
    model = torch::nn::Linear(16, 8);
    adam =
        std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  }
  Trainee(const Trainee&) = delete;
  Trainee& operator=(const Trainee&) = delete;

  // One optimizer step on step `step`'s batch (identical on every rank).
  void Train(int64_t step) {
    torch::manual_seed(kDataSeed + static_cast<uint64_t>(step));
    auto x = torch::randn({32, 16});
    adam->zero_grad();
    auto loss = model->forward(x).pow(2).mean();
    loss.backward();
    adam->step();
  }
  State state() { return State{{"model", model}, {"optim", *adam}}; }
  std::string hash() const { return ParamHash(*model); }

  torch::nn::Linear model{nullptr};
  std::unique_ptr<torch::optim::Adam> adam;
};

// Opens committed `step` through a fresh Store, verifies every byte, and
// checks that the manifest's model.safetensors tensors are bit-for-bit the
// caller's parameters (so the step read is the one just trained, whole).
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

// A POSIX backend on `path` (the children build their own).
std::shared_ptr<StorageBackend> OpenBackendForTest(const std::string& path) {
  auto b = BuiltinBackends().Open(path);
  return b.ok() ? std::shared_ptr<StorageBackend>(std::move(*b)) : nullptr;
}

// ---------------------------------------------------------------- launching ranks

// One launch of a job: every rank of it shares the store, the job id and
// (kStore) the TCPStore port.
struct Launch {
  std::string path;
  std::string job;
  WaitMode mode = WaitMode::kManifest;
  int port = -1;              // kStore
  bool agent_serves = false;  // kStore: a separate process serves the TCPStore, not rank 0
};

constexpr char kDoneKey[] = "torch-ranks-test/done";

// What a rank's body gets.
struct RankEnv {
  int rank = 0;
  const Launch* launch = nullptr;
  int in = -1;                           // lines from the parent
  int out = -1;                          // lines to the parent
  c10::intrusive_ptr<c10d::Store> c10d;  // kStore

  void Say(const std::string& line) const { WriteLine(out, line); }
  std::optional<std::string> Hear(milliseconds timeout) const { return ReadLine(in, timeout); }

  Result<std::unique_ptr<Checkpointer>> Open(milliseconds timeout, bool stripe = false,
                                             std::shared_ptr<StorageBackend> backend = {}) const {
    CheckpointerOptions o;
    o.wait = launch->mode;
    o.c10d_store = c10d;
    o.timeout = timeout;
    o.stripe = stripe;
    o.backend = std::move(backend);
    return Checkpointer::Open(launch->path, MakeRank(rank, launch->job), o);
  }
};

// The kWorld ranks of one launch (plus the TCPStore agent when asked), and
// the parent's side of their pipes. Every line a rank sends is kept.
class Ranks {
 public:
  using Body = std::function<int(RankEnv&)>;

  Ranks(const Launch& launch, Body body) : launch_(launch) {
    if (launch_.mode == WaitMode::kStore && launch_.agent_serves) StartAgent();
    for (int r = 0; r < kWorld; ++r) {
      to_.push_back(std::make_unique<Pipe>());
      from_.push_back(std::make_unique<Pipe>());
      if (!to_.back()->ok() || !from_.back()->ok()) return;
    }
    lines_.resize(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      children_.push_back(Child::Start([&, r] { return RunRank(r, body); }));
      if (!children_.back().started()) return;
    }
    for (int r = 0; r < kWorld; ++r) {
      to_[r]->CloseRead();
      from_[r]->CloseWrite();
    }
  }

  bool started() const {
    if (children_.size() != kWorld) return false;
    for (const auto& c : children_)
      if (!c.started()) return false;
    return !agent_failed_;
  }
  Child& child(int r) { return children_[r]; }
  void Tell(int r, const std::string& line) { WriteLine(to_[r]->write_fd(), line); }

  // The words after `key` of rank r's first line starting with it, reading
  // more lines as needed; nullopt when none came by the timeout (or EOF).
  std::optional<std::vector<std::string>> Await(int r, const std::string& key,
                                                milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      for (const auto& l : lines_[r]) {
        auto w = Split(l);
        if (!w.empty() && w[0] == key) return std::vector<std::string>(w.begin() + 1, w.end());
      }
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return std::nullopt;
      auto line = ReadLine(from_[r]->read_fd(), left);
      if (!line) return std::nullopt;
      lines_[r].push_back(*line);
    }
  }
  // The whole first line of rank r starting with `key ` (for "ret" lines).
  std::optional<std::string> AwaitLine(int r, const std::string& key, milliseconds timeout) {
    if (!Await(r, key, timeout)) return std::nullopt;
    for (const auto& l : lines_[r])
      if (l.rfind(key + " ", 0) == 0 || l == key) return l;
    return std::nullopt;
  }

  // Exit codes of all ranks, waiting up to `timeout` for each.
  std::vector<int> ExitCodes(milliseconds timeout) {
    std::vector<int> codes;
    for (auto& c : children_) codes.push_back(c.ExitCode(timeout));
    return codes;
  }

 private:
  void StartAgent() {
    agent_pipe_ = std::make_unique<Pipe>();
    const int port = launch_.port;
    agent_.emplace(Child::Start([&, port] {
      torch::set_num_threads(1);
      auto store = testing::ConnectTcpStore(static_cast<uint16_t>(port), /*server=*/true);
      WriteLine(agent_pipe_->write_fd(), "up");
      for (int i = 0; i < 120; ++i) std::this_thread::sleep_for(milliseconds(1000));
      return kExitNotKilled;
    }));
    agent_pipe_->CloseWrite();
    if (ReadLine(agent_pipe_->read_fd(), milliseconds(20000)) != std::optional<std::string>("up"))
      agent_failed_ = true;
  }

  // In the rank's process.
  int RunRank(int r, const Body& body) {
    for (int j = 0; j < kWorld; ++j) {  // keep only this rank's ends, so EOF means exit
      if (j != r) {
        ::close(to_[j]->write_fd());
        ::close(from_[j]->read_fd());
        ::close(to_[j]->read_fd());
        ::close(from_[j]->write_fd());
      }
    }
    ::close(to_[r]->write_fd());
    ::close(from_[r]->read_fd());
    torch::set_num_threads(1);
    RankEnv env;
    env.rank = r;
    env.launch = &launch_;
    env.in = to_[r]->read_fd();
    env.out = from_[r]->write_fd();
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

  Launch launch_;
  std::unique_ptr<Pipe> agent_pipe_;
  std::optional<Child> agent_;
  bool agent_failed_ = false;
  std::vector<std::unique_ptr<Pipe>> to_, from_;
  std::vector<Child> children_;
  std::vector<std::vector<std::string>> lines_;
};

std::string Join(const std::vector<std::string>& w) {
  std::string s;
  for (const auto& x : w) s += (s.empty() ? "" : " ") + x;
  return s;
}

// "loaded <step> <skipped steps, comma-separated or -> <reasons hash> <params hash>"
std::string FormatLoaded(const LoadResult& r, const std::string& params) {
  std::string skipped, reasons;
  for (const auto& [step, why] : r.skipped) {
    skipped += (skipped.empty() ? "" : ",") + std::to_string(step);
    reasons += why + "\n";
  }
  return "loaded " + std::to_string(r.step) + " " + (skipped.empty() ? "-" : skipped) + " " +
         TextHash(reasons) + " " + params;
}

class TorchRanksTest : public ::testing::TestWithParam<WaitMode> {
 protected:
  Launch NewLaunch(bool agent_serves = false) {
    Launch l;
    l.path = tmp_.Sub("store");
    l.job = NewJobId();
    l.mode = GetParam();
    if (l.mode == WaitMode::kStore) l.port = FreePort();
    l.agent_serves = agent_serves;
    return l;
  }
  WaitMode mode() const { return GetParam(); }
  std::string mode_name() const { return std::string(WaitModeName(GetParam())); }

  TempDir tmp_;
};

#define EXPECT_ALL_RANKS_EXIT_OK(ranks, timeout)                          \
  do {                                                                    \
    auto codes_ = (ranks).ExitCodes(timeout);                             \
    for (int r_ = 0; r_ < kWorld; ++r_)                                   \
      EXPECT_EQ(codes_[r_], kExitOk) << "rank " << r_ << " (see stderr)"; \
  } while (0)

// ---------------------------------------------------------------- a. rounds

// 20 rounds: every rank trains one step on the same batch and calls Save.
// Each waiting rank, the moment Save returns, opens the step through a fresh
// store, verifies it and finds its own parameters in it bit-for-bit: it never
// saw a torn, uncommitted or previous step. Then all ranks Load into fresh
// models: the same step, the same parameters and Adam state on every rank.
TEST_P(TorchRanksTest, EveryRankSeesOnlyCommittedStepsAndLoadsTheSame) {
  constexpr int kRounds = 20;
  const Launch launch = NewLaunch();
  Ranks ranks(launch, [&](RankEnv& me) -> int {
    Trainee t(kInitSeed);
    auto ckpt = me.Open(kTimeout);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    for (int64_t step = 1; step <= kRounds; ++step) {
      t.Train(step);
      Status s = (*ckpt)->Save(step, state);
      if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
      if (me.rank != 0) {
        s = CheckStepIsMine(launch.path, step, *t.model);
        if (!s.ok()) return Fail(me.rank, kExitBadStep, "right after Save: " + s.ToString());
      }
    }
    me.Say("trained " + t.hash());
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    auto got = (*ckpt)->Load(into);
    if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
    if (!got->has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    me.Say(FormatLoaded(**got, fresh.hash()));
    // One more identical step from the loaded state: Adam's moments came back too.
    t.Train(kRounds + 1);
    fresh.Train(kRounds + 1);
    me.Say("next " + t.hash() + " " + fresh.hash());
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());

  std::vector<std::string> loaded(kWorld), trained(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    auto tr = ranks.Await(r, "trained", milliseconds(60000));
    ASSERT_TRUE(tr.has_value()) << "rank " << r << " exit "
                                << ranks.child(r).ExitCode(milliseconds(2000));
    trained[r] = Join(*tr);
    auto ld = ranks.Await(r, "loaded", milliseconds(20000));
    ASSERT_TRUE(ld.has_value()) << "rank " << r << " exit "
                                << ranks.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 4u) << Join(*ld);
    loaded[r] = Join(*ld);
    EXPECT_EQ((*ld)[0], std::to_string(kRounds)) << "rank " << r;
    EXPECT_EQ((*ld)[1], "-") << "rank " << r << " skipped steps";
    EXPECT_EQ((*ld)[3], trained[r]) << "rank " << r << " loaded other parameters than it trained";
    auto next = ranks.Await(r, "next", milliseconds(10000));
    ASSERT_TRUE(next.has_value() && next->size() == 2u) << "rank " << r;
    EXPECT_EQ((*next)[0], (*next)[1]) << "rank " << r << ": a step after the load diverged";
  }
  for (int r = 1; r < kWorld; ++r) {
    EXPECT_EQ(trained[r], trained[0]) << "rank " << r << " trained differently (setup)";
    EXPECT_EQ(loaded[r], loaded[0]) << "rank " << r << " loaded something else than rank 0";
  }
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: %d rounds x %d ranks ok (each waiter verified every step bit-for-bit "
      "right after Save); all loaded step %d, identical params + Adam state\n",
      mode_name().c_str(), kRounds, kWorld, kRounds);
}

// ---------------------------------------------------------------- b. fallback

// Rank 0 flips a bit of the newest step's model.safetensors before the
// Load: every rank falls back to the previous step, and says so alike.
TEST_P(TorchRanksTest, EveryRankFallsBackPastACorruptStepAlike) {
  constexpr int64_t kSteps = 3;
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
      me.Say("trained" + std::to_string(step) + " " + t.hash());
    }
    if (me.rank == 0) {
      char dir[32];
      std::snprintf(dir, sizeof dir, "step-%012lld", static_cast<long long>(kSteps));
      const std::string file = launch.path + "/" + dir + "/model.safetensors";
      int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) return Fail(0, kExitCorrupt, "open " + file + ": " + std::strerror(errno));
      struct stat st;
      unsigned char c = 0;
      const off_t at = ::fstat(fd, &st) == 0 ? st.st_size - 3 : -1;  // inside the last tensor
      bool ok = at > 0 && ::pread(fd, &c, 1, at) == 1;
      c ^= 0x10;
      ok = ok && ::pwrite(fd, &c, 1, at) == 1 && ::fsync(fd) == 0;
      ::close(fd);
      if (!ok) return Fail(0, kExitCorrupt, "could not flip a bit of " + file);
    }
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    auto got = (*ckpt)->Load(into);
    if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
    if (!got->has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    for (const auto& [step, why] : (*got)->skipped)
      if (why.find("model.safetensors") == std::string::npos)
        return Fail(me.rank, kExitLoadFailed,
                    "the skip reason does not name the corrupt object: " + why);
    me.Say(FormatLoaded(**got, fresh.hash()));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());

  std::vector<std::string> loaded(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    auto ld = ranks.Await(r, "loaded", milliseconds(30000));
    ASSERT_TRUE(ld.has_value()) << "rank " << r << " exit "
                                << ranks.child(r).ExitCode(milliseconds(2000));
    ASSERT_EQ(ld->size(), 4u) << Join(*ld);
    loaded[r] = Join(*ld);
    auto t2 = ranks.Await(r, "trained2", milliseconds(1000));
    ASSERT_TRUE(t2.has_value() && t2->size() == 1u) << "rank " << r;
    EXPECT_EQ((*ld)[0], std::to_string(kSteps - 1)) << "rank " << r;
    EXPECT_EQ((*ld)[1], std::to_string(kSteps)) << "rank " << r << ": skipped steps";
    EXPECT_EQ((*ld)[3], (*t2)[0]) << "rank " << r << ": not step " << kSteps - 1 << "'s parameters";
  }
  for (int r = 1; r < kWorld; ++r)
    EXPECT_EQ(loaded[r], loaded[0]) << "rank " << r << " decided otherwise than rank 0";
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: step %lld corrupted by rank 0; all %d ranks loaded step %lld, "
      "skipped=[%lld] with the same reason, identical params\n",
      mode_name().c_str(), static_cast<long long>(kSteps), kWorld,
      static_cast<long long>(kSteps - 1), static_cast<long long>(kSteps));
}

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

// A waiter's report of a save or decision rank 0 never committed, rank 0
// SIGKILLed at kill_ns: with the file lock ABORTED saying `died` within 1 s
// of the kill (never before it), otherwise DeadlineExceeded at the deadline
// `timeout` after the waiter began at wait_ns. Returns the ms it took after
// the kill (file lock) or after it began to wait.
int64_t ExpectKilledRankZerosWaiter(WaitMode mode, const SaveReport& rep, const std::string& died,
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

// A relaunched rank: loads the newest step into a model of its own seed and
// says "loaded" (FormatLoaded).
int LoadAndSay(RankEnv& me) {
  auto ckpt = me.Open(kTimeout);
  if (!ckpt.ok()) return Fail(me.rank, kExitSetup, "relaunch: " + ckpt.status().ToString());
  Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
  State into = fresh.state();
  auto got = (*ckpt)->Load(into);
  if (!got.ok()) return Fail(me.rank, kExitLoadFailed, got.status().ToString());
  if (!got->has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
  me.Say(FormatLoaded(**got, fresh.hash()));
  return kExitOk;
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
      for (int i = 0; i < 60; ++i) std::this_thread::sleep_for(milliseconds(1000));
      return kExitNotKilled;
    }
    me.Say("waiting " + std::to_string(NowNs()));
    s = (*ckpt)->Save(2, state);
    me.Say(FormatRet(s, NowNs()));
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
    auto rep = ParseRet(ranks.AwaitLine(r, "ret", kWaitTimeout + milliseconds(6000)));
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
      for (int i = 0; i < 60; ++i) std::this_thread::sleep_for(milliseconds(1000));
      return kExitNotKilled;
    }
    me.Say("waiting " + std::to_string(NowNs()));
    s = (*ckpt)->Save(2, state);
    const int64_t t_ret = NowNs();
    std::string verified = "-";
    if (s.ok()) {  // a waiter told OK must find step 2 whole, and its own
      Status v = CheckStepIsMine(launch.path, 2, *t.model);
      verified = v.ok() ? "ok" : OneLine(v.ToString());
    }
    me.Say(FormatRet(s, t_ret));
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
    auto rep = ParseRet(ranks.AwaitLine(r, "ret", wait_timeout + milliseconds(6000)));
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
    if (!got->has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    me.Say(FormatLoaded(**got, fresh.hash()) + " " + TensorHash(big));
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

// ---------------------------------------------------------------- d. non-blocking

// The waiting ranks' SaveNonBlocking returns while rank 0 has not begun to
// save (it saves only once every waiter's ticket returned, and was polled
// false); Poll() is never true before rank 0 began; Wait() is OK once
// committed, and the step is then theirs bit-for-bit.
TEST_P(TorchRanksTest, NonBlockingSaveTicketsPollAndWait) {
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
      auto ticket = (*ckpt)->SaveNonBlocking(kStep, state);
      if (!ticket.ok()) return Fail(0, kExitSaveFailed, ticket.status().ToString());
      auto polled = ticket->Poll();
      if (!polled.ok() || !*polled)
        return Fail(0, kExitPoll, "rank 0's ticket is not done after its save");
      Status s = ticket->Wait();
      if (!s.ok()) return Fail(0, kExitSaveFailed, s.ToString());
      return kExitOk;
    }
    const int64_t t0 = NowNs();
    auto ticket = (*ckpt)->SaveNonBlocking(kStep, state);
    const int64_t t1 = NowNs();
    if (!ticket.ok()) return Fail(me.rank, kExitSaveFailed, ticket.status().ToString());
    if (ticket->step() != kStep) return Fail(me.rank, kExitPoll, "the ticket names another step");
    auto first = ticket->Poll();
    if (!first.ok()) return Fail(me.rank, kExitPoll, first.status().ToString());
    me.Say("returned " + std::to_string((t1 - t0) / 1000) + " " + std::to_string(*first));
    std::this_thread::sleep_for(milliseconds(100));
    auto second = ticket->Poll();
    const int64_t t_second = NowNs();
    if (!second.ok()) return Fail(me.rank, kExitPoll, second.status().ToString());
    Status s = ticket->Wait();
    const int64_t t_wait = NowNs();
    me.Say("polled " + std::to_string(*second) + " " + std::to_string(t_second));
    me.Say(FormatRet(s, t_wait));
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    auto after = ticket->Poll();
    if (!after.ok() || !*after) return Fail(me.rank, kExitPoll, "Poll() not true after Wait() OK");
    s = CheckStepIsMine(launch.path, kStep, *t.model);
    if (!s.ok()) return Fail(me.rank, kExitBadStep, "after Wait: " + s.ToString());
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  for (int r = 0; r < kWorld; ++r)
    ASSERT_TRUE(ranks.Await(r, "ready", milliseconds(20000)).has_value())
        << "rank " << r << " exit " << ranks.child(r).ExitCode(milliseconds(2000));
  for (int r = 0; r < kWorld; ++r) ranks.Tell(r, "go");
  // Rank 0 waits for "save": a waiter whose SaveNonBlocking blocked until
  // rank 0's save would never say "returned".
  int64_t max_return_us = 0;
  for (int r = 1; r < kWorld; ++r) {
    auto p = ranks.Await(r, "returned", milliseconds(20000));
    ASSERT_TRUE(p.has_value() && p->size() == 2u)
        << "rank " << r << "'s SaveNonBlocking did not return before rank 0 saved; exit "
        << ranks.child(r).ExitCode(milliseconds(2000));
    max_return_us = std::max<int64_t>(max_return_us, std::stoll((*p)[0]));
    EXPECT_EQ((*p)[1], "0") << "rank " << r << ": Poll() true before rank 0 began to save";
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
      EXPECT_GE(std::stoll((*p)[1]), save_ns) << "Poll() true before rank 0 saved";
    }
    auto rep = ParseRet(ranks.AwaitLine(r, "ret", milliseconds(20000)));
    ASSERT_TRUE(rep.has_value());
    EXPECT_EQ(rep->code, Code::kOk) << rep->message;
    EXPECT_GE(rep->t_ns, save_ns) << "Wait() returned before rank 0 began to save";
  }
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: SaveNonBlocking returned in <= %lld us on %d waiters, before rank 0 began "
      "to save; Poll() false until then; Wait() OK after the commit, step verified bit-for-bit\n",
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
    if (!got->has_value()) return Fail(me.rank, kExitLoadFailed, "Load found nothing");
    me.Say(FormatLoaded(**got, fresh.hash()));
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
      for (int i = 0; i < 60; ++i) std::this_thread::sleep_for(milliseconds(1000));
      return kExitNotKilled;
    }
    Trainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    me.Say("waiting " + std::to_string(NowNs()));
    auto got = (*ckpt)->Load(into);
    me.Say(FormatRet(
        got.ok() && !got->has_value() ? Status(Code::kNotFound, "loaded nothing") : got.status(),
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
    auto rep = ParseRet(ranks.AwaitLine(r, "ret", kWaitTimeout + milliseconds(6000)));
    ASSERT_TRUE(rep.has_value()) << "no report from the waiter";
    slowest_ms = std::max(slowest_ms,
                          ExpectKilledRankZerosWaiter(mode(), *rep, "writer died before publishing",
                                                      kill_ns, wait_start[r], kWaitTimeout));
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

// ---------------------------------------------------------------- g. striped saves

// A module plus eight 64 KiB tensors, the same on every rank for a seed.
struct StripedTrainee : Trainee {
  explicit StripedTrainee(uint64_t seed) : Trainee(seed) {
    for (int i = 0; i < 8; ++i) extra.push_back(torch::randn({16 << 10}));
  }
  void Train(int64_t step) {
    Trainee::Train(step);
    torch::NoGradGuard no_grad;
    for (auto& e : extra) e.add_(0.5);
  }
  State state() {
    State s = Trainee::state();
    for (size_t i = 0; i < extra.size(); ++i)
      s.items.emplace_back("t" + std::to_string(i), extra[i]);
    return s;
  }
  std::string hash() const {
    uint64_t h = Fnv(1469598103934665603ull, Trainee::hash().data(), 16);
    for (const auto& e : extra) h = Fnv(h, e.data_ptr(), e.nbytes());
    return Hex(h);
  }
  std::vector<torch::Tensor> extra;
};

// Bytes of the committed step's objects, by the rank that wrote them
// ("<object>.part-<r>.safetensors", rank 0 for the rest).
Result<std::vector<uint64_t>> BytesByRank(const std::string& path, int64_t step) {
  CKPTIO_ASSIGN_OR_RETURN(auto store, OpenStore(path));
  CKPTIO_ASSIGN_OR_RETURN(auto reader, store->OpenStep(step));
  CKPTIO_RETURN_IF_ERROR(reader->Verify());
  std::vector<uint64_t> bytes(kWorld, 0);
  for (const auto& o : reader->manifest().objects) {
    size_t at = o.name.find(".part-");
    int r = at == std::string::npos ? 0 : std::atoi(o.name.c_str() + at + 6);
    if (r < 0 || r >= kWorld) return Status(Code::kDataLoss, "odd part name " + o.name);
    bytes[r] += o.size;
  }
  return bytes;
}

// Five striped saves: every rank writes part of each, the step verifies
// the moment Save returns on every rank, and a load gives every rank the
// state it trained, bit for bit, with Adam's moments.
TEST_P(TorchRanksTest, StripedSavesSpreadTheBytesAndLoadBitExact) {
  constexpr int kRounds = 5;
  const Launch launch = NewLaunch();
  Ranks ranks(launch, [&](RankEnv& me) -> int {
    StripedTrainee t(kInitSeed);
    auto ckpt = me.Open(kTimeout, /*stripe=*/true);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    int64_t keys_after_first = 0;  // kStore, rank 0: the c10d store's keys after save 1
    for (int64_t step = 1; step <= kRounds; ++step) {
      t.Train(step);
      Status s = (*ckpt)->Save(step, state);
      if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
      if (step == 1 && me.c10d && me.rank == 0) keys_after_first = me.c10d->getNumKeys();
      auto bytes = BytesByRank(launch.path, step);
      if (!bytes.ok()) return Fail(me.rank, kExitBadStep, bytes.status().ToString());
      std::string line = "bytes";
      for (uint64_t b : *bytes) line += " " + std::to_string(b);
      me.Say(line);
    }
    me.Say("trained " + t.hash());
    StripedTrainee fresh(kFreshSeed + static_cast<uint64_t>(me.rank));
    State into = fresh.state();
    auto got = (*ckpt)->Load(into);
    if (!got.ok() || !got->has_value())
      return Fail(me.rank, kExitLoadFailed, got.ok() ? "nothing" : got.status().ToString());
    me.Say("loaded " + std::to_string((*got)->step) + " " + fresh.hash());
    t.Train(kRounds + 1);
    fresh.Train(kRounds + 1);
    me.Say("next " + t.hash() + " " + fresh.hash());
    // One more striped save: the coordination records of every striped
    // save and of the load before it are gone once it returns on rank 0.
    Status s = (*ckpt)->Save(kRounds + 1, state);
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    constexpr char kCounted[] = "torch-ranks-test/counted";
    if (me.c10d) {
      try {
        if (me.rank != 0) {
          me.c10d->wait({kCounted});  // adds nothing to the store before rank 0 counted
          return kExitOk;
        }
        // Keys added since save 1: one save outcome for each later save.
        me.Say("records " + std::to_string(me.c10d->getNumKeys() - keys_after_first));
        me.c10d->set(kCounted, std::vector<uint8_t>{1});
      } catch (const std::exception& e) {
        return Fail(me.rank, kExitSetup, std::string("TCPStore: ") + e.what());
      }
    } else if (me.rank == 0) {
      auto left = OpenBackendForTest(launch.path)->List(".coord/");
      if (!left.ok()) return Fail(me.rank, kExitBadStep, left.status().ToString());
      me.Say("records " + std::to_string(left->size()));  // .coord/save only
    }
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  for (int r = 0; r < kWorld; ++r) {
    auto bytes = ranks.Await(r, "bytes", milliseconds(60000));
    ASSERT_TRUE(bytes.has_value() && bytes->size() == kWorld)
        << "rank " << r << " exit " << ranks.child(r).ExitCode(milliseconds(2000));
    for (int w = 0; w < kWorld; ++w)
      EXPECT_GE(std::stoull((*bytes)[w]), 64u << 10) << "rank " << w << " wrote (almost) nothing";
    auto trained = ranks.Await(r, "trained", milliseconds(60000));
    auto loaded = ranks.Await(r, "loaded", milliseconds(20000));
    ASSERT_TRUE(trained && loaded && loaded->size() == 2u) << "rank " << r;
    EXPECT_EQ((*loaded)[0], std::to_string(kRounds));
    EXPECT_EQ((*loaded)[1], (*trained)[0]) << "rank " << r << " loaded other state than it trained";
    auto next = ranks.Await(r, "next", milliseconds(10000));
    ASSERT_TRUE(next && next->size() == 2u) << "rank " << r;
    EXPECT_EQ((*next)[0], (*next)[1]) << "rank " << r << ": Adam state did not come back";
  }
  auto records = ranks.Await(0, "records", milliseconds(60000));
  ASSERT_TRUE(records && records->size() == 1u);
  const int expected = launch.mode == WaitMode::kStore ? kRounds : 1;
  EXPECT_EQ(std::stoi((*records)[0]), expected)
      << "coordination records of striped saves or loads were left behind";
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: %d striped saves x %d ranks: every rank wrote part of every step, which "
      "verified on every rank as Save returned; all loaded the state they trained, Adam "
      "included; no go-ahead, receipt or load decision left behind\n",
      mode_name().c_str(), kRounds + 1, kWorld);
}

// Kills its own process when an object whose key contains `needle` is
// about to be committed (its bytes written, not yet durable).
class KillAtCommit : public ::ckptio::testing::ForwardingBackend {
 public:
  KillAtCommit(std::shared_ptr<StorageBackend> inner, std::string needle)
      : ForwardingBackend(std::move(inner)), needle_(std::move(needle)) {}
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    CKPTIO_ASSIGN_OR_RETURN(auto w, ForwardingBackend::NewObject(key, mode));
    if (std::string(key).find(needle_) == std::string::npos) return w;
    struct Killer : ObjectWriter {
      std::unique_ptr<ObjectWriter> inner;
      Status Append(const void* d, size_t n) override { return inner->Append(d, n); }
      Status Commit() override {
        ::kill(::getpid(), SIGKILL);
        return inner->Commit();
      }
    };
    auto k = std::make_unique<Killer>();
    k->inner = std::move(w);
    return std::unique_ptr<ObjectWriter>(std::move(k));
  }

 private:
  std::string needle_;
};

// Rank 2 dies (SIGKILL) while writing its stripe of step 2: no rank
// returns success for step 2 (rank 0 by its deadline, naming rank 2), step 1
// stays the newest committed step, and a relaunch loads step 1 and saves
// striped again.
TEST_P(TorchRanksTest, AStripingRankKilledMidSaveFailsTheStepAndARelaunchRecovers) {
  constexpr milliseconds kShort(4000);
  const Launch first = NewLaunch(/*agent_serves=*/true);
  Ranks ranks(first, [&](RankEnv& me) -> int {
    StripedTrainee t(kInitSeed);
    std::shared_ptr<StorageBackend> backend;
    if (me.rank == 2) {
      auto posix = OpenBackendForTest(first.path);
      if (!posix) return Fail(me.rank, kExitSetup, "no backend");
      backend = std::make_shared<KillAtCommit>(posix, "step-000000000002/");
    }
    auto ckpt = me.Open(kShort, /*stripe=*/true, backend);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    t.Train(1);
    Status s = (*ckpt)->Save(1, state);
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    me.Say("saved1 " + t.hash());
    t.Train(2);
    s = (*ckpt)->Save(2, state);  // rank 2 dies in here
    me.Say(FormatRet(s, NowNs()));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  std::string saved1;
  for (int r : {0, 1, 3}) {
    auto line = ranks.AwaitLine(r, "ret", milliseconds(60000));
    auto ret = ParseRet(line);
    ASSERT_TRUE(ret.has_value()) << "rank " << r << " exit "
                                 << ranks.child(r).ExitCode(milliseconds(2000));
    EXPECT_NE(ret->code, Code::kOk) << "rank " << r << " reported step 2 saved";
    if (r == 0) {
      EXPECT_NE(ret->message.find("rank 2's stripe"), std::string::npos) << ret->message;
    }
    auto s1 = ranks.Await(r, "saved1", milliseconds(1000));
    ASSERT_TRUE(s1.has_value());
    saved1 = (*s1)[0];
  }
  EXPECT_EQ(ranks.child(2).ExitCode(milliseconds(20000)), 128 + SIGKILL)
      << "rank 2 should have been killed";
  {
    auto store = OpenStore(first.path);
    ASSERT_TRUE(store.ok());
    auto latest = (*store)->OpenLatest();
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ((*latest)->step(), 1);
    CKPTIO_EXPECT_OK((*latest)->Verify());
    EXPECT_FALSE((*store)->OpenStep(2).ok()) << "step 2 must not be committed";
  }

  const Launch second = NewLaunch(/*agent_serves=*/true);
  Ranks again(second, [&](RankEnv& me) -> int {
    StripedTrainee t(kFreshSeed + static_cast<uint64_t>(me.rank));
    auto ckpt = me.Open(kTimeout, /*stripe=*/true);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    auto got = (*ckpt)->Load(state);
    if (!got.ok() || !got->has_value())
      return Fail(me.rank, kExitLoadFailed, got.ok() ? "nothing" : got.status().ToString());
    me.Say("loaded " + std::to_string((*got)->step) + " " + t.hash());
    t.Train(2);
    Status s = (*ckpt)->Save(2, state);
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    auto bytes = BytesByRank(second.path, 2);
    if (!bytes.ok()) return Fail(me.rank, kExitBadStep, bytes.status().ToString());
    me.Say("saved2");
    return kExitOk;
  });
  ASSERT_TRUE(again.started());
  for (int r = 0; r < kWorld; ++r) {
    auto loaded = again.Await(r, "loaded", milliseconds(60000));
    ASSERT_TRUE(loaded && loaded->size() == 2u)
        << "rank " << r << " exit " << again.child(r).ExitCode(milliseconds(2000));
    EXPECT_EQ((*loaded)[0], "1");
    EXPECT_EQ((*loaded)[1], saved1) << "rank " << r;
    EXPECT_TRUE(again.Await(r, "saved2", milliseconds(60000)).has_value()) << "rank " << r;
  }
  EXPECT_ALL_RANKS_EXIT_OK(again, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: rank 2 SIGKILLed while committing its stripe: no rank reported the step "
      "saved (rank 0 named rank 2's stripe), the previous step stayed LATEST and verified; a "
      "relaunch loaded it on every rank and saved striped again\n",
      mode_name().c_str());
}

INSTANTIATE_TEST_SUITE_P(Modes, TorchRanksTest,
                         ::testing::Values(WaitMode::kManifest, WaitMode::kFileLock,
                                           WaitMode::kStore),
                         [](const ::testing::TestParamInfo<WaitMode>& param_info) {
                           switch (param_info.param) {
                             case WaitMode::kManifest:
                               return std::string("Manifest");
                             case WaitMode::kFileLock:
                               return std::string("FileLock");
                             case WaitMode::kStore:
                               return std::string("C10dStore");
                           }
                           return std::string("Unknown");
                         });

}  // namespace
}  // namespace ckptio
