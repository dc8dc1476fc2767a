// The Checkpointer's save that returns before the commit: SaveAsync (the
// state staged into reused memory, written on a background thread). Impl's
// constructor and destructor are here too: the background save is the only
// thing a Checkpointer must end.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ckptio/log.h"
#include "ckptio/torch.h"
#include "copy.h"
#include "torch/checkpointer_impl.h"
#include "torch/libtorch_errors.h"
#include "torch/save_plan.h"
#include "torch/state_items.h"

namespace ckptio {

namespace {

using internal::ArchiveOptimizer;
using internal::CheckNames;
using internal::Guard;
using internal::Ready;
using internal::SavePlan;

// The contiguous CPU tensors copied into the staging buffer, whose tensors
// over those copies are made by the thread that writes them: 10,000 of them
// cost the caller 7 ms as from_blob calls. Shapes and dtypes are taken while
// the caller waits (the caller may change its tensors once it returns), the
// shapes into one vector (one allocation per tensor cost 1-2 ms more).
struct StagedViews {
  struct View {
    size_t object, index;  // plan.tensor_objects[object].tensors[index]
    uint64_t offset;       // in the staging buffer
    size_t dims, rank;     // its shape: dims[dims .. dims + rank)
    torch::ScalarType dtype;
  };
  std::vector<View> views;
  std::vector<int64_t> dims;

  void Clear() {  // keeps the capacity: the next save reuses it
    views.clear();
    dims.clear();
  }
  void Add(size_t object, size_t index, uint64_t offset, const torch::Tensor& t) {
    const auto shape = t.sizes();
    views.push_back({object, index, offset, dims.size(), shape.size(), t.scalar_type()});
    dims.insert(dims.end(), shape.begin(), shape.end());
  }

