// The nfs:// backend. The commit recipe and lock scheme are described in
// nfs_backend.h.
#include "ckptio/nfs_backend.h"

#include <fcntl.h>
#include <nfsc/libnfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "object_io.h"

namespace ckptio {
namespace {

constexpr size_t kWriteBuffer = 1 << 20;
// libnfs 4.0 corrupts NFSv4 WRITEs above this size (the server rejects
// them), so v4 writes go in pieces no larger.
constexpr size_t kV4MaxWrite = 3840;
constexpr uint64_t kSnapshotBytes = 1 << 20;
constexpr uint64_t kLockBytes = 1;  // v4 locks cover byte 0 (a length of 0 is refused)
constexpr int kNf3Reg = 1, kNf3Dir = 2;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::atomic<uint64_t> g_connections{0};

// Frees a libnfs context. libnfs 4.0 crashes destroying a context that still
// has requests in flight (left by a timeout or a server that died), so such
// a context only has its socket closed: its memory is left behind.
void ReleaseContext(struct nfs_context* ctx, bool failed) {
  if (!ctx) return;
  if (!failed) {
    nfs_destroy_context(ctx);
    return;
  }
  int fd = nfs_get_fd(ctx);
  if (fd >= 0) ::close(fd);
}

}  // namespace

Result<struct nfs_context*> Connect(const NfsOptions& o, const std::string& client,
                                    std::string* export_path);

namespace {

// One mounted libnfs context, shared by the backend and everything it hands
// out (writers, readers, locks), every call under `mu`.
class Connection {
 public:
  Connection(NfsOptions o, std::string u) : options(std::move(o)), uri(std::move(u)) {}
  ~Connection() {
    {
      std::lock_guard<std::mutex> g(mu);
      stop = true;
    }
    wake.notify_all();
    if (keepalive.joinable()) keepalive.join();
    ReleaseContext(ctx, failed.count(ctx) > 0);
    for (auto* old : retired) ReleaseContext(old, failed.count(old) > 0);
  }

  // NFSv4 servers forget a client whose lease ran out (no call for a lease
  // time: an idle trainer between checkpoints). Whether `s` says so.
  static bool ClientExpired(const Status& s) {
    return s.message().find("NFS4ERR_EXPIRED") != std::string::npos ||
           s.message().find("NFS4ERR_STALE_CLIENTID") != std::string::npos;
  }
  // A new connection under a new client identity (callers hold mu). Objects
  // opened on the old one keep it (and fail if the server forgot it).
  Status Reconnect() {
    std::string path = export_path;
    CKPTIO_ASSIGN_OR_RETURN(
        struct nfs_context * fresh,
        Connect(options, options.client_name + ".r" + std::to_string(++reconnects), &path));
    retired.push_back(ctx);
    ctx = fresh;
    return OkStatus();
  }

  // A Status for libnfs result `rc` (-errno) of `what`.
  Status Error(int rc, const std::string& what) const { return ErrorOn(ctx, rc, what); }
  Status ErrorOn(struct nfs_context* on, int rc, const std::string& what) const {
    const char* detail = on ? nfs_get_error(on) : nullptr;
    int err = rc < 0 ? -rc : EIO;
    std::string msg = what + " on " + uri;
    if (detail && *detail) msg += " (" + std::string(detail) + ")";
    Status s = err == ETIMEDOUT || (detail && std::strstr(detail, "timed out"))
                   ? Status(Code::kUnavailable, msg + ": the server did not answer within " +
                                                    std::to_string(options.timeout.count()) + " ms")
                   : ErrnoToStatus(err, msg);
    if (s.code() == Code::kUnavailable && on) failed.insert(on);  // see ReleaseContext
    return s;
  }

  std::string Path(std::string_view key) const {
    return root + (key.empty() ? "" : "/" + std::string(key));
  }

  // mkdir -p of the folders above `key` (callers hold mu).
  Status MakeParents(std::string_view key) {
    std::string dir = root;
    size_t start = 0;
    if (!root.empty()) {
      CKPTIO_RETURN_IF_ERROR(MakeDir(root, /*walk=*/true));
    }
    while (true) {
      size_t slash = key.find('/', start);
      if (slash == std::string_view::npos) return OkStatus();
      dir += "/" + std::string(key.substr(start, slash - start));
      CKPTIO_RETURN_IF_ERROR(MakeDir(dir, false));
      start = slash + 1;
    }
  }

  Status MakeDir(const std::string& path, bool walk) {
    if (walk) {  // each component of a root inside the export
      for (size_t pos = path.find('/', 1); pos != std::string::npos; pos = path.find('/', pos + 1))
        CKPTIO_RETURN_IF_ERROR(MakeDir(path.substr(0, pos), false));
    }
    int rc = nfs_mkdir(ctx, path.c_str());
    if (rc == 0 || rc == -EEXIST) return OkStatus();
    struct nfs_stat_64 st;
    if (nfs_stat64(ctx, path.c_str(), &st) == 0 && S_ISDIR(st.nfs_mode)) return OkStatus();
    return Error(rc, "mkdir " + path);
  }

