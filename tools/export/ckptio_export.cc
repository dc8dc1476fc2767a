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
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckptio/backends.h"
#include "ckptio/torch.h"
#include "common/progress.h"
#include "common/store_args.h"
#include "text.h"
#include "torch/tensors.h"

namespace {

using ckptio::Code;
using ckptio::Result;
using ckptio::Status;

// Where the export's bytes go: a temp file next to `path`, fsynced and
// renamed over `path` (then the folder fsynced) only when all went well, so
// `path` is either untouched or complete; on failure the temp is removed.
// Replacing a file keeps its mode, and a symlink stays a link to the file
// written (as torch.save, which opens the path, would do).
class DurableFile {
 public:
  ~DurableFile() {
    if (fd_ >= 0) ::close(fd_);
    if (created_ && !committed_) ::unlink(tmp_.c_str());
  }

  // InvalidArgument (a usage error) when `path` cannot name the output file.
  Status Create(const std::string& path) {
    path_ = path;
    if (path_.empty() || path_.back() == '/')
      return Status(Code::kInvalidArgument,
                    "-o \"" + path_ + "\" names no file: give one, e.g. -o step.pt");
    struct stat st;
    mode_t mode = 0644;  // less the umask, as for any new file
    bool keep_mode = false;
    if (::lstat(path_.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      char* target = ::realpath(path_.c_str(), nullptr);
      if (target != nullptr) {
        path_ = target;
        std::free(target);
      } else if (errno == ENOENT) {  // a link to a file not there yet: made there
        char link[4096];
        ssize_t n = ::readlink(path_.c_str(), link, sizeof link - 1);
        if (n <= 0) return ckptio::ErrnoToStatus(errno, "readlink " + path_);
        const std::string to(link, static_cast<size_t>(n));
        const size_t slash = path_.rfind('/');
        path_ = to[0] == '/' || slash == std::string::npos ? to : path_.substr(0, slash + 1) + to;
      } else {
        return ckptio::ErrnoToStatus(errno, "-o " + path_ + " is a symlink; resolving it");
      }
    }
    if (::stat(path_.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode))
        return Status(Code::kInvalidArgument,
                      "-o " + path_ + " is a folder: name the file, e.g. -o " + path_ + "/step.pt");
      if (!S_ISREG(st.st_mode))  // a device (/dev/null), FIFO or socket is never replaced
        return Status(Code::kInvalidArgument,
                      "-o " + path_ + " exists and is not a regular file: name a file");
      mode = st.st_mode & 07777;
      keep_mode = true;
    }
    tmp_ = path_ + ".ckptio-tmp." + std::to_string(::getpid());
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd_ < 0) return ckptio::ErrnoToStatus(errno, "create " + tmp_);  // maybe not ours
    created_ = true;
    if (keep_mode && ::fchmod(fd_, mode) != 0)  // open() applied the umask
      return ckptio::ErrnoToStatus(errno, "chmod " + tmp_);
    return ckptio::OkStatus();
  }
  // Bytes written; after an error none (the first error is kept).
  size_t Write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    size_t done = 0;
    while (error_.ok() && done < n) {
      ssize_t w = ::write(fd_, p + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) error_ = ckptio::ErrnoToStatus(errno, "write " + tmp_);
      if (w > 0) done += static_cast<size_t>(w);
    }
    return done;
  }
  const Status& error() const { return error_; }

  Status Commit() {
    if (!error_.ok()) return error_;
    if (::fsync(fd_) != 0) return ckptio::ErrnoToStatus(errno, "fsync " + tmp_);
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ckptio::ErrnoToStatus(errno, "close " + tmp_);
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      return ckptio::ErrnoToStatus(errno, "rename " + tmp_ + " to " + path_);
    committed_ = true;
    std::string dir =
        path_.find('/') == std::string::npos ? "." : path_.substr(0, path_.rfind('/'));
    if (dir.empty()) dir = "/";
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return ckptio::ErrnoToStatus(errno, "open " + dir);
    int rc = ::fsync(dfd);
    ::close(dfd);
    return rc != 0 ? ckptio::ErrnoToStatus(errno, "fsync " + dir) : ckptio::OkStatus();
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool created_ = false, committed_ = false;
  Status error_;
};

