// ckptio for LibTorch (library ckptio::torch): checkpoints of modules,
// optimizers, tensors and metadata across the ranks of a data-parallel job.
//
// Example: resume from the newest good step, stop on any error
//   auto rank = ckptio::RankInfo::FromEnv();            // torchrun, Slurm, Open MPI
//   if (!rank.ok()) { std::cerr << rank.status() << "\n"; return 1; }
//   ckptio::CheckpointerOptions opt;
//   opt.wait = ckptio::WaitMode::kFileLock;             // or kManifest, or kStore
//   opt.keep_last = 3;
//   auto ckpt = ckptio::Checkpointer::Open("/ckpt/run42", *rank, opt);
//   if (!ckpt.ok()) { std::cerr << ckpt.status() << "\n"; return 1; }
//   ckptio::State state{{"model", model}, {"optim", optimizer}};
//   auto got = (*ckpt)->Load(state);                   // every rank, same step
//   if (!got.ok()) {                // unreadable, or nothing verifies: never
//     std::cerr << got.status() << "\n";  // restart from step 0 because of it
//     return 1;
//   }
//   int64_t start = got->has_value() ? (*got)->step + 1 : 0;  // nullopt: none yet
//   for (int64_t step = start; step < steps; ++step) {
//     TrainStep();
//     if (step % 500 != 0) continue;
//     ckptio::Status saved = (*ckpt)->Save(step, state);  // rank 0 writes; the
//     if (!saved.ok()) { std::cerr << saved << "\n"; return 1; }  // others wait
//   }
//
// On disk (docs/FORMAT.md): each module is "<name>.safetensors" (readable by
// any safetensors reader), each optimizer "<name>.optim.pt" (LibTorch's own
// archive), named tensors "tensors.safetensors"; the manifest records every
// tensor's name, dtype, shape, saved device and byte range.
//
// Loading is all or nothing: every byte is verified and every tensor staged
// (on its target device, and checked to be one LibTorch lets replace its
// target) before the first module, optimizer or tensor of the caller
// changes; an optimizer's state is replaced, not merged, and one whose
// archive does not fit is restored.
// Each object is read once per load: mapped privately (copy-on-write) on
// local file systems, read into one buffer elsewhere, and verified chunk by
// chunk on every core. A module parameter already on the target device with
// the saved dtype and shape is filled in place (no new memory); a named tensor
// stays the caller's tensor (set_, as torch::load); other CPU tensors share
// the verified map: writes copy the touched pages, never change the checkpoint.
#ifndef CKPTIO_TORCH_H_
#define CKPTIO_TORCH_H_

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <future>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <type_traits>
#include <utility>
#include <vector>

#include "ckptio/coordination.h"
#include "ckptio/rank.h"
#include "ckptio/status.h"
#include "ckptio/store.h"

namespace ckptio {

namespace internal {
struct OpenedStep;
struct AsyncSave;
struct SavePlan;
}  // namespace internal

// A named piece of state (names unique; module and optimizer names: 1-160 of
// [A-Za-z0-9._-], no leading '.'). Holds a reference: the object must outlive.
class StateItem {
 public:
  enum class Kind { kModule, kOptimizer, kTensor };

  StateItem(std::string name, torch::nn::Module& module)
      : name_(std::move(name)), kind_(Kind::kModule), module_(&module) {}
  template <typename M>
  StateItem(std::string name, torch::nn::ModuleHolder<M>& holder)
      : StateItem(std::move(name), static_cast<torch::nn::Module&>(*holder)) {}
  StateItem(std::string name, torch::optim::Optimizer& optimizer)
      : name_(std::move(name)), kind_(Kind::kOptimizer), optimizer_(&optimizer) {}
  StateItem(std::string name, torch::Tensor& tensor)
      : name_(std::move(name)), kind_(Kind::kTensor), tensor_(&tensor) {}

  const std::string& name() const { return name_; }
  Kind kind() const { return kind_; }
  torch::nn::Module& module() const { return *module_; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  torch::Tensor& tensor() const { return *tensor_; }

 private:
  std::string name_;
  Kind kind_;
  torch::nn::Module* module_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  torch::Tensor* tensor_ = nullptr;
};

// What a checkpoint holds: named modules, optimizers and tensors, plus
// string metadata (epoch, data-loader position, RNG state...).
struct State {
  State() = default;
  State(std::initializer_list<StateItem> list) : items(list) {}

