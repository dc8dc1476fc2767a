#include "ckptio/faulty_backend.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "ckptio/backends.h"

namespace ckptio {

namespace {

class FaultyWriter : public ObjectWriter {
 public:
  FaultyWriter(FaultyBackend* owner, std::string key, std::unique_ptr<ObjectWriter> inner)
      : owner_(owner), key_(std::move(key)), inner_(std::move(inner)) {}
  Status Append(const void* data, size_t size) override {
    bool short_write = false;
    Status s = owner_->Step("append " + key_, &short_write);
    if (!s.ok()) {
      if (short_write) (void)inner_->Append(data, size / 2);  // torn: half went out
      return s;
    }
    return inner_->Append(data, size);
  }
  Status Commit() override {
    CKPTIO_RETURN_IF_ERROR(owner_->Step("commit " + key_));
    return inner_->Commit();
  }

 private:
  FaultyBackend* owner_;
  std::string key_;
  std::unique_ptr<ObjectWriter> inner_;
};

class FaultyReader : public ObjectReader {
 public:
  FaultyReader(FaultyBackend* owner, std::string key, std::unique_ptr<ObjectReader> inner)
      : owner_(owner), key_(std::move(key)), inner_(std::move(inner)) {}
  uint64_t Size() const override { return inner_->Size(); }
  Status ReadAt(uint64_t offset, void* buf, size_t size) override {
    CKPTIO_RETURN_IF_ERROR(owner_->Step("read " + key_));
    return inner_->ReadAt(offset, buf, size);
  }

