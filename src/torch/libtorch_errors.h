// LibTorch exceptions as a Status (internal to ckptio_torch): every call
// into LibTorch that can throw runs under Guard.
#ifndef CKPTIO_SRC_TORCH_LIBTORCH_ERRORS_H_
#define CKPTIO_SRC_TORCH_LIBTORCH_ERRORS_H_

#include <c10/util/Exception.h>

#include <exception>
#include <string>

#include "ckptio/status.h"

namespace ckptio::internal {

// Runs `fn`, turning a LibTorch exception into a Status.
template <typename Fn>
Status Guard(const std::string& what, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return Status(Code::kInvalidArgument, what + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status(Code::kInternal, what + ": " + e.what());
  }
}

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_LIBTORCH_ERRORS_H_
