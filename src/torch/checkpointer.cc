// Checkpointer: rank-0 saves, waiting ranks, agreed loads.
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "ckptio/backends.h"
#include "ckptio/hash.h"
#include "ckptio/safetensors.h"
#include "ckptio/torch.h"
#include "copy.h"
#include "text.h"
#include "torch/pinned_copy.h"
#include "torch/state_key.h"

namespace ckptio {

// What a save writes, planned before anything is written: the tensor
// objects, the optimizers (live, streamed at write time, or archived into
// memory for an asynchronous save) and the metadata.
namespace internal {
struct SavePlan {
  struct TensorObject {
    std::string item;    // for messages
    std::string object;  // e.g. "model.safetensors"
    std::vector<std::pair<std::string, torch::Tensor>> tensors;
    std::vector<std::string> devices;  // the devices saved from, same order
  };
  std::vector<TensorObject> tensor_objects;
  std::vector<std::pair<std::string, const torch::optim::Optimizer*>> optimizers;  // object, live
  // An optimizer archived into memory, in pieces: appending to one growing
  // buffer would hold up to twice the archive while it reallocates.
  struct Archive {
    std::string object;
    std::vector<std::string> pieces;
  };
  std::vector<Archive> archives;
  std::map<std::string, std::string> metadata;
  // Rank 0 of a striped save: the part objects the other ranks must deliver.
  std::set<std::string> stripes;
  // ... and the tensors each must hold (by part object, in order): rank 0's
  // split of its own layout, which every rank's split must match.
  struct Expected {
    std::string name, dtype;
    std::vector<int64_t> shape;
  };
  std::map<std::string, std::vector<Expected>> stripe_tensors;
};
}  // namespace internal

namespace {

using internal::SavePlan;

using json = nlohmann::json;

constexpr char kUserPrefix[] = "user.";
constexpr char kItemPrefix[] = "ckptio.item.";  // ckptio.item.<name> = module|optimizer|tensors
constexpr char kTensorsObject[] = "tensors.safetensors";

std::string ModuleObject(const std::string& name) { return name + ".safetensors"; }
std::string OptimizerObject(const std::string& name) { return name + ".optim.pt"; }

// Runs `fn`, turning a LibTorch exception into a Status.
template <typename Fn>
Status Guard(const std::string& what, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return Status(Code::kInvalidArgument, what + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status(Code::kInternal, what + ": " + e.what());
  }
}

std::vector<std::pair<std::string, torch::Tensor>> ModuleTensors(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers(/*recurse=*/true))
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  return out;
}

std::string DeviceOf(const torch::optim::Optimizer& o) {
  for (const auto& group : o.param_groups())
    for (const auto& p : group.params())
      if (p.defined()) return p.device().str();
  return "cpu";
}

SavePlan Plan(const State& state) {
  SavePlan plan;
  SavePlan::TensorObject loose{"tensors", kTensorsObject, {}, {}};
  auto add = [](SavePlan::TensorObject& to, std::vector<std::pair<std::string, torch::Tensor>> ts) {
    for (auto& [name, t] : ts) {
      to.devices.push_back(t.defined() ? t.device().str() : "cpu");
      to.tensors.emplace_back(std::move(name), std::move(t));
    }
  };
  for (const StateItem& item : state.items) {
    const std::string& name = item.name();
    switch (item.kind()) {
      case StateItem::Kind::kModule: {
        plan.metadata[kItemPrefix + name] = "module";
        SavePlan::TensorObject to{"module " + name, ModuleObject(name), {}, {}};
        add(to, ModuleTensors(item.module()));
        plan.tensor_objects.push_back(std::move(to));
        break;
      }
      case StateItem::Kind::kOptimizer:
        plan.metadata[kItemPrefix + name] = "optimizer:" + DeviceOf(item.optimizer());
        plan.optimizers.emplace_back(OptimizerObject(name), &item.optimizer());
        break;
      case StateItem::Kind::kTensor:
        // No metadata entry: tensors.safetensors lists them (and the
        // manifest holds at most 10,000 entries).
        add(loose, {{name, item.tensor()}});
        break;
    }
  }
  if (!loose.tensors.empty()) plan.tensor_objects.push_back(std::move(loose));
  for (const auto& [key, value] : state.metadata) plan.metadata[kUserPrefix + key] = value;
  return plan;
}

// Item names are unique (one ckptio.item.<name> entry each, so a module and
// a tensor both named "x" would save but never load), and a module's or
// optimizer's name is usable in its object's name. A save also keeps room
// for ".part-N.safetensors" and refuses names a striped part could take
// ("model.part-1" beside "model"); a load accepts whatever a save made.
constexpr size_t kMaxItemName = 160;  // + ".part-N.safetensors" fits kMaxKeyComponent
bool EndsLikeAPart(const std::string& name) {
  const size_t dot = name.rfind(".part-");
  return dot != std::string::npos && dot + 6 < name.size() &&
         name.find_first_not_of("0123456789", dot + 6) == std::string::npos;
}
Status CheckNames(const State& state, bool saving) {
  std::map<std::string, StateItem::Kind> seen;
  auto kind_name = [](StateItem::Kind k) {
    return k == StateItem::Kind::kModule      ? "a module"
           : k == StateItem::Kind::kOptimizer ? "an optimizer"
                                              : "a tensor";
  };
  bool loose = false;
  for (const StateItem& item : state.items) {
    const std::string& name = item.name();
    auto [it, fresh] = seen.emplace(name, item.kind());
    if (!fresh)
      return Status(Code::kInvalidArgument, "the State has two items named \"" + Printable(name) +
                                                "\" (" + kind_name(it->second) + " and " +
                                                kind_name(item.kind()) +
                                                "): item names must be unique");
    if (item.kind() == StateItem::Kind::kTensor) {
      loose = true;
      continue;
    }
    Status s = ValidateObjectName(item.kind() == StateItem::Kind::kModule ? ModuleObject(name)
                                                                          : OptimizerObject(name));
    if (name.empty() || !s.ok() || (saving && (name.size() > kMaxItemName || EndsLikeAPart(name))))
      return Status(Code::kInvalidArgument,
                    std::string(kind_name(item.kind())) + " is named \"" + Printable(name) +
                        "\", which cannot name its object in the store: module and optimizer "
                        "names are 1 to 160 of [A-Za-z0-9._-], not starting with '.' nor "
                        "ending in .part-<digits> (tensor names may be any UTF-8)");
  }
  auto module = seen.find("tensors");
  if (loose && module != seen.end() && module->second == StateItem::Kind::kModule)
    return Status(Code::kInvalidArgument,
                  "a module named \"tensors\" would share tensors.safetensors with the State's "
                  "tensors: rename the module");
  return OkStatus();
}

// Before a save or load: the previous save's outcome, else CheckNames.
Status Ready(Status previous, const State& state, bool saving) {
  return previous.ok() ? CheckNames(state, saving) : previous;
}

std::string PartObject(const std::string& object, int rank) {
  const std::string suffix = ".safetensors";
  std::string stem = object.size() > suffix.size() && object.compare(object.size() - suffix.size(),
                                                                     suffix.size(), suffix) == 0
                         ? object.substr(0, object.size() - suffix.size())
                         : object;
  return stem + ".part-" + std::to_string(rank) + suffix;
}

// Rank `rank`'s share of a striped save of `full`: tensors go, largest
// first, to the rank with the fewest bytes so far (ties: the lowest rank),
// which every rank computes alike from the same layout. Rank 0 keeps its
// parts under the objects' own names (even when empty), the optimizers and
// the metadata, and learns which part objects the others will deliver.
SavePlan StripePart(const SavePlan& full, int rank, int world) {
  struct Unit {
    size_t object, index;
    uint64_t bytes;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < full.tensor_objects.size(); ++i)
    for (size_t j = 0; j < full.tensor_objects[i].tensors.size(); ++j) {
      const torch::Tensor& t = full.tensor_objects[i].tensors[j].second;
      if (t.defined()) units.push_back({i, j, t.nbytes()});
    }
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& a, const Unit& b) { return a.bytes > b.bytes; });
  std::vector<uint64_t> load(static_cast<size_t>(world), 0);
  std::vector<std::vector<int>> owner(full.tensor_objects.size());
  for (size_t i = 0; i < full.tensor_objects.size(); ++i)
    owner[i].assign(full.tensor_objects[i].tensors.size(), 0);
  for (const Unit& u : units) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[static_cast<size_t>(r)] += u.bytes;
    owner[u.object][u.index] = r;
  }
  SavePlan part;
  if (rank == 0) {
    part.optimizers = full.optimizers;
    part.archives = full.archives;
    part.metadata = full.metadata;
  }
  for (size_t i = 0; i < full.tensor_objects.size(); ++i) {
    const auto& to = full.tensor_objects[i];
    std::vector<SavePlan::TensorObject> per_rank(static_cast<size_t>(world));
    for (size_t j = 0; j < to.tensors.size(); ++j) {
      auto& mine = per_rank[static_cast<size_t>(owner[i][j])];
      mine.tensors.push_back(to.tensors[j]);
      mine.devices.push_back(to.devices[j]);
    }
    for (int r = 0; r < world; ++r) {
      auto& p = per_rank[static_cast<size_t>(r)];
      if (r != 0 && p.tensors.empty()) continue;
      p.item = to.item;
      p.object = r == 0 ? to.object : PartObject(to.object, r);
      if (rank == 0 && r != 0) {
        part.metadata[kStripePartPrefix + p.object] = to.object;
        part.stripes.insert(p.object);
        auto& expected = part.stripe_tensors[p.object];
        for (const auto& [name, t] : p.tensors)
          expected.push_back({name, SafetensorsDtypeName(t.scalar_type()), t.sizes().vec()});
      }
      if (r == rank) part.tensor_objects.push_back(std::move(p));
    }
  }
  return part;
}