  // Held locks, by key; renewed by `keepalive` while any is held.
  // v4 locks each use a connection of their own: libnfs 4.0 loses track
  // of the open-owner sequence after a LOCK (the next OPEN on that context
  // fails with NFS4ERR_BAD_SEQID).
  struct Held {
    struct nfs_context* ctx = nullptr;  // v4: the lock's own connection
    struct nfsfh* fh = nullptr;         // v4: the open file the lock is on
    std::string path;
    std::string record;  // v3: our lease record
  };
  void StartKeepalive() {  // callers hold mu
    if (keepalive.joinable()) return;
    keepalive = std::thread([this] { KeepaliveLoop(); });
  }
  std::string LeaseRecord() const {
    return "ckptio-lease owner=" + options.client_name +
           " expires_ms=" + std::to_string(NowMs() + options.lease.count()) + "\n";
  }

  const NfsOptions options;
  const std::string uri;
  struct nfs_context* ctx = nullptr;
  std::string export_path;  // what is mounted
  std::string root;         // the store's folder, relative to the mount ("" or "/a/b")
  size_t max_write = kWriteBuffer;
  std::mutex mu;
  std::map<std::string, Held> held;
  std::atomic<uint64_t> counter{0};
  std::vector<struct nfs_context*> retired;      // replaced by Reconnect
  mutable std::set<struct nfs_context*> failed;  // transport errors seen on these
  int reconnects = 0;

 private:
  void KeepaliveLoop() {
    const auto period = options.version == 4 ? std::min<std::chrono::milliseconds>(
                                                   std::chrono::seconds(10), options.lease / 3)
                                             : options.lease / 3;
    std::unique_lock<std::mutex> g(mu);
    while (!stop) {
      wake.wait_for(g, period, [&] { return stop; });
      if (stop) break;
      for (auto& [key, h] : held) {
        if (options.version == 4) {
          // Any READ with the open stateid renews the client's lease.
          char byte;
          (void)nfs_pread(h.ctx, h.fh, 0, 1, &byte);
        } else {
          struct nfsfh* fh = nullptr;
          if (nfs_open(ctx, h.path.c_str(), O_WRONLY, &fh) == 0) {
            h.record = LeaseRecord();
            (void)nfs_pwrite(ctx, fh, 0, h.record.size(), h.record.data());
            (void)nfs_fsync(ctx, fh);
            (void)nfs_close(ctx, fh);
          }
        }
      }
    }
  }

  bool stop = false;
  std::condition_variable wake;
  std::thread keepalive;
};

class NfsWriter : public ObjectWriter {
 public:
  NfsWriter(std::shared_ptr<Connection> c, struct nfsfh* fh, std::string tmp, std::string target,
            WriteMode mode)
      : c_(std::move(c)),
        ctx_(c_->ctx),
        fh_(fh),
        tmp_(std::move(tmp)),
        target_(std::move(target)),
        mode_(mode) {}
  ~NfsWriter() override {
    if (!committed_) Discard();
  }

  Status Append(const void* data, size_t size) override {
    if (dead_) return Dead();
    buffer_.append(static_cast<const char*>(data), size);
    if (buffer_.size() < kWriteBuffer) return OkStatus();
    std::lock_guard<std::mutex> g(c_->mu);
    Status s = Flush();
    if (!s.ok()) Fail();
    return s;
  }

