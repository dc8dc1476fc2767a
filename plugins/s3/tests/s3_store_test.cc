// The s3:// backend against a real Ceph RADOS Gateway on loopback (the ctest
// fixture's, or one this process starts) and against tiny local servers
// that hang or lie: the shared conformance suite, stores saved and loaded
// over S3, a corrupted object found and passed over, racing exclusive
// creates, wrong keys, a missing bucket, calls bounded by the timeout
// whatever the server does, a hostile listing, the writer lease, and
// radosgw killed or stopped under a backend.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <functional>
#include <future>
#include <iostream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckptio/backends.h"
#include "ckptio/ckptio.h"
#include "ckptio/log.h"
#include "ckptio/s3_backend.h"
#include "common/loopback.h"
#include "conformance.h"
#include "process.h"
#include "rgw_server.h"
#include "test_util.h"

namespace {

using ckptio::testing::RgwServer;

// What the conformance suite gets where Ceph is not installed: an empty
// backend after GTEST_SKIP, so that gtest skips the test body (its SetUp
// fails on a null backend, which would fail the test instead).
class NoServerBackend : public ckptio::StorageBackend {
 public:
  std::string Uri() const override { return "s3:// (no server)"; }
  ckptio::Result<std::unique_ptr<ckptio::ObjectWriter>> NewObject(std::string_view,
                                                                  ckptio::WriteMode) override {
    return Missing();
  }
  ckptio::Result<std::unique_ptr<ckptio::ObjectReader>> OpenObject(std::string_view) override {
    return Missing();
  }
  ckptio::Result<ckptio::ObjectInfo> Stat(std::string_view) override { return Missing(); }
  ckptio::Result<std::vector<std::string>> List(std::string_view) override {
    return std::vector<std::string>();
  }
  ckptio::Status Delete(std::string_view) override { return Missing(); }

 private:
  static ckptio::Status Missing() {
    return ckptio::Status(ckptio::Code::kUnavailable, RgwServer::NotInstalledMessage());
  }
};

void SkipWithoutCeph() { GTEST_SKIP() << RgwServer::NotInstalledMessage(); }

ckptio::testing::BackendHarness S3Harness() {
  ckptio::testing::BackendHarness h;
  h.name = "s3";
  h.make = [bucket = std::make_shared<std::string>()](
               bool same_location) -> std::unique_ptr<ckptio::StorageBackend> {
    RgwServer& server = RgwServer::Shared();
    if (!server.ok()) {
      if (!RgwServer::Installed()) {
        SkipWithoutCeph();
        return std::make_unique<NoServerBackend>();
      }
      std::cerr << "no S3 server: " << server.error() << "\n";
      return nullptr;
    }
    // A fresh bucket per location, the store its whole (no prefix): S3 keys
    // are at most 1024 bytes, as ckptio's are, so a prefix would leave no
    // room for the longest valid keys (LongestValidKeysWork). The bucket's
    // name holds a random job id (NewJobId): the fixture's cluster outlives
    // this process.
    if (!same_location || bucket->empty()) {
      *bucket = server.NewBucket("conf");
      if (bucket->empty()) {
        std::cerr << server.error() << "\n";
        return nullptr;
      }
    }
    auto b = ckptio::NewS3Backend(server.Options("", *bucket));
    if (!b.ok()) {
      std::cerr << b.status() << "\n";
      return nullptr;
    }
    return std::move(*b);
  };
  // The backend's one lock is the writer's lease (kLockKey); the suite's
  // own lock names ("writer.lock") are Unimplemented over s3://, which is
  // what supports_lock = false checks. The lease is tested below.
  h.supports_lock = false;
  return h;
}

}  // namespace

CKPTIO_INSTANTIATE_BACKEND_CONFORMANCE(S3, S3Harness());

namespace ckptio {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::IsOk;
using testing::NewJobId;
using testing::RandomBytes;
using testing::RgwServer;
using testing::SameBytes;
using testing::StatusIs;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

milliseconds Since(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t);
}

// ckptio's warnings while it lives; the process-wide sink is put back
// however the test ends.
class CapturedWarnings {
 public:
  CapturedWarnings()
      : previous_(SetLogSink([this](LogLevel level, std::string_view message) {
          std::lock_guard<std::mutex> g(mu_);
          if (level == LogLevel::kWarning) lines_.emplace_back(message);
        })) {}
  ~CapturedWarnings() { SetLogSink(previous_); }
  CapturedWarnings(const CapturedWarnings&) = delete;
  CapturedWarnings& operator=(const CapturedWarnings&) = delete;
  std::vector<std::string> lines() const {
    std::lock_guard<std::mutex> g(mu_);
    return lines_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> lines_;
  LogSink previous_;  // set last: the sink uses the members above
};

std::unique_ptr<StorageBackend> NewBackend(const S3Options& options) {
  auto b = NewS3Backend(options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

Status Put(StorageBackend& b, std::string_view key, const std::string& bytes,
           WriteMode mode = WriteMode::kReplace) {
  CKPTIO_ASSIGN_OR_RETURN(auto w, b.NewObject(key, mode));
  CKPTIO_RETURN_IF_ERROR(w->Append(bytes.data(), bytes.size()));
  return w->Commit();
}

Result<std::string> Get(StorageBackend& b, std::string_view key) {
  CKPTIO_ASSIGN_OR_RETURN(auto r, b.OpenObject(key));
  std::string out(r->Size(), '\0');
  if (!out.empty()) CKPTIO_RETURN_IF_ERROR(r->ReadAt(0, out.data(), out.size()));
  return out;
}

std::unique_ptr<Store> Open(const std::string& uri) {
  auto s = OpenStore(uri);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

constexpr size_t kModelBytes = 200000;

std::string ModelBytes(int64_t step, size_t bytes = kModelBytes) {
  return RandomBytes(bytes, static_cast<uint64_t>(step));
}

Status SaveStep(StoreWriter& w, int64_t step, size_t bytes = kModelBytes) {
  CKPTIO_ASSIGN_OR_RETURN(auto p, w.Begin(step));
  const std::string data = ModelBytes(step, bytes);
  CKPTIO_RETURN_IF_ERROR(p->PutObject("model.safetensors", data.data(), data.size()));
  CKPTIO_RETURN_IF_ERROR(p->PutObject("rng.bin", "seed", 4));
  return p->Commit().status();
}

void ExpectStepVerifies(Store& store, int64_t step, size_t bytes = kModelBytes) {
  auto r = store.OpenStep(step);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(IsOk((*r)->Verify())) << "step " << step;
  auto data = (*r)->ReadAll("model.safetensors");
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_TRUE(SameBytes(*data, ModelBytes(step, bytes))) << "step " << step;
}

// The rule every load follows (ChooseStep in src/torch/load_stage.cc): the
// newest step whose objects all verify (viewed whole, as a load maps them),
// passing over damaged ones (DataLoss) only. `skipped` gets those.
Result<int64_t> NewestStepThatVerifies(Store& store, std::vector<int64_t>* skipped) {
  CKPTIO_ASSIGN_OR_RETURN(auto steps, store.ListStepsWithManifest());
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    Status v;
    auto r = store.OpenStep(*it);
    if (!r.ok()) v = r.status();
    for (size_t i = 0; v.ok() && i < (*r)->manifest().objects.size(); ++i)
      v = (*r)->View((*r)->manifest().objects[i].name).status();
    if (v.ok()) return *it;
    if (v.code() != Code::kDataLoss) return v;
    skipped->push_back(*it);
  }
  return Status(Code::kNotFound, "no step of " + store.uri() + " verifies");
}

// Tests on the shared server, each on a fresh prefix of its bucket
// (emptied afterwards: the fixture's cluster keeps its data from one ctest
// run to the next).
class S3Test : public ::testing::Test {
 protected:
  void SetUp() override {
    RgwServer& s = RgwServer::Shared();
    if (!s.ok() && !RgwServer::Installed()) GTEST_SKIP() << RgwServer::NotInstalledMessage();
    ASSERT_TRUE(s.ok()) << "no S3 server: " << s.error();
    s.ExportCredentials();  // for stores opened by URI
    prefix_ = "t-" + NewJobId();
  }

  void TearDown() override {
    if (prefix_.empty()) return;
    auto b = NewS3Backend(Options());
    if (!b.ok()) return;
    auto keys = (*b)->List("");
    if (!keys.ok()) return;
    for (const auto& key : *keys) (void)(*b)->Delete(key);
  }

  static RgwServer& server() { return RgwServer::Shared(); }
  S3Options Options() const { return server().Options(prefix_); }
  std::string Uri(const std::string& extra = "") const { return server().Uri(prefix_, extra); }

  std::string prefix_;
};

// ---------------------------------------------------------------------------
// Stores over S3.

TEST_F(S3Test, SavesTwoStepsAndLoadsTheLatestAfterReopening) {
  {
    auto store = Open(Uri());
    ASSERT_TRUE(store);
    auto w = store->OpenWriter({});
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(IsOk(SaveStep(**w, 1)));
    ASSERT_TRUE(IsOk(SaveStep(**w, 2)));
  }
  // A new store and backend: nothing comes from the writer's process state.
  auto store = Open(Uri());
  ASSERT_TRUE(store);
  auto latest = store->ReadLatest();
  ASSERT_TRUE(latest.ok()) << latest.status();
  ASSERT_TRUE(latest->has_value()) << "no LATEST after two commits";
  EXPECT_EQ((*latest)->step, 2);
  auto r = store->OpenLatest();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->step(), 2);
  EXPECT_TRUE(IsOk((*r)->Verify()));
  auto model = (*r)->ReadAll("model.safetensors");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE(SameBytes(*model, ModelBytes(2)));
  auto rng = (*r)->ReadAll("rng.bin");
  ASSERT_TRUE(rng.ok()) << rng.status();
  EXPECT_EQ(*rng, "seed");
  auto view = (*r)->View("model.safetensors");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_TRUE(SameBytes(std::string_view((*view)->data(), (*view)->size()), ModelBytes(2)));
  ExpectStepVerifies(*store, 1);

  auto steps = store->ListSteps();
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 2u);
  for (const auto& s : *steps) EXPECT_EQ(s.state, StepState::kCommitted) << s.step;
  auto check = store->Check();
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_TRUE(check->clean());
  EXPECT_EQ(check->good_steps, (std::vector<int64_t>{1, 2}));
}

// An object over one part (part_mib=5) goes up as a multipart upload, its
// parts written in pieces that straddle part boundaries, two at a time (so
// the buffers of parts sent are filled again with later ones), and comes
// back whole through ReadAt, and through View (1 MiB chunks read and hashed
// on 4 threads at once, parallel's default).
TEST_F(S3Test, AnObjectLargerThanOnePartComesBackWhole) {
  const size_t size = (22 << 20) + 12345;  // 5 parts of 5 MiB
  const std::string data = ModelBytes(7, size);
  {
    auto store = Open(Uri("part_mib=5&parallel=2"));
    ASSERT_TRUE(store);
    WriterOptions o;
    o.chunk_size = 1 << 20;
    auto w = store->OpenWriter(o);
    ASSERT_TRUE(w.ok()) << w.status();
    auto p = (*w)->Begin(7);
    ASSERT_TRUE(p.ok()) << p.status();
    auto stream = (*p)->AddObject("model.safetensors");
    ASSERT_TRUE(stream.ok()) << stream.status();
    const size_t pieces[] = {1, (5 << 20) - 2, 3, 777777, 4 << 20};
    for (size_t done = 0, i = 0; done < size; ++i) {
      size_t n = std::min(pieces[i % std::size(pieces)], size - done);
      ASSERT_TRUE(IsOk((*stream)->Write(data.data() + done, n))) << "at " << done;
      done += n;
    }
    ASSERT_TRUE(IsOk((*stream)->Close()));
    ASSERT_TRUE(IsOk((*p)->Commit().status()));
  }
  auto store = Open(Uri());
  ASSERT_TRUE(store);
  auto r = store->OpenStep(7);
  ASSERT_TRUE(r.ok()) << r.status();
  auto b = NewBackend(Options());
  ASSERT_TRUE(b);
  auto info = b->Stat((*r)->manifest().ObjectKeyOf("model.safetensors"));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->size, size);
  EXPECT_TRUE(IsOk((*r)->Verify()));
  auto all = (*r)->ReadAll("model.safetensors");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(SameBytes(*all, data));
  auto view = (*r)->View("model.safetensors");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_TRUE(SameBytes(std::string_view((*view)->data(), (*view)->size()), data));
}

