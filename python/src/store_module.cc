// ckptio._ckptio's store-level classes, for storage plugins that lay out a
// step themselves (ckptio/dcp.py, the torch.distributed.checkpoint plugin):
// the writer's pending step, the other ranks' stripes, verified reads. The
// commit protocol stays the core's: objects durable before a receipt, the
// manifest and LATEST written last, every byte read verified.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "binding_util.h"
#include "ckptio/backends.h"
#include "ckptio/log.h"
#include "ckptio/store.h"

namespace py = pybind11;

namespace ckptio::python {
namespace {

// The bytes of a piece to write: a contiguous CPU tensor's memory, or any
// object with the buffer protocol (bytes, bytearray, memoryview).
struct Piece {
  const void* data;
  size_t size;
};

Piece PieceOf(const py::handle& obj, std::vector<py::buffer_info>& keep) {
  if (THPVariable_Check(obj.ptr())) {
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (!t.device().is_cpu() || !t.is_contiguous())
      throw py::value_error("write a contiguous CPU tensor (call .cpu().contiguous() first)");
    return {t.data_ptr(), t.nbytes()};
  }
  keep.push_back(py::reinterpret_borrow<py::buffer>(obj).request());
  const py::buffer_info& b = keep.back();
  return {b.ptr, static_cast<size_t>(b.size * b.itemsize)};
}

// Writes `pieces` one after another as object `name` of `target` (a
// PendingCheckpoint or a StripeWriter), with the GIL released; returns
// each piece's (offset, length) in the object.
template <typename Target>
std::vector<std::pair<uint64_t, uint64_t>> WriteObject(Target& target, const std::string& name,
                                                       const py::list& pieces) {
  std::vector<py::buffer_info> keep;
  std::vector<Piece> bytes;
  for (const py::handle& p : pieces) bytes.push_back(PieceOf(p, keep));
  std::vector<std::pair<uint64_t, uint64_t>> at;
  Status s;
  {
    py::gil_scoped_release release;
    s = [&]() -> Status {
      CKPTIO_ASSIGN_OR_RETURN(auto stream, target.AddObject(name));
      uint64_t offset = 0;
      for (const Piece& p : bytes) {
        CKPTIO_RETURN_IF_ERROR(stream->Write(p.data, p.size));
        at.emplace_back(offset, p.size);
        offset += p.size;
      }
      return stream->Close();
    }();
  }
  Check(s);
  return at;
}

// The writer's side of a step: the store's writer lock (held while this
// lives), the pending step, the stripes' receipts, the commit. Dropped
// uncommitted, the step is abandoned (its directory cleared).
class PyPendingStep {
 public:
  PyPendingStep(std::unique_ptr<StoreWriter> writer, std::unique_ptr<PendingCheckpoint> pending)
      : writer_(std::move(writer)), pending_(std::move(pending)) {}
  PyPendingStep(PyPendingStep&&) = default;  // (returned to Python by value)
  ~PyPendingStep() {
    py::gil_scoped_release release;
    pending_.reset();
    writer_.reset();
  }

  int64_t step() const { return Live().step(); }
  std::vector<std::pair<uint64_t, uint64_t>> Write(const std::string& name,
                                                   const py::list& pieces) {
    return WriteObject(Live(), name, pieces);
  }
  void SetMetadata(const std::string& key, const std::string& value) {
    Check(Live().SetMetadata(key, value));
  }
  // (Live() before the GIL goes: it may raise.)
  void AddStripe(const py::bytes& receipt) {
    const StripeReceipt parsed =
        Value(ParseStripeReceipt(std::string(receipt), "a stripe receipt"));
    PendingCheckpoint& pending = Live();
    Check(Released([&] { return pending.AddStripe(parsed); }));  // (it stats the stripe's objects)
  }
  void Commit() {
    PendingCheckpoint& pending = Live();
    (void)Value(Released([&] { return pending.Commit(); }));
    pending_.reset();
    writer_.reset();  // the lock goes with it
  }
  void Abandon() {
    py::gil_scoped_release release;
    pending_.reset();
    writer_.reset();
  }

 private:
  PendingCheckpoint& Live() const {
    if (!pending_) Raise(Status(Code::kFailedPrecondition, "the step was committed or abandoned"));
    return *pending_;
  }
  std::unique_ptr<StoreWriter> writer_;
  std::unique_ptr<PendingCheckpoint> pending_;
};

// Another rank's objects of a pending step; finish() gives the receipt the
// writer adds (every object is durable by then).
class PyStripe {
 public:
  explicit PyStripe(std::unique_ptr<StripeWriter> stripe) : stripe_(std::move(stripe)) {}
  PyStripe(PyStripe&&) = default;  // (returned to Python by value)
  ~PyStripe() {
    py::gil_scoped_release release;
    stripe_.reset();
  }
  std::vector<std::pair<uint64_t, uint64_t>> Write(const std::string& name,
                                                   const py::list& pieces) {
    return WriteObject(*stripe_, name, pieces);
  }
  py::bytes Finish() {
    auto receipt = Value(Released([&] { return stripe_->Finish(); }));
    return py::bytes(SerializeStripeReceipt(receipt));
  }

