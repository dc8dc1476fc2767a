#include "rgw_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "common/loopback.h"
#include "test_util.h"

namespace ckptio::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What tools/rgw-server.sh needs (its `need`).
constexpr const char* kTools[] = {"ceph-mon", "ceph-osd",   "radosgw", "radosgw-admin",
                                  "ceph",     "monmaptool", "uuidgen", "curl"};

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// `sh -c cmd`, with none of this process's descriptors but 0-2: the daemons
// the script starts must not keep a test's pipes or sockets open (a reader
// waiting for EOF, ctest waiting for our output, would wait for them).
int Run(const std::string& cmd) {
  const long max_fd = std::min<long>(::sysconf(_SC_OPEN_MAX), 65536);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    for (long fd = 3; fd < max_fd; ++fd) ::close(static_cast<int>(fd));
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string Tail(const std::string& text, size_t n) {
  return text.size() <= n ? text : "..." + text.substr(text.size() - n);
}

bool OnPath(const std::string& tool) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string d;
  while (std::getline(dirs, d, ':')) {
    if (!d.empty() && ::access((d + "/" + tool).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// bind (true) or connect (false) a fresh socket to 127.0.0.1:port; whether it worked.
bool OnLoopback(int port, bool bind) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a = Loopback(port);
  auto* addr = reinterpret_cast<sockaddr*>(&a);
  bool worked = (bind ? ::bind(fd, addr, sizeof a) : ::connect(fd, addr, sizeof a)) == 0;
  ::close(fd);
  return worked;
}

bool PortFree(int port) { return OnLoopback(port, true); }

// Ten free ports in a row: S3, monitor, the OSD's 8. Below the kernel's
// ephemeral range (32768-) so that no outgoing connection takes one, and
// above the fixed ones of the fixtures (20xxx).
RgwServer::Ports PickPorts() {
  std::random_device rd;
  int base = 21000;
  for (int attempt = 0; attempt < 200; ++attempt) {
    base = 21000 + 16 * static_cast<int>(rd() % ((32000 - 21000) / 16));
    bool all_free = true;
    for (int p = base; p < base + 10 && all_free; ++p) all_free = PortFree(p);
    if (all_free) break;
  }
  return RgwServer::Ports{base, base + 1};
}

// The process's state letter ('R', 'S', 'T', 'Z'...), '\0' if it is gone.
char ProcState(int pid) {
  std::string stat = ReadText("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return '\0';
  return stat[paren + 2];
}

bool Gone(int pid) {
  char s = ProcState(pid);
  return s == '\0' || s == 'Z' || s == 'X';  // a zombie waits for its reaper, dead all the same
}

bool WaitFor(const std::function<bool()>& done, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return true;
}

bool Listening(int port) { return OnLoopback(port, false); }

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) ? std::string(buf) : path;
}

std::string MakeTempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/ckptio-rgw-XXXXXX";
  if (!::mkdtemp(pattern.data())) return "";
  return RealPath(pattern);
}

}  // namespace

// No directory where Ceph is missing: the constructor says so instead.
RgwServer::RgwServer() : RgwServer(Installed() ? MakeTempDir() : "", true, Ports{}) {}

RgwServer::RgwServer(Ports ports) : RgwServer(Installed() ? MakeTempDir() : "", true, ports) {}

RgwServer::RgwServer(std::string dir, bool owned, Ports ports)
    : dir_(std::move(dir)), owned_(owned), ports_(ports), pick_ports_(ports.s3 == 0) {
  if (dir_.empty()) {
    error_ = owned_ && !Installed() ? NotInstalledMessage()
                                    : "cannot make a temp directory for the S3 server";
    return;
  }
  if (owned_) {
    // A test process killed by a signal runs no destructor: a watcher of
    // its own session stops the cluster and removes the directory once this
    // process is gone (nothing left to do after a normal exit).
    Run("setsid sh -c " +
        Quote("while kill -0 " + std::to_string(::getpid()) + " 2>/dev/null; do sleep 1; done; " +
              Script("stop") + " >/dev/null 2>&1; rm -rf " + Quote(dir_)) +
        " </dev/null >/dev/null 2>&1 &");
    Start();
    return;
  }
  // The fixture's: its settings, and it must be up.
  if (!ReadSettings()) return;
  ok_ = Running();
  if (!ok_) {
    error_ = "the S3 server in " + dir_ +
             " (CKPTIO_RGW_DIR) is not running: tools/rgw-server.sh start " + dir_;
  }
}

