// The nfs:// backend's connection: mount, errors, reconnection, the event
// loop of READs and WRITEs in flight, and the store's folders (see
// nfs_connection.h).
#include "nfs_connection.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ckptio/layout.h"

namespace ckptio::nfs {
namespace {

// The causes (Status::cause) the backend retries on, in a category of its
// own: set where libnfs's result is classified (ErrorOn), read by Stale()
// and ClientExpired(), never found again in message text.
enum class Condition { kStaleHandle = 1, kClientExpired = 2 };

class ConditionCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "ckptio.nfs"; }
  std::string message(int c) const override {
    switch (static_cast<Condition>(c)) {
      case Condition::kStaleHandle:
        return "the file handle went stale (replaced or removed meanwhile)";
      case Condition::kClientExpired:
        return "the NFSv4 server no longer knows this client (its lease expired)";
    }
    return "unknown NFS condition";
  }
};

std::error_code MakeCause(Condition c) {
  static const ConditionCategory category;
  return {static_cast<int>(c), category};
}

// The cause of a failed mount: std::errc::timed_out for a timeout (after
// which EnsureConnected leaves the server alone for a while), else the errno.
std::error_code MountCause(int rc, struct nfs_context* ctx) {
  if (Connection::Classify(rc, nfs_get_error(ctx)) == Connection::Kind::kTimeout)
    return std::make_error_code(std::errc::timed_out);
  return {rc < 0 ? -rc : EIO, std::generic_category()};
}

}  // namespace

void ReleaseContext(struct nfs_context* ctx, bool failed) {
  if (!ctx) return;
  if (!failed) {
    nfs_destroy_context(ctx);
    return;
  }
  int fd = nfs_get_fd(ctx);
  if (fd >= 0) ::close(fd);
}

std::string ErrorText(struct nfs_context* ctx) {
  const char* e = nfs_get_error(ctx);
  return e ? e : "libnfs gave no reason";
}

std::string Dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
}

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
      return fail(Status(Code::kUnavailable, "cannot mount " + uri + ": " + ErrorText(ctx))
                      .WithCause(MountCause(rc, ctx)));
    return ctx;
  }
  // Mount the longest prefix of the path that the server exports.
  std::string path = o.path;
  std::string first_error;
  std::error_code first_cause;
  while (true) {
    int rc = nfs_mount(ctx, o.server.c_str(), path.c_str());
    if (rc == 0) break;
    if (first_error.empty()) {
      const char* e = nfs_get_error(ctx);
      first_error = e ? e : "error " + std::to_string(rc);
      first_cause = MountCause(rc, ctx);
    }
    if (rc == -ETIMEDOUT || rc == -ECONNREFUSED || path == "/")
      return fail(Status(Code::kUnavailable,
                         "cannot mount " + uri + ": " + first_error +
                             " (is the server running and exporting it? for a local test "
                             "server see tools/nfs-server.sh)")
                      .WithCause(first_cause));
    size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  *export_path = path;
  return ctx;
}

// ---------------------------------------------------------------------------
// AsyncBatch

std::unique_ptr<AsyncBatch> AsyncBatch::Split(uint64_t off, char* p, size_t n, size_t piece) {
  auto batch = std::make_unique<AsyncBatch>();
  batch->pieces.reserve((n + piece - 1) / piece);  // stable addresses
  for (size_t at = 0; at < n; at += piece)
    batch->pieces.push_back({batch.get(), off + at, std::min(piece, n - at), p + at});
  return batch;
}

void AsyncBatch::Wrote(int rc, struct nfs_context* ctx, void*, void* piece) {
  Answered(ctx, piece, rc);
}

void AsyncBatch::Read(int rc, struct nfs_context* ctx, void* data, void* piece) {
  auto* to = static_cast<Piece*>(piece);
  if (rc > 0) {
    rc = static_cast<int>(std::min(static_cast<size_t>(rc), to->len));
    std::memcpy(to->buf, data, static_cast<size_t>(rc));
  }
  Answered(ctx, piece, rc);
}

void AsyncBatch::Answered(struct nfs_context* ctx, void* piece, int rc) {
  auto* to = static_cast<Piece*>(piece);
  AsyncBatch& batch = *to->batch;
  to->rc = rc;
  if (rc < 0 && !batch.failed) {
    batch.failed = to;
    batch.failed_text = ErrorText(ctx);
  }
  --batch.pending;
}

