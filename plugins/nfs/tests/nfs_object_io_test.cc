// The nfs:// backend's objects against a real NFS-Ganesha on loopback, over
// NFSv3 and NFSv4, through libnfs calls this binary interposes
// (nfs_hooks.h): RENAMEs and READs that fail or lose their reply, broken
// connections and the reconnect after them, batches of WRITEs and READs in
// flight (short answers, calls that cannot be queued, failures), an object
// cut short, a server that reads less, and links planted in the store.
#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../nfs_limits.h"
#include "ckptio/nfs_backend.h"
#include "nfs_hooks.h"
#include "nfs_server.h"
#include "nfs_test_fixture.h"
#include "test_util.h"

namespace ckptio {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::Contains;
using testing::FreshFolder;
using testing::NfsBackendFaults;
using testing::NfsServer;
using testing::NfsV4Faults;
using testing::RandomBytes;
using testing::ReadLocal;
using testing::ReplaceLocal;

// A stat hook that fails every look at a temp (".ckptio-tmp.") as libnfs
// would, with `rc` and `text`, counting them in `looks`; other looks go
// through.
std::function<int(nfs_context*, const char*, nfs_stat_64*)> FailTempLooks(std::atomic<int>& looks,
                                                                          int rc,
                                                                          const char* text) {
  return [&looks, rc, text](nfs_context* n, const char* path, nfs_stat_64*) {
    if (!std::strstr(path, ".ckptio-tmp.")) return 1;
    ++looks;
    return nfs_hooks::Fail(n, rc, text);
  };
}

// A RENAME whose reply is lost (it happened) commits. One that failed (it
// did not happen), followed by a failed look at the temp, is an error: the
// target having our size (LATEST always has) is no proof it is ours.
TEST_P(NfsBackendFaults, AFailedRenameIsNotTakenForDoneByTheTargetsSize) {
  ASSERT_TRUE(Put(*backend_, "LATEST", "step-0001").ok());
  std::atomic<int> renames{0}, temp_stats{0};
  {
    nfs_hooks::Hooks h;
    h.rename = [&](nfs_context* n, const char*, const char*) {
      ++renames;
      // Not done (a server busy, or a reply that never came).
      return nfs_hooks::Fail(n, -EAGAIN, "rename call failed with \"NFS3ERR_JUKEBOX(-11)\"");
    };
    h.stat = FailTempLooks(temp_stats, -EIO, "nfs_service failed");  // the look fails too
    nfs_hooks::Scope scope(h);
    Status s = Put(*backend_, "LATEST", "step-0002");
    EXPECT_FALSE(s.ok()) << "a RENAME that never happened was reported committed";
  }
  EXPECT_GE(renames.load(), 1);
  EXPECT_GE(temp_stats.load(), 1);
  EXPECT_EQ(ReadLocal(dir_ + "/LATEST"), "step-0001");
  {
    nfs_hooks::Hooks h;
    h.rename = [&](nfs_context* n, const char* a, const char* b) {
      int rc = nfs_hooks::RealRename(n, a, b);
      EXPECT_EQ(rc, 0);
      return nfs_hooks::Fail(n, -EINTR, "Command timed out");  // done, the reply lost
    };
    nfs_hooks::Scope scope(h);
    Status s = Put(*backend_, "LATEST", "step-0003");
    EXPECT_TRUE(s.ok()) << "a RENAME that happened (reply lost) failed the commit: " << s;
  }
  EXPECT_EQ(ReadLocal(dir_ + "/LATEST"), "step-0003");
}

// A LINK (an object created exclusively) that failed is checked against the
// temp, which keeps its name either way: a LINK that happened with its
// reply lost commits; another client's object under the name is
// ALREADY_EXISTS and stays as it was; a LINK that failed, followed by a
// failed look at the temp, is an error.
TEST_P(NfsBackendFaults, AFailedLinkIsCheckedAgainstTheTempsFile) {
  {
    nfs_hooks::Hooks h;
    h.link = [&](nfs_context* n, const char* a, const char* b) {
      EXPECT_EQ(nfs_hooks::RealLink(n, a, b), 0);
      return nfs_hooks::Fail(n, -EINTR, "Command timed out");  // done, the reply lost
    };
    nfs_hooks::Scope scope(h);
    Status s = Put(*backend_, "linked", "ours", WriteMode::kCreateExclusive);
    EXPECT_TRUE(s.ok()) << "a LINK that happened (reply lost) failed the commit: " << s;
  }
  EXPECT_EQ(ReadLocal(dir_ + "/linked"), "ours");
  backend_ = Backend();  // (the timeout leaves the old one quiet)
  ASSERT_TRUE(backend_);
  {
    std::ofstream(dir_ + "/theirs") << "their bytes";
    Status s = Put(*backend_, "theirs", "ours", WriteMode::kCreateExclusive);
    EXPECT_EQ(s.code(), Code::kAlreadyExists) << s;
    EXPECT_EQ(ReadLocal(dir_ + "/theirs"), "their bytes");
  }
  {
    std::atomic<int> temp_stats{0};
    nfs_hooks::Hooks h;
    h.link = [&](nfs_context* n, const char*, const char*) {
      return nfs_hooks::Fail(n, -EAGAIN, "link call failed with \"NFS3ERR_JUKEBOX(-11)\"");
    };
    h.stat = FailTempLooks(temp_stats, -EIO, "nfs_service failed");  // the look fails too
    nfs_hooks::Scope scope(h);
    Status s = Put(*backend_, "unlinked", "ours", WriteMode::kCreateExclusive);
    EXPECT_FALSE(s.ok()) << "a LINK that never happened was reported committed";
    EXPECT_GE(temp_stats.load(), 1);
  }
  struct stat st;
  EXPECT_NE(::stat((dir_ + "/unlinked").c_str(), &st), 0);
}

// A RENAME or LINK that timed out is checked by a look at the temp; when
// that look times out too (the server hangs), the quiet starts again from
// it: the next call fails at once, naming the look as the reason.
TEST_P(NfsBackendFaults, ALookAfterACommitThatTimedOutRestartsTheQuiet) {
  for (WriteMode mode : {WriteMode::kReplace, WriteMode::kCreateExclusive}) {
    SCOPED_TRACE(mode == WriteMode::kReplace ? "RENAME" : "LINK");
    backend_ = Backend();
    ASSERT_TRUE(backend_);
    std::atomic<int> looks{0};
    {
      nfs_hooks::Hooks h;
      auto timed_out = [](nfs_context* n, const char*, const char*) {
        return nfs_hooks::Fail(n, -EINTR, "Command timed out");  // not done
      };
      h.rename = timed_out;
      h.link = timed_out;
      h.stat = FailTempLooks(looks, -EINTR, "Command timed out");
      nfs_hooks::Scope scope(h);
      Status s = Put(*backend_, "object", "bytes", mode);
      EXPECT_EQ(s.code(), Code::kUnavailable) << s;
    }
    EXPECT_EQ(looks.load(), 1);
    auto again = backend_->Stat("object");
    ASSERT_FALSE(again.ok());
    EXPECT_TRUE(Contains(again.status().message(), "not reconnecting") &&
                Contains(again.status().message(), "stat ") &&
                Contains(again.status().message(), ".ckptio-tmp."))
        << "the quiet's reason should be the look at the temp: " << again.status();
  }
}

// A READ or WRITE failed with EFAULT whose GETATTR probe then times out is
// the server not answering: told so, and the quiet starts (the next call
// fails at once instead of reconnecting to the hung server).
TEST_P(NfsBackendFaults, AnEfaultWhoseProbeTimesOutIsAServerNotAnswering) {
  ASSERT_TRUE(Put(*backend_, "small", "bytes").ok());
  nfs_hooks::Hooks h;
  h.pread = [&](nfs_context* n, nfsfh*, uint64_t, uint64_t, void*) {
    return nfs_hooks::Fail(n, -EFAULT, "pread call failed with \"F\"");
  };
  h.fstat = [&](nfs_context* n, nfsfh*, nfs_stat_64*) {
    return nfs_hooks::Fail(n, -EINTR, "Command timed out");
  };
  nfs_hooks::Scope scope(h);
  auto got = Get(*backend_, "small");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), Code::kUnavailable) << got.status();
  EXPECT_TRUE(Contains(got.status().message(), "did not answer")) << got.status();
  auto again = Get(*backend_, "small");
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(Contains(again.status().message(), "not reconnecting")) << again.status();
}

