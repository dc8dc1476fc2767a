// The s3:// backend's objects (internal): writers (one PUT, or a multipart
// upload with parts in parallel), readers (ranged GETs), Stat, List and
// Delete, all on keys below the store's prefix. See ckptio/s3_backend.h.
#ifndef CKPTIO_PLUGINS_S3_S3_OBJECTS_H_
#define CKPTIO_PLUGINS_S3_S3_OBJECTS_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/backend.h"
#include "s3_http.h"

namespace ckptio::s3 {

// The bucket key of a store key: "PREFIX/" + key.
std::string FullKey(const S3Options& options, std::string_view key);
// The same for a key from the core: checked (ValidateKey), and
// InvalidArgument when the prefix makes it longer than S3 takes (1024 bytes).
Result<std::string> BucketKey(const S3Options& options, std::string_view key);

using Deadline = std::chrono::steady_clock::time_point;

// kCreateExclusive as one PUT with If-None-Match: * (AlreadyExists when the
// key exists). Every 412 (a resend of ours, or libcurl's, may have caused
// it) is resolved by reading the object back: it is ours if it holds
// exactly `bytes`; Unavailable if it cannot be read.
Status PutExclusive(Client& client, const std::string& full_key, std::string_view bytes,
                    Deadline deadline);

// GET of a whole small object (NotFound when absent); `response` gets the
// answer's headers (Date, Last-Modified) when not null.
Result<std::string> GetSmall(Client& client, const std::string& full_key, Response* response,
                             Deadline deadline);

class Objects {
 public:
  explicit Objects(std::shared_ptr<Client> client) : client_(std::move(client)) {}

  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode);
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key);
  Result<ObjectInfo> Stat(std::string_view key);
  Result<std::vector<std::string>> List(std::string_view prefix);
  Status Delete(std::string_view key);
  // Aborts every multipart upload under the store's prefix.
  Result<size_t> AbortUploads();

 private:
  std::shared_ptr<Client> client_;
};

}  // namespace ckptio::s3

#endif  // CKPTIO_PLUGINS_S3_S3_OBJECTS_H_
