// One writer per store, across real processes: the fcntl writer lock, its
// release when the holder exits or is killed, lock waits, races between
// processes, the in-process guard, and generation fencing.
//
// Children are made with fork() (this test binary starts no threads before
// forking), talk to the parent through pipes and always leave with _exit().
// Child exit codes: 0 got the writer, 3 refused (FailedPrecondition), 4 any
// other error, 5 an exception.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ckptio/ckptio.h"
#include "ckptio/coordination.h"
#include "ckptio/posix_backend.h"
#include "process.h"
#include "test_util.h"

namespace ckptio {
namespace {

using ::ckptio::testing::Child;
using ::ckptio::testing::Pipe;
using ::ckptio::testing::RandomBytes;
using ::ckptio::testing::ReadLine;
using ::ckptio::testing::TempDir;
using ::ckptio::testing::WaitForEof;
using ::ckptio::testing::WriteLine;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kChildGotWriter = 0;
constexpr int kChildRefused = 3;
constexpr int kChildOtherError = 4;

// ---------------------------------------------------------------- plumbing

// "OK <generation>" or "ERR <code>: <message>", as children report.
std::string Report(const Result<std::unique_ptr<StoreWriter>>& w) {
  if (w.ok()) return "OK " + std::to_string((*w)->generation());
  return "ERR " + w.status().ToString();
}

int64_t ParseGeneration(const std::string& line) {
  if (line.rfind("OK ", 0) != 0) return -1;
  return std::stoll(line.substr(3));
}

WriterOptions Wait(milliseconds wait) {
  WriterOptions o;
  o.lock_wait = wait;
  return o;
}

int ChildCodeFor(const Status& s) {
  if (s.ok()) return kChildGotWriter;
  return s.code() == Code::kFailedPrecondition ? kChildRefused : kChildOtherError;
}

// Asks the kernel, from a forked child, which process holds a lock on
// <store>/.lock: its pid, 0 when none, -1 on error. (The child holds no
// lock, so opening .lock there cannot disturb the parent's. The in-process
// record of held locks that the child inherits is not consulted.)
pid_t LockHolderSeenByAnotherProcess(const std::string& store) {
  Pipe answer;
  if (!answer.ok()) return -1;
  Child child = Child::Start([&] {
    answer.CloseRead();
    int fd = ::open((store + "/.lock").c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return kChildOtherError;
    struct flock fl;
    std::memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = 0;
    fl.l_len = 0;
    if (::fcntl(fd, F_GETLK, &fl) != 0) return kChildOtherError;
    WriteLine(answer.write_fd(), std::to_string(fl.l_type == F_UNLCK ? 0 : fl.l_pid));
    return kChildGotWriter;
  });
  if (!child.started()) return -1;
  answer.CloseWrite();
  auto line = ReadLine(answer.read_fd(), milliseconds(10000));
  if (child.ExitCode(milliseconds(10000)) != kChildGotWriter || !line) return -1;
  return static_cast<pid_t>(std::stol(*line));
}

class WriterLockTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = tmp_.Sub("store"); }

  // Commits step `step` with one small object.
  void CommitStep(StoreWriter& w, int64_t step) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w.Begin(step));
    const std::string data = RandomBytes(1000, static_cast<uint64_t>(step));
    CKPTIO_ASSERT_OK(p->PutObject("a.bin", data.data(), data.size()));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto info, p->Commit());
    (void)info;
  }

  // The POSIX backend of the store, for a test backend to wrap.
  std::shared_ptr<StorageBackend> Posix() {
    auto posix = NewPosixBackend(path_);
    EXPECT_TRUE(posix.ok()) << posix.status();
    return std::move(*posix);
  }

  TempDir tmp_;
  std::string path_;
};

// ---------------------------------------------------------------- tests

TEST_F(WriterLockTest, SecondProcessIsRefusedNamingTheHolder) {
  Pipe ready, hold;
  ASSERT_TRUE(ready.ok() && hold.ok());
  Child child = Child::Start([&] {
    ready.CloseRead();
    hold.CloseWrite();
    auto store = OpenStore(path_);
    if (!store.ok()) {
      WriteLine(ready.write_fd(), "ERR " + store.status().ToString());
      return kChildOtherError;
    }
    auto w = (*store)->OpenWriter(WriterOptions{});
    WriteLine(ready.write_fd(), Report(w));
    if (!w.ok()) return ChildCodeFor(w.status());
    WaitForEof(hold.read_fd(), milliseconds(30000));
    return kChildGotWriter;  // the writer is destroyed on return
  });
  ASSERT_TRUE(child.started());
  ready.CloseWrite();
  hold.CloseRead();
  auto line = ReadLine(ready.read_fd(), milliseconds(10000));
  ASSERT_TRUE(line.has_value()) << "child did not report";
  const int64_t child_gen = ParseGeneration(*line);
  ASSERT_GT(child_gen, 0) << *line;

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  auto t0 = Clock::now();
  auto refused = store->OpenWriter(WriterOptions{});
  auto took = Clock::now() - t0;
  ASSERT_FALSE(refused.ok()) << "two processes hold the writer of " << path_;
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("already has a writer"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("pid " + std::to_string(child.pid())),
            std::string::npos)
      << "the error should name the holder's pid " << child.pid() << ": " << refused.status();
  // A few ms; the bound leaves room for a loaded machine, not for a wait.
  EXPECT_LT(took, milliseconds(1000)) << "lock_wait=0 should fail at once";

  t0 = Clock::now();
  auto waited = store->OpenWriter(Wait(milliseconds(300)));
  took = Clock::now() - t0;
  ASSERT_FALSE(waited.ok());
  EXPECT_EQ(waited.status().code(), Code::kFailedPrecondition) << waited.status();
  EXPECT_NE(waited.status().message().find("already has a writer"), std::string::npos)
      << waited.status();
  EXPECT_GE(took, milliseconds(300)) << "gave up before lock_wait";
  EXPECT_LT(took, milliseconds(2000)) << "waited far past lock_wait";

  // Let the child finish normally; then the lock is free.
  hold.CloseWrite();
  EXPECT_EQ(child.ExitCode(milliseconds(10000)), kChildGotWriter);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto mine, store->OpenWriter(WriterOptions{}));
  EXPECT_GT(mine->generation(), child_gen);
}

