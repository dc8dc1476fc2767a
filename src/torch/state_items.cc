// A State's items in a step: their tensors and the names they may have.
#include "torch/state_items.h"

#include <algorithm>
#include <vector>

#include "text.h"

namespace ckptio::internal {

std::vector<std::pair<std::string, torch::Tensor>> ModuleTensors(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers(/*recurse=*/true))
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  return out;
}

}  // namespace ckptio::internal

namespace ckptio {
NamedTensors StateItem::module_tensors() const {
  return module_ ? internal::ModuleTensors(*module_) : named_;
}
}  // namespace ckptio

namespace ckptio::internal {

std::string DeviceOf(const torch::optim::Optimizer& o) {
  for (const auto& group : o.param_groups())
    for (const auto& p : group.params())
      if (p.defined()) return p.device().str();
  return "cpu";
}

namespace {
// What a save refuses beside what a load does (see CheckNames).
constexpr size_t kMaxItemName = 160;  // + ".part-N.safetensors" fits kMaxKeyComponent
bool EndsLikeAPart(const std::string& name) {
  const size_t dot = name.rfind(".part-");
  return dot != std::string::npos && dot + 6 < name.size() &&
         name.find_first_not_of("0123456789", dot + 6) == std::string::npos;
}
}  // namespace

Status CheckNames(const State& state, bool saving) {
  auto kind_name = [](StateItem::Kind k) {
    return k == StateItem::Kind::kModule      ? "a module"
           : k == StateItem::Kind::kOptimizer ? "an optimizer"
                                              : "a tensor";
  };
  const StateItem* tensors_module = nullptr;
  bool loose = false;
  for (const StateItem& item : state.items) {
    const std::string& name = item.name();
    if (item.kind() == StateItem::Kind::kTensor) {
      loose = true;
      continue;
    }
    if (item.kind() == StateItem::Kind::kModule && name == "tensors") tensors_module = &item;
    Status s = ValidateObjectName(item.kind() == StateItem::Kind::kModule ? ModuleObject(name)
                                                                          : OptimizerObject(name));
    if (name.empty() || !s.ok() || (saving && (name.size() > kMaxItemName || EndsLikeAPart(name))))
      return Status(Code::kInvalidArgument,
                    std::string(kind_name(item.kind())) + " is named \"" + Printable(name) +
                        "\", which cannot name its object in the store: module and optimizer "
                        "names are 1 to 160 of [A-Za-z0-9._-], not starting with '.' nor "
                        "ending in .part-<digits> (tensor names may be any UTF-8)");
  }
  // Repeated names: the items in name order, each name's first in the
  // State first (no copy of a name: 10,000 tensors' names in a tree cost a
  // save_async's caller 2 ms).
  std::vector<const StateItem*> sorted(state.items.size());
  for (size_t i = 0; i < sorted.size(); ++i) sorted[i] = &state.items[i];
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const StateItem* a, const StateItem* b) { return a->name() < b->name(); });
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i - 1]->name() == sorted[i]->name())
      return Status(Code::kInvalidArgument,
                    "the State has two items named \"" + Printable(sorted[i]->name()) + "\" (" +
                        kind_name(sorted[i - 1]->kind()) + " and " + kind_name(sorted[i]->kind()) +
                        "): item names must be unique");
  if (loose && tensors_module)
    return Status(Code::kInvalidArgument,
                  "a module named \"tensors\" would share tensors.safetensors with the State's "
                  "tensors: rename the module");
  return OkStatus();
}

Status Ready(Status previous, const State& state, bool saving) {
  return previous.ok() ? CheckNames(state, saving) : previous;
}

}  // namespace ckptio::internal
