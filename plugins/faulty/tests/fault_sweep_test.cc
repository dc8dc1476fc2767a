// Sweeps over every operation of a save on top of a committed checkpoint:
// a crash at operation k, an error (EIO, ENOSPC, EDQUOT, EINTR, a short
// write) at operation k, or a power cut at system call k (unsynced data and
// directory entries lost or garbled). After each, a fresh process view of the store must
// hold the old or the new checkpoint, fully verifying; LATEST must never
// name a missing or torn step; fsck --repair must leave a clean store that
// lost no good step; and the next save must work.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "ckptio/ckptio.h"
#include "ckptio/faulty_backend.h"
#include "ckptio/posix_backend.h"
#include "ckptio/power_loss_fs.h"
#include "ckptio/sync_point_fs.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::RandomBytes;
using testing::TempDir;

// The checkpoint each step holds: a few objects of different shapes.
std::map<std::string, std::string> Objects(int64_t step) {
  return {{"model.safetensors", RandomBytes(300000 + step, step)},
          {"optim.optim.pt", RandomBytes(70000, step + 100)},
          {"rng.bin", RandomBytes(64, step + 200)},
          {"empty.bin", ""}};
}

Status Save(Store& store, int64_t step, WriterOptions o = {}) {
  o.chunk_size = 64 << 10;  // several chunks per object
  CKPTIO_ASSIGN_OR_RETURN(auto w, store.OpenWriter(o));
  CKPTIO_ASSIGN_OR_RETURN(auto p, w->Begin(step));
  for (const auto& [name, bytes] : Objects(step))
    CKPTIO_RETURN_IF_ERROR(p->PutObject(name, bytes.data(), bytes.size()));
  CKPTIO_RETURN_IF_ERROR(p->SetMetadata("step", std::to_string(step)));
  CKPTIO_ASSIGN_OR_RETURN(auto info, p->Commit());
  return info.retention;  // (the step stands; with keep_last, whether retention failed)
}

// Save, striped: rank 1 writes the two largest objects (committed durably,
// receipt handed over as text), the writer the rest, then commits.
Status StripedSave(Store& store, int64_t step) {
  WriterOptions o;
  o.chunk_size = 64 << 10;
  CKPTIO_ASSIGN_OR_RETURN(auto w, store.OpenWriter(o));
  CKPTIO_ASSIGN_OR_RETURN(auto p, w->Begin(step));
  CKPTIO_ASSIGN_OR_RETURN(auto stripe, store.BeginStripe(step, 1, o.chunk_size));
  for (const auto& [name, bytes] : Objects(step)) {
    if (name != "model.safetensors" && name != "optim.optim.pt") continue;
    CKPTIO_ASSIGN_OR_RETURN(auto os, stripe->AddObject(name));
    CKPTIO_RETURN_IF_ERROR(os->Write(bytes.data(), bytes.size()));
    CKPTIO_RETURN_IF_ERROR(os->Close());
  }
  CKPTIO_ASSIGN_OR_RETURN(StripeReceipt r, stripe->Finish());
  const std::string receipt = SerializeStripeReceipt(r);  // as it travels between ranks
  for (const auto& [name, bytes] : Objects(step)) {
    if (name == "model.safetensors" || name == "optim.optim.pt") continue;
    CKPTIO_RETURN_IF_ERROR(p->PutObject(name, bytes.data(), bytes.size()));
  }
  CKPTIO_ASSIGN_OR_RETURN(StripeReceipt back, ParseStripeReceipt(receipt, "receipt"));
  CKPTIO_RETURN_IF_ERROR(p->AddStripe(back));
  CKPTIO_RETURN_IF_ERROR(p->SetMetadata("step", std::to_string(step)));
  return p->Commit().status();
}

// A store with step 1 committed through the plain POSIX backend.
void OneStep(const std::string& root) {
  auto store = OpenStore(root);
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE(Save(**store, 1).ok());
}

std::string MakeBase(const TempDir& dir, const std::string& name) {
  std::string root = dir.Sub(name);
  OneStep(root);
  return root;
}

std::unique_ptr<Store> FaultyStore(const std::string& root, FaultPlan plan,
                                   std::shared_ptr<FaultyBackend>* faulty) {
  auto posix = NewPosixBackend(root);
  EXPECT_TRUE(posix.ok());
  *faulty =
      std::make_shared<FaultyBackend>(std::shared_ptr<StorageBackend>(std::move(*posix)), plan);
  return std::make_unique<Store>(*faulty);
}