TEST_F(WriterLockTest, KilledHolderReleasesTheLock) {
  Pipe ready, hold;
  ASSERT_TRUE(ready.ok() && hold.ok());
  Child child = Child::Start([&] {
    ready.CloseRead();
    hold.CloseWrite();
    auto store = OpenStore(path_);
    if (!store.ok()) return kChildOtherError;
    auto w = (*store)->OpenWriter(WriterOptions{});
    if (!w.ok()) {
      WriteLine(ready.write_fd(), Report(w));
      return ChildCodeFor(w.status());
    }
    // Die in the middle of writing an object: a temp object stays behind.
    auto p = (*w)->Begin(7);
    if (!p.ok()) return kChildOtherError;
    auto stream = (*p)->AddObject("x.bin");
    if (!stream.ok()) return kChildOtherError;
    const std::string data = RandomBytes(4096, 7);
    if (!(*stream)->Write(data.data(), data.size()).ok()) return kChildOtherError;
    WriteLine(ready.write_fd(), Report(w));
    WaitForEof(hold.read_fd(), milliseconds(30000));
    return kChildOtherError;  // should have been killed
  });
  ASSERT_TRUE(child.started());
  ready.CloseWrite();
  hold.CloseRead();
  auto line = ReadLine(ready.read_fd(), milliseconds(10000));
  ASSERT_TRUE(line.has_value()) << "child did not report";
  const int64_t child_gen = ParseGeneration(*line);
  ASSERT_GT(child_gen, 0) << *line;

  ASSERT_EQ(::kill(child.pid(), SIGKILL), 0);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  auto t0 = Clock::now();
  auto w = store->OpenWriter(Wait(milliseconds(2000)));
  auto took = Clock::now() - t0;
  ASSERT_TRUE(w.ok()) << "the lock of a SIGKILLed writer was not released: " << w.status();
  EXPECT_LT(took, milliseconds(1500));
  EXPECT_GT((*w)->generation(), child_gen);
  EXPECT_GE((*w)->stale_temps_removed(), 1u) << "the dead writer's temp object should be removed";

  auto status = child.Wait(milliseconds(5000));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL);
  // The killed save never became visible.
  auto step = store->OpenStep(7);
  EXPECT_EQ(step.status().code(), Code::kNotFound) << step.status();
}

TEST_F(WriterLockTest, RacingProcessesExactlyOneWins) {
  constexpr int kChildren = 4;
  constexpr int kRounds = 5;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Pipe go, release;
    ASSERT_TRUE(go.ok() && release.ok());
    std::vector<Child> children;
    for (int i = 0; i < kChildren; ++i) {
      children.push_back(Child::Start([&] {
        go.CloseWrite();
        release.CloseWrite();
        auto store = OpenStore(path_);
        if (!store.ok()) return kChildOtherError;
        if (!WaitForEof(go.read_fd(), milliseconds(10000))) return kChildOtherError;
        auto w = (*store)->OpenWriter(Wait(milliseconds(0)));
        if (!w.ok()) return ChildCodeFor(w.status());
        // Hold it at least 500 ms, and until the parent has seen every
        // loser leave (at most 2 s), so that every other child tried while
        // this one held the lock.
        const auto t0 = Clock::now();
        WaitForEof(release.read_fd(), milliseconds(2000));
        auto held = Clock::now() - t0;
        if (held < milliseconds(500)) std::this_thread::sleep_for(milliseconds(500) - held);
        return kChildGotWriter;
      }));
      ASSERT_TRUE(children.back().started());
    }
    go.CloseRead();
    release.CloseRead();
    go.CloseWrite();  // go!

    std::vector<int> codes(kChildren, -1);
    int done = 0;
    const auto deadline = Clock::now() + milliseconds(10000);
    while (done < kChildren && Clock::now() < deadline) {
      for (int i = 0; i < kChildren; ++i) {
        if (codes[i] != -1) continue;
        auto s = children[i].Wait(milliseconds(0));
        if (!s) continue;
        codes[i] = WIFEXITED(*s) ? WEXITSTATUS(*s) : 128 + WTERMSIG(*s);
        ++done;
      }
      if (done >= kChildren - 1) release.CloseWrite();
      std::this_thread::sleep_for(milliseconds(2));
    }
    ASSERT_EQ(done, kChildren) << "children still running after 10 s";
    int winners = 0, refused = 0;
    for (int c : codes) {
      winners += c == kChildGotWriter;
      refused += c == kChildRefused;
    }
    std::string all;
    for (int c : codes) all += std::to_string(c) + " ";
    EXPECT_EQ(winners, 1) << "exit codes: " << all;
    EXPECT_EQ(refused, kChildren - 1) << "exit codes: " << all;
  }
}