// An object of the newest step replaced behind the store's back with other
// bytes of the same size (as a bad disk or another program would): every
// read of it is DataLoss, and loading passes over it to the step before.
TEST_F(S3Test, ACorruptedObjectIsDataLossAndLoadingFallsBackToThePreviousStep) {
  auto store = Open(Uri());
  ASSERT_TRUE(store);
  {
    auto w = store->OpenWriter({});
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(IsOk(SaveStep(**w, 1)));
    ASSERT_TRUE(IsOk(SaveStep(**w, 2)));
  }
  // Where the store put it: over S3 (LocksAreLeases) a step's objects are in
  // a folder of their writer's inside the step, named by the manifest.
  std::string key;
  {
    auto r = store->OpenStep(2);
    ASSERT_TRUE(r.ok()) << r.status();
    key = (*r)->manifest().ObjectKeyOf("model.safetensors");
  }
  auto b = NewBackend(Options());
  ASSERT_TRUE(b);
  const std::string other = RandomBytes(kModelBytes, 9999);
  ASSERT_NE(other, ModelBytes(2));
  ASSERT_TRUE(IsOk(Put(*b, key, other)));
  auto info = b->Stat(key);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->size, kModelBytes) << "the size alone must not give it away";

  store = Open(Uri());
  ASSERT_TRUE(store);
  auto r2 = store->OpenLatest();  // the manifest is intact: it opens
  ASSERT_TRUE(r2.ok()) << r2.status();
  ASSERT_EQ((*r2)->step(), 2);
  Status v = (*r2)->Verify();
  EXPECT_TRUE(StatusIs(v, Code::kDataLoss));
  EXPECT_TRUE(Contains(v.message(), "model.safetensors")) << v;
  EXPECT_TRUE(StatusIs((*r2)->ReadAll("model.safetensors").status(), Code::kDataLoss));
  EXPECT_TRUE(StatusIs((*r2)->View("model.safetensors").status(), Code::kDataLoss));
  std::string head(100, 'x');
  EXPECT_TRUE(
      StatusIs((*r2)->Read("model.safetensors", 0, head.data(), head.size()), Code::kDataLoss));
  EXPECT_EQ(head, std::string(100, '\0')) << "no unverified byte is handed out";

  std::vector<int64_t> skipped;
  auto chosen = NewestStepThatVerifies(*store, &skipped);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(*chosen, 1);
  EXPECT_EQ(skipped, std::vector<int64_t>{2});
  ExpectStepVerifies(*store, 1);

  auto check = store->Check();
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_EQ(check->good_steps, std::vector<int64_t>{1});
  EXPECT_EQ(check->latest, 2);
  bool reported = false;
  for (const auto& p : check->problems)
    reported |= p.kind == FsckProblem::Kind::kCorruptStep && p.step == 2;
  EXPECT_TRUE(reported) << "fsck does not report step 2 as corrupt";
}

// A writer SIGKILLed while it holds the store: its lease ends and another
// writer takes over and commits.
TEST_F(S3Test, ADeadWritersStoreLockEndsWithItsLease) {
  const std::string uri = Uri("lease_ms=3000");
  testing::Pipe ready;
  ASSERT_TRUE(ready.ok());
  auto child = testing::Child::Start([&] {
    auto store = OpenStore(uri);
    if (!store.ok()) return 3;
    auto w = (*store)->OpenWriter({});
    if (!w.ok()) return 4;
    testing::WriteLine(ready.write_fd(), "locked");
    ::pause();
    return 0;
  });
  ready.CloseWrite();
  ASSERT_TRUE(testing::ReadLine(ready.read_fd(), milliseconds(30000)))
      << "the child did not open a writer; exit code " << child.ExitCode(milliseconds(1000));
  ::kill(child.pid(), SIGKILL);
  const auto killed = Clock::now();
  child.Wait(milliseconds(5000));
  auto store = Open(uri);
  ASSERT_TRUE(store);
  auto blocked = store->OpenWriter({});
  EXPECT_TRUE(StatusIs(blocked.status(), Code::kFailedPrecondition));
  WriterOptions o;
  o.lock_wait = milliseconds(30000);
  auto w = store->OpenWriter(o);
  ASSERT_TRUE(w.ok()) << w.status();
  std::cout << "s3: a SIGKILLed writer's lease (3 s) was taken over " << Since(killed).count()
            << " ms after the kill\n";
  ASSERT_TRUE(IsOk(SaveStep(**w, 1)));
  ExpectStepVerifies(*store, 1);
}

// ---------------------------------------------------------------------------
// Conditional creates, credentials, buckets.

