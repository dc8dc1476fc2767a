// keep_last retention, gc, and fsck / repair.
#include <sys/stat.h>
#include <unistd.h>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "ckptio/ckptio.h"
#include "ckptio/log.h"
#include "ckptio/posix_backend.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::RandomBytes;
using testing::TempDir;

class RetentionFsckTest : public ::testing::Test {
 protected:
  void SetUp() override { CKPTIO_ASSERT_OK_AND_ASSIGN(store_, OpenStore(dir_.Sub("store"))); }

  std::string StepPath(int64_t step, const std::string& name = "") const {
    return dir_.Sub("store/" + StepDirName(step) + (name.empty() ? "" : "/" + name));
  }

  Result<CommitInfo> Save(StoreWriter& w, int64_t step) {
    CKPTIO_ASSIGN_OR_RETURN(auto p, w.Begin(step));
    std::string bytes = RandomBytes(10000, static_cast<uint64_t>(step));
    CKPTIO_RETURN_IF_ERROR(p->PutObject("a.bin", bytes.data(), bytes.size()));
    CKPTIO_RETURN_IF_ERROR(p->PutObject("b.bin", "b", 1));
    return p->Commit();
  }

  std::vector<int64_t> Committed() {
    std::vector<int64_t> out;
    auto steps = store_->ListSteps();
    EXPECT_TRUE(steps.ok()) << steps.status();
    for (const auto& s : *steps)
      if (s.state == StepState::kCommitted) out.push_back(s.step);
    return out;
  }

  TempDir dir_;
  std::unique_ptr<Store> store_;
};

TEST_F(RetentionFsckTest, KeepLastKeepsTheNewestSteps) {
  WriterOptions o;
  o.keep_last = 2;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter(o));
  for (int64_t step = 1; step <= 5; ++step) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto info, Save(*w, step));
    CKPTIO_EXPECT_OK(info.retention);
    if (step >= 3) {
      EXPECT_EQ(info.retired, std::vector<int64_t>{step - 2});
    }
  }
  EXPECT_EQ(Committed(), (std::vector<int64_t>{4, 5}));
  // Deleted steps leave no directory behind.
  EXPECT_NE(::access(StepPath(1).c_str(), F_OK), 0);
}

TEST_F(RetentionFsckTest, RetentionNeverDeletesTheStepLatestNames) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  ASSERT_TRUE(Save(*w, 100).ok());
  // Lower steps after a rollback: LATEST stays on 100.
  for (int64_t step : {10, 20, 30}) ASSERT_TRUE(Save(*w, step).ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto gc, w->CollectGarbage(1));
  EXPECT_EQ(gc.deleted, (std::vector<int64_t>{10, 20, 30}));
  EXPECT_EQ(gc.newest_good, 100);
  EXPECT_TRUE(gc.corrupt.empty());
  EXPECT_EQ(Committed(), std::vector<int64_t>{100});
  EXPECT_EQ(w->CollectGarbage(0).status().code(), Code::kInvalidArgument);
}

TEST_F(RetentionFsckTest, GcKeepsLatestEvenWhenItIsNotAmongTheNewest) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  for (int64_t step : {1, 2, 3}) ASSERT_TRUE(Save(*w, step).ok());
  // Simulate LATEST left on step 1 (e.g. a crash before it moved).
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r1, store_->OpenStep(1));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest_writer,
                              store_->backend().NewObject(kLatestKey, WriteMode::kReplace));
  std::string latest = SerializeLatest({1, w->generation(), r1->manifest_hash()});
  CKPTIO_ASSERT_OK(latest_writer->Append(latest.data(), latest.size()));
  CKPTIO_ASSERT_OK(latest_writer->Commit());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto gc, w->CollectGarbage(1));
  EXPECT_EQ(gc.deleted, std::vector<int64_t>{2});
  EXPECT_EQ(Committed(), (std::vector<int64_t>{1, 3}));
}

