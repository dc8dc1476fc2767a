// Store: opening a store, listing its steps, opening a step to read, the
// writer lock and fence (step 1 of the protocol in store.h) and Begin (step
// 2). The rest of the protocol: see store_internal.h for which file holds it.
#include "ckptio/store.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "backoff.h"
#include "ckptio/coordination.h"
#include "ckptio/log.h"
#include "object_io.h"
#include "store_internal.h"

namespace ckptio {

StoreWriter::StoreWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}
StoreWriter::~StoreWriter() = default;

int64_t StoreWriter::generation() const { return state_->core->generation; }
size_t StoreWriter::stale_temps_removed() const { return state_->core->stale_temps_removed; }

Result<std::unique_ptr<PendingCheckpoint>> StoreWriter::Begin(int64_t step) {
  WriterCore& core = *state_->core;
  if (step < 0 || step > kMaxStep)
    return Status(Code::kInvalidArgument,
                  "step " + std::to_string(step) + " is outside [0, 999999999999]");
  if (core.pending)
    return Status(Code::kFailedPrecondition,
                  "another checkpoint of this writer is still pending; commit or destroy it first");
  // Still ours? A writer that took over may be writing this very step:
  // what is there would be cleared below as our own torn attempt.
  CKPTIO_RETURN_IF_ERROR(core.CheckFence().WithContext("beginning step " + std::to_string(step)));
  const std::string dir = StepDirName(step) + "/";
  CKPTIO_ASSIGN_OR_RETURN(auto keys, core.backend->List(dir));
  for (const auto& key : keys) {
    if (key == ManifestKey(step))
      return Status(Code::kAlreadyExists,
                    "step " + std::to_string(step) + " is already committed in " +
                        core.backend->Uri() +
                        "; committed checkpoints are immutable: save under a new step");
  }
  // Leftovers of a torn attempt at this step (we hold the lock: no one
  // else is writing them). Where locks are leases only our own folder's:
  // had we stalled past the lease since the fence check, a successor
  // could be saving this step in its folder (readers ignore the others,
  // and they go with the step).
  const std::string objects = core.objects_folder.empty() ? dir : dir + core.objects_folder + "/";
  for (const auto& key : keys) {
    if (key.compare(0, objects.size(), objects) != 0) continue;
    CKPTIO_RETURN_IF_ERROR(core.backend->Delete(key).WithContext(
        "clearing a torn attempt at step " + std::to_string(step) + " before saving it again"));
  }
  auto st = std::make_unique<PendingCheckpoint::State>();
  st->core = state_->core;
  st->step = step;
  st->dir = dir;
  st->objects = objects;
  if (!core.objects_folder.empty()) st->manifest.metadata[kObjectsFolderKey] = core.objects_folder;
  core.pending = true;
  return std::unique_ptr<PendingCheckpoint>(new PendingCheckpoint(std::move(st)));
}

Result<std::unique_ptr<Store>> Store::Open(std::string_view uri, const BackendRegistry& registry) {
  CKPTIO_ASSIGN_OR_RETURN(auto backend, registry.Open(uri));
  return std::make_unique<Store>(std::shared_ptr<StorageBackend>(std::move(backend)));
}

Store::Store(std::shared_ptr<StorageBackend> backend) : backend_(std::move(backend)) {}