// "F32 [90, 4]": a tensor's dtype and shape, for messages.
std::string Layout(const std::string& dtype, const std::vector<int64_t>& shape) {
  std::string out = dtype + " [";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// OK if rank `r`'s receipt holds exactly the tensors rank 0's split gave
// its part objects (name, dtype, shape). Ranks whose layouts differ split
// differently: committing their parts could hold a tensor twice and
// another not at all, and the step would load on no rank.
Status CheckStripeTensors(const SavePlan& plan, const StripeReceipt& receipt, int r) {
  const std::string prefix = "ranks do not hold the same state: rank " + std::to_string(r) + "'s ";
  std::map<std::pair<std::string, std::string>, const SavePlan::Expected*> want;
  for (const auto& o : receipt.objects) {
    auto it = plan.stripe_tensors.find(o.name);
    if (it == plan.stripe_tensors.end()) continue;  // an unexpected object: refused later
    for (const auto& e : it->second) want[{o.name, e.name}] = &e;
  }
  for (const TensorEntry& t : receipt.tensors) {
    auto it = want.find({t.object, t.name});
    if (it == want.end())
      return Status(Code::kInvalidArgument, prefix + "part " + t.object + " holds tensor " +
                                                t.name + " (" + Layout(t.dtype, t.shape) +
                                                "), which rank 0's split does not put there");
    const SavePlan::Expected& e = *it->second;
    if (t.dtype != e.dtype || t.shape != e.shape)
      return Status(Code::kInvalidArgument, prefix + "part " + t.object + " holds tensor " +
                                                t.name + " as " + Layout(t.dtype, t.shape) +
                                                ", where rank 0 has " + Layout(e.dtype, e.shape));
    want.erase(it);
  }
  if (!want.empty())
    return Status(Code::kInvalidArgument,
                  prefix + "part " + want.begin()->first.first + " lacks tensor " +
                      want.begin()->first.second + " (" +
                      Layout(want.begin()->second->dtype, want.begin()->second->shape) +
                      "), which rank 0's split puts there");
  return OkStatus();
}

// A rank's failure, as it travels in place of a receipt or a go-ahead.
std::string ErrorPayload(const Status& s) {
  return "error:" + std::to_string(static_cast<int>(s.code())) + ":" + s.message();
}
std::optional<Status> PayloadError(const std::string& payload) {
  if (payload.rfind("error:", 0) != 0) return std::nullopt;
  size_t colon = payload.find(':', 6);
  int code = colon == std::string::npos ? 0 : std::atoi(payload.substr(6, colon - 6).c_str());
  if (code <= 0 || code > static_cast<int>(Code::kInternal))
    code = static_cast<int>(Code::kInternal);
  return Status(static_cast<Code>(code),
                colon == std::string::npos ? payload : payload.substr(colon + 1));
}

// Streams an optimizer's LibTorch archive to `write` (no copy in memory).
Status ArchiveOptimizer(const torch::optim::Optimizer& optimizer, const std::string& object,
                        const std::function<Status(const void*, size_t)>& write) {
  Status written;
  CKPTIO_RETURN_IF_ERROR(Guard("saving optimizer " + object, [&] {
    torch::serialize::OutputArchive archive;
    const_cast<torch::optim::Optimizer&>(optimizer).save(archive);  // save() is not const
    // Never a short count: LibTorch's zip writer throws on one, and its
    // destructor then writes again and throws, which ends the process. After
    // an error the rest is dropped and the error returned below.
    archive.save_to([&](const void* data, size_t size) -> size_t {
      if (written.ok()) written = write(data, size);
      return size;
    });
    return OkStatus();
  }));
  return written;
}

Status WritePlan(PendingCheckpoint& pending, const SavePlan& plan) {
  for (const auto& [key, value] : plan.metadata)
    CKPTIO_RETURN_IF_ERROR(pending.SetMetadata(key, value));
  for (const auto& to : plan.tensor_objects)
    CKPTIO_RETURN_IF_ERROR(Guard("saving " + to.item, [&] {
      return WriteSafetensors(pending, to.object, to.tensors, to.devices);
    }));
  for (const auto& [object, optimizer] : plan.optimizers) {
    CKPTIO_ASSIGN_OR_RETURN(auto stream, pending.AddObject(object));
    CKPTIO_RETURN_IF_ERROR(ArchiveOptimizer(
        *optimizer, object, [&](const void* d, size_t n) { return stream->Write(d, n); }));
    CKPTIO_RETURN_IF_ERROR(stream->Close());
  }
  for (const auto& a : plan.archives) {
    CKPTIO_ASSIGN_OR_RETURN(auto stream, pending.AddObject(a.object));
    for (const auto& piece : a.pieces)
      CKPTIO_RETURN_IF_ERROR(stream->Write(piece.data(), piece.size()));
    CKPTIO_RETURN_IF_ERROR(stream->Close());
  }
  return OkStatus();
}

// Everything a load will apply, prepared without touching the caller's state.
struct Staged {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> module_tensors;  // (target, loaded)
  // (a module's contiguous tensor on a GPU, its verified bytes on the host):
  // copied into the tensor's own memory, with no second copy on the GPU.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> into_gpu;
  struct Optimizer {
    std::string name;
    torch::optim::Optimizer* target;
    std::shared_ptr<ObjectView> bytes;
    torch::Device device;  // where its state goes (map_location of the saved device)
  };
  std::vector<Optimizer> optimizers;
  std::vector<std::pair<torch::Tensor*, torch::Tensor>> tensors;
  std::map<std::string, std::string> metadata;
};

}  // namespace

// A step opened for loading: each object is viewed (read or mapped, and
// verified) once, however many tensors come from it.
struct internal::OpenedStep {
  std::unique_ptr<CheckpointReader> reader;
  std::map<std::string, std::shared_ptr<ObjectView>, std::less<>> views;

  // The verified view of `object`; for a tensor file, its safetensors header
  // checked against the manifest too.
  Result<std::shared_ptr<ObjectView>> View(const std::string& object) {
    auto it = views.find(object);
    if (it != views.end()) return it->second;
    CKPTIO_ASSIGN_OR_RETURN(auto view, reader->View(object));
    const Manifest& m = reader->manifest();
    if (std::any_of(m.tensors.begin(), m.tensors.end(),
                    [&](const TensorEntry& t) { return t.object == object; }))
      CKPTIO_RETURN_IF_ERROR(CheckSafetensorsObject(
          m, object, std::string_view(view->data(), static_cast<size_t>(view->size()))));
    return views.emplace(object, std::move(view)).first->second;
  }

  // Every object: what deciding that a step is good takes.
  Status ViewAll() {
    for (const auto& o : reader->manifest().objects) CKPTIO_RETURN_IF_ERROR(View(o.name).status());
    return OkStatus();
  }
};

