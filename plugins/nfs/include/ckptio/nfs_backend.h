// The nfs:// backend: speaks NFSv3 or NFSv4 from user space through libnfs
// (4.0), so no kernel NFS client or mount is needed.
//
//   nfs://SERVER/PATH?version=3|4&nfsport=N&mountport=N&timeout_ms=N&lease_ms=N
//                    &client=NAME
//
// PATH is the export followed by the store's folder inside it; the backend
// mounts the longest prefix of PATH the server exports (for v4, paths are in
// the server's pseudo file system, e.g. nfs://host/export/run42?version=4),
// and over v3 the store's folder itself once it exists (libnfs looks up
// every folder of a v3 path, one round trip each, on every call).
// version defaults to 3; nfsport and mountport skip the portmapper;
// timeout_ms (default 30000, whole seconds) bounds every call, so a hung
// server fails operations by then instead of hanging training; client names
// this connection to an NFSv4 server (default: host.pid.counter, unique per
// backend, as two v4 connections of one process must differ); lease_ms
// (default 15000) is how long a v3 lock outlives its holder.
//
// Commit recipe for every object (ObjectWriter::Commit), in order:
//   1. create ".ckptio-tmp.<name>.<host>.<pid>.<n>.<nonce>" in the target's
//      folder with OPEN/CREATE (nfs_open2 O_CREAT|O_EXCL);
//   2. WRITE, UNSTABLE, in pieces the server accepts (v4: 3840 bytes, the
//      largest libnfs 4.0 sends intact, 64 of them in flight at once);
//   3. COMMIT: an error fails the commit, never retried (v4: nfs_fsync;
//      v3: libnfs's CLOSE of a written file sends it, and returns its
//      result);
//   4. CLOSE, checked;
//   5. RENAME tmp -> name (kReplace), or LINK tmp -> name + REMOVE tmp
//      (kCreateExclusive). A reply lost after the server acted looks like a
//      failure, so a failed RENAME or LINK is re-checked against the temp's
//      file id (read before CLOSE for a RENAME, which takes the temp's name
//      away; from the temp's name after a failed LINK, which leaves it): it
//      happened only if the target is that file and (RENAME) the temp's
//      name is gone (NFS3ERR_NOENT); any other answer, an error looking
//      included, fails the commit;
//   6. nothing more: NFS servers make CREATE, RENAME, LINK and REMOVE
//      durable before replying (RFC 1813 §3.3, RFC 7530 §18), which is the
//      directory fsync of the POSIX recipe.
//
// Locks: NFSv4 byte-range locks (LOCK/LOCKT, exclusive or shared, over the
// first byte), each on a connection of its own, kept alive by a thread that
// renews the client's lease while any lock is held; a dead client's locks go
// when its lease expires. IsLocked: a lock held here (whose last renewal
// went through), else LOCKT's NFS4ERR_DENIED (other failures are errors).
// NFSv3 has no lock call in libnfs: exclusive locks are lease files (the
// record is written to a temp and LINKed into place, so a lease is never
// seen empty; renewed every lease/3, on a connection of its own, only while
// the file still holds our record, else the lock is lost and left to its
// new holder; a file missing for longer than the lease is lost too;
// breakable by others once expired, and only when what was moved aside is
// positively the expired record); no shared locks. IsLocked: a lease held
// here, or one not expired by lease/3 (this host's clock) on two reads up to 1 s apart.
// Both kinds are leases (LocksAreLeases): a paused holder may write on after
// its lock was broken, so the core gives each writer an objects folder.
//
// Errors: a broken connection (libnfs: EFAULT, or EIO from its event loop)
// and a timeout are Unavailable; only an NFS STALE error (a name replaced
// while we used it) makes a call look the name up again and retry. The
// next call after a broken connection mounts afresh (libnfs's own
// reconnect stays off); writers and readers opened on the broken one fail.
// After a timeout, or a fresh mount that timed out, no mount is tried for
// timeout_ms: the calls that clean up after a failed save fail at once, so
// a server that hangs mid-save fails it after one timeout_ms (lock renewals
// run without holding up a release: a v4 lock's release waits at most
// 250 ms for its own renewal, none after a timeout, then leaves the unlock
// to it). libnfs
// 4.0 reports an NFSv3 READ or WRITE the server refused as EFAULT too; a
// GETATTR on the file tells that apart from a broken connection, and a
// refused WRITE on a server without space is ResourceExhausted.
// Symbolic links: libnfs follows them in every folder of a path, so a
// folder of the store that is a link (step-N -> elsewhere) is refused
// (FailedPrecondition, naming it) before creating, renaming, linking,
// removing, opening or stat-ing anything in it, as the POSIX backend does.
//
// Thread safety: one connection per backend, shared by every call, writer
// and reader, taken one RPC (or a few) at a time in arrival order: a large
// Append goes a WRITE at a time (v4: a batch of 64) and a large ReadAt 16
// READs of up to 1 MiB, 2 in flight, per turn (4 MiB of smaller ones where
// a v4 server reads less), so other calls never wait for a whole object. v3 lease renewals, and
// each v4 lock, have a connection of their own.
#ifndef CKPTIO_NFS_BACKEND_H_
#define CKPTIO_NFS_BACKEND_H_

#include <chrono>
#include <memory>
#include <string>

#include "ckptio/backend.h"
#include "ckptio/export.h"

namespace ckptio {

struct CKPTIO_EXPORT NfsOptions {
  std::string server;  // host name or address
  std::string path;    // absolute: export + folder inside it
  int version = 3;     // 3 or 4
  int nfs_port = 0;    // 0: ask the portmapper (v3) / 2049 (v4)
  int mount_port = 0;  // v3 only; 0: ask the portmapper
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  std::string client_name;  // v4; empty: host.pid.counter
  // v3 lease locks: how long a lock outlives its holder's last renewal.
  std::chrono::milliseconds lease = std::chrono::seconds(15);
};

// Parses nfs:// URIs (see above) into options.
CKPTIO_EXPORT Result<NfsOptions> ParseNfsUri(const Uri& uri);

// Connects and mounts. Unavailable (naming the server) if it cannot.
CKPTIO_EXPORT Result<std::unique_ptr<StorageBackend>> NewNfsBackend(NfsOptions options);

// Registers "nfs" in `registry`.
CKPTIO_EXPORT Status RegisterNfsBackend(BackendRegistry& registry);

}  // namespace ckptio

#endif  // CKPTIO_NFS_BACKEND_H_
