// The nfs:// backend when the server misbehaves, on a private NFS-Ganesha
// (its own ports, so stopping it disturbs no other test): a hung server
// (SIGSTOP) fails calls by the URI's deadline; a server killed in the
// middle of a save and restarted leaves the old or the new checkpoint,
// never a torn commit, and the store recovers; a server whose file system
// fills up mid-save is reported as full, not as a lost connection.
#include <dirent.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "ckptio/backends.h"
#include "ckptio/nfs_backend.h"
#include "ckptio/store.h"
#include "nfs_server.h"
#include "test_util.h"

namespace ckptio {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::NfsServer;
using testing::RandomBytes;

NfsServer& Private() {
  // Stopped by its destructor when the test process exits.
  static NfsServer server("/tmp/ckptio-nfs-fault-" + std::to_string(::getpid()),
                          NfsServer::Ports{20590, 20148, 20149});
  return server;
}

// Whether every thread of `pid` is stopped ('T' in /proc/PID/task/*/stat).
// kill(SIGSTOP) returns before the threads stop: on a busy machine a server
// thread on another core can still answer a few fast calls.
bool AllThreadsStopped(pid_t pid) {
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = ::opendir(tasks.c_str());
  if (!d) return false;
  bool all = true;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream stat(tasks + "/" + e->d_name + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');  // the name may hold spaces
    if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T')
      all = false;
  }
  ::closedir(d);
  return all;
}

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t).count();
}

class NfsFault : public ::testing::TestWithParam<int> {
 protected:
  // (Restarts a server that an earlier test killed and failed before it
  // started it again.)
  void SetUp() override {
    if (!Private().ok() || !Private().Running()) {
      ASSERT_TRUE(Private().Start()) << "cannot start the private NFS server";
    }
  }
  int version() const { return GetParam(); }
  std::string Uri(const std::string& sub) const {
    ::mkdir((Private().export_dir() + "/" + sub).c_str(), 0755);
    return Private().Uri(version(), sub, "timeout_ms=2000&lease_ms=3000");
  }
};

Status Save(Store& store, int64_t step, size_t bytes) {
  // Made before the save begins: tests time the save from its step's
  // directory appearing, and 256 MiB take seconds to make under ASan.
  const std::string data = RandomBytes(bytes, static_cast<uint64_t>(step));
  WriterOptions o;
  o.chunk_size = 1 << 20;
  o.lock_wait = milliseconds(20000);  // a restarted server may still hold the old lock
  CKPTIO_ASSIGN_OR_RETURN(auto w, store.OpenWriter(o));
  CKPTIO_ASSIGN_OR_RETURN(auto p, w->Begin(step));
  CKPTIO_RETURN_IF_ERROR(p->PutObject("model.safetensors", data.data(), data.size()));
  return p->Commit().status();
}

TEST_P(NfsFault, AHungServerFailsCallsByTheDeadline) {
  const std::string uri = Uri("hung-v" + std::to_string(version()));
  auto store = OpenStore(uri);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE(Save(**store, 1, 1000).ok());
  ASSERT_EQ(::kill(Private().Pid(), SIGSTOP), 0);
  const auto stopping = Clock::now();
  while (!AllThreadsStopped(Private().Pid()) && MsSince(stopping) < 5000)
    std::this_thread::sleep_for(milliseconds(1));
  ASSERT_TRUE(AllThreadsStopped(Private().Pid())) << "the server did not stop within 5 s";
  const auto t0 = Clock::now();
  auto steps = (*store)->ListSteps();
  const int64_t took = MsSince(t0);
  ::kill(Private().Pid(), SIGCONT);
  ASSERT_FALSE(steps.ok()) << "a stopped server answered";
  EXPECT_EQ(steps.status().code(), Code::kUnavailable) << steps.status();
  EXPECT_NE(steps.status().message().find("127.0.0.1"), std::string::npos) << steps.status();
  EXPECT_GE(took, 1500);
  EXPECT_LT(took, 8000) << "the call outlived its 2 s deadline by far";
  std::cout << "nfs v" << version() << ": a SIGSTOPped server failed the call after " << took
            << " ms (timeout_ms=2000): " << steps.status() << "\n";
  // Once the server is back, a new connection works.
  auto again = OpenStore(uri);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->OpenLatest().ok());
}