  Status Commit() override {
    if (dead_ || committed_) return Dead();
    dead_ = true;
    std::lock_guard<std::mutex> g(c_->mu);
    Status s = Flush();
    if (!s.ok()) return Abandon(s);
    int rc = nfs_fsync(ctx_, fh_);  // COMMIT: the bytes are on stable storage
    if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "fsync (COMMIT) " + tmp_));
    rc = nfs_close(ctx_, fh_);
    fh_ = nullptr;
    if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "close " + tmp_));
    if (mode_ == WriteMode::kReplace) {
      rc = nfs_rename(ctx_, tmp_.c_str(), target_.c_str());
      if (rc < 0 && !RenameHappened()) return Abandon(c_->ErrorOn(ctx_, rc, "rename " + tmp_));
    } else {
      rc = nfs_link(ctx_, tmp_.c_str(), target_.c_str());
      if (rc < 0 && !LinkHappened()) {
        if (rc == -EEXIST)
          return Abandon(
              Status(Code::kAlreadyExists,
                     c_->uri + ": " + target_ + " already exists and is never overwritten"));
        return Abandon(c_->ErrorOn(ctx_, rc, "link " + tmp_));
      }
      (void)nfs_unlink(ctx_, tmp_.c_str());  // a leftover is removed as stale
    }
    tmp_.clear();
    committed_ = true;
    return OkStatus();
  }

 private:
  Status Dead() const {
    return Status(Code::kFailedPrecondition,
                  c_->uri + ": object " + target_ + " failed earlier or is committed");
  }

  // Writes the buffer (callers hold mu).
  Status Flush() {
    size_t done = 0;
    while (done < buffer_.size()) {
      size_t n = std::min(c_->max_write, buffer_.size() - done);
      int rc = nfs_pwrite(ctx_, fh_, offset_, n, buffer_.data() + done);
      if (rc < 0) return c_->ErrorOn(ctx_, rc, "write " + tmp_);
      if (rc == 0)
        return Status(Code::kUnavailable, c_->uri + ": write " + tmp_ + " made no progress");
      done += static_cast<size_t>(rc);
      offset_ += static_cast<uint64_t>(rc);
    }
    buffer_.clear();
    return OkStatus();
  }

  // After a failed RENAME: did it happen anyway (a lost reply)?
  bool RenameHappened() {
    struct nfs_stat_64 st;
    if (nfs_stat64(ctx_, tmp_.c_str(), &st) == 0) return false;  // the temp is still there
    return nfs_stat64(ctx_, target_.c_str(), &st) == 0 && st.nfs_size == offset_;
  }
  // After a failed LINK: is the target our temp's file?
  bool LinkHappened() {
    struct nfs_stat_64 a, b;
    return nfs_stat64(ctx_, tmp_.c_str(), &a) == 0 && nfs_stat64(ctx_, target_.c_str(), &b) == 0 &&
           a.nfs_ino == b.nfs_ino;
  }

  // Removes the temp (callers hold mu).
  Status Abandon(Status s) {
    DiscardLocked();
    return s;
  }
  void Fail() {
    dead_ = true;
    DiscardLocked();
  }
  void Discard() {
    std::lock_guard<std::mutex> g(c_->mu);
    DiscardLocked();
  }
  void DiscardLocked() {
    if (fh_) (void)nfs_close(ctx_, fh_);
    fh_ = nullptr;
    if (!tmp_.empty()) (void)nfs_unlink(ctx_, tmp_.c_str());
    tmp_.clear();
  }

  std::shared_ptr<Connection> c_;
  struct nfs_context* ctx_;  // the connection the temp was created on
  struct nfsfh* fh_;
  std::string tmp_, target_;
  WriteMode mode_;
  std::string buffer_;
  uint64_t offset_ = 0;
  bool dead_ = false, committed_ = false;
};

class NfsReader : public ObjectReader {
 public:
  NfsReader(std::shared_ptr<Connection> c, struct nfsfh* fh, uint64_t size, std::string path)
      : c_(std::move(c)), ctx_(c_->ctx), fh_(fh), size_(size), path_(std::move(path)) {}
  ~NfsReader() override {
    if (!fh_) return;  // (a snapshot: may be destroyed with mu held)
    std::lock_guard<std::mutex> g(c_->mu);
    (void)nfs_close(ctx_, fh_);
  }
  uint64_t Size() const override { return size_; }
  Status ReadAt(uint64_t offset, void* buf, size_t size) override {
    if (offset > size_ || size > size_ - offset)
      return Status(Code::kDataLoss, c_->uri + ": " + path_ + ": read of " + std::to_string(size) +
                                         " bytes at offset " + std::to_string(offset) +
                                         " is past the end (" + std::to_string(size_) + " bytes)");
    if (!fh_) {
      if (size > 0) std::memcpy(buf, snapshot_.data() + offset, size);
      return OkStatus();
    }
    std::lock_guard<std::mutex> g(c_->mu);
    return ReadLocked(offset, buf, size);
  }

  // Reads the whole object into memory and closes the file (callers hold mu).
  Status SnapshotLocked() {
    snapshot_.resize(size_);
    Status s = ReadLocked(0, snapshot_.data(), size_);
    (void)nfs_close(ctx_, fh_);
    fh_ = nullptr;
    return s;
  }

 private:
  Status ReadLocked(uint64_t offset, void* buf, size_t size) {
    char* p = static_cast<char*>(buf);
    while (size > 0) {
      size_t n = std::min(size, c_->max_write * 16);
      int rc = nfs_pread(ctx_, fh_, offset, n, p);
      if (rc < 0) return c_->ErrorOn(ctx_, rc, "read " + path_);
      if (rc == 0)
        return Status(Code::kDataLoss, c_->uri + ": " + path_ + " ends at byte " +
                                           std::to_string(offset) + " (truncated object?)");
      p += rc;
      offset += static_cast<uint64_t>(rc);
      size -= static_cast<size_t>(rc);
    }
    return OkStatus();
  }

  std::shared_ptr<Connection> c_;
  struct nfs_context* ctx_;  // the connection the file was opened on
  struct nfsfh* fh_;         // null once the object is in snapshot_
  uint64_t size_;
  std::string path_;
  std::string snapshot_;
};