// Eight writers, each with its own backend (its own connections), commit
// the same key exclusively at once: one wins, the others are told the key
// exists, and the object holds the winner's bytes. The winner's create is
// not undone by a loser's retry either.
TEST_F(S3Test, RacingExclusiveCreatesHaveOneWinnerWhoseBytesAreStored) {
  constexpr int kWriters = 8;
  constexpr int kRounds = 10;
  std::vector<std::unique_ptr<StorageBackend>> backends;
  for (int t = 0; t < kWriters; ++t) {
    backends.push_back(NewBackend(Options()));
    ASSERT_TRUE(backends.back());
  }
  for (int round = 0; round < kRounds; ++round) {
    const std::string key = "race/round-" + std::to_string(round) + "/object.bin";
    std::vector<std::string> bytes;
    for (int t = 0; t < kWriters; ++t) bytes.push_back(RandomBytes(65536, 1000 * round + t));
    std::vector<Status> results(kWriters);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kWriters; ++t) {
      threads.emplace_back([&, t] {
        auto w = backends[t]->NewObject(key, WriteMode::kCreateExclusive);
        Status s = w.ok() ? (*w)->Append(bytes[t].data(), bytes[t].size()) : w.status();
        // Line the commits up: they are what collides.
        ++ready;
        while (ready.load() < kWriters) std::this_thread::yield();
        if (s.ok()) s = (*w)->Commit();
        results[t] = s;
      });
    }
    for (auto& thread : threads) thread.join();
    int winner = -1, winners = 0;
    for (int t = 0; t < kWriters; ++t) {
      if (results[t].ok()) {
        winner = t;
        ++winners;
      } else {
        EXPECT_TRUE(StatusIs(results[t], Code::kAlreadyExists))
            << "round " << round << ", writer " << t;
      }
    }
    ASSERT_EQ(winners, 1) << "round " << round;
    auto got = Get(*backends[(winner + 1) % kWriters], key);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBytes(*got, bytes[winner])) << "round " << round << ": not the winner's bytes";
  }
  std::cout << "s3: " << kWriters << " writers racing to create one key, " << kRounds
            << " rounds: one winner each round, the winner's bytes stored\n";
}

TEST_F(S3Test, WrongKeysArePermissionDeniedNamingTheS3ErrorCode) {
  S3Options wrong_secret = Options();
  wrong_secret.secret_access_key += "-wrong";
  auto b = NewBackend(wrong_secret);
  ASSERT_TRUE(b);
  auto listed = b->List("");
  EXPECT_TRUE(StatusIs(listed.status(), Code::kPermissionDenied));
  EXPECT_TRUE(Contains(listed.status().message(), "SignatureDoesNotMatch")) << listed.status();
  Status put = Put(*b, "a.bin", "x");
  EXPECT_TRUE(StatusIs(put, Code::kPermissionDenied));

  S3Options wrong_id = Options();
  wrong_id.access_key_id = "CKPTIONOSUCHKEY00000";
  auto c = NewBackend(wrong_id);
  ASSERT_TRUE(c);
  listed = c->List("");
  EXPECT_TRUE(StatusIs(listed.status(), Code::kPermissionDenied));
  EXPECT_TRUE(Contains(listed.status().message(), "InvalidAccessKeyId")) << listed.status();

  auto good = NewBackend(Options());
  ASSERT_TRUE(good);
  EXPECT_TRUE(StatusIs(good->Stat("a.bin").status(), Code::kNotFound))
      << "a refused PUT stored something";
}

TEST_F(S3Test, AMissingBucketIsNotFoundNamingIt) {
  S3Options o = Options();
  o.bucket = "ckptio-missing-" + NewJobId();
  auto b = NewBackend(o);
  ASSERT_TRUE(b);
  auto listed = b->List("");
  EXPECT_TRUE(StatusIs(listed.status(), Code::kNotFound));
  EXPECT_TRUE(Contains(listed.status().message(), o.bucket)) << listed.status();
  Status put = Put(*b, "a.bin", "x");
  EXPECT_TRUE(StatusIs(put, Code::kNotFound));
  EXPECT_TRUE(Contains(put.message(), o.bucket)) << put;
}

// ---------------------------------------------------------------------------
// The writer lease.

TEST_F(S3Test, TheWriterLeaseExcludesAnotherBackendUntilReleased) {
  S3Options o = Options();
  o.lease = milliseconds(3000);
  auto a = NewBackend(o);
  auto b = NewBackend(o);
  ASSERT_TRUE(a && b);
  auto held = a->TryLock(kLockKey);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE(StatusIs(b->TryLock(kLockKey).status(), Code::kFailedPrecondition));
  auto locked = b->IsLocked(kLockKey);
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_TRUE(*locked);
  held->reset();  // releases it
  locked = b->IsLocked(kLockKey);
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_FALSE(*locked) << "a released lease still counts as held";
  auto taken = b->TryLock(kLockKey);
  EXPECT_TRUE(taken.ok()) << taken.status();
  EXPECT_TRUE(StatusIs(a->TryLock(kLockKey).status(), Code::kFailedPrecondition));
}

// The lease object itself excludes, not only this process's table of held
// locks: a holder in another process keeps the lock past its lease time
// (it renews) and gives it up at once when it releases.
TEST_F(S3Test, ALiveHoldersLeaseOutlivesItsTimeInAnotherProcess) {
  S3Options o = Options();
  o.lease = milliseconds(3000);
  testing::Pipe to_child, from_child;
  ASSERT_TRUE(to_child.ok() && from_child.ok());
  auto child = testing::Child::Start([&] {
    to_child.CloseWrite();
    auto b = NewS3Backend(o);
    if (!b.ok()) return 3;
    auto lock = (*b)->TryLock(kLockKey);
    if (!lock.ok()) return 4;
    testing::WriteLine(from_child.write_fd(), "locked");
    if (!testing::ReadLine(to_child.read_fd(), milliseconds(60000))) return 5;
    lock->reset();
    testing::WriteLine(from_child.write_fd(), "released");
    return 0;
  });
  to_child.CloseRead();
  from_child.CloseWrite();
  ASSERT_TRUE(testing::ReadLine(from_child.read_fd(), milliseconds(30000)))
      << "the child did not take the lock; exit code " << child.ExitCode(milliseconds(1000));
  auto b = NewBackend(o);
  ASSERT_TRUE(b);
  const auto start = Clock::now();
  while (Since(start) < milliseconds(7000)) {  // over two lease times
    auto lock = b->TryLock(kLockKey);
    ASSERT_TRUE(StatusIs(lock.status(), Code::kFailedPrecondition))
        << Since(start).count() << " ms after the child took it";
    auto locked = b->IsLocked(kLockKey);
    ASSERT_TRUE(locked.ok()) << locked.status();
    EXPECT_TRUE(*locked);
    std::this_thread::sleep_for(milliseconds(500));
  }
  testing::WriteLine(to_child.write_fd(), "release");
  ASSERT_TRUE(testing::ReadLine(from_child.read_fd(), milliseconds(30000)));
  auto taken = b->TryLock(kLockKey);
  EXPECT_TRUE(taken.ok()) << "a released lease still blocks: " << taken.status();
  EXPECT_EQ(child.ExitCode(milliseconds(10000)), 0);
}