namespace {

using internal::OpenedStep;

// `step` opened and every object verified: DataLoss when it is damaged.
Result<std::unique_ptr<OpenedStep>> OpenVerified(Store& store, int64_t step) {
  auto opened = std::make_unique<OpenedStep>();
  CKPTIO_ASSIGN_OR_RETURN(opened->reader, store.OpenStep(step));
  CKPTIO_RETURN_IF_ERROR(opened->ViewAll());
  return opened;
}

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// A module's tensor as staged: on its device, or (`into_gpu`) its verified
// bytes on the host, for a GPU tensor that takes them in place.
struct StagedTensor {
  torch::Tensor loaded;
  bool into_gpu = false;
};

// Whether the bytes of a module's tensor `target`, bound for `device`, are
// best written straight into its memory: a plain dense tensor already
// there (as MemcpysInto on the CPU). Staging them on the GPU first would
// hold the module twice there.
bool CopiesIntoGpu(const torch::Tensor& target, torch::Device device) {
  return device.is_cuda() && target.device() == device && target.layout() == torch::kStrided &&
         target.is_contiguous() && !target.is_conj() && !target.is_neg() && target.numel() > 0;
}

// Stages the tensors `wanted` (name -> live tensor) from `object`: every
// name present with the same dtype and shape, nothing extra.
Status StageTensors(OpenedStep& opened, const std::string& object, const std::string& what,
                    const std::vector<std::pair<std::string, torch::Tensor>>& wanted,
                    const MapLocation& map, const RankInfo& rank, std::vector<StagedTensor>* out) {
  CheckpointReader& reader = *opened.reader;
  CKPTIO_RETURN_IF_ERROR(opened.View(object).status());
  std::map<std::string, const TensorEntry*> saved;  // from the object and its stripes' parts
  for (const auto& t : reader.manifest().tensors)
    if (StripeBaseObject(reader.manifest(), t.object) == object) saved[t.name] = &t;
  std::string where = "step " + std::to_string(reader.step()) + ", " + what;
  std::set<c10::DeviceIndex> gpus_ready;  // (see into_gpu below)
  for (const auto& [name, live] : wanted) {
    auto it = saved.find(name);
    if (it == saved.end())
      return Status(Code::kInvalidArgument, where + ": the checkpoint has no tensor \"" + name +
                                                "\" (it has " + std::to_string(saved.size()) +
                                                "); is this the same model?");
    const TensorEntry& e = *it->second;
    if (ShapeStr(e.shape) != ShapeStr(live.sizes().vec()))
      return Status(Code::kInvalidArgument, where + ": tensor \"" + name + "\" has shape " +
                                                ShapeStr(e.shape) + " in the checkpoint but " +
                                                ShapeStr(live.sizes().vec()) + " in the model");
    CKPTIO_ASSIGN_OR_RETURN(torch::Device device, map.Resolve(e.device, rank));
    CKPTIO_ASSIGN_OR_RETURN(auto view, opened.View(e.object));
    const bool into_gpu = CopiesIntoGpu(live, device);
    CKPTIO_ASSIGN_OR_RETURN(
        torch::Tensor t, TensorFromView(view, e, into_gpu ? torch::Device(torch::kCPU) : device));
    if (t.scalar_type() != live.scalar_type())
      return Status(Code::kInvalidArgument,
                    where + ": tensor \"" + name + "\" is " +
                        std::string(c10::toString(t.scalar_type())) + " in the checkpoint but " +
                        std::string(c10::toString(live.scalar_type())) + " in the model");
    if (into_gpu && gpus_ready.insert(device.index()).second) {
      // The copy into the module must not fail halfway: the pinned buffer is
      // had now, and an error the GPU has pending from earlier work shows
      // here, before anything changes.
      try {
        internal::ReservePinned();
        torch::cuda::synchronize(device.index());
      } catch (const c10::Error& err) {
        return Status(Code::kFailedPrecondition,
                      where + ": preparing the copy of tensor \"" + name + "\" to " + device.str() +
                          ": " + err.what_without_backtrace() +
                          " (pinned host memory: free memory or raise ulimit -l; or load with "
                          "map_location \"cpu\")");
      }
    }
    out->push_back({t, into_gpu});
    saved.erase(it);
  }
  if (!saved.empty())
    return Status(Code::kInvalidArgument,
                  where + ": the checkpoint has " + std::to_string(saved.size()) +
                      " tensor(s) the model lacks, e.g. \"" + saved.begin()->first + "\"");
  return OkStatus();
}

// Whether `target` can take `loaded`'s bytes in place (copy_, set_): the
// same device and dtype, and dense. A sparse (or other non-strided) tensor
// has no storage of its own to take them; its data is replaced instead,
// which WhyNotApplicable refuses.
bool TakesInPlace(const torch::Tensor& target, const torch::Tensor& loaded) {
  return target.layout() == torch::kStrided && target.device() == loaded.device() &&
         target.dtype() == loaded.dtype();
}

// How ApplyTensors puts a loaded tensor into a module's: copied into the
// module's memory where that has the right place (byte for byte where both
// are contiguous on the CPU), else its data replaced.
bool CopiesInto(const torch::Tensor& target, const torch::Tensor& loaded) {
  return TakesInPlace(target, loaded) && target.sizes() == loaded.sizes();
}
bool MemcpysInto(const torch::Tensor& target, const torch::Tensor& loaded) {
  return CopiesInto(target, loaded) && target.device().is_cpu() && target.is_contiguous() &&
         !target.is_conj() && !target.is_neg() && loaded.is_contiguous();
}

// Whether ApplyTensors rebinds a named tensor to the loaded one: a tensor
// from .detach() or .data(), or an inference tensor, refuses set_ and
// set_data.
bool Rebinds(const torch::Tensor& target) {
  return !target.defined() || target.is_inference() ||
         !target.unsafeGetTensorImpl()->allow_tensor_metadata_change();
}

// Why LibTorch would refuse to put `loaded` into `target` (a module's, or
// with `named`, a named tensor, which takes the saved dtype and shape), or
// "": ApplyTensors must not fail halfway, so Stage refuses first.
std::string WhyNotApplicable(const torch::Tensor& target, const torch::Tensor& loaded,
                             bool named = false) {
  if (named ? Rebinds(target) : MemcpysInto(target, loaded)) return "";
  if (target.is_inference() && !c10::InferenceMode::is_enabled())
    return "is an inference tensor: load into it inside torch::InferenceMode, or into another";
  if (named ? TakesInPlace(target, loaded) : CopiesInto(target, loaded))  // set_, or copy_
    return !named && at::has_internal_overlap(target) == at::MemOverlap::Yes
               ? "has elements sharing memory (expanded): it cannot be loaded into"
               : "";
  if (target.requires_grad() && !loaded.is_floating_point() && !loaded.is_complex())
    return "requires grad, but the checkpoint's is " +
           std::string(c10::toString(loaded.scalar_type())) +
           ": load it into a tensor that does not require grad";
  if (!at::_has_compatible_shallow_copy_type(target, loaded))
    return "is a " + target.toString() + " tensor, which cannot take the checkpoint's " +
           loaded.toString() + " data";
  return "";
}

Result<Staged> Stage(OpenedStep& opened, State& state, const MapLocation& map,
                     const RankInfo& rank) {
  CheckpointReader& reader = *opened.reader;
  Staged staged;
  const auto& meta = reader.manifest().metadata;
  auto kind_of = [&](const std::string& name) -> std::string {
    auto it = meta.find(kItemPrefix + name);
    return it == meta.end() ? "" : it->second;
  };
  // The loose tensors: those of tensors.safetensors and its stripe parts
  // (unless that is a module's, one named "tensors").
  std::map<std::string, const TensorEntry*> loose_saved;
  if (kind_of("tensors") != "module" &&
      std::any_of(state.items.begin(), state.items.end(),
                  [](const StateItem& i) { return i.kind() == StateItem::Kind::kTensor; }))
    for (const auto& t : reader.manifest().tensors)
      if (StripeBaseObject(reader.manifest(), t.object) == kTensorsObject) loose_saved[t.name] = &t;
  std::vector<std::pair<torch::Tensor*, const TensorEntry*>> loose;
  for (StateItem& item : state.items) {
    const std::string& name = item.name();
    const std::string kind = kind_of(name);
    const std::string missing =
        "step " + std::to_string(reader.step()) + " has no " +
        std::string(item.kind() == StateItem::Kind::kModule      ? "module"
                    : item.kind() == StateItem::Kind::kOptimizer ? "optimizer"
                                                                 : "tensor") +
        " named \"" + name + "\"";
    switch (item.kind()) {
      case StateItem::Kind::kModule: {
        if (kind != "module") return Status(Code::kInvalidArgument, missing);
        auto live = ModuleTensors(item.module());
        std::vector<StagedTensor> loaded;
        CKPTIO_RETURN_IF_ERROR(Guard("loading module " + name, [&] {
          return StageTensors(opened, ModuleObject(name), "module " + name, live, map, rank,
                              &loaded);
        }));
        for (size_t i = 0; i < live.size(); ++i) {
          if (loaded[i].into_gpu) {  // a byte copy into its memory, as MemcpysInto
            staged.into_gpu.emplace_back(live[i].second, loaded[i].loaded);
            continue;
          }
          if (std::string why = WhyNotApplicable(live[i].second, loaded[i].loaded); !why.empty())
            return Status(Code::kInvalidArgument,
                          "module " + name + ": \"" + live[i].first + "\" " + why);
          staged.module_tensors.emplace_back(live[i].second, loaded[i].loaded);
        }
        break;
      }
      case StateItem::Kind::kOptimizer: {
        if (kind.rfind("optimizer", 0) != 0) return Status(Code::kInvalidArgument, missing);
        CKPTIO_ASSIGN_OR_RETURN(auto bytes, opened.View(OptimizerObject(name)));
        // The mapping sees the device recorded at save time ("optimizer:<d>"),
        // as for tensors; the optimizer's own where none was recorded.
        const std::string saved = kind.size() > 10 ? kind.substr(10) : DeviceOf(item.optimizer());
        CKPTIO_ASSIGN_OR_RETURN(torch::Device device, map.Resolve(saved, rank));
        staged.optimizers.push_back({name, &item.optimizer(), std::move(bytes), device});
        break;
      }
      case StateItem::Kind::kTensor: {
        // Older checkpoints also list each as ckptio.item.<name> = tensor.
        auto it = loose_saved.find(name);
        if (kind == "tensor" && it == loose_saved.end())
          return Status(Code::kDataLoss, "step " + std::to_string(reader.step()) + ": tensor \"" +
                                             name + "\" is listed but not stored");
        if (!(kind.empty() || kind == "tensor") || it == loose_saved.end())
          return Status(Code::kInvalidArgument, missing);
        loose.emplace_back(&item.tensor(), it->second);
        break;
      }
    }
  }
  if (!loose.empty()) {
    // Loose tensors take the saved shape and dtype, whatever the target
    // held before (like torch::load of a tensor).
    CKPTIO_RETURN_IF_ERROR(opened.View(kTensorsObject).status());
    for (const auto& [target, entry] : loose) {
      CKPTIO_ASSIGN_OR_RETURN(torch::Device device, map.Resolve(entry->device, rank));
      CKPTIO_ASSIGN_OR_RETURN(auto view, opened.View(entry->object));
      CKPTIO_ASSIGN_OR_RETURN(torch::Tensor t, TensorFromView(view, *entry, device));
      if (std::string why = WhyNotApplicable(*target, t, /*named=*/true); !why.empty())
        return Status(Code::kInvalidArgument, "tensor \"" + entry->name + "\" " + why);
      staged.tensors.emplace_back(target, t);
    }
  }
  for (const auto& [key, value] : meta)
    if (key.rfind(kUserPrefix, 0) == 0) staged.metadata[key.substr(sizeof kUserPrefix - 1)] = value;
  return staged;
}

void ApplyTensors(Staged& staged, State& state);

// LibTorch's Optimizer::load pairs state with parameters by position only:
// the state of another model's optimizer loads, and the next step() throws
// (or, for parameters of equal shapes in another order, trains on the wrong
// moments). Every per-parameter state tensor of the built-in optimizers
// must have its parameter's shape.
Status CheckOptimizerState(const torch::optim::Optimizer& opt) {
  namespace o = torch::optim;
  using Key = std::decay_t<decltype(opt.state())>::key_type;
  const auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& p = params[i];
      if (!p.defined()) continue;
      auto it = opt.state().find(internal::StateKey<Key>(p.unsafeGetTensorImpl()));
      if (it == opt.state().end()) continue;
      const o::OptimizerParamState* st = it->second.get();
      std::vector<torch::Tensor> per_param;
      if (auto* a = dynamic_cast<const o::AdamParamState*>(st))
        per_param = {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
      else if (auto* w = dynamic_cast<const o::AdamWParamState*>(st))
        per_param = {w->exp_avg(), w->exp_avg_sq(), w->max_exp_avg_sq()};
      else if (auto* sgd = dynamic_cast<const o::SGDParamState*>(st))
        per_param = {sgd->momentum_buffer()};
      else if (auto* r = dynamic_cast<const o::RMSpropParamState*>(st))
        per_param = {r->square_avg(), r->momentum_buffer(), r->grad_avg()};
      else if (auto* ada = dynamic_cast<const o::AdagradParamState*>(st))
        per_param = {ada->sum()};
      for (const torch::Tensor& t : per_param)
        if (t.defined() && t.sizes() != p.sizes())
          return Status(Code::kInvalidArgument,
                        "the optimizer's state for parameter " + std::to_string(i) + " of group " +
                            std::to_string(g) + " has shape " + ShapeStr(t.sizes().vec()) +
                            ", the parameter " + ShapeStr(p.sizes().vec()) +
                            ": the checkpoint's optimizer was made for other parameters (another "
                            "model, or the same in another order)");
    }
  }
  return OkStatus();
}

