// The commit protocol through the public Store API on the POSIX backend.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "ckptio/ckptio.h"
#include "ckptio/posix_backend.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::Gate;
using testing::RandomBytes;
using testing::TempDir;

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = OpenStore(dir_.Sub("store"));
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
  }

  std::unique_ptr<StoreWriter> Writer(WriterOptions o = {}) {
    auto w = store_->OpenWriter(o);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }

  // Commits `objects` (name -> bytes) as `step`.
  Result<CommitInfo> Save(StoreWriter& w, int64_t step,
                          const std::map<std::string, std::string>& objects) {
    CKPTIO_ASSIGN_OR_RETURN(auto p, w.Begin(step));
    for (const auto& [name, bytes] : objects)
      CKPTIO_RETURN_IF_ERROR(p->PutObject(name, bytes.data(), bytes.size()));
    return p->Commit();
  }

  TempDir dir_;
  std::unique_ptr<Store> store_;
};

TEST_F(StoreTest, SaveThenLoadRoundTripsEveryByte) {
  auto w = Writer();
  const std::string big = RandomBytes((9 << 20) + 123, 1);  // 3 chunks at 4 MiB
  auto info = Save(*w, 5, {{"model.bin", big}, {"empty.bin", ""}, {"tiny", "x"}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->latest_updated);
  EXPECT_EQ(info->bytes, big.size() + 1);

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenLatest());
  EXPECT_EQ(r->step(), 5);
  EXPECT_EQ(r->manifest_hash(), info->manifest_hash);
  ASSERT_EQ(r->manifest().objects.size(), 3u);
  EXPECT_EQ(r->manifest().Find("model.bin")->chunks.size(), 3u);
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string back, r->ReadAll("model.bin"));
  EXPECT_TRUE(back == big);
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string empty, r->ReadAll("empty.bin"));
  EXPECT_EQ(empty, "");
  CKPTIO_EXPECT_OK(r->Verify());

  // Ranges that straddle chunk boundaries come back exactly.
  for (uint64_t off : {uint64_t{0}, uint64_t{4194303}, uint64_t{4194304}, uint64_t{9437000}}) {
    size_t len = static_cast<size_t>(std::min<uint64_t>(5000, big.size() - off));
    std::string buf(len, '\0');
    CKPTIO_ASSERT_OK(r->Read("model.bin", off, buf.data(), len));
    EXPECT_EQ(buf, big.substr(off, len)) << off;
  }
  std::string buf(10, '\0');
  EXPECT_EQ(r->Read("model.bin", big.size() - 5, buf.data(), 10).code(), Code::kInvalidArgument);
  // CheckRange gives Read's answer about the range without reading.
  CKPTIO_EXPECT_OK(r->CheckRange("model.bin", big.size() - 5, 5));
  CKPTIO_EXPECT_OK(r->CheckRange("empty.bin", 0, 0));
  EXPECT_EQ(r->CheckRange("model.bin", big.size() - 5, 6).code(), Code::kInvalidArgument);
  EXPECT_EQ(r->CheckRange("model.bin", UINT64_MAX, 1).code(), Code::kInvalidArgument);
  EXPECT_EQ(r->CheckRange("model.bin", 1, UINT64_MAX).code(), Code::kInvalidArgument)
      << "offset + size must not wrap around";
  EXPECT_EQ(r->CheckRange("nope", 0, 0).code(), Code::kNotFound);
  auto missing = r->ReadAll("nope");
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("model.bin"), std::string::npos)
      << "the error lists the objects that exist";
}

TEST_F(StoreTest, ManifestRecordsWhatWasSaved) {
  WriterOptions o;
  o.world_size = 4;
  o.saving_rank = 0;
  o.chunk_size = 64 << 10;
  auto w = Writer(o);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(12));
  CKPTIO_ASSERT_OK(p->SetMetadata("epoch", "3"));
  CKPTIO_ASSERT_OK(p->SetMetadata("note", "caf\xc3\xa9"));
  EXPECT_EQ(p->SetMetadata("bad", "\xff\xfe").code(), Code::kInvalidArgument);
  std::string bytes = RandomBytes(200000, 2);
  CKPTIO_ASSERT_OK(p->PutObject("w", bytes.data(), bytes.size()));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto info, p->Commit());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(12));
  const Manifest& m = r->manifest();
  EXPECT_EQ(m.step, 12);
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.generation, w->generation());
  EXPECT_EQ(m.metadata.at("epoch"), "3");
  EXPECT_EQ(m.metadata.at("note"), "caf\xc3\xa9");
  const ObjectEntry* e = m.Find("w");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->chunk_size, 64u << 10);
  EXPECT_EQ(e->chunks.size(), 4u);
  EXPECT_EQ(e->hash, HashBytes(bytes));
  EXPECT_EQ(e->chunks[1], HashBytes(bytes.data() + (64 << 10), 64 << 10));
  EXPECT_GT(m.created_unix_ms, 0);
}

TEST_F(StoreTest, CommittedStepsAreImmutable) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", "one"}}).ok());
  auto again = w->Begin(1);
  ASSERT_EQ(again.status().code(), Code::kAlreadyExists);
  EXPECT_NE(again.status().message().find("immutable"), std::string::npos);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
  EXPECT_EQ(*r->ReadAll("a"), "one");
}

TEST_F(StoreTest, NothingIsVisibleBeforeCommit) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", "old"}}).ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(2));
  CKPTIO_ASSERT_OK(p->PutObject("a", "new", 3));
  // Objects are durable, but the step is not committed until the manifest.
  EXPECT_EQ(store_->OpenStep(2).status().code(), Code::kNotFound);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest, store_->ReadLatest());
  EXPECT_EQ(latest->step, 1);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListSteps());
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[1].state, StepState::kTorn);
  CKPTIO_ASSERT_OK(p->Commit().status());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenLatest());
  EXPECT_EQ(r->step(), 2);
}

TEST_F(StoreTest, AbandonedCheckpointLeavesNothingAndPreviousSurvives) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", "keep"}}).ok());
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(2));
    CKPTIO_ASSERT_OK(p->PutObject("a", "partial", 7));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto stream, p->AddObject("b"));
    CKPTIO_ASSERT_OK(stream->Write("xx", 2));
    // Neither closed nor committed: both go away with p.
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListSteps());
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].step, 1);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto keys, store_->backend().List(""));
  for (const auto& k : keys) EXPECT_EQ(k.find(kTempMarker), std::string::npos) << k;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenLatest());
  EXPECT_EQ(*r->ReadAll("a"), "keep");
}