TEST_F(WriterLockTest, SecondWriterInTheSameProcessIsRefused) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto first, store->OpenWriter(WriterOptions{}));
  const int64_t g1 = first->generation();

  auto again = store->OpenWriter(WriterOptions{});
  ASSERT_FALSE(again.ok()) << "a second writer on the same Store";
  EXPECT_EQ(again.status().code(), Code::kFailedPrecondition) << again.status();
  EXPECT_NE(again.status().message().find("already has a writer"), std::string::npos)
      << again.status();

  // Another Store object on the same path, with its own backend instance,
  // under various spellings of the path.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, OpenStore("file://" + path_));
  auto waited = other->OpenWriter(Wait(milliseconds(100)));
  ASSERT_FALSE(waited.ok()) << "a second writer through another Store";
  EXPECT_EQ(waited.status().code(), Code::kFailedPrecondition) << waited.status();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(path_ + "/./"));
  Store raw(std::shared_ptr<StorageBackend>(std::move(backend)));
  auto third = raw.OpenWriter(WriterOptions{});
  ASSERT_FALSE(third.ok()) << "a second writer through a fresh backend";
  EXPECT_EQ(third.status().code(), Code::kFailedPrecondition) << third.status();

  // The refusals did not drop the kernel lock the first writer holds.
  EXPECT_EQ(LockHolderSeenByAnotherProcess(path_), ::getpid())
      << "the first writer no longer holds the fcntl lock on .lock";

  first.reset();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto second, other->OpenWriter(WriterOptions{}));
  EXPECT_GT(second->generation(), g1);
  second.reset();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto back, store->OpenWriter(WriterOptions{}));
  EXPECT_GT(back->generation(), g1 + 1);
}

// A store reached through a symlink is the same store: a second writer in
// this process must be refused, and trying must not drop the kernel lock
// the first writer holds (closing any descriptor of .lock drops it).
TEST_F(WriterLockTest, SameProcessThroughSymlinkIsRefusedAndKeepsTheLock) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto first, store->OpenWriter(WriterOptions{}));
  const std::string link = tmp_.Sub("link");
  ASSERT_EQ(::symlink(path_.c_str(), link.c_str()), 0) << std::strerror(errno);

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto via_link, OpenStore(link));
  {
    auto second = via_link->OpenWriter(WriterOptions{});
    EXPECT_FALSE(second.ok()) << "two live writers in one process, through a symlink";
    if (!second.ok()) {
      EXPECT_EQ(second.status().code(), Code::kFailedPrecondition) << second.status();
    }
  }
  EXPECT_EQ(LockHolderSeenByAnotherProcess(path_), ::getpid())
      << "after OpenWriter through the link, the first writer's fcntl lock is gone";
}

// Store::Check probes the lock; through a symlink it must still see the
// live writer and leave its lock in place.
TEST_F(WriterLockTest, CheckThroughSymlinkKeepsTheWritersLock) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto first, store->OpenWriter(WriterOptions{}));
  ASSERT_NO_FATAL_FAILURE(CommitStep(*first, 0));
  const std::string link = tmp_.Sub("link");
  ASSERT_EQ(::symlink(path_.c_str(), link.c_str()), 0) << std::strerror(errno);
  ASSERT_EQ(LockHolderSeenByAnotherProcess(path_), ::getpid());

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto via_link, OpenStore(link));
  auto check = via_link->Check({}, /*verify_data=*/false);
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_TRUE(check->writer_active) << "Check did not see the live writer";
  EXPECT_EQ(LockHolderSeenByAnotherProcess(path_), ::getpid())
      << "after Check through the link, the writer's fcntl lock is gone";
}