// ---------------------------------------------------------------------------
// Connection

Connection::~Connection() {
  ReleaseContext(ctx, failed.count(ctx) > 0);
  for (auto* old : retired) ReleaseContext(old, failed.count(old) > 0);
}

bool Connection::ClientExpired(const Status& s) {
  return s.cause() == MakeCause(Condition::kClientExpired);
}

bool Connection::Stale(const Status& s) { return s.cause() == MakeCause(Condition::kStaleHandle); }

Status Connection::Reconnect() {
  std::string path = export_path;
  CKPTIO_ASSIGN_OR_RETURN(
      struct nfs_context * fresh,
      Connect(options, options.client_name + ".r" + std::to_string(++reconnects), &path));
  retired.push_back(ctx);
  ctx = fresh;
  return OkStatus();
}

Status Connection::EnsureConnected() {
  if (!failed.count(ctx)) return OkStatus();
  const auto now = std::chrono::steady_clock::now();
  if (InQuiet())
    return Status(
        Code::kUnavailable,
        "not reconnecting to " + uri + " yet: " + quiet_why + " " +
            std::to_string(
                std::chrono::duration_cast<std::chrono::milliseconds>(now - quiet_since).count()) +
            " ms ago; it is tried again " + std::to_string(options.timeout.count()) +
            " ms after that");
  Status s = Reconnect();
  // A refused connection (a server restarting) costs nothing to retry.
  if (s.cause() == std::errc::timed_out) StartQuiet(s.message());
  return s.WithContext("reconnecting after a failed connection to " + uri);
}

void Connection::StartQuiet(const std::string& why) const {
  quiet_since = std::chrono::steady_clock::now();
  quiet_why = why;
  quiet_until = (quiet_since + options.timeout).time_since_epoch().count();
}

Status Connection::BrokenError(const std::string& what) const {
  return Status(Code::kUnavailable, what + " on " + uri +
                                        ": the connection it was opened on failed earlier; "
                                        "it is not continued on a new one");
}

Connection::Kind Connection::Classify(int rc, const char* detail) {
  auto says = [&](const char* text) { return detail && std::strstr(detail, text); };
  const int err = rc < 0 ? -rc : EIO;
  // libnfs 4.0 reports an NFSv3 READ or WRITE that timed out as cancelled
  // (EINTR); nothing here cancels calls.
  if (err == ETIMEDOUT || says("timed out") || (err == EINTR && says("cancelled")))
    return Kind::kTimeout;
  // libnfs gives an NFSv4 status only in its error text (and as EIO).
  if (says("NFS4ERR_EXPIRED") || says("NFS4ERR_STALE_CLIENTID")) return Kind::kClientExpired;
  if (err == ESTALE || (err == EIO && says("NFS4ERR_STALE("))) return Kind::kStale;
  // libnfs reports a broken connection (an RPC that failed in transport,
  // a socket error, a reply it could not decode) as EFAULT, or as EIO
  // from its event loop: the server may or may not have acted.
  if (err == EFAULT ||
      (err == EIO && (says("nfs_service failed") || says("RPC ERROR") || says("Poll failed"))))
    return Kind::kTransport;
  return Kind::kOther;
}