// What a load tries: steps with a manifest, damaged or not (OpenStep judges),
// never a torn one; nothing else in the folder.
TEST_F(StoreTest, ListStepsWithManifestNamesCandidatesWithoutReadingThem) {
  EXPECT_EQ(store_->ListStepsWithManifest().status().code(), Code::kNotFound);
  auto w = Writer();
  for (int64_t step : {3, 1, 7}) ASSERT_TRUE(Save(*w, step, {{"a", "x"}}).ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto torn, w->Begin(9));
  CKPTIO_ASSERT_OK(torn->PutObject("a", "y", 1));
  testing::WriteFile(dir_.Sub("store/step-000000000003/MANIFEST.json"), "{torn");
  testing::WriteFile(dir_.Sub("store/notes.txt"), "not a step");
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListStepsWithManifest());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 3, 7}));
  EXPECT_EQ(store_->OpenStep(3).status().code(), Code::kDataLoss);
}

// ListSteps remembers what it parsed (and the writer what it committed) by
// the hash of the manifest's bytes: a manifest damaged afterwards is
// reported corrupt the next time, never remembered as committed.
TEST_F(StoreTest, ListStepsSeesManifestsDamagedAfterTheyWereListedOrCommitted) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", "x"}}).ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto before, store_->ListSteps());
  ASSERT_EQ(before.size(), 1u);
  EXPECT_EQ(before[0].state, StepState::kCommitted);
  ASSERT_TRUE(Save(*w, 2, {{"a", "yy"}}).ok());
  for (int64_t step : {1, 2}) {
    const std::string path = dir_.Sub("store/" + StepDirName(step) + "/MANIFEST.json");
    testing::FlipBit(path, testing::ReadFile(path).size() / 2, 1);
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto after, store_->ListSteps());
  ASSERT_EQ(after.size(), 2u);
  for (const StepEntry& e : after) {
    EXPECT_EQ(e.state, StepState::kCorrupt) << "step " << e.step;
    EXPECT_NE(e.problem.find("MANIFEST.json"), std::string::npos) << e.problem;
  }
  // Another store object over the same folder agrees.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, OpenStore(dir_.Sub("store")));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto again, other->ListSteps());
  for (const StepEntry& e : again) EXPECT_EQ(e.state, StepState::kCorrupt) << "step " << e.step;
}

// Forwards to a backend, but its objects cannot be mapped (views take the
// buffer path, as from NFS or S3), and reads of the object `unreadable`, if
// named, fail with UNAVAILABLE (a server that stopped answering).
class NoMapBackend : public testing::ForwardingBackend {
 public:
  explicit NoMapBackend(std::shared_ptr<StorageBackend> inner, std::string unreadable = "")
      : ForwardingBackend(std::move(inner)), unreadable_(std::move(unreadable)) {}
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    struct Reader : ObjectReader {
      std::unique_ptr<ObjectReader> inner;
      bool fails = false;
      uint64_t Size() const override { return inner->Size(); }
      Status ReadAt(uint64_t offset, void* buf, size_t size) override {
        if (fails) return Status(Code::kUnavailable, "the server did not answer");
        return inner->ReadAt(offset, buf, size);
      }
    };
    CKPTIO_ASSIGN_OR_RETURN(auto inner, ForwardingBackend::OpenObject(key));
    auto r = std::make_unique<Reader>();
    r->inner = std::move(inner);
    r->fails = !unreadable_.empty() && key == unreadable_;
    return std::unique_ptr<ObjectReader>(std::move(r));
  }

 private:
  std::string unreadable_;
};

// This process's resident memory (`field` "VmRSS" or "VmHWM", the peak), bytes.
uint64_t ResidentBytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) << 10;
  ADD_FAILURE() << "no " << field << " in /proc/self/status";
  return 0;
}

// How much a call adds to the process's peak resident memory.
template <typename F>
uint64_t PeakGrowth(F&& f) {
  std::ofstream("/proc/self/clear_refs") << "5";  // the peak, from here
  const uint64_t before = ResidentBytes("VmRSS");
  f();
  const uint64_t peak = ResidentBytes("VmHWM");
  return peak > before ? peak - before : 0;
}

TEST_F(StoreTest, ChoosingAStepSkipsDamagedOnesAndKeepsNoneOfItsBytes) {
  EXPECT_FALSE(*store_->ChooseStep(std::nullopt)) << "nothing saved: a fresh start";
  auto w = Writer();
  constexpr size_t kObject = 64 << 20;  // 16 chunks
  ASSERT_TRUE(Save(*w, 1, {{"a", RandomBytes(kObject, 1)}, {"b", RandomBytes(1000, 2)}}).ok());
  ASSERT_TRUE(Save(*w, 2, {{"a", RandomBytes(kObject, 3)}}).ok());
  ASSERT_TRUE(Save(*w, 3, {{"a", "x"}}).ok());
  testing::FlipBit(dir_.Sub("store/" + StepDirName(2) + "/a"), kObject - 1, 3);
  const std::string manifest3 = dir_.Sub("store/" + StepDirName(3) + "/MANIFEST.json");
  testing::FlipBit(manifest3, testing::ReadFile(manifest3).size() / 2, 1);
  w.reset();

  // Every byte is read (through ReadAt: nothing mapped, as from NFS or S3),
  // one chunk at a time.
  Store store(std::make_shared<NoMapBackend>(*NewPosixBackend(dir_.Sub("store"))));
  Result<std::optional<StepChoice>> choice = std::optional<StepChoice>();
  const uint64_t peak = PeakGrowth([&] { choice = store.ChooseStep(std::nullopt); });
  ASSERT_TRUE(choice.ok()) << choice.status();
  ASSERT_TRUE(choice->has_value());
  EXPECT_EQ((*choice)->step, 1);
  ASSERT_EQ((*choice)->skipped.size(), 2u);
  EXPECT_EQ((*choice)->skipped[0].first, 3);
  EXPECT_NE((*choice)->skipped[0].second.find("MANIFEST.json"), std::string::npos);
  EXPECT_EQ((*choice)->skipped[1].first, 2);
  EXPECT_NE((*choice)->skipped[1].second.find("chunk"), std::string::npos)
      << (*choice)->skipped[1].second;
  // (A chunk, 4 MiB, and what ASan or TSan keep beside it: 21 MB under TSan.)
  EXPECT_LT(peak, kObject / 2) << "choosing held an object's bytes";
  // The measure sees an object held: a check that keeps what it viewed.
  std::vector<std::shared_ptr<ObjectView>> kept;
  const uint64_t viewed = PeakGrowth([&] {
    choice = store.ChooseStep(std::nullopt, [&](std::unique_ptr<CheckpointReader> r) {
      for (const auto& o : r->manifest().objects) {
        CKPTIO_ASSIGN_OR_RETURN(auto view, r->View(o.name));
        kept.push_back(std::move(view));
      }
      return OkStatus();
    });
  });
  ASSERT_TRUE(choice.ok() && choice->has_value()) << choice.status();
  EXPECT_EQ((*choice)->step, 1);
  EXPECT_GE(viewed, kObject);

  // A step asked for by number is that step or its error; when no step
  // verifies, the newest problem is named.
  EXPECT_EQ(store.ChooseStep(2).status().code(), Code::kDataLoss);
  EXPECT_EQ((*store.ChooseStep(1))->step, 1);
  testing::FlipBit(dir_.Sub("store/" + StepDirName(1) + "/b"), 0, 0);
  auto none = store.ChooseStep(std::nullopt);
  EXPECT_EQ(none.status().code(), Code::kDataLoss);
  EXPECT_NE(none.status().message().find("no checkpoint in"), std::string::npos) << none.status();
  EXPECT_NE(none.status().message().find("MANIFEST.json"), std::string::npos) << none.status();
}

