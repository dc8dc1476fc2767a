// ckptio._ckptio: the Python binding of the C++ Checkpointer (ckptio::torch).
// Thin on purpose: the commit protocol, the waits, verification and
// map_location all run in the C++ core; this file converts arguments, maps
// a Status to the exceptions of ckptio/_errors.py and releases the GIL
// around every call that does I/O, hashing or waiting. The pure-Python layer
// (ckptio/__init__.py) turns a trainer's state into what these take.
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <utility>
#include <vector>

#include "ckptio/torch.h"

namespace py = pybind11;

namespace ckptio::python {
namespace {

// Raises the exception of ckptio/_errors.py for `status` (never returns).
[[noreturn]] void Raise(const Status& status) {
  py::module_::import("ckptio._errors")
      .attr("raise_status")(std::string(CodeName(status.code())), status.message(),
                            status.cause() == Cause::kWriterDied);
  throw std::logic_error("ckptio._errors.raise_status returned");  // (it always raises)
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

using Modules = std::map<std::string, NamedTensors>;
using Tensors = std::map<std::string, torch::Tensor>;
using Metadata = std::map<std::string, std::string>;

// A State over the caller's tensors: `tensors` must outlive it (a tensor
// item holds a reference).
State MakeState(const Modules& modules, Tensors& tensors, Metadata metadata) {
  State state;
  for (const auto& [name, named] : modules) state.items.emplace_back(name, named);
  for (auto& [name, tensor] : tensors) state.items.emplace_back(name, tensor);
  state.metadata = std::move(metadata);
  return state;
}

// map_location from the Python layer: None (auto), a device string, or a
// callable taking the saved device ("cuda:0") and returning a device
// string. An exception of the callable fails the load; it is kept and
// raised again, with its own type, once the load has returned.
struct PyMapLocation {
  MapLocation map = MapLocation::Auto();
  std::shared_ptr<py::object> error = std::make_shared<py::object>();
};

PyMapLocation ToMapLocation(const py::object& where) {
  PyMapLocation out;
  if (where.is_none()) return out;
  if (py::isinstance<py::str>(where)) {
    out.map = MapLocation::To(where.cast<std::string>());
    return out;
  }
  auto fn = std::make_shared<py::object>(where);
  auto error = out.error;
  out.map = MapLocation::With([fn, error](const std::string& saved) -> torch::Device {
    py::gil_scoped_acquire gil;
    try {
      return torch::Device((*fn)(saved).cast<std::string>());
    } catch (py::error_already_set& e) {
      std::string what = e.what();
      *error = e.value();
      throw std::runtime_error(what);
    } catch (const py::cast_error&) {
      throw std::runtime_error("map_location must return a device string such as \"cpu\"");
    }
  });
  return out;
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
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    o.stripe = stripe;
    o.max_staging_bytes = max_staging_bytes;
    Result<std::unique_ptr<Checkpointer>> opened = Status(Code::kInternal, "not opened");
    {
      py::gil_scoped_release release;
      opened = Checkpointer::Open(uri, rank, o);
    }
    if (!opened.ok()) Raise(opened.status());
    ckpt_ = std::move(*opened);
  }

  ~PyCheckpointer() {
    py::gil_scoped_release release;  // waits for a save in flight
    ckpt_.reset();
  }

  void Save(int64_t step, const Modules& modules, Tensors tensors, Metadata metadata) {
    const State state = MakeState(modules, tensors, std::move(metadata));
    Status saved;
    {
      py::gil_scoped_release release;
      saved = ckpt_->Save(step, state);
    }
    Check(saved);
  }

  // Returns (step or None, [(skipped step, why)], {name: tensor}, metadata).
  // The modules are loaded in place; every named tensor of the step comes
  // back by name (the Python layer rebuilds the rest from them and the
  // metadata). `before_apply(metadata, tensors)` runs once the step is
  // verified and staged, before any module changes: an exception there
  // fails the load with nothing changed.
  py::tuple Load(const Modules& modules, std::optional<int64_t> step,
                 const py::object& map_location, const py::object& before_apply) {
    Tensors none;
    State state = MakeState(modules, none, {});
    PyMapLocation map = ToMapLocation(map_location);
    LoadOptions o;
    o.step = step;
    o.map_location = map.map;
    o.other_tensors = true;
    auto hook_error = std::make_shared<py::object>();
    if (!before_apply.is_none())
      o.before_apply = [&before_apply, hook_error](const Metadata& metadata,
                                                   const LoadResult& r) -> Status {
        py::gil_scoped_acquire gil;
        try {
          before_apply(metadata, r.tensors);
          return OkStatus();
        } catch (py::error_already_set& e) {
          *hook_error = e.value();
          return Status(Code::kInvalidArgument, e.what());
        }
      };
    Result<LoadResult> got = Status(Code::kInternal, "not loaded");
    {
      py::gil_scoped_release release;
      got = ckpt_->Load(state, o);
    }
    for (const auto& kept : {map.error, hook_error})
      if (*kept && !kept->is_none()) {
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(kept->ptr())), kept->ptr());
        throw py::error_already_set();
      }
    if (!got.ok()) Raise(got.status());
    py::list skipped;
    for (const auto& [s, why] : got->skipped) skipped.append(py::make_tuple(s, why));
    return py::make_tuple(got->step ? py::cast(*got->step) : py::none(), skipped,
                          std::move(got->tensors), state.metadata);
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

  py::class_<PyCheckpointer>(m, "Checkpointer")
      .def(py::init<const std::string&, const RankInfo&, const std::string&, const py::object&, int,
                    double, bool, uint64_t>(),
           py::arg("uri"), py::arg("rank"), py::arg("wait"), py::arg("store"), py::arg("keep_last"),
           py::arg("timeout"), py::arg("stripe"), py::arg("max_staging_bytes"))
      .def("save", &PyCheckpointer::Save, py::arg("step"), py::arg("modules"), py::arg("tensors"),
           py::arg("metadata"))
      .def("load", &PyCheckpointer::Load, py::arg("modules"), py::arg("step"),
           py::arg("map_location"), py::arg("before_apply"))
      .def_property_readonly("rank", &PyCheckpointer::rank);
}