// A MKDIR that timed out (the server hangs) fails the write at once: the
// folder is not looked for (that look would wait out the deadline again,
// and the connection is not used after a timeout). One refused because the
// folder exists is looked at, and the write goes on.
TEST_P(NfsBackendFaults, AMkdirThatTimedOutIsNotFollowedByALook) {
  std::atomic<int> mkdirs{0}, looks{0};
  {
    nfs_hooks::Hooks h;
    h.mkdir = [&](nfs_context* n, const char* path) {
      ++mkdirs;
      EXPECT_EQ(nfs_hooks::RealMkdir(n, path), 0);
      return nfs_hooks::Fail(n, -EINTR, "Command timed out");  // done, the reply lost
    };
    h.stat = [&](nfs_context*, const char* path, nfs_stat_64*) {
      if (std::strstr(path, "/made")) ++looks;
      return 1;
    };
    nfs_hooks::Scope scope(h);
    Status s = Put(*backend_, "made/obj", "bytes");
    EXPECT_EQ(s.code(), Code::kUnavailable) << s;
    EXPECT_TRUE(Contains(s.message(), "did not answer")) << s;
  }
  EXPECT_EQ(mkdirs.load(), 1);
  EXPECT_EQ(looks.load(), 0) << "the folder was looked for after its MKDIR timed out";
  // Refused as existing: looked at, and the write goes on (on a new
  // connection, once the quiet after the timeout is over).
  backend_ = Backend();
  ASSERT_TRUE(backend_);
  {
    nfs_hooks::Hooks h;
    h.mkdir = [&](nfs_context* n, const char*) {
      return nfs_hooks::Fail(n, -EEXIST, "mkdir call failed with \"NFS3ERR_EXIST(-17)\"");
    };
    h.stat = [&](nfs_context*, const char* path, nfs_stat_64*) {
      if (std::strstr(path, "/made")) ++looks;
      return 1;
    };
    nfs_hooks::Scope scope(h);
    CKPTIO_EXPECT_OK(Put(*backend_, "made/obj", "bytes"));
  }
  EXPECT_GE(looks.load(), 1);
  EXPECT_EQ(ReadLocal(dir_ + "/made/obj"), "bytes");
}

// libnfs reports a broken connection as EFAULT: that is Unavailable, and
// not retried as if the file had been replaced.
TEST_P(NfsBackendFaults, ABrokenConnectionIsUnavailableAndNotRetried) {
  ASSERT_TRUE(Put(*backend_, "obj", "bytes").ok());
  std::atomic<int> calls{0};
  Result<ObjectInfo> info = Status(Code::kInternal, "unset");
  {
    nfs_hooks::Hooks h;
    h.stat = [&](nfs_context* n, const char* path, nfs_stat_64*) {
      if (!std::strstr(path, "/obj")) return 1;
      ++calls;
      return nfs_hooks::Fail(n, -EFAULT,
                             "stat call failed with \"RPC ERROR: Failed to reconnect async\"");
    };
    nfs_hooks::Scope scope(h);
    info = backend_->Stat("obj");
  }
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), Code::kUnavailable) << info.status();
  EXPECT_TRUE(Contains(info.status().message(), "connection")) << info.status();
  EXPECT_EQ(calls.load(), 1) << "a transport error was retried: " << info.status();
}

