// Checkpointer: rank-0 saves, waiting ranks, agreed loads. This file glues
// the pieces: Open, the public methods (forwarding to Checkpointer::Impl,
// checkpointer_impl.h), Save (plain), the load decision and Load. The rest of
// Impl: striped_save.cc (SaveStripe), async_save.cc (SaveAsync, the
// constructor and destructor); what it works with:
// save_plan.h (what a save writes), load_stage.h and load_apply.h (what a
// load puts into the caller's state), one_liners.cc (ckptio::save / load).
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>

#include "ckptio/backends.h"
#include "ckptio/hash.h"
#include "ckptio/log.h"
#include "ckptio/torch.h"
#include "torch/c10d_store.h"
#include "torch/checkpointer_impl.h"
#include "torch/libtorch_errors.h"
#include "torch/load_apply.h"
#include "torch/load_stage.h"
#include "torch/save_plan.h"
#include "torch/state_items.h"
#include "torch/striped_save.h"

namespace ckptio {

namespace {

using internal::Apply;
using internal::ChooseStep;
using internal::ErrorPayload;
using internal::Guard;
using internal::OpenedStep;
using internal::Plan;
using internal::Ready;
using internal::SavePlan;
using internal::Stage;
using internal::Staged;
using internal::StripeGoName;
using internal::StripePart;
using internal::StripeReceiptName;
using internal::WritePlan;

using json = nlohmann::json;

// How long rank 0's Open waits for the store's writer lock and the save
// lock (a holder that just went may take a moment to let go).
std::chrono::milliseconds LockWait(const CheckpointerOptions& options) {
  return std::min<std::chrono::milliseconds>(options.timeout, std::chrono::seconds(30));
}

// "<16 hex of the job id's hash>.c<n>": the n-th Checkpointer of the job
// this rank opened on the coordination channel (the store for file-based
// modes, counted in this process; the c10d store for kStore, counted in the
// store itself, whose server can outlive a trainer's client objects, and an
// object's address, which may come again once it is freed, differently on
// each rank, is no name for it); a job of one rank: c0, nobody to agree
// with. Two Checkpointers of one job (model and EMA, on one store or two
// sharing a TCPStore) never read each other's records or keys, and one
// opened on some ranks only (rank 0's "best model" store) shifts no other
// channel's count. Tells `coordinator` (Opened); a file-based count is kept
// only if that succeeds.
Result<std::string> OpenScope(const RankInfo& rank, const CheckpointerOptions& options,
                              const std::string& store_uri, Coordinator& coordinator) {
  const std::string job = HashBytes(rank.job_id).Hex().substr(0, 16);
  auto opened = [&](const std::string& scope) -> Result<std::string> {
    CKPTIO_RETURN_IF_ERROR(coordinator.Opened(scope, LockWait(options)));
    return scope;
  };
  if (rank.world_size == 1) return opened(job + ".c0");
  if (options.wait.mode() == WaitMode::kStore) {
    try {
      const int64_t n = options.wait.c10d_store()->store->add(
          "ckptio/opened/" + job + "/" + std::to_string(rank.rank), 1);
      return opened(job + ".c" + std::to_string(n));
    } catch (const std::exception& e) {
      const std::string text = e.what();  // (LibTorch appends a stack trace)
      return Status(Code::kUnavailable, "c10d store: counting this rank's Checkpointers: " +
                                            text.substr(0, text.find('\n')));
    }
  }
  static std::mutex mu;
  static auto* counts = new std::map<std::string, uint64_t>;  // never destroyed
  const std::string key = std::to_string(rank.rank) + '\0' + job + '\0' + store_uri;
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(mu);
    n = ++(*counts)[key];
  }
  // Only rank 0's Opened can fail (taking the save lock), and its writer
  // lock keeps any other Open of this key out until this one returns.
  auto scope = opened(job + ".c" + std::to_string(n));
  if (!scope.ok()) {
    std::lock_guard<std::mutex> lock(mu);
    --(*counts)[key];
  }
  return scope;
}

}  // namespace

