// The save plan (internal to ckptio_torch): what a rank writes of a State,
// decided before anything is written, and the writing of it into a step.
#ifndef CKPTIO_SRC_TORCH_SAVE_PLAN_H_
#define CKPTIO_SRC_TORCH_SAVE_PLAN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/torch.h"

namespace ckptio::internal {

// What a save writes, planned before anything is written: the tensor
// objects, the optimizers (live, streamed at write time, or archived into
// memory for an asynchronous save) and the metadata.
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

// Everything of `state` in one plan (a plain save, rank 0).
SavePlan Plan(const State& state);

// Rank `rank`'s share of a striped save of `full`: tensors go, largest
// first (ties by object and tensor name), to the rank with the fewest bytes
// so far (ties: the lowest rank), which every rank computes alike from the
// same layout, whatever order its State lists the items in. Rank 0 keeps its
// parts under the objects' own names (even when empty), the optimizers and
// the metadata, and learns which part objects the others will deliver.
SavePlan StripePart(const SavePlan& full, int rank, int world);

// Streams an optimizer's LibTorch archive to `write` (no copy in memory).
Status ArchiveOptimizer(const torch::optim::Optimizer& optimizer, const std::string& object,
                        const std::function<Status(const void*, size_t)>& write);

// Writes `plan` into `pending`: its metadata, tensor objects, optimizers
// (streamed) and archives; Commit is the caller's.
Status WritePlan(PendingCheckpoint& pending, const SavePlan& plan);

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_SAVE_PLAN_H_
