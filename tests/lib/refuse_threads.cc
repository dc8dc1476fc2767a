#include "refuse_threads.h"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cerrno>

namespace {
std::atomic<bool> refusing{false};
std::atomic<int> refusals{0};
}  // namespace

// Visible (the build hides symbols by default): the libraries' calls must
// find this definition before libc's.
extern "C" [[gnu::visibility("default")]] int pthread_create(pthread_t* thread,
                                                             const pthread_attr_t* attr,
                                                             void* (*start)(void*), void* arg) {
  using Create = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static const Create real = reinterpret_cast<Create>(::dlsym(RTLD_NEXT, "pthread_create"));
  if (refusing.load()) {
    ++refusals;
    return EAGAIN;
  }
  return real(thread, attr, start, arg);
}

namespace ckptio {
namespace testing {

RefuseThreads::RefuseThreads() {
  refusals = 0;
  refusing = true;
}
RefuseThreads::~RefuseThreads() { refusing = false; }
int RefuseThreads::refused() const { return refusals.load(); }

}  // namespace testing
}  // namespace ckptio