Result<std::unique_ptr<Checkpointer>> Checkpointer::Open(std::string_view uri, const RankInfo& rank,
                                                         CheckpointerOptions options) {
  CKPTIO_RETURN_IF_ERROR(rank.Validate());
  // (A wait of 0 ms would end before any rank could answer; LibTorch's
  // c10d takes 0 for "wait for ever".)
  if (options.timeout.count() <= 0)
    return Status(Code::kInvalidArgument,
                  "CheckpointerOptions::timeout is " + std::to_string(options.timeout.count()) +
                      " ms; it bounds every wait, so it must be at least 1 ms");
  auto c = std::make_unique<Impl>();
  c->rank_ = rank;
  c->options_ = std::move(options);
  std::shared_ptr<StorageBackend> shared = c->options_.backend;
  if (!shared) {
    CKPTIO_ASSIGN_OR_RETURN(auto backend, BuiltinBackends().Open(uri));
    shared = std::move(backend);
  }
  c->store_ = std::make_unique<Store>(shared);
  const WaitOn& wait = c->options_.wait;
  if (wait.mode() == WaitMode::kStore) {
    if (!wait.c10d_store()->store)
      return Status(Code::kInvalidArgument,
                    "WaitOn::C10dStore was given no store: pass the trainer's c10d store "
                    "(its TCPStore)");
    CKPTIO_ASSIGN_OR_RETURN(c->coordinator_, NewC10dCoordinator(wait.c10d_store()->store, rank));
  } else {
    CKPTIO_ASSIGN_OR_RETURN(c->coordinator_, NewFileCoordinator(shared, rank, wait.mode()));
  }
  if (rank.rank == 0) {
    WriterOptions wo;
    wo.keep_last = c->options_.keep_last;
    wo.chunk_size = c->options_.chunk_size;
    wo.world_size = rank.world_size;
    wo.saving_rank = 0;
    wo.lock_wait = LockWait(c->options_);
    CKPTIO_ASSIGN_OR_RETURN(c->writer_, c->store_->OpenWriter(wo));
  }
  // Last: an Open that fails counts on no rank.
  CKPTIO_ASSIGN_OR_RETURN(c->scope_, OpenScope(rank, c->options_, shared->Uri(), *c->coordinator_));
  return std::unique_ptr<Checkpointer>(new Checkpointer(std::move(c)));
}

Checkpointer::Checkpointer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpointer::~Checkpointer() = default;
const RankInfo& Checkpointer::rank() const { return impl_->rank_; }
Store& Checkpointer::store() { return *impl_->store_; }
Status Checkpointer::Save(int64_t step, const State& state) { return impl_->Save(step, state); }
std::future<Status> Checkpointer::SaveAsync(int64_t step, const State& state) {
  return impl_->SaveAsync(step, state);
}
Result<LoadResult> Checkpointer::Load(State& state, const LoadOptions& options) {
  return impl_->Load(state, options);
}

Status Checkpointer::Impl::ConfirmCommitted(int64_t step) {
  // A signal alone is never trusted: the step's manifest must open.
  auto reader = store_->OpenStep(step);
  if (reader.ok()) return OkStatus();
  return reader.status().WithContext("rank 0 reported step " + std::to_string(step) +
                                     " committed, but it does not open here");
}

std::string Checkpointer::Impl::NextAttempt() { return scope_ + "." + std::to_string(++save_seq_); }

Status Checkpointer::Impl::PublishDecision(const std::string& name, const std::string& payload) {
  CKPTIO_RETURN_IF_ERROR(coordinator_->Publish(name, payload));
  if (options_.stripe) decisions_.push_back(name);  // only a striped save retracts them
  return OkStatus();
}

Status Checkpointer::Impl::Abandon(int64_t step, const std::string& attempt, Status error) {
  if (rank_.world_size == 1) return error;
  if (rank_.rank == 0) {
    if (options_.stripe) (void)coordinator_->Publish(StripeGoName(attempt), ErrorPayload(error));
    (void)coordinator_->EndSave(step, attempt, error);
  } else if (options_.stripe) {  // rank 0 waits for this rank's part
    (void)coordinator_->Publish(StripeReceiptName(attempt, rank_.rank), ErrorPayload(error));
  }
  return error;
}

