// File-based coordination (manifest signal and file lock); see
// coordination.h for the protocol.
#include "ckptio/coordination.h"

#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "backoff.h"
#include "ckptio/manifest.h"
#include "ckptio/store.h"
#include "object_io.h"

namespace ckptio {

std::string_view WaitModeName(WaitMode mode) {
  switch (mode) {
    case WaitMode::kManifest:
      return "manifest";
    case WaitMode::kFileLock:
      return "file-lock";
    case WaitMode::kStore:
      return "c10d-store";
  }
  return "unknown";
}

namespace {
thread_local WaitInterrupt* innermost_interrupt = nullptr;
}  // namespace

WaitInterrupt::WaitInterrupt(std::function<Status()> check)
    : check_(std::move(check)), outer_(innermost_interrupt) {
  innermost_interrupt = this;
}

WaitInterrupt::~WaitInterrupt() { innermost_interrupt = outer_; }

Status WaitInterrupt::Check() {
  WaitInterrupt* in = innermost_interrupt;
  if (in == nullptr || !in->check_) return OkStatus();
  if (in->stopped_.ok()) in->stopped_ = in->check_();
  return in->stopped_;
}

bool Backoff::Wait() {
  using Clock = std::chrono::steady_clock;
  Clock::time_point now = Clock::now();
  const bool expired = now >= deadline_;
  const Clock::time_point wake =
      expired ? now : now + std::min<Clock::duration>(delay_, deadline_ - now);
  while (true) {
    interrupted_ = WaitInterrupt::Check();
    if (!interrupted_.ok() || expired) return false;
    if (now >= wake) break;
    std::this_thread::sleep_for(
        std::min<Clock::duration>(wake - now, std::chrono::milliseconds(50)));
    now = Clock::now();
  }
  delay_ = std::min(delay_ * 2, max_delay_);
  return true;
}

Status Backoff::Stopped(Status timed_out) const {
  return interrupted_.ok() ? timed_out : interrupted_;
}

std::chrono::steady_clock::time_point DeadlineAfter(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point now = Clock::now();
  if (timeout.count() <= 0) return now;
  if (timeout >=
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now))
    return Clock::time_point::max();
  return now + timeout;
}

Status Coordinator::SaveTimedOut(int64_t step, std::chrono::milliseconds timeout) const {
  return Status(Code::kDeadlineExceeded,
                "timed out after " + std::to_string(timeout.count()) +
                    " ms waiting for rank 0 to commit step " + std::to_string(step) +
                    " (wait mode " + std::string(WaitModeName(mode())) +
                    "); check that rank 0 is alive and saving, or raise the timeout");
}

Status Coordinator::WaitSaved(int64_t step, std::string_view attempt,
                              std::chrono::milliseconds timeout) {
  Backoff backoff(DeadlineAfter(timeout));
  while (true) {
    auto done = PollSaved(step, attempt);
    if (done.ok() && *done) return OkStatus();
    if (!done.ok() && !Transient(done.status())) return done.status();
    if (!backoff.Wait()) {
      if (done.ok()) return backoff.Stopped(SaveTimedOut(step, timeout));
      return backoff.Stopped(done.status().WithContext(
          "still failing at the deadline (" + std::to_string(timeout.count()) +
          " ms) of waiting for rank 0 to commit step " + std::to_string(step)));
    }
  }
}

namespace {

constexpr std::string_view kSaveFormat = "ckptio-save";
constexpr std::string_view kDecisionFormat = "ckptio-decision";

// Names this process in the save records it writes (field "proc"), so that
// a record of the job from another process, even one with the same host
// name and pid (a container's), is told apart: its pid and 32 random bits,
// made anew in a forked child. Lock-free (a fork may come at any time), and
// every thread of a process gets the same tag.
std::string ProcessTag() {
  static std::atomic<uint64_t> tag{0};
  const auto pid = static_cast<uint32_t>(::getpid());
  uint64_t now = tag.load();
  if (now == 0 || static_cast<uint32_t>(now >> 32) != pid) {
    uint32_t random = 0;
    if (::getrandom(&random, sizeof random, GRND_NONBLOCK) != sizeof random)
      random = static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    const uint64_t mine = static_cast<uint64_t>(pid) << 32 | random;
    if (tag.compare_exchange_strong(now, mine)) now = mine;  // else `now` is the winner's
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(now));
  return buf;
}

class FileCoordinator : public Coordinator {
 public:
  FileCoordinator(std::shared_ptr<StorageBackend> backend, RankInfo rank, WaitMode mode)
      : backend_(std::move(backend)),
        store_(backend_),
        rank_(std::move(rank)),
        job_(HashBytes(rank_.job_id).Hex().substr(0, 16)),
        mode_(mode) {}

