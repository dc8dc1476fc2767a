// No lock-in: `ckptio export` writes a file that stock PyTorch (Debian's
// python3-torch) loads with torch.load, and the safetensors objects parse
// with nothing but Python's json and struct. Every tensor is compared with
// the original, bit for bit.
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <fstream>

#include "ckptio/backends.h"
#include "ckptio/torch.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::TempDir;

std::string Shell(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) {
    *rc = -1;
    return out;
  }
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  *rc = ::pclose(p);
  return out;
}

constexpr char kCompare[] = R"PY(
import json, struct, sys, torch
store, step, exported, expected = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
# The safe unpickler (1.13's opt-in, the default since 2.6): tensors, plain
# dicts and strings only.
got = torch.load(exported, weights_only=True)
want = torch.load(expected, weights_only=False)  # the test's own reference (torch::pickle_save)
def same(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.contiguous().flatten().view(torch.uint8),
                        b.contiguous().flatten().view(torch.uint8)))
n = 0
for group in ("model", "tensors"):
    for name, t in want[group].items():
        assert same(got[group][name], t), (group, name)
        n += 1
    assert set(got[group]) == set(want[group]), group
assert got["metadata"] == {"epoch": "3"}, got["metadata"]
# An independent safetensors reader: 8-byte length, JSON header, raw bytes.
dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
for group in ("model", "tensors"):
    raw = open("%s/step-%012d/%s.safetensors" % (store, step, group), "rb").read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    data = raw[8 + hlen:]
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:e]) or bytearray(1), dtype=torch.uint8)[:e - b]
        t = t.view(dtypes[info["dtype"]]).reshape(info["shape"])
        assert same(t, want[group][name]), ("safetensors", group, name)
        n += 1
print("python interop: %d tensor comparisons equal" % n)
)PY";

TEST(ExportTest, StockPyTorchLoadsTheExportAndEveryTensorMatches) {
  if (::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed (tools/setup.sh installs it)";
  const char* bin = std::getenv("CKPTIO_BIN_DIR");
  ASSERT_NE(bin, nullptr) << "CKPTIO_BIN_DIR must name the directory of the ckptio binaries";
  TempDir dir;
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(6, 5), torch::nn::BatchNorm1d(5),
                              torch::nn::Linear(5, 2));
  model->forward(torch::randn({4, 6}));  // running stats
  std::vector<std::pair<std::string, torch::Tensor>> loose = {
      {"f64", torch::randn({3}, torch::kFloat64)},
      {"f16", torch::randn({2, 2}).to(torch::kFloat16)},
      {"bf16", torch::randn({5}).to(torch::kBFloat16)},
      {"i64", torch::randint(-9, 9, {4}, torch::kInt64)},
      {"i32", torch::randint(-9, 9, {4}, torch::kInt32)},
      {"i16", torch::randint(-9, 9, {4}, torch::kInt16)},
      {"i8", torch::randint(-9, 9, {4}, torch::kInt8)},
      {"u8", torch::randint(0, 255, {4}, torch::kUInt8)},
      {"bool", torch::randint(0, 2, {6}).to(torch::kBool)},
      {"transposed", torch::randn({3, 4}).t()},
      {"empty", torch::empty({0}, torch::kFloat32)},
  };
  std::vector<torch::Tensor> values;
  for (auto& [n, t] : loose) values.push_back(t);
  State state{{"model", model}};
  for (size_t i = 0; i < loose.size(); ++i) state.items.emplace_back(loose[i].first, values[i]);
  state.SetInt("epoch", 3);
  auto ckpt = Checkpointer::Open(dir.Sub("store"), RankInfo{});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  CKPTIO_ASSERT_OK((*ckpt)->Save(7, state));

  // The expected values, pickled independently of ckptio.
  c10::impl::GenericDict want(c10::StringType::get(), c10::AnyType::get());
  c10::Dict<std::string, at::Tensor> m, t;
  for (const auto& p : model->named_parameters()) m.insert(p.key(), p.value().detach());
  for (const auto& b : model->named_buffers()) m.insert(b.key(), b.value());
  for (const auto& [n, v] : loose) t.insert(n, v.contiguous());
  want.insert("model", m);
  want.insert("tensors", t);
  auto bytes = torch::pickle_save(want);
  std::ofstream(dir.Sub("expected.pt"), std::ios::binary).write(bytes.data(), bytes.size());
  std::ofstream(dir.Sub("compare.py")) << kCompare;

  int rc = 0;
  std::string out = Shell(
      std::string(bin) + "/ckptio export " + dir.Sub("store") + " 7 -o " + dir.Sub("out.pt"), &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("exported step 7"), std::string::npos) << out;
  out = Shell("/usr/bin/python3 " + dir.Sub("compare.py") + " " + dir.Sub("store") + " 7 " +
                  dir.Sub("out.pt") + " " + dir.Sub("expected.pt"),
              &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("tensor comparisons equal"), std::string::npos) << out;
  std::cout << out;
}

