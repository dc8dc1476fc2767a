// The POSIX backend: the shared conformance suite, plus what only a real
// file system can show (planted symlinks, file:// URIs, the sync points).
#include "ckptio/posix_backend.h"

#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "ckptio/store.h"
#include "ckptio/sync_point_fs.h"
#include "conformance.h"
#include "test_util.h"

namespace {

using ckptio::Code;
using ckptio::testing::TempDir;

ckptio::testing::BackendHarness PosixHarness() {
  ckptio::testing::BackendHarness h;
  h.name = "posix";
  // One parent directory for the process (removed at its exit); a new
  // subdirectory per location.
  static TempDir parent;
  static int next_store = 0;  // gtest may copy the harness: keep counting here
  h.make = [root = std::make_shared<std::string>(),
            n = &next_store](bool same_location) -> std::unique_ptr<ckptio::StorageBackend> {
    if (!same_location || root->empty()) {
      // An empty store; a missing root is NotFound (see MissingStore... below).
      *root = parent.Sub("store-" + std::to_string((*n)++));
      ::mkdir(root->c_str(), 0755);
    }
    auto b = ckptio::NewPosixBackend(*root);
    return b.ok() ? std::move(*b) : nullptr;
  };
  return h;
}

}  // namespace

CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(Posix, PosixHarness());

namespace ckptio {
namespace {

using testing::ReadFile;
using testing::TempDir;

std::unique_ptr<StorageBackend> Open(const std::string& root, PosixBackendOptions o = {}) {
  auto b = NewPosixBackend(root, std::move(o));
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

Status Put(StorageBackend& b, const std::string& key, const std::string& bytes,
           WriteMode mode = WriteMode::kReplace) {
  CKPTIO_ASSIGN_OR_RETURN(auto w, b.NewObject(key, mode));
  CKPTIO_RETURN_IF_ERROR(w->Append(bytes.data(), bytes.size()));
  return w->Commit();
}

// A kernel NFS client renames a file deleted while open to .nfsXXXX until
// the last close: such leftovers are never listed as objects.
TEST(PosixBackend, NfsSillyRenamedFilesAreNotObjects) {
  TempDir dir;
  auto b = Open(dir.path());
  ASSERT_TRUE(Put(*b, "step-1/a", "x").ok());
  testing::WriteFile(dir.Sub("step-1/.nfs000000000012345600000001"), "deleted while open");
  auto keys = b->List("");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys, std::vector<std::string>{"step-1/a"});
  EXPECT_EQ(b->NewObject("step-1/.nfs1", WriteMode::kReplace).status().code(),
            Code::kInvalidArgument);
}

// Files come and go while others list (every commit drops a temp name,
// retention deletes steps). An entry that vanishes between readdir and its
// stat is skipped; it must not turn the whole listing into an error (a
// NotFound there reads as "no store", so a loader would start from scratch).
TEST(PosixBackend, ListingWhileFilesComeAndGoNeverFails) {
  TempDir dir;
  auto b = Open(dir.path());
  ASSERT_TRUE(Put(*b, "step-1/keep", "x").ok());
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    const std::string path = dir.Sub("step-1/churn");
    while (!stop) {
      testing::WriteFile(path, "y");
      ::unlink(path.c_str());
    }
  });
  int failures = 0, listings = 0;
  std::string first_failure;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(700);
  while (std::chrono::steady_clock::now() < until) {
    auto keys = b->List("");
    ++listings;
    if (!keys.ok() && failures++ == 0) first_failure = keys.status().ToString();
  }
  stop = true;
  churn.join();
  EXPECT_EQ(failures, 0) << "of " << listings << " listings; first: " << first_failure;
}