// An NFSv4 server that forgot this client (its lease ran out while the
// trainer was idle) answers NFS4ERR_EXPIRED: v4 reconnects under a new
// client identity and the call goes through; the same text from a v3
// server means nothing of the kind, and the error is returned, not retried.
TEST_P(NfsBackendFaults, AnExpiredV4ClientReconnectsAndTheCallGoesThrough) {
  ASSERT_TRUE(Put(*backend_, "obj", "bytes").ok());
  std::atomic<int> calls{0};
  Result<ObjectInfo> info = Status(Code::kInternal, "unset");
  {
    nfs_hooks::Hooks h;
    h.stat = [&](nfs_context* n, const char* path, nfs_stat_64*) {
      if (!std::strstr(path, "/obj") || ++calls > 1) return 1;  // 1: the real call
      return nfs_hooks::Fail(n, -EIO, "GETATTR failed with NFS4ERR_EXPIRED(-10011)");
    };
    nfs_hooks::Scope scope(h);
    info = backend_->Stat("obj");
  }
  if (GetParam() == 4) {
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->size, 5u);
    EXPECT_EQ(calls.load(), 2);
  } else {
    ASSERT_FALSE(info.ok());
    EXPECT_EQ(info.status().code(), Code::kUnavailable) << info.status();
    EXPECT_EQ(calls.load(), 1) << info.status();
  }
}

// libnfs 4.0 fails an NFSv3 READ of a file replaced since it was opened
// (or one the server refused) with EFAULT, as it does a broken connection; GETATTR on the handle
// tells which. A small object replaced between OPEN and READ is opened again (an NFS client must
// look a replaced name up again); a large one being read fails as Unavailable, saying which it was,
// never as an internal error.
TEST_P(NfsBackendFaults, AReadFailingWithEfaultIsTold) {
  const std::string old_small = RandomBytes(1000, 1), new_small = RandomBytes(1000, 2);
  ASSERT_TRUE(Put(*backend_, "small", old_small).ok());
  const std::string big = RandomBytes(3 << 20, 3);
  ASSERT_TRUE(Put(*backend_, "big", big).ok());
  std::atomic<int> reads{0};
  std::atomic<bool> failed_read{false}, stale{true};
  nfs_hooks::Hooks h;
  h.pread = [&](nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
    if (++reads > 1) return nfs_hooks::RealPread(n, fh, off, count, buf);
    if (stale) ReplaceLocal(dir_ + "/small", new_small);
    failed_read = true;
    return nfs_hooks::Fail(n, -EFAULT, "pread call failed with \"F\"");
  };
  h.fstat = [&](nfs_context* n, nfsfh* fh, nfs_stat_64* st) {
    if (!failed_read.exchange(false) || !stale) return nfs_hooks::RealFstat(n, fh, st);
    return nfs_hooks::Fail(
        n, -ESTALE, "stat call failed with \"NFS: GETATTR failed with NFS3ERR_STALE(-116)\"");
  };
  nfs_hooks::Scope scope(h);

  auto got = Get(*backend_, "small");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, new_small);
  EXPECT_EQ(reads.load(), 2);

  // A large read goes in pipelined READs: the first one's answer fails.
  h.pread_answer = [&](nfs_context* n, uint64_t, int rc) {
    if (++reads > 1) return rc;
    failed_read = true;
    return nfs_hooks::Fail(n, -EFAULT, "pread call failed with \"F\"");
  };
  nfs_hooks::Scope pipelined(h);
  std::string out(big.size(), '\0');
  for (bool replaced : {true, false}) {
    auto reader = backend_->OpenObject("big");
    ASSERT_TRUE(reader.ok()) << reader.status();
    reads = 0;
    stale = replaced;
    Status s = (*reader)->ReadAt(0, out.data(), out.size());
    EXPECT_EQ(s.code(), Code::kUnavailable) << s;
    // Not replaced, GETATTR answers: the server refused the READ itself.
    EXPECT_TRUE(Contains(s.message(), replaced ? "stale" : "the server refused it")) << s;
  }
}

