// ckptio-bench: ckptio against raw I/O, torch::save/load and Python
// torch.save/load on the same bytes, in one run, contenders in an order
// rotated every repeat, min / median / max of --repeat runs; and the Python
// package (when it is built beside the binary, in <build>/python) against
// torch.save/load in Python. Prints a table and, with --json, the numbers;
// a run that fails its own sanity checks (bench_stats.h) prints no ratios
// and exits 3.
//
//   ckptio-bench [--dir DIR] [--size MiB] [--repeat N] [--json FILE]
//                [--nfs nfs://server/export?version=3&nfsport=N&mountport=N]
//                [--s3 s3://bucket/prefix?endpoint=...]  (credentials: AWS_* variables)
//
// Shapes: "large" (8 float tensors of size/8 each) and "small" (10,000
// tensors of 4 KiB). Saves are durable (fsync) for every contender; loads
// are from a warm page cache, and "cold" after posix_fadvise(DONTNEED) of
// every file (the page cache may keep some pages anyway on this VM; the
// cold numbers are an upper bound on what a reboot would give).
#include <fcntl.h>
#include <nfsc/libnfs.h>
#if CKPTIO_BENCH_S3
#include <curl/curl.h>
#endif
#include <spawn.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_io.h"
#include "bench_stats.h"
#include "ckptio/backends.h"
#include "ckptio/hash.h"
#if CKPTIO_BENCH_S3
#include "ckptio/s3_backend.h"
#endif
#include "ckptio/torch.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ckptio::bench::Check;
using ckptio::bench::Die;
using ckptio::bench::DropCache;
using ckptio::bench::KernelTouch;
using ckptio::bench::ReadBuffer;
using ckptio::bench::RemoveAndSettle;
using ckptio::bench::Seconds;
using ckptio::bench::Settle;
using ckptio::bench::StateOf;

void FsyncPath(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0 || ::fsync(fd) != 0) Die("fsync " + path);
  ::close(fd);
}

void WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) Die("write");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

struct Shape {
  std::string name;
  int64_t count;
  int64_t elems;  // float32 elements per tensor
};

// The state to save: `count` float tensors, deterministic content.
std::vector<torch::Tensor> MakeTensors(const Shape& s) {
  torch::manual_seed(7);
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < s.count; ++i) {
    out.push_back(torch::randn({s.elems}));
    KernelTouch(out.back().data_ptr(), out.back().nbytes());
  }
  return out;
}

// One line of a shell command's output ("" if none).
std::string FirstLine(const std::string& cmd) {
  FILE* p = ::popen(cmd.c_str(), "r");
  char line[256] = {};
  std::string out;
  if (p && std::fgets(line, sizeof line, p)) out.assign(line, std::strcspn(line, "\n"));
  if (p) ::pclose(p);
  return out;
}

// The machine and the code measured: cores, memory, the folder's file
// system, and the commit (CKPTIO_COMMIT, else git of the source tree, with
// "-dirty" when it has uncommitted changes).
void Describe(const std::string& dir, json& out) {
  out["machine"] = {{"cores", std::thread::hardware_concurrency()},
                    {"memory_gib", static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                                       ::sysconf(_SC_PAGESIZE) / (1 << 30)},
                    {"filesystem", FirstLine("df -T '" + dir + "' | tail -1 | awk '{print $2}'")}};
  std::string commit;
  if (const char* c = std::getenv("CKPTIO_COMMIT")) commit = c;
  if (commit.empty()) {
    const std::string git = "git -C '" CKPTIO_SOURCE_DIR "' ";
    commit = FirstLine(git + "rev-parse --short HEAD 2>/dev/null");
    if (!commit.empty() && !FirstLine(git + "status --porcelain -uno 2>/dev/null").empty())
      commit += "-dirty";
  }
  out["commit"] = commit.empty() ? json(nullptr) : json(commit);
}

const char* kPython = R"PY(
import os, sys, time, torch
mode, raw, path, count, elems = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if mode == "save":
    buf = bytearray(open(raw, "rb").read())
    ts = {"t%d" % i: torch.frombuffer(buf, dtype=torch.float32, count=elems, offset=i * elems * 4).clone() for i in range(count)}
    t0 = time.perf_counter()
    torch.save(ts, path)
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY); os.fsync(fd); os.close(fd)
    print(time.perf_counter() - t0)
elif mode == "load":
    t0 = time.perf_counter()
    ts = torch.load(path)
    print(time.perf_counter() - t0)
else:  # the ckptio package (path: a store), on the same tensors
    import ckptio
    buf = bytearray(open(raw, "rb").read())
    ts = {"t%d" % i: torch.frombuffer(buf, dtype=torch.float32, count=elems, offset=i * elems * 4).clone() for i in range(count)}
    ckpt = ckptio.Checkpointer(path, keep_last=1)
    if mode == "pkg_save":  # durable: fsynced and committed when it returns
        t0 = time.perf_counter()
        ckpt.save(0, ts)
        print(time.perf_counter() - t0)
    elif mode == "pkg_load":  # verified, every tensor, onto the CPU
        state = dict.fromkeys(ts)
        t0 = time.perf_counter()
        ckpt.load(state, map_location="cpu")
        print(time.perf_counter() - t0)
        assert torch.equal(state["t%d" % (count - 1)], ts["t%d" % (count - 1)])
    else:  # pkg_async: its stall, and a copy of the state into touched memory
        ckpt.save_async(1, ts).result()  # (allocates the staging memory)
        dst = {k: torch.empty_like(v) for k, v in ts.items()}
        for k, v in ts.items(): dst[k].copy_(v)
        t0 = time.perf_counter()
        for k, v in ts.items(): dst[k].copy_(v)
        memcpy = time.perf_counter() - t0
        t0 = time.perf_counter()
        fut = ckpt.save_async(2, ts)
        stall = time.perf_counter() - t0
        fut.result()
        print(stall, memcpy)
)PY";

// The Python package built beside this binary (<build>/python), or "".
std::string PythonPackageDir() {
  std::error_code ec;
  const fs::path dir =
      fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "python";
  return !ec && fs::exists(dir / "ckptio" / "__init__.py") ? dir.string() : "";
}

