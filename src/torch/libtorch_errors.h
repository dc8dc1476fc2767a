// LibTorch exceptions as a Status (internal to ckptio_torch): every call
// into LibTorch that can throw runs under Guard.
#ifndef CKPTIO_SRC_TORCH_LIBTORCH_ERRORS_H_
#define CKPTIO_SRC_TORCH_LIBTORCH_ERRORS_H_

#include <c10/util/Exception.h>

#include <exception>
#include <new>
#include <string>

#include "ckptio/status.h"

namespace ckptio::internal {

// A LibTorch exception as a Status whose message begins with `what`, the
// failed operation. Out of memory (on a GPU, or the host's:
// c10::OutOfMemoryError) is RESOURCE_EXHAUSTED: free memory, or save or load
// less at once, then retry; NotImplementedError is UNIMPLEMENTED; any other
// LibTorch error `otherwise` (INVALID_ARGUMENT where the caller's tensors or
// modules did not fit what was asked of them).
inline Status TorchErrorToStatus(const c10::Error& e, const std::string& what, Code otherwise) {
  Code code = otherwise;
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr)
    code = Code::kResourceExhausted;
  else if (dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr)
    code = Code::kUnimplemented;
  return Status(code, what + ": " + e.what_without_backtrace());
}

// Runs `fn`, turning a LibTorch exception into a Status (TorchErrorToStatus,
// INVALID_ARGUMENT otherwise), and std::bad_alloc into RESOURCE_EXHAUSTED.
template <typename Fn>
Status Guard(const std::string& what, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return TorchErrorToStatus(e, what, Code::kInvalidArgument);
  } catch (const std::bad_alloc&) {
    return Status(Code::kResourceExhausted, what + ": out of host memory");
  } catch (const std::exception& e) {
    return Status(Code::kInternal, what + ": " + e.what());
  }
}

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_LIBTORCH_ERRORS_H_
