// Status and Result<T>: how every ckptio call reports failure.
//
// No ckptio function throws for an expected failure (I/O error, corrupt
// data, lock held, bad input); it returns a Status, or a Result<T> holding
// either a T or a non-OK Status. Codes follow absl::StatusCode so callers can
// decide what to do without parsing messages:
//
//   kInvalidArgument    the caller passed something malformed (a bad name, a
//                       negative step, an unknown URI scheme). Do not retry.
//   kNotFound           the store, step or object does not exist.
//   kAlreadyExists      the step is already committed; committed checkpoints
//                       are immutable. Choose another step.
//   kPermissionDenied   the OS refused access (EACCES, EPERM).
//   kFailedPrecondition the store is not in a state that allows the call (a
//                       symlink planted in the store, another writer holds
//                       the lock, a format from a newer ckptio). Fix the
//                       state, then retry.
//   kAborted            a concurrency conflict: this writer was fenced by a
//                       newer one. Retry the whole save from a fresh writer.
//   kUnavailable        a transient failure (EIO, EINTR, EAGAIN, a server
//                       that went away). Retrying the whole call may help;
//                       a failed fsync is never retried in place.
//   kDataLoss           bytes on storage do not match their checksum, or a
//                       file is torn or malformed. The data is not usable.
//   kResourceExhausted  ENOSPC, EDQUOT, EMFILE: free space or raise limits.
//   kDeadlineExceeded   a wait ran past its deadline.
//   kUnimplemented      the backend does not support the operation.
//   kInternal           a bug or an errno with no better mapping.
//
// Messages say what happened, where (store, step, object, byte range or
// path) and, when there is one, what to do about it. Code decides on a
// Status by its code, origin and cause, never by its message text.
#ifndef CKPTIO_STATUS_H_
#define CKPTIO_STATUS_H_

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "ckptio/export.h"

namespace ckptio {

enum class Code {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kAlreadyExists,
  kPermissionDenied,
  kFailedPrecondition,
  kAborted,
  kUnavailable,
  kDataLoss,
  kResourceExhausted,
  kDeadlineExceeded,
  kUnimplemented,
  kInternal,
};

// "OK", "INVALID_ARGUMENT", ... as absl spells them.
CKPTIO_EXPORT std::string_view CodeName(Code code);
// The code of number `number` (its enumerator's value, as EncodeStatus
// writes it); nullopt when no code has that number.
CKPTIO_EXPORT std::optional<Code> CodeFromNumber(int64_t number);

class [[nodiscard]] CKPTIO_EXPORT Status {
 public:
  // Where an error arose: in this process's own calls, or on another rank,
  // which sent it here (DecodeStatus). A peer's UNAVAILABLE is that rank's
  // final outcome, not a call of this one to retry.
  enum class Origin { kThisProcess, kPeer };

  Status() = default;  // OK
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "DATA_LOSS: <message>", or "OK".
  std::string ToString() const;

  Origin origin() const { return origin_; }
  // A copy marked as another rank's error.
  Status FromPeer() const;

  // What the error came from below ckptio, when that is known: the errno
  // of a failed system call (generic category, from ErrnoToStatus), or a
  // condition of a backend's own category (the NFS backend marks a stale
  // file handle this way, and retries on it). Empty otherwise, and on a
  // status received from another rank.
  const std::error_code& cause() const { return cause_; }
  // A copy with `cause` as its cause.
  Status WithCause(std::error_code cause) const;

  // Returns a copy whose message is "<context>: <message>" (origin and
  // cause kept).
  Status WithContext(std::string_view context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
  Origin origin_ = Origin::kThisProcess;
  std::error_code cause_;
};

// Causes ckptio itself gives a Status (category "ckptio"), compared as
// `status.cause() == ckptio::Cause::kWriterDied`.
enum class Cause {
  // A waiting rank saw rank 0 die (or close its Checkpointer) before it
  // committed or decided: ABORTED, "writer died before ...".
  kWriterDied = 1,
};
CKPTIO_EXPORT const std::error_category& CauseCategory();
inline std::error_code make_error_code(Cause c) { return {static_cast<int>(c), CauseCategory()}; }

inline Status OkStatus() { return Status(); }
CKPTIO_EXPORT std::ostream& operator<<(std::ostream& os, const Status& s);

// The one place errno values become Status codes. `what` names the
// operation and path, e.g. "fsync /ckpt/step-000000000001/MANIFEST.json".
// The status's cause is `err` in the generic category.
CKPTIO_EXPORT Status ErrnoToStatus(int err, std::string_view what);

// Sending a Status to another rank (a c10d store value, a coordination
// record, a load decision): one text form for every coordinator,
// "<code number>:<message>" ("0:" for OK).
CKPTIO_EXPORT std::string EncodeStatus(const Status& status);
// The Status EncodeStatus made, marked Origin::kPeer; nullopt when `text` is
// not of that form or names no code (a damaged or hostile record never
// yields an out-of-range code).
CKPTIO_EXPORT std::optional<Status> DecodeStatus(std::string_view text);

namespace internal {
// Prints "ckptio: value() of a failed Result: <status>" and aborts.
[[noreturn]] CKPTIO_EXPORT void DieOfBadAccess(const Status& status);
}  // namespace internal

// Holds a T or a non-OK Status. Reading the value of a Result that holds an
// error (value(), *, ->) aborts the process with the error's message, in
// every build: check ok() first.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = Status(Code::kInternal, "Result built from an OK status");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & {
    Check();
    return *value_;
  }
  const T& value() const& {
    Check();
    return *value_;
  }
  T&& value() && {
    Check();
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void Check() const {
    if (!ok()) internal::DieOfBadAccess(status_);
  }

  Status status_;
  std::optional<T> value_;
};

}  // namespace ckptio

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define CKPTIO_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::ckptio::Status ckptio_status_ = (expr);        \
    if (!ckptio_status_.ok()) return ckptio_status_; \
  } while (0)

#define CKPTIO_CONCAT_INNER_(a, b) a##b
#define CKPTIO_CONCAT_(a, b) CKPTIO_CONCAT_INNER_(a, b)

// `lhs = value of rexpr (a Result<T>)`, or return its Status.
#define CKPTIO_ASSIGN_OR_RETURN(lhs, rexpr) \
  CKPTIO_ASSIGN_OR_RETURN_IMPL_(CKPTIO_CONCAT_(ckptio_result_, __LINE__), lhs, rexpr)
// `lhs` may be a declaration, so it cannot be parenthesised.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define CKPTIO_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                  \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)

template <>
struct std::is_error_code_enum<ckptio::Cause> : std::true_type {};

#endif  // CKPTIO_STATUS_H_
