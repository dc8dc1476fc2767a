#include "copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ckptio {

void StreamCopy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  if (n >= (1 << 20)) {
    const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;  // to 16-byte stores
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();  // streaming stores are weakly ordered: complete them before returning
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void ParallelCopy(const std::vector<CopyJob>& jobs) {
  constexpr uint64_t kPiece = 8 << 20;
  std::vector<CopyJob> pieces;
  for (const CopyJob& j : jobs)
    for (uint64_t o = 0; o < j.size; o += kPiece)
      pieces.push_back({j.dst + o, j.src + o, std::min(kPiece, j.size - o)});
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < pieces.size();)
      StreamCopy(pieces[i].dst, pieces[i].src, pieces[i].size);
  };
  RunOnThreads(static_cast<unsigned>(std::min<size_t>(
                   pieces.size(), std::clamp(std::thread::hardware_concurrency(), 1u, 4u))),
               work);
}

void RunOnThreads(unsigned threads, const std::function<void()>& work) {
  std::mutex mu;
  std::exception_ptr first;  // of any run, rethrown here once all returned
  auto run = [&] {
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> g(mu);
      if (!first) first = std::current_exception();
    }
  };
  std::vector<std::thread> helpers;
  for (unsigned i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(run);
    } catch (const std::exception&) {  // std::system_error, std::bad_alloc
      break;                           // no more threads to be had: those running do the rest
    }
  }
  run();
  for (auto& t : helpers) t.join();
  if (first) std::rethrow_exception(first);
}

Status FirstFailure(size_t n, unsigned threads, const std::function<Status(size_t)>& each,
                    size_t* failed_at) {
  std::atomic<size_t> next{0}, lowest{n};
  std::mutex mu;
  Status failure = OkStatus();  // of item `lowest`, under mu
  RunOnThreads(static_cast<unsigned>(std::min<size_t>(std::max(threads, 1u), n)), [&] {
    for (size_t i; (i = next.fetch_add(1)) < n && i < lowest.load();) {
      Status s = each(i);
      if (s.ok()) continue;
      std::lock_guard<std::mutex> g(mu);
      if (i < lowest.load()) {
        lowest = i;
        failure = std::move(s);
      }
    }
  });
  if (failed_at) *failed_at = lowest.load();
  return failure;
}

}  // namespace ckptio
