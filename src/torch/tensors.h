// Tensors in and out of checkpoint objects (tensors.cc; internal to
// ckptio_torch, and for the tools and tests of this tree): lower level than
// Checkpointer.
#ifndef CKPTIO_SRC_TORCH_TENSORS_H_
#define CKPTIO_SRC_TORCH_TENSORS_H_

#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/manifest.h"
#include "ckptio/status.h"
#include "ckptio/store.h"

namespace ckptio {

// Writes `tensors` as a safetensors object of `pending` and records each in
// its manifest. `devices` (optional, same order) overrides the recorded
// saved-from device.
CKPTIO_EXPORT_PRIVATE Status
WriteSafetensors(PendingCheckpoint& pending, const std::string& object,
                 const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                 const std::vector<std::string>& devices = {});
// The same into one rank's stripe of a striped save.
CKPTIO_EXPORT_PRIVATE Status
WriteSafetensors(StripeWriter& stripe, const std::string& object,
                 const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                 const std::vector<std::string>& devices = {});

// The object `object` is a part of (itself when it is not a stripe's part).
CKPTIO_EXPORT_PRIVATE std::string StripeBaseObject(const Manifest& manifest,
                                                   const std::string& object);

// The safetensors dtype of a LibTorch type ("F32"); "" if safetensors has
// none for it.
CKPTIO_EXPORT_PRIVATE const char* SafetensorsDtypeName(torch::ScalarType type);

// Reads tensor `name` of `object` from a verified checkpoint onto `device`.
CKPTIO_EXPORT_PRIVATE Result<torch::Tensor> ReadTensor(CheckpointReader& reader,
                                                       const TensorEntry& entry,
                                                       torch::Device device);

// Tensor `entry` of a verified object view (CheckpointReader::View) on
// `device`. On the CPU the tensor shares the view's memory (copy-on-write
// for a memory map: writing to the tensor never changes the checkpoint) and
// keeps the view alive; elsewhere it is a copy.
CKPTIO_EXPORT_PRIVATE Result<torch::Tensor> TensorFromView(const std::shared_ptr<ObjectView>& view,
                                                           const TensorEntry& entry,
                                                           torch::Device device);

}  // namespace ckptio

#endif  // CKPTIO_SRC_TORCH_TENSORS_H_