// A holder SIGKILLed right after it took the lock: its lease is broken once
// it has expired by the server's clock, not before.
TEST_F(S3Test, ADeadHoldersLeaseIsTakenOverOnlyAfterItExpires) {
  constexpr auto kLease = milliseconds(3000);
  S3Options o = Options();
  o.lease = kLease;
  testing::Pipe ready;
  ASSERT_TRUE(ready.ok());
  auto child = testing::Child::Start([&] {
    auto b = NewS3Backend(o);
    if (!b.ok()) return 3;
    auto lock = (*b)->TryLock(kLockKey);
    if (!lock.ok()) return 4;
    testing::WriteLine(ready.write_fd(), "locked");
    ::pause();
    return 0;
  });
  ready.CloseWrite();
  ASSERT_TRUE(testing::ReadLine(ready.read_fd(), milliseconds(30000)))
      << "the child did not take the lock; exit code " << child.ExitCode(milliseconds(1000));
  const auto locked = Clock::now();  // after it was taken: a lower bound stricter than needed
  ::kill(child.pid(), SIGKILL);
  const auto killed = Clock::now();
  child.Wait(milliseconds(5000));

  auto b = NewBackend(o);
  ASSERT_TRUE(b);
  auto held = b->IsLocked(kLockKey);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE(*held) << "the dead holder's lease is not seen";
  std::unique_ptr<BackendLock> lock;
  while (Since(killed) < milliseconds(15000)) {
    auto l = b->TryLock(kLockKey);
    if (l.ok()) {
      lock = std::move(*l);
      break;
    }
    ASSERT_TRUE(StatusIs(l.status(), Code::kFailedPrecondition));
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_NE(lock, nullptr) << "the dead holder's lease was never broken";
  const auto after_lock = Since(locked), after_kill = Since(killed);
  std::cout << "s3: a SIGKILLed holder's " << kLease.count() << " ms lease was broken "
            << after_kill.count() << " ms after the kill\n";
  EXPECT_GE(after_lock.count(), (kLease / 2).count()) << "broken long before it expired";
  // Dates of whole seconds, and a second's margin for them: up to lease + 2 s
  // after the last renewal; then the taker's 0.5 s check that the new lease
  // stayed its own, our polling and the requests.
  EXPECT_LE(after_kill.count(), (kLease + milliseconds(3500)).count())
      << "held long after it expired";
}

TEST_F(S3Test, TheSaveLockIsUnimplementedNamingTheWaitModesThatWork) {
  auto b = NewBackend(Options());
  ASSERT_TRUE(b);
  auto lock = b->TryLock(kSaveLockKey);
  EXPECT_TRUE(StatusIs(lock.status(), Code::kUnimplemented));
  EXPECT_TRUE(Contains(lock.status().message(), "manifest")) << lock.status();
}

// ---------------------------------------------------------------------------
// Servers that hang or lie: tiny ones on loopback, no Ceph needed.

// A loopback HTTP server on a port of its own, served by one thread until
// stopped: `reply` gets each request's head (request line and headers) and
// returns the whole response, after which the server closes the connection,
// or nullopt to leave the request unanswered (its connection stays open, read
// and discarded, as a hung server's does).
class LocalServer {
 public:
  using Reply = std::function<std::optional<std::string>(const std::string& head)>;

  explicit LocalServer(Reply reply) : reply_(std::move(reply)) {
    listen_fd_ = ListenOnLoopback(0, 128, &port_);
    if (listen_fd_ < 0 || ::pipe2(wake_, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "cannot listen on loopback: " << std::strerror(errno);
      return;
    }
    thread_ = std::thread([this] { Serve(); });
  }
  ~LocalServer() {
    Stop();
    for (int fd : {listen_fd_, wake_[0], wake_[1]})
      if (fd >= 0) ::close(fd);
  }
  LocalServer(const LocalServer&) = delete;
  LocalServer& operator=(const LocalServer&) = delete;

  // Closes every connection and stops accepting: a call still waiting on
  // this server ends (a watchdog's last resort).
  void Stop() {
    if (!thread_.joinable()) return;
    char c = 'x';
    if (::write(wake_[1], &c, 1) != 1) ADD_FAILURE() << "cannot wake the local server";
    thread_.join();
    ::close(listen_fd_);
    listen_fd_ = -1;
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int requests() const { return requests_.load(); }

 private:
  struct Conn {
    int fd;
    std::string in;
    bool done = false;  // answered, or never will be: the rest is discarded
  };

  void Serve() {
    std::vector<Conn> conns;
    while (true) {
      std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
      for (const Conn& c : conns) fds.push_back({c.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (fds[0].revents != 0) break;
      for (size_t i = 0; i < conns.size(); ++i) {
        if (fds[i + 2].revents != 0) Read(conns[i]);
      }
      conns.erase(
          std::remove_if(conns.begin(), conns.end(), [](const Conn& c) { return c.fd < 0; }),
          conns.end());
      if (fds[1].revents & POLLIN) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) conns.push_back(Conn{fd, "", false});
      }
    }
    for (const Conn& c : conns) ::close(c.fd);
  }

  void Read(Conn& c) {
    char buf[65536];
    ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n <= 0) {  // the client gave up or closed after our answer
      ::close(c.fd);
      c.fd = -1;
      return;
    }
    if (c.done) return;
    c.in.append(buf, static_cast<size_t>(n));
    size_t end = c.in.find("\r\n\r\n");
    if (end == std::string::npos) return;
    ++requests_;
    std::optional<std::string> answer = reply_(c.in.substr(0, end + 4));
    c.done = true;
    if (!answer) return;
    for (size_t sent = 0; sent < answer->size();) {
      ssize_t w = ::send(c.fd, answer->data() + sent, answer->size() - sent, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      sent += static_cast<size_t>(w);
    }
    // Half-close, and close when the client does: closing with a request
    // body unread would reset the connection under our answer.
    ::shutdown(c.fd, SHUT_WR);
  }

  Reply reply_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::atomic<int> requests_{0};
  std::thread thread_;
};

std::string HttpDate() {
  char buf[64];
  time_t now = ::time(nullptr);
  struct tm tm;
  ::gmtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return buf;
}

std::string HttpOk(const std::string& body) {
  return "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\nDate: " + HttpDate() + "\r\nConnection: close\r\n\r\n" +
         body;
}

// Options for a backend on a local server: bucket "hostile", prefix "run",
// made-up keys, a 2 s timeout.
S3Options LocalOptions(const LocalServer& server) {
  S3Options o;
  o.endpoint = server.endpoint();
  o.region = "us-east-1";
  o.bucket = "hostile";
  o.prefix = "run";
  o.access_key_id = "AKIDCKPTIOTEST000000";
  o.secret_access_key = "not-a-secret";
  o.timeout = milliseconds(2000);
  return o;
}

struct Timed {
  Status status;
  milliseconds took;
};

// Runs `call` on a thread of its own, so that one that never returns fails
// the test instead of hanging it: after 15 s `server` is stopped, which ends
// any request still waiting on it.
Timed Bounded(LocalServer& server, const std::function<Status()>& call) {
  auto result = std::async(std::launch::async, [call] {
    const auto start = Clock::now();
    Status s = call();
    return Timed{s, Since(start)};
  });
  if (result.wait_for(std::chrono::seconds(15)) != std::future_status::ready) {
    ADD_FAILURE() << "the call had not returned after 15 s: stopping the server";
    server.Stop();
  }
  return result.get();
}

Status PutVia(StorageBackend& b, const std::string& key, WriteMode mode) {
  return Put(b, key, "some bytes", mode);
}

// Every call ends within timeout_ms, retries included, when the server
// accepts connections and never answers.
TEST(S3AgainstAHungServer, EveryCallEndsUnavailableWithinTheTimeout) {
  LocalServer hung([](const std::string&) { return std::nullopt; });
  auto b = NewBackend(LocalOptions(hung));
  ASSERT_TRUE(b);
  const std::vector<std::pair<std::string, std::function<Status()>>> calls = {
      {"List", [&] { return b->List("").status(); }},
      {"Stat", [&] { return b->Stat("a.bin").status(); }},
      {"OpenObject", [&] { return b->OpenObject("a.bin").status(); }},
      {"NewObject+Commit", [&] { return PutVia(*b, "a.bin", WriteMode::kReplace); }},
      {"NewObject(exclusive)+Commit",
       [&] { return PutVia(*b, "b.bin", WriteMode::kCreateExclusive); }},
      {"Delete", [&] { return b->Delete("a.bin"); }},
      {"TryLock", [&] { return b->TryLock(kLockKey).status(); }},
  };
  for (const auto& [name, call] : calls) {
    Timed t = Bounded(hung, call);
    std::cout << "s3 against a hung server: " << name << " ended after " << t.took.count()
              << " ms: " << t.status << "\n";
    EXPECT_TRUE(StatusIs(t.status, Code::kUnavailable)) << name;
    EXPECT_TRUE(Contains(t.status.message(), "did not answer")) << name << ": " << t.status;
    EXPECT_LT(t.took.count(), 4000) << name << " (timeout_ms 2000)";
  }
  EXPECT_GE(hung.requests(), static_cast<int>(calls.size()) - 1)
      << "the calls did not reach the server";
}

// The server answers the GET that opens an object (its first 4096 bytes;
// the object has 1,000,000) and never another: ReadAt ends within the
// timeout, and what the open fetched is read without asking again.
TEST(S3AgainstAHungServer, ReadsEndUnavailableWithinTheTimeout) {
  const std::string head(4096, 'h');
  LocalServer half([&](const std::string& request) -> std::optional<std::string> {
    if (request.rfind("GET ", 0) != 0 || !Contains(request, "Range: bytes=0-4095"))
      return std::nullopt;
    return "HTTP/1.1 206 Partial Content\r\nContent-Length: 4096\r\n"
           "Content-Range: bytes 0-4095/1000000\r\nConnection: close\r\n\r\n" +
           head;
  });
  auto b = NewBackend(LocalOptions(half));
  ASSERT_TRUE(b);
  auto r = b->OpenObject("a.bin");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->Size(), 1000000u);
  std::string buf(100, '\0');
  const int opened = half.requests();
  EXPECT_TRUE(IsOk((*r)->ReadAt(3996, buf.data(), buf.size())));
  EXPECT_EQ(buf, head.substr(3996));
  EXPECT_EQ(half.requests(), opened) << "a read within the first 4096 bytes sent a request";
  Timed read = Bounded(half, [&] { return (*r)->ReadAt(4000, buf.data(), buf.size()); });
  EXPECT_TRUE(StatusIs(read.status, Code::kUnavailable)) << "ReadAt";
  EXPECT_LT(read.took.count(), 4000) << "ReadAt";
  // No Map over s3:// (the core reads chunks in parallel instead): it says
  // so at once, sending nothing.
  auto fresh = b->OpenObject("a.bin");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Timed map = Bounded(half, [&] { return (*fresh)->Map().status(); });
  EXPECT_TRUE(StatusIs(map.status, Code::kUnimplemented)) << "Map";
  EXPECT_LT(map.took.count(), 100) << "Map";
  EXPECT_GT((*fresh)->ConcurrentReads(), 1u);
}

// A status line and headers, no body, the connection closed after it.
std::string Answer(const std::string& status, const std::string& headers = "") {
  return "HTTP/1.1 " + status + "\r\n" + headers + "Content-Length: 0\r\nDate: " + HttpDate() +
         "\r\nConnection: close\r\n\r\n";
}

// The answer of a server holding `stored` to a GET with "Range: bytes=0-N"
// (206: the bytes from 0 to N or the end, and the object's size).
std::string RangedGet(const std::string& request, const std::string& stored) {
  const size_t at = request.find("ange: bytes=0-");
  if (at == std::string::npos) return Answer("400 Bad Request");
  const size_t last = std::min<size_t>(std::stoull(request.substr(at + 14)), stored.size() - 1);
  return "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-" + std::to_string(last) + "/" +
         std::to_string(stored.size()) + "\r\nContent-Length: " + std::to_string(last + 1) +
         "\r\nConnection: close\r\n\r\n" + stored.substr(0, last + 1);
}

// A conditional create met by 412 is ours only if the object holds exactly
// our bytes (another writer's of the same size, or ours and more, or a part
// of ours, are not): after our first try got no proper answer (503: it may
// have been stored), and on the first try too (libcurl resends a request
// on its own when a reused connection dies before the answer, which the
// retry count does not see). One ranged GET reads it back.
TEST(S3AgainstAScriptedServer, ACreateMet412IsOursOnlyIfTheObjectHoldsOurBytes) {
  const std::string mine = "our manifest's bytes";
  for (bool first_lost : {true, false}) {
    for (const std::string& stored :
         {mine, std::string("their manifest bytes"), mine + "!", mine.substr(0, mine.size() - 1)}) {
      SCOPED_TRACE(std::string(first_lost ? "first answer 503" : "412 at once") + ", stored \"" +
                   stored + "\"");
      std::atomic<int> puts{0};
      std::atomic<int> after_412{0};  // requests
      LocalServer server([&](const std::string& head) -> std::optional<std::string> {
        if (head.rfind("PUT ", 0) == 0)
          return ++puts == 1 && first_lost ? Answer("503 Service Unavailable")
                                           : Answer("412 Precondition Failed");
        ++after_412;
        if (head.rfind("GET ", 0) == 0) return RangedGet(head, stored);
        return Answer("405 Method Not Allowed");
      });
      auto b = NewBackend(LocalOptions(server));
      ASSERT_TRUE(b);
      Status s = Put(*b, "step-000000000001/MANIFEST.json", mine, WriteMode::kCreateExclusive);
      EXPECT_EQ(puts.load(), first_lost ? 2 : 1) << "the 503 was not retried";
      EXPECT_EQ(after_412.load(), 1) << "not read back by one request";
      if (stored == mine)
        EXPECT_TRUE(IsOk(s)) << "our own create, answered late, was reported as another's: " << s;
      else
        EXPECT_TRUE(StatusIs(s, Code::kAlreadyExists)) << "another writer's object taken for ours";
    }
  }
}

// A create met by 412 whose object cannot be read back (the server fails,
// or the time is up): whose it is is unknown, which is Unavailable, never
// "created by another writer" (a writer told that gives up its own commit,
// and a lock holder locks itself out until its lease goes stale).
TEST(S3AgainstAScriptedServer, ACreateMet412ThatCannotBeReadBackIsUnavailable) {
  for (bool answered : {true, false}) {
    SCOPED_TRACE(answered ? "GET answered 503" : "GET not answered");
    LocalServer server([&](const std::string& head) -> std::optional<std::string> {
      if (head.rfind("PUT ", 0) == 0) return Answer("412 Precondition Failed");
      if (answered) return Answer("503 Service Unavailable");
      return std::nullopt;  // the call waits out its timeout
    });
    auto b = NewBackend(LocalOptions(server));
    ASSERT_TRUE(b);
    Status s = Put(*b, "step-000000000001/MANIFEST.json", "ours", WriteMode::kCreateExclusive);
    EXPECT_TRUE(StatusIs(s, Code::kUnavailable)) << s;
    EXPECT_TRUE(Contains(s.message(), "whether this writer created it is unknown")) << s;
  }
}

// A multipart upload whose CompleteMultipartUpload is answered 500 sends
// it again (S3 asks for that). One whose outcome is in doubt counts as
// written only if the object is there as an upload of as many parts, of
// our size: no answer at all (the server may have completed it; not sent
// again once its time is up), or 404 NoSuchUpload (an earlier send, ours or
// libcurl's own resend, completed it and its answer was lost).
TEST(S3AgainstAScriptedServer, ACompleteInDoubtCountsOnlyIfTheObjectIsThere) {
  const std::string data(size_t{11} << 20, 'd');  // 3 parts of 5 MiB
  enum Answered { kNothing, kNoSuchUpload, k500Once };
  for (Answered answered : {kNothing, kNoSuchUpload, k500Once}) {
    for (bool there : {true, false}) {
      if (answered == k500Once && !there) continue;
      SCOPED_TRACE(std::to_string(answered) + (there ? ", there" : ", not there"));
      std::atomic<int> completes{0};
      LocalServer server([&](const std::string& head) -> std::optional<std::string> {
        if (head.rfind("POST ", 0) == 0 && head.find("uploads=") != std::string::npos)
          return HttpOk(
              "<InitiateMultipartUploadResult><UploadId>u1</UploadId>"
              "</InitiateMultipartUploadResult>");
        if (head.rfind("PUT ", 0) == 0 && head.find("partNumber=") != std::string::npos)
          return Answer("200 OK", "ETag: \"p\"\r\n");
        if (head.rfind("POST ", 0) == 0) {
          const int n = ++completes;
          if (answered == kNothing) return std::nullopt;  // the call waits out its timeout
          if (answered == k500Once)
            return n == 1 ? Answer("500 Internal Server Error")
                          : HttpOk(
                                "<CompleteMultipartUploadResult><ETag>\"e-3\"</ETag>"
                                "</CompleteMultipartUploadResult>");
          const std::string xml = "<Error><Code>NoSuchUpload</Code></Error>";
          return "HTTP/1.1 404 Not Found\r\nContent-Length: " + std::to_string(xml.size()) +
                 "\r\nConnection: close\r\n\r\n" + xml;
        }
        if (head.rfind("HEAD ", 0) == 0) {
          if (!there) return Answer("404 Not Found");
          return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(data.size()) +
                 "\r\nETag: \"0123456789abcdef-3\"\r\nConnection: close\r\n\r\n";
        }
        return Answer("204 No Content");  // the abort of an upload
      });
      S3Options o = LocalOptions(server);
      o.part_bytes = uint64_t{5} << 20;
      auto b = NewBackend(o);
      ASSERT_TRUE(b);
      Status s = Put(*b, "step-000000000001/big.bin", data);
      EXPECT_EQ(completes.load(), answered == k500Once ? 2 : 1);
      if (there) {
        EXPECT_TRUE(IsOk(s)) << "a completed upload whose answer was lost failed the write: " << s;
      } else {
        EXPECT_TRUE(StatusIs(s, Code::kUnavailable)) << "not completed: " << s;
      }
    }
  }
}

// A part answered 503 is sent again, and the upload completes.
TEST(S3AgainstAScriptedServer, APartAnswered503IsSentAgainAndTheUploadCompletes) {
  const std::string data(size_t{11} << 20, 'd');  // 3 parts of 5 MiB
  std::atomic<int> part_puts{0};
  std::mutex mu;
  std::string complete;  // the request line of CompleteMultipartUpload
  LocalServer server([&](const std::string& head) -> std::optional<std::string> {
    if (head.rfind("POST ", 0) == 0 && head.find("uploads=") != std::string::npos)
      return HttpOk(
          "<InitiateMultipartUploadResult><UploadId>u1</UploadId></InitiateMultipartUploadResult>");
    if (head.rfind("PUT ", 0) == 0 && head.find("partNumber=") != std::string::npos) {
      if (++part_puts == 1) return Answer("503 Service Unavailable");
      return Answer("200 OK", "ETag: \"p\"\r\n");
    }
    if (head.rfind("POST ", 0) == 0) {
      std::lock_guard<std::mutex> g(mu);
      complete = head.substr(0, head.find("\r\n"));
      return HttpOk(
          "<CompleteMultipartUploadResult><ETag>\"e-3\"</ETag>"
          "</CompleteMultipartUploadResult>");
    }
    return Answer("204 No Content");
  });
  S3Options o = LocalOptions(server);
  o.part_bytes = uint64_t{5} << 20;
  auto b = NewBackend(o);
  ASSERT_TRUE(b);
  EXPECT_TRUE(IsOk(Put(*b, "step-000000000001/big.bin", data)));
  EXPECT_EQ(part_puts.load(), 4) << "3 parts and one retry";
  std::lock_guard<std::mutex> g(mu);
  EXPECT_NE(complete.find("uploadId=u1"), std::string::npos) << complete;
}

// How long after a PUT's head its body of `bytes` bytes arrived, at a
// server that never answers "100 Continue" (libcurl 7.88 asks for it with
// every PUT, and without it holds the body back for a second).
milliseconds BodyDelayOfAPut(size_t bytes) {
  int port = 0;
  const int listen_fd = ListenOnLoopback(0, 1, &port);
  if (listen_fd < 0) {
    ADD_FAILURE() << "cannot listen on loopback: " << std::strerror(errno);
    return milliseconds::max();
  }
  auto delay = std::async(std::launch::async, [&]() -> milliseconds {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return milliseconds::max();
    std::string in;
    Clock::time_point head_at;
    size_t want = std::string::npos;  // head and body, once the head is in
    const auto give_up = Clock::now() + std::chrono::seconds(10);
    while (in.size() < want && Clock::now() < give_up) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char buf[65536];
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      in.append(buf, static_cast<size_t>(n));
      const size_t end = in.find("\r\n\r\n");
      if (want == std::string::npos && end != std::string::npos) {
        head_at = Clock::now();
        want = end + 4 + bytes;
      }
    }
    const bool whole = in.size() >= want;
    const milliseconds took = whole ? Since(head_at) : milliseconds::max();
    const std::string ok = Answer("200 OK");
    if (::send(fd, ok.data(), ok.size(), MSG_NOSIGNAL) < 0) ADD_FAILURE() << "cannot answer";
    ::close(fd);
    return took;
  });
  S3Options o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(port);
  o.region = "us-east-1";
  o.bucket = "b";
  o.access_key_id = "AKIDCKPTIOTEST000000";
  o.secret_access_key = "not-a-secret";
  o.timeout = milliseconds(5000);
  auto b = NewBackend(o);
  Status put =
      b ? Put(*b, "a.bin", std::string(bytes, 'b')) : Status(Code::kInternal, "no backend");
  EXPECT_TRUE(IsOk(put)) << put;
  const milliseconds took = delay.get();
  ::close(listen_fd);
  return took;
}

// A PUT of up to 1 MiB (records, manifests, small objects) sends its body
// with its head, one round trip in all; a larger one still waits for the
// server's go-ahead first.
TEST(S3AgainstAScriptedServer, ASmallPutSendsItsBodyWithoutWaitingForContinue) {
  const milliseconds small = BodyDelayOfAPut(size_t{1} << 20);
  EXPECT_LT(small.count(), 500) << "a 1 MiB PUT waited for \"100 Continue\"";
  const milliseconds large = BodyDelayOfAPut((size_t{1} << 20) + 1);
  EXPECT_GE(large.count(), 500) << "a PUT over 1 MiB sent its body without waiting";
}

// A server (or proxy) that ignores Range and sends the whole object: a
// read fails as Unavailable, never as DataLoss (fsck --repair deletes what
// is damaged; this object may be fine). An object no longer than the bytes
// an open fetches came whole, and reads.
TEST(S3AgainstAScriptedServer, AServerThatIgnoresRangeIsUnavailableNotDataLoss) {
  const std::string small(1000, 's'), big(10000, 'b');
  std::atomic<bool> honour_first{false};
  LocalServer server([&](const std::string& request) -> std::optional<std::string> {
    if (request.rfind("GET ", 0) != 0) return std::nullopt;
    const std::string& object = Contains(request, "/small.bin") ? small : big;
    if (honour_first && Contains(request, "Range: bytes=0-4095"))
      return "HTTP/1.1 206 Partial Content\r\nContent-Length: 4096\r\nContent-Range: bytes "
             "0-4095/10000\r\nConnection: close\r\n\r\n" +
             object.substr(0, 4096);
    return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(object.size()) +
           "\r\nConnection: close\r\n\r\n" + object;
  });
  auto b = NewBackend(LocalOptions(server));
  ASSERT_TRUE(b);
  auto whole = b->OpenObject("small.bin");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ((*whole)->Size(), small.size());
  std::string all(small.size(), '\0');
  EXPECT_TRUE(IsOk((*whole)->ReadAt(0, all.data(), all.size())));
  EXPECT_EQ(all, small);
  EXPECT_TRUE(StatusIs(b->OpenObject("big.bin").status(), Code::kUnavailable));
  // Range honoured for the open only (a proxy's cache, say): the reads past
  // the first bytes fail the same way.
  honour_first = true;
  auto r = b->OpenObject("big.bin");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->Size(), big.size());
  std::string buf(100, '\0');
  EXPECT_TRUE(StatusIs((*r)->ReadAt(5000, buf.data(), buf.size()), Code::kUnavailable));
  std::string got(big.size(), '\0');
  EXPECT_TRUE(IsOk((*r)->ReadAt(0, got.data(), got.size())));  // the whole object: fine
  EXPECT_EQ(got, big);
}

