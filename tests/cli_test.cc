// End-to-end tests of the `ckptio` CLI: the real binaries ($CKPTIO_BIN_DIR/
// ckptio and ckptio-gen) run as subprocesses with stdout and stderr on pipes,
// and their exit codes (0 good, 1 bad, 2 usage) and output are checked.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ckptio/ckptio.h"
#include "test_util.h"

namespace ckptio {
namespace {

using json = nlohmann::json;
using ::ckptio::testing::FlipBit;
using ::ckptio::testing::ReadFile;
using ::ckptio::testing::TempDir;

// ---------------------------------------------------------------- running

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed; -1 when it could not run
  bool timed_out = false;
  std::string out;
  std::string err;
  std::string all() const { return out + err; }
};

std::ostream& operator<<(std::ostream& os, const RunResult& r) {
  os << "exit " << r.exit_code << (r.timed_out ? " (timed out)" : "") << "\n--- stdout ---\n"
     << r.out << "--- stderr ---\n"
     << r.err << "--------------";
  return os;
}

std::string Join(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

// Runs argv[0] (a path) with stdin on /dev/null and stdout/stderr on pipes,
// killing it after `timeout`. No shell is involved.
RunResult RunCommand(const std::vector<std::string>& argv,
                     std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  RunResult r;
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    r.err = std::string("pipe2: ") + std::strerror(errno);
    return r;
  }
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    r.err = std::string("pipe2: ") + std::strerror(errno);
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return r;
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  pid_t pid = ::fork();
  if (pid < 0) {
    r.err = std::string("fork: ") + std::strerror(errno);
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
    return r;
  }
  if (pid == 0) {
    int in = ::open("/dev/null", O_RDONLY);
    if (in >= 0) ::dup2(in, 0);
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::execv(args[0], args.data());
    const char msg[] = "exec failed\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  struct pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
    if (left <= 0) {
      r.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    int n = ::poll(fds, 2, static_cast<int>(left));
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        sinks[i]->append(buf, static_cast<size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds)
    if (f.fd >= 0) ::close(f.fd);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status))
    r.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    r.exit_code = 128 + WTERMSIG(status);
  return r;
}

bool HasTerminalEscapes(const std::string& s) {
  return s.find('\r') != std::string::npos || s.find('\033') != std::string::npos;
}

// ---------------------------------------------------------------- fixture

// Steps ckptio-gen writes in MakeStore: 0, 10, 20; two 300 KiB objects each.
constexpr int64_t kSteps[] = {0, 10, 20};
constexpr uint64_t kObjectBytes = 300 * 1024;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("CKPTIO_BIN_DIR");
    if (dir == nullptr || *dir == '\0')
      FAIL() << "CKPTIO_BIN_DIR is not set: it must name the directory holding the built "
                "`ckptio` and `ckptio-gen` binaries (ctest sets it; by hand: "
                "CKPTIO_BIN_DIR=build/bin ./build/bin/cli_test)";
    bin_dir_ = dir;
    for (const char* name : {"ckptio", "ckptio-gen"}) {
      std::string path = bin_dir_ + "/" + name;
      if (::access(path.c_str(), X_OK) != 0)
        FAIL() << path << " is not an executable (CKPTIO_BIN_DIR=" << bin_dir_
               << "); build the `ckptio` and `ckptio-gen` targets first";
    }
    store_ = tmp_.Sub("store");
  }

  // Runs `ckptio ARGS...`; every run is checked for terminal escapes,
  // since stdout and stderr are pipes here.
  RunResult Ckptio(std::vector<std::string> args) {
    args.insert(args.begin(), bin_dir_ + "/ckptio");
    RunResult r = RunCommand(args);
    EXPECT_FALSE(r.timed_out) << Join(args) << "\n" << r;
    EXPECT_FALSE(HasTerminalEscapes(r.out) || HasTerminalEscapes(r.err))
        << "progress-bar escapes in output of `" << Join(args)
        << "` although stdout and stderr are pipes\n"
        << r;
    return r;
  }

  RunResult Gen(std::vector<std::string> args) {
    args.insert(args.begin(), bin_dir_ + "/ckptio-gen");
    RunResult r = RunCommand(args);
    EXPECT_FALSE(r.timed_out) << Join(args) << "\n" << r;
    return r;
  }

  // Three committed steps (0, 10, 20), two objects of 300 KiB each.
  void MakeStore() {
    RunResult r =
        Gen({store_, "--steps", "3", "--objects", "2", "--size", "300K", "--every", "10"});
    ASSERT_EQ(r.exit_code, 0) << r;
  }

  std::string StepDir(int64_t step) const { return store_ + "/" + StepDirName(step); }
  std::string ObjectPath(int64_t step, const std::string& name) const {
    return StepDir(step) + "/" + name;
  }

  // `ckptio ls --json`, parsed.
  json LsJson() {
    RunResult r = Ckptio({"ls", store_, "--json"});
    EXPECT_EQ(r.exit_code, 0) << r;
    json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "ls --json printed invalid JSON:\n" << r;
    return j;
  }

  static std::vector<int64_t> StepsOf(const json& ls) {
    std::vector<int64_t> out;
    if (!ls.is_object() || !ls.contains("steps")) return out;
    for (const auto& s : ls["steps"]) out.push_back(s.at("step").get<int64_t>());
    return out;
  }
  // The steps ls --json marks latest.
  static std::vector<int64_t> LatestOf(const json& ls) {
    std::vector<int64_t> out;
    if (!ls.is_object() || !ls.contains("steps")) return out;
    for (const auto& s : ls["steps"])
      if (s.at("latest").get<bool>()) out.push_back(s.at("step").get<int64_t>());
    return out;
  }

  TempDir tmp_;
  std::string bin_dir_;
  std::string store_;
};

