// The LibTorch adapter on one rank: loads are all-or-nothing (modules,
// optimizers, tensors that do not fit leave everything as it was), and a
// load falls back to the newest good step, loudly. See
// torch_state_test_util.h.
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "torch/tensors.h"
#include "torch_state_test_util.h"

namespace ckptio::torch_state_testing {
namespace {

TEST(TorchStateTest, AFailedLoadLeavesModelAndOptimizerUntouched) {
  TempDir dir;
  Net net;
  torch::optim::Adam adam(net.parameters());
  Train(net, adam, 2, 1);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State state{{"model", net}, {"optim", adam}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  // Damage the end of the optimizer archive, which loads after the module.
  std::string optim = dir.Sub("store/step-000000000001/optim.optim.pt");
  testing::FlipBit(optim, testing::ReadFile(optim).size() - 10, 2);

  torch::manual_seed(5);
  Net net2;
  torch::optim::Adam adam2(net2.parameters());
  Train(net2, adam2, 1, 2);
  auto before = Snapshot(net2);
  State into{{"model", net2}, {"optim", adam2}};
  LoadOptions o;
  o.step = 1;
  auto got = ckpt->Load(into, o);
  EXPECT_EQ(got.status().code(), Code::kDataLoss) << got.status();
  EXPECT_TRUE(SameAs(net2, before)) << "the module must not change when the load fails";

  // Shape mismatch: also refused before anything changes.
  struct Other : torch::nn::Module {
    Other() { fc1 = register_module("fc1", torch::nn::Linear(8, 3)); }
    torch::nn::Linear fc1{nullptr};
  } other;
  State model_only{{"model", net}};
  CKPTIO_ASSERT_OK(ckpt->Save(2, model_only));
  State wrong{{"model", other}};
  auto snap = Snapshot(other);
  o.step = 2;
  auto bad = ckpt->Load(wrong, o);
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fc1.weight"), std::string::npos) << bad.status();
  EXPECT_TRUE(SameAs(other, snap));
}

// LibTorch's optimizer load only adds state entries; a failed load must
// still leave every optimizer as it was, fresh (empty) ones included.
// LibTorch pairs optimizer state with parameters by position: the state of
// another model's optimizer would load and fail at the next step(). The load
// refuses it and leaves the optimizer as it was.
TEST(TorchStateTest, AnOptimizerMadeForOtherParametersIsRefused) {
  TempDir dir;
  auto step_once = [](torch::nn::Linear& m, torch::optim::Optimizer& opt) {
    opt.zero_grad();
    m->forward(torch::ones({2, m->options.in_features()})).sum().backward();
    opt.step();
  };
  torch::nn::Linear a(8, 16), b(16, 8);
  torch::optim::Adam adam_a(a->parameters()), adam_b(b->parameters());
  torch::optim::SGD sgd_a(a->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)),
      sgd_b(b->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  step_once(a, adam_a);
  step_once(a, sgd_a);
  step_once(b, adam_b);
  step_once(b, sgd_b);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State saved{{"adam", adam_a}, {"sgd", sgd_a}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, saved));
  for (const char* name : {"adam", "sgd"}) {
    torch::optim::Optimizer& target = std::string(name) == "adam"
                                          ? static_cast<torch::optim::Optimizer&>(adam_b)
                                          : static_cast<torch::optim::Optimizer&>(sgd_b);
    std::ostringstream before;
    {
      torch::serialize::OutputArchive out;
      target.save(out);
      out.save_to(before);
    }
    State into{{name, target}};
    auto got = ckpt->Load(into);
    ASSERT_FALSE(got.ok()) << name;
    EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find("made for other parameters"), std::string::npos)
        << got.status();
    std::ostringstream after;
    {
      torch::serialize::OutputArchive out;
      target.save(out);
      out.save_to(after);
    }
    EXPECT_EQ(before.str(), after.str()) << name << ": the optimizer changed";
    step_once(b, target);  // and it still trains
  }
  // The same optimizers load into optimizers of the same model.
  torch::optim::Adam adam_c(a->parameters());
  State same{{"adam", adam_c}};
  auto got = ckpt->Load(same);
  EXPECT_TRUE(got.ok()) << got.status();
}

TEST(TorchStateTest, AnOptimizerThatDoesNotFitLeavesEveryOptimizerAsItWas) {
  TempDir dir;
  Net net, other;
  torch::optim::Adam a(net.parameters()), b(other.parameters());
  Train(net, a, 2, 1);
  Train(other, b, 2, 2);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State saved{{"a", a}, {"b", b}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, saved));