Status Checkpointer::Impl::Save(int64_t step, const State& state) {
  const std::string attempt = NextAttempt();  // first: every rank counts every call
  Status previous = Ready(FinishAsync(), state, /*saving=*/true);
  if (!previous.ok()) return Abandon(step, attempt, previous);
  return SaveNow(step, attempt, PlanFor(state));
}

SavePlan Checkpointer::Impl::PlanFor(const State& state) const {
  if (options_.stripe && rank_.world_size > 1)
    return StripePart(Plan(state), rank_.rank, rank_.world_size);
  return rank_.rank == 0 ? Plan(state) : SavePlan();
}

Status Checkpointer::Impl::SaveNow(int64_t step, const std::string& attempt, const SavePlan& plan) {
  if (options_.stripe && rank_.world_size > 1) return SaveStripe(step, attempt, plan);
  const std::string what = rank_.ToString() + ": save of step " + std::to_string(step);
  if (rank_.rank != 0) {
    CKPTIO_RETURN_IF_ERROR(
        coordinator_->WaitSaved(step, attempt, options_.timeout).WithContext(what));
    return ConfirmCommitted(step).WithContext(what);
  }
  // A job of one rank has nobody to tell.
  const bool coordinate = rank_.world_size > 1;
  if (coordinate) {
    Status began = coordinator_->BeginSave(step, attempt, options_.timeout);
    if (!began.ok()) return Abandon(step, attempt, began.WithContext(what));
  }
  Status outcome = [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(auto pending, writer_->Begin(step));
    CKPTIO_RETURN_IF_ERROR(WritePlan(*pending, plan));
    if (coordinate) CKPTIO_RETURN_IF_ERROR(pending->SetMetadata(kSaveAttemptKey, attempt));
    auto info = pending->Commit();
    if (!info.ok()) return info.status();
    if (!info->retention.ok())
      Log(LogLevel::kWarning, info->retention.ToString());  // the save stands
    return OkStatus();
  }();
  Status published = coordinate ? coordinator_->EndSave(step, attempt, outcome) : OkStatus();
  CKPTIO_RETURN_IF_ERROR(outcome.WithContext(what));
  return published.WithContext(what + " committed, but telling the other ranks failed");
}

namespace {
// `replace`: a reason cut inside a UTF-8 sequence must not throw.
std::string DecisionText(const json& decision) {
  return decision.dump(-1, ' ', false, json::error_handler_t::replace);
}
}  // namespace

// Rank 0 picks the step (newest that verifies, or the one asked for) and
// publishes it; every rank gets the same answer, errors included. Rank 0
// keeps the step it verified in *verified, so the load reads it only once.
Result<LoadResult> Checkpointer::Impl::Decide(const std::string& name, const LoadOptions& options,
                                              std::unique_ptr<OpenedStep>* verified) {
  json decision;
  if (rank_.rank == 0) {
    decision = [&]() -> json {
      auto chosen = ChooseStep(*store_, options.step);
      if (!chosen.ok())
        return {{"code", static_cast<int>(chosen.status().code())},
                {"message", chosen.status().message()}};
      if (!chosen->has_value()) return {{"none", true}};
      json skipped = json::array();
      for (const auto& [step, why] : (*chosen)->choice.skipped) skipped.push_back({step, why});
      *verified = std::move((*chosen)->opened);
      return {{"step", (*chosen)->choice.step}, {"skipped", skipped}};
    }();
    if (rank_.world_size > 1) CKPTIO_RETURN_IF_ERROR(PublishDecision(name, DecisionText(decision)));
  } else {
    auto payload = coordinator_->WaitFor(name, options_.timeout);
    if (!payload.ok()) {
      // The wait names the record; the user needs to know whose it is.
      const bool late = payload.status().code() == Code::kDeadlineExceeded;
      return payload.status().WithContext(
          late ? "rank 0 did not say which step to load in time: check that rank 0 is alive and "
                 "calling Load (every rank loads together), or raise the timeout"
               : "waiting for rank 0 to say which step to load");
    }
    coordinator_->Consumed(name);
    decision = json::parse(*payload, nullptr, /*allow_exceptions=*/false);
    if (decision.is_discarded())
      return Status(Code::kDataLoss, "rank 0's load decision is not valid JSON");
  }
  try {
    if (decision.contains("none")) return LoadResult();
    if (decision.contains("code")) {
      // Rank 0's error, range-checked like every Status that travels.
      std::optional<Code> code = CodeFromNumber(decision["code"].get<int64_t>());
      if (!code || *code == Code::kOk)
        return Status(Code::kDataLoss, "rank 0's load decision holds no error code");
      Status failed(*code, decision["message"].get<std::string>());
      return rank_.rank == 0 ? failed : failed.FromPeer();
    }
    LoadResult r;
    r.step = decision["step"].get<int64_t>();
    for (const auto& s : decision["skipped"])
      r.skipped.emplace_back(s[0].get<int64_t>(), s[1].get<std::string>());
    return r;
  } catch (const json::exception& e) {
    return Status(Code::kDataLoss, std::string("rank 0's load decision is malformed: ") + e.what());
  }
}

