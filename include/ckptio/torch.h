// ckptio for LibTorch (library ckptio::torch): checkpoints of modules,
// optimizers, tensors and metadata across the ranks of a data-parallel job.
//
// Example: resume from the newest good step, stop on any error
//   auto rank = ckptio::RankInfo::FromEnv();            // torchrun, Slurm, Open MPI
//   if (!rank.ok()) { std::cerr << rank.status() << "\n"; return 1; }
//   ckptio::CheckpointerOptions opt;
//   opt.wait = ckptio::WaitOn::FileLock();   // or Manifest(), C10dStore(tcp_store)
//   opt.keep_last = 3;
//   auto ckpt = ckptio::Checkpointer::Open("/ckpt/run42", *rank, opt);
//   if (!ckpt.ok()) { std::cerr << ckpt.status() << "\n"; return 1; }
//   ckptio::State state{{"model", model}, {"optim", optimizer}};
//   auto loaded = (*ckpt)->Load(state);                // every rank, same step
//   if (!loaded.ok()) {             // unreadable, or nothing verifies: never
//     std::cerr << loaded.status() << "\n";  // restart from step 0 because of it
//     return 1;
//   }
//   for (int64_t step = loaded->next_step(); step < steps; ++step) {  // 0: none yet
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
#include <type_traits>
#include <utility>
#include <vector>

#include "ckptio/coordination.h"
#include "ckptio/export.h"
#include "ckptio/rank.h"
#include "ckptio/status.h"
#include "ckptio/store.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace ckptio {

namespace internal {
struct C10dStoreHandle;
}  // namespace internal

// A module's parameters and buffers by their dotted names ("fc1.weight").
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// A named piece of state (names unique; module and optimizer names: 1-160 of
// [A-Za-z0-9._-], no leading '.'). Holds a reference: the object must outlive.
class CKPTIO_EXPORT StateItem {
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
  // A module given by its tensors rather than as a torch::nn::Module (the
  // Python package passes a torch.nn.Module's state_dict(keep_vars=True)
  // this way): saved and loaded exactly as a module holding them, and
  // interchangeable with one on disk; a load fills these tensors (in place
  // where it can, as a module's).
  StateItem(std::string name, NamedTensors tensors)
      : name_(std::move(name)), kind_(Kind::kModule), named_(std::move(tensors)) {}

  const std::string& name() const { return name_; }
  Kind kind() const { return kind_; }
  // A module's parameters and buffers (kModule): the module's, or the
  // tensors it was given as.
  NamedTensors module_tensors() const;
  // The module (kModule items made from one; null for NamedTensors).
  torch::nn::Module* module() const { return module_; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  torch::Tensor& tensor() const { return *tensor_; }

 private:
  std::string name_;
  Kind kind_;
  torch::nn::Module* module_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  torch::Tensor* tensor_ = nullptr;
  NamedTensors named_;
};

// What a checkpoint holds: named modules, optimizers and tensors, plus
// string metadata (epoch, data-loader position, RNG state...).
struct CKPTIO_EXPORT State {
  State() = default;
  State(std::initializer_list<StateItem> list) : items(list) {}

  std::vector<StateItem> items;
  std::map<std::string, std::string> metadata;  // saved and loaded with the step

  void SetInt(const std::string& key, int64_t value) { metadata[key] = std::to_string(value); }
  // nullopt when absent or not an integer.
  std::optional<int64_t> GetInt(const std::string& key) const;
};

// Where loaded tensors go.
class CKPTIO_EXPORT MapLocation {
 public:
  // cuda:LOCAL_RANK when CUDA is available (cuda:0 when the process sees
  // one GPU: its own, under per-rank CUDA_VISIBLE_DEVICES), else CPU.
  static MapLocation Auto() { return MapLocation(); }
  static MapLocation To(torch::Device device);
  // "cpu", "cuda", "cuda:1"; InvalidArgument at Resolve if unparsable.
  static MapLocation To(const std::string& device);
  // Maps the device a tensor was saved from ("cuda:0", "cpu") to a target.
  // A function that throws fails the load (INVALID_ARGUMENT, with its
  // message) before anything of the state changed.
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

// How the ranks that do not write learn that rank 0 committed a save, and
// how every rank learns which step to load (ckptio/coordination.h has the
// details).
class CKPTIO_EXPORT WaitOn {
 public:
  // The others poll the store for the step's manifest (any backend).
  static WaitOn Manifest();
  // Rank 0 holds a lock on <store>/.save-lock while it saves: a rank 0 that
  // dies is seen at once (the kernel or the NFS server drops its lock).
  static WaitOn FileLock();
  // Through the trainer's c10d store (its TCPStore): no polling of the
  // storage. `store` must not be null (Checkpointer::Open refuses it).
  static WaitOn C10dStore(c10::intrusive_ptr<c10d::Store> store);

  WaitMode mode() const { return mode_; }
  // The c10d store of C10dStore(); null otherwise.
  const internal::C10dStoreHandle* c10d_store() const { return store_.get(); }