  Net net2;
  torch::optim::Adam a2(net2.parameters());
  auto fewer = net2.parameters();
  fewer.pop_back();  // b's archive has one parameter more than b2: it does not fit
  torch::optim::Adam b2(fewer);
  State into{{"a", a2}, {"b", b2}};
  auto got = ckpt->Load(into);
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
  EXPECT_NE(got.status().message().find("optimizers restored"), std::string::npos) << got.status();
  EXPECT_TRUE(a2.state().empty()) << "a's state, loaded before b failed, was left in a2";
  EXPECT_TRUE(b2.state().empty());

  // With state of its own, an optimizer gets exactly that back.
  Train(net2, a2, 1, 3);
  ASSERT_FALSE(a2.state().empty());
  std::ostringstream before;
  {
    torch::serialize::OutputArchive out;
    a2.save(out);
    out.save_to(before);
  }
  EXPECT_FALSE(ckpt->Load(into).ok());
  std::ostringstream after;
  {
    torch::serialize::OutputArchive out;
    a2.save(out);
    out.save_to(after);
  }
  EXPECT_EQ(before.str(), after.str());
}

std::string Archive(const torch::optim::Optimizer& opt) {
  std::ostringstream bytes;
  torch::serialize::OutputArchive out;
  opt.save(out);
  out.save_to(bytes);
  return bytes.str();
}

// LibTorch's optimizer load only adds and overwrites state entries: loading
// a step saved before the first step() must leave the optimizer with no
// state, as saved, not with the moments it gathered since.
TEST(TorchStateTest, ALoadedOptimizerHoldsOnlyTheSavedState) {
  TempDir dir;
  Net net;
  torch::optim::Adam adam(net.parameters());
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State state{{"model", net}, {"optim", adam}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  Train(net, adam, 3, 1);
  ASSERT_FALSE(adam.state().empty());
  LoadOptions o;
  o.step = 1;
  auto got = ckpt->Load(state, o);
  ASSERT_TRUE(got.ok() && got->step.has_value())
      << (got.ok() ? "nothing" : got.status().ToString());
  EXPECT_TRUE(adam.state().empty())
      << adam.state().size() << " parameters kept moments gathered after the save";
  // Training on agrees with a fresh model and optimizer that load the step.
  Net fresh;
  torch::optim::Adam fresh_adam(fresh.parameters());
  State into{{"model", fresh}, {"optim", fresh_adam}};
  CKPTIO_ASSERT_OK(ckpt->Load(into, o).status());
  Train(net, adam, 2, 9);
  Train(fresh, fresh_adam, 2, 9);
  EXPECT_TRUE(SameAs(net, Snapshot(fresh)));
}

// What LibTorch would refuse halfway through applying a load (here a named
// tensor that requires grad, saved as integers: set_data throws) is refused
// before anything changes: module, optimizer and tensor stay as they were.
TEST(TorchStateTest, ATensorThatCannotTakeTheSavedOneFailsTheLoadBeforeAnyChange) {
  TempDir dir;
  Net net;
  torch::optim::Adam adam(net.parameters());
  Train(net, adam, 2, 1);
  torch::Tensor counts = torch::arange(4, torch::kInt64);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State saved{{"model", net}, {"optim", adam}, {"w", counts}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, saved));

  Net net2;
  torch::optim::Adam adam2(net2.parameters());
  Train(net2, adam2, 1, 2);
  torch::Tensor w = torch::zeros({4}, torch::requires_grad());
  const auto model_before = Snapshot(net2);
  const std::string adam_before = Archive(adam2);
  State into{{"model", net2}, {"optim", adam2}, {"w", w}};
  auto got = ckpt->Load(into);
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
  EXPECT_NE(got.status().message().find("\"w\" requires grad, but the checkpoint's is Long"),
            std::string::npos)
      << got.status();
  EXPECT_TRUE(SameAs(net2, model_before)) << "the module changed";
  EXPECT_EQ(Archive(adam2), adam_before) << "the optimizer changed";
  EXPECT_TRUE(torch::equal(w, torch::zeros({4})) && w.requires_grad()) << "the tensor changed";
  // Nor does a sparse tensor of the saved dtype take it (set_ would throw).
  torch::Tensor sparse = torch::zeros({4}, torch::kInt64).to_sparse();
  State into_sparse{{"model", net2}, {"w", sparse}};
  got = ckpt->Load(into_sparse);
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
  EXPECT_NE(got.status().message().find("\"w\" is a Sparse"), std::string::npos) << got.status();
  EXPECT_TRUE(SameAs(net2, model_before)) << "the module changed";
  EXPECT_TRUE(sparse.is_sparse() && sparse._nnz() == 0) << "the tensor changed";
  // Into a tensor that does not require grad, the same step loads.
  torch::Tensor plain = torch::zeros({4});
  State fits{{"model", net2}, {"optim", adam2}, {"w", plain}};
  CKPTIO_ASSERT_OK(ckpt->Load(fits).status());
  EXPECT_TRUE(BitEqual(plain, counts));
  EXPECT_TRUE(SameAs(net2, Snapshot(net)));
}

