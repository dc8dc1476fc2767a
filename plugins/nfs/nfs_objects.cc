// The nfs:// backend's objects: writer, reader, stat, list and delete (see
// nfs_objects.h).
#include "nfs_objects.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "ckptio/layout.h"

namespace ckptio::nfs {
namespace {

constexpr uint64_t kSnapshotBytes = 1 << 20;
constexpr int kNf3Reg = 1, kNf3Dir = 2;

class NfsWriter : public ObjectWriter {
 public:
  NfsWriter(std::shared_ptr<Connection> c, struct nfsfh* fh, std::string tmp, std::string key,
            WriteMode mode)
      : c_(std::move(c)),
        ctx_(c_->ctx),
        fh_(fh),
        tmp_(std::move(tmp)),
        key_(std::move(key)),
        target_(c_->Path(key_)),
        mode_(mode) {}
  ~NfsWriter() override {
    if (!committed_) Discard();
  }

  // Small appends gather in a buffer; a buffer's worth or more goes out
  // straight from the caller's memory. Either way each WRITE takes the
  // connection's mutex on its own, so other calls and the lease renewal
  // wait for one WRITE, never for a whole tensor.
  Status Append(const void* data, size_t size) override {
    if (dead_) return Dead();
    const char* p = static_cast<const char*>(data);
    if (buffer_.size() + size < kWriteBuffer) {
      buffer_.append(p, size);
      return OkStatus();
    }
    if (!buffer_.empty()) {  // top it up and write it
      const size_t take = kWriteBuffer - buffer_.size();
      buffer_.append(p, take);
      p += take;
      size -= take;
      Status s = Write(buffer_.data(), buffer_.size());
      buffer_.clear();
      if (!s.ok()) return Fail(s);
    }
    if (size < kWriteBuffer) {
      buffer_.append(p, size);
      return OkStatus();
    }
    Status s = Write(p, size);
    return s.ok() ? s : Fail(s);
  }