 private:
  WaitOn(WaitMode mode, std::shared_ptr<const internal::C10dStoreHandle> store)
      : mode_(mode), store_(std::move(store)) {}
  WaitMode mode_;
  std::shared_ptr<const internal::C10dStoreHandle> store_;
};

struct CKPTIO_EXPORT CheckpointerOptions {
  WaitOn wait = WaitOn::Manifest();
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

struct LoadResult;

struct CKPTIO_EXPORT LoadOptions {
  std::optional<int64_t> step;  // nullopt: the newest step that verifies
  MapLocation map_location = MapLocation::Auto();
  // Also load every named tensor of the step that no item of the State
  // names (through map_location), into LoadResult::tensors: what the
  // Python package rebuilds nested state from.
  bool other_tensors = false;
  // Called once the step is verified and staged, before anything of the
  // State changes, with the step's metadata and the LoadResult to be;
  // a non-OK return fails the load with that status, nothing changed. (The
  // Python package checks there that the step fits its objects.)
  std::function<Status(const std::map<std::string, std::string>& metadata,
                       const LoadResult& result)>
      before_apply;
};

// What a Load did. A failed Load is an error (Result's status), never a
// LoadResult: a trainer that checks ok() cannot mistake a damaged or
// unreachable store for a fresh start.
struct CKPTIO_EXPORT LoadResult {
  // The step loaded into the state; nullopt when the store holds no
  // checkpoint yet (a fresh start: the state is as it was).
  std::optional<int64_t> step;
  // Newer steps that failed verification and were skipped, with the reason
  // (the same on every rank).
  std::vector<std::pair<int64_t, std::string>> skipped;
  // With LoadOptions::other_tensors: the step's named tensors that no item
  // of the State took, by name.
  std::map<std::string, torch::Tensor> tensors;

  // Where training resumes: the step after the one loaded, 0 on a fresh start.
  int64_t next_step() const { return step ? *step + 1 : 0; }
};

class CKPTIO_EXPORT Checkpointer {
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
  // Rank 0: waits for a save still in flight (SaveAsync); the others end
  // their wait for its commit.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  const RankInfo& rank() const;
  Store& store();

  // Rank 0 writes and commits `step`; every other rank returns once it is
  // committed (and its manifest opens), or with rank 0's error, "writer died"
  // (file lock), or DeadlineExceeded.
  Status Save(int64_t step, const State& state);

  // Rank 0: copies the state's tensors into staging memory that is reused
  // from save to save, and archives its optimizers into memory, then
  // writes and commits on a background thread; returns as soon as the copy
  // is done, so training may change the state at once. The future holds
  // what Save would have returned. Other ranks: return at once; the future
  // resolves when the step is committed (the options' timeout counts from
  // this call). Where no thread can be started (RLIMIT_NPROC), the call
  // saves synchronously, with a warning. One save is in flight at a time:
  // every later call of Save, SaveAsync or Load first waits for it and
  // returns its error if it failed (once). Rank 0's destructor waits for
  // it: the error of a last save that no later call reported is on its
  // future only. Another rank's destructor ends its wait for the commit
  // (the future: ABORTED, closed while waiting).
  // Not for use from several threads at once, like every other method.
  std::future<Status> SaveAsync(int64_t step, const State& state);

  // Loads into `state` on every rank: the step rank 0 chose (the newest
  // that verifies, falling back loudly), or options.step. A LoadResult
  // without a step when the store holds no checkpoint yet (a fresh start);
  // an error, the same on every rank, when checkpoints exist but none
  // verifies, or the store cannot be read.
  Result<LoadResult> Load(State& state, const LoadOptions& options = {});

  struct Impl;  // src/torch/checkpointer_impl.h

 private:
  explicit Checkpointer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

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

// One-line adoption, mirroring torch::save / torch::load: save commits the
// next step of the store at `uri` (single process), load reads the newest
// one that verifies onto `device`.
CKPTIO_EXPORT Status save(torch::nn::Module& module, std::string_view uri);
CKPTIO_EXPORT Status save(torch::optim::Optimizer& optimizer, std::string_view uri);
CKPTIO_EXPORT Status save(torch::Tensor& tensor, std::string_view uri);
template <typename M>
CKPTIO_EXPORT Status save(torch::nn::ModuleHolder<M>& module, std::string_view uri) {
  return save(static_cast<torch::nn::Module&>(*module), uri);
}
CKPTIO_EXPORT Status load(torch::nn::Module& module, std::string_view uri,
                          torch::Device device = torch::kCPU);
// An optimizer's state goes where its parameters are unless told otherwise.
CKPTIO_EXPORT Status load(torch::optim::Optimizer& optimizer, std::string_view uri);
CKPTIO_EXPORT Status load(torch::optim::Optimizer& optimizer, std::string_view uri,
                          torch::Device device);
CKPTIO_EXPORT Status load(torch::Tensor& tensor, std::string_view uri,
                          torch::Device device = torch::kCPU);
template <typename M>
CKPTIO_EXPORT Status load(torch::nn::ModuleHolder<M>& module, std::string_view uri,
                          torch::Device device = torch::kCPU) {
  return load(static_cast<torch::nn::Module&>(*module), uri, device);
}
// The same for a whole State (each item under its own name; what the
// Python package's ckptio.save / ckptio.load use). load takes no lock, like
// any reader: options.step, or the newest step that verifies (skipped ones
// logged and in the result); NotFound when nothing is saved yet.
CKPTIO_EXPORT Status save(const State& state, std::string_view uri);
CKPTIO_EXPORT Result<LoadResult> load(State& state, std::string_view uri,
                                      const LoadOptions& options = {});

}  // namespace ckptio

#endif  // CKPTIO_TORCH_H_