  WaitMode mode() const override { return mode_; }

  // This rank's own storage calls, not rank 0's failure read from its
  // record (which keeps rank 0's code, UNAVAILABLE included, and is final).
  bool Transient(const Status& s) const override {
    return s.code() == Code::kUnavailable && s.origin() == Status::Origin::kThisProcess;
  }

  Status Opened(std::string_view scope, std::chrono::milliseconds timeout) override {
    scope_ = std::string(scope);
    if (rank_.rank != 0) return OkStatus();
    if (rank_.world_size > 1) CKPTIO_RETURN_IF_ERROR(RefuseReusedJobId());
    SweepOtherJobsDecisions();
    if (rank_.world_size < 2) return OkStatus();
    if (mode_ == WaitMode::kFileLock)
      CKPTIO_RETURN_IF_ERROR(TakeSaveLock(timeout, "as the Checkpointer opens"));
    // The record this Checkpointer replaces (its "open" record here, or its
    // first save's record in manifest mode) may end a save of this job's
    // previous Checkpointer whose waiters have not read it yet: carry its
    // outcome on.
    auto replaced = ReadRecord(kSaveRecordKey, kSaveFormat);
    if (replaced.ok() && Field(*replaced, "job") == job_ &&
        (Field(*replaced, "state") == "committed" || Field(*replaced, "state") == "failed"))
      Remember(Field(*replaced, "step"), Field(*replaced, "attempt"), Field(*replaced, "state"),
               Field(*replaced, "code"), Field(*replaced, "message"));
    if (mode_ != WaitMode::kFileLock) return OkStatus();
    return WriteRecord("", scope_ + ".0", "open", OkStatus());
  }

  Status BeginSave(int64_t step, std::string_view attempt,
                   std::chrono::milliseconds timeout) override {
    // File lock: taken as the Checkpointer opens (or at its first save) and
    // held until it goes (see PollSaved), but taken again if it was lost
    // (an NFS lease that ran out while rank 0 was cut off from the server).
    if (mode_ == WaitMode::kFileLock && save_lock_) {
      auto held = backend_->IsLocked(kSaveLockKey);
      if (held.ok() && !*held) save_lock_.reset();
    }
    if (mode_ == WaitMode::kFileLock && !save_lock_)
      CKPTIO_RETURN_IF_ERROR(TakeSaveLock(timeout, "for step " + std::to_string(step)));
    return WriteRecord(std::to_string(step), attempt, "saving", OkStatus());
  }

  Status EndSave(int64_t step, std::string_view attempt, const Status& outcome) override {
    Status s =
        WriteRecord(std::to_string(step), attempt, outcome.ok() ? "committed" : "failed", outcome);
    // The next record carries this outcome: a waiter that reads the record
    // only after rank 0 began its next save still learns it.
    Remember(std::to_string(step), attempt, outcome.ok() ? "committed" : "failed",
             std::to_string(static_cast<int>(outcome.code())), Capped(outcome.message()));
    return s;
  }

