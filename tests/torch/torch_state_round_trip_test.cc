// The LibTorch adapter on one rank: every dtype, modules, optimizers and
// metadata round trip; names, memory of a synchronous save, stripe parts,
// the manifest; map_location. See torch_state_test_util.h.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "ckptio/posix_backend.h"
#include "cuda_test_util.h"
#include "safetensors_text.h"
#include "torch/tensors.h"
#include "torch_state_test_util.h"

namespace ckptio::torch_state_testing {
namespace {

// The header of `object` (of step `step` in `store`) is byte for byte the
// one a load's check recognises without parsing it (what keeps a load of
// 10,000 tensors fast).
void ExpectRecognisedHeader(const std::string& store, int64_t step, const std::string& object) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto s, Store::Open(store, BuiltinBackends()));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, s->OpenStep(step));
  const std::string bytes = testing::ReadFile(store + "/" + StepDirName(step) + "/" + object);
  CKPTIO_ASSERT_OK_AND_ASSIGN(uint64_t head, SafetensorsHeaderSize(bytes, bytes.size(), object));
  EXPECT_TRUE(IsCkptioSafetensorsHeader(reader->manifest(), object, bytes.substr(0, head)))
      << object << " of step " << step << ": " << bytes.substr(8, head - 8);
}

TEST(TorchStateTest, EveryDtypeRoundTripsBitExactly) {
  TempDir dir;
  torch::manual_seed(1);
  std::vector<std::pair<std::string, torch::Tensor>> originals = {
      {"f64", torch::randn({3, 5}, torch::kFloat64)},
      {"f32", torch::randn({7}, torch::kFloat32)},
      {"f16", torch::randn({4, 4}, torch::kFloat32).to(torch::kFloat16)},
      {"bf16", torch::randn({9}, torch::kFloat32).to(torch::kBFloat16)},
      {"i64", torch::randint(-1000000, 1000000, {6}, torch::kInt64)},
      {"i32", torch::randint(-100000, 100000, {2, 3}, torch::kInt32)},
      {"i16", torch::randint(-30000, 30000, {5}, torch::kInt16)},
      {"i8", torch::randint(-128, 127, {11}, torch::kInt8)},
      {"u8", torch::randint(0, 255, {13}, torch::kUInt8)},
      {"bool", torch::randint(0, 2, {10}, torch::kInt64).to(torch::kBool)},
      {"non_contiguous", torch::randn({6, 4}).t()},                      // transposed view
      {"strided", torch::arange(20, torch::kInt32).slice(0, 1, 20, 3)},  // stepped slice
      {"zero_size", torch::empty({0, 3}, torch::kFloat32)},
      {"scalar", torch::tensor(3.5, torch::kFloat64)},
      {"nan_inf", torch::tensor({NAN, INFINITY, -INFINITY, -0.0f})},
  };
  ASSERT_FALSE(originals[10].second.is_contiguous());
  std::vector<torch::Tensor> values;
  for (auto& [n, t] : originals) values.push_back(t);
  State save;
  for (size_t i = 0; i < originals.size(); ++i)
    save.items.emplace_back(originals[i].first, values[i]);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(1, save));

  std::vector<torch::Tensor> loaded(originals.size());
  State load;
  for (size_t i = 0; i < originals.size(); ++i)
    load.items.emplace_back(originals[i].first, loaded[i]);
  auto got = ckpt->Load(load);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->step.has_value());
  EXPECT_EQ((*got->step), 1);
  for (size_t i = 0; i < originals.size(); ++i)
    EXPECT_TRUE(BitEqual(loaded[i], originals[i].second)) << originals[i].first;
  ExpectRecognisedHeader(dir.Sub("store"), 1, "tensors.safetensors");
}

TEST(TorchStateTest, UnsupportedDtypeIsAClearError) {
  TempDir dir;
  torch::Tensor c = torch::randn({2}, torch::kComplexFloat);
  State s{{"c", c}};
  auto ckpt = OpenCkpt(dir.Sub("store"));
  Status st = ckpt->Save(1, s);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("\"c\""), std::string::npos) << st;
  EXPECT_NE(st.message().find("ComplexFloat"), std::string::npos) << st;
}

