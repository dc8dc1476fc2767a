// The LibTorch adapter: Checkpointer options and two ranks in one process
// (ticket polls, the save lock, timeouts, c10d scopes and stores, a chosen
// step retired), the one-liners, CUDA round trips. See
// torch_state_test_util.h.
#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ckptio/posix_backend.h"
#include "cuda_test_util.h"
#include "memory_of_this_thread.h"
#include "tcp_store_test_util.h"
#include "torch/libtorch_errors.h"
#include "torch/striped_save.h"
#include "torch_state_test_util.h"

namespace ckptio::torch_state_testing {
namespace {

// Rank r of a job of two, for two Checkpointers in one process.
RankInfo RankOfTwo(int r, const std::string& job) {
  RankInfo info;
  info.source = "test";
  info.rank = r;
  info.world_size = 2;
  info.local_rank = r;
  info.local_world_size = 2;
  info.job_id = job;
  return info;
}

// Fails the first `failures` reads of LATEST with UNAVAILABLE, as an NFS
// backend does for timeout_ms after a call that got no answer.
class FlakyLatest : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    if (key == kLatestKey && failures > 0) {
      --failures;
      return Status(Code::kUnavailable, "injected: the server did not answer");
    }
    return ForwardingBackend::OpenObject(key);
  }
  std::atomic<int> failures{0};
};

// A waiting rank's save: a poll that finds the storage not answering for a
// moment says "not yet", not a failed save.
TEST(TorchStateTest, AWaitingRankPollsPastAStorageThatDoesNotAnswerForAMoment) {
  TempDir dir;
  CheckpointerOptions o;
  o.timeout = std::chrono::seconds(10);
  auto ck0 = Checkpointer::Open(dir.Sub("store"), RankOfTwo(0, "flaky-poll-test"), o);
  auto posix = NewPosixBackend(dir.Sub("store"));
  ASSERT_TRUE(posix.ok());
  auto flaky = std::make_shared<FlakyLatest>(std::shared_ptr<StorageBackend>(std::move(*posix)));
  o.backend = flaky;
  auto ck1 = Checkpointer::Open(dir.Sub("store"), RankOfTwo(1, "flaky-poll-test"), o);
  ASSERT_TRUE(ck0.ok() && ck1.ok());
  torch::Tensor t = torch::full({16}, 1.0f);
  State s{{"t", t}};
  CKPTIO_ASSERT_OK((*ck0)->Save(1, s));
  flaky->failures = 3;
  Status waited = (*ck1)->Save(1, s);
  EXPECT_TRUE(waited.ok()) << "one unanswered read failed the waiting rank's save: " << waited;
  EXPECT_EQ(flaky->failures, 0);
}

// Refuses the save lock, as a storage whose lock manager is down does.
class NoSaveLock : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    if (key == ".save-lock") return Status(Code::kUnavailable, "injected: no lock manager");
    return ForwardingBackend::TryLock(key, mode);
  }
};

// File lock: rank 0's Open takes the save lock. An Open that cannot says
// so and counts no Checkpointer: the rank's next Open names the same
// Checkpointer as the other ranks' do, and their saves meet.
TEST(TorchStateTest, AFileLockOpenThatCannotTakeTheSaveLockFailsAndCountsNothing) {
  TempDir dir;
  CheckpointerOptions o;
  o.wait = WaitOn::FileLock();
  o.timeout = std::chrono::seconds(5);
  CheckpointerOptions refused = o;
  refused.backend = std::make_shared<NoSaveLock>(
      std::shared_ptr<StorageBackend>(NewPosixBackend(dir.Sub("store")).value()));
  auto failed = Checkpointer::Open(dir.Sub("store"), RankOfTwo(0, "open-lock-test"), refused);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), Code::kUnavailable) << failed.status();
  EXPECT_NE(failed.status().message().find("taking the save lock as the Checkpointer opens"),
            std::string::npos)
      << failed.status();
  auto ck0 = Checkpointer::Open(dir.Sub("store"), RankOfTwo(0, "open-lock-test"), o);
  auto ck1 = Checkpointer::Open(dir.Sub("store"), RankOfTwo(1, "open-lock-test"), o);
  ASSERT_TRUE(ck0.ok() && ck1.ok());
  torch::Tensor t0 = torch::full({16}, 2.0f), t1 = torch::full({16}, 2.0f);
  State s0{{"t", t0}}, s1{{"t", t1}};
  Status saved1;
  std::thread rank1([&] { saved1 = (*ck1)->Save(1, s1); });
  CKPTIO_EXPECT_OK((*ck0)->Save(1, s0));
  rank1.join();
  EXPECT_TRUE(saved1.ok()) << "the ranks named different Checkpointers: " << saved1;
}