// Invariant 4 when the newest steps rotted after their commit: gc keeps the
// newest step that still verifies, however old, and reads only as far back
// as it has to.
TEST_F(RetentionFsckTest, GcKeepsTheNewestStepThatVerifiesWhenNewerOnesRotted) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  for (int64_t step : {1, 2, 3, 4, 5}) ASSERT_TRUE(Save(*w, step).ok());
  testing::FlipBit(StepPath(5, "a.bin"), 1234, 3);
  testing::FlipBit(StepPath(4, "b.bin"), 0, 0);
  uint64_t read = 0;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto gc, w->CollectGarbage(1, [&](uint64_t n) { read += n; }));
  EXPECT_EQ(gc.newest_good, 3);
  EXPECT_EQ(gc.deleted, (std::vector<int64_t>{1, 2, 4})) << "a corrupt step past the window goes";
  ASSERT_EQ(gc.corrupt.size(), 2u);
  EXPECT_EQ(gc.corrupt[0].step, 5);
  EXPECT_EQ(gc.corrupt[1].step, 4);
  EXPECT_NE(gc.corrupt[0].detail.find("a.bin"), std::string::npos) << gc.corrupt[0].detail;
  EXPECT_EQ(Committed(), (std::vector<int64_t>{3, 5}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r3, store_->OpenStep(3));
  CKPTIO_EXPECT_OK(r3->Verify());
  EXPECT_GT(read, 0u);
  EXPECT_LE(read, 3 * 10001u) << "verified no further back than step 3";

  // A clean store: only the newest step is read back.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto repaired, w->Repair());
  ASSERT_TRUE(repaired.clean());
  for (int64_t step : {6, 7}) ASSERT_TRUE(Save(*w, step).ok());
  read = 0;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto clean, w->CollectGarbage(2, [&](uint64_t n) { read += n; }));
  EXPECT_EQ(clean.newest_good, 7);
  EXPECT_TRUE(clean.corrupt.empty());
  EXPECT_EQ(clean.deleted, (std::vector<int64_t>{3}));
  EXPECT_EQ(read, 10001u);
}

TEST_F(RetentionFsckTest, CleanStoreChecksClean) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  for (int64_t step : {1, 2}) ASSERT_TRUE(Save(*w, step).ok());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check());
  EXPECT_TRUE(report.clean());
  EXPECT_EQ(report.good_steps, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(report.latest, 2);
  EXPECT_TRUE(report.writer_active) << "this process holds the writer";
}

// fsck beside a live trainer: a step its retention deletes while fsck reads
// it is gone, not a failed check and not damage.
TEST_F(RetentionFsckTest, AStepRetiredWhileFsckReadsItIsNoProblem) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  for (int64_t step : {1, 2}) ASSERT_TRUE(Save(*w, step).ok());
  bool retired = false;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check([&](uint64_t) {
    if (retired) return;
    retired = true;
    // What retention does: the manifest first, then the objects.
    for (const char* name : {"MANIFEST.json", "a.bin", "b.bin"})
      ASSERT_EQ(::unlink(StepPath(1, name).c_str()), 0) << name;
    ASSERT_EQ(::rmdir(StepPath(1).c_str()), 0);
  }));
  ASSERT_TRUE(retired);
  EXPECT_TRUE(report.clean());
  EXPECT_EQ(report.good_steps, std::vector<int64_t>{2});
}

TEST_F(RetentionFsckTest, FsckFindsEveryKindOfDamageAndRepairFixesIt) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    for (int64_t step : {1, 2, 3, 4}) ASSERT_TRUE(Save(*w, step).ok());
  }
  // Damage: step 4 (named by LATEST) corrupt, step 2's manifest corrupt, a
  // torn step 5, a stale temp in step 1.
  testing::FlipBit(StepPath(4, "a.bin"), 1234, 3);
  testing::FlipBit(StepPath(2, "MANIFEST.json"), 40, 1);
  ASSERT_EQ(::mkdir(StepPath(5).c_str(), 0755), 0);
  testing::WriteFile(StepPath(5, "a.bin"), "half");
  testing::WriteFile(StepPath(1, ".ckptio-tmp.a.bin.host.1.2.dead"), "junk");

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check());
  EXPECT_FALSE(report.writer_active);
  EXPECT_EQ(report.good_steps, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(report.latest, 4);
  std::multiset<std::string> kinds;
  for (const auto& p : report.problems) kinds.insert(std::string(FsckKindName(p.kind)));
  EXPECT_EQ(kinds, (std::multiset<std::string>{"bad-latest", "corrupt-step", "corrupt-step",
                                               "stale-temp", "torn-step"}));
  // Check changed nothing.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto again, store_->Check());
  EXPECT_EQ(again.problems.size(), report.problems.size());

  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto repaired, w->Repair());
  EXPECT_TRUE(repaired.clean());
  EXPECT_EQ(repaired.latest, 3);
  EXPECT_EQ(repaired.good_steps, (std::vector<int64_t>{1, 3})) << "no good step deleted";
  EXPECT_FALSE(repaired.repairs.empty());
  EXPECT_EQ(repaired.repairs.front(), "LATEST now names step 3") << "LATEST moves first";
  w.reset();
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto final_check, store_->Check());
  EXPECT_TRUE(final_check.clean());
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto r, store_->OpenLatest());
  CKPTIO_EXPECT_OK(r->Verify());
}