// The answer that opens an object must say which bytes it holds and how
// long the object is: any other Content-Range is Unavailable (a server or
// proxy fault; never DataLoss, which fsck --repair acts on). An empty
// object, which has no byte 0 to send (416), is sized by HEAD.
TEST(S3AgainstAScriptedServer, TheOpeningAnswerMustNameItsBytesAndTheSize) {
  const std::string bytes(100, 'a');
  std::mutex mu;
  std::string range;  // the Content-Range the server sends
  LocalServer server([&](const std::string& request) -> std::optional<std::string> {
    if (Contains(request, "/empty.bin")) {
      if (request.rfind("HEAD ", 0) == 0)
        return "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      return "HTTP/1.1 416 Requested Range Not Satisfiable\r\nContent-Length: 0\r\n"
             "Connection: close\r\n\r\n";
    }
    std::lock_guard<std::mutex> g(mu);
    return "HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n" +
           (range.empty() ? "" : "Content-Range: " + range + "\r\n") + "Connection: close\r\n\r\n" +
           bytes;
  });
  auto b = NewBackend(LocalOptions(server));
  ASSERT_TRUE(b);
  for (const std::string bad :
       {"", "bytes 0-99/*", "bytes 0-99/-1", "bytes 0-99/+200", "bytes 0-99/99999999999999999999",
        "bytes 0-99/50", "bytes 1-100/200", "bytes 0-98/200", "bytes 0-99/ 200"}) {
    {
      std::lock_guard<std::mutex> g(mu);
      range = bad;
    }
    auto r = b->OpenObject("a.bin");
    EXPECT_TRUE(StatusIs(r.status(), Code::kUnavailable))
        << "Content-Range \"" << bad << "\": " << r.status();
  }
  {
    std::lock_guard<std::mutex> g(mu);
    range = "bytes 0-99/200";
  }
  auto r = b->OpenObject("a.bin");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->Size(), 200u);
  auto empty = b->OpenObject("empty.bin");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ((*empty)->Size(), 0u);
}

