// Helpers shared by ckptio's tests: temp directories, a recording backend
// wrapper, byte patterns.
#ifndef CKPTIO_TESTS_LIB_TEST_UTIL_H_
#define CKPTIO_TESTS_LIB_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckptio/backend.h"
#include "ckptio/rank.h"
#include "ckptio/status.h"

namespace ckptio::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents.
// Throws where that is on a network or FUSE file system (see TempDir()).
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A job id no other test run uses.
std::string NewJobId();
// Rank `rank` of `world` ranks on one node, in job `job`.
RankInfo TestRank(int rank, int world, const std::string& job);

// `n` pseudo-random bytes, the same for the same seed.
std::string RandomBytes(size_t n, uint64_t seed);

// Reads or writes a whole file on the real file system (bypassing ckptio).
std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& bytes);
// Flips bit `bit` (0-7) of byte `offset` in place.
void FlipBit(const std::string& path, uint64_t offset, int bit);

// Once started for n, holds each caller of Pass() until n have begun (or
// a second has passed), and counts how many were under way at once.
class Gate {
 public:
  void Start(int n) {
    std::lock_guard<std::mutex> g(mu_);
    on_ = true;
    expected_ = n;
    begun_ = most_at_once_ = 0;
  }
  void Stop() {
    std::lock_guard<std::mutex> g(mu_);
    on_ = false;
  }
  int most_at_once() {
    std::lock_guard<std::mutex> g(mu_);
    return most_at_once_;
  }
  void Pass() {
    std::unique_lock<std::mutex> g(mu_);
    if (!on_) return;
    ++begun_;
    most_at_once_ = std::max(most_at_once_, ++under_way_);
    cv_.notify_all();
    cv_.wait_for(g, std::chrono::seconds(1), [&] { return begun_ >= expected_; });
    --under_way_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool on_ = false;
  int expected_ = 0, begun_ = 0, under_way_ = 0, most_at_once_ = 0;
};

// Forwards every call to another backend; a test overrides what it changes.
class ForwardingBackend : public StorageBackend {
 public:
  explicit ForwardingBackend(std::shared_ptr<StorageBackend> inner) : inner_(std::move(inner)) {}
  std::string Uri() const override { return inner_->Uri(); }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    return inner_->NewObject(key, mode);
  }
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    return inner_->OpenObject(key);
  }
  Result<ObjectInfo> Stat(std::string_view key) override { return inner_->Stat(key); }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    return inner_->List(prefix);
  }
  Status Delete(std::string_view key) override { return inner_->Delete(key); }
  Result<bool> IsLocked(std::string_view key) override { return inner_->IsLocked(key); }
  bool LocksAreLeases() const override { return inner_->LocksAreLeases(); }
  Result<size_t> AbortUnfinishedWrites() override { return inner_->AbortUnfinishedWrites(); }
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    return inner_->TryLock(key, mode);
  }

 private:
  std::shared_ptr<StorageBackend> inner_;
};

// Wraps a backend and records every call as one line, e.g.
// "new step-000000000001/a.bin", "commit step-000000000001/a.bin",
// "delete LATEST". Thread-safe.
class RecordingBackend : public StorageBackend {
 public:
  explicit RecordingBackend(std::shared_ptr<StorageBackend> inner) : inner_(std::move(inner)) {}

  std::vector<std::string> log() const;
  void Clear();

  std::string Uri() const override { return inner_->Uri(); }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override;
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override;
  Result<ObjectInfo> Stat(std::string_view key) override;
  Result<std::vector<std::string>> List(std::string_view prefix) override;
  Status Delete(std::string_view key) override;
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override;

  void Record(std::string line);

 private:
  std::shared_ptr<StorageBackend> inner_;
  mutable std::mutex mu_;
  std::vector<std::string> log_;
};

#define CKPTIO_ASSERT_OK(expr)                 \
  do {                                         \
    const ::ckptio::Status ckptio_s_ = (expr); \
    ASSERT_TRUE(ckptio_s_.ok()) << ckptio_s_;  \
  } while (0)
#define CKPTIO_EXPECT_OK(expr)                 \
  do {                                         \
    const ::ckptio::Status ckptio_s_ = (expr); \
    EXPECT_TRUE(ckptio_s_.ok()) << ckptio_s_;  \
  } while (0)

// `lhs = value of rexpr`, or fail the test.
#define CKPTIO_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  CKPTIO_ASSERT_OK_AND_ASSIGN_IMPL_(CKPTIO_CONCAT_(ckptio_r_, __LINE__), lhs, rexpr)
#define CKPTIO_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                      \
  ASSERT_TRUE(tmp.ok()) << tmp.status();                   \
  lhs = std::move(tmp).value()

}  // namespace ckptio::testing

#endif  // CKPTIO_TESTS_LIB_TEST_UTIL_H_
