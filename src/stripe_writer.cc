// Striped saves: each rank writes its part of a step's objects and sends
// rank 0 a receipt (a partial manifest), which rank 0 adds to the commit.
#include <algorithm>

#include "store_internal.h"

namespace ckptio {

Status PendingCheckpoint::AddStripe(const StripeReceipt& receipt) {
  State& st = *state_;
  StorageBackend& backend = *st.core->backend;
  const std::string what =
      "rank " + std::to_string(receipt.rank) + "'s stripe of step " + std::to_string(st.step);
  if (st.finished)
    return Status(Code::kFailedPrecondition,
                  what + ": the step was already committed or abandoned");
  if (receipt.step != st.step)
    return Status(Code::kInvalidArgument,
                  what + ": the receipt is for step " + std::to_string(receipt.step));
  for (const ObjectEntry& o : receipt.objects) {
    CKPTIO_RETURN_IF_ERROR(ValidateObjectName(o.name).WithContext(what));
    if (st.names.count(o.name))
      return Status(Code::kInvalidArgument,
                    what + ": object \"" + o.name + "\" is already in the step");
    auto info = backend.Stat(st.objects + o.name);
    if (!info.ok()) {
      if (info.status().code() != Code::kNotFound) return info.status().WithContext(what);
      return Status(Code::kDataLoss, what + ": object " + o.name + " is not in " + backend.Uri() +
                                         "/" + st.objects +
                                         " (its writer died, or the step was "
                                         "cleared after the stripe was written)");
    }
    if (info->size != o.size)
      return Status(Code::kDataLoss, what + ": object " + o.name + " has " +
                                         std::to_string(info->size) + " bytes, the receipt says " +
                                         std::to_string(o.size));
  }
  for (const ObjectEntry& o : receipt.objects) {
    st.names.insert(o.name);
    st.manifest.objects.push_back(o);
  }
  for (const TensorEntry& t : receipt.tensors) st.manifest.tensors.push_back(t);
  return OkStatus();
}

std::string SerializeStripeReceipt(const StripeReceipt& r) {
  // A receipt is the partial manifest of one rank.
  Manifest m;
  m.step = r.step;
  m.generation = 1;
  m.world_size = r.rank + 1;
  m.saving_rank = r.rank;
  m.objects = r.objects;
  m.tensors = r.tensors;
  m.metadata["ckptio.stripe"] = "receipt";
  return SerializeManifest(m);
}

Result<StripeReceipt> ParseStripeReceipt(std::string_view bytes, std::string_view where) {
  CKPTIO_ASSIGN_OR_RETURN(Manifest m, ParseManifest(bytes, where));
  auto kind = m.metadata.find("ckptio.stripe");
  if (kind == m.metadata.end() || kind->second != "receipt")
    return Status(Code::kDataLoss, std::string(where) + ": not a stripe receipt");
  StripeReceipt r;
  r.step = m.step;
  r.rank = static_cast<int>(m.saving_rank);
  r.objects = std::move(m.objects);
  r.tensors = std::move(m.tensors);
  return r;
}

StripeWriter::StripeWriter(std::unique_ptr<PendingCheckpoint::State> state, int rank)
    : state_(std::move(state)), rank_(rank) {}

StripeWriter::~StripeWriter() {
  PendingCheckpoint::State& st = *state_;
  if (st.committed || st.manifest.objects.empty()) return;
  // Deletes only the objects it made (closed), and only while the step is
  // still the save of the writer it began under and has no manifest: this
  // writer may be a stalled rank of an earlier launch, and its names by now
  // another writer's. Anything left is a torn step, which that writer
  // clears when it abandons the step (a failed stripe fails its save).
  StorageBackend& backend = *st.core->backend;
  if (st.core->generation < 0 || !st.core->CheckFence().ok()) return;
  auto manifest = backend.Stat(ManifestKey(st.step));
  if (manifest.ok() || manifest.status().code() != Code::kNotFound) return;
  for (const auto& o : st.manifest.objects) (void)backend.Delete(st.objects + o.name);
}

int64_t StripeWriter::step() const { return state_->step; }

Result<std::unique_ptr<ObjectStream>> StripeWriter::AddObject(std::string_view name) {
  return PendingCheckpoint::AddObjectTo(*state_, name);
}

void StripeWriter::AddTensor(TensorEntry tensor) {
  state_->manifest.tensors.push_back(std::move(tensor));
}

Result<StripeReceipt> StripeWriter::Finish() {
  PendingCheckpoint::State& st = *state_;
  const std::string what =
      "rank " + std::to_string(rank_) + "'s stripe of step " + std::to_string(st.step);
  if (st.finished) return Status(Code::kFailedPrecondition, what + ": already finished");
  if (st.open_streams > 0)
    return Status(Code::kFailedPrecondition,
                  what + ": " + std::to_string(st.open_streams) + " object stream(s) still open");
  st.finished = true;
  if (!st.failure.ok()) return st.failure.WithContext(what);
  StripeReceipt r;
  r.step = st.step;
  r.rank = rank_;
  r.objects = st.manifest.objects;
  std::sort(r.objects.begin(), r.objects.end(),
            [](const ObjectEntry& a, const ObjectEntry& b) { return a.name < b.name; });
  r.tensors = st.manifest.tensors;
  // What the writer would refuse at its commit, refused here.
  CKPTIO_RETURN_IF_ERROR(
      ParseStripeReceipt(SerializeStripeReceipt(r), what).status().WithContext(what));
  st.committed = true;  // the objects are the writer's now
  return r;
}

Result<std::unique_ptr<StripeWriter>> Store::BeginStripe(int64_t step, int rank,
                                                         uint64_t chunk_size) {
  if (step < 0 || step > kMaxStep)
    return Status(Code::kInvalidArgument,
                  "step " + std::to_string(step) + " is outside [0, 999999999999]");
  if (rank < 1)
    return Status(Code::kInvalidArgument, "stripes are written by ranks other than the writer (0)");
  if (chunk_size < kMinChunkBytes || chunk_size > kMaxChunkBytes)
    return Status(Code::kInvalidArgument,
                  "chunk_size " + std::to_string(chunk_size) + " is outside the supported range");
  auto manifest = backend_->Stat(ManifestKey(step));
  if (manifest.ok())
    return Status(Code::kAlreadyExists,
                  "step " + std::to_string(step) + " is already committed in " + backend_->Uri());
  if (manifest.status().code() != Code::kNotFound) return manifest.status();
  auto core = std::make_shared<WriterCore>();
  core->backend = backend_;
  core->options.chunk_size = chunk_size;
  auto writer = LoadWriterRecord(*backend_);  // whose save this is (see ~StripeWriter)
  core->generation = writer.ok() ? writer->generation : -1;
  if (writer.ok()) core->me = *writer;
  if (backend_->LocksAreLeases()) {
    // The parts go in the writer's objects folder, named by its record.
    if (!writer.ok())
      return writer.status().WithContext("rank " + std::to_string(rank) + "'s stripe of step " +
                                         std::to_string(step) + ": reading the writer's record");
    core->objects_folder = ObjectsFolderOf(*writer);
  }
  auto st = std::make_unique<PendingCheckpoint::State>();
  st->core = std::move(core);
  st->step = step;
  st->dir = StepDirName(step) + "/";
  st->objects =
      st->core->objects_folder.empty() ? st->dir : st->dir + st->core->objects_folder + "/";
  return std::unique_ptr<StripeWriter>(new StripeWriter(std::move(st), rank));
}
}  // namespace ckptio
