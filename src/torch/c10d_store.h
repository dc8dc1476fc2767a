// The trainer's c10d store behind WaitOn::C10dStore (internal to
// ckptio_torch: the public header names c10d::Store without including it).
#ifndef CKPTIO_SRC_TORCH_C10D_STORE_H_
#define CKPTIO_SRC_TORCH_C10D_STORE_H_

#include <memory>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ckptio/coordination.h"
#include "ckptio/export.h"
#include "ckptio/rank.h"
#include "ckptio/status.h"

namespace ckptio {

namespace internal {
struct C10dStoreHandle {
  c10::intrusive_ptr<c10d::Store> store;
};
}  // namespace internal

// Coordination through a c10d::Store (WaitOn::C10dStore).
CKPTIO_EXPORT_PRIVATE Result<std::unique_ptr<Coordinator>> NewC10dCoordinator(
    c10::intrusive_ptr<c10d::Store> store, const RankInfo& rank);

}  // namespace ckptio

#endif  // CKPTIO_SRC_TORCH_C10D_STORE_H_