// Whether thread `tid` of this process is asleep (blocked), from /proc.
bool ThreadSleeping(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(f, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'S';
}

// A large Append takes the connection one batch of WRITEs at a time (one
// WRITE for v3; for v4 kV4WritesInFlight, sent together): a Stat made on
// the same backend while it runs gets in between two batches. The 2nd batch
// is held in the hook until that Stat has returned (and the 1st until the
// Stat is waiting for the connection), with deadlines, so a regression
// fails rather than hangs, and no timing margin decides the result.
TEST_P(NfsBackendFaults, OtherCallsGoThroughDuringALargeAppend) {
  ASSERT_TRUE(Put(*backend_, "other", "x").ok());
  const std::string big = RandomBytes(16 << 20, 5);
  std::atomic<int> pieces{0};
  std::atomic<pid_t> stat_tid{0};
  std::promise<void> first, stat_done;
  std::shared_future<void> stat_returned = stat_done.get_future().share();
  std::atomic<bool> stat_was_waiting{false}, held_until_stat{false};
  {
    // Called as each batch starts.
    auto batch = [&] {
      const int piece = ++pieces;
      if (piece == 1) {
        first.set_value();
        const auto deadline = Clock::now() + std::chrono::seconds(10);
        while (Clock::now() < deadline && !(stat_tid.load() && ThreadSleeping(stat_tid.load())))
          std::this_thread::sleep_for(milliseconds(1));
        stat_was_waiting = stat_tid.load() && ThreadSleeping(stat_tid.load());
      } else if (piece == 2) {
        held_until_stat =
            stat_returned.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
      }
    };
    nfs_hooks::Hooks h;
    h.pwrite = [&](nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, const void* buf) {
      if (GetParam() == 3) batch();  // every WRITE
      return nfs_hooks::RealPwrite(n, fh, off, count, buf);
    };
    // (libnfs's nfs_pwrite calls nfs_pwrite_async too: v4 only.)
    h.pwrite_async = [&](nfs_context*, nfsfh*, uint64_t off, uint64_t count) {
      // The object starts at 0, so a batch starts at a multiple of its size.
      if (GetParam() == 4 && off % (nfs_limits::kV4MaxWrite * nfs_limits::kV4WritesInFlight) == 0)
        batch();
      return static_cast<int64_t>(count);
    };
    nfs_hooks::Scope scope(h);
    auto w = backend_->NewObject("big", WriteMode::kReplace);
    ASSERT_TRUE(w.ok()) << w.status();
    nfs_hooks::max_writes_in_flight = 0;
    auto stat = std::async(std::launch::async, [&] {
      // (A deadline: a hook that never fires must fail the test, not hang it.)
      if (first.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
        stat_done.set_value();
        return std::make_pair(false, -1);
      }
      stat_tid = static_cast<pid_t>(::gettid());
      auto info = backend_->Stat("other");
      const int then = pieces.load();
      stat_done.set_value();
      return std::make_pair(info.ok(), then);
    });
    ASSERT_TRUE((*w)->Append(big.data(), big.size()).ok());
    const int total = pieces.load();
    auto [ok, pieces_then] = stat.get();
    EXPECT_TRUE(ok);
    EXPECT_TRUE(stat_was_waiting.load()) << "the Stat never waited for the connection";
    EXPECT_GE(total, 3);
    EXPECT_TRUE(held_until_stat.load())
        << "the Stat did not return while the 2nd batch of WRITEs was held (it returned after "
        << pieces_then << " of the " << total << " batches of one Append)";
    EXPECT_LE(pieces_then, 2);
    if (GetParam() == 4) {  // a batch is sent whole before its answers are read
      EXPECT_EQ(nfs_hooks::max_writes_in_flight.load(),
                static_cast<int>(nfs_limits::kV4WritesInFlight));
    }
    ASSERT_TRUE((*w)->Commit().ok());
  }
  EXPECT_TRUE(ReadLocal(dir_ + "/big") == big);
}

// NFSv4 batches of WRITEs: one the server answers short (it wrote fewer
// bytes than sent) has its rest written before the Append returns, so the
// object holds exactly what was appended, with no hole.
TEST_P(NfsV4Faults, AShortWriteInABatchHasItsRestWritten) {
  constexpr uint64_t kWrite = nfs_limits::kV4MaxWrite;
  const std::string data = RandomBytes(3 * kWrite * nfs_limits::kV4WritesInFlight + 1234, 7);
  std::atomic<int> shortened{0};
  {
    nfs_hooks::Hooks h;
    h.pwrite_async = [&](nfs_context*, nfsfh*, uint64_t off, uint64_t count) -> int64_t {
      if (count != kWrite || (off / kWrite) % 5 != 2) return static_cast<int64_t>(count);
      ++shortened;  // every 5th WRITE of a batch: 1000 bytes short
      return static_cast<int64_t>(count - 1000);
    };
    nfs_hooks::Scope scope(h);
    ASSERT_TRUE(Put(*backend_, "short", data).ok());
  }
  EXPECT_GE(shortened.load(), 30);
  EXPECT_TRUE(ReadLocal(dir_ + "/short") == data)
      << "the object differs from what was appended (" << shortened.load() << " short WRITEs)";
}

// NFSv4 batches: a WRITE libnfs cannot queue (it is out of memory) fails the
// Append as RESOURCE_EXHAUSTED with libnfs's reason, once the WRITEs already
// sent are answered (they point into the batch). The temp is removed and
// the connection stays in use.
TEST_P(NfsV4Faults, AWriteThatCannotBeQueuedFailsTheAppend) {
  constexpr uint64_t kWrite = nfs_limits::kV4MaxWrite;
  const std::string data = RandomBytes(2 << 20, 8);  // past the writer's 1 MiB buffer
  {
    nfs_hooks::Hooks h;
    h.pwrite_async = [&](nfs_context*, nfsfh*, uint64_t off, uint64_t count) -> int64_t {
      return off == 10 * kWrite ? -ENOMEM : static_cast<int64_t>(count);
    };
    nfs_hooks::Scope scope(h);
    auto w = backend_->NewObject("unqueued", WriteMode::kReplace);
    ASSERT_TRUE(w.ok()) << w.status();
    Status s = (*w)->Append(data.data(), data.size());
    EXPECT_EQ(s.code(), Code::kResourceExhausted) << s;
    EXPECT_TRUE(Contains(s.message(), "libnfs could not queue a WRITE")) << s;
    EXPECT_TRUE(Contains(s.message(), "out of memory (test hook)")) << s;
  }
  ASSERT_TRUE(Put(*backend_, "after", "x").ok());
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir_))
    names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"after"}) << "the failed object's temp was left";
}

// A large read goes in READs of up to 1 MiB, 2 MiB of them in flight at
// once (one at a time, each round trip would leave the link idle); a READ
// the server answers short has its rest read, so the bytes are exact.
TEST_P(NfsBackendFaults, ALargeReadIsPipelinedAndShortReadsAreCompleted) {
  const std::string big = RandomBytes((8 << 20) + 12345, 11);
  ASSERT_TRUE(Put(*backend_, "big", big).ok());
  std::atomic<int> shortened{0};
  nfs_hooks::Hooks h;
  h.pread_async = [&](nfs_context*, nfsfh*, uint64_t off, uint64_t count) -> int64_t {
    if (count != (1u << 20) || (off >> 20) % 3 != 1) return static_cast<int64_t>(count);
    ++shortened;  // every 3rd READ: 1000 bytes short
    return static_cast<int64_t>(count - 1000);
  };
  nfs_hooks::Scope scope(h);
  nfs_hooks::max_reads_in_flight = 0;
  auto reader = backend_->OpenObject("big");
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::string out(big.size(), '\0');
  ASSERT_TRUE((*reader)->ReadAt(0, out.data(), out.size()).ok());
  EXPECT_TRUE(out == big) << "the bytes read differ (" << shortened.load() << " short READs)";
  EXPECT_GE(shortened.load(), 2);
  EXPECT_EQ(nfs_hooks::max_reads_in_flight.load(), 2) << "READs of 1 MiB, 2 at once";
}

