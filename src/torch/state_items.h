// A State's items in a step (internal to ckptio_torch): the metadata that
// records each item's kind, the object that holds each, a module's tensors,
// and which item names can be saved and loaded.
#ifndef CKPTIO_SRC_TORCH_STATE_ITEMS_H_
#define CKPTIO_SRC_TORCH_STATE_ITEMS_H_

#include <string>
#include <utility>
#include <vector>

#include "ckptio/torch.h"

namespace ckptio::internal {

// Metadata keys: the user's (State::metadata) and one per module or
// optimizer recording its kind.
inline constexpr char kUserPrefix[] = "user.";
inline constexpr char kItemPrefix[] =
    "ckptio.item.";  // ckptio.item.<name> = module|optimizer|tensors
// The object of the State's named tensors.
inline constexpr char kTensorsObject[] = "tensors.safetensors";

inline std::string ModuleObject(const std::string& name) { return name + ".safetensors"; }
inline std::string OptimizerObject(const std::string& name) { return name + ".optim.pt"; }

// A module's parameters and its defined buffers, by name, recursively.
std::vector<std::pair<std::string, torch::Tensor>> ModuleTensors(const torch::nn::Module& m);

// The device of an optimizer's first defined parameter; "cpu" if none.
std::string DeviceOf(const torch::optim::Optimizer& o);

// Item names are unique (one ckptio.item.<name> entry each, so a module and
// a tensor both named "x" would save but never load), and a module's or
// optimizer's name is usable in its object's name. A save also keeps room
// for ".part-N.safetensors" and refuses names a striped part could take
// ("model.part-1" beside "model"); a load accepts whatever a save made.
Status CheckNames(const State& state, bool saving);

// Before a save or load: the previous save's outcome, else CheckNames.
Status Ready(Status previous, const State& state, bool saving);

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_STATE_ITEMS_H_