  std::vector<StateItem> items;
  std::map<std::string, std::string> metadata;  // saved and loaded with the step

  void SetInt(const std::string& key, int64_t value) { metadata[key] = std::to_string(value); }
  // nullopt when absent or not an integer.
  std::optional<int64_t> GetInt(const std::string& key) const;
};

// Where loaded tensors go.
class MapLocation {
 public:
  // cuda:LOCAL_RANK when CUDA is available (cuda:0 when the process sees
  // one GPU: its own, under per-rank CUDA_VISIBLE_DEVICES), else CPU.
  static MapLocation Auto() { return MapLocation(); }
  static MapLocation To(torch::Device device);
  // "cpu", "cuda", "cuda:1"; InvalidArgument at Resolve if unparsable.
  static MapLocation To(const std::string& device);
  // Maps the device a tensor was saved from ("cuda:0", "cpu") to a target.
  static MapLocation With(std::function<torch::Device(const std::string& saved)> fn);

  // The target for a tensor saved from `saved`; "cuda" without an index is
  // the current CUDA device (cuda:N). A CUDA target on a machine without
  // CUDA, or an index past the devices present, is FailedPrecondition
  // naming the device.
  Result<torch::Device> Resolve(const std::string& saved, const RankInfo& rank) const;

 private:
  MapLocation() = default;
  std::function<Result<torch::Device>(const std::string&, const RankInfo&)> fn_;
};

struct CheckpointerOptions {
  WaitMode wait = WaitMode::kManifest;
  // The trainer's store (e.g. its TCPStore), for WaitMode::kStore.
  c10::intrusive_ptr<c10d::Store> c10d_store;
  int keep_last = 0;  // 0 keeps every step
  // Every wait (for a commit, a load decision, the save lock) ends by then (>= 1 ms).
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  uint64_t chunk_size = kDefaultChunkBytes;
  // Use this backend instead of the one the URI names (fault injection,
  // sync-point hooks); the URI is then only used in messages.
  std::shared_ptr<StorageBackend> backend;
  // Striped saves (DDP replicas are identical, so any rank can write any
  // part): every rank writes about 1/world_size of the tensor bytes into
  // "<object>.part-<rank>.safetensors" objects of the step, durably, and
  // sends rank 0 a receipt; rank 0 writes the rest (and every optimizer and
  // the metadata) and commits only once every receipt is in. Every rank
  // must call Save / SaveAsync with the same state layout. Pays where
  // several writers are faster than one (parallel file systems, several NFS
  // servers); one local disk gains little (docs/PERFORMANCE.md).
  bool stripe = false;
  // SaveAsync keeps this much host memory at most for what it stages: the
  // tensor copies (a buffer kept between saves and counted while kept, in
  // a save that stages fewer tensors too; freed before a larger one is made;
  // pinned when CUDA tensors are saved) and the optimizers' archives (held
  // until the background save ends; Adam's are about twice its parameters).
  // A state that needs more is saved synchronously instead, with a warning
  // (printed once per Checkpointer; when the archives push it over,
  // after the tensors were copied: the save writes those copies; later saves
  // that would not fit by the last archives' size skip the copying).
  // Pinned memory comes from LibTorch's caching host allocator, which rounds
  // a block up to a power of two and keeps a replaced block cached: pinned
  // staging can take up to twice the tensors' share, more if the state grows
  // between saves.
  uint64_t max_staging_bytes = uint64_t{4} << 30;
};

struct LoadOptions {
  std::optional<int64_t> step;  // nullopt: the newest step that verifies
  MapLocation map_location = MapLocation::Auto();
};

struct LoadResult {
  int64_t step = 0;
  // Newer steps that failed verification and were skipped, with the reason
  // (the same on every rank).
  std::vector<std::pair<int64_t, std::string>> skipped;
};

class Checkpointer {
 public:
  // Rank 0 takes the store's writer lock for the Checkpointer's lifetime.
  // Like collectives, Checkpointers of a store (of a c10d store, in that
  // wait mode) are opened in the same order on every rank, and every rank
  // makes the same save and load calls: that is how the ranks name each
  // save and load alike without talking. The job id must be fresh per
  // launch: records an earlier launch left under the same id would pass for
  // this one's.
  static Result<std::unique_ptr<Checkpointer>> Open(std::string_view uri, const RankInfo& rank,
                                                    CheckpointerOptions options = {});
  ~Checkpointer();

