// What the binding's files share: Status to Python exceptions, Python
// exceptions kept across a C++ call, Ctrl-C in waits.
#ifndef CKPTIO_PYTHON_BINDING_UTIL_H_
#define CKPTIO_PYTHON_BINDING_UTIL_H_

#include <pybind11/pybind11.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "ckptio/coordination.h"
#include "ckptio/status.h"

namespace ckptio::python {

namespace py = pybind11;

// Raises the exception of ckptio/_errors.py for `status` (never returns).
[[noreturn]] inline void Raise(const Status& status) {
  py::module_::import("ckptio._errors")
      .attr("raise_status")(std::string(CodeName(status.code())), status.message(),
                            status.cause() == Cause::kWriterDied);
  throw std::logic_error("ckptio._errors.raise_status returned");  // (it always raises)
}

inline void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

// The value of `result`, or its status raised.
template <typename T>
T Value(Result<T> result) {
  if (!result.ok()) Raise(result.status());
  return std::move(*result);
}

// Python exceptions raised inside a C++ call (a map_location function, the
// before_apply check, Ctrl-C in a wait) fail that call; the first is kept
// and raised again, as it was, once the call has returned.
class KeptError {
 public:
  // Under the GIL, with the Python error indicator set (or in a catch of it).
  void Keep(py::error_already_set e) {
    if (!error_) error_ = std::make_shared<py::error_already_set>(std::move(e));
  }
  void RaiseIfAny() const {
    if (error_) throw *error_;
  }

 private:
  std::shared_ptr<py::error_already_set> error_;
};

// A timeout argument `name` of `seconds` (a Python float) as milliseconds:
// finite, 0 to 1e12 s (NaN, infinities and negatives would overflow or make
// no sense as a deadline; every wait of ckptio has one), else ValueError
// (InvalidArgumentError) naming it.
inline std::chrono::milliseconds TimeoutArg(double seconds, const char* name) {
  if (!(seconds >= 0 && seconds <= 1e12))  // (false for NaN too)
    Raise(Status(Code::kInvalidArgument,
                 std::string(name) + "=" + py::repr(py::float_(seconds)).cast<std::string>() +
                     ": give a number of seconds from 0 to 1e12 (every wait of ckptio ends "
                     "by a deadline)"));
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// A WaitInterrupt's check: Python's signal handlers run between the polls
// of every wait of the call (the GIL taken for that only), so Ctrl-C ends
// the wait with KeyboardInterrupt.
inline std::function<Status()> PythonSignals(KeptError& kept) {
  return [&kept]() -> Status {
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() == 0) return OkStatus();
    kept.Keep(py::error_already_set());
    return Status(Code::kAborted, "interrupted: a Python signal handler raised");
  };
}

// What `fn` returns, run with the GIL released (I/O, hashing, waits).
template <typename Fn>
auto Released(Fn&& fn) {
  std::optional<decltype(fn())> out;
  {
    py::gil_scoped_release release;
    out.emplace(fn());
  }
  return std::move(*out);
}

// Released, with Ctrl-C ending fn's waits: what fn returns, or the Python
// exception kept in `kept` meanwhile (Ctrl-C, or one of fn's callbacks).
template <typename Fn>
auto Interruptible(KeptError& kept, Fn&& fn) {
  WaitInterrupt interrupt(PythonSignals(kept));
  auto out = Released(std::forward<Fn>(fn));
  kept.RaiseIfAny();
  return out;
}
template <typename Fn>
auto Interruptible(Fn&& fn) {
  KeptError kept;
  return Interruptible(kept, std::forward<Fn>(fn));
}

// The store-level classes (store_module.cc).
void BindStore(py::module_& m);

}  // namespace ckptio::python

#endif  // CKPTIO_PYTHON_BINDING_UTIL_H_