// The invariants, checked as a restarted process would see the store.
// Returns the newest committed step (1 or 2).
int64_t CheckAfterFault(const std::string& root, const std::string& what) {
  SCOPED_TRACE(what);
  auto store = OpenStore(root);
  EXPECT_TRUE(store.ok());
  auto steps = (*store)->ListSteps();
  EXPECT_TRUE(steps.ok()) << steps.status();
  std::set<int64_t> committed;
  for (const auto& s : *steps) {
    EXPECT_NE(s.state, StepState::kCorrupt) << "step " << s.step << ": " << s.problem;
    if (s.state == StepState::kCommitted) committed.insert(s.step);
  }
  EXPECT_TRUE(committed.count(1)) << "the old checkpoint must survive";
  for (int64_t step : committed) {
    auto r = (*store)->OpenStep(step);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) continue;
    EXPECT_TRUE((*r)->Verify().ok()) << "step " << step << " does not verify";
    for (const auto& [name, bytes] : Objects(step)) {
      auto got = (*r)->ReadAll(name);
      EXPECT_TRUE(got.ok() && *got == bytes) << "step " << step << " object " << name;
    }
  }
  auto latest = (*store)->OpenLatest();
  EXPECT_TRUE(latest.ok()) << "LATEST must name a committed, verifying step: " << latest.status();
  if (latest.ok()) {
    EXPECT_TRUE(committed.count((*latest)->step()));
  }
  // fsck: at most leftovers of the failed attempt, or a LATEST one step
  // behind (a crash between the manifest and LATEST); repair fixes them.
  auto report = (*store)->Check();
  EXPECT_TRUE(report.ok()) << report.status();
  for (const auto& p : report->problems) {
    bool expected = p.kind == FsckProblem::Kind::kStaleTemp ||
                    p.kind == FsckProblem::Kind::kTornStep ||
                    (p.kind == FsckProblem::Kind::kBadLatest &&
                     p.detail.find("is newer and good") != std::string::npos);
    EXPECT_TRUE(expected) << FsckKindName(p.kind) << ": " << p.detail;
  }
  {
    auto w = (*store)->OpenWriter({});
    EXPECT_TRUE(w.ok()) << w.status();
    auto repaired = (*w)->Repair();
    EXPECT_TRUE(repaired.ok() && repaired->clean()) << repaired.status();
    EXPECT_EQ(std::set<int64_t>(repaired->good_steps.begin(), repaired->good_steps.end()),
              committed)
        << "repair lost a good step";
  }
  // No temp file survives the next writer's open.
  auto keys = (*store)->backend().List("");
  for (const auto& k : *keys) EXPECT_EQ(k.find(kTempMarker), std::string::npos) << k;
  // And training goes on.
  EXPECT_TRUE(Save(**store, 3).ok());
  return committed.count(2) ? 2 : 1;
}

// Operations a clean save of step 2 performs on top of MakeBase.
int64_t CountOps(const TempDir& dir) {
  std::string root = MakeBase(dir, "count");
  std::shared_ptr<FaultyBackend> faulty;
  auto store = FaultyStore(root, {}, &faulty);
  EXPECT_TRUE(Save(*store, 2).ok());
  return faulty->ops();
}

TEST(FaultSweep, CrashAtEveryOperationOfASave) {
  TempDir dir;
  const int64_t n = CountOps(dir);
  ASSERT_GT(n, 20);
  int old_kept = 0, new_committed = 0;
  for (int64_t k = 0; k < n; ++k) {
    std::string root = MakeBase(dir, "crash-" + std::to_string(k));
    {
      std::shared_ptr<FaultyBackend> faulty;
      FaultPlan plan;
      plan.crash_at = k;
      auto store = FaultyStore(root, plan, &faulty);
      Status s = Save(*store, 2);
      EXPECT_FALSE(s.ok()) << "a save crashed at op " << k << " of " << n << " reported success";
    }  // the "process" is gone; its fcntl locks go with it
    (CheckAfterFault(root, "crash at op " + std::to_string(k)) == 2 ? new_committed : old_kept)++;
    if (::testing::Test::HasFailure()) break;
  }
  std::cout << "crash sweep: " << n << " crash points in a save of 4 objects; " << old_kept
            << " left the old checkpoint newest, " << new_committed
            << " the new one; all verified, fsck --repair clean, next save ok\n";
  EXPECT_GT(old_kept, 0);
  EXPECT_GT(new_committed, 0) << "a crash after the manifest keeps the new step";
}

struct ErrorCase {
  const char* name;
  int err;
  Code code;
  bool short_write;
};