TEST(TorchStateTest, ModuleOptimizerAndMetadataRoundTrip) {
  TempDir dir;
  Net net;
  torch::optim::Adam adam(net.parameters(), torch::optim::AdamOptions(1e-2));
  Train(net, adam, 5, 42);
  State state{{"model", net}, {"optim", adam}};
  state.SetInt("epoch", 7);
  state.metadata["loader"] = "shard=3;offset=1200";
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(500, state));
  auto snap = Snapshot(net);

  // A fresh model and optimizer, differently initialised.
  torch::manual_seed(999);
  Net net2;
  torch::optim::Adam adam2(net2.parameters(), torch::optim::AdamOptions(1e-2));
  ASSERT_FALSE(SameAs(net2, snap));
  State into{{"model", net2}, {"optim", adam2}};
  auto got = ckpt->Load(into);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(SameAs(net2, snap)) << "parameters and BatchNorm buffers";
  EXPECT_EQ(into.GetInt("epoch"), 7);
  EXPECT_EQ(into.metadata.at("loader"), "shard=3;offset=1200");

  // Adam's moments came back: one more identical step gives identical weights.
  Train(net, adam, 1, 7);
  Train(net2, adam2, 1, 7);
  EXPECT_TRUE(SameAs(net2, Snapshot(net))) << "Adam state (exp_avg, exp_avg_sq, step) restored";

  // The module object is a real safetensors file: check its header by hand.
  std::string bytes = testing::ReadFile(dir.Sub("store/step-000000000500/model.safetensors"));
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "data starts 8-byte aligned";
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  auto w = header["fc1.weight"];
  EXPECT_EQ(w["dtype"], "F32");
  EXPECT_EQ(w["shape"], nlohmann::json({16, 8}));
  uint64_t b = w["data_offsets"][0], e = w["data_offsets"][1];
  EXPECT_EQ(e - b, 16u * 8 * 4);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + b, snap[0].data_ptr(), e - b), 0)
      << "fc1.weight (the first parameter) as saved";
  // Offsets tile the data section with no gaps (what safetensors readers check).
  uint64_t covered = 0;
  for (auto it = header.begin(); it != header.end(); ++it)
    if (it.key() != "__metadata__")
      covered += it.value()["data_offsets"][1].get<uint64_t>() -
                 it.value()["data_offsets"][0].get<uint64_t>();
  EXPECT_EQ(8 + n + covered, bytes.size());
  ExpectRecognisedHeader(dir.Sub("store"), 500, "model.safetensors");
}

// The safetensors header is written as text: names that JSON must escape,
// a 0-d tensor and a name clashing with "__metadata__" or not UTF-8.
// A module given as its named tensors (how the Python package passes a
// torch.nn.Module) is the same on disk as a torch::nn::Module: each loads
// the other's step, in place, by parameter name, and strictly.
TEST(TorchStateTest, NamedTensorsAndAModuleAreInterchangeable) {
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::manual_seed(3);
  torch::nn::Linear saved_module(4, 3);
  CKPTIO_ASSERT_OK(ckpt->Save(1, State{{"model", saved_module}}));

  torch::Tensor weight = torch::zeros({3, 4}), bias = torch::zeros({3});
  const void* weight_memory = weight.data_ptr();
  State as_tensors;
  as_tensors.items.emplace_back("model", NamedTensors{{"weight", weight}, {"bias", bias}});
  auto got = ckpt->Load(as_tensors);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(BitEqual(weight, saved_module->weight));
  EXPECT_TRUE(BitEqual(bias, saved_module->bias));
  EXPECT_EQ(weight.data_ptr(), weight_memory) << "not filled in place";

  weight.fill_(7);
  CKPTIO_ASSERT_OK(ckpt->Save(2, as_tensors));
  torch::nn::Linear loaded_module(4, 3);
  State as_module{{"model", loaded_module}};
  got = ckpt->Load(as_module);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got->step, 2);
  EXPECT_TRUE(BitEqual(loaded_module->weight, weight));

  // Strict: a name the step lacks, or one it has that the tensors lack.
  State missing;
  missing.items.emplace_back("model", NamedTensors{{"weight", weight}});
  got = ckpt->Load(missing);
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
  EXPECT_NE(got.status().message().find("lacks"), std::string::npos) << got.status();
  State extra;
  extra.items.emplace_back(
      "model",
      NamedTensors{{"weight", weight}, {"bias", bias}, {"running_mean", torch::zeros({3})}});
  got = ckpt->Load(extra);
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
  EXPECT_NE(got.status().message().find("running_mean"), std::string::npos) << got.status();
}

