// The commit protocol (numbered in store.h), reading and verification.
#include "ckptio/store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "ckptio/safetensors.h"
#include "copy.h"
#include "object_io.h"
#include "text.h"

namespace ckptio {

namespace {

std::string BaseName(std::string_view key) {
  size_t slash = key.rfind('/');
  return std::string(slash == std::string_view::npos ? key : key.substr(slash + 1));
}

// A temp object where ckptio writes: the top level, a step folder or
// .coord/. Anything deeper or elsewhere is not ours to sweep.
bool IsTempKey(std::string_view key) {
  if (BaseName(key).compare(0, kTempMarker.size(), kTempMarker) != 0) return false;
  const size_t slash = key.find('/');
  if (slash == std::string_view::npos) return true;
  const std::string_view dir = key.substr(0, slash);
  return key.find('/', slash + 1) == std::string_view::npos &&
         (dir.rfind("step-", 0) == 0 || dir == ".coord");
}

std::string ManifestKey(int64_t step) {
  return StepDirName(step) + "/" + std::string(kManifestName);
}

struct LoadedManifest {
  Manifest manifest;
  Hash128 hash;  // of the MANIFEST.json bytes
};

Result<std::string> ReadManifestBytes(StorageBackend& backend, int64_t step) {
  const std::string key = ManifestKey(step);
  auto bytes = ReadSmall(backend, key, kMaxManifestBytes);
  if (!bytes.ok() && bytes.status().code() == Code::kNotFound)
    return Status(Code::kNotFound, "step " + std::to_string(step) + " is not committed in " +
                                       backend.Uri() + " (no " + key + ")");
  return bytes;
}

// The manifest of `step`, from its bytes, checked (DataLoss naming the file).
Result<Manifest> ParseManifestOf(const StorageBackend& backend, int64_t step,
                                 std::string_view bytes) {
  const std::string where = backend.Uri() + "/" + ManifestKey(step);
  CKPTIO_ASSIGN_OR_RETURN(Manifest m, ParseManifest(bytes, where));
  if (m.step != step)
    return Status(Code::kDataLoss, where + ": manifest records step " + std::to_string(m.step) +
                                       ", its directory says " + std::to_string(step));
  return m;
}

Result<LoadedManifest> LoadManifest(StorageBackend& backend, int64_t step) {
  CKPTIO_ASSIGN_OR_RETURN(std::string bytes, ReadManifestBytes(backend, step));
  CKPTIO_ASSIGN_OR_RETURN(Manifest m, ParseManifestOf(backend, step, bytes));
  return LoadedManifest{std::move(m), HashBytes(bytes)};
}

// What ListSteps needs of a manifest: the outcome of parsing it, and two
// fields. Remembered by the store, step and hash of the bytes: the same bytes
// always parse the same way, so a remembered answer is exact, and bytes that
// changed (damage) are parsed afresh. With retention every save lists the
// retained steps; parsing each again took 20 ms a manifest of 10,000 tensors.
struct ManifestSummary {
  Status status;  // OK, or why the step is not committed
  uint64_t bytes = 0;
  int64_t created_unix_ms = 0;
};

class ManifestSummaries {
 public:
  static std::string Key(const StorageBackend& backend, int64_t step, const Hash128& bytes_hash) {
    return backend.Uri() + '\0' + std::to_string(step) + '\0' + bytes_hash.Hex();
  }
  std::optional<ManifestSummary> Find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seen_.find(key);
    return it == seen_.end() ? std::nullopt : std::optional<ManifestSummary>(it->second);
  }
  void Remember(const std::string& key, ManifestSummary summary) {
    std::lock_guard<std::mutex> lock(mu_);
    if (seen_.size() >= 4096) seen_.clear();  // bounded; a miss only costs a parse
    seen_.insert_or_assign(key, std::move(summary));
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, ManifestSummary> seen_;
};

ManifestSummaries& Summaries() {
  static auto* summaries = new ManifestSummaries;  // never destroyed: used until exit
  return *summaries;
}

ManifestSummary SummaryOf(const Manifest& m) {
  ManifestSummary summary;
  summary.bytes = m.TotalBytes();
  summary.created_unix_ms = m.created_unix_ms;
  return summary;
}

Result<ManifestSummary> SummarizeManifest(StorageBackend& backend, int64_t step) {
  auto read = ReadManifestBytes(backend, step);
  // A manifest that cannot be read whole (over the size limit, shorter than
  // its size) is a damaged step, like one that does not parse.
  if (!read.ok() && read.status().code() == Code::kDataLoss) return ManifestSummary{read.status()};
  CKPTIO_ASSIGN_OR_RETURN(std::string bytes, std::move(read));
  const std::string key = ManifestSummaries::Key(backend, step, HashBytes(bytes));
  if (auto known = Summaries().Find(key)) return *known;
  auto m = ParseManifestOf(backend, step, bytes);
  ManifestSummary summary = m.ok() ? SummaryOf(*m) : ManifestSummary{m.status()};
  Summaries().Remember(key, summary);
  return summary;
}

Result<std::optional<Latest>> LoadLatest(StorageBackend& backend) {
  auto bytes = ReadSmall(backend, kLatestKey, kMaxLatestBytes);
  if (!bytes.ok()) {
    if (bytes.status().code() == Code::kNotFound) return std::optional<Latest>();
    return bytes.status();
  }
  CKPTIO_ASSIGN_OR_RETURN(Latest l,
                          ParseLatest(*bytes, backend.Uri() + "/" + std::string(kLatestKey)));
  return std::optional<Latest>(l);
}

Result<WriterRecord> LoadWriterRecord(StorageBackend& backend) {
  CKPTIO_ASSIGN_OR_RETURN(std::string bytes, ReadSmall(backend, kWriterKey, kMaxLatestBytes));
  return ParseWriterRecord(bytes, backend.Uri() + "/" + std::string(kWriterKey));
}

// Deletes a step so that a crash part-way leaves it torn, never committed
// with objects missing: the manifest goes first.
Status DeleteStep(StorageBackend& backend, int64_t step) {
  Status s = backend.Delete(ManifestKey(step));
  if (!s.ok() && s.code() != Code::kNotFound) return s;
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend.List(StepDirName(step) + "/"));
  for (const auto& key : keys) {
    s = backend.Delete(key);
    if (!s.ok() && s.code() != Code::kNotFound) return s;
  }
  return OkStatus();
}

// Keys grouped by step directory; other keys are ignored.
Result<std::map<int64_t, std::vector<std::string>>> KeysByStep(StorageBackend& backend) {
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend.List(""));
  std::map<int64_t, std::vector<std::string>> out;
  for (auto& key : keys) {
    size_t slash = key.find('/');
    if (slash == std::string::npos) continue;
    int64_t step = ParseStepDirName(std::string_view(key).substr(0, slash));
    if (step >= 0) out[step].push_back(key.substr(slash + 1));
  }
  return out;
}

}  // namespace

