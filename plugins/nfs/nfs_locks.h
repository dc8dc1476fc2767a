// The nfs:// backend's locks (internal): NFSv4 byte-range locks, each on a
// connection of its own, and NFSv3 lease files, renewed on a connection of
// their own; the thread that renews both while any lock is held; and
// IsLocked. The scheme is described in ckptio/nfs_backend.h.
#ifndef CKPTIO_PLUGINS_NFS_NFS_LOCKS_H_
#define CKPTIO_PLUGINS_NFS_NFS_LOCKS_H_

#include <nfsc/libnfs.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "ckptio/backend.h"
#include "nfs_connection.h"

namespace ckptio::nfs {

// The locks held through one backend, and their renewal. Made with
// make_shared: each lock it hands out keeps it (and the connection) alive.
// Held locks are under `locks_mu` (taken after the connection's mu when both
// are needed): v4 locks live on connections of their own, so their renewal
// never waits for mu.
class LockTable : public std::enable_shared_from_this<LockTable> {
 public:
  explicit LockTable(std::shared_ptr<Connection> c) : c_(std::move(c)) {}
  // Stops the renewal thread and releases the v3 lease connection.
  ~LockTable();

  // One attempt each (the backend retries after a stale handle or an
  // expired v4 client); they take the connection's mu themselves.
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode);
  Result<bool> IsLocked(std::string_view key);

  // Releases the lock on `key` (the BackendLock's destructor).
  void Release(const std::string& key);

 private:
  // v4 locks each use a connection of their own: libnfs 4.0 loses track
  // of the open-owner sequence after a LOCK (the next OPEN on that context
  // fails with NFS4ERR_BAD_SEQID). Renewals READ on it without locks_mu;
  // `mu` (never held across an RPC) says whether one is under way, so a
  // release waits for it briefly, then leaves the unlock to the renewal
  // (see Release), never waiting on a hung server for it.
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

  // v3: a connection of its own for renewing lease files, so that a long
  // COMMIT or a call waiting out timeout_ms on the data connection never
  // delays a renewal past the lease. Made (again, once it failed) here;
  // callers do not hold locks_mu.
  Status RefreshLeaseConnection();
  // Starts the renewal thread, before the first lock is taken: a lock that
  // nobody renews would end with its lease while its holder still writes
  // (callers hold locks_mu).
  Status StartKeepalive();
  // Unlocks, closes and disconnects a v4 lock (once, by whoever set ended
  // or saw released). A server that just timed out on the data connection
  // is given one second per call (not timeout_ms), as is the renewal thread
  // (`by_renewal`: the other locks' renewals wait for it); one whose READ
  // failed is not asked. Unanswered, the lock ends with this client's lease
  // (a holder that is alive but was slow unlocks in time).
  void EndV4Lock(V4Lock& l, bool by_renewal) const;
  std::string LeaseRecord() const;

  void KeepaliveLoop();
  // Any READ with the open stateid renews the client's lease (run without
  // locks_mu). A lock released during the READ is unlocked here after it.
  void RenewV4(V4Lock& l);
  // Rewrites each v3 lease file that still holds our record (see the .cc).
  void RenewLeases(std::unique_lock<std::mutex>& g);

  static bool Broken(const Held& h);
  // v3: create the lease file with our record, breaking an expired one
  // (callers hold mu).
  Status TakeLease(const std::string& path, std::string* record);
  // Makes `path` a lease file holding `record`, atomically: the record goes
  // into a temp of our own (written, committed, closed), which is then
  // LINKed to `path`, which fails if `path` exists. So no lease file is ever
  // seen empty or torn (one that was would read as expired, and be broken
  // while its holder was still writing it). False if `path` exists.
  Result<bool> CreateLease(const std::string& path, const std::string& record);

  const std::shared_ptr<Connection> c_;
  std::mutex locks_mu;  // held, stop, lease_ctx, lease_failed
  std::map<std::string, Held> held;
  struct nfs_context* lease_ctx = nullptr;  // v3: see RefreshLeaseConnection
  bool lease_failed = false;                // lease_ctx saw a transport error
  std::atomic<uint64_t> counter{0};
  bool stop = false;
  std::condition_variable wake;
  std::thread keepalive;
};

}  // namespace ckptio::nfs

#endif  // CKPTIO_PLUGINS_NFS_NFS_LOCKS_H_
