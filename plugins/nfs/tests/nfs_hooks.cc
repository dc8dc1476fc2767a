// The libnfs calls that nfs_hooks.h lets NFS tests hook (see there).
#include "nfs_hooks.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <utility>

namespace nfs_hooks {

std::atomic<int> writes_in_flight{0}, max_writes_in_flight{0};
std::atomic<int> reads_in_flight{0}, max_reads_in_flight{0};

namespace {

std::mutex mu;
Hooks hooks;

template <typename F>
F Get(F Hooks::*member) {
  std::lock_guard<std::mutex> g(mu);
  return hooks.*member;
}

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

}  // namespace

Scope::Scope(Hooks h) {
  std::lock_guard<std::mutex> g(mu);
  hooks = std::move(h);
}

Scope::~Scope() {
  std::lock_guard<std::mutex> g(mu);
  hooks = Hooks{};
}

int RealRename(nfs_context* n, const char* a, const char* b) {
  static auto real = CKPTIO_REAL(nfs_rename);
  return real(n, a, b);
}
int RealLink(nfs_context* n, const char* a, const char* b) {
  static auto real = CKPTIO_REAL(nfs_link);
  return real(n, a, b);
}
int RealMount(nfs_context* n, const char* server, const char* path) {
  static auto real = CKPTIO_REAL(nfs_mount);
  return real(n, server, path);
}
int RealMkdir(nfs_context* n, const char* path) {
  static auto real = CKPTIO_REAL(nfs_mkdir);
  return real(n, path);
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
int RealClose(nfs_context* n, nfsfh* fh) {
  static auto real = CKPTIO_REAL(nfs_close);
  return real(n, fh);
}

// Fails a call as libnfs does: result `rc`, and `text` as the error.
int Fail(nfs_context* n, int rc, const std::string& text) {
  // libnfs's own setter: exported, though not in its header.
  using SetError = void (*)(nfs_context*, char*, ...);
  static auto set_error = reinterpret_cast<SetError>(Next("nfs_set_error"));
  set_error(n, const_cast<char*>("%s"), text.c_str());
  return rc;
}

namespace {

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

}  // namespace
}  // namespace nfs_hooks

// Visible (the build hides symbols by default): the backend's calls must
// find these definitions before libnfs's.
#pragma GCC visibility push(default)
extern "C" {
int nfs_rename(struct nfs_context* n, const char* a, const char* b) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::rename)) return h(n, a, b);
  return nfs_hooks::RealRename(n, a, b);
}
int nfs_link(struct nfs_context* n, const char* a, const char* b) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::link)) return h(n, a, b);
  return nfs_hooks::RealLink(n, a, b);
}
int nfs_mount(struct nfs_context* n, const char* server, const char* path) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::mount)) return h(n, server, path);
  return nfs_hooks::RealMount(n, server, path);
}
int nfs_mkdir(struct nfs_context* n, const char* path) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::mkdir)) return h(n, path);
  return nfs_hooks::RealMkdir(n, path);
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
int nfs_close(struct nfs_context* n, struct nfsfh* fh) {
  if (auto h = nfs_hooks::Get(&nfs_hooks::Hooks::close)) return h(n, fh);
  return nfs_hooks::RealClose(n, fh);
}
}  // extern "C"
#pragma GCC visibility pop
