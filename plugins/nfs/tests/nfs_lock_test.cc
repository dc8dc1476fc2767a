// The nfs:// backend's locks against a real NFS-Ganesha on loopback: NFSv4
// locks (LOCKT, renewals that fail or get stuck, releases) and NFSv3 lease
// files (renewal on a connection of its own, grace, breaking an expired
// lease, a lease taken over by another client), through libnfs calls this
// binary interposes (nfs_hooks.h) and, for the renewal thread, a
// pthread_create that fails on demand (refuse_threads.h).
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "ckptio/nfs_backend.h"
#include "nfs_hooks.h"
#include "nfs_server.h"
#include "nfs_test_fixture.h"
#include "refuse_threads.h"
#include "test_util.h"

namespace ckptio {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::Contains;
using testing::NfsBackendFaults;
using testing::NfsV3Faults;
using testing::NfsV4Faults;
using testing::RandomBytes;
using testing::ReadLocal;
using testing::ReplaceLocal;

int64_t UnixMs() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t).count();
}

// NFSv4 IsLocked: a lock held elsewhere is "locked"; a LOCKT that fails
// (a timeout, an I/O error) is that error, not "locked".
TEST_P(NfsV4Faults, IsLockedReportsAFailedTestAsAnError) {
  auto other = Backend();
  ASSERT_TRUE(other);
  {
    auto lock = other->TryLock("lk");
    ASSERT_TRUE(lock.ok()) << lock.status();
    auto locked = backend_->IsLocked("lk");
    ASSERT_TRUE(locked.ok()) << locked.status();
    EXPECT_TRUE(*locked);
  }
  auto locked = backend_->IsLocked("lk");
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_FALSE(*locked);
  for (int err : {EIO, ETIMEDOUT}) {
    nfs_hooks::Hooks h;
    h.lockf = [&](nfs_context* n, nfsfh*, nfs4_lock_op, uint64_t) {
      return nfs_hooks::Fail(n, -err, err == EIO ? "nfs_service failed" : "Command timed out");
    };
    nfs_hooks::Scope scope(h);
    auto r = backend_->IsLocked("lk");
    EXPECT_FALSE(r.ok()) << std::strerror(err) << " read as " << (r.ok() && *r ? "locked" : "free");
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status();
    }
  }
}

// Hooks under which the first READ of a thread other than this one (the
// keepalive thread's renewal) gets no answer for 3 s; *stuck says it began.
nfs_hooks::Hooks FirstRenewalReadStuck(std::atomic<bool>* stuck) {
  nfs_hooks::Hooks h;
  h.pread = [stuck, test_thread = std::this_thread::get_id()](
                nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
    if (std::this_thread::get_id() != test_thread && !stuck->exchange(true))
      std::this_thread::sleep_for(milliseconds(3000));
    return nfs_hooks::RealPread(n, fh, off, count, buf);
  };
  return h;
}

// NFSv3 lease locks: a call that times out on the data connection (a slow
// COMMIT, say) does not stop the lease renewals on their own connection,
// though no remount is tried for timeout_ms: the lock outlives its lease
// and another client cannot break it.
TEST_P(NfsV3Faults, ATimeoutOnTheDataConnectionKeepsTheLeaseRenewed) {
  auto holder = Backend("lease_ms=2000&timeout_ms=8000");  // renewed every 667 ms
  ASSERT_TRUE(holder);
  auto lock = holder->TryLock("lk");
  ASSERT_TRUE(lock.ok()) << lock.status();
  {
    nfs_hooks::Hooks h;
    h.stat = [&](nfs_context* n, const char* path, nfs_stat_64*) {
      if (!std::strstr(path, "/obj")) return 1;
      return nfs_hooks::Fail(n, -ETIMEDOUT, "Command timed out");
    };
    nfs_hooks::Scope scope(h);
    auto info = holder->Stat("obj");
    ASSERT_FALSE(info.ok());
    EXPECT_TRUE(Contains(info.status().message(), "did not answer within")) << info.status();
  }
  std::this_thread::sleep_for(milliseconds(5000));  // 2.5 leases, inside timeout_ms
  auto taken = backend_->TryLock("lk");
  ASSERT_FALSE(taken.ok()) << "another client broke the lock while its holder was renewing it";
  EXPECT_EQ(taken.status().code(), Code::kFailedPrecondition) << taken.status();
}