class NfsLock : public BackendLock {
 public:
  NfsLock(std::shared_ptr<Connection> c, std::string key)
      : c_(std::move(c)), key_(std::move(key)) {}
  ~NfsLock() override {
    std::lock_guard<std::mutex> g(c_->mu);
    auto it = c_->held.find(key_);
    if (it == c_->held.end()) return;
    Connection::Held& h = it->second;
    if (h.ctx) {  // v4: unlock, close, disconnect
      struct nfs4_flock fl {};
      fl.l_type = F_UNLCK;
      fl.l_whence = SEEK_SET;
      fl.l_len = kLockBytes;
      bool ok = nfs_fcntl(h.ctx, h.fh, NFS4_F_SETLK, &fl) == 0;
      ok = nfs_close(h.ctx, h.fh) == 0 && ok;
      ReleaseContext(h.ctx, !ok);
    } else {  // v3: remove the lease file if it is still ours
      std::string now;
      if (ReadSmallFile(*c_, h.path, &now).ok() && now == h.record)
        (void)nfs_unlink(c_->ctx, h.path.c_str());
    }
    c_->held.erase(it);
  }

  static Status ReadSmallFile(Connection& c, const std::string& path, std::string* out) {
    struct nfsfh* fh = nullptr;
    int rc = nfs_open(c.ctx, path.c_str(), O_RDONLY, &fh);
    if (rc < 0) return c.Error(rc, "open " + path);
    char buf[512];
    rc = nfs_pread(c.ctx, fh, 0, sizeof buf, buf);
    (void)nfs_close(c.ctx, fh);
    if (rc < 0) return c.Error(rc, "read " + path);
    out->assign(buf, static_cast<size_t>(rc));
    return OkStatus();
  }

 private:
  std::shared_ptr<Connection> c_;
  std::string key_;
};

class NfsBackend : public StorageBackend {
 public:
  explicit NfsBackend(std::shared_ptr<Connection> c) : c_(std::move(c)) {}

