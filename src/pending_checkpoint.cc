// Writing a checkpoint: objects stream to the backend while they are
// hashed (step 3 of store.h's protocol), then the commit: the fence, the
// manifest created exclusively, LATEST, retention (steps 4-6).
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "ckptio/safetensors.h"
#include "copy.h"
#include "object_io.h"
#include "store_internal.h"

namespace ckptio {

namespace {
// Runs one I/O function at a time on a thread of its own (started on first
// use) while the caller computes: a save hashes a buffer while the same
// buffer is being written.
class Overlap {
 public:
  ~Overlap() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Runs io() on the helper thread and compute() here; io's status once
  // both have finished. Where no thread can be started, one after the other.
  Status Run(const std::function<Status()>& io, const std::function<void()>& compute) {
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { Loop(); });
      } catch (const std::exception&) {  // std::system_error, std::bad_alloc
        compute();
        return io();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      io_ = &io;
      done_ = false;
    }
    cv_.notify_all();
    compute();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return result_;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return quit_ || io_ != nullptr; });
      if (io_ == nullptr) return;  // quit
      const std::function<Status()>* io = io_;
      lock.unlock();
      Status s = (*io)();
      lock.lock();
      io_ = nullptr;
      result_ = std::move(s);
      done_ = true;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<Status()>* io_ = nullptr;
  Status result_;
  bool done_ = false;
  bool quit_ = false;
  std::thread thread_;
};

// Writes at least this large hash on the caller's thread while they are written.
constexpr size_t kOverlapBytes = 1 << 20;
}  // namespace

struct ObjectStream::State {
  PendingCheckpoint::State* owner = nullptr;
  Overlap overlap;
  std::unique_ptr<ObjectWriter> writer;
  ObjectEntry entry;
  Hasher whole;
  Hasher chunk;
  uint64_t in_chunk = 0;
  bool closed = false;
  bool dead = false;

  void Die(const Status& why) {
    if (!dead) owner->Fail(why.WithContext("object " + entry.name));
    dead = true;
  }
};

ObjectStream::ObjectStream(std::unique_ptr<State> state) : state_(std::move(state)) {}

ObjectStream::~ObjectStream() {
  State& st = *state_;
  if (st.closed) return;
  --st.owner->open_streams;
  // An object dropped without Close() must not vanish from a commit.
  if (!st.dead)
    st.owner->Fail(Status(Code::kFailedPrecondition,
                          "object " + st.entry.name + " was abandoned without Close()"));
}

Status ObjectStream::Write(const void* data, size_t size) {
  State& st = *state_;
  if (st.dead || st.closed)
    return Status(Code::kFailedPrecondition,
                  "object " + st.entry.name + " is closed or failed earlier");
  if (st.entry.size + size > kMaxObjectBytes) {
    Status s(Code::kInvalidArgument, "exceeds 256 TiB");
    st.Die(s);
    return s;
  }
  auto hash = [&] {
    const char* p = static_cast<const char*>(data);
    const uint64_t cs = st.entry.chunk_size;
    for (size_t left = size; left > 0;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, cs - st.in_chunk));
      st.chunk.Update(p + (size - left), n);
      st.whole.Update(p + (size - left), n);  // while the piece is in cache
      st.in_chunk += n;
      left -= n;
      if (st.in_chunk == cs) {
        st.entry.chunks.push_back(st.chunk.Digest());
        st.chunk.Reset();
        st.in_chunk = 0;
      }
    }
  };
  Status s;
  if (size >= kOverlapBytes) {
    s = st.overlap.Run([&] { return st.writer->Append(data, size); }, hash);
  } else {
    hash();
    s = st.writer->Append(data, size);
  }
  st.entry.size += size;
  if (!s.ok()) st.Die(s);
  return s;
}

Status ObjectStream::Close() {
  State& st = *state_;
  if (st.dead || st.closed)
    return Status(Code::kFailedPrecondition,
                  "object " + st.entry.name + " is closed or failed earlier");
  if (st.in_chunk > 0) st.entry.chunks.push_back(st.chunk.Digest());
  st.entry.hash = st.whole.Digest();
  Status s = st.writer->Commit();
  if (!s.ok()) {
    st.Die(s);
    return s;
  }
  st.closed = true;
  --st.owner->open_streams;
  st.owner->manifest.objects.push_back(st.entry);
  return OkStatus();
}

PendingCheckpoint::PendingCheckpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}

PendingCheckpoint::~PendingCheckpoint() {
  State& st = *state_;
  // Abandon: remove what this attempt wrote, only while we are still the
  // store's writer (a fenced writer's names may by now belong to its
  // successor's committed step), and only while no manifest can be there:
  // a commit whose outcome is unknown (the manifest's commit failed, yet it
  // may have taken effect) is left whole, or torn for fsck.
  if (!st.committed && st.core->CheckFence().ok()) {
    StorageBackend& backend = *st.core->backend;
    bool no_manifest = !st.manifest_tried && !st.striped;
    if (!no_manifest) {
      auto manifest = backend.Stat(st.dir + std::string(kManifestName));
      no_manifest = !manifest.ok() && manifest.status().code() == Code::kNotFound;
    }
    if (no_manifest) {
      for (const auto& name : st.names) (void)backend.Delete(st.objects + name);
      // A striped step may also hold parts of ranks whose receipts never
      // arrived: none of it can be visible, so clear all of this writer's
      // (only its own folder where locks are leases: see Begin).
      if (st.striped) {
        auto keys = backend.List(st.objects);
        if (keys.ok())
          for (const auto& key : *keys) (void)backend.Delete(key);
      }
    }
  }
  st.core->pending = false;
}