std::string_view StepStateName(StepState s) {
  switch (s) {
    case StepState::kCommitted:
      return "committed";
    case StepState::kTorn:
      return "torn";
    case StepState::kCorrupt:
      return "corrupt";
    case StepState::kUnsupported:
      return "unsupported";
  }
  return "unknown";
}

std::string_view FsckKindName(FsckProblem::Kind k) {
  switch (k) {
    case FsckProblem::Kind::kStaleTemp:
      return "stale-temp";
    case FsckProblem::Kind::kTornStep:
      return "torn-step";
    case FsckProblem::Kind::kCorruptStep:
      return "corrupt-step";
    case FsckProblem::Kind::kBadLatest:
      return "bad-latest";
  }
  return "unknown";
}

// ---------------------------------------------------------------- reading

CheckpointReader::CheckpointReader(std::shared_ptr<StorageBackend> backend, Manifest manifest,
                                   Hash128 manifest_hash)
    : backend_(std::move(backend)), manifest_(std::move(manifest)), manifest_hash_(manifest_hash) {}

CheckpointReader::~CheckpointReader() = default;

Result<ObjectReader*> CheckpointReader::Open(const ObjectEntry& e) {
  auto it = open_.find(e.name);
  if (it != open_.end()) return it->second.get();
  std::string key = StepDirName(step()) + "/" + e.name;
  auto reader = backend_->OpenObject(key);
  if (!reader.ok()) {
    Status s = reader.status();
    if (s.code() == Code::kNotFound) {
      // Retired by retention while we read it, or damaged?
      bool retired =
          backend_->Stat(StepDirName(step()) + "/" + std::string(kManifestName)).status().code() ==
          Code::kNotFound;
      s = retired ? Status(Code::kNotFound,
                           "the step was deleted (retention or gc) while being "
                           "read; open LATEST again: " +
                               s.message())
                  : Status(Code::kDataLoss, "object is missing: " + s.message());
    }
    return s.WithContext("store " + backend_->Uri() + ", step " + std::to_string(step()));
  }
  if ((*reader)->Size() != e.size)
    return Status(Code::kDataLoss, "store " + backend_->Uri() + ", step " + std::to_string(step()) +
                                       ", object " + e.name + ": " +
                                       std::to_string((*reader)->Size()) +
                                       " bytes on storage, the manifest records " +
                                       std::to_string(e.size) + " (torn or altered object)");
  return open_.emplace(e.name, std::move(*reader)).first->second.get();
}

Status CheckpointReader::ChunkMismatch(const ObjectEntry& e, uint64_t chunk,
                                       const Hash128& got) const {
  uint64_t lo = chunk * e.chunk_size;
  uint64_t hi = std::min(e.size, lo + e.chunk_size);
  return Status(Code::kDataLoss, "checksum mismatch in store " + backend_->Uri() + ", step " +
                                     std::to_string(step()) + ", object " + e.name + ", bytes [" +
                                     std::to_string(lo) + ", " + std::to_string(hi) + ") (chunk " +
                                     std::to_string(chunk) + " of " +
                                     std::to_string(e.chunks.size()) + "): expected xxh3-128 " +
                                     e.chunks[chunk].Hex() + ", computed " + got.Hex() +
                                     "; the checkpoint is corrupt: load an older step, and run "
                                     "`ckptio fsck --repair` to retire it");
}

namespace {
Result<const ObjectEntry*> FindObject(const Manifest& m, std::string_view name,
                                      const std::string& uri) {
  const ObjectEntry* e = m.Find(name);
  if (e) return e;
  std::string names;
  for (const auto& o : m.objects) names += (names.empty() ? "" : ", ") + o.name;
  return Status(Code::kNotFound, "store " + uri + ", step " + std::to_string(m.step) +
                                     " has no object \"" + Printable(name) +
                                     "\"; it has: " + (names.empty() ? "none" : names));
}
}  // namespace