// An optimizer's device is mapped before anything loads: a missing GPU is
// named as such, not as an optimizer state that "does not fit".
TEST(TorchStateTest, AnOptimizerForAMissingDeviceSaysSoBeforeLoading) {
  if (torch::cuda::is_available() && torch::cuda::device_count() > 7)
    GTEST_SKIP() << "this machine has a cuda:7";
  TempDir dir;
  Net net;
  torch::optim::Adam adam(net.parameters());
  Train(net, adam, 1, 1);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State state{{"model", net}, {"optim", adam}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  State optim_only{{"optim", adam}};
  LoadOptions o;
  o.map_location = MapLocation::To("cuda:7");
  auto got = ckpt->Load(optim_only, o);
  EXPECT_EQ(got.status().code(), Code::kFailedPrecondition) << got.status();
  EXPECT_NE(got.status().message().find("cuda:7"), std::string::npos) << got.status();
  EXPECT_EQ(got.status().message().find("does not fit"), std::string::npos) << got.status();
}

// A module may be named "tensors" (without named tensors beside it); its
// parameters are not named tensors to a later load.
TEST(TorchStateTest, AModuleNamedTensorsIsNoSourceOfNamedTensors) {
  TempDir dir;
  Net net;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State state{{"tensors", net}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  torch::Tensor t = torch::zeros({16, 8});
  State into{{"fc1.weight", t}};
  auto got = ckpt->Load(into);
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
  EXPECT_NE(got.status().message().find("has no tensor named \"fc1.weight\""), std::string::npos)
      << got.status();
  EXPECT_TRUE(torch::equal(t, torch::zeros({16, 8})));
}

// Modules LibTorch lets a load change, and one it does not: parameters made
// under InferenceMode load outside it where they are filled byte for byte
// (contiguous, on the CPU), and a transposed one (copy_ would throw) or an
// expanded buffer (elements sharing memory) is refused before any change.
TEST(TorchStateTest, ModulesLoadWhereLibTorchLetsThemAndAreRefusedWholeElsewhere) {
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::nn::Linear saved(4, 4);
  saved->register_buffer("counts", torch::arange(4, torch::kFloat));
  State state{{"model", *saved}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));

  torch::nn::Linear inference{nullptr};
  {
    c10::InferenceMode guard;
    inference = torch::nn::Linear(4, 4);
    inference->register_buffer("counts", torch::zeros({4}));
  }
  State into{{"model", *inference}};
  CKPTIO_ASSERT_OK(ckpt->Load(into).status());
  EXPECT_TRUE(SameAs(*inference, Snapshot(*saved)));

  auto refused = [&](torch::nn::Module& m, const std::string& why) {
    SCOPED_TRACE(why);
    const auto before = Snapshot(m);
    State s{{"model", m}};
    auto got = ckpt->Load(s);
    EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find(why), std::string::npos) << got.status();
    EXPECT_TRUE(SameAs(m, before)) << "the module changed";
  };
  // Linear's tensors, as given.
  struct Like : torch::nn::Module {
    Like(torch::Tensor weight, torch::Tensor counts) {
      register_parameter("weight", std::move(weight), /*requires_grad=*/false);
      register_parameter("bias", torch::zeros({4}), /*requires_grad=*/false);
      register_buffer("counts", std::move(counts));
    }
  };
  std::unique_ptr<Like> transposed;
  {
    c10::InferenceMode guard;
    transposed = std::make_unique<Like>(torch::rand({4, 4}).t(), torch::zeros({4}));
  }
  refused(*transposed, "\"weight\" is an inference tensor");
  Like expanded(torch::rand({4, 4}), torch::zeros({1}).expand({4}));
  refused(expanded, "\"counts\" has elements sharing memory");
  // A module on the meta device (no memory: its tensors take data by
  // set_data, which refuses another tensor type), and a sparse parameter
  // (no storage to copy into; nor will set_data take dense data).
  Like meta(torch::empty({4, 4}, torch::kMeta), torch::zeros({4}));
  {
    State s{{"model", meta}};
    auto got = ckpt->Load(s);
    EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find("\"weight\" is a "), std::string::npos) << got.status();
    EXPECT_NE(got.status().message().find("which cannot take the checkpoint's"), std::string::npos)
        << got.status();
    auto p = meta.named_parameters();
    EXPECT_TRUE(p["weight"].is_meta());
    EXPECT_TRUE(BitEqual(p["bias"], torch::zeros({4}))) << "the module changed";
  }
  const torch::Tensor dense = torch::rand({4, 4});
  Like sparse(dense.to_sparse(), torch::zeros({4}));
  {
    State s{{"model", sparse}};
    auto got = ckpt->Load(s);
    EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find("\"weight\" is a Sparse"), std::string::npos)
        << got.status();
    auto p = sparse.named_parameters();
    EXPECT_TRUE(p["weight"].is_sparse() && BitEqual(p["weight"].to_dense(), dense));
    EXPECT_TRUE(BitEqual(p["bias"], torch::zeros({4}))) << "the module changed";
  }
}

