// Load apply (internal to ckptio_torch): a staged load put into the
// caller's modules, optimizers and named tensors, all or nothing, and the
// checks that let Stage refuse first what applying would fail on.
#ifndef CKPTIO_SRC_TORCH_LOAD_APPLY_H_
#define CKPTIO_SRC_TORCH_LOAD_APPLY_H_

#include <string>

#include "ckptio/torch.h"
#include "torch/load_stage.h"

namespace ckptio::internal {

// Why LibTorch would refuse to put `loaded` into `target` (a module's, or
// with `named`, a named tensor, which takes the saved dtype and shape), or
// "": ApplyTensors must not fail halfway, so Stage refuses first.
std::string WhyNotApplicable(const torch::Tensor& target, const torch::Tensor& loaded,
                             bool named = false);

// Applies a staged load. Optimizers first (the step expected to fail, on an
// archive that does not fit): on failure every optimizer is restored and
// nothing else was touched. Stage refused what the tensors' step would.
Status Apply(Staged& staged, State& state);

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_LOAD_APPLY_H_