// ---------------------------------------------------------------- usage

TEST_F(CliTest, HelpOnAppAndEverySubcommandExitsZero) {
  const std::vector<std::vector<std::string>> cases = {
      {"--help"},
      {"-h"},
      {"ls", "--help"},
      {"verify", "--help"},
      {"inspect", "--help"},
      {"fsck", "--help"},
      {"gc", "--help"},
  };
  for (const auto& args : cases) {
    RunResult r = Ckptio(args);
    EXPECT_EQ(r.exit_code, 0) << "ckptio " << Join(args) << "\n" << r;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << "ckptio " << Join(args) << "\n" << r;
  }
  RunResult top = Ckptio({"--help"});
  for (const char* sub : {"ls", "verify", "inspect", "fsck", "gc"})
    EXPECT_NE(top.out.find(sub), std::string::npos) << "--help does not list " << sub;
  RunResult gen = Gen({"--help"});
  EXPECT_EQ(gen.exit_code, 0) << gen;
}

TEST_F(CliTest, UsageErrorsExitTwo) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  const std::string before = LsJson().dump();
  const std::vector<std::vector<std::string>> cases = {
      {},                                          // no subcommand
      {"frobnicate", store_},                      // unknown subcommand
      {"ls"},                                      // missing STORE
      {"verify"},                                  //
      {"inspect"},                                 //
      {"fsck"},                                    //
      {"gc"},                                      //
      {"inspect", store_},                         // missing STEP
      {"ls", store_, "--no-such-flag"},            //
      {"verify", store_, "--all", "5"},            // --all excludes STEP
      {"gc", store_},                              // --keep is required
      {"gc", store_, "--keep", "0"},               // --keep must be >= 1
      {"gc", store_, "--keep", "-1"},              //
      {"gc", store_, "--keep", "two"},             //
      {"fsck", store_, "--wait", "-1"},            //
      {"verify", store_, "abc"},                   // bad step text
      {"inspect", store_, "abc"},                  //
      {"verify", store_, "12abc"},                 //
      {"verify", store_, "1e3"},                   //
      {"verify", store_, "99999999999999999999"},  // overflows
      {"verify", store_, "1000000000000"},         // above kMaxStep
  };
  for (const auto& args : cases) {
    RunResult r = Ckptio(args);
    EXPECT_EQ(r.exit_code, 2) << "ckptio " << Join(args) << "\n" << r;
    EXPECT_FALSE(r.err.empty()) << "no message on stderr for ckptio " << Join(args);
  }
  // None of them touched the store.
  EXPECT_EQ(LsJson().dump(), before);
}

TEST_F(CliTest, UnknownSchemeExitsTwoAndListsKnownSchemes) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"ls", "gs://bucket/x"},
        std::vector<std::string>{"verify", "gs://bucket/x", "--all"},
        std::vector<std::string>{"inspect", "gs://bucket/x", "latest"},
        std::vector<std::string>{"fsck", "gs://bucket/x", "--repair"},
        std::vector<std::string>{"gc", "gs://bucket/x", "--keep", "1"}}) {
    RunResult r = Ckptio(args);
    EXPECT_EQ(r.exit_code, 2) << "ckptio " << Join(args) << "\n" << r;
    EXPECT_NE(r.err.find("gs"), std::string::npos) << r;
    EXPECT_NE(r.err.find("file://"), std::string::npos)
        << "the error should list the known schemes\n"
        << r;
  }
}

TEST_F(CliTest, MissingStoreExitsOneWithMessage) {
  const std::string missing = tmp_.Sub("no-such-store");
  const std::vector<std::vector<std::string>> cases = {
      {"ls", missing},
      {"ls", missing, "--json"},
      {"verify", missing},
      {"verify", missing, "--all"},
      {"verify", missing, "10"},
      {"inspect", missing, "latest"},
      {"inspect", missing, "10"},
      {"fsck", missing},
      {"fsck", missing, "--repair"},
  };
  for (const auto& args : cases) {
    RunResult r = Ckptio(args);
    EXPECT_EQ(r.exit_code, 1) << "ckptio " << Join(args) << "\n" << r;
    EXPECT_NE(r.all().find(missing), std::string::npos) << "the error should name the store\n" << r;
    struct stat st;
    EXPECT_NE(::stat(missing.c_str(), &st), 0)
        << "ckptio " << Join(args) << " created the missing store";
  }
}

