// The StorageBackend conformance suite. See conformance.h for how a backend
// instantiates it; see ckptio/backend.h for the contract tested here.
#include "conformance.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

namespace ckptio::testing {

// The suite lives in a library; binaries that link it without instantiating
// it (e.g. with --whole-archive) must not fail for that.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackendConformanceTest);

std::string BackendHarnessName(const ::testing::TestParamInfo<BackendHarness>& info) {
  return info.param.name;
}

::testing::AssertionResult IsOk(const Status& status) {
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected OK, got " << status;
}

::testing::AssertionResult StatusIs(const Status& status, Code want) {
  if (status.code() == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << CodeName(want) << ", got " << status;
}

::testing::AssertionResult SameBytes(std::string_view actual, std::string_view expected) {
  size_t common = std::min(actual.size(), expected.size());
  size_t i = 0;
  while (i < common && actual[i] == expected[i]) ++i;
  if (i == common && actual.size() == expected.size()) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  failure << "got " << actual.size() << " bytes, expected " << expected.size();
  if (i < common) {
    failure << "; first difference at offset " << i << " (got 0x" << std::hex
            << int(static_cast<unsigned char>(actual[i])) << ", expected 0x"
            << int(static_cast<unsigned char>(expected[i])) << std::dec << ")";
  } else {
    failure << "; the shorter is a prefix of the longer";
  }
  return failure;
}

namespace {

std::string Join(const std::vector<std::string>& keys) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < keys.size(); ++i) out << (i ? ", " : "") << '"' << keys[i] << '"';
  out << "]";
  return out.str();
}

std::vector<std::string> Sorted(std::vector<std::string> keys) {
  std::sort(keys.begin(), keys.end());
  return keys;
}

// Waits until `count` reaches `target`: lines threads up so they collide.
void SpinUntil(const std::atomic<int>& count, int target) {
  while (count.load() < target) std::this_thread::yield();
}

}  // namespace

void BackendConformanceTest::SetUp() {
  ASSERT_TRUE(static_cast<bool>(harness().make))
      << "harness " << harness().name << " has no make function";
  backend_ = harness().make(false);
  ASSERT_NE(backend_, nullptr) << "harness " << harness().name << ": make(false) returned null";
  auto listed = backend_->List("");
  ASSERT_TRUE(IsOk(listed.status())) << "List(\"\") on a fresh backend";
  ASSERT_TRUE(listed->empty()) << "make(false) must return an empty backend; it holds "
                               << Join(*listed);
}

void BackendConformanceTest::TearDown() { backend_.reset(); }

std::unique_ptr<StorageBackend> BackendConformanceTest::OpenSameLocation() {
  std::unique_ptr<StorageBackend> other = harness().make(true);
  EXPECT_NE(other, nullptr) << "harness " << harness().name << ": make(true) returned null";
  return other;
}

Status BackendConformanceTest::PutTo(StorageBackend& backend, std::string_view key,
                                     std::string_view bytes, WriteMode mode) {
  CKPTIO_ASSIGN_OR_RETURN(std::unique_ptr<ObjectWriter> writer, backend.NewObject(key, mode));
  if (writer == nullptr) return Status(Code::kInternal, "NewObject returned OK and a null writer");
  if (!bytes.empty()) CKPTIO_RETURN_IF_ERROR(writer->Append(bytes.data(), bytes.size()));
  return writer->Commit();
}

Result<std::string> BackendConformanceTest::GetFrom(StorageBackend& backend, std::string_view key) {
  CKPTIO_ASSIGN_OR_RETURN(std::unique_ptr<ObjectReader> reader, backend.OpenObject(key));
  if (reader == nullptr) return Status(Code::kInternal, "OpenObject returned OK and a null reader");
  std::string bytes(reader->Size(), '\0');
  if (!bytes.empty()) CKPTIO_RETURN_IF_ERROR(reader->ReadAt(0, bytes.data(), bytes.size()));
  return bytes;
}

Status BackendConformanceTest::Put(std::string_view key, std::string_view bytes, WriteMode mode) {
  return PutTo(*backend_, key, bytes, mode);
}

Result<std::string> BackendConformanceTest::Get(std::string_view key) {
  return GetFrom(*backend_, key);
}

bool BackendConformanceTest::IsTempKey(std::string_view key) {
  size_t slash = key.rfind('/');
  std::string_view last = slash == std::string_view::npos ? key : key.substr(slash + 1);
  return last.substr(0, kTempMarker.size()) == kTempMarker;
}

std::vector<std::string> BackendConformanceTest::WithoutTempKeys(
    const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  for (const auto& key : keys)
    if (!IsTempKey(key)) out.push_back(key);
  return out;
}