// A read hashes the bytes as they arrive; an answer cut off in the middle
// is sent again, and the hash is of the bytes the read returns, not of
// every byte that arrived (the first try's are counted once, not twice).
TEST(S3AgainstAScriptedServer, AReadCutOffAndSentAgainHashesTheBytesItReturns) {
  std::string object(20000, '\0');
  for (size_t i = 0; i < object.size(); ++i) object[i] = static_cast<char>(i * 131 + i / 7);
  std::atomic<int> range_gets{0};
  LocalServer server([&](const std::string& head) -> std::optional<std::string> {
    const std::string prefix = "Range: bytes=";
    const size_t at = head.find(prefix);
    if (head.rfind("GET ", 0) != 0 || at == std::string::npos) return std::nullopt;
    const uint64_t lo = std::stoull(head.substr(at + prefix.size()));
    const uint64_t hi = std::stoull(head.substr(head.find('-', at) + 1));
    const std::string bytes = object.substr(lo, hi - lo + 1);
    const std::string reply =
        "HTTP/1.1 206 Partial Content\r\nContent-Length: " + std::to_string(bytes.size()) +
        "\r\nContent-Range: bytes " + std::to_string(lo) + "-" + std::to_string(hi) + "/" +
        std::to_string(object.size()) + "\r\nConnection: close\r\n\r\n";
    if (lo > 0 && ++range_gets == 1) return reply + bytes.substr(0, bytes.size() / 3);  // cut off
    return reply + bytes;
  });
  auto b = NewBackend(LocalOptions(server));
  ASSERT_TRUE(b);
  auto r = b->OpenObject("a.bin");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ((*r)->Size(), object.size());
  std::string got(10000, '\0');
  auto hash = (*r)->ReadAndHash(5000, got.data(), got.size());
  ASSERT_TRUE(hash.ok()) << hash.status();
  EXPECT_EQ(range_gets.load(), 2) << "cut off once, then whole";
  EXPECT_EQ(got, object.substr(5000, 10000));
  EXPECT_EQ(*hash, ckptio::HashBytes(got.data(), got.size()));
  // Inside the bytes fetched when it was opened: no request, the same hash.
  auto first = (*r)->ReadAndHash(10, got.data(), 100);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(range_gets.load(), 2);
  EXPECT_EQ(*first, ckptio::HashBytes(object.data() + 10, 100));
}