// An NFS client retransmits a link() whose reply was lost; the server then
// answers EEXIST although the first link landed. The name is our own file:
// the exclusive create succeeded. Another file under the name is still
// AlreadyExists.
TEST(PosixBackend, AnExclusiveCreateWhoseLinkReplyWasLostSucceeds) {
  struct LostReply : PosixFs {
    int LinkAt(int dirfd, const char* from, const char* to) override {
      if (PosixFs::LinkAt(dirfd, from, to) != 0) return -1;
      errno = EEXIST;  // the retransmission's answer
      return -1;
    }
  };
  TempDir dir;
  PosixBackendOptions o;
  o.fs = std::make_shared<LostReply>();
  auto b = Open(dir.path(), std::move(o));
  auto w = b->NewObject("step-1/MANIFEST.json", WriteMode::kCreateExclusive);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append("m", 1).ok());
  ckptio::Status committed = (*w)->Commit();
  EXPECT_TRUE(committed.ok()) << committed;
  auto keys = b->List("");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys, std::vector<std::string>{"step-1/MANIFEST.json"}) << "no temp left either";
  auto again = b->NewObject("step-1/MANIFEST.json", WriteMode::kCreateExclusive);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*again)->Append("n", 1).ok());
  EXPECT_EQ((*again)->Commit().code(), Code::kAlreadyExists);
}

// The same for a rename (kReplace): the retransmission finds the temp name
// gone and answers ENOENT. The target is our file: the commit succeeded. A
// rename that really failed (the temp is gone, the target is not ours) is
// still an error, and the old object stays.
TEST(PosixBackend, AReplaceWhoseRenameReplyWasLostSucceeds) {
  struct LostReply : PosixFs {
    int RenameAt(int dirfd, const char* from, const char* to) override {
      if (PosixFs::RenameAt(dirfd, from, to) != 0) return -1;
      errno = ENOENT;  // the retransmission's answer
      return -1;
    }
  };
  TempDir dir;
  PosixBackendOptions o;
  o.fs = std::make_shared<LostReply>();
  auto b = Open(dir.path(), std::move(o));
  CKPTIO_ASSERT_OK(Put(*b, "LATEST", "old"));
  CKPTIO_EXPECT_OK(Put(*b, "LATEST", "new"));
  EXPECT_EQ(ReadFile(dir.Sub("LATEST")), "new");
  auto keys = b->List("");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys, std::vector<std::string>{"LATEST"}) << "no temp left either";

  struct TempVanished : PosixFs {
    int RenameAt(int dirfd, const char* from, const char* to) override {
      ::unlinkat(dirfd, from, 0);
      return PosixFs::RenameAt(dirfd, from, to);
    }
  };
  PosixBackendOptions o2;
  o2.fs = std::make_shared<TempVanished>();
  auto b2 = Open(dir.path(), std::move(o2));
  Status s = Put(*b2, "LATEST", "newer");
  EXPECT_EQ(s.code(), Code::kNotFound) << s;
  EXPECT_EQ(ReadFile(dir.Sub("LATEST")), "new");
}

// A file system that makes no hard links (vfat: EPERM) fails an exclusive
// create with what to do, not "permission denied"; a write that makes no
// progress (some FUSE file systems return 0) fails instead of looping.
TEST(PosixBackend, NoHardLinksAndWritesOfNothingAreClearErrors) {
  struct NoLinks : PosixFs {
    int LinkAt(int, const char*, const char*) override {
      errno = EPERM;
      return -1;
    }
  };
  TempDir dir;
  PosixBackendOptions o;
  o.fs = std::make_shared<NoLinks>();
  auto b = Open(dir.path(), std::move(o));
  Status s = Put(*b, "step-1/MANIFEST.json", "m", WriteMode::kCreateExclusive);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("does not make hard links"), std::string::npos) << s;
  auto keys = b->List("");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_TRUE(keys->empty()) << "the temp is removed";

  struct WritesNothing : PosixFs {
    ssize_t Write(int, const void*, size_t) override { return 0; }
  };
  PosixBackendOptions o2;
  o2.fs = std::make_shared<WritesNothing>();
  auto b2 = Open(dir.path(), std::move(o2));
  auto f =
      std::async(std::launch::async, [&] { return Put(*b2, "LATEST", std::string(1 << 20, 'x')); });
  if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: a write of nothing is retried forever\n");
    std::fflush(stderr);
    ::_exit(1);  // the looping thread cannot be joined
  }
  Status w = f.get();
  EXPECT_EQ(w.code(), Code::kUnavailable) << w;
  EXPECT_NE(w.message().find("wrote nothing"), std::string::npos) << w;
}

