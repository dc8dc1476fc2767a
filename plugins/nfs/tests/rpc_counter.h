// A TCP forwarder on 127.0.0.1 in front of the NFS server that counts the
// ONC RPC calls clients send through it, by procedure: what the NFS tests
// assert as the round trips an operation costs, seen on the wire rather
// than at libnfs's API (where one call is several RPCs, and nfs_close of a
// written file sends a COMMIT of its own). Point an nfs:// URI's nfsport at
// port() (v3's mount protocol stays direct).
#ifndef CKPTIO_PLUGINS_NFS_TESTS_RPC_COUNTER_H_
#define CKPTIO_PLUGINS_NFS_TESTS_RPC_COUNTER_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ckptio::testing {

class RpcCounter {
 public:
  // The calls seen, counted by name ("LOOKUP", "COMMIT", ...; NFSv4's
  // COMPOUND, and other programs as "program/version/procedure"), and
  // every call in the order sent (`order`), so a test can check a sequence.
  struct Calls {
    std::map<std::string, int> by_name;
    std::vector<std::string> order;
    int total() const { return static_cast<int>(order.size()); }
    int operator[](const std::string& name) const {
      auto it = by_name.find(name);
      return it == by_name.end() ? 0 : it->second;
    }
    std::string ToString() const;  // "72 calls: 30 LOOKUP, 12 GETATTR, ..."
  };

  // Listens on an ephemeral port; forwards to 127.0.0.1:to_port.
  explicit RpcCounter(int to_port);
  ~RpcCounter();
  RpcCounter(const RpcCounter&) = delete;
  RpcCounter& operator=(const RpcCounter&) = delete;

  bool ok() const { return listen_fd_ >= 0; }
  int port() const { return port_; }
  // The calls since the last Take (or since the start), and starts afresh.
  Calls Take();

 private:
  void AcceptLoop();
  void Serve(int client);
  void Count(const std::string& name);

  const int to_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread acceptor_;
  std::mutex mu_;  // what follows
  bool stopping_ = false;
  std::vector<int> sockets_;
  std::vector<std::thread> servers_;
  Calls calls_;
};

}  // namespace ckptio::testing

#endif  // CKPTIO_PLUGINS_NFS_TESTS_RPC_COUNTER_H_
