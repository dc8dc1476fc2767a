// Load apply: a staged load put into the caller's state (optimizers first,
// restored on failure; then modules and named tensors), and the checks
// WhyNotApplicable makes so that Stage refuses first what would fail here.
#include "torch/load_apply.h"

#include <ATen/MemoryOverlap.h>

#include <sstream>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "copy.h"
#include "torch/libtorch_errors.h"
#include "torch/pinned_copy.h"
#include "torch/state_key.h"

namespace ckptio::internal {

namespace {

// Whether `target` can take `loaded`'s bytes in place (copy_, set_): the
// same device and dtype, and dense. A sparse (or other non-strided) tensor
// has no storage of its own to take them; its data is replaced instead,
// which WhyNotApplicable refuses.
bool TakesInPlace(const torch::Tensor& target, const torch::Tensor& loaded) {
  return target.layout() == torch::kStrided && target.device() == loaded.device() &&
         target.dtype() == loaded.dtype();
}

// How ApplyTensors puts a loaded tensor into a module's: copied into the
// module's memory where that has the right place (byte for byte where both
// are contiguous on the CPU), else its data replaced.
bool CopiesInto(const torch::Tensor& target, const torch::Tensor& loaded) {
  return TakesInPlace(target, loaded) && target.sizes() == loaded.sizes();
}
bool MemcpysInto(const torch::Tensor& target, const torch::Tensor& loaded) {
  return CopiesInto(target, loaded) && target.device().is_cpu() && target.is_contiguous() &&
         !target.is_conj() && !target.is_neg() && loaded.is_contiguous();
}

// Whether ApplyTensors rebinds a named tensor to the loaded one: a tensor
// from .detach() or .data(), or an inference tensor, refuses set_ and
// set_data.
bool Rebinds(const torch::Tensor& target) {
  return !target.defined() || target.is_inference() ||
         !target.unsafeGetTensorImpl()->allow_tensor_metadata_change();
}
// Whether set_ can be done without the dispatcher (SetDirectly): a plain
// CPU tensor (a TensorImpl itself, no view, a leaf, no names, its dispatch
// keys those of the loaded tensor) taking a CPU tensor of its dtype. The
// dispatcher's set_ costs 0.3 us a tensor (3 ms of a 10,000-tensor load);
// this 0.05 us.
bool SetsDirectly(const torch::Tensor& target, const torch::Tensor& loaded) {
  const c10::TensorImpl& impl = *target.unsafeGetTensorImpl();
  return typeid(impl) == typeid(c10::TensorImpl) && loaded.device().is_cpu() &&
         impl.key_set() == loaded.unsafeGetTensorImpl()->key_set() &&
         TakesInPlace(target, loaded) && !target.is_view() && target.is_leaf() &&
         !target.has_names();
}

// What set_(loaded) does to such a tensor: its storage, sizes, strides and
// offset those of `loaded`, and its version bumped (set_ is an in-place
// change: a backward through the values it held is refused).
void SetDirectly(const torch::Tensor& target, const torch::Tensor& loaded) {
  c10::TensorImpl* impl = target.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(loaded.storage());
  impl->set_sizes_and_strides(loaded.sizes(), loaded.strides());
  impl->set_storage_offset(loaded.storage_offset());
  impl->bump_version();
}
}  // namespace

std::string WhyNotApplicable(const torch::Tensor& target, const torch::Tensor& loaded, bool named) {
  if (named ? Rebinds(target) : MemcpysInto(target, loaded)) return "";
  if (target.is_inference() && !c10::InferenceMode::is_enabled())
    return "is an inference tensor: load into it inside torch::InferenceMode, or into another";
  if (named ? TakesInPlace(target, loaded) : CopiesInto(target, loaded))  // set_, or copy_
    return !named && at::has_internal_overlap(target) == at::MemOverlap::Yes
               ? "has elements sharing memory (expanded): it cannot be loaded into"
               : "";
  if (target.requires_grad() && !loaded.is_floating_point() && !loaded.is_complex())
    return "requires grad, but the checkpoint's is " +
           std::string(c10::toString(loaded.scalar_type())) +
           ": load it into a tensor that does not require grad";
  if (!at::_has_compatible_shallow_copy_type(target, loaded))
    return "is a " + target.toString() + " tensor, which cannot take the checkpoint's " +
           loaded.toString() + " data";
  return "";
}

namespace {

void ApplyTensors(Staged& staged, State& state);

// LibTorch's Optimizer::load pairs state with parameters by position only:
// the state of another model's optimizer loads, and the next step() throws
// (or, for parameters of equal shapes in another order, trains on the wrong
// moments). Every per-parameter state tensor of the built-in optimizers
// must have its parameter's shape.
Status CheckOptimizerState(const torch::optim::Optimizer& opt) {
  namespace o = torch::optim;
  using Key = std::decay_t<decltype(opt.state())>::key_type;
  const auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& p = params[i];
      if (!p.defined()) continue;
      auto it = opt.state().find(internal::StateKey<Key>(p.unsafeGetTensorImpl()));
      if (it == opt.state().end()) continue;
      const o::OptimizerParamState* st = it->second.get();
      std::vector<torch::Tensor> per_param;
      if (auto* a = dynamic_cast<const o::AdamParamState*>(st))
        per_param = {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
      else if (auto* w = dynamic_cast<const o::AdamWParamState*>(st))
        per_param = {w->exp_avg(), w->exp_avg_sq(), w->max_exp_avg_sq()};
      else if (auto* sgd = dynamic_cast<const o::SGDParamState*>(st))
        per_param = {sgd->momentum_buffer()};
      else if (auto* r = dynamic_cast<const o::RMSpropParamState*>(st))
        per_param = {r->square_avg(), r->momentum_buffer(), r->grad_avg()};
      else if (auto* ada = dynamic_cast<const o::AdagradParamState*>(st))
        per_param = {ada->sum()};
      for (const torch::Tensor& t : per_param)
        if (t.defined() && t.sizes() != p.sizes())
          return Status(Code::kInvalidArgument,
                        "the optimizer's state for parameter " + std::to_string(i) + " of group " +
                            std::to_string(g) + " has shape " + ShapeStr(t.sizes().vec()) +
                            ", the parameter " + ShapeStr(p.sizes().vec()) +
                            ": the checkpoint's optimizer was made for other parameters (another "
                            "model, or the same in another order)");
    }
  }
  return OkStatus();
}

}  // namespace