std::string Contents(const std::string& xml_key) {
  return "<Contents><Key>" + xml_key +
         "</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
         "<ETag>&quot;0123&quot;</ETag><Size>10</Size><StorageClass>STANDARD</StorageClass>"
         "</Contents>";
}

// A ListObjectsV2 page of `xml_keys` (as they stand in the XML).
std::string ListPage(const std::vector<std::string>& xml_keys, const std::string& next_token) {
  std::string xml =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
      "<Name>hostile</Name><Prefix>run/</Prefix><KeyCount>" +
      std::to_string(xml_keys.size()) + "</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>" +
      (next_token.empty() ? "false" : "true") + "</IsTruncated>";
  if (!next_token.empty())
    xml += "<NextContinuationToken>" + next_token + "</NextContinuationToken>";
  for (const auto& key : xml_keys) xml += Contents(key);
  return xml + "</ListBucketResult>";
}

// A listing is the server's word on which keys exist, and a hostile or
// foreign server's word must not make ckptio touch a key outside its store
// or one that is not a valid key: those are skipped, entities are decoded
// exactly once, and the good keys come back relative to the prefix, sorted,
// filtered by the List prefix (this server ignores the request's).
TEST(S3AgainstAHostileServer, AListingKeepsOnlyValidKeysInsideThePrefix) {
  const std::vector<std::string> xml_keys = {
      // Good, out of order: the server's order is not trusted either.
      "run/step-000000000001/model.safetensors",
      "run/LATEST",
      "run/step-000000000001/MANIFEST.json",
      // Outside the prefix.
      "other/x",
      "runx/y",
      "RUN/LATEST",
      "run",
      "run/",
      "/run/LATEST",
      // Traversal and empty components.
      "run/../etc/passwd",
      "run/a//b",
      "run/./a",
      "run/a/..",
      "run/step-000000000001/../../x",
      "run//LATEST",
      // Characters no key has.
      "run/a b",
      "run/caf\xc3\xa9",
      "run/a\\b",
      "run/a:b",
      "run/new&#10;line",
      "run/amp&amp;ersand",  // run/amp&ersand
      // run/a&#46;b: only a second decoding would make it "run/a.b".
      "run/a&amp;#46;b",
      // One key, "run/x</Key><Key>run/injected": decoding before parsing
      // would make two good-looking ones.
      "run/x&lt;/Key&gt;&lt;Key&gt;run/injected",
      "",
      "run/" + std::string(201, 'c'),
  };
  const std::string page = ListPage(xml_keys, "");
  LocalServer lying([&](const std::string&) { return HttpOk(page); });
  auto b = NewBackend(LocalOptions(lying));
  ASSERT_TRUE(b);
  const std::vector<std::string> good = {"LATEST", "step-000000000001/MANIFEST.json",
                                         "step-000000000001/model.safetensors"};
  Timed t = Bounded(lying, [&] {
    auto all = b->List("");
    if (!all.ok()) return all.status();
    EXPECT_EQ(*all, good);
    auto step = b->List("step-000000000001/");
    if (!step.ok()) return step.status();
    EXPECT_EQ(*step, (std::vector<std::string>{"step-000000000001/MANIFEST.json",
                                               "step-000000000001/model.safetensors"}));
    auto latest = b->List("LATEST");
    if (!latest.ok()) return latest.status();
    EXPECT_EQ(*latest, std::vector<std::string>{"LATEST"});
    auto none = b->List("run/");
    if (!none.ok()) return none.status();
    EXPECT_TRUE(none->empty()) << "run/ is the store's prefix, not a folder in it";
    return OkStatus();
  });
  EXPECT_TRUE(IsOk(t.status));
  EXPECT_GE(lying.requests(), 4);
}

// A server that pages forever (IsTruncated, a new token each time, never a
// key too many) cannot hold List open past the timeout.
TEST(S3AgainstAHostileServer, AListingThatNeverEndsEndsWithinTheTimeout) {
  std::atomic<int> pages{0};
  LocalServer endless([&](const std::string&) {
    // Slow enough that running to a page or key limit takes far longer
    // than the timeout: only a deadline on the whole call ends it in time.
    std::this_thread::sleep_for(milliseconds(50));
    const int n = ++pages;
    return HttpOk(ListPage({"run/k" + std::to_string(n)}, "token-" + std::to_string(n)));
  });
  auto b = NewBackend(LocalOptions(endless));
  ASSERT_TRUE(b);
  Timed t = Bounded(endless, [&] { return b->List("").status(); });
  std::cout << "s3: an endless listing ended after " << pages.load() << " pages, " << t.took.count()
            << " ms: " << t.status << "\n";
  EXPECT_FALSE(t.status.ok()) << "an endless listing cannot be complete";
  EXPECT_LT(t.took.count(), 4000) << "timeout_ms 2000";
}

// A page of ListMultipartUploads: (key, upload id) pairs, and the markers
// of the next page when there is one.
std::string UploadsPage(const std::vector<std::pair<std::string, std::string>>& uploads,
                        const std::string& next_key = "", const std::string& next_id = "") {
  std::string xml =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListMultipartUploadsResult><Bucket>hostile"
      "</Bucket><IsTruncated>" +
      std::string(next_key.empty() ? "false" : "true") + "</IsTruncated>";
  if (!next_key.empty())
    xml += "<NextKeyMarker>" + next_key + "</NextKeyMarker><NextUploadIdMarker>" + next_id +
           "</NextUploadIdMarker>";
  for (const auto& [key, id] : uploads)
    xml += "<Upload><Key>" + key + "</Key><UploadId>" + id + "</UploadId></Upload>";
  return xml + "</ListMultipartUploadsResult>";
}

// Unfinished uploads are listed page by page (key and upload-id markers),
// and only the store's own are aborted: not another program's under the
// prefix, nor keys outside it.
TEST(S3AgainstAScriptedServer, UnfinishedUploadsArePagedAndOnlyTheStoresOwnAborted) {
  std::mutex mu;
  std::vector<std::string> aborted;
  LocalServer server([&](const std::string& request) -> std::optional<std::string> {
    const std::string line = request.substr(0, request.find('\r'));
    if (line.rfind("DELETE ", 0) == 0) {
      std::lock_guard<std::mutex> g(mu);
      aborted.push_back(line.substr(0, line.find(" HTTP/")));
      return "HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    }
    if (line.rfind("GET ", 0) != 0 || !Contains(line, "uploads=")) return std::nullopt;
    if (!Contains(line, "key-marker="))
      return HttpOk(UploadsPage({{"run/step-000000000001/w1-aa/model.safetensors", "u1"},
                                 {"run/notes/draft.txt", "u2"},
                                 {"elsewhere/step-000000000001/x", "u3"}},
                                "run/step-000000000001/w1-aa/model.safetensors", "u1"));
    if (Contains(line, "key-marker=run%2Fstep-000000000001%2Fw1-aa%2Fmodel.safetensors") &&
        Contains(line, "upload-id-marker=u1"))
      return HttpOk(UploadsPage({{"run/step-000000000002/model.safetensors", "u4"}}));
    return std::nullopt;
  });
  auto b = NewBackend(LocalOptions(server));
  ASSERT_TRUE(b);
  auto n = b->AbortUnfinishedWrites();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 2u);
  std::lock_guard<std::mutex> g(mu);
  ASSERT_EQ(aborted.size(), 2u);
  EXPECT_TRUE(Contains(aborted[0], "/run/step-000000000001/w1-aa/model.safetensors?uploadId=u1"))
      << aborted[0];
  EXPECT_TRUE(Contains(aborted[1], "/run/step-000000000002/model.safetensors?uploadId=u4"))
      << aborted[1];
}

// A listing of uploads that says "truncated" and names the markers it was
// asked for would page in a circle: Unavailable, not a loop.
TEST(S3AgainstAHostileServer, AnUploadsListingThatRepeatsItsMarkersIsUnavailable) {
  std::atomic<int> pages{0};
  LocalServer circle([&](const std::string& request) -> std::optional<std::string> {
    if (request.rfind("GET ", 0) != 0) return std::nullopt;
    ++pages;
    return HttpOk(UploadsPage({}, "run/step-000000000001/a", "u1"));
  });
  auto b = NewBackend(LocalOptions(circle));
  ASSERT_TRUE(b);
  auto n = b->AbortUnfinishedWrites();
  EXPECT_TRUE(StatusIs(n.status(), Code::kUnavailable)) << n.status();
  EXPECT_TRUE(Contains(n.status().message(), "without a new continuation marker")) << n.status();
  EXPECT_EQ(pages.load(), 2) << "the first page, then the second naming the same markers";
}

