// The LibTorch adapter on one rank: every dtype, modules, optimizers,
// map_location, all-or-nothing loads, fallback, one-liners.
#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "ckptio/ckptio.h"
#include "ckptio/posix_backend.h"
#include "ckptio/torch.h"
#include "cuda_test_util.h"
#include "memory_of_this_thread.h"
#include "tcp_store_test_util.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::TempDir;

RankInfo Single() { return RankInfo{}; }

std::unique_ptr<Checkpointer> OpenCkpt(const std::string& uri, CheckpointerOptions o = {}) {
  auto c = Checkpointer::Open(uri, Single(), std::move(o));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

bool BitEqual(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.to(torch::kCPU).contiguous(), cb = b.to(torch::kCPU).contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

// A few optimizer steps so that Adam has moments and BatchNorm has stats.
void Train(Net& net, torch::optim::Optimizer& opt, int steps, uint64_t seed) {
  torch::manual_seed(seed);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    auto loss = net.forward(torch::randn({32, 8})).pow(2).mean();
    loss.backward();
    opt.step();
  }
}

std::vector<torch::Tensor> Snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.value().detach().clone());
  for (const auto& b : m.named_buffers()) out.push_back(b.value().detach().clone());
  return out;
}

bool SameAs(const torch::nn::Module& m, const std::vector<torch::Tensor>& snap) {
  auto now = Snapshot(m);
  if (now.size() != snap.size()) return false;
  for (size_t i = 0; i < now.size(); ++i)
    if (!BitEqual(now[i], snap[i])) return false;
  return true;
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
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->step, 1);
  for (size_t i = 0; i < originals.size(); ++i)
    EXPECT_TRUE(BitEqual(loaded[i], originals[i].second)) << originals[i].first;
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
}

// The safetensors header is written as text: names that JSON must escape,
// a 0-d tensor and a name clashing with "__metadata__" or not UTF-8.
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
  ASSERT_TRUE(got.ok() && got->has_value()) << got.status();
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
    opts.wait = WaitMode::kManifest;
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
  ASSERT_TRUE(got.ok() && got->has_value()) << (got.ok() ? "nothing" : got.status().ToString());
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
  EXPECT_EQ((*got)->step, 20);
  ASSERT_EQ((*got)->skipped.size(), 2u);
  EXPECT_EQ((*got)->skipped[0].first, 40);
  EXPECT_EQ((*got)->skipped[1].first, 30);
  EXPECT_TRUE(BitEqual(out, torch::full({100}, 20.0f)));
  EXPECT_NE(err.find("WARNING"), std::string::npos);
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
  EXPECT_FALSE(got->has_value());
}

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

// A non-blocking save's ticket on a waiting rank: a poll that finds the
// storage not answering for a moment says "not yet", not a failed save.
TEST(TorchStateTest, ATicketPollsPastAStorageThatDoesNotAnswerForAMoment) {
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
  auto ticket = (*ck1)->SaveNonBlocking(1, s);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  Result<bool> polled = false;
  for (int i = 0; i < 10 && polled.ok() && !*polled; ++i) polled = ticket->Poll();
  ASSERT_TRUE(polled.ok()) << "one unanswered read failed the ticket: " << polled.status();
  EXPECT_TRUE(*polled);
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
  o.wait = WaitMode::kFileLock;
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

// A timeout of 0 (which would end every wait at once, and which LibTorch's
// c10d takes for "wait for ever") or less is refused at Open, in every wait
// mode.
TEST(TorchStateTest, ATimeoutThatWouldNeverEndIsRefused) {
  TempDir dir;
  auto served = testing::ConnectTcpStore(0, true);
  for (auto mode : {WaitMode::kManifest, WaitMode::kStore}) {
    for (auto ms : {0, -5}) {
      CheckpointerOptions o;
      o.wait = mode;
      o.c10d_store = served;
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
  o.wait = WaitMode::kStore;
  o.timeout = std::chrono::seconds(5);
  torch::Tensor t = torch::full({4}, 3.0f);
  State s{{"t", t}};
  auto open = [&](int r, c10::intrusive_ptr<c10d::Store> store) {
    o.c10d_store = std::move(store);
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
      ASSERT_TRUE(got.ok() && !got->has_value()) << got.status();
    }
    CKPTIO_ASSERT_OK(ck0->Save(10, s));
    CKPTIO_ASSERT_OK(ck1->Save(10, s));
  }
  auto ck0 = open(0, served);
  auto ck1 = open(1, tcp(served->getPort(), false));  // a new client object
  ASSERT_TRUE(ck0 && ck1);
  auto got0 = ck0->Load(s);
  ASSERT_TRUE(got0.ok() && got0->has_value()) << got0.status();
  EXPECT_EQ((*got0)->step, 10);
  auto got1 = ck1->Load(s);
  ASSERT_TRUE(got1.ok()) << got1.status();
  ASSERT_TRUE(got1->has_value()) << "rank 1 read an earlier Checkpointer's decision";
  EXPECT_EQ((*got1)->step, 10);
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
  o.wait = WaitMode::kStore;
  o.timeout = std::chrono::milliseconds(1500);
  o.c10d_store = served;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto ck0,
                              Checkpointer::Open(dir.Sub("store"), RankOfTwo(0, "c10d-free"), o));
  o.c10d_store = client;
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
    ASSERT_TRUE(got0.ok() && got0->has_value()) << got0.status();
    ASSERT_EQ((*got0)->step, step);
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
}  // namespace ckptio
