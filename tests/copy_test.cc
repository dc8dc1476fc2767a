// StreamCopy and ParallelCopy (src/copy.h): every byte lands, whatever the
// alignment and length, and nothing outside the destination is touched.
// RunOnThreads: an exception on any thread reaches the caller.
#include "copy.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ckptio {
namespace {

std::string Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Lengths around the streaming threshold and the 64-byte loop, at every
// source and destination misalignment modulo 16.
TEST(StreamCopyTest, EveryByteAtAnyAlignmentAndLength) {
  const std::string src = Random((2 << 20) + 256, 1);
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{63}, size_t{4096}, size_t{(1 << 20) - 1}, size_t{1 << 20},
        size_t{(1 << 20) + 1}, size_t{(1 << 20) + 63}, size_t{(1 << 20) + 64}, size_t{2 << 20}}) {
    for (size_t s_off : {0, 1, 8, 15}) {
      for (size_t d_off : {0, 3, 16, 17}) {
        std::string dst(n + 64, '\x5a');
        StreamCopy(&dst[d_off], src.data() + s_off, n);
        ASSERT_EQ(std::memcmp(&dst[d_off], src.data() + s_off, n), 0)
            << n << " bytes, src +" << s_off << ", dst +" << d_off;
        for (size_t i = 0; i < d_off; ++i) ASSERT_EQ(dst[i], '\x5a') << "before, at " << i;
        for (size_t i = d_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], '\x5a') << "after";
      }
    }
  }
}

TEST(ParallelCopyTest, ManyJobsOfOddSizesAllLand) {
  std::vector<std::string> srcs, dsts;
  std::vector<CopyJob> jobs;
  for (size_t n : {size_t{0}, size_t{5}, size_t{(8 << 20) + 3}, size_t{(1 << 20) + 17},
                   size_t{20 << 20}, size_t{777}}) {
    srcs.push_back(Random(n, n));
    dsts.emplace_back(n, '\0');
  }
  for (size_t i = 0; i < srcs.size(); ++i)
    jobs.push_back({dsts[i].data(), srcs[i].data(), srcs[i].size()});
  ParallelCopy(jobs);
  for (size_t i = 0; i < srcs.size(); ++i) EXPECT_EQ(dsts[i], srcs[i]) << "job " << i;
  ParallelCopy({});  // nothing to do
}

// A run that throws, on a helper thread or on the caller's while helpers
// still run, is neither std::terminate nor lost: RunOnThreads rethrows it
// once every run returned, and the other runs went on with the pieces.
TEST(RunOnThreadsTest, AnExceptionOnAnyThreadReachesTheCallerAfterEveryRunReturned) {
  const std::thread::id caller = std::this_thread::get_id();
  for (bool helper_throws : {true, false}) {
    SCOPED_TRACE(helper_throws ? "a helper throws" : "the caller throws");
    constexpr int kPieces = 64;
    std::atomic<int> next{0}, done{0}, thrown{0};
    auto work = [&] {
      for (int i; (i = next.fetch_add(1)) < kPieces;) {
        const bool on_helper = std::this_thread::get_id() != caller;
        if (on_helper == helper_throws && thrown.fetch_add(1) == 0)
          throw std::runtime_error("piece " + std::to_string(i));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        done.fetch_add(1);
      }
    };
    EXPECT_THROW(RunOnThreads(3, work), std::runtime_error);
    EXPECT_GT(thrown.load(), 0);
    EXPECT_EQ(done.load(), kPieces - 1) << "the runs that did not throw stopped early";
  }
}

}  // namespace
}  // namespace ckptio
