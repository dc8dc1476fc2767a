// The fault-injecting backend: wraps any backend, counts every operation,
// and fails the k-th (with a chosen errno, or at random with a seed), or
// "crashes" at the k-th: that one and every later operation fail, as if the
// process had died there. For tests and the crash harness.
//
// Operations counted, in call order: NewObject, Append, Commit (of a writer),
// OpenObject, ReadAt (of a reader), Stat, List, Delete, IsLocked, TryLock.
// Crash semantics: writers and readers opened before the crash stop working
// too; whatever the inner backend had made durable stays (a crash never
// undoes a committed object: see the POSIX commit recipe).
//
// URI form: faulty+<inner-uri>?fail_at=K&errno=ENOSPC or ?crash_at=K or
// ?fail_rate=0.01&seed=7, e.g. faulty+file:///tmp/store?crash_at=12, opened
// through BackendsWithFaults() (test-only: not in BuiltinBackends()).
//
// Power loss (unsynced bytes and directory entries lost) needs to see below
// the object interface: see PowerLossFs in ckptio/power_loss_fs.h, which
// plugs into the POSIX backend's system-call layer.
#ifndef CKPTIO_FAULTY_BACKEND_H_
#define CKPTIO_FAULTY_BACKEND_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckptio/backend.h"
#include "ckptio/export.h"

namespace ckptio {

struct CKPTIO_EXPORT FaultPlan {
  int64_t fail_at = -1;      // fail only operation #fail_at (0-based)
  int fail_errno = 5;        // EIO; ENOSPC, EDQUOT, EINTR ... as ErrnoToStatus maps them
  bool short_write = false;  // at fail_at, an Append passes half its bytes on, then fails
  int64_t crash_at = -1;     // operation #crash_at and all later ones fail
  double fail_rate = 0;      // each operation fails with this probability...
  uint64_t seed = 1;         // ...drawn from this seed
};

class CKPTIO_EXPORT FaultyBackend : public StorageBackend {
 public:
  FaultyBackend(std::shared_ptr<StorageBackend> inner, FaultPlan plan);
  ~FaultyBackend() override;

  // Operations counted so far, and their names ("append step-.../a").
  int64_t ops() const;
  std::vector<std::string> log() const;
  bool crashed() const;

  std::string Uri() const override;
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override;
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override;
  Result<ObjectInfo> Stat(std::string_view key) override;
  Result<std::vector<std::string>> List(std::string_view prefix) override;
  Status Delete(std::string_view key) override;
  Result<bool> IsLocked(std::string_view key) override;
  bool LocksAreLeases() const override { return inner_->LocksAreLeases(); }
  Result<size_t> AbortUnfinishedWrites() override { return inner_->AbortUnfinishedWrites(); }
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override;

  // Counts one operation; non-OK if the plan fails it. (Used by the
  // writer and reader wrappers too.)
  Status Step(const std::string& what, bool* short_write = nullptr);

 private:
  std::shared_ptr<StorageBackend> inner_;
  FaultPlan plan_;
  mutable std::mutex mu_;
  int64_t ops_ = 0;
  bool crashed_ = false;
  uint64_t rng_;
  std::vector<std::string> log_;
};

// Registers "faulty+<scheme>" for every scheme already in `registry`.
CKPTIO_EXPORT Status RegisterFaultyBackends(BackendRegistry& registry);

// Every built-in backend (BuiltinBackends()) and "faulty+" over each, for
// tests and the benchmark; the registry users link has no faulty+ schemes.
// Built once, on first use; thread-safe.
CKPTIO_EXPORT const BackendRegistry& BackendsWithFaults();

}  // namespace ckptio

#endif  // CKPTIO_FAULTY_BACKEND_H_