// A typo in the store path is not corruption: the report must not send
// the user to `fsck --repair` over a store that does not exist.
TEST_F(CliTest, VerifyStepOnMissingStoreDoesNotClaimCorruption) {
  const std::string missing = tmp_.Sub("no-such-store");
  RunResult r = Ckptio({"verify", missing, "10"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_EQ(r.all().find("corruption found"), std::string::npos) << r;
  EXPECT_NE(r.all().find("no store"), std::string::npos) << r;
}

// gc on a path that holds no store must not create one and report success
// (a typo in the path would silently make an empty store).
TEST_F(CliTest, GcOnMissingStoreFailsAndCreatesNothing) {
  const std::string missing = tmp_.Sub("no-such-store");
  RunResult r = Ckptio({"gc", missing, "--keep", "1"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_NE(r.err.find(missing), std::string::npos) << r;
  struct stat st;
  EXPECT_NE(::stat(missing.c_str(), &st), 0) << "gc created " << missing;
}

// The store's parent (or any folder that is not a store) is refused by every
// command: repair and gc there would take a lock in it and sweep the real
// store's in-flight temp files below it.
TEST_F(CliTest, AFolderThatIsNotAStoreIsRefusedAndLeftAlone) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  const std::string parent = store_.substr(0, store_.rfind('/'));
  const std::string live_temp = ObjectPath(20, ".ckptio-tmp.shard-0.bin.vm.1.2.live");
  ::ckptio::testing::WriteFile(live_temp, "a live writer's temp");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"ls", parent}, std::vector<std::string>{"fsck", parent},
        std::vector<std::string>{"fsck", parent, "--repair"},
        std::vector<std::string>{"gc", parent, "--keep", "1"}}) {
    RunResult r = Ckptio(args);
    EXPECT_EQ(r.exit_code, 1) << r;
    EXPECT_NE(r.err.find("is not a ckptio store"), std::string::npos) << r;
  }
  struct stat st;
  EXPECT_NE(::stat((parent + "/.lock").c_str(), &st), 0) << "a lock was taken in the parent";
  EXPECT_NE(::stat((parent + "/.writer").c_str(), &st), 0);
  EXPECT_EQ(::stat(live_temp.c_str(), &st), 0) << "the store's temp was swept from its parent";
}

// ---------------------------------------------------------------- reading

TEST_F(CliTest, LsListsCommittedStepsAndMarksLatest) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  RunResult r = Ckptio({"ls", store_});
  ASSERT_EQ(r.exit_code, 0) << r;
  std::map<int64_t, std::string> rows;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string first;
    words >> first;
    if (!first.empty() && first.find_first_not_of("0123456789") == std::string::npos)
      rows[std::stoll(first)] = line;
  }
  ASSERT_EQ(rows.size(), 3u) << r;
  for (int64_t step : kSteps) {
    ASSERT_TRUE(rows.count(step)) << "step " << step << " is not listed\n" << r;
    EXPECT_NE(rows[step].find("committed"), std::string::npos) << rows[step];
    const bool marked = rows[step].find("LATEST") != std::string::npos;
    EXPECT_EQ(marked, step == 20) << rows[step];
  }
}

TEST_F(CliTest, LsJsonHasEveryStep) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  json j = LsJson();
  ASSERT_TRUE(j.is_object()) << j.dump(2);
  ASSERT_TRUE(j.contains("steps") && j["steps"].is_array()) << j.dump(2);
  EXPECT_EQ(StepsOf(j), (std::vector<int64_t>{0, 10, 20})) << j.dump(2);
  EXPECT_EQ(LatestOf(j), (std::vector<int64_t>{20})) << j.dump(2);
  for (const auto& s : j["steps"]) {
    EXPECT_EQ(s.at("state"), "committed") << s.dump();
    EXPECT_EQ(s.at("bytes").get<uint64_t>(), 2 * kObjectBytes) << s.dump();
    EXPECT_GT(s.at("created_unix_ms").get<int64_t>(), 0) << s.dump();
  }
  EXPECT_NE(j.at("store").get<std::string>().find(store_), std::string::npos) << j.dump(2);
}

