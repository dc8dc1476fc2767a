// Host-to-GPU copies through one pinned buffer of the process (internal).
#pragma once

#include <torch/types.h>

namespace ckptio::internal {

// Allocates the process's pinned buffer (64 MiB) if it is not yet there;
// throws c10::Error where it cannot be had. Call it before a change that
// must not fail halfway, then CopyThroughPinned needs no allocation.
void ReservePinned();

// Copies the contiguous CPU tensor `cpu` (typically backed by a file map,
// which CUDA cannot copy from directly) into the memory of `dst`, a
// contiguous CUDA tensor of the same byte size: 64 MiB pieces, each a host
// memcpy into the pinned buffer and a synchronous copy from it.
void CopyThroughPinned(const torch::Tensor& cpu, const torch::Tensor& dst);

}  // namespace ckptio::internal