TEST_F(StoreTest, ChoosingAStepStopsAtAnErrorThatIsNotDamage) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", "one"}}).ok());
  ASSERT_TRUE(Save(*w, 2, {{"a", "two"}}).ok());
  w.reset();
  // Step 2 cannot be read now; it is not known to be damaged, so step 1 is
  // not loaded in its place (a resume from an older step loses work).
  Store store(
      std::make_shared<NoMapBackend>(*NewPosixBackend(dir_.Sub("store")), StepDirName(2) + "/a"));
  auto choice = store.ChooseStep(std::nullopt);
  EXPECT_EQ(choice.status().code(), Code::kUnavailable) << choice.status();
  EXPECT_NE(choice.status().message().find("did not answer"), std::string::npos) << choice.status();
  // The same for an error of the caller's check.
  int checked = 0;
  choice = store_->ChooseStep(std::nullopt, [&](std::unique_ptr<CheckpointReader>) {
    ++checked;
    return Status(Code::kResourceExhausted, "no memory for the views");
  });
  EXPECT_EQ(choice.status().code(), Code::kResourceExhausted) << choice.status();
  EXPECT_EQ(checked, 1) << "only the newest step was checked";
  // Damage, by contrast, is skipped.
  choice = store_->ChooseStep(std::nullopt, [&](std::unique_ptr<CheckpointReader> r) {
    return r->step() == 2 ? Status(Code::kDataLoss, "torn") : OkStatus();
  });
  ASSERT_TRUE(choice.ok() && choice->has_value()) << choice.status();
  EXPECT_EQ((*choice)->step, 1);
}

TEST_F(StoreTest, CommitRefusesOpenOrFailedStreams) {
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(3));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto s, p->AddObject("a"));
  auto c = p->Commit();
  EXPECT_EQ(c.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("still open"), std::string::npos);
  EXPECT_EQ(p->AddObject("a").status().code(), Code::kInvalidArgument) << "duplicate name";
  EXPECT_EQ(p->AddObject("../x").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(p->AddObject("MANIFEST.json").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(w->Begin(4).status().code(), Code::kFailedPrecondition) << "one pending at a time";
}

TEST_F(StoreTest, LatestNamesTheHighestCommittedStep) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 10, {{"a", "10"}}).ok());
  auto lower = Save(*w, 5, {{"a", "5"}});
  ASSERT_TRUE(lower.ok()) << lower.status();
  EXPECT_FALSE(lower->latest_updated);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenLatest());
  EXPECT_EQ(r->step(), 10);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r5, store_->OpenStep(5));
  EXPECT_EQ(*r5->ReadAll("a"), "5");
}

TEST_F(StoreTest, TornLeftoversOfAStepAreClearedByTheNextBegin) {
  auto w = Writer();
  // A crashed attempt at step 7 left an object but no manifest.
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(
        auto obj, store_->backend().NewObject("step-000000000007/a", WriteMode::kReplace));
    CKPTIO_ASSERT_OK(obj->Append("stale", 5));
    CKPTIO_ASSERT_OK(obj->Commit());
  }
  auto info = Save(*w, 7, {{"a", "fresh"}});
  ASSERT_TRUE(info.ok()) << info.status();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(7));
  EXPECT_EQ(*r->ReadAll("a"), "fresh");
}

TEST_F(StoreTest, GenerationsIncreaseAndStaleTempsAreRemovedAtOpen) {
  int64_t first;
  {
    auto w = Writer();
    first = w->generation();
    ASSERT_TRUE(Save(*w, 1, {{"a", "x"}}).ok());
  }
  // A dead writer's temp file.
  ASSERT_EQ(::mkdir(dir_.Sub("store/step-000000000002").c_str(), 0755), 0);
  testing::WriteFile(dir_.Sub("store/step-000000000002/.ckptio-tmp.a.host.1.0.dead"), "junk");
  auto w = Writer();
  EXPECT_EQ(w->generation(), first + 1);
  EXPECT_EQ(w->stale_temps_removed(), 1u);
  EXPECT_NE(::access(dir_.Sub("store/step-000000000002").c_str(), F_OK), 0);
}

TEST_F(StoreTest, AFencedWriterCannotCommit) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", "x"}}).ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(2));
  CKPTIO_ASSERT_OK(p->PutObject("a", "y", 1));
  // Another writer claims the store (its lock was lost to us somehow).
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, NewPosixBackend(dir_.Sub("store")));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto rec, other->NewObject(kWriterKey, WriteMode::kReplace));
  std::string bytes = SerializeWriterRecord({w->generation() + 1, "elsewhere", 99, 0});
  CKPTIO_ASSERT_OK(rec->Append(bytes.data(), bytes.size()));
  CKPTIO_ASSERT_OK(rec->Commit());
  auto c = p->Commit();
  EXPECT_EQ(c.status().code(), Code::kAborted);
  EXPECT_NE(c.status().message().find("fenced"), std::string::npos) << c.status();
  EXPECT_EQ(store_->OpenStep(2).status().code(), Code::kNotFound);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest, store_->ReadLatest());
  EXPECT_EQ(latest->step, 1);
}