TEST_F(CliTest, InspectLatestJsonShowsObjectsWithTheirOnDiskHashes) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  RunResult r = Ckptio({"inspect", store_, "latest", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r;
  json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r;
  EXPECT_EQ(j.at("step").get<int64_t>(), 20);
  EXPECT_EQ(j.at("bytes").get<uint64_t>(), 2 * kObjectBytes);
  EXPECT_EQ(j.at("manifest_xxh3_128").get<std::string>(),
            HashBytes(ReadFile(StepDir(20) + "/MANIFEST.json")).Hex());
  ASSERT_TRUE(j.at("objects").is_array());
  ASSERT_EQ(j["objects"].size(), 2u) << j.dump(2);
  std::vector<std::string> names;
  for (const auto& o : j["objects"]) {
    const std::string name = o.at("name").get<std::string>();
    names.push_back(name);
    EXPECT_EQ(o.at("size").get<uint64_t>(), kObjectBytes) << o.dump();
    const std::string bytes = ReadFile(ObjectPath(20, name));
    ASSERT_EQ(bytes.size(), kObjectBytes) << name;
    EXPECT_EQ(o.at("xxh3_128").get<std::string>(), HashBytes(bytes).Hex()) << o.dump();
  }
  EXPECT_EQ(names, (std::vector<std::string>{"shard-0.bin", "shard-1.bin"}));

  // The text form shows the same hashes; a numeric step works too.
  RunResult text = Ckptio({"inspect", store_, "20"});
  ASSERT_EQ(text.exit_code, 0) << text;
  for (const auto& o : j["objects"])
    EXPECT_NE(text.out.find(o["xxh3_128"].get<std::string>()), std::string::npos) << text;

  // A step that is not committed is an error, not an empty report.
  RunResult absent = Ckptio({"inspect", store_, "5"});
  EXPECT_EQ(absent.exit_code, 1) << absent;
  EXPECT_NE(absent.err.find("5"), std::string::npos) << absent;
}

TEST_F(CliTest, VerifyAllOnGoodStoreExitsZero) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  RunResult r = Ckptio({"verify", store_, "--all"});
  EXPECT_EQ(r.exit_code, 0) << r;
  for (int64_t step : kSteps)
    EXPECT_NE(r.out.find("step " + std::to_string(step) + ": OK"), std::string::npos) << r;
  for (const std::vector<std::string>& args : {std::vector<std::string>{"verify", store_},
                                               std::vector<std::string>{"verify", store_, "latest"},
                                               std::vector<std::string>{"verify", store_, "10"},
                                               std::vector<std::string>{"ls", store_, "--verify"},
                                               std::vector<std::string>{"fsck", store_}}) {
    RunResult ok = Ckptio(args);
    EXPECT_EQ(ok.exit_code, 0) << Join(args) << "\n" << ok;
  }
  RunResult j = Ckptio({"verify", store_, "--json"});
  ASSERT_EQ(j.exit_code, 0) << j;
  json parsed = json::parse(j.out, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << j;
  EXPECT_EQ(parsed.at("ok"), true) << j.out;
}

// ---------------------------------------------------------------- corruption

class CorruptStoreTest : public CliTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(CliTest::SetUp());
    ASSERT_NO_FATAL_FAILURE(MakeStore());
    // One bit in the middle of the second object of the newest step.
    FlipBit(ObjectPath(20, "shard-1.bin"), 123457, 3);
  }
};

TEST_F(CorruptStoreTest, VerifyAllNamesStepObjectAndRange) {
  RunResult r = Ckptio({"verify", store_, "--all"});
  EXPECT_EQ(r.exit_code, 1) << r;
  const std::string all = r.all();
  EXPECT_NE(all.find("step 20"), std::string::npos) << r;
  EXPECT_NE(all.find("shard-1.bin"), std::string::npos) << r;
  EXPECT_NE(all.find("bytes ["), std::string::npos) << r;
  EXPECT_NE(all.find("DATA_LOSS"), std::string::npos) << r;
  // The good steps are still reported good, the intact object not blamed.
  EXPECT_NE(all.find("step 0: OK"), std::string::npos) << r;
  EXPECT_NE(all.find("step 10: OK"), std::string::npos) << r;
  EXPECT_EQ(all.find("shard-0.bin"), std::string::npos) << r;
}

TEST_F(CorruptStoreTest, VerifyJsonReportsNotOk) {
  RunResult r = Ckptio({"verify", store_, "--json"});
  EXPECT_EQ(r.exit_code, 1) << r;
  json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r;
  EXPECT_EQ(j.at("ok"), false) << j.dump(2);
  ASSERT_TRUE(j.at("steps").is_array());
  ASSERT_FALSE(j["steps"].empty());
  EXPECT_EQ(j["steps"][0].at("step").get<int64_t>(), 20);
  EXPECT_EQ(j["steps"][0].at("ok"), false);
  EXPECT_NE(j["steps"][0].at("errors").dump().find("shard-1.bin"), std::string::npos);

  RunResult all = Ckptio({"verify", store_, "--all", "--json"});
  EXPECT_EQ(all.exit_code, 1) << all;
  json ja = json::parse(all.out, nullptr, false);
  ASSERT_FALSE(ja.is_discarded()) << all;
  EXPECT_EQ(ja.at("ok"), false);

  // ls --verify marks the step corrupt and fails; plain ls does not read data.
  RunResult ls = Ckptio({"ls", store_, "--verify", "--json"});
  EXPECT_EQ(ls.exit_code, 1) << ls;
  json jl = json::parse(ls.out, nullptr, false);
  ASSERT_FALSE(jl.is_discarded()) << ls;
  for (const auto& s : jl.at("steps"))
    EXPECT_EQ(s.at("state"), s.at("step") == 20 ? "corrupt" : "committed") << s.dump();
}

