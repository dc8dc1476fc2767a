#include "object_io.h"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <random>

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

std::string RandomHex() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

std::string KeySafeHostName() {
  std::string h = HostName();
  for (char& c : h)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') c = '_';
  return h.substr(0, 32);
}

std::string TempObjectName(std::string_view base) {
  static std::atomic<uint64_t> counter{0};
  static const std::string host = KeySafeHostName();
  return std::string(kTempMarker) + std::string(base.substr(0, 100)) + "." + host + "." +
         std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1)) + "." +
         RandomHex();
}

}  // namespace ckptio