// WaitOn::C10dStore without a store is refused at Open, naming what to pass.
TEST(TorchStateTest, AC10dWaitWithoutAStoreIsRefused) {
  TempDir dir;
  CheckpointerOptions o;
  o.wait = WaitOn::C10dStore(c10::intrusive_ptr<c10d::Store>());
  EXPECT_EQ(o.wait.mode(), WaitMode::kStore);
  auto c = Checkpointer::Open(dir.Sub("store"), RankOfTwo(1, "null-store-test"), o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("c10d store"), std::string::npos) << c.status();
}

// LibTorch's errors keep their meaning as codes: out of memory (a GPU's or
// the host's) can be retried with less; a shape mismatch cannot.
TEST(TorchStateTest, LibTorchErrorsMapToTheirCodes) {
  auto thrown = [](auto&& fn) {
    return internal::Guard("loading x", [&]() -> Status {
      fn();
      return OkStatus();
    });
  };
  Status oom = thrown([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory"); });
  EXPECT_EQ(oom.code(), Code::kResourceExhausted) << oom;
  EXPECT_NE(oom.message().find("loading x: CUDA out of memory"), std::string::npos) << oom;
  Status host = thrown([] { throw std::bad_alloc(); });
  EXPECT_EQ(host.code(), Code::kResourceExhausted) << host;
  Status todo = thrown([] { TORCH_CHECK_WITH(NotImplementedError, false, "no kernel"); });
  EXPECT_EQ(todo.code(), Code::kUnimplemented) << todo;
  Status shape = thrown([] { TORCH_CHECK(false, "shape '[3]' is invalid for input of size 2"); });
  EXPECT_EQ(shape.code(), Code::kInvalidArgument) << shape;
}

// A rank's failure travels in place of a receipt or go-ahead as
// "error:" + EncodeStatus; a damaged one is still a failure, never OK or an
// out-of-range code.
TEST(TorchStateTest, StripeErrorPayloadsRoundTripAndRefuseDamage) {
  const Status sent(Code::kResourceExhausted, "rank 2: disk full: free space");
  auto back = internal::PayloadError(internal::ErrorPayload(sent));
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->code(), sent.code());
  EXPECT_EQ(back->message(), sent.message());
  EXPECT_EQ(back->origin(), Status::Origin::kPeer);
  EXPECT_FALSE(internal::PayloadError("ok").has_value());
  for (const char* damaged : {"error:", "error:0:fine", "error:77:x", "error:x:y"}) {
    auto got = internal::PayloadError(damaged);
    ASSERT_TRUE(got.has_value()) << damaged;
    EXPECT_EQ(got->code(), Code::kInternal) << damaged << ": " << *got;
  }
}

// A timeout of 0 (which would end every wait at once, and which LibTorch's
// c10d takes for "wait for ever") or less is refused at Open, in every wait
// mode.
TEST(TorchStateTest, ATimeoutThatWouldNeverEndIsRefused) {
  TempDir dir;
  auto served = testing::ConnectTcpStore(0, true);
  for (auto mode : {WaitMode::kManifest, WaitMode::kStore}) {
    for (auto ms : {0, -5}) {
      CheckpointerOptions o;
      o.wait = mode == WaitMode::kStore ? WaitOn::C10dStore(served) : WaitOn::Manifest();
      o.timeout = std::chrono::milliseconds(ms);
      auto c = Checkpointer::Open(dir.Sub("store"), RankOfTwo(1, "timeout-test"), o);
      ASSERT_FALSE(c.ok()) << "a timeout of " << ms << " ms was accepted";
      EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << c.status();
      EXPECT_NE(c.status().message().find("at least 1 ms"), std::string::npos) << c.status();
    }
  }
}

// kStore: a Checkpointer's scope is counted in the c10d store, not named by
// the store object's address. A trainer that reopens its Checkpointers with
// a new store client on one rank and the old object on another (or gets a
// freed object's address again) still has every rank load the same step.
TEST(TorchStateTest, C10dScopesAgreeWhenARankMakesANewStoreClient) {
  TempDir dir;
  auto tcp = [](uint16_t port, bool server) { return testing::ConnectTcpStore(port, server); };
  auto served = tcp(0, true);
  auto first_client = tcp(served->getPort(), false);
  CheckpointerOptions o;
  o.timeout = std::chrono::seconds(5);
  torch::Tensor t = torch::full({4}, 3.0f);
  State s{{"t", t}};
  auto open = [&](int r, c10::intrusive_ptr<c10d::Store> store) {
    o.wait = WaitOn::C10dStore(std::move(store));
    auto c = Checkpointer::Open(dir.Sub("store"), RankOfTwo(r, "c10d-scope-test"), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  };
  {
    auto ck0 = open(0, served);
    auto ck1 = open(1, first_client);
    ASSERT_TRUE(ck0 && ck1);
    for (auto* ck : {ck0.get(), ck1.get()}) {  // an empty store: nothing to load
      auto got = ck->Load(s);
      ASSERT_TRUE(got.ok() && !got->step.has_value()) << got.status();
    }
    CKPTIO_ASSERT_OK(ck0->Save(10, s));
    CKPTIO_ASSERT_OK(ck1->Save(10, s));
  }
  auto ck0 = open(0, served);
  auto ck1 = open(1, tcp(served->getPort(), false));  // a new client object
  ASSERT_TRUE(ck0 && ck1);
  auto got0 = ck0->Load(s);
  ASSERT_TRUE(got0.ok() && got0->step.has_value()) << got0.status();
  EXPECT_EQ((*got0->step), 10);
  auto got1 = ck1->Load(s);
  ASSERT_TRUE(got1.ok()) << got1.status();
  ASSERT_TRUE(got1->step.has_value()) << "rank 1 read an earlier Checkpointer's decision";
  EXPECT_EQ((*got1->step), 10);
}

// kStore: a rank waiting for rank 0 (here SaveAsync's thread, for the
// commit) polls the c10d store with check(), so the trainer's own calls on
// the same client go through meanwhile (LibTorch 1.13's TCPStore client
// holds its lock for a whole wait()). And a wait that timed out leaves the
// client usable once its key comes (a 1.13 wait() that timed out leaves its
// answer on the socket, read as the answer to the next call).
TEST(TorchStateTest, AWaitingRankLeavesTheC10dStoreToTheTrainer) {
  TempDir dir;
  auto served = testing::ConnectTcpStore(0, true);
  auto client = testing::ConnectTcpStore(served->getPort(), false);
  const std::vector<uint8_t> mine{7, 8, 9};
  client->set("trainer/key", mine);
  auto trainer_get = [&]() -> std::string {
    try {
      return client->get("trainer/key") == mine ? "ok" : "a wrong value";
    } catch (const std::exception& e) {
      const std::string text = e.what();
      return text.substr(0, text.find('\n'));  // (LibTorch appends a stack trace)
    }
  };
  CheckpointerOptions o;
  o.timeout = std::chrono::milliseconds(1500);
  o.wait = WaitOn::C10dStore(served);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto ck0,
                              Checkpointer::Open(dir.Sub("store"), RankOfTwo(0, "c10d-free"), o));
  o.wait = WaitOn::C10dStore(client);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto ck1,
                              Checkpointer::Open(dir.Sub("store"), RankOfTwo(1, "c10d-free"), o));
  torch::Tensor t = torch::full({4}, 1.0f);
  State s{{"t", t}};
  auto saving = ck1->SaveAsync(1, s);  // rank 0 is not saving: it times out
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(trainer_get(), "ok");
  const int64_t took_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_LT(took_ms, 500) << "the trainer's call waited for the rank's wait";
  EXPECT_EQ(saving.get().code(), Code::kDeadlineExceeded);
  CKPTIO_ASSERT_OK(ck0->Save(1, s));  // the key the timed-out wait waited for
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(trainer_get(), "ok") << "after a timed-out wait, the store client is out of step";
}