// Applies a staged load. Optimizers first (the step expected to fail, on an
// archive that does not fit): on failure every optimizer is restored and
// nothing else was touched. Stage refused what the tensors' step would.
Status Apply(Staged& staged, State& state) {
  std::vector<std::pair<torch::optim::Optimizer*, std::string>> backups;
  // LibTorch's load only adds and overwrites state entries, so every load
  // clears first: else state the archive lacks (a parameter with no step
  // yet when saved, or what a failed load installed) would stay.
  auto restore = [&] {
    std::string error;
    for (auto& [o, b] : backups) {
      try {
        o->state().clear();
        torch::serialize::InputArchive in;
        in.load_from(b.data(), b.size());
        o->load(in);
      } catch (const std::exception& e) {
        if (error.empty()) error = e.what();
      }
    }
    return error;
  };
  for (auto& staged_opt : staged.optimizers) {
    torch::optim::Optimizer* opt = staged_opt.target;
    Status s = Guard("loading optimizer " + staged_opt.name, [&] {
      std::ostringstream backup;
      {
        torch::serialize::OutputArchive out;
        opt->save(out);
        out.save_to(backup);
      }
      backups.emplace_back(opt, backup.str());
      torch::serialize::InputArchive in;
      in.load_from(staged_opt.bytes->data(), static_cast<size_t>(staged_opt.bytes->size()),
                   staged_opt.device);
      opt->state().clear();
      opt->load(in);
      return CheckOptimizerState(*opt);
    });
    if (!s.ok()) {
      const std::string restore_error = restore();
      return s.WithContext(
          restore_error.empty()
              ? "the checkpoint's optimizer state does not fit (optimizers restored, modules "
                "untouched)"
              : "the checkpoint's optimizer state does not fit, and restoring an optimizer's "
                "previous state failed too (" +
                    restore_error +
                    "): modules are untouched, but re-create the optimizers before training on");
    }
  }
  Status tensors = Guard("applying the loaded tensors", [&] {
    ApplyTensors(staged, state);
    return OkStatus();
  });
  if (tensors.ok()) return tensors;
  const std::string restore_error = restore();
  return tensors.WithContext(
      restore_error.empty()
          ? "the modules may be partly loaded (optimizers restored)"
          : "the modules may be partly loaded, and restoring an optimizer's previous state "
            "failed too (" +
                restore_error + ")");
}

// The module and tensor part of Apply: nothing here is expected to fail
// (WhyNotApplicable follows its choices).
void ApplyTensors(Staged& staged, State& state) {
  torch::NoGradGuard no_grad;
  // Bytes written behind LibTorch's back count as an in-place change, as
  // copy_ would (autograd then refuses a backward through the old values).
  auto written = [](const torch::Tensor& t) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  };
  // First what talks to a GPU (the step least sure to succeed).
  for (auto& [target, loaded] : staged.into_gpu) {
    internal::CopyThroughPinned(loaded, target);
    written(target);
  }
  std::vector<CopyJob> memcpys;  // contiguous CPU parameters: copied on every core
  for (auto& [target, loaded] : staged.module_tensors) {
    // Into the module's own memory where it already has the right place:
    // no fresh allocation, and the parameter keeps its storage.
    if (CopiesInto(target, loaded)) {
      if (MemcpysInto(target, loaded)) {
        memcpys.push_back({static_cast<char*>(target.data_ptr()),
                           static_cast<const char*>(loaded.data_ptr()), target.nbytes()});
        written(target);
      } else {
        target.copy_(loaded);
      }
    } else {
      target.set_data(loaded);
    }
  }
  ParallelCopy(memcpys);
  // As torch::load: the caller's tensor stays the same tensor (an optimizer
  // holding it sees the loaded values) and keeps requires_grad.
  for (auto& [target, loaded] : staged.tensors) {
    if (Rebinds(*target))
      *target = loaded;
    else if (TakesInPlace(*target, loaded))
      target->set_(loaded);
    else
      target->set_data(loaded);
  }
  state.metadata = std::move(staged.metadata);
}

}  // namespace

// ------------------------------------------------------------- Checkpointer

