#include "object_io.h"

#include <unistd.h>

#include <chrono>

namespace ckptio {

Result<std::string> ReadSmall(StorageBackend& backend, std::string_view key, size_t max_bytes,
                              Code over_limit) {
  CKPTIO_ASSIGN_OR_RETURN(auto reader, backend.OpenObject(key));
  if (reader->Size() > max_bytes)
    return Status(over_limit, backend.Uri() + "/" + std::string(key) + " is " +
                                  std::to_string(reader->Size()) + " bytes, over its " +
                                  std::to_string(max_bytes) + "-byte limit");
  std::string bytes(reader->Size(), '\0');
  CKPTIO_RETURN_IF_ERROR(reader->ReadAt(0, bytes.data(), bytes.size()));
  return bytes;
}

Status WriteSmall(StorageBackend& backend, std::string_view key, std::string_view bytes,
                  WriteMode mode) {
  CKPTIO_ASSIGN_OR_RETURN(auto writer, backend.NewObject(key, mode));
  CKPTIO_RETURN_IF_ERROR(writer->Append(bytes.data(), bytes.size()));
  return writer->Commit();
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

}  // namespace ckptio
