#include "ckptio/sync_point_fs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "ckptio/layout.h"

namespace ckptio {
namespace {

std::string PathAt(int dirfd, const char* name) {
  std::error_code ec;
  auto dir = std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(dirfd), ec);
  return (ec ? std::string("?") : dir.string()) + "/" + name;
}

std::string_view LastComponent(std::string_view name) {
  const size_t slash = name.rfind('/');
  return slash == std::string_view::npos ? name : name.substr(slash + 1);
}

}  // namespace

std::string_view PosixSyncPointName(PosixSyncPoint p) {
  switch (p) {
    case PosixSyncPoint::kTempOpened:
      return "temp-opened";
    case PosixSyncPoint::kDataWritten:
      return "data-written";
    case PosixSyncPoint::kFileSynced:
      return "file-synced";
    case PosixSyncPoint::kFileClosed:
      return "file-closed";
    case PosixSyncPoint::kRenamed:
      return "renamed";
    case PosixSyncPoint::kDirSynced:
      return "dir-synced";
  }
  return "unknown";
}

SyncPointFs::SyncPointFs(Hook hook, std::shared_ptr<PosixFs> inner)
    : hook_(std::move(hook)), inner_(inner ? std::move(inner) : std::make_shared<PosixFs>()) {}

bool SyncPointFs::Run(PosixSyncPoint point, const std::string& path) {
  if (hook_(point, path).ok()) return true;
  errno = EIO;
  return false;
}

int SyncPointFs::OpenAt(int dirfd, const char* name, int flags, mode_t mode) {
  const int fd = inner_->OpenAt(dirfd, name, flags, mode);
  if (fd < 0) return fd;
  {
    // A number the kernel hands out again: whatever was recorded under it
    // belonged to a descriptor closed without passing here (the backend
    // closes a discarded temp or a directory itself).
    std::lock_guard<std::mutex> g(mu_);
    temps_.erase(fd);
    renamed_.erase(fd);
  }
  if (!(flags & O_CREAT) || !IsTempObjectName(LastComponent(name))) return fd;
  const std::string path = PathAt(dirfd, name);
  if (!Run(PosixSyncPoint::kTempOpened, path)) {
    ::close(fd);
    inner_->UnlinkAt(dirfd, name, 0);
    errno = EIO;
    return -1;
  }
  std::lock_guard<std::mutex> g(mu_);
  temps_[fd] = path;
  return fd;
}

ssize_t SyncPointFs::Write(int fd, const void* data, size_t size) {
  return inner_->Write(fd, data, size);
}

int SyncPointFs::Fsync(int fd) {
  std::string temp, target;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (auto it = temps_.find(fd); it != temps_.end()) temp = it->second;
    if (auto it = renamed_.find(fd); it != renamed_.end()) {
      target = it->second;
      renamed_.erase(it);
    }
  }
  if (!temp.empty()) {
    if (!Run(PosixSyncPoint::kDataWritten, temp)) return -1;
    if (inner_->Fsync(fd) != 0) return -1;
    return Run(PosixSyncPoint::kFileSynced, temp) ? 0 : -1;
  }
  if (!target.empty()) {
    if (!Run(PosixSyncPoint::kRenamed, target)) return -1;
    if (inner_->Fsync(fd) != 0) return -1;
    return Run(PosixSyncPoint::kDirSynced, target) ? 0 : -1;
  }
  return inner_->Fsync(fd);
}

int SyncPointFs::Close(int fd) {
  std::string temp;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (auto it = temps_.find(fd); it != temps_.end()) {
      temp = it->second;
      temps_.erase(it);
    }
  }
  if (inner_->Close(fd) != 0) return -1;
  if (temp.empty()) return 0;
  return Run(PosixSyncPoint::kFileClosed, temp) ? 0 : -1;
}

int SyncPointFs::MkdirAt(int dirfd, const char* name, mode_t mode) {
  return inner_->MkdirAt(dirfd, name, mode);
}

int SyncPointFs::RenameAt(int dirfd, const char* from, const char* to) {
  const int r = inner_->RenameAt(dirfd, from, to);
  // ENOENT: on NFS, a rename whose reply was lost, which the backend may
  // find done (then the directory fsync follows, and the points with it).
  if (r == 0 || errno == ENOENT) {
    const int saved = errno;
    std::lock_guard<std::mutex> g(mu_);
    renamed_[dirfd] = PathAt(dirfd, to);
    errno = saved;
  }
  return r;
}

int SyncPointFs::LinkAt(int dirfd, const char* from, const char* to) {
  const int r = inner_->LinkAt(dirfd, from, to);
  // EEXIST: on NFS, a link whose reply was lost (as for RenameAt); where the
  // name was someone else's, no directory fsync follows and the entry waits
  // unused until the descriptor is closed.
  if (r == 0 || errno == EEXIST) {
    const int saved = errno;
    std::lock_guard<std::mutex> g(mu_);
    renamed_[dirfd] = PathAt(dirfd, to);
    errno = saved;
  }
  return r;
}

int SyncPointFs::UnlinkAt(int dirfd, const char* name, int flags) {
  return inner_->UnlinkAt(dirfd, name, flags);
}
int SyncPointFs::StatFsType(const char* path, uint64_t* f_type) {
  return inner_->StatFsType(path, f_type);
}

}  // namespace ckptio