// NFSv3 lease locks: renewals run without holding the lock table, so a
// release never waits for a renewal stuck on the server (which made a hung
// server take two timeout_ms to fail a save). The release still removes
// the lease file, and the stuck renewal, once it ends, does not bring the
// lock back: another client takes it at once.
TEST_P(NfsV3Faults, AReleaseDoesNotWaitForARenewalStuckOnTheServer) {
  std::atomic<bool> stuck{false};
  auto holder = Backend("lease_ms=1000&timeout_ms=10000");  // renewed every 333 ms
  ASSERT_TRUE(holder);
  auto lock = holder->TryLock("lk");
  ASSERT_TRUE(lock.ok()) << lock.status();
  {
    nfs_hooks::Scope scope(FirstRenewalReadStuck(&stuck));  // of the lease file
    const auto t0 = Clock::now();
    while (!stuck && Clock::now() - t0 < milliseconds(5000))
      std::this_thread::sleep_for(milliseconds(5));
    ASSERT_TRUE(stuck) << "no renewal within 5 s";
    const auto released = Clock::now();
    lock->reset();
    EXPECT_LT(MsSince(released), 1000) << "the release waited for the stuck renewal";
    EXPECT_TRUE(ReadLocal(dir_ + "/lk").empty()) << "the release left the lease file";
    auto taken = backend_->TryLock("lk");
    EXPECT_TRUE(taken.ok()) << taken.status();
    std::this_thread::sleep_for(milliseconds(3500));  // the stuck renewal ends
    auto locked = holder->IsLocked("lk");
    ASSERT_TRUE(locked.ok()) << locked.status();
    EXPECT_TRUE(*locked) << "the new holder's lease is gone";
    if (taken.ok()) taken->reset();
  }
  holder.reset();  // joins the keepalive thread before the hook's captures go
}

// NFSv4 locks: renewals (a READ on each lock's own connection) run without
// holding the lock table, so releasing another lock never waits for a
// renewal stuck on the server, and releasing the stuck one waits only
// briefly: its renewal unlocks it once the READ ends. (A hung server made a
// save take two timeout_ms to fail.) Both locks are then free again.
TEST_P(NfsV4Faults, AReleaseDoesNotWaitForARenewalStuckOnTheServer) {
  std::atomic<bool> stuck{false};
  auto holder = Backend("lease_ms=6000&timeout_ms=10000");  // renewed every 2 s
  ASSERT_TRUE(holder);
  {
    // (The first renewal comes 2 s after the first lock is taken.)
    nfs_hooks::Scope scope(FirstRenewalReadStuck(&stuck));
    auto first = holder->TryLock("a");  // renewed first (the table is sorted)
    auto second = holder->TryLock("b");
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE(second.ok()) << second.status();
    ASSERT_FALSE(stuck) << "a renewal began before both locks were taken";
    const auto t0 = Clock::now();
    while (!stuck && Clock::now() - t0 < milliseconds(5000))
      std::this_thread::sleep_for(milliseconds(5));
    ASSERT_TRUE(stuck) << "no renewal within 5 s";
    const auto stuck_at = Clock::now();
    auto released = Clock::now();
    second->reset();
    EXPECT_LT(MsSince(released), 1000)
        << "releasing a lock waited for another lock's stuck renewal";
    auto taken = backend_->TryLock("b");
    EXPECT_TRUE(taken.ok()) << "the released lock is still held: " << taken.status();
    if (taken.ok()) taken->reset();
    released = Clock::now();
    first->reset();
    EXPECT_LT(MsSince(released), 1000) << "the release waited for its lock's stuck renewal";
    // The stuck renewal ends (3 s after it began), and unlocks: polled for
    // 6.5 s from then, well inside the test server's 10 s lease (which would
    // free the lock by itself).
    do {
      std::this_thread::sleep_for(milliseconds(100));
      taken = backend_->TryLock("a");
    } while (!taken.ok() && Clock::now() - stuck_at < milliseconds(6500));
    EXPECT_TRUE(taken.ok()) << "the stuck renewal did not unlock the released lock: "
                            << taken.status();
  }
  holder.reset();  // joins the keepalive thread before the hook's captures go
}