std::string BackendConformanceTest::TestBytes(size_t size, uint64_t seed) {
  std::string out(size, '\0');
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (size_t i = 0; i < size; i += 8) {
    // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(&out[i], &z, std::min<size_t>(8, size - i));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Write, commit, read back.

TEST_P(BackendConformanceTest, RoundTripEmptyObject) {
  {
    auto writer = backend_->NewObject("empty.bin", WriteMode::kCreateExclusive);
    ASSERT_TRUE(IsOk(writer.status()));
    char unused = 'x';
    ASSERT_TRUE(IsOk((*writer)->Append(&unused, 0)));  // a zero-byte append
    ASSERT_TRUE(IsOk((*writer)->Commit()));
  }
  ASSERT_TRUE(IsOk(Put("never-appended.bin", "")));

  for (const char* key : {"empty.bin", "never-appended.bin"}) {
    SCOPED_TRACE(key);
    auto info = backend_->Stat(key);
    ASSERT_TRUE(IsOk(info.status()));
    EXPECT_EQ(info->size, 0u);

    auto reader = backend_->OpenObject(key);
    ASSERT_TRUE(IsOk(reader.status()));
    EXPECT_EQ((*reader)->Size(), 0u);
    char buf[1] = {'z'};
    // Zero bytes at offset 0 are inside the object.
    EXPECT_TRUE(IsOk((*reader)->ReadAt(0, buf, 0)));
    EXPECT_TRUE(StatusIs((*reader)->ReadAt(0, buf, 1), Code::kDataLoss));
  }
  auto listed = backend_->List("");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, (std::vector<std::string>{"empty.bin", "never-appended.bin"}));
}

TEST_P(BackendConformanceTest, RoundTripOneByte) {
  const std::string one(1, '\0');  // a NUL: no C-string shortcuts
  ASSERT_TRUE(IsOk(Put("one.bin", one)));

  auto info = backend_->Stat("one.bin");
  ASSERT_TRUE(IsOk(info.status()));
  EXPECT_EQ(info->size, 1u);

  auto got = Get("one.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, one));

  auto reader = backend_->OpenObject("one.bin");
  ASSERT_TRUE(IsOk(reader.status()));
  EXPECT_EQ((*reader)->Size(), 1u);
  char buf[2] = {'a', 'a'};
  ASSERT_TRUE(IsOk((*reader)->ReadAt(0, buf, 1)));
  EXPECT_EQ(buf[0], '\0');
  EXPECT_TRUE(StatusIs((*reader)->ReadAt(0, buf, 2), Code::kDataLoss));
  EXPECT_TRUE(StatusIs((*reader)->ReadAt(1, buf, 1), Code::kDataLoss));
}

TEST_P(BackendConformanceTest, RoundTripLargeObjectWrittenInUnevenAppends) {
  const size_t size = 3 * 1024 * 1024 + 17;
  const std::string data = TestBytes(size, 1);
  const size_t chunks[] = {1, 4095, 4097, 65536, 13, 1 << 20, 777, 300001};
  {
    auto writer = backend_->NewObject("big/object.bin", WriteMode::kReplace);
    ASSERT_TRUE(IsOk(writer.status()));
    size_t done = 0;
    for (size_t i = 0; done < size; ++i) {
      size_t n = std::min(chunks[i % std::size(chunks)], size - done);
      ASSERT_TRUE(IsOk((*writer)->Append(data.data() + done, n)))
          << "append of " << n << " bytes at " << done;
      done += n;
    }
    ASSERT_TRUE(IsOk((*writer)->Commit()));
  }

  auto info = backend_->Stat("big/object.bin");
  ASSERT_TRUE(IsOk(info.status()));
  EXPECT_EQ(info->size, size);

  auto got = Get("big/object.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, data));

  auto reader = backend_->OpenObject("big/object.bin");
  ASSERT_TRUE(IsOk(reader.status()));
  EXPECT_EQ((*reader)->Size(), size);
  const uint64_t offsets[] = {0,        1,           4095,      4096,
                              65535,    65537,       1 << 20,   (1 << 20) + 1,
                              size / 2, size - 4097, size - 17, size - 1};
  const size_t lengths[] = {1, 7, 4096, 70000};
  for (uint64_t offset : offsets) {
    for (size_t length : lengths) {
      if (offset + length > size) continue;
      std::string buf(length, '\0');
      ASSERT_TRUE(IsOk((*reader)->ReadAt(offset, buf.data(), length)))
          << "ReadAt(" << offset << ", " << length << ")";
      EXPECT_TRUE(SameBytes(buf, std::string_view(data).substr(offset, length)))
          << "ReadAt(" << offset << ", " << length << ")";
    }
  }
  std::string tail(17, '\0');
  ASSERT_TRUE(IsOk((*reader)->ReadAt(size - 17, tail.data(), 17)));
  EXPECT_TRUE(SameBytes(tail, std::string_view(data).substr(size - 17)));

  // Past the end is DataLoss: a short object is a torn object. Each probe
  // uses a fresh reader, so no probe depends on the state another left.
  struct Probe {
    uint64_t offset;
    size_t length;
  };
  const Probe past_end[] = {
      {size - 1, 2},
      {size, 1},
      {size + 4096, 16},
      {0, size + 1},
      // offset + length wraps around 2^64: a bounds check must not overflow.
      {std::numeric_limits<uint64_t>::max() - 1, 4},
  };
  std::string buf(size + 1, '\0');
  for (const Probe& probe : past_end) {
    auto fresh = backend_->OpenObject("big/object.bin");
    ASSERT_TRUE(IsOk(fresh.status()));
    EXPECT_TRUE(StatusIs((*fresh)->ReadAt(probe.offset, buf.data(), probe.length), Code::kDataLoss))
        << "ReadAt(" << probe.offset << ", " << probe.length << ") on an object of " << size
        << " bytes";
  }
}

TEST_P(BackendConformanceTest, LongestValidKeysWork) {
  // A 200-byte component and a 1024-byte key are legal; a backend that adds
  // a temp prefix or suffix must still fit them (POSIX NAME_MAX is 255).
  const std::string component(kMaxKeyComponent, 'c');
  std::string longest;
  while (longest.size() + 1 + kMaxKeyComponent <= kMaxKeyLength)
    longest += (longest.empty() ? "" : "/") + component;
  longest += "/" + std::string(kMaxKeyLength - longest.size() - 1, 'k');
  ASSERT_EQ(longest.size(), kMaxKeyLength);
  ASSERT_TRUE(IsOk(ValidateKey(component)));
  ASSERT_TRUE(IsOk(ValidateKey(longest)));

  for (const std::string& key : {component, longest}) {
    SCOPED_TRACE("key of " + std::to_string(key.size()) + " bytes");
    ASSERT_TRUE(IsOk(Put(key, "long", WriteMode::kCreateExclusive)));
    auto got = Get(key);
    ASSERT_TRUE(IsOk(got.status()));
    EXPECT_EQ(*got, "long");
    EXPECT_TRUE(IsOk(backend_->Delete(key)));
  }
}

// ---------------------------------------------------------------------------
// Visibility: nothing before Commit, nothing after an abandoned writer.

TEST_P(BackendConformanceTest, NothingVisibleBeforeCommit) {
  const std::string payload = TestBytes(100 * 1024 + 3, 2);
  struct Pending {
    std::string key;
    WriteMode mode;
  };
  const Pending pending[] = {{"pending.bin", WriteMode::kReplace},
                             {"p/q/pending.bin", WriteMode::kCreateExclusive}};
  std::unique_ptr<StorageBackend> other = OpenSameLocation();
  ASSERT_NE(other, nullptr);

  for (const Pending& p : pending) {
    SCOPED_TRACE(p.key);
    auto writer = backend_->NewObject(p.key, p.mode);
    ASSERT_TRUE(IsOk(writer.status()));
    ASSERT_TRUE(IsOk((*writer)->Append(payload.data(), 1000)));
    ASSERT_TRUE(IsOk((*writer)->Append(payload.data() + 1000, payload.size() - 1000)));

    for (StorageBackend* b : {backend_.get(), other.get()}) {
      SCOPED_TRACE(b == backend_.get() ? "writing backend" : "second backend");
      EXPECT_TRUE(StatusIs(b->Stat(p.key).status(), Code::kNotFound));
      EXPECT_TRUE(StatusIs(b->OpenObject(p.key).status(), Code::kNotFound));
      for (const char* prefix : {"", "p/", "p/q/"}) {
        auto listed = b->List(prefix);
        ASSERT_TRUE(IsOk(listed.status())) << "List(\"" << prefix << "\")";
        EXPECT_EQ(WithoutTempKeys(*listed), std::vector<std::string>{})
            << "List(\"" << prefix << "\") shows uncommitted data under a "
            << "name not starting with kTempMarker: " << Join(*listed);
      }
    }

    ASSERT_TRUE(IsOk((*writer)->Commit()));
    auto info = backend_->Stat(p.key);
    ASSERT_TRUE(IsOk(info.status()));
    EXPECT_EQ(info->size, payload.size());
    auto got = GetFrom(*other, p.key);
    ASSERT_TRUE(IsOk(got.status()));
    EXPECT_TRUE(SameBytes(*got, payload));
    ASSERT_TRUE(IsOk(backend_->Delete(p.key)));
  }
  // A successful commit leaves no temp object behind.
  auto listed = backend_->List("");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, std::vector<std::string>{});
}

TEST_P(BackendConformanceTest, AbandonedWriterLeavesNothing) {
  const std::string old_bytes = TestBytes(5000, 3);
  ASSERT_TRUE(IsOk(Put("kept.bin", old_bytes)));

  struct Abandoned {
    std::string key;
    WriteMode mode;
    size_t bytes;
  };
  const Abandoned abandoned[] = {
      {"gone.bin", WriteMode::kReplace, 70000},
      {"x/y/gone.bin", WriteMode::kCreateExclusive, 4096},
      {"never-appended.bin", WriteMode::kReplace, 0},
      {"kept.bin", WriteMode::kReplace, 12345},  // would replace kept.bin
  };
  for (const Abandoned& a : abandoned) {
    SCOPED_TRACE(a.key);
    auto writer = backend_->NewObject(a.key, a.mode);
    ASSERT_TRUE(IsOk(writer.status()));
    const std::string bytes = TestBytes(a.bytes, 4);
    if (!bytes.empty()) {
      ASSERT_TRUE(IsOk((*writer)->Append(bytes.data(), bytes.size())));
    }
    // The writer is destroyed here without Commit().
  }

  auto listed = backend_->List("");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, std::vector<std::string>{"kept.bin"})
      << "abandoned writers left objects or temp entries behind";
  for (const char* key : {"gone.bin", "x/y/gone.bin", "never-appended.bin"}) {
    EXPECT_TRUE(StatusIs(backend_->Stat(key).status(), Code::kNotFound)) << key;
  }
  auto kept = Get("kept.bin");
  ASSERT_TRUE(IsOk(kept.status()));
  EXPECT_TRUE(SameBytes(*kept, old_bytes));

  // No reservation survives either: the keys can be created exclusively.
  EXPECT_TRUE(IsOk(Put("gone.bin", "new", WriteMode::kCreateExclusive)));
  EXPECT_TRUE(IsOk(Put("x/y/gone.bin", "new", WriteMode::kCreateExclusive)));
}

// ---------------------------------------------------------------------------
// Write modes.

TEST_P(BackendConformanceTest, ReplaceIsAtomic) {
  const std::string old_bytes = TestBytes(20000, 5);
  const std::string new_bytes = TestBytes(20001, 6);
  ASSERT_TRUE(IsOk(Put("obj.bin", old_bytes)));

  {
    auto writer = backend_->NewObject("obj.bin", WriteMode::kReplace);
    ASSERT_TRUE(IsOk(writer.status()));
    ASSERT_TRUE(IsOk((*writer)->Append(new_bytes.data(), new_bytes.size())));

    // Until Commit, readers see the old object, whole.
    auto info = backend_->Stat("obj.bin");
    ASSERT_TRUE(IsOk(info.status()));
    EXPECT_EQ(info->size, old_bytes.size());
    auto before = Get("obj.bin");
    ASSERT_TRUE(IsOk(before.status()));
    EXPECT_TRUE(SameBytes(*before, old_bytes));

    ASSERT_TRUE(IsOk((*writer)->Commit()));
  }
  auto info = backend_->Stat("obj.bin");
  ASSERT_TRUE(IsOk(info.status()));
  EXPECT_EQ(info->size, new_bytes.size());
  auto after = Get("obj.bin");
  ASSERT_TRUE(IsOk(after.status()));
  EXPECT_TRUE(SameBytes(*after, new_bytes));

  // Replacing with fewer bytes leaves nothing of the old tail.
  ASSERT_TRUE(IsOk(Put("obj.bin", "short")));
  auto shorter = Get("obj.bin");
  ASSERT_TRUE(IsOk(shorter.status()));
  EXPECT_EQ(*shorter, "short");
  ASSERT_TRUE(IsOk(Put("obj.bin", "")));
  auto emptied = Get("obj.bin");
  ASSERT_TRUE(IsOk(emptied.status()));
  EXPECT_EQ(*emptied, "");

  auto listed = backend_->List("");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, std::vector<std::string>{"obj.bin"});
}