TEST_F(WriterLockTest, WaiterGetsTheLockWhenTheHolderExits) {
  Pipe ready;
  ASSERT_TRUE(ready.ok());
  Child child = Child::Start([&] {
    ready.CloseRead();
    auto store = OpenStore(path_);
    if (!store.ok()) return kChildOtherError;
    auto w = (*store)->OpenWriter(WriterOptions{});
    WriteLine(ready.write_fd(), Report(w));
    if (!w.ok()) return ChildCodeFor(w.status());
    std::this_thread::sleep_for(milliseconds(300));
    WriteLine(ready.write_fd(), "releasing " + std::to_string(::ckptio::testing::NowNs()));
    return kChildGotWriter;  // the writer is destroyed on return
  });
  ASSERT_TRUE(child.started());
  ready.CloseWrite();
  auto line = ReadLine(ready.read_fd(), milliseconds(10000));
  ASSERT_TRUE(line.has_value()) << "child did not report";
  const int64_t child_gen = ParseGeneration(*line);
  ASSERT_GT(child_gen, 0) << *line;

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  auto t0 = Clock::now();
  auto w = store->OpenWriter(Wait(milliseconds(5000)));
  const int64_t got_ns = ::ckptio::testing::NowNs();
  auto took = Clock::now() - t0;
  ASSERT_TRUE(w.ok()) << w.status();
  // The child says "releasing" before its writer lets go: a lock got
  // before that time was got while the child held it.
  auto released = ReadLine(ready.read_fd(), milliseconds(10000));
  ASSERT_TRUE(released.has_value() && released->rfind("releasing ", 0) == 0)
      << "child did not report";
  EXPECT_GE(got_ns, std::stoll(released->substr(10)))
      << "got the lock while the child still held it";
  EXPECT_LT(took, milliseconds(4000));
  EXPECT_GT((*w)->generation(), child_gen);
  EXPECT_EQ(child.ExitCode(milliseconds(5000)), kChildGotWriter);
}

// A backend whose writer lock is held by someone else until `free_after`
// from its making, counting OpenWriter's tries; then it is the store's own.
class HeldLockBackend : public testing::ForwardingBackend {
 public:
  HeldLockBackend(std::shared_ptr<StorageBackend> inner, bool leases, milliseconds free_after)
      : ForwardingBackend(std::move(inner)), leases_(leases), free_at_(Clock::now() + free_after) {}
  bool LocksAreLeases() const override { return leases_; }
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    ++tries;
    if (Clock::now() < free_at_) return Status(Code::kFailedPrecondition, "held by the test");
    return ForwardingBackend::TryLock(key, mode);
  }
  int tries = 0;

 private:
  const bool leases_;
  const Clock::time_point free_at_;
};

// A writer waiting for the lock tries again sooner where a try is a system
// call (a file lock: within 20 ms) than where it is requests to a server (a
// lease: the pause grows to 1 s, not 50 tries a second for as long as a
// save holds the store), and either way takes the lock within its pause of
// its release. However long the pause, an interrupt (Ctrl-C in Python) is
// seen within 50 ms.
TEST_F(WriterLockTest, ALeaseIsAskedForLessOftenThanAFileLockAndBothAreTakenOnRelease) {
  for (bool leases : {false, true}) {
    SCOPED_TRACE(leases ? "leases" : "file locks");
    auto backend = std::make_shared<HeldLockBackend>(Posix(), leases, milliseconds(2500));
    Store store(backend);
    const auto t0 = Clock::now();
    auto w = store.OpenWriter(Wait(milliseconds(30000)));
    const auto took = Clock::now() - t0;
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_GE(took, milliseconds(2500));
    EXPECT_LT(took, milliseconds(leases ? 3500 + 500 : 2500 + 500))
        << "the released lock was taken late";
    // 2.5 s of tries: every 20 ms, over 120; 1 ms doubling to 1 s, 13.
    if (leases)
      EXPECT_LE(backend->tries, 16) << "a lease was asked for too often";
    else
      EXPECT_GE(backend->tries, 60) << "a file lock was asked for too seldom";
  }
  const auto t0 = Clock::now();
  WaitInterrupt interrupt([&] {
    return Clock::now() - t0 < milliseconds(600) ? OkStatus() : Status(Code::kAborted, "stop");
  });
  auto backend = std::make_shared<HeldLockBackend>(Posix(), true, milliseconds(30000));
  auto w = Store(backend).OpenWriter(Wait(milliseconds(30000)));
  EXPECT_EQ(w.status().code(), Code::kAborted) << w.status();
  // Within the pause of 512 ms that began at about 511 ms, not at its end.
  EXPECT_LT(Clock::now() - t0, milliseconds(900)) << "the interrupt waited for the pause";
}