// NFSv4 locks: a lock whose renewals fail is not taken for held by its own
// process: IsLocked asks the server, which still holds it until this
// client's lease there runs out (10 s in the test server), and then not.
// (A file-lock rank 0 takes its save lock again then.)
TEST_P(NfsV4Faults, ALockWhoseRenewalsFailIsHeldOnlyWhileTheServerSaysSo) {
  std::atomic<int> failed{0};
  auto holder = Backend("lease_ms=3000");  // renewed every second
  ASSERT_TRUE(holder);
  auto lock = holder->TryLock("lk");
  ASSERT_TRUE(lock.ok()) << lock.status();
  {
    nfs_hooks::Hooks h;
    h.pread = [&failed, test_thread = std::this_thread::get_id()](
                  nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
      if (std::this_thread::get_id() == test_thread)
        return nfs_hooks::RealPread(n, fh, off, count, buf);
      ++failed;  // a renewal: the lock's connection is gone
      return nfs_hooks::Fail(n, -EIO, "nfs_service failed");
    };
    nfs_hooks::Scope scope(h);
    const auto t0 = Clock::now();
    while (failed == 0 && Clock::now() - t0 < milliseconds(5000))
      std::this_thread::sleep_for(milliseconds(5));
    ASSERT_GT(failed.load(), 0) << "no renewal within 5 s";
    auto locked = holder->IsLocked("lk");
    ASSERT_TRUE(locked.ok()) << locked.status();
    EXPECT_TRUE(*locked) << "the server still holds the lock";
    bool freed = false;
    while (!freed && Clock::now() - t0 < milliseconds(60000)) {
      std::this_thread::sleep_for(milliseconds(500));
      locked = holder->IsLocked("lk");
      ASSERT_TRUE(locked.ok()) << locked.status();
      freed = !*locked;
    }
    EXPECT_TRUE(freed) << "a lock the server let go still counts as held after " << MsSince(t0)
                       << " ms";
    auto taken = backend_->TryLock("lk");
    EXPECT_TRUE(taken.ok()) << taken.status();
    lock->reset();
  }
  holder.reset();  // joins the keepalive thread before the hook's captures go
}

// A lock needs the thread that renews it: where none can be started
// (RLIMIT_NPROC, memory), TryLock says so and takes nothing, rather than
// throw out of a Status API or hold a lock that ends with its lease while
// its holder still writes.
TEST_P(NfsBackendFaults, NoLockIsTakenWithoutItsRenewalThread) {
  {
    testing::RefuseThreads none;
    auto lock = backend_->TryLock("lk");
    EXPECT_GT(none.refused(), 0) << "no thread start was refused: the test proves nothing";
    ASSERT_FALSE(lock.ok()) << "a lock that nobody renews";
    EXPECT_EQ(lock.status().code(), Code::kResourceExhausted) << lock.status();
    EXPECT_NE(lock.status().message().find("renews locks"), std::string::npos) << lock.status();
  }
  auto other = Backend();
  ASSERT_TRUE(other);
  auto locked = other->IsLocked("lk");
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_FALSE(*locked) << "the refused TryLock left the lock held";
  auto lock = backend_->TryLock("lk");  // threads again: the same backend locks
  EXPECT_TRUE(lock.ok()) << lock.status();
}

// NFSv3 lease locks: IsLocked takes a lease for expired only past a third
// of a lease of grace, and on two reads up to a second apart: a holder's
// renewal that lands between them (a stalled server held it up; a read
// raced its rewrite) keeps the lock held.
TEST_P(NfsV3Faults, IsLockedGivesALeaseGraceAndReadsItTwice) {
  auto other = Backend("lease_ms=6000");  // 2 s of grace
  ASSERT_TRUE(other);
  auto lease = [](int64_t expires_ms) {
    return "ckptio-lease owner=holder expires_ms=" + std::to_string(expires_ms) + "\n";
  };
  auto locked = [&] {
    auto r = other->IsLocked("lk");
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() && *r;
  };
  ReplaceLocal(dir_ + "/lk", lease(UnixMs() - 500));
  EXPECT_TRUE(locked()) << "expired by 500 ms, within the grace of 2000 ms";
  ReplaceLocal(dir_ + "/lk", lease(UnixMs() - 60000));
  EXPECT_FALSE(locked()) << "expired a minute ago";
  {
    std::atomic<bool> renewed{false};
    nfs_hooks::Hooks h;
    h.pread = [&](nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
      int rc = nfs_hooks::RealPread(n, fh, off, count, buf);
      if (!renewed.exchange(true)) ReplaceLocal(dir_ + "/lk", lease(UnixMs() + 6000));
      return rc;
    };
    nfs_hooks::Scope scope(h);
    EXPECT_TRUE(locked()) << "one read of an expired lease, renewed right after, passed for free";
    EXPECT_TRUE(renewed.load());
  }
}