TEST(FaultSweep, ErrorAtEveryOperationOfASave) {
  TempDir dir;
  const int64_t n = CountOps(dir);
  const ErrorCase cases[] = {{"EIO", EIO, Code::kUnavailable, false},
                             {"ENOSPC", ENOSPC, Code::kResourceExhausted, false},
                             {"EDQUOT", EDQUOT, Code::kResourceExhausted, false},
                             {"EINTR", EINTR, Code::kUnavailable, false},
                             {"short-write", ENOSPC, Code::kResourceExhausted, true}};
  int total = 0, failed_saves = 0;
  for (const ErrorCase& c : cases) {
    for (int64_t k = 0; k < n; ++k) {
      std::string root = MakeBase(dir, std::string(c.name) + "-" + std::to_string(k));
      Status s;
      {
        std::shared_ptr<FaultyBackend> faulty;
        FaultPlan plan;
        plan.fail_at = k;
        plan.fail_errno = c.err;
        plan.short_write = c.short_write;
        auto store = FaultyStore(root, plan, &faulty);
        s = Save(*store, 2);
      }
      ++total;
      if (!s.ok()) {
        ++failed_saves;
        EXPECT_EQ(s.code(), c.code) << c.name << " at op " << k << ": " << s;
        EXPECT_NE(s.message().find("injected fault"), std::string::npos) << s;
      }
      CheckAfterFault(root, std::string(c.name) + " at op " + std::to_string(k));
      if (::testing::Test::HasFailure()) break;
    }
  }
  std::cout << "error sweep: " << total << " cases (EIO, ENOSPC, EDQUOT, EINTR, short write at "
            << "each of " << n << " operations); " << failed_saves
            << " saves failed with the mapped code, " << total - failed_saves
            << " succeeded (the fault hit an operation the save tolerates); old checkpoint "
               "intact and no temp left every time\n";
  EXPECT_GT(failed_saves, total / 2);
}

// Runs `op` on a faulty view of a fresh copy of `make(root)` once without
// faults to count its operations, then crashes it at every operation and
// calls `check(root, what)` on what is left.
template <typename Make, typename Op, typename Check>
int64_t CrashSweep(const TempDir& dir, const std::string& label, Make make, Op op, Check check) {
  std::string clean = dir.Sub(label + "-count");
  make(clean);
  std::shared_ptr<FaultyBackend> counter;
  {
    auto store = FaultyStore(clean, {}, &counter);
    EXPECT_TRUE(op(*store).ok());
  }
  const int64_t n = counter->ops();
  for (int64_t k = 0; k < n; ++k) {
    std::string root = dir.Sub(label + "-" + std::to_string(k));
    make(root);
    {
      std::shared_ptr<FaultyBackend> faulty;
      FaultPlan plan;
      plan.crash_at = k;
      auto store = FaultyStore(root, plan, &faulty);
      EXPECT_FALSE(op(*store).ok()) << label << ": crash at op " << k << " reported success";
    }
    check(root, label + " crash at op " + std::to_string(k));
    if (::testing::Test::HasFailure()) break;
  }
  return n;
}

// Steps the store holds as committed; every one of them verifies.
std::set<int64_t> VerifiedSteps(Store& store) {
  std::set<int64_t> out;
  auto steps = store.ListSteps();
  EXPECT_TRUE(steps.ok()) << steps.status();
  for (const auto& s : *steps) {
    if (s.state != StepState::kCommitted) continue;
    auto r = store.OpenStep(s.step);
    if (r.ok() && (*r)->Verify().ok()) out.insert(s.step);
  }
  return out;
}