// Bytes a load writes into a module's memory count as an in-place change,
// as copy_ would: autograd refuses a backward through the values a forward
// used before the load, rather than compute gradients of the wrong ones.
TEST(TorchStateTest, ALoadIntoAModuleCountsAsAnInPlaceChange) {
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::nn::Linear saved(8, 4);
  State state{{"model", *saved}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  torch::nn::Linear into(8, 4);
  torch::Tensor y = into->forward(torch::randn({2, 8}, torch::requires_grad())).sum();
  const int64_t version = into->weight._version();
  State in{{"model", *into}};
  CKPTIO_ASSERT_OK(ckpt->Load(in).status());
  EXPECT_TRUE(BitEqual(into->weight, saved->weight));
  EXPECT_GT(into->weight._version(), version);
  EXPECT_THROW(y.backward(), c10::Error) << "a backward through the overwritten weight";
}

// A load into a named tensor is set_ (done directly for a plain CPU tensor,
// through the dispatcher otherwise): either way an in-place change, and a
// view or a non-leaf takes the saved values as set_ gives them.
TEST(TorchStateTest, ALoadIntoANamedTensorCountsAsAnInPlaceChange) {
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::Tensor saved = torch::arange(4, torch::kFloat32);
  State state{{"w", saved}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));

  torch::Tensor leaf = torch::zeros({4}).requires_grad_();
  torch::Tensor y = (leaf * leaf).sum();  // saves `leaf` for its backward
  const int64_t version = leaf._version();
  const c10::TensorImpl* impl = leaf.unsafeGetTensorImpl();
  State into{{"w", leaf}};
  CKPTIO_ASSERT_OK(ckpt->Load(into).status());
  EXPECT_EQ(leaf.unsafeGetTensorImpl(), impl) << "the caller's tensor, not another";
  EXPECT_TRUE(BitEqual(leaf.detach(), saved));
  EXPECT_TRUE(leaf.requires_grad() && leaf.is_leaf());
  EXPECT_GT(leaf._version(), version);
  EXPECT_THROW(y.backward(), c10::Error) << "a backward through the overwritten values";
  leaf.mul(2).sum().backward();  // a fresh graph over the loaded values works
  EXPECT_TRUE(BitEqual(leaf.grad(), torch::full({4}, 2.0f)));

  torch::Tensor base = torch::zeros({8});
  torch::Tensor view = base.narrow(0, 2, 4);
  torch::Tensor other = torch::zeros({3}, torch::kFloat64);  // takes dtype and shape
  for (torch::Tensor* target : {&view, &other}) {
    State into_other{{"w", *target}};
    CKPTIO_ASSERT_OK(ckpt->Load(into_other).status());
    EXPECT_TRUE(BitEqual(*target, saved));
  }
  EXPECT_TRUE(BitEqual(base, torch::zeros({8}))) << "set_ gives the view new storage";
}

