// The POSIX backend. The commit recipe is described in posix_backend.h.
#include "ckptio/posix_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace ckptio {

int PosixFs::OpenAt(int dirfd, const char* name, int flags, mode_t mode) {
  return ::openat(dirfd, name, flags, mode);
}
ssize_t PosixFs::Write(int fd, const void* data, size_t size) { return ::write(fd, data, size); }
int PosixFs::Fsync(int fd) { return ::fsync(fd); }
int PosixFs::Close(int fd) { return ::close(fd); }
int PosixFs::MkdirAt(int dirfd, const char* name, mode_t mode) {
  return ::mkdirat(dirfd, name, mode);
}
int PosixFs::RenameAt(int dirfd, const char* from, const char* to) {
  return ::renameat(dirfd, from, dirfd, to);
}
int PosixFs::LinkAt(int dirfd, const char* from, const char* to) {
  return ::linkat(dirfd, from, dirfd, to, 0);
}
int PosixFs::UnlinkAt(int dirfd, const char* name, int flags) {
  return ::unlinkat(dirfd, name, flags);
}
int PosixFs::StatFsType(const char* path, uint64_t* f_type) {
  struct statfs info;
  if (::statfs(path, &info) != 0) return -1;
  *f_type = static_cast<uint64_t>(info.f_type);
  return 0;
}

// statfs(2) magics of network file systems that <linux/magic.h> lacks or
// that older kernels' headers lack.
#ifndef CIFS_SUPER_MAGIC
#define CIFS_SUPER_MAGIC 0xFF534D42
#endif
#ifndef SMB2_SUPER_MAGIC
#define SMB2_SUPER_MAGIC 0xFE534D42
#endif
#ifndef CEPH_SUPER_MAGIC
#define CEPH_SUPER_MAGIC 0x00C36400
#endif
#ifndef AFS_FS_MAGIC
#define AFS_FS_MAGIC 0x6B414653
#endif
#ifndef NCP_SUPER_MAGIC
#define NCP_SUPER_MAGIC 0x564C
#endif
#define CKPTIO_LUSTRE_SUPER_MAGIC 0x0BD00BD0
#define CKPTIO_GPFS_SUPER_MAGIC 0x47504653
#define CKPTIO_BEEGFS_SUPER_MAGIC 0x19830326
#define CKPTIO_ORANGEFS_SUPER_MAGIC 0x20030528

bool IsNetworkFileSystem(uint64_t f_type) {
  // Compared as 32 bits: f_type is a signed long, and on 32-bit builds the
  // magics with the top bit set (CIFS, SMB2) come back negative.
  switch (static_cast<uint32_t>(f_type)) {
    case NFS_SUPER_MAGIC:   // NFS v2-v4
    case SMB_SUPER_MAGIC:   // smbfs
    case CIFS_SUPER_MAGIC:  // cifs.ko
    case SMB2_SUPER_MAGIC:  // cifs.ko speaking SMB2/3
    case FUSE_SUPER_MAGIC:  // sshfs, s3fs, gcsfuse, GlusterFS, ... (and fuseblk)
    case V9FS_MAGIC:        // 9P (virtio-9p, WSL)
    case CEPH_SUPER_MAGIC:  // CephFS kernel client
    case AFS_SUPER_MAGIC:
    case AFS_FS_MAGIC:
    case CODA_SUPER_MAGIC:
    case NCP_SUPER_MAGIC:
    case CKPTIO_LUSTRE_SUPER_MAGIC:
    case CKPTIO_GPFS_SUPER_MAGIC:
    case CKPTIO_BEEGFS_SUPER_MAGIC:
    case CKPTIO_ORANGEFS_SUPER_MAGIC:
      return true;
    default:
      return false;
  }
}

namespace {

constexpr size_t kWriteBuffer = 1 << 20;
// Writeback of a temp file is started every this many bytes.
constexpr size_t kWriteBehind = 8 << 20;

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.Release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = o.Release();
    }
    return *this;
  }
  ~UniqueFd() { Reset(); }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

Status SyncFd(PosixFs& fs, int fd, const std::string& path) {
  if (fs.Fsync(fd) != 0) return ErrnoToStatus(errno, "fsync " + path);
  return OkStatus();
}

// What a file that is not a regular file is, for messages.
const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "of an unknown file type";
}

Status NotRegular(const std::string& path, mode_t mode) {
  return Status(Code::kFailedPrecondition,
                path + " is " + FileKind(mode) +
                    ", not a regular file: ckptio stores only regular files; remove it");
}