TEST_F(StoreTest, BadOptionsAndStepsAreRejected) {
  WriterOptions o;
  o.chunk_size = 100;
  EXPECT_EQ(store_->OpenWriter(o).status().code(), Code::kInvalidArgument);
  o = {};
  o.saving_rank = 2;
  o.world_size = 2;
  EXPECT_EQ(store_->OpenWriter(o).status().code(), Code::kInvalidArgument);
  auto w = Writer();
  EXPECT_EQ(w->Begin(-1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(w->Begin(kMaxStep + 1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(store_->OpenStep(-3).status().code(), Code::kInvalidArgument);
}

TEST_F(StoreTest, EmptyAndMissingStores) {
  EXPECT_EQ(store_->ListSteps().status().code(), Code::kNotFound) << "store dir absent";
  EXPECT_EQ(store_->OpenLatest().status().code(), Code::kNotFound);
  auto unknown = OpenStore("gs://bucket/x");
  EXPECT_EQ(unknown.status().code(), Code::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("file://"), std::string::npos);
}

TEST_F(StoreTest, ReadOfATruncatedObjectIsDataLossAndZeroesTheBuffer) {
  auto w = Writer();
  std::string bytes = RandomBytes(100000, 3);
  ASSERT_TRUE(Save(*w, 1, {{"a", bytes}}).ok());
  ASSERT_EQ(::truncate(dir_.Sub("store/step-000000000001/a").c_str(), 50000), 0);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
  std::string buf(100, 'z');
  Status s = r->Read("a", 0, buf.data(), buf.size());
  EXPECT_EQ(s.code(), Code::kDataLoss);
  EXPECT_NE(s.message().find("step 1"), std::string::npos) << s;
  EXPECT_EQ(buf, std::string(100, '\0'));
}

// Forwards to a backend, but a manifest's commit fails: after it took
// effect (its reply lost on the network, say), or before.
class FailingManifestCommit : public testing::ForwardingBackend {
 public:
  FailingManifestCommit(std::shared_ptr<StorageBackend> inner, bool takes_effect)
      : ForwardingBackend(std::move(inner)), takes_effect_(takes_effect) {}
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    struct Writer : ObjectWriter {
      std::unique_ptr<ObjectWriter> inner;
      bool takes_effect;
      Status Append(const void* data, size_t size) override { return inner->Append(data, size); }
      Status Commit() override {
        if (takes_effect) CKPTIO_RETURN_IF_ERROR(inner->Commit());
        return Status(Code::kUnavailable, "the commit failed (test)");
      }
    };
    CKPTIO_ASSIGN_OR_RETURN(auto inner, ForwardingBackend::NewObject(key, mode));
    const std::string_view manifest = "/MANIFEST.json";
    if (key.size() < manifest.size() || key.substr(key.size() - manifest.size()) != manifest)
      return inner;
    auto w = std::make_unique<Writer>();
    w->inner = std::move(inner);
    w->takes_effect = takes_effect_;
    return std::unique_ptr<ObjectWriter>(std::move(w));
  }

 private:
  bool takes_effect_;
};

// A save whose manifest's commit failed may be committed all the same:
// abandoning it deletes nothing once a manifest is there, so the step
// stays whole (a torn one would be left to fsck). Where the manifest did
// not make it, abandoning removes what the save wrote.
TEST_F(StoreTest, AnAbandonedCommitWhoseManifestMadeItDeletesNothing) {
  for (bool takes_effect : {true, false}) {
    SCOPED_TRACE(takes_effect ? "the manifest made it" : "the manifest did not make it");
    const int64_t step = takes_effect ? 1 : 2;
    auto posix = NewPosixBackend(dir_.Sub("store"));
    ASSERT_TRUE(posix.ok()) << posix.status();
    Store store(std::make_shared<FailingManifestCommit>(
        std::shared_ptr<StorageBackend>(std::move(*posix)), takes_effect));
    {
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store.OpenWriter({}));
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(step));
      CKPTIO_ASSERT_OK(p->PutObject("a", "abc", 3));
      EXPECT_EQ(p->Commit().status().code(), Code::kUnavailable);
    }  // abandoned
    if (takes_effect) {
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(step));
      CKPTIO_EXPECT_OK(r->Verify());
    } else {
      CKPTIO_ASSERT_OK_AND_ASSIGN(auto keys, store_->backend().List("step-000000000002/"));
      EXPECT_TRUE(keys.empty()) << keys.front();
    }
  }
}

// View on the POSIX backend (a private memory map) and on one that cannot
// map (a buffer read through ReadAt): the same guarantees.
class ViewTest : public StoreTest, public ::testing::WithParamInterface<bool> {
 protected:
  std::unique_ptr<CheckpointReader> Open(int64_t step) {
    std::unique_ptr<Store> store;
    if (GetParam()) {
      auto posix = NewPosixBackend(dir_.Sub("store"));
      EXPECT_TRUE(posix.ok()) << posix.status();
      store = std::make_unique<Store>(
          std::make_shared<NoMapBackend>(std::shared_ptr<StorageBackend>(std::move(*posix))));
    } else {
      store = std::move(*OpenStore(dir_.Sub("store")));
    }
    auto r = store->OpenStep(step);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }
};

TEST_P(ViewTest, HoldsEveryVerifiedByteAndOutlivesTheReader) {
  auto w = Writer();
  const std::string big = RandomBytes((9 << 20) + 123, 4);  // 3 chunks
  ASSERT_TRUE(Save(*w, 1, {{"big", big}, {"empty", ""}}).ok());
  auto r = Open(1);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto view, r->View("big", 3));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto empty, r->View("empty"));
  r.reset();
  ASSERT_EQ(view->size(), big.size());
  EXPECT_TRUE(std::string_view(view->data(), view->size()) == big);
  EXPECT_EQ(empty->size(), 0u);
}

// Large enough that the buffer path populates its memory on a second thread
// while the reads fill it: every byte must still be the object's, and a
// read that fails half way stops that thread.
TEST_P(ViewTest, ALargeObjectIsHeldWholeAndABadChunkStopsTheRead) {
  auto w = Writer();
  const std::string big = RandomBytes((40 << 20) + 5, 8);  // 11 chunks
  ASSERT_TRUE(Save(*w, 1, {{"big", big}}).ok());
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto view, Open(1)->View("big"));
    ASSERT_EQ(view->size(), big.size());
    EXPECT_TRUE(std::string_view(view->data(), view->size()) == big);
  }
  testing::FlipBit(dir_.Sub("store/step-000000000001/big"), (5 << 20) + 1, 2);  // chunk 1
  auto view = Open(1)->View("big");
  ASSERT_EQ(view.status().code(), Code::kDataLoss);
  EXPECT_NE(view.status().message().find("(chunk 1 of 11)"), std::string::npos) << view.status();
}

TEST_P(ViewTest, ACorruptChunkIsDataLossNamingTheLowestBadChunk) {
  auto w = Writer();
  const std::string big = RandomBytes((13 << 20), 5);  // 4 chunks
  ASSERT_TRUE(Save(*w, 1, {{"big", big}}).ok());
  const std::string path = dir_.Sub("store/step-000000000001/big");
  testing::FlipBit(path, (11 << 20) + 7, 3);  // chunk 2
  testing::FlipBit(path, (13 << 20) - 1, 0);  // chunk 3
  for (unsigned threads : {1u, 2u, 4u}) {
    auto view = Open(1)->View("big", threads);
    ASSERT_EQ(view.status().code(), Code::kDataLoss) << threads << " threads";
    EXPECT_NE(view.status().message().find("bytes [8388608, 12582912) (chunk 2 of 4)"),
              std::string::npos)
        << view.status();
  }
}