TEST_P(BackendConformanceTest, CreateExclusive) {
  const std::string original = TestBytes(3000, 7);
  const std::string intruder = TestBytes(4000, 8);

  // On a new key it works.
  ASSERT_TRUE(IsOk(Put("step/obj.bin", original, WriteMode::kCreateExclusive)));
  auto got = Get("step/obj.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, original));

  // On an existing key it fails with AlreadyExists, at NewObject or at
  // Commit, and the existing object is untouched.
  {
    auto writer = backend_->NewObject("step/obj.bin", WriteMode::kCreateExclusive);
    if (writer.ok()) {
      ASSERT_TRUE(IsOk((*writer)->Append(intruder.data(), intruder.size())));
      EXPECT_TRUE(StatusIs((*writer)->Commit(), Code::kAlreadyExists));
    } else {
      EXPECT_TRUE(StatusIs(writer.status(), Code::kAlreadyExists));
    }
  }
  got = Get("step/obj.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, original));

  // Two exclusive writers for one new key, both open before either commits:
  // the first commit wins, the second is AlreadyExists (wherever reported).
  {
    auto first = backend_->NewObject("step/race.bin", WriteMode::kCreateExclusive);
    ASSERT_TRUE(IsOk(first.status()));
    auto second = backend_->NewObject("step/race.bin", WriteMode::kCreateExclusive);
    ASSERT_TRUE(IsOk((*first)->Append(original.data(), original.size())));
    if (second.ok()) {
      ASSERT_TRUE(IsOk((*second)->Append(intruder.data(), intruder.size())));
    } else {
      EXPECT_TRUE(StatusIs(second.status(), Code::kAlreadyExists));
    }
    ASSERT_TRUE(IsOk((*first)->Commit()));
    if (second.ok()) {
      EXPECT_TRUE(StatusIs((*second)->Commit(), Code::kAlreadyExists));
    }
  }
  got = Get("step/race.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, original));

  // Failed commits leave no temp entries behind.
  auto listed = backend_->List("");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, (std::vector<std::string>{"step/obj.bin", "step/race.bin"}));

  // After a Delete the key is free again.
  ASSERT_TRUE(IsOk(backend_->Delete("step/obj.bin")));
  EXPECT_TRUE(IsOk(Put("step/obj.bin", intruder, WriteMode::kCreateExclusive)));
  got = Get("step/obj.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, intruder));
}

TEST_P(BackendConformanceTest, CreateExclusiveRaceHasOneWinner) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 10;
  for (int round = 0; round < kRounds; ++round) {
    const std::string key = "race/r" + std::to_string(round) + ".bin";
    std::vector<Status> results(kThreads);
    std::vector<std::string> contents(kThreads);
    for (int t = 0; t < kThreads; ++t) contents[t] = TestBytes(1000 + t, 100 * round + t);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        ++ready;
        SpinUntil(ready, kThreads);
        results[t] = Put(key, contents[t], WriteMode::kCreateExclusive);
      });
    }
    for (auto& thread : threads) thread.join();

    int winner = -1;
    for (int t = 0; t < kThreads; ++t) {
      if (results[t].ok()) {
        EXPECT_EQ(winner, -1) << key << ": threads " << winner << " and " << t
                              << " both created it exclusively";
        winner = t;
      } else {
        EXPECT_TRUE(StatusIs(results[t], Code::kAlreadyExists)) << key << ", thread " << t;
      }
    }
    ASSERT_NE(winner, -1) << key << ": no thread created it";
    auto got = Get(key);
    ASSERT_TRUE(IsOk(got.status()));
    EXPECT_TRUE(SameBytes(*got, contents[winner])) << key;
  }
  auto listed = backend_->List("race/");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(listed->size(), size_t{kRounds}) << Join(*listed);
  EXPECT_EQ(WithoutTempKeys(*listed), *listed) << "temp entries left behind";
}

