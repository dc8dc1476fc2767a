// Power-loss simulation for the POSIX backend, after the LevelDB/RocksDB
// fault-injection file systems. Plug a PowerLossFs into
// PosixBackendOptions::fs; it forwards every call to the kernel while
// tracking what is durable:
//   - a file's bytes are durable up to its size at its last fsync;
//   - a directory entry created, renamed or removed is durable once its
//     directory was fsynced afterwards.
// The power is cut at call #cut_at (0-based): that call and every later one
// fail with EIO, as if the machine had stopped there. Destroy whatever used
// the backend (the "process" is gone), then call Apply: it rewrites the real
// files into a state the disk could hold after the cut:
//   kDrop:   every unsynced directory change is undone (new names vanish,
//            removed and replaced ones come back with their old contents)
//            and every file loses its unsynced bytes;
//   kGarble: each unsynced directory change (a rename counts as one) is kept
//            or undone at random, and each file keeps a random part of its
//            unsynced tail, partly overwritten with junk.
// Files this process never wrote, and synced state, are left alone: that is
// the contract of fsync that ckptio's commit recipe relies on.
#ifndef CKPTIO_POWER_LOSS_FS_H_
#define CKPTIO_POWER_LOSS_FS_H_

#include <sys/stat.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/posix_backend.h"

namespace ckptio {

enum class PowerLossMode { kDrop, kGarble };

struct CKPTIO_EXPORT PowerLossReport {
  int undone_entries = 0;  // directory changes rolled back
  int kept_entries = 0;    // unsynced directory changes kept (kGarble)
  int files_cut = 0;       // files that lost (or garbled) unsynced bytes
  uint64_t bytes_dropped = 0;
};

class CKPTIO_EXPORT PowerLossFs : public PosixFs {
 public:
  // `scratch` is an empty or missing directory on the same file system as
  // the store (it holds hard links to removed files, to bring them back).
  PowerLossFs(std::string scratch, int64_t cut_at);
  ~PowerLossFs() override;

  int64_t ops() const;  // calls seen so far
  bool cut() const;     // whether the power is off

  int OpenAt(int dirfd, const char* name, int flags, mode_t mode) override;
  ssize_t Write(int fd, const void* data, size_t size) override;
  int Fsync(int fd) override;
  int Close(int fd) override;
  int MkdirAt(int dirfd, const char* name, mode_t mode) override;
  int RenameAt(int dirfd, const char* from, const char* to) override;
  int LinkAt(int dirfd, const char* from, const char* to) override;
  int UnlinkAt(int dirfd, const char* name, int flags) override;

  // Rewrites the files under the tracked directories into a state the disk
  // could hold after the cut (see above). Call once, after the cut and after
  // everything that used this file system is destroyed.
  Result<PowerLossReport> Apply(PowerLossMode mode, uint64_t seed);

 private:
  using FileId = std::pair<dev_t, ino_t>;
  // One unsynced change of a directory entry: what `dir/name` was before.
  struct Change {
    std::string dir;
    std::string name;
    enum class Was { kAbsent, kFile, kEmptyDir } was;
    std::string saved;  // kFile: a hard link to the old inode, in scratch
    int64_t group;      // the changes of one call undo together
  };

  bool Enter();  // counts a call; false once the power is cut
  std::string DirPath(int dirfd, const char* name, std::string* base) const;
  void NoteFileData(int fd);
  // Records that dir/name is about to change (or changed, for kAbsent).
  bool Remember(int dirfd, const char* name, int64_t group);
  Status Undo(const Change& c) const;

  const std::string scratch_;
  const int64_t cut_at_;
  mutable std::mutex mu_;
  int64_t ops_ = 0;
  int64_t saved_ = 0;
  std::vector<Change> changes_;             // oldest first
  std::map<FileId, uint64_t> synced_size_;  // files written through us
  std::set<std::string> dirs_;              // where names were changed
};

}  // namespace ckptio

#endif  // CKPTIO_POWER_LOSS_FS_H_