TEST_P(ViewTest, WritingToAViewNeverChangesTheObject) {
  auto w = Writer();
  const std::string bytes = RandomBytes(5 << 20, 6);
  ASSERT_TRUE(Save(*w, 1, {{"a", bytes}}).ok());
  auto r = Open(1);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto view, r->View("a"));
  std::memset(view->data(), 0x5a, view->size());
  CKPTIO_EXPECT_OK(r->Verify());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto again, Open(1)->View("a"));
  EXPECT_TRUE(std::string_view(again->data(), again->size()) == bytes);
}

TEST_P(ViewTest, ATruncatedObjectIsDataLoss) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", RandomBytes(100000, 7)}}).ok());
  ASSERT_EQ(::truncate(dir_.Sub("store/step-000000000001/a").c_str(), 50000), 0);
  EXPECT_EQ(Open(1)->View("a").status().code(), Code::kDataLoss);
}

// An object larger than the address space left to the process (RLIMIT_AS,
// set in a child) is ResourceExhausted, saying so, never a crash: the
// buffer path's anonymous memory and the map alike.
TEST_P(ViewTest, AnObjectLargerThanTheMemoryLeftIsResourceExhausted) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer reserves address space that a limit on it would break";
#endif
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"big", RandomBytes(96 << 20, 9)}}).ok());
  auto r = Open(1);
  ASSERT_TRUE(r);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        long pages = 0;
        std::ifstream("/proc/self/statm") >> pages;  // the address space in use
        rlimit limit{};
        limit.rlim_cur = limit.rlim_max =
            static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) +
            (rlim_t{32} << 20);
        ::setrlimit(RLIMIT_AS, &limit);
        auto view = r->View("big");
        const std::string said = view.status().ToString() + "\n";
        (void)!::write(2, said.data(), said.size());
        std::_Exit(view.status().code() == Code::kResourceExhausted ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "RESOURCE_EXHAUSTED.*big");
}

INSTANTIATE_TEST_SUITE_P(MapAndBuffer, ViewTest, ::testing::Bool(), [](const auto& param_info) {
  return param_info.param ? "Buffer" : "Map";
});

TEST_F(StoreTest, AStripedStepCommitsEveryRanksObjects) {
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(7));
  const std::string mine = RandomBytes(5 << 20, 11), theirs = RandomBytes((6 << 20) + 5, 12);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stripe, store_->BeginStripe(7, 1));
  CKPTIO_ASSERT_OK(pending->PutObject("part-0.bin", mine.data(), mine.size()));
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto os, stripe->AddObject("part-1.bin"));
    CKPTIO_ASSERT_OK(os->Write(theirs.data(), theirs.size()));
    CKPTIO_ASSERT_OK(os->Close());
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt receipt, stripe->Finish());
  // The receipt travels as text between ranks.
  CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt back,
                              ParseStripeReceipt(SerializeStripeReceipt(receipt), "receipt"));
  EXPECT_EQ(back.rank, 1);
  EXPECT_EQ(back.step, 7);
  ASSERT_EQ(back.objects.size(), 1u);
  EXPECT_EQ(back.objects[0].hash, HashBytes(theirs));
  stripe.reset();  // finished: its objects now belong to the writer's step
  EXPECT_FALSE(store_->OpenStep(7).ok()) << "visible before the writer's commit";
  CKPTIO_ASSERT_OK(pending->AddStripe(back));
  ASSERT_TRUE(pending->Commit().ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(7));
  ASSERT_EQ(r->manifest().objects.size(), 2u);
  CKPTIO_EXPECT_OK(r->Verify());
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string got, r->ReadAll("part-1.bin"));
  EXPECT_TRUE(got == theirs);
}

TEST_F(StoreTest, AStripeTheWriterCannotFindOrThatClashesIsRefused) {
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(3));
  CKPTIO_ASSERT_OK(pending->PutObject("a.bin", "aaaa", 4));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stripe, store_->BeginStripe(3, 2));
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto os, stripe->AddObject("b.bin"));
    CKPTIO_ASSERT_OK(os->Write("bbbbbbbb", 8));
    CKPTIO_ASSERT_OK(os->Close());
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt receipt, stripe->Finish());

  StripeReceipt wrong_step = receipt;
  wrong_step.step = 4;
  EXPECT_EQ(pending->AddStripe(wrong_step).code(), Code::kInvalidArgument);
  StripeReceipt clash = receipt;
  clash.objects[0].name = "a.bin";
  Status clashed = pending->AddStripe(clash);
  EXPECT_EQ(clashed.code(), Code::kInvalidArgument);
  EXPECT_NE(clashed.message().find("object \"a.bin\" is already in the step"), std::string::npos)
      << clashed;
  StripeReceipt wrong_size = receipt;
  wrong_size.objects[0].size = 9;
  Status s = pending->AddStripe(wrong_size);
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  // The stripe's writer "died" and its object is gone.
  ASSERT_EQ(::unlink(dir_.Sub("store/step-000000000003/b.bin").c_str()), 0);
  s = pending->AddStripe(receipt);
  EXPECT_EQ(s.code(), Code::kDataLoss) << s;
  EXPECT_NE(s.message().find("rank 2's stripe of step 3"), std::string::npos) << s;
}

TEST_F(StoreTest, AbandonedStripesAndStepsLeaveNothing) {
  auto w = Writer();
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(5));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto unfinished, store_->BeginStripe(5, 1));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto os, unfinished->AddObject("x.bin"));
    CKPTIO_ASSERT_OK(os->Write("x", 1));
    CKPTIO_ASSERT_OK(os->Close());
    os.reset();
    unfinished.reset();  // no Finish(): its object goes
    EXPECT_FALSE(store_->backend().Stat("step-000000000005/x.bin").ok());

    CKPTIO_ASSERT_OK_AND_ASSIGN(auto finished, store_->BeginStripe(5, 1));
    CKPTIO_ASSERT_OK(finished->AddObject("y.bin").value()->Close());
    CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt r, finished->Finish());
    finished.reset();
    CKPTIO_ASSERT_OK(pending->AddStripe(r));
  }  // the writer abandons step 5: the stripe it took goes with it
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto keys, store_->backend().List("step-000000000005/"));
  EXPECT_TRUE(keys.empty()) << keys.front();

  ASSERT_TRUE(Save(*w, 6, {{"a", "a"}}).ok());
  EXPECT_EQ(store_->BeginStripe(6, 1).status().code(), Code::kAlreadyExists);
  EXPECT_EQ(store_->BeginStripe(7, 0).status().code(), Code::kInvalidArgument);
}