 private:
  std::unique_ptr<StripeWriter> stripe_;
};

// A committed step (its manifest checked); every byte returned verified.
// Python threads may share one: the reads, made without the GIL, take turns
// (a CheckpointReader is for one thread at a time: its scratch buffer).
class PyStepReader {
 public:
  explicit PyStepReader(std::unique_ptr<CheckpointReader> reader) : reader_(std::move(reader)) {}
  int64_t step() const { return reader_->step(); }
  std::map<std::string, std::string> Metadata() const { return reader_->manifest().metadata; }
  py::bytes ReadAll(const std::string& name) {
    auto got = Value(Released([&] {
      std::lock_guard<std::mutex> turn(*mu_);
      return reader_->ReadAll(name);
    }));
    return py::bytes(got);
  }
  // Bytes [offset, offset + size) of `name` in a new uint8 CPU tensor,
  // every chunk they touch verified.
  at::Tensor Read(const std::string& name, uint64_t offset, uint64_t size) {
    // An unknown object or a range outside it is refused before anything
    // is allocated.
    Check(reader_->CheckRange(name, offset, size));
    at::Tensor out = at::empty({static_cast<int64_t>(size)}, at::kByte);
    Check(Released([&] {
      std::lock_guard<std::mutex> turn(*mu_);
      return reader_->Read(name, offset, out.data_ptr(), size);
    }));
    return out;
  }

 private:
  std::unique_ptr<CheckpointReader> reader_;
  std::unique_ptr<std::mutex> mu_ = std::make_unique<std::mutex>();  // (movable)
};

class PyStore {
 public:
  explicit PyStore(const std::string& uri) {
    auto opened = Value(Released([&] { return OpenStore(uri); }));
    store_ = std::move(opened);
  }
  std::string uri() const { return store_->uri(); }
  int64_t NextStep() {
    auto next = Value(Released([&] { return store_->NextStep(); }));
    return next;
  }
  // Takes the writer lock (waiting up to lock_wait_s; Ctrl-C ends the wait)
  // and begins `step` (clearing a torn attempt at it).
  PyPendingStep Begin(int64_t step, int keep_last, double lock_wait_s, int world_size) {
    WriterOptions o;
    o.keep_last = keep_last;
    o.lock_wait = TimeoutArg(lock_wait_s, "lock_wait");
    o.world_size = world_size;
    auto writer = Value(Interruptible([&] { return store_->OpenWriter(o); }));
    auto pending = Value(Released([&] { return writer->Begin(step); }));
    pending->ExpectStripes();
    return PyPendingStep(std::move(writer), std::move(pending));
  }
  PyStripe BeginStripe(int64_t step, int rank) {
    auto stripe = Value(Released([&] { return store_->BeginStripe(step, rank); }));
    return PyStripe(std::move(stripe));
  }
  PyStepReader OpenStep(int64_t step) {
    auto reader = Value(Released([&] { return store_->OpenStep(step); }));
    return PyStepReader(std::move(reader));
  }
  // The newest step that verifies (Store::ChooseStep: every byte read and
  // checked, none kept), each newer one it skips logged; NotFound when
  // nothing is saved yet.
  int64_t NewestGood() {
    auto choice = Value(Released([&] { return store_->ChooseStep(std::nullopt); }));
    if (!choice) Raise(Status(Code::kNotFound, "nothing saved in " + store_->uri() + " yet"));
    for (const auto& [step, why] : choice->skipped)
      Log(LogLevel::kWarning, SkippedStepWarning(step, choice->step, why));
    return choice->step;
  }
  // The store's committed keys under `prefix` (tools and tests: what a
  // save has committed so far, on any backend).
  std::vector<std::string> Keys(const std::string& prefix) {
    auto keys = Value(Released([&] { return store_->backend().List(prefix); }));
    return keys;
  }

 private:
  std::unique_ptr<Store> store_;
};

}  // namespace

void BindStore(py::module_& m) {
  py::class_<PyPendingStep>(m, "PendingStep")
      .def_property_readonly("step", &PyPendingStep::step)
      .def("write", &PyPendingStep::Write, py::arg("name"), py::arg("pieces"))
      .def("set_metadata", &PyPendingStep::SetMetadata, py::arg("key"), py::arg("value"))
      .def("add_stripe", &PyPendingStep::AddStripe, py::arg("receipt"))
      .def("commit", &PyPendingStep::Commit)
      .def("abandon", &PyPendingStep::Abandon);
  py::class_<PyStripe>(m, "Stripe")
      .def("write", &PyStripe::Write, py::arg("name"), py::arg("pieces"))
      .def("finish", &PyStripe::Finish);
  py::class_<PyStepReader>(m, "StepReader")
      .def_property_readonly("step", &PyStepReader::step)
      .def_property_readonly("metadata", &PyStepReader::Metadata)
      .def("read_all", &PyStepReader::ReadAll, py::arg("name"))
      .def("read", &PyStepReader::Read, py::arg("name"), py::arg("offset"), py::arg("size"));
  py::class_<PyStore>(m, "Store")
      .def(py::init<const std::string&>(), py::arg("uri"))
      .def_property_readonly("uri", &PyStore::uri)
      .def("next_step", &PyStore::NextStep)
      .def("begin", &PyStore::Begin, py::arg("step"), py::arg("keep_last"), py::arg("lock_wait"),
           py::arg("world_size"))
      .def("begin_stripe", &PyStore::BeginStripe, py::arg("step"), py::arg("rank"))
      .def("open_step", &PyStore::OpenStep, py::arg("step"))
      .def("newest_good", &PyStore::NewestGood)
      .def("keys", &PyStore::Keys, py::arg("prefix") = "");
  // For an argument kept to be used later (StorageWriter's lock_wait): the
  // check `begin` makes, made when it is given.
  m.def(
      "check_wait",
      [](double seconds, const std::string& name) { TimeoutArg(seconds, name.c_str()); },
      py::arg("seconds"), py::arg("name"));
}

}  // namespace ckptio::python
