// The nfs:// backend's objects (internal): the writer (the commit recipe of
// ckptio/nfs_backend.h: temp, WRITEs, COMMIT, CLOSE, RENAME or LINK), the
// reader (READs in flight; small objects read whole as they open), and
// stat, list and delete, all on the shared Connection.
#ifndef CKPTIO_PLUGINS_NFS_NFS_OBJECTS_H_
#define CKPTIO_PLUGINS_NFS_NFS_OBJECTS_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/backend.h"
#include "nfs_connection.h"

namespace ckptio::nfs {

// The objects of one backend's store. Each call is one attempt (the backend
// retries after a stale handle or an expired v4 client) and takes the
// connection's mu itself.
class Objects {
 public:
  explicit Objects(std::shared_ptr<Connection> c) : c_(std::move(c)) {}

  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode);
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key);
  Result<ObjectInfo> Stat(std::string_view key);
  Result<std::vector<std::string>> List(std::string_view prefix);
  Status Delete(std::string_view key);

 private:
  // The size of the regular file at `path` (callers hold mu).
  Result<uint64_t> RegularFileSize(const std::string& path);
  // OK if `st` (of `path`) is a regular file: a folder is NOT_FOUND (no
  // object), a symbolic link ELOOP, anything else FAILED_PRECONDITION.
  Status RegularFile(const std::string& path, const struct nfs_stat_64& st) const;
  Status Walk(const std::string& dir_key, std::vector<std::string>* out);

  const std::shared_ptr<Connection> c_;
};

}  // namespace ckptio::nfs

#endif  // CKPTIO_PLUGINS_NFS_NFS_OBJECTS_H_