// ---------------------------------------------------------------------------
// Keys, List and Delete.

TEST_P(BackendConformanceTest, NestedKeysListAndDelete) {
  // Byte order puts "a-x.bin" and "a.bin" before "a/..." ('-' < '.' < '/'),
  // and "B.bin" first: a per-directory walk gets this order wrong.
  const std::vector<std::string> keys = {"z/y.bin",   "a/b/c.bin", "a/e.bin", "ab.bin",
                                         "a/b/d.bin", "a.bin",     "a-x.bin", "B.bin"};
  for (const auto& key : keys) {
    ASSERT_TRUE(IsOk(Put(key, "content of " + key))) << key;
  }
  for (const auto& key : keys) {
    auto got = Get(key);
    ASSERT_TRUE(IsOk(got.status())) << key;
    EXPECT_EQ(*got, "content of " + key);
  }

  auto all = backend_->List("");
  ASSERT_TRUE(IsOk(all.status()));
  EXPECT_EQ(*all, Sorted(keys));

  auto under_a = backend_->List("a/");
  ASSERT_TRUE(IsOk(under_a.status()));
  EXPECT_EQ(*under_a, (std::vector<std::string>{"a/b/c.bin", "a/b/d.bin", "a/e.bin"}));
  auto under_ab = backend_->List("a/b/");
  ASSERT_TRUE(IsOk(under_ab.status()));
  EXPECT_EQ(*under_ab, (std::vector<std::string>{"a/b/c.bin", "a/b/d.bin"}));

  for (const char* missing : {"missing/", "a/missing/", "a/e.bin/"}) {
    auto listed = backend_->List(missing);
    ASSERT_TRUE(IsOk(listed.status())) << "List(\"" << missing << "\")";
    EXPECT_EQ(*listed, std::vector<std::string>{}) << "List(\"" << missing << "\")";
  }

  ASSERT_TRUE(IsOk(backend_->Delete("a/b/c.bin")));
  EXPECT_TRUE(StatusIs(backend_->Stat("a/b/c.bin").status(), Code::kNotFound));
  EXPECT_TRUE(StatusIs(backend_->OpenObject("a/b/c.bin").status(), Code::kNotFound));
  EXPECT_TRUE(StatusIs(backend_->Delete("a/b/c.bin"), Code::kNotFound));
  EXPECT_TRUE(StatusIs(backend_->Delete("never/was.bin"), Code::kNotFound));
  EXPECT_TRUE(StatusIs(backend_->Delete("never.bin"), Code::kNotFound));

  // Deleting the last object under a/b/ makes a/b/ vanish.
  ASSERT_TRUE(IsOk(backend_->Delete("a/b/d.bin")));
  under_a = backend_->List("a/");
  ASSERT_TRUE(IsOk(under_a.status()));
  EXPECT_EQ(*under_a, std::vector<std::string>{"a/e.bin"});
  under_ab = backend_->List("a/b/");
  ASSERT_TRUE(IsOk(under_ab.status()));
  EXPECT_EQ(*under_ab, std::vector<std::string>{});

  all = backend_->List("");
  ASSERT_TRUE(IsOk(all.status()));
  EXPECT_EQ(*all, (std::vector<std::string>{"B.bin", "a-x.bin", "a.bin", "a/e.bin", "ab.bin",
                                            "z/y.bin"}));

  // The vanished parent is recreated on demand.
  ASSERT_TRUE(IsOk(Put("a/b/again.bin", "again")));
  auto again = Get("a/b/again.bin");
  ASSERT_TRUE(IsOk(again.status()));
  EXPECT_EQ(*again, "again");
}