TEST_F(CorruptStoreTest, FsckReportsThenRepairRetiresTheStep) {
  RunResult check = Ckptio({"fsck", store_});
  EXPECT_EQ(check.exit_code, 1) << check;
  EXPECT_NE(check.out.find("corrupt-step"), std::string::npos) << check;
  EXPECT_NE(check.out.find("bad-latest"), std::string::npos) << check;
  // A check changes nothing.
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{0, 10, 20}));

  RunResult cj = Ckptio({"fsck", store_, "--json"});
  EXPECT_EQ(cj.exit_code, 1) << cj;
  json j = json::parse(cj.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << cj;
  EXPECT_EQ(j.at("clean"), false);
  std::set<std::string> kinds;
  for (const auto& p : j.at("problems")) kinds.insert(p.at("kind").get<std::string>());
  EXPECT_EQ(kinds, (std::set<std::string>{"corrupt-step", "bad-latest"})) << j.dump(2);
  EXPECT_EQ(j.at("good_steps"), json({0, 10})) << j.dump(2);

  RunResult repair = Ckptio({"fsck", store_, "--repair"});
  EXPECT_EQ(repair.exit_code, 0) << repair;

  RunResult verify = Ckptio({"verify", store_, "--all"});
  EXPECT_EQ(verify.exit_code, 0) << verify;
  json ls = LsJson();
  EXPECT_EQ(StepsOf(ls), (std::vector<int64_t>{0, 10})) << ls.dump(2);
  EXPECT_EQ(LatestOf(ls), (std::vector<int64_t>{10})) << ls.dump(2);
  RunResult latest = Ckptio({"verify", store_, "latest"});
  EXPECT_EQ(latest.exit_code, 0) << latest;

  RunResult again = Ckptio({"fsck", store_});
  EXPECT_EQ(again.exit_code, 0) << again;
}

// When no step verifies, repair leaves the newest corrupt step (the newest
// state there is) and says so; --delete-all-corrupt deletes it too.
TEST_F(CliTest, RepairWithNoGoodStepLeavesTheNewestCorruptOneUnlessTold) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  for (int64_t step : {0, 10, 20}) FlipBit(ObjectPath(step, "shard-0.bin"), 1000, 0);
  RunResult usage = Ckptio({"fsck", store_, "--delete-all-corrupt"});
  EXPECT_EQ(usage.exit_code, 2) << "--delete-all-corrupt without --repair\n" << usage;

  RunResult repair = Ckptio({"fsck", store_, "--repair"});
  EXPECT_EQ(repair.exit_code, 1) << "a step is still corrupt\n" << repair;
  EXPECT_NE(repair.out.find("left corrupt step 20: no step verifies"), std::string::npos) << repair;
  EXPECT_NE(repair.out.find("--delete-all-corrupt"), std::string::npos) << repair;
  EXPECT_NE(repair.out.find("problems remain after repair"), std::string::npos) << repair;
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{20}));
  RunResult check = Ckptio({"fsck", store_});
  EXPECT_EQ(check.exit_code, 1) << check;
  EXPECT_NE(check.out.find("corrupt-step"), std::string::npos) << check;

  RunResult all = Ckptio({"fsck", store_, "--repair", "--delete-all-corrupt"});
  EXPECT_EQ(all.exit_code, 0) << all;
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{}));
}

// A manifest damaged into bytes that are not UTF-8: the parse error quotes
// them, and --json output must still be JSON (nlohmann's dump throws on
// invalid UTF-8 by default).
TEST_F(CliTest, JsonOutputSurvivesAManifestThatIsNotUtf8) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  ::ckptio::testing::WriteFile(ObjectPath(20, "MANIFEST.json"), "{\"checksum\": \"\xff\xfe\x80");
  json ls = LsJson();
  EXPECT_NE(ls.dump().find("corrupt"), std::string::npos) << ls.dump(2);
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"fsck", store_, "--json"},
        std::vector<std::string>{"verify", store_, "--all", "--json"}}) {
    RunResult r = Ckptio(args);
    EXPECT_EQ(r.exit_code, 1) << r;
    json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << args[0] << " --json printed invalid JSON:\n" << r;
  }
}

// ---------------------------------------------------------------- gc

TEST_F(CliTest, GcKeepOneLeavesExactlyOneStep) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  RunResult r = Ckptio({"gc", store_, "--keep", "1"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_NE(r.out.find("deleted step 0"), std::string::npos) << r;
  EXPECT_NE(r.out.find("deleted step 10"), std::string::npos) << r;
  json ls = LsJson();
  EXPECT_EQ(StepsOf(ls), (std::vector<int64_t>{20})) << ls.dump(2);
  EXPECT_EQ(LatestOf(ls), (std::vector<int64_t>{20})) << ls.dump(2);
  struct stat st;
  EXPECT_NE(::stat(StepDir(0).c_str(), &st), 0);
  EXPECT_NE(::stat(StepDir(10).c_str(), &st), 0);
  RunResult v = Ckptio({"verify", store_, "--all"});
  EXPECT_EQ(v.exit_code, 0) << v;
  // Running it again deletes nothing.
  RunResult again = Ckptio({"gc", store_, "--keep", "1"});
  EXPECT_EQ(again.exit_code, 0) << again;
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{20}));
}