// A stripe writer that fails removes only what it made: a writer of an
// earlier launch, stalled while writing x.bin of step 5, wakes after this
// launch committed step 5 with its own x.bin. Its close fails and it goes,
// leaving the committed step whole.
TEST_F(StoreTest, AFailedStripeWriterRemovesOnlyWhatItMade) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale, store_->BeginStripe(5, 1));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stale_os, stale->AddObject("x.bin"));
  CKPTIO_ASSERT_OK(stale_os->Write("old", 3));

  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(5));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stripe, store_->BeginStripe(5, 1));
  for (const char* name : {"x.bin", "y.bin"}) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto os, stripe->AddObject(name));
    CKPTIO_ASSERT_OK(os->Write("new", 3));
    CKPTIO_ASSERT_OK(os->Close());
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt r, stripe->Finish());
  stripe.reset();
  CKPTIO_ASSERT_OK(pending->AddStripe(r));
  CKPTIO_ASSERT_OK(pending->PutObject("z.bin", "0", 1));
  CKPTIO_ASSERT_OK(pending->Commit().status());
  pending.reset();

  Status closed = stale_os->Close();  // (its temp was swept by Begin(5))
  EXPECT_FALSE(closed.ok());
  stale_os.reset();
  stale.reset();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, store_->OpenStep(5));
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string x, reader->ReadAll("x.bin"));
  EXPECT_EQ(x, "new");
  CKPTIO_EXPECT_OK(reader->Verify());
}

// The same stalled writer, but it had closed x.bin before it stalled: the
// next launch's writer cleared the torn step and committed its own x.bin.
// The stalled writer, failing later, leaves it (the step is another
// writer's save by then).
TEST_F(StoreTest, AStalledStripeWriterLeavesALaterWritersObject) {
  std::unique_ptr<StripeWriter> stale;
  {
    auto earlier = Writer();  // the earlier launch's rank 0, gone after Begin
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto begun, earlier->Begin(5));
    CKPTIO_ASSERT_OK_AND_ASSIGN(stale, store_->BeginStripe(5, 1));
    CKPTIO_ASSERT_OK(stale->AddObject("x.bin").value()->Close());
  }
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(5));  // clears the torn step
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stripe, store_->BeginStripe(5, 1));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto os, stripe->AddObject("x.bin"));
  CKPTIO_ASSERT_OK(os->Write("new", 3));
  CKPTIO_ASSERT_OK(os->Close());
  os.reset();
  CKPTIO_ASSERT_OK_AND_ASSIGN(StripeReceipt r, stripe->Finish());
  stripe.reset();
  CKPTIO_ASSERT_OK(pending->AddStripe(r));
  CKPTIO_ASSERT_OK(pending->Commit().status());
  pending.reset();

  stale.reset();  // fails without Finish()
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, store_->OpenStep(5));
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string x, reader->ReadAll("x.bin"));
  EXPECT_EQ(x, "new");
}

TEST_F(StoreTest, RetentionNeverDeletesTheStepJustSaved) {
  WriterOptions o;
  o.keep_last = 1;
  auto w = Writer(o);
  ASSERT_TRUE(Save(*w, 100, {{"a", "100"}}).ok());
  // A rollback: step 50 is below LATEST (100) and not among the newest 1,
  // but it is what the trainer just saved.
  auto info = Save(*w, 50, {{"a", "50"}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->retired.empty());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(50));
  EXPECT_EQ(*r->ReadAll("a"), "50");
}

TEST_F(StoreTest, AStreamDroppedWithoutCloseFailsTheCommit) {
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(1));
  CKPTIO_ASSERT_OK(p->PutObject("kept", "k", 1));
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto s, p->AddObject("dropped"));
    CKPTIO_ASSERT_OK(s->Write("x", 1));
  }
  auto c = p->Commit();
  EXPECT_EQ(c.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("dropped"), std::string::npos) << c.status();
  EXPECT_EQ(store_->OpenStep(1).status().code(), Code::kNotFound);
}

TEST_F(StoreTest, AnObjectErrorIsReportedByCommitWithItsCode) {
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(1));
  EXPECT_FALSE(p->AddObject("bad/name").ok());  // validation: does not poison the commit
  CKPTIO_ASSERT_OK(p->PutObject("a", "x", 1));
  CKPTIO_EXPECT_OK(p->Commit().status());
}

// The last component of `key`.
std::string NameOf(std::string_view key) { return std::string(key.substr(key.rfind('/') + 1)); }

// Forwards to a backend; each Stat passes `stats`, and those of the objects
// named in `gone` are NotFound.
class GatedStats : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<ObjectInfo> Stat(std::string_view key) override {
    stats.Pass();
    if (gone.count(NameOf(key))) return Status(Code::kNotFound, "gone (test)");
    return ForwardingBackend::Stat(key);
  }

  Gate stats;
  std::set<std::string> gone;  // set before the gate is started
};

// A commit looks its objects up all at once, not one after another (each
// lookup is a round trip on a remote store), and of several that fail it
// reports the first by name, whichever failed first.
TEST_F(StoreTest, ACommitChecksItsObjectsAtOnceAndReportsTheFirstThatFails) {
  auto posix = NewPosixBackend(dir_.Sub("store"));
  ASSERT_TRUE(posix.ok()) << posix.status();
  auto gated = std::make_shared<GatedStats>(std::shared_ptr<StorageBackend>(std::move(*posix)));
  Store store(gated);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store.OpenWriter({}));
  const std::map<std::string, std::string> objects = {
      {"a", "1"}, {"b", "22"}, {"c", "333"}, {"d", "4444"}};
  for (int64_t step : {1, 2}) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(step));
    for (const auto& [name, bytes] : objects)
      CKPTIO_ASSERT_OK(p->PutObject(name, bytes.data(), bytes.size()));
    if (step == 2) gated->gone = {"b", "d"};
    gated->stats.Start(4);
    auto info = p->Commit();
    gated->stats.Stop();
    EXPECT_EQ(gated->stats.most_at_once(), 4) << "step " << step << ": the objects were looked up "
                                              << gated->stats.most_at_once() << " at a time";
    if (step == 1) {
      CKPTIO_EXPECT_OK(info.status());
    } else {
      EXPECT_EQ(info.status().code(), Code::kDataLoss) << info.status();
      EXPECT_NE(info.status().message().find("step-000000000002/b is not in"), std::string::npos)
          << info.status();
    }
  }
}

// Forwards to a backend whose objects cannot be mapped and whose readers
// take `concurrent` reads at once (as an object store's); each opening
// passes `opens` and each read `reads`.
class RoundTripReads : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    struct Reader : ObjectReader {
      std::unique_ptr<ObjectReader> inner;
      RoundTripReads* backend;
      uint64_t Size() const override { return inner->Size(); }
      Status ReadAt(uint64_t offset, void* buf, size_t size) override {
        backend->reads.Pass();
        return inner->ReadAt(offset, buf, size);
      }
      unsigned ConcurrentReads() const override { return backend->concurrent; }
    };
    opens.Pass();
    CKPTIO_ASSIGN_OR_RETURN(auto inner, ForwardingBackend::OpenObject(key));
    auto r = std::make_unique<Reader>();
    r->inner = std::move(inner);
    r->backend = this;
    return std::unique_ptr<ObjectReader>(std::move(r));
  }

  Gate opens, reads;
  unsigned concurrent = 1;
};

