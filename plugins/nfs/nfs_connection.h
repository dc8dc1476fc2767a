// The nfs:// backend's connection to the server (internal): one mounted
// libnfs context shared by every call, writer and reader, taken one RPC (or
// a few) at a time in arrival order; how a libnfs error becomes a Status
// (timeout, STALE, broken connection); the fresh mount after a broken
// connection and the quiet period after a timeout; the event loop that
// keeps READs and WRITEs in flight; and the folders of the store (creating
// them, refusing symbolic links among them). The contract as a whole is in
// ckptio/nfs_backend.h; locks are in nfs_locks.h, objects in nfs_objects.h.
#ifndef CKPTIO_PLUGINS_NFS_NFS_CONNECTION_H_
#define CKPTIO_PLUGINS_NFS_NFS_CONNECTION_H_

#include <nfsc/libnfs.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/nfs_backend.h"

namespace ckptio::nfs {

inline constexpr size_t kWriteBuffer = 1 << 20;
inline constexpr size_t kMaxRead = 1 << 20;  // the most one READ asks for
// Bytes of READs in flight at once (at least 2 READs). Against the loopback
// server, 2 READs of 1 MiB read 1.6 x as fast as one at a time, 4 only
// 1.3 x (PERFORMANCE.md).
inline constexpr size_t kReadAhead = 2 << 20;

// Frees a libnfs context. libnfs 4.0 crashes destroying a context that still
// has requests in flight (left by a timeout or a server that died), so such
// a context only has its socket closed: its memory is left behind.
void ReleaseContext(struct nfs_context* ctx, bool failed);

// libnfs's text for the last error on `ctx` (it may have none).
std::string ErrorText(struct nfs_context* ctx);

// The folder of an absolute path in the export ("/" for a top-level one).
std::string Dir(const std::string& path);

// A new libnfs context with `o`'s settings, mounted on `export_path`
// (empty: the longest prefix of o.path that mounts, stored back there).
// `client` names it to an NFSv4 server.
Result<struct nfs_context*> Connect(const NfsOptions& o, const std::string& client,
                                    std::string* export_path);

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
  static std::unique_ptr<AsyncBatch> Split(uint64_t off, char* p, size_t n, size_t piece);
  // libnfs callbacks, the piece as private data.
  static void Wrote(int rc, struct nfs_context* ctx, void*, void* piece);
  static void Read(int rc, struct nfs_context* ctx, void* data, void* piece);

 private:
  static void Answered(struct nfs_context* ctx, void* piece, int rc);
};

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

// One mounted libnfs context, shared by the backend and everything it hands
// out (writers, readers, locks), every call on it under `mu`, one RPC (or a
// few) at a time, so no call waits for a whole object. (v4 locks and v3
// lease renewals have connections of their own: see nfs_locks.h.)
class Connection {
 public:
  Connection(NfsOptions o, std::string u) : options(std::move(o)), uri(std::move(u)) {}
  ~Connection();

  // NFSv4 servers forget a client whose lease ran out (no call for a lease
  // time: an idle trainer between checkpoints). Whether that caused `s`
  // (its Status::cause, set by ErrorOn).
  static bool ClientExpired(const Status& s);
  // Whether `s` is an NFS STALE error (its cause, set by ErrorOn): the only
  // error after which a call is looked up again and retried.
  static bool Stale(const Status& s);
  // A new connection under a new client identity (callers hold mu). Objects
  // opened on the old one keep it (and fail if the server forgot it).
  Status Reconnect();

  // Called at the start of every operation (callers hold mu). A context
  // that saw a transport error or a timeout stays broken (libnfs's
  // autoreconnect is off: it would resend writes a rebooted server lost
  // before their COMMIT), so it is replaced by a fresh mount. Objects opened
  // on it fail (see Broken): they are never continued on the new one.
  // After a timeout, or a reconnect that failed, the server is not tried
  // again until timeout_ms has passed: the calls that clean up after the
  // failed one (removing a temp, checking the fence, releasing the lock)
  // fail at once instead of each waiting out the deadline again.
  Status EnsureConnected();
  void StartQuiet(const std::string& why) const;
  // Whether the server timed out (or a reconnect failed) within timeout_ms.
  // (Read without mu by a v4 lock's release, hence the atomic.)
  bool InQuiet() const {
    return std::chrono::steady_clock::now().time_since_epoch().count() < quiet_until.load();
  }
  // Whether `on` saw a transport error (callers hold mu).
  bool Broken(struct nfs_context* on) const { return failed.count(on) > 0; }
  Status BrokenError(const std::string& what) const;

  // A Status for libnfs result `rc` (-errno) of `what`.
  Status Error(int rc, const std::string& what) const { return ErrorOn(ctx, rc, what); }
  enum class Kind { kTimeout, kStale, kClientExpired, kTransport, kOther };
  // What libnfs result `rc` (-errno) with error text `detail` means.
  static Kind Classify(int rc, const char* detail);
  // (`text`: libnfs's text for the error, if not the connection's last.)
  Status ErrorOn(struct nfs_context* on, int rc, const std::string& what,
                 const char* text = nullptr) const;

