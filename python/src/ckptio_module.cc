// ckptio._ckptio: the Python binding of the C++ Checkpointer (ckptio::torch).
// Thin on purpose: the commit protocol, the waits, verification and
// map_location all run in the C++ core; this file converts arguments, maps
// a Status to the exceptions of ckptio/_errors.py and releases the GIL
// around every call that does I/O, hashing or waiting. The pure-Python layer
// (ckptio/__init__.py) turns a trainer's state into what these take.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <utility>
#include <vector>

#include "binding_util.h"
#include "ckptio/coordination.h"
#include "ckptio/torch.h"

namespace py = pybind11;

namespace ckptio::python {
namespace {

using Modules = std::map<std::string, NamedTensors>;
using Metadata = std::map<std::string, std::string>;

// A State over the Python layer's modules and {name: tensor} dict. Its
// tensor items refer to the tensors inside the dict's Python objects,
// which the dict keeps alive for the call (a save reads them, never writes
// them). Converted by hand: through a std::map, 10,000 tensors cost a
// save_async's caller 4 ms of tree nodes made and freed, and torch 1.13's
// check of each tensor (PyObject_IsInstance) 3 ms more; a Tensor's or a
// Parameter's exact type is checked first. (Their order does not matter: a
// striped save splits by name.)
State MakeState(const Modules& modules, const py::dict& tensors, Metadata metadata) {
  State state;
  state.items.reserve(modules.size() + tensors.size());
  for (const auto& [name, named] : modules) state.items.emplace_back(name, named);
  for (const auto& [name, tensor] : tensors) {
    PyObject* t = tensor.ptr();
    if (!PyUnicode_Check(name.ptr()) || !(THPVariable_CheckExact(t) || THPVariable_Check(t)))
      throw py::type_error("tensors must map str names to tensors; got " +
                           std::string(py::str(py::type::of(name))) + " -> " +
                           std::string(py::str(py::type::of(tensor))));
    state.items.emplace_back(name.cast<std::string>(),
                             const_cast<torch::Tensor&>(THPVariable_Unpack(t)));
  }
  state.metadata = std::move(metadata);
  return state;
}

// map_location from the Python layer: None (auto), a device string, or a
// callable taking the saved device ("cuda:0") and returning a device
// string, whose exceptions fail the load (kept in `kept`).
MapLocation ToMapLocation(const py::object& where, KeptError& kept) {
  if (where.is_none()) return MapLocation::Auto();
  if (py::isinstance<py::str>(where)) return MapLocation::To(where.cast<std::string>());
  return MapLocation::With([&where, &kept](const std::string& saved) -> torch::Device {
    py::gil_scoped_acquire gil;
    try {
      return torch::Device(where(saved).cast<std::string>());
    } catch (py::error_already_set& e) {
      std::string what = e.what();
      kept.Keep(std::move(e));
      throw std::runtime_error(what);
    } catch (const py::cast_error&) {
      throw std::runtime_error("map_location must return a device string such as \"cpu\"");
    }
  });
}

// A SaveAsync's outcome. Waits with the GIL released, in slices, running
// Python's signal handlers between them (Ctrl-C ends a wait, not the save).
class PySaveFuture {
 public:
  PySaveFuture(int64_t step, std::shared_future<Status> future)
      : step_(step), future_(std::move(future)) {}