// Runs the script's `mode` in a fresh python3; the numbers it prints.
std::vector<double> PythonRun(const std::string& mode, const std::string& raw,
                              const std::string& path, const Shape& s, const std::string& script,
                              size_t numbers) {
  std::string cmd = "/usr/bin/python3 " + script + " " + mode + " " + raw + " " + path + " " +
                    std::to_string(s.count) + " " + std::to_string(s.elems);
  if (mode.rfind("pkg_", 0) == 0) cmd = "PYTHONPATH='" + PythonPackageDir() + "' " + cmd;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) Die("popen python3");
  std::vector<double> out(numbers, -1);
  bool read = true;
  for (double& x : out) read = read && std::fscanf(p, "%lf", &x) == 1 && x >= 0;
  if (::pclose(p) != 0 || !read) Die("python3 " + mode + " failed: " + cmd);
  return out;
}
double Python(const std::string& mode, const std::string& raw, const std::string& path,
              const Shape& s, const std::string& script) {
  return PythonRun(mode, raw, path, s, script, 1)[0];
}

// Raw libnfs I/O on the export of a v3 URI.
struct RawNfs {
  struct nfs_context* ctx = nullptr;
  explicit RawNfs(const std::string& uri) {
    ctx = nfs_init_context();
    struct nfs_url* url = nfs_parse_url_dir(ctx, uri.c_str());
    if (!url) Die("libnfs cannot parse " + uri + ": " + nfs_get_error(ctx));
    if (nfs_mount(ctx, url->server, url->path) != 0)
      Die("libnfs cannot mount " + uri + ": " + nfs_get_error(ctx));
    nfs_destroy_url(url);
  }
  ~RawNfs() { nfs_destroy_context(ctx); }
  // Creates `path` (removed beforehand, untimed: Remove) with the bytes of
  // `ts`, WRITE by WRITE, then COMMIT.
  void Write(const std::string& path, const std::vector<torch::Tensor>& ts) {
    struct nfsfh* fh = nullptr;
    if (nfs_open2(ctx, path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644, &fh) != 0)
      Die(std::string("raw nfs create: ") + nfs_get_error(ctx));
    const uint64_t max = std::min<uint64_t>(nfs_get_writemax(ctx), 1 << 20);
    uint64_t off = 0;
    for (const auto& t : ts) {
      const char* p = static_cast<const char*>(t.data_ptr());
      for (uint64_t done = 0; done < t.nbytes();) {
        uint64_t n = std::min<uint64_t>(max, t.nbytes() - done);
        int rc = nfs_pwrite(ctx, fh, off, n, p + done);
        if (rc <= 0) Die(std::string("raw nfs write: ") + nfs_get_error(ctx));
        done += static_cast<uint64_t>(rc);
        off += static_cast<uint64_t>(rc);
      }
    }
    if (nfs_fsync(ctx, fh) != 0 || nfs_close(ctx, fh) != 0) Die("raw nfs commit");
  }
  // Removes `path` if it is there.
  void Remove(const std::string& path) {
    const int rc = nfs_unlink(ctx, path.c_str());
    if (rc != 0 && rc != -ENOENT) Die("raw nfs remove " + path + ": " + nfs_get_error(ctx));
  }
  void Read(const std::string& path, std::vector<char>& buf) {
    struct nfsfh* fh = nullptr;
    if (nfs_open(ctx, path.c_str(), O_RDONLY, &fh) != 0) Die("raw nfs open");
    for (uint64_t off = 0; off < buf.size();) {
      uint64_t n = std::min<uint64_t>(1 << 20, buf.size() - off);
      int rc = nfs_pread(ctx, fh, off, n, buf.data() + off);
      if (rc <= 0) Die("raw nfs read");
      off += static_cast<uint64_t>(rc);
    }
    nfs_close(ctx, fh);
  }
  // Removes a store this run wrote at `path` (`uri` through ckptio): its
  // objects, then its folder. The export keeps nothing of the benchmark.
  void RemoveStore(const std::string& uri, const std::string& path) {
    auto backend = ckptio::BuiltinBackends().Open(uri);
    if (!backend.ok()) Die("nfs cleanup: " + backend.status().ToString());
    auto keys = (*backend)->List("");
    if (!keys.ok()) Die("nfs cleanup: " + keys.status().ToString());
    for (auto it = keys->rbegin(); it != keys->rend(); ++it) {
      ckptio::Status s = (*backend)->Delete(*it);
      if (!s.ok()) Die("nfs cleanup: " + s.ToString());
    }
    backend->reset();
    for (const std::string& d : {"/" + ckptio::StepDirName(1), std::string("/.coord")})
      (void)nfs_rmdir(ctx, (path + d).c_str());  // if still there
    int rc = nfs_rmdir(ctx, path.c_str());
    if (rc != 0 && rc != -ENOENT) Die("nfs cleanup: rmdir " + path + ": " + nfs_get_error(ctx));
  }
};

// Tensors of their own (TensorImpls) on the same memory as `tensors`, to
// load into: a load sets each to the loaded storage (Tensor::set_, as it
// does a caller's tensors), which must not reach `tensors` through a shared
// TensorImpl. (Copied handles would share it: the originals then held the
// loaded map, every later contender read that, a "cold" load found its
// pages still mapped, and the checks compared a tensor with itself.)
std::vector<torch::Tensor> LoadTargets(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& x : tensors) {
    torch::Tensor t = torch::empty({0}, x.options());
    t.set_(x);
    out.push_back(t);
  }
  return out;
}

