// Small-object helpers shared by the core (internal).
#ifndef CKPTIO_SRC_OBJECT_IO_H_
#define CKPTIO_SRC_OBJECT_IO_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "ckptio/backend.h"
#include "ckptio/layout.h"

namespace ckptio {

// Reads a whole object, refusing one over max_bytes with `over_limit`
// (DataLoss by default: a checkpoint file that large is damaged).
Result<std::string> ReadSmall(StorageBackend& backend, std::string_view key, size_t max_bytes,
                              Code over_limit = Code::kDataLoss);
// Writes and commits a whole object.
Status WriteSmall(StorageBackend& backend, std::string_view key, std::string_view bytes,
                  WriteMode mode);

int64_t NowUnixMs();
std::string HostName();


}  // namespace ckptio

#endif  // CKPTIO_SRC_OBJECT_IO_H_