// The one-line save picks the step after the newest committed one, even when
// LATEST lags it (a crash before LATEST moved) or is unreadable.
TEST(TorchStateTest, OneLineSaveCarriesOnWhenLatestLagsOrIsDamaged) {
  TempDir dir;
  const std::string uri = dir.Sub("one");
  torch::Tensor x = torch::full({4}, 1.0f);
  CKPTIO_ASSERT_OK(save(x, uri));
  CKPTIO_ASSERT_OK(save(x, uri));
  // LATEST back on step 0, as if the crash came before it named step 1.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(uri));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r0, store->OpenStep(0));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest, store->ReadLatest());
  ASSERT_TRUE(latest.has_value());
  testing::WriteFile(dir.Sub("one/LATEST"),
                     SerializeLatest({0, latest->generation, r0->manifest_hash()}));
  x = torch::full({4}, 2.0f);
  CKPTIO_ASSERT_OK(save(x, uri));
  testing::WriteFile(dir.Sub("one/LATEST"), "garbage");
  x = torch::full({4}, 3.0f);
  CKPTIO_ASSERT_OK(save(x, uri));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store->ListStepsWithManifest());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 1, 2, 3}));
  torch::Tensor y;
  CKPTIO_ASSERT_OK(load(y, uri));
  EXPECT_TRUE(BitEqual(y, torch::full({4}, 3.0f)));
}