// other_tensors brings the named tensors no item names; before_apply sees
// them and the metadata once everything is verified, and a refusal there
// fails the load with nothing of the state changed.
TEST(TorchStateTest, OtherTensorsAndACheckBeforeAnythingChanges) {
  TempDir dir;
  auto ckpt = OpenCkpt(dir.Sub("store"));
  torch::nn::Linear saved_module(2, 2);
  torch::Tensor a = torch::arange(3), b = torch::ones({2, 2});
  State saved{{"model", saved_module}, {"a", a}, {"opt/state/0", b}};
  saved.metadata["tree"] = "{}";
  CKPTIO_ASSERT_OK(ckpt->Save(1, saved));

  torch::nn::Linear module(2, 2);
  torch::nn::init::zeros_(module->weight);
  torch::Tensor a_target;
  State load{{"model", module}, {"a", a_target}};
  LoadOptions o;
  o.other_tensors = true;
  std::map<std::string, std::string> seen_metadata;
  std::vector<std::string> seen_tensors;
  o.before_apply = [&](const std::map<std::string, std::string>& metadata, const LoadResult& r) {
    seen_metadata = metadata;
    for (const auto& [name, t] : r.tensors) seen_tensors.push_back(name);
    return Status(Code::kInvalidArgument, "the optimizer has 3 groups, the step 1");
  };
  auto got = ckpt->Load(load, o);
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
  EXPECT_NE(got.status().message().find("3 groups"), std::string::npos) << got.status();
  EXPECT_EQ(seen_metadata, (std::map<std::string, std::string>{{"tree", "{}"}}));
  EXPECT_EQ(seen_tensors, std::vector<std::string>{"opt/state/0"});
  EXPECT_TRUE(BitEqual(module->weight, torch::zeros({2, 2}))) << "changed despite the refusal";
  EXPECT_FALSE(a_target.defined());
  EXPECT_TRUE(load.metadata.empty());

  o.before_apply = nullptr;
  got = ckpt->Load(load, o);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->tensors.size(), 1u);
  EXPECT_TRUE(BitEqual(got->tensors.at("opt/state/0"), b));
  EXPECT_TRUE(BitEqual(a_target, a));
  EXPECT_TRUE(BitEqual(module->weight, saved_module->weight));
  // Without the option, only what the State names.
  got = ckpt->Load(load);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->tensors.empty());
}

TEST(TorchStateTest, TensorNamesAreEscapedInTheSafetensorsHeader) {
  TempDir dir;
  const std::vector<std::string> names = {"quote\"d",   "back\\slash", "tab\there",
                                          "\xc3\xbcml", "ctl\x01",     "plain.weight"};
  std::vector<torch::Tensor> values;
  State state;
  for (size_t i = 0; i < names.size(); ++i) values.push_back(torch::rand({3, int64_t(i) + 1}));
  values.push_back(torch::tensor(7.5));  // 0-d
  for (size_t i = 0; i < names.size(); ++i) state.items.emplace_back(names[i], values[i]);
  state.items.emplace_back("scalar", values.back());
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));

  std::string bytes = testing::ReadFile(dir.Sub("store/step-000000000001/tensors.safetensors"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  for (const auto& name : names) EXPECT_TRUE(header.contains(name)) << name;
  EXPECT_EQ(header["scalar"]["shape"], nlohmann::json::array());
  EXPECT_EQ(header["quote\"d"]["shape"], nlohmann::json({3, 1}));
  ExpectRecognisedHeader(dir.Sub("store"), 1, "tensors.safetensors");

  std::vector<torch::Tensor> back(values.size());
  State into;
  for (size_t i = 0; i < names.size(); ++i) into.items.emplace_back(names[i], back[i]);
  into.items.emplace_back("scalar", back.back());
  auto got = ckpt->Load(into);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < values.size(); ++i) EXPECT_TRUE(torch::equal(back[i], values[i])) << i;

  torch::Tensor x = torch::ones({2});
  State clash;
  clash.items.emplace_back("__metadata__", x);
  Status s = ckpt->Save(2, clash);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("__metadata__"), std::string::npos) << s;
  State bad_utf8;
  bad_utf8.items.emplace_back("bad\xff", x);
  EXPECT_FALSE(ckpt->Save(3, bad_utf8).ok());
}