// NFSv3 lease locks: a holder whose lease another client took over (it was
// paused past its lease) does not write its record back over the new one.
TEST_P(NfsV3Faults, ARenewalLeavesANewHoldersLeaseAlone) {
  auto holder = Backend("lease_ms=1000");  // renewed every 333 ms
  ASSERT_TRUE(holder);
  auto lock = holder->TryLock("lk");
  ASSERT_TRUE(lock.ok()) << lock.status();
  const std::string theirs =
      "ckptio-lease owner=someone-else expires_ms=" + std::to_string(UnixMs() + 600000) + "\n";
  ReplaceLocal(dir_ + "/lk", theirs);
  std::this_thread::sleep_for(milliseconds(1500));
  EXPECT_EQ(ReadLocal(dir_ + "/lk"), theirs) << "the old holder overwrote the new holder's lease";
  lock->reset();
  EXPECT_EQ(ReadLocal(dir_ + "/lk"), theirs) << "the old holder removed the new holder's lease";
  auto locked = backend_->IsLocked("lk");
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_TRUE(*locked);
}

// NFSv3 lease locks: a lease file is never seen empty, so a client that
// looks while another is taking the lock cannot judge it expired and break
// it: of two racing TryLocks exactly one wins, and its lease stays.
TEST_P(NfsV3Faults, ALeaseBeingTakenIsNeverSeenEmpty) {
  auto first = Backend();
  auto second = Backend();
  ASSERT_TRUE(first && second);
  std::atomic<bool> fired{false};
  Result<std::unique_ptr<BackendLock>> inside = Status(Code::kInternal, "never ran");
  Result<std::unique_ptr<BackendLock>> outside = Status(Code::kInternal, "never ran");
  {
    nfs_hooks::Hooks h;
    h.open2 = [&](nfs_context* n, const char* path, int flags, int mode, nfsfh** fh) {
      int rc = nfs_hooks::RealOpen2(n, path, flags, mode, fh);
      // Just after the first client creates its lease (or its lease's temp):
      // the second one tries.
      if (rc == 0 && std::strstr(path, "lk") && !fired.exchange(true))
        inside = second->TryLock("lk");
      return rc;
    };
    nfs_hooks::Scope scope(h);
    outside = first->TryLock("lk");
  }
  ASSERT_TRUE(fired.load());
  EXPECT_NE(inside.ok(), outside.ok())
      << "first: " << outside.status() << "; second: " << inside.status();
  for (const auto* loser : {&inside, &outside}) {
    if (!loser->ok()) {
      EXPECT_EQ(loser->status().code(), Code::kFailedPrecondition) << loser->status();
    }
  }
  const std::string lease = ReadLocal(dir_ + "/lk");
  EXPECT_TRUE(Contains(lease, "expires_ms="))
      << "the winner's lease is gone or empty: \"" << lease << "\"";
  auto locked = backend_->IsLocked("lk");
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_TRUE(*locked);
}

// NFSv4 IsLocked: only NFS4ERR_DENIED is "locked". NFS4ERR_ACCESS (EACCES)
// and NFS4ERR_FHEXPIRED (EAGAIN) are errors.
TEST_P(NfsV4Faults, OnlyADenialIsLocked) {
  ASSERT_TRUE(Put(*backend_, "lk", "").ok());
  for (const auto& [err, text] : {std::make_pair(EACCES, "LOCKT failed with NFS4ERR_ACCESS(13)"),
                                  std::make_pair(EAGAIN, "LOCKT failed with NFS4ERR_FHEXPIRED")}) {
    nfs_hooks::Hooks h;
    h.lockf = [&, err = err, text = text](nfs_context* n, nfsfh*, nfs4_lock_op, uint64_t) {
      return nfs_hooks::Fail(n, -err, text);
    };
    nfs_hooks::Scope scope(h);
    auto r = backend_->IsLocked("lk");
    EXPECT_FALSE(r.ok()) << text << " read as " << (r.ok() && *r ? "locked" : "free");
  }
}

// NFSv3 lease locks: a breaker of an expired lease that cannot read back
// what it moved aside (it may be a lease another client took after we
// looked) puts it back and does not take the lock.
TEST_P(NfsV3Faults, ABreakerNeverDeletesALeaseItCouldNotRead) {
  const std::string expired =
      "ckptio-lease owner=dead expires_ms=" + std::to_string(UnixMs() - 60000) + "\n";
  const std::string live =
      "ckptio-lease owner=someone-else expires_ms=" + std::to_string(UnixMs() + 600000) + "\n";
  {
    std::ofstream f(dir_ + "/lk");
    f << expired;
  }
  std::atomic<bool> moved{false}, failed_read{false};
  Result<std::unique_ptr<BackendLock>> lock = Status(Code::kInternal, "never ran");
  {
    nfs_hooks::Hooks h;
    h.rename = [&](nfs_context* n, const char* a, const char* b) {
      int rc = nfs_hooks::RealRename(n, a, b);
      if (rc == 0 && std::strstr(b, ".broken.")) {
        // Another client broke the same expired lease and took the lock
        // first: what we moved aside is its live lease.
        ReplaceLocal(dir_ + "/" + std::string(std::strrchr(b, '/') + 1), live);
        moved = true;
      }
      return rc;
    };
    h.pread = [&](nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
      if (moved && !failed_read.exchange(true))
        return nfs_hooks::Fail(n, -EIO, "read call failed with \"NFS3ERR_IO(-5)\"");
      return nfs_hooks::RealPread(n, fh, off, count, buf);
    };
    nfs_hooks::Scope scope(h);
    lock = backend_->TryLock("lk");
  }
  ASSERT_TRUE(moved.load() && failed_read.load());
  EXPECT_FALSE(lock.ok()) << "took the lock after deleting a lease it could not read";
  EXPECT_EQ(ReadLocal(dir_ + "/lk"), live) << "the live lease moved aside was not put back";
}

