#include <cstdlib>
#include <iostream>

#include "ckptio/backends.h"
#if CKPTIO_WITH_NFS
#include "ckptio/nfs_backend.h"
#endif
#include "ckptio/posix_backend.h"
#if CKPTIO_WITH_S3
#include "ckptio/s3_backend.h"
#endif

namespace ckptio {

const BackendRegistry& BuiltinBackends() {
  static const BackendRegistry* registry = [] {
    auto* r = new BackendRegistry();
    Status s = RegisterPosixBackend(*r);
#if CKPTIO_WITH_NFS  // CMake option CKPTIO_WITH_NFS
    if (s.ok()) s = RegisterNfsBackend(*r);
#endif
#if CKPTIO_WITH_S3  // CMake option CKPTIO_WITH_S3
    if (s.ok()) s = RegisterS3Backend(*r);
#endif
    if (!s.ok()) {  // a programming error: two plugins claim one scheme
      std::cerr << "ckptio: " << s << "\n";
      std::abort();
    }
    return r;
  }();
  return *registry;
}

Result<std::unique_ptr<Store>> OpenStore(std::string_view uri) {
  return Store::Open(uri, BuiltinBackends());
}

}  // namespace ckptio