namespace {

// How long rank 0's Open waits for the store's writer lock and the save
// lock (a holder that just went may take a moment to let go).
std::chrono::milliseconds LockWait(const CheckpointerOptions& options) {
  return std::min<std::chrono::milliseconds>(options.timeout, std::chrono::seconds(30));
}

// "<16 hex of the job id's hash>.c<n>": the n-th Checkpointer of the job
// this rank opened on the coordination channel (the store for file-based
// modes, counted in this process; the c10d store for kStore, counted in the
// store itself, whose server can outlive a trainer's client objects, and an
// object's address, which may come again once it is freed, differently on
// each rank, is no name for it); a job of one rank: c0, nobody to agree
// with. Two Checkpointers of one job (model and EMA, on one store or two
// sharing a TCPStore) never read each other's records or keys, and one
// opened on some ranks only (rank 0's "best model" store) shifts no other
// channel's count. Tells `coordinator` (Opened); a file-based count is kept
// only if that succeeds.
Result<std::string> OpenScope(const RankInfo& rank, const CheckpointerOptions& options,
                              const std::string& store_uri, Coordinator& coordinator) {
  const std::string job = HashBytes(rank.job_id).Hex().substr(0, 16);
  auto opened = [&](const std::string& scope) -> Result<std::string> {
    CKPTIO_RETURN_IF_ERROR(coordinator.Opened(scope, LockWait(options)));
    return scope;
  };
  if (rank.world_size == 1) return opened(job + ".c0");
  if (options.wait == WaitMode::kStore) {
    try {
      const int64_t n =
          options.c10d_store->add("ckptio/opened/" + job + "/" + std::to_string(rank.rank), 1);
      return opened(job + ".c" + std::to_string(n));
    } catch (const std::exception& e) {
      const std::string text = e.what();  // (LibTorch appends a stack trace)
      return Status(Code::kUnavailable, "c10d store: counting this rank's Checkpointers: " +
                                            text.substr(0, text.find('\n')));
    }
  }
  static std::mutex mu;
  static auto* counts = new std::map<std::string, uint64_t>;  // never destroyed
  const std::string key = std::to_string(rank.rank) + '\0' + job + '\0' + store_uri;
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(mu);
    n = ++(*counts)[key];
  }
  // Only rank 0's Opened can fail (taking the save lock), and its writer
  // lock keeps any other Open of this key out until this one returns.
  auto scope = opened(job + ".c" + std::to_string(n));
  if (!scope.ok()) {
    std::lock_guard<std::mutex> lock(mu);
    --(*counts)[key];
  }
  return scope;
}

}  // namespace

Result<std::unique_ptr<Checkpointer>> Checkpointer::Open(std::string_view uri, const RankInfo& rank,
                                                         CheckpointerOptions options) {
  CKPTIO_RETURN_IF_ERROR(rank.Validate());
  // (A wait of 0 ms would end before any rank could answer; LibTorch's
  // c10d takes 0 for "wait for ever".)
  if (options.timeout.count() <= 0)
    return Status(Code::kInvalidArgument,
                  "CheckpointerOptions::timeout is " + std::to_string(options.timeout.count()) +
                      " ms; it bounds every wait, so it must be at least 1 ms");
  std::unique_ptr<Checkpointer> c(new Checkpointer());
  c->rank_ = rank;
  c->options_ = std::move(options);
  std::shared_ptr<StorageBackend> shared = c->options_.backend;
  if (!shared) {
    CKPTIO_ASSIGN_OR_RETURN(auto backend, BuiltinBackends().Open(uri));
    shared = std::move(backend);
  }
  c->store_ = std::make_unique<Store>(shared);
  if (c->options_.wait == WaitMode::kStore) {
    if (!c->options_.c10d_store)
      return Status(Code::kInvalidArgument,
                    "wait mode c10d-store needs CheckpointerOptions::c10d_store (the trainer's "
                    "TCPStore)");
    CKPTIO_ASSIGN_OR_RETURN(c->coordinator_, NewC10dCoordinator(c->options_.c10d_store, rank));
  } else {
    CKPTIO_ASSIGN_OR_RETURN(c->coordinator_, NewFileCoordinator(shared, rank, c->options_.wait));
  }
  if (rank.rank == 0) {
    WriterOptions wo;
    wo.keep_last = c->options_.keep_last;
    wo.chunk_size = c->options_.chunk_size;
    wo.world_size = rank.world_size;
    wo.saving_rank = 0;
    wo.lock_wait = LockWait(c->options_);
    CKPTIO_ASSIGN_OR_RETURN(c->writer_, c->store_->OpenWriter(wo));
  }
  // Last: an Open that fails counts on no rank.
  CKPTIO_ASSIGN_OR_RETURN(c->scope_, OpenScope(rank, c->options_, shared->Uri(), *c->coordinator_));
  return c;
}

// The staging memory and the thread of SaveAsync.
struct internal::AsyncSave {
  torch::Tensor staging;  // uint8; reused from save to save
  std::thread worker;
  int64_t step = 0;
  Status result;            // the worker's outcome, read after join
  bool unreported = false;  // result not yet returned by a later call
  bool warned = false;      // the "too large for staging" warning, once
  // Bytes of the optimizers' archives at the last save that made them (a
  // lower bound when they did not fit): a save whose tensors and archives
  // would not fit again is synchronous before anything is copied.
  uint64_t archive_bytes = 0;
};

Checkpointer::Checkpointer() : async_(std::make_unique<internal::AsyncSave>()) {}

Checkpointer::~Checkpointer() {
  if (async_->worker.joinable()) async_->worker.join();
}

Status Checkpointer::FinishAsync() {
  if (async_->worker.joinable()) async_->worker.join();
  if (!async_->unreported) return OkStatus();
  async_->unreported = false;
  return async_->result.WithContext("the asynchronous save of step " +
                                    std::to_string(async_->step) + " failed");
}

Status Checkpointer::ConfirmCommitted(int64_t step) {
  // A signal alone is never trusted: the step's manifest must open.
  auto reader = store_->OpenStep(step);
  if (reader.ok()) return OkStatus();
  return reader.status().WithContext("rank 0 reported step " + std::to_string(step) +
                                     " committed, but it does not open here");
}

std::string Checkpointer::NextAttempt() { return scope_ + "." + std::to_string(++save_seq_); }

namespace {
// The decisions of a striped save: rank 0's go-ahead, and rank r's receipt.
std::string StripeGoName(const std::string& attempt) { return "stripe-go-" + attempt; }
std::string StripeReceiptName(const std::string& attempt, int r) {
  return "stripe-" + attempt + "-" + std::to_string(r);
}

// A rank's wait for rank 0's go-ahead to a striped save, in slices with a
// poll of the save between them, so that rank 0's death (file-lock mode) or
// failure, or its going on past this save, ends the wait at once rather
// than at the deadline.
Result<std::string> WaitForGo(Coordinator& c, int64_t step, const std::string& attempt,
                              std::chrono::milliseconds timeout) {
  constexpr std::chrono::milliseconds kSlice{500};
  const auto deadline = DeadlineAfter(timeout);
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      return Status(Code::kDeadlineExceeded, "timed out after " + std::to_string(timeout.count()) +
                                                 " ms (wait mode " +
                                                 std::string(WaitModeName(c.mode())) + ")");
    auto go = c.WaitFor(StripeGoName(attempt), std::min(left, kSlice));
    const Code code = go.status().code();
    if (go.ok() || (code != Code::kDeadlineExceeded && code != Code::kAborted)) return go;
    // The save's own account first: rank 0's failure, or its death (file
    // lock, which WaitFor also reports) in words of this step.
    auto polled = c.PollSaved(step, attempt);
    if (!polled.ok() && !c.Transient(polled.status())) return polled.status();
    if (code == Code::kAborted) return go;
  }
}
}  // namespace

Status Checkpointer::PublishDecision(const std::string& name, const std::string& payload) {
  CKPTIO_RETURN_IF_ERROR(coordinator_->Publish(name, payload));
  if (options_.stripe) decisions_.push_back(name);  // only a striped save retracts them
  return OkStatus();
}

// Every rank's receipt for `attempt` means every rank read the go-ahead and
// returned from each load it began before this save (each rank makes the
// same calls in the same order). Best effort: a record left behind only
// takes space.
void Checkpointer::RetractStripeRecords(const std::string& attempt) {
  (void)coordinator_->Retract(StripeGoName(attempt));
  for (int r = 1; r < rank_.world_size; ++r)
    (void)coordinator_->Retract(StripeReceiptName(attempt, r));
  for (const auto& name : decisions_) (void)coordinator_->Retract(name);
  decisions_.clear();
}

Status Checkpointer::Abandon(int64_t step, const std::string& attempt, Status error) {
  if (rank_.world_size == 1) return error;
  if (rank_.rank == 0) {
    if (options_.stripe) (void)coordinator_->Publish(StripeGoName(attempt), ErrorPayload(error));
    (void)coordinator_->EndSave(step, attempt, error);
  } else if (options_.stripe) {  // rank 0 waits for this rank's part
    (void)coordinator_->Publish(StripeReceiptName(attempt, rank_.rank), ErrorPayload(error));
  }
  return error;
}