  std::string Uri() const override { return c_->uri; }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    return Retrying([&] { return NewObjectOnce(key, mode); });
  }
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    return Retrying([&] { return OpenObjectOnce(key); });
  }
  Result<ObjectInfo> Stat(std::string_view key) override {
    return Retrying([&] { return StatOnce(key); });
  }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    return Retrying([&] { return ListOnce(prefix); });
  }
  Status Delete(std::string_view key) override {
    return Retrying([&] { return DeleteOnce(key); });
  }
  Result<bool> IsLocked(std::string_view key) override {
    return Retrying([&] { return IsLockedOnce(key); });
  }
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    return Retrying([&] { return TryLockOnce(key, mode); });
  }

 private:
  static const Status& StatusOf(const Status& s) { return s; }
  template <typename T>
  static const Status& StatusOf(const Result<T>& r) {
    return r.status();
  }

  // Whether `s` is what libnfs reports for a file replaced (by a rename)
  // while we looked it up or read it: a stale handle, or, from libnfs 4.0's
  // READ of the replaced file, EFAULT.
  static bool Replaced(const Status& s) {
    return s.message().find("STALE") != std::string::npos ||
           s.message().find("Stale file handle") != std::string::npos ||
           s.message().find("Bad address") != std::string::npos;
  }

  // Runs `op` (which takes mu itself) again when a path it resolved went
  // stale under it (LATEST replaced between LOOKUP and GETATTR or READ: an
  // NFS client must look up again), and, if an NFSv4 server had forgotten
  // this client (its lease ran out while idle), after reconnecting.
  template <typename Op>
  auto Retrying(Op op) -> decltype(op()) {
    auto r = op();
    for (int attempt = 0; attempt < 8 && !r.ok(); ++attempt) {
      const Status& s = StatusOf(r);
      if (c_->options.version == 4 && Connection::ClientExpired(s)) {
        std::lock_guard<std::mutex> g(c_->mu);
        Status re = c_->Reconnect();
        if (!re.ok()) return re.WithContext("reconnecting after the server expired this client");
      } else if (!Replaced(s)) {
        break;
      }
      r = op();
    }
    return r;
  }

  Result<std::unique_ptr<ObjectWriter>> NewObjectOnce(std::string_view key, WriteMode mode) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    const size_t slash = key.rfind('/');
    const std::string base(slash == std::string_view::npos ? key : key.substr(slash + 1));
    if (base.compare(0, kTempMarker.size(), kTempMarker) == 0)
      return Status(Code::kInvalidArgument,
                    "object key \"" + std::string(key) + "\" uses the reserved temp prefix");
    const std::string dir =
        slash == std::string_view::npos ? c_->Path("") : c_->Path(key.substr(0, slash));
    const std::string tmp = dir + "/" + TempObjectName(base);
    std::lock_guard<std::mutex> g(c_->mu);
    CKPTIO_RETURN_IF_ERROR(c_->MakeParents(key));
    struct nfsfh* fh = nullptr;
    int rc = nfs_open2(c_->ctx, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644, &fh);
    if (rc < 0) return c_->Error(rc, "create " + tmp);
    return std::unique_ptr<ObjectWriter>(
        std::make_unique<NfsWriter>(c_, fh, tmp, c_->Path(key), mode));
  }

  Result<std::unique_ptr<ObjectReader>> OpenObjectOnce(std::string_view key) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    const std::string path = c_->Path(key);
    std::lock_guard<std::mutex> g(c_->mu);
    CKPTIO_ASSIGN_OR_RETURN(uint64_t size, RegularFileSize(path));
    struct nfsfh* fh = nullptr;
    int rc = nfs_open(c_->ctx, path.c_str(), O_RDONLY, &fh);
    if (rc < 0) return c_->Error(rc, "open " + path);
    // The size read through the open file, not the earlier lookup.
    struct nfs_stat_64 st;
    rc = nfs_fstat64(c_->ctx, fh, &st);
    if (rc < 0) {
      (void)nfs_close(c_->ctx, fh);
      return c_->Error(rc, "fstat " + path);
    }
    (void)size;
    auto reader = std::make_unique<NfsReader>(c_, fh, st.nfs_size, path);
    // Small objects (LATEST, manifests, records) are read whole now: one
    // replaced by a rename after we opened it would read as stale on NFS,
    // where no open file keeps a deleted one alive for us.
    if (st.nfs_size <= kSnapshotBytes) CKPTIO_RETURN_IF_ERROR(reader->SnapshotLocked());
    return std::unique_ptr<ObjectReader>(std::move(reader));
  }

  Result<ObjectInfo> StatOnce(std::string_view key) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard<std::mutex> g(c_->mu);
    CKPTIO_ASSIGN_OR_RETURN(uint64_t size, RegularFileSize(c_->Path(key)));
    return ObjectInfo{size};
  }

  Result<std::vector<std::string>> ListOnce(std::string_view prefix) {
    CKPTIO_RETURN_IF_ERROR(ValidatePrefix(prefix));
    size_t slash = prefix.rfind('/');
    std::string dir_key(slash == std::string_view::npos ? "" : prefix.substr(0, slash));
    if (!dir_key.empty()) CKPTIO_RETURN_IF_ERROR(ValidateKey(dir_key));
    std::vector<std::string> out;
    std::lock_guard<std::mutex> g(c_->mu);
    struct nfs_stat_64 st;
    int rc = nfs_lstat64(c_->ctx, c_->Path(dir_key).c_str(), &st);
    if (rc < 0 || !S_ISDIR(st.nfs_mode)) {
      if (dir_key.empty())
        return rc == -ENOENT ? Status(Code::kNotFound, "no store at " + c_->uri)
                             : c_->Error(rc, "list");
      if (rc < 0 && rc != -ENOENT) return c_->Error(rc, "stat " + c_->Path(dir_key));
      return out;
    }
    CKPTIO_RETURN_IF_ERROR(Walk(dir_key, &out));
    out.erase(std::remove_if(
                  out.begin(), out.end(),
                  [&](const std::string& k) { return k.compare(0, prefix.size(), prefix) != 0; }),
              out.end());
    std::sort(out.begin(), out.end());
    return out;
  }

  Status DeleteOnce(std::string_view key) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard<std::mutex> g(c_->mu);
    const std::string path = c_->Path(key);
    struct nfs_stat_64 st;
    int rc = nfs_lstat64(c_->ctx, path.c_str(), &st);
    if (rc == 0 && S_ISDIR(st.nfs_mode))
      return Status(Code::kNotFound, c_->uri + ": " + path + " is a directory, not an object");
    rc = nfs_unlink(c_->ctx, path.c_str());
    if (rc < 0) {
      // A lost reply to a REMOVE that happened: look before deciding.
      if (rc != -ENOENT && nfs_lstat64(c_->ctx, path.c_str(), &st) == -ENOENT) return OkStatus();
      return c_->Error(rc, "delete " + path);
    }
    // Folders emptied by this delete go too (a non-empty one stops it).
    std::string k(key);
    for (size_t s = k.rfind('/'); s != std::string::npos; s = k.rfind('/')) {
      k.resize(s);
      if (nfs_rmdir(c_->ctx, c_->Path(k).c_str()) < 0) break;
    }
    return OkStatus();
  }

  Result<bool> IsLockedOnce(std::string_view key) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard<std::mutex> g(c_->mu);
    if (c_->held.count(std::string(key))) return true;
    const std::string path = c_->Path(key);
    if (c_->options.version == 3) {
      std::string record;
      Status s = NfsLock::ReadSmallFile(*c_, path, &record);
      if (s.code() == Code::kNotFound) return false;
      CKPTIO_RETURN_IF_ERROR(s);
      return !LeaseExpired(record);
    }
    struct nfsfh* fh = nullptr;
    int rc = nfs_open(c_->ctx, path.c_str(), O_RDONLY, &fh);
    if (rc == -ENOENT) return false;
    if (rc < 0) return c_->Error(rc, "open lock file " + path);
    rc = nfs_lockf(c_->ctx, fh, NFS4_F_TEST, kLockBytes);  // LOCKT
    (void)nfs_close(c_->ctx, fh);
    return rc != 0;
  }

  Result<std::unique_ptr<BackendLock>> TryLockOnce(std::string_view key, LockMode mode) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    const std::string path = c_->Path(key);
    std::lock_guard<std::mutex> g(c_->mu);
    if (c_->held.count(std::string(key)))
      return Status(Code::kFailedPrecondition, path + " is already locked by this process");
    CKPTIO_RETURN_IF_ERROR(c_->MakeParents(key));
    Connection::Held h;
    h.path = path;
    if (c_->options.version == 3) {
      if (mode == LockMode::kShared)
        return Status(Code::kUnimplemented,
                      c_->uri +
                          ": NFSv3 through libnfs has no shared locks; use version=4, "
                          "or the manifest wait mode");
      CKPTIO_RETURN_IF_ERROR(TakeLease(path, &h.record));
    } else {
      std::string export_path = c_->export_path;
      CKPTIO_ASSIGN_OR_RETURN(
          h.ctx,
          Connect(c_->options, c_->options.client_name + ".lock" + std::to_string(c_->counter++),
                  &export_path));
      auto close_all = [&] {
        const bool ok = !h.fh || nfs_close(h.ctx, h.fh) == 0;
        ReleaseContext(h.ctx, !ok || c_->failed.count(h.ctx) > 0);
      };
      // (libnfs 4.0 treats O_CREAT on v4 as an exclusive create: open, else
      // create, else open what a racing creator made.)
      int rc = nfs_open(h.ctx, path.c_str(), O_RDWR, &h.fh);
      if (rc == -ENOENT)
        rc = nfs_open2(h.ctx, path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0644, &h.fh);
      if (rc == -EEXIST) rc = nfs_open(h.ctx, path.c_str(), O_RDWR, &h.fh);
      if (rc < 0) {
        Status s = c_->ErrorOn(h.ctx, rc, "open lock file " + path);
        h.fh = nullptr;
        close_all();
        return s;
      }
      struct nfs4_flock fl {};
      fl.l_type = mode == LockMode::kExclusive ? F_WRLCK : F_RDLCK;
      fl.l_whence = SEEK_SET;
      fl.l_len = kLockBytes;
      rc = nfs_fcntl(h.ctx, h.fh, NFS4_F_SETLK, &fl);
      if (rc < 0) {
        Status s = c_->ErrorOn(h.ctx, rc, "lock " + path);
        close_all();
        // NFS4ERR_DENIED: somebody else holds it.
        if (rc == -EAGAIN || rc == -EACCES || s.message().find("DENIED") != std::string::npos)
          return Status(Code::kFailedPrecondition,
                        path + " is locked by another client (" + c_->uri + ")");
        return s;
      }
    }
    c_->held.emplace(std::string(key), std::move(h));
    c_->StartKeepalive();
    return std::unique_ptr<BackendLock>(std::make_unique<NfsLock>(c_, std::string(key)));
  }

 private:
  // The size of the regular file at `path` (callers hold mu).
  Result<uint64_t> RegularFileSize(const std::string& path) {
    struct nfs_stat_64 st;
    int rc = nfs_lstat64(c_->ctx, path.c_str(), &st);
    if (rc < 0) return c_->Error(rc, "stat " + path);
    if (S_ISDIR(st.nfs_mode))
      return Status(Code::kNotFound, c_->uri + ": " + path + " is a directory, not an object");
    if (S_ISLNK(st.nfs_mode)) return ErrnoToStatus(ELOOP, "open " + c_->uri + ": " + path);
    if (!S_ISREG(st.nfs_mode))
      return Status(Code::kFailedPrecondition, c_->uri + ": " + path + " is not a regular file");
    return st.nfs_size;
  }

  Status Walk(const std::string& dir_key, std::vector<std::string>* out) {
    const std::string path = c_->Path(dir_key);
    struct nfsdir* d = nullptr;
    int rc = nfs_opendir(c_->ctx, path.c_str(), &d);
    if (rc == -ENOENT) return OkStatus();  // deleted while we listed
    if (rc < 0) return c_->Error(rc, "list " + path);
    std::vector<std::string> subdirs;
    const std::string prefix = dir_key.empty() ? "" : dir_key + "/";
    while (struct nfsdirent* e = nfs_readdir(c_->ctx, d)) {
      std::string name = e->name;
      if (name == "." || name == ".." || !ValidateKey(name).ok()) continue;
      if (e->type == kNf3Dir)
        subdirs.push_back(prefix + name);
      else if (e->type == kNf3Reg)
        out->push_back(prefix + name);
    }
    nfs_closedir(c_->ctx, d);
    for (const auto& sub : subdirs) CKPTIO_RETURN_IF_ERROR(Walk(sub, out));
    return OkStatus();
  }

  static bool LeaseExpired(const std::string& record) {
    size_t at = record.find("expires_ms=");
    if (at == std::string::npos) return true;  // torn or foreign: treat as stale
    return NowMs() > std::atoll(record.c_str() + at + 11);
  }

  // v3: create the lease file exclusively, breaking an expired one.
  Status TakeLease(const std::string& path, std::string* record) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      struct nfsfh* fh = nullptr;
      int rc = nfs_open2(c_->ctx, path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644, &fh);
      if (rc == 0) {
        *record = c_->LeaseRecord();
        rc = nfs_pwrite(c_->ctx, fh, 0, record->size(), record->data());
        if (rc >= 0) rc = nfs_fsync(c_->ctx, fh);
        int closed = nfs_close(c_->ctx, fh);
        if (rc < 0 || closed < 0) {
          (void)nfs_unlink(c_->ctx, path.c_str());
          return c_->Error(rc < 0 ? rc : closed, "write lease " + path);
        }
        return OkStatus();
      }
      if (rc != -EEXIST) return c_->Error(rc, "create lease " + path);
      std::string seen;
      Status s = NfsLock::ReadSmallFile(*c_, path, &seen);
      if (s.code() == Code::kNotFound) continue;  // released meanwhile
      CKPTIO_RETURN_IF_ERROR(s);
      if (!LeaseExpired(seen))
        return Status(Code::kFailedPrecondition, path + " is locked by another client (lease: " +
                                                     seen.substr(0, seen.find('\n')) + ")");
      // Break the expired lease: move it aside, and make sure what moved is
      // the record we judged (not a fresh lease someone took meanwhile).
      const std::string aside = path + ".broken." + RandomHex();
      if (nfs_rename(c_->ctx, path.c_str(), aside.c_str()) < 0) continue;
      std::string moved;
      if (NfsLock::ReadSmallFile(*c_, aside, &moved).ok() && moved != seen) {
        (void)nfs_link(c_->ctx, aside.c_str(), path.c_str());  // put it back
        (void)nfs_unlink(c_->ctx, aside.c_str());
        return Status(Code::kFailedPrecondition, path + " is locked by another client");
      }
      (void)nfs_unlink(c_->ctx, aside.c_str());
    }
    return Status(Code::kFailedPrecondition, path + " is contended; try again");
  }

  std::shared_ptr<Connection> c_;
};

}  // namespace