TEST(TorchStateTest, ModuleLoadCopiesIntoTheParametersOwnMemory) {
  TempDir dir;
  Net net;
  State state{{"model", net}};
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  auto snap = Snapshot(net);
  torch::manual_seed(5);
  Net net2;
  std::vector<void*> before;
  for (const auto& p : net2.parameters()) before.push_back(p.data_ptr());
  State into{{"model", net2}};
  ASSERT_TRUE(ckpt->Load(into).ok());
  EXPECT_TRUE(SameAs(net2, snap));
  std::vector<void*> after;
  for (const auto& p : net2.parameters()) after.push_back(p.data_ptr());
  EXPECT_EQ(before, after) << "parameters keep their storage (no fresh allocation)";
}

TEST(TorchStateTest, WritingToLoadedTensorsNeverChangesTheCheckpoint) {
  // Loaded CPU tensors share a private map of the tensor file: writes to
  // them must stay in the process.
  TempDir dir;
  torch::Tensor t = torch::arange(1 << 20, torch::kFloat32);  // 4 MiB
  const torch::Tensor original = t.clone();
  State state{{"t", t}};
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  for (int round = 0; round < 2; ++round) {
    torch::Tensor back;
    State into{{"t", back}};
    ASSERT_TRUE(ckpt->Load(into).ok());
    ASSERT_TRUE(BitEqual(back, original)) << "round " << round;
    back.mul_(-3).add_(1);  // every page written
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, ckpt->store().OpenStep(1));
  CKPTIO_EXPECT_OK(reader->Verify());
}

// A loaded tensor item fills the caller's tensor, as torch::load does: an
// optimizer holding it trains the loaded values, and requires_grad stays.
TEST(TorchStateTest, ALoadedTensorStaysTheCallersTensor) {
  TempDir dir;
  torch::Tensor w = torch::arange(4, torch::kFloat32).requires_grad_();
  torch::Tensor d = torch::arange(3, torch::kFloat64);
  State state{{"w", w}, {"d", d}};
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  const torch::Tensor saved_w = w.detach().clone(), saved_d = d.clone();

  torch::Tensor w2 = torch::zeros({4}).requires_grad_();
  torch::Tensor d2 = torch::zeros({5}, torch::kFloat32);  // another dtype and shape
  torch::optim::SGD sgd({w2}, 0.5);
  const torch::Tensor w2_handle = w2, d2_handle = d2;
  State into{{"w", w2}, {"d", d2}};
  auto got = ckpt->Load(into);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(BitEqual(w2.detach(), saved_w));
  EXPECT_TRUE(BitEqual(d2, saved_d)) << "takes the saved dtype and shape";
  EXPECT_TRUE(w2.requires_grad());
  EXPECT_TRUE(w2.is_same(w2_handle) && w2.is_same(sgd.param_groups()[0].params()[0]));
  EXPECT_TRUE(d2.is_same(d2_handle));
  sgd.zero_grad();
  w2.sum().backward();
  sgd.step();  // the optimizer's tensor is the loaded one
  EXPECT_TRUE(BitEqual(w2.detach(), saved_w - 0.5f));

  // A tensor from .detach() refuses set_: it is rebound, and the load
  // (which may not fail after modules changed) goes through.
  torch::Tensor base = torch::zeros({4});
  torch::Tensor detached = base.detach();
  State into_detached{{"w", detached}};
  auto again = ckpt->Load(into_detached);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(BitEqual(detached, saved_w));
}