  const RankInfo& rank() const { return rank_; }
  Store& store() { return *store_; }

  // Rank 0 writes and commits `step`; every other rank returns once it is
  // committed (and its manifest opens), or with rank 0's error, "writer died"
  // (file lock), or DeadlineExceeded.
  Status Save(int64_t step, const State& state);

  // Rank 0: Save. Other ranks: return at once; Poll() / Wait() later.
  // InvalidArgument with stripe on (use SaveAsync). The options' timeout
  // counts from this call: past it, Poll and Wait return DeadlineExceeded.
  // A Ticket uses its Checkpointer: poll or wait on it from the thread that
  // uses the Checkpointer, and only while the Checkpointer lives.
  class Ticket {
   public:
    int64_t step() const { return step_; }
    // true once committed, false while pending; an error if the save
    // failed or the deadline passed.
    Result<bool> Poll();
    Status Wait();

   private:
    friend class Checkpointer;
    Checkpointer* owner_ = nullptr;
    int64_t step_ = 0;
    std::string attempt_;
    std::chrono::steady_clock::time_point deadline_;
    Status done_;  // rank 0's result, or set once resolved
    bool resolved_ = false;
  };
  Result<Ticket> SaveNonBlocking(int64_t step, const State& state);

  // Rank 0: copies the state's tensors into staging memory that is reused
  // from save to save, and archives its optimizers into memory, then
  // writes and commits on a background thread; returns as soon as the copy
  // is done, so training may change the state at once. The future holds
  // what Save would have returned. Other ranks: the future resolves when
  // the step is committed. Where no thread can be started (RLIMIT_NPROC),
  // the call saves synchronously, with a warning. One save is in flight at
  // a time: every later call of Save, SaveAsync, SaveNonBlocking or Load
  // first waits for it and returns its error if it failed (once). The
  // destructor waits for it: the error of a last save that no later call
  // reported is on its future only.
  // Not for use from several threads at once, like every other method.
  std::future<Status> SaveAsync(int64_t step, const State& state);

  // Loads into `state` on every rank: the step rank 0 chose (the newest
  // that verifies, falling back loudly), or options.step. nullopt when the
  // store holds no checkpoint yet (a fresh start); an error, the same on
  // every rank, when checkpoints exist but none verifies.
  Result<std::optional<LoadResult>> Load(State& state, const LoadOptions& options = {});

 private:
  Checkpointer();
  Status ConfirmCommitted(int64_t step);
  // Waits for an in-flight SaveAsync; its error, the first time only.
  Status FinishAsync();
  // The next save's attempt (see ckptio/coordination.h): scope_ and the
  // number of save calls so far, the same on every rank.
  std::string NextAttempt();
  // Rank 0, a save that ends before it began: tells the other ranks (its
  // error as the attempt's outcome), and returns `error`.
  Status Abandon(int64_t step, const std::string& attempt, Status error);
  Status SaveNow(int64_t step, const std::string& attempt, const internal::SavePlan& plan);
  Status SaveStripe(int64_t step, const std::string& attempt, const internal::SavePlan& plan);
  // What this rank writes of `state`: everything on rank 0 of a plain save,
  // its part of a striped one, nothing otherwise.
  internal::SavePlan PlanFor(const State& state) const;
  Result<std::optional<LoadResult>> Decide(const std::string& name, const LoadOptions& options,
                                           std::unique_ptr<internal::OpenedStep>* verified);
  // Rank 0: publishes load decision `name` and remembers it until a striped
  // save shows that every rank is past it.
  Status PublishDecision(const std::string& name, const std::string& payload);
  // Rank 0, once every rank delivered its receipt for `attempt`: deletes
  // that save's records and the load decisions published before it.
  void RetractStripeRecords(const std::string& attempt);