Status Apply(Staged& staged, State& state) {
  std::vector<std::pair<torch::optim::Optimizer*, std::string>> backups;
  // LibTorch's load only adds and overwrites state entries, so every load
  // clears first: else state the archive lacks (a parameter with no step
  // yet when saved, or what a failed load installed) would stay.
  auto restore = [&] {
    std::string error;
    for (auto& [o, b] : backups) {
      try {
        o->state().clear();
        torch::serialize::InputArchive in;
        in.load_from(b.data(), b.size());
        o->load(in);
      } catch (const std::exception& e) {
        if (error.empty()) error = e.what();
      }
    }
    return error;
  };
  for (auto& staged_opt : staged.optimizers) {
    torch::optim::Optimizer* opt = staged_opt.target;
    Status s = Guard("loading optimizer " + staged_opt.name, [&] {
      std::ostringstream backup;
      {
        torch::serialize::OutputArchive out;
        opt->save(out);
        out.save_to(backup);
      }
      backups.emplace_back(opt, backup.str());
      torch::serialize::InputArchive in;
      in.load_from(staged_opt.bytes->data(), static_cast<size_t>(staged_opt.bytes->size()),
                   staged_opt.device);
      opt->state().clear();
      opt->load(in);
      return CheckOptimizerState(*opt);
    });
    if (!s.ok()) {
      const std::string restore_error = restore();
      return s.WithContext(
          restore_error.empty()
              ? "the checkpoint's optimizer state does not fit (optimizers restored, modules "
                "untouched)"
              : "the checkpoint's optimizer state does not fit, and restoring an optimizer's "
                "previous state failed too (" +
                    restore_error +
                    "): modules are untouched, but re-create the optimizers before training on");
    }
  }
  Status tensors = Guard("applying the loaded tensors", [&] {
    ApplyTensors(staged, state);
    return OkStatus();
  });
  if (tensors.ok()) return tensors;
  const std::string restore_error = restore();
  return tensors.WithContext(
      restore_error.empty()
          ? "the modules may be partly loaded (optimizers restored)"
          : "the modules may be partly loaded, and restoring an optimizer's previous state "
            "failed too (" +
                restore_error + ")");
}

namespace {

// The module and tensor part of Apply: nothing here is expected to fail
// (WhyNotApplicable follows its choices).
void ApplyTensors(Staged& staged, State& state) {
  torch::NoGradGuard no_grad;
  // Bytes written behind LibTorch's back count as an in-place change, as
  // copy_ would (autograd then refuses a backward through the old values).
  auto written = [](const torch::Tensor& t) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  };
  // First what talks to a GPU (the step least sure to succeed).
  for (auto& [target, loaded] : staged.into_gpu) {
    internal::CopyThroughPinned(loaded, target);
    written(target);
  }
  std::vector<CopyJob> memcpys;  // contiguous CPU parameters: copied on every core
  for (auto& [target, loaded] : staged.module_tensors) {
    // Into the module's own memory where it already has the right place:
    // no fresh allocation, and the parameter keeps its storage.
    if (CopiesInto(target, loaded)) {
      if (MemcpysInto(target, loaded)) {
        memcpys.push_back({static_cast<char*>(target.data_ptr()),
                           static_cast<const char*>(loaded.data_ptr()), target.nbytes()});
        written(target);
      } else {
        target.copy_(loaded);
      }
    } else {
      target.set_data(loaded);
    }
  }
  ParallelCopy(memcpys);
  // As torch::load: the caller's tensor stays the same tensor (an optimizer
  // holding it sees the loaded values) and keeps requires_grad.
  for (auto& [target, loaded] : staged.tensors) {
    if (Rebinds(*target))
      *target = loaded;
    else if (SetsDirectly(*target, loaded))
      SetDirectly(*target, loaded);
    else if (TakesInPlace(*target, loaded))
      target->set_(loaded);
    else
      target->set_data(loaded);
  }
  state.metadata = std::move(staged.metadata);
}

}  // namespace

}  // namespace ckptio::internal