// Whether `a` and `b` in directory `dirfd` name the same file.
bool SameFile(int dirfd, const std::string& a, const std::string& b) {
  struct stat sa, sb;
  return ::fstatat(dirfd, a.c_str(), &sa, AT_SYMLINK_NOFOLLOW) == 0 &&
         ::fstatat(dirfd, b.c_str(), &sb, AT_SYMLINK_NOFOLLOW) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

// Splits "a/b/c" into {"a","b"} and "c".
void SplitKey(std::string_view key, std::vector<std::string>* dirs, std::string* base) {
  size_t start = 0;
  while (true) {
    size_t slash = key.find('/', start);
    if (slash == std::string_view::npos) {
      *base = std::string(key.substr(start));
      return;
    }
    dirs->emplace_back(key.substr(start, slash - start));
    start = slash + 1;
  }
}

// Locks held by this process, by the lock file's device and inode (the same
// file may be reached through different paths): fcntl locks belong to the
// process, so without this a second writer in the same process would
// "succeed", and opening and closing the file would drop the first's lock.
using FileId = std::pair<dev_t, ino_t>;
std::mutex& HeldLocksMutex() {
  static std::mutex m;
  return m;
}
std::set<FileId>& HeldLocks() {
  static std::set<FileId> s;
  return s;
}

// A whole-file fcntl lock (F_SETLK: owned by the process, released by the
// kernel when the process dies) on the one descriptor of the file that this
// process has open.
class PosixLock : public BackendLock {
 public:
  PosixLock(FileId id, UniqueFd fd) : id_(id), fd_(std::move(fd)) {}
  ~PosixLock() override {
    // Unlock and close under the registry mutex: once the id is erased,
    // another thread may lock the file, and our close() would drop that lock.
    std::lock_guard<std::mutex> g(HeldLocksMutex());
    struct flock unlock {};
    unlock.l_type = F_UNLCK;  // releases either mode
    unlock.l_whence = SEEK_SET;
    (void)::fcntl(fd_.get(), F_SETLK, &unlock);
    fd_.Reset();  // before the erase
    HeldLocks().erase(id_);
  }

 private:
  FileId id_;
  UniqueFd fd_;
};

class PosixBackend;

class PosixWriter : public ObjectWriter {
 public:
  PosixWriter(const PosixBackend* backend, UniqueFd dir, UniqueFd file, std::string dir_path,
              std::string name, std::string tmp, WriteMode mode)
      : backend_(backend),
        dir_(std::move(dir)),
        file_(std::move(file)),
        dir_path_(std::move(dir_path)),
        name_(std::move(name)),
        tmp_(std::move(tmp)),
        mode_(mode) {}

  ~PosixWriter() override {
    if (!committed_) Discard();
  }

  Status Append(const void* data, size_t size) override {
    if (dead_) return Dead();
    const char* p = static_cast<const char*>(data);
    if (buffer_.size() + size <= kWriteBuffer) {
      buffer_.append(p, size);
      return OkStatus();
    }
    Status s = Flush();
    if (s.ok()) {
      if (size >= kWriteBuffer) {
        s = WriteAll(p, size);
      } else {
        buffer_.append(p, size);
      }
    }
    if (!s.ok()) Fail();
    return s;
  }

  Status Commit() override;

 private:
  Status Dead() const {
    return Status(Code::kFailedPrecondition,
                  "object " + Path(name_) + " failed earlier or is committed");
  }
  std::string Path(const std::string& base) const { return dir_path_ + "/" + base; }

  Status Flush() {
    Status s = WriteAll(buffer_.data(), buffer_.size());
    buffer_.clear();
    return s;
  }

  Status WriteAll(const char* p, size_t size) {
    while (size > 0) {
      ssize_t n = fs().Write(file_.get(), p, std::min(size, kWriteBehind));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, "write " + Path(tmp_));
      }
      if (n == 0)  // no progress and no error (some FUSE file systems): never loop on it
        return ErrnoToStatus(EIO, "write " + Path(tmp_) + " wrote nothing");
      p += n;
      size -= static_cast<size_t>(n);
      written_ += static_cast<uint64_t>(n);
      if (written_ - started_ >= kWriteBehind) {
        // Start writeback of what is written so far, so that the disk works
        // while we go on and the commit's fsync has less left to wait for
        // (RocksDB's bytes_per_sync). Advisory: durability is still the
        // fsync's, and a writeback error is reported by it.
        ::sync_file_range(file_.get(), static_cast<off_t>(started_),
                          static_cast<off_t>(written_ - started_), SYNC_FILE_RANGE_WRITE);
        started_ = written_;
      }
    }
    return OkStatus();
  }

  PosixFs& fs() const;

  void Fail() {
    dead_ = true;
    Discard();
  }

  // Removes the temp file (never the target). Never throws.
  void Discard() {
    file_.Reset();
    if (!tmp_.empty()) fs().UnlinkAt(dir_.get(), tmp_.c_str(), 0);
    tmp_.clear();
  }

  const PosixBackend* backend_;
  UniqueFd dir_;
  UniqueFd file_;
  std::string dir_path_;
  std::string name_;
  std::string tmp_;
  WriteMode mode_;
  std::string buffer_;
  uint64_t written_ = 0;  // bytes written to the temp file
  uint64_t started_ = 0;  // bytes whose writeback was started
  bool dead_ = false;
  bool committed_ = false;
};