// A READ libnfs cannot queue (out of memory) fails the read as
// RESOURCE_EXHAUSTED, once the READs sent are answered (they point into
// the batch); the connection stays in use.
TEST_P(NfsBackendFaults, AReadThatCannotBeQueuedFailsTheRead) {
  const std::string big = RandomBytes(4 << 20, 12);
  auto reader = PutAndOpen("big", big);
  ASSERT_TRUE(reader);
  std::string out(big.size(), '\0');
  {
    nfs_hooks::Hooks h;
    h.pread_async = [&](nfs_context*, nfsfh*, uint64_t off, uint64_t count) -> int64_t {
      return off == (2u << 20) ? -ENOMEM : static_cast<int64_t>(count);
    };
    nfs_hooks::Scope scope(h);
    Status s = reader->ReadAt(0, out.data(), out.size());
    EXPECT_EQ(nfs_hooks::reads_in_flight.load(), 0) << "returned before the READs sent came back";
    EXPECT_EQ(s.code(), Code::kResourceExhausted) << s;
    EXPECT_TRUE(Contains(s.message(), "libnfs could not queue a READ")) << s;
    EXPECT_TRUE(Contains(s.message(), "out of memory (test hook)")) << s;
  }
  ASSERT_TRUE(reader->ReadAt(0, out.data(), out.size()).ok());
  EXPECT_TRUE(out == big);
}

// A READ that fails (here a timeout, as libnfs reports one) ends its batch:
// no further READ goes to a server that does not answer, so a read of a
// hung server fails after one timeout_ms, as UNAVAILABLE.
TEST_P(NfsBackendFaults, AFailedReadEndsItsBatch) {
  const std::string big = RandomBytes(8 << 20, 13);
  auto reader = PutAndOpen("big", big);
  ASSERT_TRUE(reader);
  std::atomic<int> sent{0};
  std::atomic<bool> first{true};
  nfs_hooks::Hooks h;
  h.pread_async = [&](nfs_context*, nfsfh*, uint64_t, uint64_t count) {
    ++sent;
    return static_cast<int64_t>(count);
  };
  h.pread_answer = [&](nfs_context* n, uint64_t, int rc) {  // the first answer, whichever it is
    return first.exchange(false) ? nfs_hooks::Fail(n, -ETIMEDOUT, "Command timed out") : rc;
  };
  nfs_hooks::Scope scope(h);
  std::string out(big.size(), '\0');
  Status s = reader->ReadAt(0, out.data(), out.size());
  EXPECT_EQ(s.code(), Code::kUnavailable) << s;
  EXPECT_TRUE(Contains(s.message(), "did not answer within")) << s;
  EXPECT_EQ(sent.load(), 2) << "READs were sent after one failed (2 are in flight at once)";
}

// Two READs of a batch fail: the error reported is the first one, with
// libnfs's text for it, not the text of the failure libnfs recorded last
// (which would turn a refused READ into a timeout here).
TEST_P(NfsBackendFaults, ABatchReportsItsFirstFailureWithItsOwnText) {
  const std::string big = RandomBytes(8 << 20, 15);
  auto reader = PutAndOpen("big", big);
  ASSERT_TRUE(reader);
  std::atomic<int> answers{0};
  nfs_hooks::Hooks h;
  h.pread_answer = [&](nfs_context* n, uint64_t, int) {
    return ++answers == 1 ? nfs_hooks::Fail(n, -EACCES, "injected: the first failure")
                          : nfs_hooks::Fail(n, -ETIMEDOUT, "Command timed out");
  };
  nfs_hooks::Scope scope(h);
  std::string out(big.size(), '\0');
  Status s = reader->ReadAt(0, out.data(), out.size());
  EXPECT_EQ(answers.load(), 2) << "both READs in flight are answered";
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s;
  EXPECT_TRUE(Contains(s.message(), "injected: the first failure")) << s;
}

// An object cut short after it was opened (damage behind the reader's
// back): the READs past its new end answer short or with nothing, and the
// read fails as DATA_LOSS saying where the object ends. The short answer
// at the cut (64 KiB and more) is the end of the file, not a server's READ
// limit: later reads still ask for 1 MiB.
TEST_P(NfsBackendFaults, AReadOfAnObjectCutShortIsDataLoss) {
  const std::string big = RandomBytes(4 << 20, 14);
  auto reader = PutAndOpen("big", big);
  ASSERT_TRUE(reader);
  constexpr uint64_t kCut = (3 << 20) + 65636;
  std::filesystem::resize_file(dir_ + "/big", kCut);
  std::string out(big.size(), '\0');
  Status s = reader->ReadAt(0, out.data(), out.size());
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  EXPECT_TRUE(Contains(s.message(), ("ends at byte " + std::to_string(kCut)).c_str())) << s;
  EXPECT_TRUE(out.compare(0, kCut, big, 0, kCut) == 0) << "the bytes before the cut differ";

  auto whole = PutAndOpen("whole", big);
  ASSERT_TRUE(whole);
  std::atomic<uint64_t> largest_asked{0};
  nfs_hooks::Hooks h;
  h.pread_async = [&](nfs_context*, nfsfh*, uint64_t, uint64_t count) -> int64_t {
    for (uint64_t m = largest_asked; count > m && !largest_asked.compare_exchange_weak(m, count);) {
    }
    return static_cast<int64_t>(count);
  };
  nfs_hooks::Scope scope(h);
  ASSERT_TRUE(whole->ReadAt(0, out.data(), out.size()).ok());
  EXPECT_TRUE(out == big);
  EXPECT_EQ(largest_asked.load(), uint64_t{1} << 20) << "the cut was taken for a READ limit";
}

