// Coordination: how the ranks of a job learn that rank 0 committed a step,
// and agree on decisions (which step to load).
//
// Rank 0 calls BeginSave(step, attempt), writes and commits the checkpoint
// with the attempt in its manifest (metadata kSaveAttemptKey), then
// EndSave(step, attempt, outcome). Every other rank calls WaitSaved(step,
// attempt) (or polls PollSaved) and returns only once the step is committed
// by this attempt, with rank 0's error if its save failed, or with an error
// when rank 0 died or the deadline passed. No rank ever sees a step before
// it is committed: "committed" is read from the store itself (LATEST, then
// the step's manifest, which must name the attempt), never from a signal
// alone.
//
// The attempt names one save of the job, the same on every rank without
// talking (the Checkpointer counts its saves; see ckptio/torch.h): an
// earlier failed try of the same step, or a step already in the store, is
// never taken for this save's outcome, so every rank returns what rank 0
// returns.
//
// Modes:
//   kManifest  waiters poll LATEST by opening and reading it (never stat or
//              mtime, which lie on NFS), backing off from 1 ms to 50 ms.
//   kFileLock  rank 0 holds an exclusive fcntl lock on <store>/.save-lock from
//              its Checkpointer's Open (or first save) until the Checkpointer
//              is gone, writing its save records under it. Waiters never take the
//              lock (fcntl locks are not fair: many waiters taking it in turn
//              could starve rank 0); once rank 0's record is of their
//              Checkpointer they test it (F_GETLK; NFS: LOCKT, v3 lease). If
//              free, rank 0 died, closed the Checkpointer or lost the lock (an
//              NFS lease ran out), in a save, between saves or before its first
//              decision: they fail at once ("writer died before ..."), not at
//              the deadline. Rank 0 takes the lock and writes its first record
//              as its Checkpointer opens (Opened); a waiter that began before
//              that record is durable waits as in kManifest until it is.
//   kStore     a c10d::Store (e.g. the trainer's TCPStore) carries the outcome;
//              see ckptio/torch.h.
// Records live in <store>/.coord/ and carry the job id (RankInfo::job_id), so
// records of an earlier launch are never mistaken for this one's; a job id
// the next launch repeats (RankInfo::job_id_reused), or used before, is refused. Each
// save record also carries rank 0's previous outcome, so a waiter that reads
// it only after rank 0 began its next save still learns how its save ended.
#ifndef CKPTIO_COORDINATION_H_
#define CKPTIO_COORDINATION_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "ckptio/backend.h"
#include "ckptio/export.h"
#include "ckptio/rank.h"
#include "ckptio/status.h"

namespace ckptio {

enum class WaitMode { kManifest, kFileLock, kStore };
CKPTIO_EXPORT std::string_view WaitModeName(
    WaitMode mode);  // "manifest", "file-lock", "c10d-store"

// The manifest metadata entry in which rank 0 records the save attempt that
// committed the step (written when the job has several ranks).
inline constexpr char kSaveAttemptKey[] = "ckptio.save_attempt";

// now + timeout, saturating: milliseconds::max() waits for ever instead of
// overflowing into the past.
CKPTIO_EXPORT std::chrono::steady_clock::time_point DeadlineAfter(
    std::chrono::milliseconds timeout);

// Ending waits early (the Python package ends them on Ctrl-C). While a
// WaitInterrupt lives on a thread, every wait of ckptio on that thread (for
// rank 0's commit or decision, the save lock, the store's writer lock)
// calls `check` between its polls, at least every 50 ms, and ends with the
// first non-OK status it returns. An ended wait leaves things as a deadline
// would: a waiting rank changed nothing, a save never commits half a step.
// Sticky: once `check` failed, Check() returns that status without calling
// it again. Instances nest (the innermost is used); not movable.
class CKPTIO_EXPORT WaitInterrupt {
 public:
  explicit WaitInterrupt(std::function<Status()> check);
  ~WaitInterrupt();
  WaitInterrupt(const WaitInterrupt&) = delete;
  WaitInterrupt& operator=(const WaitInterrupt&) = delete;

