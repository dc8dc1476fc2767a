#include "ckptio/power_loss_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <random>
#include <set>

namespace ckptio {
namespace {

namespace fs = std::filesystem;

std::string FdPath(int fd) {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
  return ec ? std::string() : p.string();
}

bool Lstat(const std::string& path, struct stat* st) { return ::lstat(path.c_str(), st) == 0; }

int Fail() {
  errno = EIO;
  return -1;
}

}  // namespace

PowerLossFs::PowerLossFs(std::string scratch, int64_t cut_at)
    : scratch_(std::move(scratch)), cut_at_(cut_at) {}

PowerLossFs::~PowerLossFs() {
  std::error_code ec;
  fs::remove_all(scratch_, ec);
}

int64_t PowerLossFs::ops() const {
  std::lock_guard<std::mutex> g(mu_);
  return ops_;
}

bool PowerLossFs::cut() const {
  std::lock_guard<std::mutex> g(mu_);
  return cut_at_ >= 0 && ops_ > cut_at_;
}

bool PowerLossFs::Enter() {
  const int64_t op = ops_++;
  return cut_at_ < 0 || op < cut_at_;
}

// The directory holding `name` (relative to dirfd), resolved, and the base.
std::string PowerLossFs::DirPath(int dirfd, const char* name, std::string* base) const {
  std::string n(name);
  size_t slash = n.rfind('/');
  *base = slash == std::string::npos ? n : n.substr(slash + 1);
  std::string dir = slash == std::string::npos ? "" : n.substr(0, slash);
  if (!dir.empty() && dir.front() == '/') {
    std::error_code ec;
    fs::path canon = fs::canonical(dir, ec);
    return ec ? dir : canon.string();
  }
  std::string at = dirfd == AT_FDCWD ? fs::current_path().string() : FdPath(dirfd);
  return dir.empty() ? at : at + "/" + dir;
}

bool PowerLossFs::Remember(int dirfd, const char* name, int64_t group) {
  Change c;
  c.dir = DirPath(dirfd, name, &c.name);
  c.group = group;
  dirs_.insert(c.dir);
  std::string path = c.dir + "/" + c.name;
  struct stat st;
  if (!Lstat(path, &st)) {
    if (errno != ENOENT) return false;
    c.was = Change::Was::kAbsent;
  } else if (S_ISDIR(st.st_mode)) {
    c.was = Change::Was::kEmptyDir;  // only empty directories are removed
  } else {
    ::mkdir(scratch_.c_str(), 0755);
    c.saved = scratch_ + "/" + std::to_string(saved_++);
    if (::link(path.c_str(), c.saved.c_str()) != 0) return false;
    c.was = Change::Was::kFile;
  }
  changes_.push_back(std::move(c));
  return true;
}

void PowerLossFs::NoteFileData(int fd) {
  struct stat st;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
    synced_size_.emplace(FileId{st.st_dev, st.st_ino}, static_cast<uint64_t>(st.st_size));
}

int PowerLossFs::OpenAt(int dirfd, const char* name, int flags, mode_t mode) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) return Fail();
  if (!(flags & O_CREAT)) return ::openat(dirfd, name, flags, mode);
  struct stat st;
  bool existed = ::fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
  const size_t before = changes_.size();
  if (!existed && !Remember(dirfd, name, ops_)) return -1;
  int fd = ::openat(dirfd, name, flags, mode);
  if (fd < 0) {
    changes_.resize(before);
    return fd;
  }
  if (!existed && ::fstat(fd, &st) == 0) synced_size_[{st.st_dev, st.st_ino}] = 0;
  return fd;
}

ssize_t PowerLossFs::Write(int fd, const void* data, size_t size) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) return Fail();
  NoteFileData(fd);
  return ::write(fd, data, size);
}

int PowerLossFs::Fsync(int fd) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) return Fail();
  int r = ::fsync(fd);
  struct stat st;
  if (r != 0 || ::fstat(fd, &st) != 0) return r;
  if (S_ISDIR(st.st_mode)) {
    const std::string dir = FdPath(fd);
    changes_.erase(std::remove_if(changes_.begin(), changes_.end(),
                                  [&](const Change& c) { return c.dir == dir; }),
                   changes_.end());
  } else {
    synced_size_[{st.st_dev, st.st_ino}] = static_cast<uint64_t>(st.st_size);
  }
  return r;
}

int PowerLossFs::Close(int fd) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) {
    ::close(fd);  // the descriptor is gone either way
    return Fail();
  }
  return ::close(fd);
}