// gc when LATEST lags the newest step (its move failed) and reading LATEST
// fails: gc cannot tell which step LATEST names, so it deletes nothing (it
// would delete that step). A DataLoss LATEST is another matter: see
// GcKeepsTheNewestStepThatVerifiesWhenNewerOnesRotted.
TEST(FaultSweep, GcStopsWhenLatestCannotBeRead) {
  TempDir dir;
  auto make = [](const std::string& root) {
    auto store = OpenStore(root);
    ASSERT_TRUE(store.ok());
    for (int64_t step : {1, 2, 3}) ASSERT_TRUE(Save(**store, step).ok());
    auto latest = (*store)->ReadLatest();
    ASSERT_TRUE(latest.ok() && latest->has_value());
    auto r1 = (*store)->OpenStep(1);
    ASSERT_TRUE(r1.ok());
    testing::WriteFile(root + "/" + std::string(kLatestKey),
                       SerializeLatest({1, (*latest)->generation, (*r1)->manifest_hash()}));
  };
  auto gc = [](Store& store) -> Status {
    CKPTIO_ASSIGN_OR_RETURN(auto w, store.OpenWriter({}));
    return w->CollectGarbage(1).status();
  };
  // Which operation of the gc opens LATEST.
  const std::string counted = dir.Sub("count");
  make(counted);
  std::shared_ptr<FaultyBackend> counter;
  {
    auto store = FaultyStore(counted, {}, &counter);
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto w, store->OpenWriter({}));
    const int64_t from = counter->ops();
    CKPTIO_ASSERT_OK(w->CollectGarbage(1).status());
    const auto log = counter->log();
    int64_t at = -1;
    for (int64_t k = from; k < static_cast<int64_t>(log.size()) && at < 0; ++k)
      if (log[k] == "open " + std::string(kLatestKey)) at = k;
    ASSERT_GE(at, 0) << "gc never opened LATEST";
    const std::string root = dir.Sub("failed");
    make(root);
    std::shared_ptr<FaultyBackend> faulty;
    FaultPlan plan;
    plan.fail_at = at;
    auto failing = FaultyStore(root, plan, &faulty);
    Status s = gc(*failing);
    EXPECT_FALSE(s.ok()) << "gc went on without knowing which step LATEST names";
    EXPECT_NE(s.message().find("nothing was deleted"), std::string::npos) << s;
    auto after = OpenStore(root);
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(VerifiedSteps(**after), (std::set<int64_t>{1, 2, 3}));
  }
}

// gc, repair and retention scenarios, shared by the crash and power-loss
// sweeps.
void TwoSteps(const std::string& root) {
  auto store = OpenStore(root);
  for (int64_t s : {1, 2}) EXPECT_TRUE(Save(**store, s).ok());
}

void ThreeSteps(const std::string& root) {
  auto store = OpenStore(root);
  for (int64_t s : {1, 2, 3}) EXPECT_TRUE(Save(**store, s).ok());
}

Status Gc(Store& s) {
  CKPTIO_ASSIGN_OR_RETURN(auto w, s.OpenWriter({}));
  return w->CollectGarbage(1).status();
}

// Steps are deleted manifest first: a deletion cut short leaves a torn step,
// never one with a manifest and objects missing. These scenarios start with
// good steps only, so every step that has a manifest must still verify.
void ExpectNothingHalfDeleted(Store& store, const std::vector<StepEntry>& steps,
                              const std::string& who) {
  for (const auto& s : steps) {
    EXPECT_NE(s.state, StepState::kCorrupt)
        << who << " left a half-deleted committed step " << s.step << ": " << s.problem;
    if (s.state != StepState::kCommitted) continue;
    auto r = store.OpenStep(s.step);
    Status v = r.ok() ? (*r)->Verify() : r.status();
    EXPECT_TRUE(v.ok()) << who << " left a half-deleted committed step " << s.step << ": " << v;
  }
}

// A repair after the cut leaves a clean store with the same good steps.
void ExpectRepairKeeps(Store& store, const std::set<int64_t>& good) {
  auto w = store.OpenWriter({});
  ASSERT_TRUE(w.ok()) << w.status();
  auto repaired = (*w)->Repair();
  EXPECT_TRUE(repaired.ok() && repaired->clean());
  if (repaired.ok()) {
    EXPECT_EQ(std::set<int64_t>(repaired->good_steps.begin(), repaired->good_steps.end()), good);
  }
}

void CheckAfterGc(const std::string& root, const std::string& what) {
  SCOPED_TRACE(what);
  auto store = OpenStore(root);
  auto steps = (*store)->ListSteps();
  ASSERT_TRUE(steps.ok());
  ExpectNothingHalfDeleted(**store, *steps, "gc");
  auto good = VerifiedSteps(**store);
  EXPECT_TRUE(good.count(3)) << "gc must never delete the newest step";
  auto latest = (*store)->OpenLatest();
  EXPECT_TRUE(latest.ok() && (*latest)->step() == 3) << latest.status();
  ExpectRepairKeeps(**store, good);
}

// A save of step 3 whose retention (keep_last 1) retires steps 1 and 2.
Status SaveKeepingOne(Store& s) {
  WriterOptions o;
  o.keep_last = 1;
  return Save(s, 3, o);
}