// Step 20, the newest, is corrupt: gc --keep 1 keeps it (for fsck to judge)
// and step 10, the newest that verifies, says so, and exits 1.
TEST_F(CorruptStoreTest, GcKeepsTheNewestStepThatVerifies) {
  RunResult r = Ckptio({"gc", store_, "--keep", "1"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_NE(r.out.find("corrupt step 20: "), std::string::npos) << r;
  EXPECT_NE(r.out.find("deleted step 0\n"), std::string::npos) << r;
  EXPECT_NE(r.out.find("step 10, the newest that verifies"), std::string::npos) << r;
  EXPECT_NE(r.out.find("ckptio fsck --repair"), std::string::npos) << r;
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{10, 20}));
  RunResult v = Ckptio({"verify", store_, "10"});
  EXPECT_EQ(v.exit_code, 0) << v;
}

// Damage gc does not judge (a manifest that does not parse, an unreadable
// LATEST) stays, and gc says so and exits 1 as for a corrupt step.
TEST_F(CliTest, GcReportsDamageItLeaves) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  ::ckptio::testing::WriteFile(ObjectPath(0, "MANIFEST.json"), "{bad");
  RunResult r = Ckptio({"gc", store_, "--keep", "1"});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_NE(r.out.find("corrupt step 0: "), std::string::npos) << r;
  EXPECT_NE(r.out.find("ckptio fsck --repair"), std::string::npos) << r;
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{0, 20}));
  ::ckptio::testing::WriteFile(store_ + "/LATEST", "garbage");
  RunResult latest = Ckptio({"gc", store_, "--keep", "1"});
  EXPECT_EQ(latest.exit_code, 1) << latest;
  EXPECT_NE(latest.out.find("LATEST is unreadable"), std::string::npos) << latest;
}

// verify of LATEST, and --all, check that LATEST names a step that is there
// by its manifest's hash: a LATEST that does not is reported once, as LATEST.
TEST_F(CliTest, VerifyChecksWhatLatestNames) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  const std::string other = tmp_.Sub("other");
  ASSERT_EQ(
      Gen({other, "--steps", "3", "--objects", "2", "--size", "300K", "--every", "10"}).exit_code,
      0);
  // Another store's LATEST: step 20, by the hash of another manifest.
  ::ckptio::testing::WriteFile(store_ + "/LATEST", ReadFile(other + "/LATEST"));
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"verify", store_},
        std::vector<std::string>{"verify", store_, "--all"}}) {
    RunResult r = Ckptio(args);
    EXPECT_EQ(r.exit_code, 1) << Join(args) << "\n" << r;
    EXPECT_NE(r.out.find("step 20: OK"), std::string::npos) << r;
    EXPECT_NE(r.out.find("LATEST: BAD"), std::string::npos) << r;
    EXPECT_EQ(r.out.find("DATA_LOSS"), r.out.rfind("DATA_LOSS")) << "reported once\n" << r;
    EXPECT_NE(r.out.find("ckptio fsck --repair"), std::string::npos) << r;
  }
  // LATEST naming a step that is gone.
  ASSERT_EQ(std::system(("rm -rf " + StepDir(20)).c_str()), 0);
  ::ckptio::testing::WriteFile(store_ + "/LATEST", ReadFile(other + "/LATEST"));
  RunResult gone = Ckptio({"verify", store_, "--all"});
  EXPECT_EQ(gone.exit_code, 1) << gone;
  EXPECT_NE(gone.out.find("LATEST: BAD"), std::string::npos) << gone;
  EXPECT_NE(gone.out.find("NOT_FOUND"), std::string::npos) << gone;
  // No LATEST at all, beside committed steps.
  ASSERT_EQ(::unlink((store_ + "/LATEST").c_str()), 0);
  RunResult none = Ckptio({"verify", store_, "--all"});
  EXPECT_EQ(none.exit_code, 1) << none;
  EXPECT_NE(none.out.find("LATEST: BAD"), std::string::npos) << none;
  EXPECT_NE(none.out.find("there is no LATEST"), std::string::npos) << none;
}