// A server that hangs in the middle of a save fails the save by about one
// deadline, not one per call made to clean up after it (removing the temp,
// checking the fence, releasing the writer lock: those give up at once
// while the server is known not to answer). Once it answers again, the
// same store saves again.
TEST_P(NfsFault, AServerThatHangsMidSaveFailsTheSaveByOneDeadline) {
  const std::string sub = "hang-save-v" + std::to_string(version());
  auto store = OpenStore(Uri(sub));
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE(Save(**store, 1, 1000).ok());
  auto saving = std::async(std::launch::async, [&] { return Save(**store, 2, 256 << 20); });
  const std::string dir = Private().export_dir() + "/" + sub + "/" + StepDirName(2);
  const auto t0 = Clock::now();
  while (::access(dir.c_str(), F_OK) != 0 && MsSince(t0) < 10000)
    std::this_thread::sleep_for(milliseconds(1));
  ASSERT_EQ(::access(dir.c_str(), F_OK), 0) << "the save did not begin within 10 s";
  ASSERT_EQ(::kill(Private().Pid(), SIGSTOP), 0);
  const auto stopped = Clock::now();
  const bool finished = saving.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  const int64_t took = MsSince(stopped);
  ::kill(Private().Pid(), SIGCONT);
  ASSERT_TRUE(finished) << "the save hung on a stopped server";
  Status s = saving.get();
  ASSERT_FALSE(s.ok()) << "a 256 MiB save finished before the server stopped; make it larger";
  EXPECT_EQ(s.code(), Code::kUnavailable) << s;
  EXPECT_NE(s.message().find("did not answer within 2000 ms"), std::string::npos) << s;
  EXPECT_LT(took, 6000) << "the save took " << took << " ms to fail with timeout_ms=2000: " << s;
  // Back: after timeout_ms the store reconnects; the writer lock left behind
  // ends with its lease, and the same step saves.
  std::this_thread::sleep_for(milliseconds(2100));
  CKPTIO_EXPECT_OK(Save(**store, 2, 1 << 20));
  auto latest = (*store)->OpenLatest();
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ((*latest)->step(), 2);
  CKPTIO_EXPECT_OK((*latest)->Verify());
  if (HasFailure()) return;
  std::cout << "nfs v" << version() << ": a server SIGSTOPped mid-save failed the save " << took
            << " ms later (timeout_ms=2000): " << s << "; after SIGCONT the step saved\n";
}

// A refused reconnect (the server is down or restarting) costs nothing to
// retry, so unlike a timeout it does not hold off the next try: the first
// call after the server is back succeeds, well inside timeout_ms.
TEST_P(NfsFault, ARefusedReconnectIsRetriedAtOnce) {
  const std::string sub = "refused-v" + std::to_string(version());
  ::mkdir((Private().export_dir() + "/" + sub).c_str(), 0755);
  // A deadline far longer than the server takes to restart.
  auto store = OpenStore(Private().Uri(version(), sub, "timeout_ms=30000&lease_ms=3000"));
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE(Save(**store, 1, 1000).ok());
  const int pid = Private().Pid();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  const auto killed = Clock::now();
  while (::kill(pid, 0) == 0 && MsSince(killed) < 5000)
    std::this_thread::sleep_for(milliseconds(1));
  EXPECT_FALSE((*store)->ListSteps().ok()) << "a killed server answered";
  const auto t0 = Clock::now();
  auto refused = (*store)->ListSteps();  // a reconnect, refused
  ASSERT_FALSE(refused.ok()) << "a killed server answered";
  EXPECT_EQ(refused.status().code(), Code::kUnavailable) << refused.status();
  EXPECT_LT(MsSince(t0), 5000) << "a refused reconnect waited: " << refused.status();
  ASSERT_TRUE(Private().Start());
  const auto restarted = Clock::now();
  auto steps = (*store)->ListSteps();
  ASSERT_TRUE(steps.ok()) << "the first call after the restart failed: " << steps.status();
  ASSERT_EQ(steps->size(), 1u);
  EXPECT_EQ(steps->front().step, 1);
  if (HasFailure()) return;
  std::cout << "nfs v" << version() << ": reconnect refused (" << refused.status()
            << "); after the restart the first call reconnected in " << MsSince(restarted)
            << " ms (timeout_ms=30000)\n";
}

