// The one-line adoption of torch::save / torch::load: ckptio::save commits
// the next step of a single-process store, ckptio::load reads the newest
// step that verifies (of a State: also the Python package's one-liners).
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

State Of(StateItem item) {
  State state;
  state.items.push_back(std::move(item));
  return state;
}

}  // namespace

Status save(const State& state, std::string_view uri) {
  CKPTIO_ASSIGN_OR_RETURN(auto ckpt, Checkpointer::Open(uri, Single()));
  CKPTIO_ASSIGN_OR_RETURN(int64_t step, ckpt->store().NextStep());
  return ckpt->Save(step, state);
}

Result<LoadResult> load(State& state, std::string_view uri, const LoadOptions& options) {
  // Readers take no lock: open the store without a writer.
  CKPTIO_ASSIGN_OR_RETURN(auto store, OpenStore(uri));
  // The step Checkpointer::Load would take (ChooseStep); nothing saved yet
  // is an error here, as a missing file is for torch::load.
  CKPTIO_ASSIGN_OR_RETURN(auto chosen, ChooseStep(*store, options.step));
  if (!chosen) return Status(Code::kNotFound, "nothing saved in " + store->uri() + " yet");
  LoadResult result;
  result.step = chosen->choice.step;
  result.skipped = std::move(chosen->choice.skipped);
  for (const auto& [step, why] : result.skipped)
    Log(LogLevel::kWarning, SkippedStepWarning(step, chosen->choice.step, why));
  const std::string what =
      "load of step " + std::to_string(chosen->choice.step) + " from " + store->uri();
  Staged staged;
  CKPTIO_RETURN_IF_ERROR(Guard(what, [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(staged, Stage(*chosen->opened, state, options.map_location, Single(),
                                          options.other_tensors));
    result.tensors = std::move(staged.other_tensors);
    return options.before_apply ? options.before_apply(staged.metadata, result) : OkStatus();
  }));
  CKPTIO_RETURN_IF_ERROR(Apply(staged, state).WithContext(what));
  return result;
}

namespace {

Status LoadOne(StateItem item, std::string_view uri, torch::Device device) {
  State state = Of(std::move(item));
  LoadOptions options;
  options.map_location = MapLocation::To(device);
  return load(state, uri, options).status();
}

}  // namespace

Status save(torch::nn::Module& module, std::string_view uri) {
  return save(Of(StateItem("value", module)), uri);
}
Status save(torch::optim::Optimizer& optimizer, std::string_view uri) {
  return save(Of(StateItem("value", optimizer)), uri);
}
Status save(torch::Tensor& tensor, std::string_view uri) {
  return save(Of(StateItem("value", tensor)), uri);
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
