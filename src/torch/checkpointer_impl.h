// What is behind a Checkpointer (internal to ckptio_torch). The public
// methods forward here (checkpointer.cc); the rest is spread by seam:
//   checkpointer.cc   Open, Save (plain), the load decision and Load
//   striped_save.cc   SaveStripe (every rank writes its part)
//   async_save.cc     SaveAsync, and the background save's end
#ifndef CKPTIO_SRC_TORCH_CHECKPOINTER_IMPL_H_
#define CKPTIO_SRC_TORCH_CHECKPOINTER_IMPL_H_

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "ckptio/coordination.h"
#include "ckptio/store.h"
#include "ckptio/torch.h"

namespace ckptio {

namespace internal {
struct AsyncSave;
struct OpenedStep;
struct SavePlan;
}  // namespace internal

struct Checkpointer::Impl {
  Impl();
  ~Impl();  // waits for the background save

  Status Save(int64_t step, const State& state);
  std::future<Status> SaveAsync(int64_t step, const State& state);
  Result<LoadResult> Load(State& state, const LoadOptions& options);

  Status ConfirmCommitted(int64_t step);
  // Waits for an in-flight SaveAsync; its error, the first time only.
  Status FinishAsync();
  // The next save's attempt (see ckptio/coordination.h): scope_ and the
  // number of save calls so far, the same on every rank.
  std::string NextAttempt();
  // Rank 0, a save that ends before it began: tells the other ranks (its
  // error as the attempt's outcome), and returns `error`.
  Status Abandon(int64_t step, const std::string& attempt, Status error);
  Status SaveNow(int64_t step, const std::string& attempt, const internal::SavePlan& plan);
  Status SaveStripe(int64_t step, const std::string& attempt, const internal::SavePlan& plan);
  // What this rank writes of `state`: everything on rank 0 of a plain save,
  // its part of a striped one, nothing otherwise.
  internal::SavePlan PlanFor(const State& state) const;
  Result<LoadResult> Decide(const std::string& name, const LoadOptions& options,
                            std::unique_ptr<internal::OpenedStep>* verified);
  // Rank 0: publishes load decision `name` and remembers it until a striped
  // save shows that every rank is past it.
  Status PublishDecision(const std::string& name, const std::string& payload);
  // Rank 0, once every rank delivered its receipt for `attempt`: deletes
  // that save's records and the load decisions published before it.
  void RetractStripeRecords(const std::string& attempt);

  RankInfo rank_;
  CheckpointerOptions options_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<StoreWriter> writer_;  // rank 0 only
  std::unique_ptr<Coordinator> coordinator_;
  // Names this Checkpointer's saves and load decisions in the job: a hash
  // of the job id and how many Checkpointers of the job this rank opened
  // before on the same store (or c10d store); every rank opens them in the
  // same order.
  std::string scope_;
  uint64_t load_seq_ = 0;
  uint64_t save_seq_ = 0;
  std::vector<std::string> decisions_;          // rank 0: published, not yet retracted
  std::unique_ptr<internal::AsyncSave> async_;  // last: joined first
};

}  // namespace ckptio

#endif  // CKPTIO_SRC_TORCH_CHECKPOINTER_IMPL_H_