TEST_P(NfsFault, AServerKilledMidSaveLeavesAWholeCheckpoint) {
  const std::string sub = "killed-v" + std::to_string(version());
  const std::string uri = Uri(sub);
  {
    auto store = OpenStore(uri);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE(Save(**store, 1, 100000).ok());
  }
  int failed = 0, completed = 0;
  constexpr int kTrials = 3;
  for (int trial = 0; trial < kTrials; ++trial) {
    const int64_t step = 2 + trial;
    auto store = OpenStore(uri);
    ASSERT_TRUE(store.ok()) << store.status();
    // Save a large step; kill the server as soon as its data starts to land.
    auto saving = std::async(std::launch::async, [&] { return Save(**store, step, 48 << 20); });
    const std::string dir = Private().export_dir() + "/" + sub + "/" + StepDirName(step);
    const auto t0 = Clock::now();
    while (::access(dir.c_str(), F_OK) != 0 && MsSince(t0) < 10000)
      std::this_thread::sleep_for(milliseconds(1 + trial * 20));
    ASSERT_EQ(::kill(Private().Pid(), SIGKILL), 0);
    const auto killed = Clock::now();
    Status s = saving.get();
    const int64_t noticed = MsSince(killed);
    (s.ok() ? completed : failed)++;
    if (!s.ok()) {
      EXPECT_TRUE(s.code() == Code::kUnavailable || s.code() == Code::kAborted) << s;
      EXPECT_LT(noticed, 10000) << "the save hung after the server died: " << s;
    }
    // A waiter polling through another client gets a clean error, not a hang.
    auto waiter = OpenStore(uri);
    EXPECT_FALSE(waiter.ok() && (*waiter)->ReadLatest().ok()) << "a dead server answered";
    store->reset();
    ASSERT_TRUE(Private().Start());
    // The restarted job: every committed step verifies, LATEST names one, a
    // repair leaves a clean store and the next save works.
    auto after = OpenStore(uri);
    ASSERT_TRUE(after.ok()) << after.status();
    auto steps = (*after)->ListSteps();
    ASSERT_TRUE(steps.ok()) << steps.status();
    for (const auto& e : *steps) {
      EXPECT_NE(e.state, StepState::kCorrupt) << "step " << e.step << ": " << e.problem;
      if (e.state != StepState::kCommitted) continue;
      auto r = (*after)->OpenStep(e.step);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE((*r)->Verify().ok()) << "committed step " << e.step << " is torn";
    }
    auto latest = (*after)->OpenLatest();
    ASSERT_TRUE(latest.ok()) << latest.status();
    if (s.ok()) {
      EXPECT_EQ((*latest)->step(), step) << "a save that returned OK was lost";
    }
    WriterOptions o;
    o.lock_wait = milliseconds(20000);
    auto w = (*after)->OpenWriter(o);
    ASSERT_TRUE(w.ok()) << w.status();
    auto repaired = (*w)->Repair();
    ASSERT_TRUE(repaired.ok()) << repaired.status();
    EXPECT_TRUE(repaired->clean());
    w->reset();
    if (HasFailure()) return;
    std::cout << "nfs v" << version() << ": trial " << trial << ": Ganesha SIGKILLed mid-save of "
              << "step " << step << "; save " << (s.ok() ? "completed" : "failed: " + s.ToString())
              << " (" << noticed << " ms after the kill); after restart LATEST = step "
              << (*latest)->step() << ", every committed step verified, repair clean\n";
  }
  auto store = OpenStore(uri);
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE(Save(**store, 100, 1000).ok()) << "the store did not recover";
}

INSTANTIATE_TEST_SUITE_P(Versions, NfsFault, ::testing::Values(3, 4),
                         [](const auto& p) { return "v" + std::to_string(p.param); });