// A v4 server that reads less than 1 MiB per READ (here a real one capped
// at 64 KiB, as small servers are) answers each READ short; libnfs 4.0
// knows no v4 maximum to ask for. Once a short answer is followed by more
// bytes (not the end of the file), the connection asks for what the server
// answers, with 2 MiB of READs in flight: for the rest of the read (after
// one READ one at a time), for later reads, and for small objects too.
TEST_P(NfsV4Faults, AServerThatReadsLessIsReadInItsSizeWithReadsInFlight) {
  static NfsServer small("/tmp/ckptio-nfs-small-read-" + std::to_string(::getpid()),
                         NfsServer::Ports{20790, 20348, 20349}, "CKPTIO_NFS_MAX_READ=65536");
  ASSERT_TRUE(small.ok()) << "cannot start an NFS server with MaxRead = 64 KiB";
  const std::string big = RandomBytes((8 << 20) + 12345, 16);
  const std::string little = RandomBytes(1 << 20, 17);  // read whole as it opens
  const std::string dir = small.export_dir() + "/" + sub_;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/big", std::ios::binary) << big;
  std::ofstream(dir + "/little", std::ios::binary) << little;

  // (libnfs's own nfs_pread goes through nfs_pread_async: both count it.)
  std::atomic<int> one_at_a_time{0}, capped_answers{0}, asked_more{0};
  nfs_hooks::Hooks h;
  h.pread = [&](nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
    ++one_at_a_time;
    return nfs_hooks::RealPread(n, fh, off, count, buf);
  };
  h.pread_answer = [&](nfs_context*, uint64_t, int rc) {
    if (rc == 65536) ++capped_answers;  // (a fresh connection asks for 1 MiB)
    return rc;
  };
  h.pread_async = [&](nfs_context*, nfsfh*, uint64_t, uint64_t count) -> int64_t {
    if (count > 65536) ++asked_more;
    return static_cast<int64_t>(count);
  };
  nfs_hooks::Scope scope(h);
  auto reset = [&] {
    one_at_a_time = 0;
    asked_more = 0;
    nfs_hooks::max_reads_in_flight = 0;
  };

  auto backend = Backend("", small);
  ASSERT_TRUE(backend);
  auto reader = backend->OpenObject("big");
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::string out(big.size(), '\0');
  reset();
  ASSERT_TRUE((*reader)->ReadAt(0, out.data(), out.size()).ok());
  EXPECT_TRUE(out == big) << "the bytes read differ";
  ASSERT_GT(capped_answers.load(), 0) << "the server does not cap READs at 64 KiB";
  EXPECT_EQ(one_at_a_time.load(), 1)
      << "not one READ (telling the limit from the end of the file), then READs in flight";

  reset();
  out.assign(big.size(), '\0');
  ASSERT_TRUE((*reader)->ReadAt(0, out.data(), out.size()).ok());
  EXPECT_TRUE(out == big) << "the bytes read again differ";
  EXPECT_EQ(asked_more.load(), 0) << "a later read asks for more than the server reads";
  EXPECT_EQ(nfs_hooks::max_reads_in_flight.load(), 32) << "not 2 MiB of 64 KiB READs at once";
  EXPECT_EQ(one_at_a_time.load(), 1) << "one READ for the last 12345 bytes only";

  auto fresh = Backend("", small);  // has learnt nothing yet
  ASSERT_TRUE(fresh);
  reset();
  auto got = Get(*fresh, "little");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == little) << "the small object's bytes differ";
  EXPECT_EQ(one_at_a_time.load(), 2) << "a small object is read one READ at a time";
  EXPECT_EQ(asked_more.load(), 2) << "READs after those two ask for more than the server reads";
}