TEST_P(BackendConformanceTest, ListPrefixIsAStringPrefix) {
  // backend.h: List returns "every key that starts with `prefix`", so a
  // prefix need not end at a component boundary.
  for (const char* key :
       {"a/b/c.bin", "a/b/d.bin", "a/e.bin", "a-x.bin", "a.bin", "ab.bin", "b.bin"}) {
    ASSERT_TRUE(IsOk(Put(key, key))) << key;
  }
  struct Case {
    const char* prefix;
    std::vector<std::string> want;
  };
  const Case cases[] = {
      {"a", {"a-x.bin", "a.bin", "a/b/c.bin", "a/b/d.bin", "a/e.bin", "ab.bin"}},
      {"a/b", {"a/b/c.bin", "a/b/d.bin"}},
      {"a/e", {"a/e.bin"}},
      {"a/b/c.bin", {"a/b/c.bin"}},
      {"a/b/c.bin.x", {}},
      {"zz", {}},
  };
  for (const Case& c : cases) {
    auto listed = backend_->List(c.prefix);
    ASSERT_TRUE(IsOk(listed.status())) << "List(\"" << c.prefix << "\")";
    EXPECT_EQ(*listed, c.want) << "List(\"" << c.prefix << "\")";
  }
}

TEST_P(BackendConformanceTest, DirectoryPrefixIsNotAnObject) {
  ASSERT_TRUE(IsOk(Put("d/e/f.bin", "f")));
  for (const char* key : {"d", "d/e"}) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(StatusIs(backend_->Stat(key).status(), Code::kNotFound));
    EXPECT_TRUE(StatusIs(backend_->OpenObject(key).status(), Code::kNotFound));
    EXPECT_TRUE(StatusIs(backend_->Delete(key), Code::kNotFound));
  }
  auto got = Get("d/e/f.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_EQ(*got, "f");
}

