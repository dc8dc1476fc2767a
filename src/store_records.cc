// Reading the store's records: manifests (checked, and summarized for
// listings), LATEST and .writer; deleting a step manifest first.
#include <mutex>
#include <unordered_map>

#include "object_io.h"
#include "store_internal.h"

namespace ckptio {

Result<std::string> ReadManifestBytes(StorageBackend& backend, int64_t step) {
  const std::string key = ManifestKey(step);
  auto bytes = ReadSmall(backend, key, kMaxManifestBytes);
  if (!bytes.ok() && bytes.status().code() == Code::kNotFound)
    return Status(Code::kNotFound, "step " + std::to_string(step) + " is not committed in " +
                                       backend.Uri() + " (no " + key + ")");
  return bytes;
}

// The manifest of `step`, from its bytes, checked (DataLoss naming the file).
Result<Manifest> ParseManifestOf(const StorageBackend& backend, int64_t step,
                                 std::string_view bytes) {
  const std::string where = backend.Uri() + "/" + ManifestKey(step);
  CKPTIO_ASSIGN_OR_RETURN(Manifest m, ParseManifest(bytes, where));
  if (m.step != step)
    return Status(Code::kDataLoss, where + ": manifest records step " + std::to_string(m.step) +
                                       ", its directory says " + std::to_string(step));
  return m;
}

Result<LoadedManifest> LoadManifest(StorageBackend& backend, int64_t step) {
  CKPTIO_ASSIGN_OR_RETURN(std::string bytes, ReadManifestBytes(backend, step));
  CKPTIO_ASSIGN_OR_RETURN(Manifest m, ParseManifestOf(backend, step, bytes));
  return LoadedManifest{std::move(m), HashBytes(bytes)};
}

// What ListSteps needs of a manifest: the outcome of parsing it, and two
// fields. Remembered by the store, step and hash of the bytes: the same bytes
// always parse the same way, so a remembered answer is exact, and bytes that
// changed (damage) are parsed afresh. With retention every save lists the

namespace {

// Remembered by the store, step and hash of the bytes: the same bytes
// always parse the same way, so a remembered answer is exact, and bytes that
// changed (damage) are parsed afresh. With retention every save lists the
// retained steps; parsing each again took 20 ms a manifest of 10,000 tensors.
class ManifestSummaries {
 public:
  static std::string Key(const StorageBackend& backend, int64_t step, const Hash128& bytes_hash) {
    return backend.Uri() + '\0' + std::to_string(step) + '\0' + bytes_hash.Hex();
  }
  std::optional<ManifestSummary> Find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seen_.find(key);
    return it == seen_.end() ? std::nullopt : std::optional<ManifestSummary>(it->second);
  }
  void Remember(const std::string& key, ManifestSummary summary) {
    std::lock_guard<std::mutex> lock(mu_);
    if (seen_.size() >= 4096) seen_.clear();  // bounded; a miss only costs a parse
    seen_.insert_or_assign(key, std::move(summary));
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, ManifestSummary> seen_;
};

ManifestSummaries& Summaries() {
  static auto* summaries = new ManifestSummaries;  // never destroyed: used until exit
  return *summaries;
}

ManifestSummary SummaryOf(const Manifest& m) {
  ManifestSummary summary;
  summary.bytes = m.TotalBytes();
  summary.created_unix_ms = m.created_unix_ms;
  return summary;
}
}  // namespace

Result<ManifestSummary> SummarizeManifest(StorageBackend& backend, int64_t step) {
  auto read = ReadManifestBytes(backend, step);
  // A manifest that cannot be read whole (over the size limit, shorter than
  // its size) is a damaged step, like one that does not parse.
  if (!read.ok() && read.status().code() == Code::kDataLoss) return ManifestSummary{read.status()};
  CKPTIO_ASSIGN_OR_RETURN(std::string bytes, std::move(read));
  const std::string key = ManifestSummaries::Key(backend, step, HashBytes(bytes));
  if (auto known = Summaries().Find(key)) return *known;
  auto m = ParseManifestOf(backend, step, bytes);
  ManifestSummary summary = m.ok() ? SummaryOf(*m) : ManifestSummary{m.status()};
  Summaries().Remember(key, summary);
  return summary;
}

void RememberSummary(const StorageBackend& backend, int64_t step, const Hash128& bytes_hash,
                     const Manifest& m) {
  Summaries().Remember(ManifestSummaries::Key(backend, step, bytes_hash), SummaryOf(m));
}

Result<std::optional<Latest>> LoadLatest(StorageBackend& backend) {
  auto bytes = ReadSmall(backend, kLatestKey, kMaxLatestBytes);
  if (!bytes.ok()) {
    if (bytes.status().code() == Code::kNotFound) return std::optional<Latest>();
    return bytes.status();
  }
  CKPTIO_ASSIGN_OR_RETURN(Latest l,
                          ParseLatest(*bytes, backend.Uri() + "/" + std::string(kLatestKey)));
  return std::optional<Latest>(l);
}

Result<WriterRecord> LoadWriterRecord(StorageBackend& backend) {
  CKPTIO_ASSIGN_OR_RETURN(std::string bytes, ReadSmall(backend, kWriterKey, kMaxLatestBytes));
  return ParseWriterRecord(bytes, backend.Uri() + "/" + std::string(kWriterKey));
}

std::string ObjectsFolderOf(const WriterRecord& w) {
  return ObjectsFolderName(w.generation, HashBytes(SerializeWriterRecord(w)).high);
}

// Keys grouped by step directory; other keys are ignored.
Result<std::map<int64_t, std::vector<std::string>>> KeysByStep(StorageBackend& backend) {
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend.List(""));
  std::map<int64_t, std::vector<std::string>> out;
  for (auto& key : keys) {
    size_t slash = key.find('/');
    if (slash == std::string::npos) continue;
    int64_t step = ParseStepDirName(std::string_view(key).substr(0, slash));
    if (step >= 0) out[step].push_back(key.substr(slash + 1));
  }
  return out;
}

}  // namespace ckptio
