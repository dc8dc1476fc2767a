// Tensors <-> safetensors objects, and map_location.
#include "torch/tensors.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstring>
#include <mutex>
#include <string_view>
#include <unordered_set>

#include "ckptio/torch.h"
#include "safetensors_text.h"
#include "torch/libtorch_errors.h"
#include "torch/pinned_copy.h"

namespace ckptio {

namespace {

struct DtypeName {
  torch::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {torch::kFloat64, "F64"},   {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"},
    {torch::kBFloat16, "BF16"}, {torch::kInt64, "I64"},   {torch::kInt32, "I32"},
    {torch::kInt16, "I16"},     {torch::kInt8, "I8"},     {torch::kUInt8, "U8"},
    {torch::kBool, "BOOL"},
};

std::optional<torch::ScalarType> TypeOf(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}

// A BOOL byte other than 0 or 1 is undefined behaviour in LibTorch: refuse
// it (the hashes only prove the bytes are what the writer wrote).
Status CheckBools(const TensorEntry& entry, const void* data, uint64_t length) {
  if (entry.dtype != "BOOL") return OkStatus();
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (uint64_t i = 0; i < length; ++i)
    if (bytes[i] > 1)
      return Status(Code::kDataLoss, "tensor " + entry.name + ": element " + std::to_string(i) +
                                         " of a BOOL tensor is " + std::to_string(bytes[i]) +
                                         ", not 0 or 1");
  return OkStatus();
}

}  // namespace

namespace {
// Writes into a PendingCheckpoint or a StripeWriter (both have AddObject
// and AddTensor).
template <typename Sink>
Status WriteSafetensorsTo(Sink& pending, const std::string& object,
                          const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                          const std::vector<std::string>& devices) {
  // A tensor that is not a contiguous CPU tensor is copied, as it is
  // written, into one buffer the size of the largest such tensor: a GPU
  // model is never staged whole in host memory, and one allocation serves
  // them all (fresh ones per tensor grow the heap: glibc keeps freed blocks).
  struct Item {
    std::string name;
    torch::Tensor t;  // detached, anywhere, any layout
    std::string device;
    const char* dtype;
    uint64_t begin = 0, end = 0;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    if (!t.defined()) continue;
    const char* dtype = SafetensorsDtypeName(t.scalar_type());
    if (!*dtype)
      return Status(Code::kInvalidArgument,
                    "tensor \"" + name + "\" of " + object + " has dtype " +
                        std::string(c10::toString(t.scalar_type())) +
                        ", which safetensors cannot hold (supported: f64 f32 f16 bf16 i64 i32 "
                        "i16 i8 u8 bool)");
    items.push_back({name, t.detach(), i < devices.size() ? devices[i] : t.device().str(), dtype});
  }
  // Larger elements first, then by name: every tensor starts at a multiple
  // of its element size (the data section itself starts 8-aligned).
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.t.element_size() != b.t.element_size()) return a.t.element_size() > b.t.element_size();
    return a.name < b.name;
  });
  // The entries, with offsets relative to the data section until the
  // header's length is known; the header written directly (as a JSON tree,
  // 10,000 tensors took 18 ms to build, dump and free).
  std::vector<TensorEntry> entries(items.size());
  std::unordered_set<std::string_view> names = {"__metadata__"};
  names.reserve(items.size() + 1);
  uint64_t pos = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    Item& it = items[i];
    if (!names.insert(it.name).second)
      return Status(Code::kInvalidArgument, "tensor name \"" + it.name + "\" repeats in " + object);
    it.begin = pos;
    it.end = pos + static_cast<uint64_t>(it.t.numel()) * it.t.element_size();
    pos = it.end;
    TensorEntry& e = entries[i];
    e.name = it.name;
    e.object = object;
    e.dtype = it.dtype;
    e.shape = it.t.sizes().vec();
    e.device = it.device;
    e.offset = it.begin;
    e.length = it.end - it.begin;
  }
  std::vector<const TensorEntry*> in_order(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) in_order[i] = &entries[i];
  CKPTIO_ASSIGN_OR_RETURN(std::string text, SafetensorsHeaderText(in_order, 0));
  const uint64_t data_start = 8 + text.size();

  CKPTIO_ASSIGN_OR_RETURN(auto stream, pending.AddObject(object));
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  CKPTIO_RETURN_IF_ERROR(stream->Write(len, sizeof len));
  CKPTIO_RETURN_IF_ERROR(stream->Write(text.data(), text.size()));
  auto direct = [](const torch::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); };
  uint64_t staging_bytes = 0;
  for (const auto& it : items)
    if (!direct(it.t)) staging_bytes = std::max(staging_bytes, it.end - it.begin);
  torch::Tensor staging;
  if (staging_bytes > 0)
    staging = torch::empty({static_cast<int64_t>(staging_bytes)}, torch::kUInt8);
  for (const auto& it : items) {
    if (it.end > it.begin) {
      const void* data = it.t.data_ptr();
      if (!direct(it.t)) {
        torch::from_blob(staging.data_ptr(), it.t.sizes(), it.t.options().device(torch::kCPU))
            .copy_(it.t);
        data = staging.data_ptr();
      }
      CKPTIO_RETURN_IF_ERROR(stream->Write(data, it.end - it.begin));
    }
  }
  for (TensorEntry& e : entries) {
    e.offset += data_start;
    pending.AddTensor(std::move(e));
  }
  return stream->Close();
}
}  // namespace