Status Checkpointer::Save(int64_t step, const State& state) {
  const std::string attempt = NextAttempt();  // first: every rank counts every call
  Status previous = Ready(FinishAsync(), state, /*saving=*/true);
  if (!previous.ok()) return Abandon(step, attempt, previous);
  return SaveNow(step, attempt, PlanFor(state));
}

SavePlan Checkpointer::PlanFor(const State& state) const {
  if (options_.stripe && rank_.world_size > 1)
    return StripePart(Plan(state), rank_.rank, rank_.world_size);
  return rank_.rank == 0 ? Plan(state) : SavePlan();
}

std::future<Status> Checkpointer::SaveAsync(int64_t step, const State& state) {
  const std::string attempt = NextAttempt();  // first: every rank counts every call
  // Shared with the worker thread, and kept here should it fail to start.
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  Status previous = FinishAsync();
  if (!previous.ok()) {
    promise->set_value(Abandon(step, attempt, previous));
    return future;
  }
  internal::AsyncSave& as = *async_;
  as.step = step;
  // A save that ends here (an error, or too large to stage) is reported
  // like one that ends in the background: on the future and the next call.
  auto done_now = [&](Status s) {
    as.result = s;
    as.unreported = !s.ok();
    promise->set_value(std::move(s));
    return std::move(future);
  };
  if (Status names = CheckNames(state, /*saving=*/true); !names.ok())
    return done_now(Abandon(step, attempt, names));
  SavePlan plan = PlanFor(state);
  {
    // Staging: every tensor copied, 64-byte aligned, into one reused buffer.
    constexpr uint64_t kAlign = 64;
    uint64_t need = 0;
    bool cuda = false;
    for (const auto& to : plan.tensor_objects)
      for (const auto& [name, t] : to.tensors) {
        if (!t.defined()) continue;
        need = (need + kAlign - 1) / kAlign * kAlign + t.nbytes();
        cuda = cuda || t.is_cuda();
      }
    // Too large to stage (`what` says how much): the call saves synchronously.
    auto save_now = [&](const std::string& what) {
      if (!as.warned)
        std::cerr << "ckptio: warning: SaveAsync of step " << step << " needs " << what
                  << ", over max_staging_bytes (" << options_.max_staging_bytes
                  << "): saving synchronously; raise CheckpointerOptions::max_staging_bytes to "
                     "save in the background\n";
      as.warned = true;
      return done_now(SaveNow(step, attempt, plan));
    };
    if (need > options_.max_staging_bytes)
      return save_now(std::to_string(need) + " bytes of tensor staging");
    // The tensors' buffer is kept from save to save: the archives get what
    // it leaves, even when this save stages fewer tensors, or none.
    const uint64_t tensor_staging =
        std::max<uint64_t>(need, as.staging.defined() ? as.staging.numel() : 0);
    const std::string tensor_bytes = std::to_string(tensor_staging) + " bytes of tensor staging";
    if (!plan.optimizers.empty() && as.archive_bytes > options_.max_staging_bytes - tensor_staging)
      return save_now(tensor_bytes + " and " + std::to_string(as.archive_bytes) +
                      " bytes of optimizer archives (as at the last save)");
    uint64_t archived = 0;
    bool archives_too_large = false;
    Status staged = Guard("staging the state of step " + std::to_string(step), [&]() -> Status {
      const bool pinned = cuda && torch::cuda::is_available();
      if (need > 0 && (!as.staging.defined() || static_cast<uint64_t>(as.staging.numel()) < need ||
                       (pinned && !as.staging.is_pinned()))) {
        as.staging = torch::Tensor();  // freed first: never the old and the new buffer at once
        as.staging =
            torch::empty({static_cast<int64_t>(std::max<uint64_t>(need, 1))},
                         torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(pinned));
      }
      char* base = need > 0 ? static_cast<char*>(as.staging.data_ptr()) : nullptr;
      uint64_t off = 0;
      torch::NoGradGuard no_grad;
      std::vector<CopyJob> memcpys;  // contiguous CPU tensors: copied on every core
      for (auto& to : plan.tensor_objects)
        for (auto& [name, t] : to.tensors) {
          if (!t.defined()) continue;
          off = (off + kAlign - 1) / kAlign * kAlign;
          torch::Tensor copy = torch::from_blob(base + off, t.sizes(),
                                                torch::TensorOptions().dtype(t.scalar_type()));
          if (t.device().is_cpu() && t.is_contiguous())
            memcpys.push_back({base + off, static_cast<const char*>(t.data_ptr()), t.nbytes()});
          else
            copy.copy_(t.detach());  // from the GPU (into pinned memory), or strided
          off += t.nbytes();
          t = copy;
        }
      ParallelCopy(memcpys);
      // The optimizers' archives take what the staging buffer left.
      const uint64_t held = as.staging.defined() ? static_cast<uint64_t>(as.staging.numel()) : 0;
      const uint64_t room =
          options_.max_staging_bytes > held ? options_.max_staging_bytes - held : 0;
      for (const auto& [object, optimizer] : plan.optimizers) {
        auto& pieces = plan.archives.emplace_back(SavePlan::Archive{object, {}}).pieces;
        Status archive = ArchiveOptimizer(*optimizer, object, [&](const void* d, size_t n) {
          archived += n;
          if (archived > room) {  // nothing more is kept (LibTorch writes on regardless)
            archives_too_large = true;
            return Status(Code::kResourceExhausted, "over max_staging_bytes");
          }
          // Small writes (zip headers) share a piece; a record's data is one.
          constexpr size_t kLarge = 64 << 10;
          if (n < kLarge && !pieces.empty() && pieces.back().size() < kLarge)
            pieces.back().append(static_cast<const char*>(d), n);
          else
            pieces.emplace_back(static_cast<const char*>(d), n);
          return OkStatus();
        });
        if (archives_too_large) {
          plan.archives.clear();
          break;
        }
        CKPTIO_RETURN_IF_ERROR(archive);
      }
      as.archive_bytes = archived;
      if (!archives_too_large) plan.optimizers.clear();
      return OkStatus();
    });
    if (!staged.ok()) return done_now(Abandon(step, attempt, staged));
    if (archives_too_large)  // the staged tensors serve the synchronous save
      return save_now(tensor_bytes + " and at least " + std::to_string(archived) +
                      " bytes of optimizer archives");
  }
  auto staged = std::make_shared<const SavePlan>(std::move(plan));
  try {
    as.worker = std::thread([this, step, attempt, staged, promise] {
      Status s = SaveNow(step, attempt, *staged);
      async_->result = s;
      async_->unreported = !s.ok();
      promise->set_value(std::move(s));
    });
  } catch (const std::exception& e) {  // std::system_error (RLIMIT_NPROC), std::bad_alloc
    std::cerr << "ckptio: warning: SaveAsync of step " << step << " could not start its thread ("
              << e.what() << "): saving synchronously\n";
    return done_now(SaveNow(step, attempt, *staged));
  }
  return future;
}

Status Checkpointer::SaveNow(int64_t step, const std::string& attempt, const SavePlan& plan) {
  if (options_.stripe && rank_.world_size > 1) return SaveStripe(step, attempt, plan);
  const std::string what = rank_.ToString() + ": save of step " + std::to_string(step);
  if (rank_.rank != 0) {
    CKPTIO_RETURN_IF_ERROR(
        coordinator_->WaitSaved(step, attempt, options_.timeout).WithContext(what));
    return ConfirmCommitted(step).WithContext(what);
  }
  // A job of one rank has nobody to tell.
  const bool coordinate = rank_.world_size > 1;
  if (coordinate) {
    Status began = coordinator_->BeginSave(step, attempt, options_.timeout);
    if (!began.ok()) return Abandon(step, attempt, began.WithContext(what));
  }
  Status outcome = [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(auto pending, writer_->Begin(step));
    CKPTIO_RETURN_IF_ERROR(WritePlan(*pending, plan));
    if (coordinate) CKPTIO_RETURN_IF_ERROR(pending->SetMetadata(kSaveAttemptKey, attempt));
    auto info = pending->Commit();
    if (!info.ok()) return info.status();
    if (!info->retention.ok())
      std::cerr << "ckptio: warning: " << info->retention << "\n";  // the save stands
    return OkStatus();
  }();
  Status published = coordinate ? coordinator_->EndSave(step, attempt, outcome) : OkStatus();
  CKPTIO_RETURN_IF_ERROR(outcome.WithContext(what));
  return published.WithContext(what + " committed, but telling the other ranks failed");
}

