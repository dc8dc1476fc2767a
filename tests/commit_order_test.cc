// The commit order, proven on a real file system: a recording backend
// wrapper logs every backend call, and the POSIX backend's sync-point hook
// logs every fsync/close/rename/directory fsync into the same log. At every
// sync point an independent reader checks what is visible.
#include <algorithm>
#include <filesystem>

#include "ckptio/ckptio.h"
#include "ckptio/posix_backend.h"
#include "ckptio/sync_point_fs.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::RecordingBackend;
using testing::TempDir;

constexpr char kStep1[] = "step-000000000001/";
constexpr char kStep2[] = "step-000000000002/";

// Index of the first log line equal to `line`; fails the test if absent.
size_t IndexOf(const std::vector<std::string>& log, const std::string& line) {
  auto it = std::find(log.begin(), log.end(), line);
  EXPECT_NE(it, log.end()) << "missing from the log: " << line;
  return static_cast<size_t>(it - log.begin());
}

struct Visible {
  int64_t latest = -1;  // step named by LATEST, -1 if none
  bool step2 = false;   // step 2 opens (its manifest is visible)
};

class CommitOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The hook's paths have symbolic links resolved (a TMPDIR may have some).
    std::filesystem::create_directories(dir_.Sub("store"));
    root_ = std::filesystem::canonical(dir_.Sub("store")).string();
    PosixBackendOptions o;
    o.fs = std::make_shared<SyncPointFs>([this](PosixSyncPoint p, const std::string& path) {
      // Log relative to the store root, like backend keys.
      std::string rel = path.substr(root_.size() + 1);
      if (rel.find(kTempMarker) != std::string::npos)
        rel = rel.substr(0, rel.find(kTempMarker)) + "<tmp>";
      recorder_->Record(std::string(PosixSyncPointName(p)) + " " + rel);
      if (observe_) observed_.push_back({recorder_->log().back(), Observe()});
      return OkStatus();
    });
    auto posix = NewPosixBackend(root_, o);
    ASSERT_TRUE(posix.ok()) << posix.status();
    recorder_ =
        std::make_shared<RecordingBackend>(std::shared_ptr<StorageBackend>(std::move(*posix)));
    store_ = std::make_unique<Store>(recorder_);
  }

  // What a reader in another process would see right now.
  Visible Observe() {
    auto other = OpenStore(root_);
    Visible v;
    if (!other.ok()) return v;
    auto latest = (*other)->OpenLatest();
    if (latest.ok()) {
      v.latest = (*latest)->step();
      EXPECT_TRUE((*latest)->Verify().ok()) << "LATEST names a step that does not verify";
    }
    auto step2 = (*other)->OpenStep(2);
    v.step2 = step2.ok();
    if (v.step2) {
      EXPECT_TRUE((*step2)->Verify().ok()) << "a visible step does not verify";
    }
    return v;
  }

  void Save(StoreWriter& w, int64_t step) {
    auto p = w.Begin(step);
    ASSERT_TRUE(p.ok()) << p.status();
    std::string a = testing::RandomBytes(100000, step), b = testing::RandomBytes(7, step + 1);
    CKPTIO_ASSERT_OK((*p)->PutObject("a.bin", a.data(), a.size()));
    CKPTIO_ASSERT_OK((*p)->PutObject("b.bin", b.data(), b.size()));
    auto info = (*p)->Commit();
    ASSERT_TRUE(info.ok()) << info.status();
  }

  TempDir dir_;
  std::string root_;
  std::shared_ptr<RecordingBackend> recorder_;
  std::unique_ptr<Store> store_;
  bool observe_ = false;
  std::vector<std::pair<std::string, Visible>> observed_;
};

