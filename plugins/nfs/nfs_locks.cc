// The nfs:// backend's locks: NFSv4 locks, NFSv3 lease files, their renewal
// thread and IsLocked (see nfs_locks.h).
#include "nfs_locks.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include "ckptio/layout.h"

namespace ckptio::nfs {
namespace {

constexpr uint64_t kLockBytes = 1;  // v4 locks cover byte 0 (a length of 0 is refused)
// How long a v4 lock's release waits for a renewal's READ under way.
constexpr std::chrono::milliseconds kRenewalWait{250};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool LeaseExpired(const std::string& record,
                  std::chrono::milliseconds grace = std::chrono::milliseconds(0)) {
  size_t at = record.find("expires_ms=");
  if (at == std::string::npos) return true;  // torn or foreign: treat as stale
  return NowMs() > std::atoll(record.c_str() + at + 11) + grace.count();
}

// Whether a failed LOCK or LOCKT (error text `detail`) says another
// client holds the lock: NFS4ERR_DENIED, which libnfs 4.0 names in the
// error text it sets on every failure (its errno for it, EIO or ERANGE,
// says nothing). EACCES (NFS4ERR_ACCESS) and EAGAIN (NFS4ERR_EXPIRED,
// NFS4ERR_FHEXPIRED...) are errors, not "locked".
bool LockDenied(const char* detail) { return detail && std::strstr(detail, "NFS4ERR_DENIED"); }

// A lock taken through a LockTable; released when destroyed.
class NfsLock : public BackendLock {
 public:
  NfsLock(std::shared_ptr<LockTable> t, std::string key) : t_(std::move(t)), key_(std::move(key)) {}
  ~NfsLock() override { t_->Release(key_); }