TEST(TorchStateTest, LoadFallsBackToTheNewestGoodStepLoudly) {
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::Tensor t;
  State s{{"t", t}};
  for (int64_t step : {10, 20, 30, 40}) {
    t = torch::full({100}, static_cast<float>(step));
    CKPTIO_ASSERT_OK(ckpt->Save(step, s));
  }
  // Step 40's manifest is damaged, step 30's tensor bytes.
  testing::WriteFile(dir.Sub("store/step-000000000040/MANIFEST.json"), "{\"checksum\":");
  testing::FlipBit(dir.Sub("store/step-000000000030/tensors.safetensors"), 200, 0);
  torch::Tensor out;
  State in{{"t", out}};
  ::testing::internal::CaptureStderr();
  auto got = ckpt->Load(in);
  std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got->step), 20);
  ASSERT_EQ(got->skipped.size(), 2u);
  EXPECT_EQ(got->skipped[0].first, 40);
  EXPECT_EQ(got->skipped[1].first, 30);
  EXPECT_TRUE(BitEqual(out, torch::full({100}, 20.0f)));
  EXPECT_NE(err.find("ckptio: warning: "), std::string::npos) << err;
  EXPECT_NE(err.find("step 30 failed verification"), std::string::npos) << err;

  // The one-line load skips both the same way (its steps are 0, 1, 2).
  for (float v : {0.0f, 1.0f, 2.0f}) {
    torch::Tensor x = torch::full({100}, v);
    CKPTIO_ASSERT_OK(save(x, dir.Sub("one")));
  }
  testing::WriteFile(dir.Sub("one/step-000000000002/MANIFEST.json"), "{\"checksum\":");
  testing::FlipBit(dir.Sub("one/step-000000000001/tensors.safetensors"), 200, 0);
  torch::Tensor one;
  ::testing::internal::CaptureStderr();
  Status loaded = load(one, dir.Sub("one"));
  err = ::testing::internal::GetCapturedStderr();
  CKPTIO_ASSERT_OK(loaded);
  EXPECT_TRUE(BitEqual(one, torch::full({100}, 0.0f)));
  EXPECT_NE(err.find("step 2 failed verification"), std::string::npos) << err;
  EXPECT_NE(err.find("step 1 failed verification"), std::string::npos) << err;

  // With every step damaged, the same rule as Load's: DATA_LOSS naming the
  // newest problem (step 2's manifest), never the oldest step's alone.
  testing::FlipBit(dir.Sub("one/step-000000000000/tensors.safetensors"), 200, 0);
  // (A fresh tensor: `one` shares the map of the file just damaged.)
  torch::Tensor fresh = torch::full({3}, 7.0f);
  ::testing::internal::CaptureStderr();
  Status none = load(fresh, dir.Sub("one"));
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(none.code(), Code::kDataLoss) << none;
  EXPECT_NE(none.message().find("no checkpoint in"), std::string::npos) << none;
  EXPECT_NE(none.message().find("step-000000000002"), std::string::npos) << none;
  EXPECT_TRUE(BitEqual(fresh, torch::full({3}, 7.0f))) << "a failed load changed the tensor";
}

// A step written by a newer ckptio (a format version this build does not
// read) is not skipped for an older one: both loads stop and say to upgrade.
TEST(TorchStateTest, ANewerFormatStopsTheLoadInsteadOfBeingSkipped) {
  TempDir dir;
  for (float v : {1.0f, 2.0f}) {
    torch::Tensor x = torch::full({4}, v);
    CKPTIO_ASSERT_OK(save(x, dir.Sub("one")));
  }
  const std::string path = dir.Sub("one/step-000000000001/MANIFEST.json");
  nlohmann::json m = nlohmann::json::parse(testing::ReadFile(path));
  m.erase("checksum");
  m["version"] = 2;
  m["checksum"] = HashBytes(m.dump()).Hex();  // sealed as a newer writer would
  testing::WriteFile(path, m.dump());
  torch::Tensor y;
  Status one = load(y, dir.Sub("one"));
  EXPECT_EQ(one.code(), Code::kFailedPrecondition) << one;
  EXPECT_NE(one.message().find("upgrade ckptio"), std::string::npos) << one;
  EXPECT_FALSE(y.defined()) << "nothing loaded";
  State s{{"value", y}};
  auto got = OpenCkpt(dir.Sub("one"))->Load(s);
  EXPECT_EQ(got.status().code(), Code::kFailedPrecondition) << got.status();
}