// Invariant 4 through the retention inside a save: step 3, or if its
// commit did not happen step 2, survives and verifies; LATEST names a step
// that verifies; nothing is half-deleted but torn (manifest first).
void CheckAfterSaveKeepingOne(const std::string& root, const std::string& what) {
  SCOPED_TRACE(what);
  auto store = OpenStore(root);
  auto steps = (*store)->ListSteps();
  ASSERT_TRUE(steps.ok());
  ExpectNothingHalfDeleted(**store, *steps, "retention");
  auto good = VerifiedSteps(**store);
  const bool committed3 = std::any_of(steps->begin(), steps->end(), [](const StepEntry& s) {
    return s.step == 3 && s.state == StepState::kCommitted;
  });
  EXPECT_TRUE(good.count(committed3 ? 3 : 2)) << "the newest checkpoint was lost";
  auto latest = (*store)->OpenLatest();
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_TRUE(good.count((*latest)->step())) << "LATEST names step " << (*latest)->step();
  ExpectRepairKeeps(**store, good);
}

// A damaged store: the newest step (named by LATEST) corrupt, a torn step,
// a stale temp.
void Damaged(const std::string& root) {
  ThreeSteps(root);
  testing::FlipBit(root + "/step-000000000003/rng.bin", 5, 1);
  ::mkdir((root + "/step-000000000004").c_str(), 0755);
  testing::WriteFile(root + "/step-000000000004/model.safetensors", "partial");
  testing::WriteFile(root + "/step-000000000002/.ckptio-tmp.x.h.1.2.3", "junk");
}

Status Repair(Store& s) {
  CKPTIO_ASSIGN_OR_RETURN(auto w, s.OpenWriter({}));
  return w->Repair().status();
}

void CheckAfterRepair(const std::string& root, const std::string& what) {
  SCOPED_TRACE(what);
  auto store = OpenStore(root);
  auto good = VerifiedSteps(**store);
  EXPECT_EQ(good, (std::set<int64_t>{1, 2})) << "an interrupted repair lost a good step";
  auto latest = (*store)->ReadLatest();
  ASSERT_TRUE(latest.ok() && latest->has_value());
  EXPECT_TRUE((*latest)->step == 2 || (*latest)->step == 3)
      << "LATEST moved somewhere odd: " << (*latest)->step;
  auto w = (*store)->OpenWriter({});
  auto repaired = (*w)->Repair();
  EXPECT_TRUE(repaired.ok() && repaired->clean());
  EXPECT_EQ(repaired->latest, 2);
  EXPECT_EQ(repaired->good_steps, (std::vector<int64_t>{1, 2}));
}

TEST(FaultSweep, CrashAtEveryOperationOfGcAndRepair) {
  TempDir dir;
  int64_t gc_ops = CrashSweep(dir, "gc", ThreeSteps, Gc, CheckAfterGc);
  int64_t repair_ops = CrashSweep(dir, "repair", Damaged, Repair, CheckAfterRepair);
  int64_t retain_ops =
      CrashSweep(dir, "retain", TwoSteps, SaveKeepingOne, CheckAfterSaveKeepingOne);
  std::cout << "gc sweep: crash at each of " << gc_ops
            << " operations of gc --keep 1: the newest step always verified and LATEST named it; "
               "repair sweep: crash at each of "
            << repair_ops
            << " operations of fsck --repair: both good steps survived, a second repair was clean; "
               "retention sweep: crash at each of "
            << retain_ops
            << " operations of a save with keep_last 1: the newest committed step verified and "
               "LATEST named a good step\n";
}