Status WriteSafetensors(PendingCheckpoint& pending, const std::string& object,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                        const std::vector<std::string>& devices) {
  return WriteSafetensorsTo(pending, object, tensors, devices);
}

Status WriteSafetensors(StripeWriter& stripe, const std::string& object,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                        const std::vector<std::string>& devices) {
  return WriteSafetensorsTo(stripe, object, tensors, devices);
}

namespace internal {
namespace {
constexpr int64_t kPinnedPiece = 64 << 20;
std::mutex pinned_mu;
// Never freed: freeing pinned memory after CUDA shut down at exit is an
// error.
torch::Tensor* pinned_buffer = nullptr;  // under pinned_mu

void ReservePinnedLocked() {
  if (!pinned_buffer)
    pinned_buffer = new torch::Tensor(torch::empty(
        {kPinnedPiece}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true)));
}
}  // namespace

void ReservePinned() {
  std::lock_guard<std::mutex> lock(pinned_mu);
  ReservePinnedLocked();
}

void CopyThroughPinned(const torch::Tensor& cpu, const torch::Tensor& dst) {
  std::lock_guard<std::mutex> lock(pinned_mu);
  ReservePinnedLocked();
  const torch::Tensor& pinned = *pinned_buffer;
  const int64_t total = static_cast<int64_t>(cpu.nbytes());
  const char* src = static_cast<const char*>(cpu.data_ptr());
  char* out = static_cast<char*>(dst.data_ptr());
  for (int64_t off = 0; off < total; off += kPinnedPiece) {
    const int64_t n = std::min(kPinnedPiece, total - off);
    std::memcpy(pinned.data_ptr(), src + off, static_cast<size_t>(n));
    torch::Tensor gpu = torch::from_blob(
        out + off, {n}, torch::TensorOptions().dtype(torch::kUInt8).device(dst.device()));
    gpu.copy_(pinned.narrow(0, 0, n));  // synchronous: the buffer is reused next
  }
}
}  // namespace internal

namespace {
// `cpu` (tensor `entry`, verified) on `device`.
Result<torch::Tensor> OnDevice(const torch::Tensor& cpu, const TensorEntry& entry,
                               torch::Device device) {
  if (device.is_cpu()) return cpu;
  try {
    if (device.is_cuda() && cpu.nbytes() > 0) {
      torch::Tensor out = torch::empty(cpu.sizes(), cpu.options().device(device));
      internal::CopyThroughPinned(cpu, out);
      return out;
    }
    return cpu.to(device);
  } catch (const c10::Error& e) {
    return internal::TorchErrorToStatus(e, "moving tensor " + entry.name + " to " + device.str(),
                                        Code::kFailedPrecondition);
  }
}
}  // namespace

Result<torch::Tensor> ReadTensor(CheckpointReader& reader, const TensorEntry& entry,
                                 torch::Device device) {
  auto type = TypeOf(entry.dtype);
  if (!type)
    return Status(Code::kDataLoss, "tensor " + entry.name + " has unknown dtype " + entry.dtype);
  torch::Tensor cpu = torch::empty(entry.shape, torch::TensorOptions().dtype(*type));
  if (entry.length != cpu.nbytes())
    return Status(Code::kDataLoss, "tensor " + entry.name + ": manifest length " +
                                       std::to_string(entry.length) + " does not match its shape");
  if (entry.length > 0)
    CKPTIO_RETURN_IF_ERROR(reader.Read(entry.object, entry.offset, cpu.data_ptr(), entry.length));
  CKPTIO_RETURN_IF_ERROR(CheckBools(entry, cpu.data_ptr(), entry.length));
  return OnDevice(cpu, entry, device);
}