// Deletes step `retire` (manifest first, as retention does) when its first
// object other than the manifest is opened: retired between the read of its
// manifest and of its tensors.
class RetiresOnOpen : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    const std::string dir = "step-00000000000" + std::to_string(retire) + "/";
    if (retire >= 0 && key.rfind(dir, 0) == 0 && key != dir + "MANIFEST.json") {
      retire = -1;
      EXPECT_TRUE(Delete(dir + "MANIFEST.json").ok());
      auto keys = List(dir);
      for (const auto& k : keys.ok() ? *keys : std::vector<std::string>{}) (void)Delete(k);
    }
    return ForwardingBackend::OpenObject(key);
  }
  int retire = -1;
};

// Rank 0 decides which step to load, then saves again with keep_last 1
// before rank 1 has read that step (no collective between rank 0's load and
// its next save): rank 1 cannot load what rank 0 chose, and must say why
// and what to change, not "open LATEST again" (a rank may not pick another
// step). Once before rank 1 opens the step, once while it reads it.
TEST(TorchStateTest, ARankWhoseChosenStepWasRetiredSaysWhy) {
  TempDir dir;
  auto rank = [](int r) { return RankOfTwo(r, "retired-step-test"); };
  CheckpointerOptions o;
  o.keep_last = 1;
  o.timeout = std::chrono::seconds(5);
  auto ck0 = Checkpointer::Open(dir.Sub("store"), rank(0), o);
  auto posix = NewPosixBackend(dir.Sub("store"));
  ASSERT_TRUE(posix.ok());
  auto retiring =
      std::make_shared<RetiresOnOpen>(std::shared_ptr<StorageBackend>(std::move(*posix)));
  o.backend = retiring;
  auto ck1 = Checkpointer::Open(dir.Sub("store"), rank(1), o);
  ASSERT_TRUE(ck0.ok() && ck1.ok());
  torch::Tensor t = torch::full({16}, 1.0f);
  State s{{"t", t}};
  for (int64_t step : {1, 2}) {
    CKPTIO_ASSERT_OK((*ck0)->Save(step, s));
    CKPTIO_ASSERT_OK((*ck1)->Save(step, s));
  }
  for (int64_t step : {2, 3}) {
    SCOPED_TRACE(step == 2 ? "retired before rank 1 opened it" : "retired while rank 1 read it");
    auto got0 = (*ck0)->Load(s);
    ASSERT_TRUE(got0.ok() && got0->step.has_value()) << got0.status();
    ASSERT_EQ((*got0->step), step);
    if (step == 2) {
      CKPTIO_ASSERT_OK((*ck0)->Save(3, s));  // retires step 2
    } else {
      retiring->retire = 3;
    }
    auto got1 = (*ck1)->Load(s);
    ASSERT_FALSE(got1.ok()) << "rank 1 loaded a step that no longer exists";
    const std::string& m = got1.status().message();
    EXPECT_EQ(got1.status().code(), Code::kNotFound) << got1.status();
    EXPECT_NE(m.find("step " + std::to_string(step) + " of"), std::string::npos) << m;
    EXPECT_NE(m.find("keep_last"), std::string::npos) << m;
    EXPECT_NE(m.find("collective"), std::string::npos) << m;
    EXPECT_EQ(m.find("open LATEST again"), std::string::npos) << m;
    EXPECT_EQ(retiring->retire, -1) << "the test's deletion never ran";
  }
}