  Result<bool> PollSaved(int64_t step, std::string_view attempt) override {
    // The record first, then the store: a record of a later attempt was
    // written after this attempt ended, so its commit, if any, shows below.
    auto record = ReadRecord(kSaveRecordKey, kSaveFormat);
    CKPTIO_ASSIGN_OR_RETURN(bool committed, IsCommitted(step, attempt, record));
    if (committed) return true;
    if (record.ok()) CKPTIO_RETURN_IF_ERROR(Ended(*record, step, attempt));
    // File lock: rank 0 gone for good (its last record is final)?
    CKPTIO_ASSIGN_OR_RETURN(auto last, LastRecordIfRankZeroGone(Scope(attempt), record));
    if (!last) return false;
    CKPTIO_ASSIGN_OR_RETURN(committed, IsCommitted(step, attempt, *last));
    if (committed) return true;
    CKPTIO_RETURN_IF_ERROR(Ended(*last, step, attempt));
    const std::string at = Field(*last, "attempt"), state = Field(*last, "state");
    const bool inside = at == attempt && state == "saving";    // died inside this save
    const bool before = at != attempt && !Later(at, attempt);  // before beginning it
    if (!(inside || before)) return false;
    std::string why = "released the save lock without committing";
    if (before && state == "open")
      why = "released the save lock before its first save: it died, or closed its Checkpointer";
    else if (before)
      why = "released the save lock before it began this save (its last save, of step " +
            Field(*last, "step") + ", " + (state == "saving" ? "unfinished" : state) +
            "): it died, or closed its Checkpointer";
    return WriterDied("committing step " + std::to_string(step), *last, why);
  }

  Status Publish(const std::string& name, const std::string& payload) override {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(name));
    const std::string record =
        SerializeRecord(kDecisionFormat, {{"job", job_}, {"name", name}, {"payload", payload}});
    // A waiter would never accept a larger record: refuse it here, so the
    // publisher fails at once (and can publish its error instead).
    if (record.size() > kMaxDecisionBytes)
      return Status(Code::kResourceExhausted,
                    "cannot publish \"" + name + "\": its record is " +
                        std::to_string(record.size()) + " bytes, over the " +
                        std::to_string(kMaxDecisionBytes) +
                        "-byte limit of a coordination record (wait mode " +
                        std::string(WaitModeName(mode_)) + ")");
    return WriteSmall(*backend_, DecisionKey(name), record, WriteMode::kReplace);
  }