 private:
  std::shared_ptr<LockTable> t_;
  std::string key_;
};

}  // namespace

LockTable::~LockTable() {
  {
    std::lock_guard<std::mutex> g(locks_mu);
    stop = true;
  }
  wake.notify_all();
  if (keepalive.joinable()) keepalive.join();
  ReleaseContext(lease_ctx, lease_failed);
}

// ---------------------------------------------------------------------------
// Taking, testing and releasing locks

Result<std::unique_ptr<BackendLock>> LockTable::TryLock(std::string_view key, LockMode mode) {
  CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
  if (c_->options.version == 3 && mode == LockMode::kShared)
    return Status(Code::kUnimplemented,
                  c_->uri +
                      ": NFSv3 through libnfs has no shared locks; use version=4, "
                      "or the manifest wait mode");
  std::lock_guard<FairMutex> g(c_->mu);
  CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
  {
    std::lock_guard<std::mutex> l(locks_mu);
    if (held.count(std::string(key)))
      return Status(Code::kFailedPrecondition,
                    c_->Path(key) + " is already locked by this process");
    CKPTIO_RETURN_IF_ERROR(StartKeepalive());
  }
  CKPTIO_RETURN_IF_ERROR(c_->MakeParents(key));
  const std::string path = c_->Path(key);  // (MakeParents may have mounted the store's folder)
  Held h;
  h.path = path;
  h.serial = counter++;
  if (c_->options.version == 3) {
    CKPTIO_RETURN_IF_ERROR(RefreshLeaseConnection());
    CKPTIO_RETURN_IF_ERROR(TakeLease(path, &h.record));
  } else {
    h.v4 = std::make_shared<V4Lock>();
    V4Lock& v = *h.v4;
    std::string export_path = c_->export_path;
    CKPTIO_ASSIGN_OR_RETURN(
        v.ctx, Connect(c_->options, c_->options.client_name + ".lock" + std::to_string(counter++),
                       &export_path));
    auto close_all = [&] {
      const bool ok = !v.fh || nfs_close(v.ctx, v.fh) == 0;
      ReleaseContext(v.ctx, !ok || c_->failed.count(v.ctx) > 0);
    };
    // (libnfs 4.0 treats O_CREAT on v4 as an exclusive create: open, else
    // create, else open what a racing creator made.)
    int rc = nfs_open(v.ctx, path.c_str(), O_RDWR, &v.fh);
    if (rc == -ENOENT) rc = nfs_open2(v.ctx, path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0644, &v.fh);
    if (rc == -EEXIST) rc = nfs_open(v.ctx, path.c_str(), O_RDWR, &v.fh);
    if (rc < 0) {
      Status s = c_->ErrorOn(v.ctx, rc, "open lock file " + path);
      v.fh = nullptr;
      close_all();
      return s;
    }
    struct nfs4_flock fl {};
    fl.l_type = mode == LockMode::kExclusive ? F_WRLCK : F_RDLCK;
    fl.l_whence = SEEK_SET;
    fl.l_len = kLockBytes;
    rc = nfs_fcntl(v.ctx, v.fh, NFS4_F_SETLK, &fl);
    if (rc < 0) {
      // NFS4ERR_DENIED: somebody else holds it (not a failed connection).
      const bool denied = LockDenied(nfs_get_error(v.ctx));
      Status s = denied ? Status(Code::kFailedPrecondition,
                                 path + " is locked by another client (" + c_->uri + ")")
                        : c_->ErrorOn(v.ctx, rc, "lock " + path);
      close_all();
      return s;
    }
  }
  std::lock_guard<std::mutex> l(locks_mu);
  held.emplace(std::string(key), std::move(h));
  return std::unique_ptr<BackendLock>(
      std::make_unique<NfsLock>(shared_from_this(), std::string(key)));
}

Result<bool> LockTable::IsLocked(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
  std::unique_lock<FairMutex> g(c_->mu);
  CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
  {
    // Ours, unless lost: a v3 lease another client broke, or a v4 lock
    // whose last renewal failed (the server says whether it still is).
    std::lock_guard<std::mutex> l(locks_mu);
    auto it = held.find(std::string(key));
    if (it != held.end() && !it->second.lost && !Broken(it->second)) return true;
  }
  const std::string path = c_->Path(key);
  if (c_->options.version == 3) {
    // Expired past a renewal period of grace, on two reads up to a
    // second apart: a read racing the holder's rewrite, or a renewal held
    // up by a server that stalled, does not pass for a dead holder.
    for (int read = 0; read < 2; ++read) {
      if (read > 0) {
        g.unlock();  // other calls go on meanwhile
        std::this_thread::sleep_for(
            std::min<std::chrono::milliseconds>(c_->options.lease / 3, std::chrono::seconds(1)));
        g.lock();
        CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
      }
      std::string record;
      Status s = c_->ReadSmallFile(path, &record);
      if (s.code() == Code::kNotFound) return false;
      CKPTIO_RETURN_IF_ERROR(s);
      if (!LeaseExpired(record, c_->options.lease / 3)) return true;
    }
    return false;
  }
  struct nfsfh* fh = nullptr;
  int rc = nfs_open(c_->ctx, path.c_str(), O_RDONLY, &fh);
  if (rc == -ENOENT) return false;
  if (rc < 0) return c_->Error(rc, "open lock file " + path);
  rc = nfs_lockf(c_->ctx, fh, NFS4_F_TEST, kLockBytes);  // LOCKT
  // Locked only if the server said so (NFS4ERR_DENIED); a timeout or an
  // I/O error is that error, not "locked".
  const bool denied = rc < 0 && LockDenied(nfs_get_error(c_->ctx));
  Status s = rc < 0 && !denied ? c_->Error(rc, "test lock " + path) : OkStatus();
  (void)nfs_close(c_->ctx, fh);
  if (!s.ok()) return s;
  return denied;
}

void LockTable::Release(const std::string& key) {
  if (c_->options.version == 4) {
    std::shared_ptr<V4Lock> l;
    {
      std::lock_guard<std::mutex> g(locks_mu);
      auto it = held.find(key);
      if (it == held.end()) return;
      l = std::move(it->second.v4);
      held.erase(it);
    }
    // A renewal's READ under way on the lock's connection: waited for
    // briefly (a server answers it in milliseconds; one that just timed
    // out will not), else it unlocks.
    {
      const auto wait = c_->InQuiet() ? std::chrono::milliseconds(0) : kRenewalWait;
      std::unique_lock<std::mutex> s(l->mu);
      if (!l->idle.wait_for(s, wait, [&] { return !l->renewing; })) {
        l->released = true;
        return;
      }
      l->ended = true;
    }
    EndV4Lock(*l, /*by_renewal=*/false);
    return;
  }
  // v3: lease files are on the main connection.
  std::lock_guard<FairMutex> m(c_->mu);
  std::lock_guard<std::mutex> g(locks_mu);
  auto it = held.find(key);
  if (it == held.end()) return;
  Held& h = it->second;
  if (!h.lost) {  // remove the lease file if it is still ours
    std::string now;
    if (c_->EnsureConnected().ok() && c_->ReadSmallFile(h.path, &now).ok() && h.Ours(now))
      (void)nfs_unlink(c_->ctx, h.path.c_str());
  }
  held.erase(it);
}

bool LockTable::Broken(const Held& h) {
  if (!h.v4) return false;
  std::lock_guard<std::mutex> s(h.v4->mu);
  return h.v4->broken || h.v4->unrenewed;
}

void LockTable::EndV4Lock(V4Lock& l, bool by_renewal) const {
  bool ok = false;
  if (!l.broken) {
    if (by_renewal || c_->InQuiet()) nfs_set_timeout(l.ctx, 1000);
    struct nfs4_flock fl {};
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_len = kLockBytes;
    ok = nfs_fcntl(l.ctx, l.fh, NFS4_F_SETLK, &fl) == 0;
    ok = ok && nfs_close(l.ctx, l.fh) == 0;
  }
  ReleaseContext(l.ctx, !ok);
}

// ---------------------------------------------------------------------------
// v3 lease files

std::string LockTable::LeaseRecord() const {
  return "ckptio-lease owner=" + c_->options.client_name +
         " expires_ms=" + std::to_string(NowMs() + c_->options.lease.count()) + "\n";
}

Status LockTable::TakeLease(const std::string& path, std::string* record) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    const std::string fresh = LeaseRecord();
    CKPTIO_ASSIGN_OR_RETURN(bool created, CreateLease(path, fresh));
    if (created) {
      *record = fresh;
      return OkStatus();
    }
    std::string seen;
    Status s = c_->ReadSmallFile(path, &seen);
    if (s.code() == Code::kNotFound) continue;  // released meanwhile
    CKPTIO_RETURN_IF_ERROR(s);
    if (!LeaseExpired(seen))
      return Status(Code::kFailedPrecondition, path + " is locked by another client (lease: " +
                                                   seen.substr(0, seen.find('\n')) + ")");
    // Break the expired lease: move it aside, and make sure what moved is
    // the record we judged (not a fresh lease someone took meanwhile).
    const std::string aside = path + ".broken." + RandomHex();
    if (nfs_rename(c_->ctx, path.c_str(), aside.c_str()) < 0) continue;
    // Only a file positively read as the expired record is deleted: one
    // we could not read may be a live lease taken after we looked.
    std::string moved;
    Status read = c_->ReadSmallFile(aside, &moved);
    if (!read.ok() || moved != seen) {
      // Put it back; the aside name goes only once the lease is back in
      // place (else it is left, rather than a live lease deleted).
      const bool back = nfs_link(c_->ctx, aside.c_str(), path.c_str()) == 0;
      if (back) (void)nfs_unlink(c_->ctx, aside.c_str());
      const std::string left = back ? "" : " (left at " + aside + ")";
      if (!read.ok())
        return read.WithContext("breaking the expired lease " + path +
                                ": could not read what was moved aside" + left);
      return Status(Code::kFailedPrecondition, path + " is locked by another client" + left);
    }
    (void)nfs_unlink(c_->ctx, aside.c_str());
  }
  return Status(Code::kFailedPrecondition, path + " is contended; try again");
}