Status CheckpointReader::Read(std::string_view name, uint64_t offset, void* buf, size_t size) {
  CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e, FindObject(manifest_, name, backend_->Uri()));
  if (offset > e->size || size > e->size - offset)
    return Status(Code::kInvalidArgument, "read of bytes [" + std::to_string(offset) + ", " +
                                              std::to_string(offset + size) +
                                              ") is outside object " + e->name + " of " +
                                              std::to_string(e->size) + " bytes");
  if (size == 0) return OkStatus();
  auto reader_or = Open(*e);
  if (!reader_or.ok()) {
    std::memset(buf, 0, size);
    return reader_or.status();
  }
  ObjectReader* reader = *reader_or;
  char* out = static_cast<char*>(buf);
  const uint64_t end = offset + size;
  Status s;
  for (uint64_t c = offset / e->chunk_size; s.ok() && c * e->chunk_size < end; ++c) {
    const uint64_t lo = c * e->chunk_size;
    const uint64_t len = std::min(e->chunk_size, e->size - lo);
    const uint64_t want_lo = std::max(offset, lo);
    const uint64_t want_hi = std::min(end, lo + len);
    // Whole chunks land directly in the caller's buffer; partial ones go
    // through scratch so that only verified bytes are copied out.
    const bool direct = want_lo == lo && want_hi == lo + len;
    char* dst = out + (lo - offset);
    if (!direct) {
      scratch_.resize(len);
      dst = scratch_.data();
    }
    s = reader->ReadAt(lo, dst, len);
    if (!s.ok()) {
      s = s.WithContext("store " + backend_->Uri() + ", step " + std::to_string(step()) +
                        ", object " + e->name);
      break;
    }
    Hash128 got = HashBytes(dst, len);
    if (got != e->chunks[c]) {
      s = ChunkMismatch(*e, c, got);
      break;
    }
    if (!direct) std::memcpy(out + (want_lo - offset), dst + (want_lo - lo), want_hi - want_lo);
  }
  if (!s.ok()) std::memset(buf, 0, size);
  return s;
}

Result<std::string> CheckpointReader::ReadAll(std::string_view name) {
  CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e, FindObject(manifest_, name, backend_->Uri()));
  // Size first: a manifest must not make us allocate what is not there.
  CKPTIO_RETURN_IF_ERROR(Open(*e).status());
  std::string out(e->size, '\0');
  // Every chunk is checked against the sealed manifest, which is as strong
  // as the whole-object hash (VerifyObject checks that one too).
  CKPTIO_RETURN_IF_ERROR(Read(name, 0, out.data(), out.size()));
  return out;
}

namespace {
class BufferView : public ObjectView {
 public:
  explicit BufferView(uint64_t size) : data_(new char[size]), size_(size) {}  // untouched
  char* data() override { return data_.get(); }
  uint64_t size() const override { return size_; }

 private:
  std::unique_ptr<char[]> data_;
  uint64_t size_;
};

// Maps the pages of [p, p + n) ahead of whoever fills them, on a thread of
// its own, without changing a byte (MADV_POPULATE_WRITE, Linux >= 5.14;
// elsewhere it does nothing). Fresh memory costs a fault per 4 KiB page on
// its first touch, 0.38 s per GiB on this VM when a network read takes them
// one by one; populated on another core, the read finds them mapped.
class Populator {
 public:
  Populator(char* p, uint64_t n) : thread_([this, p, n] { Run(p, n); }) {}
  ~Populator() {
    stop_ = true;
    thread_.join();
  }

 private:
  void Run([[maybe_unused]] char* p, [[maybe_unused]] uint64_t n) {
#ifdef MADV_POPULATE_WRITE
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    char* lo = p + (page - reinterpret_cast<uintptr_t>(p) % page) % page;  // whole pages only
    char* const end = p + n - reinterpret_cast<uintptr_t>(p + n) % page;
    constexpr ptrdiff_t kStep = 16 << 20;
    for (; lo < end && !stop_; lo += std::min(kStep, end - lo))
      if (::madvise(lo, static_cast<size_t>(std::min(kStep, end - lo)), MADV_POPULATE_WRITE))
        return;  // not supported: the reads fault the pages in themselves
#endif
  }

  std::atomic<bool> stop_{false};
  std::thread thread_;  // declared last: starts once stop_ exists
};
}  // namespace

Result<std::shared_ptr<ObjectView>> CheckpointReader::View(std::string_view name,
                                                           unsigned threads) {
  CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e, FindObject(manifest_, name, backend_->Uri()));
  CKPTIO_ASSIGN_OR_RETURN(ObjectReader * reader, Open(*e));
  const std::string where =
      "store " + backend_->Uri() + ", step " + std::to_string(step()) + ", object " + e->name;
  auto chunk_range = [&](uint64_t c) {
    const uint64_t lo = c * e->chunk_size;
    return std::make_pair(lo, std::min(e->chunk_size, e->size - lo));
  };
  auto mapped = reader->Map();
  if (!mapped.ok() && mapped.status().code() != Code::kUnimplemented)
    return mapped.status().WithContext(where);
  if (!mapped.ok()) {
    // No map: read chunk by chunk, hashing each while it is in cache.
    auto view = std::make_shared<BufferView>(e->size);
    std::optional<Populator> populate;
    if (e->size >= (16u << 20)) {
      try {
        populate.emplace(view->data(), e->size);
      } catch (const std::exception&) {  // no thread to be had: the read faults its pages
      }
    }
    for (uint64_t c = 0; c < e->chunks.size(); ++c) {
      auto [lo, len] = chunk_range(c);
      CKPTIO_RETURN_IF_ERROR(reader->ReadAt(lo, view->data() + lo, len).WithContext(where));
      Hash128 got = HashBytes(view->data() + lo, len);
      if (got != e->chunks[c]) return ChunkMismatch(*e, c, got);
    }
    return std::shared_ptr<ObjectView>(std::move(view));
  }
  std::shared_ptr<ObjectView> view = std::move(*mapped);
  if (view->size() != e->size)
    return Status(Code::kDataLoss, where + ": mapped " + std::to_string(view->size()) +
                                       " bytes, the manifest records " + std::to_string(e->size));
  // Chunks are handed out to the threads one by one; the lowest mismatching
  // chunk is the one reported.
  const uint64_t n = e->chunks.size();
  if (threads == 0) threads = std::clamp(std::thread::hardware_concurrency(), 1u, 4u);
  threads = static_cast<unsigned>(std::min<uint64_t>(threads, n));
  std::atomic<uint64_t> next{0};
  std::atomic<uint64_t> first_bad{n};
  std::vector<Hash128> got(n);
  auto work = [&] {
    for (uint64_t c; (c = next.fetch_add(1)) < n;) {
      auto [lo, len] = chunk_range(c);
      got[c] = HashBytes(view->data() + lo, len);
      if (got[c] != e->chunks[c]) {
        uint64_t prev = first_bad.load();
        while (c < prev && !first_bad.compare_exchange_weak(prev, c)) {
        }
      }
    }
  };
  RunOnThreads(threads, work);
  if (first_bad.load() < n) return ChunkMismatch(*e, first_bad.load(), got[first_bad.load()]);
  return view;
}

