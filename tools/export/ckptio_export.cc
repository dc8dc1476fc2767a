// ckptio-export (run as `ckptio export STORE STEP -o out.pt`): writes a
// checkpoint's tensors as a file stock PyTorch loads with torch.load():
//
//   {"model": {"fc1.weight": tensor, ...},   # one dict per module
//    "tensors": {"name": tensor, ...},       # the named tensors
//    "metadata": {"epoch": "3", ...}}         # user metadata (strings)
//
// Every byte is verified before it is exported. Optimizer state is a LibTorch
// archive that Python cannot read, so it is left out (and said so).
#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "ckptio/backends.h"
#include "ckptio/torch.h"

namespace {

// Writes `bytes` to `path` durably: temp file, fsync, rename, fsync dir.
ckptio::Status WriteDurably(const std::string& path, const std::vector<char>& bytes) {
  std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
  if (dir.empty()) dir = "/";
  std::string tmp = path + ".ckptio-tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ckptio::ErrnoToStatus(errno, "create " + tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ckptio::Status s = ckptio::ErrnoToStatus(errno, "write " + tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ckptio::Status s = ckptio::ErrnoToStatus(errno, "fsync/close " + tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ckptio::Status s = ckptio::ErrnoToStatus(errno, "rename " + tmp + " to " + path);
    ::unlink(tmp.c_str());
    return s;
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return ckptio::ErrnoToStatus(errno, "open " + dir);
  int rc = ::fsync(dfd);
  ::close(dfd);
  if (rc != 0) return ckptio::ErrnoToStatus(errno, "fsync " + dir);
  return ckptio::OkStatus();
}

// torch::pickle_save without its type tags: the same zip container torch.save
// writes (data.pkl plus one record per storage), but dicts pickled as plain
// dicts. pickle_save wraps each typed dict in torch.jit._pickle.restore_type_tag,
// which torch.load (weights_only=True, the default since PyTorch 2.6) refuses.
std::vector<char> PickleForTorchLoad(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* p, size_t n) { pickled.insert(pickled.end(), p, p + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
    out.insert(out.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  return out;
}

int Run(int argc, char** argv) {
  CLI::App app{"ckptio export: write a checkpoint's tensors as a torch.load()-able file"};
  app.name("ckptio export");
  std::string uri, step_text, out;
  app.add_option("STORE", uri, "store URI or path")->required();
  app.add_option("STEP", step_text, "step number or \"latest\"")->required();
  app.add_option("-o,--output", out, "output file, e.g. out.pt")->required();
  CLI11_PARSE(app, argc, argv);

  auto store = ckptio::OpenStore(uri);
  if (!store.ok()) return std::cerr << "ckptio export: " << store.status() << "\n", 1;
  int64_t step = -1;
  if (step_text == "latest") {
    auto latest = (*store)->ReadLatest();
    if (!latest.ok() || !latest->has_value())
      return std::cerr << "ckptio export: no LATEST in " << (*store)->uri() << "\n", 1;
    step = (*latest)->step;
  } else {
    try {
      size_t used = 0;
      step = std::stoll(step_text, &used);
      if (used != step_text.size()) step = -1;
    } catch (const std::exception&) {
    }
    if (step < 0) return std::cerr << "ckptio export: bad STEP \"" << step_text << "\"\n", 2;
  }
  auto reader = (*store)->OpenStep(step);
  if (!reader.ok()) return std::cerr << "ckptio export: " << reader.status() << "\n", 1;

  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  std::map<std::string, c10::Dict<std::string, at::Tensor>> groups;
  size_t count = 0;
  for (const auto& t : (*reader)->manifest().tensors) {
    auto tensor = ckptio::ReadTensor(**reader, t, torch::kCPU);
    if (!tensor.ok()) return std::cerr << "ckptio export: " << tensor.status() << "\n", 1;
    const std::string base = ckptio::StripeBaseObject((*reader)->manifest(), t.object);
    std::string group = base.substr(0, base.rfind(".safetensors"));
    groups[group].insert(t.name, *tensor);
    ++count;
  }
  for (auto& [name, dict] : groups) top.insert(name, dict);
  c10::Dict<std::string, std::string> metadata;
  std::vector<std::string> skipped;
  for (const auto& [key, value] : (*reader)->manifest().metadata) {
    if (key.rfind("user.", 0) == 0) metadata.insert(key.substr(5), value);
    if (key.rfind("ckptio.item.", 0) == 0 && value.rfind("optimizer", 0) == 0)
      skipped.push_back(key.substr(12));
  }
  top.insert("metadata", metadata);
  std::vector<char> bytes = PickleForTorchLoad(top);
  ckptio::Status s = WriteDurably(out, bytes);
  if (!s.ok()) return std::cerr << "ckptio export: " << s << "\n", 1;
  std::cout << "exported step " << step << ": " << count << " tensor(s) in " << groups.size()
            << " group(s) to " << out << " (" << bytes.size() << " bytes)\n";
  for (const auto& name : skipped)
    std::cout << "not exported: optimizer \"" << name
              << "\" (a LibTorch archive; Python cannot load it)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "ckptio export: " << e.what() << "\n";
    return 1;
  }
}