TEST_F(WriterLockTest, FencedWriterCannotCommit) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w1, store->OpenWriter(WriterOptions{}));
  const int64_t g = w1->generation();
  ASSERT_NO_FATAL_FAILURE(CommitStep(*w1, 0));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest_before, store->ReadLatest());
  ASSERT_TRUE(latest_before.has_value());

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w1->Begin(1));
  const std::string data = RandomBytes(5000, 1);
  CKPTIO_ASSERT_OK(pending->PutObject("a.bin", data.data(), data.size()));

  // A newer writer claims the store (as if it took over after a lease ran
  // out), through a backend of its own.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, NewPosixBackend(path_));
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto rec, other->NewObject(kWriterKey, WriteMode::kReplace));
    const std::string bytes = SerializeWriterRecord({g + 1, "otherhost", 4242, 0});
    CKPTIO_ASSERT_OK(rec->Append(bytes.data(), bytes.size()));
    CKPTIO_ASSERT_OK(rec->Commit());
  }

  auto committed = pending->Commit();
  ASSERT_FALSE(committed.ok()) << "a fenced writer committed step 1";
  EXPECT_EQ(committed.status().code(), Code::kAborted) << committed.status();
  EXPECT_NE(committed.status().message().find("fenced"), std::string::npos) << committed.status();
  pending.reset();

  auto step = store->OpenStep(1);
  EXPECT_EQ(step.status().code(), Code::kNotFound) << step.status();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest_after, store->ReadLatest());
  ASSERT_TRUE(latest_after.has_value());
  EXPECT_EQ(latest_after->step, latest_before->step);
  EXPECT_EQ(latest_after->generation, latest_before->generation);
  EXPECT_EQ(latest_after->manifest_hash, latest_before->manifest_hash);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store->ListSteps());
  for (const auto& s : steps)
    EXPECT_FALSE(s.step == 1 && s.state == StepState::kCommitted) << "step 1 is listed";

  // It stays fenced: the next save fails at Begin, before it clears what
  // the new writer has put in that step as if it were its own torn attempt.
  const std::string theirs = StepDirName(2) + "/theirs.bin";
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto obj, other->NewObject(theirs, WriteMode::kReplace));
    CKPTIO_ASSERT_OK(obj->Append(data.data(), data.size()));
    CKPTIO_ASSERT_OK(obj->Commit());
  }
  auto next = w1->Begin(2);
  ASSERT_FALSE(next.ok()) << "a fenced writer began step 2";
  EXPECT_EQ(next.status().code(), Code::kAborted) << next.status();
  EXPECT_NE(next.status().message().find("fenced"), std::string::npos) << next.status();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto info, other->Stat(theirs));
  EXPECT_EQ(info.size, data.size()) << "the fenced writer cleared the new writer's object";
  EXPECT_EQ(store->OpenStep(2).status().code(), Code::kNotFound);
}

// Two writers that each believed they held the lock (an object store's
// lease broken while its holder was paused) both claim generation
// max + 1: the one whose claim .writer no longer holds is fenced, though
// the number matches.
TEST_F(WriterLockTest, ASameGenerationClaimedByAnotherWriterFences) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w1, store->OpenWriter(WriterOptions{}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w1->Begin(1));
  const std::string data = RandomBytes(5000, 2);
  CKPTIO_ASSERT_OK(pending->PutObject("a.bin", data.data(), data.size()));

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, NewPosixBackend(path_));
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto rec, other->NewObject(kWriterKey, WriteMode::kReplace));
    const std::string bytes = SerializeWriterRecord({w1->generation(), "otherhost", 4242, 7});
    CKPTIO_ASSERT_OK(rec->Append(bytes.data(), bytes.size()));
    CKPTIO_ASSERT_OK(rec->Commit());
  }
  auto committed = pending->Commit();
  ASSERT_FALSE(committed.ok()) << "a writer whose claim was overwritten committed step 1";
  EXPECT_EQ(committed.status().code(), Code::kAborted) << committed.status();
  EXPECT_NE(committed.status().message().find("otherhost"), std::string::npos)
      << committed.status();
  EXPECT_EQ(store->OpenStep(1).status().code(), Code::kNotFound);
}

// A backend like an object store: locks are leases that can be broken
// under a live holder (every TryLock succeeds, as a lease taken over after
// its holder paused past it would), and an exclusive create is not atomic
// for a large object (a multipart upload completes over whatever is there),
// so every create replaces.
class LeasingBackend : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  bool LocksAreLeases() const override { return true; }
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view, LockMode) override {
    return std::unique_ptr<BackendLock>(new BackendLock);
  }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode) override {
    return ForwardingBackend::NewObject(key, WriteMode::kReplace);
  }
};

// Where locks are leases, each writer writes its objects in a folder of its
// own, named by the manifest: a writer that lost its lease and goes on
// writing cannot touch the step its successor committed, and its commit is
// fenced. (Without folders its objects would land on the committed names.)
TEST_F(WriterLockTest, WhereLocksAreLeasesAStaleWriterCannotTouchACommittedStep) {
  Store store(std::make_shared<LeasingBackend>(Posix()));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale, store.OpenWriter(WriterOptions{}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale_step, stale->Begin(5));
  const std::string old_bytes = RandomBytes(9000, 3);

  // The successor takes over (the stale writer's lease was broken) and
  // commits step 5 with an object of the same name.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto next, store.OpenWriter(WriterOptions{}));
  const std::string new_bytes = RandomBytes(9000, 4);
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, next->Begin(5));
    CKPTIO_ASSERT_OK(p->PutObject("a.bin", new_bytes.data(), new_bytes.size()));
    CKPTIO_ASSERT_OK(p->Commit().status());
  }
  // The stale writer wakes up and goes on: its late object of the same name
  // goes to its own folder (without folders it would replace the committed
  // one), and its commit is refused.
  CKPTIO_ASSERT_OK(stale_step->PutObject("a.bin", old_bytes.data(), old_bytes.size()));
  auto committed = stale_step->Commit();
  ASSERT_FALSE(committed.ok()) << "a stale writer committed step 5 over its successor's";
  EXPECT_EQ(committed.status().code(), Code::kAborted) << committed.status();
  stale_step.reset();

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, store.OpenStep(5));
  CKPTIO_ASSERT_OK(reader->Verify());
  const auto& meta = reader->manifest().metadata;
  ASSERT_TRUE(meta.count(kObjectsFolderKey)) << "no objects folder in the manifest";
  const std::string folder = meta.at(kObjectsFolderKey);
  EXPECT_EQ(folder.rfind("w" + std::to_string(next->generation()) + "-", 0), 0u) << folder;
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string got, reader->ReadAll("a.bin"));
  EXPECT_EQ(got, new_bytes);
  EXPECT_EQ(testing::ReadFile(path_ + "/" + StepDirName(5) + "/" + folder + "/a.bin"), new_bytes);
  // A manifest whose folder would leave the step is damage.
  Manifest m = reader->manifest();
  m.metadata[kObjectsFolderKey] = "..";
  EXPECT_EQ(ParseManifest(SerializeManifest(m), "test").status().code(), Code::kDataLoss);
}

