// The nfs:// backend against a real NFS-Ganesha on loopback, over NFSv3 and
// NFSv4: the shared conformance suite, mixed access with the POSIX backend
// on the exported folder, URIs, the libnfs limits the backend works around,
// and (through libnfs calls this binary interposes) replies that fail or get
// lost, locks that change hands, and links planted in the store.
#include "ckptio/nfs_backend.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

// libnfs's own header, for the calls interposed below.
#include <nfsc/libnfs.h>

#include "../nfs_limits.h"
#include "ckptio/backends.h"
#include "ckptio/posix_backend.h"
#include "conformance.h"
#include "nfs_server.h"
#include "process.h"
#include "refuse_threads.h"
#include "test_util.h"

// Fault hooks. This executable defines libnfs's sync calls that the backend
// makes, so the backend (a shared library) calls these; each calls the real
// one (the next definition: libnfs's) unless a test set a hook for it.
namespace nfs_hooks {

struct Hooks {
  std::function<int(nfs_context*, const char*, const char*)> rename;
  std::function<int(nfs_context*, const char*, nfs_stat_64*)> stat;  // stat64 and lstat64
  std::function<int(nfs_context*, nfsfh*, uint64_t, uint64_t, const void*)> pwrite;
  // Before the real nfs_pwrite_async (v4 writes go in batches of them): the
  // bytes to send, fewer for a short WRITE, or a negative result for the
  // call to fail with (the WRITE is then not queued).
  std::function<int64_t(nfs_context*, nfsfh*, uint64_t, uint64_t)> pwrite_async;
  std::function<int(nfs_context*, nfsfh*, uint64_t, uint64_t, void*)> pread;
  // Before the real nfs_pread_async (large reads go in pipelined READs), as
  // pwrite_async: the bytes to ask for, or a negative result to fail with.
  std::function<int64_t(nfs_context*, nfsfh*, uint64_t, uint64_t)> pread_async;
  // On its answer (`rc`: bytes read, or -errno): the result to pass on.
  std::function<int(nfs_context*, uint64_t, int)> pread_answer;
  std::function<int(nfs_context*, nfsfh*, nfs4_lock_op, uint64_t)> lockf;
  std::function<int(nfs_context*, const char*, int, int, nfsfh**)> open2;
  std::function<int(nfs_context*, nfsfh*, nfs_stat_64*)> fstat;
};

// WRITEs sent with nfs_pwrite_async and not yet answered; the most at once.
std::atomic<int> writes_in_flight{0}, max_writes_in_flight{0};
// Likewise READs sent with nfs_pread_async.
std::atomic<int> reads_in_flight{0}, max_reads_in_flight{0};

std::mutex mu;
Hooks hooks;

template <typename F>
F Get(F Hooks::*member) {
  std::lock_guard<std::mutex> g(mu);
  return hooks.*member;
}

// Sets hooks for a scope.
class Scope {
 public:
  explicit Scope(Hooks h) {
    std::lock_guard<std::mutex> g(mu);
    hooks = std::move(h);
  }
  ~Scope() {
    std::lock_guard<std::mutex> g(mu);
    hooks = Hooks{};
  }
};

// The next definition of `name` (libnfs's); aborts, naming it, if there is
// none (the hooks would otherwise call through a null pointer).
void* Next(const char* name) {
  void* fn = ::dlsym(RTLD_NEXT, name);
  if (!fn) {
    std::fprintf(stderr,
                 "nfs_hooks: dlsym(RTLD_NEXT, \"%s\") found nothing (%s): is the test "
                 "linked with libnfs?\n",
                 name, [] {
                   const char* why = ::dlerror();
                   return why ? why : "no later definition";
                 }());
    std::abort();
  }
  return fn;
}
template <typename Fn>
Fn Real(Fn, const char* name) {
  return reinterpret_cast<Fn>(Next(name));
}
#define CKPTIO_REAL(fn) (nfs_hooks::Real(&::fn, #fn))

int RealRename(nfs_context* n, const char* a, const char* b) {
  static auto real = CKPTIO_REAL(nfs_rename);
  return real(n, a, b);
}
int RealStat(nfs_context* n, const char* p, nfs_stat_64* st, bool follow) {
  static auto real_stat = CKPTIO_REAL(nfs_stat64);
  static auto real_lstat = CKPTIO_REAL(nfs_lstat64);
  return follow ? real_stat(n, p, st) : real_lstat(n, p, st);
}
int RealPwrite(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, const void* buf) {
  static auto real = CKPTIO_REAL(nfs_pwrite);
  return real(n, fh, off, count, buf);
}
int RealPwriteAsync(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, const void* buf,
                    nfs_cb cb, void* data) {
  static auto real = CKPTIO_REAL(nfs_pwrite_async);
  return real(n, fh, off, count, buf, cb, data);
}
int RealPreadAsync(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, nfs_cb cb, void* data) {
  static auto real = CKPTIO_REAL(nfs_pread_async);
  return real(n, fh, off, count, cb, data);
}
int RealPread(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
  static auto real = CKPTIO_REAL(nfs_pread);
  return real(n, fh, off, count, buf);
}
int RealLockf(nfs_context* n, nfsfh* fh, nfs4_lock_op op, uint64_t count) {
  static auto real = CKPTIO_REAL(nfs_lockf);
  return real(n, fh, op, count);
}
int RealOpen2(nfs_context* n, const char* p, int flags, int mode, nfsfh** fh) {
  static auto real = CKPTIO_REAL(nfs_open2);
  return real(n, p, flags, mode, fh);
}
int RealFstat(nfs_context* n, nfsfh* fh, nfs_stat_64* st) {
  static auto real = CKPTIO_REAL(nfs_fstat64);
  return real(n, fh, st);
}

// Fails a call as libnfs does: result `rc`, and `text` as the error.
int Fail(nfs_context* n, int rc, const std::string& text) {
  // libnfs's own setter: exported, though not in its header.
  using SetError = void (*)(nfs_context*, char*, ...);
  static auto set_error = reinterpret_cast<SetError>(Next("nfs_set_error"));
  set_error(n, const_cast<char*>("%s"), text.c_str());
  return rc;
}

// Queues an asynchronous call with `queue` (the real libnfs call, given the
// callback and data to use), counting it in `in_flight` until libnfs calls
// back and the most at once in `most`; `answer`, if set, may change its
// result (the call at file offset `off`) before the caller's `cb` sees it.
int Counted(std::atomic<int>& in_flight, std::atomic<int>& most, nfs_cb cb, void* data,
            uint64_t off, std::function<int(nfs_context*, uint64_t, int)> answer,
            const std::function<int(nfs_cb, void*)>& queue) {
  struct Wrapped {
    nfs_cb cb;
    void* data;
    uint64_t off;
    std::function<int(nfs_context*, uint64_t, int)> answer;
    std::atomic<int>* in_flight;
  };
  auto* w = new Wrapped{cb, data, off, std::move(answer), &in_flight};
  const int now = ++in_flight;
  for (int max = most.load(); now > max && !most.compare_exchange_weak(max, now);) {
  }
  auto done = [](int rc, struct nfs_context* ctx, void* d, void* p) {
    auto* wrapped = static_cast<Wrapped*>(p);
    --*wrapped->in_flight;
    if (wrapped->answer) rc = wrapped->answer(ctx, wrapped->off, rc);
    wrapped->cb(rc, ctx, d, wrapped->data);
    delete wrapped;
  };
  const int rc = queue(done, w);
  if (rc != 0) {
    --in_flight;
    delete w;
  }
  return rc;
}

}  // namespace nfs_hooks