// The power-loss model itself, call by call.
class PowerLossModel : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::mkdir(root_.c_str(), 0755), 0);
    dir_ = ::open(root_.c_str(), O_RDONLY | O_DIRECTORY);
    ASSERT_GE(dir_, 0);
  }
  void TearDown() override { ::close(dir_); }
  // Creates `name` through `fs` with `bytes`, fsyncing the file if asked.
  void Write(PowerLossFs& fs, const char* name, const std::string& bytes, bool sync) {
    int fd = fs.OpenAt(dir_, name, O_WRONLY | O_CREAT | O_EXCL, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(fs.Write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    if (sync) {
      ASSERT_EQ(fs.Fsync(fd), 0);
    }
    ASSERT_EQ(fs.Close(fd), 0);
  }
  std::string Path(const char* name) const { return root_ + "/" + name; }
  bool Exists(const char* name) const { return ::access(Path(name).c_str(), F_OK) == 0; }

  TempDir tmp_;
  std::string root_ = tmp_.Sub("root");
  int dir_ = -1;
};

TEST_F(PowerLossModel, UnsyncedNamesVanishAndRemovedOnesComeBack) {
  PowerLossFs setup(tmp_.Sub("s0"), -1);
  Write(setup, "old", "old bytes", true);
  Write(setup, "gone", "gone bytes", true);
  ASSERT_EQ(setup.Fsync(dir_), 0);  // all durable from here

  PowerLossFs fs(tmp_.Sub("s1"), -1);
  Write(fs, "tmp", "new bytes", true);
  ASSERT_EQ(fs.RenameAt(dir_, "tmp", "old"), 0);
  ASSERT_EQ(fs.UnlinkAt(dir_, "gone", 0), 0);
  Write(fs, "fresh", "fresh", true);
  ASSERT_EQ(fs.MkdirAt(dir_, "sub", 0755), 0);
  auto r = fs.Apply(PowerLossMode::kDrop, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(testing::ReadFile(Path("old")), "old bytes") << "an unsynced rename was kept";
  EXPECT_EQ(testing::ReadFile(Path("gone")), "gone bytes") << "an unsynced unlink was kept";
  EXPECT_FALSE(Exists("tmp"));  // created after the last directory fsync
  EXPECT_FALSE(Exists("fresh"));
  EXPECT_FALSE(Exists("sub"));
  EXPECT_EQ(r->undone_entries, 6);  // tmp, the rename (2 entries), gone, fresh, sub
}

TEST_F(PowerLossModel, DirectoryFsyncMakesNamesDurable) {
  PowerLossFs fs(tmp_.Sub("s"), -1);
  Write(fs, "a", "synced", true);
  ASSERT_EQ(fs.Fsync(dir_), 0);
  Write(fs, "b", "not yet", true);
  auto r = fs.Apply(PowerLossMode::kDrop, 1);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(testing::ReadFile(Path("a")), "synced");
  EXPECT_FALSE(Exists("b"));
}

TEST_F(PowerLossModel, UnsyncedBytesAreDroppedOrGarbled) {
  for (PowerLossMode mode : {PowerLossMode::kDrop, PowerLossMode::kGarble}) {
    PowerLossFs fs(tmp_.Sub("s"), -1);
    const std::string synced = RandomBytes(1000, 1), tail = RandomBytes(5000, 2);
    int fd = fs.OpenAt(dir_, "f", O_WRONLY | O_CREAT | O_EXCL, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(fs.Write(fd, synced.data(), synced.size()), 1000);
    ASSERT_EQ(fs.Fsync(fd), 0);
    ASSERT_EQ(fs.Write(fd, tail.data(), tail.size()), 5000);
    ASSERT_EQ(fs.Close(fd), 0);
    ASSERT_EQ(fs.Fsync(dir_), 0);
    auto r = fs.Apply(mode, 7);
    ASSERT_TRUE(r.ok());
    std::string got = testing::ReadFile(Path("f"));
    ASSERT_GE(got.size(), synced.size());
    EXPECT_EQ(got.substr(0, 1000), synced) << "synced bytes were touched";
    if (mode == PowerLossMode::kDrop) {
      EXPECT_EQ(got.size(), 1000u);
    } else {
      EXPECT_LT(got.size(), 6000u);
      EXPECT_NE(got, synced + tail.substr(0, got.size() - 1000)) << "the kept tail was not garbled";
    }
    ASSERT_EQ(::unlink(Path("f").c_str()), 0);
  }
}

TEST_F(PowerLossModel, EveryCallFromTheCutOnFails) {
  PowerLossFs fs(tmp_.Sub("s"), 2);
  int fd = fs.OpenAt(dir_, "f", O_WRONLY | O_CREAT | O_EXCL, 0644);  // call 0
  ASSERT_GE(fd, 0);
  EXPECT_EQ(fs.Write(fd, "x", 1), 1);  // call 1
  EXPECT_FALSE(fs.cut());
  errno = 0;
  EXPECT_EQ(fs.Fsync(fd), -1);  // call 2: the cut
  EXPECT_EQ(errno, EIO);
  EXPECT_TRUE(fs.cut());
  EXPECT_EQ(fs.RenameAt(dir_, "f", "g"), -1);
  EXPECT_EQ(fs.Close(fd), -1);  // still closes the descriptor
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);
  auto r = fs.Apply(PowerLossMode::kDrop, 1);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(Exists("f"));
  EXPECT_FALSE(Exists("g"));
}

// Power loss: a store on a PowerLossFs that cuts the power at system call k.
std::unique_ptr<Store> PowerLossStore(const std::string& root, std::shared_ptr<PowerLossFs> fs) {
  PosixBackendOptions o;
  o.fs = std::move(fs);
  auto posix = NewPosixBackend(root, o);
  EXPECT_TRUE(posix.ok());
  return std::make_unique<Store>(std::shared_ptr<StorageBackend>(std::move(*posix)));
}

struct PowerLossTally {
  int64_t calls = 0;  // system calls of the operation
  int cases = 0, undone = 0, kept = 0, files_cut = 0, succeeded = 0;
  std::string Summary() const {
    return std::to_string(cases) + " power cuts (" + std::to_string(calls) +
           " system calls + 1 after success, x 2 modes); " + std::to_string(undone) +
           " unsynced directory changes undone, " + std::to_string(kept) + " kept, " +
           std::to_string(files_cut) + " files lost unsynced bytes";
  }
};

// Runs `op` on a fresh `make(root)` once to count its system calls, then
// for each mode and each k in [0, calls]: cuts the power at call k (k =
// calls: after `op` returned), applies what the cut loses and calls
// check(root, what, op_succeeded).
template <typename Make, typename Op, typename Check>
PowerLossTally PowerLossSweep(const TempDir& dir, const std::string& label, Make make, Op op,
                              Check check) {
  PowerLossTally t;
  {
    std::string clean = dir.Sub(label + "-count");
    make(clean);
    auto fs = std::make_shared<PowerLossFs>(clean + ".scratch", -1);
    EXPECT_TRUE(op(*PowerLossStore(clean, fs)).ok());
    t.calls = fs->ops();
  }
  for (PowerLossMode mode : {PowerLossMode::kDrop, PowerLossMode::kGarble}) {
    const char* mode_name = mode == PowerLossMode::kDrop ? "drop" : "garble";
    for (int64_t k = 0; k <= t.calls; ++k) {
      const std::string what =
          label + " power cut (" + mode_name + ") at call " + std::to_string(k);
      std::string root = dir.Sub(label + "-" + mode_name + "-" + std::to_string(k));
      make(root);
      auto fs = std::make_shared<PowerLossFs>(root + ".scratch", k);
      bool ok = op(*PowerLossStore(root, fs)).ok();  // the store is gone after this line
      // (A cut may hit a call the operation tolerates, such as removing an
      // emptied directory, so "ok" before the end is allowed; check() then
      // holds it to what it claimed.)
      if (k == t.calls) {
        EXPECT_TRUE(ok) << what;
      }
      auto report =
          fs->Apply(mode, static_cast<uint64_t>(k) * 2 + (mode == PowerLossMode::kGarble));
      EXPECT_TRUE(report.ok()) << report.status();
      if (report.ok()) {
        t.undone += report->undone_entries;
        t.kept += report->kept_entries;
        t.files_cut += report->files_cut;
      }
      ++t.cases;
      t.succeeded += ok;
      check(root, what, ok);
      if (::testing::Test::HasFailure()) return t;
    }
  }
  return t;
}

// Cuts the power at every system call of `save` (step 2, over a store
// holding step 1) and prints the tally as "power-loss sweep (<title>)".
void SweepASave(const std::string& name, const std::string& title,
                const std::function<Status(Store&)>& save) {
  TempDir dir;
  int old_kept = 0, new_committed = 0;
  PowerLossTally t = PowerLossSweep(
      dir, name, OneStep, save, [&](const std::string& root, const std::string& what, bool saved) {
        int64_t newest = CheckAfterFault(root, what);
        if (saved) {
          EXPECT_EQ(newest, 2) << what << ": a save that returned OK was lost";
        }
        (newest == 2 ? new_committed : old_kept)++;
      });
  ASSERT_GT(t.calls, 20);
  if (::testing::Test::HasFailure()) return;
  std::cout << "power-loss sweep (" << title << "): " << t.Summary() << "; " << old_kept
            << " left the old checkpoint newest, " << new_committed
            << " the new one; every save that returned OK survived; all verified, "
               "fsck --repair clean, next save ok\n";
  EXPECT_GT(old_kept, 0);
  EXPECT_GT(new_committed, 0);
  EXPECT_GT(t.undone, 0);
  EXPECT_GT(t.files_cut, 0);
}

TEST(FaultSweep, PowerLossAtEverySystemCallOfASave) {
  SweepASave("save", "save", [](Store& s) { return Save(s, 2); });
}

TEST(FaultSweep, PowerLossAtEverySystemCallOfAStripedSave) {
  SweepASave("striped", "striped save, writer + one stripe",
             [](Store& s) { return StripedSave(s, 2); });
}

TEST(FaultSweep, PowerLossAtEverySystemCallOfGcAndRepair) {
  TempDir dir;
  auto ignore_ok = [](auto check) {
    return [check](const std::string& root, const std::string& what, bool) { check(root, what); };
  };
  PowerLossTally gc = PowerLossSweep(dir, "gc", ThreeSteps, Gc, ignore_ok(CheckAfterGc));
  PowerLossTally repair =
      PowerLossSweep(dir, "repair", Damaged, Repair, ignore_ok(CheckAfterRepair));
  PowerLossTally retain = PowerLossSweep(
      dir, "retain", TwoSteps, SaveKeepingOne,
      [](const std::string& root, const std::string& what, bool saved) {
        CheckAfterSaveKeepingOne(root, what);
        if (saved) {
          auto store = OpenStore(root);
          EXPECT_TRUE(VerifiedSteps(**store).count(3)) << what
                                                       << ": a save that returned OK "
                                                          "was lost";
        }
      });
  if (HasFailure()) return;
  std::cout << "power-loss sweep (gc --keep 1): " << gc.Summary()
            << "; the newest step always verified and LATEST named it\n"
            << "power-loss sweep (fsck --repair): " << repair.Summary()
            << "; both good steps survived, a second repair was clean\n"
            << "power-loss sweep (save with keep_last 1): " << retain.Summary()
            << "; the newest committed step verified, LATEST named a good step, every save "
               "that returned OK survived\n";
}

// Real processes: a child saving step 2 is SIGKILLed at each named sync
// point of the POSIX commit path, for each kind of file; the parent checks
// the same invariants on the real file system.
TEST(FaultSweep, SigkillAtEveryNamedSyncPoint) {
  TempDir dir;
  const char* targets[] = {"model.safetensors", "empty.bin", "MANIFEST.json", "LATEST"};
  int kills = 0, old_kept = 0, new_committed = 0;
  for (int point = 0; point <= static_cast<int>(PosixSyncPoint::kDirSynced); ++point) {
    for (const char* target : targets) {
      const std::string name =
          std::string(PosixSyncPointName(static_cast<PosixSyncPoint>(point))) + "-" + target;
      std::string root = MakeBase(dir, name);
      std::fflush(nullptr);
      pid_t pid = ::fork();
      if (pid == 0) {
        PosixBackendOptions o;
        o.fs = std::make_shared<SyncPointFs>([point, target](PosixSyncPoint p,
                                                             const std::string& path) {
          // Temp files carry the target's name in theirs (".ckptio-tmp.<name>.").
          bool ours = path.find(std::string("/") + target) != std::string::npos ||
                      path.find(std::string(".ckptio-tmp.") + target + ".") != std::string::npos;
          if (static_cast<int>(p) == point && ours &&
              path.find("step-000000000001") == std::string::npos)
            ::raise(SIGKILL);
          return OkStatus();
        });
        auto posix = NewPosixBackend(root, o);
        if (!posix.ok()) ::_exit(3);
        Store store(std::shared_ptr<StorageBackend>(std::move(*posix)));
        ::_exit(Save(store, 2).ok() ? 0 : 4);
      }
      ASSERT_GT(pid, 0);
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << name << ": the child was not killed at its crash point (status " << status << ")";
      ++kills;
      (CheckAfterFault(root, "SIGKILL at " + name) == 2 ? new_committed : old_kept)++;
      if (::testing::Test::HasFailure()) return;
    }
  }
  std::cout << "sigkill: " << kills << " real processes killed at each of 6 sync points x 4 files "
            << "(object, empty object, manifest, LATEST); " << old_kept
            << " left the old step newest, " << new_committed
            << " the new one; every time: verified, fsck --repair clean\n";
}

TEST(FaultSweep, FaultyUrisWorkThroughTheTestRegistryOnly) {
  TempDir dir;
  std::string root = MakeBase(dir, "uri");
  auto open = [](const std::string& uri) { return Store::Open(uri, BackendsWithFaults()); };
  auto store = open("faulty+file://" + root + "?crash_at=0");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->ListSteps().status().code(), Code::kUnavailable);
  auto ok = open("faulty+file://" + root);
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE((*ok)->OpenLatest().ok());
  EXPECT_EQ(open("faulty+file://" + root + "?errno=EWHAT&fail_at=1").status().code(),
            Code::kInvalidArgument);
  // What users link knows no fault injection.
  EXPECT_EQ(OpenStore("faulty+file://" + root).status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(open("file://" + root).ok());
}

}  // namespace
}  // namespace ckptio