  // Points each view's tensor of `plan` at its copy in `base`.
  Status Make(char* base, SavePlan& plan) const {
    return Guard("staging", [&] {
      for (const View& v : views)
        plan.tensor_objects[v.object].tensors[v.index].second =
            torch::from_blob(base + v.offset, c10::IntArrayRef(dims.data() + v.dims, v.rank),
                             torch::TensorOptions().dtype(v.dtype));
      return OkStatus();
    });
  }
};

}  // namespace

// The staging memory and the thread of SaveAsync.
struct internal::AsyncSave {
  torch::Tensor staging;  // uint8; reused from save to save
  // What the staging copies, and the views the writing thread makes of the
  // copies: reused too (in a fresh process the first touch of new memory
  // costs a fault per page; 10,000 tensors' worth cost the caller 1.5 ms).
  std::vector<CopyJob> memcpys;
  StagedViews views;
  std::thread worker;
  // Whether the worker is still at work, for a caller that waits for it
  // in slices (see FinishAsync).
  std::mutex mu;
  std::condition_variable finished;
  bool running = false;
  int64_t step = 0;
  std::string attempt;      // of the save in the background
  Status result;            // the worker's outcome, read after join
  bool unreported = false;  // result not yet returned by a later call
  bool warned = false;      // the "too large for staging" warning, once
  // Set as the Checkpointer closes: a waiting rank's background wait ends
  // (rank 0's save is finished).
  std::atomic<bool> closing{false};
  // Set while a later call of the caller's, waiting for the worker, was
  // interrupted: a waiting rank's background wait ends.
  std::atomic<bool> interrupted{false};
  // Bytes of the optimizers' archives at the last save that made them (a
  // lower bound when they did not fit): a save whose tensors and archives
  // would not fit again is synchronous before anything is copied.
  uint64_t archive_bytes = 0;
};

Checkpointer::Impl::Impl() : async_(std::make_unique<internal::AsyncSave>()) {}

Checkpointer::Impl::~Impl() {
  async_->closing = true;
  if (async_->worker.joinable()) async_->worker.join();
}

Status Checkpointer::Impl::FinishAsync() {
  internal::AsyncSave& as = *async_;
  if (as.worker.joinable()) {
    // A rank other than 0 may be waiting in the background for rank 0's
    // commit, up to the deadline: this wait for it ends with this thread's
    // WaitInterrupt (Ctrl-C in Python), as the waits of a save do, and
    // ends the background wait too (rank 0's save is always finished).
    Status stop;
    std::unique_lock<std::mutex> g(as.mu);
    while (as.running && stop.ok()) {
      as.finished.wait_for(g, std::chrono::milliseconds(50));
      if (!as.running || rank_.rank == 0) continue;
      g.unlock();  // the check may run Python's signal handlers
      stop = WaitInterrupt::Check();
      g.lock();
    }
    g.unlock();
    if (!stop.ok()) as.interrupted = true;
    as.worker.join();
    as.interrupted = false;
    if (!stop.ok()) {
      as.unreported = false;  // the abandoned save's outcome is on its future
      return stop;
    }
  }
  if (!as.unreported) return OkStatus();
  as.unreported = false;
  // A rank other than 0 whose background wait ran out of time: rank 0 may
  // have committed since. Returning the stale error would take this rank
  // out of the next call's agreement (a Load that rank 0 makes alone), so
  // it looks once more. (Not when the deadline was rank 0's: its failure.)
  if (rank_.rank != 0 && as.result.code() == Code::kDeadlineExceeded &&
      as.result.origin() == Status::Origin::kThisProcess) {
    auto committed = coordinator_->PollSaved(as.step, as.attempt);
    if (committed.ok() && *committed) {
      Log(LogLevel::kWarning, "the asynchronous save of step " + std::to_string(as.step) +
                                  " was committed by rank 0 after this rank stopped waiting for "
                                  "it (its future says DEADLINE_EXCEEDED); going on");
      return OkStatus();
    }
  }
  return as.result.WithContext("the asynchronous save of step " + std::to_string(as.step) +
                               " failed");
}

std::future<Status> Checkpointer::Impl::SaveAsync(int64_t step, const State& state) {
  const std::string attempt = NextAttempt();  // first: every rank counts every call
  // Shared with the worker thread, and kept here should it fail to start.
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  Status previous = FinishAsync();
  if (!previous.ok()) {
    promise->set_value(Abandon(step, attempt, previous));
    return future;
  }
  internal::AsyncSave& as = *async_;
  as.step = step;
  as.attempt = attempt;
  // A save that ends here (an error, or too large to stage) is reported
  // like one that ends in the background: on the future and the next call.
  auto done_now = [&](Status s) {
    as.result = s;
    as.unreported = !s.ok();
    promise->set_value(std::move(s));
    return std::move(future);
  };
  if (Status names = CheckNames(state, /*saving=*/true); !names.ok())
    return done_now(Abandon(step, attempt, names));
  SavePlan plan = PlanFor(state);
  // Filled by the staging below: the tensors whose views the writing
  // thread makes, and where.
  StagedViews& views = as.views;
  views.Clear();
  char* base = nullptr;
  {
    // Staging: every tensor copied, 64-byte aligned, into one reused buffer.
    constexpr uint64_t kAlign = 64;
    uint64_t need = 0;
    bool cuda = false;
    for (const auto& to : plan.tensor_objects)
      for (const auto& [name, t] : to.tensors) {
        if (!t.defined()) continue;
        need = (need + kAlign - 1) / kAlign * kAlign + t.nbytes();
        cuda = cuda || t.is_cuda();
      }
    // Too large to stage (`what` says how much): the call saves synchronously.
    auto save_now = [&](const std::string& what) {
      if (!as.warned)
        Log(LogLevel::kWarning,
            "SaveAsync of step " + std::to_string(step) + " needs " + what +
                ", over max_staging_bytes (" + std::to_string(options_.max_staging_bytes) +
                "): saving synchronously; raise CheckpointerOptions::max_staging_bytes to save "
                "in the background");
      as.warned = true;
      return done_now(SaveNow(step, attempt, plan));
    };
    if (need > options_.max_staging_bytes)
      return save_now(std::to_string(need) + " bytes of tensor staging");
    // The tensors' buffer is kept from save to save: the archives get what
    // it leaves, even when this save stages fewer tensors, or none.
    const uint64_t tensor_staging =
        std::max<uint64_t>(need, as.staging.defined() ? as.staging.numel() : 0);
    const std::string tensor_bytes = std::to_string(tensor_staging) + " bytes of tensor staging";
    if (!plan.optimizers.empty() && as.archive_bytes > options_.max_staging_bytes - tensor_staging)
      return save_now(tensor_bytes + " and " + std::to_string(as.archive_bytes) +
                      " bytes of optimizer archives (as at the last save)");
    uint64_t archived = 0;
    bool archives_too_large = false;
    Status staged = Guard("staging the state of step " + std::to_string(step), [&]() -> Status {
      const bool pinned = cuda && torch::cuda::is_available();
      if (need > 0 && (!as.staging.defined() || static_cast<uint64_t>(as.staging.numel()) < need ||
                       (pinned && !as.staging.is_pinned()))) {
        as.staging = torch::Tensor();  // freed first: never the old and the new buffer at once
        as.staging =
            torch::empty({static_cast<int64_t>(std::max<uint64_t>(need, 1))},
                         torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(pinned));
      }
      base = need > 0 ? static_cast<char*>(as.staging.data_ptr()) : nullptr;
      uint64_t off = 0;
      torch::NoGradGuard no_grad;
      std::vector<CopyJob>& memcpys = as.memcpys;  // contiguous CPU tensors: on every core
      memcpys.clear();
      for (size_t o = 0; o < plan.tensor_objects.size(); ++o) {
        auto& tensors = plan.tensor_objects[o].tensors;
        for (size_t i = 0; i < tensors.size(); ++i) {
          torch::Tensor& t = tensors[i].second;
          if (!t.defined()) continue;
          off = (off + kAlign - 1) / kAlign * kAlign;
          if (t.device().is_cpu() && t.is_contiguous()) {
            memcpys.push_back({base + off, static_cast<const char*>(t.data_ptr()), t.nbytes()});
            views.Add(o, i, off, t);
          } else {  // from the GPU (into pinned memory), or strided
            torch::Tensor copy = torch::from_blob(base + off, t.sizes(),
                                                  torch::TensorOptions().dtype(t.scalar_type()));
            copy.copy_(t.detach());
            t = copy;
          }
          off += t.nbytes();
        }
      }
      ParallelCopy(memcpys);
      // The optimizers' archives take what the staging buffer left.
      const uint64_t held = as.staging.defined() ? static_cast<uint64_t>(as.staging.numel()) : 0;
      const uint64_t room =
          options_.max_staging_bytes > held ? options_.max_staging_bytes - held : 0;
      for (const auto& [object, optimizer] : plan.optimizers) {
        auto& pieces = plan.archives.emplace_back(SavePlan::Archive{object, {}}).pieces;
        Status archive = ArchiveOptimizer(*optimizer, object, [&](const void* d, size_t n) {
          archived += n;
          if (archived > room) {  // nothing more is kept (LibTorch writes on regardless)
            archives_too_large = true;
            return Status(Code::kResourceExhausted, "over max_staging_bytes");
          }
          // Small writes (zip headers) share a piece; a record's data is one.
          constexpr size_t kLarge = 64 << 10;
          if (n < kLarge && !pieces.empty() && pieces.back().size() < kLarge)
            pieces.back().append(static_cast<const char*>(d), n);
          else
            pieces.emplace_back(static_cast<const char*>(d), n);
          return OkStatus();
        });
        if (archives_too_large) {
          plan.archives.clear();
          break;
        }
        CKPTIO_RETURN_IF_ERROR(archive);
      }
      as.archive_bytes = archived;
      if (!archives_too_large) plan.optimizers.clear();
      return OkStatus();
    });
    if (!staged.ok()) return done_now(Abandon(step, attempt, staged));
    if (archives_too_large)  // saved synchronously, from the state as it is
      return save_now(tensor_bytes + " and at least " + std::to_string(archived) +
                      " bytes of optimizer archives");
  }
  // What the save writes, once its staged views are made (by the thread).
  auto staged = std::make_shared<SavePlan>(std::move(plan));
  auto write = [this, step, attempt, staged, base, &views] {
    Status s = views.Make(base, *staged);
    s = s.ok() ? SaveNow(step, attempt, *staged) : Abandon(step, attempt, s);
    // The plan freed before the outcome is told: the next call's join of
    // this thread then waits for nothing (10,000 tensors take milliseconds).
    *staged = SavePlan();
    views.Clear();
    return s;
  };
  try {
    as.running = true;  // (no worker runs now: FinishAsync joined it)
    as.worker = std::thread([this, step, write, promise] {
      // A rank that only waits for rank 0's commit has nothing to finish
      // when its Checkpointer closes (a trainer that gives up on Ctrl-C).
      WaitInterrupt closed([this, step] {
        if (rank_.rank == 0) return OkStatus();
        const std::string waiting =
            " while waiting for rank 0 to commit step " + std::to_string(step);
        if (async_->closing) return Status(Code::kAborted, "the Checkpointer was closed" + waiting);
        if (async_->interrupted)
          return Status(Code::kAborted, "the next call of this rank was interrupted" + waiting);
        return OkStatus();
      });
      Status s = write();
      async_->result = s;
      async_->unreported = !s.ok();
      promise->set_value(std::move(s));
      std::lock_guard<std::mutex> g(async_->mu);
      async_->running = false;
      async_->finished.notify_all();
    });
  } catch (const std::exception& e) {  // std::system_error (RLIMIT_NPROC), std::bad_alloc
    Log(LogLevel::kWarning, "SaveAsync of step " + std::to_string(step) +
                                " could not start its thread (" + e.what() +
                                "): saving synchronously");
    as.running = false;
    return done_now(write());
  }
  return future;
}

}  // namespace ckptio