// A private, copy-on-write map of a whole file.
class PosixMap : public ObjectView {
 public:
  PosixMap(void* addr, uint64_t size) : addr_(addr), size_(size) {}
  ~PosixMap() override {
    if (size_ > 0) ::munmap(addr_, size_);
  }
  char* data() override { return static_cast<char*>(addr_); }
  uint64_t size() const override { return size_; }

 private:
  void* addr_;
  uint64_t size_;
};

class PosixReader : public ObjectReader {
 public:
  PosixReader(UniqueFd fd, uint64_t size, std::string path)
      : fd_(std::move(fd)), size_(size), path_(std::move(path)) {}
  uint64_t Size() const override { return size_; }
  Result<std::unique_ptr<ObjectView>> Map() override {
    if (size_ == 0) return std::unique_ptr<ObjectView>(new PosixMap(nullptr, 0));
    // Map only on local file systems. On a network file system a file that
    // another client deletes (retention on another host, `ckptio gc`) goes
    // stale under the map: the next touch of an evicted page raises SIGBUS
    // (ESTALE). Reading into memory fails cleanly instead; Unimplemented
    // tells the caller to do that.
    struct statfs fs_info;
    if (::fstatfs(fd_.get(), &fs_info) != 0) return ErrnoToStatus(errno, "fstatfs " + path_);
    if (IsNetworkFileSystem(static_cast<uint64_t>(fs_info.f_type)))
      return Status(Code::kUnimplemented,
                    path_ + " is on a network file system: not mapped, read instead");
    // Writable but private: tensors made from the map may be written to
    // without touching the file (each written page is copied then).
    void* addr = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd_.get(), 0);
    if (addr == MAP_FAILED) return ErrnoToStatus(errno, "mmap " + path_);
    // Touching a page past the end of a file that shrank since it was opened
    // would raise SIGBUS: refuse a file that is no longer whole now.
    struct stat st;
    const bool stat_ok = ::fstat(fd_.get(), &st) == 0;
    if (!stat_ok || static_cast<uint64_t>(st.st_size) < size_) {
      Status s = stat_ok
                     ? Status(Code::kDataLoss, path_ + ": shorter than " + std::to_string(size_) +
                                                   " bytes while being mapped")
                     : ErrnoToStatus(errno, "fstat " + path_);
      ::munmap(addr, size_);
      return s;
    }
    // Start reading ahead and let the first touches map the pages: callers
    // hash a view on every core, which faults it in as it goes. On this
    // 2-core VM, 1 GiB from a warm page cache: MADV_POPULATE_READ alone took
    // 47 ms, hashing with the faults on both cores 32 ms in all.
    (void)::madvise(addr, size_, MADV_WILLNEED);
    return std::unique_ptr<ObjectView>(new PosixMap(addr, size_));
  }

  Status ReadAt(uint64_t offset, void* buf, size_t size) override {
    if (offset > size_ || size > size_ - offset)
      return Status(Code::kDataLoss, path_ + ": read of " + std::to_string(size) +
                                         " bytes at offset " + std::to_string(offset) +
                                         " is past the end of the object (" +
                                         std::to_string(size_) + " bytes)");
    char* p = static_cast<char*>(buf);
    uint64_t pos = offset;
    while (size > 0) {
      ssize_t n = ::pread(fd_.get(), p, size, static_cast<off_t>(pos));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, "read " + path_);
      }
      if (n == 0)
        return Status(Code::kDataLoss, path_ + ": object ends at byte " + std::to_string(pos) +
                                           ", read of " + std::to_string(size) +
                                           " more bytes requested (truncated object?)");
      p += n;
      pos += static_cast<uint64_t>(n);
      size -= static_cast<size_t>(n);
    }
    return OkStatus();
  }

 private:
  UniqueFd fd_;
  uint64_t size_;
  std::string path_;
};