Result<NfsOptions> ParseNfsUri(const Uri& uri) {
  auto bad = [&](const std::string& what) {
    return Status(Code::kInvalidArgument,
                  "nfs:// URI: " + what +
                      " (form: nfs://server/export/path?version=3|4"
                      "&nfsport=N&mountport=N&timeout_ms=N&lease_ms=N&client=NAME)");
  };
  NfsOptions o;
  o.server = uri.authority;
  o.path = uri.path;
  if (o.server.empty()) return bad("no server");
  if (o.path.empty() || o.path.front() != '/') return bad("no export path");
  while (o.path.size() > 1 && o.path.back() == '/') o.path.pop_back();
  auto number = [&](const std::string& key, int64_t lo, int64_t hi, int64_t* out) -> Status {
    const std::string& v = uri.params.at(key);
    char* end = nullptr;
    errno = 0;
    long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end || errno || n < lo || n > hi)
      return bad(key + "=" + v + " is not a number in [" + std::to_string(lo) + ", " +
                 std::to_string(hi) + "]");
    *out = n;
    return OkStatus();
  };
  for (const auto& [key, value] : uri.params) {
    int64_t n = 0;
    if (key == "version") {
      CKPTIO_RETURN_IF_ERROR(number(key, 3, 4, &n));
      o.version = static_cast<int>(n);
    } else if (key == "nfsport") {
      CKPTIO_RETURN_IF_ERROR(number(key, 1, 65535, &n));
      o.nfs_port = static_cast<int>(n);
    } else if (key == "mountport") {
      CKPTIO_RETURN_IF_ERROR(number(key, 1, 65535, &n));
      o.mount_port = static_cast<int>(n);
    } else if (key == "timeout_ms") {
      CKPTIO_RETURN_IF_ERROR(number(key, 1000, 86400000, &n));
      o.timeout = std::chrono::milliseconds(n);
    } else if (key == "lease_ms") {
      CKPTIO_RETURN_IF_ERROR(number(key, 1000, 3600000, &n));
      o.lease = std::chrono::milliseconds(n);
    } else if (key == "client") {
      if (value.empty() || value.size() > 64) return bad("client must be 1-64 characters");
      o.client_name = value;
    } else {
      return bad("unknown parameter \"" + key + "\"");
    }
  }
  return o;
}

