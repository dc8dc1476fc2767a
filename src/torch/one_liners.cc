// The one-line adoption of torch::save / torch::load: ckptio::save commits
// the next step of a single-process store, ckptio::load reads the newest
// step that verifies.
#include <algorithm>

#include "ckptio/backends.h"
#include "ckptio/log.h"
#include "ckptio/torch.h"
#include "torch/libtorch_errors.h"
#include "torch/load_apply.h"
#include "torch/load_stage.h"
#include "torch/state_items.h"

namespace ckptio {

namespace {

using internal::Apply;
using internal::ChooseStep;
using internal::DeviceOf;
using internal::Guard;
using internal::Stage;
using internal::Staged;

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
  // The step Checkpointer::Load would take (ChooseStep); nothing saved yet
  // is an error here, as a missing file is for torch::load.
  CKPTIO_ASSIGN_OR_RETURN(auto chosen, ChooseStep(*store, std::nullopt));
  if (!chosen) return Status(Code::kNotFound, "nothing saved in " + store->uri() + " yet");
  for (const auto& [step, why] : chosen->skipped)
    Log(LogLevel::kWarning, "step " + std::to_string(step) +
                                " failed verification and is skipped; loading step " +
                                std::to_string(chosen->step) + " instead (" + why + ")");
  MapLocation map = MapLocation::To(device);
  Staged staged;
  CKPTIO_RETURN_IF_ERROR(Guard("load from " + store->uri(), [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(staged, Stage(*chosen->opened, state, map, Single()));
    return OkStatus();
  }));
  return Apply(staged, state);
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