  Status Commit() override {
    if (dead_ || committed_) return Dead();
    dead_ = true;
    Status s = Write(buffer_.data(), buffer_.size());
    std::string().swap(buffer_);
    std::lock_guard<FairMutex> g(c_->mu);
    if (!s.ok()) return Abandon(s);
    if (c_->Broken(ctx_)) return Abandon(c_->BrokenError("commit " + tmp_));
    int rc = 0;
    // COMMIT: the bytes are on stable storage. Over v3, libnfs's close of a
    // written file sends it, and close's result is its result, so an
    // nfs_fsync first would be a second COMMIT, a round trip for nothing
    // (nfs_store_test's NfsRoundTrips sees the COMMIT on the wire).
    if (c_->options.version == 4) {
      rc = nfs_fsync(ctx_, fh_);
      if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "fsync (COMMIT) " + tmp_));
    }
    // The temp's file id, to recognise it under the target's name if the
    // reply to our RENAME is lost (the temp's name is gone after it; a LINK
    // leaves it, so LinkHappened reads it then).
    if (mode_ == WriteMode::kReplace) {
      struct nfs_stat_64 st;
      rc = nfs_fstat64(ctx_, fh_, &st);
      if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "fstat " + tmp_));
      ino_ = st.nfs_ino;
    }
    rc = nfs_close(ctx_, fh_);
    fh_ = nullptr;
    if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "close (COMMIT) " + tmp_));
    // Not through a folder swapped for a symbolic link since NewObject.
    // Nor is the temp removed through it (that would remove whatever has
    // the temp's name where the link points): it is left, and said so.
    Status linked = c_->RefuseLinkedFolders(key_);
    if (!linked.ok()) {
      const std::string left = tmp_;
      tmp_.clear();
      return linked.WithContext("commit " + target_ + " (its temp " + left +
                                " is left in place: not removed through the link)");
    }
    if (mode_ == WriteMode::kReplace) {
      rc = nfs_rename(ctx_, tmp_.c_str(), target_.c_str());
      if (rc < 0) {
        Status error = c_->ErrorOn(ctx_, rc, "rename " + tmp_);
        if (!RenameHappened()) return Abandon(error);
      }
    } else {
      rc = nfs_link(ctx_, tmp_.c_str(), target_.c_str());
      if (rc < 0) {
        Status error = c_->ErrorOn(ctx_, rc, "link " + tmp_);
        if (!LinkHappened()) {
          if (rc == -EEXIST)
            return Abandon(
                Status(Code::kAlreadyExists,
                       c_->uri + ": " + target_ + " already exists and is never overwritten"));
          return Abandon(error);
        }
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

  // Writes `size` bytes at the end of the temp, a batch of WRITEs (one for
  // v3, writes_in_flight for v4) per hold of mu.
  Status Write(const char* p, size_t size) {
    const size_t batch = c_->max_write * c_->writes_in_flight;
    for (size_t done = 0; done < size;) {
      const size_t n = std::min(batch, size - done);
      std::lock_guard<FairMutex> g(c_->mu);
      if (c_->Broken(ctx_)) return c_->BrokenError("write " + tmp_);
      CKPTIO_RETURN_IF_ERROR(n > c_->max_write ? WriteBatchLocked(offset_, p + done, n)
                                               : WriteLocked(offset_, p + done, n));
      done += n;
      offset_ += n;
    }
    return OkStatus();
  }

  // Writes [p, p + n) at `off`, one WRITE after another (callers hold mu).
  Status WriteLocked(uint64_t off, const char* p, size_t n) {
    while (n > 0) {
      int rc = nfs_pwrite(ctx_, fh_, off, std::min(n, c_->max_write), p);
      if (rc < 0) return c_->CallError(ctx_, fh_, rc, "write " + tmp_, Dir(tmp_), n);
      if (rc == 0)
        return Status(Code::kUnavailable, c_->uri + ": write " + tmp_ + " made no progress");
      p += rc;
      off += static_cast<uint64_t>(rc);
      n -= static_cast<size_t>(rc);
    }
    return OkStatus();
  }

  // Writes [p, p + n) at `off` in WRITEs of max_write bytes, all in flight
  // at once (callers hold mu). A short WRITE's rest is written after the
  // batch.
  Status WriteBatchLocked(uint64_t off, const char* p, size_t n) {
    return c_->RunBatchLocked(
        ctx_, fh_, AsyncBatch::Split(off, const_cast<char*>(p), n, c_->max_write), SIZE_MAX,
        "WRITE", "write " + tmp_, Dir(tmp_),
        [&](AsyncBatch::Piece& piece) {
          return nfs_pwrite_async(ctx_, fh_, piece.off, piece.len, piece.buf, AsyncBatch::Wrote,
                                  &piece);
        },
        [&](const AsyncBatch::Piece& piece, size_t wrote) {
          return WriteLocked(piece.off + wrote, piece.buf + wrote, piece.len - wrote);
        });
  }

  // After a failed RENAME: did it happen anyway (a lost reply)? Only if the
  // temp's name is gone for sure and the target is the temp's file. Any
  // other answer (an error looking, another file of the same size under
  // the target: LATEST always has one) means no.
  // A look that times out (the server hangs) starts the quiet again (see
  // ErrorOn), so the calls that clean up after it fail at once.
  bool RenameHappened() {
    struct nfs_stat_64 st;
    const int rc = nfs_lstat64(ctx_, tmp_.c_str(), &st);
    if (rc == -ENOENT) return TargetIsOurs();
    if (rc < 0) (void)c_->ErrorOn(ctx_, rc, "stat " + tmp_);
    return false;
  }
  // After a failed LINK: did it happen anyway? The temp keeps its name
  // either way, so only if the target is the temp's file. An error looking
  // means no.
  bool LinkHappened() {
    struct nfs_stat_64 st;
    const int rc = nfs_lstat64(ctx_, tmp_.c_str(), &st);
    if (rc < 0) {
      (void)c_->ErrorOn(ctx_, rc, "stat " + tmp_);
      return false;
    }
    ino_ = st.nfs_ino;
    return TargetIsOurs();
  }
  // Whether the target is the temp's file (ino_) after a failed RENAME or
  // LINK.
  bool TargetIsOurs() {
    struct nfs_stat_64 st;
    const int rc = nfs_lstat64(ctx_, target_.c_str(), &st);
    if (rc < 0 && rc != -ENOENT) (void)c_->ErrorOn(ctx_, rc, "stat " + target_);
    return rc == 0 && S_ISREG(st.nfs_mode) && st.nfs_ino == ino_;
  }

  // Removes the temp (callers hold mu).
  Status Abandon(Status s) {
    DiscardLocked();
    return s;
  }
  Status Fail(Status s) {
    dead_ = true;
    Discard();
    return s;
  }
  void Discard() {
    std::lock_guard<FairMutex> g(c_->mu);
    DiscardLocked();
  }
  // Closes and removes the temp, unless its connection failed: the calls
  // would each wait out the deadline on a hung server. The temp is then left
  // for the next writer's sweep of stale temps.
  void DiscardLocked() {
    const bool broken = c_->Broken(ctx_);
    if (fh_ && !broken) (void)nfs_close(ctx_, fh_);
    fh_ = nullptr;
    if (!tmp_.empty() && !broken && nfs_unlink(ctx_, tmp_.c_str()) == 0 && ctx_ == c_->ctx)
      c_->RemoveEmptyFolders(key_);
    tmp_.clear();
  }

  std::shared_ptr<Connection> c_;
  struct nfs_context* ctx_;  // the connection the temp was created on
  struct nfsfh* fh_;
  std::string tmp_, key_, target_;
  WriteMode mode_;
  std::string buffer_;
  uint64_t offset_ = 0;
  uint64_t ino_ = 0;  // the temp's file id, once read (see Commit)
  bool dead_ = false, committed_ = false;
};

class NfsReader : public ObjectReader {
 public:
  NfsReader(std::shared_ptr<Connection> c, struct nfsfh* fh, uint64_t size, std::string path)
      : c_(std::move(c)), ctx_(c_->ctx), fh_(fh), size_(size), path_(std::move(path)) {}
  ~NfsReader() override {
    if (!fh_) return;  // (a snapshot: may be destroyed with mu held)
    std::lock_guard<FairMutex> g(c_->mu);
    if (!c_->Broken(ctx_)) (void)nfs_close(ctx_, fh_);
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
    // A piece at a time under mu, so other calls interleave with a large read.
    char* p = static_cast<char*>(buf);
    while (size > 0) {
      std::lock_guard<FairMutex> g(c_->mu);
      if (c_->Broken(ctx_)) return c_->BrokenError("read " + path_);
      const size_t n = std::min(size, c_->ReadTurn());
      CKPTIO_RETURN_IF_ERROR(ReadRangeLocked(offset, p, n));
      p += n;
      offset += n;
      size -= n;
    }
    return OkStatus();
  }

  // Reads the whole object into memory and closes the file (callers hold mu).
  Status SnapshotLocked() {
    snapshot_.resize(size_);
    Status s = ReadRangeLocked(0, snapshot_.data(), size_);
    if (!c_->Broken(ctx_)) (void)nfs_close(ctx_, fh_);
    fh_ = nullptr;
    return s;
  }

 private:
  // Reads [p, p + n) at `offset` (callers hold mu): READs of max_read
  // bytes, reads_in_flight of them at once (each READ's round trip would
  // otherwise leave the link idle). A short READ's rest is read after: by
  // ReadLocked, unless the connection already reads in READs no larger
  // than the answer (a v4 server's limit it learnt, see LearnReadMax).
  Status ReadRangeLocked(uint64_t offset, char* p, size_t n) {
    if (n <= c_->max_read) return ReadLocked(offset, p, n);
    return c_->RunBatchLocked(
        ctx_, fh_, AsyncBatch::Split(offset, p, n, c_->max_read), c_->reads_in_flight, "READ",
        "read " + path_, "",
        [&](AsyncBatch::Piece& piece) {
          return nfs_pread_async(ctx_, fh_, piece.off, piece.len, AsyncBatch::Read, &piece);
        },
        [&](const AsyncBatch::Piece& piece, size_t got) {
          const uint64_t off = piece.off + got;
          char* rest = piece.buf + got;
          const size_t left = piece.len - got;
          return got >= c_->max_read ? ReadRangeLocked(off, rest, left)
                                     : ReadLocked(off, rest, left, got);
        });
  }

  // One READ after another (`short_answer`: the bytes a READ of this range
  // just before answered, less than asked). A short answer followed by a
  // READ that reads more is a v4 server's limit, not the end of the file:
  // the connection learns it and the rest goes in READs in flight.
  Status ReadLocked(uint64_t offset, char* p, size_t size, size_t short_answer = 0) {
    while (size > 0) {
      const size_t n = std::min(size, c_->max_read);
      int rc = nfs_pread(ctx_, fh_, offset, n, p);
      if (rc < 0) return c_->CallError(ctx_, fh_, rc, "read " + path_);
      if (rc == 0)
        return Status(Code::kDataLoss, c_->uri + ": " + path_ + " ends at byte " +
                                           std::to_string(offset) + " (truncated object?)");
      p += rc;
      offset += static_cast<uint64_t>(rc);
      size -= static_cast<size_t>(rc);
      if (short_answer > 0 && c_->LearnReadMax(short_answer))
        return ReadRangeLocked(offset, p, size);
      short_answer = static_cast<size_t>(rc) < n ? static_cast<size_t>(rc) : 0;
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

}  // namespace

Result<std::unique_ptr<ObjectWriter>> Objects::NewObject(std::string_view key, WriteMode mode) {
  CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
  const size_t slash = key.rfind('/');
  const std::string base(slash == std::string_view::npos ? key : key.substr(slash + 1));
  if (base.compare(0, kTempMarker.size(), kTempMarker) == 0)
    return Status(Code::kInvalidArgument,
                  "object key \"" + std::string(key) + "\" uses the reserved temp prefix");
  std::lock_guard<FairMutex> g(c_->mu);
  CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
  std::string tmp;
  struct nfsfh* fh = nullptr;
  int rc = -ENOENT;
  // Twice if the folder went in between: a delete of the last object in it
  // (another rank's, or a discarded temp's) removes an emptied folder.
  for (int attempt = 0; attempt < 2 && rc == -ENOENT; ++attempt) {
    Status made = c_->MakeParents(key);  // (may mount the store's folder)
    if (!made.ok() && made.code() == Code::kNotFound && attempt == 0) continue;  // (its parent)
    CKPTIO_RETURN_IF_ERROR(made);
    const std::string dir =
        slash == std::string_view::npos ? c_->Path("") : c_->Path(key.substr(0, slash));
    tmp = dir + "/" + TempObjectName(base);
    rc = nfs_open2(c_->ctx, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644, &fh);
  }
  if (rc < 0) return c_->Error(rc, "create " + tmp);
  return std::unique_ptr<ObjectWriter>(
      std::make_unique<NfsWriter>(c_, fh, tmp, std::string(key), mode));
}

Result<std::unique_ptr<ObjectReader>> Objects::OpenObject(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
  std::lock_guard<FairMutex> g(c_->mu);
  CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
  const std::string path = c_->Path(key);
  struct nfsfh* fh = nullptr;
  int rc = 0;
  if (c_->NoFollowOpens()) {
    // One walk, which refuses a symbolic link in any component: libnfs
    // looks at the type in each LOOKUP's answer (a server that sends none
    // leaves libnfs unable to follow a link at all, and the GETATTR below
    // refuses one opened last). On a refusal, the folder that is a link is
    // looked for, to name it.
    rc = nfs_open(c_->ctx, path.c_str(), O_RDONLY | O_NOFOLLOW, &fh);
    if (rc == -ELOOP) {
      CKPTIO_RETURN_IF_ERROR(c_->RefuseLinkedFolders(key));
      return c_->LinkRefused(path);
    }
  } else {
    CKPTIO_RETURN_IF_ERROR(c_->RefuseLinkedFolders(key));
    CKPTIO_RETURN_IF_ERROR(RegularFileSize(path).status());
    rc = nfs_open(c_->ctx, path.c_str(), O_RDONLY, &fh);
  }
  if (rc < 0) return c_->Error(rc, "open " + path);
  // What was opened, and its size, read through the open file.
  struct nfs_stat_64 st;
  rc = nfs_fstat64(c_->ctx, fh, &st);
  Status regular = rc < 0 ? c_->Error(rc, "fstat " + path) : RegularFile(path, st);
  if (!regular.ok()) {
    if (!c_->Broken(c_->ctx)) (void)nfs_close(c_->ctx, fh);
    return regular;
  }
  auto reader = std::make_unique<NfsReader>(c_, fh, st.nfs_size, path);
  // Small objects (LATEST, manifests, records) are read whole now: one
  // replaced by a rename after we opened it would read as stale on NFS,
  // where no open file keeps a deleted one alive for us.
  if (st.nfs_size <= kSnapshotBytes) CKPTIO_RETURN_IF_ERROR(reader->SnapshotLocked());
  return std::unique_ptr<ObjectReader>(std::move(reader));
}

Result<ObjectInfo> Objects::Stat(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
  std::lock_guard<FairMutex> g(c_->mu);
  CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
  CKPTIO_RETURN_IF_ERROR(c_->RefuseLinkedFolders(key));
  CKPTIO_ASSIGN_OR_RETURN(uint64_t size, RegularFileSize(c_->Path(key)));
  return ObjectInfo{size};
}

Result<std::vector<std::string>> Objects::List(std::string_view prefix) {
  CKPTIO_RETURN_IF_ERROR(ValidatePrefix(prefix));
  size_t slash = prefix.rfind('/');
  std::string dir_key(slash == std::string_view::npos ? "" : prefix.substr(0, slash));
  if (!dir_key.empty()) CKPTIO_RETURN_IF_ERROR(ValidateKey(dir_key));
  std::vector<std::string> out;
  std::lock_guard<FairMutex> g(c_->mu);
  CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
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

Status Objects::Delete(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
  std::lock_guard<FairMutex> g(c_->mu);
  CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
  const std::string path = c_->Path(key);
  CKPTIO_RETURN_IF_ERROR(c_->RefuseLinkedFolders(key));
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
  c_->RemoveEmptyFolders(key);
  return OkStatus();
}

Result<uint64_t> Objects::RegularFileSize(const std::string& path) {
  struct nfs_stat_64 st;
  int rc = nfs_lstat64(c_->ctx, path.c_str(), &st);
  if (rc < 0) return c_->Error(rc, "stat " + path);
  CKPTIO_RETURN_IF_ERROR(RegularFile(path, st));
  return st.nfs_size;
}

Status Objects::RegularFile(const std::string& path, const struct nfs_stat_64& st) const {
  if (S_ISDIR(st.nfs_mode))
    return Status(Code::kNotFound, c_->uri + ": " + path + " is a directory, not an object");
  if (S_ISLNK(st.nfs_mode)) return ErrnoToStatus(ELOOP, "open " + c_->uri + ": " + path);
  if (!S_ISREG(st.nfs_mode))
    return Status(Code::kFailedPrecondition, c_->uri + ": " + path + " is not a regular file");
  return OkStatus();
}

Status Objects::Walk(const std::string& dir_key, std::vector<std::string>* out) {
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

}  // namespace ckptio::nfs