// A manifest that cannot even be read whole (over the 64 MiB limit) is one
// corrupt step: listing, fsck and repair carry on with the others.
TEST_F(RetentionFsckTest, AnUnreadableManifestIsOneCorruptStepNotAFailedListing) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    for (int64_t step : {1, 2}) ASSERT_TRUE(Save(*w, step).ok());
  }
  ASSERT_EQ(::truncate(StepPath(2, "MANIFEST.json").c_str(), (64 << 20) + 1), 0);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListSteps());
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].state, StepState::kCommitted);
  EXPECT_EQ(steps[1].state, StepState::kCorrupt) << steps[1].problem;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto report, store_->Check());
  EXPECT_EQ(report.good_steps, (std::vector<int64_t>{1}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto repaired, w->Repair());
  EXPECT_TRUE(repaired.clean());
  EXPECT_EQ(repaired.good_steps, (std::vector<int64_t>{1}));
  EXPECT_EQ(Committed(), (std::vector<int64_t>{1}));
}

// With no step that verifies, repair deletes every corrupt step but the
// newest, which it reports as left with the LATEST that names it: it holds
// the newest state there is, and loads keep failing on it (DATA_LOSS)
// rather than finding an empty store and starting over. Told to, it deletes
// that one too, and LATEST.
TEST_F(RetentionFsckTest, RepairOfAStoreWithNoGoodStepLeavesTheNewestCorruptOne) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    for (int64_t step : {1, 2}) ASSERT_TRUE(Save(*w, step).ok());
  }
  testing::FlipBit(StepPath(1, "b.bin"), 0, 0);
  testing::FlipBit(StepPath(2, "b.bin"), 0, 0);
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto repaired, w->Repair());
    EXPECT_TRUE(repaired.good_steps.empty());
    ASSERT_EQ(repaired.problems.size(), 2u);
    EXPECT_EQ(repaired.problems[0].kind, FsckProblem::Kind::kCorruptStep);
    EXPECT_EQ(repaired.problems[0].step, 2);
    EXPECT_NE(repaired.problems[0].detail.find("b.bin"), std::string::npos)
        << repaired.problems[0].detail;
    EXPECT_EQ(repaired.problems[1].kind, FsckProblem::Kind::kBadLatest);
    EXPECT_EQ(repaired.latest, 2);
    EXPECT_EQ(repaired.repairs,
              (std::vector<std::string>{
                  "left LATEST: it names corrupt step 2, which is left", "deleted corrupt step 1",
                  "left corrupt step 2: no step verifies; it is kept for salvage (delete it "
                  "with `ckptio fsck --repair --delete-all-corrupt`)"}));
  }
  EXPECT_EQ(Committed(), (std::vector<int64_t>{2}));
  EXPECT_EQ(store_->ChooseStep(std::nullopt).status().code(), Code::kDataLoss)
      << "a load would find no checkpoint where a corrupt one is";
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto latest, store_->OpenLatest());
  EXPECT_EQ(latest->Verify().code(), Code::kDataLoss);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  RepairOptions all;
  all.delete_all_corrupt = true;
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto repaired, w->Repair({}, all));
  EXPECT_TRUE(repaired.clean());
  EXPECT_EQ(repaired.repairs, (std::vector<std::string>{"removed LATEST: no step verifies",
                                                        "deleted corrupt step 2"}));
  EXPECT_EQ(Committed(), (std::vector<int64_t>{}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto fresh, store_->ChooseStep(std::nullopt));
  EXPECT_FALSE(fresh.has_value());
}

// The step left is the newest whose manifest parses (its intact objects
// can still be read verified), rather than a newer one whose manifest is
// damaged.
TEST_F(RetentionFsckTest, RepairWithNoGoodStepLeavesTheNewestWhoseManifestParses) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    for (int64_t step : {1, 2, 3}) ASSERT_TRUE(Save(*w, step).ok());
  }
  testing::FlipBit(StepPath(1, "b.bin"), 0, 0);
  testing::FlipBit(StepPath(2, "b.bin"), 0, 0);
  testing::WriteFile(StepPath(3, "MANIFEST.json"), "{\"not\": \"a manifest\"}");
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto repaired, w->Repair());
  ASSERT_FALSE(repaired.problems.empty());
  EXPECT_EQ(repaired.problems[0].kind, FsckProblem::Kind::kCorruptStep);
  EXPECT_EQ(repaired.problems[0].step, 2);
  EXPECT_EQ(Committed(), (std::vector<int64_t>{2}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListSteps());
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].step, 2);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto two, store_->OpenStep(2));
  CKPTIO_ASSERT_OK_AND_ASSIGN(std::string a, two->ReadAll("a.bin"));
  EXPECT_FALSE(a.empty()) << "the intact object of the step left cannot be read";
}