// A LeasingBackend on which the writer that believes it holds the store
// stalls (past its lease) after its last fence check: `stall` runs once, as
// the successor that took over, when it lists `prefix`, or (`prefix`
// empty) once `fence_checks` more fence checks have opened .writer (the
// check still reads the record it opened: it passes).
class StallingBackend : public LeasingBackend {
 public:
  using LeasingBackend::LeasingBackend;
  std::string prefix;
  int fence_checks = 0;
  std::function<void()> stall;
  Result<std::vector<std::string>> List(std::string_view p) override {
    if (stall && !prefix.empty() && p == prefix) std::exchange(stall, nullptr)();
    return LeasingBackend::List(p);
  }
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    auto opened = LeasingBackend::OpenObject(key);
    if (stall && prefix.empty() && key == kWriterKey && --fence_checks == 0)
      std::exchange(stall, nullptr)();
    return opened;
  }
};

class LeaseTakeoverTest : public WriterLockTest {
 protected:
  void SetUp() override {
    WriterLockTest::SetUp();
    backend_ = std::make_shared<StallingBackend>(Posix());
    store_ = std::make_unique<Store>(backend_);
  }

  // The successor: takes the store over and writes step `step`'s objects
  // (committing them if `commit`); its pending checkpoint is kept in
  // `successor_step_`.
  void TakeOverAndSave(int64_t step, bool commit) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(successor_, store_->OpenWriter(WriterOptions{}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(successor_step_, successor_->Begin(step));
    CKPTIO_ASSERT_OK(successor_step_->PutObject("model.bin", model_.data(), model_.size()));
    CKPTIO_ASSERT_OK(successor_step_->PutObject("optim.bin", optim_.data(), optim_.size()));
    if (commit) CKPTIO_ASSERT_OK(successor_step_->Commit().status());
  }

  // Step `step` holds the successor's bytes, every one verified.
  void ExpectSuccessorsStep(int64_t step) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, store_->OpenStep(step));
    CKPTIO_ASSERT_OK(reader->Verify());
    EXPECT_EQ(reader->manifest().generation, successor_->generation());
    CKPTIO_ASSERT_OK_AND_ASSIGN(std::string model, reader->ReadAll("model.bin"));
    EXPECT_EQ(model, model_);
    CKPTIO_ASSERT_OK_AND_ASSIGN(std::string optim, reader->ReadAll("optim.bin"));
    EXPECT_EQ(optim, optim_);
  }

  std::shared_ptr<StallingBackend> backend_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<StoreWriter> successor_;
  std::unique_ptr<PendingCheckpoint> successor_step_;
  const std::string model_ = RandomBytes(9000, 11), optim_ = RandomBytes(7000, 12);
};

// A stale writer beginning a step clears its own torn attempt at it, never
// what its successor is writing there (it listed the step after its fence
// check, and stalled in between): the successor's save commits whole.
TEST_F(LeaseTakeoverTest, AStaleWritersBeginLeavesItsSuccessorsObjects) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale, store_->OpenWriter(WriterOptions{}));
  backend_->prefix = StepDirName(5) + "/";
  backend_->stall = [&] { TakeOverAndSave(5, /*commit=*/false); };
  {
    auto began = stale->Begin(5);
    ASSERT_TRUE(successor_step_) << "the stale writer's Begin never listed the step";
  }  // its step abandoned: fenced by now, it deletes nothing
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto info, successor_step_->Commit());
  EXPECT_EQ(info.step, 5);
  ExpectSuccessorsStep(5);
}

