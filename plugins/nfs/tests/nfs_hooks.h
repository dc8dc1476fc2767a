// Fault hooks for the NFS tests. nfs_hooks.cc defines libnfs's sync calls
// that the backend makes, so a test binary linked with it (and with libnfs
// and dl) has the backend (a shared library) call those; each calls the
// real one (the next definition: libnfs's) unless a test set a hook for it
// with a Scope. Link nfs_hooks.cc into a binary at most once.
#ifndef CKPTIO_PLUGINS_NFS_TESTS_NFS_HOOKS_H_
#define CKPTIO_PLUGINS_NFS_TESTS_NFS_HOOKS_H_

#include <nfsc/libnfs.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace nfs_hooks {

struct Hooks {
  std::function<int(nfs_context*, const char*, const char*)> rename;
  std::function<int(nfs_context*, const char*, const char*)> link;
  std::function<int(nfs_context*, const char*, const char*)> mount;  // server, export path
  std::function<int(nfs_context*, const char*)> mkdir;
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
  std::function<int(nfs_context*, nfsfh*)> close;
};

// WRITEs sent with nfs_pwrite_async and not yet answered; the most at once.
extern std::atomic<int> writes_in_flight, max_writes_in_flight;
// Likewise READs sent with nfs_pread_async.
extern std::atomic<int> reads_in_flight, max_reads_in_flight;

// Sets hooks for a scope.
class Scope {
 public:
  explicit Scope(Hooks h);
  ~Scope();
};

// The real libnfs calls.
int RealRename(nfs_context* n, const char* a, const char* b);
int RealLink(nfs_context* n, const char* a, const char* b);
int RealMount(nfs_context* n, const char* server, const char* path);
int RealMkdir(nfs_context* n, const char* path);
int RealStat(nfs_context* n, const char* p, nfs_stat_64* st, bool follow);
int RealPwrite(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, const void* buf);
int RealPwriteAsync(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, const void* buf,
                    nfs_cb cb, void* data);
int RealPreadAsync(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, nfs_cb cb, void* data);
int RealPread(nfs_context* n, nfsfh* fh, uint64_t off, uint64_t count, void* buf);
int RealLockf(nfs_context* n, nfsfh* fh, nfs4_lock_op op, uint64_t count);
int RealOpen2(nfs_context* n, const char* p, int flags, int mode, nfsfh** fh);
int RealFstat(nfs_context* n, nfsfh* fh, nfs_stat_64* st);
int RealClose(nfs_context* n, nfsfh* fh);

// Fails a call as libnfs does: result `rc`, and `text` as the error.
int Fail(nfs_context* n, int rc, const std::string& text);

}  // namespace nfs_hooks

#endif  // CKPTIO_PLUGINS_NFS_TESTS_NFS_HOOKS_H_
