// The backends built into this ckptio (library ckptio::backends).
#ifndef CKPTIO_BACKENDS_H_
#define CKPTIO_BACKENDS_H_

#include <memory>
#include <string_view>

#include "ckptio/backend.h"
#include "ckptio/export.h"
#include "ckptio/store.h"

namespace ckptio {

// A registry holding every built-in backend ("file", "nfs" where ckptio
// was built with CKPTIO_WITH_NFS and "s3" with CKPTIO_WITH_S3, the
// defaults; the test-only
// "faulty+" schemes are not among them: see plugins/faulty). Each plugin is
// registered by an explicit call here, so none can be dropped by the
// linker. Built once, on first use; thread-safe.
CKPTIO_EXPORT const BackendRegistry& BuiltinBackends();

// Store::Open(uri, BuiltinBackends()).
CKPTIO_EXPORT Result<std::unique_ptr<Store>> OpenStore(std::string_view uri);

}  // namespace ckptio

#endif  // CKPTIO_BACKENDS_H_