// gc or fsck --repair by a stale writer: a torn step it found is being
// saved (or was committed) by the successor by the time it deletes it.
// Neither the successor's objects nor its manifest are deleted.
TEST_F(LeaseTakeoverTest, AStaleRepairLeavesAStepItsSuccessorSavesOrCommitted) {
  for (bool commit : {false, true}) {
    SCOPED_TRACE(commit ? "committed by the successor" : "being saved by the successor");
    const int64_t step = commit ? 8 : 7;
    // A torn step, left by a writer that died.
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto dead, store_->OpenWriter(WriterOptions{}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(
        auto junk, backend_->NewObject(StepDirName(step) + "/dead.bin", WriteMode::kReplace));
    CKPTIO_ASSERT_OK(junk->Append("junk", 4));
    CKPTIO_ASSERT_OK(junk->Commit());
    dead.reset();

    CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale, store_->OpenWriter(WriterOptions{}));
    backend_->prefix = StepDirName(step) + "/";
    backend_->stall = [&] { TakeOverAndSave(step, commit); };
    auto repaired = stale->Repair();
    ASSERT_TRUE(successor_step_) << "the repair never listed step " << step;
    ASSERT_TRUE(repaired.ok()) << repaired.status();
    if (commit) {
      const std::string left = "left torn step " + std::to_string(step) +
                               ": committed since by another writer of generation " +
                               std::to_string(stale->generation()) + " or above";
      EXPECT_NE(std::find(repaired->repairs.begin(), repaired->repairs.end(), left),
                repaired->repairs.end())
          << "no \"" << left << "\" among the repairs";
    }
    if (!commit) CKPTIO_ASSERT_OK(successor_step_->Commit().status());
    ExpectSuccessorsStep(step);
    successor_step_.reset();
    successor_.reset();
  }
}

// Two writers may claim one generation where locks are leases (see
// ASameGenerationClaimedByAnotherWriterFences): a repair leaves the objects
// folder of any writer but itself of its generation or above, and clears
// those of older writers.
TEST_F(LeaseTakeoverTest, ARepairLeavesEveryFolderButItsOwnOfItsGenerationOrAbove) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter(WriterOptions{}));
  const int64_t g = w->generation();
  const std::string dir = StepDirName(4) + "/";
  auto put = [&](const std::string& key) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto obj, backend_->NewObject(key, WriteMode::kReplace));
    CKPTIO_ASSERT_OK(obj->Append("x", 1));
    CKPTIO_ASSERT_OK(obj->Commit());
  };
  const std::string older = dir + "w" + std::to_string(g - 1) + "-0123456789abcdef/a.bin";
  const std::string same = dir + "w" + std::to_string(g) + "-0123456789abcdef/a.bin";
  const std::string newer = dir + "w" + std::to_string(g + 1) + "-0123456789abcdef/a.bin";
  // Its own folder (as named in a step it commits) is not a successor's.
  ASSERT_NO_FATAL_FAILURE(CommitStep(*w, 2));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto step2, store_->OpenStep(2));
  const std::string mine = dir + step2->manifest().metadata.at(kObjectsFolderKey) + "/a.bin";
  for (const auto& key : {older, same, newer, mine, dir + "loose.bin"}) put(key);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto repaired, w->Repair());
  EXPECT_EQ(repaired.repairs,
            std::vector<std::string>{"deleted torn step 4 but for the objects of another writer "
                                     "of generation " +
                                     std::to_string(g) + " or above"});
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto left, backend_->List(dir));
  EXPECT_EQ(left, (std::vector<std::string>{same, newer}));
}

// A killed writer's temp in its objects folder is swept by the next writer
// (and listed by fsck before that), as one in a step's folder is.
TEST_F(LeaseTakeoverTest, ADeadWritersTempInItsObjectsFolderIsSwept) {
  const std::string temp =
      StepDirName(3) + "/w7-0123456789abcdef/" + TempObjectName("model.safetensors");
  for (const std::string& dir :
       {path_, path_ + "/" + StepDirName(3), path_ + "/" + StepDirName(3) + "/w7-0123456789abcdef"})
    ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0) << dir;
  testing::WriteFile(path_ + "/" + temp, "half an object");
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check());
  std::vector<std::string> temps;  // (and the torn step 3)
  for (const auto& p : report.problems)
    if (p.kind == FsckProblem::Kind::kStaleTemp) temps.push_back(p.detail);
  EXPECT_EQ(temps, std::vector<std::string>{temp});
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter(WriterOptions{}));
  EXPECT_EQ(w->stale_temps_removed(), 1u);
  EXPECT_EQ(::access((path_ + "/" + temp).c_str(), F_OK), -1) << temp << " is still there";
}