// verify and ls --verify read each step's manifest once for their work
// (on an object store each read is a round trip or two), plus once in the
// listing: counted as the process's opens of MANIFEST.json under strace.
TEST_F(CliTest, VerifyReadsEachManifestOnce) {
  if (::access("/usr/bin/strace", X_OK) != 0)
    GTEST_SKIP() << "needs /usr/bin/strace (tools/setup.sh installs it)";
  ASSERT_NO_FATAL_FAILURE(MakeStore());  // 3 steps
  const std::string log = tmp_.Sub("strace.log");
  auto manifest_opens = [&](std::vector<std::string> args) -> int {
    // (LeakSanitizer cannot run under ptrace: off for the traced process.)
    const char* asan = std::getenv("ASAN_OPTIONS");
    args.insert(args.begin(), {"/usr/bin/env",
                               "ASAN_OPTIONS=" + (asan && *asan ? std::string(asan) + ":" : "") +
                                   "detect_leaks=0",
                               "/usr/bin/strace", "-f", "-qq", "-e", "trace=open,openat", "-o", log,
                               bin_dir_ + "/ckptio"});
    RunResult r = RunCommand(args);
    EXPECT_EQ(r.exit_code, 0) << r;
    std::istringstream lines(ReadFile(log));
    int n = 0;
    for (std::string line; std::getline(lines, line);)
      n += line.find("MANIFEST.json\"") != std::string::npos;
    return n;
  };
  EXPECT_EQ(manifest_opens({"verify", store_}), 1);
  EXPECT_EQ(manifest_opens({"verify", store_, "--all"}), 2 * 3);
  EXPECT_EQ(manifest_opens({"ls", store_, "--verify"}), 2 * 3);
}

// A step that cannot be read (here: permission) is not called corrupt, and
// fsck --repair (which could not read it either) is not what to do.
TEST_F(CliTest, UnreadableDataIsNotCalledCorrupt) {
  if (::geteuid() != 0 || ::access("/usr/bin/setpriv", X_OK) != 0)
    GTEST_SKIP() << "needs root and /usr/bin/setpriv to run ckptio as another user";
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  ASSERT_EQ(::chmod(tmp_.path().c_str(), 0755), 0);
  ASSERT_EQ(std::system(("chmod -R a+rX " + store_).c_str()), 0);
  ASSERT_EQ(::chmod(ObjectPath(10, "shard-1.bin").c_str(), 0600), 0);
  auto as_nobody = [&](std::vector<std::string> args, const std::string& program = "") {
    args.insert(args.begin(), {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                               "--clear-groups", program.empty() ? bin_dir_ + "/ckptio" : program});
    return RunCommand(args);
  };
  // A checkout or $TMPDIR under a folder closed to other users (/root) keeps
  // nobody from running the binary or reaching the store at all.
  for (const RunResult& r : {as_nobody({"--help"}), as_nobody({store_ + "/LATEST"}, "/bin/cat")})
    if (r.exit_code != 0)
      GTEST_SKIP() << "user nobody cannot run " << bin_dir_ << "/ckptio or read " << store_
                   << " (is a folder above them closed to other users?):\n"
                   << r;
  RunResult v = as_nobody({"verify", store_, "--all"});
  EXPECT_EQ(v.exit_code, 1) << v;
  EXPECT_NE(v.out.find("step 10: NOT VERIFIED"), std::string::npos) << v;
  EXPECT_NE(v.out.find("PERMISSION_DENIED"), std::string::npos) << v;
  EXPECT_NE(v.out.find("step 20: OK"), std::string::npos) << v;
  EXPECT_EQ(v.out.find("corruption found"), std::string::npos) << v;
  EXPECT_NE(v.out.find("could not be read"), std::string::npos) << v;
  RunResult ls = as_nobody({"ls", store_, "--verify", "--json"});
  EXPECT_EQ(ls.exit_code, 1) << ls;
  json j = json::parse(ls.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << ls;
  for (const auto& s : j.at("steps")) {
    EXPECT_EQ(s.at("state"), "committed") << s.dump();
    if (s.at("step") == 10) {
      EXPECT_NE(s.dump().find("not verified: PERMISSION_DENIED"), std::string::npos) << s.dump();
    }
  }
}

// ---------------------------------------------------------------- manifest

// Where the value of "checksum" lies in a MANIFEST.json: [begin, end).
std::pair<size_t, size_t> ChecksumValueRange(const std::string& manifest) {
  size_t key = manifest.find("\"checksum\"");
  if (key == std::string::npos) return {0, 0};
  size_t open = manifest.find('"', key + 10);
  if (open == std::string::npos) return {0, 0};
  return {open + 1, open + 33};
}

TEST_F(CliTest, ManifestBitFlipsFailVerify) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  const std::string path = StepDir(20) + "/MANIFEST.json";
  const std::string original = ReadFile(path);
  ASSERT_GT(original.size(), 100u);
  const auto [ck_lo, ck_hi] = ChecksumValueRange(original);
  ASSERT_LT(ck_lo, ck_hi) << original;

  std::mt19937_64 rng(20240611);
  int tried = 0;
  while (tried < 20) {
    const uint64_t offset = rng() % original.size();
    const int bit = static_cast<int>(rng() % 8);
    const char c = original[offset];
    // Case flips of a hex letter inside the checksum value are covered by
    // ManifestChecksumCaseFlipFailsVerify; keep this sample independent.
    if (offset >= ck_lo && offset < ck_hi && bit == 5 &&
        std::isalpha(static_cast<unsigned char>(c)))
      continue;
    ++tried;
    FlipBit(path, offset, bit);
    RunResult r = Ckptio({"verify", store_, "20"});
    EXPECT_EQ(r.exit_code, 1) << "flip of bit " << bit << " at byte " << offset << " ('" << c
                              << "') went unnoticed\n"
                              << r;
    FlipBit(path, offset, bit);
    ASSERT_EQ(ReadFile(path), original) << "could not undo the flip";
  }
  // Undone, it verifies again: the failures above came from the flips.
  RunResult r = Ckptio({"verify", store_, "20"});
  EXPECT_EQ(r.exit_code, 0) << r;
}