// Reports which of a step's data objects are opened, and how many at once
// (each opening waits up to a second for the others, testing::Gate); its
// readers take several reads at once, as an object store's do.
class RoundTripOpens : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    const std::string name(key.substr(key.rfind('/') + 1));
    if (name.find(".safetensors") != std::string::npos ||
        name.find(".optim.pt") != std::string::npos) {
      {
        std::lock_guard<std::mutex> g(mu);
        opened.insert(name);
      }
      opens.Pass();
    }
    struct Reader : ObjectReader {
      std::unique_ptr<ObjectReader> inner;
      uint64_t Size() const override { return inner->Size(); }
      Status ReadAt(uint64_t offset, void* buf, size_t size) override {
        return inner->ReadAt(offset, buf, size);
      }
      unsigned ConcurrentReads() const override { return 4; }
    };
    auto r = std::make_unique<Reader>();
    CKPTIO_ASSIGN_OR_RETURN(r->inner, ForwardingBackend::OpenObject(key));
    return std::unique_ptr<ObjectReader>(std::move(r));
  }

  testing::Gate opens;
  std::mutex mu;
  std::set<std::string> opened;
};

// A rank other than 0, which has viewed nothing of the step rank 0 chose,
// opens the objects its state takes at once (on an object store, each
// opening and each read is a round trip), and only those: a state of one
// item, its object alone.
TEST(TorchStateTest, ARankOtherThanZeroOpensTheObjectsItLoadsAtOnce) {
  TempDir dir;
  auto rank = [](int r) { return RankOfTwo(r, "objects-at-once-test"); };
  CheckpointerOptions o;
  o.timeout = std::chrono::seconds(10);
  auto ck0 = Checkpointer::Open(dir.Sub("store"), rank(0), o);
  auto counting = std::make_shared<RoundTripOpens>(
      std::shared_ptr<StorageBackend>(NewPosixBackend(dir.Sub("store")).value()));
  o.backend = counting;
  auto ck1 = Checkpointer::Open(dir.Sub("store"), rank(1), o);
  ASSERT_TRUE(ck0.ok() && ck1.ok());
  Net net;
  torch::optim::Adam adam(net.parameters());
  Train(net, adam, 2, 1);
  torch::Tensor t = torch::arange(100, torch::kFloat32);
  State saved{{"model", net}, {"optim", adam}, {"t", t}};
  CKPTIO_ASSERT_OK((*ck0)->Save(1, saved));
  CKPTIO_ASSERT_OK((*ck1)->Save(1, saved));

  Net net1;
  torch::optim::Adam adam1(net1.parameters());
  torch::Tensor t1 = torch::zeros({100});
  State all{{"model", net1}, {"optim", adam1}, {"t", t1}};
  State model_only{{"model", net1}}, tensor_only{{"t", t1}};
  for (State* into : {&all, &model_only, &tensor_only}) {
    const bool whole = into == &all;
    SCOPED_TRACE(whole ? "module, optimizer and tensor" : "one item");
    auto got0 = (*ck0)->Load(saved);
    ASSERT_TRUE(got0.ok() && got0->step == 1) << got0.status();
    counting->opened.clear();
    counting->opens.Start(whole ? 3 : 1);
    auto got1 = (*ck1)->Load(*into);
    counting->opens.Stop();
    ASSERT_TRUE(got1.ok() && got1->step == 1) << got1.status();
    EXPECT_TRUE(BitEqual(net1.fc1->weight, net.fc1->weight));
    if (whole) {
      EXPECT_TRUE(BitEqual(t1, t));
      EXPECT_EQ(counting->opens.most_at_once(), 3) << "rank 1 opened its objects one by one";
      EXPECT_EQ(counting->opened, (std::set<std::string>{"model.safetensors", "optim.optim.pt",
                                                         "tensors.safetensors"}));
    } else {
      EXPECT_EQ(
          counting->opened,
          std::set<std::string>{into == &model_only ? "model.safetensors" : "tensors.safetensors"})
          << "rank 1 read objects its state does not take";
    }
  }
}

