#include "ckptio/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace ckptio {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case Code::kNotFound:
      return "NOT_FOUND";
    case Code::kAlreadyExists:
      return "ALREADY_EXISTS";
    case Code::kPermissionDenied:
      return "PERMISSION_DENIED";
    case Code::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case Code::kAborted:
      return "ABORTED";
    case Code::kUnavailable:
      return "UNAVAILABLE";
    case Code::kDataLoss:
      return "DATA_LOSS";
    case Code::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case Code::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case Code::kUnimplemented:
      return "UNIMPLEMENTED";
    case Code::kInternal:
      return "INTERNAL";
  }
  return "UNKNOWN";
}

std::optional<Code> CodeFromNumber(int64_t number) {
  if (number < static_cast<int64_t>(Code::kOk) || number > static_cast<int64_t>(Code::kInternal))
    return std::nullopt;
  return static_cast<Code>(number);
}

std::string EncodeStatus(const Status& status) {
  return std::to_string(static_cast<int>(status.code())) + ":" + status.message();
}

std::optional<Status> DecodeStatus(std::string_view text) {
  const size_t colon = text.find(':');
  // At most two digits: every code number has one or two.
  if (colon == std::string_view::npos || colon == 0 || colon > 2) return std::nullopt;
  int64_t number = 0;
  for (char c : text.substr(0, colon)) {
    if (c < '0' || c > '9') return std::nullopt;
    number = number * 10 + (c - '0');
  }
  const std::optional<Code> code = CodeFromNumber(number);
  if (!code) return std::nullopt;
  if (*code == Code::kOk) return OkStatus();
  return Status(*code, std::string(text.substr(colon + 1))).FromPeer();
}

namespace internal {
void DieOfBadAccess(const Status& status) {
  std::fprintf(stderr, "ckptio: value() of a failed Result (check ok() first): %s\n",
               status.ToString().c_str());
  std::abort();
}
}  // namespace internal

const std::error_category& CauseCategory() {
  class Category final : public std::error_category {
   public:
    const char* name() const noexcept override { return "ckptio"; }
    std::string message(int c) const override {
      return static_cast<Cause>(c) == Cause::kWriterDied ? "the writer (rank 0) died"
                                                         : "unknown ckptio cause";
    }
  };
  static const Category category;
  return category;
}

Status Status::FromPeer() const {
  Status copy = *this;
  copy.origin_ = Origin::kPeer;
  copy.cause_ = {};  // another process's error codes mean nothing here
  return copy;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(CodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string msg(context);
  msg += ": ";
  msg += message_;
  Status out = *this;
  out.message_ = std::move(msg);
  return out;
}

Status Status::WithCause(std::error_code cause) const {
  Status out = *this;
  out.cause_ = cause;
  return out;
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

Status ErrnoToStatus(int err, std::string_view what) {
  Code code = Code::kInternal;
  const char* advice = "";
  switch (err) {
    case ENOENT:
      code = Code::kNotFound;
      break;
    case EEXIST:
      code = Code::kAlreadyExists;
      break;
    case EACCES:
    case EPERM:
      code = Code::kPermissionDenied;
      advice = "; check the ownership and mode of the store directory";
      break;
    case ENOSPC:
    case EDQUOT:
      code = Code::kResourceExhausted;
      advice = "; free space (e.g. `ckptio gc STORE --keep N`) and save again";
      break;
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      code = Code::kResourceExhausted;
      break;
    case EIO:
      code = Code::kUnavailable;
      advice =
          "; the device reported an I/O error: check the disk or server (a failed save "
          "is discarded, never half-committed)";
      break;
    case EINTR:
    case EAGAIN:
    case ESTALE:
    case ECONNRESET:
    case ENOTCONN:
      code = Code::kUnavailable;
      break;
    case ETIMEDOUT:  // a server's timeout; DeadlineExceeded is for ckptio's own waits
      code = Code::kUnavailable;
      break;
    case ELOOP:
      code = Code::kFailedPrecondition;
      advice =
          "; a symbolic link was found where ckptio expects a plain file or "
          "directory, and ckptio never follows links inside a store: remove it";
      break;
    case ENOTDIR:
    case EISDIR:
    case ENOTEMPTY:
    case EROFS:
    case EXDEV:
      code = Code::kFailedPrecondition;
      break;
    case EINVAL:
    case ENAMETOOLONG:
      code = Code::kInvalidArgument;
      break;
    default:
      break;
  }
  std::string msg(what);
  msg += ": ";
  msg += std::strerror(err);
  msg += advice;
  return Status(code, std::move(msg)).WithCause(std::error_code(err, std::generic_category()));
}

}  // namespace ckptio