Result<bool> LockTable::CreateLease(const std::string& path, const std::string& record) {
  const size_t slash = path.rfind('/');
  const std::string tmp = path.substr(0, slash + 1) + TempObjectName(path.substr(slash + 1));
  struct nfsfh* fh = nullptr;
  int rc = nfs_open2(c_->ctx, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644, &fh);
  if (rc < 0) return c_->Error(rc, "create lease " + tmp);
  rc = nfs_pwrite(c_->ctx, fh, 0, record.size(), record.data());
  Status error = rc < 0
                     ? c_->CallError(c_->ctx, fh, rc, "write lease " + tmp, Dir(tmp), record.size())
                     : OkStatus();
  if (error.ok() && rc != static_cast<int>(record.size())) rc = -EIO;
  if (error.ok() && rc >= 0) rc = nfs_fsync(c_->ctx, fh);
  struct nfs_stat_64 st;
  if (error.ok() && rc >= 0) rc = nfs_fstat64(c_->ctx, fh, &st);
  if (error.ok() && rc < 0) error = c_->Error(rc, "write lease " + tmp);
  rc = nfs_close(c_->ctx, fh);
  if (error.ok() && rc < 0) error = c_->Error(rc, "close lease " + tmp);
  if (!error.ok()) {
    (void)nfs_unlink(c_->ctx, tmp.c_str());
    return error;
  }
  rc = nfs_link(c_->ctx, tmp.c_str(), path.c_str());
  if (rc < 0) error = c_->Error(rc, "link lease " + path);
  struct nfs_stat_64 now;
  // A lost reply to a LINK that happened: the lease is our temp's file.
  const bool ours =
      rc == 0 || (nfs_lstat64(c_->ctx, path.c_str(), &now) == 0 && now.nfs_ino == st.nfs_ino);
  (void)nfs_unlink(c_->ctx, tmp.c_str());
  if (ours) return true;
  if (rc == -EEXIST) return false;
  return error;
}