RgwServer::~RgwServer() {
  if (!owned_) {
    DeleteBuckets();
    return;
  }
  if (dir_.empty()) return;
  Stop();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

RgwServer& RgwServer::Shared() {
  static RgwServer* server = [] {
    const char* fixture = std::getenv("CKPTIO_RGW_DIR");
    // Without `env` the fixture did not start one (ctest skipped it where
    // Ceph is missing): as when run alone, start our own or skip.
    if (fixture && *fixture && ::access((std::string(fixture) + "/env").c_str(), R_OK) == 0) {
      static RgwServer adopted(RealPath(fixture), false, Ports{});
      return &adopted;
    }
    if (fixture && *fixture && Installed()) {
      std::cerr << "RgwServer: CKPTIO_RGW_DIR=" << fixture
                << " holds no server settings (env): starting one of this process's own\n";
    }
    static RgwServer own;
    return &own;
  }();
  return *server;
}

bool RgwServer::Installed() {
  for (const char* tool : kTools) {
    if (!OnPath(tool)) return false;
  }
  return true;
}

std::string RgwServer::NotInstalledMessage() {
  std::string missing;
  for (const char* tool : kTools) {
    if (!OnPath(tool)) missing += std::string(missing.empty() ? "" : ", ") + tool;
  }
  return "no S3 server for this test: Ceph is not installed (missing on PATH: " + missing +
         "; apt-get install --no-install-recommends ceph-mon ceph-osd radosgw ceph-common curl, "
         "as tools/setup.sh does)";
}

std::string RgwServer::Uri(const std::string& prefix, const std::string& extra,
                           const std::string& bucket) const {
  std::string uri = "s3://" + (bucket.empty() ? bucket_ : bucket) + "/" + prefix +
                    "?endpoint=" + endpoint_ + "&region=" + region_;
  if (!extra.empty()) uri += "&" + extra;
  return uri;
}

S3Options RgwServer::Options(const std::string& prefix, const std::string& bucket) const {
  S3Options o;
  o.endpoint = endpoint_;
  o.region = region_;
  o.bucket = bucket.empty() ? bucket_ : bucket;
  o.prefix = prefix;
  o.access_key_id = access_key_;
  o.secret_access_key = secret_key_;
  return o;
}

void RgwServer::ExportCredentials() const {
  static std::once_flag once;
  std::call_once(once, [this] {
    ::setenv("AWS_ACCESS_KEY_ID", access_key_.c_str(), 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", secret_key_.c_str(), 1);
    ::unsetenv("AWS_SESSION_TOKEN");  // it would be sent with keys it does not belong to
  });
}

std::string RgwServer::NewBucket(const std::string& label) {
  // Bucket names: 3-63 of [a-z0-9-].
  std::string clean;
  for (char c : label.substr(0, 20)) {
    clean += (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ? c
             : (c >= 'A' && c <= 'Z')                         ? static_cast<char>(c - 'A' + 'a')
                                                              : '-';
  }
  const std::string name = "ckptio-" + clean + "-" + NewJobId();
  const std::string code_file = dir_ + "/" + name + ".http";
  // Signed as the script signs its own (curl 7.88 signs no payload hash).
  int rc = Run("curl -sS -o /dev/null -w '%{http_code}' --max-time 30 --aws-sigv4 " +
               Quote("aws:amz:" + region_ + ":s3") + " --user " +
               Quote(access_key_ + ":" + secret_key_) +
               " -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' -X PUT " +
               Quote(endpoint_ + "/" + name) + " >" + Quote(code_file) + " 2>&1");
  std::string answer = ReadText(code_file);
  std::remove(code_file.c_str());
  std::lock_guard<std::mutex> lock(mu_);
  if (rc != 0 || answer != "200") {
    error_ = "creating bucket " + name + " at " + endpoint_ + ": curl exit " + std::to_string(rc) +
             ", " + Tail(answer, 500);
    return "";
  }
  buckets_.push_back(name);
  return name;
}

void RgwServer::DeleteBuckets() {
  std::vector<std::string> buckets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    buckets.swap(buckets_);
  }
  // Buckets count against the test user's limit (1000), and the fixture's
  // cluster keeps its data from one ctest run to the next.
  for (const auto& name : buckets) {
    Run("radosgw-admin -c " + Quote(dir_ + "/ceph.conf") + " bucket rm --bucket=" + Quote(name) +
        " --purge-objects >/dev/null 2>&1");
  }
}

std::string RgwServer::Script(const std::string& command) const {
  std::string env;
  if (ports_.s3 > 0) {
    env = "CKPTIO_RGW_PORT=" + std::to_string(ports_.s3) +
          " CKPTIO_CEPH_MON_PORT=" + std::to_string(ports_.mon) + " ";
  }
  return env + Quote(std::string(CKPTIO_SOURCE_DIR) + "/tools/rgw-server.sh") + " " + command +
         " " + Quote(dir_);
}

bool RgwServer::StartOnce(bool* ports_busy) {
  const std::string err_file = dir_ + "/start.err";
  int rc = Run(Script("start") + " >/dev/null 2>" + Quote(err_file));
  if (rc == 0) return true;
  const std::string err = ReadText(err_file);
  *ports_busy = err.find("in use on this machine") != std::string::npos;
  error_ = "tools/rgw-server.sh start " + dir_ + " failed (exit " + std::to_string(rc) +
           "): " + Tail(err, 3000);
  return false;
}

bool RgwServer::Start() {
  if (!Installed()) {
    error_ = NotInstalledMessage();
    ok_ = false;
    return false;
  }
  // Ports are chosen once; a restart must reuse them (the monitor that
  // still runs is on them).
  for (int attempt = 0; attempt < 5; ++attempt) {
    if (pick_ports_) ports_ = PickPorts();
    bool busy = false;
    if (StartOnce(&busy)) {
      pick_ports_ = false;
      ok_ = ReadSettings();
      return ok_;
    }
    if (!busy || !pick_ports_) break;  // another process took a port we chose: others
  }
  ok_ = false;
  return false;
}

void RgwServer::Stop() { Run(Script("stop") + " >/dev/null 2>&1"); }

bool RgwServer::Running() const { return Run(Script("status")) == 0; }

bool RgwServer::ReadSettings() {
  std::map<std::string, std::string> env;
  std::ifstream f(dir_ + "/env");
  std::string line;
  while (std::getline(f, line)) {
    size_t eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  endpoint_ = env["AWS_ENDPOINT_URL"];
  access_key_ = env["AWS_ACCESS_KEY_ID"];
  secret_key_ = env["AWS_SECRET_ACCESS_KEY"];
  region_ = env["AWS_REGION"];
  bucket_ = env["CKPTIO_S3_BUCKET"];
  if (endpoint_.empty() || access_key_.empty() || secret_key_.empty() || region_.empty() ||
      bucket_.empty()) {
    error_ = dir_ + "/env lacks some of AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, " +
             "AWS_SECRET_ACCESS_KEY, AWS_REGION, CKPTIO_S3_BUCKET";
    return false;
  }
  // The ports, for a restart of a server we did not start: the endpoint's,
  // and the monitor's in ceph.conf ("mon_host = [v2:127.0.0.1:PORT]").
  ports_.s3 = std::atoi(endpoint_.substr(endpoint_.rfind(':') + 1).c_str());
  const std::string conf = ReadText(dir_ + "/ceph.conf");
  size_t mon = conf.find("mon_host = [v2:127.0.0.1:");
  if (mon != std::string::npos) {
    ports_.mon = std::atoi(conf.c_str() + mon + std::string("mon_host = [v2:127.0.0.1:").size());
  }
  return true;
}

int RgwServer::RgwPid() const {
  std::ifstream f(dir_ + "/radosgw.pid");
  int pid = -1;
  f >> pid;
  if (!f || pid <= 0 || Gone(pid)) return -1;
  // Still ours (pids come round again): radosgw run with this dir's ceph.conf.
  std::string cmdline = ReadText("/proc/" + std::to_string(pid) + "/cmdline");
  std::vector<std::string> args;
  std::stringstream ss(cmdline);
  std::string arg;
  while (std::getline(ss, arg, '\0')) args.push_back(arg);
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "-c" && RealPath(args[i + 1]) == RealPath(dir_ + "/ceph.conf")) return pid;
  }
  return -1;
}

bool RgwServer::KillRgw() {
  const int pid = RgwPid();
  if (pid < 0) {
    error_ = "no radosgw of " + dir_ + " to kill";
    return false;
  }
  if (::kill(pid, SIGKILL) != 0) {
    error_ = "kill -KILL " + std::to_string(pid) + " failed";
    return false;
  }
  // Dead, and its listening socket with it: what a test does next meets a
  // refused connection, not the dying process.
  if (!WaitFor([&] { return Gone(pid) && !Listening(ports_.s3); }, milliseconds(10000))) {
    error_ = "radosgw " + std::to_string(pid) + " outlived SIGKILL by 10 s";
    return false;
  }
  return true;
}

bool RgwServer::PauseRgw() {
  const int pid = RgwPid();
  if (pid < 0 || ::kill(pid, SIGSTOP) != 0) {
    error_ = "no radosgw of " + dir_ + " to stop";
    return false;
  }
  return WaitFor([&] { return ProcState(pid) == 'T'; }, milliseconds(5000));
}

bool RgwServer::ResumeRgw() {
  const int pid = RgwPid();
  if (pid < 0 || ::kill(pid, SIGCONT) != 0) {
    error_ = "no radosgw of " + dir_ + " to continue";
    return false;
  }
  return WaitFor([&] { return ProcState(pid) != 'T'; }, milliseconds(5000));
}

}  // namespace ckptio::testing