// The manifest's self-checksum is written as lowercase hex. A single bit
// (0x20) turns a hex letter uppercase; the file's bytes then differ from
// what was committed (and from the hash LATEST records), so verifying that
// step must fail rather than accept the altered manifest.
TEST_F(CliTest, ManifestChecksumCaseFlipFailsVerify) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  const int64_t step = 10;  // not LATEST: only the manifest itself can tell
  const std::string path = StepDir(step) + "/MANIFEST.json";
  const std::string original = ReadFile(path);
  const auto [lo, hi] = ChecksumValueRange(original);
  ASSERT_LT(lo, hi) << original;
  size_t letter = lo;
  while (letter < hi && !(original[letter] >= 'a' && original[letter] <= 'f')) ++letter;
  if (letter == hi) GTEST_SKIP() << "checksum has no hex letter";
  FlipBit(path, letter, 5);
  RunResult r = Ckptio({"verify", store_, std::to_string(step)});
  EXPECT_EQ(r.exit_code, 1) << "manifest altered at byte " << letter << " ('" << original[letter]
                            << "' -> uppercase) still verifies\n"
                            << r;
  FlipBit(path, letter, 5);
  RunResult ok = Ckptio({"verify", store_, std::to_string(step)});
  EXPECT_EQ(ok.exit_code, 0) << ok;
}

// ---------------------------------------------------------------- lock

TEST_F(CliTest, RepairAndGcRefusedWhileAnotherProcessWrites) {
  ASSERT_NO_FATAL_FAILURE(MakeStore());
  FlipBit(ObjectPath(20, "shard-0.bin"), 1000, 0);  // something to repair
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto store, OpenStore(store_));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto writer, store->OpenWriter(WriterOptions{}));
  const std::string pid = std::to_string(::getpid());

  RunResult repair = Ckptio({"fsck", "--repair", store_});
  EXPECT_EQ(repair.exit_code, 1) << repair;
  EXPECT_NE(repair.err.find("already has a writer"), std::string::npos) << repair;
  EXPECT_NE(repair.err.find(pid), std::string::npos) << "should name the holder\n" << repair;

  RunResult gc = Ckptio({"gc", store_, "--keep", "1"});
  EXPECT_EQ(gc.exit_code, 1) << gc;
  EXPECT_NE(gc.err.find("already has a writer"), std::string::npos) << gc;

  // --wait gives up after the wait, with the same error.
  auto t0 = std::chrono::steady_clock::now();
  RunResult waited = Ckptio({"gc", store_, "--keep", "1", "--wait", "0.3"});
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(waited.exit_code, 1) << waited;
  EXPECT_NE(waited.err.find("already has a writer"), std::string::npos) << waited;
  EXPECT_GE(took, std::chrono::milliseconds(290));

  // A read-only fsck still runs and says a writer is active.
  RunResult check = Ckptio({"fsck", store_});
  EXPECT_EQ(check.exit_code, 1) << check;  // the corrupt step is still there
  EXPECT_NE(check.out.find("writer is active"), std::string::npos) << check;

  // Nothing was deleted or repaired.
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{0, 10, 20}));

  writer.reset();
  RunResult after = Ckptio({"fsck", "--repair", store_});
  EXPECT_EQ(after.exit_code, 0) << after;
  EXPECT_EQ(StepsOf(LsJson()), (std::vector<int64_t>{0, 10}));
}

// ---------------------------------------------------------------- output

// With stdout and stderr on pipes, no progress bar is drawn, even for work
// big enough to report progress many times.
TEST_F(CliTest, NoProgressEscapesWhenOutputIsAPipe) {
  RunResult gen = Gen({store_, "--steps", "2", "--objects", "2", "--size", "9M", "--every", "5"});
  ASSERT_EQ(gen.exit_code, 0) << gen;
  FlipBit(ObjectPath(5, "shard-1.bin"), 5u << 20, 1);
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"verify", store_, "--all"},
        std::vector<std::string>{"verify", store_},
        std::vector<std::string>{"ls", store_, "--verify"},
        std::vector<std::string>{"fsck", store_},
        std::vector<std::string>{"fsck", store_, "--repair"},
        std::vector<std::string>{"gc", store_, "--keep", "1"}}) {
    RunResult r = Ckptio(args);  // Ckptio() checks for \r and \033
    EXPECT_LE(r.exit_code, 1) << Join(args) << "\n" << r;
    EXPECT_FALSE(r.all().empty()) << Join(args);
  }
}

}  // namespace
}  // namespace ckptio
