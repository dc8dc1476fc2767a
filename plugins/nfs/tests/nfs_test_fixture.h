// What the nfs:// backend's tests share: fresh folders of the shared
// server's export, reading and replacing files there behind the backend's
// back, and the fixture of the fault tests (a backend on a fresh folder,
// over NFSv3 and NFSv4, or one version only). Header-only; include it from
// one test file per binary.
#ifndef CKPTIO_PLUGINS_NFS_TESTS_NFS_TEST_FIXTURE_H_
#define CKPTIO_PLUGINS_NFS_TESTS_NFS_TEST_FIXTURE_H_

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>

#include "ckptio/nfs_backend.h"
#include "nfs_server.h"
#include "test_util.h"

namespace ckptio::testing {

// A fresh folder of the export, and its name.
inline std::string FreshFolder(const std::string& label) {
  static int n = 0;
  // The export outlives this process, and pids come round again within one
  // ctest run: the random job id keeps a later process with this pid from
  // finding an earlier one's objects.
  std::string sub = label + "-" + NewJobId() + "-" + std::to_string(n++);
  ::mkdir((NfsServer::Shared().export_dir() + "/" + sub).c_str(), 0755);
  return sub;
}

inline bool Contains(const std::string& text, const char* part) {
  return text.find(part) != std::string::npos;
}

inline std::string ReadLocal(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Replaces `path` with `bytes` as a local rename would (as another client's
// commit does).
inline void ReplaceLocal(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".local-tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << bytes;
  }
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0) << path;
}

class NfsBackendFaults : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(NfsServer::Shared().ok()) << "no NFS server";
    sub_ = FreshFolder("faults");
    dir_ = NfsServer::Shared().export_dir() + "/" + sub_;
    backend_ = Backend();
    ASSERT_TRUE(backend_);
  }
  int version() const { return GetParam(); }
  // A backend on folder sub_ of `server`'s export.
  std::unique_ptr<StorageBackend> Backend(const std::string& extra = "",
                                          const NfsServer& server = NfsServer::Shared()) {
    auto uri = Uri::Parse(server.Uri(version(), sub_, extra));
    EXPECT_TRUE(uri.ok()) << uri.status();
    if (!uri.ok()) return nullptr;
    auto options = ParseNfsUri(*uri);
    EXPECT_TRUE(options.ok()) << options.status();
    if (!options.ok()) return nullptr;
    auto b = NewNfsBackend(*options);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }
  static Status Put(StorageBackend& b, std::string_view key, const std::string& bytes,
                    WriteMode mode = WriteMode::kReplace) {
    CKPTIO_ASSIGN_OR_RETURN(auto w, b.NewObject(key, mode));
    CKPTIO_RETURN_IF_ERROR(w->Append(bytes.data(), bytes.size()));
    return w->Commit();
  }
  // Puts `bytes` as object `key` and opens it (null, the test failed, if
  // either fails).
  std::unique_ptr<ObjectReader> PutAndOpen(std::string_view key, const std::string& bytes) {
    Status put = Put(*backend_, key, bytes);
    EXPECT_TRUE(put.ok()) << put;
    auto reader = backend_->OpenObject(key);
    EXPECT_TRUE(reader.ok()) << reader.status();
    return put.ok() && reader.ok() ? std::move(*reader) : nullptr;
  }
  static Result<std::string> Get(StorageBackend& b, std::string_view key) {
    CKPTIO_ASSIGN_OR_RETURN(auto r, b.OpenObject(key));
    std::string out(r->Size(), '\0');
    CKPTIO_RETURN_IF_ERROR(r->ReadAt(0, out.data(), out.size()));
    return out;
  }

  std::string sub_, dir_;
  std::unique_ptr<StorageBackend> backend_;
};

// What only one protocol version has: LOCKT (v4), lease files (v3).
class NfsV4Faults : public NfsBackendFaults {};
class NfsV3Faults : public NfsBackendFaults {};

}  // namespace ckptio::testing

#endif  // CKPTIO_PLUGINS_NFS_TESTS_NFS_TEST_FIXTURE_H_
