// Keeping a store in order: retention and garbage collection (step 6 of
// store.h's protocol), fsck (what is committed, torn, corrupt or stale) and
// repair.
#include <algorithm>
#include <map>
#include <set>

#include "ckptio/log.h"
#include "object_io.h"
#include "store_internal.h"

namespace ckptio {

std::string_view StepStateName(StepState s) {
  switch (s) {
    case StepState::kCommitted:
      return "committed";
    case StepState::kTorn:
      return "torn";
    case StepState::kCorrupt:
      return "corrupt";
    case StepState::kUnsupported:
      return "unsupported";
  }
  return "unknown";
}

std::string_view FsckKindName(FsckProblem::Kind k) {
  switch (k) {
    case FsckProblem::Kind::kStaleTemp:
      return "stale-temp";
    case FsckProblem::Kind::kTornStep:
      return "torn-step";
    case FsckProblem::Kind::kCorruptStep:
      return "corrupt-step";
    case FsckProblem::Kind::kBadLatest:
      return "bad-latest";
  }
  return "unknown";
}

Result<WriterCore::Deleted> WriterCore::DeleteStep(int64_t step, bool torn) {
  const std::string dir = StepDirName(step) + "/";
  if (!torn) {
    if (backend->LocksAreLeases()) {
      // Deleted and saved again by a successor since we found it? (This
      // narrows the race to the time between this read and the delete
      // below: there is no conditional delete to close it.)
      auto loaded = LoadManifest(*backend, step);
      if (loaded.ok()) {
        const auto& meta = loaded->manifest.metadata;
        auto folder = meta.find(kObjectsFolderKey);
        if (folder != meta.end() ? IsSuccessorsFolder(folder->second)
                                 : loaded->manifest.generation > generation)
          return Deleted::kNothingCommittedSince;
      } else if (loaded.status().code() != Code::kDataLoss &&
                 loaded.status().code() != Code::kNotFound) {
        return loaded.status().WithContext(
            "reading its manifest, to tell whether another writer "
            "saved it again");
      }
    }
    Status s = backend->Delete(ManifestKey(step));
    if (!s.ok() && s.code() != Code::kNotFound) return s;
  }
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend->List(dir));
  if (std::find(keys.begin(), keys.end(), ManifestKey(step)) != keys.end())
    return Deleted::kNothingCommittedSince;
  Deleted out = Deleted::kAll;
  for (const auto& key : keys) {
    if (IsSuccessorsKey(key)) {
      out = Deleted::kAllButASuccessorsObjects;
      continue;
    }
    Status s = backend->Delete(key);
    if (!s.ok() && s.code() != Code::kNotFound) return s;
  }
  return out;
}

namespace {
// " (done before this: a; b)", or "" if nothing was done.
std::string DoneBefore(const std::vector<std::string>& done) {
  if (done.empty()) return "";
  std::string out = " (done before this: ";
  for (size_t i = 0; i < done.size(); ++i) out += (i ? "; " : "") + done[i];
  return out + ")";
}
}  // namespace