extern "C" {
int nfs_rename(struct nfs_context* n, const char* a, const char* b) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::rename)) return h(n, a, b);
  return nfs_hooks::RealRename(n, a, b);
}
int nfs_stat64(struct nfs_context* n, const char* p, struct nfs_stat_64* st) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::stat)) {
    int rc = h(n, p, st);
    if (rc != 1) return rc;  // 1: pass through
  }
  return nfs_hooks::RealStat(n, p, st, true);
}
int nfs_lstat64(struct nfs_context* n, const char* p, struct nfs_stat_64* st) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::stat)) {
    int rc = h(n, p, st);
    if (rc != 1) return rc;
  }
  return nfs_hooks::RealStat(n, p, st, false);
}
int nfs_pwrite(struct nfs_context* n, struct nfsfh* fh, uint64_t off, uint64_t count,
               const void* buf) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::pwrite)) return h(n, fh, off, count, buf);
  return nfs_hooks::RealPwrite(n, fh, off, count, buf);
}
int nfs_pwrite_async(struct nfs_context* n, struct nfsfh* fh, uint64_t off, uint64_t count,
                     const void* buf, nfs_cb cb, void* data) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::pwrite_async)) {
    const int64_t send = h(n, fh, off, count);
    if (send < 0) return nfs_hooks::Fail(n, static_cast<int>(send), "out of memory (test hook)");
    count = static_cast<uint64_t>(send);
  }
  return nfs_hooks::Counted(nfs_hooks::writes_in_flight, nfs_hooks::max_writes_in_flight, cb, data,
                            off, nullptr, [&](nfs_cb done, void* wrapped) {
                              return nfs_hooks::RealPwriteAsync(n, fh, off, count, buf, done,
                                                                wrapped);
                            });
}
int nfs_pread_async(struct nfs_context* n, struct nfsfh* fh, uint64_t off, uint64_t count,
                    nfs_cb cb, void* data) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::pread_async)) {
    const int64_t ask = h(n, fh, off, count);
    if (ask < 0) return nfs_hooks::Fail(n, static_cast<int>(ask), "out of memory (test hook)");
    count = static_cast<uint64_t>(ask);
  }
  return nfs_hooks::Counted(nfs_hooks::reads_in_flight, nfs_hooks::max_reads_in_flight, cb, data,
                            off, nfs_hooks::Get(&nfs_hooks::Hooks::pread_answer),
                            [&](nfs_cb done, void* wrapped) {
                              return nfs_hooks::RealPreadAsync(n, fh, off, count, done, wrapped);
                            });
}
int nfs_pread(struct nfs_context* n, struct nfsfh* fh, uint64_t off, uint64_t count, void* buf) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::pread)) return h(n, fh, off, count, buf);
  return nfs_hooks::RealPread(n, fh, off, count, buf);
}
int nfs_lockf(struct nfs_context* n, struct nfsfh* fh, enum nfs4_lock_op op, uint64_t count) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::lockf)) return h(n, fh, op, count);
  return nfs_hooks::RealLockf(n, fh, op, count);
}
int nfs_open2(struct nfs_context* n, const char* p, int flags, int mode, struct nfsfh** fh) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::open2)) return h(n, p, flags, mode, fh);
  return nfs_hooks::RealOpen2(n, p, flags, mode, fh);
}
int nfs_fstat64(struct nfs_context* n, struct nfsfh* fh, struct nfs_stat_64* st) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::fstat)) return h(n, fh, st);
  return nfs_hooks::RealFstat(n, fh, st);
}
}  // extern "C"