 private:
  FaultyBackend* owner_;
  std::string key_;
  std::unique_ptr<ObjectReader> inner_;
};

int ErrnoByName(const std::string& name) {
  static const std::map<std::string, int> kNames = {
      {"EIO", EIO},       {"ENOSPC", ENOSPC}, {"EDQUOT", EDQUOT}, {"EINTR", EINTR},
      {"EACCES", EACCES}, {"EROFS", EROFS},   {"ENOMEM", ENOMEM}, {"ESTALE", ESTALE}};
  auto it = kNames.find(name);
  if (it != kNames.end()) return it->second;
  char* end = nullptr;
  long v = std::strtol(name.c_str(), &end, 10);
  return (*end == '\0' && v > 0 && v < 4096) ? static_cast<int>(v) : -1;
}

}  // namespace

FaultyBackend::FaultyBackend(std::shared_ptr<StorageBackend> inner, FaultPlan plan)
    : inner_(std::move(inner)), plan_(plan), rng_(plan.seed * 0x9E3779B97F4A7C15ull + 1) {}

FaultyBackend::~FaultyBackend() = default;

int64_t FaultyBackend::ops() const {
  std::lock_guard<std::mutex> g(mu_);
  return ops_;
}

std::vector<std::string> FaultyBackend::log() const {
  std::lock_guard<std::mutex> g(mu_);
  return log_;
}

bool FaultyBackend::crashed() const {
  std::lock_guard<std::mutex> g(mu_);
  return crashed_;
}

Status FaultyBackend::Step(const std::string& what, bool* short_write) {
  std::lock_guard<std::mutex> g(mu_);
  const int64_t k = ops_++;
  log_.push_back(what);
  if (plan_.crash_at >= 0 && k >= plan_.crash_at) crashed_ = true;
  if (crashed_)
    return Status(Code::kUnavailable, "injected crash at operation #" +
                                          std::to_string(plan_.crash_at) + " (now #" +
                                          std::to_string(k) + ": " + what + ")");
  bool fail = k == plan_.fail_at;
  if (!fail && plan_.fail_rate > 0) {
    rng_ ^= rng_ << 13;  // xorshift64
    rng_ ^= rng_ >> 7;
    rng_ ^= rng_ << 17;
    fail = static_cast<double>(rng_ % 1000000) / 1e6 < plan_.fail_rate;
  }
  if (!fail) return OkStatus();
  if (short_write) *short_write = plan_.short_write;
  return ErrnoToStatus(plan_.fail_errno,
                       "injected fault at operation #" + std::to_string(k) + " (" + what + ")");
}

std::string FaultyBackend::Uri() const { return "faulty+" + inner_->Uri(); }

Result<std::unique_ptr<ObjectWriter>> FaultyBackend::NewObject(std::string_view key,
                                                               WriteMode mode) {
  CKPTIO_RETURN_IF_ERROR(Step("new " + std::string(key)));
  CKPTIO_ASSIGN_OR_RETURN(auto inner, inner_->NewObject(key, mode));
  return std::unique_ptr<ObjectWriter>(
      std::make_unique<FaultyWriter>(this, std::string(key), std::move(inner)));
}

Result<std::unique_ptr<ObjectReader>> FaultyBackend::OpenObject(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(Step("open " + std::string(key)));
  CKPTIO_ASSIGN_OR_RETURN(auto inner, inner_->OpenObject(key));
  return std::unique_ptr<ObjectReader>(
      std::make_unique<FaultyReader>(this, std::string(key), std::move(inner)));
}

Result<ObjectInfo> FaultyBackend::Stat(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(Step("stat " + std::string(key)));
  return inner_->Stat(key);
}

Result<std::vector<std::string>> FaultyBackend::List(std::string_view prefix) {
  CKPTIO_RETURN_IF_ERROR(Step("list " + std::string(prefix)));
  return inner_->List(prefix);
}

Status FaultyBackend::Delete(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(Step("delete " + std::string(key)));
  return inner_->Delete(key);
}

Result<bool> FaultyBackend::IsLocked(std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(Step("is-locked " + std::string(key)));
  return inner_->IsLocked(key);
}

Result<std::unique_ptr<BackendLock>> FaultyBackend::TryLock(std::string_view key, LockMode mode) {
  CKPTIO_RETURN_IF_ERROR(Step("lock " + std::string(key)));
  return inner_->TryLock(key, mode);
}

Status RegisterFaultyBackends(BackendRegistry& registry) {
  for (const std::string& scheme : registry.Schemes()) {
    if (scheme.rfind("faulty+", 0) == 0) continue;
    const BackendRegistry* reg = &registry;
    CKPTIO_RETURN_IF_ERROR(registry.Register(
        "faulty+" + scheme,
        [reg, scheme](const Uri& uri) -> Result<std::unique_ptr<StorageBackend>> {
          FaultPlan plan;
          std::string rest;
          auto bad = [&](const std::string& k, const std::string& v) {
            return Status(Code::kInvalidArgument, "faulty+ URI: bad value \"" + v + "\" for " + k);
          };
          for (const auto& [k, v] : uri.params) {
            char* end = nullptr;
            if (k == "fail_at" || k == "crash_at" || k == "seed") {
              long long n = std::strtoll(v.c_str(), &end, 10);
              if (v.empty() || *end != '\0' || n < 0) return bad(k, v);
              if (k == "fail_at") plan.fail_at = n;
              if (k == "crash_at") plan.crash_at = n;
              if (k == "seed") plan.seed = static_cast<uint64_t>(n);
            } else if (k == "errno") {
              plan.fail_errno = ErrnoByName(v);
              if (plan.fail_errno < 0) return bad(k, v);
            } else if (k == "fail_rate") {
              plan.fail_rate = std::strtod(v.c_str(), &end);
              if (v.empty() || *end != '\0' || plan.fail_rate < 0 || plan.fail_rate > 1)
                return bad(k, v);
            } else if (k == "short_write") {
              plan.short_write = v == "1" || v == "true";
            } else {
              rest += (rest.empty() ? "?" : "&") + k + "=" + v;  // the inner backend's
            }
          }
          std::string inner_uri = scheme + "://" + uri.authority + uri.path + rest;
          CKPTIO_ASSIGN_OR_RETURN(auto inner, reg->Open(inner_uri));
          return std::unique_ptr<StorageBackend>(std::make_unique<FaultyBackend>(
              std::shared_ptr<StorageBackend>(std::move(inner)), plan));
        }));
  }
  return OkStatus();
}

const BackendRegistry& BackendsWithFaults() {
  static const BackendRegistry* registry = [] {
    auto* r = new BackendRegistry(BuiltinBackends());
    Status s = RegisterFaultyBackends(*r);
    if (!s.ok()) {  // a programming error: a scheme registered twice
      std::fprintf(stderr, "ckptio: %s\n", s.ToString().c_str());
      std::abort();
    }
    return r;
  }();
  return *registry;
}

}  // namespace ckptio
