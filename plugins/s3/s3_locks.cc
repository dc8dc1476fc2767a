// The s3:// backend's writer lock: lease objects (see s3_locks.h).
#include "s3_locks.h"

#include <unistd.h>

#include <chrono>
#include <ctime>

#include "ckptio/layout.h"
#include "s3_objects.h"

namespace ckptio::s3 {
namespace {

// HTTP dates have whole seconds: a lease is stale only when older than
// lease_ms by more than that.
constexpr int64_t kClockResolutionMs = 1000;

// Seconds since the epoch of an RFC 7231 date ("Sat, 05 Dec 2026 16:45:26 GMT"); -1 if not one.
int64_t HttpDate(const std::string& text) {
  std::tm tm{};
  const char* end = ::strptime(text.c_str(), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  if (end == nullptr || *end != '\0') return -1;
  return static_cast<int64_t>(::timegm(&tm));
}

class S3Lock : public BackendLock {
 public:
  S3Lock(std::shared_ptr<LeaseTable> t, std::string key) : t_(std::move(t)), key_(std::move(key)) {}
  ~S3Lock() override { t_->Release(key_); }

 private:
  std::shared_ptr<LeaseTable> t_;
  std::string key_;
};

}  // namespace

LeaseTable::~LeaseTable() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (renewer_.joinable()) renewer_.join();
}

Status LeaseTable::Supported(std::string_view key, LockMode mode) const {
  if (key != kLockKey)
    return Status(Code::kUnimplemented,
                  client_->Where() + ": an object store has no file locks, and \"" +
                      std::string(key) +
                      "\" would need one (the file-lock wait mode): use wait mode manifest "
                      "(polling) or store (the trainer's c10d store) over s3://");
  if (mode != LockMode::kExclusive)
    return Status(Code::kUnimplemented, client_->Where() + ": no shared locks over s3://");
  return OkStatus();
}

Result<LeaseTable::Seen> LeaseTable::Look(const std::string& full_key) {
  Response response;
  auto body = GetSmall(*client_, full_key, &response);
  Seen seen;
  if (!body.ok()) {
    if (body.status().code() == Code::kNotFound) return seen;
    return body.status();
  }
  seen.exists = true;
  seen.record = std::move(*body);
  const int64_t now = HttpDate(response.Header("date"));
  const int64_t renewed = HttpDate(response.Header("last-modified"));
  // Without both dates the age is unknown: not stale (never break a lease
  // on a guess).
  if (now >= 0 && renewed >= 0) {
    seen.age_ms = (now - renewed) * 1000;
    seen.stale = seen.age_ms > client_->options().lease.count() + kClockResolutionMs;
  }
  return seen;
}

Result<std::unique_ptr<BackendLock>> LeaseTable::TryLock(std::string_view key, LockMode mode) {
  CKPTIO_RETURN_IF_ERROR(Supported(key, mode));
  const std::string full = FullKey(client_->options(), key);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (held_.count(full))
      return Status(Code::kFailedPrecondition,
                    client_->Where() + "/" + std::string(key) + " is already held by this process");
  }
  const std::string record = "ckptio-lease owner=" + KeySafeHostName() + "." +
                             std::to_string(::getpid()) + "." + RandomHex() +
                             " lease_ms=" + std::to_string(client_->options().lease.count()) + "\n";
  // Two tries: the second after a stale lease was removed (or vanished).
  Status created = OkStatus();
  for (int attempt = 0; attempt < 2; ++attempt) {
    created = PutExclusive(*client_, full, record);
    if (created.ok() || created.code() != Code::kAlreadyExists) break;
    CKPTIO_ASSIGN_OR_RETURN(Seen seen, Look(full));
    if (seen.exists && !seen.stale)
      return Status(Code::kFailedPrecondition,
                    client_->Where() + "/" + std::string(key) + " is held (" +
                        seen.record.substr(0, seen.record.find('\n')) + ", renewed " +
                        std::to_string(seen.age_ms / 1000) + " s ago by the server's clock)");
    if (seen.exists) {
      Request r;
      r.method = "DELETE";
      r.key = full;
      CKPTIO_ASSIGN_OR_RETURN(Response got, client_->Send(r));
      if (got.status != 204 && got.status != 200 && got.status != 404)
        return client_->Failure(r, got);
    }
  }
  if (!created.ok()) {
    if (created.code() == Code::kAlreadyExists)
      return Status(Code::kFailedPrecondition,
                    client_->Where() + "/" + std::string(key) + " was taken by another writer");
    return created;
  }
  std::lock_guard<std::mutex> g(mu_);
  held_[full] = record;
  if (!renewer_.joinable()) {
    try {
      renewer_ = std::thread([this] { Renew(); });
    } catch (const std::system_error& e) {
      held_.erase(full);
      Request r;
      r.method = "DELETE";
      r.key = full;
      (void)client_->Send(r);
      return Status(Code::kResourceExhausted,
                    client_->Where() + ": no thread to renew the writer's lease: " + e.what());
    }
  }
  return std::unique_ptr<BackendLock>(new S3Lock(shared_from_this(), full));
}

Result<bool> LeaseTable::IsLocked(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(Supported(key, LockMode::kExclusive));
  const std::string full = FullKey(client_->options(), key);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (held_.count(full)) return true;
  }
  CKPTIO_ASSIGN_OR_RETURN(Seen seen, Look(full));
  return seen.exists && !seen.stale;
}

void LeaseTable::Release(const std::string& full_key) {
  std::string record;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = held_.find(full_key);
    if (it == held_.end()) return;  // lost to another writer: theirs now
    record = std::move(it->second);
    held_.erase(it);
  }
  auto seen = Look(full_key);
  if (!seen.ok() || !seen->exists || seen->record != record) return;
  Request r;
  r.method = "DELETE";
  r.key = full_key;
  (void)client_->Send(r);  // failing that, the lease goes stale by itself
}

void LeaseTable::Renew() {
  std::unique_lock<std::mutex> g(mu_);
  while (!stop_) {
    wake_.wait_for(g, client_->options().lease / 3);
    if (stop_) break;
    auto held = held_;
    g.unlock();
    for (const auto& [key, record] : held) {
      // Renew only what still holds our record: a lease broken while we
      // could not renew it belongs to its new holder (our writer is then
      // fenced by the core).
      auto seen = Look(key);
      bool lost = seen.ok() && seen->exists && seen->record != record;
      if (seen.ok() && !seen->exists) {
        // Gone (deleted by hand?): ours again only if nobody took it meanwhile.
        lost = PutExclusive(*client_, key, record).code() == Code::kAlreadyExists;
      } else if (!lost && seen.ok()) {
        Request r;
        r.method = "PUT";
        r.key = key;
        r.body = record;
        (void)client_->Send(r);  // a failure is retried at the next turn
      }
      if (lost) {
        std::lock_guard<std::mutex> l(mu_);
        auto it = held_.find(key);
        if (it != held_.end() && it->second == record) held_.erase(it);
      }
    }
    g.lock();
  }
}

}  // namespace ckptio::s3
