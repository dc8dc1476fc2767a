// The pause between the tries of ckptio's waits (internal: the core's and
// the LibTorch adapter's).
#ifndef CKPTIO_SRC_BACKOFF_H_
#define CKPTIO_SRC_BACKOFF_H_

#include <algorithm>
#include <chrono>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio {

// Wait() sleeps 1 ms, then twice as long each time up to `max_delay`
// (1 ms to 1 hour), never past `deadline`; false once the deadline has
// passed or the thread's WaitInterrupt ended the wait (asked at least every
// 50 ms, however long the pause).
class CKPTIO_EXPORT_PRIVATE Backoff {
 public:
  explicit Backoff(std::chrono::steady_clock::time_point deadline,
                   std::chrono::milliseconds max_delay = std::chrono::milliseconds(50))
      : deadline_(deadline),
        max_delay_(std::clamp<std::chrono::milliseconds>(max_delay, std::chrono::milliseconds(1),
                                                         std::chrono::hours(1))) {}
  bool Wait();
  // Why Wait() returned false: the interrupt's status, else `timed_out`.
  Status Stopped(Status timed_out) const;

 private:
  std::chrono::steady_clock::time_point deadline_;
  std::chrono::microseconds max_delay_;
  std::chrono::microseconds delay_{1000};
  Status interrupted_;
};

}  // namespace ckptio

#endif  // CKPTIO_SRC_BACKOFF_H_