// Loose tensors are found by their entries in tensors.safetensors, not by a
// metadata entry each (the manifest holds at most 10,000): a State of more
// tensors than that saves and loads, and asking for an item that is not
// there, or is of another kind, is a clear error.
TEST(TorchStateTest, MoreLooseTensorsThanTheManifestHasMetadataEntries) {
  TempDir dir;
  constexpr int kCount = 12000;
  Net net;
  std::vector<torch::Tensor> saved, loaded(kCount);
  for (int i = 0; i < kCount; ++i) saved.push_back(torch::full({2}, i, torch::kInt64));
  State state{{"model", net}};
  for (int i = 0; i < kCount; ++i) state.items.emplace_back("t" + std::to_string(i), saved[i]);
  state.SetInt("epoch", 3);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));

  State into{{"model", net}};
  for (int i = 0; i < kCount; ++i) into.items.emplace_back("t" + std::to_string(i), loaded[i]);
  auto got = ckpt->Load(into);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < kCount; ++i) ASSERT_TRUE(BitEqual(loaded[i], saved[i])) << "t" << i;
  EXPECT_EQ(into.GetInt("epoch"), 3);

  torch::Tensor t;
  Net other;
  const std::pair<State, std::string> wrong[] = {
      {State{{"absent", t}}, "step 1 has no tensor named \"absent\""},
      {State{{"model", t}}, "step 1 has no tensor named \"model\""},
      {State{{"t7", other}}, "step 1 has no module named \"t7\""},
  };
  for (const auto& [ask, message] : wrong) {
    State s = ask;
    auto r = ckpt->Load(s);
    ASSERT_FALSE(r.ok()) << message;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find(message), std::string::npos) << r.status();
  }
}

// Bytes that verify can still be unloadable: a BOOL byte other than 0 or 1
// (undefined behaviour in LibTorch) is refused on both read paths.
TEST(TorchStateTest, BoolBytesOtherThanZeroOrOneAreRefused) {
  TempDir dir;
  torch::Tensor flags = torch::zeros({4}, torch::kBool);
  static_cast<uint8_t*>(flags.data_ptr())[1] = 2;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State s{{"flags", flags}};
  CKPTIO_ASSERT_OK(ckpt->Save(1, s));
  for (bool mapped : {true, false}) {
    SCOPED_TRACE(mapped ? "from the object view" : "read into memory");
    torch::Tensor out;
    State in{{"flags", out}};
    LoadOptions o;
    o.step = 1;
    auto got = ckpt->Load(in, o);
    if (!mapped) {
      // The reader path (ReadTensor), reading into memory.
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, ckpt->store().OpenStep(1));
      got = Status(ReadTensor(*r, r->manifest().tensors.at(0), torch::kCPU).status());
    }
    EXPECT_EQ(got.status().code(), Code::kDataLoss) << got.status();
    EXPECT_NE(got.status().message().find("element 1 of a BOOL tensor is 2"), std::string::npos)
        << got.status();
  }
}

// Checkpoints written before loose tensors lost their metadata entries
// (`ckptio.item.<name>` = "tensor") still load, and an entry whose tensor is
// missing is damage.
TEST(TorchStateTest, LooseTensorsListedInMetadataStillLoad) {
  TempDir dir;
  torch::Tensor x = torch::arange(6).reshape({2, 3}), y, z;
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(dir.Sub("store")));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, store->OpenWriter({}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, writer->Begin(2));
    CKPTIO_ASSERT_OK(WriteSafetensors(*pending, "tensors.safetensors", {{"x", x}}));
    CKPTIO_ASSERT_OK(pending->SetMetadata("ckptio.item.x", "tensor"));
    CKPTIO_ASSERT_OK(pending->SetMetadata("ckptio.item.z", "tensor"));
    ASSERT_TRUE(pending->Commit().ok());
  }
  auto ckpt = OpenCkpt(dir.Sub("store"));
  State into{{"x", y}};
  auto got = ckpt->Load(into);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(BitEqual(y, x));
  State lost{{"z", z}};
  LoadOptions at2;
  at2.step = 2;
  auto r = ckpt->Load(lost, at2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("\"z\" is listed but not stored"), std::string::npos)
      << r.status();
}

TEST(TorchStateTest, AnEmptyStoreLoadsNothing) {
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::Tensor t;
  State s{{"t", t}};
  auto got = ckpt->Load(s);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(got->step.has_value());
}

}  // namespace
}  // namespace ckptio::torch_state_testing