Status Connection::ErrorOn(struct nfs_context* on, int rc, const std::string& what,
                           const char* text) const {
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
    const std::error_code cause = MakeCause(Condition::kStaleHandle);
    return Status(Code::kUnavailable, msg + ": " + cause.message()).WithCause(cause);
  } else if (kind == Kind::kClientExpired) {
    s = ErrnoToStatus(err, msg).WithCause(MakeCause(Condition::kClientExpired));
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

bool Connection::LearnReadMax(size_t got) {
  const size_t fits = got & ~size_t{4095};
  if (options.version != 4 || fits == 0 || fits >= max_read) return false;
  max_read = fits;
  reads_in_flight = std::max<size_t>(2, kReadAhead / max_read);
  return true;
}

Status Connection::RunBatchLocked(
    struct nfs_context* on, struct nfsfh* fh, std::unique_ptr<AsyncBatch> batch, size_t window,
    const char* call, const std::string& what, const std::string& dir,
    const std::function<int(AsyncBatch::Piece&)>& send,
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

Status Connection::MakeParents(std::string_view key) {
  if (!root.empty()) {  // each component of a root inside the export
    for (size_t pos = root.find('/', 1); pos != std::string::npos; pos = root.find('/', pos + 1))
      CKPTIO_RETURN_IF_ERROR(MakeDir(root.substr(0, pos), /*in_store=*/false));
    CKPTIO_RETURN_IF_ERROR(MakeDir(root, /*in_store=*/false));
    if (mount_root) MountRoot();
  }
  for (size_t slash = key.find('/'); slash != std::string_view::npos;
       slash = key.find('/', slash + 1))
    CKPTIO_RETURN_IF_ERROR(MakeDir(Path(key.substr(0, slash)), /*in_store=*/true));
  return OkStatus();
}

void Connection::MountRoot() {
  mount_root = false;
  std::string path = options.path;
  auto fresh = Connect(options, options.client_name + ".store", &path);
  if (!fresh.ok()) return;  // a server that mounts only its exports: walks stay longer
  retired.push_back(ctx);
  ctx = *fresh;
  export_path = path;
  root.clear();
  recently_made.clear();  // (paths from the old mount)
}

Status Connection::MakeDir(const std::string& path, bool in_store) {
  struct nfs_stat_64 st;
  // A folder this connection made lately (a step's, or the writer's
  // objects folder in it, as its next object goes in): looked at first,
  // which is all a MKDIR refused as EEXIST leads to; made again if it has
  // gone.
  const bool recent = in_store && std::find(recently_made.begin(), recently_made.end(), path) !=
                                      recently_made.end();
  if (recent) {
    const int look = nfs_lstat64(ctx, path.c_str(), &st);
    if (look == 0) return InStoreFolder(path, st);
    if (look != -ENOENT) return Error(look, "stat " + path);
  }
  int rc = nfs_mkdir(ctx, path.c_str());
  if (rc == 0) {
    if (in_store && !recent) {
      recently_made.insert(recently_made.begin(), path);
      if (recently_made.size() > 2) recently_made.pop_back();
    }
    return OkStatus();
  }
  Status error = Error(rc, "mkdir " + path);
  // A server that did not answer (or a connection that broke) is not asked
  // whether the folder is there: the save cannot go on before the quiet
  // ends, and the look would wait out the deadline again.
  if (Broken(ctx)) return error;
  if (!in_store) {  // the user's path to the store: links there are theirs
    if (rc == -EEXIST) return OkStatus();
    if (nfs_stat64(ctx, path.c_str(), &st) == 0 && S_ISDIR(st.nfs_mode)) return OkStatus();
    return error;
  }
  if (nfs_lstat64(ctx, path.c_str(), &st) != 0) return error;
  return InStoreFolder(path, st);
}

void Connection::RemoveEmptyFolders(std::string_view key) {
  std::string k(key);
  for (size_t s = k.rfind('/'); s != std::string::npos; s = k.rfind('/')) {
    k.resize(s);
    if (nfs_rmdir(ctx, Path(k).c_str()) < 0) break;
  }
}

Status Connection::InStoreFolder(const std::string& path, const struct nfs_stat_64& st) const {
  if (S_ISDIR(st.nfs_mode)) return OkStatus();
  if (S_ISLNK(st.nfs_mode)) return LinkRefused(path);
  return Status(Code::kFailedPrecondition,
                uri + ": " + path + " exists and is not a folder, so objects cannot go in it");
}

Status Connection::RefuseLinkedFolders(std::string_view key) {
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

Status Connection::LinkRefused(const std::string& path) const {
  return ErrnoToStatus(ELOOP, uri + ": " + path + " is a symbolic link");
}

Status Connection::ReadSmallFile(const std::string& path, std::string* out) {
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

Status Connection::CallError(struct nfs_context* on, struct nfsfh* fh, int rc,
                             const std::string& what, const std::string& dir, uint64_t bytes,
                             const char* text) {
  if (rc != -EFAULT) return ErrorOn(on, rc, what, text);
  struct nfs_stat_64 st;
  int probe = nfs_fstat64(on, fh, &st);
  if (probe == -ESTALE) return ErrorOn(on, probe, what);
  // The connection failed, or the server did not answer the probe (its
  // error text, the connection's last, makes that a timeout).
  if (probe < 0) return ErrorOn(on, rc, what);
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

}  // namespace ckptio::nfs