// ViewAll opens a step's objects (or those named) at once; where reads
// are round trips (readers that take several at once) it reads them at once
// too, else one after another; every byte verified either way, and of two
// damaged objects the first by name is the one reported, as going one by
// one.
TEST_F(StoreTest, ViewAllOpensObjectsAtOnceAndReadsThemAtOnceWhereReadsAreRoundTrips) {
  const std::map<std::string, std::string> objects = {{"a", RandomBytes(5000, 1)},
                                                      {"b", RandomBytes(6000, 2)},
                                                      {"c", RandomBytes(7000, 3)},
                                                      {"d", RandomBytes(8000, 4)}};
  {
    auto w = Writer();
    CKPTIO_ASSERT_OK(Save(*w, 1, objects).status());
  }
  auto posix = NewPosixBackend(dir_.Sub("store"));
  ASSERT_TRUE(posix.ok()) << posix.status();
  auto backend =
      std::make_shared<RoundTripReads>(std::shared_ptr<StorageBackend>(std::move(*posix)));
  Store store(backend);
  for (unsigned concurrent : {4u, 1u}) {
    SCOPED_TRACE("readers take " + std::to_string(concurrent) + " reads at once");
    backend->concurrent = concurrent;
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store.OpenStep(1));
    backend->opens.Start(4);
    // One at a time: the first read waits a second for a second one, alone.
    backend->reads.Start(concurrent == 1 ? 2 : 4);
    auto views = r->ViewAll();
    backend->opens.Stop();
    backend->reads.Stop();
    ASSERT_TRUE(views.ok()) << views.status();
    ASSERT_EQ(views->size(), objects.size());
    size_t i = 0;
    for (const auto& [name, bytes] : objects) {
      const auto& v = (*views)[i++];
      EXPECT_EQ(std::string(v->data(), v->size()), bytes) << name;
    }
    EXPECT_EQ(backend->opens.most_at_once(), 4);
    EXPECT_EQ(backend->reads.most_at_once(), concurrent == 1 ? 1 : 4);
  }
  {
    // Some of them, in the order asked, likewise; a name the step lacks
    // is NotFound, naming it.
    backend->concurrent = 4;
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store.OpenStep(1));
    backend->opens.Start(2);
    backend->reads.Start(2);
    auto views = r->ViewAll({"d", "b"});
    backend->opens.Stop();
    backend->reads.Stop();
    ASSERT_TRUE(views.ok()) << views.status();
    ASSERT_EQ(views->size(), 2u);
    EXPECT_EQ(std::string((*views)[0]->data(), (*views)[0]->size()), objects.at("d"));
    EXPECT_EQ(std::string((*views)[1]->data(), (*views)[1]->size()), objects.at("b"));
    EXPECT_EQ(backend->opens.most_at_once(), 2);
    EXPECT_EQ(backend->reads.most_at_once(), 2);
    auto unknown = r->ViewAll({"a", "zz", "c"});
    EXPECT_EQ(unknown.status().code(), Code::kNotFound) << unknown.status();
    EXPECT_NE(unknown.status().message().find("no object \"zz\""), std::string::npos)
        << unknown.status();
  }
  // b damaged, d gone: b is the error going one by one, though d's opening
  // fails before b is read.
  testing::FlipBit(dir_.Sub("store") + "/step-000000000001/b", 100, 0);
  ASSERT_EQ(::unlink((dir_.Sub("store") + "/step-000000000001/d").c_str()), 0);
  backend->concurrent = 4;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store.OpenStep(1));
  auto views = r->ViewAll();
  EXPECT_EQ(views.status().code(), Code::kDataLoss) << views.status();
  EXPECT_NE(views.status().message().find("object b"), std::string::npos) << views.status();
}

TEST_F(StoreTest, AFencedWritersAbandonedCheckpointDeletesNothing) {
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(2));
  CKPTIO_ASSERT_OK(p->PutObject("a", "old writer", 10));
  // A successor claims the store and commits step 2 under the same names.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, NewPosixBackend(dir_.Sub("store")));
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto rec, other->NewObject(kWriterKey, WriteMode::kReplace));
    std::string bytes = SerializeWriterRecord({w->generation() + 1, "elsewhere", 99, 0});
    CKPTIO_ASSERT_OK(rec->Append(bytes.data(), bytes.size()));
    CKPTIO_ASSERT_OK(rec->Commit());
    CKPTIO_ASSERT_OK(other->Delete("step-000000000002/a"));
    CKPTIO_ASSERT_OK_AND_ASSIGN(
        auto obj, other->NewObject("step-000000000002/a", WriteMode::kCreateExclusive));
    CKPTIO_ASSERT_OK(obj->Append("successor", 9));
    CKPTIO_ASSERT_OK(obj->Commit());
  }
  EXPECT_EQ(p->Commit().status().code(), Code::kAborted);
  p.reset();  // the fenced writer abandons its checkpoint
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto obj, other->OpenObject("step-000000000002/a"));
  EXPECT_EQ(obj->Size(), 9u) << "the successor's object survived";
  EXPECT_EQ(w->CollectGarbage(1).status().code(), Code::kAborted) << "gc is fenced too";
}

// gc and repair read every byte before they delete (minutes on a big
// store); a writer that took over meanwhile must not lose steps to them.
TEST_F(StoreTest, GcAndRepairFencedWhileTheyVerifyDeleteNothing) {
  auto w = Writer();
  for (int64_t step : {1, 2, 3}) ASSERT_TRUE(Save(*w, step, {{"a", "step data"}}).ok());
  ASSERT_EQ(::mkdir(dir_.Sub("store/step-000000000004").c_str(), 0755), 0);  // torn
  testing::WriteFile(dir_.Sub("store/step-000000000004/a"), "half");
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto other, NewPosixBackend(dir_.Sub("store")));
  bool taken = false;
  auto take_over = [&](uint64_t) {
    if (taken) return;
    taken = true;
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto rec, other->NewObject(kWriterKey, WriteMode::kReplace));
    std::string bytes = SerializeWriterRecord({w->generation() + 1, "elsewhere", 99, 0});
    CKPTIO_ASSERT_OK(rec->Append(bytes.data(), bytes.size()));
    CKPTIO_ASSERT_OK(rec->Commit());
  };
  EXPECT_EQ(w->CollectGarbage(1, take_over).status().code(), Code::kAborted);
  ASSERT_TRUE(taken) << "gc verified nothing";
  taken = false;
  w.reset();
  w = Writer();
  EXPECT_EQ(w->Repair(take_over).status().code(), Code::kAborted);
  ASSERT_TRUE(taken);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListSteps());
  ASSERT_EQ(steps.size(), 4u) << "nothing deleted";
  EXPECT_EQ(steps[3].state, StepState::kTorn);
}