// A FIFO (or device) under an object's or the lock's name is refused at
// once, never waited on: open(O_RDONLY) of a FIFO blocks until a writer
// comes. Run under a deadline, so that a regression fails instead of hanging.
TEST(PosixBackend, AFifoUnderAnObjectOrLockNameIsRefusedNotWaitedOn) {
  TempDir dir;
  auto b = Open(dir.path());
  CKPTIO_ASSERT_OK(Put(*b, "step-1/a", "x"));
  ASSERT_EQ(::mkfifo(dir.Sub("LATEST").c_str(), 0644), 0);
  ASSERT_EQ(::mkfifo(dir.Sub(".lock").c_str(), 0644), 0);
  ASSERT_EQ(::mkfifo(dir.Sub("step-1/b").c_str(), 0644), 0);
  auto within_5s = [](const char* what, std::function<Status()> call) {
    auto f = std::async(std::launch::async, std::move(call));
    if (f.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      std::fprintf(stderr, "FAILED: %s still blocked after 5 s (opened a FIFO?)\n", what);
      std::fflush(stderr);
      ::_exit(1);  // the blocked thread cannot be joined
    }
    return f.get();
  };
  auto refused = [](const Status& s) {
    return s.code() == Code::kFailedPrecondition && s.message().find("FIFO") != std::string::npos;
  };
  Status s = within_5s("OpenObject(LATEST)", [&] { return b->OpenObject("LATEST").status(); });
  EXPECT_TRUE(refused(s)) << s;
  EXPECT_NE(s.message().find(dir.Sub("LATEST")), std::string::npos) << s;
  s = within_5s("OpenObject(step-1/b)", [&] { return b->OpenObject("step-1/b").status(); });
  EXPECT_TRUE(refused(s)) << s;
  s = within_5s("Store::ReadLatest", [&] {
    Store store(std::shared_ptr<StorageBackend>(Open(dir.path())));
    return store.ReadLatest().status();
  });
  EXPECT_TRUE(refused(s)) << s;
  s = within_5s("IsLocked(.lock)", [&] { return b->IsLocked(".lock").status(); });
  EXPECT_TRUE(refused(s)) << s;
  EXPECT_NE(s.message().find(dir.Sub(".lock")), std::string::npos) << s;
  s = within_5s("TryLock(.lock)", [&] { return b->TryLock(".lock").status(); });
  EXPECT_TRUE(refused(s)) << s;
}

// A .lock this user may not open for writing (another user's, mode 0644) is
// PermissionDenied, which callers do not retry: not Unavailable ("retry").
TEST(PosixBackend, ALockFileThatCannotBeOpenedIsPermissionDenied) {
  TempDir dir;
  auto b = Open(dir.path());
  CKPTIO_ASSERT_OK(Put(*b, "LATEST", "x"));
  testing::WriteFile(dir.Sub(".lock"), "");
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(dir.Sub(".lock").c_str(), 0444), 0);
  if (::geteuid() != 0) {
    auto lock = b->TryLock(".lock");
    EXPECT_EQ(lock.status().code(), Code::kPermissionDenied) << lock.status();
    return;
  }
  // root opens anything: try as nobody, in a child.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(2);
    auto lock = b->TryLock(".lock");
    if (lock.status().code() == Code::kPermissionDenied) ::_exit(0);
    std::fprintf(stderr, "TryLock as nobody: %s\n", lock.status().ToString().c_str());
    ::_exit(1);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus));
  if (WEXITSTATUS(wstatus) == 2) GTEST_SKIP() << "cannot drop root privileges here";
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "see the child's message above";
}