TEST_P(BackendConformanceTest, InvalidKeysAreRejected) {
  // Objects that a backend which forgot to validate would find, or damage,
  // through the hostile keys below ("a//b" and "a/./b" name "a/b" on POSIX,
  // "a/../b" names "b", "x/" and "." name directories).
  const std::vector<std::string> existing = {"a/b", "b", "keep.bin", "x/inside.bin"};
  for (const auto& key : existing) ASSERT_TRUE(IsOk(Put(key, key))) << key;

  std::string too_long;
  while (too_long.size() <= kMaxKeyLength) too_long += "0123456789/";
  too_long += "end";

  struct BadKey {
    const char* label;
    std::string key;
    // List accepts "" (everything) and a key followed by one '/'.
    bool valid_list_prefix;
  };
  const BadKey bad_keys[] = {
      {"parent_escape", "../x", false},
      {"dotdot", "..", false},
      {"dot", ".", false},
      {"absolute", "/abs", false},
      {"root", "/", false},
      {"double_slash", "a//b", false},
      {"dot_component", "a/./b", false},
      {"dotdot_component", "a/../b", false},
      {"trailing_dotdot", "a/..", false},
      {"empty", "", true},
      {"embedded_nul", std::string("a\0b", 3), false},
      {"newline", "a\nb", false},
      {"backslash", "a\\b", false},
      {"space", "a b", false},
      {"non_ascii", "caf\xc3\xa9", false},
      {"trailing_slash", "x/", true},
      {"component_of_300_bytes", std::string(300, 'c'), false},
      {"key_over_1024_bytes", too_long, false},
  };
  for (const BadKey& bad : bad_keys) {
    SCOPED_TRACE(bad.label);
    ASSERT_FALSE(ValidateKey(bad.key).ok()) << "test bug: the key is valid";
    for (WriteMode mode : {WriteMode::kReplace, WriteMode::kCreateExclusive}) {
      auto writer = backend_->NewObject(bad.key, mode);
      EXPECT_TRUE(StatusIs(writer.status(), Code::kInvalidArgument))
          << "NewObject, mode " << static_cast<int>(mode);
    }
    EXPECT_TRUE(StatusIs(backend_->OpenObject(bad.key).status(), Code::kInvalidArgument))
        << "OpenObject";
    EXPECT_TRUE(StatusIs(backend_->Stat(bad.key).status(), Code::kInvalidArgument)) << "Stat";
    EXPECT_TRUE(StatusIs(backend_->Delete(bad.key), Code::kInvalidArgument)) << "Delete";
    if (!bad.valid_list_prefix) {
      EXPECT_TRUE(StatusIs(backend_->List(bad.key).status(), Code::kInvalidArgument)) << "List";
    }
    if (harness().supports_lock) {
      EXPECT_TRUE(StatusIs(backend_->TryLock(bad.key).status(), Code::kInvalidArgument))
          << "TryLock";
    }
  }

  // Nothing was created, replaced or deleted.
  auto listed = backend_->List("");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, Sorted(existing));
  for (const auto& key : existing) {
    auto got = Get(key);
    ASSERT_TRUE(IsOk(got.status())) << key;
    EXPECT_EQ(*got, key);
  }
}

