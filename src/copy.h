// Large memory copies (internal): staging for SaveAsync, loads into
// existing parameters; and the helper threads they and the verified view's
// hashing share (RunOnThreads).
#ifndef CKPTIO_SRC_COPY_H_
#define CKPTIO_SRC_COPY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ckptio/export.h"

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

}  // namespace ckptio

#endif  // CKPTIO_SRC_COPY_H_