// Objects are mapped only on local file systems: on a network one a file
// deleted by another client goes stale under the map (SIGBUS on touch).
TEST(PosixBackend, NetworkFileSystemsAreNotMapped) {
  for (uint64_t t : {uint64_t{NFS_SUPER_MAGIC}, uint64_t{SMB_SUPER_MAGIC}, uint64_t{0xFF534D42},
                     uint64_t{0xFE534D42}, uint64_t{FUSE_SUPER_MAGIC}, uint64_t{V9FS_MAGIC},
                     uint64_t{0x00C36400}, uint64_t{0x0BD00BD0}, uint64_t{0x47504653}})
    EXPECT_TRUE(IsNetworkFileSystem(t)) << std::hex << t;
  // f_type is a signed long: a 32-bit build sees CIFS's magic negative.
  EXPECT_TRUE(
      IsNetworkFileSystem(static_cast<uint64_t>(int64_t{static_cast<int32_t>(0xFF534D42)})));
  for (uint64_t t :
       {uint64_t{EXT4_SUPER_MAGIC}, uint64_t{XFS_SUPER_MAGIC}, uint64_t{BTRFS_SUPER_MAGIC},
        uint64_t{TMPFS_MAGIC}, uint64_t{0x794C7630}, uint64_t{0x2FC12FC1}, uint64_t{0}})
    EXPECT_FALSE(IsNetworkFileSystem(t)) << std::hex << t;

  // Here (TempDir is on a local file system): mapped.
  TempDir dir;
  auto b = Open(dir.path());
  CKPTIO_ASSERT_OK(Put(*b, "obj", "bytes"));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, b->OpenObject("obj"));
  auto view = r->Map();
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(std::string((*view)->data(), (*view)->size()), "bytes");
}

// Says every path is on NFS (after the real statfs, so that a missing path
// is still ENOENT), and records the paths asked about.
class NfsTypedFs : public PosixFs {
 public:
  std::vector<std::string> asked;
  int StatFsType(const char* path, uint64_t* f_type) override {
    asked.emplace_back(path);
    if (PosixFs::StatFsType(path, f_type) != 0) return -1;
    *f_type = NFS_SUPER_MAGIC;
    return 0;
  }
};

// On a network file system (kernel NFS, SMB, CephFS...) fcntl locks are
// leases: a client cut off past its lease loses them without knowing. The
// backend says so, and the store then gives each writer's objects a folder
// of its own, as on nfs:// and s3://. Judged by the root, or before it is
// made by its nearest existing ancestor.
TEST(PosixBackend, LocksAreLeasesOnANetworkFileSystem) {
  TempDir dir;
  EXPECT_FALSE(Open(dir.path())->LocksAreLeases()) << "TempDir is on a local file system";

  auto nfs = std::make_shared<NfsTypedFs>();
  PosixBackendOptions o;
  o.fs = nfs;
  std::shared_ptr<StorageBackend> b = Open(dir.Sub("a/b/store"), o);
  EXPECT_TRUE(b->LocksAreLeases());
  EXPECT_EQ(nfs->asked, (std::vector<std::string>{dir.Sub("a/b/store"), dir.Sub("a/b"),
                                                  dir.Sub("a"), dir.path()}));

  Store store(b);
  const std::string data = testing::RandomBytes(5000, 1);
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store.OpenWriter({}));
    for (int64_t step : {1, 2}) {
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(step));
      CKPTIO_ASSERT_OK(p->PutObject("a.bin", data.data(), data.size()));
      CKPTIO_ASSERT_OK(p->Commit().status());
    }
    CKPTIO_ASSERT_OK(w->CollectGarbage(1).status());
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store.OpenLatest());
  EXPECT_EQ(r->step(), 2);
  const auto& meta = r->manifest().metadata;
  ASSERT_TRUE(meta.count(kObjectsFolderKey)) << "no objects folder on a network file system";
  EXPECT_EQ(ReadFile(dir.Sub("a/b/store/" + StepDirName(2) + "/" + meta.at(kObjectsFolderKey) +
                             "/a.bin")),
            data);
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string got, r->ReadAll("a.bin"));
  EXPECT_EQ(got, data);
  EXPECT_EQ(::access(dir.Sub("a/b/store/" + StepDirName(1)).c_str(), F_OK), -1)
      << "gc left step 1's folders behind";
}

TEST(PosixBackend, PlantedDirectorySymlinkIsNeverFollowed) {
  TempDir dir;
  TempDir outside;
  auto b = Open(dir.Sub("store"));
  ASSERT_TRUE(Put(*b, "LATEST", "x").ok());
  ASSERT_EQ(::symlink(outside.path().c_str(), dir.Sub("store/step-000000000001").c_str()), 0);
  Status s = Put(*b, "step-000000000001/a.bin", "data");
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("symbolic link"), std::string::npos) << s;
  EXPECT_EQ(b->OpenObject("step-000000000001/a.bin").status().code(), Code::kFailedPrecondition);
  // Nothing was written through the link.
  EXPECT_EQ(::access((outside.path() + "/a.bin").c_str(), F_OK), -1);
  // Listing skips the link instead of walking into it.
  auto keys = b->List("");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys, std::vector<std::string>{"LATEST"});
}