// An object that is itself a symbolic link (LATEST pointing at a file
// outside the store, a step's object at another step's) is refused, named,
// and never read through.
TEST_P(NfsBackendFaults, AnObjectThatIsASymbolicLinkIsNotOpened) {
  const std::string outside_dir = NfsServer::Shared().export_dir() + "/" + FreshFolder("outside");
  std::ofstream(outside_dir + "/secret") << "not the store's";
  ASSERT_EQ(::symlink((outside_dir + "/secret").c_str(), (dir_ + "/LATEST").c_str()), 0);
  ASSERT_TRUE(Put(*backend_, "step-000000000001/model.safetensors", "step one").ok());
  ASSERT_EQ(::mkdir((dir_ + "/step-000000000002").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("../step-000000000001/model.safetensors",
                      (dir_ + "/step-000000000002/model.safetensors").c_str()),
            0);
  for (const std::string key : {"LATEST", "step-000000000002/model.safetensors"}) {
    SCOPED_TRACE(key);
    auto opened = backend_->OpenObject(key);
    EXPECT_EQ(opened.status().code(), Code::kFailedPrecondition) << opened.status();
    EXPECT_TRUE(Contains(opened.status().message(), key.c_str()) &&
                Contains(opened.status().message(), "symbolic link"))
        << opened.status();
    EXPECT_EQ(backend_->Stat(key).status().code(), Code::kFailedPrecondition);
  }
  // A folder where an object is expected is no object.
  EXPECT_EQ(backend_->OpenObject("step-000000000001").status().code(), Code::kNotFound);
}

// The folder made for a step's first object is looked at again before the
// next object goes in (not made again): swapped for a link, or for a file,
// meanwhile, it is refused and nothing is created where the link points;
// removed, it is made again.
TEST_P(NfsBackendFaults, AFolderMadeEarlierIsLookedAtAgain) {
  const std::string outside_dir = NfsServer::Shared().export_dir() + "/" + FreshFolder("outside");
  const std::string step = dir_ + "/step-000000000007";
  ASSERT_TRUE(Put(*backend_, "step-000000000007/a", "first").ok());
  ASSERT_EQ(::rename(step.c_str(), (step + ".moved").c_str()), 0);
  ASSERT_EQ(::symlink(outside_dir.c_str(), step.c_str()), 0);
  auto through_link = backend_->NewObject("step-000000000007/b", WriteMode::kCreateExclusive);
  EXPECT_EQ(through_link.status().code(), Code::kFailedPrecondition) << through_link.status();
  EXPECT_TRUE(Contains(through_link.status().message(), "symbolic link")) << through_link.status();
  EXPECT_TRUE(std::filesystem::is_empty(outside_dir)) << "a temp was created through the link";
  ASSERT_EQ(::unlink(step.c_str()), 0);
  std::ofstream(step) << "a file";
  auto in_file = backend_->NewObject("step-000000000007/b", WriteMode::kCreateExclusive);
  EXPECT_EQ(in_file.status().code(), Code::kFailedPrecondition) << in_file.status();
  EXPECT_TRUE(Contains(in_file.status().message(), "not a folder")) << in_file.status();
  ASSERT_EQ(::unlink(step.c_str()), 0);
  EXPECT_TRUE(Put(*backend_, "step-000000000007/b", "second").ok());
  EXPECT_EQ(ReadLocal(step + "/b"), "second");
}

// A look at the folder made last that fails other than as "not there"
// fails the create with that error: no MKDIR, no temp.
TEST_P(NfsBackendFaults, AFailedLookAtAFolderMadeEarlierFailsTheCreate) {
  ASSERT_TRUE(Put(*backend_, "step-000000000008/a", "first").ok());
  auto is_step = [](const char* path) {
    const std::string p = path, step = "/step-000000000008";
    return p.size() >= step.size() && p.compare(p.size() - step.size(), step.size(), step) == 0;
  };
  std::atomic<int> looks{0}, mkdirs{0}, creates{0};
  nfs_hooks::Hooks h;
  h.stat = [&](nfs_context* n, const char* path, nfs_stat_64*) {
    if (!is_step(path)) return 1;
    ++looks;
    return nfs_hooks::Fail(n, -EACCES, "NFS3ERR_ACCES");
  };
  h.mkdir = [&](nfs_context* n, const char* path) {
    if (is_step(path)) ++mkdirs;
    return nfs_hooks::RealMkdir(n, path);
  };
  h.open2 = [&](nfs_context* n, const char* path, int flags, int mode, nfsfh** fh) {
    ++creates;
    return nfs_hooks::RealOpen2(n, path, flags, mode, fh);
  };
  {
    nfs_hooks::Scope scope(h);
    auto w = backend_->NewObject("step-000000000008/b", WriteMode::kCreateExclusive);
    EXPECT_EQ(w.status().code(), Code::kPermissionDenied) << w.status();
    EXPECT_TRUE(Contains(w.status().message(), "stat ") &&
                Contains(w.status().message(), "step-000000000008"))
        << w.status();
  }
  EXPECT_EQ(looks.load(), 1);
  EXPECT_EQ(mkdirs.load(), 0);
  EXPECT_EQ(creates.load(), 0);
  EXPECT_TRUE(Put(*backend_, "step-000000000008/b", "second").ok());
  EXPECT_EQ(ReadLocal(dir_ + "/step-000000000008/b"), "second");
}

// An object whose open file cannot be looked at (GETATTR fails) is not
// opened: the error names it, the file is closed, and the connection goes
// on.
TEST_P(NfsBackendFaults, AnOpenWhoseLookAtTheFileFailsIsAnError) {
  ASSERT_TRUE(Put(*backend_, "step-000000000009/a", "bytes", WriteMode::kCreateExclusive).ok());
  std::atomic<int> looks{0}, closed{0};
  std::atomic<nfsfh*> looked_at{nullptr};
  nfs_hooks::Hooks h;
  h.fstat = [&](nfs_context* n, nfsfh* fh, nfs_stat_64*) {
    ++looks;
    looked_at = fh;
    return nfs_hooks::Fail(n, -EACCES, "NFS3ERR_ACCES");
  };
  h.close = [&](nfs_context* n, nfsfh* fh) {
    if (fh == looked_at.load()) ++closed;
    return nfs_hooks::RealClose(n, fh);
  };
  {
    nfs_hooks::Scope scope(h);
    auto r = backend_->OpenObject("step-000000000009/a");
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status();
    EXPECT_TRUE(Contains(r.status().message(), "fstat ") &&
                Contains(r.status().message(), "step-000000000009/a"))
        << r.status();
  }
  EXPECT_EQ(looks.load(), 1);
  EXPECT_EQ(closed.load(), 1) << "the file was left open";
  auto got = Get(*backend_, "step-000000000009/a");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "bytes");
}

// A server that will not mount the store's folder itself, only its export:
// the backend stays on the export (v3 tries the folder again once it has
// made or found it, and is refused again), walks one folder more, checks
// links by looking first, and works as before.
TEST_P(NfsBackendFaults, AStoreWhoseFolderWillNotMountStaysOnItsExport) {
  std::atomic<int> refused{0};
  nfs_hooks::Hooks h;
  h.mount = [&](nfs_context* n, const char* server, const char* path) {
    if (!std::strstr(path, sub_.c_str())) return nfs_hooks::RealMount(n, server, path);
    ++refused;
    return nfs_hooks::Fail(n, -EACCES,
                           "mount_cb: RPC error: Mount failed with error MNT3ERR_ACCES(13)");
  };
  nfs_hooks::Scope scope(h);
  backend_ = Backend();
  ASSERT_TRUE(backend_);
  ASSERT_TRUE(Put(*backend_, "step-000000000001/a", "bytes", WriteMode::kCreateExclusive).ok());
  auto got = Get(*backend_, "step-000000000001/a");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "bytes");
  EXPECT_EQ(refused.load(), version() == 3 ? 2 : 1);
  const std::string outside_dir = NfsServer::Shared().export_dir() + "/" + FreshFolder("outside");
  std::ofstream(outside_dir + "/secret") << "not the store's";
  ASSERT_EQ(::symlink((outside_dir + "/secret").c_str(), (dir_ + "/LATEST").c_str()), 0);
  EXPECT_EQ(backend_->OpenObject("LATEST").status().code(), Code::kFailedPrecondition);
  ASSERT_EQ(::symlink(outside_dir.c_str(), (dir_ + "/step-000000000002").c_str()), 0);
  auto linked = backend_->OpenObject("step-000000000002/secret");
  EXPECT_EQ(linked.status().code(), Code::kFailedPrecondition) << linked.status();
  EXPECT_TRUE(Contains(linked.status().message(), "symbolic link")) << linked.status();
}