Status LockTable::RefreshLeaseConnection() {
  {
    std::lock_guard<std::mutex> l(locks_mu);
    if (lease_ctx && !lease_failed) return OkStatus();
  }
  std::string path = c_->export_path;
  CKPTIO_ASSIGN_OR_RETURN(
      struct nfs_context * fresh,
      Connect(c_->options, c_->options.client_name + ".lease" + std::to_string(counter++), &path));
  std::lock_guard<std::mutex> l(locks_mu);
  if (lease_ctx && !lease_failed) {  // made meanwhile by another caller
    ReleaseContext(fresh, false);
  } else {
    ReleaseContext(lease_ctx, lease_failed);
    lease_ctx = fresh;
    lease_failed = false;
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------
// Renewal

Status LockTable::StartKeepalive() {
  if (keepalive.joinable()) return OkStatus();
  try {
    keepalive = std::thread([this] { KeepaliveLoop(); });
  } catch (const std::exception& e) {  // std::system_error (EAGAIN), std::bad_alloc
    return Status(Code::kResourceExhausted,
                  c_->uri + ": no lock taken: cannot start the thread that renews locks (" +
                      e.what() + "); raise the process or memory limits");
  }
  return OkStatus();
}

void LockTable::KeepaliveLoop() {
  const NfsOptions& options = c_->options;
  const auto period = options.version == 4 ? std::min<std::chrono::milliseconds>(
                                                 std::chrono::seconds(10), options.lease / 3)
                                           : options.lease / 3;
  std::unique_lock<std::mutex> g(locks_mu);
  while (!stop) {
    wake.wait_for(g, period, [&] { return stop; });
    if (stop) break;
    if (options.version == 4) {
      std::vector<std::shared_ptr<V4Lock>> locks;
      for (auto& [key, h] : held) locks.push_back(h.v4);
      g.unlock();
      for (auto& l : locks) RenewV4(*l);
      g.lock();
      continue;
    }
    // v3: on the lease connection, never waiting for mu.
    if (held.empty()) continue;
    if (!lease_ctx || lease_failed) {
      g.unlock();
      (void)RefreshLeaseConnection();  // else try again next period
      g.lock();
      if (stop) break;
      if (!lease_ctx || lease_failed) continue;
    }
    RenewLeases(g);
  }
}

void LockTable::RenewV4(V4Lock& l) {
  {
    std::lock_guard<std::mutex> s(l.mu);
    if (l.ended) return;
    l.renewing = true;
  }
  char byte;
  const int rc = nfs_pread(l.ctx, l.fh, 0, 1, &byte);
  using Kind = Connection::Kind;
  const Kind kind = rc < 0 ? Connection::Classify(rc, nfs_get_error(l.ctx)) : Kind::kOther;
  bool end;
  {
    std::lock_guard<std::mutex> s(l.mu);
    l.renewing = false;
    l.broken = l.broken || kind == Kind::kTimeout || kind == Kind::kTransport;
    l.unrenewed = rc < 0;  // e.g. NFS4ERR_EXPIRED after a pause past the lease
    end = l.released;
    l.ended = l.ended || end;
  }
  l.idle.notify_all();
  if (end) EndV4Lock(l, /*by_renewal=*/true);
}

// Rewrites each v3 lease file that still holds our record, on lease_ctx,
// read and written through one open handle: should a breaker move the
// file aside between the two, our write lands on the file it moved, which
// it then finds changed and puts back. A lease file that no longer holds
// our record was broken by another client (we were paused past the
// lease): the lock is lost and never written again, so the new holder's
// record stands (the writer fence catches the rest). A lease file that is
// missing is not taken for lost at once: a breaker of an expired lease
// moves it aside and puts back one it finds renewed, so it vanishes
// briefly. Only one missing for longer than the lease is lost. A
// transport error replaces lease_ctx before the next renewal.
// Called with `g` (locks_mu) held; the RPCs run without it, so that a
// release never waits for a renewal stuck on a hung server. Each record
// is made known (in_flight) before it is written, so a release meanwhile
// still recognises the lease file as ours and removes it.
void LockTable::RenewLeases(std::unique_lock<std::mutex>& g) {
  struct Renewal {
    std::string key, path;
    uint64_t serial = 0;
    std::string record, pending, next;  // the lock's, when the renewal began
    bool missing = false, opened = false, read = false, ours = false, wrote = false;
    std::string on_file;  // what the lease file held
  };
  std::vector<Renewal> renewals;
  for (auto& [key, h] : held) {
    if (h.lost) continue;
    Renewal r;
    r.key = key;
    r.path = h.path;
    r.serial = h.serial;
    r.record = h.record;
    r.pending = h.pending;
    renewals.push_back(std::move(r));
  }
  struct nfs_context* on = lease_ctx;
  bool broken = false;  // lease_ctx saw a transport error
  g.unlock();
  auto transport = [&](int rc) {
    const Connection::Kind kind = Connection::Classify(rc, nfs_get_error(on));
    if (kind == Connection::Kind::kTimeout || kind == Connection::Kind::kTransport) broken = true;
  };
  for (Renewal& r : renewals) {
    if (broken) break;
    struct nfsfh* fh = nullptr;
    int rc = nfs_open(on, r.path.c_str(), O_RDWR, &fh);
    if (rc == -ENOENT) {
      r.missing = true;
      continue;
    }
    if (rc < 0) {  // try again next period
      transport(rc);
      continue;
    }
    r.opened = true;
    char buf[512];
    rc = nfs_pread(on, fh, 0, sizeof buf, buf);
    if (rc < 0) transport(rc);
    if (rc >= 0) {
      r.read = true;
      r.on_file.assign(buf, static_cast<size_t>(rc));
      // (r.next cannot be there: it was never sent.)
      r.ours = r.on_file == r.record || (!r.pending.empty() && r.on_file == r.pending);
      // The new record's expiry counts from now, not from before the RPCs;
      // it is in_flight before it is sent. A lock released meanwhile is
      // not renewed.
      if (r.ours) {
        g.lock();
        auto it = held.find(r.key);
        if (it != held.end() && it->second.serial == r.serial) {
          r.next = LeaseRecord();
          it->second.in_flight = r.next;
        } else {
          r.ours = false;
        }
        g.unlock();
      }
      if (r.ours) {
        rc = nfs_pwrite(on, fh, 0, r.next.size(), r.next.data());
        if (rc == static_cast<int>(r.next.size())) rc = nfs_fsync(on, fh);
        r.wrote = rc == 0;
        if (rc < 0) transport(rc);
      }
    }
    (void)nfs_close(on, fh);
  }
  g.lock();
  if (broken) lease_failed = true;
  for (Renewal& r : renewals) {
    auto it = held.find(r.key);
    if (it == held.end() || it->second.serial != r.serial) continue;  // released meanwhile
    Held& h = it->second;
    h.in_flight.clear();
    if (r.missing) {
      const int64_t now = NowMs();
      if (h.missing_since_ms == 0)
        h.missing_since_ms = now;
      else if (now - h.missing_since_ms > c_->options.lease.count())
        h.lost = true;
      continue;
    }
    if (r.opened) h.missing_since_ms = 0;
    if (r.read && !r.ours) h.lost = true;
    if (!r.ours) continue;
    if (r.wrote) {
      h.record = std::move(r.next);
      h.pending.clear();
    } else {  // the WRITE failed, or got no answer: it may have landed
      h.record = std::move(r.on_file);
      h.pending = std::move(r.next);
    }
  }
}

}  // namespace ckptio::nfs
