// The save plan: a State turned into tensor objects, optimizers and
// metadata, a striped save's share of it per rank, and its writing.
#include "torch/save_plan.h"

#include <algorithm>

#include "torch/libtorch_errors.h"
#include "torch/state_items.h"
#include "torch/tensors.h"

namespace ckptio::internal {

SavePlan Plan(const State& state) {
  SavePlan plan;
  SavePlan::TensorObject loose{"tensors", kTensorsObject, {}, {}};
  const size_t loose_count =
      std::count_if(state.items.begin(), state.items.end(),
                    [](const StateItem& i) { return i.kind() == StateItem::Kind::kTensor; });
  loose.tensors.reserve(loose_count);
  loose.devices.reserve(loose_count);
  auto add = [](SavePlan::TensorObject& to, std::string name, torch::Tensor t) {
    to.devices.push_back(!t.defined() || t.is_cpu() ? "cpu" : t.device().str());
    to.tensors.emplace_back(std::move(name), std::move(t));
  };
  for (const StateItem& item : state.items) {
    const std::string& name = item.name();
    switch (item.kind()) {
      case StateItem::Kind::kModule: {
        plan.metadata[kItemPrefix + name] = "module";
        SavePlan::TensorObject to{"module " + name, ModuleObject(name), {}, {}};
        for (auto& [tensor_name, t] : item.module_tensors())
          add(to, std::move(tensor_name), std::move(t));
        plan.tensor_objects.push_back(std::move(to));
        break;
      }
      case StateItem::Kind::kOptimizer:
        plan.metadata[kItemPrefix + name] = "optimizer:" + DeviceOf(item.optimizer());
        plan.optimizers.emplace_back(OptimizerObject(name), &item.optimizer());
        break;
      case StateItem::Kind::kTensor:
        // No metadata entry: tensors.safetensors lists them (and the
        // manifest holds at most 10,000 entries).
        add(loose, name, item.tensor());
        break;
    }
  }
  if (!loose.tensors.empty()) plan.tensor_objects.push_back(std::move(loose));
  for (const auto& [key, value] : state.metadata) plan.metadata[kUserPrefix + key] = value;
  return plan;
}

SavePlan StripePart(const SavePlan& full, int rank, int world) {
  struct Unit {
    size_t object, index;
    uint64_t bytes;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < full.tensor_objects.size(); ++i)
    for (size_t j = 0; j < full.tensor_objects[i].tensors.size(); ++j) {
      const torch::Tensor& t = full.tensor_objects[i].tensors[j].second;
      if (t.defined()) units.push_back({i, j, t.nbytes()});
    }
  // Largest first; ties by object and tensor name, never by the order the
  // State listed them in: ranks that built the same state in different
  // orders (a Python dict filled in another order) split it alike.
  auto tensor_name = [&full](const Unit& u) -> const std::string& {
    return full.tensor_objects[u.object].tensors[u.index].first;
  };
  std::sort(units.begin(), units.end(), [&](const Unit& a, const Unit& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    const std::string& oa = full.tensor_objects[a.object].object;
    const std::string& ob = full.tensor_objects[b.object].object;
    return oa != ob ? oa < ob : tensor_name(a) < tensor_name(b);
  });
  std::vector<uint64_t> load(static_cast<size_t>(world), 0);
  std::vector<std::vector<int>> owner(full.tensor_objects.size());
  for (size_t i = 0; i < full.tensor_objects.size(); ++i)
    owner[i].assign(full.tensor_objects[i].tensors.size(), 0);
  for (const Unit& u : units) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[static_cast<size_t>(r)] += u.bytes;
    owner[u.object][u.index] = r;
  }
  SavePlan part;
  if (rank == 0) {
    part.optimizers = full.optimizers;
    part.archives = full.archives;
    part.metadata = full.metadata;
  }
  for (size_t i = 0; i < full.tensor_objects.size(); ++i) {
    const auto& to = full.tensor_objects[i];
    std::vector<SavePlan::TensorObject> per_rank(static_cast<size_t>(world));
    for (size_t j = 0; j < to.tensors.size(); ++j) {
      auto& mine = per_rank[static_cast<size_t>(owner[i][j])];
      mine.tensors.push_back(to.tensors[j]);
      mine.devices.push_back(to.devices[j]);
    }
    for (int r = 0; r < world; ++r) {
      auto& p = per_rank[static_cast<size_t>(r)];
      if (r != 0 && p.tensors.empty()) continue;
      p.item = to.item;
      p.object = r == 0 ? to.object : StripePartName(to.object, r);
      if (rank == 0 && r != 0) {
        part.metadata[kStripePartPrefix + p.object] = to.object;
        part.stripes.insert(p.object);
        auto& expected = part.stripe_tensors[p.object];
        for (const auto& [name, t] : p.tensors)
          expected.push_back({name, SafetensorsDtypeName(t.scalar_type()), t.sizes().vec()});
      }
      if (r == rank) part.tensor_objects.push_back(std::move(p));
    }
  }
  return part;
}

Status ArchiveOptimizer(const torch::optim::Optimizer& optimizer, const std::string& object,
                        const std::function<Status(const void*, size_t)>& write) {
  Status written;
  CKPTIO_RETURN_IF_ERROR(Guard("saving optimizer " + object, [&] {
    torch::serialize::OutputArchive archive;
    const_cast<torch::optim::Optimizer&>(optimizer).save(archive);  // save() is not const
    // Never a short count: LibTorch's zip writer throws on one, and its
    // destructor then writes again and throws, which ends the process. After
    // an error the rest is dropped and the error returned below.
    archive.save_to([&](const void* data, size_t size) -> size_t {
      if (written.ok()) written = write(data, size);
      return size;
    });
    return OkStatus();
  }));
  return written;
}

Status WritePlan(PendingCheckpoint& pending, const SavePlan& plan) {
  for (const auto& [key, value] : plan.metadata)
    CKPTIO_RETURN_IF_ERROR(pending.SetMetadata(key, value));
  for (const auto& to : plan.tensor_objects)
    CKPTIO_RETURN_IF_ERROR(Guard("saving " + to.item, [&] {
      return WriteSafetensors(pending, to.object, to.tensors, to.devices);
    }));
  for (const auto& [object, optimizer] : plan.optimizers) {
    CKPTIO_ASSIGN_OR_RETURN(auto stream, pending.AddObject(object));
    CKPTIO_RETURN_IF_ERROR(ArchiveOptimizer(
        *optimizer, object, [&](const void* d, size_t n) { return stream->Write(d, n); }));
    CKPTIO_RETURN_IF_ERROR(stream->Close());
  }
  for (const auto& a : plan.archives) {
    CKPTIO_ASSIGN_OR_RETURN(auto stream, pending.AddObject(a.object));
    for (const auto& piece : a.pieces)
      CKPTIO_RETURN_IF_ERROR(stream->Write(piece.data(), piece.size()));
    CKPTIO_RETURN_IF_ERROR(stream->Close());
  }
  return OkStatus();
}

}  // namespace ckptio::internal