int64_t PendingCheckpoint::step() const { return state_->step; }

Result<std::unique_ptr<ObjectStream>> PendingCheckpoint::AddObject(std::string_view name) {
  return AddObjectTo(*state_, name);
}

Result<std::unique_ptr<ObjectStream>> PendingCheckpoint::AddObjectTo(State& st,
                                                                     std::string_view name) {
  if (st.finished)
    return Status(Code::kFailedPrecondition,
                  "step " + std::to_string(st.step) + " was already committed or abandoned");
  CKPTIO_RETURN_IF_ERROR(ValidateObjectName(name));
  if (st.names.size() >= kMaxObjects)
    return Status(Code::kInvalidArgument, "a checkpoint holds at most 100000 objects");
  if (!st.names.emplace(name).second)
    return Status(Code::kInvalidArgument, "object \"" + std::string(name) +
                                              "\" was already added to step " +
                                              std::to_string(st.step));
  auto writer =
      st.core->backend->NewObject(st.objects + std::string(name), WriteMode::kCreateExclusive);
  if (!writer.ok()) {
    st.Fail(writer.status().WithContext("object " + std::string(name)));
    return writer.status();
  }
  auto os = std::make_unique<ObjectStream::State>();
  os->owner = &st;
  os->writer = std::move(*writer);
  os->entry.name = std::string(name);
  os->entry.chunk_size = st.core->options.chunk_size;
  ++st.open_streams;
  return std::unique_ptr<ObjectStream>(new ObjectStream(std::move(os)));
}

Status PendingCheckpoint::PutObject(std::string_view name, const void* data, size_t size) {
  CKPTIO_ASSIGN_OR_RETURN(auto stream, AddObject(name));
  CKPTIO_RETURN_IF_ERROR(stream->Write(data, size));
  return stream->Close();
}

Status PendingCheckpoint::SetMetadata(std::string key, std::string value) {
  CKPTIO_RETURN_IF_ERROR(ValidateMetadata(key, value));
  if (key == kObjectsFolderKey)
    return Status(Code::kInvalidArgument,
                  std::string("metadata key \"") + kObjectsFolderKey + "\" is the store's own");
  if (state_->manifest.metadata.size() >= kMaxMetadataEntries &&
      !state_->manifest.metadata.count(key))
    return Status(Code::kInvalidArgument, "at most 10000 metadata entries");
  state_->manifest.metadata[std::move(key)] = std::move(value);
  return OkStatus();
}

void PendingCheckpoint::ExpectStripes() { state_->striped = true; }

void PendingCheckpoint::AddTensor(TensorEntry tensor) {
  state_->manifest.tensors.push_back(std::move(tensor));
}

namespace {
// Objects checked at once by CheckObjects: each check is a round trip or
// two on a remote store (a HEAD, or the GET that opens an object), which
// would otherwise add up one after another at every commit.
constexpr unsigned kCheckThreads = 8;

// Object `e` of `m`, looked up in `dir` just before the manifest names it:
// there, of its recorded size (stripes were written by other ranks; where
// locks are leases, a writer that lost its lease could have cleared it),
// DataLoss otherwise. An object that holds tensors is read back too: its
// safetensors header must agree with the manifest's entries, as every load
// checks (InvalidArgument otherwise: a reader would reject the step, yet
// retention would count it as good).
Status CheckObject(StorageBackend& backend, const std::string& dir, const Manifest& m,
                   const ObjectEntry& e, bool holds_tensors) {
  const std::string key = dir + e.name;
  auto missing = [&](const Status& s) -> Status {
    if (s.code() != Code::kNotFound) return s;
    return Status(Code::kDataLoss, "object " + key + " is not in " + backend.Uri() +
                                       " (its writer died, or the step was cleared after it "
                                       "was written)");
  };
  auto wrong_size = [&](uint64_t size) {
    return Status(Code::kDataLoss, "object " + key + " in " + backend.Uri() + " holds " +
                                       std::to_string(size) + " bytes, not the " +
                                       std::to_string(e.size) + " written");
  };
  if (!holds_tensors) {
    auto info = backend.Stat(key);
    if (!info.ok()) return missing(info.status());
    if (info->size != e.size) return wrong_size(info->size);
    return OkStatus();
  }
  auto reader = backend.OpenObject(key);
  if (!reader.ok()) return missing(reader.status());
  const uint64_t size = (*reader)->Size();
  if (size != e.size) return wrong_size(size);
  std::string header(std::min<uint64_t>(size, 8), '\0');
  CKPTIO_RETURN_IF_ERROR((*reader)->ReadAt(0, header.data(), header.size()));
  Status s = OkStatus();
  if (auto n = SafetensorsHeaderSize(header, size, key); !n.ok()) {
    s = n.status();
  } else {
    header.resize(*n);
    CKPTIO_RETURN_IF_ERROR((*reader)->ReadAt(0, header.data(), header.size()));
    s = CheckSafetensorsObject(m, e.name, header);
  }
  if (!s.ok())
    return Status(Code::kInvalidArgument,
                  "the checkpoint is inconsistent: its tensor entries disagree with object " +
                      e.name + ": " + s.message());
  return OkStatus();
}

// Every object of `m` checked by CheckObject, up to kCheckThreads at once;
// the first that fails in name order is the one reported.
Status CheckObjects(StorageBackend& backend, const std::string& dir, const Manifest& m) {
  std::set<std::string_view> with_tensors;
  for (const TensorEntry& t : m.tensors) with_tensors.insert(t.object);
  return FirstFailure(m.objects.size(), kCheckThreads, [&](size_t i) {
    const ObjectEntry& e = m.objects[i];
    return CheckObject(backend, dir, m, e, with_tensors.count(e.name) > 0);
  });
}
}  // namespace

