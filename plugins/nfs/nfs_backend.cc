// The nfs:// backend: assembles the StorageBackend from the connection
// (nfs_connection.h), the objects (nfs_objects.h) and the locks
// (nfs_locks.h), retrying a call after a stale handle or an expired NFSv4
// client; parses nfs:// URIs and registers the scheme. The commit recipe and
// lock scheme are described in ckptio/nfs_backend.h.
#include "ckptio/nfs_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckptio/layout.h"
#include "nfs_connection.h"
#include "nfs_limits.h"
#include "nfs_locks.h"
#include "nfs_objects.h"

namespace ckptio {
namespace {

using nfs::Connection;
using nfs::FairMutex;
using nfs_limits::kV4MaxWrite;
using nfs_limits::kV4WritesInFlight;

std::atomic<uint64_t> g_connections{0};

class NfsBackend : public StorageBackend {
 public:
  explicit NfsBackend(std::shared_ptr<Connection> c)
      : c_(std::move(c)), objects_(c_), locks_(std::make_shared<nfs::LockTable>(c_)) {}

  std::string Uri() const override { return c_->uri; }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    return Retrying([&] { return objects_.NewObject(key, mode); });
  }
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    return Retrying([&] { return objects_.OpenObject(key); });
  }
  Result<ObjectInfo> Stat(std::string_view key) override {
    return Retrying([&] { return objects_.Stat(key); });
  }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    return Retrying([&] { return objects_.List(prefix); });
  }
  Status Delete(std::string_view key) override {
    return Retrying([&] { return objects_.Delete(key); });
  }
  // Both kinds are leases: a v3 lease file is broken once its holder stops
  // renewing it, and a v4 server drops the locks of a client whose lease
  // ran out (a paused process, a cut network), which may then reconnect and
  // write on. So each writer's objects go in a folder of its own.
  bool LocksAreLeases() const override { return true; }
  Result<bool> IsLocked(std::string_view key) override {
    return Retrying([&] { return locks_->IsLocked(key); });
  }
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    return Retrying([&] { return locks_->TryLock(key, mode); });
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

  const std::shared_ptr<Connection> c_;
  nfs::Objects objects_;
  // Shared with the locks it hands out, which may outlive the backend.
  const std::shared_ptr<nfs::LockTable> locks_;
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

Result<std::unique_ptr<StorageBackend>> NewNfsBackend(NfsOptions o) {
  if (o.version != 3 && o.version != 4)
    return Status(Code::kInvalidArgument, "NFS version must be 3 or 4");
  if (o.client_name.empty())
    o.client_name = KeySafeHostName() + "." + std::to_string(::getpid()) + "." +
                    std::to_string(g_connections.fetch_add(1)) + "." + RandomHex().substr(0, 8);
  std::string uri = "nfs://" + o.server + o.path + "?version=" + std::to_string(o.version);
  auto c = std::make_shared<Connection>(o, uri);
  CKPTIO_ASSIGN_OR_RETURN(c->ctx, nfs::Connect(o, o.client_name, &c->export_path));
  c->root = o.path.substr(c->export_path == "/" ? 0 : c->export_path.size());
  if (c->root == "/") c->root.clear();
  c->mount_root = o.version == 3 && !c->root.empty();
  if (o.version == 4) {
    c->max_write = kV4MaxWrite;
    c->writes_in_flight = kV4WritesInFlight;
  } else {
    uint64_t wmax = nfs_get_writemax(c->ctx);
    if (wmax > 0) c->max_write = std::min<uint64_t>(wmax, nfs::kWriteBuffer);
  }
  // (libnfs 4.0 knows no v4 maximum: see LearnReadMax.)
  if (uint64_t rmax = nfs_get_readmax(c->ctx); rmax > 0)
    c->max_read = std::min<uint64_t>(rmax, nfs::kMaxRead);
  c->reads_in_flight = std::max<size_t>(2, nfs::kReadAhead / c->max_read);
  return std::unique_ptr<StorageBackend>(std::make_unique<NfsBackend>(std::move(c)));
}

Status RegisterNfsBackend(BackendRegistry& registry) {
  return registry.Register("nfs", [](const Uri& uri) -> Result<std::unique_ptr<StorageBackend>> {
    CKPTIO_ASSIGN_OR_RETURN(NfsOptions o, ParseNfsUri(uri));
    return NewNfsBackend(std::move(o));
  });
}

}  // namespace ckptio