// A striped save, in order:
//   1. rank 0 takes the save (coordination), begins the step (clearing a
//      torn attempt at it) and publishes "go" (or its error);
//   2. every other rank writes its part objects into the step, each
//      committed durably, and publishes its receipt (or its error);
//   3. rank 0 writes its own part, the optimizers and the metadata, adds
//      every receipt (each part object must be there, with its size), and
//      commits; the other ranks return once the step is committed.
// The records are named by the save's attempt, so a retry of the same step
// never reads an earlier attempt's receipts.
Status Checkpointer::SaveStripe(int64_t step, const std::string& attempt, const SavePlan& plan) {
  const std::string what = rank_.ToString() + ": striped save of step " + std::to_string(step);
  const std::string go = StripeGoName(attempt);
  auto receipt_of = [&](int r) { return StripeReceiptName(attempt, r); };
  if (rank_.rank != 0) {
    auto started = WaitForGo(*coordinator_, step, attempt, options_.timeout);
    if (!started.ok())  // rank 0, late, must not wait for this rank's part in turn
      return Abandon(step, attempt,
                     started.status().WithContext(what + ": waiting for rank 0 to begin the step"));
    if (auto e = PayloadError(*started))
      return e->WithContext(what + ": rank 0 could not begin the step");
    Status wrote = [&]() -> Status {
      CKPTIO_ASSIGN_OR_RETURN(auto stripe,
                              store_->BeginStripe(step, rank_.rank, options_.chunk_size));
      for (const auto& to : plan.tensor_objects)
        CKPTIO_RETURN_IF_ERROR(Guard("saving " + to.item, [&] {
          return WriteSafetensors(*stripe, to.object, to.tensors, to.devices);
        }));
      CKPTIO_ASSIGN_OR_RETURN(StripeReceipt receipt, stripe->Finish());
      return coordinator_->Publish(receipt_of(rank_.rank), SerializeStripeReceipt(receipt));
    }();
    if (!wrote.ok()) {
      (void)coordinator_->Publish(receipt_of(rank_.rank), ErrorPayload(wrote));
      return wrote.WithContext(what);
    }
    CKPTIO_RETURN_IF_ERROR(
        coordinator_->WaitSaved(step, attempt, options_.timeout).WithContext(what));
    return ConfirmCommitted(step).WithContext(what);
  }
  Status began = coordinator_->BeginSave(step, attempt, options_.timeout);
  if (!began.ok()) return Abandon(step, attempt, began.WithContext(what));
  bool every_receipt = false;
  Status outcome = [&]() -> Status {
    auto pending = writer_->Begin(step);
    CKPTIO_RETURN_IF_ERROR(
        coordinator_->Publish(go, pending.ok() ? "ok" : ErrorPayload(pending.status())));
    if (!pending.ok()) return pending.status();
    (*pending)->ExpectStripes();  // abandoned, the step is cleared whole
    // Every receipt is collected even when a part failed, so that no rank
    // is still writing into the step when it is abandoned (the parts
    // received are deleted with it), and a retry starts clean.
    Status first = WritePlan(**pending, plan);
    if (first.ok()) first = (*pending)->SetMetadata(kSaveAttemptKey, attempt);
    std::set<std::string> expected = plan.stripes;
    const auto deadline = DeadlineAfter(options_.timeout);
    every_receipt = true;
    for (int r = 1; r < rank_.world_size; ++r) {
      const std::string whose = "rank " + std::to_string(r) + "'s stripe";
      Status s = [&]() -> Status {
        const auto left = std::max(std::chrono::milliseconds(1),
                                   std::chrono::duration_cast<std::chrono::milliseconds>(
                                       deadline - std::chrono::steady_clock::now()));
        auto payload = coordinator_->WaitFor(receipt_of(r), left);
        if (!payload.ok()) {
          every_receipt = false;
          // (The wait's own message gives what was left of the deadline:
          // 1 ms for a rank after one that came late.)
          if (payload.status().code() == Code::kDeadlineExceeded)
            return Status(Code::kDeadlineExceeded,
                          "timed out waiting for " + whose + ": none came within " +
                              std::to_string(options_.timeout.count()) +
                              " ms (CheckpointerOptions::timeout) of rank 0 writing its own "
                              "part; is rank " +
                              std::to_string(r) + " alive, and saving step " +
                              std::to_string(step) + "?");
          return payload.status().WithContext("waiting for " + whose);
        }
        if (auto e = PayloadError(*payload)) return e->WithContext(whose + " failed");
        CKPTIO_ASSIGN_OR_RETURN(StripeReceipt receipt, ParseStripeReceipt(*payload, whose));
        if (receipt.rank != r || receipt.step != step)
          return Status(Code::kDataLoss, whose + ": the receipt is rank " +
                                             std::to_string(receipt.rank) + "'s, for step " +
                                             std::to_string(receipt.step));
        // Added first, so that the part is deleted with the step if refused.
        CKPTIO_RETURN_IF_ERROR((*pending)->AddStripe(receipt));
        CKPTIO_RETURN_IF_ERROR(CheckStripeTensors(plan, receipt, r));
        for (const auto& o : receipt.objects)
          if (expected.erase(o.name) == 0)
            return Status(Code::kInvalidArgument,
                          whose + " holds " + o.name +
                              ", which its part does not name: do all ranks save the same state?");
        return OkStatus();
      }();
      if (first.ok()) first = s;
    }
    CKPTIO_RETURN_IF_ERROR(first);
    if (!expected.empty())
      return Status(Code::kInvalidArgument,
                    "no rank delivered " + *expected.begin() +
                        ": do all ranks save the same state with stripe on?");
    auto info = (*pending)->Commit();
    if (!info.ok()) return info.status();
    if (!info->retention.ok()) std::cerr << "ckptio: warning: " << info->retention << "\n";
    return OkStatus();
  }();
  Status published = coordinator_->EndSave(step, attempt, outcome);
  if (every_receipt) RetractStripeRecords(attempt);
  CKPTIO_RETURN_IF_ERROR(outcome.WithContext(what));
  return published.WithContext(what + " committed, but telling the other ranks failed");
}

Result<bool> Checkpointer::Ticket::Poll() {
  if (!resolved_) {
    auto r = owner_->coordinator_->PollSaved(step_, attempt_);
    const bool before_deadline = std::chrono::steady_clock::now() < deadline_;
    if (!r.ok() && owner_->coordinator_->Transient(r.status()) && before_deadline) return false;
    if (r.ok() && !*r) {
      if (before_deadline) return false;
      r = owner_->coordinator_->SaveTimedOut(step_, owner_->options_.timeout);
    }
    resolved_ = true;
    done_ = r.ok() ? owner_->ConfirmCommitted(step_) : r.status();
  }
  if (!done_.ok()) return done_;
  return true;
}

Status Checkpointer::Ticket::Wait() {
  if (!resolved_) {
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline_ - std::chrono::steady_clock::now()));
    Status s = owner_->coordinator_->WaitSaved(step_, attempt_, left);
    if (s.code() == Code::kDeadlineExceeded)
      s = owner_->coordinator_->SaveTimedOut(step_, owner_->options_.timeout);
    if (s.ok()) s = owner_->ConfirmCommitted(step_);
    resolved_ = true;
    done_ = s;
  }
  return done_;
}

Result<Checkpointer::Ticket> Checkpointer::SaveNonBlocking(int64_t step, const State& state) {
  const std::string attempt = NextAttempt();  // first: every rank counts every call
  Status previous = Ready(FinishAsync(), state, /*saving=*/true);
  if (!previous.ok()) return Abandon(step, attempt, previous);
  if (options_.stripe && rank_.world_size > 1)
    return Status(Code::kInvalidArgument,
                  "SaveNonBlocking does not stripe (every rank writes its part of a striped "
                  "save); use SaveAsync, whose future resolves at the commit");
  Ticket t;
  t.owner_ = this;
  t.step_ = step;
  t.attempt_ = attempt;
  t.deadline_ = DeadlineAfter(options_.timeout);
  if (rank_.rank == 0) {
    t.done_ = SaveNow(step, attempt, PlanFor(state));
    t.resolved_ = true;
  }
  return t;
}

namespace {
// `replace`: a reason cut inside a UTF-8 sequence must not throw.
std::string DecisionText(const json& decision) {
  return decision.dump(-1, ' ', false, json::error_handler_t::replace);
}
}  // namespace