TEST(TorchStateTest, OneLineSaveAndLoadMirrorTorch) {
  TempDir dir;
  const std::string uri = "file://" + dir.Sub("m");
  torch::nn::Linear lin(5, 3);
  CKPTIO_ASSERT_OK(save(lin, uri));
  CKPTIO_ASSERT_OK(save(lin, uri));  // the next step, not an overwrite
  torch::nn::Linear lin2(5, 3);
  CKPTIO_ASSERT_OK(load(lin2, uri));
  EXPECT_TRUE(BitEqual(lin2->weight, lin->weight));
  EXPECT_TRUE(BitEqual(lin2->bias, lin->bias));
  auto store = OpenStore(uri);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, (*store)->ListSteps());
  EXPECT_EQ(steps.size(), 2u);

  torch::Tensor x = torch::arange(12).reshape({3, 4}), y;
  CKPTIO_ASSERT_OK(save(x, "file://" + dir.Sub("t")));
  CKPTIO_ASSERT_OK(load(y, "file://" + dir.Sub("t")));
  EXPECT_TRUE(BitEqual(x, y));
  EXPECT_EQ(load(y, "file://" + dir.Sub("nothing")).code(), Code::kNotFound);
}

TEST(TorchStateTest, CudaRoundTrip) {
  CKPTIO_REQUIRE_CUDA();
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::Tensor t = torch::randn({1000}, torch::Device("cuda:0"));
  State s{{"t", t}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, s));
  torch::Tensor out;
  State in{{"t", out}};
  LoadOptions o;
  o.map_location = MapLocation::To("cuda:0");
  ASSERT_TRUE(ckpt->Load(in, o).ok());
  EXPECT_TRUE(out.is_cuda());
  EXPECT_TRUE(BitEqual(out, t));
}

