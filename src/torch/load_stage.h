// Load staging (internal to ckptio_torch): a step opened with every object
// verified once, and everything a load will apply, prepared from it without
// touching the caller's state.
#ifndef CKPTIO_SRC_TORCH_LOAD_STAGE_H_
#define CKPTIO_SRC_TORCH_LOAD_STAGE_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/safetensors.h"
#include "ckptio/torch.h"

namespace ckptio::internal {

// A step opened for loading: each object is viewed (read or mapped, and
// verified) once, however many tensors come from it.
struct OpenedStep {
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

  // Views of `objects` (CheckpointReader::ViewAll: at once where reads are
  // round trips, headers checked too), those not viewed yet.
  Status ViewAll(const std::vector<std::string>& objects) {
    std::vector<std::string> unviewed;
    for (const std::string& o : objects)
      if (!views.count(o)) unviewed.push_back(o);
    if (unviewed.empty()) return OkStatus();
    CKPTIO_ASSIGN_OR_RETURN(auto got, reader->ViewAll(unviewed));
    for (size_t i = 0; i < unviewed.size(); ++i) views.emplace(unviewed[i], std::move(got[i]));
    return OkStatus();
  }
  // Every object: what deciding that a step is good takes.
  Status ViewAll() {
    std::vector<std::string> all;
    for (const ObjectEntry& o : reader->manifest().objects) all.push_back(o.name);
    return ViewAll(all);
  }
};

// The step a load takes (and the newer ones skipped), opened and verified.
struct ChosenStep {
  StepChoice choice;
  std::unique_ptr<OpenedStep> opened;
};
// Store::ChooseStep, the one rule of every load, with each candidate's
// objects viewed and the chosen step's views kept for the load. Used by
// Checkpointer::Load (rank 0's decision) and the one-liner ckptio::load.
Result<std::optional<ChosenStep>> ChooseStep(Store& store, std::optional<int64_t> step);

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
  std::map<std::string, torch::Tensor> other_tensors;  // LoadOptions::other_tensors
  std::map<std::string, std::string> metadata;
};

// Stages what `state` takes from `opened`, changing nothing of it: every
// item found under its kind; a module's tensors verified, each with the
// module's dtype and shape, on the device `map` gives it; an optimizer's
// verified archive and the device its state goes to; the named tensors
// (which take the saved dtype and shape); with `other_tensors`, every other
// named tensor of the step; the user metadata. Refuses what Apply could not
// put in (WhyNotApplicable).
Result<Staged> Stage(OpenedStep& opened, State& state, const MapLocation& map, const RankInfo& rank,
                     bool other_tensors = false);

// "[90, 4]": a shape, for messages.
std::string ShapeStr(const std::vector<int64_t>& s);

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_LOAD_STAGE_H_
