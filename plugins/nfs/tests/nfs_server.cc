#include "nfs_server.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>

namespace ckptio::testing {
namespace {

int Run(const std::string& cmd) { return std::system(cmd.c_str()); }

}  // namespace

NfsServer::NfsServer(std::string dir, Ports ports, std::string env)
    : NfsServer(std::move(dir), ports, std::move(env), true) {}

NfsServer::NfsServer(std::string dir, Ports ports, std::string env, bool owned)
    : dir_(std::move(dir)), ports_(ports), env_(std::move(env)), owned_(owned) {
  ok_ = owned_ ? Start()
               : Run(std::string(CKPTIO_SOURCE_DIR) + "/tools/nfs-server.sh status " + dir_) == 0;
  if (!ok_) std::cerr << "NfsServer: no NFS server running for " << dir_ << "\n";
}

NfsServer::~NfsServer() {
  if (!owned_) return;
  Stop();
  Run("rm -rf '" + dir_ + "'");
}

NfsServer& NfsServer::Shared() {
  static NfsServer* server = [] {
    const char* fixture = std::getenv("CKPTIO_NFS_DIR");
    if (fixture && *fixture) return new NfsServer(fixture, Ports{}, "", false);
    static NfsServer own("/tmp/ckptio-nfs-" + std::to_string(::getpid()), Ports{});
    return &own;
  }();
  return *server;
}

std::string NfsServer::Uri(int version, const std::string& sub, const std::string& extra) const {
  std::string q = "?version=" + std::to_string(version) + "&nfsport=" + std::to_string(ports_.nfs);
  if (version == 3) q += "&mountport=" + std::to_string(ports_.mount);
  if (!extra.empty()) q += "&" + extra;
  std::string path = version == 4 ? "/export" : export_dir();
  return "nfs://127.0.0.1" + path + (sub.empty() ? "" : "/" + sub) + q;
}

bool NfsServer::Start() {
  std::string env = "CKPTIO_NFS_PORT=" + std::to_string(ports_.nfs) +
                    " CKPTIO_NFS_MOUNT_PORT=" + std::to_string(ports_.mount) +
                    " CKPTIO_NFS_NLM_PORT=" + std::to_string(ports_.nlm) + " " + env_ + " ";
  ok_ = Run(env + CKPTIO_SOURCE_DIR + "/tools/nfs-server.sh start " + dir_ + " >/dev/null") == 0;
  return ok_;
}

void NfsServer::Stop() {
  Run(std::string(CKPTIO_SOURCE_DIR) + "/tools/nfs-server.sh stop " + dir_ + " >/dev/null");
}

bool NfsServer::Running() const {
  return Run(std::string(CKPTIO_SOURCE_DIR) + "/tools/nfs-server.sh status " + dir_) == 0;
}

int NfsServer::Pid() const {
  std::ifstream f(dir_ + "/ganesha.pid");
  int pid = -1;
  f >> pid;
  return f ? pid : -1;
}

}  // namespace ckptio::testing
