#include "ckptio/layout.h"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <random>

#include "object_io.h"  // HostName

namespace ckptio {

std::string StepDirName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%012lld", static_cast<long long>(step));
  return buf;
}

int64_t ParseStepDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() != kPrefix.size() + 12 || name.substr(0, kPrefix.size()) != kPrefix) return -1;
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

std::string ManifestKey(int64_t step) { return ObjectKey(step, kManifestName); }

std::string ObjectKey(int64_t step, std::string_view object) {
  return StepDirName(step) + "/" + std::string(object);
}

std::string DecisionKey(std::string_view name) {
  return std::string(kDecisionPrefix) + std::string(name);
}

bool IsStoreKey(std::string_view key) {
  return key == kLatestKey || key == kWriterKey || key == kLockKey || key == kSaveLockKey ||
         key.rfind(std::string(kCoordDir) + "/", 0) == 0 || key.rfind("step-", 0) == 0;
}

std::string StripePartName(std::string_view object, int rank) {
  constexpr std::string_view kSuffix = ".safetensors";
  const bool has_suffix =
      object.size() > kSuffix.size() && object.substr(object.size() - kSuffix.size()) == kSuffix;
  const std::string_view stem =
      has_suffix ? object.substr(0, object.size() - kSuffix.size()) : object;
  return std::string(stem) + ".part-" + std::to_string(rank) + std::string(kSuffix);
}

std::string TempObjectName(std::string_view base) {
  static std::atomic<uint64_t> counter{0};
  static const std::string host = KeySafeHostName();
  return std::string(kTempMarker) + std::string(base.substr(0, 100)) + "." + host + "." +
         std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1)) + "." +
         RandomHex();
}

bool IsTempObjectName(std::string_view base) {
  return base.substr(0, kTempMarker.size()) == kTempMarker;
}

bool IsSweepableTempKey(std::string_view key) {
  const size_t last = key.rfind('/');
  if (!IsTempObjectName(last == std::string_view::npos ? key : key.substr(last + 1))) return false;
  const size_t slash = key.find('/');
  if (slash == std::string_view::npos) return true;
  const std::string_view dir = key.substr(0, slash);
  if (last == slash) return dir.rfind("step-", 0) == 0 || dir == kCoordDir;
  // step-N/<objects folder>/<temp>
  const std::string_view folder = key.substr(slash + 1, last - slash - 1);
  return dir.rfind("step-", 0) == 0 && ObjectsFolderGeneration(folder) >= 0;
}

namespace {
std::string Hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}
}  // namespace

std::string ObjectsFolderName(int64_t generation, uint64_t id) {
  return "w" + std::to_string(generation) + "-" + Hex16(id);
}

int64_t ObjectsFolderGeneration(std::string_view name) {
  const size_t dash = name.find('-');
  if (name.empty() || name[0] != 'w' || dash == std::string_view::npos || dash < 2 || dash > 20 ||
      name.size() != dash + 17)
    return -1;
  int64_t g = 0;
  for (char c : name.substr(1, dash - 1)) {
    if (c < '0' || c > '9' || g > (INT64_MAX - (c - '0')) / 10) return -1;
    g = g * 10 + (c - '0');
  }
  for (char c : name.substr(dash + 1))
    if (!std::isxdigit(static_cast<unsigned char>(c)) ||
        std::isupper(static_cast<unsigned char>(c)))
      return -1;
  return g;
}

std::string KeySafeHostName() {
  std::string h = HostName();
  for (char& c : h)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') c = '_';
  return h.substr(0, 32);
}

std::string RandomHex() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return Hex16(rng());
}

}  // namespace ckptio