  Result<std::string> WaitFor(const std::string& name, std::chrono::milliseconds timeout) override {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(name));
    Backoff backoff(DeadlineAfter(timeout));
    auto next_check = std::chrono::steady_clock::now();  // of rank 0's life (file lock)
    while (true) {
      auto decision = ReadDecision(name);
      if (decision.ok() && *decision) return **decision;
      const bool failing = !decision.ok();
      if (failing && !Transient(decision.status())) return decision.status();
      if (!failing && std::chrono::steady_clock::now() >= next_check) {
        next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
        CKPTIO_ASSIGN_OR_RETURN(auto published, PublisherGone(name));
        if (published) return *published;
      }
      if (!backoff.Wait()) {
        if (failing)
          return backoff.Stopped(decision.status().WithContext(
              "still failing at the deadline (" + std::to_string(timeout.count()) +
              " ms) of waiting for \"" + name + "\""));
        return backoff.Stopped(Status(
            Code::kDeadlineExceeded,
            "timed out after " + std::to_string(timeout.count()) + " ms waiting for \"" + name +
                "\" to be published (wait mode " + std::string(WaitModeName(mode_)) + ")"));
      }
    }
  }

  Status Retract(const std::string& name) override {
    CKPTIO_RETURN_IF_ERROR(ValidateKey(name));
    Status s = backend_->Delete(DecisionKey(name));
    return s.code() == Code::kNotFound ? OkStatus() : s;
  }

 private:
  using Record = std::map<std::string, std::string>;

  Status TakeSaveLock(std::chrono::milliseconds timeout, const std::string& when) {
    Backoff backoff(DeadlineAfter(timeout));
    while (true) {
      auto lock = backend_->TryLock(kSaveLockKey, LockMode::kExclusive);
      if (lock.ok()) {
        save_lock_ = std::move(*lock);
        return OkStatus();
      }
      if (lock.status().code() != Code::kFailedPrecondition)
        return lock.status().WithContext("taking the save lock " + when);
      if (!backoff.Wait())
        return backoff.Stopped(lock.status().WithContext("taking the save lock " + when));
    }
  }

  // File lock: rank 0's last record if rank 0 of `scope` is gone for good:
  // `record` and the one returned are of that scope, written holding the
  // save lock (from rank 0's Opened or first save on), and nobody was on the
  // lock before or after the second was read (so it is not a record of a
  // rank 0 that took a lost lock again meanwhile). Waiters only test the
  // lock, never take it, so they never keep rank 0 from it.
  Result<std::optional<Record>> LastRecordIfRankZeroGone(std::string_view scope,
                                                         const Result<Record>& record) {
    const std::optional<Record> not_gone;
    if (mode_ != WaitMode::kFileLock || !record.ok() || !UnderLock(*record, scope)) return not_gone;
    auto held = [&]() -> Result<bool> {
      auto r = backend_->IsLocked(kSaveLockKey);
      if (!r.ok() && r.status().code() == Code::kUnimplemented)
        return r.status().WithContext(
            "the file-lock wait mode tests rank 0's save lock: use the manifest wait mode");
      return r;
    };
    CKPTIO_ASSIGN_OR_RETURN(bool locked, held());
    if (locked) return not_gone;
    auto last = ReadRecord(kSaveRecordKey, kSaveFormat);
    if (!last.ok()) return not_gone;
    CKPTIO_ASSIGN_OR_RETURN(locked, held());
    if (locked || !UnderLock(*last, scope)) return not_gone;
    return std::optional<Record>(*std::move(last));
  }

  // Rank 0 of several, before it writes anything: refuses a job id that
  // another process used on this store before (the message says what
  // repeats one; in this process, a Checkpointer on the same store under
  // another URI also gives a load decision away), whose records the other
  // ranks would take for this launch's: a load decision, a commit. The evidence:
  // rank 0's save record of this job written by another process, or a load
  // decision of the Checkpointer now opening, which has made none yet. Best
  // effort: a record it cannot read proves nothing.
  Status RefuseReusedJobId() {
    std::string evidence;
    auto record = ReadRecord(kSaveRecordKey, kSaveFormat);
    if (record.ok() && Field(*record, "job") == job_ && Field(*record, "proc") != ProcessTag()) {
      evidence = std::string(kSaveRecordKey) + " is rank 0's record of this job from another " +
                 "process (" + Field(*record, "host") + ", pid " + Field(*record, "pid") +
                 ", attempt " + Field(*record, "attempt") + ")";
    } else if (auto keys = backend_->List(DecisionKey(scope_ + "-load-")); keys.ok()) {
      for (const std::string& key : *keys) {
        auto decision = ReadRecord(key, kDecisionFormat, kMaxDecisionBytes);
        if (decision.ok() && Field(*decision, "job") == job_) {
          evidence = key + " is a load decision of the Checkpointer now opening (" + scope_ +
                     "), which has made none yet (or this process opened another Checkpointer "
                     "on this store under another URI)";
          break;
        }
      }
    }
    if (evidence.empty()) return OkStatus();
    return Status(Code::kFailedPrecondition,
                  "job id \"" + rank_.job_id + "\" was used before on " + backend_->Uri() + ": " +
                      evidence +
                      ". The other ranks would take that launch's records for this one's. Every "
                      "launch, and every program a launch runs in turn, needs its own job id (a "
                      "CKPTIO_JOB_ID, ckptio-launch --job-id or torchrun --rdzv-id used again "
                      "repeats one, as do an elastic torchrun re-rendezvous and a second program "
                      "in one launch or Slurm step): export CKPTIO_JOB_ID=$(date +%s%N) per "
                      "program, give each torchrun launch its own --rdzv-id, or use wait mode "
                      "c10d-store, whose records live in the trainer's c10d store");
  }

  // Rank 0, holding the store's writer lock (so no other job's rank 0 can
  // publish here any more): deletes the decision records of other jobs,
  // which relaunches would otherwise pile up in .coord/. Best effort: what
  // a failing storage keeps is swept at a later Open.
  void SweepOtherJobsDecisions() {
    auto keys = backend_->List(kDecisionPrefix);
    if (!keys.ok()) return;
    for (const std::string& key : *keys) {
      auto record = ReadRecord(key, kDecisionFormat, kMaxDecisionBytes);
      if (record.ok() && Field(*record, "job") != job_) (void)backend_->Delete(key);
    }
  }

  // The payload published under `name` for this job; nullopt while there
  // is none (absent, torn, another job's). Over the size limit is final (a
  // publisher refuses such a record; a rewrite would not shrink it in time).
  Result<std::optional<std::string>> ReadDecision(const std::string& name) {
    auto record = ReadRecord(DecisionKey(name), kDecisionFormat, kMaxDecisionBytes);
    if (record.ok() && Field(*record, "job") == job_ && record->count("payload"))
      return std::optional<std::string>(Field(*record, "payload"));
    if (!record.ok() && record.status().code() != Code::kNotFound &&
        record.status().code() != Code::kDataLoss)
      return record.status();
    return std::optional<std::string>();
  }

  // A waiting rank's check on rank 0 in WaitFor (file lock, after Opened):
  // if rank 0 is gone, the payload it published before it let the save lock
  // go (read again now), or ABORTED. nullopt while rank 0 may still publish,
  // or when the check itself failed: it only ever shortens a wait, never
  // turns a storage hiccup into a failure. Rank 0 waits only for receipts.
  Result<std::optional<std::string>> PublisherGone(const std::string& name) {
    const std::optional<std::string> waiting;
    if (mode_ != WaitMode::kFileLock || scope_.empty() || rank_.rank == 0) return waiting;
    auto last = LastRecordIfRankZeroGone(scope_, ReadRecord(kSaveRecordKey, kSaveFormat));
    if (!last.ok() && last.status().code() == Code::kUnimplemented) return last.status();
    if (!last.ok() || !*last) return waiting;
    auto decision = ReadDecision(name);
    if (!decision.ok()) return waiting;
    if (*decision) return decision;
    return WriterDied("publishing its decision \"" + name + "\"", **last,
                      "released the save lock: it died, or closed its Checkpointer");
  }

  static Status WriterDied(const std::string& before, const Record& last, const std::string& why) {
    return Status(Code::kAborted, "writer died before " + before + ": rank 0 (" +
                                      Field(last, "host") + ", pid " + Field(last, "pid") + ") " +
                                      why +
                                      "; the newest committed checkpoint is intact: restart the "
                                      "job to resume from it")
        .WithCause(Cause::kWriterDied);
  }

  // A decision record may carry a stripe receipt, which lists every chunk
  // and tensor of a rank's part: as large as a manifest may be.
  static constexpr size_t kMaxDecisionBytes = kMaxManifestBytes;
  static constexpr const char* kRankZeroFailed = "rank 0 failed to save step ";

  // Rank 0's failure, with its code, as every waiter reports it (fields
  // "code" and "message", or "prev_code" and "prev_message", together the
  // text EncodeStatus makes). A code that is missing, damaged or OK (a
  // failure must have one) becomes INTERNAL.
  static Status Failure(const std::map<std::string, std::string>& r, const std::string& prefix,
                        int64_t step) {
    auto msg = r.find(prefix + "message");
    const std::string message = kRankZeroFailed + std::to_string(step) + ": " +
                                (msg == r.end() ? "(no message)" : msg->second);
    const std::string code = Field(r, prefix + "code");
    std::optional<Status> sent;
    if (code.find_first_not_of("0123456789") == std::string::npos)  // digits only
      sent = DecodeStatus(code + ":" + message);
    if (!sent || sent->ok()) return Status(Code::kInternal, message).FromPeer();
    return *sent;
  }

  // OK while rank 0 may still commit `attempt` of `step`. Rank 0's failure
  // if the record says it failed; once the record is a later attempt's
  // (rank 0 is past this one, which then did not commit): its failure if
  // the record still carries it, else an error saying the outcome was
  // overwritten.
  Status Ended(const std::map<std::string, std::string>& r, int64_t step,
               std::string_view attempt) {
    if (Field(r, "job") != job_) return OkStatus();
    if (Mine(r, step, attempt) && Field(r, "state") == "failed") return Failure(r, "", step);
    if (Field(r, "prev_attempt") == attempt && Field(r, "prev_step") == std::to_string(step)) {
      if (Field(r, "prev_state") == "failed") return Failure(r, "prev_", step);
      // Committed, yet not seen as committed here: not yet visible, or gone.
      auto reader = store_.OpenStep(step);
      if (!reader.ok() && reader.status().code() == Code::kNotFound)
        return Status(Code::kNotFound, "rank 0 committed step " + std::to_string(step) +
                                           ", but it is no longer in the store: retention "
                                           "(keep_last) removed it before this rank looked");
      return OkStatus();
    }
    if (!Later(Field(r, "attempt"), attempt)) return OkStatus();
    return Status(Code::kAborted,
                  "rank 0 went on to a later save (" + Field(r, "attempt") + ") and step " +
                      std::to_string(step) + " is not in the store as this save's (" +
                      std::string(attempt) +
                      ") commit: it failed (rank 0's log has the error; its record was replaced "
                      "before this rank read it), or it was committed and already removed by "
                      "retention (keep_last)");
  }

  static std::string Field(const std::map<std::string, std::string>& r, const std::string& key) {
    auto it = r.find(key);
    return it == r.end() ? std::string() : it->second;
  }

  // The scope S of an attempt "S.<k>": one Checkpointer of the job.
  static std::string_view Scope(std::string_view attempt) {
    return attempt.substr(0, attempt.rfind('.'));
  }
  bool OfScope(const Record& r, std::string_view scope) const {
    return Field(r, "job") == job_ && Scope(Field(r, "attempt")) == scope;
  }
  // Written by rank 0 of Checkpointer `scope` holding the save lock.
  bool UnderLock(const Record& r, std::string_view scope) const {
    return OfScope(r, scope) && Field(r, "lock") == "held";
  }

  // "<scope>.<k>" of the same scope with a larger k.
  static bool Later(std::string_view a, std::string_view than) {
    const size_t i = a.rfind('.'), j = than.rfind('.');
    if (i == std::string_view::npos || j == std::string_view::npos ||
        a.substr(0, i) != than.substr(0, j))
      return false;
    auto number = [](std::string_view d) -> std::optional<uint64_t> {
      if (d.empty() || d.size() > 18 || d.find_first_not_of("0123456789") != std::string_view::npos)
        return std::nullopt;
      return std::stoull(std::string(d));
    };
    auto x = number(a.substr(i + 1)), y = number(than.substr(j + 1));
    return x && y && *x > *y;
  }

  // Whether rank 0's record says `attempt` of `step` is over and not
  // failed: committed (as this save's, or the last one's outcome), or rank 0
  // is past it (a manifest it left then stays). A record of another job or
  // Checkpointer (scope) says nothing of this save: then true, and the
  // manifest alone decides.
  bool SaysFinal(const std::map<std::string, std::string>& r, int64_t step,
                 std::string_view attempt) const {
    if (!OfScope(r, Scope(attempt))) return true;
    if (Mine(r, step, attempt)) return Field(r, "state") == "committed";
    if (Field(r, "prev_step") == std::to_string(step) && Field(r, "prev_attempt") == attempt)
      return Field(r, "prev_state") == "committed";
    return Later(Field(r, "attempt"), attempt);
  }

  bool Mine(const std::map<std::string, std::string>& r, int64_t step,
            std::string_view attempt) const {
    return Field(r, "job") == job_ && Field(r, "step") == std::to_string(step) &&
           Field(r, "attempt") == attempt && !Field(r, "state").empty();
  }

  // Committed means: LATEST (opened and read) is at or past `step`, and the
  // step's own manifest opens and names `attempt` (a step saved before, or
  // by another try, is not this save's commit). LATEST moves only once the
  // commit is durable; a step below the one LATEST names (a save after a
  // load fell back past a damaged newer step) does not move it, and its
  // manifest shows before the commit is final (the folder's fsync can still
  // fail and undo it): then rank 0's record must also say it committed.
  Result<bool> IsCommitted(int64_t step, std::string_view attempt,
                           const Result<std::map<std::string, std::string>>& record) {
    auto latest = store_.ReadLatest();
    if (!latest.ok()) {
      // A LATEST being replaced is never torn (atomic rename); a damaged one
      // is rank 0's problem to report.
      if (latest.status().code() == Code::kDataLoss) return false;
      if (latest.status().code() == Code::kNotFound) return false;  // no store yet
      return latest.status();
    }
    if (!latest->has_value() || (*latest)->step < step) return false;
    if ((*latest)->step > step && !(record.ok() && SaysFinal(*record, step, attempt))) return false;
    auto reader = store_.OpenStep(step);
    if (reader.ok()) {
      const auto& meta = (*reader)->manifest().metadata;
      auto it = meta.find(kSaveAttemptKey);
      return it != meta.end() && it->second == attempt;
    }
    if (reader.status().code() == Code::kNotFound) return false;
    return reader.status();
  }

  // A message as a save record carries it: waiters read at most
  // kMaxRecordBytes (64 KiB), and the record holds two (this save's and the
  // last), each escaped to at most 6 times its size.
  static std::string Capped(const std::string& message) {
    constexpr size_t kMax = 4 << 10;
    if (message.size() <= kMax) return message;
    size_t cut = kMax;
    while (cut > 0 && (static_cast<unsigned char>(message[cut]) & 0xC0) == 0x80) --cut;
    return message.substr(0, cut) + " [... " + std::to_string(message.size() - cut) +
           " more bytes in rank 0's log]";
  }

  // NotFound when absent, DataLoss when damaged (or torn), ResourceExhausted
  // when over `max_bytes`.
  Result<std::map<std::string, std::string>> ReadRecord(std::string_view key,
                                                        std::string_view format,
                                                        size_t max_bytes = kMaxRecordBytes) {
    CKPTIO_ASSIGN_OR_RETURN(std::string bytes,
                            ReadSmall(*backend_, key, max_bytes, Code::kResourceExhausted));
    return ParseRecord(bytes, format, backend_->Uri() + "/" + std::string(key), max_bytes);
  }

  // A save's outcome, for the prev_* fields of the records that follow.
  void Remember(const std::string& step, std::string_view attempt, const std::string& state,
                const std::string& code, const std::string& message) {
    previous_ = {{"prev_step", step},
                 {"prev_attempt", std::string(attempt)},
                 {"prev_state", state},
                 {"prev_code", code},
                 {"prev_message", message}};
  }

  // `step` is empty in the "open" record (rank 0's Opened).
  Status WriteRecord(const std::string& step, std::string_view attempt, const std::string& state,
                     const Status& outcome) {
    Record fields = previous_;
    fields.insert({{"job", job_},
                   {"step", step},
                   {"attempt", std::string(attempt)},
                   {"state", state},
                   {"host", HostName()},
                   {"pid", std::to_string(::getpid())},
                   {"proc", ProcessTag()},
                   {"code", std::to_string(static_cast<int>(outcome.code()))},
                   {"message", Capped(outcome.message())}});
    if (save_lock_) fields["lock"] = "held";
    return WriteSmall(*backend_, kSaveRecordKey, SerializeRecord(kSaveFormat, fields),
                      WriteMode::kReplace);
  }

  std::shared_ptr<StorageBackend> backend_;
  Store store_;
  RankInfo rank_;
  std::string job_;  // hash of the job id: records of other launches never match
  WaitMode mode_;
  std::string scope_;  // named by Opened: WaitFor then tests rank 0's life (file lock)
  std::unique_ptr<BackendLock> save_lock_;
  std::map<std::string, std::string> previous_;  // rank 0: prev_* fields, the last outcome
};

}  // namespace