// Opening a writer sweeps temp objects where ckptio writes them, and
// nowhere else: not in folders a user keeps inside the store.
TEST_F(StoreTest, TheStaleTempSweepStaysInCkptiosOwnFolders) {
  { auto w = Writer(); }
  const std::string ours[] = {"store/.ckptio-tmp.LATEST.h.1.2.dead",
                              "store/.coord/.ckptio-tmp.save.h.1.2.dead"};
  const std::string theirs = "store/notes/run/.ckptio-tmp.x.h.1.2.dead";
  ASSERT_EQ(::mkdir(dir_.Sub("store/.coord").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(dir_.Sub("store/notes").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(dir_.Sub("store/notes/run").c_str(), 0755), 0);
  for (const auto& f : ours) testing::WriteFile(dir_.Sub(f), "junk");
  testing::WriteFile(dir_.Sub(theirs), "someone else's");
  auto w = Writer();
  EXPECT_EQ(w->stale_temps_removed(), 2u);
  for (const auto& f : ours) EXPECT_NE(::access(dir_.Sub(f).c_str(), F_OK), 0) << f;
  EXPECT_EQ(::access(dir_.Sub(theirs).c_str(), F_OK), 0);
}

// Every metadata value is within its limit, but together they make a
// manifest over the 64 MiB readers accept: the commit is refused instead of
// committing a step no one can read.
TEST_F(StoreTest, AManifestOverTheReadLimitIsNotCommitted) {
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto p, w->Begin(1));
  CKPTIO_ASSERT_OK(p->PutObject("a", "x", 1));
  const std::string value(kMaxMetadataValueBytes, 'v');
  for (size_t i = 0; i * kMaxMetadataValueBytes <= kMaxManifestBytes; ++i)
    CKPTIO_ASSERT_OK(p->SetMetadata("k" + std::to_string(i), value));
  auto info = p->Commit();
  EXPECT_EQ(info.status().code(), Code::kResourceExhausted) << info.status();
  EXPECT_NE(info.status().message().find("larger chunk size"), std::string::npos) << info.status();
  p.reset();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListStepsWithManifest());
  EXPECT_TRUE(steps.empty());
  ASSERT_TRUE(Save(*w, 1, {{"a", "one"}}).ok()) << "the writer carries on";
}

TEST_F(StoreTest, AStepRetiredWhileBeingReadIsNotFoundNotCorrupt) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 1, {{"a", "one"}}).ok());
  ASSERT_TRUE(Save(*w, 2, {{"a", "two"}}).ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenStep(1));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto gc, w->CollectGarbage(1));
  ASSERT_EQ(gc.deleted, std::vector<int64_t>{1});
  auto got = r->ReadAll("a");
  EXPECT_EQ(got.status().code(), Code::kNotFound) << got.status();
  EXPECT_NE(got.status().message().find("deleted"), std::string::npos) << got.status();
}

// fsck beside a live writer: the newest torn step is its save in progress,
// not a problem; an older torn step is one (no writer is writing it).
TEST_F(StoreTest, CheckBesideALiveWriterCountsOnlyOlderTornSteps) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 2, {{"a", "x"}}).ok());
  // An older writer's crash: an object of step 1, no manifest.
  ASSERT_EQ(::mkdir(dir_.Sub("store/step-000000000001").c_str(), 0755), 0);
  testing::WriteFile(dir_.Sub("store/step-000000000001/a"), "x");
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(3));
  CKPTIO_ASSERT_OK(pending->PutObject("a", "half of it", 10));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check());
  EXPECT_TRUE(report.writer_active);
  EXPECT_EQ(report.in_progress, 3);
  ASSERT_EQ(report.problems.size(), 1u);
  EXPECT_EQ(report.problems[0].kind, FsckProblem::Kind::kTornStep);
  EXPECT_EQ(report.problems[0].step, 1);
  CKPTIO_ASSERT_OK(pending->Commit().status());
  w.reset();
  CKPTIO_ASSERT_OK_AND_ASSIGN(report, store_->Check());
  EXPECT_FALSE(report.in_progress.has_value()) << "no writer: every torn step is a problem";
  EXPECT_EQ(report.problems.size(), 1u);
}

// A save below a newer torn step (the writer fell back past a crashed save
// and saves again from an older step): the step it is writing an object of
// is its save, the newer torn step the problem.
TEST_F(StoreTest, CheckBesideALiveWriterFindsASaveBelowANewerTornStep) {
  auto w = Writer();
  ASSERT_TRUE(Save(*w, 2, {{"a", "x"}}).ok());
  ASSERT_EQ(::mkdir(dir_.Sub("store/step-000000000009").c_str(), 0755), 0);
  testing::WriteFile(dir_.Sub("store/step-000000000009/a"), "x");
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto pending, w->Begin(3));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto stream, pending->AddObject("a"));
  CKPTIO_ASSERT_OK(stream->Write("half", 4));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check());
  EXPECT_EQ(report.in_progress, 3);
  ASSERT_EQ(report.problems.size(), 1u);
  EXPECT_EQ(report.problems[0].kind, FsckProblem::Kind::kTornStep);
  EXPECT_EQ(report.problems[0].step, 9);
  EXPECT_NE(report.problems[0].detail.find("writing step 3"), std::string::npos)
      << report.problems[0].detail;
  // Between two objects nothing tells which torn step is being written: the
  // newest is taken to be, and the other is not called someone else's.
  CKPTIO_ASSERT_OK(stream->Close());
  CKPTIO_ASSERT_OK_AND_ASSIGN(report, store_->Check());
  EXPECT_EQ(report.in_progress, 9);
  ASSERT_EQ(report.problems.size(), 1u);
  EXPECT_EQ(report.problems[0].step, 3);
  EXPECT_NE(report.problems[0].detail.find("unless the active writer is saving it"),
            std::string::npos)
      << report.problems[0].detail;
  CKPTIO_ASSERT_OK(pending->Commit().status());
}

TEST_F(StoreTest, CheckDoesNotTakeTheWriterLock) {
  {
    auto w = Writer();
    ASSERT_TRUE(Save(*w, 1, {{"a", "x"}}).ok());
  }
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto locked, store_->backend().IsLocked(kLockKey));
  EXPECT_FALSE(locked);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check());
  EXPECT_FALSE(report.writer_active);
  auto w = Writer();
  CKPTIO_ASSERT_OK_AND_ASSIGN(locked, store_->backend().IsLocked(kLockKey));
  EXPECT_TRUE(locked);
  CKPTIO_ASSERT_OK_AND_ASSIGN(report, store_->Check());
  EXPECT_TRUE(report.writer_active);
  // And the writer still holds its lock after the check looked.
  CKPTIO_ASSERT_OK_AND_ASSIGN(locked, store_->backend().IsLocked(kLockKey));
  EXPECT_TRUE(locked);
}

}  // namespace
}  // namespace ckptio
