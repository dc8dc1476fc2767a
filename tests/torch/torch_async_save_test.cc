// Checkpointer::SaveAsync: the call returns once the state is staged, the
// commit happens in the background with every invariant, errors surface on
// the future and on the next call, the destructor waits; the staging limit;
// tickets and decisions of several Checkpointers. See
// torch_async_test_util.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "memory_of_this_thread.h"
#include "torch_async_test_util.h"

namespace ckptio::torch_async_testing {
namespace {

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
  ASSERT_TRUE(got.ok() && got->step.has_value()) << got.status();
  EXPECT_EQ((*got->step), 10);
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
    ASSERT_TRUE(got.ok() && got->step.has_value())
        << (got.ok() ? "nothing" : got.status().ToString());
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

// Every wait has a deadline, a waiting rank's SaveAsync too: with rank 0
// never saving, its future stays pending, then resolves DeadlineExceeded once
// the timeout since the call has passed (not later), naming the step, the
// mode and rank 0.
TEST_F(AsyncSaveTest, AWaitingRanksAsyncSaveEndsAtTheDeadline) {
  CheckpointerOptions o;
  o.timeout = 1000ms;
  auto c1 = RankOfTwo(1, "async-deadline-test", dir_.Sub("store"), o);
  ASSERT_TRUE(c1);
  Net net;
  State state{{"model", net}};
  const auto t0 = std::chrono::steady_clock::now();
  auto waiting = c1->SaveAsync(7, state);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 500ms) << "a waiting rank's SaveAsync blocked";
  EXPECT_FALSE(Ready(waiting)) << "committed without rank 0";
  Status late = waiting.get();
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(late.code(), Code::kDeadlineExceeded) << late;
  for (const char* word : {"step 7", "manifest", "rank 0"})
    EXPECT_NE(late.message().find(word), std::string::npos) << late;
  EXPECT_GE(took, 1000ms) << "gave up before the deadline";
  EXPECT_LT(took, 1850ms) << "waited past the deadline";
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
    return got->step == 20 ? OkStatus() : Status(Code::kInternal, "loaded another step");
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

}  // namespace
}  // namespace ckptio::torch_async_testing
