// The striped save: every rank writes its part of the step's tensors, rank 0
// checks each rank's receipt against its own split and commits once all are
// in; and the records the ranks exchange for it.
#include "torch/striped_save.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "ckptio/log.h"
#include "ckptio/torch.h"
#include "torch/checkpointer_impl.h"
#include "torch/libtorch_errors.h"
#include "torch/save_plan.h"
#include "torch/tensors.h"

namespace ckptio {

namespace internal {

std::string StripeGoName(const std::string& attempt) { return "stripe-go-" + attempt; }
std::string StripeReceiptName(const std::string& attempt, int r) {
  return "stripe-" + attempt + "-" + std::to_string(r);
}

constexpr std::string_view kErrorPrefix = "error:";

std::string ErrorPayload(const Status& s) { return std::string(kErrorPrefix) + EncodeStatus(s); }

std::optional<Status> PayloadError(const std::string& payload) {
  if (payload.rfind(kErrorPrefix, 0) != 0) return std::nullopt;
  std::optional<Status> sent = DecodeStatus(std::string_view(payload).substr(kErrorPrefix.size()));
  // A damaged failure, or one without an error code, is still a failure.
  if (!sent || sent->ok())
    return Status(Code::kInternal, "unreadable failure \"" + payload.substr(0, 200) + "\"")
        .FromPeer();
  return sent;
}

}  // namespace internal

namespace {

using internal::ErrorPayload;
using internal::Guard;
using internal::PayloadError;
using internal::SavePlan;
using internal::StripeGoName;
using internal::StripeReceiptName;

// "F32 [90, 4]": a tensor's dtype and shape, for messages.
std::string Layout(const std::string& dtype, const std::vector<int64_t>& shape) {
  std::string out = dtype + " [";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// OK if rank `r`'s receipt holds exactly the tensors rank 0's split gave
// its part objects (name, dtype, shape). Ranks whose layouts differ split
// differently: committing their parts could hold a tensor twice and
// another not at all, and the step would load on no rank.
Status CheckStripeTensors(const SavePlan& plan, const StripeReceipt& receipt, int r) {
  const std::string prefix = "ranks do not hold the same state: rank " + std::to_string(r) + "'s ";
  std::map<std::pair<std::string, std::string>, const SavePlan::Expected*> want;
  for (const auto& o : receipt.objects) {
    auto it = plan.stripe_tensors.find(o.name);
    if (it == plan.stripe_tensors.end()) continue;  // an unexpected object: refused later
    for (const auto& e : it->second) want[{o.name, e.name}] = &e;
  }
  for (const TensorEntry& t : receipt.tensors) {
    auto it = want.find({t.object, t.name});
    if (it == want.end())
      return Status(Code::kInvalidArgument, prefix + "part " + t.object + " holds tensor " +
                                                t.name + " (" + Layout(t.dtype, t.shape) +
                                                "), which rank 0's split does not put there");
    const SavePlan::Expected& e = *it->second;
    if (t.dtype != e.dtype || t.shape != e.shape)
      return Status(Code::kInvalidArgument, prefix + "part " + t.object + " holds tensor " +
                                                t.name + " as " + Layout(t.dtype, t.shape) +
                                                ", where rank 0 has " + Layout(e.dtype, e.shape));
    want.erase(it);
  }
  if (!want.empty())
    return Status(Code::kInvalidArgument,
                  prefix + "part " + want.begin()->first.first + " lacks tensor " +
                      want.begin()->first.second + " (" +
                      Layout(want.begin()->second->dtype, want.begin()->second->shape) +
                      "), which rank 0's split puts there");
  return OkStatus();
}

// A rank's wait for rank 0's go-ahead to a striped save, in slices with a
// poll of the save between them, so that rank 0's death (file-lock mode) or
// failure, or its going on past this save, ends the wait at once rather
// than at the deadline.
Result<std::string> WaitForGo(Coordinator& c, int64_t step, const std::string& attempt,
                              std::chrono::milliseconds timeout) {
  constexpr std::chrono::milliseconds kSlice{500};
  const auto deadline = DeadlineAfter(timeout);
  while (true) {
    CKPTIO_RETURN_IF_ERROR(WaitInterrupt::Check());  // (WaitFor's may not be ABORTED)
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      return Status(Code::kDeadlineExceeded, "timed out after " + std::to_string(timeout.count()) +
                                                 " ms (wait mode " +
                                                 std::string(WaitModeName(c.mode())) + ")");
    auto go = c.WaitFor(StripeGoName(attempt), std::min(left, kSlice));
    const Code code = go.status().code();
    if (go.ok() || (code != Code::kDeadlineExceeded && code != Code::kAborted)) return go;
    // The save's own account first: rank 0's failure, or its death (file
    // lock, which WaitFor also reports) in words of this step.
    auto polled = c.PollSaved(step, attempt);
    if (!polled.ok() && !c.Transient(polled.status())) return polled.status();
    if (code == Code::kAborted) return go;
  }
}

}  // namespace

// Every rank's receipt for `attempt` means every rank read the go-ahead and
// returned from each load it began before this save (each rank makes the
// same calls in the same order). Best effort: a record left behind only
// takes space.
void Checkpointer::Impl::RetractStripeRecords(const std::string& attempt) {
  (void)coordinator_->Retract(StripeGoName(attempt));
  for (int r = 1; r < rank_.world_size; ++r)
    (void)coordinator_->Retract(StripeReceiptName(attempt, r));
  for (const auto& name : decisions_) (void)coordinator_->Retract(name);
  decisions_.clear();
}

// A striped save, in order:
//   1. rank 0 takes the save (coordination), begins the step (clearing a
//      torn attempt at it) and publishes "go" (or its error);
//   2. every other rank writes its part objects into the step, each
//      committed durably, and publishes its receipt (or its error);
//   3. rank 0 writes its own part, the optimizers and the metadata, adds
//      every receipt (each part object must be there, with its size), and
//      commits; the other ranks return once the step is committed.
// The records are named by the save's attempt, so a retry of the same step
// never reads an earlier attempt's receipts.
Status Checkpointer::Impl::SaveStripe(int64_t step, const std::string& attempt,
                                      const SavePlan& plan) {
  const std::string what = rank_.ToString() + ": striped save of step " + std::to_string(step);
  const std::string go = StripeGoName(attempt);
  auto receipt_of = [&](int r) { return StripeReceiptName(attempt, r); };
  if (rank_.rank != 0) {
    auto started = WaitForGo(*coordinator_, step, attempt, options_.timeout);
    if (!started.ok())  // rank 0, late, must not wait for this rank's part in turn
      return Abandon(step, attempt,
                     started.status().WithContext(what + ": waiting for rank 0 to begin the step"));
    if (auto e = PayloadError(*started))
      return e->WithContext(what + ": rank 0 could not begin the step");
    Status wrote = [&]() -> Status {
      CKPTIO_ASSIGN_OR_RETURN(auto stripe,
                              store_->BeginStripe(step, rank_.rank, options_.chunk_size));
      for (const auto& to : plan.tensor_objects)
        CKPTIO_RETURN_IF_ERROR(Guard("saving " + to.item, [&] {
          return WriteSafetensors(*stripe, to.object, to.tensors, to.devices);
        }));
      CKPTIO_ASSIGN_OR_RETURN(StripeReceipt receipt, stripe->Finish());
      return coordinator_->Publish(receipt_of(rank_.rank), SerializeStripeReceipt(receipt));
    }();
    if (!wrote.ok()) {
      (void)coordinator_->Publish(receipt_of(rank_.rank), ErrorPayload(wrote));
      return wrote.WithContext(what);
    }
    CKPTIO_RETURN_IF_ERROR(
        coordinator_->WaitSaved(step, attempt, options_.timeout).WithContext(what));
    return ConfirmCommitted(step).WithContext(what);
  }
  Status began = coordinator_->BeginSave(step, attempt, options_.timeout);
  if (!began.ok()) return Abandon(step, attempt, began.WithContext(what));
  bool every_receipt = false;
  Status outcome = [&]() -> Status {
    auto pending = writer_->Begin(step);
    CKPTIO_RETURN_IF_ERROR(
        coordinator_->Publish(go, pending.ok() ? "ok" : ErrorPayload(pending.status())));
    if (!pending.ok()) return pending.status();
    (*pending)->ExpectStripes();  // abandoned, the step is cleared whole
    // Every receipt is collected even when a part failed, so that no rank
    // is still writing into the step when it is abandoned (the parts
    // received are deleted with it), and a retry starts clean.
    Status first = WritePlan(**pending, plan);
    if (first.ok()) first = (*pending)->SetMetadata(kSaveAttemptKey, attempt);
    std::set<std::string> expected = plan.stripes;
    const auto deadline = DeadlineAfter(options_.timeout);
    every_receipt = true;
    for (int r = 1; r < rank_.world_size; ++r) {
      const std::string whose = "rank " + std::to_string(r) + "'s stripe";
      Status s = [&]() -> Status {
        const auto left = std::max(std::chrono::milliseconds(1),
                                   std::chrono::duration_cast<std::chrono::milliseconds>(
                                       deadline - std::chrono::steady_clock::now()));
        auto payload = coordinator_->WaitFor(receipt_of(r), left);
        if (!payload.ok()) {
          every_receipt = false;
          // (The wait's own message gives what was left of the deadline:
          // 1 ms for a rank after one that came late.)
          if (payload.status().code() == Code::kDeadlineExceeded)
            return Status(Code::kDeadlineExceeded,
                          "timed out waiting for " + whose + ": none came within " +
                              std::to_string(options_.timeout.count()) +
                              " ms (CheckpointerOptions::timeout) of rank 0 writing its own "
                              "part; is rank " +
                              std::to_string(r) + " alive, and saving step " +
                              std::to_string(step) + "?");
          return payload.status().WithContext("waiting for " + whose);
        }
        if (auto e = PayloadError(*payload)) return e->WithContext(whose + " failed");
        CKPTIO_ASSIGN_OR_RETURN(StripeReceipt receipt, ParseStripeReceipt(*payload, whose));
        if (receipt.rank != r || receipt.step != step)
          return Status(Code::kDataLoss, whose + ": the receipt is rank " +
                                             std::to_string(receipt.rank) + "'s, for step " +
                                             std::to_string(receipt.step));
        // Added first, so that the part is deleted with the step if refused.
        CKPTIO_RETURN_IF_ERROR((*pending)->AddStripe(receipt));
        CKPTIO_RETURN_IF_ERROR(CheckStripeTensors(plan, receipt, r));
        for (const auto& o : receipt.objects)
          if (expected.erase(o.name) == 0)
            return Status(Code::kInvalidArgument,
                          whose + " holds " + o.name +
                              ", which its part does not name: do all ranks save the same state?");
        return OkStatus();
      }();
      if (first.ok()) first = s;
    }
    CKPTIO_RETURN_IF_ERROR(first);
    if (!expected.empty())
      return Status(Code::kInvalidArgument,
                    "no rank delivered " + *expected.begin() +
                        ": do all ranks save the same state with stripe on?");
    auto info = (*pending)->Commit();
    if (!info.ok()) return info.status();
    if (!info->retention.ok()) Log(LogLevel::kWarning, info->retention.ToString());
    return OkStatus();
  }();
  Status published = coordinator_->EndSave(step, attempt, outcome);
  if (every_receipt) RetractStripeRecords(attempt);
  CKPTIO_RETURN_IF_ERROR(outcome.WithContext(what));
  return published.WithContext(what + " committed, but telling the other ranks failed");
}

}  // namespace ckptio