// Item names: unique (a module and a tensor both named "x" would save, then
// never load), and a module's or optimizer's name must make an object name.
TEST(TorchStateTest, ItemNamesAreCheckedBeforeAnythingIsWritten) {
  TempDir dir;
  Net net;
  torch::optim::Adam adam(net.parameters());
  torch::Tensor t = torch::ones({2});
  auto ckpt = OpenCkpt(dir.Sub("store"));
  struct Bad {
    State state;
    std::string message;
    bool load_too;  // a save keeps room for stripe parts; a load takes what a save made
  };
  const Bad bad[] = {
      {State{{"x", net}, {"x", t}}, "two items named \"x\" (a module and a tensor)", true},
      {State{{"x", net}, {"x", adam}}, "two items named \"x\" (a module and an optimizer)", true},
      {State{{"a", t}, {"a", t}}, "two items named \"a\" (a tensor and a tensor)", true},
      {State{{"enc/dec", net}}, "a module is named \"enc/dec\", which cannot name its object",
       true},
      {State{{"", adam}}, "an optimizer is named \"\", which", true},
      {State{{".hidden", net}}, "a module is named \".hidden\"", true},
      {State{{"tensors", net}, {"t", t}}, "a module named \"tensors\" would share", true},
      {State{{std::string(161, 'm'), net}}, "which cannot name its object", false},
      {State{{"model.part-1", net}}, "a module is named \"model.part-1\"", false},
  };
  for (const auto& [state, message, load_too] : bad) {
    Status saved = ckpt->Save(1, state);
    EXPECT_EQ(saved.code(), Code::kInvalidArgument) << message;
    EXPECT_NE(saved.message().find(message), std::string::npos) << saved;
    if (!load_too) continue;
    State into = state;
    auto loaded = ckpt->Load(into);
    ASSERT_FALSE(loaded.ok()) << message;
    EXPECT_NE(loaded.status().message().find(message), std::string::npos) << loaded.status();
  }
  Status async = ckpt->SaveAsync(1, bad[0].state).get();
  EXPECT_NE(async.message().find(bad[0].message), std::string::npos) << async;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, ckpt->store().ListSteps());
  EXPECT_TRUE(steps.empty()) << "nothing was written";
  // Allowed: a tensor named "tensors", a module and an optimizer sharing a
  // stem, names with ".part" that a part cannot take.
  State fine{{"tensors", t}, {"net.v2", net}, {"net.v2.part-x", adam}};
  EXPECT_EQ(ckpt->Save(2, fine).code(), Code::kInvalidArgument) << "SaveAsync's error, again";
  CKPTIO_EXPECT_OK(ckpt->Save(2, fine));
  auto back = ckpt->Load(fine);
  EXPECT_TRUE(back.ok()) << back.status();
}

TEST(TorchStateTest, LoadsThroughABackendThatCannotMap) {
  // RecordingBackend forwards reads but not Map(): tensors come from a
  // verified buffer instead.
  TempDir dir;
  Net net;
  torch::Tensor loose = torch::randn({3, 5}, torch::kFloat64);
  State state{{"model", net}, {"loose", loose}};
  auto posix = NewPosixBackend(dir.Sub("store"));
  ASSERT_TRUE(posix.ok());
  CheckpointerOptions o;
  o.backend = std::make_shared<testing::RecordingBackend>(
      std::shared_ptr<StorageBackend>(std::move(*posix)));
  auto ckpt = OpenCkpt(dir.Sub("store"), o);
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  auto snap = Snapshot(net);
  torch::manual_seed(6);
  Net net2;
  torch::Tensor loose2;
  State into{{"model", net2}, {"loose", loose2}};
  ASSERT_TRUE(ckpt->Load(into).ok());
  EXPECT_TRUE(SameAs(net2, snap));
  EXPECT_TRUE(BitEqual(loose2, loose));
}

// VmHWM / VmRSS of this process, in bytes (0 if unknown).
uint64_t ProcStatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) << 10;
  return 0;
}

