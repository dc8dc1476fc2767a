// Load staging: the verified bytes of a step made into the tensors,
// optimizer archives and metadata a load will apply, each checked first.
#include "torch/load_stage.h"

#include <algorithm>
#include <optional>
#include <set>

#include "torch/libtorch_errors.h"
#include "torch/load_apply.h"
#include "torch/pinned_copy.h"
#include "torch/state_items.h"
#include "torch/tensors.h"

namespace ckptio::internal {

Result<std::optional<ChosenStep>> ChooseStep(Store& store, std::optional<int64_t> step) {
  // Each candidate's objects viewed (and verified) once, kept for the load.
  std::unique_ptr<OpenedStep> opened;
  CKPTIO_ASSIGN_OR_RETURN(
      auto choice, store.ChooseStep(step, [&opened](std::unique_ptr<CheckpointReader> reader) {
        opened = std::make_unique<OpenedStep>();
        opened->reader = std::move(reader);
        return opened->ViewAll();
      }));
  if (!choice) return std::optional<ChosenStep>();
  return std::optional<ChosenStep>(ChosenStep{std::move(*choice), std::move(opened)});
}

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

namespace {

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
        return internal::TorchErrorToStatus(
            err,
            where + ": preparing the copy of tensor \"" + name + "\" to " + device.str() +
                " (pinned host memory: free memory or raise ulimit -l; or load with "
                "map_location \"cpu\")",
            Code::kFailedPrecondition);
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

}  // namespace

Result<Staged> Stage(OpenedStep& opened, State& state, const MapLocation& map, const RankInfo& rank,
                     bool other_tensors) {
  CheckpointReader& reader = *opened.reader;
  Staged staged;
  const auto& meta = reader.manifest().metadata;
  auto kind_of = [&](const std::string& name) -> std::string {
    auto it = meta.find(kItemPrefix + name);
    return it == meta.end() ? "" : it->second;
  };
  // The loose tensors: those of tensors.safetensors and its stripe parts
  // (unless that is a module's, one named "tensors"), by name; `taken` once
  // an item of the State takes one; a name in two parts (no writer makes
  // one), the first listed. (Pointers sorted, not a tree of copied names:
  // 10,000 tensors cost a load milliseconds that way.)
  std::vector<const TensorEntry*> loose_saved;
  if (kind_of("tensors") != "module" &&
      (other_tensors || std::any_of(state.items.begin(), state.items.end(), [](const StateItem& i) {
         return i.kind() == StateItem::Kind::kTensor;
       }))) {
    const std::string* object = nullptr;  // entries come object by object
    bool loose_object = false;
    for (const auto& t : reader.manifest().tensors) {
      if (!object || *object != t.object) {
        object = &t.object;
        loose_object = StripeBaseObject(reader.manifest(), t.object) == kTensorsObject;
      }
      if (loose_object) loose_saved.push_back(&t);
    }
    std::stable_sort(loose_saved.begin(), loose_saved.end(),
                     [](const TensorEntry* a, const TensorEntry* b) { return a->name < b->name; });
  }
  std::vector<bool> taken(loose_saved.size());
  auto find_loose = [&](const std::string& name) -> std::optional<size_t> {
    auto it =
        std::lower_bound(loose_saved.begin(), loose_saved.end(), name,
                         [](const TensorEntry* e, const std::string& n) { return e->name < n; });
    if (it == loose_saved.end() || (*it)->name != name) return std::nullopt;
    return static_cast<size_t>(it - loose_saved.begin());
  };
  // The object a module or optimizer item takes; "" when the step has no
  // such item.
  auto object_of = [&](const StateItem& item) -> std::string {
    const std::string kind = kind_of(item.name());
    if (item.kind() == StateItem::Kind::kModule && kind == "module")
      return ModuleObject(item.name());
    if (item.kind() == StateItem::Kind::kOptimizer && kind.rfind("optimizer", 0) == 0)
      return OptimizerObject(item.name());
    return "";
  };
  {
    // Every object the items take (a module's with its stripes' parts, a
    // loose tensor's part), viewed at once first: on an object store each
    // is round trips, and a rank other than 0 has viewed none yet (rank 0,
    // which chose the step, has viewed them all).
    std::set<std::string> bases, parts;
    for (const StateItem& item : state.items) {
      if (std::string object = object_of(item); !object.empty()) bases.insert(std::move(object));
      if (item.kind() != StateItem::Kind::kTensor) continue;
      if (const std::optional<size_t> found = find_loose(item.name()))
        parts.insert(loose_saved[*found]->object);
    }
    if (!loose_saved.empty() && (other_tensors || !parts.empty())) {
      parts.insert(kTensorsObject);
      if (other_tensors) bases.insert(kTensorsObject);
    }
    std::vector<std::string> wanted;
    for (const ObjectEntry& o : reader.manifest().objects)
      if (parts.count(o.name) || bases.count(StripeBaseObject(reader.manifest(), o.name)))
        wanted.push_back(o.name);
    CKPTIO_RETURN_IF_ERROR(opened.ViewAll(wanted));
  }
  std::vector<std::pair<torch::Tensor*, const TensorEntry*>> loose;
  for (StateItem& item : state.items) {
    const std::string& name = item.name();
    const std::string kind = kind_of(name);
    auto missing = [&] {
      return Status(Code::kInvalidArgument,
                    "step " + std::to_string(reader.step()) + " has no " +
                        std::string(item.kind() == StateItem::Kind::kModule      ? "module"
                                    : item.kind() == StateItem::Kind::kOptimizer ? "optimizer"
                                                                                 : "tensor") +
                        " named \"" + name + "\"");
    };
    switch (item.kind()) {
      case StateItem::Kind::kModule: {
        const std::string object = object_of(item);
        if (object.empty()) return missing();
        auto live = item.module_tensors();
        std::vector<StagedTensor> loaded;
        CKPTIO_RETURN_IF_ERROR(Guard("loading module " + name, [&] {
          return StageTensors(opened, object, "module " + name, live, map, rank, &loaded);
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
        const std::string object = object_of(item);
        if (object.empty()) return missing();
        CKPTIO_ASSIGN_OR_RETURN(auto bytes, opened.View(object));
        // The mapping sees the device recorded at save time ("optimizer:<d>"),
        // as for tensors; the optimizer's own where none was recorded.
        const std::string saved = kind.size() > 10 ? kind.substr(10) : DeviceOf(item.optimizer());
        CKPTIO_ASSIGN_OR_RETURN(torch::Device device, map.Resolve(saved, rank));
        staged.optimizers.push_back({name, &item.optimizer(), std::move(bytes), device});
        break;
      }
      case StateItem::Kind::kTensor: {
        // Older checkpoints also list each as ckptio.item.<name> = tensor.
        const std::optional<size_t> found = find_loose(name);
        if (kind == "tensor" && !found)
          return Status(Code::kDataLoss, "step " + std::to_string(reader.step()) + ": tensor \"" +
                                             name + "\" is listed but not stored");
        if (!(kind.empty() || kind == "tensor") || !found) return missing();
        loose.emplace_back(&item.tensor(), loose_saved[*found]);
        taken[*found] = true;
        break;
      }
    }
  }
  if (!loose.empty() || (other_tensors && !loose_saved.empty())) {
    // Loose tensors take the saved shape and dtype, whatever the target
    // held before (like torch::load of a tensor).
    CKPTIO_RETURN_IF_ERROR(opened.View(kTensorsObject).status());
    std::shared_ptr<ObjectView> view;  // of `viewed`: entries come object by object
    const std::string* viewed = nullptr;
    auto load = [&](const TensorEntry& entry) -> Result<torch::Tensor> {
      CKPTIO_ASSIGN_OR_RETURN(torch::Device device, map.Resolve(entry.device, rank));
      if (!viewed || *viewed != entry.object) {
        CKPTIO_ASSIGN_OR_RETURN(view, opened.View(entry.object));
        viewed = &entry.object;
      }
      return TensorFromView(view, entry, device);
    };
    for (const auto& [target, entry] : loose) {
      CKPTIO_ASSIGN_OR_RETURN(torch::Tensor t, load(*entry));
      if (std::string why = WhyNotApplicable(*target, t, /*named=*/true); !why.empty())
        return Status(Code::kInvalidArgument, "tensor \"" + entry->name + "\" " + why);
      staged.tensors.emplace_back(target, t);
    }
    if (other_tensors)
      for (size_t i = 0; i < loose_saved.size(); ++i) {
        if (taken[i]) continue;
        CKPTIO_ASSIGN_OR_RETURN(torch::Tensor t, load(*loose_saved[i]));
        // In name order: each goes at the end.
        staged.other_tensors.emplace_hint(staged.other_tensors.end(), loose_saved[i]->name,
                                          std::move(t));
      }
  }
  for (const auto& [key, value] : meta)
    if (key.rfind(kUserPrefix, 0) == 0) staged.metadata[key.substr(sizeof kUserPrefix - 1)] = value;
  return staged;
}

}  // namespace ckptio::internal
