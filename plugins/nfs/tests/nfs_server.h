// The NFS-Ganesha an NFS test talks to: the one the ctest fixture started
// (CKPTIO_NFS_DIR set), or one this process starts with tools/nfs-server.sh
// on its own ports and stops at exit.
#ifndef CKPTIO_PLUGINS_NFS_TESTS_NFS_SERVER_H_
#define CKPTIO_PLUGINS_NFS_TESTS_NFS_SERVER_H_

#include <string>

namespace ckptio::testing {

class NfsServer {
 public:
  struct Ports {
    int nfs = 20490, mount = 20048, nlm = 20049;
  };
  // Starts a private server in `dir` on `ports` (stopped by the destructor),
  // `env` setting tools/nfs-server.sh's knobs ("CKPTIO_NFS_MAX_READ=65536").
  NfsServer(std::string dir, Ports ports, std::string env = "");
  ~NfsServer();
  NfsServer(const NfsServer&) = delete;
  NfsServer& operator=(const NfsServer&) = delete;

  // The fixture's server, or a private one on the default ports.
  static NfsServer& Shared();

  bool ok() const { return ok_; }
  const std::string& dir() const { return dir_; }
  std::string export_dir() const { return dir_ + "/export"; }
  int nfs_port() const { return ports_.nfs; }
  // nfs:// URI of folder `sub` of the export (v4: through the pseudo path).
  std::string Uri(int version, const std::string& sub, const std::string& extra = "") const;

  // Lifecycle of a private server, for fault tests.
  bool Start();
  void Stop();
  int Pid() const;       // Ganesha's, or -1
  bool Running() const;  // Ganesha is up (not killed or exited)

 private:
  NfsServer(std::string dir, Ports ports, std::string env, bool owned);
  std::string dir_;
  Ports ports_;
  std::string env_;
  bool owned_;
  bool ok_ = false;
};

}  // namespace ckptio::testing

#endif  // CKPTIO_PLUGINS_NFS_TESTS_NFS_SERVER_H_