TEST(TorchStateTest, ASynchronousSaveNeedsAtMost64MiBOfExtraMemory) {
  // 320 MiB of module parameters, 640 MiB of Adam moments, 64 MiB of loose
  // tensors and 128 MiB of transposed views (made contiguous one at a time):
  // streamed to storage, never serialised into memory whole.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "under a sanitizer the RSS includes its shadow memory";
#endif
  TempDir dir;
  auto big = std::make_shared<torch::nn::Module>();
  for (int i = 0; i < 5; ++i)
    big->register_parameter("w" + std::to_string(i), torch::randn({16 << 20}));
  torch::optim::Adam adam(big->parameters(), torch::optim::AdamOptions(1e-3));
  for (auto& p : big->parameters()) p.mutable_grad() = torch::ones_like(p);
  adam.step();  // creates exp_avg and exp_avg_sq
  torch::Tensor loose = torch::randn({16 << 20});
  State state{{"model", *big}, {"optim", adam}, {"loose", loose}};
  std::vector<torch::Tensor> views;
  for (int i = 0; i < 8; ++i) views.push_back(torch::randn({2048, 2048}).t());
  for (int i = 0; i < 8; ++i) state.items.emplace_back("view" + std::to_string(i), views[i]);
  auto ckpt = OpenCkpt(dir.Sub("store"));
  std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current RSS
  const uint64_t before = ProcStatusBytes("VmRSS");
  if (before == 0 || ProcStatusBytes("VmHWM") > before + (8 << 20))
    GTEST_SKIP() << "this kernel cannot reset the peak RSS (/proc/self/clear_refs)";
  CKPTIO_ASSERT_OK(ckpt->Save(1, state));
  const uint64_t extra = ProcStatusBytes("VmHWM") - before;
  std::cout << "peak extra memory during a synchronous save of ~1 GiB of state: "
            << extra / (1 << 20) << " MiB\n";
  EXPECT_LE(extra, uint64_t{64} << 20);
}

TEST(TorchStateTest, AModuleSpreadOverStripePartsLoadsWhole) {
  // A striped step built by hand in one process: rank 1's part holds fc1,
  // rank 0's object the rest; the load gathers the module from both.
  TempDir dir;
  Net net;
  auto snap = Snapshot(net);
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(dir.Sub("store")));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, store->OpenWriter({}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, writer->Begin(4));
    std::vector<std::pair<std::string, torch::Tensor>> part, rest;
    for (const auto& p : net.named_parameters())
      (p.key().rfind("fc1.", 0) == 0 ? part : rest).emplace_back(p.key(), p.value());
    for (const auto& b : net.named_buffers()) rest.emplace_back(b.key(), b.value());
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto stripe, store->BeginStripe(4, 1));
    CKPTIO_ASSERT_OK(WriteSafetensors(*stripe, "model.part-1.safetensors", part));
    CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt receipt, stripe->Finish());
    CKPTIO_ASSERT_OK(WriteSafetensors(*pending, "model.safetensors", rest));
    CKPTIO_ASSERT_OK(pending->AddStripe(receipt));
    CKPTIO_ASSERT_OK(pending->SetMetadata("ckptio.item.model", "module"));
    CKPTIO_ASSERT_OK(pending->SetMetadata(
        std::string(kStripePartPrefix) + "model.part-1.safetensors", "model.safetensors"));
    ASSERT_TRUE(pending->Commit().ok());
  }
  torch::manual_seed(77);
  Net net2;
  ASSERT_FALSE(SameAs(net2, snap));
  State into{{"model", net2}};
  auto got = OpenCkpt(dir.Sub("store"))->Load(into);
  ASSERT_TRUE(got.ok() && got->step.has_value()) << got.status();
  EXPECT_TRUE(SameAs(net2, snap));
}

TEST(TorchStateTest, ManifestRecordsEveryTensor) {
  TempDir dir;
  Net net;
  State state{{"model", net}};
  auto ckpt = OpenCkpt(dir.Sub("store"));
  CKPTIO_ASSERT_OK(ckpt->Save(3, state));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, ckpt->store().OpenStep(3));
  size_t expected = net.named_parameters().size() + net.named_buffers().size();
  EXPECT_EQ(r->manifest().tensors.size(), expected);
  for (const auto& t : r->manifest().tensors) {
    EXPECT_EQ(t.object, "model.safetensors");
    EXPECT_EQ(t.device, "cpu");
  }
}