// torch::pickle_save without its type tags, streamed to `out`: the same zip
// container torch.save writes (data.pkl plus one record per storage), but
// dicts pickled as plain dicts. pickle_save wraps each typed dict in
// torch.jit._pickle.restore_type_tag, which torch.load (weights_only=True,
// the default since PyTorch 2.6) refuses.
Status PickleForTorchLoad(const c10::IValue& value, DurableFile& out, ckptio::Progress& progress) {
  std::vector<char> pickled;  // the pickle itself: small (tensors are records)
  torch::jit::Pickler pickler(
      [&](const char* p, size_t n) { pickled.insert(pickled.end(), p, p + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  try {
    // Never a short count: LibTorch's zip writer throws on one, and its
    // destructor then writes again and throws, which ends the process.
    // The first error is kept in `out` and reported after.
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
      progress.Add(out.Write(p, n));
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                       writer);
    writer.writeEndOfFile();
  } catch (const std::exception& e) {
    return out.error().ok() ? Status(Code::kInternal, e.what()) : out.error();
  }
  return out.error();
}

int Fail(const Status& s) {
  std::cerr << "ckptio export: " << s << "\n";
  return s.code() == Code::kInvalidArgument ? 2 : 1;
}

int Run(int argc, char** argv) {
  CLI::App app{"ckptio export: write a checkpoint's tensors as a torch.load()-able file"};
  app.name("ckptio export");
  std::string uri, step_text, out;
  app.add_option("STORE", uri, "store URI or path")->required();
  app.add_option("STEP", step_text, "step number or \"latest\"")->required();
  app.add_option("-o,--output", out, "output file, e.g. out.pt")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is 0; every usage error 2, as in `ckptio`
  }

  DurableFile file;  // first: a bad -o is a usage error before any reading
  if (Status made = file.Create(out); !made.ok()) return Fail(made);
  auto store = ckptio::OpenExisting(uri);
  if (!store.ok()) return Fail(store.status());
  auto step = ckptio::ResolveStep(**store, step_text);
  if (!step.ok()) return Fail(step.status());
  auto reader = (*store)->OpenStep(*step);
  if (!reader.ok()) return Fail(reader.status());
  const ckptio::Manifest& manifest = (*reader)->manifest();

  // Tensors share their object's verified view (a memory map on local
  // disk): nothing is copied before the zip writer streams it to the file.
  std::map<std::string, std::shared_ptr<ckptio::ObjectView>> views;
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  std::map<std::string, c10::Dict<std::string, at::Tensor>> groups;
  uint64_t bytes = 0;
  for (const auto& t : manifest.tensors) {
    auto& view = views[t.object];
    if (!view) {
      auto opened = (*reader)->View(t.object);
      if (!opened.ok()) return Fail(opened.status());
      view = *opened;
    }
    auto tensor = ckptio::TensorFromView(view, t, torch::kCPU);
    if (!tensor.ok()) return Fail(tensor.status());
    const std::string base = ckptio::StripeBaseObject(manifest, t.object);
    groups[base.substr(0, base.rfind(".safetensors"))].insert(t.name, *tensor);
    bytes += t.length;
  }
  for (auto& [name, dict] : groups) top.insert(name, dict);
  c10::Dict<std::string, std::string> metadata;
  std::vector<std::string> skipped;
  for (const auto& [key, value] : manifest.metadata) {
    if (key.rfind("user.", 0) == 0) metadata.insert(key.substr(5), value);
    if (key.rfind("ckptio.item.", 0) == 0 && value.rfind("optimizer", 0) == 0)
      skipped.push_back(key.substr(12));
  }
  top.insert("metadata", metadata);

  if (manifest.tensors.empty())
    return Fail(Status(Code::kFailedPrecondition,
                       "step " + std::to_string(*step) +
                           " holds no module or named tensors: nothing to export (optimizer "
                           "archives are LibTorch's own and are not exported)"));
  ckptio::Progress progress(bytes);
  Status s = PickleForTorchLoad(top, file, progress);
  if (s.ok()) s = file.Commit();
  progress.Done();
  if (!s.ok()) return Fail(s);
  std::cout << "exported step " << *step << ": " << manifest.tensors.size() << " tensor(s) in "
            << groups.size() << " group(s) to " << out << " (" << ckptio::HumanBytes(bytes)
            << " of tensor data)\n";
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