Status CheckpointReader::VerifyObject(std::string_view name, const ProgressFn& progress) {
  CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e, FindObject(manifest_, name, backend_->Uri()));
  CKPTIO_ASSIGN_OR_RETURN(ObjectReader * reader, Open(*e));
  Hasher whole;
  std::string buf;
  for (uint64_t c = 0; c < e->chunks.size(); ++c) {
    const uint64_t lo = c * e->chunk_size;
    const uint64_t len = std::min(e->chunk_size, e->size - lo);
    buf.resize(len);
    Status s = reader->ReadAt(lo, buf.data(), len);
    if (!s.ok())
      return s.WithContext("store " + backend_->Uri() + ", step " + std::to_string(step()) +
                           ", object " + e->name);
    Hash128 got = HashBytes(buf.data(), len);
    if (got != e->chunks[c]) return ChunkMismatch(*e, c, got);
    whole.Update(buf.data(), len);
    if (progress) progress(len);
  }
  if (whole.Digest() != e->hash) {
    open_.erase(e->name);
    return Status(Code::kDataLoss, "whole-object checksum mismatch in store " + backend_->Uri() +
                                       ", step " + std::to_string(step()) + ", object " + e->name +
                                       ": expected xxh3-128 " + e->hash.Hex() + ", computed " +
                                       whole.Digest().Hex());
  }
  // A tensor file's own header must agree with the manifest's entries.
  Status header = OkStatus();
  for (const TensorEntry& t : manifest_.tensors) {
    if (t.object != e->name) continue;
    header = CheckSafetensorsObject(*this, e->name).WithContext("store " + backend_->Uri());
    break;
  }
  open_.erase(e->name);  // verifying a whole store must not pile up descriptors
  return header;
}

Status CheckpointReader::Verify(const ProgressFn& progress) {
  for (const auto& o : manifest_.objects) CKPTIO_RETURN_IF_ERROR(VerifyObject(o.name, progress));
  return OkStatus();
}

// ---------------------------------------------------------------- writing

namespace {
// What a writer and its pending checkpoints share; lives as long as any.
struct WriterCore {
  std::shared_ptr<StorageBackend> backend;
  std::unique_ptr<BackendLock> lock;
  WriterOptions options;
  int64_t generation = 0;
  size_t stale_temps_removed = 0;
  bool pending = false;

  // Aborted if another writer has claimed the store since we did.
  Status CheckFence() {
    auto rec = LoadWriterRecord(*backend);
    if (!rec.ok()) {
      if (rec.status().code() == Code::kNotFound)
        return Status(Code::kAborted, "this writer (generation " + std::to_string(generation) +
                                          ") was fenced: " + backend->Uri() +
                                          "/.writer is gone; open a new writer to continue");
      return rec.status().WithContext("checking the writer fence");
    }
    if (rec->generation != generation)
      return Status(Code::kAborted,
                    "this writer (generation " + std::to_string(generation) +
                        ") was fenced: " + backend->Uri() + "/.writer names generation " +
                        std::to_string(rec->generation) + " (host " + rec->host + ", pid " +
                        std::to_string(rec->pid) +
                        "). Another writer took over the store; stop writing from this "
                        "process and open a new writer to continue");
    return OkStatus();
  }

  // `just_committed`: the step this writer has just committed, which counts
  // as the good step (its bytes were hashed as they were written), so
  // retention after a save reads nothing back.
  Result<GcReport> CollectGarbage(int keep_last, std::optional<int64_t> just_committed,
                                  const ProgressFn& progress);
};
}  // namespace

struct PendingCheckpoint::State {
  std::shared_ptr<WriterCore> core;
  int64_t step = 0;
  std::string dir;  // "step-000000000012/"
  Manifest manifest;
  std::set<std::string, std::less<>> names;
  int open_streams = 0;
  Status failure;         // the first failure of any object; fails the commit
  bool finished = false;  // committed, or failed to commit
  bool committed = false;
  bool striped = false;         // abandoning clears the whole step directory
  bool manifest_tried = false;  // Commit wrote the manifest (it may be there)