// Tensors recorded as saved from cuda:0 (as on a GPU trainer) must land on
// the device map_location asks for, never on the recorded one.
class MapLocationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = OpenStore(dir_.Sub("store"));
    ASSERT_TRUE(store.ok());
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, (*store)->OpenWriter({}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(1));
    weight_ = torch::randn({4, 4});
    CKPTIO_ASSERT_OK(WriteSafetensors(*p, "model.safetensors", {{"weight", weight_}}, {"cuda:0"}));
    CKPTIO_ASSERT_OK(p->SetMetadata("ckptio.item.model", "module"));
    CKPTIO_ASSERT_OK(p->Commit().status());
  }

  struct One : torch::nn::Module {
    One() { weight = register_parameter("weight", torch::zeros({4, 4})); }
    torch::Tensor weight;
  };

  // Loads `s` through a mapping that records each saved device it is asked
  // about and answers the CPU; returns what it was asked.
  std::vector<std::string> LoadRecordingDevices(State& s) {
    auto ckpt = OpenCkpt(dir_.Sub("store"));
    std::vector<std::string> seen;
    LoadOptions o;
    o.map_location = MapLocation::With([&](const std::string& saved) {
      seen.push_back(saved);
      return torch::Device(torch::kCPU);
    });
    auto got = ckpt->Load(s, o);
    EXPECT_TRUE(got.ok()) << got.status();
    return seen;
  }

  // Loads the model through `map`: it must land on `device`, bit-exact.
  void ExpectLandsOn(const MapLocation& map, const torch::Device& device) {
    auto ckpt = OpenCkpt(dir_.Sub("store"));  // rank 0, LOCAL_RANK 0
    One m;
    State s{{"model", m}};
    LoadOptions o;
    o.map_location = map;
    auto got = ckpt->Load(s, o);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(m.weight.device(), device);
    EXPECT_TRUE(BitEqual(m.weight, weight_));
  }

  TempDir dir_;
  torch::Tensor weight_;
};

// A mapping function that throws (a device string LibTorch cannot parse,
// or the caller's own exception) fails the load before the state changes.
TEST_F(MapLocationTest, AFunctionThatThrowsFailsTheLoadAndChangesNothing) {
  auto ckpt = OpenCkpt(dir_.Sub("store"));
  for (int how = 0; how < 2; ++how) {
    One m;
    State s{{"model", m}};
    LoadOptions o;
    o.map_location = MapLocation::With([&](const std::string&) -> torch::Device {
      if (how == 0) return torch::Device("not-a-device:7");  // c10::Error
      throw std::runtime_error("no rule for this device");
    });
    auto got = ckpt->Load(s, o);
    EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find(how == 0 ? "not-a-device" : "no rule for this device"),
              std::string::npos)
        << got.status();
    EXPECT_TRUE(BitEqual(m.weight, torch::zeros({4, 4})));
  }
}

TEST_F(MapLocationTest, AFunctionSeesTheSavedDeviceAndPicksTheTarget) {
  One m;
  State s{{"model", m}};
  EXPECT_EQ(LoadRecordingDevices(s), std::vector<std::string>{"cuda:0"});
  EXPECT_TRUE(m.weight.device().is_cpu());
  EXPECT_TRUE(BitEqual(m.weight, weight_));
}

// An optimizer's mapping sees the device its parameters had when saved
// (recorded with it), as tensors do, not where the live optimizer is.
TEST_F(MapLocationTest, AFunctionSeesAnOptimizersSavedDevice) {
  One m;
  torch::optim::SGD sgd(m.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::ostringstream archive;
  {
    torch::serialize::OutputArchive out;
    sgd.save(out);
    out.save_to(archive);
  }
  {
    auto store = OpenStore(dir_.Sub("store"));
    ASSERT_TRUE(store.ok());
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, (*store)->OpenWriter({}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(2));
    const std::string bytes = archive.str();
    CKPTIO_ASSERT_OK(p->PutObject("opt.optim.pt", bytes.data(), bytes.size()));
    CKPTIO_ASSERT_OK(p->SetMetadata("ckptio.item.opt", "optimizer:cuda:0"));
    CKPTIO_ASSERT_OK(p->Commit().status());
  }
  State s{{"opt", sgd}};
  EXPECT_EQ(LoadRecordingDevices(s), std::vector<std::string>{"cuda:0"});
}

TEST_F(MapLocationTest, AutoAndExplicitCpuLandOnCpuWithoutCuda) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA present: see tools/gpu-check.sh";
  for (auto map : {MapLocation::Auto(), MapLocation::To("cpu"), MapLocation::To(torch::kCPU)})
    ExpectLandsOn(map, torch::Device(torch::kCPU));
}