TEST_F(CommitOrderTest, EveryObjectIsSyncedRenamedAndDirSyncedInThatOrder) {
  auto w = store_->OpenWriter({});
  ASSERT_TRUE(w.ok()) << w.status();
  recorder_->Clear();
  Save(**w, 1);
  auto log = recorder_->log();
  for (std::string key : {std::string(kStep1) + "a.bin", std::string(kStep1) + "b.bin",
                          std::string(kStep1) + "MANIFEST.json", std::string("LATEST")}) {
    std::string dir = key.find('/') == std::string::npos ? "" : key.substr(0, key.find('/') + 1);
    size_t renamed = IndexOf(log, "renamed " + key);
    size_t dir_synced = IndexOf(log, "dir-synced " + key);
    size_t committed = IndexOf(log, "commit " + key);
    // Objects are written one after another: the temp file renamed to `key`
    // is the last one opened before the rename.
    auto before = [&](const std::string& line, size_t end) {
      for (size_t i = end; i-- > 0;)
        if (log[i] == line) return i;
      ADD_FAILURE() << line << " not found before " << log[end];
      return end;
    };
    size_t closed = before("file-closed " + dir + "<tmp>", renamed);
    size_t synced = before("file-synced " + dir + "<tmp>", closed);
    size_t created = before("temp-opened " + dir + "<tmp>", synced);
    for (size_t i = created + 1; i < renamed; ++i)
      EXPECT_NE(log[i].rfind("temp-opened", 0), 0u) << key << ": another temp interleaved";
    EXPECT_LT(synced, closed) << key << ": fsync before close";
    EXPECT_LT(renamed, dir_synced) << key << ": the directory fsync must follow the rename";
    EXPECT_LT(dir_synced, committed) << key << ": Commit returns only after the directory fsync";
  }
  // Protocol order: objects, then the manifest (created exclusively), then LATEST.
  size_t a = IndexOf(log, std::string("commit ") + kStep1 + "a.bin");
  size_t b = IndexOf(log, std::string("commit ") + kStep1 + "b.bin");
  size_t manifest_new = IndexOf(log, std::string("new-exclusive ") + kStep1 + "MANIFEST.json");
  size_t manifest = IndexOf(log, std::string("commit ") + kStep1 + "MANIFEST.json");
  size_t latest_new = IndexOf(log, "new LATEST");
  size_t latest = IndexOf(log, "commit LATEST");
  EXPECT_LT(std::max(a, b), manifest_new);
  EXPECT_LT(manifest, latest_new);
  EXPECT_EQ(latest, log.size() - 1) << "nothing follows LATEST's commit";
}

TEST_F(CommitOrderTest, ReadersNeverSeeAStepBeforeItIsDurable) {
  auto w = store_->OpenWriter({});
  ASSERT_TRUE(w.ok()) << w.status();
  Save(**w, 1);
  observe_ = true;
  Save(**w, 2);
  observe_ = false;
  ASSERT_FALSE(observed_.empty());
  const std::string manifest = std::string(kStep2) + "MANIFEST.json";
  bool manifest_renamed = false, latest_renamed = false;
  for (const auto& [event, seen] : observed_) {
    if (event == "renamed " + manifest) manifest_renamed = true;
    if (event == "renamed LATEST") latest_renamed = true;
    // Step 2 becomes visible exactly when its manifest is renamed into place,
    // after every object and the manifest's own bytes were synced.
    EXPECT_EQ(seen.step2, manifest_renamed) << "at " << event;
    // LATEST moves from 1 to 2 exactly at its rename, and always names a step
    // that opens and verifies (checked in Observe).
    EXPECT_EQ(seen.latest, latest_renamed ? 2 : 1) << "at " << event;
  }
  EXPECT_TRUE(manifest_renamed);
  EXPECT_TRUE(latest_renamed);
  // The manifest's rename came after both objects' directory fsyncs.
  auto log = recorder_->log();
  size_t m = IndexOf(log, "renamed " + manifest);
  EXPECT_LT(IndexOf(log, std::string("dir-synced ") + kStep2 + "a.bin"), m);
  EXPECT_LT(IndexOf(log, std::string("dir-synced ") + kStep2 + "b.bin"), m);
  EXPECT_LT(IndexOf(log, "file-synced " + std::string(kStep2) + "<tmp>"), m);
}

TEST_F(CommitOrderTest, RetentionDeletesTheManifestBeforeTheObjects) {
  WriterOptions o;
  o.keep_last = 1;
  auto w = store_->OpenWriter(o);
  ASSERT_TRUE(w.ok()) << w.status();
  Save(**w, 1);
  recorder_->Clear();
  Save(**w, 2);
  auto log = recorder_->log();
  size_t latest = IndexOf(log, "commit LATEST");
  size_t manifest = IndexOf(log, std::string("delete ") + kStep1 + "MANIFEST.json");
  size_t a = IndexOf(log, std::string("delete ") + kStep1 + "a.bin");
  size_t b = IndexOf(log, std::string("delete ") + kStep1 + "b.bin");
  EXPECT_LT(latest, manifest) << "old steps go only after LATEST has moved";
  EXPECT_LT(manifest, std::min(a, b)) << "a half-deleted step must be torn, not committed";
}

}  // namespace
}  // namespace ckptio