// ---------------------------------------------------------------------------
// Locks.

TEST_P(BackendConformanceTest, TryLockIsExclusive) {
  if (!harness().supports_lock) {
    EXPECT_TRUE(StatusIs(backend_->TryLock("writer.lock").status(), Code::kUnimplemented));
    return;
  }
  auto first = backend_->TryLock("writer.lock");
  ASSERT_TRUE(IsOk(first.status()));
  ASSERT_NE(*first, nullptr);

  // Held, even against another holder in this process.
  EXPECT_TRUE(StatusIs(backend_->TryLock("writer.lock").status(), Code::kFailedPrecondition));
  // Locks with other names are independent.
  auto other_name = backend_->TryLock("other.lock");
  EXPECT_TRUE(IsOk(other_name.status()));

  first->reset();  // releases it
  auto again = backend_->TryLock("writer.lock");
  EXPECT_TRUE(IsOk(again.status()));
  EXPECT_TRUE(StatusIs(backend_->TryLock("writer.lock").status(), Code::kFailedPrecondition));
}

TEST_P(BackendConformanceTest, TryLockExcludesAnotherBackendOnSameLocation) {
  if (!harness().supports_lock) GTEST_SKIP() << "the backend has no locks";
  std::unique_ptr<StorageBackend> other = OpenSameLocation();
  ASSERT_NE(other, nullptr);

  auto held = backend_->TryLock("writer.lock");
  ASSERT_TRUE(IsOk(held.status()));
  // POSIX record locks are per process: a second open file description in
  // this process must still be refused.
  EXPECT_TRUE(StatusIs(other->TryLock("writer.lock").status(), Code::kFailedPrecondition));
  held->reset();

  auto taken = other->TryLock("writer.lock");
  ASSERT_TRUE(IsOk(taken.status()));
  EXPECT_TRUE(StatusIs(backend_->TryLock("writer.lock").status(), Code::kFailedPrecondition));
}

