// The POSIX backend: file:///abs/path or a plain path (local disk or a
// kernel-mounted NFS path).
//
// Commit recipe for every object (ObjectWriter::Commit), in order:
//   1. openat(dir, ".ckptio-tmp.<name>.<host>.<pid>.<n>",
//             O_WRONLY|O_CREAT|O_EXCL|O_CLOEXEC|O_NOFOLLOW) in the target's
//      own directory (so the rename cannot cross filesystems);
//   2. write(), looping on short writes and EINTR;
//   3. fsync(file)  -- an error fails the commit; it is never retried, since
//      after a failed fsync the page cache may claim data that is gone;
//   4. close(file), checked (NFS reports write-back errors here);
//   5. renameat(tmp -> name) for WriteMode::kReplace, or linkat(tmp -> name)
//      + unlinkat(tmp) for kCreateExclusive (fails if the name exists);
//   6. fsync(dir), so the new name survives power loss. If this fails after
//      an exclusive create, the new name is unlinked again: an object must
//      not stay visible without being durable.
// Directories are created with mkdirat + fsync of their parent. Every path
// inside the store is walked component by component with O_NOFOLLOW, so a
// symlink planted in the store is an error (FailedPrecondition), never
// followed, and a FIFO, socket or device under an object's name is refused
// (FailedPrecondition) without waiting on it. Locks are whole-file fcntl
// locks (F_SETLK: never flock, which NFS does not propagate) on a
// descriptor opened with openat(O_RDWR|O_NOFOLLOW) in the walked
// directory. On NFS a commit whose rename or link reply was lost (the
// retransmission answers ENOENT or EEXIST) succeeds if the target is now
// the temp file's inode. Objects are memory-mapped only on local file
// systems (see IsNetworkFileSystem); elsewhere Map() is Unimplemented and
// callers read them into memory. On those file systems fcntl locks are
// leases (a client cut off past its lease loses them without knowing), and
// the backend says so (LocksAreLeases), judging the store's folder with
// PosixFs::StatFsType when it is made; Map() asks fstatfs(2) of the file.
#ifndef CKPTIO_POSIX_BACKEND_H_
#define CKPTIO_POSIX_BACKEND_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "ckptio/backend.h"
#include "ckptio/export.h"

namespace ckptio {

// The system calls through which the backend opens, writes, syncs, renames
// and removes, and the statfs(2) that tells which file system the store is
// on (not reads, other stats or locks), so that tests can model what a power cut keeps,
// stop at each step of the recipe above (see plugins/faulty's PowerLossFs and
// SyncPointFs, test-only), or put a store on NFS. Each returns like the call
// it names (-1 with errno set on failure). The default forwards to the
// kernel.
class CKPTIO_EXPORT PosixFs {
 public:
  virtual ~PosixFs() = default;
  virtual int OpenAt(int dirfd, const char* name, int flags, mode_t mode);
  virtual ssize_t Write(int fd, const void* data, size_t size);
  virtual int Fsync(int fd);
  virtual int Close(int fd);  // the checked close of a written file
  virtual int MkdirAt(int dirfd, const char* name, mode_t mode);
  virtual int RenameAt(int dirfd, const char* from, const char* to);
  virtual int LinkAt(int dirfd, const char* from, const char* to);
  virtual int UnlinkAt(int dirfd, const char* name, int flags);
  // statfs(2) of `path`, its f_type only.
  virtual int StatFsType(const char* path, uint64_t* f_type);
};

struct CKPTIO_EXPORT PosixBackendOptions {
  // The system-call layer; null means the kernel's.
  std::shared_ptr<PosixFs> fs;
};

// Whether statfs(2)'s f_type names a network or cluster file system (NFS,
// SMB/CIFS, FUSE, 9P, CephFS, AFS, Coda, NCP, Lustre, GPFS, BeeGFS,
// OrangeFS), on which ObjectReader::Map() refuses to map: a file deleted by
// another client goes stale under a map, and touching it raises SIGBUS. On
// such a file system the backend's locks are leases (LocksAreLeases): a
// client cut off from the server past its lease loses its locks without
// knowing it, and its process goes on writing.
CKPTIO_EXPORT bool IsNetworkFileSystem(uint64_t f_type);

// A backend rooted at `root` (absolute, or relative to the current
// directory). The root is created on the first write or lock.
CKPTIO_EXPORT Result<std::unique_ptr<StorageBackend>> NewPosixBackend(
    std::string root, PosixBackendOptions options = {});

// Registers "file" (file:///abs/path, file://localhost/abs/path and plain
// paths) in `registry`.
CKPTIO_EXPORT Status RegisterPosixBackend(BackendRegistry& registry);

}  // namespace ckptio

#endif  // CKPTIO_POSIX_BACKEND_H_