// Rank 0 picks the step (newest that verifies, or the one asked for) and
// publishes it; every rank gets the same answer, errors included. Rank 0
// keeps the step it verified in *verified, so the load reads it only once.
Result<std::optional<LoadResult>> Checkpointer::Decide(const std::string& name,
                                                       const LoadOptions& options,
                                                       std::unique_ptr<OpenedStep>* verified) {
  json decision;
  if (rank_.rank == 0) {
    decision = [&]() -> json {
      std::vector<int64_t> candidates;
      if (options.step) {
        candidates.push_back(*options.step);
      } else {
        // Manifests are read (and checked) once, by OpenStep below.
        auto steps = store_->ListStepsWithManifest();
        if (!steps.ok()) {
          if (steps.status().code() == Code::kNotFound) return {{"none", true}};
          return {{"code", static_cast<int>(steps.status().code())},
                  {"message", steps.status().message()}};
        }
        candidates.assign(steps->rbegin(), steps->rend());
        if (candidates.empty()) return {{"none", true}};
      }
      json skipped = json::array();
      for (int64_t step : candidates) {
        auto opened = OpenVerified(*store_, step);
        if (opened.ok()) {
          *verified = std::move(*opened);
          return {{"step", step}, {"skipped", skipped}};
        }
        const Status& v = opened.status();
        if (v.code() != Code::kDataLoss || options.step)
          return {{"code", static_cast<int>(v.code())}, {"message", v.message()}};
        // The decision travels as one small record: keep it bounded (the
        // first 50 skipped steps, 300 bytes of reason each).
        if (skipped.size() < 50) skipped.push_back({step, v.message().substr(0, 300)});
      }
      return {{"code", static_cast<int>(Code::kDataLoss)},
              {"message", "no checkpoint in " + store_->uri() + " verifies; newest problem: " +
                              skipped.front()[1].get<std::string>()}};
    }();
    if (rank_.world_size > 1) CKPTIO_RETURN_IF_ERROR(PublishDecision(name, DecisionText(decision)));
  } else {
    CKPTIO_ASSIGN_OR_RETURN(std::string payload, coordinator_->WaitFor(name, options_.timeout));
    decision = json::parse(payload, nullptr, /*allow_exceptions=*/false);
    if (decision.is_discarded())
      return Status(Code::kDataLoss, "rank 0's load decision is not valid JSON");
  }
  try {
    if (decision.contains("none")) return std::optional<LoadResult>();
    if (decision.contains("code"))
      return Status(static_cast<Code>(decision["code"].get<int>()),
                    decision["message"].get<std::string>());
    LoadResult r;
    r.step = decision["step"].get<int64_t>();
    for (const auto& s : decision["skipped"])
      r.skipped.emplace_back(s[0].get<int64_t>(), s[1].get<std::string>());
    return std::optional<LoadResult>(r);
  } catch (const json::exception& e) {
    return Status(Code::kDataLoss, std::string("rank 0's load decision is malformed: ") + e.what());
  }
}

Result<std::optional<LoadResult>> Checkpointer::Load(State& state, const LoadOptions& options) {
  const std::string what = rank_.ToString() + ": load";
  // Named first: every rank counts every call, whatever happens next.
  const std::string decision = scope_ + "-load-" + std::to_string(++load_seq_);
  Status previous = Ready(FinishAsync(), state, /*saving=*/false);
  if (!previous.ok()) {
    if (rank_.rank == 0 && rank_.world_size > 1)  // the others wait for a decision: this one
      (void)PublishDecision(decision, DecisionText({{"code", static_cast<int>(previous.code())},
                                                    {"message", previous.message()}}));
    return previous;
  }
  std::unique_ptr<OpenedStep> opened;
  auto decided = Decide(decision, options, &opened);
  if (!decided.ok()) return decided.status().WithContext(what);
  if (!decided->has_value()) return decided;
  const LoadResult& r = **decided;
  for (const auto& [step, why] : r.skipped)
    std::cerr << "ckptio: WARNING: " << rank_.ToString() << ": step " << step
              << " failed verification and is skipped; loading step " << r.step << " instead ("
              << why << ")\n";
  // Not rank 0 (which holds the step open): the step rank 0 chose and
  // verified can be gone before this rank reads it, and this rank may not
  // pick another.
  auto gone = [&]() {
    return Status(Code::kNotFound,
                  what + ": step " + std::to_string(r.step) + " of " + store_->uri() +
                      ", which rank 0 chose and verified, was removed before this rank read "
                      "it: rank 0 went on to a save whose retention (keep_last) or a gc "
                      "retired it. Have a collective (a barrier, or a training step) between "
                      "the load and the next save on every rank, or raise keep_last");
  };
  if (!opened) {
    auto reader = store_->OpenStep(r.step);
    if (!reader.ok())
      return reader.status().code() == Code::kNotFound ? gone() : reader.status().WithContext(what);
    opened = std::make_unique<OpenedStep>();
    opened->reader = std::move(*reader);
  }
  Staged staged;
  Status s = Guard(what, [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(staged, Stage(*opened, state, options.map_location, rank_));
    return OkStatus();
  });
  if (!s.ok() && s.code() == Code::kNotFound && rank_.rank != 0 &&
      store_->OpenStep(r.step).status().code() == Code::kNotFound)
    return gone();
  if (!s.ok()) return s.WithContext(what + " of step " + std::to_string(r.step));
  CKPTIO_RETURN_IF_ERROR(
      Apply(staged, state).WithContext(what + " of step " + std::to_string(r.step)));
  return decided;
}

// ------------------------------------------------------------- one-liners

namespace {

RankInfo Single() {
  RankInfo r;
  r.source = "single";
  return r;
}

Status SaveOne(StateItem item, std::string_view uri) {
  CKPTIO_ASSIGN_OR_RETURN(auto ckpt, Checkpointer::Open(uri, Single()));
  // After the newest step that has a manifest, not after LATEST: LATEST can
  // lag a committed step (a crash before it moved) or be unreadable, and
  // saving at a taken step fails every time.
  int64_t step = 0;
  auto steps = ckpt->store().ListStepsWithManifest();
  if (steps.ok() && !steps->empty()) {
    step = steps->back() + 1;
  } else if (!steps.ok() && steps.status().code() != Code::kNotFound) {
    return steps.status().WithContext("finding the next step of " + std::string(uri));
  }
  auto latest = ckpt->store().ReadLatest();
  if (latest.ok() && latest->has_value()) step = std::max(step, (*latest)->step + 1);
  State state;
  state.items.push_back(std::move(item));
  return ckpt->Save(step, state);
}

Status LoadOne(StateItem item, std::string_view uri, torch::Device device) {
  // Readers take no lock: open the store without a writer.
  CKPTIO_ASSIGN_OR_RETURN(auto store, OpenStore(uri));
  State state;
  state.items.push_back(std::move(item));
  // The newest step that verifies.
  auto steps = store->ListStepsWithManifest();
  if (!steps.ok()) {
    if (steps.status().code() == Code::kNotFound)
      return Status(Code::kNotFound, "nothing saved in " + store->uri() + " yet");
    return steps.status();
  }
  Status last = Status(Code::kNotFound, "no committed checkpoint in " + store->uri());
  for (auto it = steps->rbegin(); it != steps->rend(); ++it) {
    auto opened = OpenVerified(*store, *it);
    if (opened.status().code() == Code::kDataLoss) {
      std::cerr << "ckptio: WARNING: step " << *it << " failed verification and is skipped ("
                << opened.status().message() << ")\n";
      last = opened.status();
      continue;
    }
    CKPTIO_RETURN_IF_ERROR(opened.status());
    MapLocation map = MapLocation::To(device);
    Staged staged;
    CKPTIO_RETURN_IF_ERROR(Guard("load from " + store->uri(), [&]() -> Status {
      CKPTIO_ASSIGN_OR_RETURN(staged, Stage(**opened, state, map, Single()));
      return OkStatus();
    }));
    return Apply(staged, state);
  }
  return last;
}

}  // namespace

Status save(torch::nn::Module& module, std::string_view uri) {
  return SaveOne(StateItem("value", module), uri);
}
Status save(torch::optim::Optimizer& optimizer, std::string_view uri) {
  return SaveOne(StateItem("value", optimizer), uri);
}
Status save(torch::Tensor& tensor, std::string_view uri) {
  return SaveOne(StateItem("value", tensor), uri);
}
Status load(torch::nn::Module& module, std::string_view uri, torch::Device device) {
  return LoadOne(StateItem("value", module), uri, device);
}
Status load(torch::optim::Optimizer& optimizer, std::string_view uri, torch::Device device) {
  return LoadOne(StateItem("value", optimizer), uri, device);
}
Status load(torch::optim::Optimizer& optimizer, std::string_view uri) {
  return load(optimizer, uri, torch::Device(DeviceOf(optimizer)));
}
Status load(torch::Tensor& tensor, std::string_view uri, torch::Device device) {
  return LoadOne(StateItem("value", tensor), uri, device);
}

}  // namespace ckptio