  // libnfs 4.0 knows no NFSv4 READ maximum, so max_read starts at kMaxRead
  // there; a server that reads less answers each READ short, with its own
  // maximum. A READ answered `got` bytes short, then one that read more
  // (so not the end of the file), teaches it (callers hold mu): READs then
  // ask for that much (in 4 KiB units), more of them in flight. Whether
  // max_read was lowered. (v3 asks the server: a short answer there is the
  // end of a truncated file.)
  bool LearnReadMax(size_t got);
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
                        const std::function<Status(const AsyncBatch::Piece&, size_t)>& rest);

  // mkdir -p of the folders above `key` (callers hold mu). A folder of the
  // store that is a symbolic link is refused (see RefuseLinkedFolders).
  // The first time the store's folder is there (see mount_root), it is
  // mounted, and root and every path built from it change: callers build
  // their paths after this.
  Status MakeParents(std::string_view key);
  // Mounts the store's folder itself in place of its export (callers hold
  // mu), once: libnfs walks every v3 path from the mounted folder, one
  // LOOKUP (a round trip) per folder, so a store mounted one folder up
  // pays one more for every call, about a quarter of a save's round trips.
  // (A store that already exists is mounted directly by Connect.) If the
  // server will not mount it, walks stay as they were. The old context is
  // retired, not destroyed: nothing is open on it, as nothing in a store
  // that was not there can have been opened.
  void MountRoot();
  Status MakeDir(const std::string& path, bool in_store);
  // Removes the folders above `key` that are empty, deepest first, up to
  // the first that is not (callers hold mu): a deleted or discarded
  // object's step leaves no empty folders behind.
  void RemoveEmptyFolders(std::string_view key);
  // OK if `st` (of store folder `path`) is a folder; a link is refused.
  Status InStoreFolder(const std::string& path, const struct nfs_stat_64& st) const;

  // libnfs follows symbolic links in every component of a path but the
  // last, so a planted "step-N -> ../elsewhere" would take creates, renames
  // and deletes outside the store. Refuses a key any of whose folders is a
  // link (callers hold mu), as the POSIX backend does (O_NOFOLLOW at each
  // step). Folders are checked outermost first, so no check follows a link.
  Status RefuseLinkedFolders(std::string_view key);
  // Whether objects are opened with O_NOFOLLOW (callers hold mu), which
  // refuses a link in any component of the path in the open's own walk, in
  // place of a look at each folder and at the object first (two round
  // trips each). Over v3 (libnfs 4.0's v4 open is not known to honour it),
  // with the store's folder mounted (a link in the user's path to the
  // store is theirs to have, and O_NOFOLLOW would refuse it too).
  bool NoFollowOpens() const { return options.version == 3 && root.empty(); }
  Status LinkRefused(const std::string& path) const;

  // Reads up to 512 bytes of a small file (callers hold mu).
  Status ReadSmallFile(const std::string& path, std::string* out);

  // The Status for a failed READ or WRITE (result `rc`) of `fh` on `on`
  // (callers hold mu). libnfs 4.0 fails an NFSv3 READ or WRITE that the
  // server refused with EFAULT, as it does a broken connection, and drops
  // the server's reason (NFS3ERR_NOSPC, _STALE, _IO...). GETATTR on the
  // handle tells them apart: ESTALE for a file replaced (by a rename) since
  // it was opened, an error for a broken connection, an answer when the
  // server refused the call itself. After a refused WRITE of `bytes` bytes,
  // FSSTAT on `dir` tells whether the server is out of space. A GETATTR
  // that times out reports the server as not answering (see InQuiet).
  Status CallError(struct nfs_context* on, struct nfsfh* fh, int rc, const std::string& what,
                   const std::string& dir = "", uint64_t bytes = 0, const char* text = nullptr);

  const NfsOptions options;
  const std::string uri;
  struct nfs_context* ctx = nullptr;
  std::string export_path;  // what is mounted
  std::string root;         // the store's folder, relative to the mount ("" or "/a/b")
  // v3, and the store's folder did not exist when it was mounted: mount it
  // once it does (see MountRoot).
  bool mount_root = false;
  // The store folders MakeDir made last, newest first (see there): a step's
  // and the writer's objects folder inside it.
  std::vector<std::string> recently_made;
  size_t max_write = kWriteBuffer;
  size_t writes_in_flight = 1;  // WRITEs of max_write bytes sent at once
  size_t max_read = kMaxRead;
  size_t reads_in_flight = 2;  // READs of max_read bytes in flight at once
  FairMutex mu;                // ctx, retired, failed, stranded, reconnects; every call on them
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
};

}  // namespace ckptio::nfs

#endif  // CKPTIO_PLUGINS_NFS_NFS_CONNECTION_H_
