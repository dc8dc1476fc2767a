// The nfs:// backend. The commit recipe and lock scheme are described in
// nfs_backend.h.
#include "ckptio/nfs_backend.h"

#include <fcntl.h>
#include <nfsc/libnfs.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "nfs_limits.h"
#include "object_io.h"

namespace ckptio {
namespace {

constexpr size_t kWriteBuffer = 1 << 20;
constexpr size_t kMaxRead = 1 << 20;  // the most one READ asks for
using nfs_limits::kV4MaxWrite;
using nfs_limits::kV4WritesInFlight;
constexpr uint64_t kSnapshotBytes = 1 << 20;
// Bytes of READs in flight at once (at least 2 READs). Against the loopback
// server, 2 READs of 1 MiB read 1.6 x as fast as one at a time, 4 only
// 1.3 x (PERFORMANCE.md).
constexpr size_t kReadAhead = 2 << 20;
constexpr uint64_t kLockBytes = 1;  // v4 locks cover byte 0 (a length of 0 is refused)
// How long a v4 lock's release waits for a renewal's READ under way.
constexpr std::chrono::milliseconds kRenewalWait{250};
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

// libnfs's text for the last error on `ctx` (it may have none).
std::string ErrorText(struct nfs_context* ctx) {
  const char* e = nfs_get_error(ctx);
  return e ? e : "libnfs gave no reason";
}

// Asynchronous READs or WRITEs of one file: piece i is [off, off + len) of
// the file, at buf in memory (a READ's answer is copied there), and rc its
// outcome once answered: the bytes done, or -errno. Calls in flight point
// into the batch, and a READ's into buf.
struct AsyncBatch {
  struct Piece {
    AsyncBatch* batch;
    uint64_t off;
    size_t len;
    char* buf;
    int rc = 0;
  };
  size_t sent = 0;     // pieces[0, sent) were queued
  size_t pending = 0;  // of those, not yet answered
  // The first piece answered with an error, and libnfs's text for it then
  // (a later failure replaces the connection's): queue no more.
  const Piece* failed = nullptr;
  std::string failed_text;
  std::vector<Piece> pieces;

  // [p, p + n) at file offset `off`, in pieces of at most `piece` bytes.
  static std::unique_ptr<AsyncBatch> Split(uint64_t off, char* p, size_t n, size_t piece) {
    auto batch = std::make_unique<AsyncBatch>();
    batch->pieces.reserve((n + piece - 1) / piece);  // stable addresses
    for (size_t at = 0; at < n; at += piece)
      batch->pieces.push_back({batch.get(), off + at, std::min(piece, n - at), p + at});
    return batch;
  }
  // libnfs callbacks, the piece as private data.
  static void Wrote(int rc, struct nfs_context* ctx, void*, void* piece) {
    Answered(ctx, piece, rc);
  }
  static void Read(int rc, struct nfs_context* ctx, void* data, void* piece) {
    auto* to = static_cast<Piece*>(piece);
    if (rc > 0) {
      rc = static_cast<int>(std::min(static_cast<size_t>(rc), to->len));
      std::memcpy(to->buf, data, static_cast<size_t>(rc));
    }
    Answered(ctx, piece, rc);
  }

 private:
  static void Answered(struct nfs_context* ctx, void* piece, int rc) {
    auto* to = static_cast<Piece*>(piece);
    AsyncBatch& batch = *to->batch;
    to->rc = rc;
    if (rc < 0 && !batch.failed) {
      batch.failed = to;
      batch.failed_text = ErrorText(ctx);
    }
    --batch.pending;
  }
};

}  // namespace

Result<struct nfs_context*> Connect(const NfsOptions& o, const std::string& client,
                                    std::string* export_path);

namespace {

// A mutex that serves waiters in the order they came. A large write takes
// the connection's mutex once per WRITE; with std::mutex the writer takes it
// again before a woken waiter gets to run, so the other calls (and the v3
// lease renewal) would still wait for the whole object.
class FairMutex {
 public:
  void lock() {
    std::unique_lock<std::mutex> g(m_);
    const uint64_t ticket = next_++;
    turn_.wait(g, [&] { return serving_ == ticket; });
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> g(m_);
      ++serving_;
    }
    turn_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable turn_;
  uint64_t next_ = 0, serving_ = 0;
};

// The folder of an absolute path in the export ("/" for a top-level one).
std::string Dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
}

// Appended to the message of an NFS STALE error, and what Replaced() looks
// for: the only error after which a call is looked up again and retried.
constexpr const char* kStaleHandle = "the file handle went stale (replaced or removed meanwhile)";

// One mounted libnfs context, shared by the backend and everything it hands
// out (writers, readers, locks), every call on it under `mu`, one RPC (or a
// few) at a time, so no call waits for a whole object. Held locks are under
// `locks_mu` (taken after mu when both are needed): v4 locks live on
// connections of their own, so their renewal never waits for `mu`.
class Connection {
 public:
  Connection(NfsOptions o, std::string u) : options(std::move(o)), uri(std::move(u)) {}
  ~Connection() {
    {
      std::lock_guard<std::mutex> g(locks_mu);
      stop = true;
    }
    wake.notify_all();
    if (keepalive.joinable()) keepalive.join();
    ReleaseContext(lease_ctx, lease_failed);
    ReleaseContext(ctx, failed.count(ctx) > 0);
    for (auto* old : retired) ReleaseContext(old, failed.count(old) > 0);
  }