// A repair that finds no good step removes LATEST only while the store is
// still its own: a writer that took over while it verified (and wrote a
// LATEST of its own) keeps that LATEST.
TEST_F(RetentionFsckTest, RepairLeavesLatestAloneOnceFenced) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    ASSERT_TRUE(Save(*w, 1).ok());
  }
  testing::FlipBit(StepPath(1, "b.bin"), 0, 0);
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  const std::string theirs = "LATEST of the writer that took over";
  bool took_over = false;
  auto repaired = w->Repair([&](uint64_t) {
    if (took_over) return;
    took_over = true;
    testing::WriteFile(dir_.Sub("store/") + std::string(kWriterKey),
                       SerializeWriterRecord({w->generation() + 1, "otherhost", 4242, 0}));
    testing::WriteFile(dir_.Sub("store/") + std::string(kLatestKey), theirs);
  });
  ASSERT_TRUE(took_over) << "Repair verified without reporting progress";
  ASSERT_FALSE(repaired.ok()) << "a fenced repair went on";
  EXPECT_EQ(repaired.status().code(), Code::kAborted) << repaired.status();
  EXPECT_EQ(testing::ReadFile(dir_.Sub("store/") + std::string(kLatestKey)), theirs);
}

TEST_F(RetentionFsckTest, RepairNeverDeletesAStepThatVerifies) {
  // Many rounds of random damage; the set of verifying steps never shrinks.
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
  std::mt19937_64 rng(7);
  int64_t next = 1;
  for (int round = 0; round < 10; ++round) {
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(Save(*w, next++).ok());
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto steps, store_->ListSteps());
    int64_t victim = steps[rng() % steps.size()].step;
    testing::FlipBit(StepPath(victim, rng() % 2 ? "a.bin" : "MANIFEST.json"), rng() % 50,
                     static_cast<int>(rng() % 8));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto before, store_->Check());
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto after, w->Repair());
    EXPECT_TRUE(after.clean()) << "round " << round;
    EXPECT_EQ(after.good_steps, before.good_steps) << "round " << round;
    ASSERT_FALSE(after.good_steps.empty());
    EXPECT_EQ(after.latest, after.good_steps.back());
  }
}

// Fails every Delete of a key that holds `refuse` (PermissionDenied), as a
// file the process may not remove would.
class RefusingDelete : public testing::ForwardingBackend {
 public:
  RefusingDelete(std::shared_ptr<StorageBackend> inner, std::string refuse)
      : ForwardingBackend(std::move(inner)), refuse_(std::move(refuse)) {}
  Status Delete(std::string_view key) override {
    if (key.find(refuse_) != std::string_view::npos)
      return Status(Code::kPermissionDenied, "delete " + std::string(key) + ": refused");
    return ForwardingBackend::Delete(key);
  }

 private:
  std::string refuse_;
};

// The store at `path` through test backend `B` (over the POSIX backend).
template <class B, class... Args>
Store StoreThrough(const std::string& path, Args&&... args) {
  auto posix = NewPosixBackend(path);
  EXPECT_TRUE(posix.ok()) << posix.status();
  return Store(std::make_shared<B>(std::shared_ptr<StorageBackend>(std::move(*posix)),
                                   std::forward<Args>(args)...));
}

Store StoreRefusingDeletesOf(const std::string& path, const std::string& refuse) {
  return StoreThrough<RefusingDelete>(path, refuse);
}

