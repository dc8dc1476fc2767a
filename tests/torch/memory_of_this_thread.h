// LibTorch's memory profiling hook, for tests that bound what an operation
// allocates: install it with
//   c10::DebugInfoGuard g(c10::DebugInfoKind::PROFILER_STATE, memory);
// and it counts the tensor memory of one device type that this thread
// allocates while it is installed, live and at its peak (LibTorch's CPU and
// CUDA caching allocators report every allocation and free to it).
#ifndef CKPTIO_TESTS_TORCH_MEMORY_OF_THIS_THREAD_H_
#define CKPTIO_TESTS_TORCH_MEMORY_OF_THIS_THREAD_H_

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <cstdint>

namespace ckptio::testing {

class MemoryOfThisThread : public c10::MemoryReportingInfoBase {
  // reportMemoryUsage's totals are int64_t in LibTorch 1.13, size_t in 2.x.
  template <typename F>
  struct TotalOf;
  template <typename C, typename T>
  struct TotalOf<void (C::*)(void*, int64_t, T, T, c10::Device)> {
    using type = T;
  };
  using Total = TotalOf<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::type;

 public:
  explicit MemoryOfThisThread(c10::DeviceType type) : type_(type) {}
  void reportMemoryUsage(void*, int64_t size, Total, Total, c10::Device device) override {
    if (device.type() != type_) return;
    live += size;
    peak = std::max(peak, live);
  }
  bool memoryProfilingEnabled() const override { return true; }

  int64_t live = 0, peak = 0;

 private:
  const c10::DeviceType type_;
};

}  // namespace ckptio::testing

#endif  // CKPTIO_TESTS_TORCH_MEMORY_OF_THIS_THREAD_H_
