#include "test_util.h"

#include <sys/vfs.h>

#include <boost/filesystem.hpp>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include "ckptio/posix_backend.h"

namespace ckptio::testing {

namespace fs = boost::filesystem;

TempDir::TempDir() {
  fs::path base = fs::temp_directory_path();
  // On a network (or FUSE) file system the POSIX backend works in lease
  // mode, each writer's objects in a folder of its own, and the tests that
  // name objects' paths would fail for that reason alone.
  struct statfs info {};
  if (::statfs(base.c_str(), &info) == 0 && IsNetworkFileSystem(static_cast<uint64_t>(info.f_type)))
    throw std::runtime_error("the tests need a local file system for their files, and " +
                             base.string() +
                             " is a network or FUSE one: set TMPDIR to a local folder");
  fs::path p = base / fs::unique_path("ckptio-test-%%%%-%%%%-%%%%");
  fs::create_directories(p);
  path_ = p.string();
}

TempDir::~TempDir() {
  boost::system::error_code ec;
  fs::remove_all(path_, ec);
}

std::string NewJobId() {
  std::random_device rd;
  char buf[32];
  std::snprintf(buf, sizeof buf, "job-%08x%08x", rd(), rd());
  return buf;
}

RankInfo TestRank(int rank, int world, const std::string& job) {
  RankInfo r;
  r.rank = rank;
  r.local_rank = rank;
  r.world_size = world;
  r.local_world_size = world;
  r.job_id = job;
  r.source = "explicit";
  return r;
}

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>(rng() & 0xff);
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void FlipBit(const std::string& path, uint64_t offset, int bit) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ (1 << bit));
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

namespace {
class RecordingWriter : public ObjectWriter {
 public:
  RecordingWriter(RecordingBackend* owner, std::string key, std::unique_ptr<ObjectWriter> inner)
      : owner_(owner), key_(std::move(key)), inner_(std::move(inner)) {}
  Status Append(const void* data, size_t size) override {
    owner_->Record("append " + key_);
    return inner_->Append(data, size);
  }
  Status Commit() override {
    Status s = inner_->Commit();
    owner_->Record((s.ok() ? "commit " : "commit-failed ") + key_);
    return s;
  }

 private:
  RecordingBackend* owner_;
  std::string key_;
  std::unique_ptr<ObjectWriter> inner_;
};
}  // namespace

void RecordingBackend::Record(std::string line) {
  std::lock_guard<std::mutex> g(mu_);
  log_.push_back(std::move(line));
}

std::vector<std::string> RecordingBackend::log() const {
  std::lock_guard<std::mutex> g(mu_);
  return log_;
}

void RecordingBackend::Clear() {
  std::lock_guard<std::mutex> g(mu_);
  log_.clear();
}

Result<std::unique_ptr<ObjectWriter>> RecordingBackend::NewObject(std::string_view key,
                                                                  WriteMode mode) {
  Record(std::string(mode == WriteMode::kReplace ? "new " : "new-exclusive ") + std::string(key));
  CKPTIO_ASSIGN_OR_RETURN(auto inner, inner_->NewObject(key, mode));
  return std::unique_ptr<ObjectWriter>(
      std::make_unique<RecordingWriter>(this, std::string(key), std::move(inner)));
}

Result<std::unique_ptr<ObjectReader>> RecordingBackend::OpenObject(std::string_view key) {
  Record("open " + std::string(key));
  return inner_->OpenObject(key);
}

Result<ObjectInfo> RecordingBackend::Stat(std::string_view key) {
  Record("stat " + std::string(key));
  return inner_->Stat(key);
}

Result<std::vector<std::string>> RecordingBackend::List(std::string_view prefix) {
  Record("list " + std::string(prefix));
  return inner_->List(prefix);
}

Status RecordingBackend::Delete(std::string_view key) {
  Status s = inner_->Delete(key);
  Record((s.ok() ? "delete " : "delete-failed ") + std::string(key));
  return s;
}

Result<std::unique_ptr<BackendLock>> RecordingBackend::TryLock(std::string_view key,
                                                               LockMode mode) {
  Record(std::string(mode == LockMode::kShared ? "lock-shared " : "lock ") + std::string(key));
  return inner_->TryLock(key, mode);
}

}  // namespace ckptio::testing