  // NFSv4 servers forget a client whose lease ran out (no call for a lease
  // time: an idle trainer between checkpoints). Whether `s` says so.
  static bool ClientExpired(const Status& s) {
    return s.message().find("NFS4ERR_EXPIRED") != std::string::npos ||
           s.message().find("NFS4ERR_STALE_CLIENTID") != std::string::npos;
  }
  // Whether `s` is an NFS STALE error (see kStaleHandle).
  static bool Stale(const Status& s) {
    return s.code() == Code::kUnavailable && s.message().find(kStaleHandle) != std::string::npos;
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

  // Called at the start of every operation (callers hold mu). A context
  // that saw a transport error or a timeout stays broken (libnfs's
  // autoreconnect is off: it would resend writes a rebooted server lost
  // before their COMMIT), so it is replaced by a fresh mount. Objects opened
  // on it fail (see Broken): they are never continued on the new one.
  // After a timeout, or a reconnect that failed, the server is not tried
  // again until timeout_ms has passed: the calls that clean up after the
  // failed one (removing a temp, checking the fence, releasing the lock)
  // fail at once instead of each waiting out the deadline again.
  Status EnsureConnected() {
    if (!failed.count(ctx)) return OkStatus();
    const auto now = std::chrono::steady_clock::now();
    if (InQuiet())
      return Status(Code::kUnavailable,
                    "not reconnecting to " + uri + " yet: " + quiet_why + " " +
                        std::to_string(
                            std::chrono::duration_cast<std::chrono::milliseconds>(now - quiet_since)
                                .count()) +
                        " ms ago; it is tried again " + std::to_string(options.timeout.count()) +
                        " ms after that");
    Status s = Reconnect();
    // A refused connection (a server restarting) costs nothing to retry.
    if (s.code() == Code::kUnavailable && Classify(-EIO, s.message().c_str()) == Kind::kTimeout)
      StartQuiet(s.message());
    return s.WithContext("reconnecting after a failed connection to " + uri);
  }
  void StartQuiet(const std::string& why) const {
    quiet_since = std::chrono::steady_clock::now();
    quiet_why = why;
    quiet_until = (quiet_since + options.timeout).time_since_epoch().count();
  }
  // Whether the server timed out (or a reconnect failed) within timeout_ms.
  // (Read without mu by a v4 lock's release, hence the atomic.)
  bool InQuiet() const {
    return std::chrono::steady_clock::now().time_since_epoch().count() < quiet_until.load();
  }
  // Whether `on` saw a transport error (callers hold mu).
  bool Broken(struct nfs_context* on) const { return failed.count(on) > 0; }
  Status BrokenError(const std::string& what) const {
    return Status(Code::kUnavailable, what + " on " + uri +
                                          ": the connection it was opened on failed earlier; "
                                          "it is not continued on a new one");
  }

  // A Status for libnfs result `rc` (-errno) of `what`.
  Status Error(int rc, const std::string& what) const { return ErrorOn(ctx, rc, what); }
  enum class Kind { kTimeout, kStale, kTransport, kOther };
  // What libnfs result `rc` (-errno) with error text `detail` means.
  static Kind Classify(int rc, const char* detail) {
    auto says = [&](const char* text) { return detail && std::strstr(detail, text); };
    const int err = rc < 0 ? -rc : EIO;
    // libnfs 4.0 reports an NFSv3 READ or WRITE that timed out as cancelled
    // (EINTR); nothing here cancels calls.
    if (err == ETIMEDOUT || says("timed out") || (err == EINTR && says("cancelled")))
      return Kind::kTimeout;
    // (libnfs 4.0 reports NFS4ERR_STALE as EIO.)
    if (err == ESTALE || (err == EIO && says("NFS4ERR_STALE("))) return Kind::kStale;
    // libnfs reports a broken connection (an RPC that failed in transport,
    // a socket error, a reply it could not decode) as EFAULT, or as EIO
    // from its event loop: the server may or may not have acted.
    if (err == EFAULT ||
        (err == EIO && (says("nfs_service failed") || says("RPC ERROR") || says("Poll failed"))))
      return Kind::kTransport;
    return Kind::kOther;
  }
  // (`text`: libnfs's text for the error, if not the connection's last.)
  Status ErrorOn(struct nfs_context* on, int rc, const std::string& what,
                 const char* text = nullptr) const {
    const char* detail = text ? text : on ? nfs_get_error(on) : nullptr;
    int err = rc < 0 ? -rc : EIO;
    std::string msg = what + " on " + uri;
    if (detail && *detail) msg += " (" + std::string(detail) + ")";
    Status s;
    const Kind kind = Classify(rc, detail);
    if (kind == Kind::kTimeout) {
      s = Status(Code::kUnavailable, msg + ": the server did not answer within " +
                                         std::to_string(options.timeout.count()) + " ms");
      if (on == ctx) StartQuiet(s.message());  // (a lock's own connection: not the data's)
    } else if (kind == Kind::kStale) {
      return Status(Code::kUnavailable, msg + ": " + kStaleHandle);
    } else if (kind == Kind::kTransport) {
      s = Status(Code::kUnavailable, msg + ": the connection to the server failed (" +
                                         std::strerror(err) +
                                         "); the call may or may not have taken effect");
    } else {
      s = ErrnoToStatus(err, msg);
    }
    if (s.code() == Code::kUnavailable && on) failed.insert(on);  // see ReleaseContext
    return s;
  }

  // libnfs 4.0 knows no NFSv4 READ maximum, so max_read starts at kMaxRead
  // there; a server that reads less answers each READ short, with its own
  // maximum. A READ answered `got` bytes short, then one that read more
  // (so not the end of the file), teaches it (callers hold mu): READs then
  // ask for that much (in 4 KiB units), more of them in flight. Whether
  // max_read was lowered. (v3 asks the server: a short answer there is the
  // end of a truncated file.)
  bool LearnReadMax(size_t got) {
    const size_t fits = got & ~size_t{4095};
    if (options.version != 4 || fits == 0 || fits >= max_read) return false;
    max_read = fits;
    reads_in_flight = std::max<size_t>(2, kReadAhead / max_read);
    return true;
  }
  // The bytes a large read reads per hold of mu (callers hold it): 16
  // READs, or more while they are small, to keep reads_in_flight busy.
  size_t ReadTurn() const { return std::max(16 * max_read, 2 * kReadAhead); }

  std::string Path(std::string_view key) const {
    return root + (key.empty() ? "" : "/" + std::string(key));
  }

  // Runs the calls (`call`s: READ or WRITE) of `batch` on file `fh` of
  // `on`, `window` of them in flight at once, `send` queuing one (0, or
  // libnfs's error), driving libnfs's event loop as its synchronous calls
  // do (callers hold mu); then `rest` completes each piece answered short,
  // given the bytes done. Once a call failed (a timeout: no more calls to a
  // hung server) or one could not be queued, the batch waits only for those
  // sent, and fails with the first failure (CallError, `dir` as there),
  // else RESOURCE_EXHAUSTED (libnfs out of memory). If the event loop
  // fails, the calls in flight stay on a connection now marked failed and
  // never serviced again (so they never touch their buffers), and the
  // batch they point to stays with it.
  Status RunBatchLocked(struct nfs_context* on, struct nfsfh* fh, std::unique_ptr<AsyncBatch> batch,
                        size_t window, const char* call, const std::string& what,
                        const std::string& dir, const std::function<int(AsyncBatch::Piece&)>& send,
                        const std::function<Status(const AsyncBatch::Piece&, size_t)>& rest) {
    AsyncBatch& b = *batch;
    Status unqueued;
    while (true) {
      while (unqueued.ok() && !b.failed && b.sent < b.pieces.size() && b.pending < window) {
        if (send(b.pieces[b.sent]) != 0) {
          unqueued =
              Status(Code::kResourceExhausted, uri + ": " + what + ": libnfs could not queue a " +
                                                   call + " (" + ErrorText(on) + ")");
          break;
        }
        ++b.pending;
        ++b.sent;
      }
      if (b.pending == 0) break;
      struct pollfd pfd = {nfs_get_fd(on), static_cast<short>(nfs_which_events(on)), 0};
      int ready = ::poll(&pfd, 1, 100);  // timeouts are found by nfs_service
      if (ready < 0 && errno == EINTR) continue;
      if (nfs_service(on, ready < 0 ? -1 : pfd.revents) < 0) {
        Status s = ErrorOn(on, -EFAULT, what);
        stranded.push_back(std::move(batch));
        return s;
      }
    }
    if (b.failed)
      return CallError(on, fh, b.failed->rc, what, dir, b.failed->len, b.failed_text.c_str());
    CKPTIO_RETURN_IF_ERROR(unqueued);
    for (const auto& piece : b.pieces) {
      const size_t done = static_cast<size_t>(piece.rc);
      if (done < piece.len) CKPTIO_RETURN_IF_ERROR(rest(piece, done));
    }
    return OkStatus();
  }

  // mkdir -p of the folders above `key` (callers hold mu). A folder of the
  // store that is a symbolic link is refused (see RefuseLinkedFolders).
  Status MakeParents(std::string_view key) {
    if (!root.empty()) {  // each component of a root inside the export
      for (size_t pos = root.find('/', 1); pos != std::string::npos; pos = root.find('/', pos + 1))
        CKPTIO_RETURN_IF_ERROR(MakeDir(root.substr(0, pos), /*in_store=*/false));
      CKPTIO_RETURN_IF_ERROR(MakeDir(root, /*in_store=*/false));
    }
    for (size_t slash = key.find('/'); slash != std::string_view::npos;
         slash = key.find('/', slash + 1))
      CKPTIO_RETURN_IF_ERROR(MakeDir(Path(key.substr(0, slash)), /*in_store=*/true));
    return OkStatus();
  }

  Status MakeDir(const std::string& path, bool in_store) {
    int rc = nfs_mkdir(ctx, path.c_str());
    if (rc == 0) return OkStatus();
    Status error = Error(rc, "mkdir " + path);
    struct nfs_stat_64 st;
    if (!in_store) {  // the user's path to the store: links there are theirs
      if (rc == -EEXIST) return OkStatus();
      if (nfs_stat64(ctx, path.c_str(), &st) == 0 && S_ISDIR(st.nfs_mode)) return OkStatus();
      return error;
    }
    if (nfs_lstat64(ctx, path.c_str(), &st) != 0) return error;
    if (S_ISDIR(st.nfs_mode)) return OkStatus();
    if (S_ISLNK(st.nfs_mode)) return LinkRefused(path);
    return Status(Code::kFailedPrecondition,
                  uri + ": " + path + " exists and is not a folder, so objects cannot go in it");
  }

  // libnfs follows symbolic links in every component of a path but the
  // last, so a planted "step-N -> ../elsewhere" would take creates, renames
  // and deletes outside the store. Refuses a key any of whose folders is a
  // link (callers hold mu), as the POSIX backend does (O_NOFOLLOW at each
  // step). Folders are checked outermost first, so no check follows a link.
  Status RefuseLinkedFolders(std::string_view key) {
    for (size_t slash = key.find('/'); slash != std::string_view::npos;
         slash = key.find('/', slash + 1)) {
      const std::string dir = Path(key.substr(0, slash));
      struct nfs_stat_64 st;
      int rc = nfs_lstat64(ctx, dir.c_str(), &st);
      if (rc == -ENOENT) return OkStatus();  // nothing below it either
      if (rc < 0) return Error(rc, "stat " + dir);
      if (S_ISLNK(st.nfs_mode)) return LinkRefused(dir);
      if (!S_ISDIR(st.nfs_mode))
        return Status(Code::kFailedPrecondition, uri + ": " + dir + " is not a folder");
    }
    return OkStatus();
  }
  Status LinkRefused(const std::string& path) const {
    return ErrnoToStatus(ELOOP, uri + ": " + path + " is a symbolic link");
  }

  // Reads up to 512 bytes of a small file (callers hold mu).
  Status ReadSmallFile(const std::string& path, std::string* out) {
    struct nfsfh* fh = nullptr;
    int rc = nfs_open(ctx, path.c_str(), O_RDONLY, &fh);
    if (rc < 0) return Error(rc, "open " + path);
    char buf[512];
    rc = nfs_pread(ctx, fh, 0, sizeof buf, buf);
    Status s = rc < 0 ? CallError(ctx, fh, rc, "read " + path) : OkStatus();
    (void)nfs_close(ctx, fh);
    if (!s.ok()) return s;
    out->assign(buf, static_cast<size_t>(rc));
    return OkStatus();
  }

  // The Status for a failed READ or WRITE (result `rc`) of `fh` on `on`
  // (callers hold mu). libnfs 4.0 fails an NFSv3 READ or WRITE that the
  // server refused with EFAULT, as it does a broken connection, and drops
  // the server's reason (NFS3ERR_NOSPC, _STALE, _IO...). GETATTR on the
  // handle tells them apart: ESTALE for a file replaced (by a rename) since
  // it was opened, an error for a broken connection, an answer when the
  // server refused the call itself. After a refused WRITE of `bytes` bytes,
  // FSSTAT on `dir` tells whether the server is out of space.
  Status CallError(struct nfs_context* on, struct nfsfh* fh, int rc, const std::string& what,
                   const std::string& dir = "", uint64_t bytes = 0, const char* text = nullptr) {
    if (rc != -EFAULT) return ErrorOn(on, rc, what, text);
    struct nfs_stat_64 st;
    int probe = nfs_fstat64(on, fh, &st);
    if (probe == -ESTALE) return ErrorOn(on, probe, what);
    if (probe < 0) return ErrorOn(on, rc, what);  // the connection failed
    const std::string where = what + " on " + uri + ": the server refused it";
    std::string known;
    struct nfs_statvfs_64 fs;
    if (!dir.empty() && nfs_statvfs64(on, dir.c_str(), &fs) == 0) {
      const uint64_t free = fs.f_bavail * fs.f_frsize;
      if (free < bytes)
        return ErrnoToStatus(ENOSPC, where + " (" + std::to_string(free) + " bytes free there)");
      known = std::to_string(free) + " bytes are free there, so it is not space; ";
    }
    return Status(Code::kUnavailable,
                  where + " (" + known +
                      "libnfs does not pass on a server's reason for refusing an NFSv3 READ or "
                      "WRITE: " +
                      (dir.empty() ? "an I/O error on the server is likely"
                                   : "a quota, a read-only export or an I/O error on the server "
                                     "are likely") +
                      "; see the server's log)");
  }

  // v3: a connection of its own for renewing lease files, so that a long
  // COMMIT or a call waiting out timeout_ms on the data connection never
  // delays a renewal past the lease. Made (again, once it failed) here;
  // callers do not hold locks_mu.
  Status RefreshLeaseConnection() {
    {
      std::lock_guard<std::mutex> l(locks_mu);
      if (lease_ctx && !lease_failed) return OkStatus();
    }
    std::string path = export_path;
    CKPTIO_ASSIGN_OR_RETURN(
        struct nfs_context * fresh,
        Connect(options, options.client_name + ".lease" + std::to_string(counter++), &path));
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

  // v4 locks each use a connection of their own: libnfs 4.0 loses track
  // of the open-owner sequence after a LOCK (the next OPEN on that context
  // fails with NFS4ERR_BAD_SEQID). Renewals READ on it without locks_mu;
  // `mu` (never held across an RPC) says whether one is under way, so a
  // release waits for it briefly, then leaves the unlock to the renewal
  // (see NfsLock), never waiting on a hung server for it.
  struct V4Lock {
    struct nfs_context* ctx = nullptr;
    struct nfsfh* fh = nullptr;  // the open file the lock is on
    std::mutex mu;
    std::condition_variable idle;  // renewing went false
    bool renewing = false;         // a READ is under way
    bool released = false;         // released while renewing: the renewal unlocks
    bool ended = false;            // unlocked, or being unlocked: no more READs
    bool broken = false;           // a READ timed out or its connection failed
    bool unrenewed = false;        // the last renewal READ failed, whatever the error
  };
  // Held locks, by key; renewed by `keepalive` while any is held.
  struct Held {
    std::shared_ptr<V4Lock> v4;
    std::string path;
    uint64_t serial = 0;           // tells a lock from a later one of the same key
    std::string record;            // v3: our lease record, as the lease file holds it
    std::string pending;           // v3: a renewal whose WRITE failed (it may have landed)
    std::string in_flight;         // v3: the record a renewal is writing now
    bool lost = false;             // v3: the lease file no longer holds our record
    int64_t missing_since_ms = 0;  // v3: when a renewal first found no lease file
    bool Ours(const std::string& seen) const {
      return seen == record || (!pending.empty() && seen == pending) ||
             (!in_flight.empty() && seen == in_flight);
    }
  };
  // Starts the renewal thread, before the first lock is taken: a lock that
  // nobody renews would end with its lease while its holder still writes
  // (callers hold locks_mu).
  Status StartKeepalive() {
    if (keepalive.joinable()) return OkStatus();
    try {
      keepalive = std::thread([this] { KeepaliveLoop(); });
    } catch (const std::exception& e) {  // std::system_error (EAGAIN), std::bad_alloc
      return Status(Code::kResourceExhausted,
                    uri + ": no lock taken: cannot start the thread that renews locks (" +
                        e.what() + "); raise the process or memory limits");
    }
    return OkStatus();
  }
  // Unlocks, closes and disconnects a v4 lock (once, by whoever set ended
  // or saw released). A server that just timed out on the data connection
  // is given one second per call (not timeout_ms), as is the renewal thread
  // (`by_renewal`: the other locks' renewals wait for it); one whose READ
  // failed is not asked. Unanswered, the lock ends with this client's lease
  // (a holder that is alive but was slow unlocks in time).
  void EndV4Lock(V4Lock& l, bool by_renewal) const {
    bool ok = false;
    if (!l.broken) {
      if (by_renewal || InQuiet()) nfs_set_timeout(l.ctx, 1000);
      struct nfs4_flock fl {};
      fl.l_type = F_UNLCK;
      fl.l_whence = SEEK_SET;
      fl.l_len = kLockBytes;
      ok = nfs_fcntl(l.ctx, l.fh, NFS4_F_SETLK, &fl) == 0;
      ok = ok && nfs_close(l.ctx, l.fh) == 0;
    }
    ReleaseContext(l.ctx, !ok);
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
  size_t writes_in_flight = 1;  // WRITEs of max_write bytes sent at once
  size_t max_read = kMaxRead;
  size_t reads_in_flight = 2;  // READs of max_read bytes in flight at once
  FairMutex mu;                // ctx, retired, failed, stranded, reconnects; every call on them
  std::mutex locks_mu;         // held, stop, lease_ctx, lease_failed
  std::map<std::string, Held> held;
  struct nfs_context* lease_ctx = nullptr;  // v3: see RefreshLeaseConnection
  bool lease_failed = false;                // lease_ctx saw a transport error
  std::atomic<uint64_t> counter{0};
  std::vector<struct nfs_context*> retired;      // replaced by Reconnect
  mutable std::set<struct nfs_context*> failed;  // transport errors seen on these
  // What requests left in flight on a failed context point to (see
  // RunBatchLocked): kept until the contexts are released, since a failed
  // context is never serviced again and its callbacks never run.
  std::vector<std::shared_ptr<void>> stranded;
  // No reconnect before quiet_until (steady_clock ticks; see EnsureConnected):
  // since quiet_since, for quiet_why (those two under mu).
  mutable std::chrono::steady_clock::time_point quiet_since{};
  mutable std::string quiet_why;
  mutable std::atomic<std::chrono::steady_clock::rep> quiet_until{0};
  int reconnects = 0;

 private:
  void KeepaliveLoop() {
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

  // Any READ with the open stateid renews the client's lease (run without
  // locks_mu). A lock released during the READ is unlocked here after it.
  void RenewV4(V4Lock& l) {
    {
      std::lock_guard<std::mutex> s(l.mu);
      if (l.ended) return;
      l.renewing = true;
    }
    char byte;
    const int rc = nfs_pread(l.ctx, l.fh, 0, 1, &byte);
    const Kind kind = rc < 0 ? Classify(rc, nfs_get_error(l.ctx)) : Kind::kOther;
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
  void RenewLeases(std::unique_lock<std::mutex>& g) {
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
      const Kind kind = Classify(rc, nfs_get_error(on));
      if (kind == Kind::kTimeout || kind == Kind::kTransport) broken = true;
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
        else if (now - h.missing_since_ms > options.lease.count())
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

  bool stop = false;
  std::condition_variable wake;
  std::thread keepalive;
};

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
    int rc = nfs_fsync(ctx_, fh_);  // COMMIT: the bytes are on stable storage
    if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "fsync (COMMIT) " + tmp_));
    // The temp's file id, to recognise it under the target's name if the
    // reply to our RENAME or LINK is lost.
    struct nfs_stat_64 st;
    rc = nfs_fstat64(ctx_, fh_, &st);
    if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "fstat " + tmp_));
    ino_ = st.nfs_ino;
    rc = nfs_close(ctx_, fh_);
    fh_ = nullptr;
    if (rc < 0) return Abandon(c_->ErrorOn(ctx_, rc, "close " + tmp_));
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
        if (!TargetIsOurs()) {
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
  bool RenameHappened() {
    struct nfs_stat_64 st;
    if (nfs_lstat64(ctx_, tmp_.c_str(), &st) != -ENOENT) return false;
    return TargetIsOurs();
  }
  // Whether the target is the temp's file (after a failed RENAME or LINK).
  bool TargetIsOurs() {
    struct nfs_stat_64 st;
    return nfs_lstat64(ctx_, target_.c_str(), &st) == 0 && S_ISREG(st.nfs_mode) &&
           st.nfs_ino == ino_;
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
    if (!tmp_.empty() && !broken) (void)nfs_unlink(ctx_, tmp_.c_str());
    tmp_.clear();
  }

  std::shared_ptr<Connection> c_;
  struct nfs_context* ctx_;  // the connection the temp was created on
  struct nfsfh* fh_;
  std::string tmp_, key_, target_;
  WriteMode mode_;
  std::string buffer_;
  uint64_t offset_ = 0;
  uint64_t ino_ = 0;  // the temp's file id, once committed
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

class NfsLock : public BackendLock {
 public:
  NfsLock(std::shared_ptr<Connection> c, std::string key)
      : c_(std::move(c)), key_(std::move(key)) {}
  ~NfsLock() override {
    if (c_->options.version == 4) {
      std::shared_ptr<Connection::V4Lock> l;
      {
        std::lock_guard<std::mutex> g(c_->locks_mu);
        auto it = c_->held.find(key_);
        if (it == c_->held.end()) return;
        l = std::move(it->second.v4);
        c_->held.erase(it);
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
      c_->EndV4Lock(*l, /*by_renewal=*/false);
      return;
    }
    // v3: lease files are on the main connection.
    std::lock_guard<FairMutex> m(c_->mu);
    std::lock_guard<std::mutex> g(c_->locks_mu);
    auto it = c_->held.find(key_);
    if (it == c_->held.end()) return;
    Connection::Held& h = it->second;
    if (!h.lost) {  // remove the lease file if it is still ours
      std::string now;
      if (c_->EnsureConnected().ok() && c_->ReadSmallFile(h.path, &now).ok() && h.Ours(now))
        (void)nfs_unlink(c_->ctx, h.path.c_str());
    }
    c_->held.erase(it);
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

  // Whether `s` says a file was replaced (by a rename) while we looked it
  // up or read it: an NFS STALE status, and nothing else (a broken
  // connection is Unavailable, and not retried here).
  static bool Replaced(const Status& s) { return Connection::Stale(s); }

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
        std::lock_guard<FairMutex> g(c_->mu);
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
    std::lock_guard<FairMutex> g(c_->mu);
    CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
    CKPTIO_RETURN_IF_ERROR(c_->MakeParents(key));
    struct nfsfh* fh = nullptr;
    int rc = nfs_open2(c_->ctx, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644, &fh);
    if (rc < 0) return c_->Error(rc, "create " + tmp);
    return std::unique_ptr<ObjectWriter>(
        std::make_unique<NfsWriter>(c_, fh, tmp, std::string(key), mode));
  }

  Result<std::unique_ptr<ObjectReader>> OpenObjectOnce(std::string_view key) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    const std::string path = c_->Path(key);
    std::lock_guard<FairMutex> g(c_->mu);
    CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
    CKPTIO_RETURN_IF_ERROR(c_->RefuseLinkedFolders(key));
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
    std::lock_guard<FairMutex> g(c_->mu);
    CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
    CKPTIO_RETURN_IF_ERROR(c_->RefuseLinkedFolders(key));
    CKPTIO_ASSIGN_OR_RETURN(uint64_t size, RegularFileSize(c_->Path(key)));
    return ObjectInfo{size};
  }

  Result<std::vector<std::string>> ListOnce(std::string_view prefix) {
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

  Status DeleteOnce(std::string_view key) {
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
    std::unique_lock<FairMutex> g(c_->mu);
    CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
    {
      // Ours, unless lost: a v3 lease another client broke, or a v4 lock
      // whose last renewal failed (the server says whether it still is).
      std::lock_guard<std::mutex> l(c_->locks_mu);
      auto it = c_->held.find(std::string(key));
      if (it != c_->held.end() && !it->second.lost && !Broken(it->second)) return true;
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

  // Whether a failed LOCK or LOCKT (error text `detail`) says another
  // client holds the lock: NFS4ERR_DENIED, which libnfs 4.0 names in the
  // error text it sets on every failure (its errno for it, EIO or ERANGE,
  // says nothing). EACCES (NFS4ERR_ACCESS) and EAGAIN (NFS4ERR_EXPIRED,
  // NFS4ERR_FHEXPIRED...) are errors, not "locked".
  static bool LockDenied(const char* detail) {
    return detail && std::strstr(detail, "NFS4ERR_DENIED");
  }

  Result<std::unique_ptr<BackendLock>> TryLockOnce(std::string_view key, LockMode mode) {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
    const std::string path = c_->Path(key);
    if (c_->options.version == 3 && mode == LockMode::kShared)
      return Status(Code::kUnimplemented,
                    c_->uri +
                        ": NFSv3 through libnfs has no shared locks; use version=4, "
                        "or the manifest wait mode");
    std::lock_guard<FairMutex> g(c_->mu);
    CKPTIO_RETURN_IF_ERROR(c_->EnsureConnected());
    {
      std::lock_guard<std::mutex> l(c_->locks_mu);
      if (c_->held.count(std::string(key)))
        return Status(Code::kFailedPrecondition, path + " is already locked by this process");
      CKPTIO_RETURN_IF_ERROR(c_->StartKeepalive());
    }
    CKPTIO_RETURN_IF_ERROR(c_->MakeParents(key));
    Connection::Held h;
    h.path = path;
    h.serial = c_->counter++;
    if (c_->options.version == 3) {
      CKPTIO_RETURN_IF_ERROR(c_->RefreshLeaseConnection());
      CKPTIO_RETURN_IF_ERROR(TakeLease(path, &h.record));
    } else {
      h.v4 = std::make_shared<Connection::V4Lock>();
      Connection::V4Lock& v = *h.v4;
      std::string export_path = c_->export_path;
      CKPTIO_ASSIGN_OR_RETURN(
          v.ctx,
          Connect(c_->options, c_->options.client_name + ".lock" + std::to_string(c_->counter++),
                  &export_path));
      auto close_all = [&] {
        const bool ok = !v.fh || nfs_close(v.ctx, v.fh) == 0;
        ReleaseContext(v.ctx, !ok || c_->failed.count(v.ctx) > 0);
      };
      // (libnfs 4.0 treats O_CREAT on v4 as an exclusive create: open, else
      // create, else open what a racing creator made.)
      int rc = nfs_open(v.ctx, path.c_str(), O_RDWR, &v.fh);
      if (rc == -ENOENT)
        rc = nfs_open2(v.ctx, path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0644, &v.fh);
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
    std::lock_guard<std::mutex> l(c_->locks_mu);
    c_->held.emplace(std::string(key), std::move(h));
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

  static bool LeaseExpired(const std::string& record,
                           std::chrono::milliseconds grace = std::chrono::milliseconds(0)) {
    size_t at = record.find("expires_ms=");
    if (at == std::string::npos) return true;  // torn or foreign: treat as stale
    return NowMs() > std::atoll(record.c_str() + at + 11) + grace.count();
  }
  static bool Broken(const Connection::Held& h) {
    if (!h.v4) return false;
    std::lock_guard<std::mutex> s(h.v4->mu);
    return h.v4->broken || h.v4->unrenewed;
  }

  // v3: create the lease file with our record, breaking an expired one
  // (callers hold mu).
  Status TakeLease(const std::string& path, std::string* record) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      const std::string fresh = c_->LeaseRecord();
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

  // Makes `path` a lease file holding `record`, atomically: the record goes
  // into a temp of our own (written, committed, closed), which is then
  // LINKed to `path`, which fails if `path` exists. So no lease file is ever
  // seen empty or torn (one that was would read as expired, and be broken
  // while its holder was still writing it). False if `path` exists.
  Result<bool> CreateLease(const std::string& path, const std::string& record) {
    const size_t slash = path.rfind('/');
    const std::string tmp = path.substr(0, slash + 1) + TempObjectName(path.substr(slash + 1));
    struct nfsfh* fh = nullptr;
    int rc = nfs_open2(c_->ctx, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644, &fh);
    if (rc < 0) return c_->Error(rc, "create lease " + tmp);
    rc = nfs_pwrite(c_->ctx, fh, 0, record.size(), record.data());
    Status error =
        rc < 0 ? c_->CallError(c_->ctx, fh, rc, "write lease " + tmp, Dir(tmp), record.size())
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
    return fail(
        Status(Code::kInvalidArgument, "libnfs refused " + settings + ": " + ErrorText(ctx)));
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
      return fail(Status(Code::kUnavailable, "cannot mount " + uri + ": " + ErrorText(ctx)));
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
    c->writes_in_flight = kV4WritesInFlight;
  } else {
    uint64_t wmax = nfs_get_writemax(c->ctx);
    if (wmax > 0) c->max_write = std::min<uint64_t>(wmax, kWriteBuffer);
  }
  // (libnfs 4.0 knows no v4 maximum: see LearnReadMax.)
  if (uint64_t rmax = nfs_get_readmax(c->ctx); rmax > 0)
    c->max_read = std::min<uint64_t>(rmax, kMaxRead);
  c->reads_in_flight = std::max<size_t>(2, kReadAhead / c->max_read);
  return std::unique_ptr<StorageBackend>(std::make_unique<NfsBackend>(std::move(c)));
}

Status RegisterNfsBackend(BackendRegistry& registry) {
  return registry.Register("nfs", [](const Uri& uri) -> Result<std::unique_ptr<StorageBackend>> {
    CKPTIO_ASSIGN_OR_RETURN(NfsOptions o, ParseNfsUri(uri));
    return NewNfsBackend(std::move(o));
  });
}

}  // namespace ckptio
