// What the files of the store share (internal to ckptio_core): reading its
// records, and the state behind a writer and its pending checkpoints.
// store.h numbers the commit protocol; each file says which part it holds:
//   store.cc               opening a store, listing, the writer lock (step 1), Begin (2)
//   store_records.cc       reading manifests, LATEST and .writer
//   checkpoint_reader.cc   verified reads
//   pending_checkpoint.cc  streaming objects (3), the commit (4, 5)
//   stripe_writer.cc       striped saves: a rank's part, its receipt
//   store_maintenance.cc   retention and gc (6), fsck and repair
#ifndef CKPTIO_SRC_STORE_INTERNAL_H_
#define CKPTIO_SRC_STORE_INTERNAL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/layout.h"
#include "ckptio/store.h"

namespace ckptio {

// Reading the store's records (store_records.cc).
struct LoadedManifest {
  Manifest manifest;
  Hash128 hash;  // of the MANIFEST.json bytes
};
// The bytes of step's MANIFEST.json; NotFound naming the step if absent.
Result<std::string> ReadManifestBytes(StorageBackend& backend, int64_t step);
// The manifest of `step`, from its bytes, checked (DataLoss naming the file).
Result<Manifest> ParseManifestOf(const StorageBackend& backend, int64_t step,
                                 std::string_view bytes);
Result<LoadedManifest> LoadManifest(StorageBackend& backend, int64_t step);

// What ListSteps needs of a manifest: the outcome of parsing it, and two
// fields (remembered per store, step and manifest bytes: see store_records.cc).
struct ManifestSummary {
  Status status;  // OK, or why the step is not committed
  uint64_t bytes = 0;
  int64_t created_unix_ms = 0;
};
Result<ManifestSummary> SummarizeManifest(StorageBackend& backend, int64_t step);
// Records the summary of manifest `m` of `step`, whose bytes hash to
// `bytes_hash` (a writer that has just committed it).
void RememberSummary(const StorageBackend& backend, int64_t step, const Hash128& bytes_hash,
                     const Manifest& m);

Result<std::optional<Latest>> LoadLatest(StorageBackend& backend);
Result<WriterRecord> LoadWriterRecord(StorageBackend& backend);

// Keys grouped by step directory; other keys are ignored.
Result<std::map<int64_t, std::vector<std::string>>> KeysByStep(StorageBackend& backend);

// The objects folder of the writer that claimed the store with `w` (see
// kObjectsFolderKey): "w<generation>-" and 16 hex digits of the record's
// hash, so two writers' folders differ even where they claimed the same
// generation. Stripe writers derive the same from .writer.
std::string ObjectsFolderOf(const WriterRecord& w);

// What a writer and its pending checkpoints share; lives as long as any.
struct WriterCore {
  std::shared_ptr<StorageBackend> backend;
  std::unique_ptr<BackendLock> lock;
  WriterOptions options;
  int64_t generation = 0;
  WriterRecord me;  // what this writer wrote to .writer
  // Where this writer's objects go inside a step: "" (the step's folder),
  // or ObjectsFolderOf(me) where the backend's locks are leases.
  std::string objects_folder;
  size_t stale_temps_removed = 0;
  bool pending = false;

  // Aborted if another writer has claimed the store since we did.
  Status CheckFence() {
    auto rec = LoadWriterRecord(*backend);
    if (!rec.ok()) {
      if (rec.status().code() == Code::kNotFound)
        return Status(Code::kAborted, "this writer (generation " + std::to_string(generation) +
                                          ") was fenced: " + backend->Uri() +
                                          "/.writer is gone; open a new writer to continue");
      return rec.status().WithContext("checking the writer fence");
    }
    // The whole record, not just the number: two writers that each believed
    // they held the lock (a lease broken while its holder was paused, over
    // s3://) may claim the same generation, and only the last to write
    // .writer owns it.
    if (rec->generation != generation || rec->host != me.host || rec->pid != me.pid ||
        rec->started_unix_ms != me.started_unix_ms)
      return Status(Code::kAborted,
                    "this writer (generation " + std::to_string(generation) +
                        ") was fenced: " + backend->Uri() + "/.writer names generation " +
                        std::to_string(rec->generation) + " (host " + rec->host + ", pid " +
                        std::to_string(rec->pid) +
                        "). Another writer took over the store; stop writing from this "
                        "process and open a new writer to continue");
    return OkStatus();
  }

  // Where locks are leases: whether objects folder `folder` (layout.h) may
  // be a successor's, a writer that took the store over after our lease
  // was broken: another writer's, of our generation or above (two writers
  // may claim one generation, see CheckFence).
  bool IsSuccessorsFolder(std::string_view folder) const {
    const int64_t g = ObjectsFolderGeneration(folder);
    return g >= generation && folder != objects_folder;
  }
  // Whether `key` ("step-N/<folder>/<name>") lies in such a folder, where
  // locks are leases.
  bool IsSuccessorsKey(std::string_view key) const {
    const size_t first = key.find('/'), last = key.rfind('/');
    return backend->LocksAreLeases() && first != last &&
           IsSuccessorsFolder(key.substr(first + 1, last - first - 1));
  }
  // "another writer of generation G or above", for reports.
  std::string SuccessorWords() const {
    return "another writer of generation " + std::to_string(generation) + " or above";
  }

  // Deletes `step`, so that a crash part-way leaves it torn, never
  // committed with objects missing: the manifest goes first. `torn`: the
  // step was found without a manifest. A manifest listed after that (for a
  // step found torn, or after deleting its manifest) is another writer's
  // commit: the step is left. Where locks are leases, nothing else a
  // successor saves is deleted either (this writer may have stalled past
  // its lease since its last fence check): not the objects in its folder,
  // nor, for a step found committed, a manifest naming its folder.
  enum class Deleted { kAll, kAllButASuccessorsObjects, kNothingCommittedSince };
  Result<Deleted> DeleteStep(int64_t step, bool torn);

  // `just_committed`: the step this writer has just committed, which counts
  // as the good step (its bytes were hashed as they were written), so
  // retention after a save reads nothing back.
  Result<GcReport> CollectGarbage(int keep_last, std::optional<int64_t> just_committed,
                                  const ProgressFn& progress);
};

struct PendingCheckpoint::State {
  std::shared_ptr<WriterCore> core;
  int64_t step = 0;
  std::string dir;      // "step-000000000012/": where the manifest goes
  std::string objects;  // where the objects go: dir, or dir + objects folder + "/"
  Manifest manifest;
  std::set<std::string, std::less<>> names;
  int open_streams = 0;
  Status failure;         // the first failure of any object; fails the commit
  bool finished = false;  // committed, or failed to commit
  bool committed = false;
  bool striped = false;         // abandoning clears all of `objects`
  bool manifest_tried = false;  // Commit wrote the manifest (it may be there)

  void Fail(const Status& why) {
    if (failure.ok()) failure = why;
  }
};

struct StoreWriter::State {
  std::shared_ptr<WriterCore> core;
};

}  // namespace ckptio

#endif  // CKPTIO_SRC_STORE_INTERNAL_H_
