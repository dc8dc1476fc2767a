// The StorageBackend conformance suite: one set of tests that every storage
// driver must pass (after TensorStore's kvstore/test_util.h).
//
// A backend's test binary describes how to build its backend and
// instantiates the suite once, at global namespace scope:
//
//   #include "conformance.h"
//
//   ckptio::testing::BackendHarness PosixHarness() {
//     ckptio::testing::BackendHarness h;
//     h.name = "posix";
//     h.make = [root = std::make_shared<std::string>()](bool same_location)
//         -> std::unique_ptr<ckptio::StorageBackend> {
//       if (!same_location) *root = MakeFreshTempDir();
//       return OpenPosixBackendOrNull(*root);
//     };
//     return h;
//   }
//
//   CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(Posix, PosixHarness());
//
// The binary links the conformance library and gtest_main. The suite's
// tests live in conformance.cc; the macro references a function defined
// there, so the linker always pulls them in from a static library.
#ifndef CKPTIO_TESTS_LIB_CONFORMANCE_H_
#define CKPTIO_TESTS_LIB_CONFORMANCE_H_

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/backend.h"
#include "ckptio/status.h"

namespace ckptio::testing {

// How the suite obtains backends of one driver.
struct BackendHarness {
  // Names the instantiation in test names; [A-Za-z0-9_] only.
  std::string name;

  // Returns a fresh, empty backend rooted at a new location each call. May be
  // called several times in one test; calls after the first within a test
  // must return a backend on the SAME location when `same_location` is true.
  // Returns null if the backend cannot be built (the test then fails).
  // Cleaning up old locations is the harness's business.
  std::function<std::unique_ptr<StorageBackend>(bool same_location)> make;

  // False if the backend's TryLock is Unimplemented.
  bool supports_lock = true;
};

// Lets gtest print a harness by name (it holds a std::function).
inline void PrintTo(const BackendHarness& harness, std::ostream* os) {
  *os << "BackendHarness{" << harness.name << "}";
}

// Test name suffix for an instantiation: the harness's name.
std::string BackendHarnessName(const ::testing::TestParamInfo<BackendHarness>& info);

// gtest assertion helpers: `EXPECT_TRUE(IsOk(status))`,
// `EXPECT_TRUE(StatusIs(result.status(), Code::kNotFound))`.
::testing::AssertionResult IsOk(const Status& status);
::testing::AssertionResult StatusIs(const Status& status, Code want);

// Compares byte strings without dumping megabytes into a failure message:
// reports both sizes and the first differing offset.
::testing::AssertionResult SameBytes(std::string_view actual, std::string_view expected);

class BackendConformanceTest : public ::testing::TestWithParam<BackendHarness> {
 protected:
  // backend_ = make(false); fails the test unless it is non-null and empty.
  void SetUp() override;
  void TearDown() override;

  const BackendHarness& harness() const { return GetParam(); }

  // A second backend on the location of backend_ (make(true)); fails the
  // calling test (non-fatally) and returns null if the harness returns null.
  std::unique_ptr<StorageBackend> OpenSameLocation();

  // NewObject + one Append (none if `bytes` is empty) + Commit on backend_.
  Status Put(std::string_view key, std::string_view bytes, WriteMode mode = WriteMode::kReplace);
  // OpenObject + one ReadAt of the whole object (none if it is empty).
  Result<std::string> Get(std::string_view key);

  // The same, on any backend.
  static Status PutTo(StorageBackend& backend, std::string_view key, std::string_view bytes,
                      WriteMode mode = WriteMode::kReplace);
  static Result<std::string> GetFrom(StorageBackend& backend, std::string_view key);

  // True if the last component of `key` starts with kTempMarker.
  static bool IsTempKey(std::string_view key);
  // `keys` without the temp entries.
  static std::vector<std::string> WithoutTempKeys(const std::vector<std::string>& keys);

  // `size` deterministic pseudo-random bytes (NULs included), different for
  // different seeds.
  static std::string TestBytes(size_t size, uint64_t seed);

  std::unique_ptr<StorageBackend> backend_;
};

}  // namespace ckptio::testing

// Instantiates the conformance suite for one or more BackendHarness values:
//
//   CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(Posix, PosixHarness());
//
// Use at global namespace scope, once per `prefix` in a binary. The harness
// expressions are evaluated at global scope when gtest registers the tests.
#define CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(prefix, ...)                                   \
  static ::std::vector<::ckptio::testing::BackendHarness>                                     \
      ckptio_conformance_harnesses_##prefix##_() {                                            \
    return {__VA_ARGS__};                                                                     \
  }                                                                                           \
  namespace ckptio::testing {                                                                 \
  INSTANTIATE_TEST_SUITE_P(prefix, BackendConformanceTest,                                    \
                           ::testing::ValuesIn(::ckptio_conformance_harnesses_##prefix##_()), \
                           ::ckptio::testing::BackendHarnessName);                            \
  }                                                                                           \
  static_assert(true, "CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE needs a ';'")

#endif  // CKPTIO_TESTS_LIB_CONFORMANCE_H_