// A private server whose export is an 8 MiB tmpfs: a file system that fills.
class FullServer {
 public:
  static constexpr uint64_t kBytes = 8 << 20;
  FullServer() : dir_("/tmp/ckptio-nfs-full-" + std::to_string(::getpid())) {
    std::filesystem::create_directories(export_dir());
    const std::string size = "size=" + std::to_string(kBytes);
    if (::mount("tmpfs", export_dir().c_str(), "tmpfs", 0, size.c_str()) != 0) {
      why_ = "cannot mount an 8 MiB tmpfs to export (" + std::string(std::strerror(errno)) +
             "): this test needs root and mount(2)";
      return;
    }
    mounted_ = true;
    server_ = std::make_unique<NfsServer>(dir_, NfsServer::Ports{20690, 20248, 20249});
  }
  ~FullServer() {
    if (server_) server_->Stop();
    if (mounted_) ::umount2(export_dir().c_str(), MNT_DETACH);
    server_.reset();  // removes dir_
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  bool mounted() const { return mounted_; }
  const std::string& why() const { return why_; }  // not mounted
  std::string export_dir() const { return dir_ + "/export"; }
  NfsServer& server() { return *server_; }

 private:
  std::string dir_, why_;
  bool mounted_ = false;
  std::unique_ptr<NfsServer> server_;
};

FullServer& Full() {
  static FullServer server;
  return server;
}

// The paths under `dir` (recursively) whose name contains `needle`.
std::vector<std::string> FilesNamed(const std::string& dir, const std::string& needle) {
  std::vector<std::string> found;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec))
    if (it->path().string().find(needle) != std::string::npos) found.push_back(it->path());
  return found;
}

class NfsFull : public ::testing::TestWithParam<int> {
 protected:
  int version() const { return GetParam(); }
};

// The server's file system fills up in the middle of a save. libnfs 4.0
// reports a refused NFSv3 WRITE like a broken connection (EFAULT, reason
// dropped); the backend must still say "no space" (RESOURCE_EXHAUSTED, with
// the gc hint), remove its temp, and keep the connection: the committed
// step still reads back and the next, smaller save commits.
TEST_P(NfsFull, AFullServerIsReportedAsFullAndTheStoreStaysUsable) {
  if (!Full().mounted()) GTEST_SKIP() << Full().why();
  ASSERT_TRUE(Full().server().ok()) << "cannot start an NFS server exporting the tmpfs";
  const std::string sub = "full-v" + std::to_string(version());
  ASSERT_EQ(::mkdir((Full().export_dir() + "/" + sub).c_str(), 0755), 0);
  auto store = OpenStore(Full().server().Uri(version(), sub, "timeout_ms=5000"));
  ASSERT_TRUE(store.ok()) << store.status();
  CKPTIO_ASSERT_OK(Save(**store, 1, 1 << 20));

  Status full = Save(**store, 2, 2 * FullServer::kBytes);
  EXPECT_EQ(full.code(), Code::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("No space left"), std::string::npos) << full;
  EXPECT_NE(full.message().find("ckptio gc"), std::string::npos) << full;
  const std::string dir = Full().export_dir() + "/" + sub;
  EXPECT_EQ(FilesNamed(dir, ".ckptio-tmp"), std::vector<std::string>{}) << "temps left behind";
  EXPECT_EQ(FilesNamed(dir, StepDirName(2) + "/"), std::vector<std::string>{});

  auto latest = (*store)->OpenLatest();
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ((*latest)->step(), 1);
  CKPTIO_EXPECT_OK((*latest)->Verify());
  CKPTIO_EXPECT_OK(Save(**store, 3, 1 << 20));  // the store stays usable
  if (HasFailure()) return;
  std::cout << "nfs v" << version() << ": a save larger than the server's 8 MiB file system "
            << "failed with " << CodeName(full.code()) << " (" << full.message()
            << "); no temp left, step 1 verified, step 3 committed after it\n";
}

INSTANTIATE_TEST_SUITE_P(Versions, NfsFull, ::testing::Values(3, 4),
                         [](const auto& p) { return "v" + std::to_string(p.param); });

}  // namespace
}  // namespace ckptio