Result<std::unique_ptr<Coordinator>> NewFileCoordinator(std::shared_ptr<StorageBackend> backend,
                                                        const RankInfo& rank, WaitMode mode) {
  CKPTIO_RETURN_IF_ERROR(rank.Validate());
  if (mode == WaitMode::kStore)
    return Status(Code::kInvalidArgument,
                  "wait mode c10d-store needs the trainer's c10d::Store (see ckptio/torch.h)");
  if (rank.world_size > 1 && rank.job_id.empty())
    return Status(Code::kInvalidArgument,
                  "file-based coordination of " + std::to_string(rank.world_size) +
                      " ranks needs a job id shared by all ranks of this launch: run under "
                      "torchrun, ckptio-launch, Slurm or mpirun, or set CKPTIO_JOB_ID");
  if (rank.world_size > 1 && rank.job_id_reused)
    return Status(Code::kInvalidArgument,
                  "file-based coordination needs a job id that the next launch will not repeat, "
                  "and \"" +
                      rank.job_id +
                      "\" (torchrun's static rendezvous: its master "
                      "address) would: an earlier launch's records would pass for this one's. Set "
                      "CKPTIO_JOB_ID fresh per launch (export CKPTIO_JOB_ID=$(date +%s%N)), run "
                      "torchrun with --rdzv-id, or use wait mode c10d-store");
  return std::unique_ptr<Coordinator>(
      std::make_unique<FileCoordinator>(std::move(backend), rank, mode));
}

}  // namespace ckptio