  // The innermost WaitInterrupt of this thread: its status; OK without one.
  static Status Check();

 private:
  std::function<Status()> check_;
  Status stopped_;
  WaitInterrupt* outer_;
};

class CKPTIO_EXPORT Coordinator {
 public:
  virtual ~Coordinator() = default;
  virtual WaitMode mode() const = 0;

  // Every rank, once, as its Checkpointer opens: `scope` names it (attempts
  // "<scope>.<k>"). Rank 0 (holding the store's writer lock by then) refuses
  // a job id used before, deletes other jobs' decision records, and with the
  // file lock and several ranks takes the save lock (waiting up to `timeout`)
  // and records that, so the others learn of its death while they wait for
  // its first decision. Without Opened: the lock comes at the first save.
  virtual Status Opened(std::string_view scope, std::chrono::milliseconds timeout) {
    (void)scope, (void)timeout;
    return OkStatus();
  }

  // `attempt`: the save's name, the same on every rank ([A-Za-z0-9._-]).
  // Rank 0, before writing `step`.
  virtual Status BeginSave(int64_t step, std::string_view attempt,
                           std::chrono::milliseconds timeout) = 0;
  // Rank 0, after: publishes the outcome (OK means committed).
  virtual Status EndSave(int64_t step, std::string_view attempt, const Status& outcome) = 0;

  // Other ranks, once: true when `step` is committed by `attempt`, false
  // while it is pending; rank 0's failure or death is returned as an error.
  virtual Result<bool> PollSaved(int64_t step, std::string_view attempt) = 0;
  // Other ranks: PollSaved until true, an error, or the deadline
  // (DeadlineExceeded naming the step, the mode and rank 0). A Transient
  // error is polled past; if the last poll before the deadline failed so,
  // that error is returned.
  virtual Status WaitSaved(int64_t step, std::string_view attempt,
                           std::chrono::milliseconds timeout);
  // Whether an error of one poll may not recur at the next: the storage not
  // answering for a moment (a timed-out NFS call, a lock connection being
  // replaced) says nothing of rank 0's save. No error is, by default.
  virtual bool Transient(const Status&) const { return false; }
  // WaitSaved's DeadlineExceeded: names the step, the mode and rank 0.
  Status SaveTimedOut(int64_t step, std::chrono::milliseconds timeout) const;

  // Rank 0 publishes `payload` under `name`; the others wait for it (file
  // lock, after Opened: ABORTED at once if rank 0 is gone without it).
  virtual Status Publish(const std::string& name, const std::string& payload) = 0;
  virtual Result<std::string> WaitFor(const std::string& name,
                                      std::chrono::milliseconds timeout) = 0;
  // Rank 0, once every rank is past `name` (read it, or stopped waiting for
  // it): deletes it, so that a long job's records do not pile up. Absent is
  // not an error. A rank still waiting for it would wait to its deadline.
  virtual Status Retract(const std::string& name) = 0;
  // A rank other than 0, once, after WaitFor(name) returned a record that
  // every rank but 0 reads (a load decision). Where the medium counts
  // readers atomically (the c10d store; its save outcomes likewise), the
  // last reader deletes the record; the file modes keep it (Retract, or the
  // next launch, removes it).
  virtual void Consumed(const std::string& name) { (void)name; }
};

// kManifest or kFileLock coordination through the store at `backend`.
// InvalidArgument for kStore (see ckptio/torch.h), or when a job of several
// ranks has no job id, or one a relaunch repeats (set CKPTIO_JOB_ID).
CKPTIO_EXPORT Result<std::unique_ptr<Coordinator>> NewFileCoordinator(
    std::shared_ptr<StorageBackend> backend, const RankInfo& rank, WaitMode mode);

}  // namespace ckptio

#endif  // CKPTIO_COORDINATION_H_