// A new libnfs context with `o`'s settings, mounted on `export_path`
// (empty: the longest prefix of o.path that mounts, stored back there).
Result<struct nfs_context*> Connect(const NfsOptions& o, const std::string& client,
                                    std::string* export_path) {
  const std::string uri = "nfs://" + o.server + o.path + "?version=" + std::to_string(o.version);
  struct nfs_context* ctx = nfs_init_context();
  if (!ctx) return Status(Code::kResourceExhausted, "nfs_init_context failed");
  auto fail = [&](Status s) {
    ReleaseContext(ctx, /*failed=*/true);  // a failed mount may leave requests in flight
    return s;
  };
  // libnfs 4.0 sets ports and the version only from URL arguments.
  std::string settings = "nfs://" + o.server + "/?version=" + std::to_string(o.version);
  if (o.nfs_port) settings += "&nfsport=" + std::to_string(o.nfs_port);
  if (o.mount_port) settings += "&mountport=" + std::to_string(o.mount_port);
  struct nfs_url* parsed = nfs_parse_url_dir(ctx, settings.c_str());
  if (!parsed)
    return fail(Status(Code::kInvalidArgument,
                       "libnfs refused " + settings + ": " + std::string(nfs_get_error(ctx))));
  nfs_destroy_url(parsed);
  // libnfs counts timeouts in whole seconds.
  nfs_set_timeout(ctx, static_cast<int>(std::max<int64_t>(1, o.timeout.count() / 1000) * 1000));
  nfs_set_autoreconnect(ctx, 0);  // never retry silently: a dead server is an error
  // No client-side caching: a directory listing reused while the directory's
  // mtime looks unchanged can miss what another client just committed.
  nfs_set_dircache(ctx, 0);
  nfs_set_pagecache(ctx, 0);
  if (o.version == 4) {
    // Two v4 connections of one process must not share a client identity.
    nfs4_set_client_name(ctx, client.c_str());
    const std::string verifier = RandomHex().substr(0, 8);
    nfs4_set_verifier(ctx, verifier.c_str());
  }
  if (!export_path->empty()) {
    int rc = nfs_mount(ctx, o.server.c_str(), export_path->c_str());
    if (rc != 0)
      return fail(Status(Code::kUnavailable,
                         "cannot mount " + uri + ": " + std::string(nfs_get_error(ctx))));
    return ctx;
  }
  // Mount the longest prefix of the path that the server exports.
  std::string path = o.path;
  std::string first_error;
  while (true) {
    int rc = nfs_mount(ctx, o.server.c_str(), path.c_str());
    if (rc == 0) break;
    if (first_error.empty()) {
      const char* e = nfs_get_error(ctx);
      first_error = e ? e : "error " + std::to_string(rc);
    }
    if (rc == -ETIMEDOUT || rc == -ECONNREFUSED || path == "/")
      return fail(Status(Code::kUnavailable,
                         "cannot mount " + uri + ": " + first_error +
                             " (is the server running and exporting it? for a local test "
                             "server see tools/nfs-server.sh)"));
    size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  *export_path = path;
  return ctx;
}

Result<std::unique_ptr<StorageBackend>> NewNfsBackend(NfsOptions o) {
  if (o.version != 3 && o.version != 4)
    return Status(Code::kInvalidArgument, "NFS version must be 3 or 4");
  if (o.client_name.empty())
    o.client_name = KeySafeHostName() + "." + std::to_string(::getpid()) + "." +
                    std::to_string(g_connections.fetch_add(1)) + "." + RandomHex().substr(0, 8);
  std::string uri = "nfs://" + o.server + o.path + "?version=" + std::to_string(o.version);
  auto c = std::make_shared<Connection>(o, uri);
  CKPTIO_ASSIGN_OR_RETURN(c->ctx, Connect(o, o.client_name, &c->export_path));
  c->root = o.path.substr(c->export_path == "/" ? 0 : c->export_path.size());
  if (c->root == "/") c->root.clear();
  if (o.version == 4) {
    c->max_write = kV4MaxWrite;
  } else {
    uint64_t wmax = nfs_get_writemax(c->ctx);
    if (wmax > 0) c->max_write = std::min<uint64_t>(wmax, kWriteBuffer);
  }
  return std::unique_ptr<StorageBackend>(std::make_unique<NfsBackend>(std::move(c)));
}

Status RegisterNfsBackend(BackendRegistry& registry) {
  return registry.Register("nfs", [](const Uri& uri) -> Result<std::unique_ptr<StorageBackend>> {
    CKPTIO_ASSIGN_OR_RETURN(NfsOptions o, ParseNfsUri(uri));
    return NewNfsBackend(std::move(o));
  });
}

}  // namespace ckptio