class PosixBackend : public StorageBackend {
 public:
  PosixBackend(std::string root, PosixBackendOptions options)
      : root_(std::move(root)), options_(std::move(options)) {
    if (!options_.fs) options_.fs = std::make_shared<PosixFs>();
    leases_ = OnNetworkFileSystem();
  }

  ~PosixBackend() override = default;

  std::string Uri() const override { return "file://" + root_; }
  bool LocksAreLeases() const override { return leases_; }
  const PosixBackendOptions& options() const { return options_; }
  PosixFs& fs() const { return *options_.fs; }

  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    CKPTIO_ASSIGN_OR_RETURN(KeyParts k, Parts(key));
    if (IsTempObjectName(k.base))
      return Status(Code::kInvalidArgument,
                    "object key \"" + std::string(key) + "\" uses the reserved temp prefix");
    CKPTIO_ASSIGN_OR_RETURN(UniqueFd dir, OpenDir(k.dirs, /*create=*/true));
    std::string dir_path = DirPath(k.dirs);
    std::string tmp = TempObjectName(k.base);
    int fd = fs().OpenAt(dir.get(), tmp.c_str(),
                         O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return ErrnoToStatus(errno, "create " + dir_path + "/" + tmp);
    auto writer = std::make_unique<PosixWriter>(this, std::move(dir), UniqueFd(fd), dir_path,
                                                k.base, tmp, mode);
    return std::unique_ptr<ObjectWriter>(std::move(writer));
  }

  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    CKPTIO_ASSIGN_OR_RETURN(KeyParts k, Parts(key));
    CKPTIO_ASSIGN_OR_RETURN(UniqueFd dir, OpenDir(k.dirs, false));
    // O_NONBLOCK: opening a FIFO (or a tty) planted under the name would
    // otherwise wait for a writer forever; the fstat below refuses it.
    int fd =
        fs().OpenAt(dir.get(), k.base.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0) return ErrnoToStatus(errno, "open " + k.path);
    UniqueFd file(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, "fstat " + k.path);
    if (S_ISDIR(st.st_mode))
      return Status(Code::kNotFound, k.path + " is a directory, not an object");
    if (!S_ISREG(st.st_mode)) return NotRegular(k.path, st.st_mode);
    // Regular files ignore O_NONBLOCK, but some FUSE file systems do not:
    // read them blocking, as before.
    int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
      return ErrnoToStatus(errno, "fcntl " + k.path);
    return std::unique_ptr<ObjectReader>(
        std::make_unique<PosixReader>(std::move(file), static_cast<uint64_t>(st.st_size), k.path));
  }

  Result<ObjectInfo> Stat(std::string_view key) override {
    CKPTIO_ASSIGN_OR_RETURN(KeyParts k, Parts(key));
    CKPTIO_ASSIGN_OR_RETURN(UniqueFd dir, OpenDir(k.dirs, false));
    struct stat st;
    if (::fstatat(dir.get(), k.base.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      return ErrnoToStatus(errno, "stat " + k.path);
    if (S_ISLNK(st.st_mode)) return ErrnoToStatus(ELOOP, "stat " + k.path);
    if (!S_ISREG(st.st_mode))
      return Status(Code::kNotFound, k.path + " is not an object (not a regular file)");
    return ObjectInfo{static_cast<uint64_t>(st.st_size)};
  }

  Result<std::vector<std::string>> List(std::string_view prefix) override {
    CKPTIO_RETURN_IF_ERROR(ValidatePrefix(prefix));
    // Walk the deepest directory named by the prefix, then filter.
    size_t slash = prefix.rfind('/');
    std::string dir_key(slash == std::string_view::npos ? "" : prefix.substr(0, slash));
    if (!dir_key.empty()) CKPTIO_RETURN_IF_ERROR(ValidateKey(dir_key));
    std::vector<std::string> dirs;
    if (!dir_key.empty()) {
      std::string base;
      SplitKey(dir_key, &dirs, &base);
      dirs.push_back(base);
    }
    std::vector<std::string> out;
    auto dir = OpenDir(dirs, false);
    if (!dir.ok()) {
      if (dir.status().code() == Code::kNotFound) {
        if (dirs.empty()) return Status(Code::kNotFound, "no store at " + root_);
        return out;
      }
      return dir.status();
    }
    CKPTIO_RETURN_IF_ERROR(Walk(dir->get(), dir_key.empty() ? "" : dir_key + "/", &out));
    out.erase(std::remove_if(
                  out.begin(), out.end(),
                  [&](const std::string& k) { return k.compare(0, prefix.size(), prefix) != 0; }),
              out.end());
    std::sort(out.begin(), out.end());
    return out;
  }

  Status Delete(std::string_view key) override {
    CKPTIO_ASSIGN_OR_RETURN(KeyParts k, Parts(key));
    // Keep every level open, to remove directories that become empty.
    CKPTIO_ASSIGN_OR_RETURN(std::vector<UniqueFd> chain, OpenDirChain(k.dirs, false));
    if (fs().UnlinkAt(chain.back().get(), k.base.c_str(), 0) != 0) {
      if (errno == EISDIR)
        return Status(Code::kNotFound, k.path + " is a directory, not an object");
      return ErrnoToStatus(errno, "delete " + k.path);
    }
    CKPTIO_RETURN_IF_ERROR(SyncFd(fs(), chain.back().get(), DirPath(k.dirs)));
    for (size_t i = k.dirs.size(); i-- > 0;) {
      chain.pop_back();
      if (fs().UnlinkAt(chain.back().get(), k.dirs[i].c_str(), AT_REMOVEDIR) != 0) break;
      CKPTIO_RETURN_IF_ERROR(
          SyncFd(fs(), chain.back().get(), DirPath({k.dirs.begin(), k.dirs.begin() + i})));
    }
    return OkStatus();
  }

  Result<bool> IsLocked(std::string_view key) override {
    CKPTIO_ASSIGN_OR_RETURN(KeyParts k, Parts(key));
    std::lock_guard<std::mutex> g(HeldLocksMutex());
    auto dir = OpenDir(k.dirs, false);
    if (!dir.ok())
      return dir.status().code() == Code::kNotFound ? Result<bool>(false) : dir.status();
    struct stat st;
    if (::fstatat(dir->get(), k.base.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      return errno == ENOENT ? Result<bool>(false) : ErrnoToStatus(errno, "stat " + k.path);
    if (HeldLocks().count({st.st_dev, st.st_ino})) return true;
    if (!S_ISREG(st.st_mode)) return NotRegular(k.path, st.st_mode);
    // Safe to open and close: this process holds no lock on the file (and
    // cannot take one meanwhile: the registry mutex is held). O_NONBLOCK: a
    // FIFO put there since the fstatat would block the open forever.
    UniqueFd fd(
        fs().OpenAt(dir->get(), k.base.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0));
    if (fd.get() < 0) return ErrnoToStatus(errno, "open lock file " + k.path);
    struct stat opened;
    if (::fstat(fd.get(), &opened) != 0) return ErrnoToStatus(errno, "fstat " + k.path);
    if (!S_ISREG(opened.st_mode)) return NotRegular(k.path, opened.st_mode);
    struct flock probe {};
    probe.l_type = F_WRLCK;
    probe.l_whence = SEEK_SET;
    if (::fcntl(fd.get(), F_GETLK, &probe) != 0) return ErrnoToStatus(errno, "F_GETLK " + k.path);
    return probe.l_type != F_UNLCK;
  }

  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    CKPTIO_ASSIGN_OR_RETURN(KeyParts k, Parts(key));
    std::lock_guard<std::mutex> g(HeldLocksMutex());
    CKPTIO_ASSIGN_OR_RETURN(UniqueFd dir, OpenDir(k.dirs, true));
    // Identify the file with fstatat, which opens nothing: opening and
    // closing it would drop a lock this process already holds.
    struct stat st;
    if (::fstatat(dir.get(), k.base.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno != ENOENT) return ErrnoToStatus(errno, "stat lock file " + k.path);
      int fd = fs().OpenAt(dir.get(), k.base.c_str(),
                           O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
      if (fd < 0 && errno != EEXIST) return ErrnoToStatus(errno, "create lock file " + k.path);
      if (fd >= 0) {
        ::close(fd);  // a new file: nobody in this process holds a lock on it
        CKPTIO_RETURN_IF_ERROR(SyncFd(fs(), dir.get(), DirPath(k.dirs)));
      }
      if (::fstatat(dir.get(), k.base.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
        return ErrnoToStatus(errno, "stat lock file " + k.path);
    }
    if (S_ISLNK(st.st_mode)) return ErrnoToStatus(ELOOP, "open lock file " + k.path);
    if (!S_ISREG(st.st_mode)) return NotRegular(k.path, st.st_mode);
    const FileId id{st.st_dev, st.st_ino};
    if (HeldLocks().count(id))
      return Status(Code::kFailedPrecondition, k.path + " is already locked by this process");
    // Open it relative to the directory already walked, never by path again
    // (a symlink swapped in is ELOOP). Read-write: an exclusive fcntl lock
    // needs a writable descriptor. O_NONBLOCK only keeps a FIFO swapped in
    // from blocking the open; fcntl locks ignore it. Not through fs(): that
    // models what a power cut keeps, and taking a lock changes nothing.
    UniqueFd fd(::openat(dir.get(), k.base.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
    if (fd.get() < 0) return ErrnoToStatus(errno, "open lock file " + k.path);
    struct stat opened;
    if (::fstat(fd.get(), &opened) != 0) return ErrnoToStatus(errno, "fstat " + k.path);
    const FileId opened_id{opened.st_dev, opened.st_ino};
    if (opened_id != id) {
      // Replaced since the fstatat. If by a file this process has locked,
      // closing this descriptor would drop that lock: keep it open.
      if (HeldLocks().count(opened_id)) {
        (void)fd.Release();
        return Status(Code::kFailedPrecondition, k.path + " is already locked by this process");
      }
      return Status(Code::kUnavailable, k.path + " was replaced while being locked; try again");
    }
    if (!S_ISREG(opened.st_mode)) return NotRegular(k.path, opened.st_mode);
    struct flock want {};
    want.l_type = mode == LockMode::kExclusive ? F_WRLCK : F_RDLCK;
    want.l_whence = SEEK_SET;  // l_start = l_len = 0: the whole file
    int rc;
    while ((rc = ::fcntl(fd.get(), F_SETLK, &want)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
      // POSIX allows either errno for a conflicting holder.
      if (errno == EAGAIN || errno == EACCES)
        return Status(Code::kFailedPrecondition, k.path + " is locked by another process");
      if (errno == ENOLCK)
        return Status(Code::kUnavailable,
                      "lock " + k.path + ": " + std::strerror(errno) +
                          " (on NFS: is the lock manager, rpc.statd/lockd, running on the "
                          "client and the server?)");
      return ErrnoToStatus(errno, "lock " + k.path);
    }
    HeldLocks().insert(id);
    return std::unique_ptr<BackendLock>(std::make_unique<PosixLock>(id, std::move(fd)));
  }

 private:
  // A validated key, split into its directories and base name.
  struct KeyParts {
    std::vector<std::string> dirs;
    std::string base;
    std::string path;  // absolute, for messages
  };
  Result<KeyParts> Parts(std::string_view key) const {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    KeyParts k;
    SplitKey(key, &k.dirs, &k.base);
    k.path = DirPath(k.dirs) + "/" + k.base;
    return k;
  }

  std::string DirPath(const std::vector<std::string>& dirs) const {
    std::string p = root_;
    for (const auto& d : dirs) p += "/" + d;
    return p;
  }

  // Opens (creating it, and each missing parent, when `create`) the root.
  Result<UniqueFd> RootFd(bool create) const {
    int fd = fs().OpenAt(AT_FDCWD, root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (fd >= 0) return UniqueFd(fd);
    if (errno != ENOENT || !create) {
      if (errno == ENOENT) return Status(Code::kNotFound, "no store at " + root_);
      return ErrnoToStatus(errno, "open store directory " + root_);
    }
    // mkdir -p, fsyncing each parent that gained an entry.
    size_t pos = 1;
    while (pos != std::string::npos) {
      pos = root_.find('/', pos + 1);
      std::string part = root_.substr(0, pos);
      if (fs().MkdirAt(AT_FDCWD, part.c_str(), 0755) == 0) {
        std::string parent = part.substr(0, part.rfind('/'));
        UniqueFd pfd(fs().OpenAt(AT_FDCWD, parent.empty() ? "/" : parent.c_str(),
                                 O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0));
        if (pfd.get() < 0) return ErrnoToStatus(errno, "open " + parent);
        CKPTIO_RETURN_IF_ERROR(SyncFd(fs(), pfd.get(), parent));
      } else if (errno != EEXIST) {
        return ErrnoToStatus(errno, "create store directory " + part);
      }
    }
    fd = fs().OpenAt(AT_FDCWD, root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (fd < 0) return ErrnoToStatus(errno, "open store directory " + root_);
    return UniqueFd(fd);
  }

  // Walks `dirs` below the root without following symlinks.
  Result<UniqueFd> OpenDir(const std::vector<std::string>& dirs, bool create) const {
    CKPTIO_ASSIGN_OR_RETURN(std::vector<UniqueFd> chain, OpenDirChain(dirs, create));
    return std::move(chain.back());
  }

  // The root and every directory of `dirs` below it, opened in order.
  Result<std::vector<UniqueFd>> OpenDirChain(const std::vector<std::string>& dirs,
                                             bool create) const {
    std::vector<UniqueFd> chain;
    CKPTIO_ASSIGN_OR_RETURN(UniqueFd root, RootFd(create));
    chain.push_back(std::move(root));
    for (size_t i = 0; i < dirs.size(); ++i) {
      const UniqueFd& cur = chain.back();
      const char* name = dirs[i].c_str();
      int fd = fs().OpenAt(cur.get(), name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0);
      if (fd < 0 && errno == ENOENT && create) {
        if (fs().MkdirAt(cur.get(), name, 0755) != 0 && errno != EEXIST)
          return ErrnoToStatus(errno,
                               "create directory " + DirPath({dirs.begin(), dirs.begin() + i + 1}));
        CKPTIO_RETURN_IF_ERROR(SyncFd(fs(), cur.get(), DirPath({dirs.begin(), dirs.begin() + i})));
        fd = fs().OpenAt(cur.get(), name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0);
      }
      if (fd < 0) {
        int err = errno;
        std::string path = DirPath({dirs.begin(), dirs.begin() + i + 1});
        struct stat st;
        if ((err == ENOTDIR || err == ELOOP) &&
            ::fstatat(cur.get(), name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
          if (S_ISLNK(st.st_mode)) return ErrnoToStatus(ELOOP, "open directory " + path);
          // An object where a directory would be: no such prefix.
          return Status(Code::kNotFound, path + " is an object, not a directory");
        }
        return ErrnoToStatus(err, "open directory " + path);
      }
      chain.emplace_back(fd);
    }
    return chain;
  }

  Status Walk(int dirfd, const std::string& prefix, std::vector<std::string>* out) const {
    int dup = ::fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) return ErrnoToStatus(errno, "dup");
    DIR* d = ::fdopendir(dup);
    if (!d) {
      ::close(dup);
      return ErrnoToStatus(errno, "list " + root_ + "/" + prefix);
    }
    ::rewinddir(d);
    std::vector<std::string> subdirs;
    while (true) {
      // Reset before every call: readdir leaves errno alone at the end, and
      // a skipped entry below (ENOENT) must not read as a listing error.
      errno = 0;
      struct dirent* e = ::readdir(d);
      if (e == nullptr) break;
      std::string name = e->d_name;
      if (name == "." || name == ".." || !ValidateKey(name).ok()) continue;
      struct stat st;
      if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;  // deleted while we listed
        int err = errno;
        ::closedir(d);
        return ErrnoToStatus(err, "stat " + root_ + "/" + prefix + name);
      }
      if (S_ISDIR(st.st_mode))
        subdirs.push_back(name);
      else if (S_ISREG(st.st_mode))
        out->push_back(prefix + name);
    }
    int err = errno;
    ::closedir(d);
    if (err != 0) return ErrnoToStatus(err, "list " + root_ + "/" + prefix);
    for (const auto& sub : subdirs) {
      UniqueFd fd(
          fs().OpenAt(dirfd, sub.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0));
      if (fd.get() < 0) {
        if (errno == ENOENT || errno == ELOOP || errno == ENOTDIR) continue;  // gone, or a link
        return ErrnoToStatus(errno, "open directory " + root_ + "/" + prefix + sub);
      }
      CKPTIO_RETURN_IF_ERROR(Walk(fd.get(), prefix + sub + "/", out));
    }
    return OkStatus();
  }

  // Whether the root, or (before it is made) its nearest existing
  // ancestor, is on a network file system; false if that cannot be told.
  bool OnNetworkFileSystem() const {
    std::string path = root_;
    while (true) {
      uint64_t type = 0;
      if (fs().StatFsType(path.c_str(), &type) == 0) return IsNetworkFileSystem(type);
      if (errno != ENOENT || path == "/") return false;
      const size_t slash = path.rfind('/');
      path = slash == 0 ? "/" : path.substr(0, slash);
    }
  }

  std::string root_;
  PosixBackendOptions options_;
  bool leases_ = false;  // LocksAreLeases()
};

PosixFs& PosixWriter::fs() const { return backend_->fs(); }

Status PosixWriter::Commit() {
  if (dead_ || committed_) return Dead();
  dead_ = true;  // whatever happens below, this writer is finished
  const std::string tmp_path = Path(tmp_);
  const std::string target = Path(name_);
  auto fail = [&](Status s) {
    Discard();
    return s;
  };
  Status s = Flush();
  if (s.ok()) s = SyncFd(fs(), file_.get(), tmp_path);
  if (!s.ok()) return fail(s);
  // The temp's identity, to recognise it under the target's name below.
  struct stat tmp_st;
  if (::fstat(file_.get(), &tmp_st) != 0) return fail(ErrnoToStatus(errno, "fstat " + tmp_path));
  if (fs().Close(file_.Release()) != 0) return fail(ErrnoToStatus(errno, "close " + tmp_path));
  if (mode_ == WriteMode::kReplace) {
    if (fs().RenameAt(dir_.get(), tmp_.c_str(), name_.c_str()) != 0) {
      int err = errno;
      // On NFS a rename whose reply was lost is retransmitted and answered
      // ENOENT (the temp name is gone) although it succeeded: then the
      // target is our own file.
      struct stat now;
      const bool ours = err == ENOENT &&
                        ::fstatat(dir_.get(), name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 &&
                        now.st_dev == tmp_st.st_dev && now.st_ino == tmp_st.st_ino;
      if (!ours) return fail(ErrnoToStatus(err, "rename " + tmp_path + " to " + target));
    }
    tmp_.clear();
  } else {
    if (fs().LinkAt(dir_.get(), tmp_.c_str(), name_.c_str()) != 0) {
      int err = errno;
      // On NFS a link whose reply was lost is retransmitted and answered
      // EEXIST although it succeeded: then the name is our own file.
      if (err == EEXIST && !SameFile(dir_.get(), tmp_, name_))
        return fail(
            Status(Code::kAlreadyExists, target + " already exists and is never overwritten"));
      if (err == EPERM || err == ENOSYS || err == EOPNOTSUPP)  // vfat, exfat, some FUSE
        return fail(Status(Code::kFailedPrecondition,
                           "link " + tmp_path + " to " + target + ": " + std::strerror(err) +
                               ": the file system does not make hard links, which ckptio needs "
                               "to create an object without overwriting one; put the store "
                               "on ext4, xfs, btrfs or NFS"));
      if (err != EEXIST) return fail(ErrnoToStatus(err, "link " + tmp_path + " to " + target));
    }
    fs().UnlinkAt(dir_.get(), tmp_.c_str(), 0);  // a leftover is removed as stale
    tmp_.clear();
  }
  s = SyncFd(fs(), dir_.get(), dir_path_);
  if (!s.ok()) {
    // Visible but not known durable. A new exclusive name is taken back; a
    // replaced one cannot be, and the caller learns that from the error.
    if (mode_ == WriteMode::kCreateExclusive) {
      fs().UnlinkAt(dir_.get(), name_.c_str(), 0);
      fs().Fsync(dir_.get());
    }
    return s;
  }
  committed_ = true;
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<StorageBackend>> NewPosixBackend(std::string root,
                                                        PosixBackendOptions options) {
  if (root.empty()) return Status(Code::kInvalidArgument, "empty store path");
  if (root.find('\0') != std::string::npos)
    return Status(Code::kInvalidArgument, "store path contains NUL");
  if (root.front() != '/') {
    char cwd[4096];
    if (!::getcwd(cwd, sizeof cwd)) return ErrnoToStatus(errno, "getcwd");
    root = std::string(cwd) + "/" + root;
  }
  // Normalise: drop empty and "." components; refuse "..".
  std::string norm;
  size_t start = 1;
  while (start <= root.size()) {
    size_t slash = root.find('/', start);
    if (slash == std::string::npos) slash = root.size();
    std::string part = root.substr(start, slash - start);
    if (part == "..")
      return Status(Code::kInvalidArgument,
                    "store path \"" + root + "\" contains '..'; give a direct path");
    if (!part.empty() && part != ".") norm += "/" + part;
    start = slash + 1;
  }
  if (norm.empty()) return Status(Code::kInvalidArgument, "the file system root cannot be a store");
  return std::unique_ptr<StorageBackend>(
      std::make_unique<PosixBackend>(std::move(norm), std::move(options)));
}

Status RegisterPosixBackend(BackendRegistry& registry) {
  return registry.Register("file", [](const Uri& uri) -> Result<std::unique_ptr<StorageBackend>> {
    if (!uri.authority.empty() && uri.authority != "localhost")
      return Status(Code::kInvalidArgument,
                    "file:// URI with host \"" + uri.authority +
                        "\": use file:///absolute/path (three slashes) or a plain path");
    if (!uri.params.empty())
      return Status(Code::kInvalidArgument,
                    "file:// URIs take no parameters (got \"" + uri.params.begin()->first + "\")");
    return NewPosixBackend(uri.path);
  });
}

}  // namespace ckptio