Result<GcReport> WriterCore::CollectGarbage(int keep_last, std::optional<int64_t> just_committed,
                                            const ProgressFn& progress) {
  if (keep_last < 1)
    return Status(Code::kInvalidArgument,
                  "keep_last must be at least 1 (got " + std::to_string(keep_last) + ")");
  CKPTIO_RETURN_IF_ERROR(CheckFence());
  Store store(backend);
  CKPTIO_ASSIGN_OR_RETURN(auto steps, store.ListSteps());
  std::vector<int64_t> committed;
  for (const auto& s : steps)
    if (s.state == StepState::kCommitted) committed.push_back(s.step);
  std::set<int64_t> keep;
  for (size_t i = committed.size() > size_t(keep_last) ? committed.size() - keep_last : 0;
       i < committed.size(); ++i)
    keep.insert(committed[i]);
  // The step LATEST names is kept; if LATEST cannot be read (other than
  // unreadable bytes, DataLoss), which step that is is unknown: stop.
  auto latest = LoadLatest(*backend);
  if (!latest.ok() && latest.status().code() != Code::kDataLoss)
    return latest.status().WithContext("gc: reading LATEST (nothing was deleted)");
  if (latest.ok() && latest->has_value()) keep.insert((*latest)->step);
  GcReport report;
  if (just_committed) {
    report.newest_good = *just_committed;
  } else {
    // Invariant 4 for steps that rotted after their commit: keep the newest
    // one that still verifies, however old.
    for (auto it = committed.rbegin(); it != committed.rend() && !report.newest_good; ++it) {
      auto reader = store.OpenStep(*it);
      Status v = reader.ok() ? (*reader)->Verify(progress) : reader.status();
      if (v.ok()) {
        report.newest_good = *it;
      } else if (v.code() == Code::kDataLoss) {
        report.corrupt.push_back({FsckProblem::Kind::kCorruptStep, *it, v.message()});
      } else {
        return v.WithContext("gc: verifying step " + std::to_string(*it) +
                             " (nothing was deleted)");
      }
    }
  }
  if (report.newest_good) keep.insert(*report.newest_good);
  std::vector<std::string> done;  // for an error part-way
  for (int64_t step : committed) {
    if (keep.count(step)) continue;
    // Verifying can take long, and a lease lock can lapse meanwhile.
    Status s = CheckFence();
    auto deleted = s.ok() ? DeleteStep(step, /*torn=*/false) : Result<Deleted>(s);
    if (!deleted.ok())
      return deleted.status().WithContext("retention: deleting step " + std::to_string(step) +
                                          DoneBefore(done));
    if (*deleted == Deleted::kNothingCommittedSince) {
      const std::string left = "left step " + std::to_string(step) + ": " + SuccessorWords() +
                               " committed it again since it was listed";
      Log(LogLevel::kWarning, "store " + backend->Uri() + ": retention " + left);
      report.left.push_back(step);
      done.push_back(left);
      continue;
    }
    report.deleted.push_back(step);
    done.push_back("deleted step " + std::to_string(step));
  }
  return report;
}

Result<GcReport> StoreWriter::CollectGarbage(int keep_last, const ProgressFn& progress) {
  return state_->core->CollectGarbage(keep_last, std::nullopt, progress);
}