// A module on a GPU loads into its own memory there: the verified bytes go
// from the host through the pinned buffer, with no second copy of the
// module on the GPU (a model that fills more than half of it still loads),
// for "cuda:0" and for "cuda" (the current GPU) alike. The weight is over
// 64 MiB: copied in more than one piece.
TEST(TorchStateTest, CudaModuleLoadsWithoutASecondCopyOnTheGpu) {
  CKPTIO_REQUIRE_CUDA();
  constexpr int64_t kMiB = 1 << 20;
  const torch::Device gpu("cuda:0");
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::nn::Linear saved(2048, 8200);  // 64.06 MiB of weight
  saved->to(gpu);
  State state{{"model", *saved}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  torch::nn::Linear into(2048, 8200);
  into->to(gpu);
  const void* weight_memory = into->weight.data_ptr();
  {
    auto probe = std::make_shared<testing::MemoryOfThisThread>(c10::DeviceType::CUDA);
    c10::DebugInfoGuard profiling(c10::DebugInfoKind::PROFILER_STATE, probe);
    torch::Tensor mib =
        torch::empty({kMiB}, torch::TensorOptions().dtype(torch::kUInt8).device(gpu));
    ASSERT_GE(probe->peak, kMiB) << "the hook sees no GPU memory: the test would prove nothing";
  }
  for (const char* where : {"cuda:0", "cuda"}) {
    SCOPED_TRACE(where);
    {
      torch::NoGradGuard no_grad;
      into->weight.zero_();
      into->bias.zero_();
    }
    auto memory = std::make_shared<testing::MemoryOfThisThread>(c10::DeviceType::CUDA);
    {
      c10::DebugInfoGuard profiling(c10::DebugInfoKind::PROFILER_STATE, memory);
      State in{{"model", *into}};
      LoadOptions o;
      o.map_location = MapLocation::To(where);
      CKPTIO_ASSERT_OK(ckpt->Load(in, o).status());
    }
    EXPECT_TRUE(BitEqual(into->weight, saved->weight) && BitEqual(into->bias, saved->bias));
    EXPECT_EQ(into->weight.data_ptr(), weight_memory) << "the parameter moved to new memory";
    EXPECT_LT(memory->peak, kMiB) << "GPU memory taken by the load (a second copy of the module?)";
  }
}

// The one-line optimizer load puts the state where the parameters are (a
// CPU default would break the first step() of a model on a GPU).
TEST(TorchStateTest, CudaOneLineOptimizerLoadFollowsItsParameters) {
  CKPTIO_REQUIRE_CUDA();
  TempDir dir;
  Net net;
  net.to(torch::Device("cuda:0"));
  torch::optim::Adam adam(net.parameters());
  torch::manual_seed(1);
  adam.zero_grad();
  net.forward(torch::randn({32, 8}, torch::Device("cuda:0"))).pow(2).mean().backward();
  adam.step();
  CKPTIO_ASSERT_OK(save(adam, dir.Sub("opt")));
  Net net2;
  net2.to(torch::Device("cuda:0"));
  torch::optim::Adam adam2(net2.parameters());
  CKPTIO_ASSERT_OK(load(adam2, dir.Sub("opt")));
  ASSERT_FALSE(adam2.state().empty());
  for (const auto& [key, st] : adam2.state())
    EXPECT_TRUE(static_cast<torch::optim::AdamParamState&>(*st).exp_avg().is_cuda()) << key;
}

// LibTorch >= 2.4 starts TCPStores on libuv unless told not to; builds
// without it (Debian's) refuse. The switch is set where it exists, and
// compiles to nothing where it does not (LibTorch 1.x).
TEST(TorchStateTest, UseClassicTcpStoreTurnsLibuvOffWhereTheSwitchExists) {
  struct WithSwitch {
    bool useLibUV = true;
  } with_switch;
  UseClassicTcpStore(with_switch);
  EXPECT_FALSE(with_switch.useLibUV);
  struct WithoutSwitch {
    int port = 29500;
  } without_switch;
  UseClassicTcpStore(without_switch);
  EXPECT_EQ(without_switch.port, 29500);
}

}  // namespace
}  // namespace ckptio::torch_state_testing
