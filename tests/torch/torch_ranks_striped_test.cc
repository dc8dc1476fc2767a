// The Checkpointer across real processes, every wait mode: striped saves
// (every rank writes part of each step) that load bit-exactly, and a
// striping rank SIGKILLed mid-save. See torch_ranks_test_util.h.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "torch_ranks_test_util.h"

namespace ckptio::torch_ranks_testing {
namespace {

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
    Result<int64_t> keys_before = -1;  // kStore, rank 0: the c10d store's keys before any save
    if (me.c10d) keys_before = me.KeysAtBarrier("opened");
    if (!keys_before.ok()) return Fail(me.rank, kExitSetup, keys_before.status().ToString());
    for (int64_t step = 1; step <= kRounds; ++step) {
      t.Train(step);
      Status s = (*ckpt)->Save(step, state);
      if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
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
    if (!got.ok() || !got->step.has_value())
      return Fail(me.rank, kExitLoadFailed, got.ok() ? "nothing" : got.status().ToString());
    me.Say("loaded " + std::to_string((*got->step)) + " " + fresh.hash());
    t.Train(kRounds + 1);
    fresh.Train(kRounds + 1);
    me.Say("next " + t.hash() + " " + fresh.hash());
    // One more striped save: the coordination records of every striped
    // save and of the load before it are gone once it returns on rank 0
    // (the c10d store: once it returned on every rank, save outcomes too).
    Status s = (*ckpt)->Save(kRounds + 1, state);
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    if (me.c10d) {
      auto keys = me.KeysAtBarrier("saved");  // every rank returned from its last save
      if (!keys.ok()) return Fail(me.rank, kExitSetup, keys.status().ToString());
      if (me.rank == 0) me.Say("records " + std::to_string(*keys - *keys_before));
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
  const int expected = launch.mode == WaitMode::kStore ? 0 : 1;
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
// A rank's striped Checkpointer in the failure scenarios, rank 2's on the
// POSIX store at `path` wrapped by `wrap`.
template <typename Wrap>
Result<std::unique_ptr<Checkpointer>> OpenStriped(RankEnv& me, milliseconds timeout,
                                                  const std::string& path, Wrap wrap) {
  std::shared_ptr<StorageBackend> backend;
  if (me.rank == 2) {
    std::shared_ptr<StorageBackend> posix = OpenBackendForTest(path);
    if (!posix) return Status(Code::kInternal, "no backend for " + path);
    backend = wrap(posix);
  }
  return me.Open(timeout, /*stripe=*/true, backend);
}

// After a striped save of step 2 that failed: step 1 is still the newest
// committed step and verifies; step 2 is not committed.
void ExpectStep1StaysLatest(const std::string& path) {
  auto store = OpenStore(path);
  ASSERT_TRUE(store.ok());
  auto latest = (*store)->OpenLatest();
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ((*latest)->step(), 1);
  CKPTIO_EXPECT_OK((*latest)->Verify());
  EXPECT_FALSE((*store)->OpenStep(2).ok()) << "step 2 must not be committed";
}

// A relaunched rank's striped save of step 2 into the store at `path`,
// checked (every rank wrote its share); says "saved2".
int SaveStep2Striped(RankEnv& me, Checkpointer& ckpt, State& state, const std::string& path) {
  Status s = ckpt.Save(2, state);
  if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
  auto bytes = BytesByRank(path, 2);
  if (!bytes.ok()) return Fail(me.rank, kExitBadStep, bytes.status().ToString());
  me.Say("saved2");
  return kExitOk;
}

TEST_P(TorchRanksTest, AStripingRankKilledMidSaveFailsTheStepAndARelaunchRecovers) {
  constexpr milliseconds kShort(4000);
  const Launch first = NewLaunch(/*agent_serves=*/true);
  Ranks ranks(first, [&](RankEnv& me) -> int {
    StripedTrainee t(kInitSeed);
    auto ckpt = OpenStriped(me, kShort, first.path, [](auto posix) {
      return std::make_shared<KillAtCommit>(posix, "step-000000000002/");
    });
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    t.Train(1);
    Status s = (*ckpt)->Save(1, state);
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    me.Say("saved1 " + t.hash());
    t.Train(2);
    s = (*ckpt)->Save(2, state);  // rank 2 dies in here
    me.Say(FormatReport(s, NowNs()));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  std::string saved1;
  for (int r : {0, 1, 3}) {
    auto line = ranks.AwaitLine(r, "ret", milliseconds(60000));
    auto ret = ParseReport(line);
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
  ExpectStep1StaysLatest(first.path);

  const Launch second = NewLaunch(/*agent_serves=*/true);
  Ranks again(second, [&](RankEnv& me) -> int {
    StripedTrainee t(kFreshSeed + static_cast<uint64_t>(me.rank));
    auto ckpt = me.Open(kTimeout, /*stripe=*/true);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    auto got = (*ckpt)->Load(state);
    if (!got.ok() || !got->step.has_value())
      return Fail(me.rank, kExitLoadFailed, got.ok() ? "nothing" : got.status().ToString());
    me.Say("loaded " + std::to_string((*got->step)) + " " + t.hash());
    t.Train(2);
    return SaveStep2Striped(me, **ckpt, state, second.path);
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

// Holds rank 2 before it writes into the step: the first object whose key
// holds `needle` makes the file `held`, then waits (up to 60 s) for
// `release` before it is created.
class HoldBeforeWriting : public ::ckptio::testing::ForwardingBackend {
 public:
  HoldBeforeWriting(std::shared_ptr<StorageBackend> inner, std::string needle, std::string held,
                    std::string release)
      : ForwardingBackend(std::move(inner)),
        needle_(std::move(needle)),
        held_(std::move(held)),
        release_(std::move(release)) {}
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    if (std::string(key).find(needle_) != std::string::npos) {
      if (std::FILE* f = std::fopen(held_.c_str(), "w")) std::fclose(f);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (::access(release_.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until)
        ::usleep(10000);
    }
    return ForwardingBackend::NewObject(key, mode);
  }

 private:
  std::string needle_, held_, release_;
};

// Rank 0 interrupted (WaitInterrupt: the Python package's Ctrl-C) while it
// waits for rank 2's stripe, which rank 2 has not begun to write: rank 0's
// save ends at once with the interrupt's status and gives the step up
// without waiting for the other ranks; no rank reports step 2 saved, step 1
// stays the newest committed step; rank 2's part, written after that, is
// left in the uncommitted step and cleared by the next save of step 2,
// which commits striped.
TEST_P(TorchRanksTest, AStripedSaveInterruptedWaitingForARankCommitsNothing) {
  const Launch first = NewLaunch(/*agent_serves=*/true);
  const std::string held = first.path + ".held", release = first.path + ".release";
  Ranks ranks(first, [&](RankEnv& me) -> int {
    StripedTrainee t(kInitSeed);
    auto ckpt = OpenStriped(me, kTimeout, first.path, [&](auto posix) {
      return std::make_shared<HoldBeforeWriting>(posix, "step-000000000002/", held, release);
    });
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    t.Train(1);
    Status s = (*ckpt)->Save(1, state);
    if (!s.ok()) return Fail(me.rank, kExitSaveFailed, s.ToString());
    t.Train(2);
    if (me.rank == 0) {
      // Interrupted 0.3 s after rank 2 began to hold: rank 2 had the
      // go-ahead, so rank 0 is then waiting for the receipts (it cannot have
      // rank 2's).
      std::optional<std::chrono::steady_clock::time_point> seen;
      WaitInterrupt interrupt([&]() -> Status {
        if (!seen && ::access(held.c_str(), F_OK) == 0) seen = std::chrono::steady_clock::now();
        if (seen && std::chrono::steady_clock::now() - *seen > milliseconds(300))
          return Status(Code::kAborted, "interrupted by the test");
        return OkStatus();
      });
      s = (*ckpt)->Save(2, state);
      const int64_t returned = NowNs();
      std::FILE* f = std::fopen(release.c_str(), "w");  // rank 2 may finish now
      if (f) std::fclose(f);
      me.Say(FormatReport(s, returned));
      return kExitOk;
    }
    s = (*ckpt)->Save(2, state);
    me.Say(FormatReport(s, NowNs()));
    return kExitOk;
  });
  ASSERT_TRUE(ranks.started());
  for (int r = 0; r < kWorld; ++r) {
    auto ret = ParseReport(ranks.AwaitLine(r, "ret", milliseconds(90000)));
    ASSERT_TRUE(ret.has_value()) << "rank " << r << " exit "
                                 << ranks.child(r).ExitCode(milliseconds(2000));
    EXPECT_NE(ret->code, Code::kOk) << "rank " << r << " reported step 2 saved";
    if (r == 0) {
      EXPECT_EQ(ret->code, Code::kAborted) << ret->message;
      EXPECT_NE(ret->message.find("interrupted by the test"), std::string::npos) << ret->message;
    }
  }
  EXPECT_ALL_RANKS_EXIT_OK(ranks, milliseconds(30000));
  ExpectStep1StaysLatest(first.path);
  // Rank 2's part, written after rank 0 gave the step up, is left there.
  bool late_part = false;
  for (const auto& f : std::filesystem::directory_iterator(first.path + "/step-000000000002"))
    late_part = late_part || f.path().filename().string().find(".part-2") != std::string::npos;
  EXPECT_TRUE(late_part) << "the scenario: rank 2 must have committed its part late";

  const Launch second = NewLaunch(/*agent_serves=*/true);
  Ranks again(second, [&](RankEnv& me) -> int {
    StripedTrainee t(kInitSeed);
    auto ckpt = me.Open(kTimeout, /*stripe=*/true);
    if (!ckpt.ok()) return Fail(me.rank, kExitSetup, ckpt.status().ToString());
    State state = t.state();
    t.Train(1);
    t.Train(2);
    return SaveStep2Striped(me, **ckpt, state, second.path);
  });
  ASSERT_TRUE(again.started());
  for (int r = 0; r < kWorld; ++r)
    EXPECT_TRUE(again.Await(r, "saved2", milliseconds(60000)).has_value()) << "rank " << r;
  EXPECT_ALL_RANKS_EXIT_OK(again, milliseconds(30000));
  if (HasFailure()) return;
  std::printf(
      "torch-ranks: %s: rank 0 interrupted while rank 2 held back its stripe: rank 0's save "
      "ended ABORTED (the interrupt's status), no rank reported step 2 saved, step 1 stayed LATEST "
      "and verified; the "
      "next striped save of step 2 committed over rank 2's late part\n",
      mode_name().c_str());
}

}  // namespace
}  // namespace ckptio::torch_ranks_testing