namespace {

// `known_corrupt`: steps found corrupt earlier, with the reason; reported
// again without being opened (a check that does not verify data would
// pass them). `parsed`, if given, gets every step whose manifest parses.
Result<FsckReport> CheckStore(Store& store, const ProgressFn& progress, bool verify_data,
                              bool we_hold_lock,
                              const std::map<int64_t, std::string>& known_corrupt = {},
                              std::set<int64_t>* parsed = nullptr) {
  StorageBackend& backend = store.backend();
  FsckReport r;
  if (!we_hold_lock) {
    // Look without taking the lock: a trainer opening its writer right now
    // must not find it held by fsck.
    auto locked = backend.IsLocked(kLockKey);
    if (!locked.ok() && locked.status().code() != Code::kUnimplemented) return locked.status();
    r.writer_active = locked.ok() && *locked;
  }
  // Listed after the lock test: temps listed before a writer took the lock
  // (and swept them) would pass for its own.
  CKPTIO_ASSIGN_OR_RETURN(auto keys, backend.List(""));
  // Steps with a temp object: with a live writer, those it is writing (it
  // swept every earlier writer's temps as it took the lock).
  std::set<int64_t> writing;
  bool seen_writing = false;  // in_progress has a temp object, not just a guess
  for (const auto& key : keys) {
    if (!IsSweepableTempKey(key)) continue;
    if (!r.writer_active) r.problems.push_back({FsckProblem::Kind::kStaleTemp, -1, key});
    const size_t slash = key.find('/');
    if (slash != std::string::npos) writing.insert(ParseStepDirName(key.substr(0, slash)));
  }
  CKPTIO_ASSIGN_OR_RETURN(auto steps, store.ListSteps());
  if (r.writer_active) {
    // Its save in progress: a torn step it is writing an object of, else
    // (between two objects) most likely the newest step. A save below a
    // newer step (after a load fell back past it) is found by the former.
    for (const auto& s : steps)
      if (s.state == StepState::kTorn && writing.count(s.step)) r.in_progress = s.step;
    seen_writing = r.in_progress.has_value();
    if (!r.in_progress && !steps.empty() && steps.back().state == StepState::kTorn)
      r.in_progress = steps.back().step;
  }
  std::map<int64_t, Hash128> good;
  for (const auto& s : steps) {
    if (parsed && s.state == StepState::kCommitted) parsed->insert(s.step);
    if (s.state == StepState::kTorn) {
      if (r.in_progress == s.step) continue;
      std::string detail = "no MANIFEST.json: an unfinished save";
      if (seen_writing)
        detail +=
            ", not the active writer's (it is writing step " + std::to_string(*r.in_progress) + ")";
      else if (r.writer_active)
        detail +=
            ", unless the active writer is saving it (between two objects: run fsck "
            "again to tell)";
      r.problems.push_back({FsckProblem::Kind::kTornStep, s.step, std::move(detail)});
      continue;
    }
    if (auto known = known_corrupt.find(s.step); known != known_corrupt.end()) {
      r.problems.push_back({FsckProblem::Kind::kCorruptStep, s.step, known->second});
      continue;
    }
    if (s.state == StepState::kCorrupt) {
      r.problems.push_back({FsckProblem::Kind::kCorruptStep, s.step, s.problem});
      continue;
    }
    if (s.state == StepState::kUnsupported)
      return Status(Code::kFailedPrecondition,
                    "step " + std::to_string(s.step) + ": " + s.problem +
                        " (this ckptio will not judge or repair a store a newer one wrote)");
    auto reader = store.OpenStep(s.step);
    Status v =
        reader.ok() ? (verify_data ? (*reader)->Verify(progress) : OkStatus()) : reader.status();
    if (v.ok()) {
      good[s.step] = (*reader)->manifest_hash();
    } else if (v.code() == Code::kDataLoss) {
      r.problems.push_back({FsckProblem::Kind::kCorruptStep, s.step, v.message()});
    } else if (v.code() != Code::kNotFound) {
      return v;
    }  // NotFound: retired since the listing (a live writer's retention)
  }
  for (const auto& [step, hash] : good) r.good_steps.push_back(step);

  auto latest = store.ReadLatest();
  auto bad_latest = [&](std::string detail) {
    r.problems.push_back({FsckProblem::Kind::kBadLatest, -1, std::move(detail)});
  };
  if (!latest.ok()) {
    if (latest.status().code() != Code::kDataLoss &&
        latest.status().code() != Code::kFailedPrecondition)
      return latest.status();
    bad_latest("LATEST is unreadable: " + latest.status().message());
  } else if (!latest->has_value()) {
    if (!good.empty())
      bad_latest("LATEST is missing but step " + std::to_string(good.rbegin()->first) +
                 " is committed");
  } else {
    const Latest& l = **latest;
    r.latest = l.step;
    auto it = good.find(l.step);
    if (it == good.end())
      bad_latest("LATEST names step " + std::to_string(l.step) +
                 ", which is missing, torn or corrupt");
    else if (it->second != l.manifest_hash)
      bad_latest("LATEST records manifest xxh3-128 " + l.manifest_hash.Hex() + " for step " +
                 std::to_string(l.step) + ", but that manifest hashes to " + it->second.Hex());
    else if (good.rbegin()->first > l.step)
      bad_latest("LATEST names step " + std::to_string(l.step) + " but step " +
                 std::to_string(good.rbegin()->first) + " is newer and good");
  }
  return r;
}

}  // namespace

Result<FsckReport> Store::Check(const ProgressFn& progress, bool verify_data) {
  return CheckStore(*this, progress, verify_data, /*we_hold_lock=*/false);
}

