// The s3:// backend's writer lock (internal): a lease object, created with
// If-None-Match, renewed by a thread while held, stale by the server's clock
// after lease_ms without renewal. See ckptio/s3_backend.h.
#ifndef CKPTIO_PLUGINS_S3_S3_LOCKS_H_
#define CKPTIO_PLUGINS_S3_S3_LOCKS_H_

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ckptio/backend.h"
#include "s3_http.h"

namespace ckptio::s3 {

// Made with make_shared: each lock keeps its table (and client) alive.
class LeaseTable : public std::enable_shared_from_this<LeaseTable> {
 public:
  explicit LeaseTable(std::shared_ptr<Client> client) : client_(std::move(client)) {}
  ~LeaseTable();  // stops the renewal thread

  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode);
  Result<bool> IsLocked(std::string_view key);
  void Release(const std::string& full_key);

 private:
  using Deadline = std::chrono::steady_clock::time_point;
  struct Seen {
    bool exists = false;
    std::string record;
    bool stale = false;
    int64_t age_ms = 0;  // since its last renewal, by the server's clock
  };
  struct Held {
    std::string record;                             // what our lease object holds
    std::chrono::steady_clock::time_point renewed;  // last written (this host's clock)
  };
  Status Supported(std::string_view key, LockMode mode) const;
  Result<Seen> Look(const std::string& full_key, Deadline deadline);
  void Renew();  // the thread's loop
  void RenewOne(const std::string& full_key, std::chrono::milliseconds within);

  std::shared_ptr<Client> client_;
  // Held by a renewal of a lease and by its release, so that neither's
  // requests land between the other's: taken before mu_, never inside it.
  std::mutex io_mu_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::map<std::string, Held> held_;  // by full key
  std::thread renewer_;
};

}  // namespace ckptio::s3

#endif  // CKPTIO_PLUGINS_S3_S3_LOCKS_H_