// Commits step 1 of DIR/store, holding tensor "x" of `n` floats.
void SaveStepOne(const TempDir& dir, int64_t n) {
  torch::Tensor x = torch::randn({n});
  State state{{"x", x}};
  auto ckpt = Checkpointer::Open(dir.Sub("store"), RankInfo{});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  CKPTIO_ASSERT_OK((*ckpt)->Save(1, state));
}

TEST(ExportTest, ExportOfACorruptStepFailsAndWritesNothing) {
  const char* bin = std::getenv("CKPTIO_BIN_DIR");
  ASSERT_NE(bin, nullptr);
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveStepOne(dir, 1000));
  testing::FlipBit(dir.Sub("store/step-000000000001/tensors.safetensors"), 500, 4);
  int rc = 0;
  std::string out = Shell(
      std::string(bin) + "/ckptio export " + dir.Sub("store") + " 1 -o " + dir.Sub("out.pt"), &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("DATA_LOSS"), std::string::npos) << out;
  EXPECT_NE(::access(dir.Sub("out.pt").c_str(), F_OK), 0) << "no file from a bad step";
}

// A write that fails midway (here the file-size limit: EFBIG) is exit 1 with
// the error, leaves no temp file and no output. LibTorch's zip writer must
// not see it as a short write: its destructor would throw and abort.
TEST(ExportTest, AWriteErrorFailsCleanly) {
  const char* bin = std::getenv("CKPTIO_BIN_DIR");
  ASSERT_NE(bin, nullptr);
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveStepOne(dir, 100000));  // 400 KB, over the 64 KiB limit
  ASSERT_EQ(::mkdir(dir.Sub("out").c_str(), 0755), 0);
  int rc = 0;
  std::string said = Shell("trap '' XFSZ; ulimit -f 64; " + std::string(bin) + "/ckptio export " +
                               dir.Sub("store") + " 1 -o " + dir.Sub("out/x.pt"),
                           &rc);
  ASSERT_TRUE(WIFEXITED(rc)) << said;
  EXPECT_EQ(WEXITSTATUS(rc), 1) << said;
  EXPECT_NE(said.find("File too large"), std::string::npos) << said;
  ::DIR* d = ::opendir(dir.Sub("out").c_str());
  ASSERT_NE(d, nullptr);
  std::vector<std::string> left;
  while (auto* e = ::readdir(d))
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") left.push_back(e->d_name);
  ::closedir(d);
  EXPECT_TRUE(left.empty()) << "left behind: " << left.front();
}

