// SyncPointFs: the POSIX backend's system-call layer (PosixFs) with a hook
// at each named point of its commit recipe (posix_backend.h), for the crash
// and commit-order tests. Test-only, like the rest of plugins/faulty: the
// backend users link has no hooks.
//
// The hook runs after the step it names, with the path of the temp file
// (points 1-4) or of the target (5-6), as the kernel names the folder
// (/proc/self/fd: symbolic links in the store's path resolved). A non-OK return fails the system
// call there with EIO (as a real error at that point would; the call's own effect is undone where
// the backend could not see it: a temp file the failed open created is removed); a hook may also
// kill the process there (the crash tests do). Use: PosixBackendOptions::fs =
// std::make_shared<SyncPointFs>(hook), then NewPosixBackend(root, options).
//
// How each point is seen from below the backend: a temp file is an OpenAt
// with O_CREAT of a name that IsTempObjectName; data-written and file-synced
// are just before and after its Fsync; file-closed after its Close; renamed
// is just before the first Fsync of the directory after a RenameAt or LinkAt
// into it (so after the link's temp unlink), dir-synced just after it.
// Thread-safe: each writer has its own file and directory descriptors.
#ifndef CKPTIO_SYNC_POINT_FS_H_
#define CKPTIO_SYNC_POINT_FS_H_

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "ckptio/export.h"
#include "ckptio/posix_backend.h"
#include "ckptio/status.h"

namespace ckptio {

// The named points of the POSIX commit recipe (posix_backend.h).
enum class PosixSyncPoint {
  kTempOpened,   // 1
  kDataWritten,  // 2
  kFileSynced,   // 3
  kFileClosed,   // 4
  kRenamed,      // 5 (rename or link)
  kDirSynced,    // 6
};
CKPTIO_EXPORT std::string_view PosixSyncPointName(PosixSyncPoint p);

class CKPTIO_EXPORT SyncPointFs : public PosixFs {
 public:
  using Hook = std::function<Status(PosixSyncPoint, const std::string& path)>;
  // `inner`: the layer below (null: the kernel's).
  explicit SyncPointFs(Hook hook, std::shared_ptr<PosixFs> inner = nullptr);

  int OpenAt(int dirfd, const char* name, int flags, mode_t mode) override;
  ssize_t Write(int fd, const void* data, size_t size) override;
  int Fsync(int fd) override;
  int Close(int fd) override;
  int MkdirAt(int dirfd, const char* name, mode_t mode) override;
  int RenameAt(int dirfd, const char* from, const char* to) override;
  int LinkAt(int dirfd, const char* from, const char* to) override;
  int UnlinkAt(int dirfd, const char* name, int flags) override;
  int StatFsType(const char* path, uint64_t* f_type) override;

 private:
  // Runs the hook; false (errno EIO) if it fails the call.
  bool Run(PosixSyncPoint point, const std::string& path);

  Hook hook_;
  std::shared_ptr<PosixFs> inner_;
  std::mutex mu_;
  std::map<int, std::string> temps_;    // open temp file descriptor -> its path
  std::map<int, std::string> renamed_;  // directory descriptor -> target renamed into it
};

}  // namespace ckptio

#endif  // CKPTIO_SYNC_POINT_FS_H_