// A folder of the store that is a symbolic link is refused, naming it, and
// nothing is created or deleted where it points: another folder of the
// export (step-N -> ../elsewhere: libnfs 4.0 happens to refuse a link with
// "..") or another step of the store (step-N -> step-M: libnfs follows it,
// so a delete of step N's files would delete step M's).
TEST_P(NfsBackendFaults, LinkedFoldersInTheStoreAreRefused) {
  const std::string outside = FreshFolder("outside");
  const std::string outside_dir = NfsServer::Shared().export_dir() + "/" + outside;
  const std::string other_step = dir_ + "/step-000000000041";
  ASSERT_EQ(::mkdir(other_step.c_str(), 0755), 0);
  int n = 0;
  for (const auto& [target, pointee] :
       {std::make_pair("../" + outside, outside_dir),
        std::make_pair(std::string("step-000000000041"), other_step)}) {
    SCOPED_TRACE("a step folder linked to " + target);
    {
      std::ofstream f(pointee + "/victim");
      f << "not this step's";
    }
    const std::string step = "step-00000000120" + std::to_string(n++);
    ASSERT_EQ(::symlink(target.c_str(), (dir_ + "/" + step).c_str()), 0);
    auto expect_refused = [&](const Status& s, const char* what) {
      EXPECT_EQ(s.code(), Code::kFailedPrecondition) << what << ": " << s;
      EXPECT_TRUE(Contains(s.message(), step.c_str()) && Contains(s.message(), "symbolic link"))
          << what << ": " << s;
    };
    expect_refused(Put(*backend_, step + "/model.safetensors", "tensor bytes"), "NewObject");
    expect_refused(Put(*backend_, step + "/MANIFEST.json", "{}", WriteMode::kCreateExclusive),
                   "NewObject (exclusive)");
    expect_refused(backend_->Delete(step + "/victim"), "Delete");
    expect_refused(backend_->OpenObject(step + "/victim").status(), "OpenObject");
    expect_refused(backend_->Stat(step + "/victim").status(), "Stat");
    EXPECT_EQ(ReadLocal(pointee + "/victim"), "not this step's");
    EXPECT_NE(::access((pointee + "/model.safetensors").c_str(), F_OK), 0);
    EXPECT_NE(::access((pointee + "/MANIFEST.json").c_str(), F_OK), 0);
  }
  // Nor a file where a folder should be.
  {
    std::ofstream f(dir_ + "/step-000000001300");
    f << "a file";
  }
  Status s = Put(*backend_, "step-000000001300/x", "bytes");
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s;
}

// A broken connection (libnfs's autoreconnect is off) is replaced by a
// fresh mount at the next call: one transport error does not disable the
// backend. An object being written on the broken connection fails rather
// than carry on over the new one.
TEST_P(NfsBackendFaults, TheNextCallAfterABrokenConnectionReconnects) {
  ::signal(SIGPIPE, SIG_IGN);  // writes on the shut-down socket
  ASSERT_TRUE(Put(*backend_, "obj", "bytes").ok());
  auto open_writer = backend_->NewObject("half", WriteMode::kReplace);
  ASSERT_TRUE(open_writer.ok()) << open_writer.status();
  ASSERT_TRUE((*open_writer)->Append("abc", 3).ok());
  {
    nfs_hooks::Hooks h;
    h.stat = [&](nfs_context* n, const char* path, nfs_stat_64*) {
      if (!std::strstr(path, "/obj")) return 1;
      ::shutdown(nfs_get_fd(n), SHUT_RDWR);  // the connection really breaks
      return nfs_hooks::Fail(n, -EFAULT, "stat call failed with \"RPC ERROR: socket closed\"");
    };
    nfs_hooks::Scope scope(h);
    auto info = backend_->Stat("obj");
    ASSERT_FALSE(info.ok());
    EXPECT_EQ(info.status().code(), Code::kUnavailable) << info.status();
  }
  auto info = backend_->Stat("obj");
  ASSERT_TRUE(info.ok()) << "the backend stayed broken after one transport error: "
                         << info.status();
  EXPECT_EQ(info->size, 5u);
  Status put = Put(*backend_, "new", "fresh");
  EXPECT_TRUE(put.ok()) << put;
  EXPECT_EQ(ReadLocal(dir_ + "/new"), "fresh");
  Status half = (*open_writer)->Commit();
  EXPECT_EQ(half.code(), Code::kUnavailable) << half;
  EXPECT_NE(::access((dir_ + "/half").c_str(), F_OK), 0);
}

// A commit whose folder was swapped for a symbolic link after NewObject is
// refused, and the temp is not removed through the link (which would remove
// whatever has the temp's name where it points).
TEST_P(NfsBackendFaults, ACommitRefusedForALinkedFolderRemovesNothingThroughIt) {
  const std::string step = "step-000000000050", other = "step-000000000051";
  ASSERT_EQ(::mkdir((dir_ + "/" + step).c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir_ + "/" + other).c_str(), 0755), 0);
  auto w = backend_->NewObject(step + "/obj", WriteMode::kReplace);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append("x", 1).ok());
  std::string temp;
  if (DIR* d = ::opendir((dir_ + "/" + step).c_str())) {
    while (struct dirent* e = ::readdir(d))
      if (std::strstr(e->d_name, ".ckptio-tmp.")) temp = e->d_name;
    ::closedir(d);
  }
  ASSERT_FALSE(temp.empty());
  ASSERT_EQ(std::rename((dir_ + "/" + step).c_str(), (dir_ + "/moved").c_str()), 0);
  ASSERT_EQ(::symlink(other.c_str(), (dir_ + "/" + step).c_str()), 0);
  {
    std::ofstream f(dir_ + "/" + other + "/" + temp);
    f << "victim";
  }
  Status s = (*w)->Commit();
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s.message(), "symbolic link")) << s;
  w->reset();
  EXPECT_EQ(ReadLocal(dir_ + "/" + other + "/" + temp), "victim")
      << "the temp was removed through the linked folder";
  EXPECT_NE(::access((dir_ + "/" + other + "/obj").c_str(), F_OK), 0);
}

INSTANTIATE_TEST_SUITE_P(Versions, NfsBackendFaults, ::testing::Values(3, 4),
                         [](const auto& p) { return "v" + std::to_string(p.param); });
INSTANTIATE_TEST_SUITE_P(Version, NfsV4Faults, ::testing::Values(4),
                         [](const auto& p) { return "v" + std::to_string(p.param); });

}  // namespace
}  // namespace ckptio
