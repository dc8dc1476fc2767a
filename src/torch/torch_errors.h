// LibTorch exceptions as Status codes (internal to ckptio_torch).
#ifndef CKPTIO_SRC_TORCH_TORCH_ERRORS_H_
#define CKPTIO_SRC_TORCH_TORCH_ERRORS_H_

#include <c10/util/Exception.h>

#include <string>

#include "ckptio/status.h"

namespace ckptio::internal {

// `what`: the failed operation, which begins the message. Out of memory (a
// GPU, or the host: c10::OutOfMemoryError) is RESOURCE_EXHAUSTED (free
// memory or save less at once, then retry); NotImplementedError UNIMPLEMENTED;
// IndexError, ValueError, TypeError INVALID_ARGUMENT (what the caller passed
// does not fit); any other LibTorch error `otherwise`.
inline Status TorchErrorToStatus(const c10::Error& e, const std::string& what, Code otherwise) {
  Code code = otherwise;
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e))
    code = Code::kResourceExhausted;
  else if (dynamic_cast<const c10::NotImplementedError*>(&e))
    code = Code::kUnimplemented;
  else if (dynamic_cast<const c10::IndexError*>(&e) || dynamic_cast<const c10::ValueError*>(&e) ||
           dynamic_cast<const c10::TypeError*>(&e))
    code = Code::kInvalidArgument;
  return Status(code, what + ": " + e.what_without_backtrace());
}

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_TORCH_ERRORS_H_