int PowerLossFs::MkdirAt(int dirfd, const char* name, mode_t mode) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) return Fail();
  const size_t before = changes_.size();
  if (!Remember(dirfd, name, ops_)) return -1;
  int r = ::mkdirat(dirfd, name, mode);
  if (r != 0 || changes_.back().was != Change::Was::kAbsent) changes_.resize(before);
  return r;
}

int PowerLossFs::RenameAt(int dirfd, const char* from, const char* to) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) return Fail();
  const size_t before = changes_.size();
  // Undone newest first: `from` comes back, then `to` gets its old self.
  if (!Remember(dirfd, to, ops_) || !Remember(dirfd, from, ops_)) {
    changes_.resize(before);
    return -1;
  }
  int r = ::renameat(dirfd, from, dirfd, to);
  if (r != 0) changes_.resize(before);
  return r;
}

int PowerLossFs::LinkAt(int dirfd, const char* from, const char* to) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) return Fail();
  const size_t before = changes_.size();
  if (!Remember(dirfd, to, ops_)) return -1;
  int r = ::linkat(dirfd, from, dirfd, to, 0);
  if (r != 0) changes_.resize(before);
  return r;
}

int PowerLossFs::UnlinkAt(int dirfd, const char* name, int flags) {
  std::lock_guard<std::mutex> g(mu_);
  if (!Enter()) return Fail();
  const size_t before = changes_.size();
  if (!Remember(dirfd, name, ops_)) return -1;
  int r = ::unlinkat(dirfd, name, flags);
  if (r != 0) changes_.resize(before);
  return r;
}

Status PowerLossFs::Undo(const Change& c) const {
  struct stat st;
  if (!Lstat(c.dir, &st)) return OkStatus();  // its directory was undone too
  const std::string path = c.dir + "/" + c.name;
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return ErrnoToStatus(ec.value(), "power loss: remove " + path);
  if (c.was == Change::Was::kFile && ::link(c.saved.c_str(), path.c_str()) != 0)
    return ErrnoToStatus(errno, "power loss: restore " + path);
  if (c.was == Change::Was::kEmptyDir && ::mkdir(path.c_str(), 0755) != 0)
    return ErrnoToStatus(errno, "power loss: restore directory " + path);
  return OkStatus();
}

Result<PowerLossReport> PowerLossFs::Apply(PowerLossMode mode, uint64_t seed) {
  std::lock_guard<std::mutex> g(mu_);
  std::mt19937_64 rng(seed);
  PowerLossReport report;
  // Directory entries, newest first, a call's changes together.
  std::map<int64_t, bool> undo_group;
  for (auto it = changes_.rbegin(); it != changes_.rend(); ++it) {
    auto [slot, fresh] = undo_group.emplace(it->group, true);
    if (fresh && mode == PowerLossMode::kGarble) slot->second = rng() % 2 == 0;
    if (!slot->second) {
      ++report.kept_entries;
      continue;
    }
    CKPTIO_RETURN_IF_ERROR(Undo(*it));
    ++report.undone_entries;
  }
  changes_.clear();
  // File data: every file written through us, wherever its name now is.
  // (Names only move within a directory, so looking in every directory in
  // which a name was created or changed finds them.)
  std::set<FileId> done;
  std::error_code ec;
  for (const auto& dir : dirs_) {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      struct stat st;
      const std::string path = e.path().string();
      if (!Lstat(path, &st) || !S_ISREG(st.st_mode)) continue;
      FileId id{st.st_dev, st.st_ino};
      auto it = synced_size_.find(id);
      if (it == synced_size_.end() || !done.insert(id).second) continue;
      const uint64_t size = static_cast<uint64_t>(st.st_size);
      if (size <= it->second) continue;
      uint64_t keep = it->second;
      if (mode == PowerLossMode::kGarble) keep += rng() % (size - it->second + 1);
      if (::truncate(path.c_str(), static_cast<off_t>(keep)) != 0)
        return ErrnoToStatus(errno, "power loss: truncate " + path);
      if (keep > it->second) {  // part of the unsynced tail, partly junk
        uint64_t start = it->second + rng() % (keep - it->second);
        std::string junk(keep - start, '\0');
        for (char& ch : junk) ch = static_cast<char>(rng());
        int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
        if (fd < 0) return ErrnoToStatus(errno, "power loss: open " + path);
        ssize_t n = ::pwrite(fd, junk.data(), junk.size(), static_cast<off_t>(start));
        ::close(fd);
        if (n != static_cast<ssize_t>(junk.size()))
          return Status(Code::kInternal, "power loss: garble " + path + " failed");
      }
      ++report.files_cut;
      report.bytes_dropped += size - keep;
    }
  }
  synced_size_.clear();
  fs::remove_all(scratch_, ec);
  return report;
}

}  // namespace ckptio