namespace {

using ckptio::testing::NfsServer;

ckptio::testing::BackendHarness NfsHarness(int version) {
  ckptio::testing::BackendHarness h;
  h.name = "nfs_v" + std::to_string(version);
  static int next_store = 0;
  h.make = [version, sub = std::make_shared<std::string>(),
            n = &next_store](bool same_location) -> std::unique_ptr<ckptio::StorageBackend> {
    NfsServer& server = NfsServer::Shared();
    if (!server.ok()) return nullptr;
    if (!same_location || sub->empty()) {
      // The export outlives this process, and pids come round again within
      // one ctest run: the random job id keeps a later process with this
      // pid from finding an earlier one's objects.
      *sub = "conf-v" + std::to_string(version) + "-" + ckptio::testing::NewJobId() + "-" +
             std::to_string((*n)++);
      ::mkdir((server.export_dir() + "/" + *sub).c_str(), 0755);
    }
    auto uri = ckptio::Uri::Parse(server.Uri(version, *sub));
    if (!uri.ok()) return nullptr;
    auto options = ckptio::ParseNfsUri(*uri);
    if (!options.ok()) return nullptr;
    auto b = ckptio::NewNfsBackend(*options);
    if (!b.ok()) {
      std::cerr << b.status() << "\n";
      return nullptr;
    }
    return std::move(*b);
  };
  h.supports_lock = true;
  return h;
}

}  // namespace

CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(NfsV3, NfsHarness(3));
CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(NfsV4, NfsHarness(4));

namespace ckptio {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::NfsServer;
using testing::RandomBytes;

// A fresh folder of the export, and its name.
std::string FreshFolder(const std::string& label) {
  static int n = 0;
  std::string sub = label + "-" + testing::NewJobId() + "-" + std::to_string(n++);  // see above
  ::mkdir((NfsServer::Shared().export_dir() + "/" + sub).c_str(), 0755);
  return sub;
}

std::unique_ptr<Store> Open(const std::string& uri) {
  auto s = OpenStore(uri);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

Status SaveStep(Store& store, int64_t step, size_t bytes = 200000, WriterOptions o = {}) {
  o.chunk_size = 64 << 10;
  CKPTIO_ASSIGN_OR_RETURN(auto w, store.OpenWriter(o));
  CKPTIO_ASSIGN_OR_RETURN(auto p, w->Begin(step));
  const std::string data = RandomBytes(bytes, static_cast<uint64_t>(step));
  CKPTIO_RETURN_IF_ERROR(p->PutObject("model.safetensors", data.data(), data.size()));
  CKPTIO_RETURN_IF_ERROR(p->PutObject("rng.bin", "seed", 4));
  return p->Commit().status();
}

void ExpectStepVerifies(Store& store, int64_t step, size_t bytes = 200000) {
  auto r = store.OpenStep(step);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)->Verify().ok());
  auto data = (*r)->ReadAll("model.safetensors");
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, RandomBytes(bytes, static_cast<uint64_t>(step)));
}

class NfsStore : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { ASSERT_TRUE(NfsServer::Shared().ok()) << "no NFS server"; }
  int version() const { return GetParam(); }
};

// Rank 0 writes over NFS while others read the exported folder directly
// (as through a kernel mount), and the other way round.
TEST_P(NfsStore, MixedAccessWithThePosixBackend) {
  const std::string sub = FreshFolder("mixed");
  const std::string local = NfsServer::Shared().export_dir() + "/" + sub;
  auto nfs = Open(NfsServer::Shared().Uri(version(), sub));
  auto posix = Open(local);
  ASSERT_TRUE(nfs && posix);
  ASSERT_TRUE(SaveStep(*nfs, 1).ok());
  ExpectStepVerifies(*posix, 1);
  ASSERT_TRUE(SaveStep(*posix, 2).ok());
  ExpectStepVerifies(*nfs, 2);
  auto latest = nfs->ReadLatest();
  ASSERT_TRUE(latest.ok() && latest->has_value());
  EXPECT_EQ((*latest)->step, 2);
}

// A reader polling LATEST through one client sees a commit made through
// another at its next read: libnfs keeps no attribute or data cache.
TEST_P(NfsStore, ACommitIsSeenByAnotherClientAtItsNextPoll) {
  const std::string sub = FreshFolder("stale");
  auto writer = Open(NfsServer::Shared().Uri(version(), sub));
  auto reader = Open(NfsServer::Shared().Uri(version() == 3 ? 4 : 3, sub));
  ASSERT_TRUE(writer && reader);
  auto w = writer->OpenWriter({});
  ASSERT_TRUE(w.ok()) << w.status();
  int64_t worst_us = 0;
  constexpr int kRounds = 20;
  for (int64_t step = 1; step <= kRounds; ++step) {
    auto p = (*w)->Begin(step);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE((*p)->PutObject("x", "y", 1).ok());
    ASSERT_TRUE((*p)->Commit().ok());
    const auto committed = Clock::now();
    auto latest = reader->ReadLatest();  // the first poll after the commit
    ASSERT_TRUE(latest.ok()) << latest.status();
    ASSERT_TRUE(latest->has_value() && (*latest)->step == step)
        << "the first poll after committing step " << step << " did not see it";
    worst_us = std::max<int64_t>(
        worst_us,
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - committed).count());
  }
  std::cout << "nfs v" << version() << ": " << kRounds
            << " commits each seen by another client's first poll after it; slowest poll "
            << worst_us << " us\n";
  EXPECT_LT(worst_us, 1000000);
}

