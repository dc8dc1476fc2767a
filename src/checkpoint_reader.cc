// CheckpointReader: reads of a committed step, every byte verified
// against its manifest before it is returned.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "ckptio/safetensors.h"
#include "copy.h"
#include "store_internal.h"
#include "text.h"

namespace ckptio {

CheckpointReader::CheckpointReader(std::shared_ptr<StorageBackend> backend, Manifest manifest,
                                   Hash128 manifest_hash)
    : backend_(std::move(backend)), manifest_(std::move(manifest)), manifest_hash_(manifest_hash) {}

CheckpointReader::~CheckpointReader() = default;

namespace {
// Objects ViewAll opens, and where reads are round trips views, at once.
constexpr unsigned kViewAllAtOnce = 4;
// What to do about a step whose bytes do not match its manifest.
constexpr char kCorrupt[] =
    "the checkpoint is corrupt: load an older step, and run `ckptio fsck --repair` to retire it";
}  // namespace

Result<ObjectReader*> CheckpointReader::Open(const ObjectEntry& e) {
  auto it = open_.find(e.name);
  if (it != open_.end()) return it->second.get();
  CKPTIO_ASSIGN_OR_RETURN(auto reader, OpenUncached(e));
  return open_.emplace(e.name, std::move(reader)).first->second.get();
}

Result<std::unique_ptr<ObjectReader>> CheckpointReader::OpenUncached(const ObjectEntry& e) const {
  std::string key = manifest_.ObjectKeyOf(e.name);
  auto reader = backend_->OpenObject(key);
  if (!reader.ok()) {
    Status s = reader.status();
    if (s.code() == Code::kNotFound) {
      // Retired by retention while we read it, or damaged?
      bool retired = backend_->Stat(ManifestKey(step())).status().code() == Code::kNotFound;
      s = retired ? Status(Code::kNotFound,
                           "the step was deleted (retention or gc) while being "
                           "read; open LATEST again: " +
                               s.message())
                  : Status(Code::kDataLoss, "object is missing: " + s.message());
    }
    return s.WithContext("store " + backend_->Uri() + ", step " + std::to_string(step()));
  }
  if ((*reader)->Size() != e.size)
    return Status(Code::kDataLoss,
                  "store " + backend_->Uri() + ", step " + std::to_string(step()) + ", object " +
                      e.name + ": " + std::to_string((*reader)->Size()) +
                      " bytes on storage, the manifest records " + std::to_string(e.size) +
                      " (torn or altered object); " + kCorrupt);
  return std::move(*reader);
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
                                     e.chunks[chunk].Hex() + ", computed " + got.Hex() + "; " +
                                     kCorrupt);
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

// "store URI, step N, object NAME", for messages.
std::string ObjectWhere(const std::string& uri, int64_t step, const ObjectEntry& e) {
  return "store " + uri + ", step " + std::to_string(step) + ", object " + e.name;
}

// Offset and length of chunk `c` of `e`.
std::pair<uint64_t, uint64_t> ChunkRange(const ObjectEntry& e, uint64_t c) {
  const uint64_t lo = c * e.chunk_size;
  return {lo, std::min(e.chunk_size, e.size - lo)};
}

// Lowers `lowest` to `c` if `c` is lower: threads that each find a bad
// chunk leave the lowest one to be reported.
void LowerTo(std::atomic<uint64_t>& lowest, uint64_t c) {
  uint64_t prev = lowest.load();
  while (c < prev && !lowest.compare_exchange_weak(prev, c)) {
  }
}

// The entry of `name` if [offset, offset+size) lies inside it.
Result<const ObjectEntry*> FindRange(const Manifest& m, const std::string& uri,
                                     std::string_view name, uint64_t offset, uint64_t size) {
  CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e, FindObject(m, name, uri));
  if (offset > e->size || size > e->size - offset)
    return Status(Code::kInvalidArgument,
                  "store " + uri + ", step " + std::to_string(m.step) + ": read of bytes [" +
                      std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                      std::to_string(size) + ") is outside object " + e->name + " of " +
                      std::to_string(e->size) + " bytes");
  return e;
}
}  // namespace

Status CheckpointReader::CheckRange(std::string_view name, uint64_t offset, uint64_t size) const {
  return FindRange(manifest_, backend_->Uri(), name, offset, size).status();
}