Result<CommitInfo> PendingCheckpoint::Commit() {
  State& st = *state_;
  WriterCore& core = *st.core;
  StorageBackend& backend = *core.backend;
  const std::string what = "commit of step " + std::to_string(st.step) + " to " + backend.Uri();
  if (st.finished)
    return Status(Code::kFailedPrecondition, what + ": already committed or abandoned");
  if (st.open_streams > 0)
    return Status(Code::kFailedPrecondition,
                  what + ": " + std::to_string(st.open_streams) +
                      " object stream(s) still open; Close() each before Commit()");
  st.finished = true;
  if (!st.failure.ok()) return st.failure.WithContext(what + ": the checkpoint was abandoned");

  // 4. The manifest, created exclusively, commits the step.
  Manifest& m = st.manifest;
  std::sort(m.objects.begin(), m.objects.end(),
            [](const ObjectEntry& a, const ObjectEntry& b) { return a.name < b.name; });
  m.step = st.step;
  m.generation = core.generation;
  m.world_size = core.options.world_size;
  m.saving_rank = core.options.saving_rank;
  m.created_unix_ms = NowUnixMs();
  m.writer = HostName() + ":" + std::to_string(::getpid());
  // Never commit a manifest that readers would reject (e.g. a tensor entry
  // outside its object).
  auto serialized = SerializeCheckedManifest(m, ManifestKey(st.step));
  if (!serialized.ok())
    return serialized.status().code() == Code::kResourceExhausted
               ? serialized.status().WithContext(what)
               : Status(Code::kInvalidArgument, what + ": the checkpoint is inconsistent: " +
                                                    serialized.status().message());
  const Status objects = CheckObjects(backend, st.objects, m);
  // Being fenced explains an object that went, too.
  CKPTIO_RETURN_IF_ERROR(core.CheckFence().WithContext(what));
  CKPTIO_RETURN_IF_ERROR(objects.WithContext(what));
  const std::string& bytes = *serialized;
  st.manifest_tried = true;
  CKPTIO_RETURN_IF_ERROR(
      WriteSmall(backend, st.dir + std::string(kManifestName), bytes, WriteMode::kCreateExclusive)
          .WithContext(what));
  st.committed = true;

  CommitInfo info;
  info.step = st.step;
  info.generation = core.generation;
  info.manifest_hash = HashBytes(bytes);
  info.bytes = m.TotalBytes();
  // Written by the checked serializer, these bytes parse back to `m`.
  RememberSummary(backend, st.step, info.manifest_hash, m);

  // 5. LATEST names the highest committed step.
  auto latest = LoadLatest(backend);
  if (!latest.ok() && latest.status().code() != Code::kDataLoss)
    return latest.status().WithContext("step " + std::to_string(st.step) +
                                       " is committed but LATEST could not be read, so it was "
                                       "not updated (run `ckptio fsck --repair`)");
  if (!latest.ok() || !latest->has_value() || (*latest)->step <= st.step) {
    Status s = core.CheckFence();
    if (s.ok())
      s = WriteSmall(backend, kLatestKey,
                     SerializeLatest({st.step, core.generation, info.manifest_hash}),
                     WriteMode::kReplace);
    if (!s.ok())
      return s.WithContext("step " + std::to_string(st.step) +
                           " is committed but LATEST was not updated (run `ckptio fsck "
                           "--repair` to repoint it)");
    info.latest_updated = true;
  }

  // 6. Retention.
  if (core.options.keep_last > 0) {
    auto retired = core.CollectGarbage(core.options.keep_last, st.step, {});
    if (retired.ok()) {
      info.retired = std::move(retired->deleted);
    } else {
      info.retention = retired.status();
    }
  }
  return info;
}
}  // namespace ckptio