TEST_F(MapLocationTest, AMissingCudaDeviceIsAClearErrorAndLeavesTheModel) {
  if (torch::cuda::is_available() && torch::cuda::device_count() > 7)
    GTEST_SKIP() << "this machine has a cuda:7";
  auto ckpt = OpenCkpt(dir_.Sub("store"));
  One m;
  State s{{"model", m}};
  LoadOptions o;
  o.map_location = MapLocation::To("cuda:7");
  auto got = ckpt->Load(s, o);
  EXPECT_EQ(got.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(got.status().message().find("cuda:7"), std::string::npos) << got.status();
  EXPECT_TRUE(BitEqual(m.weight, torch::zeros({4, 4}))) << "model untouched";
  o.map_location = MapLocation::To("gpu-please");
  EXPECT_EQ(ckpt->Load(s, o).status().code(), Code::kInvalidArgument);
}

// With CUDA, Auto is this rank's own GPU (cuda:LOCAL_RANK), whatever the
// manifest recorded; a function may pick a GPU too.
TEST_F(MapLocationTest, CudaAutoAndAFunctionLandOnTheRanksOwnDevice) {
  CKPTIO_REQUIRE_CUDA();
  const MapLocation maps[] = {
      MapLocation::Auto(), MapLocation::To("cuda:0"),
      MapLocation::With([](const std::string&) { return torch::Device("cuda:0"); })};
  for (const MapLocation& map : maps) ExpectLandsOn(map, torch::Device("cuda:0"));
}

// Auto on a rank whose LOCAL_RANK names a GPU this process does not see:
// with one visible GPU, that one is the rank's own (per-rank
// CUDA_VISIBLE_DEVICES, Slurm --gpus-per-task=1); with several, a clear
// error naming the missing one, not a silent pile-up on cuda:0.
TEST_F(MapLocationTest, CudaAutoForALocalRankPastTheLastGpu) {
  CKPTIO_REQUIRE_CUDA();
  const int n = static_cast<int>(torch::cuda::device_count());
  // Ranks 0 and n of one job (in this process): rank 0 decides the step.
  auto open = [&](int r) {
    RankInfo rank;
    rank.world_size = rank.local_world_size = n + 1;
    rank.rank = rank.local_rank = r;
    rank.job_id = "cuda-auto-test";
    CheckpointerOptions opts;
    opts.wait = WaitOn::Manifest();
    auto c = Checkpointer::Open(dir_.Sub("store"), rank, opts);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  };
  auto rank0 = open(0), last = open(n);  // last: LOCAL_RANK n, one past the last GPU
  ASSERT_TRUE(rank0 && last);
  One m0, m;
  State s0{{"model", m0}}, s{{"model", m}};
  CKPTIO_ASSERT_OK(rank0->Load(s0).status());
  EXPECT_EQ(m0.weight.device(), torch::Device("cuda:0"));
  auto got = last->Load(s);
  if (n == 1) {
    CKPTIO_ASSERT_OK(got.status());
    EXPECT_EQ(m.weight.device(), torch::Device("cuda:0"));
    return;
  }
  EXPECT_EQ(got.status().code(), Code::kFailedPrecondition) << got.status();
  EXPECT_NE(got.status().message().find("cuda:" + std::to_string(n)), std::string::npos)
      << got.status();
  EXPECT_TRUE(BitEqual(m.weight, torch::zeros({4, 4}))) << "model untouched";
}

}  // namespace
}  // namespace ckptio::torch_state_testing