// A writer that dies keeps the store's writer lock only until its lease
// ends: the NFSv4 server's lease, or the v3 lease file's.
TEST_P(NfsStore, ADeadWritersLockEndsWithItsLease) {
  const std::string sub = FreshFolder("dead");
  const std::string uri = NfsServer::Shared().Uri(version(), sub, "lease_ms=3000");
  testing::Pipe ready;
  ASSERT_TRUE(ready.ok());
  auto child = testing::Child::Start([&] {
    auto store = OpenStore(uri);
    if (!store.ok()) return 3;
    auto w = (*store)->OpenWriter({});
    if (!w.ok()) return 4;
    testing::WriteLine(ready.write_fd(), "locked");
    ::pause();
    return 0;
  });
  ready.CloseWrite();
  ASSERT_TRUE(testing::ReadLine(ready.read_fd(), milliseconds(20000)));
  ::kill(child.pid(), SIGKILL);
  const auto killed = Clock::now();
  child.Wait(milliseconds(5000));
  auto store = Open(uri);
  ASSERT_TRUE(store);
  auto blocked = store->OpenWriter({});
  EXPECT_EQ(blocked.status().code(), Code::kFailedPrecondition) << blocked.status();
  WriterOptions o;
  o.lock_wait = milliseconds(30000);
  auto w = store->OpenWriter(o);
  ASSERT_TRUE(w.ok()) << w.status();
  const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - killed).count();
  std::cout << "nfs v" << version() << ": a SIGKILLed writer's lock was taken over " << waited
            << " ms after the kill (lease: "
            << (version() == 4 ? "the server's 10 s" : "3 s lease file") << ")\n";
  auto p = (*w)->Begin(1);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*p)->PutObject("x", "y", 1).ok());
  EXPECT_TRUE((*p)->Commit().ok());
}

// A live holder keeps its lock past the lease time: the backend renews the
// v4 lease (and rewrites the v3 lease file) while the lock is held.
TEST_P(NfsStore, ALiveWritersLockOutlivesTheLease) {
  const std::string sub = FreshFolder("live");
  const std::string uri = NfsServer::Shared().Uri(version(), sub, "lease_ms=3000");
  auto holder = Open(uri);
  auto other = Open(uri);
  ASSERT_TRUE(holder && other);
  auto w = holder->OpenWriter({});
  ASSERT_TRUE(w.ok()) << w.status();
  // v4: the server's lease is 10 s (tools/nfs-server.sh); v3: 3 s.
  std::this_thread::sleep_for(milliseconds(version() == 4 ? 13000 : 5000));
  auto second = other->OpenWriter({});
  EXPECT_EQ(second.status().code(), Code::kFailedPrecondition)
      << "a held lock was lost after one lease time: " << second.status();
  auto p = (*w)->Begin(1);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE((*p)->PutObject("x", "y", 1).ok());
  EXPECT_TRUE((*p)->Commit().ok()) << "the idle holder's connection must still work";
}

INSTANTIATE_TEST_SUITE_P(Versions, NfsStore, ::testing::Values(3, 4),
                         [](const auto& p) { return "v" + std::to_string(p.param); });