  int64_t step() const { return step_; }
  bool done() const {
    return future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  // True once done; false when `timeout_s` (None or +inf: no limit, as
  // concurrent.futures has it; negative: none left) passed first.
  bool Wait(std::optional<double> timeout_s) const {
    if (timeout_s && std::isnan(*timeout_s))
      python::Raise(
          Status(Code::kInvalidArgument, "timeout=nan: give a number of seconds, or None"));
    auto deadline = std::chrono::steady_clock::time_point::max();
    if (timeout_s && *timeout_s < 0)
      deadline = std::chrono::steady_clock::now();
    else if (timeout_s && std::isfinite(*timeout_s))
      deadline = DeadlineAfter(
          std::chrono::milliseconds(static_cast<int64_t>(std::min(*timeout_s, 1e12) * 1000)));
    while (true) {
      {
        py::gil_scoped_release release;
        const auto slice = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
        if (future_.wait_until(std::min(slice, deadline)) == std::future_status::ready) return true;
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (std::chrono::steady_clock::now() >= deadline) return false;
    }
  }
  // After Wait() returned true: raises the save's error, if it failed.
  void Raise() const {
    Status s;
    {
      py::gil_scoped_release release;
      s = future_.get();
    }
    Check(s);
  }

 private:
  int64_t step_;
  std::shared_future<Status> future_;
};

// A load through `load` (a Checkpointer's, or the one-liner's). Returns
// (step or None, [(skipped step, why)]). The modules are loaded in place;
// `before_apply(metadata, {name: tensor})`, unless None, gets the step's metadata and
// every named tensor (the Python layer rebuilds the rest from them) once
// the step is verified and staged, before any module changes: an exception
// there fails the load with nothing changed. (They are handed over once:
// 10,000 tensors cost milliseconds to convert.)
py::tuple LoadWith(const Modules& modules, std::optional<int64_t> step,
                   const py::object& map_location, const py::object& before_apply,
                   const std::function<Result<LoadResult>(State&, const LoadOptions&)>& load) {
  State state = MakeState(modules, py::dict(), {});
  KeptError kept;
  LoadOptions o;
  o.step = step;
  o.map_location = ToMapLocation(map_location, kept);
  o.other_tensors = true;
  if (!before_apply.is_none())
    o.before_apply = [&before_apply, &kept](const Metadata& metadata,
                                            const LoadResult& r) -> Status {
      py::gil_scoped_acquire gil;
      // Python's cycle collector is off while the step's tensors become
      // Python objects and the Python layer decodes them: tens of thousands
      // of objects at once, none of them cyclic garbage, whose collections
      // walk every live object of the program (39 of a 145 ms load in the
      // bench). Not during the wait for rank 0's decision, which can be long.
      struct GcPaused {
        int was_enabled = PyGC_Disable();
        ~GcPaused() {
          if (was_enabled) PyGC_Enable();
        }
      } paused;
      try {
        before_apply(metadata, r.tensors);
        return OkStatus();
      } catch (py::error_already_set& e) {
        std::string what = e.what();
        kept.Keep(std::move(e));
        return Status(Code::kInvalidArgument, what);
      }
    };
  Result<LoadResult> got = Interruptible(kept, [&] { return load(state, o); });
  if (!got.ok()) Raise(got.status());
  py::list skipped;
  for (const auto& [s, why] : got->skipped) skipped.append(py::make_tuple(s, why));
  return py::make_tuple(got->step ? py::cast(*got->step) : py::none(), skipped);
}

class PyCheckpointer {
 public:
  PyCheckpointer(const std::string& uri, const RankInfo& rank, const std::string& wait,
                 const py::object& store, int keep_last, double timeout_s, bool stripe,
                 uint64_t max_staging_bytes) {
    CheckpointerOptions o;
    if (wait == "manifest") {
      o.wait = WaitOn::Manifest();
    } else if (wait == "file-lock") {
      o.wait = WaitOn::FileLock();
    } else if (wait == "store") {
      o.wait = WaitOn::C10dStore(store.cast<c10::intrusive_ptr<c10d::Store>>());
    } else {
      Raise(Status(Code::kInvalidArgument, "wait is \"" + wait +
                                               "\"; it must be \"manifest\", \"file-lock\" or "
                                               "\"store\""));
    }
    o.keep_last = keep_last;
    o.timeout = TimeoutArg(timeout_s, "timeout");
    o.stripe = stripe;
    o.max_staging_bytes = max_staging_bytes;
    // (Rank 0 may wait for the writer lock.)
    auto opened = Interruptible([&] { return Checkpointer::Open(uri, rank, o); });
    if (!opened.ok()) Raise(opened.status());
    ckpt_ = std::move(*opened);
  }

  ~PyCheckpointer() {
    py::gil_scoped_release release;  // waits for a save in flight
    ckpt_.reset();
  }

  void Save(int64_t step, const Modules& modules, const py::dict& tensors, Metadata metadata) {
    const State state = MakeState(modules, tensors, std::move(metadata));
    Check(Interruptible([&] { return ckpt_->Save(step, state); }));
  }

  // Returns once the state is staged (rank 0) or at once (the others); the
  // state's tensors are not used after. A wait before that (the previous
  // save, the save lock) ends on Ctrl-C; the background save does not.
  PySaveFuture SaveAsync(int64_t step, const Modules& modules, const py::dict& tensors,
                         Metadata metadata) {
    const State state = MakeState(modules, tensors, std::move(metadata));
    return PySaveFuture(step, Interruptible([&] { return ckpt_->SaveAsync(step, state); }).share());
  }

  py::tuple Load(const Modules& modules, std::optional<int64_t> step,
                 const py::object& map_location, const py::object& before_apply) {
    return LoadWith(modules, step, map_location, before_apply,
                    [this](State& state, const LoadOptions& o) { return ckpt_->Load(state, o); });
  }

  const RankInfo& rank() const { return ckpt_->rank(); }

 private:
  std::unique_ptr<Checkpointer> ckpt_;
};

}  // namespace
}  // namespace ckptio::python

PYBIND11_MODULE(_ckptio, m) {
  using namespace ckptio;
  using namespace ckptio::python;
  m.doc() = "ckptio's C++ core for the Python package (use the ckptio package, not this)";
  BindStore(m);

  py::class_<RankInfo>(m, "RankInfo")
      .def(py::init<>())
      .def_readwrite("rank", &RankInfo::rank)
      .def_readwrite("local_rank", &RankInfo::local_rank)
      .def_readwrite("world_size", &RankInfo::world_size)
      .def_readwrite("local_world_size", &RankInfo::local_world_size)
      .def_readwrite("job_id", &RankInfo::job_id)
      .def_readwrite("job_id_reused", &RankInfo::job_id_reused)
      .def_readwrite("source", &RankInfo::source)
      .def("__repr__", [](const RankInfo& r) { return "<ckptio.RankInfo " + r.ToString() + ">"; })
      .def_static("from_env", [] {
        auto r = RankInfo::FromEnv();
        if (!r.ok()) Raise(r.status());
        return *r;
      });

  m.def(
      "save_one",
      [](const std::string& uri, const Modules& modules, const py::dict& tensors,
         Metadata metadata) {
        const State state = MakeState(modules, tensors, std::move(metadata));
        Check(Interruptible([&] { return ckptio::save(state, uri); }));  // (the writer lock)
      },
      py::arg("uri"), py::arg("modules"), py::arg("tensors"), py::arg("metadata"));
  m.def(
      "load_one",
      [](const std::string& uri, const Modules& modules, std::optional<int64_t> step,
         const py::object& map_location, const py::object& before_apply) {
        return LoadWith(
            modules, step, map_location, before_apply,
            [&uri](State& state, const LoadOptions& o) { return ckptio::load(state, uri, o); });
      },
      py::arg("uri"), py::arg("modules"), py::arg("step"), py::arg("map_location"),
      py::arg("before_apply"));

  py::class_<PySaveFuture>(m, "SaveFuture")
      .def_property_readonly("step", &PySaveFuture::step)
      .def("done", &PySaveFuture::done)
      .def("wait", &PySaveFuture::Wait, py::arg("timeout"))
      .def("raise_error", &PySaveFuture::Raise);

  py::class_<PyCheckpointer>(m, "Checkpointer")
      .def(py::init<const std::string&, const RankInfo&, const std::string&, const py::object&, int,
                    double, bool, uint64_t>(),
           py::arg("uri"), py::arg("rank"), py::arg("wait"), py::arg("store"), py::arg("keep_last"),
           py::arg("timeout"), py::arg("stripe"), py::arg("max_staging_bytes"))
      .def("save", &PyCheckpointer::Save, py::arg("step"), py::arg("modules"), py::arg("tensors"),
           py::arg("metadata"))
      .def("save_async", &PyCheckpointer::SaveAsync, py::arg("step"), py::arg("modules"),
           py::arg("tensors"), py::arg("metadata"))
      .def("load", &PyCheckpointer::Load, py::arg("modules"), py::arg("step"),
           py::arg("map_location"), py::arg("before_apply"))
      .def_property_readonly("rank", &PyCheckpointer::rank);
}
