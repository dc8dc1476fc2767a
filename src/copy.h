// Large memory copies (internal): staging for SaveAsync, loads into
// existing parameters; and the helper threads they, the verified view's
// hashing and the object lookups of commits and loads share (RunOnThreads,
// FirstFailure).
#ifndef CKPTIO_SRC_COPY_H_
#define CKPTIO_SRC_COPY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio {

// memcpy, with streaming (non-temporal) stores from 1 MiB up, where the
// destination will have left the caches before anyone reads it: skipping
// the read-for-ownership of every destination line makes a large copy about
// a quarter faster (1 GiB on this VM's 2 cores: 0.052 s with memcpy, 0.039 s
// streaming; glibc streams only above 288 MiB per call here). Any
// alignment; done (fenced) when it returns.
CKPTIO_EXPORT_PRIVATE void StreamCopy(char* dst, const char* src, size_t n);

struct CopyJob {
  char* dst;
  const char* src;
  uint64_t size;
};

// Runs the copies with StreamCopy in 8 MiB pieces on up to 4 threads (one
// per core); returns when all are done.
CKPTIO_EXPORT_PRIVATE void ParallelCopy(const std::vector<CopyJob>& jobs);

// Runs `work` here and on up to `threads` - 1 helper threads at once, and
// returns when every run has returned. Fewer helpers where the system gives
// no more threads (RLIMIT_NPROC, memory), so `work` must take its pieces
// from a shared counter until none are left, whoever runs it. An exception
// that leaves a run, on any thread, is rethrown here once every run
// returned (the first one, if several).
CKPTIO_EXPORT_PRIVATE void RunOnThreads(unsigned threads, const std::function<void()>& work);

// Runs `each(i)` for i in [0, n), handed out in order to this thread and up
// to `threads` - 1 helpers (RunOnThreads), none past the lowest i whose call
// failed, and returns that failure (its i in *failed_at, n if none), else
// OK: the error going one by one would have met first.
CKPTIO_EXPORT_PRIVATE Status FirstFailure(size_t n, unsigned threads,
                                          const std::function<Status(size_t)>& each,
                                          size_t* failed_at = nullptr);

}  // namespace ckptio

#endif  // CKPTIO_SRC_COPY_H_