Result<torch::Tensor> TensorFromView(const std::shared_ptr<ObjectView>& view,
                                     const TensorEntry& entry, torch::Device device) {
  auto type = TypeOf(entry.dtype);
  if (!type)
    return Status(Code::kDataLoss, "tensor " + entry.name + " has unknown dtype " + entry.dtype);
  const auto options = torch::TensorOptions().dtype(*type);
  int64_t numel = 1;
  for (int64_t d : entry.shape) numel *= d;
  const uint64_t element = c10::elementSize(*type);
  if (entry.length != static_cast<uint64_t>(numel) * element)
    return Status(Code::kDataLoss, "tensor " + entry.name + ": manifest length " +
                                       std::to_string(entry.length) + " does not match its shape");
  if (entry.offset > view->size() || entry.length > view->size() - entry.offset)
    return Status(Code::kDataLoss, "tensor " + entry.name + " lies outside its object");
  char* data = view->data() + entry.offset;
  CKPTIO_RETURN_IF_ERROR(CheckBools(entry, data, entry.length));
  torch::Tensor cpu;
  if (entry.length == 0) {
    cpu = torch::empty(entry.shape, options);
  } else if (reinterpret_cast<uintptr_t>(data) % element != 0) {
    cpu = torch::empty(entry.shape, options);  // misaligned for its type: copy
    std::memcpy(cpu.data_ptr(), data, entry.length);
  } else {
    // Shares the view's memory, and keeps the view alive while it is used:
    // a storage whose context is a reference to the view (what from_blob
    // builds, without its std::function deleter and two allocations more
    // per tensor; 10,000 tensors cost a load ~2 ms that way).
    auto* keep = new std::shared_ptr<ObjectView>(view);
    c10::DataPtr bytes(data, keep,
                       [](void* ctx) { delete static_cast<std::shared_ptr<ObjectView>*>(ctx); },
                       c10::Device(c10::kCPU));
    cpu = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(c10::Storage::use_byte_size_t(), entry.length, std::move(bytes),
                     /*allocator=*/nullptr, /*resizable=*/false),
        c10::DispatchKeySet(c10::DispatchKey::CPU), c10::scalarTypeToTypeMeta(*type));
    cpu.unsafeGetTensorImpl()->set_sizes_contiguous(entry.shape);
  }
  return OnDevice(cpu, entry, device);
}

const char* SafetensorsDtypeName(torch::ScalarType type) {
  for (const auto& d : kDtypes)
    if (d.type == type) return d.name;
  return "";
}

std::string StripeBaseObject(const Manifest& manifest, const std::string& object) {
  auto it = manifest.metadata.find(kStripePartPrefix + object);
  return it == manifest.metadata.end() ? object : it->second;
}

// ------------------------------------------------------------- map_location

namespace {
Result<torch::Device> Checked(torch::Device d, const std::string& asked) {
  if (d.is_cuda()) {
    if (!torch::cuda::is_available())
      return Status(Code::kFailedPrecondition,
                    "map_location asks for " + asked +
                        " but CUDA is not available on this machine; load with "
                        "map_location \"cpu\" (or Auto)");
    const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
    if (d.has_index() && d.index() >= n)
      return Status(Code::kFailedPrecondition, "map_location asks for " + asked + " but only " +
                                                   std::to_string(n) + " CUDA device(s) exist");
    // "cuda" is the current one, as LibTorch allocates there: named, so
    // that a module already on it is recognised as being where it goes.
    if (!d.has_index()) return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
  }
  return d;
}

Result<torch::Device> Parse(const std::string& text) {
  try {
    return torch::Device(text);
  } catch (const c10::Error&) {
    return Status(Code::kInvalidArgument, "map_location \"" + text +
                                              "\" is not a device (use \"cpu\", \"cuda\" or "
                                              "\"cuda:N\")");
  }
}
}  // namespace

MapLocation MapLocation::To(torch::Device device) {
  MapLocation m;
  m.fn_ = [device](const std::string&, const RankInfo&) { return Checked(device, device.str()); };
  return m;
}

MapLocation MapLocation::To(const std::string& device) {
  MapLocation m;
  m.fn_ = [device](const std::string&, const RankInfo&) -> Result<torch::Device> {
    CKPTIO_ASSIGN_OR_RETURN(torch::Device d, Parse(device));
    return Checked(d, device);
  };
  return m;
}

MapLocation MapLocation::With(std::function<torch::Device(const std::string& saved)> fn) {
  MapLocation m;
  m.fn_ = [fn = std::move(fn)](const std::string& saved, const RankInfo&) -> Result<torch::Device> {
    // The caller's function may throw (a bad device string): an error of
    // the load, before anything of the state changed.
    std::optional<torch::Device> d;
    try {
      d = fn(saved);
    } catch (const c10::Error& e) {
      return internal::TorchErrorToStatus(e, "map_location of \"" + saved + "\"",
                                          Code::kInvalidArgument);
    } catch (const std::exception& e) {
      return Status(Code::kInvalidArgument,
                    "map_location of \"" + saved + "\" failed: " + std::string(e.what()));
    }
    return Checked(*d, d->str());
  };
  return m;
}

Result<torch::Device> MapLocation::Resolve(const std::string& saved, const RankInfo& rank) const {
  if (fn_) return fn_(saved, rank);
  // Auto: this rank's own GPU, never the one the tensor was saved from.
  if (!torch::cuda::is_available()) return torch::Device(torch::kCPU);
  // One visible GPU is this process's own (Slurm --gpus-per-task=1, or a
  // launcher setting CUDA_VISIBLE_DEVICES per rank), whatever LOCAL_RANK says.
  if (torch::cuda::device_count() == 1) return torch::Device(torch::kCUDA, 0);
  torch::Device d(torch::kCUDA, static_cast<c10::DeviceIndex>(rank.local_rank));
  return Checked(d, d.str() + " (auto: LOCAL_RANK " + std::to_string(rank.local_rank) + ")");
}

std::optional<int64_t> State::GetInt(const std::string& key) const {
  auto it = metadata.find(key);
  if (it == metadata.end() || it->second.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (*end != '\0' || errno != 0) return std::nullopt;
  return static_cast<int64_t>(v);
}

}  // namespace ckptio