// A stale writer's gc or retention deletes the steps it found too old; by
// the time it deletes one, its successor may have deleted that step and
// saved it again (a load that fell back below it, then a save): the
// successor's step is left whole.
TEST_F(LeaseTakeoverTest, AStaleGcLeavesAStepItsSuccessorSavedAgain) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale, store_->OpenWriter(WriterOptions{}));
  for (int64_t step : {1, 2, 3}) ASSERT_NO_FATAL_FAILURE(CommitStep(*stale, step));
  backend_->fence_checks = 2;  // gc's first, then the one before it deletes step 1
  backend_->stall = [&] {
    // Nothing deleted yet; a successor deletes step 1, and the writer after
    // it saves step 1 again.
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListStepsWithManifest());
    ASSERT_EQ(steps, (std::vector<int64_t>{1, 2, 3})) << "the stall came after a deletion";
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto deleting, store_->OpenWriter(WriterOptions{}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto gc, deleting->CollectGarbage(2));
    ASSERT_EQ(gc.deleted, std::vector<int64_t>{1});
    TakeOverAndSave(1, /*commit=*/true);
  };
  auto gc = stale->CollectGarbage(1);
  ASSERT_TRUE(successor_step_) << "the stale gc never checked its fence twice";
  // Fenced at step 2's check: it went past step 1 (and left it).
  EXPECT_EQ(gc.status().code(), Code::kAborted) << gc.status();
  EXPECT_NE(gc.status().message().find("retention: deleting step 2 (done before this: left step 1"),
            std::string::npos)
      << gc.status();
  ExpectSuccessorsStep(1);
}

// The same, with the stall after the stale gc deleted step 1's manifest and
// before it lists the step's objects: the successor saves step 1 anew in
// between, and its manifest, in that listing, is left with its objects.
TEST_F(LeaseTakeoverTest, AStaleGcLeavesAStepSavedAgainAfterItDeletedTheManifest) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale, store_->OpenWriter(WriterOptions{}));
  for (int64_t step : {1, 2}) ASSERT_NO_FATAL_FAILURE(CommitStep(*stale, step));
  backend_->prefix = StepDirName(1) + "/";
  backend_->stall = [&] {
    ASSERT_EQ(store_->OpenStep(1).status().code(), Code::kNotFound) << "manifest not deleted yet";
    TakeOverAndSave(1, /*commit=*/true);
  };
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto gc, stale->CollectGarbage(1));
  ASSERT_TRUE(successor_step_) << "the stale gc never listed step 1";
  EXPECT_EQ(gc.deleted, std::vector<int64_t>{});
  EXPECT_EQ(gc.left, std::vector<int64_t>{1});
  ExpectSuccessorsStep(1);
}

// Whatever cleared an object after it was written (here by hand), Commit
// looks every object up before the manifest names it: a missing one or one
// of another size fails the commit (DataLoss), and nothing is committed.
TEST_F(WriterLockTest, ACommitRefusesAnObjectGoneOrResizedSinceItWasWritten) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(path_));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store->OpenWriter(WriterOptions{}));
  for (bool remove : {true, false}) {
    const int64_t step = remove ? 1 : 2;
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(step));
    const std::string data = RandomBytes(5000, 5);
    CKPTIO_ASSERT_OK(p->PutObject("a.bin", data.data(), data.size()));
    CKPTIO_ASSERT_OK(p->PutObject("optim.bin", data.data(), data.size()));
    const std::string file = path_ + "/" + StepDirName(step) + "/optim.bin";
    if (remove)
      ASSERT_EQ(::unlink(file.c_str()), 0);
    else
      ASSERT_EQ(::truncate(file.c_str(), 100), 0);
    auto committed = p->Commit();
    ASSERT_FALSE(committed.ok()) << "committed a step whose object " << file << " was "
                                 << (remove ? "deleted" : "cut short");
    EXPECT_EQ(committed.status().code(), Code::kDataLoss) << committed.status();
    EXPECT_NE(committed.status().message().find("optim.bin"), std::string::npos)
        << committed.status();
    p.reset();
    EXPECT_EQ(store->OpenStep(step).status().code(), Code::kNotFound);
  }
}

// Where locks are leases, gc reads a step's manifest again before deleting
// it (has a successor saved the step again since?). When that read fails
// for a reason other than damage, gc cannot tell, so it stops there and
// deletes nothing of that step.
class ManifestReadFails : public LeasingBackend {
 public:
  using LeasingBackend::LeasingBackend;
  std::string failing;  // this key's opens fail, after the first (gc's listing)
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    if (key == failing && ++opens_ > 1) return Status(Code::kUnavailable, "read timed out");
    return LeasingBackend::OpenObject(key);
  }

 private:
  int opens_ = 0;
};

TEST_F(WriterLockTest, WhereLocksAreLeasesGcStopsWhenItCannotReadAStepsManifest) {
  auto backend = std::make_shared<ManifestReadFails>(Posix());
  Store store(backend);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store.OpenWriter(WriterOptions{}));
  for (int64_t step : {1, 2, 3}) ASSERT_NO_FATAL_FAILURE(CommitStep(*w, step));
  backend->failing = ManifestKey(1);
  auto gc = w->CollectGarbage(1);
  ASSERT_FALSE(gc.ok()) << "gc deleted step 1 without knowing whether it was saved again";
  EXPECT_EQ(gc.status().code(), Code::kUnavailable) << gc.status();
  EXPECT_NE(gc.status().message().find("deleting step 1"), std::string::npos) << gc.status();
  EXPECT_NE(gc.status().message().find("reading its manifest"), std::string::npos) << gc.status();
  backend->failing.clear();
  for (int64_t step : {1, 2, 3}) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store.OpenStep(step));
    CKPTIO_EXPECT_OK(r->Verify());
  }
}

}  // namespace

}  // namespace ckptio
