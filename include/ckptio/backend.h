// StorageBackend: the narrow, object-shaped interface every store sits on.
//
// A backend moves bytes and nothing else. It names objects by *keys*:
// relative paths of one or more components joined by '/', each component
// made of [A-Za-z0-9._-] (see ValidateKey). It never interprets them. The
// commit protocol, checksums, manifests and LATEST live in the core
// (store.h), so every backend gets identical verification and crash
// semantics.
//
// Durability contract (what the core relies on):
//   * An object becomes visible under its key only when ObjectWriter::Commit
//     returns OK, and at that moment its bytes and the name are durable
//     (POSIX: fsync the file, close, rename, fsync the directory).
//   * Before that, nothing is visible under the key. In-flight data may be
//     visible to List() only as keys whose last component is a temp name:
//     TempObjectName(<the key's last component>) in the key's folder
//     (ckptio/layout.h), which the core deletes (at the top, in step-*/ and
//     in .coord/, where it writes) when no writer holds the lock.
//   * Delete is durable when it returns OK.
//
// Thread safety: a backend may be used from several threads at once; a
// single ObjectWriter or ObjectReader may not.
#ifndef CKPTIO_BACKEND_H_
#define CKPTIO_BACKEND_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/hash.h"
#include "ckptio/layout.h"
#include "ckptio/status.h"

namespace ckptio {

// Limits on keys, enforced by ValidateKey.
inline constexpr size_t kMaxKeyComponent = 200;
inline constexpr size_t kMaxKeyLength = 1024;

// OK if `key` is a legal key: non-empty components separated by single '/',
// each of [A-Za-z0-9._-], none "." or "..", no leading or trailing '/', at
// most kMaxKeyComponent bytes per component and kMaxKeyLength in all.
// InvalidArgument naming the offence otherwise. Backends call this on every
// key they receive, so nothing is ever written outside the store.
CKPTIO_EXPORT Status ValidateKey(std::string_view key);

// OK if `prefix` may be passed to StorageBackend::List: "" (everything), a
// legal key, or a legal key followed by one '/'.
CKPTIO_EXPORT Status ValidatePrefix(std::string_view prefix);

// Writes one object. Not thread-safe.
class CKPTIO_EXPORT ObjectWriter {
 public:
  // Discards the object if Commit() did not succeed. Never throws and never
  // makes anything visible.
  virtual ~ObjectWriter() = default;

  // Appends bytes. They are not durable or visible until Commit().
  virtual Status Append(const void* data, size_t size) = 0;

  // Makes the object durable and visible under its key, atomically. On
  // error the object is discarded (its temp data removed where possible);
  // the writer must not be used again. Never retries a failed sync.
  virtual Status Commit() = 0;
};

// The bytes of a whole object in memory: a private memory map or a buffer,
// owned by the view and released with it. Writable; writes change only the
// view (a map is copy-on-write), never the object.
class CKPTIO_EXPORT ObjectView {
 public:
  virtual ~ObjectView() = default;
  virtual char* data() = 0;
  virtual uint64_t size() const = 0;
};

// Private zero-filled memory of `size` bytes (mmap), freed with the object;
// from byte `huge_from` on advised onto transparent huge pages (a fault per
// aligned 2 MiB instead of per 4 KiB when first touched). For buffers that
// objects are read into or written from: a view of an object that cannot be
// mapped, a part of an upload. ResourceExhausted when there is no memory.
class CKPTIO_EXPORT AnonymousMemory {
 public:
  static Result<AnonymousMemory> Allocate(size_t size, size_t huge_from = 0);
  AnonymousMemory(AnonymousMemory&& other) noexcept;
  AnonymousMemory& operator=(AnonymousMemory&& other) noexcept;
  AnonymousMemory(const AnonymousMemory&) = delete;
  AnonymousMemory& operator=(const AnonymousMemory&) = delete;
  ~AnonymousMemory();
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  AnonymousMemory(char* data, size_t size, size_t mapped)
      : data_(data), size_(size), mapped_(mapped) {}
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // at least one page: mmap takes no empty mapping
};

// Reads one committed object. Not thread-safe.
class CKPTIO_EXPORT ObjectReader {
 public:
  virtual ~ObjectReader() = default;
  // Size of the object when it was opened.
  virtual uint64_t Size() const = 0;
  // Fills buf with exactly `size` bytes starting at `offset`. Reading past
  // the end is DataLoss (a short object is a torn object).
  virtual Status ReadAt(uint64_t offset, void* buf, size_t size) = 0;
  // ReadAt, and the XXH3-128 of the bytes read (HashBytes of `buf` after
  // it). The default reads, then hashes `buf`: a second pass over memory. A
  // backend whose bytes arrive in small pieces (a network read) hashes each
  // piece in `buf` just after writing it there, while it is in cache; the
  // hash is always of the bytes in `buf`.
  virtual Result<Hash128> ReadAndHash(uint64_t offset, void* buf, size_t size);
  // How many ReadAt calls (on distinct ranges) may run at once from
  // different threads, and pay: 1 (the default) where ReadAt is not
  // thread-safe or gains nothing (a local file, one NFS connection); an
  // object store's ranged GETs go in parallel. Readers that cannot Map are
  // read chunk by chunk on this many threads.
  virtual unsigned ConcurrentReads() const { return 1; }
  // Maps the whole object privately (copy-on-write) with its pages read in,
  // so touching them costs no I/O while they stay cached. The map outlives
  // the reader. Unimplemented where the backend cannot map (callers then
  // use ReadAt). Pages the kernel evicts are read again from storage on
  // the next touch: callers verify what they map before they use it.
  virtual Result<std::unique_ptr<ObjectView>> Map() {
    return Status(Code::kUnimplemented, "this backend cannot map objects");
  }
};

// An exclusive lock held until the object is destroyed.
class CKPTIO_EXPORT BackendLock {
 public:
  virtual ~BackendLock() = default;
};

enum class LockMode { kExclusive, kShared };

enum class WriteMode {
  kReplace,          // Atomically replace an existing object, if any.
  kCreateExclusive,  // Fail with AlreadyExists if the key exists.
};

struct CKPTIO_EXPORT ObjectInfo {
  uint64_t size = 0;
};

class CKPTIO_EXPORT StorageBackend {
 public:
  virtual ~StorageBackend() = default;