TEST(PosixBackend, PlantedFileSymlinkIsNeverFollowed) {
  TempDir dir;
  TempDir outside;
  auto b = Open(dir.Sub("store"));
  ASSERT_TRUE(Put(*b, "LATEST", "x").ok());
  testing::WriteFile(outside.Sub("secret"), "secret");
  ASSERT_EQ(::symlink(outside.Sub("secret").c_str(), dir.Sub("store/obj").c_str()), 0);
  EXPECT_EQ(b->OpenObject("obj").status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(b->Stat("obj").status().code(), Code::kFailedPrecondition);
  // Replacing the name replaces the link itself, never the file it points to.
  ASSERT_TRUE(Put(*b, "obj", "new").ok());
  EXPECT_EQ(ReadFile(outside.Sub("secret")), "secret");
  EXPECT_EQ(ReadFile(dir.Sub("store/obj")), "new");
  // A lock file planted as a link is refused, not opened.
  ASSERT_EQ(::symlink(outside.Sub("secret").c_str(), dir.Sub("store/.lock").c_str()), 0);
  EXPECT_EQ(b->TryLock(".lock").status().code(), Code::kFailedPrecondition);
}

TEST(PosixBackend, SyncPointsRunInRecipeOrderAndNothingIsVisibleBeforeRename) {
  TempDir dir;
  std::string target = dir.Sub("store/obj.bin");
  std::vector<std::string> seen;
  PosixBackendOptions o;
  o.fs = std::make_shared<SyncPointFs>([&](PosixSyncPoint p, const std::string& path) {
    bool visible = ::access(target.c_str(), F_OK) == 0;
    seen.push_back(std::string(PosixSyncPointName(p)) + (visible ? " visible" : " hidden"));
    if (p <= PosixSyncPoint::kFileClosed) {
      EXPECT_NE(path.find(".ckptio-tmp.obj.bin"), std::string::npos);
    }
    return OkStatus();
  });
  auto b = Open(dir.Sub("store"), o);
  for (auto mode : {WriteMode::kReplace, WriteMode::kCreateExclusive}) {
    seen.clear();
    ::unlink(target.c_str());
    auto w = b->NewObject("obj.bin", mode);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->Append("abc", 3).ok());
    ASSERT_TRUE((*w)->Commit().ok());
    EXPECT_EQ(seen, (std::vector<std::string>{"temp-opened hidden", "data-written hidden",
                                              "file-synced hidden", "file-closed hidden",
                                              "renamed visible", "dir-synced visible"}));
  }
}

TEST(PosixBackend, FailureAtEverySyncPointLeavesNoObjectAndNoTemp) {
  for (int fail_at = 0; fail_at <= static_cast<int>(PosixSyncPoint::kDirSynced); ++fail_at) {
    for (auto mode : {WriteMode::kReplace, WriteMode::kCreateExclusive}) {
      TempDir dir;
      PosixBackendOptions o;
      o.fs = std::make_shared<SyncPointFs>([&](PosixSyncPoint p, const std::string&) {
        return static_cast<int>(p) == fail_at ? Status(Code::kUnavailable, "injected") : OkStatus();
      });
      auto b = Open(dir.Sub("store"), o);
      auto w = b->NewObject("obj.bin", mode);
      Status s = w.ok() ? (*w)->Append("abc", 3) : w.status();
      if (s.ok()) s = (*w)->Commit();
      EXPECT_EQ(s.code(), Code::kUnavailable) << "fail at " << fail_at;
      if (w.ok()) w->reset();
      auto keys = b->List("");
      ASSERT_TRUE(keys.ok()) << keys.status();
      // A replace that failed after the rename did make the object visible
      // (it cannot be taken back); every other failure leaves nothing.
      bool renamed = fail_at >= static_cast<int>(PosixSyncPoint::kRenamed);
      std::vector<std::string> want;
      if (renamed && mode == WriteMode::kReplace) want = {"obj.bin"};
      EXPECT_EQ(*keys, want) << "fail at " << fail_at;
    }
  }
}