Result<std::vector<StepEntry>> Store::ListSteps() {
  CKPTIO_ASSIGN_OR_RETURN(auto by_step, KeysByStep(*backend_));
  std::vector<StepEntry> out;
  for (const auto& [step, names] : by_step) {
    StepEntry e;
    e.step = step;
    bool has_manifest = std::find(names.begin(), names.end(), kManifestName) != names.end();
    Result<ManifestSummary> summary = ManifestSummary{};
    if (has_manifest) {
      summary = SummarizeManifest(*backend_, step);
      // Deleted since it was listed (another process's retention): what is
      // left is torn, like any step without a manifest.
      if (!summary.ok() && summary.status().code() == Code::kNotFound) has_manifest = false;
    }
    if (has_manifest) {
      CKPTIO_RETURN_IF_ERROR(summary.status());
      const Status& loaded = summary->status;
      if (loaded.ok()) {
        e.state = StepState::kCommitted;
        e.bytes = summary->bytes;
        e.created_unix_ms = summary->created_unix_ms;
      } else if (loaded.code() == Code::kDataLoss) {
        e.state = StepState::kCorrupt;
        e.problem = loaded.message();
      } else if (loaded.code() == Code::kFailedPrecondition) {
        e.state = StepState::kUnsupported;  // a newer format: never ours to judge
        e.problem = loaded.message();
      } else {
        return loaded;
      }
    } else {
      e.state = StepState::kTorn;
      for (const auto& name : names) {
        auto info = backend_->Stat(ObjectKey(step, name));
        if (info.ok()) e.bytes += info->size;
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

Result<std::vector<int64_t>> Store::ListStepsWithManifest() {
  CKPTIO_ASSIGN_OR_RETURN(auto by_step, KeysByStep(*backend_));
  std::vector<int64_t> out;
  for (const auto& [step, names] : by_step)
    if (std::find(names.begin(), names.end(), kManifestName) != names.end()) out.push_back(step);
  return out;
}

Result<std::optional<Latest>> Store::ReadLatest() { return LoadLatest(*backend_); }

Result<int64_t> Store::NextStep() {
  int64_t step = 0;
  auto steps = ListStepsWithManifest();
  if (steps.ok() && !steps->empty()) {
    step = steps->back() + 1;
  } else if (!steps.ok() && steps.status().code() != Code::kNotFound) {
    return steps.status().WithContext("finding the next step of " + uri());
  }
  auto latest = ReadLatest();
  if (latest.ok() && latest->has_value()) step = std::max(step, (*latest)->step + 1);
  return step;
}

Result<std::unique_ptr<CheckpointReader>> Store::OpenStep(int64_t step) {
  if (step < 0 || step > kMaxStep)
    return Status(Code::kInvalidArgument,
                  "step " + std::to_string(step) + " is outside [0, 999999999999]");
  CKPTIO_ASSIGN_OR_RETURN(LoadedManifest loaded, LoadManifest(*backend_, step));
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(backend_, std::move(loaded.manifest), loaded.hash));
}

Result<std::optional<StepChoice>> Store::ChooseStep(std::optional<int64_t> step,
                                                    const StepCheck& verify) {
  std::vector<int64_t> candidates;
  if (step) {
    candidates.push_back(*step);
  } else {
    // Manifests are read (and checked) once, by OpenStep below.
    auto steps = ListStepsWithManifest();
    if (!steps.ok() && steps.status().code() == Code::kNotFound) return std::optional<StepChoice>();
    CKPTIO_RETURN_IF_ERROR(steps.status());
    candidates.assign(steps->rbegin(), steps->rend());
    if (candidates.empty()) return std::optional<StepChoice>();
  }
  StepChoice choice;
  for (int64_t candidate : candidates) {
    auto reader = OpenStep(candidate);
    Status v = !reader.ok() ? reader.status()
               : verify     ? verify(std::move(*reader))
                            : (*reader)->Verify();
    if (v.ok()) {
      choice.step = candidate;
      return std::optional<StepChoice>(std::move(choice));
    }
    if (v.code() != Code::kDataLoss || step) return v;
    if (choice.skipped.size() < 50)
      choice.skipped.emplace_back(candidate, v.message().substr(0, 300));
  }
  return Status(Code::kDataLoss, "no checkpoint in " + uri() +
                                     " verifies; newest problem: " + choice.skipped.front().second);
}

std::string SkippedStepWarning(int64_t skipped, int64_t loading, std::string_view why) {
  return "step " + std::to_string(skipped) + " failed verification and is skipped; loading step " +
         std::to_string(loading) + " instead (" + std::string(why) + ")";
}

Result<std::unique_ptr<CheckpointReader>> Store::OpenLatest() {
  CKPTIO_ASSIGN_OR_RETURN(std::optional<Latest> latest, ReadLatest());
  if (!latest)
    return Status(Code::kNotFound, "store " + uri() + " has no LATEST: nothing committed yet");
  CKPTIO_ASSIGN_OR_RETURN(auto reader, OpenStep(latest->step));
  if (reader->manifest_hash() != latest->manifest_hash)
    return Status(Code::kDataLoss,
                  "store " + uri() + ": LATEST names step " + std::to_string(latest->step) +
                      " with manifest xxh3-128 " + latest->manifest_hash.Hex() +
                      ", but its MANIFEST.json hashes to " + reader->manifest_hash().Hex());
  return reader;
}

Result<std::unique_ptr<StoreWriter>> Store::OpenWriter(const WriterOptions& options) {
  if (options.chunk_size < kMinChunkBytes || options.chunk_size > kMaxChunkBytes)
    return Status(Code::kInvalidArgument, "chunk_size must be within [4 KiB, 64 MiB]");
  if (options.keep_last < 0)
    return Status(Code::kInvalidArgument, "keep_last must be >= 0 (0 keeps every step)");
  if (options.world_size < 1 || options.saving_rank < 0 ||
      options.saving_rank >= options.world_size)
    return Status(Code::kInvalidArgument, "saving_rank " + std::to_string(options.saving_rank) +
                                              " is not within world_size " +
                                              std::to_string(options.world_size));

  // 1. The lock, waiting up to lock_wait. Tries come closer together where
  // one is a system call (a file lock) than where it is requests to a
  // server (a lease, on NFS or an object store, whose holder renews it or
  // lets it go stale over seconds).
  Backoff backoff(DeadlineAfter(options.lock_wait),  // (saturating: max() is for ever)
                  std::chrono::milliseconds(backend_->LocksAreLeases() ? 1000 : 20));
  std::unique_ptr<BackendLock> lock;
  while (true) {
    auto got = backend_->TryLock(kLockKey);
    if (got.ok()) {
      lock = std::move(*got);
      break;
    }
    if (got.status().code() != Code::kFailedPrecondition) return got.status();
    if (backoff.Wait()) continue;
    CKPTIO_RETURN_IF_ERROR(backoff.Stopped(OkStatus()));  // interrupted
    std::string holder = "unknown";
    auto rec = LoadWriterRecord(*backend_);
    if (rec.ok())
      holder = "host " + rec->host + ", pid " + std::to_string(rec->pid) + ", generation " +
               std::to_string(rec->generation);
    return Status(Code::kFailedPrecondition,
                  "store " + uri() + " already has a writer (last recorded writer: " + holder +
                      "; " + got.status().message() +
                      "). ckptio allows one writer per store: wait for it to finish, "
                      "stop it, or raise the writer's lock wait");
  }

  auto core = std::make_shared<WriterCore>();
  core->backend = backend_;
  core->lock = std::move(lock);
  core->options = options;

  // Claim a generation above every one on record, then announce it.
  int64_t generation = 0;
  auto latest = LoadLatest(*backend_);
  if (latest.ok() && latest->has_value()) generation = (*latest)->generation;
  if (!latest.ok() && latest.status().code() != Code::kDataLoss) return latest.status();
  auto rec = LoadWriterRecord(*backend_);
  if (rec.ok()) generation = std::max(generation, rec->generation);
  if (!rec.ok() && rec.status().code() != Code::kNotFound && rec.status().code() != Code::kDataLoss)
    return rec.status();
  core->generation = generation + 1;
  core->me =
      WriterRecord{core->generation, HostName(), static_cast<int64_t>(::getpid()), NowUnixMs()};
  CKPTIO_RETURN_IF_ERROR(
      WriteSmall(*backend_, kWriterKey, SerializeWriterRecord(core->me), WriteMode::kReplace)
          .WithContext("claiming the writer generation of " + uri()));
  if (backend_->LocksAreLeases()) core->objects_folder = ObjectsFolderOf(core->me);

  // Unfinished writes and temp objects now belong to dead writers. Best
  // effort: one that cannot be removed costs space, not correctness (temps
  // are never read; fsck lists them), so it is logged and left.
  auto aborted = backend_->AbortUnfinishedWrites();
  if (aborted.ok())
    core->stale_temps_removed = *aborted;
  else
    Log(LogLevel::kWarning, "store " + uri() +
                                ": unfinished writes of earlier writers were not "
                                "all aborted (" +
                                aborted.status().ToString() + "); `ckptio fsck --repair` retries");
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend_->List(""));
  size_t left = 0;
  Status first_error;
  for (const auto& key : keys) {
    if (!IsSweepableTempKey(key)) continue;
    Status s = backend_->Delete(key);
    if (s.ok() || s.code() == Code::kNotFound) {
      ++core->stale_temps_removed;
    } else if (left++ == 0) {
      first_error = s;
    }
  }
  if (left > 0)
    Log(LogLevel::kWarning, "store " + uri() + ": " + std::to_string(left) +
                                " stale temp object(s) of earlier writers could not be removed "
                                "(first: " +
                                first_error.ToString() +
                                "); they are never read, and `ckptio fsck` lists them");
  auto state = std::make_unique<StoreWriter::State>();
  state->core = std::move(core);
  return std::unique_ptr<StoreWriter>(new StoreWriter(std::move(state)));
}

}  // namespace ckptio