Result<LoadResult> Checkpointer::Impl::Load(State& state, const LoadOptions& options) {
  const std::string what = rank_.ToString() + ": load";
  // Named first: every rank counts every call, whatever happens next.
  const std::string decision = scope_ + "-load-" + std::to_string(++load_seq_);
  Status previous = Ready(FinishAsync(), state, /*saving=*/false);
  if (!previous.ok()) {
    if (rank_.rank == 0 && rank_.world_size > 1)  // the others wait for a decision: this one
      (void)PublishDecision(decision, DecisionText({{"code", static_cast<int>(previous.code())},
                                                    {"message", previous.message()}}));
    return previous;
  }
  std::unique_ptr<OpenedStep> opened;
  auto decided = Decide(decision, options, &opened);
  if (!decided.ok()) return decided.status().WithContext(what);
  if (!decided->step) return decided;  // a fresh start
  const LoadResult& r = *decided;
  const int64_t step = *r.step;
  for (const auto& [skipped, why] : r.skipped)
    Log(LogLevel::kWarning, rank_.ToString() + ": " + SkippedStepWarning(skipped, step, why));
  // Not rank 0 (which holds the step open): the step rank 0 chose and
  // verified can be gone before this rank reads it, and this rank may not
  // pick another.
  auto gone = [&]() {
    return Status(Code::kNotFound,
                  what + ": step " + std::to_string(step) + " of " + store_->uri() +
                      ", which rank 0 chose and verified, was removed before this rank read "
                      "it: rank 0 went on to a save whose retention (keep_last) or a gc "
                      "retired it. Have a collective (a barrier, or a training step) between "
                      "the load and the next save on every rank, or raise keep_last");
  };
  if (!opened) {
    auto reader = store_->OpenStep(step);
    if (!reader.ok())
      return reader.status().code() == Code::kNotFound ? gone() : reader.status().WithContext(what);
    opened = std::make_unique<OpenedStep>();
    opened->reader = std::move(*reader);
  }
  Staged staged;
  Status s = Guard(what, [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(
        staged, Stage(*opened, state, options.map_location, rank_, options.other_tensors));
    decided->tensors = std::move(staged.other_tensors);
    return options.before_apply ? options.before_apply(staged.metadata, *decided) : OkStatus();
  });
  if (!s.ok() && s.code() == Code::kNotFound && rank_.rank != 0 &&
      store_->OpenStep(step).status().code() == Code::kNotFound)
    return gone();
  if (!s.ok()) return s.WithContext(what + " of step " + std::to_string(step));
  CKPTIO_RETURN_IF_ERROR(
      Apply(staged, state).WithContext(what + " of step " + std::to_string(step)));
  return decided;
}

}  // namespace ckptio