// Credentials that may write but not list multipart uploads (403 on the
// listing): nothing is aborted, with a warning naming the refusal, and the
// call succeeds (an upload left behind costs space, not safety).
TEST(S3AgainstAScriptedServer, UploadsThatMayNotBeListedAreSkippedWithAWarning) {
  LocalServer refusing([&](const std::string& request) -> std::optional<std::string> {
    if (request.rfind("GET ", 0) != 0 || !Contains(request, "uploads=")) return std::nullopt;
    const std::string body =
        "<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>";
    return "HTTP/1.1 403 Forbidden\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nConnection: close\r\n\r\n" + body;
  });
  CapturedWarnings captured;
  auto b = NewBackend(LocalOptions(refusing));
  ASSERT_TRUE(b);
  auto n = b->AbortUnfinishedWrites();
  const auto warnings = captured.lines();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 0u);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(Contains(warnings[0], "AccessDenied")) << warnings[0];
  EXPECT_TRUE(Contains(warnings[0], "unfinished uploads")) << warnings[0];
}

// A lease that cannot be renewed for a whole lease (the server answers
// nothing after the lock was taken) is given up: a warning says the next
// commit will be refused, and releasing it later sends no DELETE (the
// lease may be another writer's by then).
TEST(S3AgainstAHungServer, ALeaseNotRenewedForAWholeLeaseIsGivenUp) {
  std::atomic<int> creates{0}, deletes{0};
  LocalServer server([&](const std::string& request) -> std::optional<std::string> {
    if (request.rfind("DELETE ", 0) == 0) ++deletes;
    if (request.rfind("PUT ", 0) == 0 && Contains(request, "If-None-Match: *") && ++creates == 1)
      return "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nDate: " + HttpDate() +
             "\r\nConnection: close\r\n\r\n";
    return std::nullopt;  // hangs: every renewal ends by its deadline
  });
  CapturedWarnings captured;
  S3Options o = LocalOptions(server);
  o.lease = milliseconds(1000);
  auto b = NewBackend(o);
  ASSERT_TRUE(b);
  const auto taken = std::chrono::steady_clock::now();
  auto lock = b->TryLock(kLockKey);
  ASSERT_TRUE(lock.ok()) << lock.status();
  std::string lost;
  while (lost.empty() && std::chrono::steady_clock::now() - taken < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(milliseconds(50));
    for (const auto& w : captured.lines())
      if (Contains(w, "was lost")) lost = w;
  }
  const auto after =
      std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - taken);
  ASSERT_FALSE(lost.empty()) << "a lease not renewed for 10 s was never given up";
  std::cout << "s3: a lease of 1000 ms that could not be renewed was given up after "
            << after.count() << " ms\n";
  EXPECT_GE(after.count(), 1000) << "given up before a whole lease went by";
  EXPECT_TRUE(Contains(lost, "refused by the fence")) << lost;
  lock->reset();
  EXPECT_EQ(deletes.load(), 0) << "a lease given up is not deleted: it may be another's";
}

// ---------------------------------------------------------------------------
// radosgw killed or stopped under a backend: a private server per test, as
// other processes use the shared one.

class S3Faults : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!RgwServer::Installed()) GTEST_SKIP() << RgwServer::NotInstalledMessage();
    server_ = std::make_unique<RgwServer>();
    ASSERT_TRUE(server_->ok()) << server_->error();
    options_ = server_->Options("faults-" + NewJobId());
    options_.timeout = milliseconds(3000);
    backend_ = NewBackend(options_);
    ASSERT_TRUE(backend_);
  }

  std::unique_ptr<RgwServer> server_;
  S3Options options_;
  std::unique_ptr<StorageBackend> backend_;
};

// With radosgw gone, calls fail fast as Unavailable (refused connections,
// retried within the timeout); once it is back, the same backend works
// again (its pooled connections to the dead server are not reused) and the
// data is intact.
TEST_F(S3Faults, AKilledGatewayIsUnavailableAndTheSameBackendWorksAfterItsRestart) {
  const std::string bytes = RandomBytes(100000, 1);
  ASSERT_TRUE(IsOk(Put(*backend_, "a.bin", bytes)));
  ASSERT_TRUE(server_->KillRgw()) << server_->error();

  auto start = Clock::now();
  auto listed = backend_->List("");
  EXPECT_TRUE(StatusIs(listed.status(), Code::kUnavailable));
  EXPECT_LT(Since(start).count(), options_.timeout.count() + 1000) << "List";
  start = Clock::now();
  EXPECT_TRUE(StatusIs(Put(*backend_, "b.bin", "b"), Code::kUnavailable));
  EXPECT_LT(Since(start).count(), options_.timeout.count() + 1000) << "Put";

  ASSERT_TRUE(server_->RestartRgw()) << server_->error();
  listed = backend_->List("");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(*listed, std::vector<std::string>{"a.bin"});
  auto got = Get(*backend_, "a.bin");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(SameBytes(*got, bytes));
  EXPECT_TRUE(IsOk(Put(*backend_, "b.bin", "b")));
}

// radosgw SIGKILLed in the middle of a save, with a multipart upload under
// way: the save fails (Unavailable), nothing of it is visible, the previous
// step still loads, and the next writer (once the dead one's lease ran out)
// aborts the upload left behind.
TEST_F(S3Faults, AGatewayKilledMidSaveLeavesThePreviousStepAndTheUploadIsAbortedLater) {
  options_.part_bytes = uint64_t{5} << 20;
  options_.lease = milliseconds(3000);
  auto shared = std::shared_ptr<StorageBackend>(NewBackend(options_));
  ASSERT_TRUE(shared);
  WriterOptions wo;
  wo.lock_wait = milliseconds(15000);
  {
    Store store(shared);
    auto w = store.OpenWriter(wo);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(IsOk(SaveStep(**w, 1)));
    auto p = (*w)->Begin(2);
    ASSERT_TRUE(p.ok()) << p.status();
    auto stream = (*p)->AddObject("model.safetensors");
    ASSERT_TRUE(stream.ok()) << stream.status();
    const std::string part = RandomBytes(size_t{6} << 20, 2);
    ASSERT_TRUE(IsOk((*stream)->Write(part.data(), part.size())));  // the upload has begun
    ASSERT_TRUE(server_->KillRgw()) << server_->error();
    Status wrote = (*stream)->Write(part.data(), part.size());
    if (wrote.ok()) wrote = (*stream)->Close();
    EXPECT_TRUE(StatusIs(wrote, Code::kUnavailable));
    auto committed = (*p)->Commit();
    EXPECT_FALSE(committed.ok()) << "a save committed with its server dead";
  }  // the writer is gone; its lease could not be released
  ASSERT_TRUE(server_->RestartRgw()) << server_->error();

  Store store(NewBackend(options_));
  auto latest = store.ReadLatest();
  ASSERT_TRUE(latest.ok()) << latest.status();
  ASSERT_TRUE(latest->has_value());
  EXPECT_EQ((*latest)->step, 1);
  EXPECT_EQ(store.OpenStep(2).status().code(), Code::kNotFound);
  ExpectStepVerifies(store, 1);

  auto w = store.OpenWriter(wo);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_GE((*w)->stale_temps_removed(), 1u) << "the dead save's upload was not aborted";
  auto left = store.backend().AbortUnfinishedWrites();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u) << "uploads are left after the writer took the store";
  EXPECT_TRUE(IsOk(SaveStep(**w, 2)));
  ExpectStepVerifies(store, 2);
  if (!HasFailure())
    std::cout << "s3: radosgw SIGKILLed in the middle of a multipart save: the save failed "
                 "UNAVAILABLE, step 1 stayed LATEST and verified, the next writer aborted "
              << (*w)->stale_temps_removed() << " leftover upload(s) and saved step 2\n";
}

// A stopped radosgw (SIGSTOP) holds connections and answers nothing: calls
// end within the timeout, and work again once it continues.
TEST_F(S3Faults, AStoppedGatewayIsUnavailableWithinTheTimeout) {
  ASSERT_TRUE(IsOk(Put(*backend_, "a.bin", "a")));
  ASSERT_TRUE(server_->PauseRgw()) << server_->error();
  auto start = Clock::now();
  auto info = backend_->Stat("a.bin");
  const auto took = Since(start);
  ASSERT_TRUE(server_->ResumeRgw()) << server_->error();
  EXPECT_TRUE(StatusIs(info.status(), Code::kUnavailable));
  EXPECT_LT(took.count(), options_.timeout.count() + 1000);
  info = backend_->Stat("a.bin");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->size, 1u);
}

}  // namespace
}  // namespace ckptio
