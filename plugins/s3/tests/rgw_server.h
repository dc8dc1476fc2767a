// The Ceph RADOS Gateway an S3 test talks to: the one the ctest fixture
// started (CKPTIO_RGW_DIR names its directory, which holds `env`), or one
// this process starts with tools/rgw-server.sh in a fresh temp directory on
// free ports and stops at exit. Fault tests start private ones of their own
// and kill, pause or restart radosgw there (never on the shared one: other
// test processes use it at the same time).
#ifndef CKPTIO_PLUGINS_S3_TESTS_RGW_SERVER_H_
#define CKPTIO_PLUGINS_S3_TESTS_RGW_SERVER_H_

#include <mutex>
#include <string>
#include <vector>

#include "ckptio/s3_backend.h"

namespace ckptio::testing {

class RgwServer {
 public:
  struct Ports {
    int s3 = 0;   // RGW's HTTP port
    int mon = 0;  // the monitor's; the OSD takes the 8 after it
  };

  // Starts a private server in a fresh temp directory on free ports (or on
  // `ports`), stopped and removed by the destructor. ok() says whether it
  // started, error() why not.
  RgwServer();
  explicit RgwServer(Ports ports);
  ~RgwServer();
  RgwServer(const RgwServer&) = delete;
  RgwServer& operator=(const RgwServer&) = delete;

  // The fixture's server, or a private one for this process.
  static RgwServer& Shared();

  // Whether Ceph's daemons and tools (and curl) are on PATH: where they are
  // not, the S3 tests skip with NotInstalledMessage().
  static bool Installed();
  static std::string NotInstalledMessage();

  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  const std::string& dir() const { return dir_; }
  const std::string& endpoint() const { return endpoint_; }  // "http://127.0.0.1:20280"
  const std::string& bucket() const { return bucket_; }      // the server's own bucket
  const std::string& access_key() const { return access_key_; }
  const std::string& secret_key() const { return secret_key_; }
  const std::string& region() const { return region_; }
  Ports ports() const { return ports_; }

  // "s3://BUCKET/PREFIX?endpoint=...&region=...[&extra]" (bucket() when
  // `bucket` is empty). The credentials are not in it: see
  // ExportCredentials.
  std::string Uri(const std::string& prefix, const std::string& extra = "",
                  const std::string& bucket = "") const;
  // Options for NewS3Backend, on `prefix` of `bucket` (bucket() if empty).
  S3Options Options(const std::string& prefix, const std::string& bucket = "") const;

  // Sets AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to this server's and
  // unsets AWS_SESSION_TOKEN, for stores opened by Uri(). Once per process
  // (setenv is not thread-safe): call it before starting threads.
  void ExportCredentials() const;

  // A new empty bucket "ckptio-LABEL-job-...", deleted with everything in it
  // when this process exits (or this private server goes). "" if it could
  // not be made (error() says why). Thread-safe.
  std::string NewBucket(const std::string& label);

  // Lifecycle, for fault tests on a private server.
  bool Start();  // starts, or restarts the daemons that are missing
  void Stop();
  bool RestartRgw() { return Start(); }
  bool Running() const;  // all three daemons up
  int RgwPid() const;    // radosgw's, or -1
  // SIGKILLs radosgw and waits until it is gone (its port closed).
  bool KillRgw();
  // SIGSTOP / SIGCONT radosgw: connections are still accepted (by the
  // kernel) and never answered while it is stopped.
  bool PauseRgw();
  bool ResumeRgw();

 private:
  RgwServer(std::string dir, bool owned, Ports ports);
  bool ReadSettings();
  bool StartOnce(bool* ports_busy);
  void DeleteBuckets();
  std::string Script(const std::string& command) const;

  std::string dir_;
  bool owned_;
  Ports ports_;
  bool pick_ports_;  // the ports are ours to choose (again, if taken)
  bool ok_ = false;
  std::string error_;
  std::string endpoint_, bucket_, access_key_, secret_key_, region_;
  std::mutex mu_;  // buckets_
  std::vector<std::string> buckets_;
};

}  // namespace ckptio::testing

#endif  // CKPTIO_PLUGINS_S3_TESTS_RGW_SERVER_H_
