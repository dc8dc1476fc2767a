// Thread starts that fail on demand, as where the system gives no more
// threads (RLIMIT_NPROC, memory): a binary linking refuse_threads.cc gets its
// pthread_create, which every thread start of the process (std::thread, in
// the libraries too) goes through, and which fails with EAGAIN while a
// RefuseThreads lives.
#ifndef CKPTIO_TESTS_LIB_REFUSE_THREADS_H_
#define CKPTIO_TESTS_LIB_REFUSE_THREADS_H_

namespace ckptio {
namespace testing {

// No new thread while it lives (one at a time).
class RefuseThreads {
 public:
  RefuseThreads();
  ~RefuseThreads();
  RefuseThreads(const RefuseThreads&) = delete;
  RefuseThreads& operator=(const RefuseThreads&) = delete;

  // The thread starts refused since it was made: a test that expects a
  // refusal checks that there was one, or it proves nothing.
  int refused() const;
};

}  // namespace testing
}  // namespace ckptio

#endif  // CKPTIO_TESTS_LIB_REFUSE_THREADS_H_