#if CKPTIO_BENCH_S3
// Raw S3 I/O through libcurl, the client library of the s3:// backend: one
// PUT of the tensors' bytes back to back and one GET of them, signed the
// same way (SigV4, unsigned payload), settings from the same URI and AWS_*
// variables. What a program that PUTs a blob itself would get.
struct RawS3 {
  ckptio::S3Options o;
  CURL* c = nullptr;
  explicit RawS3(const std::string& uri) {
    auto parsed = ckptio::Uri::Parse(uri);
    if (!parsed.ok()) Die(parsed.status().ToString());
    auto options = ckptio::ParseS3Uri(*parsed);
    if (!options.ok()) Die(options.status().ToString());
    o = *options;
    c = curl_easy_init();
    if (!c) Die("curl_easy_init");
  }
  ~RawS3() { curl_easy_cleanup(c); }
  std::string Url(const std::string& key) const {
    return o.endpoint + "/" + o.bucket + "/" + (o.prefix.empty() ? "" : o.prefix + "/") + key;
  }
  // Sends one request; body from `tensors` (PUT) or into `sink` (GET).
  long Send(const std::string& method, const std::string& key,
            const std::vector<torch::Tensor>* tensors, std::vector<char>* sink) {
    struct Io {
      const std::vector<torch::Tensor>* tensors;
      size_t tensor = 0, offset = 0;
      std::vector<char>* sink;
      size_t got = 0;
    } io{tensors, 0, 0, sink, 0};
    curl_easy_reset(c);
    const std::string url = Url(key), sigv4 = "aws:amz:" + o.region + ":s3",
                      userpwd = o.access_key_id + ":" + o.secret_access_key;
    struct curl_slist* h = curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(c, CURLOPT_USERPWD, userpwd.c_str());
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    using Cb = size_t (*)(char*, size_t, size_t, void*);
    Cb write = [](char* d, size_t a, size_t b, void* arg) -> size_t {
      auto* st = static_cast<Io*>(arg);
      const size_t n = a * b;
      if (!st->sink || st->got + n > st->sink->size()) return n;  // an error document
      std::memcpy(st->sink->data() + st->got, d, n);
      st->got += n;
      return n;
    };
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &io);
    if (method == "PUT") {
      uint64_t total = 0;
      for (const auto& t : *tensors) total += t.nbytes();
      Cb read = [](char* d, size_t a, size_t b, void* arg) -> size_t {
        auto* st = static_cast<Io*>(arg);
        size_t done = 0;
        while (done < a * b && st->tensor < st->tensors->size()) {
          const auto& t = (*st->tensors)[st->tensor];
          const size_t n = std::min(a * b - done, t.nbytes() - st->offset);
          std::memcpy(d + done, static_cast<const char*>(t.data_ptr()) + st->offset, n);
          done += n;
          st->offset += n;
          if (st->offset == t.nbytes()) st->tensor++, st->offset = 0;
        }
        return done;
      };
      curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(c, CURLOPT_READFUNCTION, read);
      curl_easy_setopt(c, CURLOPT_READDATA, &io);
      curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(total));
    } else if (method != "GET") {
      curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method.c_str());
    }
    CURLcode rc = curl_easy_perform(c);
    curl_slist_free_all(h);
    if (rc != CURLE_OK) Die("raw s3 " + method + " " + url + ": " + curl_easy_strerror(rc));
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    if (method == "GET" && io.got != sink->size()) Die("raw s3 GET: short answer");
    return status;
  }
  void Put(const std::string& key, const std::vector<torch::Tensor>& tensors) {
    if (long s = Send("PUT", key, &tensors, nullptr); s != 200)
      Die("raw s3 PUT answered " + std::to_string(s));
  }
  void Get(const std::string& key, std::vector<char>& buf) {
    if (long s = Send("GET", key, nullptr, &buf); s != 200)
      Die("raw s3 GET answered " + std::to_string(s));
  }
  void Delete(const std::string& key) { (void)Send("DELETE", key, nullptr, nullptr); }
};

// Every key under the store (the bench's own prefix), deleted.
void RemoveS3Store(const std::string& store) {
  auto s = ckptio::OpenStore(store);
  if (!s.ok()) Die("s3 cleanup: " + s.status().ToString());
  auto keys = (*s)->backend().List("");
  if (!keys.ok()) Die("s3 cleanup: " + keys.status().ToString());
  for (const auto& key : *keys) (void)(*s)->backend().Delete(key);
}
#endif

// Runs `group` starting with its (r mod size)-th member, wrapping around;
// with `settle`, the file system holding that folder settled before each
// (Settle: the writeback of what ran before done, not paid by the next).
void RunRotated(std::vector<std::function<void()>>& group, int r, const std::string& settle = "") {
  for (size_t i = 0; i < group.size(); ++i) {
    if (!settle.empty()) Settle(settle);
    group[(static_cast<size_t>(r) + i) % group.size()]();
  }
}

// Opening the store (rank 0 takes the writer lock) is outside the timed
// region of a save and of a load alike: a trainer opens once, then saves
// and loads through the open Checkpointer. (Each contender opens its own,
// before its timer starts.)
std::unique_ptr<ckptio::Checkpointer> OpenStore(const std::string& store) {
  auto ckpt = ckptio::Checkpointer::Open(store, ckptio::RankInfo{});
  if (!ckpt.ok()) Die(ckpt.status().ToString());
  return std::move(*ckpt);
}

void CkptioSave(const std::string& store, const ckptio::State& state, std::vector<double>* t) {
  auto ckpt = OpenStore(store);
  t->push_back(Seconds([&] { Check(ckpt->Save(1, state), "ckptio save to " + store); }));
}

void CkptioLoad(ckptio::Checkpointer& ckpt, const std::string& store, ckptio::State& state,
                std::vector<double>* t) {
  ckptio::LoadOptions lo;
  lo.map_location = ckptio::MapLocation::To("cpu");
  t->push_back(Seconds([&] {
    auto loaded = ckpt.Load(state, lo);
    if (!loaded.ok()) Die("ckptio load from " + store + ": " + loaded.status().ToString());
    if (!loaded->step) Die("ckptio load from " + store + ": the store is empty");
  }));
}

void CkptioLoad(const std::string& store, ckptio::State& state, std::vector<double>* t) {
  CkptioLoad(*OpenStore(store), store, state, t);
}

std::string WithSub(const std::string& uri, const std::string& sub) {
  size_t q = uri.find('?');
  return q == std::string::npos ? uri + "/" + sub : uri.substr(0, q) + "/" + sub + uri.substr(q);
}

