// The s3:// backend's writer lock: lease objects (see s3_locks.h).
#include "s3_locks.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <thread>

#include "ckptio/layout.h"
#include "ckptio/log.h"
#include "s3_objects.h"

namespace ckptio::s3 {
namespace {

// HTTP dates have whole seconds: a lease is stale only when older than
// lease_ms by more than that.
constexpr int64_t kClockResolutionMs = 1000;
// How long a writer that broke a stale lease waits before checking that the
// new lease is still its own.
constexpr std::chrono::milliseconds kTakeoverSettle{500};

// Seconds since the epoch of an RFC 7231 date ("Sat, 05 Dec 2026 16:45:26
// GMT"); -1 if not one. Parsed by hand: strptime's month names follow the
// locale, and under another LC_TIME no lease would ever look stale.
int64_t HttpDate(const std::string& text) {
  static const char* const kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                        "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  char month[4] = {};
  int day = 0, year = 0, hour = 0, minute = 0, second = 0, used = 0;
  if (std::sscanf(text.c_str(), "%*3s, %2d %3s %4d %2d:%2d:%2d GMT%n", &day, month, &year, &hour,
                  &minute, &second, &used) != 6 ||
      static_cast<size_t>(used) != text.size())
    return -1;
  int mon = -1;
  for (int i = 0; i < 12; ++i)
    if (std::strcmp(month, kMonths[i]) == 0) mon = i;
  if (mon < 0 || day < 1 || day > 31 || hour > 23 || minute > 59 || second > 60) return -1;
  std::tm tm{};
  tm.tm_year = year - 1900;
  tm.tm_mon = mon;
  tm.tm_mday = day;
  tm.tm_hour = hour;
  tm.tm_min = minute;
  tm.tm_sec = second;
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

Result<LeaseTable::Seen> LeaseTable::Look(const std::string& full_key, Deadline deadline) {
  Response response;
  auto body = GetSmall(*client_, full_key, &response, deadline);
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
  const Deadline deadline = client_->Deadline();
  auto taken = [&] {
    return Status(Code::kFailedPrecondition,
                  client_->Where() + "/" + std::string(key) + " was taken by another writer");
  };
  // Two tries: the second after a stale lease was removed (or vanished).
  Status created = OkStatus();
  bool broke_stale = false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    created = PutExclusive(*client_, full, record, deadline);
    if (created.ok() || created.code() != Code::kAlreadyExists) break;
    CKPTIO_ASSIGN_OR_RETURN(Seen seen, Look(full, deadline));
    if (seen.exists && !seen.stale)
      return Status(Code::kFailedPrecondition,
                    client_->Where() + "/" + std::string(key) + " is held (" +
                        seen.record.substr(0, seen.record.find('\n')) + ", renewed " +
                        std::to_string(seen.age_ms / 1000) + " s ago by the server's clock)");
    if (seen.exists) {
      Request r;
      r.method = "DELETE";
      r.key = full;
      CKPTIO_ASSIGN_OR_RETURN(Response got, client_->Send(r, deadline));
      if (got.status != 204 && got.status != 200 && got.status != 404)
        return client_->Failure(r, got);
      broke_stale = true;
    }
  }
  if (!created.ok()) return created.code() == Code::kAlreadyExists ? taken() : created;
  if (broke_stale) {
    // Another writer that found the same stale lease may have deleted ours
    // right after we made it, and made its own: S3 has no conditional
    // DELETE to prevent that (and RGW 16 refuses If-Match on PUT). Look
    // again a moment later and back off unless the lease is still ours.
    // (Correctness does not rest on this: the fence in .writer stops all
    // but the last writer to claim the store.)
    std::this_thread::sleep_for(kTakeoverSettle);
    CKPTIO_ASSIGN_OR_RETURN(Seen seen, Look(full, client_->Deadline()));
    if (!seen.exists || seen.record != record) return taken();
  }
  std::lock_guard<std::mutex> g(mu_);
  held_[full] = Held{record, std::chrono::steady_clock::now()};
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
  CKPTIO_ASSIGN_OR_RETURN(Seen seen, Look(full, client_->Deadline()));
  return seen.exists && !seen.stale;
}

void LeaseTable::Release(const std::string& full_key) {
  // After any renewal of this key under way, and before the next: a
  // renewal that raced the release could put the lease back.
  std::lock_guard<std::mutex> io(io_mu_);
  std::string record;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = held_.find(full_key);
    if (it == held_.end()) return;  // lost to another writer: theirs now
    record = std::move(it->second.record);
    held_.erase(it);
  }
  const Deadline deadline = client_->Deadline();
  auto seen = Look(full_key, deadline);
  if (!seen.ok() || !seen->exists || seen->record != record) return;
  Request r;
  r.method = "DELETE";
  r.key = full_key;
  (void)client_->Send(r, deadline);  // failing that, the lease goes stale by itself
}

void LeaseTable::Renew() {
  const auto every = client_->options().lease / 3;
  std::unique_lock<std::mutex> g(mu_);
  while (!stop_) {
    wake_.wait_for(g, every);
    if (stop_) break;
    std::vector<std::string> keys;
    for (const auto& [key, held] : held_) keys.push_back(key);
    g.unlock();
    for (const auto& key : keys) RenewOne(key, every);
    g.lock();
  }
}

void LeaseTable::RenewOne(const std::string& key, std::chrono::milliseconds within) {
  std::lock_guard<std::mutex> io(io_mu_);
  std::string record;
  std::chrono::steady_clock::time_point last;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = held_.find(key);
    if (it == held_.end()) return;  // released meanwhile
    record = it->second.record;
    last = it->second.renewed;
  }
  // Each renewal ends by the next one is due: a server slower than that
  // must not keep the lease from being renewed for longer than it lasts.
  const Deadline deadline = std::chrono::steady_clock::now() + within;
  // Renew only what still holds our record: a lease broken while we could
  // not renew it belongs to its new holder (our writer is then fenced by
  // the core).
  auto seen = Look(key, deadline);
  bool lost = seen.ok() && seen->exists && seen->record != record;
  bool renewed = false;
  if (seen.ok() && !seen->exists) {
    // Gone (deleted by hand?): ours again only if nobody took it meanwhile.
    Status s = PutExclusive(*client_, key, record, deadline);
    lost = s.code() == Code::kAlreadyExists;
    renewed = s.ok();
  } else if (!lost && seen.ok() &&
             std::chrono::steady_clock::now() < last + client_->options().lease) {
    // Sent only while a whole lease has not passed since the last renewal,
    // and given up when it would: past that, another writer may have
    // broken the lease since we looked and made its own, which this PUT
    // would overwrite. (Narrowed, not closed: S3 cannot make the PUT
    // conditional on our record; the fence in .writer is what stops a
    // writer that lost its lease.)
    Request r;
    r.method = "PUT";
    r.key = key;
    r.body = record;
    auto put = client_->Send(r, std::min(deadline, last + client_->options().lease));
    renewed = put.ok() && put->status == 200;  // else tried again at the next turn
  }
  std::lock_guard<std::mutex> g(mu_);
  auto it = held_.find(key);
  if (it == held_.end() || it->second.record != record) return;
  const auto now = std::chrono::steady_clock::now();
  if (renewed) it->second.renewed = now;
  // Not renewed for a whole lease: another writer may hold it by now.
  if (!lost && now - it->second.renewed > client_->options().lease) lost = true;
  if (lost) {
    held_.erase(it);
    Log(LogLevel::kWarning, client_->Where() + ": the writer's lease " + key +
                                " was lost (taken over, or not renewed for a whole lease); this "
                                "writer's next commit will be refused by the fence");
  }
}

}  // namespace ckptio::s3