Result<FsckReport> StoreWriter::Repair(const ProgressFn& progress, const RepairOptions& options) {
  WriterCore& core = *state_->core;
  if (core.pending)
    return Status(Code::kFailedPrecondition, "cannot repair while a checkpoint is pending");
  StorageBackend& backend = *core.backend;
  Store store(core.backend);
  std::set<int64_t> parses;
  CKPTIO_ASSIGN_OR_RETURN(FsckReport before, CheckStore(store, progress, true, true, {}, &parses));
  std::vector<std::string> repairs;
  // With no step that verifies, the newest corrupt one is left (see
  // RepairOptions): the newest whose manifest parses, if any (what is
  // intact in it can still be read verified), else the newest.
  std::map<int64_t, std::string> spared;
  if (before.good_steps.empty() && !options.delete_all_corrupt) {
    const FsckProblem* pick = nullptr;
    for (auto p = before.problems.rbegin(); p != before.problems.rend(); ++p) {
      if (p->kind != FsckProblem::Kind::kCorruptStep) continue;
      if (!pick) pick = &*p;  // the newest
      if (parses.count(p->step)) {
        pick = &*p;
        break;
      }
    }
    if (pick) spared[pick->step] = pick->detail;
  }
  // What was repaired goes with an error part-way.
  auto stopped = [&](const Status& s, const std::string& doing) {
    return s.WithContext("repair: " + doing + DoneBefore(repairs));
  };
  // Order matters for crash safety: LATEST moves to a good step before any
  // step it may name is deleted.
  for (const auto& p : before.problems) {
    if (p.kind != FsckProblem::Kind::kBadLatest) continue;
    CKPTIO_RETURN_IF_ERROR(core.CheckFence());  // (checking took a while)
    if (before.latest && spared.count(*before.latest)) {
      // Loads that open LATEST keep failing on the step, too.
      repairs.push_back("left LATEST: it names corrupt step " + std::to_string(*before.latest) +
                        ", which is left");
    } else if (before.good_steps.empty()) {
      Status s = backend.Delete(kLatestKey);
      if (!s.ok() && s.code() != Code::kNotFound)
        return stopped(s, "removing LATEST (no step verifies)");
      repairs.push_back("removed LATEST: no step verifies");
    } else {
      const int64_t newest = before.good_steps.back();
      auto reader = store.OpenStep(newest);
      Status s = reader.status();
      if (s.ok())
        s = WriteSmall(backend, kLatestKey,
                       SerializeLatest({newest, core.generation, (*reader)->manifest_hash()}),
                       WriteMode::kReplace);
      if (!s.ok()) return stopped(s, "pointing LATEST at step " + std::to_string(newest));
      repairs.push_back("LATEST now names step " + std::to_string(newest));
    }
    break;
  }
  for (const auto& p : before.problems) {
    if (p.kind == FsckProblem::Kind::kBadLatest) continue;
    const bool torn = p.kind == FsckProblem::Kind::kTornStep;
    const std::string what =
        p.kind == FsckProblem::Kind::kStaleTemp
            ? "stale temp " + p.detail
            : std::string(torn ? "torn" : "corrupt") + " step " + std::to_string(p.step);
    if (p.kind == FsckProblem::Kind::kCorruptStep && spared.count(p.step)) {
      repairs.push_back("left " + what +
                        ": no step verifies; it is kept for salvage (delete it with `ckptio "
                        "fsck --repair --delete-all-corrupt`)");
      continue;
    }
    // Checking took a while (every byte was read): still ours to change?
    Status s = core.CheckFence();
    if (!s.ok()) return stopped(s, "deleting " + what);
    if (p.kind == FsckProblem::Kind::kStaleTemp) {
      if (core.IsSuccessorsKey(p.detail)) {  // an object it is writing now, perhaps
        repairs.push_back("left " + what + ": " + core.SuccessorWords() + "'s");
        continue;
      }
      s = backend.Delete(p.detail);
      if (!s.ok() && s.code() != Code::kNotFound) return stopped(s, "deleting " + what);
      repairs.push_back("deleted " + what);
      continue;
    }
    auto deleted = core.DeleteStep(p.step, torn);
    if (!deleted.ok()) return stopped(deleted.status(), "deleting " + what);
    switch (*deleted) {
      case WriterCore::Deleted::kAll:
        repairs.push_back("deleted " + what);
        break;
      case WriterCore::Deleted::kAllButASuccessorsObjects:
        repairs.push_back("deleted " + what + " but for the objects of " + core.SuccessorWords());
        break;
      case WriterCore::Deleted::kNothingCommittedSince:
        repairs.push_back("left " + what + ": committed " + (torn ? "since" : "again") + " by " +
                          core.SuccessorWords());
        break;
    }
  }
  // Every remaining step verified above; re-read the structure only.
  CKPTIO_ASSIGN_OR_RETURN(FsckReport after, CheckStore(store, {}, false, true, spared));
  after.repairs = std::move(repairs);
  return after;
}
}  // namespace ckptio