  RankInfo rank_;
  CheckpointerOptions options_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<StoreWriter> writer_;  // rank 0 only
  std::unique_ptr<Coordinator> coordinator_;
  // Names this Checkpointer's saves and load decisions in the job: a hash
  // of the job id and how many Checkpointers of the job this rank opened
  // before on the same store (or c10d store); every rank opens them in the
  // same order.
  std::string scope_;
  uint64_t load_seq_ = 0;
  uint64_t save_seq_ = 0;
  std::vector<std::string> decisions_;          // rank 0: published, not yet retracted
  std::unique_ptr<internal::AsyncSave> async_;  // last: joined first
};

// Coordination through a c10d::Store (WaitMode::kStore).
Result<std::unique_ptr<Coordinator>> NewC10dCoordinator(c10::intrusive_ptr<c10d::Store> store,
                                                        const RankInfo& rank);

namespace internal {
template <typename T, typename = void>
struct HasUseLibUV : std::false_type {};
template <typename T>
struct HasUseLibUV<T, std::void_t<decltype(std::declval<T&>().useLibUV)>> : std::true_type {};
}  // namespace internal

// Turns TCPStore's libuv backend off where LibTorch has the switch
// (TCPStoreOptions::useLibUV, on by default since LibTorch 2.4): builds
// without libuv, Debian's among them, otherwise refuse to start a store
// ("use_libuv was requested but PyTorch was build without libuv support").
// With LibTorch 1.x it does nothing. Options: c10d::TCPStoreOptions.
template <typename Options>
void UseClassicTcpStore(Options& options) {
  if constexpr (internal::HasUseLibUV<Options>::value) options.useLibUV = false;
}

// Writes `tensors` as a safetensors object of `pending` and records each in
// its manifest. `devices` (optional, same order) overrides the recorded
// saved-from device. Lower level than Checkpointer; used by tests and tools.
Status WriteSafetensors(PendingCheckpoint& pending, const std::string& object,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                        const std::vector<std::string>& devices = {});
// The same into one rank's stripe of a striped save.
Status WriteSafetensors(StripeWriter& stripe, const std::string& object,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                        const std::vector<std::string>& devices = {});

// The object `object` is a part of (itself when it is not a stripe's part).
std::string StripeBaseObject(const Manifest& manifest, const std::string& object);

// The safetensors dtype of a LibTorch type ("F32"); "" if safetensors has
// none for it.
const char* SafetensorsDtypeName(torch::ScalarType type);

// Reads tensor `name` of `object` from a verified checkpoint onto `device`.
Result<torch::Tensor> ReadTensor(CheckpointReader& reader, const TensorEntry& entry,
                                 torch::Device device);

// Tensor `entry` of a verified object view (CheckpointReader::View) on
// `device`. On the CPU the tensor shares the view's memory (copy-on-write
// for a memory map: writing to the tensor never changes the checkpoint) and
// keeps the view alive; elsewhere it is a copy.
Result<torch::Tensor> TensorFromView(const std::shared_ptr<ObjectView>& view,
                                     const TensorEntry& entry, torch::Device device);

// One-line adoption, mirroring torch::save / torch::load: save commits the
// next step of the store at `uri` (single process), load reads the newest
// one that verifies onto `device`.
Status save(torch::nn::Module& module, std::string_view uri);
Status save(torch::optim::Optimizer& optimizer, std::string_view uri);
Status save(torch::Tensor& tensor, std::string_view uri);
template <typename M>
Status save(torch::nn::ModuleHolder<M>& module, std::string_view uri) {
  return save(static_cast<torch::nn::Module&>(*module), uri);
}
Status load(torch::nn::Module& module, std::string_view uri, torch::Device device = torch::kCPU);
// An optimizer's state goes where its parameters are unless told otherwise.
Status load(torch::optim::Optimizer& optimizer, std::string_view uri);
Status load(torch::optim::Optimizer& optimizer, std::string_view uri, torch::Device device);
Status load(torch::Tensor& tensor, std::string_view uri, torch::Device device = torch::kCPU);
template <typename M>
Status load(torch::nn::ModuleHolder<M>& module, std::string_view uri,
            torch::Device device = torch::kCPU) {
  return load(static_cast<torch::nn::Module&>(*module), uri, device);
}

}  // namespace ckptio

#endif  // CKPTIO_TORCH_H_