TEST_P(BackendConformanceTest, TryLockRaceHasOneWinner) {
  if (!harness().supports_lock) GTEST_SKIP() << "the backend has no locks";
  constexpr int kThreads = 8;
  constexpr int kRounds = 5;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<Status> results(kThreads);
    std::atomic<int> ready{0};
    std::atomic<int> tried{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        ++ready;
        SpinUntil(ready, kThreads);
        auto lock = backend_->TryLock("race.lock");
        results[t] = lock.status();
        // Hold any lock won until every thread has tried.
        ++tried;
        SpinUntil(tried, kThreads);
      });
    }
    for (auto& thread : threads) thread.join();

    int winners = 0;
    for (int t = 0; t < kThreads; ++t) {
      if (results[t].ok()) {
        ++winners;
      } else {
        EXPECT_TRUE(StatusIs(results[t], Code::kFailedPrecondition))
            << "round " << round << ", thread " << t;
      }
    }
    EXPECT_EQ(winners, 1) << "round " << round;
  }
}

// ---------------------------------------------------------------------------
// Miscellaneous.

TEST_P(BackendConformanceTest, UriIsNotEmpty) { EXPECT_FALSE(backend_->Uri().empty()); }

TEST_P(BackendConformanceTest, ConcurrentWritersThroughOneBackend) {
  constexpr int kThreads = 4;
  constexpr int kObjects = 20;
  // Even objects share one directory; odd ones go to a directory per object
  // index that all threads create at about the same time.
  auto key_of = [](int t, int i) {
    return i % 2 == 0 ? "conc/shared/t" + std::to_string(t) + "-" + std::to_string(i) + ".bin"
                      : "conc/n" + std::to_string(i) + "/t" + std::to_string(t) + ".bin";
  };
  auto bytes_of = [](int t, int i) { return TestBytes(1000 + 37 * i + t, 1000 * t + i); };

  std::vector<std::vector<std::string>> errors(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ++ready;
      SpinUntil(ready, kThreads);
      for (int i = 0; i < kObjects; ++i) {
        const std::string key = key_of(t, i);
        const std::string bytes = bytes_of(t, i);
        Status put = Put(key, bytes, WriteMode::kCreateExclusive);
        if (!put.ok()) {
          errors[t].push_back("Put " + key + ": " + put.ToString());
          continue;
        }
        auto got = Get(key);
        if (!got.ok()) {
          errors[t].push_back("Get " + key + ": " + got.status().ToString());
        } else if (*got != bytes) {
          errors[t].push_back("Get " + key + ": wrong contents");
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    for (const auto& error : errors[t]) ADD_FAILURE() << "thread " << t << ": " << error;
  }

  std::vector<std::string> want;
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kObjects; ++i) {
      const std::string key = key_of(t, i);
      want.push_back(key);
      auto got = Get(key);
      ASSERT_TRUE(IsOk(got.status())) << key;
      EXPECT_TRUE(SameBytes(*got, bytes_of(t, i))) << key;
    }
  }
  auto listed = backend_->List("conc/");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, Sorted(want));
}

TEST_P(BackendConformanceTest, SecondBackendOnSameLocationSeesCommits) {
  const std::string big = TestBytes(200000, 9);
  ASSERT_TRUE(IsOk(Put("shared/one.bin", "one")));
  ASSERT_TRUE(IsOk(Put("shared/big.bin", big)));

  std::unique_ptr<StorageBackend> other = OpenSameLocation();
  ASSERT_NE(other, nullptr);

  auto listed = other->List("");
  ASSERT_TRUE(IsOk(listed.status()));
  EXPECT_EQ(*listed, (std::vector<std::string>{"shared/big.bin", "shared/one.bin"}));
  auto info = other->Stat("shared/big.bin");
  ASSERT_TRUE(IsOk(info.status()));
  EXPECT_EQ(info->size, big.size());
  auto got = GetFrom(*other, "shared/big.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, big));
  got = GetFrom(*other, "shared/one.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_EQ(*got, "one");

  // And the other way round, including deletes.
  ASSERT_TRUE(IsOk(PutTo(*other, "shared/two.bin", "two")));
  got = Get("shared/two.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_EQ(*got, "two");
  ASSERT_TRUE(IsOk(other->Delete("shared/one.bin")));
  EXPECT_TRUE(StatusIs(backend_->Stat("shared/one.bin").status(), Code::kNotFound));

  // The second backend honours kCreateExclusive against the first's objects.
  EXPECT_TRUE(StatusIs(PutTo(*other, "shared/big.bin", "clobber", WriteMode::kCreateExclusive),
                       Code::kAlreadyExists));
  got = Get("shared/big.bin");
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_TRUE(SameBytes(*got, big));
}

}  // namespace ckptio::testing