// --gpu DEVICE: the CUDA paths, on the "large" shape held on DEVICE.
void GpuBench(const std::string& dir, const std::string& device_name, int64_t size_mib, int repeat,
              json& out) {
  if (!torch::cuda::is_available()) Die("--gpu: CUDA is not available on this machine");
  const torch::Device device(device_name);
  const Shape shape{"large", 8, (size_mib << 20) / 8 / 4};
  std::vector<torch::Tensor> host = MakeTensors(shape), tensors;
  for (const auto& h : host) tensors.push_back(h.to(device));
  const double gib = static_cast<double>(shape.count * shape.elems * 4) / (1 << 30);
  std::map<std::string, std::vector<double>> t;
  auto sync = [&] { torch::cuda::synchronize(device.has_index() ? device.index() : -1); };
  torch::Tensor pinned =
      torch::empty({static_cast<int64_t>(size_mib << 20)},
                   torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
  pinned.fill_(1);
  const std::string store = dir + "/gpu-store", async_store = dir + "/gpu-async-store";
  ckptio::CheckpointerOptions o;
  o.keep_last = 1;
  auto async_ckpt = ckptio::Checkpointer::Open(async_store, ckptio::RankInfo{}, o);
  if (!async_ckpt.ok()) Die(async_ckpt.status().ToString());
  std::vector<torch::Tensor> async_tensors = tensors;
  ckptio::State async_state = StateOf(async_tensors);
  Check((*async_ckpt)->SaveAsync(0, async_state).get(), "SaveAsync (warm-up)");
  ckptio::LoadOptions lo;
  lo.map_location = ckptio::MapLocation::To(device);
  for (int r = 0; r < repeat; ++r) {
    t["d2h_pinned"].push_back(Seconds([&] {
      int64_t off = 0;
      for (const auto& x : tensors) {
        int64_t n = static_cast<int64_t>(x.nbytes());
        pinned.narrow(0, off, n).copy_(torch::from_blob(
            x.data_ptr(), {n}, torch::TensorOptions().dtype(torch::kUInt8).device(device)));
        off += n;
      }
      sync();
    }));
    std::future<ckptio::Status> done;
    t["ckptio_save_async_stall"].push_back(
        Seconds([&] { done = (*async_ckpt)->SaveAsync(r + 1, async_state); }));
    Check(done.get(), "SaveAsync");
    RemoveAndSettle(store);
    std::vector<torch::Tensor> mine = LoadTargets(tensors);
    ckptio::State state = StateOf(mine);
    CkptioSave(store, state, &t["ckptio_save"]);
    auto module = std::make_shared<torch::nn::Module>();
    for (size_t i = 0; i < tensors.size(); ++i)
      module->register_parameter("t" + std::to_string(i), torch::zeros_like(tensors[i]), false);
    const std::string mod_store = dir + "/gpu-module-store";
    fs::remove_all(mod_store);
    ckptio::State mstate{{"model", *module}};
    std::vector<double> unused;
    {
      std::vector<torch::Tensor> src = tensors;  // save the real values under the module's names
      auto saver = std::make_shared<torch::nn::Module>();
      for (size_t i = 0; i < src.size(); ++i)
        saver->register_parameter("t" + std::to_string(i), src[i], false);
      ckptio::State sstate{{"model", *saver}};
      CkptioSave(mod_store, sstate, &unused);
    }
    t["ckptio_load_module"].push_back(Seconds([&] {
      auto ckpt = ckptio::Checkpointer::Open(mod_store, ckptio::RankInfo{});
      if (!ckpt.ok()) Die(ckpt.status().ToString());
      auto got = (*ckpt)->Load(mstate, lo);
      if (!got.ok()) Die(got.status().ToString());
      sync();
    }));
    const auto loaded = module->parameters();
    for (size_t i = 0; i < tensors.size(); ++i)
      if (!loaded[i].is_cuda() || !torch::equal(loaded[i], tensors[i]))
        Die("ckptio loaded different bytes onto " + device_name);
    const std::string tpt = dir + "/gpu-torch.pt";
    torch::save(host, tpt);
    t["torch_load_to_device"].push_back(Seconds([&] {
      std::vector<torch::Tensor> back;
      torch::load(back, tpt, device);
      sync();
    }));
  }
  json& js = out["gpu"];
  js["device"] = device_name;
  js["gib"] = gib;
  std::printf("\ngpu (%s): 8 tensors, %.3f GiB on the device, median of %d\n", device_name.c_str(),
              gib, repeat);
  for (const auto& [name, v] : t) {
    const double m = ckptio::bench::Summarize(v).median;
    js["seconds"][name] = m;
    js["gib_per_s"][name] = gib / m;
    std::printf("  %-26s %10.3f %10.3f\n", name.c_str(), m, gib / m);
  }
  auto sec = [&](const char* what) { return js["seconds"].value(what, 0.0); };
  js["ratios"]["async_stall_vs_d2h"] = sec("d2h_pinned") / sec("ckptio_save_async_stall");
  js["ratios"]["async_stall_vs_sync_save"] = sec("ckptio_save") / sec("ckptio_save_async_stall");
  js["ratios"]["module_load_vs_torch_load"] =
      sec("torch_load_to_device") / sec("ckptio_load_module");
  for (auto it = js["ratios"].begin(); it != js["ratios"].end(); ++it)
    std::printf("  %-32s %.3f\n", it.key().c_str(), it->get<double>());
}

// One rank of the multi-rank save measurement (a fresh process, started by
// StripeRanks): saves the "large" tensors `repeat` times with rank 0
// writing everything, then `repeat` times striped, alternating; rank 0
// writes "plain <seconds>" / "striped <seconds>" lines to `report`.
int StripeChild(const std::string& store_dir, int64_t size_mib, int repeat,
                const std::string& report) {
  torch::set_num_threads(1);
  auto rank = ckptio::RankInfo::FromEnv();
  if (!rank.ok()) Die(rank.status().ToString());
  const Shape shape{"large", 8, (size_mib << 20) / 8 / 4};
  std::vector<torch::Tensor> tensors = MakeTensors(shape);
  ckptio::State state = StateOf(tensors);
  // A barrier: nobody starts timing while another rank still builds its
  // tensors (that would steal the CPU from the measured save).
  fs::create_directories(store_dir);
  std::ofstream(store_dir + "/ready-" + std::to_string(rank->rank)).put('1');
  for (int r = 0; r < rank->world_size; ++r)
    while (!fs::exists(store_dir + "/ready-" + std::to_string(r)))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::unique_ptr<ckptio::Checkpointer> ckpt[2];
  for (bool striped : {false, true}) {
    ckptio::CheckpointerOptions o;
    o.stripe = striped;
    o.keep_last = 1;
    o.timeout = std::chrono::minutes(5);
    auto c = ckptio::Checkpointer::Open(store_dir + (striped ? "/striped" : "/plain"), *rank, o);
    if (!c.ok()) Die(c.status().ToString());
    ckpt[striped] = std::move(*c);
  }
  std::ofstream out;
  if (rank->rank == 0) out.open(report);
  for (int r = 1; r <= repeat; ++r)
    for (bool striped : {false, true}) {
      double secs = Seconds([&] { Check(ckpt[striped]->Save(r, state), "multi-rank save"); });
      if (rank->rank == 0) out << (striped ? "striped " : "plain ") << secs << "\n";
    }
  return 0;
}

// What checksums cost: a save of the "large" shape's bytes through
// ckptio::Store by ckptio-bench-save, against the same save by
// ckptio-bench-save-unhashed (the same program built with a hasher that does
// no work; what it writes never verifies), each a child process timing only
// its save, back to back in alternating order, in `dir` and again on tmpfs
// (`shm`, when it has room: no disk to hide the hashing behind, and far less
// noise). A phase of its own, after the other contenders, so that their
// writeback does not land in the middle of these pairs.
void ChecksumPairs(const std::string& dir, const std::string& shm, const Shape& shape, int repeat,
                   std::map<std::string, std::vector<double>>& t) {
  const fs::path bin = fs::read_symlink("/proc/self/exe").parent_path();
  auto save = [&](bool checksums, const std::string& store) {
    const std::string cmd =
        "'" + (bin / (checksums ? "ckptio-bench-save" : "ckptio-bench-save-unhashed")).string() +
        "' '" + store + "' " + std::to_string(shape.count) + " " + std::to_string(shape.elems * 4);
    FILE* p = ::popen(cmd.c_str(), "r");
    if (!p) Die("popen " + cmd);
    double secs = -1;
    if (std::fscanf(p, "%lf", &secs) != 1) secs = -1;
    if (::pclose(p) != 0 || secs < 0) Die("checksum pair save failed: " + cmd);
    return secs;
  };
  for (const std::string where : {"", "_tmpfs"}) {
    if (!where.empty() && shm.empty()) continue;
    const std::string store = (where.empty() ? dir : shm) + "/store-pair";
    for (int r = 0; r < repeat; ++r) {
      for (bool checksums : {r % 2 == 0, r % 2 == 1}) {
        RemoveAndSettle(store);
        t[(checksums ? "ckptio_save_hashed" : "ckptio_save_unhashed") + where].push_back(
            save(checksums, store));
      }
    }
    RemoveAndSettle(store);
  }
}

// Runs `world` ranks of StripeChild as fresh processes of this program and
// collects rank 0's times.
void StripeRanks(const char* self, const std::string& dir, int world, int64_t size_mib, int repeat,
                 std::map<std::string, std::vector<double>>& t) {
  const std::string report = dir + "/stripe-times.txt", store = dir + "/stripe-stores";
  fs::remove_all(store);
  std::vector<pid_t> pids;
  const std::string job = "bench-" + std::to_string(::getpid());
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env_strings = {
        "RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
        "WORLD_SIZE=" + std::to_string(world), "LOCAL_WORLD_SIZE=" + std::to_string(world),
        "CKPTIO_JOB_ID=" + job};
    for (char** e = environ; *e; ++e) {
      std::string v = *e;
      if (v.rfind("RANK=", 0) && v.rfind("LOCAL_RANK=", 0) && v.rfind("WORLD_SIZE=", 0) &&
          v.rfind("LOCAL_WORLD_SIZE=", 0) && v.rfind("CKPTIO_JOB_ID=", 0))
        env_strings.push_back(v);
    }
    std::vector<char*> envp;
    for (auto& v : env_strings) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = {
        self, "--stripe-child", store, std::to_string(size_mib), std::to_string(repeat), report};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (::posix_spawn(&pid, self, nullptr, nullptr, argv.data(), envp.data()) != 0)
      Die("posix_spawn " + std::string(self));
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die("a multi-rank save rank failed");
  }
  std::ifstream in(report);
  std::string kind;
  double secs;
  while (in >> kind >> secs)
    t[kind == "striped" ? "ckptio_save_striped_" + std::to_string(world) + "ranks"
                        : "ckptio_save_" + std::to_string(world) + "ranks"]
        .push_back(secs);
  fs::remove_all(store);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--stripe-child")
    return StripeChild(argv[2], std::stoll(argv[3]), std::stoi(argv[4]), argv[5]);
  CLI::App app{"ckptio-bench: ckptio vs raw I/O, torch::save/load and torch.save/load"};
  std::string dir = "./bench-data", json_path, nfs_uri, s3_uri;
  int64_t size_mib = 256;
  int repeat = 3;
  bool no_python = false;
  app.add_option("--dir", dir, "scratch folder (its file system is what is measured)");
  app.add_option("--size", size_mib, "MiB of tensors per contender")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  app.add_option("--repeat", repeat, "runs per contender; medians are reported")
      ->check(CLI::Range(1, 100));
  app.add_option("--json", json_path, "write every number here");
  app.add_option("--nfs", nfs_uri, "also measure over this NFSv3 nfs:// URI (an export)");
#if CKPTIO_BENCH_S3
  app.add_option("--s3", s3_uri,
                 "also measure over this s3:// URI (a bucket and prefix; credentials from the "
                 "AWS_* variables), against raw libcurl PUT/GET of the same bytes");
#endif
  app.add_flag("--no-python", no_python, "skip Python: torch.save/load and the ckptio package");
  bool keep_broken = false;
  app.add_flag("--keep-broken", keep_broken,
               "print ratios (marked) even when the run fails its own sanity checks; without "
               "it such a run prints none and exits 3");
  std::string gpu;
  app.add_option("--gpu", gpu,
                 "only measure the CUDA paths on this device (e.g. cuda:0): async save of "
                 "device tensors, verified load onto the device");
  int stripe_ranks = 4;
  app.add_option("--stripe-ranks", stripe_ranks,
                 "also time saves by this many local ranks, rank 0 writing everything and "
                 "striped (0: skip)")
      ->check(CLI::Range(0, 64));
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string script = dir + "/torch_bench.py";
  std::ofstream(script) << kPython;
  // The Python package's contenders need it built beside this binary.
  const bool py_package = !no_python && !PythonPackageDir().empty();
  if (!no_python && !py_package)
    std::printf("no Python package beside %s: its contenders are skipped\n", argv[0]);

  if (!gpu.empty()) {
    json out;
    Describe(dir, out);
    GpuBench(dir, gpu, size_mib, repeat, out);
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
    fs::remove_all(dir);
    return 0;
  }
  // tmpfs for the second checksum-cost pair, where /dev/shm has room for it.
  std::string shm;
  {
    struct statvfs v;
    const uint64_t need = 2 * (static_cast<uint64_t>(size_mib) << 20);
    if (::statvfs("/dev/shm", &v) == 0 && static_cast<uint64_t>(v.f_bavail) * v.f_frsize > need)
      shm = "/dev/shm/ckptio-bench-" + std::to_string(::getpid());
    if (!shm.empty()) fs::create_directories(shm);
  }
  const int64_t bytes = size_mib << 20;
  std::vector<Shape> shapes = {{"large", 8, bytes / 8 / 4}, {"small", 10000, 1024}};
  json out;
  Describe(dir, out);
  out["size_mib"] = size_mib;
  out["repeat"] = repeat;
  std::vector<std::string> broken;  // the sanity checks' verdicts, "shape: why"

  for (const Shape& shape : shapes) {
    const std::vector<torch::Tensor> tensors = MakeTensors(shape);
    const double gib = static_cast<double>(shape.count * shape.elems * 4) / (1 << 30);
    std::map<std::string, std::vector<double>> t;
    const std::string raw = dir + "/raw.bin", tpt = dir + "/torch.pt", pypt = dir + "/py.pt";
    // SaveAsync keeps one Checkpointer (its staging memory is reused from
    // save to save); the first save, which allocates it, is not measured.
    const std::string async_store = dir + "/async-store";
    std::unique_ptr<ckptio::Checkpointer> async_ckpt;
    std::vector<torch::Tensor> async_tensors = tensors;
    ckptio::State async_state = StateOf(async_tensors);
    std::vector<char> copy_buf;
    if (shape.name == "large") {
      ckptio::CheckpointerOptions o;
      o.keep_last = 1;
      auto c = ckptio::Checkpointer::Open(async_store, ckptio::RankInfo{}, o);
      if (!c.ok()) Die(c.status().ToString());
      async_ckpt = std::move(*c);
      Check(async_ckpt->SaveAsync(0, async_state).get(), "ckptio SaveAsync");
      copy_buf.resize(static_cast<size_t>(shape.count * shape.elems * 4));
      std::memset(copy_buf.data(), 1, copy_buf.size());  // touched, like reused staging
    }
    for (int r = 0; r < repeat; ++r) {
      if (async_ckpt) {
        // memcpy of the state into memory already touched: the floor for
        // any stall that copies the state.
        t["memcpy"].push_back(Seconds([&] {
          size_t off = 0;
          for (const auto& x : tensors) {
            std::memcpy(copy_buf.data() + off, x.data_ptr(), x.nbytes());
            off += x.nbytes();
          }
        }));
        // XXH3 over the state on one core: what a save would add if it did
        // not overlap hashing with its writes.
        t["xxh3"].push_back(Seconds([&] {
          for (const auto& x : tensors) (void)ckptio::HashBytes(x.data_ptr(), x.nbytes());
        }));
        std::future<ckptio::Status> done;
        t["ckptio_save_async_stall"].push_back(
            Seconds([&] { done = async_ckpt->SaveAsync(r + 1, async_state); }));
        Check(done.get(), "ckptio SaveAsync");
      }
      // Each group's contenders run in an order rotated by one every repeat,
      // so that none always follows the same, heavier one (its writeback,
      // its page cache). Each starts from a settled file system: what it
      // replaces removed, and the removal's TRIMs done (RemoveAndSettle).
      const std::string store = dir + "/store";
      std::vector<torch::Tensor> mine = LoadTargets(tensors);
      ckptio::State state = StateOf(mine);
      std::vector<std::function<void()>> saves;
      // raw write + fsync: the durable limit.
      saves.push_back([&] {
        RemoveAndSettle(raw);
        t["raw_write"].push_back(Seconds([&] {
          int fd = ::open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
          if (fd < 0) Die("open " + raw);
          for (const auto& x : tensors)
            WriteAll(fd, static_cast<const char*>(x.data_ptr()), x.nbytes());
          if (::fsync(fd) != 0) Die("fsync");
          ::close(fd);
          FsyncPath(dir);  // the new name, as ckptio's recipe does
        }));
      });
      // The same with writeback started every 8 MiB (sync_file_range), as
      // ckptio's POSIX backend does: the fair limit for a careful writer.
      saves.push_back([&] {
        RemoveAndSettle(raw);
        t["raw_write_behind"].push_back(Seconds([&] {
          int fd = ::open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
          if (fd < 0) Die("open " + raw);
          off_t started = 0, written = 0;
          for (const auto& x : tensors) {
            const char* p = static_cast<const char*>(x.data_ptr());
            for (size_t done = 0; done < x.nbytes();) {
              size_t n = std::min<size_t>(8 << 20, x.nbytes() - done);
              WriteAll(fd, p + done, n);
              done += n;
              written += static_cast<off_t>(n);
              if (written - started >= (8 << 20)) {
                ::sync_file_range(fd, started, written - started, SYNC_FILE_RANGE_WRITE);
                started = written;
              }
            }
          }
          if (::fsync(fd) != 0) Die("fsync");
          ::close(fd);
          FsyncPath(dir);
        }));
      });
      // ckptio save (a fresh store each time: retention stays out of it).
      saves.push_back([&] {
        RemoveAndSettle(store);
        CkptioSave(store, state, &t["ckptio_save"]);
      });
      saves.push_back([&] {
        RemoveAndSettle(tpt);
        t["torch_save"].push_back(Seconds([&] {
          torch::save(tensors, tpt);
          FsyncPath(tpt);
          FsyncPath(dir);
        }));
      });
      if (!no_python) {
        saves.push_back([&] {
          RemoveAndSettle(pypt);
          t["python_save"].push_back(Python("save", raw, pypt, shape, script));
        });
      }
      // The Python package on the same tensors: save, warm load, async stall.
      if (py_package) {
        saves.push_back([&] {
          const std::string pystore = dir + "/py-store";
          RemoveAndSettle(pystore);
          t["python_ckptio_save"].push_back(Python("pkg_save", raw, pystore, shape, script));
          t["python_ckptio_load"].push_back(Python("pkg_load", raw, pystore, shape, script));
          RemoveAndSettle(pystore);
          const auto async = PythonRun("pkg_async", raw, pystore, shape, script, 2);
          t["python_ckptio_save_async_stall"].push_back(async[0]);
          t["python_memcpy"].push_back(async[1]);
          fs::remove_all(pystore);
        });
      }
      RunRotated(saves, r);
      std::vector<char> buf = ReadBuffer(static_cast<size_t>(fs::file_size(raw)));
      auto raw_read = [&] {
        int fd = ::open(raw.c_str(), O_RDONLY);
        for (size_t off = 0; off < buf.size();) {
          ssize_t n = ::pread(fd, buf.data() + off, buf.size() - off, static_cast<off_t>(off));
          if (n <= 0) Die("read");
          off += static_cast<size_t>(n);
        }
        ::close(fd);
      };
      // Warm loads.
      std::vector<std::function<void()>> warm = {
          [&] { t["raw_read"].push_back(Seconds(raw_read)); },
          [&] {
            CkptioLoad(store, state, &t["ckptio_load"]);
            if (!torch::equal(mine.back(), tensors.back())) Die("ckptio loaded different bytes");
            // Test hook (tests/bench/bench_smoke_test.sh): a warm load made
            // 50 ms slower, so that the sanity checks must refuse the run.
            if (std::getenv("CKPTIO_BENCH_TEST_SLOW_WARM_LOAD")) t["ckptio_load"].back() += 0.05;
          },
          [&] {
            t["torch_load"].push_back(Seconds([&] {
              std::vector<torch::Tensor> back;
              torch::load(back, tpt);
            }));
          }};
      // Into a module whose parameters exist already (the usual resume):
      // ckptio copies into them instead of handing out mapped tensors.
      if (shape.name == "large") {
        warm.push_back([&] {
          const std::string mod_store = dir + "/module-store";
          fs::remove_all(mod_store);
          auto module = std::make_shared<torch::nn::Module>();
          for (size_t i = 0; i < tensors.size(); ++i)
            module->register_parameter("t" + std::to_string(i), tensors[i].clone(), false);
          for (auto& p : module->parameters()) KernelTouch(p.data_ptr(), p.nbytes());
          ckptio::State mstate{{"model", *module}};
          std::vector<double> unused;
          CkptioSave(mod_store, mstate, &unused);
          for (auto& p : module->parameters()) p.data().zero_();
          CkptioLoad(mod_store, mstate, &t["ckptio_load_module"]);
          if (!torch::equal(module->parameters().back(), tensors.back()))
            Die("ckptio loaded different bytes into the module");
          fs::remove_all(mod_store);
        });
      }
      if (!no_python)
        warm.push_back(
            [&] { t["python_load"].push_back(Python("load", raw, pypt, shape, script)); });
      RunRotated(warm, r, dir);
      // Cold loads. The warm load's tensors map the store's files: drop
      // them, or the kernel cannot evict those pages.
      for (auto& m : mine) m = torch::Tensor();
      std::vector<std::function<void()>> cold = {
          [&] {
            DropCache(raw);
            t["raw_read_cold"].push_back(Seconds(raw_read));
          },
          [&] {
            auto ckpt = OpenStore(store);  // opened first: the open reads LATEST and .writer
            DropCache(store);
            CkptioLoad(*ckpt, store, state, &t["ckptio_load_cold"]);
            if (!torch::equal(mine.back(), tensors.back())) Die("ckptio loaded different bytes");
            for (auto& m : mine) m = torch::Tensor();
          },
          [&] {
            DropCache(tpt);
            t["torch_load_cold"].push_back(Seconds([&] {
              std::vector<torch::Tensor> back;
              torch::load(back, tpt);
            }));
          }};
      if (!no_python) {
        cold.push_back([&] {
          DropCache(pypt);
          t["python_load_cold"].push_back(Python("load", raw, pypt, shape, script));
        });
      }
      RunRotated(cold, r, dir);
    }
    if (shape.name == "large") ChecksumPairs(dir, shm, shape, repeat, t);
    if (stripe_ranks > 1 && shape.name == "large")
      StripeRanks(argv[0], dir, stripe_ranks, size_mib, repeat, t);
    if (!nfs_uri.empty() && shape.name == "large") {
      RawNfs nfs(nfs_uri);
      const std::string sub = "ckptio-bench-" + std::to_string(::getpid());
      std::vector<char> buf = ReadBuffer(static_cast<size_t>(bytes));
      const std::string raw_file = "/" + sub + ".raw";
      for (int r = 0; r < repeat; ++r) {
        std::vector<torch::Tensor> mine = LoadTargets(tensors);
        ckptio::State state = StateOf(mine);
        const std::string store = WithSub(nfs_uri, sub + "-" + std::to_string(r));
        // Raw and ckptio take turns going first, each from a settled
        // server: sync() writes back what the other left dirty and ends
        // the removals' work when the server is this machine (elsewhere it
        // settles nothing of the server's). The raw file of the previous
        // repeat is removed untimed, as ckptio's previous store is.
        std::vector<std::function<void()>> writes = {
            [&] {
              nfs.Remove(raw_file);
              ::sync();
              t["nfs_raw_write"].push_back(Seconds([&] { nfs.Write(raw_file, tensors); }));
            },
            [&] {
              ::sync();
              CkptioSave(store, state, &t["nfs_ckptio_save"]);
            }};
        RunRotated(writes, r);
        std::vector<std::function<void()>> reads = {
            [&] { t["nfs_raw_read"].push_back(Seconds([&] { nfs.Read(raw_file, buf); })); },
            [&] { CkptioLoad(store, state, &t["nfs_ckptio_load"]); }};
        RunRotated(reads, r);
        nfs.RemoveStore(store, "/" + sub + "-" + std::to_string(r));
      }
      nfs.Remove(raw_file);
    }
#if CKPTIO_BENCH_S3
    if (!s3_uri.empty() && shape.name == "large") {
      RawS3 raw_s3(s3_uri);
      const std::string sub = "ckptio-bench-" + std::to_string(::getpid());
      std::vector<char> buf = ReadBuffer(static_cast<size_t>(bytes));
      for (int r = 0; r < repeat; ++r) {
        std::vector<torch::Tensor> mine = LoadTargets(tensors);
        ckptio::State state = StateOf(mine);
        const std::string store = WithSub(s3_uri, sub + "-" + std::to_string(r));
        // Raw and ckptio take turns going first; the raw PUT goes to a new
        // key, as ckptio's do, not over the last repeat's (deleted untimed).
        std::vector<std::function<void()>> puts = {
            [&] {
              raw_s3.Delete(sub + ".raw");
              t["s3_raw_put"].push_back(Seconds([&] { raw_s3.Put(sub + ".raw", tensors); }));
            },
            [&] { CkptioSave(store, state, &t["s3_ckptio_save"]); }};
        RunRotated(puts, r);
        std::vector<std::function<void()>> gets = {
            [&] { t["s3_raw_get"].push_back(Seconds([&] { raw_s3.Get(sub + ".raw", buf); })); },
            [&] { CkptioLoad(store, state, &t["s3_ckptio_load"]); }};
        RunRotated(gets, r);
        if (!torch::equal(mine.back(), tensors.back())) Die("ckptio loaded different bytes (s3)");
        RemoveS3Store(store);
      }
      raw_s3.Delete(sub + ".raw");
    }
#endif
    json& js = out["shapes"][shape.name];
    js["tensors"] = shape.count;
    js["gib"] = gib;
    std::printf("\n%s: %lld tensors, %.3f GiB, %d run(s) each (seconds; GiB/s of the median)\n",
                shape.name.c_str(), static_cast<long long>(shape.count), gib, repeat);
    std::printf("  %-32s %9s %9s %9s %9s\n", "contender", "min", "median", "max", "GiB/s");
    for (const auto& [name, v] : t) {
      const ckptio::bench::Summary m = ckptio::bench::Summarize(v);
      js["seconds"][name] = m.median;
      js["min"][name] = m.min;
      js["max"][name] = m.max;
      js["spread"][name] = m.spread;
      js["noisy"][name] = m.noisy;
      js["gib_per_s"][name] = gib / m.median;
      js["runs"][name] = v;
      std::printf("  %-32s %9.4f %9.4f %9.4f %9.3f%s\n", name.c_str(), m.min, m.median, m.max,
                  gib / m.median, m.noisy ? "  noisy" : "");
    }
    for (const std::string& why : ckptio::bench::SanityFailures(t))
      broken.push_back(shape.name + ": " + why);
  }
  out["sanity"]["ok"] = broken.empty();
  out["sanity"]["failures"] = broken;
  auto sec = [&](const char* shape, const char* what) {
    return out["shapes"][shape]["seconds"].value(what, 0.0);
  };
  json& ratios = out["ratios"];
  ratios["save_vs_raw_write"] = sec("large", "raw_write") / sec("large", "ckptio_save");
  ratios["save_vs_raw_write_behind"] =
      sec("large", "raw_write_behind") / sec("large", "ckptio_save");
  ratios["save_vs_torch_save"] = sec("large", "torch_save") / sec("large", "ckptio_save");
  ratios["load_vs_torch_load"] = sec("large", "torch_load") / sec("large", "ckptio_load");
  ratios["load_vs_raw_read"] = sec("large", "raw_read") / sec("large", "ckptio_load");
  ratios["module_load_vs_raw_read"] = sec("large", "raw_read") / sec("large", "ckptio_load_module");
  ratios["module_load_vs_torch_load"] =
      sec("large", "torch_load") / sec("large", "ckptio_load_module");
  ratios["small_tensors_save_vs_raw_write"] =
      sec("small", "raw_write") / sec("small", "ckptio_save");
  ratios["async_stall_vs_sync_save"] =
      sec("large", "ckptio_save") / sec("large", "ckptio_save_async_stall");
  // memcpy's time over the stall: the target (stall <= 1.5 x memcpy) is >= 0.67.
  ratios["async_stall_vs_memcpy"] =
      sec("large", "memcpy") / sec("large", "ckptio_save_async_stall");
  ratios["load_vs_torch_load_cold"] =
      sec("large", "torch_load_cold") / sec("large", "ckptio_load_cold");
  ratios["load_vs_raw_read_cold"] =
      sec("large", "raw_read_cold") / sec("large", "ckptio_load_cold");
  ratios["small_tensors_load_vs_raw_read"] = sec("small", "raw_read") / sec("small", "ckptio_load");
  if (py_package) {
    // The Python package against torch.save (+ fsync) and torch.load of the
    // same tensors, both in Python (targets: >= 2, >= 5; the stall <= 1.5x
    // a copy of the state: >= 0.67).
    for (const char* shape : {"large", "small"}) {
      const std::string suffix = std::string(shape) == "large" ? "" : "_small_tensors";
      ratios["python_pkg_save_vs_torch_save" + suffix] =
          sec(shape, "python_save") / sec(shape, "python_ckptio_save");
      ratios["python_pkg_load_vs_torch_load" + suffix] =
          sec(shape, "python_load") / sec(shape, "python_ckptio_load");
      ratios["python_pkg_async_stall_vs_memcpy" + suffix] =
          sec(shape, "python_memcpy") / sec(shape, "python_ckptio_save_async_stall");
    }
  }
  if (!no_python) {
    ratios["save_vs_python_save"] = sec("large", "python_save") / sec("large", "ckptio_save");
    ratios["load_vs_python_load"] = sec("large", "python_load") / sec("large", "ckptio_load");
    ratios["load_vs_python_load_cold"] =
        sec("large", "python_load_cold") / sec("large", "ckptio_load_cold");
  }
  if (stripe_ranks > 1) {
    const std::string w = std::to_string(stripe_ranks);
    ratios["striped_save_vs_rank0_save_" + w + "ranks"] =
        sec("large", ("ckptio_save_" + w + "ranks").c_str()) /
        sec("large", ("ckptio_save_striped_" + w + "ranks").c_str());
  }
  if (!nfs_uri.empty()) {
    ratios["nfs_save_vs_raw_libnfs_write"] =
        sec("large", "nfs_raw_write") / sec("large", "nfs_ckptio_save");
    ratios["nfs_load_vs_raw_libnfs_read"] =
        sec("large", "nfs_raw_read") / sec("large", "nfs_ckptio_load");
  }
  if (!s3_uri.empty()) {
    ratios["s3_save_vs_raw_put"] = sec("large", "s3_raw_put") / sec("large", "s3_ckptio_save");
    ratios["s3_load_vs_raw_get"] = sec("large", "s3_raw_get") / sec("large", "s3_ckptio_load");
  }
  {
    // Best of the runs each, the usual estimate of undisturbed time on a
    // noisy machine (the disk here swings by 2x from run to run).
    const json& secs = out["shapes"]["large"]["runs"];
    auto best = [&](const std::string& k) {
      const auto v = secs[k].get<std::vector<double>>();
      return *std::min_element(v.begin(), v.end());
    };
    std::printf("\nchecksums' share of a large save (1 - best unhashed / best hashed)\n");
    for (std::string where : {"", "_tmpfs"}) {
      if (!secs.contains("ckptio_save_hashed" + where)) continue;
      const double share =
          1 - best("ckptio_save_unhashed" + where) / best("ckptio_save_hashed" + where);
      out["checksum_share_of_save" + where] = share;
      std::printf("  %-32s %.1f %%\n", where.empty() ? dir.c_str() : "tmpfs (/dev/shm)",
                  100 * share);
    }
  }
  if (!broken.empty()) {
    std::printf(
        "\nthis run is broken by its own checks (noisy: a contender's runs span more than "
        "%.0f %% of their median):\n",
        100 * ckptio::bench::kNoisySpread);
    for (const auto& why : broken) std::printf("  %s\n", why.c_str());
    if (!keep_broken) {
      std::printf("ratios withheld: run again on a quieter machine (--keep-broken prints them)\n");
      out.erase("ratios");
      if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
      fs::remove_all(dir);
      if (!shm.empty()) fs::remove_all(shm);
      return 3;
    }
  }
  std::printf("\nratios (>1: ckptio faster; speed ratio = other's time / ckptio's time)%s\n",
              broken.empty() ? "" : ", FROM A BROKEN RUN");
  for (auto it = ratios.begin(); it != ratios.end(); ++it) {
    if (it->is_null())
      std::printf("  %-32s n/a (not implemented)\n", it.key().c_str());
    else
      std::printf("  %-32s %.3f\n", it.key().c_str(), it->get<double>());
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  fs::remove_all(dir);
  if (!shm.empty()) fs::remove_all(shm);
  return 0;
}