// A file that shrank between open and map must be refused, not mapped: the
// first touch past its new end would kill the process with SIGBUS.
// After a commit that failed at a sync point (its temp file closed by the
// backend itself, so the wrapper never saw it go), the next commit on the
// same backend still runs every point in order: a reused descriptor number
// carries nothing over.
TEST(PosixBackend, SyncPointsStayInOrderAfterAFailedCommit) {
  TempDir dir;
  std::vector<std::string> seen;
  bool fail = true;
  PosixBackendOptions o;
  o.fs = std::make_shared<SyncPointFs>([&](PosixSyncPoint p, const std::string&) {
    seen.emplace_back(PosixSyncPointName(p));
    if (fail && p == PosixSyncPoint::kDataWritten) return Status(Code::kUnavailable, "injected");
    return OkStatus();
  });
  auto b = Open(dir.Sub("store"), o);
  EXPECT_EQ(Put(*b, "first", "abc").code(), Code::kUnavailable);
  fail = false;
  // New folders: their descriptors take the numbers the failed commit freed,
  // and creating them syncs their parents.
  for (const char* key : {"a/b/second", "LATEST"}) {
    seen.clear();
    CKPTIO_ASSERT_OK(Put(*b, key, "def"));
    EXPECT_EQ(seen, (std::vector<std::string>{"temp-opened", "data-written", "file-synced",
                                              "file-closed", "renamed", "dir-synced"}))
        << key;
  }
}

TEST(PosixBackend, AnObjectThatShrankSinceItWasOpenedIsNotMapped) {
  TempDir dir;  // on a local file system, where objects are mapped
  auto b = Open(dir.Sub("store"));
  const std::string bytes(3 << 20, 'x');
  CKPTIO_ASSERT_OK(Put(*b, "obj", bytes));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto whole, b->OpenObject("obj"));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto view, whole->Map());
  EXPECT_EQ(std::string(view->data(), view->size()), bytes);

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, b->OpenObject("obj"));
  ASSERT_EQ(::truncate(dir.Sub("store/obj").c_str(), 1 << 20), 0);
  auto shrunk = r->Map();
  EXPECT_EQ(shrunk.status().code(), Code::kDataLoss) << shrunk.status();
  EXPECT_NE(shrunk.status().message().find("shorter than 3145728 bytes"), std::string::npos)
      << shrunk.status();
}

TEST(PosixBackend, FileUris) {
  BackendRegistry r;
  ASSERT_TRUE(RegisterPosixBackend(r).ok());
  TempDir dir;
  EXPECT_TRUE(r.Open("file://" + dir.path()).ok());
  EXPECT_TRUE(r.Open("file://localhost" + dir.path()).ok());
  EXPECT_TRUE(r.Open(dir.path()).ok());
  auto host = r.Open("file://otherhost/x");
  EXPECT_EQ(host.status().code(), Code::kInvalidArgument);
  EXPECT_NE(host.status().message().find("three slashes"), std::string::npos);
  EXPECT_EQ(r.Open("file:///x?version=3").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.Open("file:///a/../b").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.Open("file:///").status().code(), Code::kInvalidArgument);
  auto b = r.Open("file://" + dir.path() + "/./x//y/");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->Uri(), "file://" + dir.path() + "/x/y");
  // RFC 8089's short form file:/abs is the path /abs.
  auto short_form = r.Open("file:" + dir.path());
  ASSERT_TRUE(short_form.ok()) << short_form.status();
  EXPECT_EQ((*short_form)->Uri(), "file://" + dir.path());
}

TEST(PosixBackend, MissingStoreIsNotFoundAndNotCreatedByReads) {
  TempDir dir;
  auto b = Open(dir.Sub("nope"));
  EXPECT_EQ(b->List("").status().code(), Code::kNotFound);
  EXPECT_EQ(b->Stat("LATEST").status().code(), Code::kNotFound);
  EXPECT_EQ(b->OpenObject("LATEST").status().code(), Code::kNotFound);
  EXPECT_EQ(::access(dir.Sub("nope").c_str(), F_OK), -1);
  ASSERT_TRUE(Put(*b, "a/b/c", "x").ok());  // the first write creates it
  EXPECT_EQ(ReadFile(dir.Sub("nope/a/b/c")), "x");
}

}  // namespace
}  // namespace ckptio