  void Fail(const Status& why) {
    if (failure.ok()) failure = why;
  }
};

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
      for (const auto& name : st.names) (void)backend.Delete(st.dir + name);
      // A striped step may also hold parts of ranks whose receipts never
      // arrived: none of it can be visible, so clear it all.
      if (st.striped) {
        auto keys = backend.List(st.dir);
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
      st.core->backend->NewObject(st.dir + std::string(name), WriteMode::kCreateExclusive);
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
    auto info = backend.Stat(st.dir + o.name);
    if (!info.ok()) {
      if (info.status().code() != Code::kNotFound) return info.status().WithContext(what);
      return Status(Code::kDataLoss, what + ": object " + o.name + " is not in " + backend.Uri() +
                                         "/" + st.dir +
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

// ---------------------------------------------------------------- stripes

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
  for (const auto& o : st.manifest.objects) (void)backend.Delete(st.dir + o.name);
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

namespace {
// Each object of `m` that holds tensors, read back from `dir` (stripes
// were written by other ranks): its safetensors header must agree with the
// manifest's entries, as every load checks. InvalidArgument otherwise
// (a reader would reject the step, yet retention would count it as good).
Status CheckTensorObjects(StorageBackend& backend, const std::string& dir, const Manifest& m) {
  std::set<std::string_view> objects;
  for (const TensorEntry& t : m.tensors) objects.insert(t.object);
  for (std::string_view name : objects) {
    const std::string object(name), key = dir + object;
    auto reader = backend.OpenObject(key);
    if (!reader.ok() && reader.status().code() == Code::kNotFound)
      return Status(Code::kDataLoss, "object " + key + " is not in " + backend.Uri() +
                                         " (its writer died, or the step was cleared after it "
                                         "was written)");
    CKPTIO_RETURN_IF_ERROR(reader.status());
    const uint64_t size = (*reader)->Size();
    std::string header(std::min<uint64_t>(size, 8), '\0');
    CKPTIO_RETURN_IF_ERROR((*reader)->ReadAt(0, header.data(), header.size()));
    Status s = OkStatus();
    if (auto n = SafetensorsHeaderSize(header, size, key); !n.ok()) {
      s = n.status();
    } else {
      header.resize(*n);
      CKPTIO_RETURN_IF_ERROR((*reader)->ReadAt(0, header.data(), header.size()));
      s = CheckSafetensorsObject(m, object, header);
    }
    if (!s.ok())
      return Status(Code::kInvalidArgument,
                    "the checkpoint is inconsistent: its tensor entries disagree with object " +
                        object + ": " + s.message());
  }
  return OkStatus();
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
  auto serialized =
      SerializeCheckedManifest(m, StepDirName(st.step) + "/" + std::string(kManifestName));
  if (!serialized.ok())
    return serialized.status().code() == Code::kResourceExhausted
               ? serialized.status().WithContext(what)
               : Status(Code::kInvalidArgument, what + ": the checkpoint is inconsistent: " +
                                                    serialized.status().message());
  CKPTIO_RETURN_IF_ERROR(CheckTensorObjects(backend, st.dir, m).WithContext(what));
  const std::string& bytes = *serialized;
  CKPTIO_RETURN_IF_ERROR(core.CheckFence().WithContext(what));
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
  Summaries().Remember(ManifestSummaries::Key(backend, st.step, info.manifest_hash), SummaryOf(m));

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

Result<GcReport> WriterCore::CollectGarbage(int keep_last, std::optional<int64_t> just_committed,
                                            const ProgressFn& progress) {
  if (keep_last < 1)
    return Status(Code::kInvalidArgument,
                  "keep_last must be at least 1 (got " + std::to_string(keep_last) + ")");
  CKPTIO_RETURN_IF_ERROR(CheckFence());
  Store store(backend);
  CKPTIO_ASSIGN_OR_RETURN(auto steps, store.ListSteps());
  std::vector<int64_t> committed;
  for (const auto& s : steps)
    if (s.state == StepState::kCommitted) committed.push_back(s.step);
  std::set<int64_t> keep;
  for (size_t i = committed.size() > size_t(keep_last) ? committed.size() - keep_last : 0;
       i < committed.size(); ++i)
    keep.insert(committed[i]);
  // The step LATEST names is kept; if LATEST cannot be read (other than
  // unreadable bytes, DataLoss), which step that is is unknown: stop.
  auto latest = LoadLatest(*backend);
  if (!latest.ok() && latest.status().code() != Code::kDataLoss)
    return latest.status().WithContext("gc: reading LATEST (nothing was deleted)");
  if (latest.ok() && latest->has_value()) keep.insert((*latest)->step);
  GcReport report;
  if (just_committed) {
    report.newest_good = *just_committed;
  } else {
    // Invariant 4 for steps that rotted after their commit: keep the newest
    // one that still verifies, however old.
    for (auto it = committed.rbegin(); it != committed.rend() && !report.newest_good; ++it) {
      auto reader = store.OpenStep(*it);
      Status v = reader.ok() ? (*reader)->Verify(progress) : reader.status();
      if (v.ok()) {
        report.newest_good = *it;
      } else if (v.code() == Code::kDataLoss) {
        report.corrupt.push_back({FsckProblem::Kind::kCorruptStep, *it, v.message()});
      } else {
        return v.WithContext("gc: verifying step " + std::to_string(*it) +
                             " (nothing was deleted)");
      }
    }
  }
  if (report.newest_good) keep.insert(*report.newest_good);
  for (int64_t step : committed) {
    if (keep.count(step)) continue;
    // Verifying can take long, and a lease lock can lapse meanwhile.
    CKPTIO_RETURN_IF_ERROR(CheckFence());
    CKPTIO_RETURN_IF_ERROR(
        DeleteStep(*backend, step).WithContext("retention: deleting step " + std::to_string(step)));
    report.deleted.push_back(step);
  }
  return report;
}

struct StoreWriter::State {
  std::shared_ptr<WriterCore> core;
};

StoreWriter::StoreWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}
StoreWriter::~StoreWriter() = default;

int64_t StoreWriter::generation() const { return state_->core->generation; }
size_t StoreWriter::stale_temps_removed() const { return state_->core->stale_temps_removed; }

Result<std::unique_ptr<PendingCheckpoint>> StoreWriter::Begin(int64_t step) {
  WriterCore& core = *state_->core;
  if (step < 0 || step > kMaxStep)
    return Status(Code::kInvalidArgument,
                  "step " + std::to_string(step) + " is outside [0, 999999999999]");
  if (core.pending)
    return Status(Code::kFailedPrecondition,
                  "another checkpoint of this writer is still pending; commit or destroy it first");
  // Still ours? A writer that took over may be writing this very step:
  // what is there would be cleared below as our own torn attempt.
  CKPTIO_RETURN_IF_ERROR(core.CheckFence().WithContext("beginning step " + std::to_string(step)));
  const std::string dir = StepDirName(step) + "/";
  CKPTIO_ASSIGN_OR_RETURN(auto keys, core.backend->List(dir));
  for (const auto& key : keys) {
    if (BaseName(key) == kManifestName)
      return Status(Code::kAlreadyExists,
                    "step " + std::to_string(step) + " is already committed in " +
                        core.backend->Uri() +
                        "; committed checkpoints are immutable: save under a new step");
  }
  // Leftovers of a torn attempt at this step (we hold the lock: no one
  // else is writing them).
  for (const auto& key : keys)
    CKPTIO_RETURN_IF_ERROR(core.backend->Delete(key).WithContext(
        "clearing a torn attempt at step " + std::to_string(step) + " before saving it again"));
  auto st = std::make_unique<PendingCheckpoint::State>();
  st->core = state_->core;
  st->step = step;
  st->dir = dir;
  core.pending = true;
  return std::unique_ptr<PendingCheckpoint>(new PendingCheckpoint(std::move(st)));
}

Result<GcReport> StoreWriter::CollectGarbage(int keep_last, const ProgressFn& progress) {
  return state_->core->CollectGarbage(keep_last, std::nullopt, progress);
}

// ---------------------------------------------------------------- store

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
  auto st = std::make_unique<PendingCheckpoint::State>();
  st->core = std::move(core);
  st->step = step;
  st->dir = StepDirName(step) + "/";
  return std::unique_ptr<StripeWriter>(new StripeWriter(std::move(st), rank));
}

Result<std::unique_ptr<Store>> Store::Open(std::string_view uri, const BackendRegistry& registry) {
  CKPTIO_ASSIGN_OR_RETURN(auto backend, registry.Open(uri));
  return std::make_unique<Store>(std::shared_ptr<StorageBackend>(std::move(backend)));
}

Store::Store(std::shared_ptr<StorageBackend> backend) : backend_(std::move(backend)) {}

Result<std::vector<StepEntry>> Store::ListSteps() {
  CKPTIO_ASSIGN_OR_RETURN(auto by_step, KeysByStep(*backend_));
  std::vector<StepEntry> out;
  for (const auto& [step, names] : by_step) {
    StepEntry e;
    e.step = step;
    bool has_manifest = std::find(names.begin(), names.end(), kManifestName) != names.end();
    Result<ManifestSummary> summary = ManifestSummary{};
    if (has_manifest) {
      summary = SummarizeManifest(*backend_, step);
      // Deleted since it was listed (another process's retention): what is
      // left is torn, like any step without a manifest.
      if (!summary.ok() && summary.status().code() == Code::kNotFound) has_manifest = false;
    }
    if (has_manifest) {
      CKPTIO_RETURN_IF_ERROR(summary.status());
      const Status& loaded = summary->status;
      if (loaded.ok()) {
        e.state = StepState::kCommitted;
        e.bytes = summary->bytes;
        e.created_unix_ms = summary->created_unix_ms;
      } else if (loaded.code() == Code::kDataLoss) {
        e.state = StepState::kCorrupt;
        e.problem = loaded.message();
      } else if (loaded.code() == Code::kFailedPrecondition) {
        e.state = StepState::kUnsupported;  // a newer format: never ours to judge
        e.problem = loaded.message();
      } else {
        return loaded;
      }
    } else {
      e.state = StepState::kTorn;
      for (const auto& name : names) {
        auto info = backend_->Stat(StepDirName(step) + "/" + name);
        if (info.ok()) e.bytes += info->size;
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

Result<std::vector<int64_t>> Store::ListStepsWithManifest() {
  CKPTIO_ASSIGN_OR_RETURN(auto by_step, KeysByStep(*backend_));
  std::vector<int64_t> out;
  for (const auto& [step, names] : by_step)
    if (std::find(names.begin(), names.end(), kManifestName) != names.end()) out.push_back(step);
  return out;
}

Result<std::optional<Latest>> Store::ReadLatest() { return LoadLatest(*backend_); }

Result<std::unique_ptr<CheckpointReader>> Store::OpenStep(int64_t step) {
  if (step < 0 || step > kMaxStep)
    return Status(Code::kInvalidArgument,
                  "step " + std::to_string(step) + " is outside [0, 999999999999]");
  CKPTIO_ASSIGN_OR_RETURN(LoadedManifest loaded, LoadManifest(*backend_, step));
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(backend_, std::move(loaded.manifest), loaded.hash));
}

Result<std::unique_ptr<CheckpointReader>> Store::OpenLatest() {
  CKPTIO_ASSIGN_OR_RETURN(std::optional<Latest> latest, ReadLatest());
  if (!latest)
    return Status(Code::kNotFound, "store " + uri() + " has no LATEST: nothing committed yet");
  CKPTIO_ASSIGN_OR_RETURN(auto reader, OpenStep(latest->step));
  if (reader->manifest_hash() != latest->manifest_hash)
    return Status(Code::kDataLoss,
                  "store " + uri() + ": LATEST names step " + std::to_string(latest->step) +
                      " with manifest xxh3-128 " + latest->manifest_hash.Hex() +
                      ", but its MANIFEST.json hashes to " + reader->manifest_hash().Hex());
  return reader;
}

Result<std::unique_ptr<StoreWriter>> Store::OpenWriter(const WriterOptions& options) {
  if (options.chunk_size < kMinChunkBytes || options.chunk_size > kMaxChunkBytes)
    return Status(Code::kInvalidArgument, "chunk_size must be within [4 KiB, 64 MiB]");
  if (options.keep_last < 0)
    return Status(Code::kInvalidArgument, "keep_last must be >= 0 (0 keeps every step)");
  if (options.world_size < 1 || options.saving_rank < 0 ||
      options.saving_rank >= options.world_size)
    return Status(Code::kInvalidArgument, "saving_rank " + std::to_string(options.saving_rank) +
                                              " is not within world_size " +
                                              std::to_string(options.world_size));

  // 1. The lock, waiting up to lock_wait.
  const auto deadline = std::chrono::steady_clock::now() + options.lock_wait;
  std::unique_ptr<BackendLock> lock;
  while (true) {
    auto got = backend_->TryLock(kLockKey);
    if (got.ok()) {
      lock = std::move(*got);
      break;
    }
    if (got.status().code() != Code::kFailedPrecondition ||
        std::chrono::steady_clock::now() >= deadline) {
      if (got.status().code() != Code::kFailedPrecondition) return got.status();
      std::string holder = "unknown";
      auto rec = LoadWriterRecord(*backend_);
      if (rec.ok())
        holder = "host " + rec->host + ", pid " + std::to_string(rec->pid) + ", generation " +
                 std::to_string(rec->generation);
      return Status(Code::kFailedPrecondition,
                    "store " + uri() + " already has a writer (last recorded writer: " + holder +
                        "; " + got.status().message() +
                        "). ckptio allows one writer per store: wait for it to finish, "
                        "stop it, or raise the writer's lock wait");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  auto core = std::make_shared<WriterCore>();
  core->backend = backend_;
  core->lock = std::move(lock);
  core->options = options;

  // Claim a generation above every one on record, then announce it.
  int64_t generation = 0;
  auto latest = LoadLatest(*backend_);
  if (latest.ok() && latest->has_value()) generation = (*latest)->generation;
  if (!latest.ok() && latest.status().code() != Code::kDataLoss) return latest.status();
  auto rec = LoadWriterRecord(*backend_);
  if (rec.ok()) generation = std::max(generation, rec->generation);
  if (!rec.ok() && rec.status().code() != Code::kNotFound && rec.status().code() != Code::kDataLoss)
    return rec.status();
  core->generation = generation + 1;
  WriterRecord me{core->generation, HostName(), static_cast<int64_t>(::getpid()), NowUnixMs()};
  CKPTIO_RETURN_IF_ERROR(
      WriteSmall(*backend_, kWriterKey, SerializeWriterRecord(me), WriteMode::kReplace)
          .WithContext("claiming the writer generation of " + uri()));

  // Temp objects now belong to dead writers.
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend_->List(""));
  for (const auto& key : keys) {
    if (!IsTempKey(key)) continue;
    Status s = backend_->Delete(key);
    if (!s.ok() && s.code() != Code::kNotFound) return s.WithContext("removing stale temp");
    ++core->stale_temps_removed;
  }
  auto state = std::make_unique<StoreWriter::State>();
  state->core = std::move(core);
  return std::unique_ptr<StoreWriter>(new StoreWriter(std::move(state)));
}

namespace {

Result<FsckReport> CheckStore(Store& store, const ProgressFn& progress, bool verify_data,
                              bool we_hold_lock) {
  StorageBackend& backend = store.backend();
  FsckReport r;
  if (!we_hold_lock) {
    // Look without taking the lock: a trainer opening its writer right now
    // must not find it held by fsck.
    auto locked = backend.IsLocked(kLockKey);
    if (!locked.ok() && locked.status().code() != Code::kUnimplemented) return locked.status();
    r.writer_active = locked.ok() && *locked;
  }
  // Listed after the lock test: temps listed before a writer took the lock
  // (and swept them) would pass for its own.
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend.List(""));
  // Steps with a temp object: with a live writer, those it is writing (it
  // swept every earlier writer's temps as it took the lock).
  std::set<int64_t> writing;
  bool seen_writing = false;  // in_progress has a temp object, not just a guess
  for (const auto& key : keys) {
    if (!IsTempKey(key)) continue;
    if (!r.writer_active) r.problems.push_back({FsckProblem::Kind::kStaleTemp, -1, key});
    const size_t slash = key.find('/');
    if (slash != std::string::npos) writing.insert(ParseStepDirName(key.substr(0, slash)));
  }
  CKPTIO_ASSIGN_OR_RETURN(auto steps, store.ListSteps());
  if (r.writer_active) {
    // Its save in progress: a torn step it is writing an object of, else
    // (between two objects) most likely the newest step. A save below a
    // newer step (after a load fell back past it) is found by the former.
    for (const auto& s : steps)
      if (s.state == StepState::kTorn && writing.count(s.step)) r.in_progress = s.step;
    seen_writing = r.in_progress.has_value();
    if (!r.in_progress && !steps.empty() && steps.back().state == StepState::kTorn)
      r.in_progress = steps.back().step;
  }
  std::map<int64_t, Hash128> good;
  for (const auto& s : steps) {
    if (s.state == StepState::kTorn) {
      if (r.in_progress == s.step) continue;
      std::string detail = "no MANIFEST.json: an unfinished save";
      if (seen_writing)
        detail +=
            ", not the active writer's (it is writing step " + std::to_string(*r.in_progress) + ")";
      else if (r.writer_active)
        detail +=
            ", unless the active writer is saving it (between two objects: run fsck "
            "again to tell)";
      r.problems.push_back({FsckProblem::Kind::kTornStep, s.step, std::move(detail)});
      continue;
    }
    if (s.state == StepState::kCorrupt) {
      r.problems.push_back({FsckProblem::Kind::kCorruptStep, s.step, s.problem});
      continue;
    }
    if (s.state == StepState::kUnsupported)
      return Status(Code::kFailedPrecondition,
                    "step " + std::to_string(s.step) + ": " + s.problem +
                        " (this ckptio will not judge or repair a store a newer one wrote)");
    auto reader = store.OpenStep(s.step);
    Status v =
        reader.ok() ? (verify_data ? (*reader)->Verify(progress) : OkStatus()) : reader.status();
    if (v.ok()) {
      good[s.step] = (*reader)->manifest_hash();
    } else if (v.code() == Code::kDataLoss) {
      r.problems.push_back({FsckProblem::Kind::kCorruptStep, s.step, v.message()});
    } else if (v.code() != Code::kNotFound) {
      return v;
    }  // NotFound: retired since the listing (a live writer's retention)
  }
  for (const auto& [step, hash] : good) r.good_steps.push_back(step);

  auto latest = store.ReadLatest();
  auto bad_latest = [&](std::string detail) {
    r.problems.push_back({FsckProblem::Kind::kBadLatest, -1, std::move(detail)});
  };
  if (!latest.ok()) {
    if (latest.status().code() != Code::kDataLoss &&
        latest.status().code() != Code::kFailedPrecondition)
      return latest.status();
    bad_latest("LATEST is unreadable: " + latest.status().message());
  } else if (!latest->has_value()) {
    if (!good.empty())
      bad_latest("LATEST is missing but step " + std::to_string(good.rbegin()->first) +
                 " is committed");
  } else {
    const Latest& l = **latest;
    r.latest = l.step;
    auto it = good.find(l.step);
    if (it == good.end())
      bad_latest("LATEST names step " + std::to_string(l.step) +
                 ", which is missing, torn or corrupt");
    else if (it->second != l.manifest_hash)
      bad_latest("LATEST records manifest xxh3-128 " + l.manifest_hash.Hex() + " for step " +
                 std::to_string(l.step) + ", but that manifest hashes to " + it->second.Hex());
    else if (good.rbegin()->first > l.step)
      bad_latest("LATEST names step " + std::to_string(l.step) + " but step " +
                 std::to_string(good.rbegin()->first) + " is newer and good");
  }
  return r;
}

}  // namespace

Result<FsckReport> Store::Check(const ProgressFn& progress, bool verify_data) {
  return CheckStore(*this, progress, verify_data, /*we_hold_lock=*/false);
}

Result<FsckReport> StoreWriter::Repair(const ProgressFn& progress) {
  WriterCore& core = *state_->core;
  if (core.pending)
    return Status(Code::kFailedPrecondition, "cannot repair while a checkpoint is pending");
  StorageBackend& backend = *core.backend;
  Store store(core.backend);
  CKPTIO_ASSIGN_OR_RETURN(FsckReport before, CheckStore(store, progress, true, true));
  std::vector<std::string> repairs;
  // Order matters for crash safety: LATEST moves to a good step before any
  // step it may name is deleted.
  for (const auto& p : before.problems) {
    if (p.kind != FsckProblem::Kind::kBadLatest) continue;
    if (before.good_steps.empty()) {
      CKPTIO_RETURN_IF_ERROR(core.CheckFence());  // (checking took a while)
      Status s = backend.Delete(kLatestKey);
      if (!s.ok() && s.code() != Code::kNotFound)
        return s.WithContext("repair: removing LATEST (no step verifies)");
      repairs.push_back("removed LATEST: no step verifies");
    } else {
      int64_t newest = before.good_steps.back();
      CKPTIO_ASSIGN_OR_RETURN(auto reader, store.OpenStep(newest));
      CKPTIO_RETURN_IF_ERROR(core.CheckFence());
      CKPTIO_RETURN_IF_ERROR(WriteSmall(
          backend, kLatestKey, SerializeLatest({newest, core.generation, reader->manifest_hash()}),
          WriteMode::kReplace));
      repairs.push_back("LATEST now names step " + std::to_string(newest));
    }
    break;
  }
  for (const auto& p : before.problems) {
    // Checking took a while (every byte was read): still ours to change?
    if (p.kind != FsckProblem::Kind::kBadLatest) CKPTIO_RETURN_IF_ERROR(core.CheckFence());
    switch (p.kind) {
      case FsckProblem::Kind::kCorruptStep:
        CKPTIO_RETURN_IF_ERROR(
            DeleteStep(backend, p.step)
                .WithContext("repair: deleting corrupt step " + std::to_string(p.step)));
        repairs.push_back("deleted corrupt step " + std::to_string(p.step));
        break;
      case FsckProblem::Kind::kTornStep:
        CKPTIO_RETURN_IF_ERROR(
            DeleteStep(backend, p.step)
                .WithContext("repair: deleting torn step " + std::to_string(p.step)));
        repairs.push_back("deleted torn step " + std::to_string(p.step));
        break;
      case FsckProblem::Kind::kStaleTemp: {
        Status s = backend.Delete(p.detail);
        if (!s.ok() && s.code() != Code::kNotFound)
          return s.WithContext("repair: deleting stale temp " + p.detail);
        repairs.push_back("deleted stale temp " + p.detail);
        break;
      }
      case FsckProblem::Kind::kBadLatest:
        break;
    }
  }
  // Every remaining step verified above; re-read the structure only.
  CKPTIO_ASSIGN_OR_RETURN(FsckReport after, CheckStore(store, {}, false, true));
  after.repairs = std::move(repairs);
  return after;
}

}  // namespace ckptio