Status CheckpointReader::Read(std::string_view name, uint64_t offset, void* buf, size_t size) {
  CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e,
                          FindRange(manifest_, backend_->Uri(), name, offset, size));
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
    const auto [lo, len] = ChunkRange(*e, c);
    const uint64_t want_lo = std::max(offset, lo);
    const uint64_t want_hi = std::min(end, lo + len);
    // Whole chunks land directly in the caller's buffer; partial ones go
    // through scratch so that only verified bytes are copied out.
    const bool direct = want_lo == lo && want_hi == lo + len;
    if (!direct) scratch_.resize(len);
    char* dst = direct ? out + (lo - offset) : scratch_.data();
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
// Fresh anonymous memory for an object read through ReadAt, on transparent
// huge pages where the kernel has them (a hint): touching a fresh 256 MiB
// took 28 ms on 2 MiB pages against 80 ms on 4 KiB pages on this VM.
class BufferView : public ObjectView {
 public:
  explicit BufferView(AnonymousMemory memory) : memory_(std::move(memory)) {}
  char* data() override { return memory_.data(); }
  uint64_t size() const override { return memory_.size(); }

 private:
  AnonymousMemory memory_;
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
  const std::string where = ObjectWhere(backend_->Uri(), step(), *e);
  auto mapped = reader->Map();
  if (!mapped.ok() && mapped.status().code() != Code::kUnimplemented)
    return mapped.status().WithContext(where);
  std::shared_ptr<ObjectView> view;
  std::optional<Populator> populate;
  // Without a map the chunks are read into a buffer, each hashed as it is
  // read (ObjectReader::ReadAndHash) by the thread that reads it: one
  // thread, or as many as the reader takes at once (an object store's
  // ranged GETs).
  const bool read = !mapped.ok();
  if (read) {
    auto memory = AnonymousMemory::Allocate(static_cast<size_t>(e->size));
    if (!memory.ok()) return memory.status().WithContext(where + ": reading it whole");
    view = std::make_shared<BufferView>(std::move(*memory));
    if (e->size >= (16u << 20)) {
      try {
        populate.emplace(view->data(), e->size);
      } catch (const std::exception&) {  // no thread to be had: the read faults its pages
      }
    }
    const unsigned concurrent = std::max(1u, reader->ConcurrentReads());
    threads = threads == 0 ? concurrent : std::min(threads, concurrent);
  } else {
    view = std::move(*mapped);
    if (view->size() != e->size)
      return Status(Code::kDataLoss, where + ": mapped " + std::to_string(view->size()) +
                                         " bytes, the manifest records " + std::to_string(e->size) +
                                         "; " + kCorrupt);
    if (threads == 0) threads = std::clamp(std::thread::hardware_concurrency(), 1u, 4u);
  }
  // Chunks are handed out to the threads one by one; a failed read, else the
  // lowest mismatching chunk, is the one reported.
  const uint64_t n = e->chunks.size();
  threads = static_cast<unsigned>(std::min<uint64_t>(threads, n));
  std::atomic<uint64_t> next{0};
  std::atomic<uint64_t> first_bad{n};
  std::vector<Hash128> got(n);
  std::mutex failed_mu;
  Status failed = OkStatus();
  auto work = [&] {
    for (uint64_t c; (c = next.fetch_add(1)) < n;) {
      auto [lo, len] = ChunkRange(*e, c);
      if (read) {
        Result<Hash128> h = reader->ReadAndHash(lo, view->data() + lo, len);
        if (!h.ok()) {
          std::lock_guard<std::mutex> g(failed_mu);
          if (failed.ok()) failed = h.status();
          next = n;  // the others stop at their next chunk
          return;
        }
        got[c] = *h;
      } else {
        got[c] = HashBytes(view->data() + lo, len);
      }
      if (got[c] != e->chunks[c]) LowerTo(first_bad, c);
    }
  };
  RunOnThreads(threads, work);
  if (!failed.ok()) return failed.WithContext(where);
  if (first_bad.load() < n) return ChunkMismatch(*e, first_bad.load(), got[first_bad.load()]);
  return view;
}

Result<std::vector<std::shared_ptr<ObjectView>>> CheckpointReader::ViewAll() {
  std::vector<std::string> names;
  for (const ObjectEntry& o : manifest_.objects) names.push_back(o.name);
  return ViewAll(names);
}