// gc, retention after a commit, and repair that fail part-way say what they
// had already done (a caller shown only the error would not know that steps
// were gone).
TEST_F(RetentionFsckTest, AnErrorPartWayReportsWhatWasAlreadyDeleted) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    for (int64_t step : {1, 2, 3, 4}) ASSERT_TRUE(Save(*w, step).ok());
  }
  Store refusing = StoreRefusingDeletesOf(dir_.Sub("store"), StepDirName(3) + "/MANIFEST");
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, refusing.OpenWriter({}));
    auto gc = w->CollectGarbage(1);
    ASSERT_FALSE(gc.ok()) << "gc could not delete step 3, yet succeeded";
    EXPECT_EQ(gc.status().code(), Code::kPermissionDenied) << gc.status();
    EXPECT_NE(gc.status().message().find("deleting step 3 (done before this: deleted step 1; "
                                         "deleted step 2)"),
              std::string::npos)
        << gc.status();
  }
  EXPECT_EQ(Committed(), (std::vector<int64_t>{3, 4}));
  {
    WriterOptions o;
    o.keep_last = 1;
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, refusing.OpenWriter(o));
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto info, Save(*w, 5));
    EXPECT_EQ(info.retention.code(), Code::kPermissionDenied) << info.retention;
    EXPECT_NE(info.retention.message().find("retention: deleting step 3"), std::string::npos)
        << info.retention;
  }
  // Repair: steps 3 and 4 corrupt (LATEST names 5, good); 4 cannot go.
  testing::FlipBit(StepPath(3, "a.bin"), 10, 1);
  testing::FlipBit(StepPath(4, "a.bin"), 10, 1);
  Store refusing_4 = StoreRefusingDeletesOf(dir_.Sub("store"), StepDirName(4) + "/MANIFEST");
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, refusing_4.OpenWriter({}));
  auto repaired = w->Repair();
  ASSERT_FALSE(repaired.ok()) << "repair could not delete step 4, yet succeeded";
  EXPECT_NE(repaired.status().message().find(
                "repair: deleting corrupt step 4 (done before this: deleted corrupt step 3)"),
            std::string::npos)
      << repaired.status();
  EXPECT_EQ(Committed(), (std::vector<int64_t>{4, 5}));
}

// A temp object of a dead writer that cannot be removed costs space, not
// correctness: the next writer opens anyway, says so, and removes the rest.
TEST_F(RetentionFsckTest, AStaleTempThatCannotBeRemovedDoesNotStopTheNextWriter) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    ASSERT_TRUE(Save(*w, 1).ok());
  }
  testing::WriteFile(StepPath(1, ".ckptio-tmp.a.bin.host.1.2.stuck"), "junk");
  testing::WriteFile(StepPath(1, ".ckptio-tmp.b.bin.host.1.3.dead"), "junk");
  std::vector<std::string> warnings;
  LogSink previous = SetLogSink([&](LogLevel level, std::string_view m) {
    if (level == LogLevel::kWarning) warnings.emplace_back(m);
  });
  Store refusing = StoreRefusingDeletesOf(dir_.Sub("store"), ".stuck");
  auto w = refusing.OpenWriter({});
  SetLogSink(previous);
  ASSERT_TRUE(w.ok()) << "one undeletable stale temp stopped the writer: " << w.status();
  EXPECT_EQ((*w)->stale_temps_removed(), 1u);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("1 stale temp object(s)"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("stuck"), std::string::npos) << warnings[0];
  EXPECT_EQ(::access(StepPath(1, ".ckptio-tmp.b.bin.host.1.3.dead").c_str(), F_OK), -1);
  CKPTIO_ASSERT_OK(Save(**w, 2).status());
}

// Unfinished writes (multipart uploads) of dead writers that cannot be
// aborted are invisible to readers: the next writer opens anyway, says so,
// and still sweeps the stale temps.
class FailingAborts : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Result<size_t> AbortUnfinishedWrites() override {
    return Status(Code::kUnavailable, "the server is down for maintenance");
  }
};

TEST_F(RetentionFsckTest, UnfinishedWritesThatCannotBeAbortedDoNotStopTheNextWriter) {
  {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store_->OpenWriter({}));
    ASSERT_TRUE(Save(*w, 1).ok());
  }
  testing::WriteFile(StepPath(1, ".ckptio-tmp.b.bin.host.1.3.dead"), "junk");
  std::vector<std::string> warnings;
  LogSink previous = SetLogSink([&](LogLevel level, std::string_view m) {
    if (level == LogLevel::kWarning) warnings.emplace_back(m);
  });
  Store failing = StoreThrough<FailingAborts>(dir_.Sub("store"));
  auto w = failing.OpenWriter({});
  SetLogSink(previous);
  ASSERT_TRUE(w.ok()) << "a failed abort of unfinished writes stopped the writer: " << w.status();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("unfinished writes of earlier writers were not all aborted"),
            std::string::npos)
      << warnings[0];
  EXPECT_NE(warnings[0].find("down for maintenance"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("ckptio fsck --repair"), std::string::npos) << warnings[0];
  EXPECT_EQ((*w)->stale_temps_removed(), 1u) << "the temp sweep did not go on";
  EXPECT_EQ(::access(StepPath(1, ".ckptio-tmp.b.bin.host.1.3.dead").c_str(), F_OK), -1);
  CKPTIO_ASSERT_OK(Save(**w, 2).status());
}

}  // namespace
}  // namespace ckptio