// NFSv3 lease locks: a renewal that finds the lease file missing (a
// breaker's move aside, put back a moment later) does not give the lock up.
TEST_P(NfsV3Faults, ARenewalRidesOutALeaseBrieflyMovedAside) {
  auto holder = Backend("lease_ms=3000");  // renewed every second
  ASSERT_TRUE(holder);
  auto lock = holder->TryLock("lk");
  ASSERT_TRUE(lock.ok()) << lock.status();
  const std::string lk = dir_ + "/lk", aside = dir_ + "/lk.aside";
  ASSERT_EQ(std::rename(lk.c_str(), aside.c_str()), 0);
  std::this_thread::sleep_for(milliseconds(2200));  // at least one renewal finds it gone
  ASSERT_EQ(std::rename(aside.c_str(), lk.c_str()), 0);
  const std::string put_back = ReadLocal(lk);
  std::this_thread::sleep_for(milliseconds(2400));
  EXPECT_NE(ReadLocal(lk), put_back) << "renewal stopped after the lease file briefly vanished";
  auto locked = holder->IsLocked("lk");
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_TRUE(*locked) << "the holder gave its lock up";
}

// NFSv3 lease locks: renewal does not wait for the data connection. A
// WRITE that takes longer than the lease (a slow COMMIT, a call waiting
// out its timeout) does not let another client break a live holder's lease.
TEST_P(NfsV3Faults, ALeaseIsRenewedWhileTheDataConnectionIsBusy) {
  auto holder = Backend("lease_ms=2000");
  auto other = Backend("lease_ms=2000");
  ASSERT_TRUE(holder && other);
  auto lock = holder->TryLock("lk");
  ASSERT_TRUE(lock.ok()) << lock.status();
  auto w = holder->NewObject("big", WriteMode::kReplace);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string big = RandomBytes(2 << 20, 7);
  std::atomic<bool> slowed{false};
  std::promise<void> writing;
  Result<std::unique_ptr<BackendLock>> stolen = Status(Code::kInternal, "never ran");
  {
    nfs_hooks::Hooks h;
    const auto writer_thread = std::this_thread::get_id();
    h.pwrite = [&](nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, const void* buf) {
      if (std::this_thread::get_id() == writer_thread && !slowed.exchange(true)) {
        writing.set_value();
        std::this_thread::sleep_for(milliseconds(6000));  // holds the data connection
      }
      return nfs_hooks::RealPwrite(n, fh, off, count, buf);
    };
    nfs_hooks::Scope scope(h);
    auto thief = std::async(std::launch::async, [&] {
      writing.get_future().wait();
      std::this_thread::sleep_for(milliseconds(4000));  // twice the lease
      stolen = other->TryLock("lk");
    });
    ASSERT_TRUE((*w)->Append(big.data(), big.size()).ok());
    thief.get();
  }
  EXPECT_FALSE(stolen.ok())
      << "a live holder's lease was broken while its data connection was busy";
  if (!stolen.ok()) {
    EXPECT_EQ(stolen.status().code(), Code::kFailedPrecondition) << stolen.status();
  }
  EXPECT_TRUE((*w)->Commit().ok());
}

INSTANTIATE_TEST_SUITE_P(Versions, NfsBackendFaults, ::testing::Values(3, 4),
                         [](const auto& p) { return "v" + std::to_string(p.param); });
INSTANTIATE_TEST_SUITE_P(Version, NfsV4Faults, ::testing::Values(4),
                         [](const auto& p) { return "v" + std::to_string(p.param); });
INSTANTIATE_TEST_SUITE_P(Version, NfsV3Faults, ::testing::Values(3),
                         [](const auto& p) { return "v" + std::to_string(p.param); });

}  // namespace
}  // namespace ckptio