Result<std::vector<std::shared_ptr<ObjectView>>> CheckpointReader::ViewAll(
    const std::vector<std::string>& names) {
  const size_t n = names.size();
  // Opened at once (on a remote store each opening is a round trip), then
  // kept as Open keeps them: those before the first that failed to open.
  std::vector<std::unique_ptr<ObjectReader>> opened(n);
  size_t unopened = n;
  const Status open = FirstFailure(
      n, kViewAllAtOnce,
      [&](size_t i) -> Status {
        CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e,
                                FindObject(manifest_, names[i], backend_->Uri()));
        if (open_.count(names[i])) return OkStatus();
        CKPTIO_ASSIGN_OR_RETURN(opened[i], OpenUncached(*e));
        return OkStatus();
      },
      &unopened);
  unsigned concurrent = 1;
  for (size_t i = 0; i < unopened; ++i) {
    if (opened[i]) open_.emplace(names[i], std::move(opened[i]));
    concurrent = std::max(concurrent, open_.at(names[i])->ConcurrentReads());
  }
  // Viewed several at once where reads are round trips (readers that take
  // concurrent reads), keeping about 16 reads in flight; else one by one,
  // each View parallel within. Nothing below changes open_. A tensor
  // file's safetensors header must agree with the manifest, as for
  // VerifyObject.
  std::set<std::string_view> with_tensors;
  for (const TensorEntry& t : manifest_.tensors) with_tensors.insert(t.object);
  const unsigned at_once = concurrent > 1 ? std::clamp(16 / concurrent, 1u, kViewAllAtOnce) : 1;
  std::vector<std::shared_ptr<ObjectView>> views(n);
  CKPTIO_RETURN_IF_ERROR(FirstFailure(unopened, at_once, [&](size_t i) -> Status {
    const std::string& name = names[i];
    CKPTIO_ASSIGN_OR_RETURN(views[i], View(name));
    if (!with_tensors.count(name)) return OkStatus();
    return CheckSafetensorsObject(
               manifest_, name,
               std::string_view(views[i]->data(), static_cast<size_t>(views[i]->size())))
        .WithContext("store " + backend_->Uri());
  }));
  CKPTIO_RETURN_IF_ERROR(open);
  return views;
}

Status CheckpointReader::VerifyObject(std::string_view name, const ProgressFn& progress) {
  CKPTIO_ASSIGN_OR_RETURN(const ObjectEntry* e, FindObject(manifest_, name, backend_->Uri()));
  CKPTIO_ASSIGN_OR_RETURN(ObjectReader * reader, Open(*e));
  const std::string where = ObjectWhere(backend_->Uri(), step(), *e);
  Hasher whole;
  auto mapped = reader->Map();
  if (!mapped.ok() && mapped.status().code() != Code::kUnimplemented)
    return mapped.status().WithContext(where);
  if (mapped.ok()) {
    // On a map, helper threads hash the chunks while this one hashes the
    // whole object, the longest leg (one streaming hash), and reports
    // progress: the object is checked in about the time of that one hash.
    const char* data = (*mapped)->data();
    if ((*mapped)->size() != e->size)
      return Status(Code::kDataLoss, where + ": mapped " + std::to_string((*mapped)->size()) +
                                         " bytes, the manifest records " + std::to_string(e->size) +
                                         "; " + kCorrupt);
    const uint64_t n = e->chunks.size();
    std::atomic<uint64_t> next{0};
    std::atomic<uint64_t> first_bad{n};
    std::vector<Hash128> got(n);
    auto chunks = [&] {
      for (uint64_t c; (c = next.fetch_add(1)) < n && c < first_bad.load();) {
        auto [lo, len] = ChunkRange(*e, c);
        got[c] = HashBytes(data + lo, len);
        if (got[c] != e->chunks[c]) LowerTo(first_bad, c);
      }
    };
    const unsigned helpers = std::clamp(std::thread::hardware_concurrency(), 2u, 4u) - 1;
    std::vector<std::thread> threads;
    struct Join {  // also when `progress` throws: no thread is left running
      std::vector<std::thread>& threads;
      ~Join() {
        for (auto& t : threads)
          if (t.joinable()) t.join();
      }
    } join{threads};
    for (unsigned i = 0; i < helpers && i < n; ++i) {
      try {
        threads.emplace_back(chunks);
      } catch (const std::exception&) {  // no thread to be had: the chunks are hashed below
        break;
      }
    }
    for (uint64_t c = 0; c < n && first_bad.load() == n; ++c) {
      auto [lo, len] = ChunkRange(*e, c);
      whole.Update(data + lo, len);
      if (progress) progress(len);
    }
    chunks();  // whatever the helpers left, or all of it without helpers
    for (auto& t : threads) t.join();
    if (first_bad.load() < n) return ChunkMismatch(*e, first_bad.load(), got[first_bad.load()]);
  } else {
    std::string buf;
    for (uint64_t c = 0; c < e->chunks.size(); ++c) {
      auto [lo, len] = ChunkRange(*e, c);
      buf.resize(len);
      Status s = reader->ReadAt(lo, buf.data(), len);
      if (!s.ok()) return s.WithContext(where);
      Hash128 got = HashBytes(buf.data(), len);
      if (got != e->chunks[c]) return ChunkMismatch(*e, c, got);
      whole.Update(buf.data(), len);
      if (progress) progress(len);
    }
  }
  if (whole.Digest() != e->hash) {
    open_.erase(e->name);
    return Status(Code::kDataLoss, "whole-object checksum mismatch in " + where +
                                       ": expected xxh3-128 " + e->hash.Hex() + ", computed " +
                                       whole.Digest().Hex() + "; " + kCorrupt);
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
}  // namespace ckptio