  // Where the backend points, for messages ("file:///ckpt/run42").
  virtual std::string Uri() const = 0;

  // Starts a new object under `key`. Missing parent "directories" are
  // created as needed. Nothing is visible until ObjectWriter::Commit().
  virtual Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) = 0;

  // Opens a committed object. NotFound if absent.
  virtual Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) = 0;

  // NotFound if absent.
  virtual Result<ObjectInfo> Stat(std::string_view key) = 0;

  // Every key that starts with `prefix` ("" for all, "step-000000000001/"
  // for one directory), sorted, including in-flight temp objects. A missing
  // prefix is an empty list, not an error; NotFound means the store itself
  // (the backend's root) does not exist. Entries that are not plain objects
  // (symlinks, devices) are skipped.
  virtual Result<std::vector<std::string>> List(std::string_view prefix) = 0;

  // Durably deletes the object. NotFound if absent. A "directory" that
  // becomes empty disappears with its last object.
  virtual Status Delete(std::string_view key) = 0;

  // Tries once to take an inter-process lock named `key`: exclusive, or
  // shared with other shared holders. FailedPrecondition if a conflicting
  // holder has it; a process holds at most one lock per key, so a second
  // TryLock of the same key in this process is FailedPrecondition whatever
  // the modes. Unimplemented if the backend cannot lock.
  virtual Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key,
                                                       LockMode mode = LockMode::kExclusive) {
    (void)key;
    (void)mode;
    return Status(Code::kUnimplemented, Uri() + ": this backend does not support locks");
  }

  // Discards writes that were started and never committed, and that List
  // does not show as temp objects (an object store's multipart uploads
  // under the store); returns how many. The core calls it where it sweeps
  // stale temp objects: when a writer takes the store (so also at `ckptio
  // fsck --repair` and `gc`). Default: there are none.
  virtual Result<size_t> AbortUnfinishedWrites() { return size_t{0}; }

  // Whether a writer can go on changing objects after it lost the writer
  // lock without knowing it: TryLock's locks are leases that the storage
  // does not enforce on writes (an object store; NFS or any network file
  // system, whose locks end with a lease). The core then writes the
  // objects of each writer in a folder of its own inside the step, named by
  // the manifest (kObjectsFolderKey, manifest.h), so a stale writer's late
  // writes never land on a step that another writer committed.
  virtual bool LocksAreLeases() const { return false; }

  // Whether anyone (another process, or this one) holds a lock named `key`,
  // without taking it. Unimplemented if the backend cannot tell.
  virtual Result<bool> IsLocked(std::string_view key) {
    (void)key;
    return Status(Code::kUnimplemented, Uri() + ": this backend does not support locks");
  }
};

// A parsed store URI: "file:///abs/path", "nfs://server/export?version=3",
// or a plain path (scheme "file").
struct CKPTIO_EXPORT Uri {
  std::string scheme;     // lowercase, never empty
  std::string authority;  // "" for file://
  std::string path;
  std::map<std::string, std::string> params;  // from "?k=v&k2=v2"

  static Result<Uri> Parse(std::string_view text);
};

using BackendFactory = std::function<Result<std::unique_ptr<StorageBackend>>(const Uri& uri)>;

// Maps URI schemes to backend factories. Backends are registered by explicit
// calls (see ckptio/backends.h), never by static initialisers a linker could
// drop.
class CKPTIO_EXPORT BackendRegistry {
 public:
  // AlreadyExists if the scheme is taken; InvalidArgument if it is not
  // lowercase [a-z0-9+.-].
  Status Register(std::string scheme, BackendFactory factory);

  // Parses `uri` and builds the backend of its scheme. An unknown scheme is
  // InvalidArgument listing the known ones.
  Result<std::unique_ptr<StorageBackend>> Open(std::string_view uri) const;

  std::vector<std::string> Schemes() const;

 private:
  std::map<std::string, BackendFactory> factories_;
};

}  // namespace ckptio

#endif  // CKPTIO_BACKEND_H_