// Replacing an export keeps the file's mode, and writes through a symlink
// (as torch.save would); a step without tensors exports nothing (exit 1).
TEST(ExportTest, ReplacingKeepsTheModeAndTheSymlink) {
  const char* bin = std::getenv("CKPTIO_BIN_DIR");
  ASSERT_NE(bin, nullptr);
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveStepOne(dir, 10));
  const std::string real = dir.Sub("real.pt"), link = dir.Sub("link.pt");
  testing::WriteFile(real, "old");
  ASSERT_EQ(::chmod(real.c_str(), 0600), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  int rc = 0;
  std::string said =
      Shell(std::string(bin) + "/ckptio export " + dir.Sub("store") + " 1 -o " + link, &rc);
  ASSERT_EQ(rc, 0) << said;
  struct stat st;
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode)) << "the link was replaced by a file";
  ASSERT_EQ(::stat(real.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_GT(st.st_size, 100) << "the export went to the link's target";
  // A relative link to a file not there yet: the file is made where it points.
  ASSERT_EQ(::mkdir(dir.Sub("sub").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("new.pt", dir.Sub("sub/last.pt").c_str()), 0);
  said = Shell(
      std::string(bin) + "/ckptio export " + dir.Sub("store") + " 1 -o " + dir.Sub("sub/last.pt"),
      &rc);
  ASSERT_EQ(rc, 0) << said;
  ASSERT_EQ(::lstat(dir.Sub("sub/last.pt").c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  ASSERT_EQ(::stat(dir.Sub("sub/new.pt").c_str(), &st), 0) << said;
  EXPECT_GT(st.st_size, 100);

  auto store = OpenStore(dir.Sub("bare"));
  ASSERT_TRUE(store.ok()) << store.status();
  auto writer = (*store)->OpenWriter(WriterOptions{});
  ASSERT_TRUE(writer.ok()) << writer.status();
  auto pending = (*writer)->Begin(5);
  ASSERT_TRUE(pending.ok()) << pending.status();
  CKPTIO_ASSERT_OK((*pending)->PutObject("blob", "bytes", 5));
  CKPTIO_ASSERT_OK((*pending)->Commit().status());
  said = Shell(
      std::string(bin) + "/ckptio export " + dir.Sub("bare") + " 5 -o " + dir.Sub("none.pt"), &rc);
  EXPECT_EQ(WEXITSTATUS(rc), 1) << said;
  EXPECT_NE(said.find("nothing to export"), std::string::npos) << said;
  EXPECT_NE(::access(dir.Sub("none.pt").c_str(), F_OK), 0) << said;
}

// Exit codes as for `ckptio`: 2 for a usage error, 1 for a store problem,
// each with a message that says what to do.
TEST(ExportTest, UsageErrorsExitTwoAndStoreProblemsOne) {
  const char* bin = std::getenv("CKPTIO_BIN_DIR");
  ASSERT_NE(bin, nullptr);
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SaveStepOne(dir, 10));
  const std::string store = dir.Sub("store"), out = " -o " + dir.Sub("out.pt");
  struct Case {
    std::string args;
    int rc;
    std::string says;
  };
  std::vector<Case> cases = {
      {store + " 1", 2, "--output is required"},
      {store + " 1x" + out, 2, "bad STEP"},
      {store + " 1000000000000" + out, 2, "bad STEP"},
      {dir.Sub("nothing-here") + " latest" + out, 1, "NOT_FOUND"},
      {store + " 2" + out, 1, "NOT_FOUND"},
      {store + " 1 -o ''", 2, "names no file"},
      {store + " 1 -o " + dir.path() + "/", 2, "names no file"},
      {store + " 1 -o " + dir.path(), 2, "is a folder"},
      {store + " 1 -o /dev/null", 2, "is not a regular file"},
  };
  for (const Case& c : cases) {
    int rc = 0;
    std::string said = Shell(std::string(bin) + "/ckptio export " + c.args, &rc);
    ASSERT_TRUE(WIFEXITED(rc)) << c.args;
    EXPECT_EQ(WEXITSTATUS(rc), c.rc) << c.args << "\n" << said;
    EXPECT_NE(said.find(c.says), std::string::npos) << c.args << "\n" << said;
  }
  testing::WriteFile(dir.Sub("store/LATEST"), "garbage");
  int rc = 0;
  std::string said = Shell(std::string(bin) + "/ckptio export " + store + " latest" + out, &rc);
  EXPECT_EQ(WEXITSTATUS(rc), 1) << said;
  EXPECT_NE(said.find("DATA_LOSS"), std::string::npos) << said;
  EXPECT_NE(said.find("ckptio fsck --repair"), std::string::npos) << said;
  EXPECT_NE(::access(dir.Sub("out.pt").c_str(), F_OK), 0) << "no file from a failed export";
}

}  // namespace
}  // namespace ckptio