TEST(NfsUri, ParsesAndRefusesPrecisely) {
  auto parse = [](const std::string& text) -> Result<NfsOptions> {
    CKPTIO_ASSIGN_OR_RETURN(Uri u, Uri::Parse(text));
    return ParseNfsUri(u);
  };
  auto o = parse("nfs://filer/exports/run42/?version=4&nfsport=2049&timeout_ms=5000&client=r0");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->server, "filer");
  EXPECT_EQ(o->path, "/exports/run42");
  EXPECT_EQ(o->version, 4);
  EXPECT_EQ(o->nfs_port, 2049);
  EXPECT_EQ(o->timeout, milliseconds(5000));
  EXPECT_EQ(o->client_name, "r0");
  for (const char* bad :
       {"nfs:///no/server", "nfs://h/p?version=2", "nfs://h/p?nfsport=0", "nfs://h/p?timeout_ms=5",
        "nfs://h/p?colour=blue", "nfs://h/p?mountport=x"}) {
    auto r = parse(bad);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad << ": " << r.status();
  }
  // Nobody listening: a clear error naming the server and what to check.
  auto none = OpenStore("nfs://127.0.0.1/export?version=3&nfsport=1&mountport=1&timeout_ms=2000");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), Code::kUnavailable) << none.status();
  EXPECT_NE(none.status().message().find("cannot mount nfs://127.0.0.1/export"), std::string::npos)
      << none.status();
}

// ---------------------------------------------------------------------------
// Failures, lost replies, locks changing hands and planted links, through the
// libnfs hooks at the top of this file.

int64_t UnixMs() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t).count();
}

bool Contains(const std::string& text, const char* part) {
  return text.find(part) != std::string::npos;
}

std::string ReadLocal(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Replaces `path` with `bytes` as a local rename would (as another client's
// commit does).
void ReplaceLocal(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".local-tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << bytes;
  }
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0) << path;
}

class NfsBackendFaults : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(NfsServer::Shared().ok()) << "no NFS server";
    sub_ = FreshFolder("faults");
    dir_ = NfsServer::Shared().export_dir() + "/" + sub_;
    backend_ = Backend();
    ASSERT_TRUE(backend_);
  }
  int version() const { return GetParam(); }
  // A backend on folder sub_ of `server`'s export.
  std::unique_ptr<StorageBackend> Backend(const std::string& extra = "",
                                          const NfsServer& server = NfsServer::Shared()) {
    auto uri = Uri::Parse(server.Uri(version(), sub_, extra));
    EXPECT_TRUE(uri.ok()) << uri.status();
    if (!uri.ok()) return nullptr;
    auto options = ParseNfsUri(*uri);
    EXPECT_TRUE(options.ok()) << options.status();
    if (!options.ok()) return nullptr;
    auto b = NewNfsBackend(*options);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }
  static Status Put(StorageBackend& b, std::string_view key, const std::string& bytes,
                    WriteMode mode = WriteMode::kReplace) {
    CKPTIO_ASSIGN_OR_RETURN(auto w, b.NewObject(key, mode));
    CKPTIO_RETURN_IF_ERROR(w->Append(bytes.data(), bytes.size()));
    return w->Commit();
  }
  // Puts `bytes` as object `key` and opens it (null, the test failed, if
  // either fails).
  std::unique_ptr<ObjectReader> PutAndOpen(std::string_view key, const std::string& bytes) {
    Status put = Put(*backend_, key, bytes);
    EXPECT_TRUE(put.ok()) << put;
    auto reader = backend_->OpenObject(key);
    EXPECT_TRUE(reader.ok()) << reader.status();
    return put.ok() && reader.ok() ? std::move(*reader) : nullptr;
  }
  static Result<std::string> Get(StorageBackend& b, std::string_view key) {
    CKPTIO_ASSIGN_OR_RETURN(auto r, b.OpenObject(key));
    std::string out(r->Size(), '\0');
    CKPTIO_RETURN_IF_ERROR(r->ReadAt(0, out.data(), out.size()));
    return out;
  }

  std::string sub_, dir_;
  std::unique_ptr<StorageBackend> backend_;
};

// What only one protocol version has: LOCKT (v4), lease files (v3).
class NfsV4Faults : public NfsBackendFaults {};
class NfsV3Faults : public NfsBackendFaults {};

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
    h.stat = [&](nfs_context* n, const char* path, nfs_stat_64*) {
      if (!std::strstr(path, ".ckptio-tmp.")) return 1;
      ++temp_stats;
      return nfs_hooks::Fail(n, -EIO, "nfs_service failed");  // the look fails too
    };
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
